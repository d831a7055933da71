"""paged_prefill's warpgroup kernels (``kernel_options={"wgmma": True}``, with
or without a producer warpgroup: turns, persistent blocks, the swizzled layout,
lazy rescaling, the lean key loop) against the float64 dense reference, and
the tilings they reject."""
import itertools

import numpy as np
import pytest

import paged_numba as pn
from paged_numba.testing import check_attention, prefill_reference
from test_prefill import (LONG_F16, MQA_DECODE_F16, SIM, WS, WS_HEADS, WS_TWO, _problem,
                          check_prefill, rounding, run_prefill)


# wgmma: 43 query tokens x 2 heads fill both warpgroups of an 8-warp tile (128 rows);
# 45 keys in 32-key tiles (two products of 16 keys each in O += P V)
WG_LONG = _problem([40, 3], [45, 20], [[9, 3, 0, 7, 5, 10], [1, 8, 2, -1, -1, -1]], 8,
                   head_size=32, num_heads=2, dtype="float16")
WG_LONG_BF16 = _problem([40, 3], [45, 20], [[9, 3, 0, 7, 5, 10], [1, 8, 2, -1, -1, -1]], 8,
                        head_size=32, num_heads=2, dtype="bfloat16", layout="vllm")
WG = dict(tensor_cores=True, kernel_options=dict(wgmma=True))
WG_TWO = dict(WG, block_n=32, num_warps=8) if SIM else WG      # two warpgroups
WG_ONE = dict(WG, block_n=16, num_warps=4) if SIM else WG
# the producer kernel: 100 keys in 16-key tiles (7) go round its 4-stage ring
# almost twice, so the consumers hand stages back and the producer waits for them
WS_LONG = _problem([40, 3], [100, 20],
                   [[9, 3, 0, 7, 5, 10, 11, 12, 4, 13, 14, 15, 16], [1, 8, 2] + [-1] * 10], 8,
                   head_size=32, num_heads=2, dtype="float16")
# head size 128: two 128-byte atoms a row in the swizzled layout (k-steps 4.. in the second)
WG_D128 = _problem([5], [20], [[3, 0, 2]], 8, head_size=128, num_heads=2, dtype="float16")
# head size 256: four 128-byte atoms a row; 40 keys in 16-key tiles go round a 3-stage ring
WS_D256 = _problem([5], [40], [[3, 0, 2, 4, 1]], 8, head_size=256, num_heads=2, dtype="bfloat16")
WS_ONE = dict(WS, block_n=16, num_warps=4)
# WS_LONG and two sequences of 9 and 7 keys: one 16-key tile each, the last two items of
# a persistent block's walk (the first too short to pay the second's query copies)
WS_SHORT = _problem([40, 3, 5, 4], [100, 20, 9, 7],
                    [[9, 3, 0, 7, 5, 10, 11, 12, 4, 13, 14, 15, 16], [1, 8, 2] + [-1] * 10,
                     [17, 6] + [-1] * 11, [18] + [-1] * 12], 8, head_size=32, num_heads=2,
                    dtype="float16")


@pytest.mark.parametrize("p, causal, tiling, extra", [
    (WG_LONG, True, WG_TWO, {}), (WG_LONG_BF16, False, WG_ONE, {}),
    (LONG_F16, True, WG_ONE, dict(sliding_window=19, alibi_slopes=np.array([0.25, -0.5]),
                                  logits_soft_cap=3.0)),
    (LONG_F16, True, dict(WG_ONE, num_parts=2), {}), (MQA_DECODE_F16, True, WG_ONE, {})],
    ids=["two-warpgroups", "bf16-vllm-noncausal", "variants", "split-k", "mqa-decode"])
def test_tc_prefill_wgmma(p, causal, tiling, extra):
    """Warpgroup products (``kernel_options={"wgmma": True}``) within the
    tensor-core bound: two warpgroups of rows, several key tiles and 16-key
    steps of ``P V``, the "vllm" layout's element-wise values, the variants,
    split-K and a decode-like tile."""
    check_prefill(p, causal, tiling, **extra)


@pytest.mark.parametrize("p, causal, tiling, extra", [
    (WS_LONG, True, WS_TWO, {}), (WS_LONG, False, WS_ONE, {}),
    (LONG_F16, True, dict(WS_ONE, num_parts=2),
     dict(sliding_window=19, alibi_slopes=np.array([0.25, -0.5]), logits_soft_cap=3.0)),
    (WS_LONG, True, dict(WS_ONE, kernel_options=dict(WS["kernel_options"], stages=3)), {}),
    (WS_LONG, True, dict(WS_TWO, kernel_options=dict(WS["kernel_options"], pingpong=True,
                                                     swizzle=True)), {}),
    (WS_LONG, True, dict(WS_TWO, kernel_options=dict(WS["kernel_options"], pingpong=True,
                                                     swizzle=True, persistent=1)), {}),
    (WS_HEADS, True, dict(WS_TWO, heads_per_block=1, kernel_options=dict(
        WS["kernel_options"], pingpong=True, persistent=3, stages=3)), {}),
    (WS_HEADS, True, dict(WS_TWO, heads_per_block=1, kernel_options=dict(
        WS["kernel_options"], pingpong=True, persistent=3, stages=3, prefetch_queries=True,
        prefetch_ranges=True)), {}),
    (WS_HEADS, False, dict(WS_TWO, heads_per_block=2, kernel_options=dict(
        WS["kernel_options"], pingpong=True, swizzle=True, persistent=2,
        prefetch_queries=True)), dict(sliding_window=30)),
    (WS_SHORT, True, dict(WS_TWO, kernel_options=dict(
        WS["kernel_options"], pingpong=True, swizzle=True, persistent=1, lean_loop=True,
        prefetch_queries=True)), {}),
    (WS_SHORT, True, dict(WS_TWO, kernel_options=dict(
        WS["kernel_options"], pingpong=True, swizzle=True, persistent=1, lean_loop=True,
        prefetch_queries=True, deferred_stores=True)), {}),
    (WS_HEADS, True, dict(WS_TWO, heads_per_block=1, kernel_options=dict(
        WS["kernel_options"], pingpong=True, persistent=3, stages=3, prefetch_queries=True,
        deferred_stores=True)), dict(alibi_slopes=np.array([0.25, -0.5, 1.0, 0.125]))),
    (WS_HEADS, True, dict(WS_TWO, heads_per_block=2, num_parts=2, kernel_options=dict(
        WS["kernel_options"], pingpong=True, swizzle=True, persistent=2, prefetch_ranges=True)),
     dict(sliding_window=30)),
    (WS_LONG, True, dict(WS_TWO, kernel_options=dict(WS["kernel_options"], pingpong=True,
                                                     swizzle=True, mbarriers=True)), {}),
    (WS_HEADS, True, dict(WS_TWO, heads_per_block=1, kernel_options=dict(
        WS["kernel_options"], pingpong=True, persistent=3, stages=3, mbarriers=True)), {}),
    (WS_HEADS, True, dict(WS_TWO, heads_per_block=1, kernel_options=dict(
        WS["kernel_options"], pingpong=True, swizzle=True, persistent=3, stages=3,
        mbarriers=True, lean_loop=True)), {}),
    (WS_LONG, True, dict(WS_ONE, kernel_options=dict(WS["kernel_options"], q_in_regs=True)), {}),
    (WS_LONG, True, dict(WS_TWO, kernel_options=dict(
        WS["kernel_options"], pingpong=True, swizzle=True, persistent=1, lean_loop=True,
        q_in_regs=True)), {}),
    (WG_D128, False, dict(WS_ONE, block_n=32, kernel_options=dict(
        WS["kernel_options"], swizzle=True, split_halves=True, q_in_regs=True)), {}),
    (WS_LONG, True, dict(WS_TWO, block_n=32, kernel_options=dict(
        WS["kernel_options"], pingpong=True, swizzle=True, persistent=1, lean_loop=True,
        fast_exp2=True, fma_exp2=True)), dict(logits_soft_cap=3.0)),
    (WS_HEADS, True, dict(WS_TWO, heads_per_block=1, block_n=32, kernel_options=dict(
        WS["kernel_options"], pingpong=True, persistent=3, stages=3, fast_exp2=True,
        fma_exp2=2)), {}),
    (WS_LONG, True, dict(WS_TWO, block_n=48, kernel_options=dict(
        WS["kernel_options"], pingpong=True, swizzle=True, persistent=1, lean_loop=True,
        stages=3, lazy_rescale=True, lane_vote=True)), {}),
    (WS_LONG, True, dict(WS_TWO, block_n=96, kernel_options=dict(
        WS["kernel_options"], pingpong=True, swizzle=True, persistent=1, lean_loop=True,
        stages=3, lazy_rescale=True, lane_vote=True)), dict(logits_soft_cap=3.0))],
    ids=["two-consumer-warpgroups", "one-noncausal", "variants-split-k", "three-stages",
         "pingpong", "persistent-one-block", "persistent-serpentine", "prefetch-serpentine",
         "prefetch-swizzled-window", "prefetch-lean-loop",
         "deferred-stores-lean-loop", "deferred-stores-serpentine", "persistent-split-k-ranges", "mbarriers",
         "mbarriers-persistent", "mbarriers-lean-loop", "queries-in-registers",
         "queries-in-registers-default-loop",
         "queries-in-registers-head-128-split", "fma-exp2-lean-loop", "fma-exp2-half",
         "default-options-48-key-tiles", "default-options-96-key-tiles"])
def test_tc_prefill_producer(p, causal, tiling, extra):
    """A producer warpgroup doing the copies (``kernel_options={"wgmma": True,
    "producer": True}``), within the tensor-core bound: more key tiles than
    ring stages (the empty/full barriers), two consumer warpgroups (also
    taking turns), the variants with split-K; persistent blocks: one block for
    every tile, three blocks for eight (tile, head block) items of two KV
    heads (in the serpentine block 0 takes items 0, 5, 6 and block 2 items 2,
    3; the ring goes on from one item's keys to the next); the same with the
    next item's queries copied ahead into a second buffer
    (``prefetch_queries``: three blocks taking 3, 3 and 2 items alternate
    their buffers, their next ranges read ahead too, ``prefetch_ranges``; two
    blocks of two items, swizzled, not causal, with a window; one block
    walking every item with the lean loop, the copies paid over its turns
    and the rest after a short item's loop; the same and three blocks of the
    serpentine with each item's output stored during the next item's loop,
    ``deferred_stores``); two blocks of
    two items with split-K and a window, the next ranges read ahead; the
    copies arriving at mbarriers (``mbarriers``: 7 tiles round a 4-stage ring,
    the phases' parity alternating; and across persistent blocks' items, also
    with the lean loop); the
    queries as the register A operand of ``S = Q K^T`` (``q_in_regs``: one
    warpgroup; the default's loop, swizzled, persistent, lean; head size 128
    in the copy engine's layout); a quarter of the exponentials on the FMA pipe
    (``fma_exp2``: 32-key tiles, so each tile has such an n-tile; a half,
    ``fma_exp2=2``, in the serpentine); the head-size-128 default's options
    (lazy rescaling, the lane vote, 3 stages) on tiles of 48 and 96 keys, a
    number of keys that is not a power of two (96: two tiles, the second of
    4 keys, with a soft cap)."""
    check_prefill(p, causal, tiling, **extra)


SPLIT = dict(WS["kernel_options"], swizzle=True, lean_loop=True, split_rings=True, stages=2)


@pytest.mark.parametrize("p, causal, tiling", [
    (WS_LONG, True, dict(WS_TWO, kernel_options=dict(SPLIT, pingpong=True, persistent=1))),
    (WS_HEADS, False, dict(WS_TWO, heads_per_block=1, kernel_options=dict(
        SPLIT, pingpong=True, persistent=3))),
    (WS_D256, True, dict(WS_ONE, kernel_options=dict(SPLIT, stages=3))),
    (WS_LONG, True, dict(WS_TWO, num_parts=2, kernel_options=dict(SPLIT, pingpong=True)))],
    ids=["persistent-one-block", "persistent-serpentine-noncausal", "head-256-three-stages",
         "split-k-turns"])
def test_tc_prefill_split_rings(p, causal, tiling):
    """The producer kernel with a K ring and a V ring (``split_rings``,
    lean loop, swizzled) within the tensor-core bound: one persistent block
    whose 7 tiles of 16 keys go round two 2-stage rings almost four times
    (turns: each warpgroup acquires K_j and V_{j-1}, releases K_j once S_j
    has landed); three blocks across eight items of two KV heads, the rings
    running on from item to item; one warpgroup at head size 256, bf16, 3
    stages a ring, no turns; split-K in two parts with turns, blocks that are
    not persistent (the producer claims only the stages it refills)."""
    check_prefill(p, causal, tiling)


@pytest.mark.parametrize("p, causal, tiling", [
    (WG_LONG, True, dict(WG_TWO, kernel_options=dict(wgmma=True, swizzle=True))),
    (WS_LONG, True, dict(WS_ONE, kernel_options=dict(wgmma=True, producer=True, swizzle=True))),
    (WG_LONG_BF16, False, dict(WG_ONE, kernel_options=dict(wgmma=True, swizzle=True))),
    (WG_D128, True, dict(WG_ONE, kernel_options=dict(wgmma=True, swizzle=True))),
    (WG_D128, False, dict(WS_ONE, block_n=32, kernel_options=dict(
        wgmma=True, producer=True, swizzle=True, split_halves=True))),
    (WS_D256, True, dict(WS_ONE, kernel_options=dict(
        wgmma=True, producer=True, swizzle=True, lean_loop=True, stages=3)))],
    ids=["wgmma", "producer", "bf16-vllm-noncausal", "head-128", "producer-head-128-split",
         "producer-head-256-lean"])
def test_tc_prefill_swizzled(p, causal, tiling):
    """Both warpgroup kernels with their tiles in the swizzled layout
    (``swizzle=True``; head size 32: 64-byte atom rows; 128: two 128-byte
    atoms a row); the producer kernel's K/V tiles at head size 128 also in
    the layout of tensor-map copies (``split_halves``: the rows' first 64
    elements, then their last 64; 32-key tiles, two products in ``P V``); the
    producer kernel at head size 256 (four atoms a row), bf16, lean loop."""
    check_prefill(p, causal, tiling)


def run_grown(p, causal, tiling, creep=False, **extra):
    """The problem's prefill on keys whose size grows along its first sequence:
    the first 16 at 1, the next 32 at 3 (a row's maximum grows by less than
    the lazy slack), the next 16 at 12 (by far more), the rest at 1. ``creep``:
    instead, keys 16-31 are keys 0-15 again, 1 % larger (a row's maximum
    grows by a little, where the first 16 keys held it).
    ``((q, k, v), out, lse, cache)``."""
    q, k, v = p.arrays()
    grow = np.ones(p.seq_lens[0], np.float32)
    if not creep:
        grow[16:48], grow[48:64] = 3.0, 12.0

    def key(pos):
        return p.block_tables[0, pos // p.block_size], pos % p.block_size

    for pos, g in enumerate(grow):
        k[key(pos)] = (k[key(pos)].astype(np.float32) * g).astype(k.dtype)
    if creep:
        for pos in range(16, 32):
            k[key(pos)] = (k[key(pos - 16)].astype(np.float32) * 1.01).astype(k.dtype)
    kc, vc = p.layout_pools(k, v)
    cache = pn.PagedKVCache.from_host(kc, vc, p.layout)
    out, lse = pn.paged_prefill(q, cache, p.block_tables, p.cu_seqlens_q, p.seq_lens,
                                causal=causal, return_lse=True, **extra, **tiling)
    return (q, k, v), out, lse, cache


@pytest.mark.parametrize("tiling", [
    dict(WS_TWO, kernel_options=dict(WS["kernel_options"], pingpong=True, swizzle=True,
                                     lazy_rescale=True)),
    dict(WG_ONE, kernel_options=dict(wgmma=True, swizzle=True, lazy_rescale=True))],
    ids=["producer", "wgmma"])
def test_tc_prefill_lazy_rescale(tiling):
    """``lazy_rescale=True`` within the tensor-core bound, on keys whose size
    grows along the sequence (:func:`run_grown`): where a row's maximum grows
    by less than the slack it is kept (weights above 1), where it grows by
    far more it moves (O and the row sum rescaled)."""
    p = WS_LONG
    (q, k, v), out, lse, cache = run_grown(p, True, tiling)
    check_attention(q, out, lse, *prefill_reference(p, q, k, v, causal=True,
                                                    tensor_cores=rounding(cache, tiling)))


@pytest.mark.parametrize("p, causal, tiling, extra, lazy", [
    (WS_LONG, True, WS_ONE, {}, True),
    (LONG_F16, True, dict(WS_ONE, num_parts=2),
     dict(sliding_window=19, alibi_slopes=np.array([0.25, -0.5]), logits_soft_cap=3.0), True),
    (WS_HEADS, False, dict(WS_TWO, heads_per_block=1, kernel_options=dict(
        WS["kernel_options"], pingpong=True, swizzle=True, persistent=3, stages=3)),
     dict(sliding_window=23), True),
    (WS_LONG, True, WS_ONE, {}, False),
    (WS_LONG, True, WS_ONE, dict(creep=True), False),
    (WS_LONG, True, WS_ONE, dict(creep=True), True),
    (LONG_F16, False, dict(WS_ONE, num_parts=2), dict(sliding_window=19), False)],
    ids=["lazy-causal", "lazy-variants-split-k", "lazy-persistent-noncausal-window", "causal",
         "causal-creeping-maxima", "lazy-causal-creeping-maxima", "noncausal-window-split-k"])
def test_tc_prefill_lane_vote_is_bit_for_bit(p, causal, tiling, extra, lazy):
    """``lane_vote`` (a warp none of whose lanes' own maxima would move its
    row's maximum skips the quad's exchange of maxima), ``staged_p`` (P
    packed by the softmax into staging registers), and both with
    ``early_weights`` (the weights against the kept maxima taken before the
    vote), give the lean producer kernel's outputs and log-sum-exps bit for
    bit, with lazy
    rescaling and without, on keys that grow past the slack and under it
    (:func:`run_grown`) or creep past it, with windows whose first tiles
    leave rows without a maximum."""
    opts = dict(tiling.get("kernel_options", WS["kernel_options"]), lean_loop=True,
                lazy_rescale=lazy)
    base = run_grown(p, causal, dict(tiling, kernel_options=opts), **extra)
    vote = run_grown(p, causal, dict(tiling, kernel_options=dict(opts, lane_vote=True)),
                     **extra)
    staged = run_grown(p, causal, dict(tiling, kernel_options=dict(opts, staged_p=True)),
                       **extra)
    early = run_grown(p, causal, dict(tiling, kernel_options=dict(
        opts, lane_vote=True, early_weights=True, staged_p=True)), **extra)
    for runs in zip(base[1:3], vote[1:3], staged[1:3], early[1:3]):
        a, *others = [np.asarray(x) for x in runs]
        for b in others:
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
    assert np.isfinite(np.asarray(base[1], np.float32)).all()
    q, k, v = base[0]
    variants = {key: val for key, val in extra.items() if key != "creep"}
    check_attention(q, base[1], base[2], *prefill_reference(
        p, q, k, v, causal=causal, tensor_cores=rounding(base[3], tiling), **variants))


@pytest.mark.skipif(not SIM, reason="calls a device function from the host (simulator)")
def test_tc_prefill_mask_limits():
    """The lean key loop's tile test (two compares against ``mask_limits``,
    computed once an item, in int32) gives the three conditions it stands for:
    the context's end, the causal diagonal, the window's edge."""
    from numba import int32
    from paged_numba.kernels.prefill_tc_parts import tile_parts
    BN = 16
    P = tile_parts(32, 8, 1, BN, "float16", "nhd", 4)
    edges = (0, 1, 14, 15, 16, 17, 31, 32, 33, 47, 48)      # about the tile's edges
    for pos0, nq, kv_hi, causal, window in itertools.product(
            edges, (1, 2, 4), edges[1:], (0, 1), (0, 1, 2, 15, 16, 17, 40)):
        for kt in range(0, 64, BN):
            want = (kt + BN > kv_hi or (causal != 0 and kt + BN - 1 > pos0)
                    or (window > 0 and pos0 + nq - 1 - kt >= window))
            lo, hi = P.mask_limits(*(int32(x) for x in (pos0, nq, kv_hi, causal, window)))
            assert (kt <= lo or kt > hi) == want, (kt, pos0, nq, kv_hi, causal, window)


@pytest.mark.parametrize("p, causal, tiling, extra", [
    (WS_LONG, True, WS_ONE, {}),
    (LONG_F16, True, dict(WS_ONE, num_parts=2),
     dict(sliding_window=19, alibi_slopes=np.array([0.25, -0.5]), logits_soft_cap=3.0)),
    (WS_LONG, False, dict(WS_ONE, kernel_options=dict(WS["kernel_options"], stages=3)),
     dict(sliding_window=23)),
    (WS_HEADS, True, dict(WS_TWO, heads_per_block=1, kernel_options=dict(
        WS["kernel_options"], pingpong=True, swizzle=True, persistent=3, stages=3,
        lazy_rescale=True)), {})],
    ids=["causal", "variants-split-k", "noncausal-window-three-stages", "persistent-lazy"])
def test_tc_prefill_lean_loop_is_bit_for_bit(p, causal, tiling, extra):
    """``lean_loop`` (32-bit counters, each tile's mask decided before its
    scores land, the softmax unseeded) gives the producer kernel's outputs and
    log-sum-exps bit for bit: one consumer warpgroup, the variants with
    split-K, a window, and persistent blocks taking turns."""
    base = run_prefill(p, causal, tiling, **extra)
    lean = run_prefill(p, causal, dict(tiling, kernel_options=dict(
        tiling["kernel_options"], lean_loop=True)), **extra)
    for a, b in zip(base[1:3], lean[1:3]):
        a, b = np.asarray(a), np.asarray(b)
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
    assert np.isfinite(np.asarray(base[1], np.float32)).all()


def test_wgmma_rejects_tilings_it_cannot_run():
    with pytest.raises(ValueError, match="num_warps a multiple of 4"):
        check_prefill(LONG_F16, True, dict(WG, num_warps=2, block_n=16))
    with pytest.raises(ValueError, match="needs m_tiles=1"):
        check_prefill(LONG_F16, True, dict(tensor_cores=True, num_warps=4, block_n=16,
                                           kernel_options=dict(wgmma=True, m_tiles=2)))
    with pytest.raises(ValueError, match="'producer'. needs kernel_options.'wgmma'"):
        check_prefill(LONG_F16, True, dict(tensor_cores=True, num_warps=4, block_n=16,
                                           kernel_options=dict(producer=True)))
    with pytest.raises(ValueError, match="num_warps 4 or 8"):
        check_prefill(LONG_F16, True, dict(WS, num_warps=12, block_n=16))
    with pytest.raises(ValueError, match=r"kernel_options\['stages'\] must be >= 2"):
        check_prefill(LONG_F16, True, dict(WS_ONE, kernel_options=dict(WS["kernel_options"],
                                                                       stages=1)))
    with pytest.raises(ValueError, match="takes 3 to 7 stages, but got stages=2"):
        check_prefill(LONG_F16, True, dict(WS_ONE, kernel_options=dict(WS["kernel_options"],
                                                                       stages=2)))
    with pytest.raises(ValueError, match="split_rings=True needs lean_loop=True"):
        check_prefill(LONG_F16, True, dict(WS_TWO, kernel_options=dict(
            WS["kernel_options"], split_rings=True, stages=2)))
    with pytest.raises(ValueError, match="split rings take 2 stages each with pingpong, 2 or 3 "
                                         "without .* but got stages=3, pingpong=True"):
        check_prefill(LONG_F16, True, dict(WS_TWO, kernel_options=dict(SPLIT, pingpong=True,
                                                                       stages=3)))
    with pytest.raises(ValueError, match="not an fp8 cache, mbarriers or tensor_maps"):
        check_prefill(LONG_F16, True, dict(WS_TWO, kernel_options=dict(SPLIT, pingpong=True,
                                                                       mbarriers=True)))
    with pytest.raises(ValueError, match="split_rings=True, producer_registers=None, .* without "
                                         "producer=True"):
        check_prefill(LONG_F16, True, dict(WG_ONE, kernel_options=dict(wgmma=True,
                                                                       split_rings=True)))
    with pytest.raises(ValueError, match="apply to the producer kernel"):
        check_prefill(LONG_F16, True, dict(WG_ONE, kernel_options=dict(wgmma=True, stages=3)))
    with pytest.raises(ValueError, match="apply to the producer kernel"):
        check_prefill(LONG_F16, True, dict(WG_ONE, kernel_options=dict(wgmma=True, pingpong=True)))
    with pytest.raises(ValueError, match="pingpong needs two consumer warpgroups"):
        check_prefill(LONG_F16, True, dict(WS_ONE, kernel_options=dict(WS["kernel_options"],
                                                                       pingpong=True)))
    with pytest.raises(ValueError, match="pingpong needs .* at most 4 stages"):
        check_prefill(LONG_F16, True, dict(WS_TWO, kernel_options=dict(
            WS["kernel_options"], pingpong=True, stages=5)))
    with pytest.raises(ValueError, match="deferred_stores=True needs prefetch_queries=True"):
        check_prefill(LONG_F16, True, dict(WS_TWO, kernel_options=dict(
            WS["kernel_options"], pingpong=True, persistent=1, deferred_stores=True)))
    with pytest.raises(ValueError, match="deferred_stores=True, .* without producer=True"):
        check_prefill(LONG_F16, True, dict(WG_ONE, kernel_options=dict(wgmma=True,
                                                                       deferred_stores=True)))
    with pytest.raises(ValueError, match="fma_exp2=True needs fast_exp2=True"):
        check_prefill(LONG_F16, True, dict(WS_TWO, kernel_options=dict(
            WS["kernel_options"], fast_exp2=False, fma_exp2=True)))
    with pytest.raises(ValueError, match=r"kernel_options\['fma_exp2'\] must be a power of two "
                                         r"in \[1, 8\], but got 3"):
        check_prefill(LONG_F16, True, dict(WS_TWO, kernel_options=dict(
            WS["kernel_options"], fma_exp2=3)))
    with pytest.raises(ValueError, match="fma_exp2=True, .* without producer=True"):
        check_prefill(LONG_F16, True, dict(WG_ONE, kernel_options=dict(wgmma=True, fast_exp2=True,
                                                                       fma_exp2=True)))
    with pytest.raises(ValueError, match="lane_vote, .* lane_vote=True, .* without producer=True"):
        check_prefill(LONG_F16, True, dict(WG_ONE, kernel_options=dict(
            wgmma=True, lazy_rescale=True, lane_vote=True)))
    with pytest.raises(ValueError, match="early_weights needs lane_vote=True and one m-tile a "
                                         "warp, but got lane_vote=False"):
        check_prefill(LONG_F16, True, dict(WS_TWO, kernel_options=dict(
            WS["kernel_options"], early_weights=True)))
    with pytest.raises(ValueError, match="staged_p, .* staged_p=True, .* without producer=True"):
        check_prefill(LONG_F16, True, dict(WG_ONE, kernel_options=dict(wgmma=True,
                                                                       staged_p=True)))
    with pytest.raises(ValueError, match="lane_vote=True, .* need wgmma=True"):
        check_prefill(LONG_F16, True, dict(tensor_cores=True, num_warps=4, block_n=16,
                                           kernel_options=dict(lane_vote=True)))
    with pytest.raises(ValueError, match="persistent=True needs pingpong=True"):
        check_prefill(LONG_F16, True, dict(WS_TWO, kernel_options=dict(
            WS["kernel_options"], persistent=True)))
    with pytest.raises(ValueError,
                       match=r"kernel_options\['persistent'\] must be a positive integer"):
        check_prefill(LONG_F16, True, dict(WS_TWO, kernel_options=dict(
            WS["kernel_options"], pingpong=True, persistent=0)))
    with pytest.raises(ValueError, match="apply to the producer kernel"):
        check_prefill(LONG_F16, True, dict(WG_ONE, kernel_options=dict(wgmma=True,
                                                                       persistent=2)))
    with pytest.raises(ValueError, match="producer_registers=40, split_halves=False, mbarriers=False without producer=True"):
        check_prefill(LONG_F16, True, dict(WG_ONE, kernel_options=dict(wgmma=True,
                                                                       producer_registers=40)))
    with pytest.raises(ValueError, match="split_halves=True needs swizzle=True"):
        check_prefill(LONG_F16, True, dict(WS_TWO, kernel_options=dict(WS["kernel_options"],
                                                                       split_halves=True)))
    with pytest.raises(ValueError, match="split_halves=True, mbarriers=False without producer=True"):
        check_prefill(LONG_F16, True, dict(WG_ONE, kernel_options=dict(wgmma=True,
                                                                       split_halves=True)))
    with pytest.raises(ValueError, match="mbarriers=True needs pingpong=True"):
        check_prefill(LONG_F16, True, dict(WS_TWO, kernel_options=dict(WS["kernel_options"],
                                                                       mbarriers=True)))
    with pytest.raises(ValueError, match="mbarriers=True without producer=True"):
        check_prefill(LONG_F16, True, dict(WG_ONE, kernel_options=dict(wgmma=True,
                                                                       mbarriers=True)))
    with pytest.raises(ValueError, match="producer_registers needs two consumer warpgroups"):
        check_prefill(LONG_F16, True, dict(WS_ONE, kernel_options=dict(WS["kernel_options"],
                                                                       producer_registers=40)))
    with pytest.raises(ValueError, match="multiple of 8 from 24 to 160, but got 44"):
        check_prefill(LONG_F16, True, dict(WS_TWO, kernel_options=dict(WS["kernel_options"],
                                                                       producer_registers=44)))
    with pytest.raises(ValueError, match=r"wgmma takes none of q_in_regs \(but with producer\)"):
        check_prefill(LONG_F16, True, dict(WG_ONE, kernel_options=dict(wgmma=True,
                                                                       q_in_regs=True)))
    with pytest.raises(ValueError, match="head size 128 at most, but got head_size=256"):
        check_prefill(WS_D256, True, dict(WS_ONE, kernel_options=dict(WS["kernel_options"],
                                                                      q_in_regs=True)))
    with pytest.raises(ValueError, match=r"kernel_options\['producer_registers'\] must be at most 160, but got 168"):
        check_prefill(LONG_F16, True, dict(WS_TWO, kernel_options=dict(WS["kernel_options"],
                                                                       producer_registers=168)))
