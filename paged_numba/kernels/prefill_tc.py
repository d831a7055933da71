"""Paged prefill attention on tensor cores (fp16 and bf16 caches).

Computes what ``kernels.prefill`` computes (see its NumPy spec: the same
arguments, grid, outputs and variants) with both products on tensor cores,
FlashAttention-2's loop order and work split:

* a thread block owns one *tile* of ``M = 16 * NW`` rows: ``BQ`` consecutive
  query tokens of one sequence times the ``HPB`` query heads of one GQA group
  (row ``r`` is token ``r // HPB``, head ``r % HPB``), so each K/V element is
  read once for the whole group; warp ``w`` owns rows ``16 w .. 16 w + 15``
  (the ``M`` rows of its ``mma.m16n8k16`` products). Rows past the tile's
  queries repeat its last query (finite data, never written);
* the queries are copied once (``cp.async``) into shared memory and read as
  A fragments with ``ldmatrix``, kept in registers where ``Q_IN_REGS``;
* keys and values are walked in tiles of ``BN`` tokens from the first one any
  row admits to the last one (causal: the tile's last position); each tile is
  gathered through the block table with 16-byte ``cp.async`` copies (any
  layout, any block size: a tile may span pages or a page tiles; tokens past
  the end copy the last one) into a two-stage ring, the copies of tile
  ``j + 1`` in flight while tile ``j`` is computed, one barrier a tile. Rows
  of ``D`` elements sit as ``D / 8`` 16-byte chunks, chunk ``ch`` of row ``n``
  at position ``ch ^ (n % 8)`` (XOR swizzle: the eight rows an ``ldmatrix``
  phase reads fall in eight distinct bank groups). The "vllm" layout's
  values are strided by the block size, so they are gathered element by
  element into the same rows;
* ``S = Q K^T``: per warp ``16 x BN`` in fp32 accumulators, ``D / 16 x BN /
  8`` products with the K fragments from ``ldmatrix``;
* the online softmax runs on the accumulator fragments (lane ``(r, c)``,
  ``r = lane // 4``, holds rows ``r`` and ``r + 8``, keys ``8 j + 2c, 8 j +
  2c + 1``): scale into base 2, soft cap, ALiBi, the mask (only on tiles that
  need one: the causal diagonal, the window's edge, the context's end), row
  maxima over the four lanes of a row (2 shuffles), ``exp2``; each lane keeps
  its share of the row sums, and the running output is rescaled only when a
  row's maximum grew (a warp vote);
* ``O += P V``: the probabilities are rounded to the cache's dtype in
  registers and used as they lie as A fragments (an m16n8k16 accumulator
  pair of n-tiles is an A fragment), the V fragments come from
  ``ldmatrix.trans``; fp32 accumulators ``16 x D`` per warp;
* epilogue: the row sums over the quad, ``out = O / l`` in the query's dtype,
  ``lse = (m + log2 l) ln 2``.

Rounding differs from the CUDA-core kernel in two places, both bounded by
``testing.prefill_error_bound(tensor_cores=dtype)``: the tensor cores'
truncating accumulation, and P rounded to fp16 / bf16 before ``P V`` (the
row sums ``l`` use the unrounded fp32 weights).
"""
import functools
import math

from numba import config, cuda, float32, int32, int64, uint32

from .access import device_function, vector_offsets
from .async_copy import commit_group, copy16_async, wait_group
from .decode import LOG2E, STORAGE, lane_reducer
from .convert import codec
from .mma import ldmatrix_x4, ldmatrix_x4_trans, mma_m16n8k16, pack_pair

FULL_MASK = 0xFFFFFFFF
NEG_INF = float32(-math.inf)
LN2 = 0.6931471805599453
DTYPES = ("float16", "bfloat16")
LAYOUTS = ("nhd", "vllm", "hnd", "interleaved")
MAX_SHARED_BYTES = 232448          # static + dynamic shared memory of one block (sm_90, opt-in)
STAGES = 2                         # K/V tiles in the ring


def supports(head_size, dtype, layout):
    """Whether :func:`prefill_tc_kernel` handles this combination: fp16 or bf16,
    a head size that is a power of two from 16 to 256 (rows of a power of two
    16-byte chunks, so the swizzle is a bijection)."""
    return (dtype in DTYPES and layout in LAYOUTS and 16 <= head_size <= 256
            and head_size & (head_size - 1) == 0)


def shared_bytes(head_size, num_warps, block_n):
    """Dynamic shared memory of one block: the queries and the K/V ring, 2 bytes
    an element.

    >>> shared_bytes(128, 8, 64)           # 128 query rows + 2 stages of 64 keys and values
    98304
    """
    return 2 * head_size * (16 * num_warps + STAGES * 2 * block_n)


def prefill_tc_config(head_size, group_size, max_q_len=None):
    """Default tiling ``(heads_per_block, block_q, block_n, num_warps)``.

    ``heads_per_block`` is the largest power of two dividing the GQA group (at
    most 8), as for the CUDA-core kernel; 8 warps (128 rows) for prompts, and
    keys tiles of 128 (head size 64), 64 (128) or 32 (256), the fastest of
    those timed on the H200 (``experiments/NOTES.md``, prefill v2); fewer
    warps when the batch's longest query fills fewer rows (decode-like
    batches), at least one (16 rows).

    >>> prefill_tc_config(128, 4), prefill_tc_config(128, 4, max_q_len=1)
    ((4, 32, 64, 8), (4, 4, 64, 1))
    >>> prefill_tc_config(64, 8), prefill_tc_config(256, 1)
    ((8, 16, 128, 8), (1, 128, 32, 8))
    """
    hpb = 1
    while hpb * 2 <= min(group_size, 8) and group_size % (hpb * 2) == 0:
        hpb *= 2
    block_n = 32 if head_size > 128 else 64 if head_size > 64 else 128
    num_warps = 8
    if max_q_len is not None:
        rows = int(max_q_len) * hpb
        while num_warps > 1 and 16 * (num_warps // 2) >= rows:
            num_warps //= 2
    return hpb, 16 * num_warps // hpb, block_n, num_warps


@functools.cache
def prefill_tc_kernel(head_size, block_size, heads_per_block, block_n, dtype, layout,
                      num_warps=8, q_in_regs=None, max_registers=None):
    """Compile-time specialised tensor-core prefill kernel: arguments and grid
    as for :func:`kernels.prefill.prefill_kernel` with ``block_q = 16 *
    num_warps // heads_per_block`` and ``32 * num_warps`` threads; the launch
    needs ``dynamic_shared_bytes`` (set on the kernel) of dynamic shared
    memory. ``q_in_regs`` keeps the query fragments in registers for the whole
    loop instead of re-reading them from shared memory each tile (default: up
    to head size 128, where it measured 3-5% faster on the H200); ``max_registers`` caps the registers per thread. Neither
    changes the arithmetic."""
    if not supports(head_size, dtype, layout):
        raise ValueError(f"no tensor-core prefill kernel for head_size={head_size}, {dtype}, "
                         f"{layout}")
    D = head_size
    BLOCK_SIZE = block_size
    HPB = heads_per_block
    NW = num_warps
    M = 16 * NW                           # rows of a tile
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
    CPT = -(-CHUNKS // NT)                # ... that each thread copies
    QCHUNKS = M * NCH
    QCPT = -(-QCHUNKS // NT)
    QREGS = (D <= 128) if q_in_regs is None else bool(q_in_regs)
    assert HPB & (HPB - 1) == 0 and M % HPB == 0 and BN % 16 == 0 and NW >= 1
    Q_OFF = 0
    KV_OFF = M * D                        # stage s: K at KV_OFF + 2 s BN D, V after it
    TOTAL = KV_OFF + STAGES * 2 * BN * D
    DYNAMIC_BYTES = 2 * TOTAL
    assert DYNAMIC_BYTES <= MAX_SHARED_BYTES, "tile too large for shared memory"
    STAGE_V = layout != "vllm"
    # each thread copies chunk tid % NCH of rows tid // NCH + u NT / NCH, all at
    # the same swizzle, so its slots differ by constants
    FIXED_CHUNK = NT % NCH == 0 and (NT // NCH) % (SWZ + 1) == 0
    KV_HEAD_AXIS = {"nhd": 2, "vllm": 1, "hnd": 1, "interleaved": 3}[layout]
    SMEM_T = STORAGE[dtype]
    k_flat, v_flat = vector_offsets(layout, 8, BLOCK_SIZE, D)
    wait_all = wait_group(0)
    mma = mma_m16n8k16(dtype)
    pack = pack_pair(dtype)
    _, from_f32 = codec(dtype)
    quad_max = lane_reducer(3, True)
    quad_sum = lane_reducer(3, False)

    @device_function
    def slot(base, row, ch):
        """Flat index in shared memory of chunk ``ch`` of ``row`` (swizzled)."""
        return base + (row * NCH + (ch ^ (row & SWZ))) * 8

    @device_function
    def lane_slot(row, b, lt):
        """An ldmatrix lane's offset from a fragment's first row: the lane names
        row ``row`` (``row % 8 == lt``, below 16) and chunk ``2 p + b`` of k-step
        pair ``p``. The swizzled position ``(2 p + b) ^ (row & SWZ)`` is ``(2 p) ^
        x``, and a power-of-two row length keeps the XOR inside the row, so the
        offset of pair ``p`` is this value XOR ``16 p`` (see :func:`frag_slot`)."""
        return (row * NCH + (b ^ (lt & SWZ))) * 8

    @device_function
    def frag_slot(base, row, p, lane_off):
        """Flat index of the lane's chunk of k-step pair ``p`` in the fragment
        whose first row is ``row`` (a multiple of 16): one XOR with a constant."""
        return base + row * NCH * 8 + (lane_off ^ (16 * p))

    def strider(flat):
        @device_function
        def strides(pool, kvh, ch):
            """``(base, block stride, token stride)`` in elements of chunk ``ch``
            of KV head ``kvh``'s rows in ``pool``: int32 (a block's elements fit)."""
            b0 = flat(pool, 0, kvh, 0, ch)
            return (int32(b0), int32(flat(pool, 1, kvh, 0, ch) - b0),
                    int32(flat(pool, 0, kvh, 1, ch) - b0))
        return strides

    k_strides = strider(k_flat)
    v_strides = strider(v_flat if STAGE_V else k_flat)

    @device_function
    def wide(block, stride):
        """``block * stride`` (both non-negative int32) as int64: one 32 x 32 -> 64
        multiply."""
        return int64(uint32(block)) * int64(uint32(stride))

    @device_function
    def issue_tile(sm, key_cache, value_cache, block_tables, seq, kvh, kt, lo, last, stage,
                   tid, kstr, vstr, tid_slot):
        """Start copying keys and values ``kt .. kt + BN - 1`` (clamped into
        ``[lo, last]``) into ``stage`` of the ring, as one group; ``kstr``, ``vstr``
        are this thread's :func:`strides`, ``tid_slot`` its first chunk's slot."""
        kbase = KV_OFF + 2 * stage * BN * D
        vbase = kbase + BN * D
        for u in range(CPT):
            idx = tid + u * NT
            if CHUNKS % NT == 0 or idx < CHUNKS:
                n = tid // NCH + u * (NT // NCH) if FIXED_CHUNK else idx // NCH
                ch = tid % NCH if FIXED_CHUNK else idx % NCH
                t = int32(min(max(kt + n, lo), last))
                b = int32(uint32(t) // uint32(BLOCK_SIZE))
                blk = block_tables[seq, b]
                off = int32(t - b * BLOCK_SIZE)
                if FIXED_CHUNK:       # the same chunk and row % 8 for every u
                    dk = kbase + tid_slot + u * NT * 8
                    dv = dk + BN * D
                    copy16_async(sm, dk, key_cache, wide(blk, kstr[1]) + (kstr[0] + off * kstr[2]))
                else:
                    dk = slot(kbase, n, ch)
                    dv = slot(vbase, n, ch)
                    copy16_async(sm, dk, key_cache, k_flat(key_cache, blk, kvh, off, ch))
                if STAGE_V:
                    if FIXED_CHUNK:
                        copy16_async(sm, dv, value_cache,
                                     wide(blk, vstr[1]) + (vstr[0] + off * vstr[2]))
                    else:
                        copy16_async(sm, dv, value_cache, v_flat(value_cache, blk, kvh, off, ch))
                else:
                    for e in range(8):
                        sm[dv + e] = value_cache[blk, kvh, ch * 8 + e, off]
        commit_group()

    @device_function
    def admits(k, p, kv_hi, causal, window):
        """Whether the query at position ``p`` admits key ``k``."""
        return k < kv_hi and (causal == 0 or k <= p) and (window <= 0 or p - k < window)

    @device_function
    def q_fragment(sm, warp, kk, qo):
        """The warp's A fragment of k-step ``kk`` (query dims ``16 kk ..``)."""
        return ldmatrix_x4(sm, frag_slot(Q_OFF, warp * 16, kk, qo))

    @cuda.jit(**({} if max_registers is None or config.ENABLE_CUDASIM
                 else dict(max_registers=max_registers)))
    def paged_prefill_tc_kernel(out, lse, query, key_cache, value_cache, block_tables,
                                cu_seqlens_q, seq_lens, tile_seq, tile_q0, scale, causal,
                                alibi_slopes, soft_cap, window):
        tile = cuda.blockIdx.x
        hb = cuda.blockIdx.y
        tid = int32(cuda.threadIdx.x)
        lane = int32(tid % 32)
        warp = int32(tid // 32)
        r = int32(lane // 4)                  # fragment row (and row + 8)
        c = int32(lane % 4)                   # fragment column pair
        lj = int32(lane // 8)                 # ldmatrix: the matrix this lane names a row of
        lt = int32(lane % 8)                  # ... and the row
        num_heads = query.shape[1]
        group = num_heads // key_cache.shape[KV_HEAD_AXIS]
        h0 = hb * HPB
        kvh = h0 // group
        seq = tile_seq[tile]
        q0 = tile_q0[tile]
        row0 = cu_seqlens_q[seq]
        q_len = cu_seqlens_q[seq + 1] - row0
        kv_len = seq_lens[seq]
        nq = int32(min(BQ, q_len - q0))       # valid query tokens of this tile
        pos0 = int32(kv_len - q_len + q0)     # position of its first query
        kv_lo = int32(0 if window <= 0 else max(pos0 - window + 1, 0))
        kv_hi = int32(min(pos0 + nq, kv_len) if causal else kv_len)
        last = int32(kv_hi - 1)
        ntiles = int32(0)
        if kv_hi > kv_lo:
            ntiles = int32((kv_hi - kv_lo + BN - 1) // BN)

        sm = cuda.shared.array(0, SMEM_T, alignment=16)
        kstr = k_strides(key_cache, kvh, tid % NCH)
        vstr = v_strides(value_cache if STAGE_V else key_cache, kvh, tid % NCH)
        tid_slot = slot(0, tid // NCH, tid % NCH)

        # -- the tile's queries -> shared memory (rows past nq repeat the last query)
        for u in range(QCPT):
            idx = tid + u * NT
            if QCHUNKS % NT == 0 or idx < QCHUNKS:
                row = idx // NCH
                ch = idx % NCH
                qi = min(row // HPB, nq - 1)
                src = ((row0 + q0 + qi) * num_heads + h0 + row % HPB) * D + ch * 8
                copy16_async(sm, slot(Q_OFF, row, ch), query, src)
        if ntiles > 0:
            issue_tile(sm, key_cache, value_cache, block_tables, seq, kvh, kv_lo, kv_lo, last,
                       0, tid, kstr, vstr, tid_slot)
        else:
            commit_group()

        # -- ldmatrix lane offsets: Q rows lt + 8 (lj & 1), chunk 2 p + (lj >> 1); K rows
        # lt + 8 (lj >> 1), chunk 2 p + (lj & 1); V as Q
        qo = lane_slot(lt + 8 * (lj & 1), lj >> 1, lt)
        ko = lane_slot(lt + 8 * (lj >> 1), lj & 1, lt)
        vo = qo

        # -- this lane's two rows: row a = 16 warp + r, row b = row a + 8
        ra = warp * 16 + r
        rb = ra + 8
        pa = int32(pos0 + min(ra // HPB, nq - 1))
        pb = int32(pos0 + min(rb // HPB, nq - 1))
        qscale = scale * float32(LOG2E)
        cap2 = soft_cap * float32(LOG2E)
        slope_a = alibi_slopes[h0 + ra % HPB] * float32(LOG2E)
        slope_b = alibi_slopes[h0 + rb % HPB] * float32(LOG2E)
        alibi = cuda.any_sync(FULL_MASK, slope_a != 0.0 or slope_b != 0.0)
        m_a = NEG_INF
        m_b = NEG_INF
        l_a = float32(0.0)                    # this lane's share of the row sums
        l_b = float32(0.0)
        qa = cuda.local.array((KSTEPS if QREGS else 1, 4), uint32)
        s = cuda.local.array((NTILE_S, 4), float32)
        o = cuda.local.array((NTILE_O, 4), float32)
        for i in range(NTILE_O):
            for e in range(4):
                o[i, e] = 0.0

        for j in range(ntiles):
            stage = int32(j % STAGES)
            kt = int32(kv_lo + j * BN)
            wait_all()
            cuda.syncthreads()  # tile j (and the queries) landed; everyone is done with tile j - 1
            if j + 1 < ntiles:
                issue_tile(sm, key_cache, value_cache, block_tables, seq, kvh, kt + BN, kv_lo,
                           last, (j + 1) % STAGES, tid, kstr, vstr, tid_slot)
            if QREGS and j == 0:
                for kk in range(KSTEPS):
                    qa[kk, 0], qa[kk, 1], qa[kk, 2], qa[kk, 3] = q_fragment(sm, warp, kk, qo)
            kbase = KV_OFF + 2 * stage * BN * D
            vbase = kbase + BN * D

            # -- S = Q K^T: 16 rows x BN keys per warp
            for i in range(NTILE_S):
                for e in range(4):
                    s[i, e] = 0.0
            for kk in range(KSTEPS):
                if QREGS:
                    a0 = qa[kk, 0]
                    a1 = qa[kk, 1]
                    a2 = qa[kk, 2]
                    a3 = qa[kk, 3]
                else:
                    a0, a1, a2, a3 = q_fragment(sm, warp, kk, qo)
                for nb in range(NTILE_S // 2):   # keys 16 nb .. 16 nb + 15
                    w0, w1, w2, w3 = ldmatrix_x4(
                        sm, frag_slot(kbase, 16 * nb, kk, ko))
                    s[2 * nb, 0], s[2 * nb, 1], s[2 * nb, 2], s[2 * nb, 3] = mma(
                        a0, a1, a2, a3, w0, w1, s[2 * nb, 0], s[2 * nb, 1], s[2 * nb, 2],
                        s[2 * nb, 3])
                    s[2 * nb + 1, 0], s[2 * nb + 1, 1], s[2 * nb + 1, 2], s[2 * nb + 1, 3] = mma(
                        a0, a1, a2, a3, w2, w3, s[2 * nb + 1, 0], s[2 * nb + 1, 1],
                        s[2 * nb + 1, 2], s[2 * nb + 1, 3])

            # -- logits in base 2, variants, mask (tiles that need one), row maxima
            masked = (kt + BN > kv_hi or (causal != 0 and kt + BN - 1 > pos0)
                      or (window > 0 and pos0 + nq - 1 - kt >= window))
            for i in range(NTILE_S):
                for e in range(4):
                    s[i, e] *= qscale
            if soft_cap > 0.0:
                for i in range(NTILE_S):
                    for e in range(4):
                        s[i, e] = cap2 * math.tanh(s[i, e] / cap2)
            if alibi:
                for i in range(NTILE_S):
                    k = float32(kt + 8 * i + 2 * c)
                    s[i, 0] += slope_a * (k - pa)
                    s[i, 1] += slope_a * (k + 1 - pa)
                    s[i, 2] += slope_b * (k - pb)
                    s[i, 3] += slope_b * (k + 1 - pb)
            if masked:
                for i in range(NTILE_S):
                    k = int32(kt + 8 * i + 2 * c)
                    if not admits(k, pa, kv_hi, causal, window):
                        s[i, 0] = NEG_INF
                    if not admits(k + 1, pa, kv_hi, causal, window):
                        s[i, 1] = NEG_INF
                    if not admits(k, pb, kv_hi, causal, window):
                        s[i, 2] = NEG_INF
                    if not admits(k + 1, pb, kv_hi, causal, window):
                        s[i, 3] = NEG_INF
            mx_a = NEG_INF
            mx_b = NEG_INF
            for i in range(NTILE_S):
                mx_a = max(mx_a, max(s[i, 0], s[i, 1]))
                mx_b = max(mx_b, max(s[i, 2], s[i, 3]))
            mx_a = quad_max(mx_a)
            mx_b = quad_max(mx_b)

            # -- online softmax: rescale where a row's maximum grew, exp2, row sums
            new_a = max(m_a, mx_a)
            new_b = max(m_b, mx_b)
            grew = new_a > m_a or new_b > m_b
            use_a = new_a if new_a != NEG_INF else float32(0.0)
            use_b = new_b if new_b != NEG_INF else float32(0.0)
            if cuda.any_sync(FULL_MASK, grew):
                alpha_a = math.exp2(m_a - use_a)
                alpha_b = math.exp2(m_b - use_b)
                l_a *= alpha_a
                l_b *= alpha_b
                for i in range(NTILE_O):
                    o[i, 0] *= alpha_a
                    o[i, 1] *= alpha_a
                    o[i, 2] *= alpha_b
                    o[i, 3] *= alpha_b
            m_a = new_a
            m_b = new_b
            for i in range(NTILE_S):
                s[i, 0] = math.exp2(s[i, 0] - use_a)
                s[i, 1] = math.exp2(s[i, 1] - use_a)
                s[i, 2] = math.exp2(s[i, 2] - use_b)
                s[i, 3] = math.exp2(s[i, 3] - use_b)
                l_a += s[i, 0] + s[i, 1]
                l_b += s[i, 2] + s[i, 3]

            # -- O += P V: P rounded to the cache dtype is the A operand as it lies
            for ks in range(PV_STEPS):             # keys 16 ks .. 16 ks + 15
                p0 = pack(s[2 * ks, 0], s[2 * ks, 1])
                p1 = pack(s[2 * ks, 2], s[2 * ks, 3])
                p2 = pack(s[2 * ks + 1, 0], s[2 * ks + 1, 1])
                p3 = pack(s[2 * ks + 1, 2], s[2 * ks + 1, 3])
                for db in range(NTILE_O // 2):     # dims 16 db .. 16 db + 15
                    w0, w1, w2, w3 = ldmatrix_x4_trans(
                        sm, frag_slot(vbase, 16 * ks, db, vo))
                    o[2 * db, 0], o[2 * db, 1], o[2 * db, 2], o[2 * db, 3] = mma(
                        p0, p1, p2, p3, w0, w1, o[2 * db, 0], o[2 * db, 1], o[2 * db, 2],
                        o[2 * db, 3])
                    o[2 * db + 1, 0], o[2 * db + 1, 1], o[2 * db + 1, 2], o[2 * db + 1, 3] = mma(
                        p0, p1, p2, p3, w2, w3, o[2 * db + 1, 0], o[2 * db + 1, 1],
                        o[2 * db + 1, 2], o[2 * db + 1, 3])

        # -- epilogue: out = O / l, lse = (m + log2 l) ln 2, valid rows only
        l_a = quad_sum(l_a)
        l_b = quad_sum(l_b)
        inv_a = float32(0.0)
        inv_b = float32(0.0)
        if l_a > 0.0:
            inv_a = float32(1.0) / l_a
        if l_b > 0.0:
            inv_b = float32(1.0) / l_b
        qa_ok = ra // HPB < nq
        qb_ok = rb // HPB < nq
        out_a = row0 + q0 + ra // HPB
        out_b = row0 + q0 + rb // HPB
        ha = h0 + ra % HPB
        hb_ = h0 + rb % HPB
        for i in range(NTILE_O):
            d = 8 * i + 2 * c
            if qa_ok:
                out[out_a, ha, d] = from_f32(o[i, 0] * inv_a)
                out[out_a, ha, d + 1] = from_f32(o[i, 1] * inv_a)
            if qb_ok:
                out[out_b, hb_, d] = from_f32(o[i, 2] * inv_b)
                out[out_b, hb_, d + 1] = from_f32(o[i, 3] * inv_b)
        if c == 0:
            if qa_ok:
                lse[out_a, ha] = (m_a + math.log2(l_a)) * float32(LN2) if l_a > 0.0 else NEG_INF
            if qb_ok:
                lse[out_b, hb_] = (m_b + math.log2(l_b)) * float32(LN2) if l_b > 0.0 else NEG_INF

    # what a launch must ask for (``_launch.PackedLaunch`` reads it)
    paged_prefill_tc_kernel.dynamic_shared_bytes = DYNAMIC_BYTES
    return paged_prefill_tc_kernel
