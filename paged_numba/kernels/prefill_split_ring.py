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
  publications, so that neither waits for the other's ring
  (:func:`kernels.prefill_producer.split_producer`);
* each ring's stage has its *full* barriers (one a consumer warpgroup with
  ``pingpong``) and its *empty* barrier, as in :mod:`kernels.prefill_ring`.

Shared memory (elements from ``P.KV_OFF``, ``P`` the tile of
:func:`kernels.prefill_tc_parts.tile_parts` built with ``stages`` stages):
K stage ``s`` at ``s * BN * D``, V stage ``s`` at ``(stages + s) * BN * D``:
the same bytes as the joint ring of ``stages`` stages.
"""
from types import SimpleNamespace

from numba import int32

from . import wgmma as wg
from .access import device_function, wide
from .async_copy import commit_group, copy16_async
from .prefill_ring import turn_parts

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
