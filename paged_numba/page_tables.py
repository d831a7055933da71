"""CSR page tables (FlashInfer's format) and padded block tables (plain NumPy, no numba).

A padded block table is int32 ``[num_seqs, max_blocks]``, ``-1`` past each
sequence's blocks, with int32 ``seq_lens [num_seqs]`` beside it (vLLM's
format, what :class:`~paged_numba.allocator.BlockAllocator` returns). The
same information in compressed sparse rows, FlashInfer's paged-KV format:

``kv_indptr`` : int32 ``[num_seqs + 1]``
    Prefix sums of the pages per sequence: sequence ``i`` owns
    ``kv_indices[kv_indptr[i]:kv_indptr[i + 1]]``; ``kv_indptr[0] == 0``.
``kv_indices`` : int32 ``[kv_indptr[-1]]``
    Physical block ids, sequence by sequence, each in logical order.
``kv_last_page_len`` : int32 ``[num_seqs]``
    Tokens in each sequence's last page: in ``[1, block_size]`` for a
    sequence with pages, and ``0`` for a sequence with none.

So ``seq_len = (pages - 1) * block_size + kv_last_page_len`` when
``pages = kv_indptr[i + 1] - kv_indptr[i] > 0``, and ``0`` otherwise.

:class:`CSRTable` holds the three; pass one as ``block_tables`` to
:func:`~paged_numba.paged_decode` or :func:`~paged_numba.paged_prefill`.
Every integer argument here may be a NumPy array, a list or a tuple (a
padded table: a list of rows).

Note
----
FlashInfer requires every sequence to own at least one page; here a sequence
may be empty (no pages, ``kv_last_page_len`` 0), as an allocator's
``allocate(seq_id, 0)`` makes one. A block id may appear more than once
(sequences sharing a prefix's blocks), so none of these functions checks for
repeats.

Examples
--------
>>> import numpy as np
>>> table = np.array([[0, 1, 2, 3], [4, 5, -1, -1]], np.int32)
>>> indptr, indices, last = padded_to_csr(table, [60, 17], block_size=16)
>>> indptr            # ceil(60 / 16) = 4 pages, ceil(17 / 16) = 2: [0, 4, 4 + 2]
array([0, 4, 6], dtype=int32)
>>> indices
array([0, 1, 2, 3, 4, 5], dtype=int32)
>>> last              # 60 = 3 * 16 + 12; 17 = 1 * 16 + 1
array([12,  1], dtype=int32)
>>> seq_lens_from_csr(indptr, last, 16)   # (4 - 1) * 16 + 12 = 60; (2 - 1) * 16 + 1 = 17
array([60, 17], dtype=int32)
"""
from typing import NamedTuple

import numpy as np

from ._checks import INT32_MAX, int_array
NO_BLOCK = -1  # allocator.NO_BLOCK; not imported, so this file loads on its own by path
INT64 = np.iinfo(np.int64)


class CSRTable(NamedTuple):
    """A CSR page table, the explicit way to pass one where a padded table is
    also accepted (``block_tables`` of :func:`~paged_numba.paged_decode` and
    :func:`~paged_numba.paged_prefill`). :func:`padded_to_csr` returns one.

    A list or tuple of rows is always a padded table, whatever its length; a
    plain tuple of three arrays (NumPy or CUDA) is still read as CSR.

    Attributes
    ----------
    kv_indptr : array of int, ``[num_seqs + 1]``
    kv_indices : array of int, ``[kv_indptr[-1]]``
    kv_last_page_len : array of int, ``[num_seqs]``
        Each may be a NumPy or CUDA array, a list or a tuple.

    Examples
    --------
    >>> CSRTable([0, 2], [5, 1], [3])      # one sequence: 2 pages, 3 tokens in the last
    CSRTable(kv_indptr=[0, 2], kv_indices=[5, 1], kv_last_page_len=[3])
    >>> csr_to_padded(*CSRTable([0, 2], [5, 1], [3]), block_size=4)[1]    # 7 = 1 * 4 + 3
    array([7], dtype=int32)
    """
    kv_indptr: object
    kv_indices: object
    kv_last_page_len: object


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, but got {value!r}.")
    return int(value)


def _int_array(name, x, ndim):
    """``x`` as int64 (checked in its own dtype first, so a uint64 past the int64 range
    does not wrap)."""
    return int_array(name, x, ndim, lo=int(INT64.min), hi=int(INT64.max), dtype=np.int64,
                     what="int64")


def _fits_int32(name, values, meaning):
    """Raise ``ValueError`` unless every entry of int64 ``values`` fits the int32 result."""
    over = np.flatnonzero(values > INT32_MAX)
    if over.size:
        i = int(over[0])
        raise ValueError(f"{name}[{i}] would be {int(values[i])} ({meaning}), more than int32 "
                         f"holds ({INT32_MAX}).")


def _csr_lens(pages, last, block_size):
    """``(pages - 1) * block_size + last`` (0 where ``pages`` is 0) as int64,
    after checking that each fits int32 (an int64 product could wrap and
    pass the check)."""
    full = np.maximum(pages - 1, 0)
    room = INT32_MAX - np.minimum(last, INT32_MAX)       # >= 0
    over = np.flatnonzero((pages > 0) & (full > room // block_size))
    if over.size:
        i = int(over[0])
        value = int(full[i]) * int(block_size) + int(last[i])
        raise ValueError(f"seq_lens[{i}] would be {value} (tokens), more than int32 holds "
                         f"({INT32_MAX}).")
    return np.where(pages > 0, full * block_size + last, 0)


def check_offsets(name, offsets):
    """``offsets`` (a non-empty 1-D int array, e.g. ``kv_indptr`` or
    ``cu_seqlens_q``) starts at 0 and never decreases; returns the lengths
    ``np.diff(offsets)``.

    >>> check_offsets("cu_seqlens_q", np.array([0, 10, 13, 14]))     # query lengths [10, 3, 1]
    array([10,  3,  1])
    >>> check_offsets("cu_seqlens_q", np.array([0, 6, 5]))
    Traceback (most recent call last):
        ...
    ValueError: cu_seqlens_q must be non-decreasing, but cu_seqlens_q[2] = 5 < cu_seqlens_q[1] = 6.
    """
    if offsets[0] != 0:
        raise ValueError(f"{name}[0] must be 0, but got {int(offsets[0])}.")
    lengths = np.diff(offsets)
    down = np.flatnonzero(lengths < 0)
    if down.size:
        i = int(down[0])
        raise ValueError(f"{name} must be non-decreasing, but {name}[{i + 1}] = "
                         f"{int(offsets[i + 1])} < {name}[{i}] = {int(offsets[i])}.")
    return lengths


def _check_pages(kv_indptr, kv_last_page_len, block_size):
    """Check ``kv_indptr`` and ``kv_last_page_len``; return them as int64 with
    the pages per sequence, ``[num_seqs]``."""
    indptr = _int_array("kv_indptr", kv_indptr, 1)
    last = _int_array("kv_last_page_len", kv_last_page_len, 1)
    if indptr.size == 0:
        raise ValueError("kv_indptr must be [num_seqs + 1], so it has at least one entry, but got shape (0,).")
    pages = check_offsets("kv_indptr", indptr)
    if last.shape != pages.shape:
        raise ValueError(f"kv_last_page_len must be [num_seqs] = [{pages.size}] (len(kv_indptr) - 1), "
                         f"but got shape {last.shape}.")
    bad = np.flatnonzero((pages == 0) & (last != 0))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"kv_last_page_len[{i}] is {int(last[i])}, but sequence {i} has no pages, "
                         "so it must be 0.")
    bad = np.flatnonzero((pages > 0) & ((last < 1) | (last > block_size)))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"kv_last_page_len[{i}] is {int(last[i])}, but sequence {i} has {int(pages[i])} "
                         f"pages, so it must lie in [1, {block_size}] (block_size).")
    return indptr, last, pages


def _check_indices(kv_indices, indptr, num_blocks=None):
    indices = _int_array("kv_indices", kv_indices, 1)
    if indices.size != indptr[-1]:
        raise ValueError(f"kv_indptr[-1] = {int(indptr[-1])} must equal len(kv_indices) = {indices.size}.")
    # block ids become int32: without num_blocks, that range bounds them
    outside = (indices < 0) | (indices >= (INT32_MAX + 1 if num_blocks is None else num_blocks))
    bad = np.flatnonzero(outside)
    if bad.size:
        j = int(bad[0])
        seq = int(np.searchsorted(indptr, j, side="right")) - 1  # the sequence that owns entry j
        where = "[0, num_blocks)" if num_blocks is None else f"[0, {num_blocks})"
        if num_blocks is None and indices[j] > INT32_MAX:
            where += f" and the int32 range of block ids ({INT32_MAX})"
        raise ValueError(f"kv_indices[{j}] (page {j - int(indptr[seq])} of sequence {seq}) is "
                         f"{int(indices[j])}, outside {where}.")
    return indices


def validate_csr(kv_indptr, kv_indices, kv_last_page_len, num_blocks, block_size):
    """Raise ``ValueError`` naming the offending value unless the CSR page table is valid.

    Parameters
    ----------
    kv_indptr : array_like of int, ``[num_seqs + 1]``
        Starts at 0, non-decreasing, ends at ``len(kv_indices)``.
    kv_indices : array_like of int, ``[kv_indptr[-1]]``
        Block ids, each in ``[0, num_blocks)``.
    kv_last_page_len : array_like of int, ``[num_seqs]``
        In ``[1, block_size]`` for a sequence with pages, 0 for one without.
    num_blocks : int
        Physical blocks in the pool.
    block_size : int
        Tokens per block (page).

    Examples
    --------
    >>> validate_csr([0, 4, 6], [0, 1, 2, 3, 4, 5], [12, 1], num_blocks=6, block_size=16)
    >>> validate_csr([0, 4, 6], [0, 1, 2, 3, 4, 6], [12, 1], num_blocks=6, block_size=16)
    Traceback (most recent call last):
        ...
    ValueError: kv_indices[5] (page 1 of sequence 1) is 6, outside [0, 6).
    """
    num_blocks = _positive_int("num_blocks", num_blocks)
    block_size = _positive_int("block_size", block_size)
    indptr, _, _ = _check_pages(kv_indptr, kv_last_page_len, block_size)
    _check_indices(kv_indices, indptr, num_blocks)


def seq_lens_from_csr(kv_indptr, kv_last_page_len, block_size):
    """Tokens per sequence, int32 ``[num_seqs]``, from ``kv_indptr [num_seqs + 1]``
    and ``kv_last_page_len [num_seqs]``.

    ``seq_len = (pages - 1) * block_size + kv_last_page_len`` for a sequence
    with ``pages > 0``, else 0.

    >>> seq_lens_from_csr([0, 3, 3, 4], [5, 0, 8], block_size=8)   # 2 * 8 + 5 = 21; empty; 0 * 8 + 8
    array([21,  0,  8], dtype=int32)
    """
    block_size = _positive_int("block_size", block_size)
    _, last, pages = _check_pages(kv_indptr, kv_last_page_len, block_size)
    return _csr_lens(pages, last, block_size).astype(np.int32)


def padded_to_csr(block_tables, seq_lens, block_size):
    """Convert a padded block table to a CSR :class:`CSRTable` ``(kv_indptr, kv_indices,
    kv_last_page_len)``.

    Parameters
    ----------
    block_tables : array_like of int, ``[num_seqs, max_blocks]``
        Physical block of each logical block (an array, or a list of rows).
        Entries past a sequence's ``ceil(seq_len / block_size)`` blocks are
        ignored (usually ``-1``).
    seq_lens : array_like of int, ``[num_seqs]``
        Tokens per sequence, ``>= 0``.
    block_size : int
        Tokens per block (page).

    Returns
    -------
    CSRTable
        NumPy int32 arrays ``kv_indptr [num_seqs + 1]``, ``kv_indices
        [kv_indptr[-1]]`` and ``kv_last_page_len [num_seqs]`` (0 for an
        empty sequence); it unpacks as a 3-tuple.

    Raises ``ValueError`` for a negative length, a sequence that needs more
    blocks than its row has, or a negative id inside the used part of a row.

    Examples
    --------
    >>> import numpy as np
    >>> table = np.array([[7, 2, -1], [-1, -1, -1], [4, 0, 5]], np.int32)
    >>> for a in padded_to_csr(table, [9, 0, 24], block_size=8):   # 9 = 1 * 8 + 1; 24 = 2 * 8 + 8
    ...     print(a)
    [0 2 2 5]
    [7 2 4 0 5]
    [1 0 8]
    """
    block_size = _positive_int("block_size", block_size)
    table = _int_array("block_tables", block_tables, 2)
    lens = _int_array("seq_lens", seq_lens, 1)
    num_seqs, max_blocks = table.shape
    if lens.shape != (num_seqs,):
        raise ValueError(f"seq_lens must be [num_seqs] = [{num_seqs}], but got shape {lens.shape}.")
    bad = np.flatnonzero(lens < 0)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"seq_lens[{i}] is {int(lens[i])}; sequence lengths must be >= 0.")
    pages = -(-lens // block_size)
    over = np.flatnonzero(pages > max_blocks)
    if over.size:
        i = int(over[0])
        raise ValueError(f"seq_lens[{i}] = {int(lens[i])} needs {int(pages[i])} blocks of {block_size}, "
                         f"but block_tables has {max_blocks} columns.")
    used = np.arange(max_blocks) < pages[:, None]          # [num_seqs, max_blocks]
    neg = np.argwhere(used & (table < 0))
    if neg.size:
        i, j = (int(n) for n in neg[0])
        raise ValueError(f"block_tables[{i}, {j}] is {int(table[i, j])}, inside the "
                         f"{int(pages[i])} used blocks of sequence {i} (seq_len {int(lens[i])}).")
    big = np.argwhere(used & (table > INT32_MAX))
    if big.size:
        i, j = (int(n) for n in big[0])
        raise ValueError(f"block_tables[{i}, {j}] is {int(table[i, j])}, a block id past the "
                         f"int32 range ({INT32_MAX}).")
    _fits_int32("seq_lens", lens, "tokens")
    indptr = np.concatenate([[0], np.cumsum(pages)])
    _fits_int32("kv_indptr", indptr, "pages")
    kv_indptr = indptr.astype(np.int32)
    kv_indices = table[used].astype(np.int32)               # row-major: sequence by sequence
    kv_last_page_len = np.where(lens > 0, (lens - 1) % block_size + 1, 0).astype(np.int32)
    return CSRTable(kv_indptr, kv_indices, kv_last_page_len)


def csr_to_padded(kv_indptr, kv_indices, kv_last_page_len, block_size, max_blocks=None):
    """Convert a CSR page table to a padded block table and ``seq_lens``.

    Parameters
    ----------
    kv_indptr : array_like of int, ``[num_seqs + 1]``
    kv_indices : array_like of int, ``[kv_indptr[-1]]``
        Block ids, ``>= 0``.
    kv_last_page_len : array_like of int, ``[num_seqs]``
    block_size : int
        Tokens per block (page).
    max_blocks : int, optional
        Columns of the table; defaults to the most pages of any sequence.
        Fewer than that raises ``ValueError``.

    Returns
    -------
    block_tables : numpy.ndarray, int32 ``[num_seqs, max_blocks]``, ``-1`` past each sequence's pages
    seq_lens : numpy.ndarray, int32 ``[num_seqs]``

    Examples
    --------
    >>> table, lens = csr_to_padded([0, 4, 6], [0, 1, 2, 3, 4, 5], [12, 1], block_size=16)
    >>> table
    array([[ 0,  1,  2,  3],
           [ 4,  5, -1, -1]], dtype=int32)
    >>> lens              # 3 * 16 + 12 = 60; 1 * 16 + 1 = 17
    array([60, 17], dtype=int32)
    """
    block_size = _positive_int("block_size", block_size)
    indptr, last, pages = _check_pages(kv_indptr, kv_last_page_len, block_size)
    indices = _check_indices(kv_indices, indptr)
    longest = int(pages.max(initial=0))
    if max_blocks is None:
        max_blocks = longest
    elif isinstance(max_blocks, bool) or not isinstance(max_blocks, (int, np.integer)):
        raise ValueError(f"max_blocks must be an integer, but got {max_blocks!r}.")
    elif max_blocks < longest:
        raise ValueError(f"max_blocks={max_blocks} is smaller than the most pages of a sequence ({longest}).")
    elif max_blocks > INT32_MAX:
        raise ValueError(f"max_blocks must be at most {INT32_MAX}, but got {max_blocks}.")
    lens = _csr_lens(pages, last, block_size)
    if pages.size * int(max_blocks) > 2**31:      # 8 GB of int32 entries
        raise ValueError(f"a padded table of {pages.size} rows x max_blocks={max_blocks} has "
                         f"{pages.size * int(max_blocks)} entries, more than 2**31.")
    table = np.full((pages.size, max_blocks), NO_BLOCK, np.int32)
    table[np.arange(max_blocks) < pages[:, None]] = indices
    return table, lens.astype(np.int32)
