"""What a persistent block's consumer warp hands from one item to the next
inside the key loop (``prefetch_queries`` and ``deferred_stores`` of
:func:`kernels.prefill_wgmma_ws.prefill_wgmma_ws_kernel`).

A consumer warp owns 16 query rows of each item: it copies them into shared
memory before the item's products can start, and after the products it
stages its output rows in the same shared memory and stores them. With
``prefetch_queries`` there are two such buffers, used by the items in turn,
and the warp copies the rows of its block's *next* item into the other
buffer while it works on this one. Issued all at once at the item's start,
those 16-byte copies queue behind the producer's K/V copies for the
multiprocessor's memory pipeline, and the item's first products wait until
the last of them has been issued; the 16-byte stores of the output rows do
the same at the item's end. Here such work is *owed* and paid a step at a
time, each time the warpgroup has issued products and passed its turn,
before it waits for them, so that the wait for an issue slot overlaps the
tensor cores' work:

* with ``deferred_stores``, first the stores of the item before (staged in
  the buffer that the next item's queries go into), one 16-byte store a
  lane a step;
* then the next item's range (dependent loads), once;
* then the next item's query copies, one 16-byte copy a lane a step (one
  commit group).

Whatever a short item's loop leaves is paid when the item ends (``settle``),
and the block's last stores after its last item. The owed work is
``OWED_WORDS`` ``int32`` (a local array): the copy steps left (``RANGE``
before the range is read, 0 when nothing is owed), the copies' buffer (a
flat offset), the next item's ``row0, q0, nq``, first head and tile,
whether its copies have started; the store steps left, the stores' buffer
and the stored item's ``row0, q0, nq`` and first head.
"""
from types import SimpleNamespace

from numba import cuda, int32

from .async_copy import commit_group
from .prefill_tc_io import cuda_function

OWED_WORDS = 14
RANGE = -1


def handover_parts(P, work_item, pass_turn, deferred_stores=False):
    """``owe``, ``owe_stores``, ``step``, ``settle`` and
    ``pass_turn_paying`` for tile parts ``P``
    (:func:`kernels.prefill_tc_parts.tile_parts`), the items' ``work_item``
    (:func:`kernels.prefill_items.item_parts`) and the ring's ``pass_turn``.
    ``q`` below is the tuple ``(sm, query, num_heads, lane, warp,
    cu_seqlens_q, seq_lens, tile_seq, tile_q0, causal, window, tables,
    out)``; the key loop's tuple ``a`` carries ``owed`` at ``a[3]`` and ``q``
    at ``a[4]``."""
    WARP_QCHUNKS = P.WARP_QCHUNKS
    STEPS = WARP_QCHUNKS // 32            # a lane's 16-byte copies (or stores) of its warp's rows
    tile_range, load_chunk, store_chunk = P.tile_range, P.load_query_chunk_at, P.store_chunk
    DEFER = bool(deferred_stores)

    @cuda_function
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

    @cuda_function
    def owe_stores(owed, qbase, row0, q0, nq, h0):
        """At an item's end (``deferred_stores``): its rows, staged at flat
        ``qbase``, owed to the output."""
        owed[8] = int32(STEPS)
        owed[9] = qbase
        owed[10] = row0
        owed[11] = q0
        owed[12] = nq
        owed[13] = h0

    @cuda_function
    def step(owed, q):
        """Pay one step of what ``owed`` holds (nothing when nothing is owed)."""
        k = owed[0]
        if DEFER and owed[8] > 0:
            n = owed[8]
            store_chunk(q[12], q[0], owed[9], q[4], q[3] + (STEPS - n) * 32, owed[12],
                        owed[10], owed[11], owed[13])
            owed[8] = n - 1
        elif k == RANGE:
            if DEFER:           # every lane's stores have read the buffer the copies refill
                cuda.syncwarp()
            _, _, _, _, _, cu_seqlens_q, seq_lens, tile_seq, tile_q0, causal, window, tables, \
                _ = q
            _, row0, q0, nq, _, _, _, ntiles, _ = tile_range(
                owed[6], cu_seqlens_q, seq_lens, tile_seq, tile_q0, causal, window, tables)
            owed[2] = row0
            owed[3] = q0
            owed[4] = nq
            owed[0] = int32(STEPS) if ntiles > 0 else int32(0)
        elif k > 0:
            load_chunk(q[0], owed[1], q[1], q[4] * WARP_QCHUNKS + q[3] + (STEPS - k) * 32,
                       owed[2], owed[3], owed[4], owed[5], q[2])
            owed[0] = k - 1
            owed[7] = 1
            if k == 1:
                commit_group()

    @cuda_function
    def settle(owed, q):
        """Pay whatever is still owed; whether the next item's queries are
        on their way."""
        while owed[0] != 0 or (DEFER and owed[8] != 0):
            step(owed, q)
        return owed[7] != 0

    @cuda_function
    def pass_turn_paying(last, a):
        """The ring's ``pass_turn``, then one step of the owed work."""
        pass_turn(last, a)
        step(a[3], a[4])

    return SimpleNamespace(owe=owe, owe_stores=owe_stores, step=step, settle=settle,
                           pass_turn_paying=pass_turn_paying)
