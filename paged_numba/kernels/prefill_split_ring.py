"""Separate K and V rings for the warp-specialised prefill kernel
(:func:`kernels.prefill_wgmma_ws.prefill_wgmma_ws_kernel`, ``split_rings=True``).

The consumers' key loop reads the keys of tile ``j`` (``S_j = Q K_j^T``) and
the values of tile ``j - 1`` (``O += P_{j-1} V_{j-1}``), never the keys and
values of one tile at once. A joint ring, whose stage holds a tile's K and V,
needs three stages for that (tile ``j - 1``'s values, tile ``j``'s keys, tile
``j + 1`` in flight); two rings of two stages each hold the same lookahead in
two thirds of the memory, so the tiles can have twice the keys at head size
256:

* the K ring: ``K_j`` being read, ``K_{j+1}`` in flight. ``K_j``'s stage is free
  once ``S_j`` has landed, half a tile before a joint stage would be;
* the V ring: ``V_{j-1}`` being read, ``V_j`` in flight;
* the producer warpgroup splits: warps 0 and 1 copy the keys, warps 2 and 3
  the values, each pair with its own order of claims, copies and
  publications, so that neither waits for the other's ring;
* each ring's stage has its *full* barriers (one a consumer warpgroup with
  ``pingpong``) and its *empty* barrier, as in :mod:`kernels.prefill_ring`.

Shared memory (elements from ``P.KV_OFF``, ``P`` the tile of
:func:`kernels.prefill_tc_parts.tile_parts` built with ``stages`` stages):
K stage ``s`` at ``s * BN * D``, V stage ``s`` at ``(stages + s) * BN * D``:
the same bytes as the joint ring of ``stages`` stages.
"""
from types import SimpleNamespace

from numba import cuda, int32

from . import wgmma as wg
from .access import device_function, wide
from .async_copy import commit_group, copy16_async, wait_group
from .prefill_ring import turn_parts
from .prefill_tc_parts import cuda_function

HALF = 64                       # producer threads a ring (two warps)


def split_ring_parts(stages, pingpong, persistent, consumers):
    """The barriers of a K ring and a V ring of ``stages`` stages each, for
    ``consumers`` consumer threads (one or two warpgroups) and a producer of
    two warps a ring. ``ring`` is 0 (K) or 1 (V); ``g`` counts a block's tiles:

    * ``acquire(ring, g, a)``: a consumer waits until tile ``g``'s keys (or
      values) have landed; ``a[0]`` is its warpgroup;
    * ``release(ring, g, ntiles, a)``: a consumer is done with them (the
      producer waits only for a stage it refills: in a persistent block
      every stage, the last ones at the end);
    * ``claim(ring, g)``: the producer waits until tile ``g``'s stage is free;
    * ``publish(ring, g)``: the producer's copies of tile ``g`` landed;
    * ``take_turn(a)``, ``pass_turn(last, a)``, ``turn_sync``, ``turn_arrive``
      and ``TURN``: the pingpong turns (:func:`kernels.prefill_ring.turn_parts`).

    Named barrier ids: 0 is ``__syncthreads``, then the K ring's full ones,
    the V ring's, the two rings' empty ones and the turns: 15 with two stages
    and ``pingpong``, the most a block has besides barrier 0."""
    S, PINGPONG, PERSISTENT = int(stages), bool(pingpong), bool(persistent)
    SETS = 2 if PINGPONG else 1
    FULL = 1                              # + ring * SETS * S (+ S for warpgroup 1)
    EMPTY = FULL + 2 * SETS * S           # + ring * S
    TURN = EMPTY + 2 * S
    if TURN + 2 > 16:
        raise ValueError(f"split_rings with stages={stages}"
                         f"{' and pingpong' if PINGPONG else ''} needs {TURN + 1} named "
                         f"barriers besides __syncthreads', more than 15")
    fence_proxy = wg.fence_proxy_async
    full_count = HALF + (128 if PINGPONG else consumers)
    full_sync, full_arrive = wg.bar_sync(full_count), wg.bar_arrive(full_count)
    empty_sync, empty_arrive = wg.bar_sync(HALF + consumers), wg.bar_arrive(HALF + consumers)
    take_turn, pass_turn, turn_sync, turn_arrive = turn_parts(TURN, PINGPONG, PERSISTENT)

    @device_function
    def acquire(ring, g, a):
        """Wait until tile ``g`` of ``ring`` is published to this warpgroup."""
        full_sync(FULL + ring * (SETS * S) + (a[0] * S if PINGPONG else 0) + g % S)

    @device_function
    def release(ring, g, ntiles, a):
        """This warpgroup's products are done with tile ``g`` of ``ring``."""
        if PERSISTENT or g + S < ntiles:
            empty_arrive(EMPTY + ring * S + g % S)

    @device_function
    def claim(ring, g):
        """(producer) Wait until the consumers released the tile that last used
        tile ``g``'s stage of ``ring``."""
        empty_sync(EMPTY + ring * S + g % S)

    @device_function
    def publish(ring, g):
        """(producer) This thread's copies of tile ``g`` of ``ring`` landed:
        into the tensor cores' view, then arrive at the stage's full
        barrier(s)."""
        fence_proxy()
        full_arrive(FULL + ring * (SETS * S) + g % S)
        if PINGPONG:
            full_arrive(FULL + ring * (SETS * S) + S + g % S)

    return SimpleNamespace(acquire=acquire, release=release, claim=claim, publish=publish,
                           take_turn=take_turn, pass_turn=pass_turn, turn_sync=turn_sync,
                           turn_arrive=turn_arrive, TURN=TURN, STAGES=S,
                           PERSISTENT=PERSISTENT)


def row_copies(P):
    """``(issue_keys, issue_values)``: start copying one tile's keys (or
    values) ``kt .. kt + BN - 1``, clamped into ``[lo, last]``, into the ring
    stage at flat ``base``, as one group, by the ``P.CT`` threads of one
    ring (``tid`` from 0); arguments as for ``P.issue_entries`` (the tile's
    ``P.tile_entries`` looked up already, ``strides`` this thread's
    ``P.k_strides`` or ``P.v_strides``, ``tid_slot`` its first chunk's slot).
    Values in whole rows only (``P.STAGE_V``)."""
    NCH, CT, CPT, CHUNKS = P.NCH, P.CT, P.CPT, P.CHUNKS
    FIXED_CHUNK, ROW_STEP = P.FIXED_CHUNK, P.ROW_STEP
    row_of, chunk_of, kv_slot, token_block, record_ = (P.row_of, P.chunk_of, P.kv_slot,
                                                       P.token_block, P.record_)

    def issuer(flat):
        @device_function
        def issue(sm, cache, tables, seq, kvh, kt, lo, last, base, tid, strides, tid_slot,
                  entries):
            kt = int32(kt)
            e0, mine, bad = entries
            for u in range(CPT):
                idx = tid + u * CT
                if CHUNKS % CT == 0 or idx < CHUNKS:
                    n = int32(row_of(tid) + u * (CT // NCH) if FIXED_CHUNK else row_of(idx))
                    t = int32(min(max(int32(kt + n), lo), last))
                    blk, off, bad = token_block(tables, seq, t, e0, mine, bad, cache.shape[0])
                    if FIXED_CHUNK:       # the same chunk and row % 8 for every u
                        copy16_async(sm, base + tid_slot + u * ROW_STEP, cache,
                                     wide(blk, strides[1]) + int32(strides[0] + off * strides[2]))
                    else:
                        ch = chunk_of(idx)
                        copy16_async(sm, kv_slot(base, n, ch), cache,
                                     flat(cache, blk, kvh, off, ch))
            commit_group()
            record_(tables[0], tables[1], seq, bad)     # after the copies: see checked_block
        return issue

    return issuer(P.k_flat), issuer(P.v_flat)


def split_producer(P, I, R, mark, merge):
    """The producer of split rings: ``produce(sm, key_cache, value_cache,
    tables, cu_seqlens_q, seq_lens, tile_seq, tile_q0, causal, window, errors,
    num_rounds, items, num_heads, group, tid, mrows)``, run by the producer
    warpgroup's threads (``tid`` < 128): warps 0-1 copy each item's keys into
    the K ring, warps 2-3 its values into the V ring, the block's items taken
    as :func:`kernels.prefill_items.item_parts` ``I`` gives them, ``R`` the
    rings' barriers (:func:`split_ring_parts`), ``mark`` the kernel's
    timeline stamps; with ``merge`` the last item's ``row0, q0, nq, h0`` are
    left in ``mrows``. Each pair of warps issues tile ``g``'s copies, then
    waits for tile ``g - 1``'s and publishes them."""
    S, BN, D, KV_OFF = R.STAGES, P.BN, P.D, P.KV_OFF
    V_RING = S * BN * D                 # elements from the K ring to the V ring
    MERGE = bool(merge)
    claim, publish = R.claim, R.publish
    issue_keys, issue_values = row_copies(P)
    kv_slot, row_of, chunk_of, tile_entries = P.kv_slot, P.row_of, P.chunk_of, P.tile_entries
    k_strides, v_strides, wait_all = P.k_strides, P.v_strides, P.wait_all
    work_item, item_range, next_entries, next_bounds = (I.work_item, I.item_range,
                                                        I.next_entries, I.next_bounds)
    PERSISTENT = R.PERSISTENT
    wait_older = wait_group(1)

    @cuda_function
    def produce(sm, key_cache, value_cache, tables, cu_seqlens_q, seq_lens, tile_seq, tile_q0,
                causal, window, errors, num_rounds, items, num_heads, group, tid, mrows):
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
                seq, row0, q0, nq, pos0, kv_lo, kv_hi, ntiles, kv_first = item_range(
                    rnd, tile, nx, cu_seqlens_q, seq_lens, tile_seq, tile_q0, causal, window,
                    tables)
                next_entries(rnd, items, num_heads, nx, tile_seq, tile_q0, tid & 31)
                if MERGE:
                    mrows[0], mrows[1], mrows[2], mrows[3] = row0, q0, nq, h0
                last = int32(kv_hi - 1)
                mark(errors, rnd, 0, 1, tid)
                for j in range(ntiles):
                    g = done + j
                    kt = int32(kv_first + j * BN)
                    entries = tile_entries(tables, seq, kt, kv_lo, last, htid,
                                           key_cache.shape[0])
                    if g >= S:          # the consumers are done with tile g - S
                        claim(ring, g)
                    base = KV_OFF + ring * V_RING + (g % S) * (BN * D)
                    if ring == 0:
                        issue_keys(sm, key_cache, tables, seq, kvh, kt, kv_lo, last, base, htid,
                                   kstr, tid_slot, entries)
                    else:
                        issue_values(sm, value_cache, tables, seq, kvh, kt, kv_lo, last, base,
                                     htid, vstr, tid_slot, entries)
                    if g >= 1:
                        wait_older()
                        publish(ring, g - 1)
                    if j == 0:
                        mark(errors, rnd, 0, 2, tid)
                next_bounds(rnd, items, num_heads, nx, cu_seqlens_q, seq_lens, tid & 31)
                mark(errors, rnd, 0, 3, tid)
                done += ntiles
        if done > 0:
            wait_all()
            publish(ring, done - 1)
        if PERSISTENT:                  # the releases of the last tiles
            for g in range(max(done - S, 0), done):
                claim(ring, g)

    return produce
