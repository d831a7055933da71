"""The logits of the tensor-core prefill tile: the scale, the variants (soft
cap, ALiBi) and the masks, on a tile's score fragments in registers; the part
of :func:`kernels.prefill_tc_parts.tile_parts` between ``S = Q K^T`` and the
online softmax.

:func:`logit_parts` takes the namespace of one tile specialisation (its
constants ``MT``, ``NTILE_S``, ``BN`` and ``LEAN``) and returns the device
functions; the fragment conventions are those of :mod:`.prefill_tc_parts`
(lane ``(r, c)`` holds, in n-tile ``i``, keys ``kt + 8 i + 2 c`` and ``+ 1``
of rows ``r`` and ``r + 8``).
"""
import math
from types import SimpleNamespace

from numba import float32, int32

from .access import device_function
from .prefill_tc_io import NEG_INF, cuda_function

NO_LOWER_BOUND = -(2 ** 31)   # no window: no lower bound on the keys a row admits


def logit_parts(P):
    """Device functions that turn a tile's scores into base-2 logits for the
    tile of namespace ``P``."""
    MT, NTILE_S, BN, LEAN = P.MT, P.NTILE_S, P.BN, P.LEAN

    @device_function
    def logits(s, pos, slope, kt, c, pos0, nq, kv_hi, causal, window, qscale, soft_cap, cap2,
               alibi, plain):
        """The tile's logits in base 2 with the variants, and the mask where the
        tile needs one (the causal diagonal, the window's edge, the context's end)."""
        masked = (kt + BN > kv_hi or (causal != 0 and kt + BN - 1 > pos0)
                  or (window > 0 and pos0 + nq - 1 - kt >= window))
        if not plain:
            scale_logits(s, qscale)
        if soft_cap > 0.0:
            cap_logits(s, cap2)
        if alibi:
            alibi_logits(s, pos, slope, kt, c)
        if masked:
            apply_mask(s, pos, kt, c, kv_hi, causal, window)

    @device_function
    def scale_logits(s, qscale):
        """The tile's scores times ``qscale`` (the scale in base 2)."""
        for t in range(MT):
            for i in range(NTILE_S):
                for e in range(4):
                    s[t, i, e] *= qscale

    @device_function
    def cap_logits(s, cap2):
        """The soft cap ``cap2 tanh(x / cap2)`` (base 2) on the tile's logits."""
        for t in range(MT):
            for i in range(NTILE_S):
                for e in range(4):
                    s[t, i, e] = cap2 * math.tanh(s[t, i, e] / cap2)

    @device_function
    def alibi_logits(s, pos, slope, kt, c):
        """ALiBi's ``slope * (key - query)`` added to the tile's logits."""
        for t in range(MT):
            for i in range(NTILE_S):      # distances in int32, exact in fp32
                for h in range(2):
                    d0 = float32(int32(kt + 8 * i + 2 * c - pos[t, h]))
                    s[t, i, 2 * h] += slope[t, h] * d0
                    s[t, i, 2 * h + 1] += slope[t, h] * (d0 + float32(1.0))

    @device_function
    def apply_mask(s, pos, kt, c, kv_hi, causal, window):
        """-inf for the keys each row of the tile does not admit."""
        for t in range(MT):
            for h in range(2):
                # row (t, h) admits keys lo <= k < hi: below the context's end, at
                # or before its position (causal), within the window
                p = pos[t, h]
                hi = int32(min(kv_hi, p + 1) if causal != 0 else kv_hi)
                lo = int32(p - window + 1 if window > 0 else NO_LOWER_BOUND)
                for i in range(NTILE_S):
                    k = int32(kt + 8 * i + 2 * c)
                    # LEAN: k + 1 alone is int64, its compares 64-bit
                    if LEAN:
                        k1 = int32(k + 1)
                    else:
                        k1 = k + 1
                    if k < lo or k >= hi:
                        s[t, i, 2 * h] = NEG_INF
                    if k1 < lo or k1 >= hi:
                        s[t, i, 2 * h + 1] = NEG_INF

    @cuda_function
    def mask_limits(pos0, nq, kv_hi, causal, window):
        """(``LEAN`` key loops) ``(lo, hi)``: the tile at keys ``kt ..`` needs a
        mask (the causal diagonal, the window's edge, the context's end)
        exactly when ``kt <= lo`` or ``kt > hi`` (``kt >= 0``). Computed once
        an item, so that each tile takes two compares; in int32 (positions are
        far below 2**31), where Numba's int64 arithmetic gave chains of 64-bit
        uniform compares."""
        hi = int32(kv_hi - BN)                          # kt + BN - 1 >= kv_hi
        if causal != 0:                                 # kt + BN - 1 > pos0
            hi = int32(min(hi, int32(pos0 - (BN - 1))))
        lo = int32(NO_LOWER_BOUND)                      # (kt <= lo: never)
        if window > 0:                                  # pos0 + nq - 1 - kt >= window
            lo = int32(pos0 + nq - 1 - window)
        return lo, hi

    @device_function
    def logits_masked(s, pos, slope, kt, c, kv_hi, causal, window, qscale, soft_cap, cap2,
                      alibi, plain, masked):
        """(``LEAN`` key loops) :func:`logits` with the tile's mask decided by
        the caller (from :func:`mask_limits`, before the scores land). ``plain``
        (see :func:`exponent_scale`) means no soft cap and no ALiBi too, so one
        branch skips all three variants."""
        if not plain:
            scale_logits(s, qscale)
            if soft_cap > 0.0:
                cap_logits(s, cap2)
            if alibi:
                alibi_logits(s, pos, slope, kt, c)
        if masked:
            apply_mask(s, pos, kt, c, kv_hi, causal, window)

    return SimpleNamespace(logits=logits, scale_logits=scale_logits, cap_logits=cap_logits,
                           alibi_logits=alibi_logits, apply_mask=apply_mask,
                           mask_limits=mask_limits, logits_masked=logits_masked)
