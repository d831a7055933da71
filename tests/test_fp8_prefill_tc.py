"""fp8 caches on the tensor-core prefill (the producer kernel widens the
codes into its tiles: ``kernels.prefill_fp8``).

``paged_prefill`` over fp8 pools with fp16 or bf16 queries matches the
float64 reference of the dequantised values within the tensor-core error
model (P rounded to the query's type, the scales one rounding more): both
formats, both scale granularities, head sizes 64 and 128, the layouts the
kernel takes, more key tiles than the staging and fp16 rings hold, split-K,
two consumer warpgroups taking turns in persistent blocks; the plan's choice
of kernel and its errors.
"""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import paged_numba as pn
from paged_numba import fp8 as F
from paged_numba.testing import (PrefillProblem, check_attention, prefill_problems,
                                 prefill_reference, variants)

SIM = pn.simulator_enabled()
WS = dict(tensor_cores=True)
# the simulator runs every thread in Python: one consumer warpgroup, 16-key tiles
ONE = dict(WS, block_n=16, num_warps=4) if SIM else WS
TWO = dict(WS, block_n=16, num_warps=8) if SIM else WS


def _problem(q_lens, seq_lens, table, block_size, head_size=64, num_heads=2, num_kv_heads=1,
             layout="nhd", dtype="float8_e4m3fn", query_dtype="float16", per_head=False,
             seed=0):
    table = np.asarray(table, np.int32)
    return PrefillProblem(
        num_seqs=len(q_lens), num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_size=head_size, block_size=block_size, num_blocks=int(table.max()) + 1,
        layout=layout, dtype=dtype, q_lens=np.asarray(q_lens, np.int32),
        seq_lens=np.asarray(seq_lens, np.int32), block_tables=table, seed=seed,
        query_dtype=query_dtype, per_head_scales=per_head)


def run_fp8_prefill(p, causal=True, tiling=None, **extra):
    """``paged_prefill`` over ``p``'s fp8 pools: ``(q, out, lse, reference)``,
    the reference's bound that of the tensor-core kernel in the query's type."""
    q, k, v = p.arrays()
    ks, vs = p.scales()
    cache = pn.PagedKVCache.from_host(*p.layout_pools(k, v), p.layout, k_scale=ks, v_scale=vs)
    out, lse = pn.paged_prefill(q, cache, p.block_tables, p.cu_seqlens_q, p.seq_lens,
                                causal=causal, return_lse=True,
                                **(tiling or {}), **extra)
    ref = prefill_reference(p, q, F.dequantize(k, ks), F.dequantize(v, vs), causal=causal,
                            tensor_cores=str(p.query_dtype), **extra)
    return q, out, lse, ref


# 70 keys in 16-key tiles (5) after 50 cached: round the 2-stage staging ring
# and the 4-stage tile ring; pages of 8 (a tile spans two)
LONG = _problem([20, 3], [70, 20], [[9, 3, 0, 7, 5, 10, 11, 12, 4], [1, 8, 2] + [-1] * 6], 8)
# head size 128, two KV heads, bf16 queries, per-head scales, E5M2
WIDE = _problem([9, 1], [40, 17], [[3, 0, 2, 5, 6], [1, 4, 7, -1, -1]], 8, head_size=128,
                num_heads=4, num_kv_heads=2, layout="hnd", dtype="float8_e5m2",
                query_dtype="bfloat16", per_head=True, seed=3)
# two KV heads, a tile a sequence: 4 (tile, head block) items for persistent blocks
ITEMS = _problem([20, 3], [40, 20], [[9, 3, 0, 7, 5], [1, 8, 2, -1, -1]], 8,
                 num_heads=4, num_kv_heads=2, layout="interleaved", per_head=True, seed=5)
# one chunk of 5 after 35 cached tokens: three key tiles for two parts
CHUNK = _problem([5], [40], [[4, 0, 2, 1, 3]], 8, seed=7)


@pytest.mark.parametrize("p, causal, tiling, extra", [
    (LONG, True, ONE, {}),
    (WIDE, False, ONE, dict(sliding_window=21)),
    (CHUNK, True, dict(ONE, num_parts=2), dict(logits_soft_cap=3.0)),
    (ITEMS, True, dict(TWO, heads_per_block=2, kernel_options=dict(
        wgmma=True, producer=True, swizzle=True, pingpong=True, persistent=2)), {}),
    (WIDE, True, dict(ONE, block_n=32, kernel_options=dict(
        wgmma=True, producer=True, swizzle=True, split_halves=True)), {})],
    ids=["rings", "head128-bf16-e5m2-window", "split-k-soft-cap", "persistent-pingpong",
         "head128-split-halves"])
def test_fp8_prefill_tensor_cores(p, causal, tiling, extra):
    q, out, lse, ref = run_fp8_prefill(p, causal, tiling, **extra)
    assert out.dtype == np.dtype(p.query_dtype)
    check_attention(q, out, lse, *ref)


@pytest.mark.skipif(SIM, reason="the producer kernel's property: a GPU's sizes")
@pytest.mark.parametrize("fmt", F.FP8_DTYPES)
@given(data=st.data())
def test_fp8_prefill_tensor_cores_property(fmt, data):
    p = data.draw(prefill_problems(head_sizes=(64, 128), block_sizes=(1, 16, 64), dtypes=(fmt,),
                                   layouts=("nhd", "hnd", "interleaved"), groups=(1, 4, 8),
                                   max_seqs=3, max_q_len=300, max_cached=600,
                                   query_dtypes=("float16", "bfloat16")),
                  label="problem")
    extra = data.draw(variants(p.num_heads, max_window=int(p.seq_lens.max()) + 2), label="variants")
    causal = data.draw(st.booleans(), label="causal")
    q, out, lse, ref = run_fp8_prefill(p, causal, WS, **extra)
    check_attention(q, out, lse, *ref)


def test_fp8_prefill_kernel_choice():
    from paged_numba.prefill import uses_tensor_cores

    c = pn.PagedKVCache(4, 16, 1, 128, dtype="float8_e4m3fn")
    # by default on an sm_90 GPU only (the simulator takes it when asked)
    assert uses_tensor_cores(c, True, "bfloat16")
    for bad in (dict(query_dtype="float32"), dict(head_size=256), dict(layout="vllm"),
                dict(head_size=32)):
        cache = pn.PagedKVCache(4, 16, 1, bad.get("head_size", 128), dtype="float8_e5m2",
                                layout=bad.get("layout", "nhd"))
        assert not uses_tensor_cores(cache, None, bad.get("query_dtype"))
        with pytest.raises(ValueError, match="tensor_cores=True needs, for an fp8 cache"):
            uses_tensor_cores(cache, True, bad.get("query_dtype"))
    with pytest.raises(ValueError, match="runs on the producer kernel only"):
        pn.PrefillPlan(c, [0, 3], [3], 2, tensor_cores=True,
                       kernel_options=dict(wgmma=True, producer=False))
