"""The order in which prefill runs its tiles (``plan_tiles``): every tile once,
longest first within groups of sequences whose keys fit a budget, the groups
filled greedily; and a plan's output does not depend on that order."""
import numpy as np
from hypothesis import example, given
from hypothesis import strategies as st
from numba import cuda

import paged_numba as pn
from paged_numba.prefill import plan_tiles
from test_prefill import SEED_MIX_F16


def tile_keys(q_len, kv_len, q0, block_q, causal, window):
    """(first, end) of the keys tile ``q0`` of a sequence reads."""
    last = kv_len - q_len + min(q0 + block_q, q_len) - 1
    hi = last + 1 if causal else kv_len
    lo = 0 if window is None else max(kv_len - q_len + q0 - window + 1, 0)
    return lo, hi


@st.composite
def batches(draw):
    n = draw(st.integers(1, 6))
    q_lens = draw(st.lists(st.integers(0, 40), min_size=n, max_size=n))
    seq_lens = [q + draw(st.integers(0, 60)) for q in q_lens]
    block_q = draw(st.sampled_from([1, 4, 16]))
    causal = draw(st.booleans())
    window = draw(st.one_of(st.none(), st.integers(1, 50)))
    group_keys = draw(st.one_of(st.none(), st.integers(0, 200)))
    return q_lens, seq_lens, block_q, causal, window, group_keys


@given(batches())
@example(([4, 4], [4, 4], 2, True, None, 8))       # two sequences fill the budget exactly
@example(([4, 4, 2], [4, 4, 9], 2, True, None, 9))  # the heaviest tile's sequence first
def test_tiles_run_once_longest_first_in_greedy_groups(batch):
    q_lens, seq_lens, block_q, causal, window, group_keys = batch
    seq, q0 = plan_tiles(q_lens, seq_lens, block_q, causal, window, group_keys)
    want = sorted((s, q) for s, n in enumerate(q_lens) for q in range(0, n, block_q))
    assert sorted(zip(seq.tolist(), q0.tolist())) == want           # every tile once
    keys = [tile_keys(q_lens[s], seq_lens[s], q, block_q, causal, window)
            for s, q in zip(seq.tolist(), q0.tolist())]
    work = np.array([hi - lo for lo, hi in keys])
    if group_keys is None:
        assert (np.diff(work) <= 0).all()
        return
    # the groups: runs of tiles whose sequences the greedy rule put together
    span = {}
    for s, (lo, hi) in zip(seq.tolist(), keys):
        a = span.get(s, (lo, hi))
        span[s] = (min(a[0], lo), max(a[1], hi))
    heaviest = {s: work[seq == s].max() for s in span}
    by_weight = sorted(span, key=lambda s: -heaviest[s])       # stable: ties by sequence
    groups, used = [[]], 0
    for s in by_weight:
        k = span[s][1] - span[s][0]
        if groups[-1] and used + k > group_keys:
            groups, used = groups + [[]], 0
        groups[-1].append(s)
        used += k
    at = 0
    for g in groups:
        size = int(np.isin(seq, g).sum())
        assert set(seq[at:at + size].tolist()) == set(g)             # a group's tiles together
        assert (np.diff(work[at:at + size]) <= 0).all()              # longest first within it
        at += size
    assert at == len(seq)


def test_the_output_does_not_depend_on_the_tile_order():
    """One group (longest first over the batch) against a group per
    sequence (budget 0): the same output and log-sum-exps, bit for bit."""
    p = SEED_MIX_F16
    q, k, v = p.arrays()
    kc, vc = p.layout_pools(k, v)
    cache = pn.PagedKVCache.from_host(kc, vc, p.layout)
    dq, table = cuda.to_device(q), cuda.to_device(p.block_tables)
    got = {}
    for budget in (0, 1):
        plan = pn.PrefillPlan(cache, p.cu_seqlens_q, p.seq_lens, p.num_heads, causal=True,
                              tensor_cores=False, block_q=2, block_n=4, num_warps=1,
                              tile_group_bytes=budget)
        order = plan._tiles[0].copy_to_host()
        out = plan.run(dq, table).copy_to_host()
        got[budget] = (order, out, plan.lse.copy_to_host())
    assert not np.array_equal(got[0][0], got[1][0])                  # the orders differ
    np.testing.assert_array_equal(got[0][1].view(np.uint16), got[1][1].view(np.uint16))
    np.testing.assert_array_equal(got[0][2], got[1][2])
