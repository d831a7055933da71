"""Paged prefill attention with warpgroup products and a producer warpgroup
(warp specialisation, sm_90a).

The tile, its arguments, grid, outputs and arithmetic are those of
:func:`kernels.prefill_wgmma.prefill_wgmma_kernel`; what differs is who copies
the keys and values:

* warpgroup 0 (threads 0-127) is the *producer*: it gathers K/V tiles through
  the block table with ``cp.async`` into a ring of ``stages`` stages (4 by
  default; its loops in :mod:`kernels.prefill_producer`), and gives back
  most of its registers (``setmaxnreg.dec`` to 40; 64 in a persistent block);
* the other warpgroups are *consumers* (64 rows each, ``setmaxnreg.inc`` to
  232, or 216): the products and the online softmax of the ``wgmma`` kernel,
  with no copy of their own. A ``wgmma.fence`` waits until every earlier instruction
  of its warp has released its registers, and a ``cp.async`` holds its
  address registers until the memory pipeline takes it, so copies issued by
  the warps that run the products stall the products;
* stage ``s`` has two barriers (:mod:`kernels.prefill_ring`): *full* (the
  producer arrives once the stage's copies landed, the consumers wait) and
  *empty* (the consumers arrive once the products reading it are done, the
  producer waits before overwriting it). The producer runs up to
  ``stages - 2`` tiles ahead of the tile whose scores the consumers compute;
* with ``pingpong`` the two consumer warpgroups take turns at the tensor
  cores: each issues its products only after the other has issued its own
  (a pair of named barriers, one a warpgroup, that one waits at and the other
  arrives at), so one warpgroup's softmax runs while the other's products
  do. Each warpgroup then has its own full barriers (the two pass them at
  different times), so the ring has at most 4 stages (16 named barriers);
* with ``persistent`` each block takes several (tile, head block) items in
  turn, and the ring, its barriers and the turns run on from one item to the
  next, so that the producer copies an item's first tiles and one warpgroup
  starts on it while the other finishes the last item and stores it; each
  warpgroup loads its own query rows;
* an fp8 cache's codes go through a staging ring, which the producer widens
  into the tiles (:mod:`kernels.prefill_fp8`);
* with ``tensor_maps`` the copy engine copies the tiles whose keys are all
  valid, one producer thread issuing box copies (:mod:`kernels.prefill_tma`);
* each consumer warp loads and owns 16 query rows in shared memory, and
  writes its output through them once its products are done (16-byte stores
  of whole rows, ``store_staged`` of :func:`kernels.prefill_tc_parts.tile_parts`),
  except in split-K, whose float32 partial outputs are stored from registers.
"""
import functools

from numba import config, cuda, float32, int32, uint32, uint64

from . import tma, wgmma as wg
from .access import device_function
from .async_copy import commit_group
from .decode import LOG2E
from .prefill_fp8 import fp8_parts
from .prefill_items import item_parts
from .prefill_key_loop import key_loop
from .prefill_ring import ring_parts
from .prefill_producer import joint_producer, split_producer
from .prefill_split_ring import HALF, split_ring_parts
from .prefill_tc_io import cuda_function
from .prefill_tc_parts import FULL_MASK, tile_parts
from .prefill_tc_tiling import MAX_SHARED_BYTES
from .pdl import launch_dependents
from .prefill_tma import tma_parts
from .item_handover import OWED_WORDS, handover_parts
from .prefill_wgmma import product_parts
from .timeline import LOOP_WORDS, ROLES, ROUNDS, STAMPS, clock32, globaltimer
from .guard import WORDS
from .merge_tail import merge_tail_parts
from .warpgroup_merge import pair_merge_parts, scratch_words
from .prefill_ws_options import (CONSUMER_REGS, PERSISTENT_REGS, PRODUCER_REGS, check_options,
                                 register_split)

STAGES = 4            # K/V tiles in the ring
PRODUCER_THREADS = 128


def ws_shared_bytes(head_size, num_warps, block_n, stages=STAGES, prefetch_queries=False):
    """Dynamic shared memory of one block: 16 query rows a consumer warp (twice
    with ``prefetch_queries``) and a ``stages``-stage K/V ring, 2 bytes an
    element.

    >>> ws_shared_bytes(128, 8, 64), ws_shared_bytes(128, 8, 128, stages=3)
    (163840, 229376)
    >>> ws_shared_bytes(128, 8, 64, prefetch_queries=True)
    196608
    """
    copies = 2 if prefetch_queries else 1
    return 2 * head_size * (copies * 16 * num_warps + stages * 2 * block_n)


@functools.cache
def prefill_wgmma_ws_kernel(head_size, block_size, heads_per_block, block_n, dtype, layout,
                            num_warps=8, fast_exp2=False, split_k=False, swizzle=False,
                            stages=STAGES, pingpong=False, persistent=False, guard=True,
                            lazy_rescale=False, timeline=False, prefetch_queries=False,
                            prefetch_ranges=False, kv_dtype=None, producer_registers=None,
                            split_halves=False, mbarriers=False, tensor_maps=False,
                            merge_parts=False, lean_loop=False, q_in_regs=False,
                            split_rings=False, pdl=False, alternate_tiles=False,
                            deferred_stores=False, fma_exp2=False,
                            lane_vote=False, early_weights=False, staged_p=False):
    """Compile-time specialised warp-specialised prefill kernel: arguments,
    grid and outputs as for :func:`kernels.prefill_wgmma.prefill_wgmma_kernel`
    with ``num_warps`` consumer warps (4 or 8: one or two warpgroups; the
    registers move from producer to consumers with two) and one producer
    warpgroup, ``32 * num_warps + 128`` threads (``block_threads``, set on the
    kernel) and ``dynamic_shared_bytes`` of dynamic shared memory; ``swizzle``
    as for the wgmma kernel; ``stages`` (3 to 7) K/V tiles in the ring;
    ``pingpong`` (8 consumer warps, at most 4 stages) the two consumer
    warpgroups taking turns at the tensor cores.

    ``persistent`` (with ``pingpong``): grid ``(blocks, 1, num_parts)``, any
    number of blocks (one a multiprocessor, say). The work items are the
    (tile, head block) pairs in the order of the tile list, heads inner;
    block ``b`` takes item ``b`` of each round of ``blocks`` items, then item
    ``blocks - 1 - b`` of the next (a serpentine: the longest tiles come first,
    and the blocks' shares even out). The ring, its barriers and the turns run
    on across a block's items: the producer copies the next item's first
    tiles while the consumers finish the last one and store it, and one
    warpgroup starts the next item while the other finishes. ``guard`` and
    ``lazy_rescale`` as for :func:`kernels.prefill_tc_parts.tile_parts`.

    The other options (``prefetch_queries``, ``deferred_stores``,
    ``prefetch_ranges``, ``timeline``, ``kv_dtype``, ``producer_registers``,
    ``split_halves``, ``mbarriers``, ``tensor_maps``, ``merge_parts``,
    ``lean_loop``, ``q_in_regs``, ``split_rings``, ``pdl``,
    ``alternate_tiles``) are described in :mod:`kernels.prefill_ws_options`,
    which checks their combinations; ``fma_exp2`` (with ``fast_exp2``),
    ``lane_vote``, ``early_weights`` (with ``lane_vote``) and ``staged_p`` as for
    :func:`kernels.prefill_tc_parts.tile_parts`."""
    check_options(head_size, dtype, layout, num_warps, block_n, split_k, swizzle, stages,
                  pingpong, persistent, timeline, prefetch_queries, prefetch_ranges, kv_dtype,
                  split_halves, mbarriers, tensor_maps, merge_parts, q_in_regs, split_rings,
                  lean_loop, pdl, alternate_tiles, deferred_stores)
    if fma_exp2 and not fast_exp2:
        raise ValueError(f"fma_exp2={fma_exp2!r} needs fast_exp2=True, but got "
                         f"fast_exp2={fast_exp2}")
    ALT = bool(alternate_tiles)
    PDL = bool(pdl)
    SPLIT_RINGS = bool(split_rings)
    FP8 = kv_dtype is not None
    STAGES = int(stages)
    layout_kind = ("swizzle-split" if split_halves else "swizzle") if swizzle else True
    P = tile_parts(head_size, block_size, heads_per_block, block_n, dtype, layout,
                   4 if ALT else num_warps, 1, split_k, layout_kind, fast_exp2, False, False,
                   STAGES,
                   copy_threads=HALF if SPLIT_RINGS else PRODUCER_THREADS, guard=guard,
                   lazy_rescale=lazy_rescale, lean=lean_loop, fma_exp2=fma_exp2,
                   lane_vote=lane_vote, early_weights=early_weights,
                   staged_p=staged_p)
    ALIGN = 1024 if swizzle else 16
    if not P.STAGE_V:
        raise ValueError(f"the producer kernel copies values row by row: not for the {layout} "
                         f"layout")
    Q_REGS = bool(q_in_regs)
    W = product_parts(P, q_regs=Q_REGS, split_rings=SPLIT_RINGS)
    starts, load_q_words, KSTEPS = W.starts, W.load_q_words, P.KSTEPS
    D, PV_STEPS, NTILE_S, NTILE_O = P.D, P.PV_STEPS, P.NTILE_S, P.NTILE_O
    S_SLOTS, P_ROWS = P.S_SLOTS, P.P_ROWS
    KV_HEAD_AXIS, SMEM_T = P.KV_HEAD_AXIS, P.SMEM_T
    load_queries, init_rows = P.load_warp_queries, P.init_rows
    store_staged, stage_rows, SPLIT = P.store_staged, P.stage_rows, P.SPLIT
    exponent_scale = P.exponent_scale
    store_half, wait_all = P.store_half, P.wait_all
    fence_proxy = wg.fence_proxy_async
    NTHREADS = 32 * num_warps + PRODUCER_THREADS
    MOVE_REGS = num_warps == 8           # 384 threads start with 168 registers each
    if producer_registers is not None and not MOVE_REGS:
        raise ValueError(f"producer_registers needs two consumer warpgroups (num_warps=8), but "
                         f"got num_warps={num_warps}")
    producer_regs, consumer_regs = (register_split(producer_registers)
                                    if producer_registers is not None else
                                    PERSISTENT_REGS if persistent else
                                    (PRODUCER_REGS, CONSUMER_REGS))
    shrink = wg.setmaxnreg(False, producer_regs)
    grow = wg.setmaxnreg(True, consumer_regs)
    PINGPONG = bool(pingpong)
    PERSISTENT = bool(persistent)
    TIMELINE = bool(timeline)
    LOOP_CLOCKS = timeline == "loop"      # and each consumer's steps of its key loop
    ACC_WORDS = LOOP_WORDS + 1            # its sums, its tiles and its last reading
    PREFETCH = bool(prefetch_queries)
    Q2_DELTA = P.TOTAL - P.Q_OFF          # the second query buffer, after the ring
    DYNAMIC_BYTES = P.DYNAMIC_BYTES + (2 * P.M * D if PREFETCH or ALT else 0)
    MERGE_AT = DYNAMIC_BYTES // 4         # (ALT) warpgroup 1's state, float32 words
    if ALT:
        DYNAMIC_BYTES += 4 * scratch_words(NTILE_O)
    MBAR = bool(mbarriers)
    MBAR_AT = DYNAMIC_BYTES // 8          # the stages' mbarriers (uint64), after the rest
    if MBAR:
        DYNAMIC_BYTES += 8 * STAGES
    TMAPS = bool(tensor_maps)
    if TMAPS:
        T = tma_parts(P, MBAR_AT)
        whole_tiles = T.whole_tiles
    else:
        @device_function
        def whole_tiles(kv_first, kv_hi):
            return int32(0)
    if FP8:                               # the staging ring of codes, after the ring
        F = fp8_parts(P, kv_dtype, PRODUCER_THREADS)
        DYNAMIC_BYTES += F.STAGING_BYTES
    assert not swizzle or (2 * Q2_DELTA) % 1024 == 0, "second query buffer off a swizzle atom"
    if DYNAMIC_BYTES > MAX_SHARED_BYTES:
        raise ValueError(f"{'fp8 staging' if FP8 else 'prefetch_queries'} needs {DYNAMIC_BYTES} "
                         f"bytes of shared memory, more than {MAX_SHARED_BYTES}: fewer stages "
                         f"or a smaller block_n")
    MERGE = bool(merge_parts)
    merge_tail = (merge_tail_parts(heads_per_block, D, NTHREADS, dtype).merge_tail if MERGE
                  else None)
    # (ALT: a stage's barriers are the producer's and one warpgroup's)
    R = ring_parts(STAGES, PINGPONG, PERSISTENT, MBAR, MBAR_AT,
                   PRODUCER_THREADS + 128 if ALT else NTHREADS)
    RS = split_ring_parts(STAGES, PINGPONG, PERSISTENT, 32 * num_warps) if SPLIT_RINGS else None
    turns = RS if SPLIT_RINGS else R      # the ring whose named barriers hold the turns
    take_turn, pass_turn, turn_sync, turn_arrive, TURN = (
        turns.take_turn, turns.pass_turn, turns.turn_sync, turns.turn_arrive, turns.TURN)

    I = item_parts(P, persistent, prefetch_ranges)
    rounds, work_item, item_range = I.rounds, I.work_item, I.item_range
    next_entries, next_bounds = I.next_entries, I.next_bounds
    DEFER = bool(deferred_stores)
    if PREFETCH:        # the next item's query copies (and DEFER: the last one's stores) paid
        H = handover_parts(P, work_item, pass_turn, DEFER)      # inside the key loop
        owe, owe_stores, settle, pass_turn = H.owe, H.owe_stores, H.settle, H.pass_turn_paying
    if LOOP_CLOCKS and (PREFETCH or not lean_loop):
        raise ValueError(f"timeline='loop' times the lean key loop without prefetch_queries, "
                         f"but got lean_loop={lean_loop}, prefetch_queries={prefetch_queries}")

    @device_function
    def tick(k, a):
        """(``timeline="loop"``) add the cycles since the last tick to step
        ``k`` of the loop (``a[3]``: the sums, the tiles and the last
        reading; ``LOOP_START`` only reads the clock; the last step counts a
        tile)."""
        acc = a[3]
        now = clock32()
        if k < LOOP_WORDS - 1:
            acc[k] += now - acc[LOOP_WORDS]
        if k == LOOP_WORDS - 2:
            acc[LOOP_WORDS - 1] += uint32(1)
        acc[LOOP_WORDS] = now

    run_keys = key_loop(P, W, STAGES, R.acquire, R.release, take_turn, pass_turn,
                        lean=lean_loop, split=RS, step=2 if ALT else 1,
                        tick=tick if LOOP_CLOCKS else None)
    merge_pair = pair_merge_parts(NTILE_O, MERGE_AT, turn_sync, TURN) if ALT else None

    @device_function
    def write_clocks(errors, rnd, cwg, acc, tid):
        """(``timeline="loop"``) the first thread of each consumer warpgroup
        writes the item's loop clocks, and every thread zeroes its sums."""
        if LOOP_CLOCKS:
            if tid % 128 == 0 and rnd < ROUNDS:
                at = (WORDS + cuda.gridDim.x * (ROUNDS * ROLES * STAMPS)
                      + ((cuda.blockIdx.x * ROUNDS + rnd) * 2 + cwg) * LOOP_WORDS)
                for k in range(LOOP_WORDS):
                    errors[at + k] = acc[k]
            for k in range(LOOP_WORDS):
                acc[k] = uint32(0)

    @device_function
    def mark(errors, rnd, role, k, tid):
        """Stamp point ``k`` of round ``rnd`` for warpgroup ``role`` (its
        first thread; only with ``timeline``)."""
        if TIMELINE and tid % 128 == 0 and rnd < ROUNDS:
            errors[WORDS + ((cuda.blockIdx.x * ROUNDS + rnd) * ROLES + role) * STAMPS + k] = \
                globaltimer()

    produce = (split_producer(P, I, RS, mark, MERGE) if SPLIT_RINGS else
               joint_producer(P, I, R, mark, MERGE, F if FP8 else None, T if TMAPS else None,
                              MBAR_AT if MBAR else None))

    jit = cuda.jit if config.ENABLE_CUDASIM else functools.partial(
        cuda.jit, launch_bounds=(NTHREADS, 1))

    @cuda_function
    def body(out, lse, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
             tile_seq, tile_q0, scale, causal, alibi_slopes, soft_cap, window, errors,
             kv_scales, maps, merged):
        if PDL:
            launch_dependents()
        tid = int32(cuda.threadIdx.x)
        num_heads = query.shape[1]
        group = num_heads // key_cache.shape[KV_HEAD_AXIS]
        tables = (block_tables, errors)
        num_rounds, items = rounds(tile_seq.shape[0], num_heads)
        sm = cuda.shared.array(0, SMEM_T, alignment=ALIGN)
        words = cuda.shared.array(0, uint32, alignment=ALIGN)    # the same memory
        fwords = cuda.shared.array(0, float32, alignment=ALIGN)  # (MERGE: its weights)
        bars = cuda.shared.array(0, uint64, alignment=ALIGN)     # (MBAR: from MBAR_AT)
        if MBAR:
            if tid == 0:
                for st in range(STAGES):
                    tma.mbarrier_init(bars, MBAR_AT + st, PRODUCER_THREADS)
                tma.mbarrier_init_fence()
            cuda.syncthreads()

        if tid < PRODUCER_THREADS:
            if MOVE_REGS:
                shrink()
            mrows = cuda.local.array(4, int32)  # (MERGE) the last item's row0, q0, nq, h0
            produce(sm, words, key_cache, value_cache, tables, cu_seqlens_q, seq_lens, tile_seq,
                    tile_q0, causal, window, errors, maps, bars, num_rounds, items, num_heads,
                    group, tid, mrows)
            if MERGE:
                merge_tail(out, lse, merged[0], merged[1], merged[2], words, fwords, tid,
                           mrows[0], mrows[1], mrows[2], mrows[3])
            return

        if MOVE_REGS:
            grow()
        ct = int32(tid - PRODUCER_THREADS)
        lane = int32(ct % 32)
        warp = int32(ct // 32)
        r = int32(lane // 4)
        c = int32(lane % 4)
        # this warpgroup's 64 query rows (the index through a shuffle: uniform to ptxas)
        cwg = cuda.shfl_sync(FULL_MASK, warp >> 2, 0)
        # the warp's 16 rows of the item (ALT: both warpgroups have the same rows)
        wrow = int32(warp - 4 * cwg) if ALT else warp
        qs, kvs = starts(sm, cwg * (Q2_DELTA if ALT else 64 * D))
        qs2 = starts(sm, Q2_DELTA + cwg * 64 * D)[0]      # (used with PREFETCH)
        pos = cuda.local.array((1, 2), int32)
        slope = cuda.local.array((1, 2), float32)
        m = cuda.local.array((1, 2), float32)
        l_ = cuda.local.array((1, 2), float32)
        alpha = cuda.local.array((1, 2), float32)
        qscale = scale * float32(LOG2E)
        cap2 = soft_cap * float32(LOG2E)
        s = cuda.local.array((S_SLOTS, NTILE_S, 4), float32)     # logits (and weights)
        o = cuda.local.array((1, NTILE_O, 4), float32)
        pa = cuda.local.array((P_ROWS, 4), uint32)        # P_{j-1} as A words (and P_j staged)
        qa = cuda.local.array((KSTEPS, 4), uint32)        # (Q_REGS) the queries as A words
        done = int32(0)
        par = int32(0)          # the query buffer of this item (PREFETCH: the items alternate)
        have = False            # its queries were started by the previous item
        nx = cuda.local.array(2, int32)     # the next item's range, read ahead
        owed = cuda.local.array(OWED_WORDS, int32)   # (PREFETCH) the work owed to the loop
        if PREFETCH:                                 # nothing yet
            owed[0] = 0
            owed[8] = 0
        q_args = (sm, query, num_heads, lane, warp, cu_seqlens_q, seq_lens, tile_seq, tile_q0,
                  causal, window, tables, out)
        mrows = cuda.local.array(4, int32)  # (MERGE) the item's row0, q0, nq, h0
        acc = cuda.local.array(ACC_WORDS, uint32)      # (LOOP_CLOCKS) the loop's sums
        for k in range(ACC_WORDS):
            acc[k] = uint32(0)
        for rnd in range(num_rounds):
            tile, h0, real = work_item(rnd, items, num_heads)
            if real:
                mark(errors, rnd, 1 + cwg, 0, ct)
                seq, row0, q0, nq, pos0, kv_lo, kv_hi, ntiles, kv_first = item_range(
                    rnd, tile, nx, cu_seqlens_q, seq_lens, tile_seq, tile_q0, causal, window,
                    tables)
                mark(errors, rnd, 1 + cwg, 4, ct)
                qbase = int32((cwg if ALT else par) * Q2_DELTA)
                if ntiles > 0 and not have:
                    # its own rows: this warp's products and stores of the item
                    # that last used them are done (program order)
                    load_queries(sm, qbase, query, lane, wrow, row0, q0, nq, h0, num_heads)
                    commit_group()
                mark(errors, rnd, 1 + cwg, 5, ct)
                if PREFETCH:            # the next item's queries, into the other buffer,
                    owe(owed, rnd, items, num_heads, int32((1 - par) * Q2_DELTA))  # paid later
                if ntiles > 0:
                    wait_all()          # (PREFETCH: the next item's are not started yet)
                    mark(errors, rnd, 1 + cwg, 6, ct)
                    # visible to the tensor cores after the first turn (or full)
                    # barrier, which every thread of the warpgroup passes
                    fence_proxy()
                    if Q_REGS:          # the warp's rows, copied by all its lanes
                        cuda.syncwarp()
                        load_q_words(qa, words, qbase, wrow, r, c)
                else:
                    mark(errors, rnd, 1 + cwg, 6, ct)
                mark(errors, rnd, 1 + cwg, 1, ct)
                # the next item's entries asked for after the fence above (the
                # fence does not wait for a load in flight: experiments/fence_probe.py)
                next_entries(rnd, items, num_heads, nx, tile_seq, tile_q0, lane)
                any_slope = init_rows(pos, slope, m, l_, wrow, r, pos0, nq, h0, alibi_slopes)
                alibi = cuda.any_sync(FULL_MASK, any_slope)
                iq = qscale * kv_scales[0, h0 // group] if FP8 else qscale   # K's codes' scale
                # without soft cap or ALiBi the scale goes into the exponent's FFMA
                plain, sc = exponent_scale(True, iq, soft_cap, alibi)
                for i in range(NTILE_O):
                    for e in range(4):
                        o[0, i, e] = 0.0
                if PINGPONG and cwg == 1 and ntiles > 0 and (done == 0 or not PERSISTENT):
                    turn_arrive(TURN)           # warpgroup 0 issues first
                # the ring's count below which this item's tiles came by boxes
                boxed_below = int32(done + whole_tiles(kv_first, kv_hi))
                first = int32(cwg if ALT else 0)     # (done is 0 with ALT: not persistent)
                ring = ((cwg, bars, boxed_below, owed, q_args) if PREFETCH else
                        (cwg, bars, boxed_below, acc) if LOOP_CLOCKS else
                        (cwg, bars, boxed_below))
                if Q_REGS:
                    run_keys(qa, kvs, s, o, pa, m, l_, alpha, pos, slope, c, pos0, nq, kv_first,
                             kv_hi, ntiles, done, first, causal, window, iq, soft_cap, cap2, alibi,
                             sc, plain, ring)
                else:
                    run_keys(qs if par == 0 else qs2, kvs, s, o, pa, m, l_, alpha, pos, slope,
                             c, pos0, nq, kv_first, kv_hi, ntiles, done, first, causal, window,
                             iq, soft_cap, cap2, alibi, sc, plain, ring)
                mark(errors, rnd, 1 + cwg, 2, ct)
                write_clocks(errors, rnd, cwg, acc, ct)
                next_bounds(rnd, items, num_heads, nx, cu_seqlens_q, seq_lens, lane)
                if FP8:                 # V's codes' scale
                    vs = kv_scales[1, h0 // group]
                    for i in range(NTILE_O):
                        for e in range(4):
                            o[0, i, e] *= vs
                if ALT:                 # warpgroup 0 takes on warpgroup 1's tiles
                    merge_pair(o, m, l_, fwords, cwg, int32(ct - 128 * cwg), sc)
                mark(errors, rnd, 1 + cwg, 7, ct)
                if ALT and cwg == 1:
                    pass                # (its state went to warpgroup 0)
                elif SPLIT:
                    store_half(out, lse, o, m, l_, sc, wrow, r, c, nq, row0, q0, h0, 0, 0)
                    store_half(out, lse, o, m, l_, sc, wrow, r, c, nq, row0, q0, h0, 0, 1)
                elif DEFER:     # staged now, stored during the next item's key loop
                    have = settle(owed, q_args)
                    stage_rows(lse, o, m, l_, sc, wrow, wg.opaque(lane), nq, row0, q0, h0, sm,
                               qbase)
                    owe_stores(owed, qbase, row0, q0, nq, h0)
                else:       # through this warp's query rows (the per-warp query loads)
                    store_staged(out, lse, o, m, l_, sc, wrow, lane, nq, row0, q0, h0, sm,
                                 qbase)
                mark(errors, rnd, 1 + cwg, 3, ct)
                done += ntiles
                if PREFETCH:
                    if not DEFER:       # what the loop left of the next item's copies
                        have = settle(owed, q_args)
                    par = int32(1 - par)
                if MERGE:
                    mrows[0], mrows[1], mrows[2], mrows[3] = row0, q0, nq, h0
        if DEFER:
            settle(owed, q_args)        # the last item's stores
        if PERSISTENT and cwg == 0 and done > 0:
            turn_sync(TURN)             # warpgroup 1's last products passed a turn
        if MERGE:
            merge_tail(out, lse, merged[0], merged[1], merged[2], words, fwords, tid,
                       mrows[0], mrows[1], mrows[2], mrows[3])

    if FP8:
        @jit
        def paged_prefill_wgmma_ws_kernel(out, lse, query, key_cache, value_cache, block_tables,
                                          cu_seqlens_q, seq_lens, tile_seq, tile_q0, scale,
                                          causal, alibi_slopes, soft_cap, window, errors,
                                          kv_scales):
            body(out, lse, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                 tile_seq, tile_q0, scale, causal, alibi_slopes, soft_cap, window, errors,
                 kv_scales, None, None)
    elif TMAPS:
        @jit
        def paged_prefill_wgmma_ws_kernel(out, lse, query, key_cache, value_cache, block_tables,
                                          cu_seqlens_q, seq_lens, tile_seq, tile_q0, scale,
                                          causal, alibi_slopes, soft_cap, window, errors,
                                          key_map, value_map):
            body(out, lse, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                 tile_seq, tile_q0, scale, causal, alibi_slopes, soft_cap, window, errors,
                 alibi_slopes, (key_map, value_map), None)      # no scales: never read
    elif MERGE:
        @jit
        def paged_prefill_wgmma_ws_kernel(out, lse, query, key_cache, value_cache, block_tables,
                                          cu_seqlens_q, seq_lens, tile_seq, tile_q0, scale,
                                          causal, alibi_slopes, soft_cap, window, errors,
                                          final_out, final_lse, tickets):
            body(out, lse, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                 tile_seq, tile_q0, scale, causal, alibi_slopes, soft_cap, window, errors,
                 alibi_slopes, None, (final_out, final_lse, tickets))     # no scales: never read
    else:
        @jit
        def paged_prefill_wgmma_ws_kernel(out, lse, query, key_cache, value_cache, block_tables,
                                          cu_seqlens_q, seq_lens, tile_seq, tile_q0, scale,
                                          causal, alibi_slopes, soft_cap, window, errors):
            body(out, lse, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                 tile_seq, tile_q0, scale, causal, alibi_slopes, soft_cap, window, errors,
                 alibi_slopes, None, None)     # no scales: never read

    paged_prefill_wgmma_ws_kernel.dynamic_shared_bytes = DYNAMIC_BYTES
    paged_prefill_wgmma_ws_kernel.block_threads = NTHREADS
    return paged_prefill_wgmma_ws_kernel
