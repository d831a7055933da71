"""Bad inputs of the block bookkeeping (``BlockAllocator``, ``BlockManager``,
``block_keys``): each raises ``ValueError`` or ``TypeError`` naming the
argument and its value, and leaves the object exactly as it was."""
import copy

import numpy as np
import pytest

from paged_numba.allocator import BlockAllocator
from paged_numba.block_manager import BlockManager, block_keys
from paged_numba.prefix_cache import token_list


def manager():
    m = BlockManager(num_blocks=6, block_size=2, enable_prefix_caching=True, num_host_blocks=4)
    m.allocate("a", 3, token_ids=[1, 2, 3])      # [0, 1]
    m.allocate("s", 1, token_ids=[4])            # [2], then swapped out
    m.swap_out("s")
    return m


def check_unchanged(obj, call, error, match):
    before = copy.deepcopy(obj.__dict__)
    with pytest.raises(error, match=match):
        call()
    assert copy.deepcopy(obj.__dict__) == before


@pytest.mark.parametrize("bad", [[1], {"k": 1}, ([1], 2)], ids=["list", "dict", "tuple-of-list"])
@pytest.mark.parametrize("call, name", [
    (lambda m, b: m.allocate(b, 1), "seq_id"),
    (lambda m, b: m.can_append(b), "seq_id"),
    (lambda m, b: m.append(b, 1, [0]), "seq_id"),
    (lambda m, b: m.free(b), "seq_id"),
    (lambda m, b: m.swap_out(b), "seq_id"),
    (lambda m, b: m.swap_in(b), "seq_id"),
    (lambda m, b: m.seq_len(b), "seq_id"),
    (lambda m, b: m.slot_mapping(b, 0, 1), "seq_id"),
    (lambda m, b: m.block_table([b]), "seq_id"),
    (lambda m, b: m.fork(b, "n"), "parent"),
    (lambda m, b: m.fork("a", b), "child"),
])
def test_manager_unhashable_seq_id_is_named(call, name, bad):
    m = manager()
    check_unchanged(m, lambda: call(m, bad), ValueError, rf"^{name} must be hashable, but got ")
    assert bad not in m


@pytest.mark.parametrize("bad", [[1], ([1], 2)])
def test_allocator_unhashable_seq_id(bad):
    a = BlockAllocator(num_blocks=4, block_size=2)
    a.allocate("a", 3)
    check_unchanged(a, lambda: a.allocate(bad, 1), ValueError, "seq_id must be hashable")
    assert bad not in a                          # a tuple holding a list used to raise TypeError


@pytest.mark.parametrize("bad, match", [
    ([1.5, 2.0], r"token_ids\[0\] must be an integer, but got 1\.5 \(float\)"),
    ([1, 2.0], r"token_ids\[1\] must be an integer, but got 2\.0 \(float\)"),
    ([1, True], r"token_ids\[1\] must be an integer, but got True \(bool\)"),
    ([1, None], r"token_ids\[1\] must be an integer, but got None"),
    (np.array([1.0, 2.0]), "token_ids must hold integers, but got dtype float64"),
    (np.array([True, False]), "token_ids must hold integers, but got dtype bool"),
    (np.array([[1], [2]]), r"token_ids must be a 1-D array of integers, but got shape \(2, 1\)"),
    ("ab", "token_ids must be a list or 1-D array of integers, but got 'ab' \\(str\\)"),
    (7, r"token_ids must be a list or 1-D array of integers, but got 7 \(int\)"),
])
def test_token_ids_must_be_integers(bad, match):
    m = manager()
    check_unchanged(m, lambda: m.allocate("n", 2, token_ids=bad), TypeError, match)
    check_unchanged(m, lambda: m.can_allocate(2, token_ids=bad), TypeError, match)
    check_unchanged(m, lambda: m.append("a", 2, token_ids=bad), TypeError, match)
    with pytest.raises(TypeError, match=match):
        block_keys(bad, block_size=2)


def test_integer_token_ids_of_every_kind_are_taken():
    m = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    m.allocate("l", 3, token_ids=[1, 2, 3])
    m.allocate("r", 3, token_ids=range(1, 4))
    m.allocate("u", 3, token_ids=np.array([1, 2, 3], np.uint16))
    m.allocate("t", 3, token_ids=(np.int64(1), 2, np.int8(3)))
    # the three copies of [1, 2] reuse l's block 0: 3 hits of 4 lookups
    assert [m.blocks_of(s)[0] for s in "lrut"] == [0, 0, 0, 0] and m.hit_rate == 3 / 4
    assert m.token_ids("u") == [1, 2, 3] and all(type(t) is int for t in m.token_ids("u"))
    m.append("u", 1, token_ids=np.array([4]))
    assert token_list("token_ids", np.array([5, 6], np.int32)) == [5, 6]


@pytest.mark.parametrize("start, end, match", [
    (1.5, 3, r"start must be an integer, but got 1\.5 \(float\)"),
    (1.0, 3, r"start must be an integer, but got 1\.0 \(float\)"),
    (True, 3, r"start must be an integer, but got True \(bool\)"),
    (None, 3, r"start must be an integer, but got None \(NoneType\)"),
    (0, 2.0, r"end must be an integer, but got 2\.0 \(float\)"),
    (np.float32(0), 1, r"start must be an integer, but got np\.float32\(0\.0\)|start must be an integer, but got 0\.0"),
])
def test_slot_mapping_start_and_end_must_be_integers(start, end, match):
    m = manager()
    check_unchanged(m, lambda: m.slot_mapping("a", start, end), ValueError, match)
    a = BlockAllocator(num_blocks=4, block_size=2)
    a.allocate("a", 3)
    check_unchanged(a, lambda: a.slot_mapping("a", start, end), ValueError, match)


def test_slot_mapping_takes_numpy_integers():
    m = manager()
    assert m.slot_mapping("a", np.int64(1), np.int32(3)).tolist() == [1, 2]   # 1 = 0 * 2 + 1; 2 = 1 * 2 + 0


@pytest.mark.parametrize("call", [lambda m: m.block_table("a"), lambda m: m.seq_lens("a")])
def test_seq_ids_string_is_not_a_list_of_ids(call):
    m = manager()                                # "a" is an id: "a" as seq_ids used to read as ["a"]
    check_unchanged(m, lambda: call(m), ValueError, "seq_ids must be a list of sequence ids or None, but got 'a'")


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_blocks=0, block_size=2), "num_blocks must be a positive integer, but got 0"),
    (dict(num_blocks=4, block_size=2.0), r"block_size must be an integer, but got 2\.0 \(float\)"),
    (dict(num_blocks=4, block_size=2, num_host_blocks=-1), "num_host_blocks must be >= 0, but got -1"),
    (dict(num_blocks=4, block_size=2, enable_prefix_caching=1), "enable_prefix_caching must be True or False"),
    # block ids and lengths go into int32 tables (a deque of 2**62 ids would exhaust memory)
    (dict(num_blocks=2**62, block_size=2), f"num_blocks must be at most 2147483647, but got {2**62}"),
    (dict(num_blocks=4, block_size=2, num_host_blocks=2**62),
     "num_host_blocks must be at most 2147483647"),
    (dict(num_blocks=4, block_size=2**40), "block_size must be at most 2147483647"),
])
def test_manager_constructor(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BlockManager(**kwargs)


@pytest.mark.parametrize("args, error, match", [
    (([1, 2], 0), ValueError, "block_size must be a positive integer, but got 0"),
    (([1, 2], 2.0), ValueError, r"block_size must be an integer, but got 2\.0"),
    (([1, 2], 2, [3]), ValueError, r"extra_key must be hashable, but got \[3\]"),
    (([1, 2], 1, None, [1]), ValueError, r"parent must be an integer, but got \[1\] \(list\)"),
    (({1, 2}, 1), TypeError, r"token_ids must be a list or 1-D array of integers, but got \{1, 2\} "
                             r"\(set\)"),
    (({1: 2}, 1), TypeError, r"token_ids must be a list .* \(dict\)"),
])
def test_block_keys_arguments(args, error, match):
    with pytest.raises(error, match=match):
        block_keys(*args)


def test_lengths_past_int32_are_refused_before_anything_changes():
    m = BlockManager(num_blocks=2, block_size=2**31 - 1)
    check_unchanged(m, lambda: m.allocate("a", 2**31 + 5), ValueError,
                    "num_tokens must be at most 2147483647, but got 2147483653")
    m.allocate("a", 2**31 - 3)
    check_unchanged(m, lambda: m.append("a", 5), ValueError,
                    "num_new_tokens=5 would make sequence 'a' 2147483650 tokens long")
    a = BlockAllocator(num_blocks=2, block_size=2**31 - 1)
    a.allocate("a", 2**31 - 3)
    check_unchanged(a, lambda: a.append_slots("a", 5), ValueError,
                    "num_new_tokens=5 would make sequence 'a' 2147483650 tokens long")
    assert m.seq_len("a") == a.seq_len("a") == 2**31 - 3


@pytest.mark.parametrize("call, error, match", [
    (lambda p, k: p.register(-1, k), ValueError, "block must be >= 0, but got -1"),
    (lambda p, k: p.register(9, k), ValueError, "block must be at most 3, but got 9"),
    (lambda p, k: p.register(1, [1]), TypeError, r"key must be a block key .* \[1\] \(list\)"),
    (lambda p, k: p.release(9), ValueError, "block must be at most 3, but got 9"),
    (lambda p, k: p.release(1.0), ValueError, r"block must be an integer, but got 1\.0"),
    (lambda p, k: p.claim(0), ValueError, "block 0 is not evictable"),
    (lambda p, k: p.evict(), ValueError, "no evictable block"),
    (lambda p, k: p.lookup([k], 1.5), ValueError, r"max_blocks must be an integer, but got 1\.5"),
    (lambda p, k: p.lookup(k, 1), TypeError, "keys must be a list of block keys"),
    (lambda p, k: p.record(-5, 3), ValueError, "num_lookups must be >= 0, but got -5"),
    (lambda p, k: p.record(2, 3), ValueError, "num_hits must be at most 2, but got 3"),
], ids=["register-negative", "register-past", "register-key", "release-past", "release-float",
        "claim-held", "evict-empty", "lookup-float", "lookup-one-key", "record-negative",
        "record-more-hits"])
def test_prefix_cache_arguments(call, error, match):
    from paged_numba.prefix_cache import PrefixCache

    p = PrefixCache(4)
    key = block_keys([1, 2], 2)[0]
    p.register(0, key)                           # block 0 cached and held
    check_unchanged(p, lambda: call(p, key), error, match)
    for bad, match in [(2.5, r"num_blocks must be an integer, but got 2\.5"),
                       (-1, "num_blocks must be >= 0, but got -1")]:
        with pytest.raises(ValueError, match=match):
            PrefixCache(bad)
