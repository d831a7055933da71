"""serving_sim: hand-computed memory accounting, admission, preemption, properties."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from paged_numba.serving_sim import compare, make_requests, simulate

ONE = [[32, 1]]   # 32 prompt tokens + 1 generated: 33 token states during its only step


@pytest.mark.parametrize("allocator, block_size, reserved", [
    ("paged", 16, 48),                  # ceil(33 / 16) = 3 blocks = 48 slots, 15 empty
    ("contiguous-max", None, 100),      # max_len = 100 reserved, 67 empty
    ("contiguous-oracle", None, 33),    # exactly prompt + output
    ("paged", 1, 33),                   # one slot per token
])
def test_single_request_waste(allocator, block_size, reserved):
    r = simulate(allocator, block_size, ONE, budget_tokens=128, max_len=100)
    assert (r["mean_reserved_slots"], r["mean_used_slots"]) == (reserved, 33)
    assert r["internal_frac"] * 128 == pytest.approx(reserved - 33)
    assert r["useful_frac"] == pytest.approx(33 / reserved)
    assert (r["steps"], r["window"], r["mean_running"]) == (1, "all", 1.0)


def test_growth_over_steps():
    # prompt 10, output 8, block 4: lengths 11..18 hold 12,12,16,16,16,16,20,20 slots
    r = simulate("paged", 4, [[10, 8]], budget_tokens=64, max_len=100)
    assert r["steps"] == 8
    assert r["mean_used_slots"] == sum(range(11, 19)) / 8           # 14.5
    assert r["mean_reserved_slots"] == (12 * 2 + 16 * 4 + 20 * 2) / 8  # 16.0
    # slots later filled by the same request: 12-11, 0, 16-13, 16-14, 16-15, 0, 18-17, 0
    assert r["future_frac"] * 64 * 8 == pytest.approx(1 + 3 + 2 + 1 + 1)


@pytest.mark.parametrize("allocator, block_size, budget", [
    ("contiguous-max", None, 300),      # 3 * max_len
    ("contiguous-oracle", None, 99),    # 3 * 33
    ("paged", 16, 144 + 15),            # 3 * 3 blocks of 16; the 15 left over make no block
])
def test_budget_for_k_requests_runs_k(allocator, block_size, budget):
    r = simulate(allocator, block_size, ONE * 10, budget_tokens=budget, max_len=100)
    assert r["window"] == "saturated"
    assert r["mean_running"] == 3.0
    assert r["steps"] == 4              # 10 requests of one step, 3 at a time
    assert r["peak_reserved_slots"] <= budget


def test_preemption_lifo_and_recompute():
    # 2 blocks of 4 slots. Step 1: both admitted at 3 + 1 = 4 tokens, 1 block each.
    # Step 2: request 0 needs a second block -> the later one (1) is preempted.
    # Step 3: request 0 reaches 6 = 3 + 3 and finishes. Step 4: request 1 comes back
    # with 3 + 1 + 1 = 5 tokens (2 blocks). Step 5: it reaches 6 and finishes.
    r = simulate("paged", 4, [[3, 3], [3, 3]], budget_tokens=8, max_len=8)
    assert (r["steps"], r["preemptions"]) == (5, 1)
    assert r["tokens_per_step"] == 6 / 5


def test_fcfs_head_blocks_the_queue():
    # the second request (90 tokens) does not fit next to the first; the small
    # third one waits behind it although it would fit
    r = simulate("contiguous-oracle", None, [[40, 10], [80, 10], [5, 5]], budget_tokens=100,
                 max_len=100)
    assert r["steps"] == 10 + 10
    assert r["window"] == "saturated" and r["mean_running"] == 1.0


def test_make_requests_deterministic_and_bounded():
    a, b, c = make_requests(500, seed=3), make_requests(500, seed=3), make_requests(500, seed=4)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert a.min() >= 1 and (a.sum(axis=1) <= 2048).all()
    short = make_requests(200, seed=0, max_len=64)
    assert (short.sum(axis=1) <= 64).all()
    r1 = simulate("paged", 16, a, 16384)
    assert r1 == simulate("paged", 16, b, 16384)


def test_paging_beats_contiguous_on_chat_traces():
    rows = {(r["allocator"], r["block_size"]): r
            for r in compare(make_requests(300, seed=0), budget_tokens=16384)}
    assert rows[("contiguous-max", None)]["useful_frac"] < 0.4
    assert rows[("paged", 16)]["useful_frac"] > 0.96
    assert rows[("paged", 16)]["batch_ratio"] > 2
    assert rows[("paged", 1)]["useful_frac"] == 1.0


@pytest.mark.parametrize("kwargs, match", [
    (dict(allocator="buddy", block_size=None), "allocator"),
    (dict(allocator="paged", block_size=None), "block_size"),
    (dict(allocator="paged", block_size=0), "block_size"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        simulate(requests=ONE, budget_tokens=100, max_len=100, **kwargs)


def test_requests_that_never_fit():
    with pytest.raises(ValueError, match="max_len"):
        simulate("paged", 16, [[90, 20]], budget_tokens=1000, max_len=100)
    with pytest.raises(ValueError, match="budget_tokens"):
        simulate("contiguous-max", None, ONE, budget_tokens=99, max_len=100)
    with pytest.raises(ValueError, match="budget_tokens"):
        simulate("paged", 16, ONE, budget_tokens=47, max_len=100)   # 33 tokens need 48


@st.composite
def workloads(draw):
    reqs = draw(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 20)), min_size=1,
                         max_size=12))
    block_size = draw(st.sampled_from([1, 2, 3, 8, 16]))
    longest = max(p + o for p, o in reqs)
    budget = draw(st.integers(-(-longest // block_size) * block_size, 4 * longest + 64))
    return reqs, block_size, budget, longest


@given(workloads(), st.sampled_from(["contiguous-max", "contiguous-oracle", "paged"]))
def test_properties(workload, allocator):
    reqs, block_size, budget, longest = workload
    max_len = longest if allocator != "contiguous-max" else min(budget, longest + 5)
    r = simulate(allocator, block_size, reqs, budget, max_len)
    assert r["peak_reserved_slots"] <= budget
    assert r["used_frac"] + r["internal_frac"] + r["unreserved_frac"] == pytest.approx(1)
    assert 0 <= r["future_frac"] <= r["internal_frac"] + 1e-12
    assert 0 < r["useful_frac"] <= 1
    assert r["tokens_per_step"] * r["steps"] == pytest.approx(sum(o for _, o in reqs))
    if allocator == "paged" and block_size == 1:
        assert r["useful_frac"] == 1.0 and r["internal_frac"] == 0
