"""fp8 caches on the tensor-core decode kernel.

* The fragment conversions (``kernels.fp8_mma.pairs`` and ``crossed``) give
  each code's exact value in fp16 and bf16, in the order the products take
  them, for every code in both byte positions (all 65,536 pairs on a GPU).
* ``paged_decode`` over fp8 pools with fp16 or bf16 queries (the tensor-core
  kernel: keys through ``ldmatrix`` and converted in registers, values
  through ``ldmatrix.trans`` and a byte permutation) matches the float64
  reference of the dequantised values within the error model: both formats,
  both scale granularities, the layouts it takes, the variants, split-K;
  also with 16 heads a block (the mma's rows 8..15).
"""
import functools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import cuda

import paged_numba as pn
from paged_numba import fp8 as F
from paged_numba.kernels import decode_tc
from paged_numba.kernels import fp8 as K
from paged_numba.kernels import fp8_mma
from paged_numba._arrays import host_bits
from paged_numba.testing import (DecodeProblem, check_attention, decode_problems,
                                 decode_reference, variants)
from test_fp8 import run_fp8_decode

FORMATS = F.FP8_DTYPES
MMA = ("float16", "bfloat16")
SIM = pn.simulator_enabled()


@functools.cache
def _converter(fmt, mma):
    pairs, crossed = fp8_mma.pairs(fmt, mma), fp8_mma.crossed(fmt, mma)

    @cuda.jit
    def convert(words, out):
        i = cuda.grid(1)
        if i < words.size:
            out[4 * i], out[4 * i + 1] = pairs(words[i])
            out[4 * i + 2], out[4 * i + 3] = crossed(words[i])
    return convert


def _halves(words, mma):
    """float64 values of the 16-bit halves of ``words`` (low half first)."""
    h = words.astype(np.uint32)
    lo, hi = (h & 0xFFFF).astype(np.uint16), (h >> 16).astype(np.uint16)
    if mma == "float16":
        return lo.view(np.float16).astype(np.float64), hi.view(np.float16).astype(np.float64)
    f = lambda x: (x.astype(np.uint32) << 16).view(np.float32).astype(np.float64)  # noqa: E731
    return f(lo), f(hi)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("mma", MMA)
def test_fragment_conversions_are_exact_on_every_code_pair(fmt, mma):
    # words b0 | b1 << 8 | b2 << 16 | b3 << 24: every (b0, b1) pair, (b2, b3) another
    n = 4096 if SIM else 65536
    i = np.arange(n, dtype=np.uint32) * (65536 // n)
    words = i | (((i * 40503 + 12345) & 0xFFFF) << 16)
    out = cuda.device_array(4 * n, np.uint32)
    _converter(fmt, mma)[(n + 255) // 256, 256](cuda.to_device(words), out)
    got = out.copy_to_host().reshape(n, 4)
    value = np.asarray(K.decode_table(fmt), np.float64)
    b = [(words >> (8 * k)) & 0xFF for k in range(4)]
    expected = {0: (b[0], b[1]), 1: (b[2], b[3]), 2: (b[0], b[2]), 3: (b[1], b[3])}
    for col, (lo, hi) in expected.items():
        got_lo, got_hi = _halves(got[:, col], mma)
        assert np.array_equal(got_lo, value[lo], equal_nan=True), (fmt, mma, col, "low half")
        assert np.array_equal(got_hi, value[hi], equal_nan=True), (fmt, mma, col, "high half")


def test_unknown_conversions_are_refused():
    with pytest.raises(ValueError, match="no fp8 fragment conversion"):
        fp8_mma.pairs("float8_e4m3fn", "float32")
    with pytest.raises(ValueError, match="no fp8 fragment conversion"):
        fp8_mma.crossed("float16", "float16")


# the simulator runs 128 Python threads a block: small problems there, all head sizes on a GPU
SHAPES = (dict(head_sizes=(64,), block_sizes=(1, 8, 16), max_seqs=2, max_seq_len=40) if SIM else
          dict(head_sizes=decode_tc.FP8_HEAD_SIZES, block_sizes=(1, 5, 8, 16, 32), max_seqs=4,
               max_seq_len=3000))


@pytest.mark.parametrize("fmt", FORMATS)
@settings(max_examples=2 if SIM else 60, deadline=None)
@given(data=st.data())
def test_fp8_tensor_core_decode_matches_reference(fmt, data):
    p = data.draw(decode_problems(layouts=decode_tc.FP8_LAYOUTS, dtypes=(fmt,), groups=(1, 2, 4),
                                  max_kv_heads=2, query_dtypes=MMA, **SHAPES), label="problem")
    assert decode_tc.supports(p.head_size, 4, p.dtype, p.layout)
    extra = data.draw(variants(p.num_heads, max_window=int(p.seq_lens.max()) + 2),
                      label="variants")
    parts = data.draw(st.sampled_from([None, 1, 2]), label="num_partitions")
    q, out, lse, ref = run_fp8_decode(p, parts, **extra)
    assert out.dtype == np.dtype(p.query_dtype)
    check_attention(q, out, lse, *ref)


@pytest.mark.parametrize("fmt, query_dtype", [("float8_e4m3fn", "float16"),
                                              ("float8_e5m2", "bfloat16")])
def test_fp8_sixteen_heads_a_block(fmt, query_dtype):
    p = DecodeProblem(num_seqs=2, num_heads=16, num_kv_heads=1, head_size=64, block_size=8,
                      num_blocks=7, layout="nhd", dtype=fmt, query_dtype=query_dtype,
                      seq_lens=np.array([19, 30], np.int32),
                      block_tables=np.array([[2, 0, 5, 6], [1, 3, 4, 6]], np.int32), seed=3,
                      per_head_scales=True)
    q, k, v = p.arrays()
    ks, vs = p.scales()
    cache = pn.PagedKVCache.from_host(*p.layout_pools(k, v), p.layout, k_scale=ks, v_scale=vs)
    plan = pn.DecodePlan(cache, 2, 16, 4, heads_per_block=16, query_dtype=query_dtype)
    assert plan.tensor_cores and plan.heads_per_block == 16
    out = plan.run(cuda.to_device(host_bits(q)), cuda.to_device(p.block_tables),
                   cuda.to_device(p.seq_lens))
    ref = decode_reference(p, q, F.dequantize(k, ks), F.dequantize(v, vs),
                           num_partitions=plan.num_partitions)
    check_attention(q, out.copy_to_host().view(q.dtype), plan.lse.copy_to_host(), *ref)


def test_fp8_kernel_choice():
    c = pn.PagedKVCache(8, 16, 2, 64, dtype="float8_e4m3fn")
    assert pn.DecodePlan(c, 2, 8, 4, query_dtype="bfloat16").tensor_cores
    assert not pn.DecodePlan(c, 2, 8, 4, query_dtype="float32").tensor_cores
    assert not pn.DecodePlan(c, 2, 8, 4, pv_mma=False).tensor_cores
    with pytest.raises(ValueError, match="fp8 cache needs float16 or bfloat16 queries"):
        pn.DecodePlan(c, 2, 8, 4, query_dtype="float32", tensor_cores=True)
    with pytest.raises(ValueError, match="heads_per_block=16 needs the tensor-core kernel"):
        pn.DecodePlan(pn.PagedKVCache(8, 16, 1, 64, dtype="float8_e5m2"), 2, 16, 4,
                      heads_per_block=16, query_dtype="float32")
    small = pn.PagedKVCache(8, 16, 2, 32, dtype="float8_e4m3fn")     # head size 32: CUDA cores
    assert not pn.DecodePlan(small, 2, 8, 4).tensor_cores
    vllm = pn.PagedKVCache(8, 16, 2, 64, dtype="float8_e4m3fn", layout="vllm")
    assert not pn.DecodePlan(vllm, 2, 8, 4).tensor_cores
