"""Prefix cache of :class:`~paged_numba.block_manager.BlockManager`: full KV
blocks keyed by their token prefix, and the LRU set of cached blocks that no
sequence holds (plain Python, no numba).

The key of a full block is ``(hash(key of the block before), its token ids,
extra_key)`` (:func:`block_keys`), so two prompts that start with the same
tokens get the same keys for the blocks they share, as in vLLM's automatic
prefix caching. :class:`PrefixCache` maps keys to device blocks. The block
manager keeps the reference counts: it calls :meth:`PrefixCache.claim` when a
block's count goes from 0 to 1 and :meth:`PrefixCache.release` when it falls
to 0, and :meth:`PrefixCache.evict` when it needs a block and the free list
is empty.
"""

import reprlib
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Set

import numpy as np

from ._checks import INT32_MAX, _is_int, flag, hashable, integer

__all__ = ["PrefixCache", "block_keys", "token_list"]


def token_list(name, token_ids) -> list[int]:
    """``token_ids`` as a list of Python ints, after checking that it is a 1-D
    NumPy integer array or an iterable (list, tuple, range) of integers.

    Bools, floats (even ``2.0``), strings and float arrays raise ``TypeError``
    naming ``name`` (and the index of the first bad entry): a token id is an
    index into a vocabulary, never rounded.

    Parameters
    ----------
    name : str
        The argument's name, for the message.
    token_ids : array or iterable of int, ``[num_tokens]``

    Returns
    -------
    list of int, ``[num_tokens]``

    Examples
    --------
    >>> token_list("token_ids", np.arange(3))
    [0, 1, 2]
    >>> token_list("token_ids", [1.5, 2.0])
    Traceback (most recent call last):
        ...
    TypeError: token_ids[0] must be an integer, but got 1.5 (float).
    >>> token_list("token_ids", np.array([1.0, 2.0]))
    Traceback (most recent call last):
        ...
    TypeError: token_ids must hold integers, but got dtype float64.
    """
    if isinstance(token_ids, np.ndarray):
        if token_ids.dtype == np.bool_ or not np.issubdtype(token_ids.dtype, np.integer):
            raise TypeError(f"{name} must hold integers, but got dtype {token_ids.dtype.name}.")
        if token_ids.ndim != 1:
            raise TypeError(f"{name} must be a 1-D array of integers, but got shape {token_ids.shape}.")
        return token_ids.tolist()
    if isinstance(token_ids, (str, bytes, Set, Mapping)) or not isinstance(token_ids, Iterable):
        # (a set or a dict has no token order)
        raise TypeError(f"{name} must be a list or 1-D array of integers, but got "
                        f"{reprlib.repr(token_ids)} ({type(token_ids).__name__}).")
    tokens = list(token_ids)
    for i, t in enumerate(tokens):
        if not _is_int(t):
            raise TypeError(f"{name}[{i}] must be an integer, but got {t!r} ({type(t).__name__}).")
    return [int(t) for t in tokens]


def block_keys(token_ids, block_size: int, extra_key=None, parent=None) -> list[tuple]:
    """Prefix-cache keys of the full blocks of ``token_ids``.

    The key of block ``i`` is ``(hash(key of block i - 1), tokens of block i,
    extra_key)`` (``parent`` hash, default ``None``, for block 0), so equal keys
    mean equal token prefixes up to 64-bit hash collisions of the parent; the
    block's own tokens are compared exactly. A partly full last block has no key.

    Parameters
    ----------
    token_ids : array or sequence of int, ``[num_tokens]``
        Integers only (:func:`token_list`: anything else raises ``TypeError``).
    block_size : int
        Tokens per block (> 0).
    extra_key : hashable, optional
        Anything else the cached K/V depend on (a LoRA id, an image hash).
    parent : int, optional
        Hash of the key before ``token_ids[0]``'s block.

    Returns
    -------
    list of tuples, ``[num_tokens // block_size]``

    Examples
    --------
    >>> keys = block_keys([5, 6, 7, 8, 9], block_size=2)   # 5 = 2 * 2 + 1: two full blocks
    >>> len(keys), keys[0]
    (2, (None, (5, 6), None))
    >>> keys[1][0] == hash(keys[0]), keys[1][1]
    (True, (7, 8))
    """
    tokens = token_list("token_ids", token_ids)
    block_size = integer("block_size", block_size, lo=1)
    hashable("extra_key", extra_key)
    if parent is not None:
        parent = integer("parent", parent)
    keys = []
    for i in range(len(tokens) // block_size):
        key = (parent, tuple(tokens[i * block_size:(i + 1) * block_size]), extra_key)
        keys.append(key)
        parent = hash(key)
    return keys


class PrefixCache:
    """Device blocks by block key, and the evictable (count 0) cached blocks.

    A block is *cached* while it holds a key. A cached block that no sequence
    holds is *evictable*: its contents stay on the device, in least recently
    used order, until :meth:`evict` hands it out again.

    Parameters
    ----------
    num_blocks : int
        Device blocks in the pool.
    enabled : bool
        When False, :meth:`register` caches nothing (and nothing is ever found).

    Examples
    --------
    >>> c = PrefixCache(num_blocks=4)
    >>> keys = block_keys([1, 2, 3, 4], block_size=2)
    >>> c.register(0, keys[0]); c.register(1, keys[1])
    >>> c.lookup(keys, max_blocks=2)
    [0, 1]
    >>> c.release(1), c.release(0), c.release(2)   # counts fell to 0; block 2 has no key
    (True, True, False)
    >>> c.evictable_ids                              # least recently used first
    [1, 0]
    >>> c.evict(), c.lookup(keys, max_blocks=2)      # block 1's key is gone: the prefix stops
    (1, [0])
    >>> c.num_evictions, len(c)
    (1, 1)
    """

    def __init__(self, num_blocks: int, enabled: bool = True):
        num_blocks = integer("num_blocks", num_blocks, lo=0, hi=INT32_MAX)
        self.enabled = flag("enabled", enabled)
        self._block_of: dict[tuple, int] = {}                          # key -> block
        self._key_of: list[tuple | None] = [None] * num_blocks         # block -> key
        self._evictable: OrderedDict[int, None] = OrderedDict()        # count 0, LRU first
        self.num_lookup_blocks = 0      # full prompt blocks looked up
        self.num_hit_blocks = 0         # of them, found
        self.num_evictions = 0          # cached blocks evicted to make room

    def __len__(self) -> int:
        """Cached keys (blocks held by sequences included)."""
        return len(self._block_of)

    def __eq__(self, other) -> bool:
        return type(other) is PrefixCache and vars(self) == vars(other)

    @property
    def hit_rate(self) -> float:
        """``num_hit_blocks / num_lookup_blocks`` (0.0 before any lookup)."""
        return self.num_hit_blocks / self.num_lookup_blocks if self.num_lookup_blocks else 0.0

    @property
    def evictable_ids(self) -> list[int]:
        """The evictable blocks, least recently used first."""
        return list(self._evictable)

    @property
    def num_evictable(self) -> int:
        """Cached blocks that no sequence holds."""
        return len(self._evictable)

    def items(self):
        """``(key, block)`` pairs of every cached block."""
        return self._block_of.items()

    def get(self, key):
        """The block cached under ``key``, or None."""
        return self._block_of.get(key)

    def is_evictable(self, block: int) -> bool:
        return block in self._evictable

    def _block(self, block) -> int:
        """``block`` checked: an integer id of the pool."""
        return integer("block", block, lo=0, hi=len(self._key_of) - 1)

    def lookup(self, keys: list[tuple], max_blocks: int) -> list[int]:
        """Cached blocks of the longest cached prefix of ``keys`` (a list of
        :func:`block_keys`), at most ``max_blocks`` (changes nothing;
        :meth:`record` counts the lookup)."""
        if not isinstance(keys, list):       # (a tuple is one key)
            raise TypeError(f"keys must be a list of block keys, but got "
                            f"{reprlib.repr(keys)} ({type(keys).__name__}).")
        max_blocks = integer("max_blocks", max_blocks, lo=0)
        hits = []
        for key in keys[:max_blocks]:
            block = self._block_of.get(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def record(self, num_lookups: int, num_hits: int) -> None:
        """Count a prompt's lookup of ``num_lookups`` full blocks, ``num_hits`` found."""
        num_lookups = integer("num_lookups", num_lookups, lo=0)
        num_hits = integer("num_hits", num_hits, lo=0, hi=num_lookups)
        self.num_lookup_blocks += num_lookups
        self.num_hit_blocks += num_hits

    def register(self, block: int, key: tuple) -> None:
        """Enter full ``block`` under ``key`` (one of :func:`block_keys`), unless
        another block holds that key."""
        block = self._block(block)
        if not isinstance(key, tuple):
            raise TypeError(f"key must be a block key (a tuple from block_keys), but got "
                            f"{reprlib.repr(key)} ({type(key).__name__}).")
        hashable("key", key)
        if self.enabled and key not in self._block_of:
            self._block_of[key] = block
            self._key_of[block] = key

    def claim(self, block: int) -> None:
        """A sequence takes evictable ``block`` (its count goes from 0 to 1)."""
        if self._block(block) not in self._evictable:
            raise ValueError(f"block {block} is not evictable (cached with no holder), so it "
                             f"cannot be claimed")
        del self._evictable[block]

    def release(self, block: int) -> bool:
        """``block``'s count fell to 0: keep it as the most recently used evictable
        block if it is cached (True), else the caller frees it (False)."""
        if self._key_of[self._block(block)] is None:
            return False
        self._evictable[block] = None
        return True

    def evict(self) -> int:
        """Forget the least recently used evictable block's key and return the block."""
        if not self._evictable:
            raise ValueError("no evictable block: every cached block is held by a sequence")
        block, _ = self._evictable.popitem(last=False)
        del self._block_of[self._key_of[block]]
        self._key_of[block] = None
        self.num_evictions += 1
        return block
