"""The parts of the tensor-core decode kernel (:mod:`paged_numba.kernels.decode_tc`):
its compile-time constants and the device functions its loop calls, for one
specialisation. :func:`decode_tc_parts` returns them as a namespace; the
module docstring of :mod:`.decode_tc` describes the design.

The copy ring: ``chunk``, ``vdst``, ``swizzled`` (ring indices), ``block_at``,
``token_at``, ``step_blocks`` (table reads, guarded: through ``block_of_``,
``length_of_`` and ``outside_``, :mod:`.guard`'s functions or, with
``guard=False``, their unchecked forms), ``issue`` (a step's ``cp.async``
copies), ``gather_values`` (the "vllm" values, element by element).
The fragments: ``load_a`` (the query's A words), ``key_words``/``value_words``
(fp8 codes into mma words, :mod:`.fp8_mma`), ``weights`` (one head's step of
the online softmax), ``rescale_half``, ``pv_tiles``, ``pv_tile8``, ``pv_words``
(P @ V on tensor cores), ``pv_token`` (P @ V in fp32 FMAs), ``put_row``,
``row_a``, ``row_b`` (the output rows into the epilogue's merge).
"""
import math
from types import SimpleNamespace

from numba import cuda, float32, int32, uint16, uint32

from .access import device_function, row_strides, vector_accessors, vector_offsets, wide
from .async_copy import commit_group, copy16_async, wait_group
from .convert import codec
from .decode import FULL_MASK, NEG_INF, STORAGE, lane_reducer, warp_merger
from .guard import (block_of, block_unchecked, length_of, length_unchecked, outside,
                    outside_unchecked)
from .mma import load_words, mma_m16n8k8, mma_m16n8k16, split_pack
from .decode_tc_tiling import (DTYPES, FP8_DTYPES, MAX_HPB, STEP, dynamic_ring_bytes, kv_bytes,
                               ring_stages, supports)
from .fp8 import encoder, to_f32_any
from .fp8_mma import crossed, mma_m16n8k32, pairs
from .vector import load16


#: the format the queries are quantised to for ``qk_fp8`` (its largest finite value)
QK_FORMAT, QK_MAX = "float8_e4m3fn", 448.0
FLT_MAX = float32(3.4028234663852886e38)


def decode_tc_parts(head_size, block_size, heads_per_block, dtype, layout, num_warps, stages,
                    split, prefetch, pv_mma, key_rows, query_dtype, qk_fp8=False, guard=True):
    """The constants and device functions of one :func:`.decode_tc.decode_tc_kernel`
    specialisation (its arguments, checked here), as a namespace. ``guard=False``
    takes table ids and lengths as they are (no compare, no select, no record),
    only to time the device guard (:mod:`.guard`)."""
    if not supports(head_size, heads_per_block, dtype, layout):
        raise ValueError(f"no tensor-core decode kernel for head_size={head_size}, "
                         f"heads_per_block={heads_per_block}, {dtype}, {layout}")
    FP8 = dtype in FP8_DTYPES
    if FP8 and not (pv_mma and key_rows):
        raise ValueError(f"an fp8 cache ({dtype}) needs pv_mma=True and key_rows=True, but got "
                         f"pv_mma={pv_mma}, key_rows={key_rows}")
    QK8 = bool(qk_fp8)                    # Q K^T in fp8: the queries quantised per head
    if QK8 and not FP8:
        raise ValueError(f"qk_fp8=True needs an fp8 cache, but got {dtype}")
    MMA_T = (query_dtype or "float16") if FP8 else dtype    # the products' operand type
    if MMA_T not in DTYPES:
        raise ValueError(f"the tensor-core decode kernel of an fp8 cache takes float16 or "
                         f"bfloat16 queries, but got query_dtype={query_dtype!r}")
    if heads_per_block > MAX_HPB and not pv_mma:
        raise ValueError(f"heads_per_block={heads_per_block} (more than {MAX_HPB}) needs pv_mma=True: "
                         f"the CUDA-core P @ V holds {MAX_HPB} heads a lane at most")
    D = head_size
    BLOCK_SIZE = block_size
    HPB = heads_per_block
    TWO = HPB > 8                         # heads 8..15 in the mma's rows 8..15 (c2, c3)
    NH = 2 if TWO else 1                  # 8-head halves of P @ V's output tiles
    HROWS = 16 if TWO else MAX_HPB        # rows of the warps' (m, l) tables
    HP4 = -(-HPB // 4) * 4                # probability row padded to whole 16-byte reads
    VEC = 8                               # ring elements (16-bit) of a 16-byte vector
    CVEC = 16 // kv_bytes(dtype)          # cache elements of a 16-byte vector
    NVEC = D // CVEC                      # 16-byte vectors of a K or V row
    KV4 = NVEC // 4                       # key vectors per lane and token (c, c + 4, ...)
    KSTEPS = D // 16                      # mma products per step
    QA = 2 * KSTEPS                       # A-fragment words per lane
    KW = 2 * KSTEPS                       # B-fragment words per lane and step
    LPR = min(32, NVEC)                   # lanes per value row
    TG = 32 // LPR                        # token groups of the value lanes
    TPL = STEP // TG                      # value tokens per lane and step
    NW = num_warps
    NT = 32 * NW
    PV = pv_mma
    KR = key_rows
    # the ring in dynamic shared memory where that holds more of the stages asked for
    # (more warps, or a deeper ring) than the static 48 KB
    DYNAMIC_BYTES = dynamic_ring_bytes(D, NW, stages, layout, PV, kv_bytes(dtype))
    DYNAMIC = DYNAMIC_BYTES > 0
    STAGES = ring_stages(D, NW, stages, layout, PV, DYNAMIC, kv_bytes(dtype))
    STAGE_V = layout != "vllm"            # "vllm" value rows are strided: not cp.async
    NMMA = D // 16                        # P @ V on tensor cores: 16-dim output tiles
    NLDM = NVEC // 4                      # ... and ldmatrix.x4 loads a step (fp8: 4 tiles
    #                                       a load, else 2)
    assert STAGES >= 2, "the copy ring does not fit: use fewer warps"
    CPS = KV4 + (TPL if STAGE_V or PV else 0)   # 16-byte chunks per lane and step
    RING = STAGES * CPS * NT * VEC
    ONE_BLOCK = BLOCK_SIZE % STEP == 0    # a step's tokens share one block
    SMEM_T = uint16 if FP8 else STORAGE[dtype]     # fp8: code pairs
    PREFETCH = prefetch and ONE_BLOCK     # block numbers of 32 steps held one per lane
    assert STAGES - 1 <= 32, "the ring's fill reads the first window of block numbers"
    KV_HEAD_AXIS = {"nhd": 2, "vllm": 1, "hnd": 1, "interleaved": 3}[layout]
    k_flat, v_flat = vector_offsets(layout, CVEC, BLOCK_SIZE, D)
    _, v_vec = vector_accessors(layout, "float16" if FP8 else dtype)   # (not with fp8)
    wait_stages = wait_group(STAGES - 1)
    mma = mma_m16n8k16(MMA_T)
    mma8 = mma_m16n8k8(MMA_T)
    split_p = split_pack(MMA_T)
    _, from_f32 = codec("float32" if split else MMA_T)
    key_words = value_words = mma32 = encode_q = None
    if QK8:     # E4M3 queries times the cache's codes, as they stand
        mma32 = mma_m16n8k32(QK_FORMAT, dtype)
        encode_q = encoder(QK_FORMAT)
    if FP8:
        key_words = pairs(dtype, MMA_T)           # a key row's dims 4c .. 4c + 3
        value_words = crossed(dtype, MMA_T)       # dims 2r, 2r + 1 of tokens 2c, 2c + 1
    quad_max = lane_reducer(3, True)            # over the 4 lanes of a head row
    quad_sum = lane_reducer(3, False)
    # the device guard's reads, or (guard=False) the same reads taken as they are
    block_of_, length_of_, outside_ = ((block_of, length_of, outside) if guard else
                                       (block_unchecked, length_unchecked, outside_unchecked))
    @device_function
    def row_a(i, r):
        """The dim of row ``r`` of P @ V's output tile ``i``."""
        return 16 * i + 2 * r if FP8 else 16 * i + r

    @device_function
    def row_b(i, r):
        """The dim of row ``r + 8`` of P @ V's output tile ``i``."""
        return 16 * i + 2 * r + 1 if FP8 else 16 * i + r + 8

    if PV:
        @device_function
        def put_row(acc_s, warp, hh, r, c, o, f):
            """Lanes of column pair ``(hh % 8) // 2`` hold head ``hh``'s output in
            their mma tiles of half ``hh // 8``: dims ``16 i + r`` and ``16 i + r +
            8`` (fp8: ``16 i + 2 r`` and ``16 i + 2 r + 1``); the 2**15 of the
            weights comes off here (exactly)."""
            if c == (hh % 8) // 2:
                f = f * float32(2.0 ** -15)
                if not TWO:
                    for i in range(NMMA):
                        acc_s[warp, row_a(i, r)] = o[0, i, hh % 2] * f
                        acc_s[warp, row_b(i, r)] = o[0, i, 2 + hh % 2] * f
                else:   # constant indices only: the tiles stay in registers
                    odd = hh % 2 == 1
                    for i in range(NMMA):
                        x0 = o[0, i, 1] if odd else o[0, i, 0]
                        x2 = o[0, i, 3] if odd else o[0, i, 2]
                        if hh >= 8:
                            x0 = o[NH - 1, i, 1] if odd else o[NH - 1, i, 0]
                            x2 = o[NH - 1, i, 3] if odd else o[NH - 1, i, 2]
                        acc_s[warp, row_a(i, r)] = x0 * f
                        acc_s[warp, row_b(i, r)] = x2 * f
        merge_warps = warp_merger(NW, HPB, D, VEC, 1, LPR, from_f32, put_row)
    else:
        merge_warps = warp_merger(NW, HPB, D, VEC, 1, LPR, from_f32)

    # (base, block stride, token stride, stride to vector vec + 4) of a lane's vectors
    k_rows = row_strides(k_flat, 4)
    v_rows = row_strides(v_flat if STAGE_V else k_flat, 4)

    @device_function
    def chunk(stage, c, tid):
        """Flat index in the ring of this thread's chunk ``c`` of ``stage``."""
        return ((stage * CPS + c) * NT + tid) * VEC

    @device_function
    def vdst(stage, k, tid, vsw):
        """Ring index of the lane's value copy ``k`` (token ``t = g + k * TG``,
        vector ``lr``). For P @ V on tensor cores the slot in the copy's strip is
        XOR-swizzled by ``t % 8`` (``vsw = lane ^ (g % 8)`` is the lane's share):
        the copies stay conflict-free, and the eight rows of each ldmatrix phase
        (one vector, tokens 0..7) fall in eight distinct 16-byte bank groups."""
        if PV:
            return swizzled(stage, KV4 + k, k, tid, vsw)
        return chunk(stage, KV4 + k, tid)

    @device_function
    def swizzled(stage, strip, k, tid, vsw):
        """Ring index of the lane's copy ``k`` (token ``g + k * TG``, vector
        ``lr``) in ``strip``, XOR-swizzled (see ``vdst``)."""
        return ((stage * CPS + strip) * NT + (tid & ~31) + (vsw ^ ((k * TG) & 7))) * VEC

    @device_function
    def query_word(query, seq, h, v, c):
        """Word ``c`` (elements ``2c, 2c + 1``) of vector ``v`` of query row ``h``."""
        w0, w1, w2, w3 = load_words(query, (seq * query.shape[1] + h) * D + v * VEC)
        w = w0
        if c == 1:
            w = w1
        elif c == 2:
            w = w2
        elif c == 3:
            w = w3
        return w

    @device_function
    def block_at(block_tables, errors, seq, b, nb):
        """``block_tables[seq, b]`` if it is a block of the pool (``[0, nb)``),
        else 0. With the prefetch every table read of a step reads the block of
        its first token, which the window's load has checked (``step_blocks``,
        recorded after the loop): here it is only kept in the pool."""
        if PREFETCH:
            blk = block_tables[seq, b]
            return int32(0) if outside_(blk, nb) else blk
        return block_of_(block_tables, errors, seq, b, nb)

    @device_function
    def token_at(block_tables, errors, nb, seq, s, lo, hi):
        """``(physical block, offset in it)`` of token ``s`` moved into ``[lo, hi]``
        (a token outside reads a neighbour inside: finite data, masked out);
        ``nb``: the pool's blocks."""
        t = int32(min(max(s, lo), hi))
        b = int32(uint32(t) // uint32(BLOCK_SIZE))
        return block_at(block_tables, errors, seq, b, nb), int32(t - b * BLOCK_SIZE)

    @device_function
    def step_blocks(block_tables, nb, seq, astart, warp, j0, end, lane):
        """Lane ``lane``'s entry of the warp's block-number window: the block
        of the first token of step ``j0 + lane`` (0 past the end), and whether
        the table held an id outside the pool there instead (then 0)."""
        s = int32(astart + (warp + (j0 + lane) * NW) * STEP)
        blk = int32(0)
        if s < end:
            blk = block_tables[seq, uint32(s) // uint32(BLOCK_SIZE)]
        bad = outside_(blk, nb)
        return (int32(0) if bad else blk), bad

    @device_function
    def issue(ring, key_cache, value_cache, block_tables, errors, nb, seq, krows, vrows, s0, lo,
              hi, stage, r, g, tid, blk, vsw):
        """Copy the step's key vectors (token ``s0 + r``) and value vectors
        (tokens ``s0 + g + k * TG``) into ``stage`` of the ring, as one group;
        tokens outside ``[lo, hi]`` copy token ``lo`` or ``hi`` instead."""
        # int32 token and in-block arithmetic, int64 only for block * block stride
        kb0, k_blk, k_tok, k_v4 = krows
        vb0, v_blk, v_tok, _ = vrows
        if ONE_BLOCK and s0 >= lo and int32(s0 + STEP - 1) <= hi:
            b = int32(uint32(s0) // uint32(BLOCK_SIZE))
            if not PREFETCH:
                blk = block_of_(block_tables, errors, seq, b, nb)
            off = int32(s0 - b * BLOCK_SIZE)
            vt = wide(blk, v_blk) + int32(vb0 + (off + g) * v_tok)
            if KR:
                kt = wide(blk, k_blk) + int32(kb0 + (off + g) * k_tok)
                for k in range(TPL):
                    copy16_async(ring, swizzled(stage, k, k, tid, vsw), key_cache,
                                 kt + int32((k * TG) * k_tok))
            else:
                kt = wide(blk, k_blk) + int32(kb0 + (off + r) * k_tok)
                for i in range(KV4):
                    copy16_async(ring, chunk(stage, i, tid), key_cache, kt + i * k_v4)
            if STAGE_V:
                for k in range(TPL):
                    copy16_async(ring, vdst(stage, k, tid, vsw), value_cache,
                                 vt + int32((k * TG) * v_tok))
        elif KR:        # keys and values of token g + k * TG: one table load each
            for k in range(TPL):
                bt, off = token_at(block_tables, errors, nb, seq, s0 + g + k * TG, lo, hi)
                kt = wide(bt, k_blk) + int32(kb0 + off * k_tok)
                copy16_async(ring, swizzled(stage, k, k, tid, vsw), key_cache, kt)
                if STAGE_V:
                    vt = wide(bt, v_blk) + int32(vb0 + off * v_tok)
                    copy16_async(ring, vdst(stage, k, tid, vsw), value_cache, vt)
        else:
            bt, off = token_at(block_tables, errors, nb, seq, s0 + r, lo, hi)
            kt = wide(bt, k_blk) + int32(kb0 + off * k_tok)
            for i in range(KV4):
                copy16_async(ring, chunk(stage, i, tid), key_cache, kt + i * k_v4)
            if STAGE_V:
                for k in range(TPL):
                    bt, off = token_at(block_tables, errors, nb, seq, s0 + g + k * TG, lo, hi)
                    vt = wide(bt, v_blk) + int32(vb0 + off * v_tok)
                    copy16_async(ring, vdst(stage, k, tid, vsw), value_cache, vt)
        commit_group()

    @device_function
    def pv_token(k, acc, vr, pr, ring, stage, tid, p_s, warp, g, s0, start, hi,
                 value_cache, block_tables, errors, nb, seq, kvh, lr):
        """Add value token ``g + k * TG`` of the step, weighted by each head's
        probability, to the lane's running outputs."""
        if STAGE_V:
            load16(ring, chunk(stage, KV4 + k, tid), vr, 0)
        else:   # a token outside [start, end) reads a neighbour inside (p = 0)
            t = int32(min(max(s0 + g + k * TG, start), hi))
            b = int32(uint32(t) // uint32(BLOCK_SIZE))
            v_vec(value_cache, block_at(block_tables, errors, seq, b, nb), kvh,
                  t - b * BLOCK_SIZE, lr, vr, 0)
        for h4 in range(0, HP4, 4):
            load16(p_s, (warp * STEP + g + k * TG) * MAX_HPB + h4, pr, h4)
        for hh in range(HPB):
            for e in range(VEC):
                acc[hh, e] += pr[hh] * vr[e]

    @device_function
    def gather_values(ring, stage, tid, value_cache, block_tables, errors, nb, seq, kvh, s0,
                      start, hi, g, lr, vsw):
        """P @ V on tensor cores with "vllm" value rows (strided by the block
        size, so not ``cp.async``): store the lane's value vectors where the
        other layouts' copies put them, element by element."""
        for k in range(TPL):
            blk, tok = token_at(block_tables, errors, nb, seq, s0 + g + k * TG, start, hi)
            base = vdst(stage, k, tid, vsw)
            for e in range(VEC):
                ring[base + e] = value_cache[blk, kvh, lr * VEC + e, tok]

    @device_function
    def load_a(qa, query, seq, h, valid, c):
        """A-fragment words of query row ``h`` (zeros unless ``valid``): vector
        ``c + 4i`` holds the words of k-steps ``2i`` (words 0, 1) and ``2i + 1``
        (words 2, 3); with ``key_rows`` k-step ``kk`` takes words ``c`` of vectors
        ``2 kk`` and ``2 kk + 1``; with an fp8 cache k-step ``kk`` takes dims ``16 kk
        + 4c, + 1`` (word 0) and ``+ 2, + 3`` (word 1), as the keys' ldmatrix gives
        them."""
        if FP8:
            for kk in range(KSTEPS):
                w0 = uint32(0)
                w1 = uint32(0)
                w2 = uint32(0)
                w3 = uint32(0)
                if valid:   # 8-element vector 2 kk + c // 2: dims 16 kk + 8 (c // 2) ..
                    w0, w1, w2, w3 = load_words(query, ((seq * query.shape[1] + h) * D
                                                        + (2 * kk + (c >> 1)) * VEC))
                if c & 1:
                    w0 = w2
                    w1 = w3
                qa[2 * kk] = w0
                qa[2 * kk + 1] = w1
            return
        for i in range(KV4):
            w0 = uint32(0)
            w1 = uint32(0)
            w2 = uint32(0)
            w3 = uint32(0)
            if valid and not KR:
                w0, w1, w2, w3 = load_words(query, ((seq * query.shape[1] + h) * D
                                                    + (c + 4 * i) * VEC))
            if valid and KR:
                w0 = query_word(query, seq, h, 4 * i, c)
                w1 = query_word(query, seq, h, 4 * i + 1, c)
                w2 = query_word(query, seq, h, 4 * i + 2, c)
                w3 = query_word(query, seq, h, 4 * i + 3, c)
            qa[4 * i] = w0
            qa[4 * i + 1] = w1
            qa[4 * i + 2] = w2
            qa[4 * i + 3] = w3

    @device_function
    def load_a8(qa, query, seq, h, valid, c):
        """``qk_fp8``: query row ``h`` (zeros unless ``valid``) quantised to
        E4M3 codes, ``x / s`` rounded to nearest even with ``s = max |x| / 448``
        over the row (1 for a row of zeros; NaN where the row holds a NaN or an
        infinity, so that its codes and logits are NaN; 2**-149 where the
        division underflows to 0): word ``v`` holds dims
        ``16 v + 4 c .. 16 v + 4 c + 3`` (the lowest in the lowest byte), so that
        the 32-dim k-step ``kk`` takes words ``2 kk`` (its dims ``4c ..``) and ``2 kk
        + 1`` (dims ``16 + 4c ..``), as the keys' ldmatrix gives the codes.
        Returns ``s`` (the same in the row's four lanes)."""
        amax = float32(0.0)
        bad = float32(0.0)
        for v in range(D // 16):     # the row's largest magnitude (read again below)
            for i in range(4):
                x = float32(0.0)
                if valid:
                    x = to_f32_any(query[seq, h, 16 * v + 4 * c + i])
                ax = abs(x)
                if not ax <= FLT_MAX:          # NaN or an infinity
                    bad = float32(1.0)
                elif ax > amax:
                    amax = ax
        amax = quad_max(amax)
        s = float32(1.0)
        if amax > float32(0.0):
            s = amax / float32(QK_MAX)
            if s == float32(0.0):
                s = float32(2.0 ** -149)
        if quad_max(bad) > float32(0.0):
            s = float32(math.nan)
        for v in range(D // 16):
            w = uint32(0)
            for i in range(4):
                x = float32(0.0)
                if valid:
                    x = to_f32_any(query[seq, h, 16 * v + 4 * c + i])
                w |= uint32(encode_q(x / s)) << uint32(8 * i)
            qa[v] = w
        return s

    @device_function
    def weights(d0, d1, valid, slope, m_run, l_run, t0, start, end, qpos, qscale, soft_cap,
                cap2):
        """One head's step of the online softmax over the lane's logits ``d0,
        d1`` (tokens ``t0, t0 + 1``; all masked unless ``valid``): the weights,
        the new maximum and sum, the rescale factor and whether the maximum grew."""
        z0 = d0 * qscale
        z1 = d1 * qscale
        if soft_cap > 0.0:
            z0 = cap2 * math.tanh(z0 / cap2)
            z1 = cap2 * math.tanh(z1 / cap2)
        t1 = int32(t0 + 1)
        z0 += slope * float32(int32(t0 - qpos))
        z1 += slope * float32(int32(t1 - qpos))
        if not valid or t0 < start or t0 >= end:
            z0 = NEG_INF
        if not valid or t1 < start or t1 >= end:
            z1 = NEG_INF
        m_new = max(m_run, quad_max(max(z0, z1)))
        grew = m_new > m_run
        alpha = float32(1.0)
        if grew:
            alpha = math.exp2(m_run - m_new)
        # exp2 of -inf - 0 is 0; a NaN logit stays NaN (NaN in, NaN out)
        m_use = m_new if m_new != NEG_INF else float32(0.0)
        p0 = math.exp2(z0 - m_use)
        p1 = math.exp2(z1 - m_use)
        return p0, p1, m_new, l_run * alpha + p0 + p1, alpha, grew

    @device_function
    def rescale_half(o, hf, alpha, c):
        """Scale half ``hf``'s output tiles by their heads' factors (lane ``(r,
        c)`` holds heads ``2c`` and ``2c + 1`` of the half: lanes ``8c`` and ``8c + 4``
        hold their factors)."""
        a_even = cuda.shfl_sync(FULL_MASK, alpha, 8 * c)       # head 2c
        a_odd = cuda.shfl_sync(FULL_MASK, alpha, 8 * c + 4)    # head 2c + 1
        for i in range(NMMA):
            o[hf, i, 0] *= a_even
            o[hf, i, 1] *= a_odd
            o[hf, i, 2] *= a_even
            o[hf, i, 3] *= a_odd

    @device_function
    def pv_tiles(o, hf, k, w0, w1, w2, w3, p_lo, p_hi):
        """Output tiles ``2k`` and ``2k + 1`` of half ``hf`` += the value words of
        ldmatrix ``k`` times the weights (``P^T``'s B fragment, low then high half)."""
        t = 2 * k
        o[hf, t, 0], o[hf, t, 1], o[hf, t, 2], o[hf, t, 3] = mma8(
            w0, w1, p_lo, o[hf, t, 0], o[hf, t, 1], o[hf, t, 2], o[hf, t, 3])
        o[hf, t, 0], o[hf, t, 1], o[hf, t, 2], o[hf, t, 3] = mma8(
            w0, w1, p_hi, o[hf, t, 0], o[hf, t, 1], o[hf, t, 2], o[hf, t, 3])
        t = 2 * k + 1
        o[hf, t, 0], o[hf, t, 1], o[hf, t, 2], o[hf, t, 3] = mma8(
            w2, w3, p_lo, o[hf, t, 0], o[hf, t, 1], o[hf, t, 2], o[hf, t, 3])
        o[hf, t, 0], o[hf, t, 1], o[hf, t, 2], o[hf, t, 3] = mma8(
            w2, w3, p_hi, o[hf, t, 0], o[hf, t, 1], o[hf, t, 2], o[hf, t, 3])

    @device_function
    def pv_tile8(o, hf, t, a0, a1, p_lo, p_hi):
        """fp8: output tile ``t`` of half ``hf`` += the value fragment ``(a0, a1)``
        (dims ``16 t + 2 r`` and ``+ 1``) times the weights, low then high half."""
        o[hf, t, 0], o[hf, t, 1], o[hf, t, 2], o[hf, t, 3] = mma8(
            a0, a1, p_lo, o[hf, t, 0], o[hf, t, 1], o[hf, t, 2], o[hf, t, 3])
        o[hf, t, 0], o[hf, t, 1], o[hf, t, 2], o[hf, t, 3] = mma8(
            a0, a1, p_hi, o[hf, t, 0], o[hf, t, 1], o[hf, t, 2], o[hf, t, 3])

    @device_function
    def pv_words(o, k, j, w, p_lo, p_hi, q_lo, q_hi):
        """fp8: word ``j`` of value ldmatrix ``k`` into output tile ``4 k + j``."""
        a0, a1 = value_words(w)
        pv_tile8(o, 0, 4 * k + j, a0, a1, p_lo, p_hi)
        if TWO:
            pv_tile8(o, 1, 4 * k + j, a0, a1, q_lo, q_hi)


    return SimpleNamespace(**{k: v for k, v in locals().items() if not k.startswith("__")})
