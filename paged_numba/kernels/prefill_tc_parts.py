"""The parts of the tensor-core prefill tile that do not depend on how the
products are computed: its constants, the shared-memory layout of the query
and K/V tiles, the paged gathers into it, the tile's key range, and the
namespaces of its other parts: the query copies and the output stores
(:mod:`.prefill_tc_io`), the logits' variants and mask
(:mod:`.prefill_logits`) and the online softmax on accumulator fragments
(:mod:`.prefill_softmax`). ``kernels.prefill_tc`` (``mma.sync``) and
``kernels.prefill_wgmma`` (warpgroup products) build their kernels from them.

:func:`tile_parts` returns a namespace of compile-time constants and device
functions, specialised on the same arguments as the kernels. The fragment
conventions are those of ``mma.m16n8k16`` (which ``wgmma`` accumulators share):
a lane ``(r, c) = (lane // 4, lane % 4)`` of warp ``w`` holds, for m-tile
``t``, rows ``16 (MT w + t) + r + 8 h`` (``h = 0, 1``) and, in n-tile ``i``,
columns ``8 i + 2 c, 8 i + 2 c + 1``.
"""
import functools
import math
from types import SimpleNamespace

from numba import cuda, float32, int32, uint32

from .access import device_function, row_strides, vector_offsets, wide
from .async_copy import commit_group, copy16_async, wait_group
from .convert import codec
from .decode import LOG2E, STORAGE, lane_reducer
from .fastmath import exp2_approx
from .guard import (checked_block, checked_unchecked, clamped_length, clamped_unchecked,
                    record_block, record_nothing)
from .mma import pack_pair
from .prefill_logits import logit_parts
from .prefill_softmax import softmax_parts
from .prefill_tc_io import NEG_INF, cuda_function, query_parts
from .prefill_tc_tiling import MAX_SHARED_BYTES, STAGES as DEFAULT_STAGES
from .warp_reduce import FULL_MASK


@functools.cache
def tile_parts(head_size, block_size, heads_per_block, block_n, dtype, layout, num_warps,
               m_tiles=1, split_k=False, core_matrices=False, fast_exp2=False,
               token_copies=False, q_in_regs=None, stages=DEFAULT_STAGES, copy_threads=None,
               guard=True, lazy_rescale=False, lean=False, fma_exp2=False, lane_vote=False,
               early_weights=False, staged_p=False):
    """Constants and device functions of one tile specialisation.

    ``core_matrices`` lays the tiles out as ``wgmma`` core matrices (rows
    ``8 i .. 8 i + 7`` of 16-byte chunk ``ch`` at ``(i * D / 8 + ch) * 128``
    bytes, the copies in that order) instead of rows with XOR-swizzled
    chunks; ``core_matrices="swizzle"`` in ``wgmma``'s swizzled layout (8-row
    atoms of ``min(128, 2 D)``-byte rows, a row group's atoms side by side,
    whole rows copied in turn); ``"swizzle-split"`` the same for the queries,
    and K and V tiles with each ``SPAN``-byte column group's rows one after
    another (the first 64 elements of every row, then the next 64: the layout
    a tensor-map copy of 128-byte box rows writes, ``kv_slot``); ``stages``
    is the number of K/V tiles in the ring; ``copy_threads`` the threads that
    run :func:`issue_tile` (default: all ``32 * num_warps``); ``guard=False``
    takes table ids and lengths as they are
    (:func:`kernels.guard.checked_unchecked`: only to time the guard);
    ``lazy_rescale`` keeps a row's maximum in :func:`weights_half` until the
    tile's exceeds it by more than ``RESCALE_SLACK`` (base 2). ``lean``: the
    softmax's row maxima and sums start from the tile's first pairs rather
    than from -inf and 0, the per-element mask compares in int32, and
    :func:`mask_limits` / :func:`logits_masked` let a key loop decide a
    tile's mask with two compares before its scores land (the same results;
    fewer instructions, read from the SASS). ``fma_exp2=k`` (a power of two;
    True means 4): the weights of every k-th n-tile (``i % k == k - 1``) by
    :func:`kernels.fastmath.exp2_fma` on the FMA pipe, the rest by ``exp2``,
    to take load off the special-function unit (the same bound: both are
    within 2 ulp). ``lane_vote``: a warp none of whose lanes' own maxima
    would move its row's maximum (beyond the lazy slack, or at all without
    ``lazy_rescale``) takes the weights without exchanging the maxima within
    each quad (:func:`tile_weights_rows`; the same results).
    ``early_weights`` (with ``lane_vote``): the weights are taken against the
    kept maxima beside the lanes' own maxima, before the vote, into a second
    slot of the logits' array (``S_SLOTS`` 2, the weights in slot
    ``WSLOT`` 1), and kept where the vote passes (the same results).
    ``staged_p``: the softmax packs the weights as P's A words at once, into
    staging rows ``PB ..`` of the A words' array (``P_ROWS`` rows), which the
    key loop copies to rows ``0 ..`` once the last tile's ``P V`` has landed
    (the same results).
    """
    LEAN = bool(lean)
    D = head_size
    BLOCK_SIZE = block_size
    HPB = heads_per_block
    NW = num_warps
    MT = int(m_tiles)                     # 16-row m-tiles a warp
    M = 16 * MT * NW                      # rows of a tile
    BQ = M // HPB                         # query tokens of a tile
    BN = block_n
    NT = 32 * NW
    NCH = D // 8                          # 16-byte chunks of a row
    SWZ = min(NCH, 8) - 1                 # swizzle mask
    KSTEPS = D // 16                      # k-steps of S = Q K^T
    NTILE_S = BN // 8                     # n-tiles of S
    NTILE_O = D // 8                      # n-tiles of O
    PV_STEPS = BN // 16                   # k-steps of O += P V
    CHUNKS = BN * NCH                     # 16-byte chunks of a K (or V) tile
    CT = NT if copy_threads is None else int(copy_threads)   # threads that copy K/V
    CPT = -(-CHUNKS // CT)                # ... chunks that each of them copies
    QCHUNKS = M * NCH
    QCPT = -(-QCHUNKS // NT)
    QREGS = (D <= 128) if q_in_regs is None else bool(q_in_regs)
    SPLIT = bool(split_k)
    SWIZZLED = core_matrices in ("swizzle", "swizzle-split")
    KV_SPLIT = core_matrices == "swizzle-split"
    CORE = bool(core_matrices) and not SWIZZLED
    # swizzle: rows of SPAN-byte atom rows (8 rows an atom, SEGS atoms a row group)
    SPAN = min(128, 2 * D)
    CPS = SPAN // 16                      # 16-byte chunks of an atom row
    SEGS = NCH // CPS
    assert HPB & (HPB - 1) == 0 and M % HPB == 0 and BN % 16 == 0 and NW >= 1
    Q_OFF = 0
    KV_OFF = M * D                        # stage s: K at KV_OFF + 2 s BN D, V after it
    STAGES = int(stages)
    TOTAL = KV_OFF + STAGES * 2 * BN * D
    DYNAMIC_BYTES = 2 * TOTAL
    assert DYNAMIC_BYTES <= MAX_SHARED_BYTES, "tile too large for shared memory"
    STAGE_V = layout != "vllm"
    # each thread copies chunk tid % NCH of rows tid // NCH + u CT / NCH, all at
    # the same swizzle, so its slots differ by constants
    FIXED_CHUNK = CT % NCH == 0 and (CT // NCH) % (SWZ + 1) == 0
    if CORE:    # chunk order = slot order (8 rows of one chunk, then the next chunk)
        FIXED_CHUNK = CT % (8 * NCH) == 0
    if SWIZZLED:   # a thread's rows 8 apart: the same atom row, the same XOR
        FIXED_CHUNK = CT % NCH == 0 and (CT // NCH) % 8 == 0
    # elements between a thread's K/V chunks u and u + 1 where FIXED_CHUNK
    ROW_STEP = (CT // NCH) * (SPAN // 2) if KV_SPLIT else CT * 8
    # token_copies: TPT threads a token (or TOKS tokens a thread), CPTOK chunks each
    TPT = max(1, NT // BN)
    TOKS = max(1, BN // NT)
    CPTOK = NCH // TPT
    if token_copies and (TPT > NCH or NCH % TPT):
        raise ValueError(f"token_copies needs 32 * num_warps / block_n <= head_size / 8 threads "
                         f"a token, but got {TPT} for head_size={D}, block_n={BN}, "
                         f"num_warps={NW}")
    exp2 = exp2_approx if fast_exp2 else math.exp2
    # fma_exp2: every FMA_EVERY-th n-tile's weights on the FMA pipe (True: a quarter)
    FMA_EVERY = 4 if fma_exp2 is True else int(fma_exp2 or 0)
    LAZY = bool(lazy_rescale)
    # lane_vote: a warp none of whose lanes' own maxima would move a row's
    # maximum skips the quad's exchange of maxima
    VOTE = bool(lane_vote)
    # early_weights: the weights land in slot WSLOT of the logits' array, of
    # S_SLOTS slots a thread (one m-tile a warp)
    EARLY = bool(early_weights)
    if EARLY and (not VOTE or MT != 1):
        raise ValueError(f"early_weights needs lane_vote=True and one m-tile a warp, but got "
                         f"lane_vote={lane_vote}, m_tiles={m_tiles}")
    WSLOT = int(EARLY)
    S_SLOTS = 1 + WSLOT
    # staged_p: P's A words packed by the softmax into rows PB.. of P_ROWS
    STAGED = bool(staged_p)
    if STAGED and MT != 1:
        raise ValueError(f"staged_p needs one m-tile a warp, but got m_tiles={m_tiles}")
    PB = PV_STEPS if STAGED else 0
    P_ROWS = PV_STEPS + PB
    checked_, record_, clamped_ = ((checked_block, record_block, clamped_length) if guard else
                                   (checked_unchecked, record_nothing, clamped_unchecked))
    KV_HEAD_AXIS = {"nhd": 2, "vllm": 1, "hnd": 1, "interleaved": 3}[layout]
    SMEM_T = STORAGE[dtype]
    k_flat, v_flat = vector_offsets(layout, 8, BLOCK_SIZE, D)
    wait_all = wait_group(0)
    pack = pack_pair(dtype)
    _, from_f32 = codec(dtype)
    BF16 = dtype == "bfloat16"
    quad_max = lane_reducer(3, True)
    quad_sum = lane_reducer(3, False)


    if CORE:
        @device_function
        def slot(base, row, ch):
            """Flat index in shared memory of chunk ``ch`` of ``row`` (core matrices)."""
            return base + ((row >> 3) * NCH + ch) * 64 + (row & 7) * 8

        @device_function
        def row_of(idx):
            """The row of the ``idx``-th chunk a tile copies (in slot order)."""
            return (idx // (8 * NCH)) * 8 + (idx & 7)

        @device_function
        def chunk_of(idx):
            return (idx >> 3) % NCH
    else:                   # rows in turn: a warp copies whole rows
        if SWIZZLED:
            @device_function
            def slot(base, row, ch):
                """Flat index of chunk ``ch`` of ``row`` in the ``wgmma`` swizzled
                layout (atoms of 8 rows x SPAN bytes, chunk XOR address bits 7..;
                bases 1024-byte aligned)."""
                r8 = row & 7
                x = ((r8 * SPAN) >> 7) & (CPS - 1)
                return base + (((row >> 3) * SEGS + ch // CPS) * 8 + r8) * (SPAN // 2) + \
                    ((ch % CPS) ^ x) * 8
        else:
            @device_function
            def slot(base, row, ch):
                """Flat index in shared memory of chunk ``ch`` of ``row`` (swizzled)."""
                return base + (row * NCH + (ch ^ (row & SWZ))) * 8

        @device_function
        def row_of(idx):
            """The row of the ``idx``-th chunk a tile copies."""
            return idx // NCH

        @device_function
        def chunk_of(idx):
            return idx % NCH

    if KV_SPLIT:
        @device_function
        def kv_slot(base, row, ch):
            """Flat index of chunk ``ch`` of K/V ``row``: column group ``ch // CPS``
            after the ``BN`` rows of the groups before it, the chunk XORed as in
            :func:`slot` (bases 1024-byte aligned)."""
            x = (((row & 7) * SPAN) >> 7) & (CPS - 1)
            return base + ((ch // CPS) * BN + row) * (SPAN // 2) + ((ch % CPS) ^ x) * 8
    else:
        kv_slot = slot

    # (base, block stride, token stride, chunk stride) of a thread's chunk
    k_strides = row_strides(k_flat, 1)
    v_strides = row_strides(v_flat if STAGE_V else k_flat, 1)

    @device_function
    def issue_by_token(sm, key_cache, value_cache, tables, seq, kvh, kt, lo, last, stage,
                       tid, kstr, vstr):
        """``issue_tile`` with each thread copying chunks ``tid % TPT + TPT j`` of
        tokens ``tid // TPT + k NT / TPT``: one table lookup a token."""
        kbase = KV_OFF + 2 * stage * BN * D
        vbase = kbase + BN * D
        c0 = tid % TPT
        bad = int32(-1)
        for k in range(TOKS):
            n = tid // TPT + k * (NT // TPT)
            t = int32(min(max(kt + n, lo), last))
            b = int32(uint32(t) // uint32(BLOCK_SIZE))
            blk, bad = checked_(tables[0], seq, b, key_cache.shape[0], bad)
            off = int32(t - b * BLOCK_SIZE)
            ka = wide(blk, kstr[1]) + (kstr[0] + off * kstr[2])
            va = wide(blk, vstr[1]) + (vstr[0] + off * vstr[2])
            for j in range(CPTOK):
                ch = c0 + TPT * j
                copy16_async(sm, kv_slot(kbase, n, ch), key_cache, ka + j * (TPT * kstr[3]))
                if STAGE_V:
                    copy16_async(sm, kv_slot(vbase, n, ch), value_cache,
                                 va + j * (TPT * vstr[3]))
                else:
                    dv = kv_slot(vbase, n, ch)
                    for e in range(8):
                        sm[dv + e] = value_cache[blk, kvh, ch * 8 + e, off]
        commit_group()
        record_(tables[0], tables[1], seq, bad)

    # the keys of a tile lie in at most LOOKUP consecutive table entries; when a
    # warp has a lane for each, every lane loads (and checks) one and the
    # threads take their rows' blocks from the lanes by shuffles: one table
    # load a thread and tile, where a load for each of its rows would each
    # hold a register until it returns
    LOOKUP = (BN - 1) // BLOCK_SIZE + 2
    WARP_LOOKUP = LOOKUP <= 32

    @cuda_function
    def tile_entries(tables, seq, kt, lo, last, tid, num_blocks):
        """``(e0, blk, bad)``: the first table entry of the tile's keys ``kt ..
        kt + BN - 1`` (clamped into ``[lo, last]``), and this lane's block,
        entry ``e0 + lane`` (or the tile's last entry), checked (without a
        warp lookup: ``(0, 0, -1)``, and each row is looked up in turn)."""
        if not WARP_LOOKUP:
            return int32(0), int32(0), int32(-1)
        t0 = int32(min(max(kt, lo), last))
        t1 = int32(min(max(int32(kt + (BN - 1)), lo), last))
        e0 = int32(uint32(t0) // uint32(BLOCK_SIZE))
        e1 = int32(uint32(t1) // uint32(BLOCK_SIZE))
        blk, bad = checked_(tables[0], seq, int32(min(int32(e0 + (tid & 31)), e1)), num_blocks,
                            int32(-1))
        return e0, blk, bad

    @cuda_function
    def token_block(tables, seq, t, e0, mine, bad, num_blocks):
        """``(blk, off, bad)``: the block and in-block offset of key ``t``
        (clamped already), from the warp's lookup lanes (:func:`tile_entries`'
        ``e0``, ``mine``; every lane of the warp takes part) or, without one,
        the table (checked: ``bad`` as for :func:`kernels.guard.checked_block`)."""
        b = int32(uint32(t) // uint32(BLOCK_SIZE))
        if WARP_LOOKUP:
            blk = cuda.shfl_sync(FULL_MASK, mine, int32(b - e0))
        else:
            blk, bad = checked_(tables[0], seq, b, num_blocks, bad)
        return blk, int32(t - b * BLOCK_SIZE), bad

    @device_function
    def issue_tile(sm, key_cache, value_cache, tables, seq, kvh, kt, lo, last, stage,
                   tid, kstr, vstr, tid_slot):
        """Start copying keys and values ``kt .. kt + BN - 1`` (clamped into
        ``[lo, last]``) into ``stage`` of the ring, as one group; ``tables`` is
        ``(block_tables, errors)`` (an id outside the pool reads block 0, see
        :mod:`.guard`), ``kstr``, ``vstr`` this thread's :func:`strides`,
        ``tid_slot`` its first chunk's slot. Every lane of the calling warps
        takes part (the table lookup goes through shuffles)."""
        issue_entries(sm, key_cache, value_cache, tables, seq, kvh, kt, lo, last, stage, tid,
                      kstr, vstr, tid_slot,
                      tile_entries(tables, seq, kt, lo, last, tid, key_cache.shape[0]))

    @device_function
    def issue_entries(sm, key_cache, value_cache, tables, seq, kvh, kt, lo, last, stage,
                      tid, kstr, vstr, tid_slot, entries):
        """:func:`issue_tile` with the tile's :func:`tile_entries` looked up
        already (by a caller that loads them before it waits for the stage)."""
        kt = int32(kt)
        kbase = KV_OFF + 2 * stage * BN * D
        vbase = kbase + BN * D
        e0, mine, bad = entries
        for u in range(CPT):
            idx = tid + u * CT
            if CHUNKS % CT == 0 or idx < CHUNKS:
                n = int32(row_of(tid) + u * (CT // NCH) if FIXED_CHUNK else row_of(idx))
                ch = chunk_of(tid) if FIXED_CHUNK else chunk_of(idx)
                t = int32(min(max(int32(kt + n), lo), last))
                blk, off, bad = token_block(tables, seq, t, e0, mine, bad, key_cache.shape[0])
                if FIXED_CHUNK:       # the same chunk and row % 8 for every u
                    dk = kbase + tid_slot + u * ROW_STEP
                    dv = dk + BN * D
                    copy16_async(sm, dk, key_cache,
                                 wide(blk, kstr[1]) + int32(kstr[0] + off * kstr[2]))
                else:
                    dk = kv_slot(kbase, n, ch)
                    dv = kv_slot(vbase, n, ch)
                    copy16_async(sm, dk, key_cache, k_flat(key_cache, blk, kvh, off, ch))
                if STAGE_V:
                    if FIXED_CHUNK:
                        copy16_async(sm, dv, value_cache,
                                     wide(blk, vstr[1]) + int32(vstr[0] + off * vstr[2]))
                    else:
                        copy16_async(sm, dv, value_cache, v_flat(value_cache, blk, kvh, off, ch))
                else:
                    for e in range(8):
                        sm[dv + e] = value_cache[blk, kvh, ch * 8 + e, off]
        commit_group()
        record_(tables[0], tables[1], seq, bad)     # after the copies: see checked_block

    @cuda_function
    def tile_range(tile, cu_seqlens_q, seq_lens, tile_seq, tile_q0, causal, window, tables):
        """The tile's sequence and keys: ``(seq, row0, q0, nq, pos0, kv_lo, kv_hi,
        ntiles, kv_first)`` (split-K: this part's share of the key tiles); a
        length beyond what the sequence's row of ``tables = (block_tables,
        errors)`` holds is clamped to it (:mod:`.guard`)."""
        seq = tile_seq[tile]
        return range_of(seq, tile_q0[tile], cu_seqlens_q[seq], cu_seqlens_q[seq + 1],
                        seq_lens[seq], causal, window, tables)

    @cuda_function
    def range_of(seq, q0, row0, row_end, n, causal, window, tables):
        """:func:`tile_range` of values already read: ``tile_seq[tile]``,
        ``tile_q0[tile]``, ``cu_seqlens_q[seq]``, ``cu_seqlens_q[seq + 1]`` and
        ``seq_lens[seq]``."""
        q_len = row_end - row0
        kv_len = clamped_(n, tables[1], seq, tables[0].shape[1] * BLOCK_SIZE)
        nq = int32(min(BQ, q_len - q0))       # valid query tokens of this tile
        pos0 = int32(kv_len - q_len + q0)     # position of its first query
        kv_lo = int32(0 if window <= 0 else max(pos0 - window + 1, 0))
        kv_hi = int32(min(pos0 + nq, kv_len) if causal else kv_len)
        ntiles = int32(0)
        if kv_hi > kv_lo:
            ntiles = int32((kv_hi - kv_lo + BN - 1) // BN)
        kv_first = kv_lo
        if SPLIT:                             # this part's K/V tiles: j0 .. j0 + ntiles - 1
            per = int32((ntiles + cuda.gridDim.z - 1) // cuda.gridDim.z)
            j0 = int32(min(cuda.blockIdx.z * per, ntiles))
            ntiles = int32(min(per, ntiles - j0))
            kv_first = int32(kv_lo + j0 * BN)
        return seq, row0, q0, nq, pos0, kv_lo, kv_hi, ntiles, kv_first

    @device_function
    def init_rows(pos, slope, m, l_, warp, r, pos0, nq, h0, alibi_slopes):
        """This lane's rows: positions, ALiBi slopes (base 2), running maxima and
        sums; returns whether any of them has a slope."""
        any_slope = False
        for t in range(MT):
            for h in range(2):
                rr = 16 * (MT * warp + t) + r + 8 * h
                pos[t, h] = int32(pos0 + min(rr // HPB, nq - 1))
                slope[t, h] = alibi_slopes[h0 + rr % HPB] * float32(LOG2E)
                any_slope = any_slope or slope[t, h] != 0.0
                m[t, h] = NEG_INF
                l_[t, h] = 0.0
        return any_slope

    parts = SimpleNamespace(**{k: v for k, v in locals().items() if not k.startswith("__")})
    return SimpleNamespace(**vars(parts), **vars(query_parts(parts)), **vars(logit_parts(parts)),
                           **vars(softmax_parts(parts)))
