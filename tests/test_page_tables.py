"""Tests for paged_numba/page_tables.py (bookkeeping: it must import without numba)."""
import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import paged_numba.allocator as alloc
import paged_numba.page_tables as pt


def assert_int32(actual, expected):
    actual = np.asarray(actual)
    assert actual.dtype == np.int32, actual.dtype
    np.testing.assert_array_equal(actual, np.asarray(expected).reshape(actual.shape))


# -- hand-built cases -------------------------------------------------------------------------

def test_readme_batch_60_and_17_tokens():
    table = np.array([[0, 1, 2, 3], [4, 5, -1, -1]], np.int32)
    indptr, indices, last = pt.padded_to_csr(table, np.array([60, 17], np.int32), 16)
    assert_int32(indptr, [0, 4, 6])         # ceil(60 / 16) = 4 pages; ceil(17 / 16) = 2; 4 + 2 = 6
    assert_int32(indices, [0, 1, 2, 3, 4, 5])
    assert_int32(last, [12, 1])             # 60 = 3 * 16 + 12; 17 = 1 * 16 + 1
    assert_int32(pt.seq_lens_from_csr(indptr, last, 16), [60, 17])
    back, lens = pt.csr_to_padded(indptr, indices, last, 16)
    assert_int32(back, table)
    assert_int32(lens, [60, 17])


def test_full_last_page_empty_sequences_and_scattered_blocks():
    table = [[9, 3, -1], [-1, -1, -1], [2, 7, 0], [5, -1, -1]]
    # 32 = (2 - 1) * 16 + 16: a full last page is 16, not 0; 0 tokens: no pages, last 0;
    # 33 = (3 - 1) * 16 + 1; 1 = (1 - 1) * 16 + 1
    indptr, indices, last = pt.padded_to_csr(table, [32, 0, 33, 1], 16)
    assert_int32(indptr, [0, 2, 2, 5, 6])
    assert_int32(indices, [9, 3, 2, 7, 0, 5])
    assert_int32(last, [16, 0, 1, 1])
    back, lens = pt.csr_to_padded(indptr, indices, last, 16, max_blocks=4)
    assert_int32(back, [[9, 3, -1, -1], [-1] * 4, [2, 7, 0, -1], [5, -1, -1, -1]])
    assert_int32(lens, [32, 0, 33, 1])


def test_block_size_one_and_entries_past_the_used_part_ignored():
    # page size 1: every token is a page, every last page holds 1 token (54 = 53 * 1 + 1)
    table = np.arange(60, dtype=np.int32)[None, :]
    indptr, indices, last = pt.padded_to_csr(table, [54], 1)
    assert_int32(indptr, [0, 54])
    assert_int32(indices, np.arange(54))
    assert_int32(last, [1])
    # 5 tokens of block 4 = 2 pages; the stale 8 past them is not part of the sequence
    indptr, indices, last = pt.padded_to_csr([[1, 6, 8]], [5], 4)
    assert_int32(indices, [1, 6])
    assert_int32(last, [1])   # 5 = 1 * 4 + 1


def test_no_sequences():
    indptr, indices, last = pt.padded_to_csr(np.zeros((0, 0), np.int32), np.zeros(0, np.int32), 16)
    assert_int32(indptr, [0])
    assert indices.shape == (0,) and last.shape == (0,)
    assert indices.dtype == last.dtype == np.int32
    table, lens = pt.csr_to_padded([0], [], [], 16)
    assert table.shape == (0, 0) and table.dtype == np.int32 and lens.shape == (0,)
    pt.validate_csr([0], [], [], num_blocks=1, block_size=16)


def test_seq_lens_from_csr_arithmetic():
    # 3 pages, last 5: 2 * 8 + 5 = 21; no pages: 0; 1 page of 8: 0 * 8 + 8 = 8
    assert_int32(pt.seq_lens_from_csr([0, 3, 3, 4], [5, 0, 8], 8), [21, 0, 8])


def test_agrees_with_the_allocator():
    a = alloc.BlockAllocator(num_blocks=12, block_size=4)
    a.allocate("a", 9)    # [0, 1, 2]: 9 = 2 * 4 + 1
    a.allocate("b", 0)    # []
    a.allocate("c", 8)    # [3, 4]: 8 = 1 * 4 + 4
    a.free("a")
    a.allocate("d", 10)   # [5, 6, 7]: 10 = 2 * 4 + 2
    indptr, indices, last = pt.padded_to_csr(a.block_table(), a.seq_lens(), 4)
    assert_int32(indptr, [0, 0, 2, 5])
    assert_int32(indices, a.blocks_of("c") + a.blocks_of("d"))
    assert_int32(last, [0, 4, 2])
    table, lens = pt.csr_to_padded(indptr, indices, last, 4)
    assert_int32(table, a.block_table())
    assert_int32(lens, a.seq_lens())


# -- round trips ------------------------------------------------------------------------------

@st.composite
def padded_tables(draw):
    """``(block_tables, seq_lens, block_size, num_blocks)``; padding is -1 or stale ids."""
    block_size = draw(st.sampled_from([1, 2, 3, 5, 16]))
    num_blocks = draw(st.integers(1, 40))
    seq_lens = np.array(draw(st.lists(st.integers(0, 60), max_size=6)), np.int32)
    pages = -(-seq_lens // block_size)
    max_blocks = int(pages.max(initial=0)) + draw(st.integers(0, 2))
    ids = st.integers(0, num_blocks - 1)
    table = np.array(draw(st.lists(st.lists(ids, min_size=max_blocks, max_size=max_blocks),
                                   min_size=len(seq_lens), max_size=len(seq_lens))),
                     np.int32).reshape(len(seq_lens), max_blocks)
    if draw(st.booleans()):  # else keep the stale ids drawn past each sequence's pages
        table[np.arange(max_blocks) >= pages[:, None]] = -1
    return table, seq_lens, block_size, num_blocks


@given(padded_tables())
def test_padded_to_csr_to_padded(case):
    table, seq_lens, block_size, num_blocks = case
    indptr, indices, last = pt.padded_to_csr(table, seq_lens, block_size)
    pt.validate_csr(indptr, indices, last, num_blocks, block_size)
    assert indptr.dtype == indices.dtype == last.dtype == np.int32
    pages = np.diff(indptr)
    assert_int32(pages, -(-seq_lens // block_size))
    back, lens = pt.csr_to_padded(indptr, indices, last, block_size, max_blocks=table.shape[1])
    assert back.shape == table.shape
    used = np.arange(table.shape[1]) < pages[:, None]
    assert np.array_equal(back[used], table[used]) and (back[~used] == -1).all()
    assert_int32(lens, seq_lens)
    assert_int32(pt.seq_lens_from_csr(indptr, last, block_size), seq_lens)
    # every token maps to the same slot both ways: seq i, token t -> page t // B, offset t % B
    for i, n in enumerate(seq_lens):
        t = np.arange(n)
        slots_padded = table[i, t // block_size].astype(np.int64) * block_size + t % block_size
        slots_csr = indices[indptr[i] + t // block_size].astype(np.int64) * block_size + t % block_size
        assert np.array_equal(slots_padded, slots_csr)


@st.composite
def csr_tables(draw):
    """``(kv_indptr, kv_indices, kv_last_page_len, block_size, num_blocks)``, valid."""
    block_size = draw(st.sampled_from([1, 2, 3, 5, 16]))
    num_blocks = draw(st.integers(1, 40))
    pages = draw(st.lists(st.integers(0, 5), max_size=6))
    last = [draw(st.integers(1, block_size)) if p else 0 for p in pages]
    indices = draw(st.lists(st.integers(0, num_blocks - 1), min_size=sum(pages), max_size=sum(pages)))
    indptr = np.concatenate([[0], np.cumsum(pages, dtype=np.int64)]).astype(np.int32)
    return indptr, np.array(indices, np.int32), np.array(last, np.int32), block_size, num_blocks


@given(csr_tables(), st.integers(0, 2))
def test_csr_to_padded_to_csr(case, extra_columns):
    indptr, indices, last, block_size, num_blocks = case
    pt.validate_csr(indptr, indices, last, num_blocks, block_size)
    longest = int(np.diff(indptr).max(initial=0))
    table, lens = pt.csr_to_padded(indptr, indices, last, block_size, max_blocks=longest + extra_columns)
    assert table.shape == (len(last), longest + extra_columns)
    again = pt.padded_to_csr(table, lens, block_size)
    for a, b in zip(again, (indptr, indices, last)):
        assert_int32(a, b)


# -- validation -------------------------------------------------------------------------------

# a valid table to break: seq_lens [60, 17], block 16, 8 blocks
GOOD = dict(kv_indptr=[0, 4, 6], kv_indices=[0, 1, 2, 3, 4, 5], kv_last_page_len=[12, 1],
            num_blocks=8, block_size=16)


@pytest.mark.parametrize("change, message", [
    (dict(kv_indptr=[1, 4, 6]), "kv_indptr[0] must be 0, but got 1."),
    (dict(kv_indptr=[0, 6, 4, 6], kv_last_page_len=[12, 1, 1]),
     "kv_indptr must be non-decreasing, but kv_indptr[2] = 4 < kv_indptr[1] = 6."),
    (dict(kv_indptr=[0, 4, 7]), "kv_indptr[-1] = 7 must equal len(kv_indices) = 6."),
    (dict(kv_indptr=[]), "kv_indptr must be [num_seqs + 1], so it has at least one entry, but got shape (0,)."),
    (dict(kv_indptr=[[0, 4, 6]]), "kv_indptr must have 1 dimension, but got shape (1, 3)."),
    (dict(kv_indptr=[0.0, 4.0, 6.0]), "kv_indptr[0] must be an integer, but got 0.0 (float)."),
    (dict(kv_indptr=np.array([0.0, 4.0, 6.0])), "kv_indptr must hold integers, but got dtype float64."),
    (dict(kv_indices=[0, 1, 2, 3, 4, 8]), "kv_indices[5] (page 1 of sequence 1) is 8, outside [0, 8)."),
    (dict(kv_indices=[0, -1, 2, 3, 4, 5]), "kv_indices[1] (page 1 of sequence 0) is -1, outside [0, 8)."),
    (dict(kv_last_page_len=[12, 1, 1]), "kv_last_page_len must be [num_seqs] = [2] (len(kv_indptr) - 1), "
                                        "but got shape (3,)."),
    (dict(kv_last_page_len=[17, 1]), "kv_last_page_len[0] is 17, but sequence 0 has 4 pages, so it must "
                                     "lie in [1, 16] (block_size)."),
    (dict(kv_last_page_len=[12, 0]), "kv_last_page_len[1] is 0, but sequence 1 has 2 pages"),
    (dict(kv_indptr=[0, 4, 4, 6], kv_last_page_len=[12, 3, 1]),
     "kv_last_page_len[1] is 3, but sequence 1 has no pages, so it must be 0."),
    (dict(num_blocks=0), "num_blocks must be a positive integer, but got 0."),
    (dict(block_size=16.0), "block_size must be a positive integer, but got 16.0."),
])
def test_validate_csr_names_the_value(change, message):
    pt.validate_csr(**GOOD)
    with pytest.raises(ValueError, match=re.escape(message)):
        pt.validate_csr(**{**GOOD, **change})


def test_empty_sequence_between_others_points_at_the_right_owner():
    # indptr [0, 2, 2, 3]: entry 2 belongs to sequence 2 (sequence 1 is empty)
    with pytest.raises(ValueError, match=re.escape("kv_indices[2] (page 0 of sequence 2) is 5, outside [0, 5).")):
        pt.validate_csr([0, 2, 2, 3], [0, 1, 5], [3, 0, 4], num_blocks=5, block_size=4)


def test_csr_converters_check_their_input():
    with pytest.raises(ValueError, match=re.escape("kv_indptr[0] must be 0, but got 2.")):
        pt.seq_lens_from_csr([2, 4], [1], 16)
    message = "kv_indices[0] (page 0 of sequence 0) is -1, outside [0, num_blocks)."   # no num_blocks to check against
    with pytest.raises(ValueError, match=re.escape(message)):
        pt.csr_to_padded([0, 1], [-1], [1], 16)
    with pytest.raises(ValueError, match=re.escape("max_blocks=3 is smaller than the most pages of a sequence (4).")):
        pt.csr_to_padded(**{k: GOOD[k] for k in ("kv_indptr", "kv_indices", "kv_last_page_len", "block_size")},
                         max_blocks=3)


@pytest.mark.parametrize("table, seq_lens, block_size, message", [
    ([[0, 1]], [-3], 4, "seq_lens[0] is -3; sequence lengths must be >= 0."),
    ([[0, 1]], [9], 4, "seq_lens[0] = 9 needs 3 blocks of 4, but block_tables has 2 columns."),   # ceil(9 / 4) = 3
    ([[0, 1], [2, -1]], [8, 5], 4, "block_tables[1, 1] is -1, inside the 2 used blocks of sequence 1 (seq_len 5)."),
    ([[0, 1]], [4, 4], 4, "seq_lens must be [num_seqs] = [1], but got shape (2,)."),
    ([0, 1], [4], 4, "block_tables must have 2 dimensions, but got shape (2,)."),
    ([[0, 1]], [4], 0, "block_size must be a positive integer, but got 0."),
])
def test_padded_to_csr_names_the_value(table, seq_lens, block_size, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        pt.padded_to_csr(table, seq_lens, block_size)
