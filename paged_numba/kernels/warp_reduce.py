"""Warp-level building blocks of the decode kernels: reductions across lanes
(``lane_reducer``, ``transposing_reducer``) and the merge of the warps'
partial states by the (m, l) rule (``warp_merger``), with the constants they
share. Under the simulator the shuffles go through ``paged_numba._simulator``.
"""
import math

from numba import cuda, float32

from .access import device_function

FULL_MASK = 0xFFFFFFFF
NEG_INF = float32(-math.inf)
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def _pow2_floor(n):
    p = 1
    while p * 2 <= n:
        p *= 2
    return p


def _pow2_ceil(n):
    p = 1
    while p < n:
        p *= 2
    return p


def transposing_reducer(n, lanes):
    """Device function ``reduce(vals, lane)`` summing ``vals[0:n]`` (``n`` a
    power of two) across the ``lanes`` lanes of an aligned lane group.

    Step with offset ``o`` (``lanes / 2`` first): a lane whose bit ``o`` is
    clear keeps the first half of its values and sends the second half to its
    partner, which does the opposite, and both add what they receive. When a
    lane holds one value the remaining steps are a plain butterfly. Afterwards
    lane ``r`` of the group holds the sums of values
    ``[r * n // lanes, r * n // lanes + max(n // lanes, 1))`` in ``vals[0:...]``
    (lanes with equal ``r * n // lanes`` hold copies).
    """
    if lanes == 1:
        @device_function
        def done(vals, lane):
            pass
        return done
    o = lanes // 2
    if n == 1:
        rest = transposing_reducer(1, o)

        @device_function
        def butterfly(vals, lane):
            vals[0] += cuda.shfl_xor_sync(FULL_MASK, vals[0], o)
            rest(vals, lane)
        return butterfly
    half = n // 2
    rest = transposing_reducer(half, o)

    @device_function
    def transpose(vals, lane):
        upper = (lane & o) != 0
        for i in range(half):
            a = vals[i]
            b = vals[i + half]
            got = cuda.shfl_xor_sync(FULL_MASK, a if upper else b, o)
            vals[i] = (b if upper else a) + got
        rest(vals, lane)
    return transpose


def lane_reducer(mask, op_max):
    """Device function ``reduce(x)``: max (``op_max``) or sum of ``x`` over the
    lanes that differ from the caller only in the bits of ``mask``."""

    @device_function
    def reduce(x):
        o = 1
        while o < 32:
            if mask & o:
                y = cuda.shfl_xor_sync(FULL_MASK, x, o)
                x = max(x, y) if op_max else x + y
            o *= 2
        return x
    return reduce


def warp_merger(num_warps, hpb, head_size, vec, vpl, lpr, from_f32, put_row=None, store=None):
    """Device function ``merge(out, lse, seq, part, h0, warp, tid, g, lane_r, acc,
    m_s, l_s, acc_s)``: the decode kernels' epilogue. Each warp holds its own
    softmax state for the ``hpb`` query heads from ``h0``: ``m_s[warp, hh]``,
    ``l_s[warp, hh]`` (base 2, written before the call) and, in lane ``g *
    lpr + lane_r``, the partial output ``acc[hh, i * vec + e]`` of elements
    ``(lane_r + i * lpr) * vec + e`` for the ``lpr``-lane token group ``g``.
    It sums the token groups with shuffles and merges the warps with the (m, l)
    rule through ``acc_s [num_warps, head_size]`` float32 shared memory, then
    writes ``out[seq, part, h0 + hh, :]`` (through ``from_f32``) and the
    natural-log ``lse[seq, part, h0 + hh]`` (``-inf`` when no key was seen,
    NaN with the output when some warp's ``l`` is NaN).

    ``put_row(acc_s, warp, hh, g, lane_r, acc, f)``, when given, replaces the
    token-group sums and the store of ``f`` times head ``hh``'s row into
    ``acc_s[warp]``, for partial outputs held in another layout.

    ``store(out, seq, part, head, d, x)``, when given, replaces the store of
    float32 ``x`` as ``out[seq, part, head, d] = from_f32(x)``, for an output
    whose element type the kernel learns from the array."""
    NW, HPB, D, VEC, VPL, LPR = num_warps, hpb, head_size, vec, vpl, lpr
    NVEC = D // VEC
    NT = 32 * NW
    ACC = VPL * VEC
    group_sum = lane_reducer(31 & ~(LPR - 1), False)
    OWN_ROWS = put_row is not None
    if store is None:
        @device_function
        def store(out, seq, part, head, d, x):
            out[seq, part, head, d] = from_f32(x)

    @device_function
    def merge(out, lse, seq, part, h0, warp, tid, g, lane_r, acc, m_s, l_s, acc_s):
        if not OWN_ROWS:
            for hh in range(HPB):
                for j in range(ACC):
                    acc[hh, j] = group_sum(acc[hh, j])
        cuda.syncthreads()  # wait for every warp's (m, l)
        for hh in range(HPB):
            mx = NEG_INF
            for w in range(NW):
                mx = max(mx, m_s[w, hh])
            # subtract 0 when no warp has a finite maximum: a warp that saw no key
            # (m = -inf, l = 0) adds 0, one that saw only NaN logits (l = NaN) adds NaN
            m_use = mx if mx != NEG_INF else float32(0.0)
            total = float32(0.0)
            for w in range(NW):
                total += l_s[w, hh] * math.exp2(m_s[w, hh] - m_use)
            f = float32(0.0)
            if total != 0.0:            # and NaN: NaN logits make the row NaN
                f = math.exp2(m_s[warp, hh] - m_use) / total
            if OWN_ROWS:
                put_row(acc_s, warp, hh, g, lane_r, acc, f)
            elif g == 0:
                for i in range(VPL):
                    v = lane_r + i * LPR
                    if v < NVEC:
                        for e in range(VEC):
                            acc_s[warp, v * VEC + e] = acc[hh, i * VEC + e] * f
            cuda.syncthreads()  # wait for every warp's weighted row
            for d in range(tid, D, NT):
                o = float32(0.0)
                for w in range(NW):
                    o += acc_s[w, d]
                store(out, seq, part, h0 + hh, d, o)
            if tid == 0:
                if total != 0.0:
                    lse[seq, part, h0 + hh] = (mx + math.log2(total)) * float32(LN2)
                else:
                    lse[seq, part, h0 + hh] = NEG_INF
            cuda.syncthreads()  # acc_s is free for the next head

    return merge
