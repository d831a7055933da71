"""Host-side block manager with sharing: reference counts, fork with
copy-on-write, prefix caching and swapping (plain Python + NumPy, no numba).

:class:`~paged_numba.allocator.BlockAllocator` gives every sequence blocks of
its own. :class:`BlockManager` lets sequences share physical blocks:

* every device block has a reference count, the number of block tables that
  hold it; ``fork`` copies a table and increments the counts;
* a block is written only while its count is 1. A sequence that appends to
  a shared, partly full last block first gets a fresh block and the
  ``(src, dst)`` copy to make (copy-on-write); shared full blocks are never
  copied, new tokens go to new blocks;
* with prefix caching, every full block is keyed by ``(parent_hash,
  token_ids, extra_key)``, so a new sequence whose prompt starts with cached
  blocks gets those blocks instead of computing them again. A cached block
  whose count falls to 0 stays on the device in an LRU *evictable* set until
  a new block is needed;
* ``swap_out`` moves a sequence's blocks to a host pool of its own size and
  ``swap_in`` brings them back, each returning the block pairs to copy
  (:func:`paged_numba.blocks.swap_blocks` copies them).

A device block is always in exactly one of four states: *free* (in the free
list), *cached* (count 0, evictable, content kept), *owned* (count >= 1;
*shared* when >= 2). A host block is free or *swapped* (held by one
swapped-out sequence).

``block_table()``, ``seq_lens()`` and ``slot_mapping()`` are those of
``BlockAllocator``: the tables go to the same kernels.

Three files: this one (counts, allocate, fork, append, free, tables),
:mod:`paged_numba.prefix_cache` (block keys, the cache and its LRU set) and
:mod:`paged_numba.swapping` (swap_out, swap_in, which ``BlockManager``
inherits).
"""

from collections import deque
from collections.abc import Hashable

import numpy as np

from ._checks import INT32_MAX, flag, hashable, integer
from .allocator import (NO_BLOCK, OutOfBlocksError, _check_count, _check_ids, num_blocks_for, padded_block_table,
                        slots_from_table)
from .prefix_cache import PrefixCache, block_keys, token_list
from .swapping import Swapping

__all__ = ["BlockManager", "NO_BLOCK", "OutOfBlocksError", "block_keys"]


class BlockManager(Swapping):
    """Shared KV-cache blocks: reference counts, fork and copy-on-write, prefix
    caching with LRU eviction, and swapping to a host pool.

    Parameters
    ----------
    num_blocks : int
        Device blocks in the pool (> 0).
    block_size : int
        Token slots per block (> 0).
    enable_prefix_caching : bool
        Key full blocks by their token prefix and reuse them (default False).
        Sequences allocated with ``token_ids`` then take part.
    num_host_blocks : int
        Blocks in the host pool for :meth:`swap_out` (>= 0, default 0).

    Attributes
    ----------
    prefix_cache : PrefixCache
        The block keys and the evictable blocks (:mod:`paged_numba.prefix_cache`).
    free_block_ids, free_host_block_ids : deque of int
        The device and host free lists, next block first.

    Notes
    -----
    Every method either succeeds or raises and leaves the manager unchanged:
    ``ValueError`` (naming the argument and its value) for bad arguments (an
    unhashable sequence id included), ``TypeError`` for ``token_ids`` that are
    not integers,
    :class:`OutOfBlocksError` when the device (or host) pool is too small.

    The pairs returned by :meth:`append`, :meth:`swap_out` and :meth:`swap_in`
    must be copied (:func:`~paged_numba.blocks.copy_blocks`,
    :func:`~paged_numba.blocks.swap_blocks`) before the new tokens are written
    or the next step reads the blocks. A newly allocated full block is entered
    in the prefix cache at once: the caller writes its K/V in the same step.

    Examples
    --------
    Fork, then copy-on-write of the shared, partly full last block:

    >>> m = BlockManager(num_blocks=8, block_size=4)
    >>> m.allocate("a", 6)               # ceil(6 / 4) = 2 blocks; block 1 holds 2 tokens
    ([0, 1], 0)
    >>> m.fork("a", "b")                 # "b" shares blocks 0 and 1
    >>> m.ref_count(0), m.ref_count(1)
    (2, 2)
    >>> m.append("b")                    # token 6 would go into shared block 1: copy it
    [(1, 2)]
    >>> m.block_table()
    array([[0, 1],
           [0, 2]], dtype=int32)
    >>> m.append("a")                    # block 1 is now a's alone: written in place
    []
    >>> m
    BlockManager(num_blocks=8, block_size=4, free=5, cached=0, owned=3 (shared=1), seqs=2, swapped=0/0 host blocks in 0 seqs)

    Prefix caching: a second prompt with the same first 8 tokens reuses 2 blocks:

    >>> m = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    >>> m.allocate("p", 10, token_ids=range(10))     # 10 = 2 * 4 + 2
    ([0, 1, 2], 0)
    >>> m.allocate("q", 9, token_ids=[*range(8), 99])   # prefill only token 8
    ([0, 1, 3], 8)
    >>> m.free("p"); m.free("q")
    >>> m.num_cached_blocks, m.num_free_blocks, m.hit_rate   # 2 hits of 4 looked up
    (2, 6, 0.5)
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 num_host_blocks: int = 0):
        # block ids and sequence lengths go into int32 tables
        self._num_blocks = integer("num_blocks", num_blocks, lo=1, hi=INT32_MAX)
        self._block_size = integer("block_size", block_size, lo=1, hi=INT32_MAX)
        self._caching = flag("enable_prefix_caching", enable_prefix_caching)
        self._num_host_blocks = integer("num_host_blocks", num_host_blocks, lo=0, hi=INT32_MAX)
        self.free_block_ids: deque[int] = deque(range(self._num_blocks))
        self.free_host_block_ids: deque[int] = deque(range(self._num_host_blocks))
        self._ref = [0] * self._num_blocks
        self.prefix_cache = PrefixCache(self._num_blocks, self._caching)
        # per sequence: resident block list or swapped host block list, length, tokens, extra key
        self._blocks: dict[Hashable, list[int]] = {}
        self._host: dict[Hashable, list[int]] = {}
        self._lens: dict[Hashable, int] = {}
        self._tokens: dict[Hashable, list[int] | None] = {}     # None: not in prefix caching
        self._keys: dict[Hashable, list[tuple]] = {}             # keys of its full blocks
        self._extra: dict[Hashable, Hashable] = {}

    # -- counts (read-only) ---------------------------------------------------------
    num_blocks = property(lambda self: self._num_blocks, doc="Device blocks in the pool.")
    block_size = property(lambda self: self._block_size, doc="Token slots per block.")
    num_host_blocks = property(lambda self: self._num_host_blocks, doc="Blocks in the host pool.")
    enable_prefix_caching = property(lambda self: self._caching, doc="Whether full blocks are cached.")
    num_free_blocks = property(lambda self: len(self.free_block_ids), doc="Device blocks in the free list.")
    num_cached_blocks = property(lambda self: self.prefix_cache.num_evictable,
                                 doc="Device blocks with count 0 kept for the prefix cache (evictable).")
    num_owned_blocks = property(lambda self: self._num_blocks - self.num_free_blocks - self.num_cached_blocks,
                                doc="Device blocks held by at least one sequence.")
    num_shared_blocks = property(lambda self: sum(r > 1 for r in self._ref),
                                 doc="Device blocks held by two or more sequences.")
    num_free_host_blocks = property(lambda self: len(self.free_host_block_ids), doc="Host blocks free.")
    num_swapped_blocks = property(lambda self: self._num_host_blocks - self.num_free_host_blocks,
                                  doc="Host blocks holding swapped-out sequences.")
    num_available_blocks = property(lambda self: self.num_free_blocks + self.num_cached_blocks,
                                    doc="Device blocks a new block can come from (free or evictable).")

    num_lookup_blocks = property(lambda self: self.prefix_cache.num_lookup_blocks,
                                 doc="Full prompt blocks looked up in the prefix cache.")
    num_hit_blocks = property(lambda self: self.prefix_cache.num_hit_blocks,
                              doc="Of the blocks looked up, those found.")
    num_evictions = property(lambda self: self.prefix_cache.num_evictions,
                             doc="Cached blocks evicted to make room.")
    hit_rate = property(lambda self: self.prefix_cache.hit_rate,
                        doc="``num_hit_blocks / num_lookup_blocks`` (0.0 before any lookup).")
    cached_block_ids = property(lambda self: self.prefix_cache.evictable_ids,
                                doc="The evictable cached blocks, least recently used first.")

    def ref_count(self, block: int) -> int:
        """Block tables holding device ``block``."""
        if isinstance(block, bool) or not isinstance(block, (int, np.integer)) \
                or not 0 <= block < self._num_blocks:
            raise ValueError(f"block must be an int in [0, {self._num_blocks}), but got {block!r}")
        return self._ref[block]

    # -- sequences ------------------------------------------------------------------
    @property
    def seq_ids(self) -> list:
        """Resident (not swapped-out) sequence ids, in insertion order."""
        return list(self._blocks)

    def __contains__(self, seq_id) -> bool:
        try:
            return seq_id in self._lens
        except TypeError:            # unhashable: never a sequence id
            return False

    def __len__(self) -> int:   # resident + swapped sequences
        return len(self._blocks) + len(self._host)

    def blocks_of(self, seq_id) -> list[int]:
        """Device blocks of resident ``seq_id`` in logical order (a copy)."""
        return list(self._blocks[self._check_seq(seq_id)])

    def seq_len(self, seq_id) -> int:
        """Tokens stored for ``seq_id`` (resident or swapped out)."""
        return self._lens[self._check_known(seq_id)]

    def token_ids(self, seq_id) -> list[int] | None:
        """Token ids of ``seq_id`` when prefix caching tracks them, else None."""
        t = self._tokens[self._check_known(seq_id)]
        return None if t is None else list(t)

    # -- allocate / fork / append / free ----------------------------------------------
    def _check_tokens(self, token_ids, num_tokens, name="token_ids"):
        if token_ids is None:
            return None
        tokens = token_list(name, token_ids)
        if len(tokens) != num_tokens:
            raise ValueError(f"{name} must have {num_tokens} entries (one per token), but got "
                             f"{len(tokens)}")
        return tokens

    def _plan_allocate(self, seq_id, num_tokens, token_ids, extra_key):
        if hashable("seq_id", seq_id) in self:
            raise ValueError(f"sequence {seq_id!r} is already allocated")
        num_tokens = integer("num_tokens", num_tokens, lo=0, hi=INT32_MAX)
        tokens = self._check_tokens(token_ids, num_tokens)
        hashable("extra_key", extra_key)
        needed = num_blocks_for(num_tokens, self._block_size)
        keys, hits = [], []
        if self._caching and tokens is not None:
            keys = block_keys(tokens, self._block_size, extra_key)
            # leave at least one token to compute, so the step yields its logits
            hits = self.prefix_cache.lookup(keys, (num_tokens - 1) // self._block_size if num_tokens else 0)
        reused_evictable = sum(map(self.prefix_cache.is_evictable, hits))
        new = needed - len(hits)
        if new > self.num_available_blocks - reused_evictable:
            raise OutOfBlocksError(
                f"sequence {seq_id!r} needs {new} new blocks but only "
                f"{self.num_available_blocks - reused_evictable} are free or evictable")
        return num_tokens, tokens, keys, hits, new

    def can_allocate(self, num_tokens: int, token_ids=None, extra_key=None) -> bool:
        """Whether a new sequence of ``num_tokens`` tokens fits (counting prefix-cache hits)."""
        try:
            self._plan_allocate(_Probe, num_tokens, token_ids, extra_key)
        except OutOfBlocksError:
            return False
        return True

    def allocate(self, seq_id, num_tokens: int, token_ids=None, extra_key=None) -> tuple[list[int], int]:
        """Blocks for a new sequence of ``num_tokens`` tokens, reusing cached prefix blocks.

        Parameters
        ----------
        seq_id : hashable
            A new id (not resident, not swapped out).
        num_tokens : int
            Tokens of the prompt (>= 0).
        token_ids : array or sequence of int, ``[num_tokens]``, optional
            The prompt: a 1-D NumPy integer array or a list (tuple, range) of
            ints; floats, bools and strings raise ``TypeError``. With prefix caching on, the sequence then takes part in
            it: its longest cached prefix of full blocks is reused (never all
            ``num_tokens``: at least the last token is left to compute), its new
            full blocks are entered in the cache, and :meth:`append` needs the
            new tokens' ids.
        extra_key : hashable, optional
            Part of every block key (e.g. a LoRA id): prompts with different
            extra keys share nothing.

        Returns
        -------
        blocks : list of int, ``[ceil(num_tokens / block_size)]``
            The sequence's block table.
        num_cached_tokens : int
            Tokens already in the cache (a multiple of ``block_size``): prefill only
            positions ``num_cached_tokens`` to ``num_tokens - 1``
            (``slot_mapping(seq_id, num_cached_tokens, num_tokens)``).
        """
        num_tokens, tokens, keys, hits, new = self._plan_allocate(seq_id, num_tokens, token_ids, extra_key)
        for b in hits:
            self._incref(b)
        blocks = hits + self._take(new)
        for i in range(len(hits), len(keys)):
            self.prefix_cache.register(blocks[i], keys[i])
        if self._caching and tokens is not None:
            self.prefix_cache.record(len(keys), len(hits))
        self._blocks[seq_id], self._lens[seq_id] = blocks, num_tokens
        self._tokens[seq_id] = tokens if self._caching else None
        self._keys[seq_id] = keys
        self._extra[seq_id] = extra_key
        return list(blocks), len(hits) * self._block_size

    def fork(self, parent, child) -> None:
        """Make ``child`` share all of resident ``parent``'s blocks (counts + 1).

        Nothing is copied now; the first append into a shared, partly full block
        copies that block (:meth:`append`).
        """
        self._check_seq(parent, "parent")
        if hashable("child", child) in self:
            raise ValueError(f"sequence {child!r} is already allocated")
        for b in self._blocks[parent]:
            self._incref(b)
        self._blocks[child] = list(self._blocks[parent])
        self._lens[child] = self._lens[parent]
        t = self._tokens[parent]
        self._tokens[child] = None if t is None else list(t)
        self._keys[child] = list(self._keys[parent])
        self._extra[child] = self._extra[parent]

    def _plan_append(self, seq_id, num_new_tokens):
        """``(n, cow, new)``: tokens, whether the last block is copied, new blocks."""
        self._check_seq(seq_id)
        n = _check_count(num_new_tokens, "num_new_tokens")
        old, blocks = self._lens[seq_id], self._blocks[seq_id]
        if old + n > INT32_MAX:
            raise ValueError(f"num_new_tokens={n} would make sequence {seq_id!r} {old + n} tokens "
                             f"long, but a length must be at most {INT32_MAX} (int32 tables)")
        cow = bool(n) and old % self._block_size != 0 and self._ref[blocks[-1]] > 1
        new = num_blocks_for(old + n, self._block_size) - len(blocks) + cow
        if new > self.num_available_blocks:
            raise OutOfBlocksError(f"sequence {seq_id!r} needs {new} new blocks but only "
                                   f"{self.num_available_blocks} are free or evictable")
        return n, cow, new

    def can_append(self, seq_id, num_new_tokens: int = 1) -> bool:
        """Whether ``seq_id`` can grow by ``num_new_tokens`` tokens (copy-on-write included)."""
        try:
            self._plan_append(seq_id, num_new_tokens)
        except OutOfBlocksError:
            return False
        return True

    def append(self, seq_id, num_new_tokens: int = 1, token_ids=None) -> list[tuple[int, int]]:
        """Grow resident ``seq_id`` by ``num_new_tokens`` tokens.

        Returns the copy-on-write pairs ``[(src, dst)]`` (at most one): if the
        sequence's last block is shared and partly full, it gets a fresh block
        ``dst``, and the caller copies block ``src`` to it
        (:func:`~paged_numba.blocks.copy_blocks`) before writing the new tokens.
        ``token_ids`` (``[num_new_tokens]``, integers as for :meth:`allocate`) are
        required for a sequence that takes part in prefix caching; blocks they
        fill are entered in the cache.

        Examples
        --------
        >>> m = BlockManager(num_blocks=4, block_size=2)
        >>> m.allocate("a", 2)
        ([0], 0)
        >>> m.fork("a", "b")
        >>> m.append("b")          # block 0 is shared but full: no copy, new block 1
        []
        >>> m.blocks_of("a"), m.blocks_of("b")
        ([0], [0, 1])
        >>> m.append("b", -1)
        Traceback (most recent call last):
            ...
        ValueError: num_new_tokens must be >= 0, but got -1.
        """
        n, cow, new = self._plan_append(seq_id, num_new_tokens)
        tokens = self._check_tokens(token_ids, n)
        if self._tokens[seq_id] is not None and tokens is None and n:
            raise ValueError(f"sequence {seq_id!r} takes part in prefix caching: append needs its "
                             f"{n} new token_ids, but got token_ids=None")
        if not n:
            return []
        blocks, old = self._blocks[seq_id], self._lens[seq_id]
        fresh = self._take(new)
        copies = []
        if cow:
            src, dst = blocks[-1], fresh.pop(0)
            self._decref(src)
            blocks[-1] = dst
            copies.append((src, dst))
        blocks.extend(fresh)
        self._lens[seq_id] = old + n
        seq_tokens = self._tokens[seq_id]
        if seq_tokens is not None:
            seq_tokens.extend(tokens)
            bs = self._block_size
            first, last = old // bs, (old + n) // bs      # blocks completed by this append
            if first < last:
                seq_keys = self._keys[seq_id]
                parent = hash(seq_keys[-1]) if seq_keys else None
                keys = block_keys(seq_tokens[first * bs:last * bs], bs, self._extra[seq_id], parent)
                for i, key in enumerate(keys):
                    self.prefix_cache.register(blocks[first + i], key)
                seq_keys.extend(keys)
        return copies

    def append_slots(self, seq_id, num_new_tokens: int = 1, token_ids=None):
        """:meth:`append`, then return ``(slots, copies)``: the new tokens' slots,
        int64 ``[num_new_tokens]``, and the copy-on-write pairs."""
        start = self._lens[self._check_seq(seq_id)]
        copies = self.append(seq_id, num_new_tokens, token_ids)
        return self.slot_mapping(seq_id, start, start + int(num_new_tokens)), copies

    def free(self, seq_id) -> None:
        """Forget ``seq_id``: drop its block references (resident) or host blocks (swapped).

        A device block whose count reaches 0 returns to the free list, or, if it
        is in the prefix cache, to the evictable set (most recently used; the
        sequence's last blocks are freed first, so they are evicted first).
        """
        self._check_known(seq_id)
        if seq_id in self._host:
            self.free_host_block_ids.extend(self._host.pop(seq_id))
        else:
            for b in reversed(self._blocks.pop(seq_id)):
                self._decref(b)
        del self._lens[seq_id], self._tokens[seq_id], self._keys[seq_id], self._extra[seq_id]

    # -- tables for kernels ----------------------------------------------------------------
    def slot_mapping(self, seq_id, start: int, end: int) -> np.ndarray:
        """Slots of token positions ``[start, end)`` of resident ``seq_id``, int64 ``[end - start]``."""
        n = self._lens[self._check_seq(seq_id)]
        start, end = integer("start", start), integer("end", end)
        if not 0 <= start <= end <= n:
            raise ValueError(f"need 0 <= start <= end <= seq_len, but got {start=}, {end=}, seq_len={n}")
        return slots_from_table(self._blocks[seq_id], np.arange(start, end), self._block_size)

    def block_table(self, seq_ids=None, max_blocks: int | None = None) -> np.ndarray:
        """Block tables of resident ``seq_ids`` (default: all), int32 ``[num_seqs, max_blocks]``, -1-padded."""
        return padded_block_table([self.blocks_of(s) for s in self._ids(seq_ids)], max_blocks)

    def seq_lens(self, seq_ids=None) -> np.ndarray:
        """Token counts of resident ``seq_ids`` (default: all), int32 ``[num_seqs]``."""
        ids = self._ids(seq_ids)
        for s in ids:
            self._check_seq(s)
        return np.array([self._lens[s] for s in ids], dtype=np.int32)

    # -- helpers ------------------------------------------------------------------------
    def _ids(self, seq_ids):
        return list(self._blocks) if _check_ids(seq_ids) is None else list(seq_ids)

    def _check_known(self, seq_id, name="seq_id"):
        """``seq_id`` is a hashable id of a resident or swapped-out sequence."""
        if hashable(name, seq_id) not in self._lens:
            raise ValueError(f"unknown sequence id {seq_id!r}")
        return seq_id

    def _check_seq(self, seq_id, name="seq_id"):
        """``seq_id`` is resident."""
        if self._check_known(seq_id, name) in self._host:
            raise ValueError(f"sequence {seq_id!r} is swapped out; swap_in first")
        return seq_id

    def _incref(self, b):
        if self._ref[b] == 0:
            self.prefix_cache.claim(b)
        self._ref[b] += 1

    def _decref(self, b):
        self._ref[b] -= 1
        if self._ref[b] == 0 and not self.prefix_cache.release(b):
            self.free_block_ids.append(b)

    def _take(self, n: int) -> list[int]:
        """``n`` blocks with count 1: free ones first, then the least recently used cached ones."""
        out = []
        for _ in range(n):
            b = self.free_block_ids.popleft() if self.free_block_ids else self.prefix_cache.evict()
            self._ref[b] = 1
            out.append(b)
        return out

    def __repr__(self) -> str:
        return (f"BlockManager(num_blocks={self._num_blocks}, block_size={self._block_size}, "
                f"free={self.num_free_blocks}, cached={self.num_cached_blocks}, "
                f"owned={self.num_owned_blocks} (shared={self.num_shared_blocks}), "
                f"seqs={len(self._blocks)}, swapped={self.num_swapped_blocks}/{self._num_host_blocks} "
                f"host blocks in {len(self._host)} seqs"
                + (f", prefix_cache={len(self.prefix_cache)} blocks, hit_rate={100 * self.hit_rate:.1f}%"
                   if self._caching else "") + ")")


class _Probe:
    """A sequence id no caller can hold, for ``can_allocate``."""
