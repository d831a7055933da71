"""The producer warpgroup's loops of the warp-specialised prefill kernel
(:func:`kernels.prefill_wgmma_ws.prefill_wgmma_ws_kernel`): over the block's
work items and each item's K/V tiles, claiming a ring stage, copying the
tile into it and publishing it to the consumers.

* :func:`joint_producer`: one ring whose stage holds a tile's keys and
  values (:mod:`kernels.prefill_ring`), by ``cp.async`` gathers (or, with
  tensor maps, box copies of whole tiles: :mod:`kernels.prefill_tma`), or
  for an fp8 cache through a staging ring that the producer widens
  (:mod:`kernels.prefill_fp8`);
* :func:`split_producer`: a K ring and a V ring, warps 0-1 copying keys and
  warps 2-3 values (:mod:`kernels.prefill_split_ring`).

The joint producer issues tile ``g``'s copies before waiting for tile ``g -
1``'s, so a thread has two tiles of copies in flight (with mbarriers the
copies arrive for it as they land, and it never waits for them); the split
producer publishes tile ``g - S + 1`` before claiming tile ``g``'s stage (see
:func:`split_producer`).
"""
from numba import cuda, int32

from . import tma
from .async_copy import wait_group
from .prefill_split_ring import HALF, row_copies
from .prefill_tc_io import cuda_function
from .access import device_function


def item_opening(I, merge):
    """``open_item(rnd, tile, h0, nx, cu_seqlens_q, seq_lens, tile_seq, tile_q0,
    causal, window, tables, items, num_heads, tid, mrows)``, what both
    producers do as an item begins: its key range ``(seq, kv_lo, kv_hi,
    ntiles, kv_first)`` (:func:`kernels.prefill_items.item_parts` ``I``), the
    next item's table entries asked for, and with ``merge`` the item's ``row0,
    q0, nq, h0`` left in ``mrows``."""
    item_range, next_entries, MERGE = I.item_range, I.next_entries, bool(merge)

    @device_function
    def open_item(rnd, tile, h0, nx, cu_seqlens_q, seq_lens, tile_seq, tile_q0, causal, window,
                  tables, items, num_heads, tid, mrows):
        seq, row0, q0, nq, pos0, kv_lo, kv_hi, ntiles, kv_first = item_range(
            rnd, tile, nx, cu_seqlens_q, seq_lens, tile_seq, tile_q0, causal, window, tables)
        next_entries(rnd, items, num_heads, nx, tile_seq, tile_q0, tid & 31)
        if MERGE:
            mrows[0], mrows[1], mrows[2], mrows[3] = row0, q0, nq, h0
        return seq, kv_lo, kv_hi, ntiles, kv_first

    return open_item


def joint_producer(P, I, R, mark, merge, fp8=None, tmaps=None, mbar_at=None):
    """The producer of a joint ring: ``produce(sm, words, key_cache,
    value_cache, tables, cu_seqlens_q, seq_lens, tile_seq, tile_q0, causal,
    window, errors, maps, bars, num_rounds, items, num_heads, group, tid,
    mrows)``, run by the producer warpgroup's 128 threads, the block's items
    taken as :func:`kernels.prefill_items.item_parts` ``I`` gives them, ``R``
    the ring's barriers (:func:`kernels.prefill_ring.ring_parts`), ``mark``
    the kernel's timeline stamps; with ``merge`` the last item's ``row0, q0,
    nq, h0`` are left in ``mrows``. ``fp8``: the staging ring's parts
    (:func:`kernels.prefill_fp8.fp8_parts`); ``tmaps``: the box copies'
    (:func:`kernels.prefill_tma.tma_parts`); ``mbar_at``: the stages'
    mbarriers in ``bars`` (the copies arrive at them), else None."""
    STAGES, BN = P.STAGES, P.BN
    FP8, TMAPS, MBAR = fp8 is not None, tmaps is not None, mbar_at is not None
    MBAR_AT = mbar_at if MBAR else 0
    PERSISTENT = R.PERSISTENT
    bar_sync, EMPTY, publish = R.bar_sync, R.EMPTY, R.publish
    kv_slot, row_of, chunk_of, tile_entries = P.kv_slot, P.row_of, P.chunk_of, P.tile_entries
    k_strides, v_strides, wait_all, issue_entries = (P.k_strides, P.v_strides, P.wait_all,
                                                     P.issue_entries)
    work_item, next_bounds, open_item = I.work_item, I.next_bounds, item_opening(I, merge)
    wait_older = wait_group(1)            # all but this thread's newest group of copies
    fp8_issue, fp8_widen, fp8_strides = ((fp8.issue, fp8.widen, fp8.strides) if FP8 else
                                         (None, None, None))
    if TMAPS:
        whole_tiles, issue_boxes = tmaps.whole_tiles, tmaps.issue_boxes
    else:
        issue_boxes = None

        @device_function
        def whole_tiles(kv_first, kv_hi):
            return int32(0)

    @device_function
    def land(words, g, tid):
        """(fp8) Tile ``g``'s codes copied by this thread landed: widen them
        into its stage once the consumers are done with the stage's last
        tile, then publish it."""
        if g >= STAGES:
            bar_sync(EMPTY + g % STAGES)
        fp8_widen(words, g, g % STAGES, tid)
        publish(g)

    @cuda_function
    def produce(sm, words, key_cache, value_cache, tables, cu_seqlens_q, seq_lens, tile_seq,
                tile_q0, causal, window, errors, maps, bars, num_rounds, items, num_heads,
                group, tid, mrows):
        tid_slot = kv_slot(0, row_of(tid), chunk_of(tid))
        done = int32(0)             # tiles of the ring so far
        nx = cuda.local.array(2, int32)     # the next item's range, read ahead
        for rnd in range(num_rounds):
            tile, h0, real = work_item(rnd, items, num_heads)
            if real:
                mark(errors, rnd, 0, 0, tid)
                kvh = h0 // group
                if FP8:
                    kstr, vstr = fp8_strides(key_cache, value_cache, kvh, tid)
                else:
                    kstr = k_strides(key_cache, kvh, chunk_of(tid))
                    vstr = v_strides(value_cache, kvh, chunk_of(tid))
                mark(errors, rnd, 0, 4, tid)
                seq, kv_lo, kv_hi, ntiles, kv_first = open_item(
                    rnd, tile, h0, nx, cu_seqlens_q, seq_lens, tile_seq, tile_q0, causal,
                    window, tables, items, num_heads, tid, mrows)
                last = int32(kv_hi - 1)
                boxed = whole_tiles(kv_first, kv_hi)     # its first tiles by boxes
                mark(errors, rnd, 0, 1, tid)
                for j in range(ntiles):
                    g = done + j
                    kt = int32(kv_first + j * BN)
                    # the table entries first: their latency passes in the wait
                    entries = tile_entries(tables, seq, kt, kv_lo, last, tid,
                                           key_cache.shape[0])
                    if FP8:     # codes into staging; the last tile's widened
                        fp8_issue(sm, key_cache, value_cache, tables, seq, kt, kv_lo, last,
                                  g, tid, kstr, vstr, entries)
                        if g >= 1:
                            wait_older()
                            land(words, g - 1, tid)
                    else:
                        if g >= STAGES:     # the consumers are done with tile g - STAGES
                            bar_sync(EMPTY + g % STAGES)
                        if TMAPS and j < boxed:     # a whole tile: by box copies
                            issue_boxes(sm, maps, key_cache, value_cache, tables, seq, kvh,
                                        kt, g % STAGES, tid, entries, bars)
                        else:
                            issue_entries(sm, key_cache, value_cache, tables, seq, kvh, kt,
                                          kv_lo, last, g % STAGES, tid, kstr, vstr,
                                          tid_slot, entries)
                            if MBAR:    # the hardware arrives once they land
                                tma.copies_arrive(bars, MBAR_AT + g % STAGES)
                        if not MBAR and g >= 1:
                            wait_older()
                            publish(g - 1)
                    if j == 0:
                        mark(errors, rnd, 0, 2, tid)
                next_bounds(rnd, items, num_heads, nx, cu_seqlens_q, seq_lens, tid & 31)
                mark(errors, rnd, 0, 3, tid)
                done += ntiles
        if done > 0:
            wait_all()
            if FP8:
                land(words, done - 1, tid)
            elif not MBAR:
                publish(done - 1)
        if PERSISTENT:              # the releases of the last tiles
            for g in range(max(done - STAGES, 0), done):
                bar_sync(EMPTY + g % STAGES)

    return produce


def split_producer(P, I, R, mark, merge):
    """The producer of split rings: ``produce`` as for :func:`joint_producer`
    (``words``, ``maps`` and ``bars`` unused), warps 0-1 copying each item's
    keys into the K ring and warps 2-3 its values into the V ring, ``R`` the
    rings' barriers (:func:`kernels.prefill_split_ring.split_ring_parts`).
    Before a pair of warps claims tile ``g``'s stage it waits for tile
    ``g - S + 1``'s copies and publishes them: with two stages a ring, a
    publication after the claim (as the joint producer does) would hold tile
    ``g - 1`` back until the consumers freed tile ``g - 2``'s stage and tile
    ``g``'s copies were issued, and the copies would not overlap the products."""
    S, BN, D, KV_OFF = R.STAGES, P.BN, P.D, P.KV_OFF
    V_RING = S * BN * D                 # elements from the K ring to the V ring
    claim, publish = R.claim, R.publish
    issue_keys, issue_values = row_copies(P)
    kv_slot, row_of, chunk_of, tile_entries = P.kv_slot, P.row_of, P.chunk_of, P.tile_entries
    k_strides, v_strides, wait_all = P.k_strides, P.v_strides, P.wait_all
    work_item, next_bounds, open_item = I.work_item, I.next_bounds, item_opening(I, merge)
    PERSISTENT = R.PERSISTENT
    wait_lagging = wait_group(S - 2)    # all but the newest S - 2 groups: tile g - S + 1

    @cuda_function
    def produce(sm, words, key_cache, value_cache, tables, cu_seqlens_q, seq_lens, tile_seq,
                tile_q0, causal, window, errors, maps, bars, num_rounds, items, num_heads,
                group, tid, mrows):
        ring = int32(tid // HALF)       # warps 0-1 copy the keys, 2-3 the values
        htid = int32(tid % HALF)
        tid_slot = kv_slot(0, row_of(htid), chunk_of(htid))
        done = int32(0)
        nx = cuda.local.array(2, int32)
        for rnd in range(num_rounds):
            tile, h0, real = work_item(rnd, items, num_heads)
            if real:
                mark(errors, rnd, 0, 0, tid)
                kvh = h0 // group
                kstr = k_strides(key_cache, kvh, chunk_of(htid))
                vstr = v_strides(value_cache, kvh, chunk_of(htid))
                mark(errors, rnd, 0, 4, tid)
                seq, kv_lo, kv_hi, ntiles, kv_first = open_item(
                    rnd, tile, h0, nx, cu_seqlens_q, seq_lens, tile_seq, tile_q0, causal,
                    window, tables, items, num_heads, tid, mrows)
                last = int32(kv_hi - 1)
                mark(errors, rnd, 0, 1, tid)
                for j in range(ntiles):
                    g = done + j
                    kt = int32(kv_first + j * BN)
                    entries = tile_entries(tables, seq, kt, kv_lo, last, htid,
                                           key_cache.shape[0])
                    if g >= S - 1:      # tile g - S + 1 out before waiting for a stage
                        wait_lagging()
                        publish(ring, g - S + 1)
                    if g >= S:          # the consumers are done with tile g - S
                        claim(ring, g)
                    base = KV_OFF + ring * V_RING + (g % S) * (BN * D)
                    if ring == 0:
                        issue_keys(sm, key_cache, tables, seq, kvh, kt, kv_lo, last, base, htid,
                                   kstr, tid_slot, entries)
                    else:
                        issue_values(sm, value_cache, tables, seq, kvh, kt, kv_lo, last, base,
                                     htid, vstr, tid_slot, entries)
                    if j == 0:
                        mark(errors, rnd, 0, 2, tid)
                next_bounds(rnd, items, num_heads, nx, cu_seqlens_q, seq_lens, tid & 31)
                mark(errors, rnd, 0, 3, tid)
                done += ntiles
        if done > 0:
            wait_all()
            for g in range(max(done - S + 1, 0), done):
                publish(ring, g)
        if PERSISTENT:                  # the releases of the last tiles
            for g in range(max(done - S, 0), done):
                claim(ring, g)

    return produce
