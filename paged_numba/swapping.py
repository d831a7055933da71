"""Swapping of :class:`~paged_numba.block_manager.BlockManager`: whole
sequences move to a host pool and back (plain Python, no numba).

``swap_out`` gives a resident sequence host blocks of the pool's free list
and drops its device references; ``swap_in`` takes device blocks for it
again, reusing full blocks that are still in the prefix cache. Both return
the block pairs to copy, which :func:`paged_numba.blocks.swap_blocks` copies.
"""

from .allocator import OutOfBlocksError

__all__ = ["Swapping"]


class Swapping:
    """The swap methods of :class:`~paged_numba.block_manager.BlockManager`,
    which inherits them. They use the manager's state: ``_blocks`` (resident
    sequences' device blocks), ``_host`` (swapped sequences' host blocks),
    ``free_host_block_ids``, the prefix cache and the reference counts
    (``_incref``, ``_decref``, ``_take``).
    """

    @property
    def swapped_seq_ids(self) -> list:
        """Swapped-out sequence ids, in the order they were swapped out."""
        return list(self._host)

    def is_swapped(self, seq_id) -> bool:
        """Whether ``seq_id`` is swapped out."""
        return self._check_known(seq_id) in self._host

    def host_blocks_of(self, seq_id) -> list[int]:
        """Host blocks of swapped-out ``seq_id`` in logical order (a copy)."""
        if self._check_known(seq_id) not in self._host:
            raise ValueError(f"sequence {seq_id!r} is not swapped out")
        return list(self._host[seq_id])

    def can_swap_out(self, seq_id) -> bool:
        """Whether the host pool has room for resident ``seq_id``'s blocks."""
        return len(self._blocks[self._check_seq(seq_id)]) <= self.num_free_host_blocks

    def swap_out(self, seq_id) -> list[tuple[int, int]]:
        """Move resident ``seq_id`` to the host pool.

        Returns ``[(device_block, host_block)]`` in logical order; copy them
        (``swap_blocks(cache, host_pool, pairs)``) before the device blocks are
        reused. The device references are dropped as in :meth:`BlockManager.free` (a block
        shared with another sequence stays on the device for it; a cached block
        stays evictable). Raises :class:`OutOfBlocksError` if the host pool is too small.
        """
        blocks = self._blocks[self._check_seq(seq_id)]
        if len(blocks) > self.num_free_host_blocks:
            raise OutOfBlocksError(f"sequence {seq_id!r} needs {len(blocks)} host blocks but only "
                                   f"{self.num_free_host_blocks} are free")
        host = [self.free_host_block_ids.popleft() for _ in blocks]
        for b in reversed(blocks):
            self._decref(b)
        del self._blocks[seq_id]
        self._host[seq_id] = host
        return list(zip(blocks, host))

    def _plan_swap_in(self, seq_id):
        self._check_known(seq_id)
        if seq_id not in self._host:
            raise ValueError(f"sequence {seq_id!r} is not swapped out")
        host = self._host[seq_id]
        hits = [None] * len(host)
        keys = []
        if self._tokens[seq_id] is not None:     # full blocks still cached on the device need no copy
            keys = self._keys[seq_id]
            hits[:len(keys)] = [self.prefix_cache.get(k) for k in keys]
        reused = [b for b in hits if b is not None]
        new = len(host) - len(reused)
        available = self.num_available_blocks - sum(map(self.prefix_cache.is_evictable, reused))
        if new > available:
            raise OutOfBlocksError(f"sequence {seq_id!r} needs {new} new blocks but only "
                                   f"{available} are free or evictable")
        return host, hits, keys, new

    def can_swap_in(self, seq_id) -> bool:
        """Whether swapped-out ``seq_id`` fits on the device again."""
        try:
            self._plan_swap_in(seq_id)
        except OutOfBlocksError:
            return False
        return True

    def swap_in(self, seq_id) -> list[tuple[int, int]]:
        """Bring swapped-out ``seq_id`` back to the device.

        Returns ``[(host_block, device_block)]`` to copy
        (``swap_blocks(host_pool, cache, pairs)``) before the sequence is used.
        Full blocks still in the prefix cache on the device are taken from it
        and need no copy. The host blocks return to the host free list.

        Examples
        --------
        >>> from paged_numba.block_manager import BlockManager
        >>> m = BlockManager(num_blocks=4, block_size=2, num_host_blocks=4)
        >>> m.allocate("a", 3)
        ([0, 1], 0)
        >>> m.swap_out("a")
        [(0, 0), (1, 1)]
        >>> m.free_block_ids       # a's blocks went back last block first
        deque([2, 3, 1, 0])
        >>> m.allocate("b", 2)
        ([2], 0)
        >>> m.swap_in("a")         # host 0 -> device 3, host 1 -> device 1
        [(0, 3), (1, 1)]
        >>> m.swap_in("a")
        Traceback (most recent call last):
            ...
        ValueError: sequence 'a' is not swapped out
        """
        host, hits, keys, new = self._plan_swap_in(seq_id)
        for b in hits:
            if b is not None:
                self._incref(b)
        fresh = iter(self._take(new))
        blocks, copies = [], []
        for i, (h, b) in enumerate(zip(host, hits)):
            if b is None:
                b = next(fresh)
                copies.append((h, b))
                if i < len(keys):
                    self.prefix_cache.register(b, keys[i])
            blocks.append(b)
        del self._host[seq_id]
        self.free_host_block_ids.extend(host)
        self._blocks[seq_id] = blocks
        return copies
