"""``Q K^T`` in fp8 (``DecodePlan(qk_fp8=True)``) on the tensor-core decode kernel.

* ``kernels.fp8_mma.mma_m16n8k32`` takes its fragments where its docstring
  says (A rows ``r``, ``r + 8``, B columns ``r``; four codes a word) and
  adds their exact products within the fp8 accumulation model;
* each query head is quantised in the kernel bit for bit as
  ``paged_numba.fp8.quantize_rows`` does on the host;
* the decode matches the float64 reference of those quantised queries over
  the dequantised pools, within the bound of the fp8 products
  (``testing.bounds.FP8_TENSOR_CORE_U``): both cache formats, fp16 and bf16
  queries, the variants, split-K and 16 heads a block.
"""
import functools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import cuda

import paged_numba as pn
from paged_numba import fp8 as F
from paged_numba._arrays import host_bits
from paged_numba.kernels import decode_tc
from paged_numba.kernels import fp8_mma
from paged_numba.kernels.decode_tc_parts import decode_tc_parts
from paged_numba.testing import (DecodeProblem, check_attention, decode_problems,
                                 decode_reference, variants)
from paged_numba.testing.bounds import FP8_TENSOR_CORE_U, gamma
from test_fp8_decode_tc import FORMATS, MMA, SHAPES, SIM


@functools.cache
def _product(afmt, bfmt):
    mma = fp8_mma.mma_m16n8k32(afmt, bfmt)

    @cuda.jit
    def product(a, b, c, d):
        lane = cuda.threadIdx.x
        d[lane, 0], d[lane, 1], d[lane, 2], d[lane, 3] = mma(
            a[lane, 0], a[lane, 1], a[lane, 2], a[lane, 3], b[lane, 0], b[lane, 1],
            c[lane, 0], c[lane, 1], c[lane, 2], c[lane, 3])
    return product


def _word(codes):
    """Four codes in one word, the first in the lowest byte."""
    return np.uint32(sum(int(x) << (8 * i) for i, x in enumerate(codes)))


@pytest.mark.parametrize("afmt, bfmt", [("float8_e4m3fn", "float8_e4m3fn"),
                                        ("float8_e4m3fn", "float8_e5m2")])
@pytest.mark.parametrize("seed", range(2))
def test_fp8_mma_takes_its_fragments_where_documented(afmt, bfmt, seed):
    rng = np.random.default_rng(seed)
    A = F.quantize(rng.standard_normal((16, 32)) * 4, 1.0, afmt)
    B = F.quantize(rng.standard_normal((32, 8)) * 4, 1.0, bfmt)
    C = rng.standard_normal((16, 8)).astype(np.float32)
    ac, bc = A.view(np.uint8), B.view(np.uint8)
    a = np.zeros((32, 4), np.uint32)
    b = np.zeros((32, 2), np.uint32)
    c = np.zeros((32, 4), np.float32)
    for lane in range(32):
        r, q = divmod(lane, 4)
        a[lane] = [_word(ac[r, 4 * q:4 * q + 4]), _word(ac[r + 8, 4 * q:4 * q + 4]),
                   _word(ac[r, 4 * q + 16:4 * q + 20]), _word(ac[r + 8, 4 * q + 16:4 * q + 20])]
        b[lane] = [_word(bc[4 * q:4 * q + 4, r]), _word(bc[4 * q + 16:4 * q + 20, r])]
        c[lane] = [C[r, 2 * q], C[r, 2 * q + 1], C[r + 8, 2 * q], C[r + 8, 2 * q + 1]]
    d = cuda.device_array((32, 4), np.float32)
    _product(afmt, bfmt)[1, 32](cuda.to_device(a), cuda.to_device(b), cuda.to_device(c), d)
    d = d.copy_to_host()
    A64, B64 = A.astype(np.float64), B.astype(np.float64)
    exact = A64 @ B64 + C
    mags = np.abs(A64) @ np.abs(B64) + np.abs(C)
    for lane in range(32):
        r, q = divmod(lane, 4)
        rows, cols = [r, r, r + 8, r + 8], [2 * q, 2 * q + 1, 2 * q, 2 * q + 1]
        err = np.abs(d[lane] - exact[rows, cols])
        assert (err <= gamma(33, FP8_TENSOR_CORE_U) * mags[rows, cols]).all(), (lane, err)


def test_fp8_mma_refuses_other_formats():
    with pytest.raises(ValueError, match="no fp8 tensor-core product"):
        fp8_mma.mma_m16n8k32("float16", "float8_e4m3fn")


@functools.cache
def _quantiser(head_size, query_dtype):
    P = decode_tc_parts(head_size, 16, 4, "float8_e4m3fn", "nhd", 4, 2, False, True, True,
                        True, query_dtype, qk_fp8=True)
    load_a8, words = P.load_a8, head_size // 16

    @cuda.jit
    def quantise(query, codes, scales):
        lane = cuda.threadIdx.x
        r, c = lane // 4, lane % 4
        qa = cuda.local.array(16, np.uint32)
        s = load_a8(qa, query, 0, r, r < query.shape[1], c)
        if r < query.shape[1]:
            for v in range(words):
                for i in range(4):
                    codes[r, 16 * v + 4 * c + i] = (qa[v] >> (8 * i)) & 0xFF
            scales[r] = s
    return quantise


def _host(name):
    import ml_dtypes
    return np.float16 if name == "float16" else ml_dtypes.bfloat16


@pytest.mark.parametrize("query_dtype", MMA)
def test_the_kernel_quantises_each_query_head_as_quantize_rows(query_dtype):
    head_size = 64
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 8, head_size)) * np.exp(rng.uniform(-8, 8, (1, 8, 1)))
    x[0, 1] = 0.0                                   # a row of zeros: scale 1
    x[0, 2, 5] = np.nan                             # rows with a NaN or an infinity: NaN
    x[0, 3, 7] = -np.inf
    x[0, 4, 0] = 448.0 * 2.0 ** -20                 # ties and the largest code
    x[0, 4, 1:] = np.linspace(-1, 1, head_size - 1) * x[0, 4, 0]
    q = x.astype(_host(query_dtype))
    codes = cuda.device_array((8, head_size), np.uint8)
    scales = cuda.device_array(8, np.float32)
    _quantiser(head_size, query_dtype)[1, 32](cuda.to_device(host_bits(q)), codes, scales)
    want_codes, want_s = F.quantize_rows(q[0])
    assert np.array_equal(scales.copy_to_host(), want_s, equal_nan=True)
    assert np.array_equal(codes.copy_to_host(), want_codes.view(np.uint8))


def run_qk_fp8(p, num_partitions=None, heads_per_block=None, **extra):
    """``DecodePlan(qk_fp8=True)`` on problem ``p``; returns the query, the
    output, its lse and the reference of the quantised queries with bounds."""
    q, k, v = p.arrays()
    ks, vs = p.scales()
    cache = pn.PagedKVCache.from_host(*p.layout_pools(k, v), p.layout, k_scale=ks, v_scale=vs)
    plan = pn.DecodePlan(cache, p.num_seqs, p.num_heads, p.block_tables.shape[1],
                         num_partitions=num_partitions, query_dtype=p.query_dtype,
                         heads_per_block=heads_per_block, qk_fp8=True, **extra)
    assert plan.tensor_cores and plan.qk_fp8
    out = plan.run(cuda.to_device(host_bits(q)), cuda.to_device(p.block_tables),
                   cuda.to_device(p.seq_lens))
    codes, s = F.quantize_rows(q)
    q8 = codes.astype(np.float64) * s[..., None].astype(np.float64)
    ref = decode_reference(p, q8, F.dequantize(k, ks), F.dequantize(v, vs),
                           num_partitions=plan.num_partitions, qk_fp8=True, **extra)
    return q, out.copy_to_host().view(q.dtype), plan.lse.copy_to_host(), ref


@pytest.mark.parametrize("fmt", FORMATS)
@settings(max_examples=2 if SIM else 40, deadline=None)
@given(data=st.data())
def test_fp8_queries_decode_matches_the_reference_of_the_quantised_queries(fmt, data):
    p = data.draw(decode_problems(layouts=decode_tc.FP8_LAYOUTS, dtypes=(fmt,), groups=(1, 2, 4),
                                  max_kv_heads=2, query_dtypes=MMA, **SHAPES), label="problem")
    extra = data.draw(variants(p.num_heads, max_window=int(p.seq_lens.max()) + 2),
                      label="variants")
    parts = data.draw(st.sampled_from([None, 1, 2]), label="num_partitions")
    q, out, lse, ref = run_qk_fp8(p, parts, **extra)
    check_attention(q, out, lse, *ref)


def test_fp8_queries_sixteen_heads_a_block():
    p = DecodeProblem(num_seqs=2, num_heads=16, num_kv_heads=1, head_size=64, block_size=8,
                      num_blocks=7, layout="nhd", dtype="float8_e4m3fn", query_dtype="bfloat16",
                      seq_lens=np.array([19, 30], np.int32),
                      block_tables=np.array([[2, 0, 5, 6], [1, 3, 4, 6]], np.int32), seed=5,
                      per_head_scales=True)
    q, out, lse, ref = run_qk_fp8(p, heads_per_block=16)
    check_attention(q, out, lse, *ref)


def test_fp8_queries_need_the_fp8_tensor_core_kernel():
    c16 = pn.PagedKVCache(8, 16, 2, 64)
    with pytest.raises(ValueError, match="qk_fp8=True needs an fp8 cache on the tensor-core"):
        pn.DecodePlan(c16, 2, 8, 4, qk_fp8=True)
    c8 = pn.PagedKVCache(8, 16, 2, 64, dtype="float8_e4m3fn")
    with pytest.raises(ValueError, match="qk_fp8=True needs an fp8 cache on the tensor-core"):
        pn.DecodePlan(c8, 2, 8, 4, query_dtype="float32", qk_fp8=True)
    mqa = pn.DecodePlan(pn.PagedKVCache(8, 16, 1, 64, dtype="float8_e4m3fn"), 2, 32, 4,
                        qk_fp8=True)         # fp8 MQA stays on the decode kernel
    assert mqa.tensor_cores and mqa.qk_fp8
    with pytest.raises(ValueError, match="qk_fp8 must be True or False"):
        pn.DecodePlan(c8, 2, 8, 4, qk_fp8="yes")


def test_quantize_rows_keeps_float32_subnormal_rows_finite():
    # max |x| / 448 underflows to 0 in float32: the scale becomes 2**-149, not 0
    codes, s = F.quantize_rows(np.array([[1e-45, 0.0], [3e-44, -1e-45]], np.float32))
    assert (s == np.float32(2.0 ** -149)).all()
    assert codes.astype(np.float64).tolist() == [[1.0, 0.0], [20.0, -1.0]]
