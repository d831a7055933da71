"""NaN and Inf in the data: every CUDA-core kernel and the split-K merge give
what the float64 reference gives; the tensor-core kernels too for non-finite
queries and keys (see the note above their tests).

The rule is in ``paged_numba.reference``'s docstring: a NaN in a row's query
or in a key it attends makes the row (output and log-sum-exp) NaN, ``+inf``
logits too, and a non-finite value reaches the output elements of the rows
that attend its token, and no other. Here the NaN, +inf and -inf entries of
each kernel's output and log-sum-exp are exactly the reference's, with and
without split-K, and the finite ones are within the bounds of the same
problem without the non-finite data (so they are what the clean data gives).
The data (fp32 caches, head size 16) picks the CUDA-core kernels.
"""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import paged_numba as pn
from paged_numba._launch import launch_count
from paged_numba.reference import paged_decode_reference, paged_prefill_reference
from paged_numba.testing import (DecodeProblem, PrefillProblem, check_close, decode_problems,
                                 decode_reference, prefill_problems, prefill_reference)

F32 = np.float32
I32 = np.int32
# the simulator computes in NumPy scalars, which warn about inf - inf
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def check_non_finite(out, ref, bound, what):
    """``out``'s NaN, +inf and -inf entries are exactly ``ref``'s (float64, from
    the data with the non-finite entries), and its other entries are within
    ``bound`` (from the same problem without them) plus the output's rounding.
    ``out``, ``ref`` and ``bound`` have one shape (an output's or an lse's)."""
    out = np.asarray(out)
    for test in (np.isnan, np.isposinf, np.isneginf):
        diff = np.argwhere(test(out) != test(ref))
        where = tuple(int(i) for i in diff[0]) if diff.size else None
        assert not diff.size, (f"{what}: {test.__name__} differs first at {where}: "
                               f"{out[where]} vs {ref[where]}")
    finite = np.isfinite(ref)
    check_close(out[finite], ref[finite], bound[finite], what)


def _slot(p, seq, token):
    """(block, offset) of token ``token`` of sequence ``seq`` in problem ``p``'s pools."""
    return int(p.block_tables[seq, token // p.block_size]), token % p.block_size


TABLES = np.random.default_rng(5).permutation(36).astype(I32)
# 6 sequences of 44 tokens (6 blocks of 8, 44 = 5 * 8 + 4), 2 query heads on 1 KV head:
# sequence 0 stays clean, each other one gets its own non-finite data (_decode_data)
DECODE = DecodeProblem(num_seqs=6, num_heads=2, num_kv_heads=1, head_size=16, block_size=8,
                       num_blocks=36, layout="nhd", dtype="float32",
                       seq_lens=np.full(6, 44, I32), block_tables=TABLES.reshape(6, 6), seed=7)


def _decode_data(p, q, k, v):
    q, k, v = q.copy(), k.copy(), v.copy()
    q[1, 0, 3] = np.nan                        # row (1, head 0): NaN
    q[2, 1, 5] = np.inf                        # +-inf logits: row (2, head 1) NaN
    k[_slot(p, 3, 30) + (0, 2)] = np.nan       # token 30's key: both heads of sequence 3
    v[_slot(p, 4, 10) + (0, 1)] = np.nan       # element 1 of sequence 4 (outside window 20)
    v[_slot(p, 4, 40) + (0, 7)] = np.inf       # element 7 of sequence 4: +inf
    k[_slot(p, 5, 3) + (0, 0)] = np.nan        # sequence 5: early tokens, outside window 20
    v[_slot(p, 5, 4) + (0, 2)] = -np.inf
    return q, k, v


@pytest.mark.parametrize("num_partitions, window", [(1, None), (2, None), (2, 20)],
                         ids=["unsplit", "split", "split-window"])
def test_decode_non_finite_data_follows_the_reference(num_partitions, window):
    p = DECODE
    variants = {} if window is None else {"sliding_window": window}
    clean = p.arrays()
    _, _, bound, bound_lse = decode_reference(p, *clean, num_partitions=num_partitions, **variants)
    q, k, v = _decode_data(p, *clean)
    ref, ref_lse = paged_decode_reference(q, k, v, p.block_tables, p.seq_lens, **variants)
    assert np.isnan(ref).any() and np.isinf(ref).any() and np.isnan(ref_lse).any()
    cache = pn.PagedKVCache.from_host(k, v, "nhd")
    launches = launch_count()
    out, lse = pn.paged_decode(q, cache, p.block_tables, p.seq_lens, return_lse=True,
                               num_partitions=num_partitions, **variants)
    assert launch_count() - launches == (1 if num_partitions == 1 else 2)   # + the merge
    check_non_finite(out, ref, bound, "output")
    check_non_finite(lse, ref_lse, bound_lse, "lse")


def _scatter_non_finite(data, arrays):
    """Copies of ``arrays`` with one to four NaN, +inf or -inf values drawn into
    random places of random ones."""
    arrays = [x.copy() for x in arrays]
    for _ in range(data.draw(st.integers(1, 4))):
        arr = data.draw(st.sampled_from(arrays))
        where = tuple(data.draw(st.integers(0, n - 1)) for n in arr.shape)
        arr[where] = data.draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    return arrays


@settings(max_examples=4) if pn.simulator_enabled() else (lambda f: f)   # GPU: the profile's
@given(data=st.data())
def test_decode_non_finite_values_anywhere_follow_the_reference(data):
    """One to four NaN, +inf or -inf values at random places of the queries and
    of the key and value pools (read through the table or not) of a random
    problem, decoded in one to three parts: the output's and the log-sum-exp's
    non-finite entries are exactly the reference's, the others within the clean
    problem's bounds."""
    p = data.draw(decode_problems(head_sizes=(16,), block_sizes=(4, 8), layouts=("nhd",),
                                  dtypes=("float32",), groups=(1, 2), max_seq_len=40),
                  label="problem")
    parts = data.draw(st.integers(1, 3), label="num_partitions")
    clean = p.arrays()
    _, _, bound, bound_lse = decode_reference(p, *clean, num_partitions=parts)
    q, k, v = _scatter_non_finite(data, clean)
    ref, ref_lse = paged_decode_reference(q, k, v, p.block_tables, p.seq_lens)
    cache = pn.PagedKVCache.from_host(k, v, "nhd")
    out, lse = pn.paged_decode(q, cache, p.block_tables, p.seq_lens, return_lse=True,
                               num_partitions=parts)
    check_non_finite(out, ref, bound, "output")
    check_non_finite(lse, ref_lse, bound_lse, "lse")


# 5 sequences of 20 tokens (3 blocks of 8), the last 4 of them queries (positions
# 16..19); sequence 0's key 9 and the others' data as in _prefill_data
PREFILL = PrefillProblem(num_seqs=5, num_heads=2, num_kv_heads=1, head_size=16, block_size=8,
                         num_blocks=15, layout="nhd", dtype="float32", q_lens=np.full(5, 4, I32),
                         seq_lens=np.full(5, 20, I32),
                         block_tables=np.random.default_rng(6).permutation(15).astype(I32)
                         .reshape(5, 3), seed=8)


def _prefill_data(p, q, k, v):
    q, k, v = q.copy(), k.copy(), v.copy()
    k[_slot(p, 0, 9) + (0, 1)] = np.nan        # window 8: only the query at 16 attends key 9
    q[4 * 1 + 1, 0, 3] = np.nan                # sequence 1's query at 17, head 0
    v[_slot(p, 2, 19) + (0, 3)] = np.nan       # the last key: causal, only the query at 19
    v[_slot(p, 2, 18) + (0, 6)] = np.inf       # the queries at 18 and 19: +inf
    k[_slot(p, 3, 17) + (0, 2)] = np.nan       # the queries at 17, 18, 19
    v[_slot(p, 4, 11) + (0, 5)] = np.nan       # window 8: the queries at 16, 17, 18
    return q, k, v


@pytest.mark.parametrize("variants", [dict(), dict(sliding_window=8, block_q=2),
                                      dict(causal=False)], ids=["causal", "window", "full"])
def test_prefill_non_finite_data_follows_the_reference(variants):
    p, variants = PREFILL, dict(variants)
    tiling = {key: variants.pop(key) for key in ("block_q",) if key in variants}
    clean = p.arrays()
    _, _, bound, bound_lse = prefill_reference(p, *clean, **variants)
    q, k, v = _prefill_data(p, *clean)
    ref, ref_lse = paged_prefill_reference(q, k, v, p.block_tables, p.cu_seqlens_q,
                                           p.seq_lens, **variants)
    assert np.isnan(ref).any() and np.isnan(ref_lse).any()
    cache = pn.PagedKVCache.from_host(k, v, "nhd")
    launches = launch_count()
    out, lse = pn.paged_prefill(q, cache, p.block_tables, p.cu_seqlens_q, p.seq_lens,
                                return_lse=True, **variants, **tiling)
    assert launch_count() - launches == 1
    check_non_finite(out, ref, bound, "output")
    check_non_finite(lse, ref_lse, bound_lse, "lse")


@settings(max_examples=4) if pn.simulator_enabled() else (lambda f: f)   # GPU: the profile's
@given(data=st.data(), causal=st.booleans())
def test_prefill_non_finite_values_anywhere_follow_the_reference(data, causal):
    """The decode property above for a random prefill, causal or not (dropping
    NaN weights fails it)."""
    p = data.draw(prefill_problems(head_sizes=(16,), block_sizes=(4, 8), layouts=("nhd",),
                                   dtypes=("float32",), groups=(1, 2), max_q_len=12,
                                   max_cached=24), label="problem")
    clean = p.arrays()
    _, _, bound, bound_lse = prefill_reference(p, *clean, causal=causal)
    q, k, v = _scatter_non_finite(data, clean)
    ref, ref_lse = paged_prefill_reference(q, k, v, p.block_tables, p.cu_seqlens_q, p.seq_lens,
                                           causal=causal)
    cache = pn.PagedKVCache.from_host(k, v, "nhd")
    out, lse = pn.paged_prefill(q, cache, p.block_tables, p.cu_seqlens_q, p.seq_lens,
                                return_lse=True, causal=causal)
    check_non_finite(out, ref, bound, "output")
    check_non_finite(lse, ref_lse, bound_lse, "lse")


def merge64(v, s):
    """The float64 (m, l) merge of ``kernels.merge``'s spec: ``v [n, S, H, D]``,
    ``s [n, S, H]`` -> ``out [n, H, D]``, ``lse [n, H]`` (rows of empty states:
    zeros and -inf)."""
    v, s = v.astype(np.float64), s.astype(np.float64)
    m = s.max(axis=1, keepdims=True)
    empty = np.isneginf(m)
    w = np.exp(s - np.where(empty, 0, m))
    total = w.sum(axis=1, keepdims=True)
    out = np.einsum("nsh,nshd->nhd", w / np.where(empty, 1, total), v)
    with np.errstate(divide="ignore"):
        lse = np.where(empty, -np.inf, m + np.log(np.where(empty, 1, total)))[:, 0]
    return out, lse


def test_merge_states_propagates_non_finite_states_as_the_float64_merge():
    rng = np.random.default_rng(9)
    v = rng.standard_normal((7, 3, 1, 4)).astype(F32)
    s = rng.standard_normal((7, 3, 1)).astype(F32)
    s[3] = -np.inf                               # row 3: every state empty
    s[5, 1] = -np.inf                            # row 5: one empty state ...
    clean_out, clean_lse = pn.merge_states(v, s)
    v[5, 1, 0, 3] = np.nan                       # ... holding a NaN (0 * NaN is NaN)
    s[1, 1] = np.nan                             # row 1: a NaN state
    s[2, 0] = np.inf                             # row 2: one +inf state (exp(inf - inf))
    s[6, [0, 2]] = np.inf                        # row 6: two
    v[4, 2, 0, 1] = np.nan                       # row 4: element 1 of one state
    ref, ref_lse = merge64(v, s)
    out, lse = pn.merge_states(v, s)
    for got, want, clean in ((out, ref, clean_out), (lse, ref_lse, clean_lse)):
        for test in (np.isnan, np.isposinf, np.isneginf):
            assert np.array_equal(test(got), test(want))
        finite = np.isfinite(want)     # the rest is what the same rows gave without them
        assert np.array_equal(got[finite], clean[finite])
    assert np.isnan(out[[1, 2, 6]]).all() and np.isnan(lse[[1, 2, 6]]).all()


# The tensor-core kernels (fp16, head size 32) follow the rule for the query and
# the keys. Their P V products are mma over whole 8- or 16-key steps, so a
# non-finite *value* of a key that a row does not attend but that shares its
# step reaches that row (0 * NaN); their values stay finite here.
TC_DECODE = DecodeProblem(num_seqs=4, num_heads=2, num_kv_heads=1, head_size=32, block_size=8,
                          num_blocks=24, layout="nhd", dtype="float16",
                          seq_lens=np.full(4, 44, I32), block_tables=np.random.default_rng(5).permutation(24).astype(I32)
                          .reshape(4, 6),
                          seed=7)
TC_PREFILL = PrefillProblem(num_seqs=3, num_heads=2, num_kv_heads=1, head_size=32, block_size=8,
                            num_blocks=9, layout="nhd", dtype="float16",
                            q_lens=np.full(3, 4, I32), seq_lens=np.full(3, 20, I32),
                            block_tables=np.random.default_rng(6).permutation(9).astype(I32)
                            .reshape(3, 3), seed=8)


def _query_key_data(p, q, k, rows):
    """NaN in a query, +inf in another, NaN in a key of sequence 2's token 3;
    ``rows``: the query rows of sequences 0 and 1."""
    q, k = q.copy(), k.copy()
    q[rows[0], 0, 3] = np.nan
    q[rows[1], 1, 5] = np.inf
    k[_slot(p, 2, 3) + (0, 2)] = np.nan
    return q, k


@pytest.mark.parametrize("num_partitions", [1, 2], ids=["unsplit", "split"])
def test_tensor_core_decode_non_finite_queries_and_keys(num_partitions):
    p = TC_DECODE
    q, k, v = p.arrays()
    _, _, bound, bound_lse = decode_reference(p, q, k, v, num_partitions=num_partitions)
    q, k = _query_key_data(p, q, k, (0, 1))
    ref, ref_lse = paged_decode_reference(q, k, v, p.block_tables, p.seq_lens)
    assert np.isnan(ref_lse[[0, 1, 2]]).any(axis=1).all()
    out, lse = pn.paged_decode(q, pn.PagedKVCache.from_host(k, v, "nhd"), p.block_tables,
                               p.seq_lens, return_lse=True, num_partitions=num_partitions)
    check_non_finite(out, ref, bound, "output")
    check_non_finite(lse, ref_lse, bound_lse, "lse")


def test_tensor_core_prefill_non_finite_queries_and_keys():
    p = TC_PREFILL
    q, k, v = p.arrays()
    tiling = dict(tensor_cores=True, block_n=16, num_warps=1)
    _, _, bound, bound_lse = prefill_reference(p, q, k, v, tensor_cores="float16")
    q, k = _query_key_data(p, q, k, (1, 4 + 2))
    ref, ref_lse = paged_prefill_reference(q, k, v, p.block_tables, p.cu_seqlens_q, p.seq_lens)
    assert np.isnan(ref_lse[8:]).all()          # every query of sequence 2 attends key 3
    out, lse = pn.paged_prefill(q, pn.PagedKVCache.from_host(k, v, "nhd"), p.block_tables,
                                p.cu_seqlens_q, p.seq_lens, return_lse=True, **tiling)
    check_non_finite(out, ref, bound, "output")
    check_non_finite(lse, ref_lse, bound_lse, "lse")
