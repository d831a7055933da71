"""Paged decode attention with the q.k products on tensor cores (fp16/bf16
caches, and fp8 caches with fp16/bf16 queries).

Computes what ``kernels.decode`` computes (see its NumPy spec, with the
same arguments, grid and outputs) with a different work split and rounding;
every layout gives bit-identical results. For head sizes 32, 64, 128 and
256, KV-head groups of at most 8 query heads, and every layout.

Structure (of the base kernel; the variants at the end replace its key
reads or its P @ V):

* grid ``(num_heads // HPB, num_seqs, num_partitions)``, ``NW`` warps with no
  barrier until the epilogue; warp ``w`` takes the 8-token steps ``w, w + NW,
  ...`` of its partition (steps start at multiples of 8) and keeps its own
  online softmax;
* copies: each lane ``cp.async``-copies into its own slots of a shared-memory
  ring (static; dynamic where more warps or stages are asked for than 48 KB
  hold), ``STAGES - 1`` steps ahead, the 16-byte key vectors ``c, c + 4, ...``
  of token ``r`` of the step (``r = lane // 4``, ``c = lane % 4``) and the
  value vector ``lane % LPR`` of its tokens ``lane // LPR + k * TG`` (the
  "vllm" layout's value rows are strided: it reads them directly when it
  needs them). Tokens outside the partition copy a neighbour inside it
  (finite data, masked out). Where a step lies in one block (block sizes
  that are multiples of 8), lane ``i`` holds the block number of the warp's
  step ``32 n + i`` and a step takes its own with one shuffle, so the copies
  do not wait for a table load;
* logits: ``S = Q K^T`` for the step's 8 tokens is ``D / 16`` tensor-core
  products ``mma.m16n8k16`` with the group's query rows as ``A`` (loaded once,
  rows ``HPB..15`` zero) and the keys as ``B``. The head dimension is
  permuted the same way in both operands (it is a sum), so a lane's key
  vectors are its ``B`` fragments as they are; products and sums are fp32;
* softmax: lane ``(r, c)`` holds the logits of head ``r`` for tokens ``2c,
  2c + 1``: scale (base 2), soft cap, ALiBi, mask, a max over the four lanes of
  the head (2 shuffles), ``exp2``. The probabilities go through a per-warp
  shared ``[8 tokens, HPB]`` table to the lanes that hold the values;
* P @ V in fp32 FMAs: lane ``(g, lr)`` accumulates value vector ``lr`` of
  its tokens for every head of the group; the running output is rescaled only
  when a head's maximum grew (a warp vote);
* epilogue: ``kernels.decode.warp_merger``, shared with that kernel;
* out-of-range lengths and block ids are clamped and recorded as in
  ``kernels.decode`` (:mod:`.guard`); with the prefetch a block id is checked
  where the lanes load their window of them (a lane that saw a bad one
  records it after the loop, the recording code out of the loop's way), and
  the copies' own reads of it only clamp.

Variants (other rounding; ``paged_decode``'s and ``DecodePlan``'s ``pv_mma``
and ``key_rows`` options choose them, by default ``pv_mma`` everywhere and
``key_rows`` in the unsplit kernel): ``pv_mma`` does P @ V on tensor cores,
``O^T += V^T P^T`` with ``mma.m16n8k8`` (the QK product's D fragment is
``P^T``'s B fragment as it stands; the weights go in as hi + lo halves), the
values copied as above into an XOR-swizzled ring and read with
``ldmatrix.trans``; ``key_rows`` copies the keys the same way and reads their
B fragments with ``ldmatrix``.

fp8 caches (``dtype`` "float8_e4m3fn" or "float8_e5m2", ``query_dtype``
"float16" or "bfloat16", head sizes 64/128/256, not "vllm"; both variants):
the ring holds the codes (16 a 16-byte vector, typed 16-bit for ``ldmatrix``)
and :mod:`.fp8_mma` converts them in registers: a key ldmatrix word (dims
``4c .. 4c + 3``) into the two B words of one k-step, the query's A words
loaded in that order; a value ``ldmatrix.trans`` word (dims ``2r, 2r + 1``
of tokens ``2c, 2c + 1``) into the A fragment of output rows ``16 t + 2r``
and ``+ 1`` (``row_a``, ``row_b``). The products are in the query's type;
``kv_scales [2, num_kv_heads]`` is a last argument: K's scale goes into the
logits' scale, V's onto the output before the warps merge.
"""
import functools
import math

from numba import config, cuda, float32, int32, uint16, uint32

from .access import device_function, row_strides, vector_accessors, vector_offsets, wide
from .async_copy import commit_group, copy16_async, wait_group
from .convert import codec
from .decode import FULL_MASK, LOG2E, NEG_INF, STORAGE, lane_reducer, warp_merger
from .guard import block_of, length_of, outside
from .mma import ldmatrix_x4, ldmatrix_x4_trans, load_words, mma_m16n8k8, mma_m16n8k16, split_pack
from .decode_tc_tiling import (  # noqa: F401  (the tiling's names, kept here too)
    DTYPES, FP8_DTYPES, FP8_HEAD_SIZES, FP8_LAYOUTS, HEAD_SIZES, LAYOUTS, MAX_HPB,
    MAX_SHARED_BYTES, SATURATING_WARP_DIMS,
    STEP, _chunks_per_lane, dynamic_ring_bytes, kv_bytes, ring_stages, saturating_blocks,
    supports)
from .fp8_mma import crossed, pairs
from .vector import load16


@functools.cache
def decode_tc_kernel(head_size, block_size, heads_per_block, dtype, layout,
                     num_warps=4, stages=2, split=False, max_registers=None,
                     unroll_pv=True, prefetch=True, pv_mma=False,
                     key_rows=False, query_dtype=None):
    """Compile-time specialised tensor-core decode kernel; arguments, grid and
    block as for :func:`kernels.decode.decode_kernel` (``32 * num_warps``
    threads). ``max_registers`` caps the registers per thread (ptxas spills
    the rest); ``unroll_pv`` writes the P @ V token loop out; ``prefetch``
    keeps the block numbers of the warp's next 32 steps in its lanes (block
    sizes that are multiples of 8). None of the three changes the arithmetic:
    outputs are bit-identical either way. ``pv_mma`` does P @ V on tensor
    cores too (``mma.m16n8k8``, the weights split into hi + lo halves): other
    rounding, bounded in ``testing.attention_error_bound(pv=...)``.
    ``key_rows`` copies the keys as the values are copied (whole rows an
    instruction, the XOR-swizzled ring) and reads the mma's B fragments with
    ``ldmatrix``: the head dimension in its natural order, so other rounding
    too. Both together were 2.6-3.8% faster than neither on the H200's large
    headline shapes (``docs/journal/decode_tc.md``, decode v8, 2026-11-30); ``tuning.decode_launch``
    says which ones ``paged_decode`` uses by default."""
    if not supports(head_size, heads_per_block, dtype, layout):
        raise ValueError(f"no tensor-core decode kernel for head_size={head_size}, "
                         f"heads_per_block={heads_per_block}, {dtype}, {layout}")
    FP8 = dtype in FP8_DTYPES
    if FP8 and not (pv_mma and key_rows):
        raise ValueError(f"an fp8 cache ({dtype}) needs pv_mma=True and key_rows=True, but got "
                         f"pv_mma={pv_mma}, key_rows={key_rows}")
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
    if FP8:
        key_words = pairs(dtype, MMA_T)           # a key row's dims 4c .. 4c + 3
        value_words = crossed(dtype, MMA_T)       # dims 2r, 2r + 1 of tokens 2c, 2c + 1
    quad_max = lane_reducer(3, True)            # over the 4 lanes of a head row
    quad_sum = lane_reducer(3, False)
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
            return int32(0) if outside(blk, nb) else blk
        return block_of(block_tables, errors, seq, b, nb)

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
        bad = outside(blk, nb)
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
                blk = block_of(block_tables, errors, seq, b, nb)
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

    @device_function
    def decode(out, lse, query, key_cache, value_cache, block_tables, seq_lens, scale,
               partition_size, alibi_slopes, soft_cap, window, errors, kv_scales):
        hb = cuda.blockIdx.x
        seq = cuda.blockIdx.y
        part = cuda.blockIdx.z
        tid = int32(cuda.threadIdx.x)
        lane = int32(tid % 32)
        warp = int32(tid // 32)
        r = int32(lane // 4)                 # mma row (query head) / key token of the step
        c = int32(lane % 4)                  # mma column pair: tokens 2c, 2c + 1
        lr = int32(lane % LPR)               # value vector this lane owns
        g = int32(lane // LPR)               # value token group
        group = query.shape[1] // key_cache.shape[KV_HEAD_AXIS]
        h0 = hb * HPB
        kvh = h0 // group
        nb = int32(key_cache.shape[0])       # blocks of the pool: table entries in [0, nb)
        # clamped into what the table's row holds (so its reads stay in it)
        seq_len = int32(length_of(seq_lens, errors, seq, block_tables.shape[1] * BLOCK_SIZE))
        qpos = int32(seq_len - 1)
        first = int32(0 if window <= 0 else max(seq_len - window, 0))
        start = int32(max(part * partition_size, first))
        end = int32(min(part * partition_size + partition_size, seq_len))
        hi = int32(end - 1)

        m_s = cuda.shared.array((NW, HROWS), float32)
        l_s = cuda.shared.array((NW, HROWS), float32)
        alpha_s = cuda.shared.array((NW, MAX_HPB), float32, alignment=16)
        # (the CUDA-core P @ V's weights; none with two halves, whose tables are larger)
        p_s = cuda.shared.array((NW, 1 if TWO else STEP, 1 if TWO else MAX_HPB), float32,
                                alignment=16)
        acc_s = cuda.shared.array((NW, D), float32)
        ring = cuda.shared.array(0 if DYNAMIC else RING, SMEM_T, alignment=16)

        # A fragments: query row h0 + r (zero for r >= HPB); with two halves
        # row h0 + r + 8 too (the mma's rows 8..15), else zeros
        qa = cuda.local.array(QA, uint32)
        qb = cuda.local.array(QA, uint32)
        load_a(qa, query, seq, h0 + r, r < HPB, c)
        load_a(qb, query, seq, h0 + r + 8, TWO and r + 8 < HPB, c)
        zero = uint32(0)
        k_scale = float32(1.0)
        v_scale = float32(1.0)
        if FP8:     # the codes' scales: K's into the logits' scale, V's into the output
            k_scale = kv_scales[0, kvh]
            v_scale = kv_scales[1, kvh]
        qscale = scale * float32(LOG2E) * k_scale
        cap2 = soft_cap * float32(LOG2E)
        slope = float32(0.0)
        if r < HPB:
            slope = alibi_slopes[h0 + r] * float32(LOG2E)
        slope2 = float32(0.0)
        if TWO and r + 8 < HPB:
            slope2 = alibi_slopes[h0 + r + 8] * float32(LOG2E)
        m_run = NEG_INF
        l_run = float32(0.0)
        m_run2 = NEG_INF            # head r + 8 (two halves)
        l_run2 = float32(0.0)
        acc = cuda.local.array((HPB, VEC), float32)
        for hh in range(HPB):
            for e in range(VEC):
                acc[hh, e] = 0.0
        o = cuda.local.array((NH, NMMA, 4), float32)   # PV: the mma tiles of O^T, a half each
        for hf in range(NH):
            for i in range(NMMA):
                for e in range(4):
                    o[hf, i, e] = 0.0
        kw = cuda.local.array(KW, uint32)
        vr = cuda.local.array(VEC, float32)
        pr = cuda.local.array(HP4, float32)
        # P @ V on tensor cores: the swizzle's lane shares (see vdst); ldmatrix
        # x4 number k reads vectors 4k + j, lane 8j + t naming token t's row
        vsw = int32(lane ^ (g & 7))
        lt = int32(lane & 7)
        lrow = int32((((lt % TG) * LPR + (lane >> 3)) ^ lt) + warp * 32)
        lstrip = int32(KV4 + lt // TG)
        krows = k_rows(key_cache, kvh, lr if KR else c)
        vrows = v_rows(value_cache, kvh, lr)

        astart = int32(start - start % STEP)
        nsteps = int32(0)
        if astart + warp * STEP < end:
            nsteps = int32((end - astart - warp * STEP + NW * STEP - 1) // (NW * STEP))
        tab_win = int32(0)
        bad = False              # this lane's windows held an id outside the pool
        if PREFETCH:
            tab_win, bad = step_blocks(block_tables, nb, seq, astart, warp, 0, end, lane)
        for j in range(STAGES - 1):                 # fill the ring
            blk = int32(0)
            if PREFETCH:
                blk = cuda.shfl_sync(FULL_MASK, tab_win, j)
            if j < nsteps:
                issue(ring, key_cache, value_cache, block_tables, errors, nb, seq, krows, vrows,
                      int32(astart + (warp + j * NW) * STEP), start, hi, j, r, g, tid, blk,
                      vsw)
            else:
                commit_group()
        stage = int32(0)
        nxt_stage = int32(STAGES - 1)
        for j in range(nsteps):
            if PV or KR:
                cuda.syncwarp()                      # last step's ldmatrix reads are done
            nxt = int32(j + STAGES - 1)
            blk = int32(0)
            if PREFETCH:
                if nxt & 31 == 0:
                    tab_win, bad_win = step_blocks(block_tables, nb, seq, astart, warp, nxt, end,
                                                   lane)
                    bad = bad or bad_win
                blk = cuda.shfl_sync(FULL_MASK, tab_win, nxt & 31)
            if nxt < nsteps:
                issue(ring, key_cache, value_cache, block_tables, errors, nb, seq, krows, vrows,
                      int32(astart + (warp + nxt * NW) * STEP), start, hi, nxt_stage, r, g, tid,
                      blk, vsw)
            else:
                commit_group()
            nxt_stage = int32(nxt_stage + 1 if nxt_stage + 1 < STAGES else 0)
            wait_stages()                           # this step's group has landed
            s0 = int32(astart + (warp + j * NW) * STEP)
            if PV and not STAGE_V:
                gather_values(ring, stage, tid, value_cache, block_tables, errors, nb, seq, kvh,
                              s0, start, hi, g, lr, vsw)
            if PV or KR:
                cuda.syncwarp()                      # every lane's rows are in the ring
            # -- logits of head r, tokens 2c and 2c + 1, on tensor cores
            for i in range(KV4):
                if FP8:  # vectors 4i .. 4i + 3 of tokens 0..7: B of k-steps 4i .. 4i + 3
                    x0, x1, x2, x3 = ldmatrix_x4(
                        ring, ((stage * CPS + lt // TG) * NT + (lrow ^ (4 * i))) * VEC)
                    kw[8 * i], kw[8 * i + 1] = key_words(x0)
                    kw[8 * i + 2], kw[8 * i + 3] = key_words(x1)
                    kw[8 * i + 4], kw[8 * i + 5] = key_words(x2)
                    kw[8 * i + 6], kw[8 * i + 7] = key_words(x3)
                elif KR:  # vectors 4i .. 4i + 3 of tokens 0..7: B of k-steps 2i, 2i + 1
                    kw[4 * i], kw[4 * i + 1], kw[4 * i + 2], kw[4 * i + 3] = ldmatrix_x4(
                        ring, ((stage * CPS + lt // TG) * NT + (lrow ^ (4 * i))) * VEC)
                else:
                    kw[4 * i], kw[4 * i + 1], kw[4 * i + 2], kw[4 * i + 3] = load_words(
                        ring, chunk(stage, i, tid))
            d0 = float32(0.0)
            d1 = float32(0.0)
            d2 = float32(0.0)
            d3 = float32(0.0)
            for kk in range(KSTEPS):
                d0, d1, d2, d3 = mma(qa[2 * kk], qb[2 * kk] if TWO else zero, qa[2 * kk + 1],
                                     qb[2 * kk + 1] if TWO else zero,
                                     kw[2 * kk], kw[2 * kk + 1], d0, d1, d2, d3)
            # -- online softmax (variants in order: soft cap, ALiBi; then the mask):
            # head r from (d0, d1), with two halves head r + 8 from (d2, d3)
            t0 = int32(s0 + 2 * c)
            p0, p1, m_run, l_run, alpha, grew = weights(
                d0, d1, r < HPB, slope, m_run, l_run, t0, start, end, qpos, qscale, soft_cap,
                cap2)
            p2 = float32(0.0)
            p3 = float32(0.0)
            alpha2 = float32(1.0)
            grew2 = False
            if TWO:
                p2, p3, m_run2, l_run2, alpha2, grew2 = weights(
                    d2, d3, r + 8 < HPB, slope2, m_run2, l_run2, t0, start, end, qpos, qscale,
                    soft_cap, cap2)
            if PV:
                # -- P @ V on tensor cores: O^T += V^T P^T, 16 dims x 8 heads a tile;
                # this lane's (p0, p1) is P^T's B fragment as it stands ((p2, p3) the
                # second half's)
                p_hi, p_lo = split_p(p0, p1)
                q_hi, q_lo = p_hi, p_lo
                if TWO:
                    q_hi, q_lo = split_p(p2, p3)
                if cuda.any_sync(FULL_MASK, grew):
                    rescale_half(o, 0, alpha, c)
                if TWO and cuda.any_sync(FULL_MASK, grew2):
                    rescale_half(o, 1, alpha2, c)
                for k in range(NLDM):
                    w0, w1, w2, w3 = ldmatrix_x4_trans(
                        ring, ((stage * CPS + lstrip) * NT + (lrow ^ (4 * k))) * VEC)
                    if FP8:
                        pv_words(o, k, 0, w0, p_lo, p_hi, q_lo, q_hi)
                        pv_words(o, k, 1, w1, p_lo, p_hi, q_lo, q_hi)
                        pv_words(o, k, 2, w2, p_lo, p_hi, q_lo, q_hi)
                        pv_words(o, k, 3, w3, p_lo, p_hi, q_lo, q_hi)
                    else:
                        pv_tiles(o, 0, k, w0, w1, w2, w3, p_lo, p_hi)
                        if TWO:
                            pv_tiles(o, 1, k, w0, w1, w2, w3, q_lo, q_hi)
                stage = int32(stage + 1 if stage + 1 < STAGES else 0)
                continue
            cuda.syncwarp()                          # the last step's reads of p_s are done
            if r < HPB:
                p_s[warp, 2 * c, r] = p0
                p_s[warp, 2 * c + 1, r] = p1
                if c == 0:
                    alpha_s[warp, r] = alpha
            rescale = cuda.any_sync(FULL_MASK, grew)
            cuda.syncwarp()
            # -- P @ V: rescale the running output if a maximum grew, add the tokens
            if rescale:
                for h4 in range(0, HP4, 4):
                    load16(alpha_s, warp * MAX_HPB + h4, pr, h4)
                for hh in range(HPB):
                    for e in range(VEC):
                        acc[hh, e] *= pr[hh]
            if not unroll_pv:
                for k in range(TPL):
                    pv_token(k, acc, vr, pr, ring, stage, tid, p_s, warp, g, s0, start, hi,
                             value_cache, block_tables, errors, nb, seq, kvh, lr)
            else:                                   # TPL is 1, 2, 4 or 8
                pv_token(0, acc, vr, pr, ring, stage, tid, p_s, warp, g, s0, start, hi,
                         value_cache, block_tables, errors, nb, seq, kvh, lr)
                if TPL > 1:
                    pv_token(1, acc, vr, pr, ring, stage, tid, p_s, warp, g, s0, start, hi,
                             value_cache, block_tables, errors, nb, seq, kvh, lr)
                if TPL > 2:
                    pv_token(2, acc, vr, pr, ring, stage, tid, p_s, warp, g, s0, start, hi,
                             value_cache, block_tables, errors, nb, seq, kvh, lr)
                    pv_token(3, acc, vr, pr, ring, stage, tid, p_s, warp, g, s0, start, hi,
                             value_cache, block_tables, errors, nb, seq, kvh, lr)
                if TPL > 4:
                    for k in range(4, TPL):
                        pv_token(k, acc, vr, pr, ring, stage, tid, p_s, warp, g, s0, start, hi,
                                 value_cache, block_tables, errors, nb, seq, kvh, lr)
            stage = int32(stage + 1 if stage + 1 < STAGES else 0)

        if bad:   # rare: record it (the entries of the partition's steps, read again)
            for b in range(astart // BLOCK_SIZE, (end + BLOCK_SIZE - 1) // BLOCK_SIZE):
                block_of(block_tables, errors, seq, b, nb)
        # -- epilogue: the warp's state, then the warps merged with the (m, l) rule
        l_run = quad_sum(l_run)
        if c == 0 and r < HPB:
            m_s[warp, r] = m_run
            l_s[warp, r] = l_run
        if TWO:
            l_run2 = quad_sum(l_run2)
            if c == 0 and r + 8 < HPB:
                m_s[warp, r + 8] = m_run2
                l_s[warp, r + 8] = l_run2
        if FP8:
            for hf in range(NH):
                for i in range(NMMA):
                    for e in range(4):
                        o[hf, i, e] *= v_scale
        if PV:
            merge_warps(out, lse, seq, part, h0, warp, tid, r, c, o, m_s, l_s, acc_s)
        else:
            merge_warps(out, lse, seq, part, h0, warp, tid, g, lr, acc, m_s, l_s, acc_s)

    jit = cuda.jit(**({} if max_registers is None or config.ENABLE_CUDASIM
                      else dict(max_registers=max_registers)))
    if FP8:
        @jit
        def paged_decode_tc_fp8_kernel(out, lse, query, key_cache, value_cache, block_tables,
                                       seq_lens, scale, partition_size, alibi_slopes, soft_cap,
                                       window, errors, kv_scales):
            decode(out, lse, query, key_cache, value_cache, block_tables, seq_lens, scale,
                   partition_size, alibi_slopes, soft_cap, window, errors, kv_scales)
        kernel = paged_decode_tc_fp8_kernel
    else:
        @jit
        def paged_decode_tc_kernel(out, lse, query, key_cache, value_cache, block_tables,
                                   seq_lens, scale, partition_size, alibi_slopes, soft_cap,
                                   window, errors):
            decode(out, lse, query, key_cache, value_cache, block_tables, seq_lens, scale,
                   partition_size, alibi_slopes, soft_cap, window, errors,
                   alibi_slopes)     # (no scales)
        kernel = paged_decode_tc_kernel
    # what a launch must ask for (``_launch.PackedLaunch`` reads it)
    kernel.dynamic_shared_bytes = DYNAMIC_BYTES
    return kernel
