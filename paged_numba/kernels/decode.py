"""Paged decode attention: one query token per sequence, K/V read through a block table.

NumPy spec of what one launch computes, for sequence ``s``, query head ``h``,
KV head ``g = h // (num_heads // num_kv_heads)`` and partition ``p`` (tokens
``[p * partition_size, min((p + 1) * partition_size, seq_lens[s]))``)::

    K, V = keys and values of those tokens, found via block_tables[s]
                                                   # (only keys k with qpos - k < window)
    z = scale * K[:, g] @ query[s, h]              # logits, fp32
    z = soft_cap * tanh(z / soft_cap)              # if soft_cap > 0
    z += alibi_slopes[h] * (k - qpos)              # qpos = seq_lens[s] - 1
    m = z.max(); l = exp(z - m).sum()
    out[s, p, h] = exp(z - m) @ V[:, g] / l        # 0 when the partition is empty
    lse[s, p, h] = m + log(l)                      # -inf when the partition is empty

With one partition that is the attention output itself; with several, the
partials are combined by ``kernels.merge`` with the (m, l) rule.

Structure (vLLM's kernel, with the KV head's query group handled together so
that each K/V element is read from memory once for ``HPB`` query heads):

* grid ``(num_heads // HPB, num_seqs, num_partitions)``, ``NUM_WARPS`` warps;
* the ``HPB`` query vectors (pre-scaled) sit in shared memory;
* the partition is walked in chunks of ``CHUNK`` tokens: logits of a chunk go to
  shared memory; each head's chunk max and exp-sum are reduced with
  ``shfl_xor_sync`` inside a warp and through shared memory across the
  ``WPH`` warps that share the head (warps own heads when ``HPB >= NUM_WARPS``),
  and the running output is rescaled by ``exp(m_old - m_new)`` (online
  softmax), so shared memory does not grow with the context;
* P @ V is accumulated in fp32 registers, one 16-byte vector of head
  elements per lane and token slot; at the end the slots' partial rows are
  summed through shared memory, one head at a time.
"""
import functools
import math

from numba import cuda, float32

from .access import device_function, vector_accessors

FULL_MASK = 0xFFFFFFFF
NEG_INF = float32(-math.inf)


def _pow2_floor(n):
    p = 1
    while p * 2 <= n:
        p *= 2
    return p


@functools.cache
def decode_kernel(head_size, block_size, heads_per_block, itemsize, layout,
                  num_warps=4, chunk=256, unroll=4):
    """Compile-time specialised decode kernel.

    Kernel arguments: ``out [num_seqs, num_partitions, num_heads, head_size]``,
    ``lse [num_seqs, num_partitions, num_heads]`` float32, ``query
    [num_seqs, num_heads, head_size]``, ``key_cache``, ``value_cache`` (C-contiguous
    pools), ``block_tables [num_seqs, max_blocks]`` int32, ``seq_lens [num_seqs]``
    int32, ``scale`` float32, ``partition_size`` int32, ``alibi_slopes
    [num_heads]`` float32 (zeros for none), ``soft_cap`` float32 (0 for none),
    ``window`` int32 (0 for none). Launch with grid
    ``(num_heads // heads_per_block, num_seqs, num_partitions)`` and
    ``32 * num_warps`` threads.
    """
    HEAD_SIZE = head_size
    BLOCK_SIZE = block_size
    HPB = heads_per_block                 # query heads sharing one K/V read
    VEC = 16 // itemsize                  # elements in a 16-byte vector
    NVEC = HEAD_SIZE // VEC               # vectors in one head row
    NW = num_warps
    NT = 32 * NW
    CHUNK = chunk
    U = unroll                            # tokens per lane whose loads are in flight together
    # LPR lanes cover one token's head row, one 16-byte vector each (VPL if the
    # row has more than 32); SLOTS tokens are handled side by side per step.
    LPR = min(32, _pow2_floor(NVEC))
    VPL = -(-NVEC // LPR)
    SLOTS = NT // LPR
    ACC = VPL * VEC                       # elements of a row this lane owns
    STEP = SLOTS * U
    KV_R = U * ACC                        # registers for the in-flight vectors
    # softmax: WPH warps share one head's logits; each warp owns HPW heads
    WPH = max(NW // HPB, 1)
    HPW = -(-HPB // NW)
    KV_HEAD_AXIS = {"nhd": 2, "vllm": 1, "hnd": 1, "interleaved": 3}[layout]
    assert HEAD_SIZE % VEC == 0 and NW & (NW - 1) == 0
    k_vec, v_vec = vector_accessors(layout, VEC)

    def stager(vec_fn):
        """Device function loading this lane's vectors of U tokens of one step
        (tokens ``first + u * SLOTS + slot`` for ``u < U``, those below
        ``first + n``) into ``kv_r``, all loads issued before any is used."""

        @device_function
        def stage(pool, block_tables, seq, kvh, first, n, slot, lane_r, kv_r):
            for u in range(U):
                tl = u * SLOTS + slot
                if tl < n:
                    t = first + tl
                    blk = block_tables[seq, t // BLOCK_SIZE]
                    off = t % BLOCK_SIZE
                    for i in range(VPL):
                        v = lane_r + i * LPR
                        if v < NVEC:
                            vec_fn(pool, blk, kvh, off, v, kv_r, (u * VPL + i) * VEC)

        return stage

    stage_k, stage_v = stager(k_vec), stager(v_vec)

    @cuda.jit
    def paged_decode_kernel(out, lse, query, key_cache, value_cache, block_tables,
                            seq_lens, scale, partition_size, alibi_slopes, soft_cap, window):
        hb = cuda.blockIdx.x
        seq = cuda.blockIdx.y
        part = cuda.blockIdx.z
        tid = cuda.threadIdx.x
        lane = tid % 32
        warp = tid // 32
        group = query.shape[1] // key_cache.shape[KV_HEAD_AXIS]
        h0 = hb * HPB
        kvh = h0 // group
        seq_len = seq_lens[seq]
        qpos = seq_len - 1                       # the query is the newest token
        first = 0 if window <= 0 else max(seq_len - window, 0)   # sliding window: qpos - k < window
        start = max(part * partition_size, first)
        end = min(part * partition_size + partition_size, seq_len)
        lane_r = tid % LPR          # which vectors of a row this lane owns
        slot = tid // LPR           # which token of a step this lane serves

        q_s = cuda.shared.array((HPB, HEAD_SIZE), float32)
        p_s = cuda.shared.array((HPB, CHUNK), float32)
        max_s = cuda.shared.array((NW, HPW), float32)
        sum_s = cuda.shared.array((NW, HPW), float32)
        alpha_s = cuda.shared.array(HPB, float32)
        l_s = cuda.shared.array(HPB, float32)
        m_s = cuda.shared.array(HPB, float32)
        out_s = cuda.shared.array((SLOTS, HEAD_SIZE), float32)

        # -- stage the scaled queries of the group, then keep this lane's slice in registers
        for i in range(tid, HPB * HEAD_SIZE, NT):
            hh = i // HEAD_SIZE
            d = i % HEAD_SIZE
            q_s[hh, d] = float32(query[seq, h0 + hh, d]) * scale
        cuda.syncthreads()  # wait for q_s
        q_r = cuda.local.array((HPB, ACC), float32)
        acc = cuda.local.array((HPB, ACC), float32)
        kv_r = cuda.local.array(KV_R, float32)
        for hh in range(HPB):
            for i in range(VPL):
                v = lane_r + i * LPR
                for e in range(VEC):
                    q_r[hh, i * VEC + e] = q_s[hh, v * VEC + e] if v < NVEC else 0.0
                    acc[hh, i * VEC + e] = 0.0
        for j in range(KV_R):
            kv_r[j] = 0.0
        slope_r = cuda.local.array(HPB, float32)
        for hh in range(HPB):
            slope_r[hh] = alibi_slopes[h0 + hh]
        m_run = cuda.local.array(HPW, float32)   # running max / exp-sum of this
        l_run = cuda.local.array(HPW, float32)   # warp's heads (same in all WPH warps)
        for j in range(HPW):
            m_run[j] = NEG_INF
            l_run[j] = 0.0
        sub = warp % WPH            # this warp's share of its heads' tokens
        head_base = (warp // WPH) * HPW

        for c0 in range(start, end, CHUNK):
            n = min(CHUNK, end - c0)
            # -- qk: U tokens per lane, their key vectors loaded before any is used
            for base in range(0, n, STEP):       # uniform trip count: shuffles below
                stage_k(key_cache, block_tables, seq, kvh, c0 + base, n - base, slot, lane_r, kv_r)
                for u in range(U):
                    tl = base + u * SLOTS + slot
                    for hh in range(HPB):
                        x = float32(0.0)
                        for a in range(ACC):
                            x += q_r[hh, a] * kv_r[u * ACC + a]
                        o = LPR // 2
                        while o > 0:
                            x += cuda.shfl_xor_sync(FULL_MASK, x, o)
                            o //= 2
                        if tl < n and lane_r == 0:
                            # variants, in order: soft cap, then ALiBi (slopes are 0 without it)
                            if soft_cap > 0.0:
                                x = soft_cap * math.tanh(x / soft_cap)
                            p_s[hh, tl] = x + slope_r[hh] * float32(c0 + tl - qpos)
            cuda.syncthreads()  # wait for the chunk's logits

            # -- softmax: max over the chunk, shuffles in the warp, shared memory across its WPH warps
            for j in range(HPW):
                hh = head_base + j
                if hh < HPB:                       # warp-uniform
                    mx = NEG_INF
                    for tl in range(sub * 32 + lane, n, 32 * WPH):
                        mx = max(mx, p_s[hh, tl])
                    o = 16
                    while o > 0:
                        mx = max(mx, cuda.shfl_xor_sync(FULL_MASK, mx, o))
                        o //= 2
                    max_s[warp, j] = mx
            if WPH > 1:
                cuda.syncthreads()  # wait for the other warps' maxima of my heads
            for j in range(HPW):
                hh = head_base + j
                if hh < HPB:
                    mx = max_s[warp - sub, j]
                    for w in range(1, WPH):
                        mx = max(mx, max_s[warp - sub + w, j])
                    m_new = max(m_run[j], mx)
                    alpha = math.exp(m_run[j] - m_new)
                    m_run[j] = m_new
                    if sub == 0 and lane == 0:
                        alpha_s[hh] = alpha
                    s = float32(0.0)
                    for tl in range(sub * 32 + lane, n, 32 * WPH):
                        p = math.exp(p_s[hh, tl] - m_new)
                        p_s[hh, tl] = p
                        s += p
                    o = 16
                    while o > 0:
                        s += cuda.shfl_xor_sync(FULL_MASK, s, o)
                        o //= 2
                    sum_s[warp, j] = s
                    l_run[j] *= alpha
            cuda.syncthreads()  # wait for probabilities, per-warp sums and alpha_s
            for j in range(HPW):
                hh = head_base + j
                if hh < HPB:
                    for w in range(WPH):
                        l_run[j] += sum_s[warp - sub + w, j]

            # -- pv: rescale the running output, then add this chunk, U tokens in flight
            for hh in range(HPB):
                a = alpha_s[hh]
                for j in range(ACC):
                    acc[hh, j] *= a
            for base in range(0, n, STEP):
                stage_v(value_cache, block_tables, seq, kvh, c0 + base, n - base, slot, lane_r, kv_r)
                for u in range(U):
                    tl = base + u * SLOTS + slot
                    if tl < n:
                        for hh in range(HPB):
                            p = p_s[hh, tl]
                            for a in range(ACC):
                                acc[hh, a] += p * kv_r[u * ACC + a]
            cuda.syncthreads()  # p_s, max_s, sum_s and alpha_s are free for the next chunk

        # -- epilogue: publish each head's (m, l), then sum the token slots per head
        for j in range(HPW):
            hh = head_base + j
            if hh < HPB and sub == 0 and lane == 0:
                m_s[hh] = m_run[j]
                l_s[hh] = l_run[j]
        for hh in range(HPB):
            for i in range(VPL):
                v = lane_r + i * LPR
                if v < NVEC:
                    for e in range(VEC):
                        out_s[slot, v * VEC + e] = acc[hh, i * VEC + e]
            cuda.syncthreads()  # wait for every slot's partial row (and m_s, l_s)
            inv = float32(0.0)
            if l_s[hh] > 0.0:
                inv = float32(1.0) / l_s[hh]
            for d in range(tid, HEAD_SIZE, NT):
                total = float32(0.0)
                for sl in range(SLOTS):
                    total += out_s[sl, d]
                out[seq, part, h0 + hh, d] = total * inv
            cuda.syncthreads()  # out_s is free for the next head
        if tid < HPB:
            if l_s[tid] > 0.0:
                lse[seq, part, h0 + tid] = m_s[tid] + math.log(l_s[tid])
            else:
                lse[seq, part, h0 + tid] = NEG_INF

    return paged_decode_kernel


def heads_per_block(group_size, limit=8):
    """Largest divisor of the GQA group size that is at most ``limit``."""
    for hpb in range(min(group_size, limit), 0, -1):
        if group_size % hpb == 0:
            return hpb
    return 1
