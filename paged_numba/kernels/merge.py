"""Merge partial attention states with the (m, l) rule.

NumPy spec, for one row ``i`` and head ``h`` with states ``k = 0..S-1``
(each a partial output ``v[i, k, h]`` normalised by its own exp-sum, and its
log-sum-exp ``s[i, k, h] = m_k + log(l_k)``)::

    M = max_k s[i, k, h]                     # -inf when every state is empty
    w_k = exp(s[i, k, h] - M)                # = l_k * exp(m_k - M) / exp(M - M)
    out[i, h] = sum_k w_k * v[i, k, h] / sum_k w_k
    lse_out[i, h] = M + log(sum_k w_k)

which is ``m = max(m1, m2)``, ``l = l1 e^(m1 - m) + l2 e^(m2 - m)`` applied
to all states at once. Empty states (``s = -inf``) weigh nothing; a row with
only empty states gets zeros and ``-inf``. Non-finite log-sum-exps follow the
float64 spec (``numpy.max`` propagates NaN): a NaN state, or a ``+inf`` one
(``exp(inf - inf)`` is NaN), makes the row's output and log-sum-exp NaN; a
NaN in ``v[i, k, h, d]`` makes ``out[i, h, d]`` NaN, even where state ``k``
is empty (its weight is 0, and ``0 * NaN`` is NaN, as in the float64
spec): an empty state's ``v`` must be finite (zeros,
as the split-K kernels write), not an unwritten buffer, unless every state
of the row is empty (then nothing is read).

``v`` is read and ``out`` written through ``codec`` (``convert.py``), so either
may hold bfloat16 bit patterns (``uint16``).
"""
import functools
import math

from numba import cuda, float32

from .convert import codec, device_jit
from .decode import FULL_MASK, NEG_INF
from .pdl import wait_for_primary

UNROLL = 8       # partial outputs loaded per thread before their sum is taken


@device_jit
def fold_states(s, i, h, lane, num_states):
    """``(m, total)`` of row ``i``, head ``h`` over its ``num_states``
    log-sum-exps ``s[i, :, h]`` with the (m, l) rule, for a whole warp: each
    lane folds states ``lane, lane + 32, ...``, then a butterfly of shuffles
    combines the lanes, and every lane returns the row's maximum and lane 0's
    sum (the lanes may round differently). Shared by the merge kernel and the
    merges inside attention kernels (:mod:`.merge_tail`), which must give the
    same bits."""
    m = NEG_INF
    total = float32(0.0)
    # m is never NaN (a NaN state fails x > m): NaN travels in total instead
    for k in range(lane, num_states, 32):
        x = float32(s[i, k, h])
        if x > m:
            # the new maximum's own weight exp(x - x): 1, or NaN for x = +inf
            total = total * math.exp(m - x) + (x - x + float32(1.0))
            m = x
        elif x != NEG_INF:
            total += math.exp(x - m)         # NaN for a NaN state
    for o in (16, 8, 4, 2, 1):
        m2 = cuda.shfl_xor_sync(FULL_MASK, m, o)
        t2 = cuda.shfl_xor_sync(FULL_MASK, total, o)
        mn = max(m, m2)
        mu = mn if mn != NEG_INF else float32(0.0)    # empty lanes add 0 (or their NaN)
        total = total * math.exp(m - mu) + t2 * math.exp(m2 - mu)
        m = mn
    return m, cuda.shfl_sync(FULL_MASK, total, 0)


@functools.cache
def merge_kernel(out_dtype="float32", v_dtype="float32", num_threads=128, pdl=False):
    """Kernel ``(out, lse_out, v, s)``: ``v [n, S, H, D]``, ``s [n, S, H]`` float32,
    ``out [n, H, D]``, ``lse_out [n, H]`` float32. Grid ``(H, n)``,
    ``num_threads`` (a multiple of 32).

    Each warp folds the ``S`` log-sum-exps with the (m, l) rule, one state per
    lane and then a butterfly of shuffles, so finding the weights costs one
    round of loads rather than ``S``. Lane ``k`` then holds the weight of state
    ``k`` of each run of 32, and every thread (one output element ``d``)
    takes the weights by shuffle while it loads ``UNROLL`` partial outputs at
    a time, so that the loads are in flight together.

    ``out_dtype`` and ``v_dtype`` name the storage dtypes (``"float16"``,
    ``"float32"``, ``"bfloat16"``); float16 and float32 share one conversion
    (numba's own), so the defaults serve any mix of the two. ``pdl``: each
    block first waits for the kernel it was launched after to finish
    (:mod:`.pdl`), for a launch that lets it start early."""
    NT = num_threads
    PDL = bool(pdl)
    assert NT % 32 == 0
    v_to_f32, _ = codec(v_dtype)
    _, out_from_f32 = codec(out_dtype)

    @cuda.jit
    def merge_states_kernel(out, lse_out, v, s):
        if PDL:
            wait_for_primary()
        h = cuda.blockIdx.x
        i = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        lane = tid % 32
        num_states = s.shape[1]
        head_size = v.shape[3]
        m, total = fold_states(s, i, h, lane, num_states)
        mu = m if m != NEG_INF else float32(0.0)
        inv = float32(0.0)
        if total != 0.0:                         # and NaN
            inv = float32(1.0) / total
        for d0 in range(0, head_size, NT):
            d = min(d0 + tid, head_size - 1)     # spare lanes load a valid element, store nothing
            acc = float32(0.0)
            if total != 0.0:                     # not a row of empty states only
                for k0 in range(0, num_states, 32):
                    w = float32(0.0)
                    if k0 + lane < num_states:
                        w = math.exp(float32(s[i, k0 + lane, h]) - mu) * inv
                    run = min(32, num_states - k0)
                    j = 0
                    while j + UNROLL <= run:
                        for u in range(UNROLL):
                            acc += (cuda.shfl_sync(FULL_MASK, w, j + u)
                                    * v_to_f32(v[i, k0 + j + u, h, d]))
                        j += UNROLL
                    while j < run:
                        acc += cuda.shfl_sync(FULL_MASK, w, j) * v_to_f32(v[i, k0 + j, h, d])
                        j += 1
            if d0 + tid < head_size:
                out[i, h, d] = out_from_f32(acc)
        if tid == 0:
            if total != 0.0:
                lse_out[i, h] = m + math.log(total)
            else:
                lse_out[i, h] = NEG_INF

    return merge_states_kernel
