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

Out-of-range inputs (possible only when the caller skipped validation) are
not followed (:mod:`.guard`): a ``seq_lens`` entry outside ``[0,
max_blocks * block_size]`` is clamped into it, and a table entry the
sequence uses that is not a block of the pool reads block 0 instead; either
is recorded in ``errors [4]`` int64 (that sequence's output is wrong, the
others' are untouched).

Non-finite data as in ``paged_numba.reference``: ``max`` passes over a NaN
logit (a comparison with NaN is false), so the running maximum stays a number
and the NaN travels in the exp-sums instead. Where no finite maximum exists
yet the exponent subtracts 0 (not ``-inf``), so a masked logit still weighs 0
and a NaN one NaN; a NaN exp-sum then makes the epilogue's ``l != 0`` test
pass, and ``1 / l`` and ``log l`` carry it to the output and the lse. The
steady loop does no extra work for it.

Structure (FlashDecoding's split of the context, with the query heads of one
KV head's group handled together so that each K/V byte is read once):

* grid ``(num_heads // HPB, num_seqs, num_partitions)``, ``NW`` warps, and no
  barrier until the epilogue: every warp streams its own steps of the
  partition and keeps its own online-softmax state;
* a row of a token's key (``head_size`` elements) is split over ``LPR``
  lanes, one 16-byte vector each, so a warp covers ``TPW = 32 / LPR``
  tokens side by side, ``U`` of them per lane in a warp step; each lane
  copies the key and value vectors it needs with ``cp.async`` into its own
  slots of a shared-memory ring ``STAGES - 1`` steps ahead and reads them
  back when it gets there (loads in flight hold no registers, and no lane
  reads another's slots, so no barrier is needed; the "vllm" value layout,
  whose rows are strided, is read directly instead);
* the ``HPB x U`` partial dot products of a lane are reduced across its
  ``LPR`` lanes by a *transposing* butterfly: at each shuffle step a lane
  keeps half of its values and trades the other half, so after
  ``log2(LPR)`` steps each lane owns whole logits (``HPB U - 1`` shuffles
  instead of ``HPB U log2(LPR)``), and the softmax of a logit is computed by
  the one lane that owns it;
* logits are kept in base 2 (the query is pre-scaled by ``scale * log2(e)``)
  so each probability is one ``exp2``; the running output is rescaled only
  when some head's running maximum grows (a warp vote);
* the probabilities reach the lanes that hold the value vectors by
  ``shfl_sync``; P @ V accumulates in fp32 registers;
* epilogue: the token groups of a warp are summed with shuffles, the warps'
  states merged with the (m, l) rule through shared memory.
"""
import functools
import math

from numba import cuda, float32, int32, uint8, uint16
from numba.core.types import float16

from .access import device_function, vector_accessors, vector_offsets
from .async_copy import commit_group, copy16_async, wait_group
from .convert import codec
from .fp8 import FORMATS as FP8_FORMATS
from .fp8 import fp8_vector_accessors, load16_fp8, store_as, to_f32_any
from .guard import block_of, length_of, outside
from .vector import load16

from .warp_reduce import (  # noqa: F401  (kernels.decode.lane_reducer etc., as before)
    FULL_MASK, LN2, LOG2E, NEG_INF, _pow2_ceil, _pow2_floor, lane_reducer, transposing_reducer,
    warp_merger)

STORAGE = {"float16": float16, "float32": float32, "bfloat16": uint16,
           "float8_e4m3fn": uint8, "float8_e5m2": uint8}
SHARED_BYTES = 48 * 1024      # static shared memory of one thread block


@functools.cache
def decode_kernel(head_size, block_size, heads_per_block, dtype, layout,
                  num_warps=4, unroll=4, stages=4, split=False):
    """Compile-time specialised decode kernel for a cache of ``dtype`` (a name).

    Kernel arguments: ``out [num_seqs, num_partitions, num_heads, head_size]``
    (the cache's dtype; float32 split-K partials when ``split``), ``lse [num_seqs,
    num_partitions, num_heads]`` float32, ``query [num_seqs, num_heads,
    head_size]``, ``key_cache``, ``value_cache`` (C-contiguous pools),
    ``block_tables [num_seqs, max_blocks]`` int32, ``seq_lens [num_seqs]``
    int32, ``scale`` float32, ``partition_size`` int32, ``alibi_slopes
    [num_heads]`` float32 (zeros for none), ``soft_cap`` float32 (0 for
    none), ``window`` int32 (0 for none), ``errors [4]`` int64 (the cache's
    error word: :mod:`.guard`). Launch with grid ``(num_heads //
    heads_per_block, num_seqs, num_partitions)`` and ``32 * num_warps``
    threads.

    An fp8 ``dtype`` (``"float8_e4m3fn"``, ``"float8_e5m2"``: ``uint8`` pools,
    16 codes a 16-byte vector) adds a last argument ``kv_scales [2,
    num_kv_heads]`` float32 (K's scale of each KV head, then V's), after
    ``errors``.
    The codes are decoded exactly to float32 as they are read from the copy
    ring (``kernels.fp8``); K's scale of the block's KV head is folded into
    the query's scale (``q * (scale * log2 e * k_scale)``) and V's into the
    accumulated output before the warps are merged. The query may be fp16,
    fp32 or bf16 bits (``uint16``), and the unsplit output takes the query's
    type: the kernel follows the arrays' types (one dispatcher compiles one
    version for each).
    """
    HEAD_SIZE = head_size
    BLOCK_SIZE = block_size
    HPB = heads_per_block                 # query heads sharing one K/V read
    FP8 = dtype in FP8_FORMATS            # uint8 codes, decoded as they are read
    VEC = 16 // {"float32": 4}.get(dtype, 1 if FP8 else 2)   # elements in a 16-byte vector
    SMEM_T = STORAGE[dtype]
    NVEC = HEAD_SIZE // VEC               # vectors in one head row
    NW = num_warps
    NT = 32 * NW
    U = unroll                            # tokens per lane and warp step
    # LPR lanes cover one token's row, one 16-byte vector each (VPL of them
    # when the row has more than 32 vectors); TPW tokens side by side per warp.
    LPR = min(32, _pow2_floor(NVEC))
    VPL = -(-NVEC // LPR)
    TPW = 32 // LPR
    ACC = VPL * VEC                       # elements of a row this lane owns
    STEP = TPW * U                        # tokens per warp step
    # copy ring: each lane copies its own vectors of U tokens per step into
    # shared memory (keys, and values unless "vllm", whose value rows are not
    # contiguous) and reads them back itself, STAGES - 1 steps later
    STAGE_V = layout != "vllm"
    CPS = U * VPL * (2 if STAGE_V else 1)             # 16-byte chunks per lane and step
    ring_bytes = SHARED_BYTES - 4 * (NW * HEAD_SIZE + 2 * NW * HPB) - 256
    STAGES = max(2, min(stages, ring_bytes // (CPS * NT * 16)))
    RING = STAGES * CPS * NT * VEC                    # elements
    # logits of a lane group per step: index hh * UP + u, padded to a power of two
    UP = _pow2_ceil(U)
    N = _pow2_ceil(HPB) * UP
    NF = max(N // LPR, 1)                 # logits each lane owns after the reduction
    DUP = max(LPR // N, 1)                # lanes holding copies of one logit
    UL = min(NF, UP)                      # owned logits per owned head
    HL = NF // UL                         # heads a lane owns logits of
    # lanes sharing an owned head: the low bits of the group index that only
    # select u or a copy, and every token group of the warp
    head_mask = (max(LPR // _pow2_ceil(HPB), 1) - 1) | (31 & ~(LPR - 1))
    KV_HEAD_AXIS = {"nhd": 2, "vllm": 1, "hnd": 1, "interleaved": 3}[layout]
    assert HEAD_SIZE % VEC == 0 and NW & (NW - 1) == 0
    k_flat, v_flat = vector_offsets(layout, VEC, BLOCK_SIZE, HEAD_SIZE)
    wait_stages = wait_group(STAGES - 1)
    store = None
    if FP8:
        load_kv = load16_fp8(dtype)
        to_f32 = to_f32_any                                 # by the query's type
        _, from_f32 = codec("float32")
        if not split:
            @device_function
            def store_typed(out, seq, part, head, d, x):    # in the output's (query's) type
                out[seq, part, head, d] = store_as(x, out)
            store = store_typed
        _, v_vec = fp8_vector_accessors(layout, dtype)     # ("vllm" values, one by one)

        @device_function
        def kv_scale(kv_scales, kvh):
            return kv_scales[0, kvh], kv_scales[1, kvh]

        @device_function
        def scale_acc(acc, vs):
            for hh in range(HPB):
                for a in range(ACC):
                    acc[hh, a] *= vs
    else:
        load_kv = load16
        _, v_vec = vector_accessors(layout, dtype)
        to_f32, _ = codec(dtype)
        _, from_f32 = codec("float32" if split else dtype)     # the output's element type

        @device_function
        def kv_scale(kv_scales, kvh):
            return float32(1.0), float32(1.0)

        @device_function
        def scale_acc(acc, vs):
            pass
    reduce_logits = transposing_reducer(N, LPR)
    head_max = lane_reducer(head_mask, True)
    head_sum = lane_reducer(head_mask, False)
    merge_warps = warp_merger(NW, HPB, HEAD_SIZE, VEC, VPL, LPR, from_f32, store=store)

    @device_function
    def src_lane(idx):
        """Lane (within its group) that owns logit ``idx`` after the reduction."""
        return idx * LPR // N

    @device_function
    def src_slot(idx):
        """Where in that lane's owned values logit ``idx`` sits."""
        return idx - (idx * LPR // N) * NF if N >= LPR else 0

    @device_function
    def chunk(stage, c, tid):
        """Flat index in the ring of this thread's chunk ``c`` of ``stage``."""
        return ((stage * CPS + c) * NT + tid) * VEC

    @device_function
    def issue(ring, key_cache, value_cache, block_tables, errors, seq, kvh, s0, end, stage, g,
              lane_r, tid):
        """Start copying the vectors of the step's tokens ``s0 + u * TPW + g``
        (those below ``end``) into ``stage`` of the ring, as one group. A table
        entry that is not a block of the pool copies block 0; it is recorded
        after the copies are issued (the rare path reads the entries again:
        fewer registers than recording in the loop)."""
        bad = False
        for u in range(U):
            t = s0 + u * TPW + g
            if t < end:
                blk = block_tables[seq, t // BLOCK_SIZE]
                if outside(blk, key_cache.shape[0]):
                    bad = True
                    blk = int32(0)
                off = t % BLOCK_SIZE
                for i in range(VPL):
                    v = lane_r + i * LPR
                    if v < NVEC:
                        copy16_async(ring, chunk(stage, u * VPL + i, tid), key_cache,
                                     k_flat(key_cache, blk, kvh, off, v))
                        if STAGE_V:
                            copy16_async(ring, chunk(stage, (U + u) * VPL + i, tid), value_cache,
                                         v_flat(value_cache, blk, kvh, off, v))
        commit_group()
        if bad:
            for u in range(U):
                t = s0 + u * TPW + g
                if t < end:
                    block_of(block_tables, errors, seq, t // BLOCK_SIZE, key_cache.shape[0])

    @device_function
    def decode(out, lse, query, key_cache, value_cache, block_tables, seq_lens, scale,
               partition_size, alibi_slopes, soft_cap, window, errors, kv_scales):
        hb = cuda.blockIdx.x
        seq = cuda.blockIdx.y
        part = cuda.blockIdx.z
        tid = cuda.threadIdx.x
        lane = tid % 32
        warp = tid // 32
        lane_r = lane % LPR                  # which vectors of a row this lane owns
        g = lane // LPR                      # which token of a step's TPW this lane serves
        gbase = g * LPR
        group = query.shape[1] // key_cache.shape[KV_HEAD_AXIS]
        h0 = hb * HPB
        kvh = h0 // group
        # clamped into what the table's row holds (so its reads stay in it)
        seq_len = length_of(seq_lens, errors, seq, block_tables.shape[1] * BLOCK_SIZE)
        qpos = seq_len - 1                   # the query is the newest token
        first = 0 if window <= 0 else max(seq_len - window, 0)   # sliding window: qpos - k < window
        start = max(part * partition_size, first)
        end = min(part * partition_size + partition_size, seq_len)
        base = lane_r * N // LPR             # first logit index this lane owns
        owner = lane_r % DUP == 0            # counts its logits in the exp-sums

        m_s = cuda.shared.array((NW, HPB), float32)
        l_s = cuda.shared.array((NW, HPB), float32)
        acc_s = cuda.shared.array((NW, HEAD_SIZE), float32)
        ring = cuda.shared.array(RING, SMEM_T)

        # -- this lane's slice of the group's queries, scaled into base-2 logits
        k_scale, v_scale = kv_scale(kv_scales, kvh)      # fp8: the codes' scales (else 1)
        qscale = scale * float32(LOG2E) * k_scale
        q_r = cuda.local.array((HPB, ACC), float32)
        acc = cuda.local.array((HPB, ACC), float32)
        for hh in range(HPB):
            for i in range(VPL):
                v = lane_r + i * LPR
                for e in range(VEC):
                    x = float32(0.0)
                    if v < NVEC:
                        x = to_f32(query[seq, h0 + hh, v * VEC + e]) * qscale
                    q_r[hh, i * VEC + e] = x
                    acc[hh, i * VEC + e] = 0.0
        cap2 = soft_cap * float32(LOG2E)     # c tanh(z / c) in base 2
        slope = cuda.local.array(HL, float32)
        m_run = cuda.local.array(HL, float32)
        l_run = cuda.local.array(HL, float32)
        alpha_r = cuda.local.array(HL, float32)
        for a in range(HL):
            hh = (base + a * UL) // UP
            slope[a] = alibi_slopes[h0 + hh] * float32(LOG2E) if hh < HPB else 0.0
            m_run[a] = NEG_INF
            l_run[a] = 0.0
        kr = cuda.local.array(ACC, float32)
        vr = cuda.local.array(ACC, float32)
        red = cuda.local.array(N, float32)
        p = cuda.local.array(NF, float32)

        # this warp's steps: tokens [s0, s0 + STEP) for s0 = start + (warp + j NW) STEP
        nsteps = 0
        if start + warp * STEP < end:
            nsteps = (end - start - warp * STEP + NW * STEP - 1) // (NW * STEP)
        for j in range(STAGES - 1):                 # fill the ring
            if j < nsteps:
                issue(ring, key_cache, value_cache, block_tables, errors, seq, kvh,
                      start + (warp + j * NW) * STEP, end, j, g, lane_r, tid)
            else:
                commit_group()
        for j in range(nsteps):
            nxt = j + STAGES - 1
            if nxt < nsteps:
                issue(ring, key_cache, value_cache, block_tables, errors, seq, kvh,
                      start + (warp + nxt * NW) * STEP, end, nxt % STAGES, g, lane_r, tid)
            else:
                commit_group()
            wait_stages()                           # this step's group has landed
            stage = j % STAGES
            s0 = start + (warp + j * NW) * STEP
            # -- qk: partial dots of each token's key, then the transposing reduction
            for u in range(U):
                valid = s0 + u * TPW + g < end
                for i in range(VPL):
                    v = lane_r + i * LPR
                    if valid and v < NVEC:
                        load_kv(ring, chunk(stage, u * VPL + i, tid), kr, i * VEC)
                    else:
                        for e in range(VEC):
                            kr[i * VEC + e] = 0.0
                for hh in range(HPB):
                    x = float32(0.0)
                    for a in range(ACC):
                        x += q_r[hh, a] * kr[a]
                    red[hh * UP + u] = x
            for j2 in range(HPB * UP, N):
                red[j2] = 0.0
            for hh in range(HPB):
                for u in range(U, UP):
                    red[hh * UP + u] = 0.0
            reduce_logits(red, lane_r)
            # -- online softmax of the owned logits (variants in order: soft cap, ALiBi)
            grew = False
            for a in range(HL):
                mx = NEG_INF
                for b in range(UL):
                    idx = base + a * UL + b
                    u = idx % UP
                    t = s0 + u * TPW + g
                    z = NEG_INF
                    if idx // UP < HPB and u < U and t < end:
                        z = red[a * UL + b]
                        if soft_cap > 0.0:
                            z = cap2 * math.tanh(z / cap2)
                        z += slope[a] * float32(t - qpos)
                    red[a * UL + b] = z
                    mx = max(mx, z)
                m_new = max(m_run[a], head_max(mx))
                grew = grew or m_new > m_run[a]
                alpha = float32(1.0)
                if m_new > m_run[a]:
                    alpha = math.exp2(m_run[a] - m_new)
                # no finite maximum yet: subtract 0, so masked logits (-inf) still give 0
                # and NaN logits (which max() passes over) give NaN
                m_use = m_new if m_new != NEG_INF else float32(0.0)
                lsum = float32(0.0)
                for b in range(UL):
                    e = math.exp2(red[a * UL + b] - m_use)
                    p[a * UL + b] = e
                    lsum += e
                l_run[a] = l_run[a] * alpha + (lsum if owner else float32(0.0))
                m_run[a] = m_new
                alpha_r[a] = alpha
            # -- pv: rescale the running output if a maximum grew, then add U tokens
            if cuda.any_sync(FULL_MASK, grew):
                for hh in range(HPB):
                    idx = hh * UP
                    al = cuda.shfl_sync(FULL_MASK, alpha_r[src_slot(idx) // UL], gbase + src_lane(idx))
                    for a in range(ACC):
                        acc[hh, a] *= al
            for u in range(U):
                t = s0 + u * TPW + g
                for i in range(VPL):
                    v = lane_r + i * LPR
                    if t < end and v < NVEC:
                        if STAGE_V:
                            load_kv(ring, chunk(stage, (U + u) * VPL + i, tid), vr, i * VEC)
                        else:
                            # the keys' copy of token t has recorded a bad entry
                            blk = block_tables[seq, t // BLOCK_SIZE]
                            if outside(blk, key_cache.shape[0]):
                                blk = int32(0)
                            v_vec(value_cache, blk, kvh, t % BLOCK_SIZE, v, vr, i * VEC)
                    else:
                        for e in range(VEC):
                            vr[i * VEC + e] = 0.0
                for hh in range(HPB):
                    idx = hh * UP + u
                    pb = cuda.shfl_sync(FULL_MASK, p[src_slot(idx)], gbase + src_lane(idx))
                    for a in range(ACC):
                        acc[hh, a] += pb * vr[a]

        # -- epilogue: the warp's state (token groups summed), then the warps merged
        for a in range(HL):
            l_run[a] = head_sum(l_run[a])
            if g == 0 and (base + a * UL) % UP == 0 and owner:
                hh = (base + a * UL) // UP
                if hh < HPB:
                    m_s[warp, hh] = m_run[a]
                    l_s[warp, hh] = l_run[a]
        scale_acc(acc, v_scale)                          # fp8: V's scale (else nothing)
        merge_warps(out, lse, seq, part, h0, warp, tid, g, lane_r, acc, m_s, l_s, acc_s)

    if FP8:
        @cuda.jit
        def paged_decode_fp8_kernel(out, lse, query, key_cache, value_cache, block_tables,
                                    seq_lens, scale, partition_size, alibi_slopes, soft_cap,
                                    window, errors, kv_scales):
            decode(out, lse, query, key_cache, value_cache, block_tables, seq_lens, scale,
                   partition_size, alibi_slopes, soft_cap, window, errors, kv_scales)

        return paged_decode_fp8_kernel

    @cuda.jit
    def paged_decode_kernel(out, lse, query, key_cache, value_cache, block_tables,
                            seq_lens, scale, partition_size, alibi_slopes, soft_cap, window,
                            errors):
        decode(out, lse, query, key_cache, value_cache, block_tables, seq_lens, scale,
               partition_size, alibi_slopes, soft_cap, window, errors, alibi_slopes)  # no scales

    return paged_decode_kernel


def heads_per_block(group_size, limit=8):
    """Largest divisor of the GQA group size that is at most ``limit``."""
    for hpb in range(min(group_size, limit), 0, -1):
        if group_size % hpb == 0:
            return hpb
    return 1
