"""Tests for paged_numba/block_manager.py (plain Python): hand-built cases with
their arithmetic, bad inputs (the error names the argument and value, and the
manager is unchanged), and a state machine against a model of the cache's
contents."""
import copy

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from paged_numba.block_manager import BlockManager, OutOfBlocksError, block_keys


def state(m):
    """Everything a manager holds, for 'nothing changed' checks."""
    return copy.deepcopy(m.__dict__)


def test_drop_in_tables_match_block_allocator():
    from paged_numba.allocator import BlockAllocator

    a, m = BlockAllocator(8, 4), BlockManager(8, 4)
    for s, n in (("x", 6), ("y", 9), ("z", 0)):     # 9 = 2 * 4 + 1
        assert a.allocate(s, n) == m.allocate(s, n)[0]
    a.append("x", 3), m.append("x", 3)
    np.testing.assert_array_equal(a.block_table(), m.block_table())
    np.testing.assert_array_equal(a.seq_lens(), m.seq_lens())
    np.testing.assert_array_equal(a.slot_mapping("y", 2, 9), m.slot_mapping("y", 2, 9))
    assert m.block_table().dtype == np.int32 and m.seq_lens().dtype == np.int32


def test_fork_and_copy_on_write():
    m = BlockManager(num_blocks=6, block_size=4)
    m.allocate("a", 6)                      # [0, 1]; block 1 holds 6 - 4 = 2 tokens
    m.fork("a", "b")
    m.fork("b", "c")
    assert [m.ref_count(b) for b in (0, 1)] == [3, 3] and m.num_shared_blocks == 2
    slots, copies = m.append_slots("c", 3)  # 9 tokens: shared block 1 copied to 2, then block 3
    assert copies == [(1, 2)] and m.blocks_of("c") == [0, 2, 3]
    np.testing.assert_array_equal(slots, [10, 11, 12])   # 10 = 2 * 4 + 2; 12 = 3 * 4 + 0
    assert m.ref_count(1) == 2 and m.ref_count(2) == 1
    assert m.append("c") == []              # block 3 is c's own
    assert m.append("b") == [(1, 4)]        # block 1 still shared by a and b
    assert m.append("a") == [] and m.blocks_of("a") == [0, 1]   # a alone now: in place
    m.free("a"), m.free("b")
    assert m.ref_count(0) == 1 and m.num_free_blocks == 6 - 3   # c holds 0, 2, 3
    m.free("c")
    assert m.num_free_blocks == 6 and m.num_owned_blocks == 0


def test_full_shared_block_is_never_copied():
    m = BlockManager(num_blocks=4, block_size=2)
    m.allocate("a", 4)                      # two full blocks
    m.fork("a", "b")
    assert m.append("b", 2) == [] and m.blocks_of("b") == [0, 1, 2]
    assert m.ref_count(0) == m.ref_count(1) == 2 and m.ref_count(2) == 1


def test_copy_on_write_counts_its_block_in_out_of_blocks():
    m = BlockManager(num_blocks=2, block_size=4)
    m.allocate("a", 5)                      # both blocks
    m.fork("a", "b")
    before = state(m)
    assert not m.can_append("b") and m.can_append("b", 0)
    with pytest.raises(OutOfBlocksError, match="'b' needs 1 new blocks but only 0"):
        m.append("b")
    assert state(m) == before


def test_prefix_cache_hit_evict_and_counters():
    m = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    blocks, cached = m.allocate("p", 5, token_ids=[1, 2, 3, 4, 5])   # keys of [1, 2], [3, 4]
    assert blocks == [0, 1, 2] and cached == 0
    blocks, cached = m.allocate("q", 4, token_ids=[1, 2, 3, 4])
    # the whole prompt is cached, but the last token is always computed: 1 block reused
    assert blocks == [0, 3] and cached == 2 and m.ref_count(0) == 2
    assert (m.num_lookup_blocks, m.num_hit_blocks) == (4, 1)
    m.free("p")                             # 2 -> free; 1 -> cached; 0 still held by q
    assert m.cached_block_ids == [1] and m.num_free_blocks == 1
    m.free("q")                             # 3 is not cached (key [3, 4] is block 1's); 0 cached
    assert m.cached_block_ids == [1, 0] and m.num_free_blocks == 2
    assert m.num_free_blocks + m.num_cached_blocks + m.num_owned_blocks == 4
    blocks, cached = m.allocate("r", 5, token_ids=[1, 2, 3, 4, 9])    # both cached blocks back
    assert blocks == [0, 1, 2] and cached == 4 and m.num_cached_blocks == 0
    m.free("r")                             # frees 2, then 1, then 0: LRU order 1, 0
    assert m.cached_block_ids == [1, 0]
    m.allocate("s", 8)                      # 4 blocks: 2 free + 2 evicted, LRU first
    assert m.blocks_of("s") == [3, 2, 1, 0] and m.num_evictions == 2
    assert m.hit_rate == pytest.approx(3 / 6)   # (0 + 1 + 2) hits of (2 + 2 + 2) lookups


def test_extra_key_separates_prompts():
    m = BlockManager(num_blocks=6, block_size=2, enable_prefix_caching=True)
    m.allocate("a", 3, token_ids=[7, 7, 7], extra_key="lora-1")
    assert m.allocate("b", 3, token_ids=[7, 7, 7], extra_key="lora-2")[1] == 0
    assert m.allocate("c", 3, token_ids=[7, 7, 7], extra_key="lora-1")[1] == 2
    assert block_keys([7, 7], 2, "x")[0] == (None, (7, 7), "x")


def test_append_fills_and_caches_blocks():
    m = BlockManager(num_blocks=6, block_size=2, enable_prefix_caching=True)
    m.allocate("a", 1, token_ids=[5])
    m.append("a", 3, token_ids=[6, 7, 8])   # fills blocks [5, 6] and [7, 8]
    assert m.token_ids("a") == [5, 6, 7, 8]
    blocks, cached = m.allocate("b", 5, token_ids=[5, 6, 7, 8, 0])
    assert cached == 4 and blocks[:2] == m.blocks_of("a")


def test_caching_off_ignores_token_ids():
    m = BlockManager(num_blocks=4, block_size=2)
    m.allocate("a", 3, token_ids=[1, 2, 3])
    assert m.allocate("b", 3, token_ids=[1, 2, 3]) == ([2, 3], 0)
    assert m.token_ids("a") is None and m.append("a") == []   # no token_ids needed


def test_swap_out_and_in():
    m = BlockManager(num_blocks=4, block_size=2, num_host_blocks=3)
    m.allocate("a", 3)                      # [0, 1]
    m.fork("a", "b")
    assert m.swap_out("b") == [(0, 0), (1, 1)]
    assert m.is_swapped("b") and m.swapped_seq_ids == ["b"] and m.seq_ids == ["a"]
    assert m.ref_count(0) == 1 and m.num_swapped_blocks == 2 and m.seq_len("b") == 3
    assert not m.can_swap_out("a")          # 2 blocks, 1 host block free
    with pytest.raises(OutOfBlocksError, match="2 host blocks but only 1"):
        m.swap_out("a")
    assert m.swap_in("b") == [(0, 2), (1, 3)]
    assert m.num_free_host_blocks == 3 and m.block_table().tolist() == [[0, 1], [2, 3]]
    m.swap_out("a")
    m.free("a")                             # a swapped-out sequence frees its host blocks
    assert m.num_free_host_blocks == 3 and "a" not in m


def test_swap_in_reuses_cached_blocks():
    m = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True, num_host_blocks=4)
    m.allocate("a", 5, token_ids=[1, 2, 3, 4, 5])
    assert m.swap_out("a") == [(0, 0), (1, 1), (2, 2)]
    assert m.cached_block_ids == [1, 0]     # full blocks stay on the device, evictable
    assert list(m.free_block_ids) == [3, 2]
    assert m.swap_in("a") == [(2, 3)]       # only the partly full block is copied back
    assert m.blocks_of("a") == [0, 1, 3] and m.num_cached_blocks == 0


def test_repr():
    m = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True, num_host_blocks=2)
    m.allocate("a", 9, token_ids=range(9))  # 3 blocks, 2 full ones cached
    m.fork("a", "b")
    m.allocate("c", 1)
    m.swap_out("c")
    assert repr(m) == ("BlockManager(num_blocks=8, block_size=4, free=5, cached=0, owned=3 (shared=3), "
                       "seqs=2, swapped=1/2 host blocks in 1 seqs, prefix_cache=2 blocks, hit_rate=0.0%)")
    m.free("a"), m.free("b")
    assert "free=6, cached=2, owned=0 (shared=0)" in repr(m)


# -- bad inputs: the error names the argument and its value; nothing changes ---------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(num_blocks=0, block_size=4), "num_blocks .* 0"),
    (dict(num_blocks=4, block_size=2.0), "block_size .* 2.0"),
    (dict(num_blocks=True, block_size=2), "num_blocks .* True"),
    (dict(num_blocks=4, block_size=2, num_host_blocks=-1), "num_host_blocks .* -1"),
    (dict(num_blocks=4, block_size=2, enable_prefix_caching="yes"), "enable_prefix_caching .* 'yes'"),
])
def test_constructor_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BlockManager(**kwargs)


def _manager():
    m = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True, num_host_blocks=1)
    m.allocate("a", 3, token_ids=[1, 2, 3])     # [0, 1]
    m.allocate("s", 1, token_ids=[4])
    m.swap_out("s")
    return m


@pytest.mark.parametrize("call, error, match", [
    (lambda m: m.allocate("a", 1), ValueError, "'a' is already allocated"),
    (lambda m: m.allocate("s", 1), ValueError, "'s' is already allocated"),
    (lambda m: m.allocate("n", -2), ValueError, "num_tokens must be >= 0, but got -2"),
    (lambda m: m.allocate("n", 2, token_ids=[1]), ValueError, "token_ids must have 2 entries .* got 1"),
    (lambda m: m.allocate("n", 1, token_ids=[1], extra_key=[3]), ValueError, r"extra_key .* \[3\]"),
    (lambda m: m.allocate("n", 5), OutOfBlocksError, "'n' needs 3 new blocks but only 2"),
    (lambda m: m.can_allocate(-1), ValueError, "num_tokens .* -1"),
    (lambda m: m.fork("zz", "n"), ValueError, "unknown sequence id 'zz'"),
    (lambda m: m.fork("s", "n"), ValueError, "'s' is swapped out"),
    (lambda m: m.fork("a", "s"), ValueError, "'s' is already allocated"),
    (lambda m: m.append("a", -1, token_ids=[]), ValueError, "num_new_tokens must be >= 0, but got -1"),
    (lambda m: m.append("a", 1), ValueError, "'a' takes part in prefix caching.*token_ids=None"),
    (lambda m: m.append("a", 2, token_ids=[1]), ValueError, "token_ids must have 2 entries .* got 1"),
    (lambda m: m.append("a", 9, token_ids=[0] * 9), OutOfBlocksError, "'a' needs 4 new blocks but only 2"),
    (lambda m: m.append("s", 1, token_ids=[1]), ValueError, "'s' is swapped out"),
    (lambda m: m.append_slots("zz"), ValueError, "unknown sequence id 'zz'"),
    (lambda m: m.can_append("a", -3), ValueError, "-3"),
    (lambda m: m.free("zz"), ValueError, "unknown sequence id 'zz'"),
    (lambda m: m.swap_out("zz"), ValueError, "unknown sequence id 'zz'"),
    (lambda m: m.swap_out("s"), ValueError, "'s' is swapped out"),
    (lambda m: m.swap_out("a"), OutOfBlocksError, "'a' needs 2 host blocks but only 0"),
    (lambda m: m.swap_in("a"), ValueError, "'a' is not swapped out"),
    (lambda m: m.swap_in("zz"), ValueError, "unknown sequence id 'zz'"),
    (lambda m: m.slot_mapping("a", 0, 4), ValueError, "end=4.*seq_len=3"),
    (lambda m: m.slot_mapping("a", 2, 1), ValueError, "start=2"),
    (lambda m: m.slot_mapping("s", 0, 1), ValueError, "'s' is swapped out"),
    (lambda m: m.block_table(["a", "zz"]), ValueError, "unknown sequence id 'zz'"),
    (lambda m: m.block_table(max_blocks=1), ValueError, "max_blocks=1"),
    (lambda m: m.seq_lens(["s"]), ValueError, "'s' is swapped out"),
    (lambda m: m.ref_count(4), ValueError, r"block must be an int in \[0, 4\), but got 4"),
    (lambda m: m.ref_count(-1), ValueError, "but got -1"),
    (lambda m: m.host_blocks_of("a"), ValueError, "'a' is not swapped out"),
    (lambda m: m.seq_len("zz"), ValueError, "'zz'"),
])
def test_bad_calls_raise_and_change_nothing(call, error, match):
    m = _manager()
    before = state(m)
    with pytest.raises(error, match=match):
        call(m)
    assert state(m) == before


def test_swap_in_out_of_blocks_changes_nothing():
    m = BlockManager(num_blocks=2, block_size=2, num_host_blocks=2)
    m.allocate("a", 3)
    m.swap_out("a")
    m.allocate("b", 1)
    before = state(m)
    assert not m.can_swap_in("a")
    with pytest.raises(OutOfBlocksError, match="'a' needs 2 new blocks but only 1"):
        m.swap_in("a")
    assert state(m) == before


# -- state machine ------------------------------------------------------------------------

PREFIXES = [(), (1, 2, 3, 4, 5, 6), (1, 2, 3, 4, 0, 0), (7, 7)]


class ManagerMachine(RuleBasedStateMachine):
    """Random fork / append / free / allocate (with prefixes) / evict / swap.

    The model holds each sequence's tokens and a simulated device and host
    memory (a token id per slot). The test plays the caller: it makes the
    copies the manager returns and writes each new token into its slot, and it
    checks that no block it writes is shared. After every step the tables must
    read back every sequence's tokens."""

    @initialize(num_blocks=st.integers(1, 10), block_size=st.sampled_from([1, 2, 3, 4]),
                caching=st.booleans(), num_host=st.integers(0, 8))
    def setup(self, num_blocks, block_size, caching, num_host):
        self.m = BlockManager(num_blocks, block_size, enable_prefix_caching=caching, num_host_blocks=num_host)
        self.bs = block_size
        self.model: dict[int, list[int]] = {}        # tokens of every sequence
        self.tracked: dict[int, bool] = {}           # allocated with token_ids
        self.dev = [[None] * block_size for _ in range(num_blocks)]
        self.host = [[None] * block_size for _ in range(num_host)]
        self.next_id = 0

    # -- the caller's side ---
    def _write(self, seq, positions):
        m, bs = self.m, self.bs
        for t in positions:
            slot = int(m.slot_mapping(seq, t, t + 1)[0])
            b = slot // bs
            assert m.ref_count(b) == 1, f"block {b} written while shared (count {m.ref_count(b)})"
            self.dev[b][slot % bs] = self.model[seq][t]

    def _new_id(self):
        self.next_id += 1
        return self.next_id

    def _resident(self):
        return sorted(self.m.seq_ids)

    def _expect_failure(self, call, error):
        before = state(self.m)
        with pytest.raises(error):
            call()
        assert state(self.m) == before

    # -- rules ---
    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 2), max_size=6),
          use_tokens=st.booleans())
    def allocate(self, prefix, suffix, use_tokens):
        seq, tokens = self._new_id(), list(prefix) + suffix
        ids = tokens if use_tokens else None
        if not self.m.can_allocate(len(tokens), ids):
            return self._expect_failure(lambda: self.m.allocate(seq, len(tokens), ids), OutOfBlocksError)
        free_before = self.m.num_free_blocks
        blocks, cached = self.m.allocate(seq, len(tokens), token_ids=ids)
        assert len(blocks) == -(-len(tokens) // self.bs) and cached % self.bs == 0
        assert cached == 0 or (self.m.enable_prefix_caching and use_tokens and cached < len(tokens))
        new = len(blocks) - cached // self.bs
        assert self.m.num_evictions >= 0 and (new <= free_before or self.m.num_evictions > 0)
        self.model[seq], self.tracked[seq] = tokens, use_tokens and self.m.enable_prefix_caching
        for t in range(cached):                      # reused blocks already hold the prompt
            slot = int(self.m.slot_mapping(seq, t, t + 1)[0])
            assert self.dev[slot // self.bs][slot % self.bs] == tokens[t]
        self._write(seq, range(cached, len(tokens)))

    @rule(num_tokens=st.integers(1, 12))
    def evict(self, num_tokens):
        """A large untracked allocation, which takes free blocks, then evicts cached ones."""
        m, seq = self.m, self._new_id()
        need = -(-num_tokens // self.bs)
        free, cached, evictions = m.num_free_blocks, m.num_cached_blocks, m.num_evictions
        if need > free + cached:
            return self._expect_failure(lambda: m.allocate(seq, num_tokens), OutOfBlocksError)
        m.allocate(seq, num_tokens)
        assert m.num_evictions - evictions == max(0, need - free)
        assert m.num_cached_blocks == cached - max(0, need - free)
        self.model[seq], self.tracked[seq] = [0] * num_tokens, False
        self._write(seq, range(num_tokens))

    @precondition(lambda self: self.m.seq_ids)
    @rule(data=st.data())
    def fork(self, data):
        parent, child = data.draw(st.sampled_from(self._resident())), self._new_id()
        self.m.fork(parent, child)
        self.model[child], self.tracked[child] = list(self.model[parent]), self.tracked[parent]

    @precondition(lambda self: self.m.seq_ids)
    @rule(data=st.data(), new=st.lists(st.integers(0, 2), max_size=5))
    def append(self, data, new):
        seq = data.draw(st.sampled_from(self._resident()))
        ids = new if self.tracked[seq] else None
        if not self.m.can_append(seq, len(new)):
            return self._expect_failure(lambda: self.m.append(seq, len(new), ids), OutOfBlocksError)
        start = len(self.model[seq])
        slots, copies = self.m.append_slots(seq, len(new), token_ids=ids)
        assert len(copies) <= 1 and len(slots) == len(new)
        for src, dst in copies:                      # copy before writing
            assert start % self.bs and self.m.ref_count(dst) == 1 and self.m.ref_count(src) >= 1
            self.dev[dst] = list(self.dev[src])
        self.model[seq] += new
        self._write(seq, range(start, start + len(new)))

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.model)))
        self.m.free(seq)
        del self.model[seq], self.tracked[seq]

    @precondition(lambda self: self.m.seq_ids)
    @rule(data=st.data())
    def swap_out(self, data):
        seq = data.draw(st.sampled_from(self._resident()))
        if not self.m.can_swap_out(seq):
            return self._expect_failure(lambda: self.m.swap_out(seq), OutOfBlocksError)
        free_host = set(self.m.free_host_block_ids)
        pairs = self.m.swap_out(seq)
        assert {h for _, h in pairs} <= free_host
        for d, h in pairs:
            self.host[h] = list(self.dev[d])

    @precondition(lambda self: self.m.swapped_seq_ids)
    @rule(data=st.data())
    def swap_in(self, data):
        seq = data.draw(st.sampled_from(sorted(self.m.swapped_seq_ids)))
        if not self.m.can_swap_in(seq):
            return self._expect_failure(lambda: self.m.swap_in(seq), OutOfBlocksError)
        host_blocks = self.m.host_blocks_of(seq)
        pairs = self.m.swap_in(seq)
        for h, d in pairs:
            assert h in host_blocks and self.m.ref_count(d) == 1
            self.dev[d] = list(self.host[h])

    # -- invariants ---
    @invariant()
    def counts_equal_tables_holding_a_block(self):
        m = self.m
        holders = [0] * m.num_blocks
        for s in m.seq_ids:
            blocks = m.blocks_of(s)
            assert len(blocks) == len(set(blocks)) == -(-m.seq_len(s) // self.bs)
            for b in blocks:
                holders[b] += 1
        assert [m.ref_count(b) for b in range(m.num_blocks)] == holders
        assert m.num_shared_blocks == sum(h > 1 for h in holders)

    @invariant()
    def states_partition_the_pools(self):
        m = self.m
        free, cached = list(m.free_block_ids), m.cached_block_ids
        owned = [b for b in range(m.num_blocks) if m.ref_count(b) > 0]
        assert sorted(free + cached + owned) == list(range(m.num_blocks))
        assert m.num_free_blocks + m.num_cached_blocks + m.num_owned_blocks == m.num_blocks
        swapped = [h for s in m.swapped_seq_ids for h in m.host_blocks_of(s)]
        assert sorted(swapped + list(m.free_host_block_ids)) == list(range(m.num_host_blocks))
        assert m.num_free_host_blocks + m.num_swapped_blocks == m.num_host_blocks
        # free + cached + owned + swapped = the two pools, less the free host blocks
        assert (m.num_free_blocks + m.num_cached_blocks + m.num_owned_blocks + m.num_swapped_blocks
                == m.num_blocks + m.num_host_blocks - m.num_free_host_blocks)
        if not m.enable_prefix_caching:
            assert not cached

    @invariant()
    def tables_read_back_every_sequence(self):
        m, bs = self.m, self.bs
        assert sorted(m.seq_ids + m.swapped_seq_ids) == sorted(self.model)
        for s, tokens in self.model.items():
            assert m.seq_len(s) == len(tokens)
            if m.is_swapped(s):
                got = [self.host[h][i] for h in m.host_blocks_of(s) for i in range(bs)][:len(tokens)]
            else:
                got = [self.dev[slot // bs][slot % bs] for slot in m.slot_mapping(s, 0, len(tokens))]
            assert got == tokens, f"sequence {s}"
        np.testing.assert_array_equal(m.seq_lens(), [len(self.model[s]) for s in m.seq_ids])

    @invariant()
    def cached_blocks_hold_their_keys(self):
        for key, b in self.m.prefix_cache.items():
            assert self.dev[b] == list(key[1])
        assert 0.0 <= self.m.hit_rate <= 1.0 and self.m.num_hit_blocks <= self.m.num_lookup_blocks


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)
