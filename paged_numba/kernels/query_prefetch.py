"""The next item's queries, copied a few at a time inside the key loop
(``prefetch_queries`` of :func:`kernels.prefill_wgmma_ws.prefill_wgmma_ws_kernel`).

A consumer warp of a persistent block owns 16 query rows of each item and
copies them into shared memory before the item's products can start. With
``prefetch_queries`` it copies the rows of its block's *next* item into a
second buffer while it works on this one, so that the next item finds them
there. Issued all at once at the item's start, those 16-byte copies queue
behind the producer's K/V copies for the multiprocessor's memory pipeline,
and the item's first products wait until the last of them has been issued.
Here the copies are *owed* at the item's start and paid a step at a time,
each time the warpgroup has issued products and passed its turn, before it
waits for them, so that the wait for an issue slot overlaps the tensor
cores' work: the first step reads the next item's range (dependent loads),
each later one starts one 16-byte copy a lane; whatever is still owed when
the item's key loop ends is paid then. The owed work is eight ``int32`` (a
local array, ``OWED_WORDS``): the steps left (``RANGE`` before the range is
read, then the copies a lane still to start, 0 when nothing is owed), the
buffer's flat offset, the next item's ``row0, q0, nq``, its first head and
tile, and whether it has queries to copy (1 once its copies are started).
"""
from types import SimpleNamespace

from numba import int32

from .access import device_function
from .async_copy import commit_group

OWED_WORDS = 8
RANGE = -1


def query_prefetch_parts(P, work_item, pass_turn):
    """``owe``, ``step``, ``settle`` and ``pass_turn_paying`` for tile parts
    ``P`` (:func:`kernels.prefill_tc_parts.tile_parts`), the items'
    ``work_item`` (:func:`kernels.prefill_items.item_parts`) and the ring's
    ``pass_turn``. ``q`` below is the tuple ``(sm, query, num_heads, lane,
    warp, cu_seqlens_q, seq_lens, tile_seq, tile_q0, causal, window,
    tables)``; the key loop's tuple ``a`` carries ``owed`` at ``a[3]`` and
    ``q`` at ``a[4]``."""
    WARP_QCHUNKS = P.WARP_QCHUNKS
    COPIES = WARP_QCHUNKS // 32           # a lane's 16-byte copies of its warp's rows
    tile_range, load_chunk = P.tile_range, P.load_query_chunk_at

    @device_function
    def owe(owed, rnd, items, num_heads, qbase):
        """At the start of round ``rnd``'s item: the queries of the next
        round's item owed into the buffer at flat ``qbase`` (nothing when the
        block has no next item)."""
        tile, h0, real = work_item(rnd + 1, items, num_heads)
        owed[0] = int32(RANGE) if real else int32(0)
        owed[1] = qbase
        owed[5] = h0
        owed[6] = tile
        owed[7] = 0

    @device_function
    def step(owed, q):
        """Pay one step of what ``owed`` holds (nothing when nothing is owed)."""
        k = owed[0]
        if k == RANGE:
            _, _, _, _, _, cu_seqlens_q, seq_lens, tile_seq, tile_q0, causal, window, tables = q
            _, row0, q0, nq, _, _, _, ntiles, _ = tile_range(
                owed[6], cu_seqlens_q, seq_lens, tile_seq, tile_q0, causal, window, tables)
            owed[2] = row0
            owed[3] = q0
            owed[4] = nq
            owed[0] = int32(COPIES) if ntiles > 0 else int32(0)
        elif k > 0:
            sm, query, num_heads, lane, warp = q[0], q[1], q[2], q[3], q[4]
            load_chunk(sm, owed[1], query, warp * WARP_QCHUNKS + lane + (COPIES - k) * 32,
                       owed[2], owed[3], owed[4], owed[5], num_heads)
            owed[0] = k - 1
            owed[7] = 1
            if k == 1:
                commit_group()

    @device_function
    def settle(owed, q):
        """Pay whatever is still owed; whether the next item's queries are
        on their way."""
        while owed[0] != 0:
            step(owed, q)
        return owed[7] != 0

    @device_function
    def pass_turn_paying(last, a):
        """The ring's ``pass_turn``, then one step of the owed copies."""
        pass_turn(last, a)
        step(a[3], a[4])

    return SimpleNamespace(owe=owe, step=step, settle=settle,
                           pass_turn_paying=pass_turn_paying)
