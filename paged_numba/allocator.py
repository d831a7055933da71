"""Host-side block bookkeeping for a paged KV cache (plain Python + NumPy, no numba).

The KV cache is one pool of ``num_blocks`` physical blocks of ``block_size`` token
slots each. A sequence owns a block table: logical block ``i`` (its tokens
``i * block_size`` to ``(i + 1) * block_size - 1``) lives in physical block
``table[i]``, so token ``t`` is stored in slot
``table[t // block_size] * block_size + t % block_size``.

``-1`` (:data:`NO_BLOCK`) is the one sentinel: it pads block tables past a
sequence's blocks, and a slot of ``-1`` tells a kernel to skip that token.
"""

from collections import deque
from collections.abc import Hashable, Iterable, Sequence

import numpy as np

from ._checks import INT32_MAX, hashable, int_array, integer
NO_BLOCK = -1


class OutOfBlocksError(RuntimeError):
    """The pool has too few free blocks; the allocator was left unchanged.

    A ``RuntimeError``, raised by :meth:`BlockAllocator.allocate` and
    :meth:`BlockAllocator.append`.

    Examples
    --------
    >>> a = BlockAllocator(num_blocks=2, block_size=4)
    >>> a.allocate("s0", 9)           # ceil(9 / 4) = 3 blocks, 2 in the pool
    Traceback (most recent call last):
        ...
    paged_numba.allocator.OutOfBlocksError: sequence 's0' needs 3 blocks but only 2 are free
    >>> a.num_free_blocks, len(a)     # nothing was taken
    (2, 0)
    >>> issubclass(OutOfBlocksError, RuntimeError)
    True
    """


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``.

    Parameters
    ----------
    num_tokens : int
        Tokens to store (an integer >= 0; anything else raises ``ValueError``).
    block_size : int
        Token slots per block (> 0).

    Returns
    -------
    int

    Examples
    --------
    >>> num_blocks_for(45, 16)    # 45 = (3 - 1) * 16 + 13: the third block holds 13
    3
    >>> num_blocks_for(32, 16), num_blocks_for(33, 16), num_blocks_for(0, 16)
    (2, 3, 0)
    """
    return -(-_check_count(num_tokens, "num_tokens") // integer("block_size", block_size, lo=1))


def padded_block_table(rows: Sequence[Sequence[int]], max_blocks: int | None = None) -> np.ndarray:
    """Stack per-sequence block lists into an int32 table ``[num_seqs, max_blocks]``.

    Entries past a row's length are ``-1``. ``max_blocks`` defaults to the longest
    row; a ``max_blocks`` shorter than that, or a row entry that is not an
    integer in the int32 range, raises ``ValueError``.

    Parameters
    ----------
    rows : sequence of sequences of int, ``num_seqs`` rows of any lengths
        Physical blocks of each sequence, in logical order.
    max_blocks : int, optional
        Columns of the table.

    Returns
    -------
    numpy.ndarray of int32, ``[num_seqs, max_blocks]``

    Examples
    --------
    >>> padded_block_table([[7, 2, 5], [0], []])
    array([[ 7,  2,  5],
           [ 0, -1, -1],
           [-1, -1, -1]], dtype=int32)
    >>> padded_block_table([[7, 2, 5]], max_blocks=4)
    array([[ 7,  2,  5, -1]], dtype=int32)
    >>> padded_block_table([[7, 2, 5]], max_blocks=2)
    Traceback (most recent call last):
        ...
    ValueError: max_blocks=2 is smaller than the longest row (3 blocks)
    """
    rows = [int_array(f"rows[{i}]", row, ndim=1) for i, row in enumerate(rows)]
    longest = max((len(r) for r in rows), default=0)
    if max_blocks is None:
        max_blocks = longest
    elif integer("max_blocks", max_blocks, lo=0) < longest:
        raise ValueError(f"max_blocks={max_blocks} is smaller than the longest row ({longest} blocks)")
    table = np.full((len(rows), max_blocks), NO_BLOCK, dtype=np.int32)
    for i, row in enumerate(rows):
        table[i, : len(row)] = row
    return table


def slots_from_table(block_table_row, positions, block_size: int) -> np.ndarray:
    """Cache slots of token ``positions`` of one sequence, as int64 ``[num_positions]``.

    ``block_table_row`` is ``[max_blocks]`` (may be ``-1``-padded); a position whose
    block is ``-1`` gets slot ``-1``. Positions outside ``[0, max_blocks * block_size)``
    raise ``ValueError``.

    Parameters
    ----------
    block_table_row : array of int, ``[max_blocks]``
    positions : array of int, ``[num_positions]``
        Token positions in the sequence.
    block_size : int

    Returns
    -------
    numpy.ndarray of int64, ``[num_positions]``
        ``row[t // block_size] * block_size + t % block_size`` for each position ``t``.

    Examples
    --------
    >>> slots_from_table([7, 2, -1], [0, 5, 6, 9], block_size=4)
    array([28,  9, 10, -1])
    >>> # 28 = 7 * 4 + 0; 9 = 2 * 4 + 5 % 4; position 9 is in logical block 9 // 4 = 2: -1
    >>> slots_from_table([7, 2, -1], [12], block_size=4)
    Traceback (most recent call last):
        ...
    ValueError: positions must lie in [0, 12), but got 12..12
    """
    row = int_array("block_table_row", block_table_row, ndim=1, dtype=np.int64)
    pos = int_array("positions", positions, ndim=1, lo=0, hi=np.iinfo(np.int64).max,
                    dtype=np.int64, what="token positions")
    block_size = integer("block_size", block_size, lo=1)
    if pos.size and (pos.min() < 0 or pos.max() >= row.size * block_size):
        raise ValueError(f"positions must lie in [0, {row.size * block_size}), but got {pos.min()}..{pos.max()}")
    blocks = row[pos // block_size]
    return np.where(blocks == NO_BLOCK, NO_BLOCK, blocks * block_size + pos % block_size)


def _check_count(n: int, name: str) -> int:
    """``n`` as an int, checked: an integer (not a bool or float) >= 0."""
    return integer(name, n, lo=0)


def _check_ids(seq_ids):
    """``seq_ids`` (None: all sequences) is an iterable of ids, not a string."""
    if seq_ids is not None and (isinstance(seq_ids, (str, bytes)) or not isinstance(seq_ids, Iterable)):
        raise ValueError(f"seq_ids must be a list of sequence ids or None, but got {seq_ids!r}")
    return seq_ids


class BlockAllocator:
    """Hands out fixed-size KV-cache blocks from one pool and tracks each sequence.

    Free blocks sit in a deque, taken from the front and returned to the back.
    Each sequence (any hashable id) owns a list of physical blocks and a token
    count; it always holds exactly ``ceil(seq_len / block_size)`` blocks.

    Parameters
    ----------
    num_blocks : int
        Physical blocks in the pool (> 0).
    block_size : int
        Token slots per block (> 0).

    Examples
    --------
    >>> a = BlockAllocator(num_blocks=8, block_size=4)
    >>> a.allocate("s0", 6)   # ceil(6 / 4) = 2 blocks; block 1 holds 2 tokens
    [0, 1]
    >>> a.append("s0", 2)     # 8 = 2 * 4: fills block 1, no new block
    []
    >>> a.append("s0")        # token 8 opens logical block 2
    [2]
    >>> a.allocate("s1", 3)
    [3]
    >>> a.block_table()
    array([[ 0,  1,  2],
           [ 3, -1, -1]], dtype=int32)
    >>> a.append_slots("s1", 2)   # tokens 3, 4 -> 3*4+3 = 15, new block 4 -> 4*4+0 = 16
    array([15, 16])
    >>> a.free("s0")
    >>> a
    BlockAllocator(num_blocks=8, block_size=4, free=6, seqs=1, tokens=5/8 slots used (62.5%))
    """

    def __init__(self, num_blocks: int, block_size: int):
        self._num_blocks = integer("num_blocks", num_blocks, lo=1, hi=INT32_MAX)
        self._block_size = integer("block_size", block_size, lo=1, hi=INT32_MAX)
        self.free_block_ids: deque[int] = deque(range(self._num_blocks))
        self._blocks: dict[Hashable, list[int]] = {}
        self._lens: dict[Hashable, int] = {}

    # -- counts (read-only) ---------------------------------------------------
    num_blocks = property(lambda self: self._num_blocks, doc="Physical blocks in the pool.")
    block_size = property(lambda self: self._block_size, doc="Token slots per block.")
    num_free_blocks = property(lambda self: len(self.free_block_ids), doc="Blocks in the free list.")
    num_used_blocks = property(lambda self: self._num_blocks - self.num_free_blocks, doc="Blocks owned by sequences.")
    num_used_slots = property(lambda self: sum(self._lens.values()), doc="Tokens stored, over all sequences.")
    num_reserved_slots = property(lambda self: self.num_used_blocks * self._block_size, doc="Slots in used blocks.")
    internal_fragmentation = property(lambda self: self.num_reserved_slots - self.num_used_slots,
                                      doc="Reserved but empty slots (< ``block_size`` per sequence).")

    @property
    def utilisation(self) -> float:
        """``num_used_slots / num_reserved_slots``; 1.0 when nothing is reserved."""
        reserved = self.num_reserved_slots
        return self.num_used_slots / reserved if reserved else 1.0

    # -- sequences ------------------------------------------------------------
    @property
    def seq_ids(self) -> list:
        """Sequence ids in insertion order."""
        return list(self._blocks)

    def __contains__(self, seq_id) -> bool:
        try:
            return seq_id in self._blocks
        except TypeError:            # unhashable (a list, a tuple holding one): never a sequence id
            return False

    def __len__(self) -> int:  # number of sequences
        return len(self._blocks)

    def blocks_of(self, seq_id) -> list[int]:
        """Physical blocks of ``seq_id`` in logical order (a copy)."""
        return list(self._blocks[self._check_seq(seq_id)])

    def seq_len(self, seq_id) -> int:
        """Tokens stored for ``seq_id``."""
        return self._lens[self._check_seq(seq_id)]

    # -- allocate / append / free -----------------------------------------------
    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a new sequence of ``num_tokens`` tokens fits in the free blocks."""
        return num_blocks_for(num_tokens, self._block_size) <= self.num_free_blocks

    def allocate(self, seq_id, num_tokens: int) -> list[int]:
        """Take blocks for a new sequence of ``num_tokens`` tokens and return them.

        ``slot_mapping(seq_id, 0, num_tokens)`` then gives its prefill slots.
        Raises ``ValueError`` if ``seq_id`` exists, :class:`OutOfBlocksError` if the
        pool is too small (leaving everything unchanged).

        Examples
        --------
        >>> a = BlockAllocator(num_blocks=4, block_size=16)
        >>> a.allocate("x", 33)   # ceil(33 / 16) = 3 blocks; 48 - 33 = 15 empty slots
        [0, 1, 2]
        >>> a.internal_fragmentation
        15
        >>> a.allocate("y", 0)    # an empty sequence owns no block
        []
        >>> a.can_allocate(17)    # needs 2 blocks, 1 is free
        False
        """
        if hashable("seq_id", seq_id) in self._blocks:
            raise ValueError(f"sequence {seq_id!r} is already allocated")
        num_tokens = integer("num_tokens", num_tokens, lo=0, hi=INT32_MAX)   # int32 lengths
        blocks = self._take(num_blocks_for(num_tokens, self._block_size), seq_id)
        self._blocks[seq_id], self._lens[seq_id] = blocks, num_tokens
        return list(blocks)

    def _new_blocks_needed(self, seq_id, num_new_tokens: int) -> int:
        n = self._lens[self._check_seq(seq_id)] + _check_count(num_new_tokens, "num_new_tokens")
        if n > INT32_MAX:
            raise ValueError(f"num_new_tokens={num_new_tokens} would make sequence {seq_id!r} {n} "
                             f"tokens long, but a length must be at most {INT32_MAX} (int32 tables)")
        return num_blocks_for(n, self._block_size) - len(self._blocks[seq_id])

    def can_append(self, seq_id, num_new_tokens: int = 1) -> bool:
        """Whether ``seq_id`` can grow by ``num_new_tokens`` tokens."""
        return self._new_blocks_needed(seq_id, num_new_tokens) <= self.num_free_blocks

    def append(self, seq_id, num_new_tokens: int = 1) -> list[int]:
        """Grow ``seq_id`` by ``num_new_tokens`` tokens; return the newly taken blocks.

        A block is taken only once the last one is full.
        """
        num_new_tokens = _check_count(num_new_tokens, "num_new_tokens")
        new = self._take(self._new_blocks_needed(seq_id, num_new_tokens), seq_id)
        self._blocks[seq_id].extend(new)
        self._lens[seq_id] += num_new_tokens
        return new

    def append_slots(self, seq_id, num_new_tokens: int = 1) -> np.ndarray:
        """:meth:`append`, then return the slots of the new tokens, int64 ``[num_new_tokens]``."""
        num_new_tokens = _check_count(num_new_tokens, "num_new_tokens")    # before any change
        start = self.seq_len(seq_id)
        self.append(seq_id, num_new_tokens)
        return self.slot_mapping(seq_id, start, start + num_new_tokens)

    def free(self, seq_id) -> None:
        """Forget ``seq_id`` and return its blocks to the back of the free list."""
        self.free_block_ids.extend(self._blocks.pop(self._check_seq(seq_id)))
        del self._lens[seq_id]

    # -- tables for kernels -------------------------------------------------------
    def slot_mapping(self, seq_id, start: int, end: int) -> np.ndarray:
        """Slots of token positions ``[start, end)`` of ``seq_id``, int64 ``[end - start]``."""
        n = self.seq_len(seq_id)
        start, end = integer("start", start), integer("end", end)
        if not 0 <= start <= end <= n:
            raise ValueError(f"need 0 <= start <= end <= seq_len, but got {start=}, {end=}, seq_len={n}")
        return slots_from_table(self._blocks[seq_id], np.arange(start, end), self._block_size)

    def block_table(self, seq_ids=None, max_blocks: int | None = None) -> np.ndarray:
        """Block tables of ``seq_ids`` (default: all, in insertion order), ``-1``-padded.

        Returns int32 ``[num_seqs, max_blocks]``; ``max_blocks`` defaults to the longest.
        """
        return padded_block_table([self.blocks_of(s) for s in self._ids(seq_ids)], max_blocks)

    def seq_lens(self, seq_ids=None) -> np.ndarray:
        """Token counts of ``seq_ids`` (default: all), int32 ``[num_seqs]``."""
        return int_array("seq_lens", [self.seq_len(s) for s in self._ids(seq_ids)])

    # -- helpers ------------------------------------------------------------------
    def _ids(self, seq_ids):
        return list(self._blocks) if _check_ids(seq_ids) is None else list(seq_ids)

    def _check_seq(self, seq_id):
        if hashable("seq_id", seq_id) not in self._blocks:
            raise ValueError(f"unknown sequence id {seq_id!r}")
        return seq_id

    def _take(self, n: int, seq_id) -> list[int]:
        if n > len(self.free_block_ids):
            raise OutOfBlocksError(f"sequence {seq_id!r} needs {n} blocks but only {self.num_free_blocks} are free")
        return [self.free_block_ids.popleft() for _ in range(n)]

    def __repr__(self) -> str:
        return (f"BlockAllocator(num_blocks={self._num_blocks}, block_size={self._block_size}, "
                f"free={self.num_free_blocks}, seqs={len(self)}, tokens={self.num_used_slots}/"
                f"{self.num_reserved_slots} slots used ({100 * self.utilisation:.1f}%))")
