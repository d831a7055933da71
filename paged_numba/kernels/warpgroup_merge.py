"""Two consumer warpgroups' online-softmax states of the same query rows,
merged in shared memory (the ``alternate_tiles`` option of
:func:`kernels.prefill_wgmma_ws.prefill_wgmma_ws_kernel`, where the two take
every other K/V tile of an item).

Both warpgroups hold their 64 rows in the ``wgmma`` accumulator layout, so
thread ``t`` of one holds the same rows and columns as thread ``t`` of the
other: warpgroup 1 writes its running maxima ``m``, sums ``l`` and output
``O`` (not yet divided by ``l``) as they are, and warpgroup 0 rescales both
to the larger maximum and adds::

    m = max(m0, m1)
    O = O0 exp2((m0 - m) sc) + O1 exp2((m1 - m) sc)      (likewise l)

with ``sc`` the exponent's scale (:func:`kernels.prefill_tc_parts.tile_parts`'
``exponent_scale``). A row neither saw (both maxima -inf) keeps zeros; a NaN
in either state reaches the output.
"""
import math

from numba import float32

from .access import device_function
from .decode import NEG_INF


def scratch_words(ntile_o):
    """Float32 words of shared memory the hand-over takes: ``4 ntile_o + 4``
    values a thread of a warpgroup.

    >>> scratch_words(16)
    8704
    """
    return 128 * (4 * ntile_o + 4)


def pair_merge_parts(ntile_o, at, sync, barrier):
    """``merge_pair(o, m, l_, fwords, wg, t, sc)``: warpgroup ``wg`` (0 or 1),
    thread ``t`` of its 128, with ``o [1, ntile_o, 4]``, ``m`` and ``l_ [1,
    2]``; the scratch is ``fwords[at : at + scratch_words(ntile_o)]``, and
    ``sync(barrier)`` a named barrier of the two warpgroups' 256 threads.
    Afterwards warpgroup 0 holds the merged state; warpgroup 1's is spent.
    The scratch is free again once warpgroup 0 has returned."""
    NO = int(ntile_o)
    AT = int(at)
    BAR = int(barrier)
    M_AT = AT + 4 * NO * 128
    L_AT = M_AT + 2 * 128

    @device_function
    def merge_pair(o, m, l_, fwords, wg, t, sc):
        if wg == 1:
            for i in range(NO):
                for e in range(4):
                    fwords[AT + (4 * i + e) * 128 + t] = o[0, i, e]
            for h in range(2):
                fwords[M_AT + h * 128 + t] = m[0, h]
                fwords[L_AT + h * 128 + t] = l_[0, h]
        sync(BAR)
        if wg == 0:
            for h in range(2):
                m0 = m[0, h]
                m1 = fwords[M_AT + h * 128 + t]
                mx = max(m0, m1)
                a0 = float32(1.0)
                a1 = float32(1.0)
                if mx != NEG_INF:
                    a0 = math.exp2((m0 - mx) * sc)
                    a1 = math.exp2((m1 - mx) * sc)
                m[0, h] = mx
                l_[0, h] = l_[0, h] * a0 + fwords[L_AT + h * 128 + t] * a1
                for i in range(NO):
                    for e in range(2 * h, 2 * h + 2):
                        o[0, i, e] = o[0, i, e] * a0 + fwords[AT + (4 * i + e) * 128 + t] * a1

    return merge_pair
