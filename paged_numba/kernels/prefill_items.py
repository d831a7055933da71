"""The work items of the producer prefill kernel's blocks
(:func:`kernels.prefill_wgmma_ws.prefill_wgmma_ws_kernel`).

An item is a (query tile, head block) pair. A block that is not persistent
has one, from its grid position; a persistent block takes item ``b`` of each
round of ``gridDim.x`` items, then item ``gridDim.x - 1 - b`` of the next (a
serpentine). With ``prefetch_ranges`` each warp reads the next item's tile
entries and its sequence's bounds a round early, a value a lane, and takes
them by shuffles when the item starts.
"""
from types import SimpleNamespace

from numba import cuda, int32

from .access import device_function
from .prefill_tc_io import cuda_function
from .prefill_tc_parts import FULL_MASK


def item_parts(P, persistent, prefetch_ranges):
    """``rounds``, ``work_item``, ``item_range``, ``next_entries`` and
    ``next_bounds`` for tile parts ``P`` (heads ``P.HPB`` a block)."""
    HPB = P.HPB
    PERSISTENT = bool(persistent)
    RANGES = bool(prefetch_ranges)
    tile_range, range_of = P.tile_range, P.range_of

    @cuda_function
    def rounds(num_tiles, num_heads):
        """The block's rounds of work items, and the number of items."""
        if PERSISTENT:
            items = num_tiles * (num_heads // HPB)
            return int32((items + cuda.gridDim.x - 1) // cuda.gridDim.x), int32(items)
        return int32(1), int32(1)

    @cuda_function
    def work_item(rnd, items, num_heads):
        """Round ``rnd``'s item of this block: ``(tile, first head, whether
        there is one)`` (the serpentine order of a persistent block)."""
        if PERSISTENT:
            b = cuda.blockIdx.x if rnd % 2 == 0 else cuda.gridDim.x - 1 - cuda.blockIdx.x
            w = int32(rnd * cuda.gridDim.x + b)
            nhb = num_heads // HPB
            return int32(w // nhb), int32((w % nhb) * HPB), w < items
        return int32(cuda.blockIdx.x), int32(cuda.blockIdx.y * HPB), True

    @device_function
    def item_range(rnd, tile, nx, cu_seqlens_q, seq_lens, tile_seq, tile_q0, causal, window,
                   tables):
        """:func:`kernels.prefill_tc_parts.tile_parts`' ``tile_range`` of round ``rnd``'s ``tile``, from the values
        :func:`next_entries` and :func:`next_bounds` read into ``nx`` during
        the last round (with ``prefetch_ranges``; else read now). Each lane
        read one of them (an address that differs by lane: a warp-uniform one
        would be moved to a uniform register as soon as it lands, which waits
        for it there); the warp's lanes share them by shuffles."""
        if RANGES and rnd > 0:
            return range_of(cuda.shfl_sync(FULL_MASK, nx[0], 0),
                            cuda.shfl_sync(FULL_MASK, nx[0], 1),
                            cuda.shfl_sync(FULL_MASK, nx[1], 0),
                            cuda.shfl_sync(FULL_MASK, nx[1], 1),
                            cuda.shfl_sync(FULL_MASK, nx[1], 2), causal, window, tables)
        return tile_range(tile, cu_seqlens_q, seq_lens, tile_seq, tile_q0, causal, window,
                          tables)

    @device_function
    def next_entries(rnd, items, num_heads, nx, tile_seq, tile_q0, lane):
        """Start reading round ``rnd + 1``'s tile entries into ``nx[0]`` (lane 0
        ``tile_seq``, the others ``tile_q0``; used from :func:`next_bounds`
        on, long after: the loads do not stall). Past the last item the last
        tile's, unused (no condition, so nothing selects on the loaded value)."""
        if RANGES:
            ntile = min(work_item(rnd + 1, items, num_heads)[0], tile_seq.shape[0] - 1)
            nx[0] = tile_seq[ntile] if lane == 0 else tile_q0[ntile]

    @device_function
    def next_bounds(rnd, items, num_heads, nx, cu_seqlens_q, seq_lens, lane):
        """Start reading the bounds of round ``rnd + 1``'s sequence into
        ``nx[1]``: lanes 0 and 1 ``cu_seqlens_q[seq]``, ``[seq + 1]``, the others
        ``seq_lens[seq]``."""
        if RANGES:
            nseq = cuda.shfl_sync(FULL_MASK, nx[0], 0)
            nx[1] = cu_seqlens_q[nseq + lane] if lane < 2 else seq_lens[nseq]

    return SimpleNamespace(rounds=rounds, work_item=work_item, item_range=item_range,
                           next_entries=next_entries, next_bounds=next_bounds)
