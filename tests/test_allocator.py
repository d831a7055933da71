"""Tests for paged_numba/allocator.py (bookkeeping: it imports no numba, see test_architecture.py)."""
import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import paged_numba.allocator as alloc


BlockAllocator, OutOfBlocksError = alloc.BlockAllocator, alloc.OutOfBlocksError


def snapshot(a):
    """Everything observable about an allocator's state."""
    return (list(a.free_block_ids), a.seq_ids, {s: a.blocks_of(s) for s in a.seq_ids},
            a.block_table().tolist(), a.seq_lens().tolist(), a.num_used_slots)


@pytest.mark.parametrize("num_tokens, block_size, expected", [
    (0, 16, 0), (1, 16, 1), (16, 16, 1), (17, 16, 2), (33, 16, 3),  # 33 = 2 * 16 + 1
    (54, 1, 54), (97, 16, 7),  # 97 = 6 * 16 + 1
])
def test_num_blocks_for(num_tokens, block_size, expected):
    assert alloc.num_blocks_for(num_tokens, block_size) == expected


def test_allocate_33_tokens_block_16():
    a = BlockAllocator(num_blocks=8, block_size=16)
    assert a.allocate("s", 33) == [0, 1, 2]  # ceil(33 / 16) = 3
    assert a.num_used_blocks == 3 and a.num_free_blocks == 5  # 8 - 3
    assert a.num_used_slots == 33 and a.num_reserved_slots == 48  # 48 = 3 * 16
    assert a.internal_fragmentation == 15  # 48 - 33 = 15; the last block holds 33 - 32 = 1
    assert a.utilisation == pytest.approx(33 / 48)
    np.testing.assert_array_equal(a.slot_mapping("s", 31, 33), [31, 32])  # 32 = 2 * 16 + 0
    assert len(a) == 1 and "s" in a and "t" not in a and a.seq_len("s") == 33


def test_append_takes_one_block_exactly_at_the_boundary():
    a = BlockAllocator(num_blocks=8, block_size=4)
    assert a.allocate(0, 3) == [0]
    assert a.append(0) == []  # 4 = 1 * 4: block 0 is now full, still one block
    assert a.num_used_blocks == 1
    assert a.append(0, 0) == []
    assert a.append(0) == [1]  # token 4 = 1 * 4 + 0 opens logical block 1
    assert a.append(0, 3) == []  # 8 = 2 * 4: fills block 1
    assert a.append(0, 9) == [2, 3, 4]  # 17 tokens: ceil(17 / 4) = 5 blocks, 5 - 2 = 3 new
    assert a.blocks_of(0) == [0, 1, 2, 3, 4] and a.seq_len(0) == 17


def test_empty_sequence_owns_no_block_until_first_append():
    a = BlockAllocator(num_blocks=2, block_size=4)
    assert a.allocate("e", 0) == [] and a.utilisation == 1.0
    assert a.slot_mapping("e", 0, 0).shape == (0,)
    np.testing.assert_array_equal(a.append_slots("e", 1), [0])


def test_free_returns_blocks_to_the_back_of_the_pool():
    a = BlockAllocator(num_blocks=4, block_size=2)
    a.allocate("a", 3)  # blocks [0, 1]
    a.allocate("b", 1)  # block [2]
    a.free("a")
    assert list(a.free_block_ids) == [3, 0, 1]
    assert a.num_free_blocks == 3 and a.num_used_blocks == 1 and a.seq_ids == ["b"]
    assert a.allocate("c", 6) == [3, 0, 1]  # ceil(6 / 2) = 3
    assert not a.can_allocate(1) and a.can_allocate(0)


def test_out_of_blocks_leaves_allocator_unchanged():
    a = BlockAllocator(num_blocks=5, block_size=4)
    a.allocate("a", 6)  # blocks [0, 1]
    a.allocate("b", 4)  # block [2]
    before = snapshot(a)
    assert not a.can_allocate(9)  # ceil(9 / 4) = 3 > 2 free
    with pytest.raises(OutOfBlocksError, match="needs 3 blocks but only 2 are free"):
        a.allocate("c", 9)
    assert snapshot(a) == before and "c" not in a
    assert a.can_append("a", 10) and not a.can_append("a", 11)  # 16 = 4 * 4 fits; 17 needs 5 - 2 = 3 new
    with pytest.raises(OutOfBlocksError, match="needs 3 blocks but only 2 are free"):
        a.append("a", 11)
    with pytest.raises(OutOfBlocksError):
        a.append_slots("b", 9)  # 13 tokens: ceil(13 / 4) = 4, 4 - 1 = 3 new
    assert snapshot(a) == before


def test_slot_mapping_with_scattered_blocks():
    a = BlockAllocator(num_blocks=6, block_size=4)
    a.allocate("a", 4)  # [0]
    a.allocate("b", 4)  # [1]
    assert a.append("a") == [2]
    # a's token 4 is in logical block 1 -> physical 2: slot 8 = 2 * 4 + 0
    np.testing.assert_array_equal(a.slot_mapping("a", 0, 5), [0, 1, 2, 3, 8])
    slots = a.append_slots("b", 2)  # b's tokens 4, 5 -> block 3: 12 = 3 * 4 + 0, 13
    assert slots.dtype == np.int64
    np.testing.assert_array_equal(slots, [12, 13])
    np.testing.assert_array_equal(a.slot_mapping("b", 3, 6), [7, 12, 13])  # 7 = 1 * 4 + 3


def test_slots_from_table_arithmetic_and_padding():
    row = [5, 2, -1]
    # position 7 = 1 * 4 + 3 -> 2 * 4 + 3 = 11; position 2 -> 5 * 4 + 2 = 22; position 9 is in padding
    np.testing.assert_array_equal(alloc.slots_from_table(row, [7, 2, 9], 4), [11, 22, -1])
    with pytest.raises(ValueError, match="12"):  # 12 = 3 * 4 slots in the row
        alloc.slots_from_table(row, [12], 4)
    with pytest.raises(ValueError):
        alloc.slots_from_table(row, [-1], 4)


def test_block_table_padded_with_minus_one():
    a = BlockAllocator(num_blocks=10, block_size=2)
    a.allocate(7, 5)  # [0, 1, 2]
    a.allocate(3, 1)  # [3]
    a.allocate(9, 0)  # []
    table = a.block_table()
    assert table.dtype == np.int32
    np.testing.assert_array_equal(table, [[0, 1, 2], [3, -1, -1], [-1, -1, -1]])
    np.testing.assert_array_equal(a.block_table([3, 7], max_blocks=4), [[3, -1, -1, -1], [0, 1, 2, -1]])
    with pytest.raises(ValueError, match="max_blocks=2"):
        a.block_table(max_blocks=2)
    lens = a.seq_lens()
    assert lens.dtype == np.int32 and lens.tolist() == [5, 1, 0]
    assert a.seq_lens([9, 7]).tolist() == [0, 5]


def test_padded_block_table():
    np.testing.assert_array_equal(alloc.padded_block_table([[4], [], [1, 2]]), [[4, -1], [-1, -1], [1, 2]])
    assert alloc.padded_block_table([]).shape == (0, 0)
    assert alloc.padded_block_table([[1]], max_blocks=3).tolist() == [[1, -1, -1]]


def test_repr_reports_utilisation():
    a = BlockAllocator(num_blocks=64, block_size=16)
    a.allocate(0, 20)  # ceil(20 / 16) = 2 blocks
    a.allocate(1, 21)  # 2 blocks
    # 41 = 20 + 21 tokens in 4 * 16 = 64 slots: 41 / 64 = 64.06%
    assert repr(a) == "BlockAllocator(num_blocks=64, block_size=16, free=60, seqs=2, tokens=41/64 slots used (64.1%))"


@pytest.mark.parametrize("args, match", [((0, 16), "num_blocks .* 0"), ((8, -2), "block_size .* -2"),
                                         ((8.0, 16), "num_blocks .* 8.0"), ((True, 16), "num_blocks")])
def test_constructor_validation(args, match):
    with pytest.raises(ValueError, match=match):
        BlockAllocator(*args)


def test_argument_validation():
    a = BlockAllocator(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="-3"):
        a.allocate("a", -3)
    with pytest.raises(ValueError, match="-1"):
        a.can_allocate(-1)
    a.allocate("a", 2)
    with pytest.raises(ValueError, match="'a'"):
        a.allocate("a", 1)
    with pytest.raises(ValueError, match="-2"):
        a.append("a", -2)
    for call in (lambda: a.free("zz"), lambda: a.append("zz"), lambda: a.seq_len("zz"), lambda: a.block_table(["zz"])):
        with pytest.raises(ValueError, match="'zz'"):
            call()
    with pytest.raises(ValueError, match="end=3"):
        a.slot_mapping("a", 0, 3)  # only 2 tokens
    with pytest.raises(ValueError, match="start=2"):
        a.slot_mapping("a", 2, 1)
    assert a.seq_len("a") == 2 and a.num_free_blocks == 3


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate / append / free against a dict model of sequence lengths."""

    @initialize(num_blocks=st.integers(1, 12), block_size=st.sampled_from([1, 2, 3, 16]))
    def setup(self, num_blocks, block_size):
        self.a = BlockAllocator(num_blocks, block_size)
        self.model: dict[int, int] = {}
        self.next_id = 0

    @rule(num_tokens=st.integers(0, 40))
    def allocate(self, num_tokens):
        seq_id, self.next_id = self.next_id, self.next_id + 1
        if self.a.can_allocate(num_tokens):
            assert len(self.a.allocate(seq_id, num_tokens)) == alloc.num_blocks_for(num_tokens, self.a.block_size)
            self.model[seq_id] = num_tokens
        else:
            before = snapshot(self.a)
            with pytest.raises(OutOfBlocksError):
                self.a.allocate(seq_id, num_tokens)
            assert snapshot(self.a) == before

    @precondition(lambda self: self.model)
    @rule(data=st.data(), num_new=st.integers(0, 20))
    def append(self, data, num_new):
        seq_id = data.draw(st.sampled_from(sorted(self.model)))
        if self.a.can_append(seq_id, num_new):
            old = self.model[seq_id]
            slots = self.a.append_slots(seq_id, num_new)
            self.model[seq_id] += num_new
            np.testing.assert_array_equal(slots, self.a.slot_mapping(seq_id, old, old + num_new))
        else:
            before = snapshot(self.a)
            with pytest.raises(OutOfBlocksError):
                self.a.append(seq_id, num_new)
            assert snapshot(self.a) == before

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.model)))
        self.a.free(seq_id)
        del self.model[seq_id]

    @invariant()
    def blocks_partition_the_pool(self):
        owned = [b for s in self.a.seq_ids for b in self.a.blocks_of(s)]
        assert len(owned) == len(set(owned)) == self.a.num_used_blocks  # no block owned twice
        assert sorted(owned + list(self.a.free_block_ids)) == list(range(self.a.num_blocks))
        assert self.a.num_used_blocks + self.a.num_free_blocks == self.a.num_blocks

    @invariant()
    def sequences_match_model(self):
        a, bs = self.a, self.a.block_size
        assert sorted(a.seq_ids) == sorted(self.model) and len(a) == len(self.model)
        for s, n in self.model.items():
            assert a.seq_len(s) == n and len(a.blocks_of(s)) == -(-n // bs)
        assert a.num_used_slots == sum(self.model.values())
        assert a.internal_fragmentation == a.num_reserved_slots - a.num_used_slots
        assert 0 <= a.internal_fragmentation <= len(self.model) * (bs - 1)

    @invariant()
    def slot_mapping_is_injective(self):
        a = self.a
        slots = np.concatenate([a.slot_mapping(s, 0, a.seq_len(s)) for s in a.seq_ids] + [np.empty(0, np.int64)])
        assert len(np.unique(slots)) == len(slots) == a.num_used_slots
        assert slots.size == 0 or (slots.min() >= 0 and slots.max() < a.num_blocks * a.block_size)
        table = a.block_table()
        for row, s in zip(table, a.seq_ids):
            k = len(a.blocks_of(s))
            assert row[:k].tolist() == a.blocks_of(s) and (row[k:] == -1).all()


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
