"""cascade_decode and CascadeDecodePlan against the float64 reference over whole contexts."""
import numpy as np
import pytest
from hypothesis import given, settings
from numba import cuda
from hypothesis import strategies as st

import paged_numba as pn
from paged_numba.kernels import prefill_tc
from paged_numba.testing import DecodeProblem, cascade_reference, check_attention, lengths

SIM = pn.simulator_enabled()
LAYOUTS = ("nhd", "vllm", "hnd", "interleaved")
# The simulator runs every CUDA thread as a Python thread: few, small examples
# there (each is a prefill launch, a decode launch and a merge).
if SIM:
    SHAPES = dict(head_sizes=(8, 16, 32), block_sizes=(1, 4, 8), max_shared=24, max_suffix=12,
                  max_seqs=3)
    EXAMPLES = 3
else:
    SHAPES = dict(head_sizes=(64, 128, 256), block_sizes=(1, 16, 32), max_shared=3000,
                  max_suffix=600, max_seqs=24)
    EXAMPLES = None     # the profile's count


@st.composite
def cascade_problems(draw, head_sizes, block_sizes, max_shared, max_suffix, max_seqs):
    """``(suffix problem, shared_block_table, shared_len, logits_soft_cap,
    prefix_parts)``: a shared prefix (maybe empty) and suffixes (some maybe
    empty) on disjoint blocks of one pool, in random order, with -1 padding
    after each table; the prefix pass split in parts where tensor cores run it."""
    bs = draw(st.sampled_from(block_sizes))
    num_kv_heads = draw(st.integers(1, 2))
    group = draw(st.sampled_from((1, 2, 4)))
    num_seqs = draw(st.integers(1, max_seqs))
    shared_len = draw(st.one_of(st.just(0), lengths(bs, max_shared)))
    seq_lens = np.array(draw(st.lists(st.one_of(st.just(0), lengths(bs, max_suffix)),
                                      min_size=num_seqs, max_size=num_seqs)), np.int32)
    used_shared = -(-shared_len // bs)
    used = -(-seq_lens // bs)
    num_blocks = max(used_shared + int(used.sum()) + draw(st.integers(0, 2)), 1)
    perm = np.array(draw(st.permutations(range(num_blocks))), np.int32)
    shared = np.full(used_shared + draw(st.integers(0, 2)), -1, np.int32)
    shared[:used_shared] = perm[:used_shared]
    table = np.full((num_seqs, max(int(used.max()), 1) + draw(st.integers(0, 1))), -1, np.int32)
    start = used_shared
    for i, u in enumerate(used.tolist()):
        table[i, :u] = perm[start:start + u]
        start += u
    suffix = DecodeProblem(
        num_seqs=num_seqs, num_heads=num_kv_heads * group, num_kv_heads=num_kv_heads,
        head_size=draw(st.sampled_from(head_sizes)), block_size=bs, num_blocks=num_blocks,
        layout=draw(st.sampled_from(LAYOUTS)),
        dtype=draw(st.sampled_from(("float16", "float32", "bfloat16"))),
        seq_lens=seq_lens, block_tables=table, seed=draw(st.integers(0, 2**32 - 1)))
    parts = None
    if prefill_tc.supports(suffix.head_size, suffix.dtype, suffix.layout):
        parts = draw(st.sampled_from([None, 2, 3]))
    return suffix, shared, shared_len, draw(st.sampled_from([None, 4.0])), parts


def check_cascade(p, shared, shared_len, cap=None, prefix_parts=None):
    q, k, v = p.arrays()
    cache = pn.PagedKVCache.from_host(*p.layout_pools(k, v), layout=p.layout)
    out, lse = pn.cascade_decode(q, cache, shared, shared_len, p.block_tables, p.seq_lens,
                                 logits_soft_cap=cap, prefix_parts=prefix_parts, return_lse=True)
    return check_attention(q, out, lse, *cascade_reference(p, q, k, v, shared, shared_len,
                                                           logits_soft_cap=cap))


@settings(max_examples=EXAMPLES or settings().max_examples)
@given(case=cascade_problems(**SHAPES))
def test_cascade_matches_reference(case):
    check_cascade(*case)


def _problem(seq_lens, table, num_blocks, head_size=16, dtype="float16", layout="nhd",
             num_heads=2, num_kv_heads=1, block_size=4):
    return DecodeProblem(num_seqs=len(seq_lens), num_heads=num_heads, num_kv_heads=num_kv_heads,
                         head_size=head_size, block_size=block_size, num_blocks=num_blocks,
                         layout=layout, dtype=dtype, seq_lens=np.array(seq_lens, np.int32),
                         block_tables=np.array(table, np.int32), seed=0)


def test_empty_suffixes_attend_the_prefix_alone():
    # 3 sequences, no suffix tokens: each query attends the 10 prefix tokens
    # (10 = 2 * 4 + 2, blocks 4, 0, 2), and all three rows get the same keys;
    # the prefix's keys in 2 parts (tensor cores, fp16, head size 16)
    p = _problem([0, 0, 0], [[-1], [-1], [-1]], 5)
    check_cascade(p, np.array([4, 0, 2], np.int32), 10, prefix_parts=2)


def test_more_sequences_than_prefix_tokens_and_mixed_suffixes():
    # 5 query rows over a 2-token prefix: the prefill pass takes them in chunks of
    # 2, 2 and 1 (q_len <= seq_len); suffixes of 0, 1, 4, 5 and 9 tokens
    p = _problem([0, 1, 4, 5, 9], [[-1, -1, -1], [1, -1, -1], [2, -1, -1], [3, 4, -1],
                                   [5, 6, 7]], 8, dtype="float32", layout="hnd")
    cache = pn.PagedKVCache(8, 4, 1, 16, dtype="float32")
    assert pn.CascadeDecodePlan(cache, [0], 2, 5, 2, 3).prefix_chunks == 3
    check_cascade(p, np.array([0], np.int32), 2)


def test_no_prefix_is_plain_decode():
    p = _problem([3, 6], [[1, -1], [0, 2]], 3)
    q, k, v = p.arrays()
    cache = pn.PagedKVCache.from_host(k, v)
    got = pn.cascade_decode(q, cache, np.zeros(0, np.int32), 0, p.block_tables, p.seq_lens)
    assert np.array_equal(got, pn.paged_decode(q, cache, p.block_tables, p.seq_lens))


def test_plan_runs_step_after_step():
    """One plan over a fixed 7-token prefix, run for two decode steps: the
    suffixes grow by one token in the same device buffers."""
    from numba import cuda

    p = _problem([2, 4], [[3, -1], [4, 5]], 6, head_size=16)
    q, k, v = p.arrays()
    cache = pn.PagedKVCache.from_host(k, v)
    shared = np.array([1, 0], np.int32)                       # 7 = 4 + 3 tokens
    plan = pn.CascadeDecodePlan(cache, shared, 7, num_seqs=2, num_heads=2, max_blocks=2)
    dq, dt, dl = cuda.to_device(q), cuda.to_device(p.block_tables), cuda.to_device(p.seq_lens)
    for step in range(2):
        lens = p.seq_lens + step
        dl.copy_to_device(lens)
        out = plan.run(dq, dt, dl).copy_to_host()
        grown = DecodeProblem(**{**p.__dict__, "seq_lens": lens})
        check_attention(q, out, plan.lse.copy_to_host(),
                        *cascade_reference(grown, q, k, v, shared, 7))


# -- bad inputs: a ValueError naming the argument, before any launch ---------------------

@pytest.fixture
def no_launch(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a kernel was launched")
    monkeypatch.setattr(pn._launch.PackedLaunch, "__call__", refuse)


CACHE = dict(num_blocks=6, block_size=4, num_kv_heads=1, head_size=8)
GOOD = dict(shared_block_table=np.array([0, 1], np.int32), shared_len=6,
            block_tables=np.array([[2], [3]], np.int32), seq_lens=np.array([3, 1], np.int32))


@pytest.mark.parametrize("change, message", [
    (dict(shared_len=-1), r"shared_len must be a non-negative integer, but got -1\."),
    (dict(shared_len=6.0), r"shared_len must be a non-negative integer, but got 6\.0\."),
    (dict(shared_len=9), r"shared_len = 9 needs 3 blocks of 4 tokens, but shared_block_table "
                         r"has only 2 entries\."),
    (dict(shared_block_table=np.array([[0, 1]], np.int32)),
     r"shared_block_table must be \[max_shared_blocks\], but got shape \(1, 2\)\."),
    (dict(shared_block_table=np.array([0.0, 1.0])),
     r"shared_block_table must hold integers, but got dtype float64\."),
    (dict(shared_block_table=np.array([0, 6], np.int32)),
     r"shared_block_table\[1\] is 6, but shared_len = 6 uses its first 2 entries, which must "
     r"be block ids in \[0, 6\)\."),
    (dict(block_tables=np.array([[2]], np.int32)),
     r"block_tables must have num_seqs = 2 rows, but got shape \(1, 1\)\."),
    (dict(seq_lens=np.array([3, -1], np.int32)),
     r"seq_lens\[1\] is -1; sequence lengths must be >= 0\."),
    (dict(seq_lens=np.array([5, 1], np.int32)),
     r"seq_lens\[0\] = 5 needs 2 blocks of 4 tokens, but the block table has only 1 columns\."),
    (dict(block_tables=np.array([[2], [-1]], np.int32)),
     r"block_tables\[1, 0\] is -1, but sequence 1 \(seq_len 1\) uses its first 1 entries"),
    (dict(seq_lens=np.array([3, 1, 1], np.int32)),
     r"seq_lens must be \[num_seqs\] = \[2\], but got shape \(3,\)\."),
], ids=["negative-shared-len", "float-shared-len", "shared-table-too-short", "shared-table-2d",
        "shared-table-float", "shared-block-out-of-range", "tables-rows", "negative-seq-len",
        "suffix-too-long", "suffix-table-hole", "seq-lens-shape"])
def test_bad_inputs_name_the_argument(no_launch, change, message):
    cache = pn.PagedKVCache(**CACHE)
    q = np.zeros((2, 2, 8), np.float16)
    with pytest.raises(ValueError, match=message):
        pn.cascade_decode(q, cache, **{**GOOD, **change})


def test_bad_query_and_scale(no_launch):
    cache = pn.PagedKVCache(**CACHE)
    args = GOOD.values()
    with pytest.raises(ValueError, match="query must have the same dtype as the cache, but got "
                                         "float32 and float16"):
        pn.cascade_decode(np.zeros((2, 2, 8), np.float32), cache, *args)
    with pytest.raises(ValueError, match=r"query head_size must equal the cache's, but got 16 "
                                         r"and 8\."):
        pn.cascade_decode(np.zeros((2, 2, 16), np.float16), cache, *args)
    with pytest.raises(ValueError, match=r"scale must be finite, but got inf\."):
        pn.cascade_decode(np.zeros((2, 2, 8), np.float16), cache, *args, scale=float("inf"))
    with pytest.raises(ValueError, match=r"num_seqs must be >= 0, but got -2\."):
        pn.CascadeDecodePlan(cache, [0, 1], 6, num_seqs=-2, num_heads=2, max_blocks=1)
    with pytest.raises(ValueError, match=r"num_heads must be at most 65535, but got 2147483648\."):
        pn.CascadeDecodePlan(cache, [0, 1], 6, num_seqs=2, num_heads=2**31, max_blocks=1)
    plan = pn.CascadeDecodePlan(cache, [0, 1], 6, num_seqs=2, num_heads=2, max_blocks=1)
    with pytest.raises(TypeError, match="CascadeDecodePlan.run needs device arrays, but query "
                                        "is ndarray"):   # (its own name, not DecodePlan's)
        plan.run(np.zeros((2, 2, 8), np.float16), cuda.to_device(GOOD["block_tables"]),
                 cuda.to_device(GOOD["seq_lens"]))
    q = np.zeros((2, 2, 8), np.float16)
    for kw, message in [
            (dict(scale=10**400), r"scale must be at most 2\.359e\+38 in magnitude"),
            (dict(scale="a"), r"scale must be a real number, but got 'a' \(str\)"),
            (dict(scale=np.array([0.5])), r"scale must be a real number, but got array"),
            (dict(return_lse=None), r"return_lse must be True or False, but got None"),
            (dict(validate="no"), r"validate must be True or False, but got 'no'"),
            (dict(prefix_parts=2000), r"prefix_parts must be at most 1024, but got 2000")]:
        with pytest.raises(ValueError, match=message):
            pn.cascade_decode(q, cache, *args, **kw)
    with pytest.raises(ValueError, match=r"prefix_parts \(split-K of the prefix pass\) needs the "
                                         r"tensor-core prefill kernel, but this cache \(float32, "
                                         r"head_size 8\) runs on CUDA cores; got prefix_parts=2\."):
        pn.cascade_decode(np.zeros((2, 2, 8), np.float32),
                          pn.PagedKVCache(**CACHE, dtype="float32"), *args, prefix_parts=2)
