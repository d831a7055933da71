"""The parts of the tensor-core prefill tile that do not depend on how the
products are computed: its constants, the shared-memory layout of the query
and K/V tiles, the paged gathers into it, the tile's key range, the logits'
variants and mask, the online softmax on accumulator fragments and the
epilogue (the query copies and the output stores are in
:mod:`.prefill_tc_io`). ``kernels.prefill_tc`` (``mma.sync``) and ``kernels.prefill_wgmma``
(warpgroup products) build their kernels from them.

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
from .fastmath import exp2_approx, exp2_fma
from .guard import (checked_block, checked_unchecked, clamped_length, clamped_unchecked,
                    record_block, record_nothing)
from .mma import pack_pair
from .prefill_logits import logit_parts
from .prefill_tc_io import NEG_INF, cuda_function, query_parts
from .prefill_tc_tiling import MAX_SHARED_BYTES, STAGES as DEFAULT_STAGES

FULL_MASK = 0xFFFFFFFF

# lazy_rescale: a row's running maximum (in the exponent's base-2 units) moves
# only when the tile's maximum exceeds it by more than this, so the weights stay
# below 2**RESCALE_SLACK (256: exact in fp16 and bf16, far from their overflow)
RESCALE_SLACK = 8.0


@functools.cache
def tile_parts(head_size, block_size, heads_per_block, block_n, dtype, layout, num_warps,
               m_tiles=1, split_k=False, core_matrices=False, fast_exp2=False,
               token_copies=False, q_in_regs=None, stages=DEFAULT_STAGES, copy_threads=None,
               guard=True, lazy_rescale=False, lean=False, fma_exp2=False):
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
    within 2 ulp).
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

    @device_function
    def exponent_scale(fold, qscale, soft_cap, alibi):
        """``(plain, sc)``: with ``fold`` and no soft cap or ALiBi (and a positive
        scale) the logits stay unscaled, the maxima too, and ``sc = qscale``
        scales them in the exponent's FFMA; else they are scaled first and
        ``sc`` is 1."""
        plain = fold and soft_cap <= 0.0 and not alibi and qscale > 0.0
        return plain, (qscale if plain else float32(1.0))

    @device_function
    def row_max(s, m, t, h):
        """The running maximum of row half ``h`` of m-tile ``t`` with this tile's
        logits (over the quad of lanes that share the row); the lane's pairs
        go round-robin into two independent maxima (half the dependent steps).
        ``LEAN``: they start from the first two pairs, not from -inf (a seed
        costs an instruction each and changes no result: ``max.f32`` passes
        over NaN and the running maximum, never NaN, takes part last)."""
        if LEAN:
            a = max(s[t, 0, 2 * h], s[t, 0, 2 * h + 1])
            b = max(s[t, 1, 2 * h], s[t, 1, 2 * h + 1])
            first = 2
        else:
            a = NEG_INF
            b = NEG_INF
            first = 0
        for i in range(first, NTILE_S, 2):
            a = max(a, max(s[t, i, 2 * h], s[t, i, 2 * h + 1]))
            b = max(b, max(s[t, i + 1, 2 * h], s[t, i + 1, 2 * h + 1]))
        return max(m[t, h], quad_max(max(a, b)))

    @device_function
    def exp_weights(s, l_, sc, use, t, h):
        """Logits -> weights ``exp2(x sc - use sc)`` in place, one FFMA and one
        exp2 each, summed (two partial sums) into the lane's share of the row sum.
        ``LEAN``: the sums start from the first two pairs, not from 0 (a weight
        is +0 or more, or NaN, so ``0 + x`` is ``x``)."""
        sub = -use * sc
        a = float32(0.0)                  # two independent partial sums
        b = float32(0.0)
        for i in range(NTILE_S):
            if FMA_EVERY and i % FMA_EVERY == FMA_EVERY - 1:     # on the FMA pipe
                s[t, i, 2 * h] = exp2_fma(s[t, i, 2 * h] * sc + sub)
                s[t, i, 2 * h + 1] = exp2_fma(s[t, i, 2 * h + 1] * sc + sub)
            else:
                s[t, i, 2 * h] = exp2(s[t, i, 2 * h] * sc + sub)
                s[t, i, 2 * h + 1] = exp2(s[t, i, 2 * h + 1] * sc + sub)
            if LEAN and i == 0:
                a = s[t, i, 2 * h] + s[t, i, 2 * h + 1]
            elif LEAN and i == 1:
                b = s[t, i, 2 * h] + s[t, i, 2 * h + 1]
            elif i % 2 == 0:
                a += s[t, i, 2 * h] + s[t, i, 2 * h + 1]
            else:
                b += s[t, i, 2 * h] + s[t, i, 2 * h + 1]
        l_[t, h] += a + b

    @cuda_function
    def softmax_half(s, o, m, l_, sc, t, h):
        """Online softmax of row half ``h`` of m-tile ``t`` (this lane's row ``16 t
        + r + 8 h`` of the warp, logits ``s[t, :, 2 h:2 h + 2]``): the row maximum
        over the quad, the rescale of O and the row sum where it grew (a warp
        vote), then one FFMA and one exp2 a weight, summed into the lane's share."""
        new = row_max(s, m, t, h)
        use = new if new != NEG_INF else float32(0.0)
        if cuda.any_sync(FULL_MASK, new > m[t, h]):
            alpha = exp2((m[t, h] - use) * sc)
            l_[t, h] *= alpha
            for i in range(NTILE_O):
                o[t, i, 2 * h] *= alpha
                o[t, i, 2 * h + 1] *= alpha
        m[t, h] = new
        exp_weights(s, l_, sc, use, t, h)

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

    @device_function
    def weights_half(s, m, l_, alpha, sc, t, h):
        """:func:`softmax_half` without touching O: the factor O must be scaled by
        goes to ``alpha[t, h]`` (1 where the row's maximum did not move), for
        :func:`rescale_half` once the product that writes O has landed. With
        ``lazy_rescale`` the maximum moves only when the tile's exceeds it by
        more than ``RESCALE_SLACK``: the weights, up to ``2**RESCALE_SLACK``,
        and the row sum are relative to the kept maximum, as O is, so most
        tiles after the first leave ``alpha`` at 1 and O unscaled (the warp
        vote in :func:`rescale_half` skips the multiplies)."""
        new = row_max(s, m, t, h)
        old = m[t, h]
        alpha[t, h] = float32(1.0)
        if new > old:
            # a first maximum (old = -inf) always moves: (new - old) sc = inf
            if not LAZY or (new - old) * sc > float32(RESCALE_SLACK):
                alpha[t, h] = exp2((old - new) * sc)
                l_[t, h] *= alpha[t, h]
                m[t, h] = new
        else:
            m[t, h] = new               # the same, or NaN (which the weights carry)
        use = m[t, h] if m[t, h] != NEG_INF else float32(0.0)
        exp_weights(s, l_, sc, use, t, h)

    @cuda_function
    def rescale_half(o, alpha, t, h):
        """``O *= alpha`` for row half ``h`` of m-tile ``t``, where any row of the
        warp grew (a warp vote)."""
        if cuda.any_sync(FULL_MASK, alpha[t, h] != 1.0):
            for i in range(NTILE_O):
                o[t, i, 2 * h] *= alpha[t, h]
                o[t, i, 2 * h + 1] *= alpha[t, h]

    parts = SimpleNamespace(**{k: v for k, v in locals().items() if not k.startswith("__")})
    return SimpleNamespace(**vars(parts), **vars(query_parts(parts)), **vars(logit_parts(parts)))
