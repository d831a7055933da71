"""State machine for the block allocator (plain Python): ``BlockAllocator``
driven by random valid and invalid calls, checked against a small model
written here. The block manager's machine is in
``test_block_manager_machine.py``; it imports the shared helpers below.

The model predicts every result exactly from the documented rules: free
blocks are taken from the front of the free list and returned to its back.

A call with a bad argument must raise ``ValueError`` naming the argument,
and any failed call must leave the bookkeeping exactly as it was (a deep
snapshot).
"""
import copy
from collections import deque

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from paged_numba.allocator import BlockAllocator, OutOfBlocksError

UNHASHABLE = [[1], {"a": 1}, ([1], 2), {3}]
BAD_COUNTS = [-1, 1.0, 2.5, True, None, "2", np.float64(1.0)]
BAD_POSITIONS = [1.5, 0.0, True, None, "0", np.float32(1)]


def ceil_div(n, d):
    return -(-n // d)


def snapshot(obj):
    """Everything the object holds, for 'a failed call changed nothing'."""
    return copy.deepcopy(obj.__dict__)


def expect_unchanged(obj, call, error, match=None):
    """``call()`` raises ``error`` (message matching ``match``) and ``obj`` is as before."""
    before = snapshot(obj)
    with pytest.raises(error, match=match):
        call()
    assert snapshot(obj) == before


# -- BlockAllocator --------------------------------------------------------------------------

class AllocatorMachine(RuleBasedStateMachine):
    """The model: the free list (a deque), each sequence's table and length."""

    @initialize(num_blocks=st.integers(1, 10), block_size=st.sampled_from([1, 2, 3, 5]))
    def setup(self, num_blocks, block_size):
        self.a = BlockAllocator(num_blocks, block_size)
        self.nb, self.bs = num_blocks, block_size
        self.free = deque(range(num_blocks))
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}
        self.next_id = 0

    def _new_id(self):
        self.next_id += 1
        return self.next_id

    def _take(self, n):
        return [self.free.popleft() for _ in range(n)]

    def _seq(self, data):
        return data.draw(st.sampled_from(sorted(self.tables)))

    # -- valid calls (out of blocks included) ---
    @rule(num_tokens=st.integers(0, 25), as_numpy=st.booleans())
    def allocate(self, num_tokens, as_numpy):
        seq, need = self._new_id(), ceil_div(num_tokens, self.bs)
        n = np.int64(num_tokens) if as_numpy else num_tokens
        assert self.a.can_allocate(n) == (need <= len(self.free))
        if need > len(self.free):
            return expect_unchanged(self.a, lambda: self.a.allocate(seq, n), OutOfBlocksError,
                                    f"needs {need} blocks but only {len(self.free)}")
        expected = list(self.free)[:need]
        assert self.a.allocate(seq, n) == expected
        self._take(need)
        self.tables[seq], self.lens[seq] = expected, num_tokens

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), num_new=st.integers(0, 12), slots=st.booleans())
    def append(self, data, num_new, slots):
        seq = self._seq(data)
        old = self.lens[seq]
        need = ceil_div(old + num_new, self.bs) - len(self.tables[seq])
        assert self.a.can_append(seq, num_new) == (need <= len(self.free))
        if need > len(self.free):
            call = (lambda: self.a.append_slots(seq, num_new)) if slots else (lambda: self.a.append(seq, num_new))
            return expect_unchanged(self.a, call, OutOfBlocksError)
        expected = list(self.free)[:need]
        if slots:
            got = self.a.append_slots(seq, num_new)
        else:
            assert self.a.append(seq, num_new) == expected
        self._take(need)
        self.tables[seq] += expected
        self.lens[seq] += num_new
        if slots:
            pos = np.arange(old, old + num_new)
            table = np.array(self.tables[seq], dtype=np.int64)
            np.testing.assert_array_equal(got, table[pos // self.bs] * self.bs + pos % self.bs)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def free(self, data):
        seq = self._seq(data)
        self.a.free(seq)
        self.free.extend(self.tables.pop(seq))
        del self.lens[seq]

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def slot_mapping(self, data):
        seq = self._seq(data)
        n = self.lens[seq]
        start = data.draw(st.integers(-2, n + 2))
        end = data.draw(st.integers(-2, n + 2))
        if not 0 <= start <= end <= n:
            return expect_unchanged(self.a, lambda: self.a.slot_mapping(seq, start, end), ValueError,
                                    f"start={start}, end={end}, seq_len={n}")
        got = self.a.slot_mapping(seq, start, end)
        want = [self.tables[seq][t // self.bs] * self.bs + t % self.bs for t in range(start, end)]
        assert got.tolist() == want and got.dtype == np.int64

    # -- invalid calls ---
    @rule(data=st.data(), kind=st.sampled_from(["unhashable_seq_id", "unknown_or_taken_seq_id", "count",
                                                "position"]))
    def bad_call(self, data, kind):
        """One call with a bad argument (one rule, so that valid calls get most steps)."""
        getattr(self, f"_bad_{kind}")(data)

    def _bad_unhashable_seq_id(self, data):
        bad = data.draw(st.sampled_from(UNHASHABLE))
        op = data.draw(st.sampled_from(["allocate", "append", "append_slots", "free", "seq_len", "blocks_of",
                                        "slot_mapping", "can_append", "block_table"]))
        a = self.a
        calls = {"allocate": lambda: a.allocate(bad, 1), "append": lambda: a.append(bad),
                 "append_slots": lambda: a.append_slots(bad), "free": lambda: a.free(bad),
                 "seq_len": lambda: a.seq_len(bad), "blocks_of": lambda: a.blocks_of(bad),
                 "slot_mapping": lambda: a.slot_mapping(bad, 0, 0), "can_append": lambda: a.can_append(bad),
                 "block_table": lambda: a.block_table([bad])}
        expect_unchanged(a, calls[op], ValueError, "seq_id must be hashable")
        assert bad not in a

    def _bad_unknown_or_taken_seq_id(self, data):
        op = data.draw(st.sampled_from(["append", "free", "seq_len", "slot_mapping", "allocate"]))
        a, new = self.a, self._new_id()
        if op == "allocate":
            if not self.tables:
                return
            seq = self._seq(data)
            return expect_unchanged(a, lambda: a.allocate(seq, 0), ValueError, f"{seq!r} is already allocated")
        calls = {"append": lambda: a.append(new), "free": lambda: a.free(new),
                 "seq_len": lambda: a.seq_len(new), "slot_mapping": lambda: a.slot_mapping(new, 0, 0)}
        expect_unchanged(a, calls[op], ValueError, f"unknown sequence id {new!r}")

    def _bad_count(self, data):
        bad = data.draw(st.sampled_from(BAD_COUNTS))
        op = data.draw(st.sampled_from(["allocate", "append", "can"]))
        a = self.a
        if op == "allocate":
            return expect_unchanged(a, lambda: a.allocate(self._new_id(), bad), ValueError, "num_tokens")
        if op == "can":
            return expect_unchanged(a, lambda: a.can_allocate(bad), ValueError, "num_tokens")
        if self.tables:
            seq = self._seq(data)
            expect_unchanged(a, lambda: a.append_slots(seq, bad), ValueError, "num_new_tokens")

    def _bad_position(self, data):
        if not self.tables:
            return
        bad = data.draw(st.sampled_from(BAD_POSITIONS))
        which = data.draw(st.sampled_from(["start", "end"]))
        seq = self._seq(data)
        args = (bad, self.lens[seq]) if which == "start" else (0, bad)
        expect_unchanged(self.a, lambda: self.a.slot_mapping(seq, *args), ValueError, f"{which} must be an integer")

    # -- invariants ---
    @invariant()
    def pool_is_partitioned(self):
        a = self.a
        owned = [b for s in a.seq_ids for b in a.blocks_of(s)]
        assert len(owned) == len(set(owned)), "a block owned by two sequences"
        assert list(a.free_block_ids) == list(self.free)
        assert sorted(owned + list(a.free_block_ids)) == list(range(self.nb))
        assert a.num_free_blocks + a.num_used_blocks == self.nb == a.num_blocks

    @invariant()
    def tables_match_model(self):
        a = self.a
        assert a.seq_ids == list(self.tables)        # insertion order, as the model's dict
        for s, table in self.tables.items():
            assert a.blocks_of(s) == table and len(table) == ceil_div(self.lens[s], self.bs)
            assert a.seq_len(s) == self.lens[s]
        assert a.num_used_slots == sum(self.lens.values())
        padded = a.block_table()
        for row, table in zip(padded.tolist(), self.tables.values()):
            assert row == table + [-1] * (len(row) - len(table))

    @invariant()
    def slots_never_collide(self):
        a = self.a
        slots = [int(x) for s in a.seq_ids for x in a.slot_mapping(s, 0, a.seq_len(s))]
        assert len(slots) == len(set(slots)) == a.num_used_slots
        assert all(0 <= x < self.nb * self.bs for x in slots)


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
