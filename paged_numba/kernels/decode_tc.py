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
  the copies' own reads of it only clamp. ``guard=False`` builds the kernel
  without any of this (to time what it costs).

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
logits' scale, V's onto the output before the warps merge. With ``qk_fp8``
each query head's row is quantised to E4M3 (a scale of its own, ``load_a8``)
and ``mma.m16n8k32`` takes the key ldmatrix words as they are, a 32-dim
k-step each; the row's scale joins K's in the logits' scale.
"""
import functools
from operator import attrgetter

from numba import config, cuda, float32, int32, uint32

from .access import device_function
from .async_copy import commit_group
from .decode import FULL_MASK, LOG2E, NEG_INF
from .decode_tc_parts import decode_tc_parts
from .decode_tc_tiling import (  # noqa: F401  (the tiling's names, kept here too)
    DTYPES, FP8_DTYPES, FP8_HEAD_SIZES, FP8_LAYOUTS, HEAD_SIZES, LAYOUTS, MAX_HPB,
    MAX_SHARED_BYTES, SATURATING_WARP_DIMS, STEP, _chunks_per_lane, dynamic_ring_bytes,
    kv_bytes, ring_stages, saturating_blocks, supports)
from .mma import ldmatrix_x4, ldmatrix_x4_trans, load_words
from .pdl import launch_dependents
from .vector import load16


@functools.cache
def decode_tc_kernel(head_size, block_size, heads_per_block, dtype, layout,
                     num_warps=4, stages=2, split=False, max_registers=None,
                     unroll_pv=True, prefetch=True, pv_mma=False,
                     key_rows=False, query_dtype=None, qk_fp8=False, guard=True, pdl=False):
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
    says which ones ``paged_decode`` uses by default. ``guard=False`` takes
    table ids and lengths as they are (an id outside the pool is followed
    outside it, nothing is recorded), only to time the device guard
    (:mod:`kernels.guard`); on valid inputs the outputs are bit-identical.
    ``pdl`` (split kernels): each block lets the merge launched after it
    start early (:mod:`.pdl`)."""
    P = decode_tc_parts(head_size, block_size, heads_per_block, dtype, layout, num_warps,
                        stages, split, prefetch, pv_mma, key_rows, query_dtype, qk_fp8,
                        guard=guard)
    (BLOCK_SIZE, CPS, D, DYNAMIC, DYNAMIC_BYTES, FP8, HP4, HPB, HROWS, KR, KSTEPS, KV4,
     KV_HEAD_AXIS, KW, LPR, NH, NLDM, NMMA, NT, NW, PREFETCH, PV, QA, RING, SMEM_T, STAGES,
     STAGE_V, TG, TPL, TWO, VEC, block_of, chunk, gather_values, issue, k_rows, key_words,
     length_of, load_a, merge_warps, mma, pv_tiles, pv_token, pv_words, quad_sum,
     rescale_half, split_p, step_blocks, v_rows, wait_stages, weights) = attrgetter(
        "BLOCK_SIZE", "CPS", "D", "DYNAMIC", "DYNAMIC_BYTES", "FP8", "HP4", "HPB", "HROWS",
        "KR", "KSTEPS", "KV4", "KV_HEAD_AXIS", "KW", "LPR", "NH", "NLDM", "NMMA", "NT", "NW",
        "PREFETCH", "PV", "QA", "RING", "SMEM_T", "STAGES", "STAGE_V", "TG", "TPL", "TWO",
        "VEC", "block_of_", "chunk", "gather_values", "issue", "k_rows", "key_words",
        "length_of_", "load_a", "merge_warps", "mma", "pv_tiles", "pv_token", "pv_words",
        "quad_sum", "rescale_half", "split_p", "step_blocks", "v_rows", "wait_stages",
        "weights")(P)
    QK8, load_a8, mma32 = P.QK8, P.load_a8, P.mma32
    PDL = bool(pdl)

    @device_function
    def decode(out, lse, query, key_cache, value_cache, block_tables, seq_lens, scale,
               partition_size, alibi_slopes, soft_cap, window, errors, kv_scales):
        if PDL:
            launch_dependents()
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
        sa = float32(1.0)           # qk_fp8: the rows' query scales
        sb = float32(1.0)
        if QK8:
            sa = load_a8(qa, query, seq, h0 + r, r < HPB, c)
            sb = load_a8(qb, query, seq, h0 + r + 8, TWO and r + 8 < HPB, c)
        else:
            load_a(qa, query, seq, h0 + r, r < HPB, c)
            load_a(qb, query, seq, h0 + r + 8, TWO and r + 8 < HPB, c)
        zero = uint32(0)
        k_scale = float32(1.0)
        v_scale = float32(1.0)
        if FP8:     # the codes' scales: K's into the logits' scale, V's into the output
            k_scale = kv_scales[0, kvh]
            v_scale = kv_scales[1, kvh]
        qscale = scale * float32(LOG2E) * k_scale
        qscale2 = qscale            # head r + 8's (two halves)
        if QK8:
            qscale2 = qscale * sb
            qscale = qscale * sa
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
                if FP8 and not QK8:
                    # vectors 4i .. 4i + 3 of tokens 0..7: B of k-steps 4i .. 4i + 3
                    x0, x1, x2, x3 = ldmatrix_x4(
                        ring, ((stage * CPS + lt // TG) * NT + (lrow ^ (4 * i))) * VEC)
                    kw[8 * i], kw[8 * i + 1] = key_words(x0)
                    kw[8 * i + 2], kw[8 * i + 3] = key_words(x1)
                    kw[8 * i + 4], kw[8 * i + 5] = key_words(x2)
                    kw[8 * i + 6], kw[8 * i + 7] = key_words(x3)
                elif KR:  # vectors 4i .. 4i + 3 of tokens 0..7: B of k-steps 2i, 2i + 1
                    # (qk_fp8: fp8 codes as they stand, B of 32-dim k-steps 2i, 2i + 1)
                    kw[4 * i], kw[4 * i + 1], kw[4 * i + 2], kw[4 * i + 3] = ldmatrix_x4(
                        ring, ((stage * CPS + lt // TG) * NT + (lrow ^ (4 * i))) * VEC)
                else:
                    kw[4 * i], kw[4 * i + 1], kw[4 * i + 2], kw[4 * i + 3] = load_words(
                        ring, chunk(stage, i, tid))
            d0 = float32(0.0)
            d1 = float32(0.0)
            d2 = float32(0.0)
            d3 = float32(0.0)
            if QK8:
                for kk in range(KSTEPS // 2):
                    d0, d1, d2, d3 = mma32(qa[2 * kk], qb[2 * kk] if TWO else zero,
                                           qa[2 * kk + 1], qb[2 * kk + 1] if TWO else zero,
                                           kw[2 * kk], kw[2 * kk + 1], d0, d1, d2, d3)
            else:
                for kk in range(KSTEPS):
                    d0, d1, d2, d3 = mma(qa[2 * kk], qb[2 * kk] if TWO else zero,
                                         qa[2 * kk + 1], qb[2 * kk + 1] if TWO else zero,
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
                    d2, d3, r + 8 < HPB, slope2, m_run2, l_run2, t0, start, end, qpos, qscale2,
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
