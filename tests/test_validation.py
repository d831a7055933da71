"""Bad input raises a clear error naming the value, before any launch, and
changes nothing in the cache or the allocator."""
import numpy as np
import pytest

import paged_numba as pn


@pytest.fixture
def setup():
    rng = np.random.default_rng(1)
    k = rng.standard_normal((4, 8, 2, 16)).astype(np.float16)
    cache = pn.PagedKVCache.from_host(k, -k, "nhd")
    q = rng.standard_normal((2, 4, 16)).astype(np.float16)
    table = np.array([[1, 3, -1], [0, -1, -1]], np.int32)
    lens = np.array([12, 5], np.int32)
    return cache, q, table, lens


def _unchanged(cache, snapshot):
    k, v = cache.to_host()
    return np.array_equal(k, snapshot[0]) and np.array_equal(v, snapshot[1])


@pytest.mark.parametrize("change, message", [
    (lambda q, t, l: (q, np.array([[1, 7, -1], [0, -1, -1]], np.int32), l), r"block_tables\[0, 1\] is 7"),
    (lambda q, t, l: (q, np.array([[1, -1, -1], [0, -1, -1]], np.int32), l), r"block_tables\[0, 1\] is -1"),
    (lambda q, t, l: (q, t, np.array([25, 5], np.int32)), r"seq_lens\[0\] = 25 needs 4 blocks"),
    (lambda q, t, l: (q, t, np.array([12, -2], np.int32)), r"seq_lens\[1\] is -2"),
    (lambda q, t, l: (q[:, :3], t, l), "multiple of num_kv_heads, but got 3 and 2"),
    (lambda q, t, l: (q.astype(np.float32), t, l), "dtype as the cache, but got float32 and float16"),
    (lambda q, t, l: (q[..., :8], t, l), "head_size must equal the cache's, but got 8 and 16"),
    (lambda q, t, l: (q[0], t, l), r"query must be \[num_seqs, num_heads, head_size\]"),
    (lambda q, t, l: (q, t[:1], l), "num_seqs = 2 rows"),
    (lambda q, t, l: (q, t, l[:1]), r"seq_lens must be \[num_seqs\] = \[2\]"),
    (lambda q, t, l: (q, t.astype(np.float32), l), "block_tables must hold integers, but got dtype float32"),
])
def test_decode_rejects(setup, change, message):
    cache, q, table, lens = setup
    snapshot = cache.to_host()
    q2, t2, l2 = change(q, table, lens)
    with pytest.raises(ValueError, match=message):
        pn.paged_decode(q2, cache, t2, l2)
    assert _unchanged(cache, snapshot)


def test_decode_rejects_unsupported_head_size():
    cache = pn.PagedKVCache(2, 8, 1, 12)
    q = np.zeros((1, 1, 12), np.float16)
    with pytest.raises(ValueError, match="head_size must be a multiple of 8 in \\[8, 256\\], but got 12"):
        pn.paged_decode(q, cache, np.zeros((1, 1), np.int32), np.ones(1, np.int32))


def test_decode_rejects_bad_scale_and_partitions(setup):
    cache, q, table, lens = setup
    with pytest.raises(ValueError, match="scale must be finite, but got nan"):
        pn.paged_decode(q, cache, table, lens, scale=float("nan"))
    with pytest.raises(ValueError, match="num_partitions must be a positive integer, but got 0"):
        pn.paged_decode(q, cache, table, lens, num_partitions=0)


@pytest.mark.parametrize("slots, message", [
    ([0, 64, 1], r"slot_mapping\[1\] is 64, outside \[0, 32\)"),   # 32 = 4 blocks * 8 tokens
    ([0, -2, 1], r"slot_mapping\[1\] is -2"),
    ([3, 5, 3], "slot 3 appears more than once"),
    ([0, 1], r"slot_mapping must be \[num_tokens\] = \[3\]"),
])
def test_write_kv_rejects_and_leaves_cache_alone(setup, slots, message):
    cache, *_ = setup
    snapshot = cache.to_host()
    key = np.ones((3, 2, 16), np.float16)
    with pytest.raises(ValueError, match=message):
        pn.write_kv(cache, key, key, np.array(slots))
    assert _unchanged(cache, snapshot)


def test_write_kv_rejects_shape_and_dtype(setup):
    cache, *_ = setup
    key = np.ones((3, 2, 16), np.float16)
    with pytest.raises(ValueError, match=r"key must be \[num_tokens, 2, 16\] for this cache, but got \(3, 2, 8\)"):
        pn.write_kv(cache, key[..., :8], key, np.arange(3))
    with pytest.raises(ValueError, match="value must have the same dtype as the cache, but got float32"):
        pn.write_kv(cache, key, key.astype(np.float32), np.arange(3))
    with pytest.raises(ValueError, match="key must have the same dtype as the cache, but got bfloat16 and float16"):
        pn.write_kv(cache, key.astype("bfloat16"), key, np.arange(3))


def test_cache_rejects_bad_geometry():
    with pytest.raises(ValueError, match="num_blocks must be a positive integer, but got 0"):
        pn.PagedKVCache(0, 16, 1, 64)
    with pytest.raises(ValueError, match="dtype must be one of"):
        pn.PagedKVCache(1, 16, 1, 64, dtype="int8")
    with pytest.raises(ValueError, match="layout must be one of .* but got 'nchw'"):
        pn.PagedKVCache(1, 16, 1, 64, layout="nchw")
    with pytest.raises(ValueError, match="multiple of x = 8 for float16, but got head_size=12"):
        pn.PagedKVCache(1, 16, 1, 12, layout="vllm")


def test_allocator_out_of_blocks_changes_nothing():
    alloc = pn.BlockAllocator(num_blocks=3, block_size=4)
    alloc.allocate("a", 9)                      # 9 tokens = 3 blocks of 4
    before = (list(alloc.free_block_ids), alloc.block_table().copy(), alloc.seq_lens().copy())
    with pytest.raises(pn.OutOfBlocksError):
        alloc.append("a", 4)                    # 13 tokens would need a 4th block
    with pytest.raises(pn.OutOfBlocksError):
        alloc.allocate("b", 1)
    after = (list(alloc.free_block_ids), alloc.block_table(), alloc.seq_lens())
    assert before[0] == after[0]
    assert np.array_equal(before[1], after[1]) and np.array_equal(before[2], after[2])


def test_every_public_name_runs_in_a_doctest():
    """The quick tier (``-m quick``) relies on the doctests to run every public
    function on the simulator: each name of ``paged_numba.__all__`` appears in
    an example line (``>>>``) of the package or the README."""
    import pathlib
    import re

    root = pathlib.Path(pn.__file__).parent
    texts = [p.read_text() for p in root.rglob("*.py")]
    texts.append((root.parent / "README.md").read_text())
    lines = "\n".join(l for t in texts for l in t.splitlines() if l.lstrip().startswith(">>>"))
    missing = [n for n in pn.__all__ if not re.search(rf"\b{n}\b", lines)]
    assert not missing, f"public names with no doctest: {missing}"
