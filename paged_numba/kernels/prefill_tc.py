"""Paged prefill attention on tensor cores (fp16 and bf16 caches).

Computes what ``kernels.prefill`` computes (see its NumPy spec: the same
arguments, grid, outputs and variants) with both products on tensor cores,
FlashAttention-2's loop order and work split:

* a thread block owns one *tile* of ``M = 16 * NW`` rows (``32 * NW`` with
  ``m_tiles=2``): ``BQ`` consecutive
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

from numba import config, cuda, float32, int32, uint32

from .access import device_function, row_strides, vector_offsets, wide
from .async_copy import commit_group, copy16_async, wait_group
from .decode import LOG2E, STORAGE, lane_reducer
from .convert import codec
from .fastmath import exp2_approx
from .mma import ldmatrix_x4, ldmatrix_x4_trans, mma_m16n8k16, pack_pair
from . import wgmma as wg
from .prefill_tc_tiling import (  # noqa: F401  (the tiling's names, kept here too)
    DTYPES, LAYOUTS, MAX_SHARED_BYTES, STAGES, prefill_tc_config, shared_bytes, supports)

FULL_MASK = 0xFFFFFFFF
NEG_INF = float32(-math.inf)
LN2 = 0.6931471805599453


@functools.cache
def prefill_tc_kernel(head_size, block_size, heads_per_block, block_n, dtype, layout,
                      num_warps=8, q_in_regs=None, max_registers=None, fast_exp2=False,
                      fma_softmax=False, token_copies=False, m_tiles=1, split_k=False,
                      wgmma=False):
    """Compile-time specialised tensor-core prefill kernel: arguments and grid
    as for :func:`kernels.prefill.prefill_kernel` with ``block_q = 16 *
    m_tiles * num_warps // heads_per_block`` and ``32 * num_warps`` threads; the
    launch needs ``dynamic_shared_bytes`` (set on the kernel) of dynamic shared
    memory. ``q_in_regs`` keeps the query fragments in registers for the whole
    loop instead of re-reading them from shared memory each tile (default: up
    to head size 128, where it measured 3-5% faster on the H200);
    ``max_registers`` caps the registers per thread. Neither changes the
    arithmetic.

    Three options cut instructions from the loop (off by default until timed):
    ``fast_exp2`` takes each exponential as one ``ex2.approx.ftz`` (weights
    below ``2**-126`` of the row's largest become 0); ``fma_softmax``, where
    there is no soft cap or ALiBi and ``scale > 0``, keeps the logits unscaled
    and folds the scale into the exponent's argument (one FFMA a logit, in
    place of a multiply and a subtract); ``token_copies`` has each thread copy
    whole stretches of one token's row (``32 * num_warps / block_n`` threads a
    token), so the table lookup and address arithmetic are done once a token
    instead of once a chunk. ``m_tiles=2`` gives each warp 32 rows (two m16
    tiles) instead of 16, as FlashAttention-2 does: each K and V fragment read
    from shared memory feeds two products instead of one, for twice the
    accumulator registers; the arithmetic of each row is unchanged.

    ``split_k=True`` compiles the split-K form (for decode-like batches of few
    tiles, MQA and large GQA groups): grid ``(num_tiles, num_heads //
    heads_per_block, num_parts)``; part ``z`` of a tile takes its share of the
    tile's K/V tiles (``ceil(n / num_parts)`` each, in order) and writes its
    state unnormalised by the other parts, ``out [total_q, num_parts,
    num_heads, head_size]`` float32 (``O / l`` of its keys) and ``lse
    [total_q, num_parts, num_heads]`` (``-inf`` for a part with no keys), for
    :func:`kernels.merge.merge_kernel` to merge.

    ``wgmma=True`` (sm_90a: H100, H200) computes both products with warpgroup
    instructions (:mod:`.wgmma`) instead of ``ldmatrix`` + ``mma.sync``: each
    four warps (a warpgroup, 64 rows) issue ``S = Q K^T`` as ``head_size / 16``
    ``m64nBNk16`` products with Q and K read straight from shared memory, and
    ``O += P V`` as ``BN / 16`` ``m64nDk16`` products with P from registers.
    Shared memory then holds the tiles as core matrices (8 rows x 16 bytes,
    rows ``8 i .. 8 i + 7`` of chunk ``ch`` at ``(i * D / 8 + ch) * 128``
    bytes) instead of swizzled rows. It needs ``num_warps % 4 == 0``,
    ``m_tiles=1`` and ``block_n <= 256``; the fragments, the softmax and the
    epilogue are those of the ``mma.sync`` path, so the arithmetic is the same
    up to the tensor cores' order of accumulation."""
    if not supports(head_size, dtype, layout):
        raise ValueError(f"no tensor-core prefill kernel for head_size={head_size}, {dtype}, "
                         f"{layout}")
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
    CPT = -(-CHUNKS // NT)                # ... that each thread copies
    QCHUNKS = M * NCH
    QCPT = -(-QCHUNKS // NT)
    QREGS = (D <= 128) if q_in_regs is None else bool(q_in_regs)
    SPLIT = bool(split_k)
    WG = bool(wgmma)
    if WG:
        if NW % 4 or MT != 1 or BN > 256 or token_copies:
            raise ValueError(f"wgmma needs num_warps % 4 == 0, m_tiles=1, block_n <= 256 and no "
                             f"token_copies, but got num_warps={NW}, m_tiles={MT}, "
                             f"block_n={BN}, token_copies={token_copies}")
        QREGS = False
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
    if WG:      # chunk order = slot order (8 rows of one chunk, then the next chunk)
        FIXED_CHUNK = NT % (8 * NCH) == 0
    # token_copies: TPT threads a token (or TOKS tokens a thread), CPTOK chunks each
    TPT = max(1, NT // BN)
    TOKS = max(1, BN // NT)
    CPTOK = NCH // TPT
    if token_copies and (TPT > NCH or NCH % TPT):
        raise ValueError(f"token_copies needs 32 * num_warps / block_n <= head_size / 8 threads "
                         f"a token, but got {TPT} for head_size={D}, block_n={BN}, "
                         f"num_warps={NW}")
    exp2 = exp2_approx if fast_exp2 else math.exp2
    FMA = bool(fma_softmax)
    KV_HEAD_AXIS = {"nhd": 2, "vllm": 1, "hnd": 1, "interleaved": 3}[layout]
    SMEM_T = STORAGE[dtype]
    k_flat, v_flat = vector_offsets(layout, 8, BLOCK_SIZE, D)
    wait_all = wait_group(0)
    mma = mma_m16n8k16(dtype)
    pack = pack_pair(dtype)
    _, from_f32 = codec(dtype)
    quad_max = lane_reducer(3, True)
    # wgmma: S from Q and K as K-major core matrices (next chunk 128 bytes on, next
    # 8 rows D * 16), O from P in registers and V as MN-major (next 8 keys D * 16
    # bytes on, next 8 dims 128)
    wg_s = wg.wgmma_ss(dtype, BN, 128, NCH * 128, 128, NCH * 128, False)
    wg_o = wg.wgmma_rs(dtype, D, NCH * 128, 128, True)
    pin_s, wait_s = wg.pin(BN // 2), wg.wait_pin(0, BN // 2)
    pin_o, wait_o = wg.pin(D // 2), wg.wait_pin(0, D // 2)
    pin_p = wg.pin(4 * PV_STEPS)
    wg_fence, wg_commit, fence_proxy = wg.fence, wg.commit, wg.fence_proxy_async
    quad_sum = lane_reducer(3, False)

    if WG:
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

    # (base, block stride, token stride, chunk stride) of a thread's chunk
    k_strides = row_strides(k_flat, 1)
    v_strides = row_strides(v_flat if STAGE_V else k_flat, 1)

    @device_function
    def issue_by_token(sm, key_cache, value_cache, block_tables, seq, kvh, kt, lo, last, stage,
                       tid, kstr, vstr):
        """``issue_tile`` with each thread copying chunks ``tid % TPT + TPT j`` of
        tokens ``tid // TPT + k NT / TPT``: one table lookup a token."""
        kbase = KV_OFF + 2 * stage * BN * D
        vbase = kbase + BN * D
        c0 = tid % TPT
        for k in range(TOKS):
            n = tid // TPT + k * (NT // TPT)
            t = int32(min(max(kt + n, lo), last))
            b = int32(uint32(t) // uint32(BLOCK_SIZE))
            blk = block_tables[seq, b]
            off = int32(t - b * BLOCK_SIZE)
            ka = wide(blk, kstr[1]) + (kstr[0] + off * kstr[2])
            va = wide(blk, vstr[1]) + (vstr[0] + off * vstr[2])
            for j in range(CPTOK):
                ch = c0 + TPT * j
                copy16_async(sm, slot(kbase, n, ch), key_cache, ka + j * (TPT * kstr[3]))
                if STAGE_V:
                    copy16_async(sm, slot(vbase, n, ch), value_cache, va + j * (TPT * vstr[3]))
                else:
                    dv = slot(vbase, n, ch)
                    for e in range(8):
                        sm[dv + e] = value_cache[blk, kvh, ch * 8 + e, off]
        commit_group()

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
                n = row_of(tid) + u * (NT // NCH) if FIXED_CHUNK else row_of(idx)
                ch = chunk_of(tid) if FIXED_CHUNK else chunk_of(idx)
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
    def q_fragment(sm, mtile, kk, qo):
        """The A fragment of m-tile ``mtile`` (rows ``16 mtile ..``) at k-step ``kk``
        (query dims ``16 kk ..``)."""
        return ldmatrix_x4(sm, frag_slot(Q_OFF, mtile * 16, kk, qo))

    @device_function
    def mma_into(acc, t, n, a0, a1, a2, a3, b0, b1):
        """``acc[t, n, :] += A B`` for the A fragment ``a0..a3`` and the B fragment
        ``b0, b1`` (one m16n8k16 product into n-tile ``n`` of m-tile ``t``)."""
        acc[t, n, 0], acc[t, n, 1], acc[t, n, 2], acc[t, n, 3] = mma(
            a0, a1, a2, a3, b0, b1, acc[t, n, 0], acc[t, n, 1], acc[t, n, 2], acc[t, n, 3])

    @device_function
    def softmax_half(s, o, m, l_, sc, t, h):
        """Online softmax of row half ``h`` of m-tile ``t`` (this lane's row ``16 t
        + r + 8 h`` of the warp, logits ``s[t, :, 2 h:2 h + 2]``): the row maximum
        over the quad, the rescale of O and the row sum where it grew (a warp
        vote), then one FFMA and one exp2 a weight, summed into the lane's share."""
        mx = NEG_INF
        for i in range(NTILE_S):
            mx = max(mx, max(s[t, i, 2 * h], s[t, i, 2 * h + 1]))
        mx = quad_max(mx)
        new = max(m[t, h], mx)
        grew = new > m[t, h]
        use = new if new != NEG_INF else float32(0.0)
        if cuda.any_sync(FULL_MASK, grew):
            alpha = exp2((m[t, h] - use) * sc)
            l_[t, h] *= alpha
            for i in range(NTILE_O):
                o[t, i, 2 * h] *= alpha
                o[t, i, 2 * h + 1] *= alpha
        m[t, h] = new
        sub = -use * sc
        for i in range(NTILE_S):
            s[t, i, 2 * h] = exp2(s[t, i, 2 * h] * sc + sub)
            s[t, i, 2 * h + 1] = exp2(s[t, i, 2 * h + 1] * sc + sub)
            l_[t, h] += s[t, i, 2 * h] + s[t, i, 2 * h + 1]

    @device_function
    def store_half(out, lse, o, m, l_, sc, warp, r, c, nq, row0, q0, h0, t, h):
        """Epilogue of row half ``h`` of m-tile ``t``: ``out = O / l`` in the
        output dtype and ``lse = (m + log2 l) ln 2``, for rows of a valid query."""
        rr = 16 * (MT * warp + t) + r + 8 * h
        lsum = quad_sum(l_[t, h])
        inv = float32(0.0)
        if lsum != 0.0:
            inv = float32(1.0) / lsum
        if rr // HPB < nq:
            row = row0 + q0 + rr // HPB
            head = h0 + rr % HPB
            part = cuda.blockIdx.z
            for i in range(NTILE_O):
                d = 8 * i + 2 * c
                if SPLIT:
                    out[row, part, head, d] = o[t, i, 2 * h] * inv
                    out[row, part, head, d + 1] = o[t, i, 2 * h + 1] * inv
                else:
                    out[row, head, d] = from_f32(o[t, i, 2 * h] * inv)
                    out[row, head, d + 1] = from_f32(o[t, i, 2 * h + 1] * inv)
            if c == 0:
                x = NEG_INF
                if lsum != 0.0:
                    x = (m[t, h] * sc + math.log2(lsum)) * float32(LN2)
                if SPLIT:
                    lse[row, part, head] = x
                else:
                    lse[row, head] = x

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
        if SPLIT:                             # this part's K/V tiles: j0 .. j0 + ntiles - 1
            per = int32((ntiles + cuda.gridDim.z - 1) // cuda.gridDim.z)
            j0 = int32(min(cuda.blockIdx.z * per, ntiles))
            ntiles = int32(min(per, ntiles - j0))
            kv_first = int32(kv_lo + j0 * BN)
        else:
            kv_first = kv_lo

        sm = cuda.shared.array(0, SMEM_T, alignment=16)
        first_chunk = tid % TPT if token_copies else chunk_of(tid)
        kstr = k_strides(key_cache, kvh, first_chunk)
        vstr = v_strides(value_cache if STAGE_V else key_cache, kvh, first_chunk)
        tid_slot = slot(0, row_of(tid), chunk_of(tid))

        # -- the tile's queries -> shared memory (rows past nq repeat the last query)
        for u in range(QCPT):
            idx = tid + u * NT
            if QCHUNKS % NT == 0 or idx < QCHUNKS:
                row = row_of(idx)
                ch = chunk_of(idx)
                qi = min(row // HPB, nq - 1)
                src = ((row0 + q0 + qi) * num_heads + h0 + row % HPB) * D + ch * 8
                copy16_async(sm, slot(Q_OFF, row, ch), query, src)
        if ntiles > 0 and token_copies:
            issue_by_token(sm, key_cache, value_cache, block_tables, seq, kvh, kv_first, kv_lo,
                           last, 0, tid, kstr, vstr)
        elif ntiles > 0:
            issue_tile(sm, key_cache, value_cache, block_tables, seq, kvh, kv_first, kv_lo, last,
                       0, tid, kstr, vstr, tid_slot)
        else:
            commit_group()

        # -- ldmatrix lane offsets: Q rows lt + 8 (lj & 1), chunk 2 p + (lj >> 1); K rows
        # lt + 8 (lj >> 1), chunk 2 p + (lj & 1); V as Q
        qo = lane_slot(lt + 8 * (lj & 1), lj >> 1, lt)
        ko = lane_slot(lt + 8 * (lj >> 1), lj & 1, lt)
        vo = qo

        # -- this lane's rows: 16 (MT w + t) + r + 8 h of m-tile t < MT and half h < 2
        pos = cuda.local.array((MT, 2), int32)
        slope = cuda.local.array((MT, 2), float32)
        m = cuda.local.array((MT, 2), float32)
        l_ = cuda.local.array((MT, 2), float32)   # this lane's share of the row sums
        qscale = scale * float32(LOG2E)
        cap2 = soft_cap * float32(LOG2E)
        any_slope = False
        for t in range(MT):
            for h in range(2):
                rr = 16 * (MT * warp + t) + r + 8 * h
                pos[t, h] = int32(pos0 + min(rr // HPB, nq - 1))
                slope[t, h] = alibi_slopes[h0 + rr % HPB] * float32(LOG2E)
                any_slope = any_slope or slope[t, h] != 0.0
                m[t, h] = NEG_INF
                l_[t, h] = 0.0
        alibi = cuda.any_sync(FULL_MASK, any_slope)
        # fma_softmax: logits stay unscaled (the maxima too) and sc scales them in
        # the exponent; else they are scaled first and sc is 1
        plain = FMA and soft_cap <= 0.0 and not alibi and qscale > 0.0
        sc = qscale if plain else float32(1.0)
        qa = cuda.local.array((MT, KSTEPS if QREGS else 1, 4), uint32)
        s = cuda.local.array((MT, NTILE_S, 4), float32)
        o = cuda.local.array((MT, NTILE_O, 4), float32)
        pa = cuda.local.array((PV_STEPS, 4), uint32)     # wgmma: P as A words
        for t in range(MT):
            for i in range(NTILE_O):
                for e in range(4):
                    o[t, i, e] = 0.0

        for j in range(ntiles):
            stage = int32(j % STAGES)
            kt = int32(kv_first + j * BN)
            wait_all()
            if WG:
                fence_proxy()   # this thread's copies, visible to the tensor cores' reads
            cuda.syncthreads()  # tile j (and the queries) landed; everyone is done with tile j - 1
            if j + 1 < ntiles and token_copies:
                issue_by_token(sm, key_cache, value_cache, block_tables, seq, kvh, kt + BN, kv_lo,
                               last, (j + 1) % STAGES, tid, kstr, vstr)
            elif j + 1 < ntiles:
                issue_tile(sm, key_cache, value_cache, block_tables, seq, kvh, kt + BN, kv_lo,
                           last, (j + 1) % STAGES, tid, kstr, vstr, tid_slot)
            if QREGS and j == 0:
                for t in range(MT):
                    for kk in range(KSTEPS):
                        qa[t, kk, 0], qa[t, kk, 1], qa[t, kk, 2], qa[t, kk, 3] = q_fragment(
                            sm, MT * warp + t, kk, qo)
            kbase = KV_OFF + 2 * stage * BN * D
            vbase = kbase + BN * D

            # -- S = Q K^T: 16 MT rows x BN keys per warp; each K fragment serves MT m-tiles
            if WG:              # the warpgroup's 64 rows, D / 16 products, then wait
                qbase = Q_OFF + (warp >> 2) * 64 * D
                pin_s(s)
                wg_fence()
                for kk in range(KSTEPS):
                    wg_s(s, sm, qbase + 128 * kk, sm, kbase + 128 * kk, kk > 0)
                wg_commit()
                wait_s(s)
            for t in range(MT if not WG else 0):
                for i in range(NTILE_S):
                    for e in range(4):
                        s[t, i, e] = 0.0
            for kk in range(KSTEPS if not WG else 0):
                if not QREGS:
                    for t in range(MT):
                        qa[t, 0, 0], qa[t, 0, 1], qa[t, 0, 2], qa[t, 0, 3] = q_fragment(
                            sm, MT * warp + t, kk, qo)
                qk = kk if QREGS else 0
                for nb in range(NTILE_S // 2):   # keys 16 nb .. 16 nb + 15
                    w0, w1, w2, w3 = ldmatrix_x4(sm, frag_slot(kbase, 16 * nb, kk, ko))
                    for t in range(MT):
                        a0 = qa[t, qk, 0]
                        a1 = qa[t, qk, 1]
                        a2 = qa[t, qk, 2]
                        a3 = qa[t, qk, 3]
                        mma_into(s, t, 2 * nb, a0, a1, a2, a3, w0, w1)
                        mma_into(s, t, 2 * nb + 1, a0, a1, a2, a3, w2, w3)

            # -- logits in base 2, variants, mask (tiles that need one)
            masked = (kt + BN > kv_hi or (causal != 0 and kt + BN - 1 > pos0)
                      or (window > 0 and pos0 + nq - 1 - kt >= window))
            if not plain:
                for t in range(MT):
                    for i in range(NTILE_S):
                        for e in range(4):
                            s[t, i, e] *= qscale
            if soft_cap > 0.0:
                for t in range(MT):
                    for i in range(NTILE_S):
                        for e in range(4):
                            s[t, i, e] = cap2 * math.tanh(s[t, i, e] / cap2)
            if alibi:
                for t in range(MT):
                    for i in range(NTILE_S):      # distances in int32, exact in fp32
                        for h in range(2):
                            d0 = float32(int32(kt + 8 * i + 2 * c - pos[t, h]))
                            s[t, i, 2 * h] += slope[t, h] * d0
                            s[t, i, 2 * h + 1] += slope[t, h] * (d0 + float32(1.0))
            if masked:
                for t in range(MT):
                    for i in range(NTILE_S):
                        k = int32(kt + 8 * i + 2 * c)
                        for h in range(2):
                            if not admits(k, pos[t, h], kv_hi, causal, window):
                                s[t, i, 2 * h] = NEG_INF
                            if not admits(k + 1, pos[t, h], kv_hi, causal, window):
                                s[t, i, 2 * h + 1] = NEG_INF

            # -- online softmax, one call a row half (t, h constants: no loop to unroll)
            softmax_half(s, o, m, l_, sc, 0, 0)
            softmax_half(s, o, m, l_, sc, 0, 1)
            if MT == 2:
                softmax_half(s, o, m, l_, sc, 1, 0)
                softmax_half(s, o, m, l_, sc, 1, 1)

            # -- O += P V: P rounded to the cache dtype is the A operand as it lies;
            # each V fragment serves MT m-tiles
            if WG:              # P words first, then fence, BN / 16 products, wait
                for ks in range(PV_STEPS):
                    pa[ks, 0] = pack(s[0, 2 * ks, 0], s[0, 2 * ks, 1])
                    pa[ks, 1] = pack(s[0, 2 * ks, 2], s[0, 2 * ks, 3])
                    pa[ks, 2] = pack(s[0, 2 * ks + 1, 0], s[0, 2 * ks + 1, 1])
                    pa[ks, 3] = pack(s[0, 2 * ks + 1, 2], s[0, 2 * ks + 1, 3])
                pin_p(pa)
                pin_o(o)
                wg_fence()
                for ks in range(PV_STEPS):
                    wg_o(o, pa[ks, 0], pa[ks, 1], pa[ks, 2], pa[ks, 3], sm,
                         vbase + ks * 16 * D, True)
                wg_commit()
                wait_o(o)
            for ks in range(PV_STEPS if not WG else 0):   # keys 16 ks .. 16 ks + 15
                for db in range(NTILE_O // 2):     # dims 16 db .. 16 db + 15
                    w0, w1, w2, w3 = ldmatrix_x4_trans(sm, frag_slot(vbase, 16 * ks, db, vo))
                    for t in range(MT):
                        p0 = pack(s[t, 2 * ks, 0], s[t, 2 * ks, 1])
                        p1 = pack(s[t, 2 * ks, 2], s[t, 2 * ks, 3])
                        p2 = pack(s[t, 2 * ks + 1, 0], s[t, 2 * ks + 1, 1])
                        p3 = pack(s[t, 2 * ks + 1, 2], s[t, 2 * ks + 1, 3])
                        mma_into(o, t, 2 * db, p0, p1, p2, p3, w0, w1)
                        mma_into(o, t, 2 * db + 1, p0, p1, p2, p3, w2, w3)

        # -- epilogue, one call a row half
        store_half(out, lse, o, m, l_, sc, warp, r, c, nq, row0, q0, h0, 0, 0)
        store_half(out, lse, o, m, l_, sc, warp, r, c, nq, row0, q0, h0, 0, 1)
        if MT == 2:
            store_half(out, lse, o, m, l_, sc, warp, r, c, nq, row0, q0, h0, 1, 0)
            store_half(out, lse, o, m, l_, sc, warp, r, c, nq, row0, q0, h0, 1, 1)

    # what a launch must ask for (``_launch.PackedLaunch`` reads it)
    paged_prefill_tc_kernel.dynamic_shared_bytes = DYNAMIC_BYTES
    return paged_prefill_tc_kernel
