"""Paged prefill attention: many query tokens per sequence, K/V read through a block table.

NumPy spec of what one launch computes. Sequence ``s`` has ``q_len =
cu_seqlens_q[s + 1] - cu_seqlens_q[s]`` query tokens (rows
``cu_seqlens_q[s]:cu_seqlens_q[s + 1]`` of ``query``) and ``kv_len =
seq_lens[s]`` tokens in the cache, its queries included; query ``j`` sits at
position ``p = kv_len - q_len + j`` (bottom-right aligned). For query head
``h`` and its KV head ``g = h // (num_heads // num_kv_heads)``::

    K, V = keys and values of tokens 0 .. kv_len - 1, found via block_tables[s]
    z = scale * K[:, g] @ query[row, h]            # logits, fp32, row = cu_seqlens_q[s] + j
    z = soft_cap * tanh(z / soft_cap)              # if soft_cap > 0
    z += alibi_slopes[h] * (k - p)                 # key position k; slopes are 0 without ALiBi
    admitted = (p - k < window if window > 0) & (k <= p if causal)
    m = z[admitted].max(); l = exp(z[admitted] - m).sum()
    out[row, h] = exp(z[admitted] - m) @ V[admitted, g] / l    # 0 when nothing is admitted
    lse[row, h] = m + log(l)                                   # -inf when nothing is admitted

Structure (FlashAttention-2's loop order, on CUDA cores in fp32):

* a thread block owns one *tile*: ``BQ`` consecutive query tokens of one
  sequence times the ``HPB`` query heads of one GQA group that share a KV
  head, i.e. ``M = BQ * HPB`` rows (row ``r`` is token ``r // HPB``, head
  ``r % HPB``), so each K/V element is read once for the whole group; the
  host lists the tiles ``(tile_seq, tile_q0)``; grid ``(num_tiles,
  num_heads // HPB)``, ``NUM_WARPS`` warps;
* the tile's queries, pre-scaled, sit transposed in shared memory
  ``q_s [HEAD_SIZE, M]``;
* keys are walked in tiles of ``BN`` tokens from the first one any row
  admits (sliding window) to the last one (causal: the tile's last
  position); tiles that every row masks are never loaded. Each K tile is
  loaded with 16-byte vectors (``kernels.access``) into ``kv_s [HEAD_SIZE,
  BN + 1]`` (transposed, padded against bank conflicts);
* ``S = Q K^T``: each thread computes an ``RM x RN`` register micro-tile
  (rows ``tr + i * TR``, keys ``tc + j * TC``); masking and the variants are
  applied there, and each row's max and exp-sum are reduced over the ``TC``
  lanes that share it with ``shfl_xor_sync`` (online softmax: running ``m``,
  ``l`` per row, the rescale factor ``exp(m_old - m_new)`` goes to
  ``alpha_s``); probabilities go to ``p_s [M, BN + 1]``;
* the V tile then replaces K in ``kv_s`` and ``O += P V`` is accumulated in
  fp32 registers, an ``RMO x RD`` micro-tile per thread (rows ``to + i * TRO``,
  elements ``td + j * TD``, so a warp's lanes read consecutive elements);
* epilogue: ``out = O / l`` in the query dtype, ``lse = m + log(l)``.

Non-finite data as in ``paged_numba.reference``: a NaN logit, which ``max``
passes over, makes its exp-sum NaN (the exponent subtracts 0 while a row has
no finite maximum), and the epilogue's ``l != 0`` carries it to the output and
the lse. A key that some rows of a tile mask (the causal diagonal, the
window's edge) is added only to the rows that admit it: its weight is 0 in the
others, but ``0 * NaN`` would not be. A tile whose keys every row admits (all
but the diagonal and edge tiles) takes the plain loop, unchanged.
"""
import functools
import math

import numpy as np
from numba import cuda, float32, int32

from .access import device_function, vector_accessors
from .convert import codec
from .fp8 import FORMATS as FP8_FORMATS
from .fp8 import fp8_vector_accessors, store_as, to_f32_any
from .guard import checked_block, length_of, record_block

FULL_MASK = 0xFFFFFFFF
NEG_INF = float32(-math.inf)
SHARED_LIMIT = 48 * 1024          # static shared memory per block


def _itemsize(dtype):
    return {"bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}.get(dtype) or np.dtype(dtype).itemsize


def _pow2s(limit):
    p = 1
    while p <= limit:
        yield p
        p *= 2


def micro_tiles(rows, cols, threads):
    """Split a ``rows x cols`` tile over ``threads`` threads: ``(T_COLS,
    T_ROWS, R_ROWS, R_COLS)`` with ``T_COLS`` (a power of two <= 32) lanes
    across the columns and ``T_ROWS = threads // T_COLS`` across the rows;
    each thread owns ``R_ROWS x R_COLS`` entries (the last ones may fall
    outside the tile). Picks the fewest operand loads per useful product."""
    best = None
    for tc in _pow2s(min(32, threads)):
        tr = threads // tc
        rr, rc = -(-rows // tr), -(-cols // tc)
        cost = (rr + rc) / (min(rows, tr * rr) * min(cols, tc * rc) / threads)
        if best is None or cost < best[0] - 1e-9:
            best = (cost, (tc, tr, rr, rc))
    return best[1]


def shared_bytes(head_size, rows, block_n):
    """Static shared memory of one block: queries, the K/V tile, probabilities,
    and three per-row floats."""
    return 4 * (head_size * rows + head_size * (block_n + 1) + rows * (block_n + 1) + 3 * rows)


def prefill_config(head_size, group_size, max_q_len=None):
    """Default tiling ``(heads_per_block, block_q, block_n, num_warps)``.

    Rows per tile ``M = block_q * heads_per_block`` and keys per tile
    ``block_n`` are as large as 48 KB of shared memory allows (``M = 64`` up
    to head size 64, 32 up to 128, 16 above); ``heads_per_block`` is the
    largest power of two dividing the GQA group (at most 8), and ``block_q``
    shrinks to the batch's longest query (decode-like batches waste no rows).
    """
    hpb = 1
    while hpb * 2 <= min(group_size, 8) and group_size % (hpb * 2) == 0:
        hpb *= 2
    rows = 64 if head_size <= 64 else 32 if head_size <= 128 else 16
    block_n = 32 if head_size <= 128 else 16
    num_warps = 4
    rows = max(rows, hpb)
    block_q = rows // hpb
    if max_q_len is not None:
        block_q = min(block_q, 1 << max(int(max_q_len) - 1, 0).bit_length())
    return hpb, block_q, block_n, num_warps


@functools.cache
def prefill_kernel(head_size, block_size, heads_per_block, block_q, block_n, dtype, layout,
                   num_warps=4):
    """Compile-time specialised prefill kernel.

    Kernel arguments: ``out [total_q, num_heads, head_size]`` (``dtype``),
    ``lse [total_q, num_heads]`` float32, ``query [total_q, num_heads,
    head_size]``, ``key_cache``, ``value_cache`` (C-contiguous pools in
    ``layout``), ``block_tables [num_seqs, max_blocks]`` int32,
    ``cu_seqlens_q [num_seqs + 1]`` int32, ``seq_lens [num_seqs]`` int32,
    ``tile_seq [num_tiles]``, ``tile_q0 [num_tiles]`` int32 (sequence and first
    query of each tile), ``scale`` float32, ``causal`` int32 (0 or 1),
    ``alibi_slopes [num_heads]`` float32 (zeros for none), ``soft_cap``
    float32 (0 for none), ``window`` int32 (0 for none), ``errors [4]`` int64
    (:mod:`.guard`: a block id outside the pool reads block 0, a length
    beyond the table's row is clamped to it, and the first is recorded).
    Launch with grid ``(num_tiles, num_heads // heads_per_block)`` and
    ``32 * num_warps`` threads.

    An fp8 ``dtype`` (``uint8`` pools of codes) adds ``kv_scales [2,
    num_kv_heads]`` float32 last, as in ``kernels.decode``: the codes are
    decoded exactly as the tiles are staged, K's scale multiplies the query's
    scale, V's the normalised output; the query (fp16, fp32 or bf16 bits)
    and the output share their type.
    """
    HEAD_SIZE = head_size
    BLOCK_SIZE = block_size
    HPB = heads_per_block
    BQ = block_q
    BN = block_n
    M = BQ * HPB                          # rows of a tile: (query token, head) pairs
    NT = 32 * num_warps
    VEC = 16 // _itemsize(dtype)          # elements in a 16-byte vector
    NVEC = HEAD_SIZE // VEC               # vectors in one head row
    NLOAD = BN * NVEC                     # vectors in one K or V tile
    LPT = -(-NLOAD // NT)                 # vectors each thread loads per tile
    KV_R = LPT * VEC                      # registers holding them
    TC, TR, RM, RN = micro_tiles(M, BN, NT)         # S = Q K^T
    TD, TRO, RMO, RD = micro_tiles(M, HEAD_SIZE, NT)  # O += P V
    PAD = BN + 1
    KV_HEAD_AXIS = {"nhd": 2, "vllm": 1, "hnd": 1, "interleaved": 3}[layout]
    assert HEAD_SIZE % VEC == 0 and HPB & (HPB - 1) == 0 and TC <= 32
    assert shared_bytes(HEAD_SIZE, M, BN) <= SHARED_LIMIT, "tile too large for shared memory"
    FP8 = dtype in FP8_FORMATS
    if FP8:
        k_vec, v_vec = fp8_vector_accessors(layout, dtype)
        to_f32 = to_f32_any                          # by the query's type

        @device_function
        def put(out, row, h, d, x):                  # in the output's (query's) type
            out[row, h, d] = store_as(x, out)

        @device_function
        def kv_scale(kv_scales, kvh):
            return kv_scales[0, kvh], kv_scales[1, kvh]

        @device_function
        def times_v_scale(x, vs):
            return x * vs
    else:
        k_vec, v_vec = vector_accessors(layout, dtype)
        to_f32, from_f32 = codec(dtype)

        @device_function
        def put(out, row, h, d, x):
            out[row, h, d] = from_f32(x)

        @device_function
        def kv_scale(kv_scales, kvh):
            return float32(1.0), float32(1.0)

        @device_function
        def times_v_scale(x, vs):
            return x

    def tile_stager(vec_fn):
        """Device function copying keys ``[kt, kt + kn)`` (or values) of a
        tile into ``kv_s[d, n]``: 16-byte vectors, all loads issued before
        the stores, zeros past ``kn``."""

        @device_function
        def stage(pool, block_tables, errors, seq, kvh, kt, kn, tid, kv_r, kv_s):
            bad = int32(-1)
            for u in range(LPT):
                idx = tid + u * NT
                n = idx % BN
                if idx < NLOAD and n < kn:
                    t = kt + n
                    blk, bad = checked_block(block_tables, seq, t // BLOCK_SIZE, pool.shape[0],
                                             bad)
                    vec_fn(pool, blk, kvh, t % BLOCK_SIZE, idx // BN, kv_r, u * VEC)
                else:
                    for e in range(VEC):
                        kv_r[u * VEC + e] = 0.0
            record_block(block_tables, errors, seq, bad)    # after the loads: see checked_block
            for u in range(LPT):
                idx = tid + u * NT
                if idx < NLOAD:
                    n = idx % BN
                    v = idx // BN
                    for e in range(VEC):
                        kv_s[v * VEC + e, n] = kv_r[u * VEC + e]

        return stage

    stage_k, stage_v = tile_stager(k_vec), tile_stager(v_vec)

    @device_function
    def prefill(out, lse, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                tile_seq, tile_q0, scale, causal, alibi_slopes, soft_cap, window, errors,
                kv_scales):
        tile = cuda.blockIdx.x
        hb = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        group = query.shape[1] // key_cache.shape[KV_HEAD_AXIS]
        h0 = hb * HPB
        kvh = h0 // group
        seq = tile_seq[tile]
        q0 = tile_q0[tile]
        row0 = cu_seqlens_q[seq]                     # this sequence's first query row
        q_len = cu_seqlens_q[seq + 1] - row0
        # (clamped to what the table's row holds: see kernels.guard)
        kv_len = length_of(seq_lens, errors, seq, block_tables.shape[1] * BLOCK_SIZE)
        nq = min(BQ, q_len - q0)                     # valid query tokens in this tile
        pos0 = kv_len - q_len + q0                   # position of the tile's first query
        # keys any row admits: from the window's start for the first query to
        # the last query's position (causal) or the end
        kv_lo = 0 if window <= 0 else max(pos0 - window + 1, 0)
        kv_hi = min(pos0 + nq, kv_len) if causal else kv_len
        # keys every query of the tile admits: up to the first query's position
        # (causal) and from the last query's window on
        full_lo = 0 if window <= 0 else pos0 + nq - window
        full_hi = pos0 + 1 if causal else kv_len

        q_s = cuda.shared.array((HEAD_SIZE, M), float32)
        kv_s = cuda.shared.array((HEAD_SIZE, PAD), float32)
        p_s = cuda.shared.array((M, PAD), float32)
        alpha_s = cuda.shared.array(M, float32)
        m_s = cuda.shared.array(M, float32)
        l_s = cuda.shared.array(M, float32)

        # -- stage the tile's queries, scaled, transposed: q_s[d, r]
        k_scale, v_scale = kv_scale(kv_scales, kvh)  # fp8: the codes' scales (else 1)
        scale = scale * k_scale
        for i in range(tid, M * HEAD_SIZE, NT):
            r = i // HEAD_SIZE
            d = i % HEAD_SIZE
            qi = r // HPB
            x = float32(0.0)
            if qi < nq:
                x = to_f32(query[row0 + q0 + qi, h0 + r % HPB, d]) * scale
            q_s[d, r] = x

        # S-phase coordinates: rows tr + i * TR, keys tc + j * TC
        tc = tid % TC
        tr = tid // TC
        # PV-phase coordinates: rows to + i * TRO, elements td + j * TD
        td = tid % TD
        to = tid // TD
        s_r = cuda.local.array((RM, RN), float32)
        m_run = cuda.local.array(RM, float32)
        l_run = cuda.local.array(RM, float32)
        pos_r = cuda.local.array(RM, int32)
        ok_r = cuda.local.array(RM, int32)
        slope_r = cuda.local.array(RM, float32)
        for i in range(RM):
            r = tr + i * TR
            m_run[i] = NEG_INF
            l_run[i] = 0.0
            pos_r[i] = pos0 + r // HPB
            ok_r[i] = 1 if r // HPB < nq else 0    # rows past the tile's queries admit nothing
            slope_r[i] = alibi_slopes[h0 + min(r, M - 1) % HPB]
        acc = cuda.local.array((RMO, RD), float32)
        for i in range(RMO):
            for j in range(RD):
                acc[i, j] = 0.0
        kv_r = cuda.local.array(KV_R, float32)
        qv = cuda.local.array(RM, float32)
        kk = cuda.local.array(RN, float32)
        pv = cuda.local.array(RMO, float32)
        vv = cuda.local.array(RD, float32)

        for kt in range(kv_lo, kv_hi, BN):
            kn = min(BN, kv_hi - kt)                 # keys of this tile
            # -- K tile -> kv_s[d, n], 16-byte vectors, all loads issued before the stores
            stage_k(key_cache, block_tables, errors, seq, kvh, kt, kn, tid, kv_r, kv_s)
            cuda.syncthreads()  # wait for the K tile (and q_s on the first pass)

            # -- S = Q K^T, an RM x RN micro-tile per thread
            for i in range(RM):
                for j in range(RN):
                    s_r[i, j] = 0.0
            for d in range(HEAD_SIZE):
                for i in range(RM):
                    qv[i] = q_s[d, min(tr + i * TR, M - 1)]
                for j in range(RN):
                    kk[j] = kv_s[d, min(tc + j * TC, BN - 1)]
                for i in range(RM):
                    for j in range(RN):
                        s_r[i, j] += qv[i] * kk[j]

            # -- mask, variants, online softmax per row (rows shared by TC lanes)
            for i in range(RM):
                p = pos_r[i]
                ok = ok_r[i]
                mx = NEG_INF
                for j in range(RN):
                    n = tc + j * TC
                    k = kt + n
                    x = s_r[i, j]
                    if soft_cap > 0.0:
                        x = soft_cap * math.tanh(x / soft_cap)
                    x += slope_r[i] * float32(k - p)
                    admit = (ok != 0 and n < kn and (causal == 0 or k <= p)
                             and (window <= 0 or p - k < window))
                    if not admit:
                        x = NEG_INF
                    s_r[i, j] = x
                    mx = max(mx, x)
                o = TC // 2
                while o > 0:
                    mx = max(mx, cuda.shfl_xor_sync(FULL_MASK, mx, o))
                    o //= 2
                m_new = max(m_run[i], mx)
                m_use = m_new if m_new != NEG_INF else float32(0.0)
                alpha = math.exp(m_run[i] - m_use)
                m_run[i] = m_new
                total = float32(0.0)
                r = tr + i * TR
                for j in range(RN):
                    e = math.exp(s_r[i, j] - m_use)
                    total += e
                    n = tc + j * TC
                    if r < M and n < BN:
                        p_s[r, n] = e
                o = TC // 2
                while o > 0:
                    total += cuda.shfl_xor_sync(FULL_MASK, total, o)
                    o //= 2
                l_run[i] = l_run[i] * alpha + total
                if tc == 0 and r < M:
                    alpha_s[r] = alpha
            cuda.syncthreads()  # wait for p_s, alpha_s; everyone is done with the K tile

            # -- V tile -> kv_s[d, n]
            stage_v(value_cache, block_tables, errors, seq, kvh, kt, kn, tid, kv_r, kv_s)
            cuda.syncthreads()  # wait for the V tile

            # -- O = alpha O + P V, an RMO x RD micro-tile per thread
            for i in range(RMO):
                a = alpha_s[min(to + i * TRO, M - 1)]
                for j in range(RD):
                    acc[i, j] *= a
            if full_lo <= kt and kt + kn <= full_hi:    # every query admits every key
                for n in range(BN):
                    for i in range(RMO):
                        pv[i] = p_s[min(to + i * TRO, M - 1), n]
                    for j in range(RD):
                        vv[j] = kv_s[min(td + j * TD, HEAD_SIZE - 1), n]
                    for i in range(RMO):
                        for j in range(RD):
                            acc[i, j] += pv[i] * vv[j]
            else:
                # the causal diagonal and the window's edge: a key goes only to the rows
                # that admit it, so a NaN or Inf value of a masked key (weight 0, but
                # 0 * NaN is NaN) reaches no output
                for n in range(BN):
                    for i in range(RMO):
                        pv[i] = p_s[min(to + i * TRO, M - 1), n]
                    for j in range(RD):
                        vv[j] = kv_s[min(td + j * TD, HEAD_SIZE - 1), n]
                    k = kt + n
                    for i in range(RMO):
                        qp = pos0 + min(to + i * TRO, M - 1) // HPB     # the row's position
                        if (causal == 0 or k <= qp) and (window <= 0 or qp - k < window):
                            for j in range(RD):
                                acc[i, j] += pv[i] * vv[j]
            cuda.syncthreads()  # kv_s, p_s and alpha_s are free for the next tile

        # -- epilogue: publish each row's (m, l), then out = O / l and lse = m + log l
        if tc == 0:
            for i in range(RM):
                r = tr + i * TR
                if r < M:
                    m_s[r] = m_run[i]
                    l_s[r] = l_run[i]
        cuda.syncthreads()  # wait for m_s, l_s
        for i in range(RMO):
            r = to + i * TRO
            if r < M and r // HPB < nq:
                row = row0 + q0 + r // HPB
                h = h0 + r % HPB
                inv = float32(0.0)
                if l_s[r] != 0.0:                    # and NaN: NaN logits make the row NaN
                    inv = float32(1.0) / l_s[r]
                for j in range(RD):
                    d = td + j * TD
                    if d < HEAD_SIZE:
                        put(out, row, h, d, times_v_scale(acc[i, j] * inv, v_scale))
        for r in range(tid, M, NT):
            if r // HPB < nq:
                x = NEG_INF
                if l_s[r] != 0.0:
                    x = m_s[r] + math.log(l_s[r])
                lse[row0 + q0 + r // HPB, h0 + r % HPB] = x

    if FP8:
        @cuda.jit
        def paged_prefill_fp8_kernel(out, lse, query, key_cache, value_cache, block_tables,
                                     cu_seqlens_q, seq_lens, tile_seq, tile_q0, scale, causal,
                                     alibi_slopes, soft_cap, window, errors, kv_scales):
            prefill(out, lse, query, key_cache, value_cache, block_tables, cu_seqlens_q,
                    seq_lens, tile_seq, tile_q0, scale, causal, alibi_slopes, soft_cap, window,
                    errors, kv_scales)

        return paged_prefill_fp8_kernel

    @cuda.jit
    def paged_prefill_kernel(out, lse, query, key_cache, value_cache, block_tables, cu_seqlens_q,
                             seq_lens, tile_seq, tile_q0, scale, causal, alibi_slopes, soft_cap,
                             window, errors):
        prefill(out, lse, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                tile_seq, tile_q0, scale, causal, alibi_slopes, soft_cap, window, errors,
                alibi_slopes)                        # no scales

    return paged_prefill_kernel


def prefill_signature(dtype, layout, query_dtype="float16", tensor_maps=False):
    """Argument types the API launches the prefill kernel with (an fp8 cache:
    ``query_dtype`` queries and outputs, the scales last; the error word
    before them; ``tensor_maps``: the pools' two maps last)."""
    from numba.core import types
    from numba.np.numpy_support import from_dtype

    def arr(dt, ndim):
        return types.Array(from_dtype(np.dtype(dt)), ndim, "C")

    kdim, vdim = {"nhd": (4, 4), "vllm": (5, 4), "hnd": (4, 4), "interleaved": (5, 5)}[layout]
    i32 = arr("int32", 1)
    def store_of(dt):      # bf16 travels as its bit patterns, fp8 as its codes
        return {"bfloat16": "uint16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}.get(dt, dt)

    fp8 = dtype in FP8_FORMATS
    q = store_of(query_dtype if fp8 else dtype)
    pool = store_of(dtype)
    return (arr(q, 3), arr("float32", 2), arr(q, 3), arr(pool, kdim), arr(pool, vdim),
            arr("int32", 2), i32, i32, i32, i32, types.float32, types.int32, arr("float32", 1),
            types.float32, types.int32, arr("int64", 1)) + ((arr("float32", 2),) if fp8 else ()) + (
            (arr("uint64", 1),) * 2 if tensor_maps else ())


# (head_size, group_size, dtype, layout, block_size): the head sizes that pick
# each default tile (64, 128, 256) plus one that is not a power of two (72),
# every dtype, GQA groups 1, 4 and 8, and the layouts whose loads differ
# (vllm's values are strided, interleaved shares one pool).
PTX_POINTS = [
    (64, 4, "float16", "nhd", 16), (128, 4, "float16", "nhd", 16),
    (128, 4, "float32", "nhd", 16), (256, 4, "float16", "nhd", 16),
    (72, 4, "float16", "nhd", 16), (128, 1, "float16", "nhd", 16),
    (128, 8, "float16", "nhd", 16), (128, 4, "float16", "vllm", 16),
    (128, 4, "float16", "hnd", 16), (128, 4, "float16", "interleaved", 16),
    (64, 8, "float32", "hnd", 1), (256, 1, "float32", "vllm", 32),
    (128, 4, "bfloat16", "nhd", 16),
    (64, 4, "float8_e4m3fn", "nhd", 16), (64, 1, "float8_e5m2", "vllm", 16),   # fp16 queries
]


def prefill_specializations(points=PTX_POINTS):
    """Yield ``(name, kernel, signature)`` for the default-tiled prefill kernel
    at each point ``(head_size, group_size, dtype, layout, block_size)``, plus
    a decode-like tile (``block_q = 1``) of the first point, for
    ``numba.cuda.compile_ptx``."""
    for hs, group, dtype, layout, bs in points:
        hpb, bq, bn, nw = prefill_config(hs, group)
        kernel = prefill_kernel(hs, bs, hpb, bq, bn, dtype, layout, nw)
        yield (f"prefill hs={hs} group={group} {dtype} {layout} bs={bs} hpb={hpb} bq={bq} "
               f"bn={bn} warps={nw}", kernel, prefill_signature(dtype, layout))
    hs, group, dtype, layout, bs = points[0]
    hpb, _, bn, nw = prefill_config(hs, group)
    yield (f"prefill hs={hs} group={group} {dtype} {layout} bs={bs} hpb={hpb} bq=1 bn={bn} "
           f"warps={nw}", prefill_kernel(hs, bs, hpb, 1, bn, dtype, layout, nw),
           prefill_signature(dtype, layout))
