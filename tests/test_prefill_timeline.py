"""The persistent producer kernel built with ``timeline=True`` (an experiments'
option: ``paged_numba.kernels.timeline``) computes what it computes without,
and stamps every item of every block, in order."""
import numpy as np
import pytest
from numba import cuda

import paged_numba as pn
from paged_numba.kernels import prefill_tc
from paged_numba.kernels.timeline import POINTS, ROUNDS, STAMPS, read_timeline, timeline_words
from test_prefill import WS, WS_HEADS, WS_TWO


def test_timeline_stamps_every_item_and_changes_nothing():
    """Eight (tile, head block) items on three persistent blocks (serpentine:
    blocks 0 and 1 take three, block 2 two): the output is bit for bit the
    kernel's without stamps; each warpgroup of a block stamps exactly its
    items, each item's points in the order ``POINTS`` gives, each item after the
    last."""
    p = WS_HEADS
    tiling = dict(WS_TWO, heads_per_block=1, kernel_options=dict(
        WS["kernel_options"], pingpong=True, persistent=3, stages=3))
    q, k, v = p.arrays()
    kc, vc = p.layout_pools(k, v)
    cache = pn.PagedKVCache.from_host(kc, vc, p.layout)
    plan = pn.PrefillPlan(cache, p.cu_seqlens_q, p.seq_lens, p.num_heads, causal=True, **tiling)
    dq, table = cuda.to_device(q), cuda.to_device(p.block_tables)
    want = plan.run(dq, table).copy_to_host()
    blocks = plan._grid[0]
    assert blocks == 3
    plan._kernel = prefill_tc.prefill_tc_kernel(
        cache.head_size, cache.block_size, plan.heads_per_block, plan.block_n, cache.dtype.name,
        cache.layout, plan.num_warps, **plan.kernel_options, timeline=True)
    cache._errors = cuda.to_device(np.zeros(timeline_words(blocks), np.int64))
    plan._inputs = None
    got = plan.run(dq, table).copy_to_host()
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    errors = cache._errors.copy_to_host()
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


def test_timeline_needs_persistent_producer():
    with pytest.raises(ValueError, match="timeline=True needs persistent=True"):
        prefill_tc.prefill_tc_kernel(32, 8, 1, 16, "float16", "nhd", 8, wgmma=True,
                                     producer=True, pingpong=True, timeline=True)
    with pytest.raises(ValueError, match="mbarriers apply to the producer kernel"):
        prefill_tc.prefill_tc_kernel(32, 8, 1, 16, "float16", "nhd", 4, wgmma=True,
                                     timeline=True)
