"""The persistent producer kernel built with ``timeline=True`` (an experiments'
option: ``paged_numba.kernels.timeline``) computes what it computes without,
and stamps every item of every block, in order."""
import numpy as np
import pytest
from numba import cuda

import paged_numba as pn
from paged_numba.kernels import prefill_tc
from paged_numba.kernels.timeline import (LOOP_PHASES, LOOP_WORDS, POINTS, ROUNDS, STAMPS,
                                          read_loop_clocks, read_timeline, timeline_words)
from test_prefill import WS, WS_HEADS, WS_TWO


def stamped_run(options, timeline):
    """WS_HEADS through the persistent producer kernel with ``options``, then
    through the same kernel built with ``timeline``: the plan, both outputs and
    the error array's words."""
    p = WS_HEADS
    tiling = dict(WS_TWO, heads_per_block=1, kernel_options=dict(WS["kernel_options"], **options))
    q, k, v = p.arrays()
    kc, vc = p.layout_pools(k, v)
    cache = pn.PagedKVCache.from_host(kc, vc, p.layout)
    plan = pn.PrefillPlan(cache, p.cu_seqlens_q, p.seq_lens, p.num_heads, causal=True, **tiling)
    dq, table = cuda.to_device(q), cuda.to_device(p.block_tables)
    want = plan.run(dq, table).copy_to_host()
    blocks = plan._grid[0]
    plan._kernel = prefill_tc.prefill_tc_kernel(
        cache.head_size, cache.block_size, plan.heads_per_block, plan.block_n, cache.dtype.name,
        cache.layout, plan.num_warps, **plan.kernel_options, timeline=timeline)
    cache._errors = cuda.to_device(np.zeros(timeline_words(blocks), np.int64))
    plan._inputs = None
    got = plan.run(dq, table).copy_to_host()
    return plan, want, got, cache._errors.copy_to_host()


def test_timeline_stamps_every_item_and_changes_nothing():
    """Eight (tile, head block) items on three persistent blocks (serpentine:
    blocks 0 and 1 take three, block 2 two): the output is bit for bit the
    kernel's without stamps; each warpgroup of a block stamps exactly its
    items, each item's points in the order ``POINTS`` gives, each item after the
    last."""
    plan, want, got, errors = stamped_run(dict(pingpong=True, persistent=3, stages=3), True)
    blocks = plan._grid[0]
    assert blocks == 3
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    assert not errors[:4].any()                      # no offence recorded
    stamps = read_timeline(errors, blocks)
    assert stamps.shape == (3, ROUNDS, 3, STAMPS)
    for b, items in enumerate((3, 3, 2)):
        for role in range(3):
            order = [k for k, _ in POINTS[role]]
            unused = [k for k in range(STAMPS) if k not in order]
            t = stamps[b, :, role]
            assert (t[:items][:, order] > 0).all() and not t[items:].any(), (b, role)
            assert not t[:, unused].any(), (b, role)
            assert (np.diff(t[:items][:, order], axis=1) >= 0).all(), (b, role)
            assert (t[1:items, 0] >= t[:items - 1, order[-1]]).all(), (b, role)


def item_key_tiles(plan, p):
    """Key tiles of each work item in the kernel's order (tile-major, head
    blocks inner), from the plan's tiles: causal, no window."""
    seq, q0 = plan._tiles[0].copy_to_host(), plan._tiles[1].copy_to_host()
    tiles = []
    for s_, q in zip(seq, q0):
        q_len = p.cu_seqlens_q[s_ + 1] - p.cu_seqlens_q[s_]
        nq = min(plan.block_q, q_len - q)
        kv_hi = min(p.seq_lens[s_] - q_len + q + nq, p.seq_lens[s_])
        tiles.append(-(-kv_hi // plan.block_n))
    return np.repeat(tiles, plan.num_heads // plan.heads_per_block)


def test_loop_clocks_count_every_steady_tile_and_change_nothing():
    """``timeline="loop"`` on the lean loop: the output is bit for bit the
    kernel's without clocks; each consumer warpgroup of each block records,
    for exactly its items, one tile fewer than the item's key tiles (the
    first is the loop's prologue), and (on the simulator, where the cycle
    counter counts the microseconds of the clock the stamps read in
    nanoseconds) the steps add up to no more than the item's keys phase."""
    plan, want, got, errors = stamped_run(
        dict(pingpong=True, persistent=3, stages=4, lean_loop=True), "loop")
    blocks = plan._grid[0]
    tiles = item_key_tiles(plan, WS_HEADS)
    assert blocks == 3 and len(tiles) == 8 and set(tiles) == {2, 3}
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    assert not errors[:4].any()
    clocks = read_loop_clocks(errors, blocks)
    stamps = read_timeline(errors, blocks)
    assert clocks.shape == (3, ROUNDS, 2, LOOP_WORDS) and LOOP_WORDS == len(LOOP_PHASES) + 1
    for b, items in enumerate((3, 3, 2)):
        for rnd in range(ROUNDS):
            w = rnd * blocks + (b if rnd % 2 == 0 else blocks - 1 - b)
            for wg in range(2):
                c = clocks[b, rnd, wg]
                if rnd >= items:
                    assert not c.any(), (b, rnd, wg)
                    continue
                assert c[-1] == tiles[w] - 1, (b, rnd, wg, c, tiles[w])
                assert c[:-1].sum() > 0, (b, rnd, wg)
                if pn.simulator_enabled():
                    keys = stamps[b, rnd, 1 + wg, 2] - stamps[b, rnd, 1 + wg, 1]
                    assert c[:-1].sum() * 1000 <= keys + 1000, (b, rnd, wg)


def test_timeline_needs_persistent_producer():
    with pytest.raises(ValueError, match="timeline=True needs persistent=True"):
        prefill_tc.prefill_tc_kernel(32, 8, 1, 16, "float16", "nhd", 8, wgmma=True,
                                     producer=True, pingpong=True, timeline=True)
    with pytest.raises(ValueError, match="times the lean key loop"):
        prefill_tc.prefill_tc_kernel(32, 8, 1, 16, "float16", "nhd", 8, wgmma=True,
                                     producer=True, pingpong=True, persistent=2, timeline="loop")
    with pytest.raises(ValueError, match="mbarriers apply to the producer kernel"):
        prefill_tc.prefill_tc_kernel(32, 8, 1, 16, "float16", "nhd", 4, wgmma=True,
                                     timeline=True)
