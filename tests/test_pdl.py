"""Split-K decode with its merge launched early (``DecodePlan(pdl=True)``), on
the decode kernel and on the prefill tile that takes MQA and large groups.

The merge blocks may start while the decode blocks still run and wait for
the partial states themselves (``griddepcontrol.wait``): on a GPU a merge
that read a partial state too early would change the output, so the plan's
outputs must be bit for bit those of the same plan without it, over several
runs of the captured graph and with new buffers. Under the simulator the
launches are ordinary ones (the plumbing is what is checked there).
"""
import numpy as np
import pytest
from numba import cuda

import paged_numba as pn

SIM = pn.simulator_enabled()
# (num_seqs, context, num_partitions): one long sequence, a batch; larger on a GPU
CASES = [(1, 40, 2)] if SIM else [(1, 32768, 32), (16, 4096, 4), (7, 3000, 3)]
# MQA (32 query heads on one KV head) on either prefill tile
MQA_CASES = [(2, 40, 2)] if SIM else [(64, 4096, 2), (7, 3000, 3)]


def _plans(num_seqs, context, parts, pdl, group_kernel=None):
    rng = np.random.default_rng(context)
    block_size, kv_heads, heads, d = (8, 1, 4, 32) if SIM else (16, 2, 8, 128)
    if group_kernel is not None:
        kv_heads, heads, d = 1, 32, 64 if SIM else 128
    max_blocks = -(-context // block_size)
    num_blocks = num_seqs * max_blocks + 3
    k = rng.standard_normal((num_blocks, block_size, kv_heads, d)).astype(np.float16)
    v = rng.standard_normal((num_blocks, block_size, kv_heads, d)).astype(np.float16)
    cache = pn.PagedKVCache.from_host(k, v, "nhd")
    table = rng.permutation(num_blocks)[:num_seqs * max_blocks].reshape(num_seqs, max_blocks)
    lens = np.clip(context - rng.integers(0, block_size * 3, num_seqs), 1, context)
    plan = pn.DecodePlan(cache, num_seqs, heads, max_blocks, num_partitions=parts, pdl=pdl,
                         group_kernel=group_kernel)
    q = [cuda.to_device(rng.standard_normal((num_seqs, heads, d)).astype(np.float16))
         for _ in range(2)]
    return plan, q, cuda.to_device(table.astype(np.int32)), cuda.to_device(lens.astype(np.int32))


@pytest.mark.parametrize("num_seqs, context, parts, group_kernel",
                         [c + (None,) for c in CASES]
                         + [c + (k,) for c in MQA_CASES for k in ("tile", "wgmma")])
def test_the_merge_launched_early_gives_the_same_bits(num_seqs, context, parts, group_kernel):
    plain, q, table, lens = _plans(num_seqs, context, parts, False, group_kernel)
    early, *_ = _plans(num_seqs, context, parts, True, group_kernel)
    assert plain.num_partitions == early.num_partitions == parts > 1
    assert early.tensor_cores and early.pdl and not plain.pdl
    if group_kernel is not None:
        assert early._group.kind == group_kernel and early._group.merge.programmatic
    for step in range(2 if SIM else 4):   # the first run packs and captures, then replays
        qq = q[step % 2]
        want = plain.run(qq, table, lens).copy_to_host(), plain.lse.copy_to_host()
        got = early.run(qq, table, lens).copy_to_host(), early.lse.copy_to_host()
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), step
    out = cuda.device_array_like(q[0])          # new buffers: a new merge launch
    lse = cuda.device_array((num_seqs, early.num_heads), np.float32)
    early.run(q[0], table, lens, out=out, lse=lse)
    plain.run(q[0], table, lens)
    assert np.array_equal(out.copy_to_host(), plain.out.copy_to_host())
    assert np.array_equal(lse.copy_to_host(), plain.lse.copy_to_host())


def test_pdl_applies_to_split_tensor_core_plans_only():
    cache = pn.PagedKVCache(16, 16, 2, 64)
    assert not pn.DecodePlan(cache, 2, 8, 4, num_partitions=1, pdl=True).pdl
    assert not pn.DecodePlan(cache, 2, 8, 4, num_partitions=2, pdl=True,
                             tensor_cores=False).pdl
    assert pn.DecodePlan(cache, 2, 8, 4, num_partitions=2, pdl=True).pdl
    with pytest.raises(ValueError, match="pdl must be True or False"):
        pn.DecodePlan(cache, 2, 8, 4, pdl="yes")
    mqa = pn.PagedKVCache(16, 16, 1, 64)
    assert pn.DecodePlan(mqa, 2, 32, 4, num_partitions=2, pdl=True).pdl      # the prefill tile
    assert not pn.DecodePlan(mqa, 2, 32, 4, num_partitions=1, pdl=True).pdl
    from paged_numba.kernels.prefill_tc import prefill_tc_kernel
    with pytest.raises(ValueError, match="pdl=True lets a split-K merge start early"):
        prefill_tc_kernel(64, 16, 32, 64, "float16", "nhd", 2, pdl=True)    # not split
