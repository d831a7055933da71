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
only empty states gets zeros and ``-inf``.

``v`` is read and ``out`` written through ``codec`` (``convert.py``), so either
may hold bfloat16 bit patterns (``uint16``).
"""
import functools
import math

from numba import cuda, float32

from .convert import codec

NEG_INF = float32(-math.inf)


@functools.cache
def merge_kernel(out_dtype="float32", v_dtype="float32", num_threads=128):
    """Kernel ``(out, lse_out, v, s)``: ``v [n, S, H, D]``, ``s [n, S, H]`` float32,
    ``out [n, H, D]``, ``lse_out [n, H]`` float32. Grid ``(H, n)``, ``num_threads``.

    ``out_dtype`` and ``v_dtype`` name the storage dtypes (``"float16"``,
    ``"float32"``, ``"bfloat16"``); float16 and float32 share one conversion
    (numba's own), so the defaults serve any mix of the two."""
    NT = num_threads
    v_to_f32, _ = codec(v_dtype)
    _, out_from_f32 = codec(out_dtype)

    @cuda.jit
    def merge_states_kernel(out, lse_out, v, s):
        h = cuda.blockIdx.x
        i = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        num_states = s.shape[1]
        head_size = v.shape[3]
        # every thread scans the (few) log-sum-exps: a broadcast read
        mx = NEG_INF
        for k in range(num_states):
            mx = max(mx, float32(s[i, k, h]))
        total = float32(0.0)
        if mx != NEG_INF:
            for k in range(num_states):
                total += math.exp(float32(s[i, k, h]) - mx)
        inv = float32(0.0)
        if total > 0.0:
            inv = float32(1.0) / total
        for d in range(tid, head_size, NT):
            acc = float32(0.0)
            if mx != NEG_INF:
                for k in range(num_states):
                    w = math.exp(float32(s[i, k, h]) - mx)
                    acc += w * v_to_f32(v[i, k, h, d])
            out[i, h, d] = out_from_f32(acc * inv)
        if tid == 0:
            if total > 0.0:
                lse_out[i, h] = mx + math.log(total)
            else:
                lse_out[i, h] = NEG_INF

    return merge_states_kernel
