"""The producer kernel's whole K/V tiles through the copy engine
(``kernel_options['tensor_maps']``) against the float64 reference."""
import numpy as np
import pytest
from numba import cuda

import paged_numba as pn
from paged_numba.kernels import prefill_tma
from paged_numba.testing import PrefillProblem, check_attention, prefill_reference

OPTIONS = dict(wgmma=True, producer=True, swizzle=True, pingpong=True, split_halves=True,
               mbarriers=True, tensor_maps=True)
TILING = dict(tensor_cores=True, block_n=16, num_warps=8, kernel_options=OPTIONS)


def problem(q_lens, seq_lens, block_size, layout, num_heads=2, num_kv_heads=1, head_size=64,
            dtype="float16", seed=0):
    """A problem whose sequences take pages in a scrambled order."""
    rng = np.random.default_rng(seed)
    pages = [-(-n // block_size) for n in seq_lens]
    ids = rng.permutation(sum(pages) + 2).astype(np.int32)      # two pages no one uses
    table = np.full((len(pages), max(pages)), -1, np.int32)
    start = 0
    for i, n in enumerate(pages):
        table[i, :n] = ids[start:start + n]
        start += n
    return PrefillProblem(num_seqs=len(q_lens), num_heads=num_heads, num_kv_heads=num_kv_heads,
                          head_size=head_size, block_size=block_size,
                          num_blocks=sum(pages) + 2, layout=layout, dtype=dtype,
                          q_lens=np.asarray(q_lens, np.int32),
                          seq_lens=np.asarray(seq_lens, np.int32), block_tables=table,
                          seed=seed)


def poisoned(p, k, v):
    """``k``, ``v`` with NaN in every row that no sequence holds (past each
    sequence's end in its last page, and the unused pages): a box copy of a
    partial tile would carry them into ``P V`` (NaN times a zero weight)."""
    k, v = k.copy(), v.copy()
    held = np.zeros(k.shape[:2], bool)
    for s, n in enumerate(p.seq_lens):
        for t in range(int(n)):
            held[p.block_tables[s, t // p.block_size], t % p.block_size] = True
    k[~held] = np.nan
    v[~held] = np.nan
    return k, v


def check(p, causal=True, tiling=TILING, **variants):
    q, k, v = p.arrays()
    k, v = poisoned(p, k, v)
    kc, vc = p.layout_pools(k, v)
    cache = pn.PagedKVCache.from_host(kc, vc, p.layout)
    out, lse = pn.paged_prefill(q, cache, p.block_tables, p.cu_seqlens_q, p.seq_lens,
                                causal=causal, return_lse=True, **variants, **tiling)
    check_attention(q, out, lse, *prefill_reference(p, q, k, v, causal=causal,
                                                    tensor_cores=p.dtype, **variants))


@pytest.mark.parametrize("p, causal, tiling, variants", [
    # 100 keys in 16-key tiles of two 8-token pages: 6 whole tiles and the
    # last partial, round a 4-stage ring almost twice; 20 keys: 1 and 1
    (problem([40, 3], [100, 20], 8, "nhd"), True, TILING, {}),
    # pages of 32 tokens hold two tiles each (a box from the middle of a page)
    (problem([5, 30], [70, 30], 32, "hnd", dtype="bfloat16"), False, TILING, {}),
    # head size 128 (two column groups), two KV heads, persistent blocks
    # carrying the ring across items, a window whose first tile is partial
    (problem([24, 9], [64, 41], 16, "nhd", num_heads=4, num_kv_heads=2, head_size=128),
     True, dict(TILING, heads_per_block=1, kernel_options=dict(OPTIONS, persistent=3,
                                                               stages=3)),
     dict(sliding_window=29))],
    ids=["nhd-pages-of-8", "hnd-bf16-pages-of-32-noncausal", "head-128-persistent-window"])
def test_whole_tiles_by_boxes(p, causal, tiling, variants):
    """Whole tiles come by box copies and the others by ``cp.async``, into the
    same ring, within the tensor-core bound; rows outside the sequences hold
    NaN, so a box copy of a tile that is not whole fails the check."""
    check(p, causal, tiling, **variants)


def test_which_tiles_go_by_boxes():
    """``run_rows`` and the boxes of each layout, and the launches refused."""
    assert prefill_tma.run_rows(8, 64) == 8 and prefill_tma.run_rows(64, 16) == 16
    p = problem([3], [20], 4, "nhd")
    q, k, v = p.arrays()
    cache = pn.PagedKVCache.from_host(*p.layout_pools(k, v), p.layout)
    with pytest.raises(ValueError, match="block_size=4"):
        pn.PrefillPlan(cache, p.cu_seqlens_q, p.seq_lens, 2, **TILING)
    p = problem([3], [20], 8, "vllm")
    q, k, v = p.arrays()
    cache = pn.PagedKVCache.from_host(*p.layout_pools(k, v), p.layout)
    with pytest.raises(ValueError, match="vllm"):
        pn.PrefillPlan(cache, p.cu_seqlens_q, p.seq_lens, 2, **TILING)
    p = problem([3], [20], 8, "nhd")
    q, k, v = p.arrays()
    cache = pn.PagedKVCache.from_host(*p.layout_pools(k, v), p.layout)
    with pytest.raises(ValueError, match="tensor_maps=True needs split_halves=True"):
        pn.PrefillPlan(cache, p.cu_seqlens_q, p.seq_lens, 2,
                       **dict(TILING, kernel_options=dict(OPTIONS, split_halves=False)))
    with pytest.raises(ValueError, match="tensor_maps=True runs on the producer kernel"):
        pn.PrefillPlan(cache, p.cu_seqlens_q, p.seq_lens, 2,
                       **dict(TILING, kernel_options=dict(wgmma=True, tensor_maps=True)))


def test_whole_tiles_read_through_the_maps():
    """Every tile of a sequence of whole tiles (48 keys, not causal) comes by
    box copies: a plan given the tensor maps of other pools attends over
    those pools' keys and values."""
    p = problem([5], [48], 8, "nhd")
    q, k, v = p.arrays()
    other = problem([5], [48], 8, "nhd", seed=1)
    _, k2, v2 = other.arrays()
    cache = pn.PagedKVCache.from_host(*p.layout_pools(k, v), p.layout)
    elsewhere = pn.PagedKVCache.from_host(*p.layout_pools(k2, v2), p.layout)
    plan = pn.PrefillPlan(cache, p.cu_seqlens_q, p.seq_lens, 2, causal=False, **TILING)
    plan._maps = prefill_tma.pool_maps(elsewhere.key_cache, elsewhere.value_cache, p.layout,
                                       plan.block_n)
    out = plan.run(cuda.to_device(q), cuda.to_device(p.block_tables))
    check_attention(q, out.copy_to_host(), plan.lse.copy_to_host(),
                    *prefill_reference(p, q, k2, v2, causal=False, tensor_cores=p.dtype))


@pytest.mark.parametrize("bad", [6, -1])
def test_an_id_outside_the_pool_in_a_whole_tile_reads_block_zero(bad):
    """With validation off, a block id outside the pool in a tile that goes by
    boxes is read as block 0 and recorded, as on the ``cp.async`` path."""
    rng = np.random.default_rng(3)
    k = rng.standard_normal((6, 8, 1, 64)).astype(np.float16)
    v = rng.standard_normal((6, 8, 1, 64)).astype(np.float16)
    cache = pn.PagedKVCache.from_host(k, v)
    q = cuda.to_device(rng.standard_normal((5, 2, 64)).astype(np.float16))
    plan = pn.PrefillPlan(cache, [0, 5], [16], 2, causal=False, **TILING)   # one whole tile
    table = np.array([[4, 0]], np.int32)
    dt = cuda.to_device(table)

    def run(entry):
        table[0, 1] = entry
        dt.copy_to_device(table)
        return plan.run(q, dt).copy_to_host()

    want, clean = run(0), run(5)
    cache.check()
    got = run(bad)
    with pytest.raises(ValueError, match=rf"block_tables\[0, 1\] = {bad} \(validate=False\), "
                                         r"outside \[0, 6\); it read block 0"):
        cache.check()
    assert np.array_equal(got, want) and not np.array_equal(got, clean)
