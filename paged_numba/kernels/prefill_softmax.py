"""The online softmax of the tensor-core prefill tile: row maxima, weights,
row sums and the rescale of O, on a tile's logits in registers; the part of
:func:`kernels.prefill_tc_parts.tile_parts` between the logits
(:mod:`.prefill_logits`) and ``P V``.

:func:`softmax_parts` takes the namespace of one tile specialisation (its
constants ``NTILE_S``, ``NTILE_O``, ``PV_STEPS``, ``LEAN``, ``LAZY``,
``VOTE``, ``FMA_EVERY``, ``EARLY``, ``WSLOT``, ``STAGED`` and ``PB``, its
``exp2``, ``quad_max`` and ``pack``) and returns the device functions; the
fragment conventions are those of :mod:`.prefill_tc_parts` (lane ``(r, c)``
holds, in n-tile ``i``, keys ``kt + 8 i + 2 c`` and ``+ 1`` of rows ``r``
and ``r + 8``: row half ``h`` is row ``r + 8 h``). The logits of m-tile
``t`` are ``s[t]``; the weights go to ``s[t + WSLOT]`` (``WSLOT`` 0: in
place; 1 with ``early_weights``, whose weights are taken while the logits
are still needed).
"""
from types import SimpleNamespace

from numba import cuda, float32

from .access import device_function
from .fastmath import exp2_fma, fma
from .prefill_tc_io import NEG_INF, cuda_function
from .warp_reduce import FULL_MASK

# lazy_rescale: a row's running maximum (in the exponent's base-2 units) moves
# only when the tile's maximum exceeds it by more than this, so the weights stay
# below 2**RESCALE_SLACK (256: exact in fp16 and bf16, far from their overflow)
RESCALE_SLACK = 8.0


def softmax_parts(P):
    """Device functions of the online softmax for the tile of namespace ``P``."""
    NTILE_S, NTILE_O, LEAN, LAZY, VOTE, FMA_EVERY = (P.NTILE_S, P.NTILE_O, P.LEAN, P.LAZY,
                                                     P.VOTE, P.FMA_EVERY)
    EARLY, WSLOT, STAGED, PB, PV_STEPS = P.EARLY, P.WSLOT, P.STAGED, P.PB, P.PV_STEPS
    exp2, quad_max, pack = P.exp2, P.quad_max, P.pack

    @device_function
    def exponent_scale(fold, qscale, soft_cap, alibi):
        """``(plain, sc)``: with ``fold`` and no soft cap or ALiBi (and a positive
        scale) the logits stay unscaled, the maxima too, and ``sc = qscale``
        scales them in the exponent's FFMA; else they are scaled first and
        ``sc`` is 1."""
        plain = fold and soft_cap <= 0.0 and not alibi and qscale > 0.0
        return plain, (qscale if plain else float32(1.0))

    @device_function
    def lane_max(s, t, h):
        """This lane's own largest logit of row half ``h`` of m-tile ``t`` (no
        exchange within the quad): its pairs go round-robin into two
        independent maxima (half the dependent steps). ``LEAN``: they start
        from the first two pairs, not from -inf (a seed costs an instruction
        each and changes no result: ``max.f32`` passes over NaN)."""
        if LEAN:
            a = max(s[t, 0, 2 * h], s[t, 0, 2 * h + 1])
            b = max(s[t, 1, 2 * h], s[t, 1, 2 * h + 1])
            first = 2
        else:
            a = NEG_INF
            b = NEG_INF
            first = 0
        for i in range(first, NTILE_S, 2):
            a = max(a, max(s[t, i, 2 * h], s[t, i, 2 * h + 1]))
            b = max(b, max(s[t, i + 1, 2 * h], s[t, i + 1, 2 * h + 1]))
        return max(a, b)

    @device_function
    def row_max(s, m, t, h):
        """The running maximum of row half ``h`` of m-tile ``t`` with this tile's
        logits: the lanes' own (:func:`lane_max`) over the quad of lanes that
        share the row, then the running maximum (never NaN) last."""
        return max(m[t, h], quad_max(lane_max(s, t, h)))

    @device_function
    def exp_into(s, sc, use, t, h):
        """Logits of row half ``h`` of m-tile ``t`` -> weights ``exp2(x sc - use
        sc)``, one FMA and one exp2 each, into slot ``t + WSLOT`` (in place
        without ``early_weights``); returns their sum (two partial sums), the
        lane's share of the row sum. ``LEAN``: the sums start from the first two
        pairs, not from 0 (a weight is +0 or more, or NaN, so ``0 + x`` is
        ``x``)."""
        sub = -use * sc
        w = t + WSLOT
        a = float32(0.0)                  # two independent partial sums
        b = float32(0.0)
        for i in range(NTILE_S):
            # one explicit FMA each: the early weights' products x sc would
            # otherwise be shared with the later ones' (a multiply, then an add)
            x0 = fma(s[t, i, 2 * h], sc, sub)
            x1 = fma(s[t, i, 2 * h + 1], sc, sub)
            if FMA_EVERY and i % FMA_EVERY == FMA_EVERY - 1:     # on the FMA pipe
                s[w, i, 2 * h] = exp2_fma(x0)
                s[w, i, 2 * h + 1] = exp2_fma(x1)
            else:
                s[w, i, 2 * h] = exp2(x0)
                s[w, i, 2 * h + 1] = exp2(x1)
            if LEAN and i == 0:
                a = s[w, i, 2 * h] + s[w, i, 2 * h + 1]
            elif LEAN and i == 1:
                b = s[w, i, 2 * h] + s[w, i, 2 * h + 1]
            elif i % 2 == 0:
                a += s[w, i, 2 * h] + s[w, i, 2 * h + 1]
            else:
                b += s[w, i, 2 * h] + s[w, i, 2 * h + 1]
        return a + b

    @device_function
    def exp_weights(s, l_, sc, use, t, h):
        """:func:`exp_into`, its sum added to the row sum ``l_[t, h]``."""
        l_[t, h] += exp_into(s, sc, use, t, h)

    @cuda_function
    def softmax_half(s, o, m, l_, sc, t, h):
        """Online softmax of row half ``h`` of m-tile ``t`` (this lane's row ``16 t
        + r + 8 h`` of the warp, logits ``s[t, :, 2 h:2 h + 2]``): the row maximum
        over the quad, the rescale of O and the row sum where it grew (a warp
        vote), then one FFMA and one exp2 a weight, summed into the lane's share."""
        new = row_max(s, m, t, h)
        use = new if new != NEG_INF else float32(0.0)
        if cuda.any_sync(FULL_MASK, new > m[t, h]):
            alpha = exp2((m[t, h] - use) * sc)
            l_[t, h] *= alpha
            for i in range(NTILE_O):
                o[t, i, 2 * h] *= alpha
                o[t, i, 2 * h + 1] *= alpha
        m[t, h] = new
        exp_weights(s, l_, sc, use, t, h)

    @device_function
    def move_max(s, m, l_, alpha, sc, t, h):
        """The running maximum of row half ``h`` of m-tile ``t`` with this
        tile's logits; where it moves, the factor O must be scaled by goes to
        ``alpha[t, h]`` (else 1) and the row sum is scaled by it. With
        ``lazy_rescale`` it moves only when the tile's maximum exceeds it by
        more than ``RESCALE_SLACK``. Returns the maximum before."""
        new = row_max(s, m, t, h)
        old = m[t, h]
        alpha[t, h] = float32(1.0)
        if new > old:
            # a first maximum (old = -inf) always moves: (new - old) sc = inf
            if not LAZY or (new - old) * sc > float32(RESCALE_SLACK):
                alpha[t, h] = exp2((old - new) * sc)
                l_[t, h] *= alpha[t, h]
                m[t, h] = new
        else:
            m[t, h] = new               # the same, or NaN (which the weights carry)
        return old

    @device_function
    def weights_half(s, m, l_, alpha, sc, t, h):
        """:func:`softmax_half` without touching O: the factor O must be scaled by
        goes to ``alpha[t, h]`` (1 where the row's maximum did not move), for
        :func:`rescale_half` once the product that writes O has landed. With
        ``lazy_rescale`` the maximum moves only when the tile's exceeds it by
        more than ``RESCALE_SLACK``: the weights, up to ``2**RESCALE_SLACK``,
        and the row sum are relative to the kept maximum, as O is, so most
        tiles after the first leave ``alpha`` at 1 and O unscaled (the warp
        vote in :func:`rescale_half` skips the multiplies)."""
        move_max(s, m, l_, alpha, sc, t, h)
        use = m[t, h] if m[t, h] != NEG_INF else float32(0.0)
        exp_weights(s, l_, sc, use, t, h)

    @device_function
    def weights_half_early(s, m, l_, alpha, sc, t, h, early):
        """:func:`weights_half` after the early weights (``early_weights``):
        where the row's maximum stays (within the lazy slack) the weights in
        slot ``t + WSLOT`` are already those :func:`weights_half` takes (the
        same expressions) and their sum ``early`` is added; where it moves (or
        turns NaN), or the row has none yet, they are taken again from the
        logits. The early weights thus stand on both sides of
        the vote, and no compiler moves them after it."""
        old = move_max(s, m, l_, alpha, sc, t, h)
        if m[t, h] == old and old != NEG_INF:
            l_[t, h] += early
        else:       # (a first tile's early weights, against -inf, go unused)
            exp_weights(s, l_, sc, m[t, h] if m[t, h] != NEG_INF else float32(0.0), t, h)

    @device_function
    def beyond(lane, m, sc):
        """Whether a lane's own maximum ``lane`` may move its row's maximum
        ``m`` (a finite one): beyond ``RESCALE_SLACK`` of it with
        ``lazy_rescale`` (the expression :func:`weights_half` evaluates for the
        row's maximum over the quad), above it without."""
        if LAZY:
            return (lane - m) * sc > float32(RESCALE_SLACK)
        return lane > m

    @device_function
    def pack_weights(pa, s, row):
        """The weights (slot ``WSLOT`` of ``s``, one m-tile a warp) rounded to
        the cache dtype as the A words of ``P V``, into rows ``row ..`` of
        ``pa``."""
        for ks in range(PV_STEPS):
            pa[row + ks, 0] = pack(s[WSLOT, 2 * ks, 0], s[WSLOT, 2 * ks, 1])
            pa[row + ks, 1] = pack(s[WSLOT, 2 * ks, 2], s[WSLOT, 2 * ks, 3])
            pa[row + ks, 2] = pack(s[WSLOT, 2 * ks + 1, 0], s[WSLOT, 2 * ks + 1, 1])
            pa[row + ks, 3] = pack(s[WSLOT, 2 * ks + 1, 2], s[WSLOT, 2 * ks + 1, 3])

    @device_function
    def tile_weights_rows(s, m, l_, alpha, sc, t, pa):
        """:func:`weights_half` of both row halves of m-tile ``t``. With
        ``lane_vote`` a warp first votes on its lanes' own maxima: where none
        may move its row's maximum (:func:`beyond`), the row's maximum over the
        quad may not either, since the test is monotone in the maximum; so no
        row's maximum moves, and the weights are taken against the kept ones at
        once, with no exchange of maxima between the quad's lanes (two
        dependent shuffles a half) before the exponentials: the same values as
        without the vote, bit for bit. A warp where any lane may move a
        maximum, or any row has none yet, takes :func:`weights_half`.
        ``early_weights``: the weights against the kept maxima are taken
        before the vote, beside the lanes' maxima (off the chain of maxima,
        vote and exponentials), into slot ``t + WSLOT``; the vote keeps them,
        or :func:`weights_half_early` keeps those of the rows whose maxima
        stay. ``staged_p``: each way ends by packing the weights into P's
        staging rows of ``pa`` (:func:`pack_weights`), beside their last
        exponentials."""
        if VOTE:
            m0 = m[t, 0]
            m1 = m[t, 1]
            # a row without a maximum is far whatever its lanes hold; 0 stands
            # in for its -inf in the test, so that -inf - -inf makes no NaN
            u0 = m0 if m0 != NEG_INF else float32(0.0)
            u1 = m1 if m1 != NEG_INF else float32(0.0)
            if EARLY:
                # the weights against the kept maxima, before the vote says
                # whether they stand (a row without a maximum fails it: its
                # weights against 0 are dropped)
                e0 = exp_into(s, sc, u0, t, 0)
                e1 = exp_into(s, sc, u1, t, 1)
            far = (beyond(lane_max(s, t, 0), u0, sc) | beyond(lane_max(s, t, 1), u1, sc)
                   | (m0 == NEG_INF) | (m1 == NEG_INF))
            if not cuda.any_sync(FULL_MASK, far):
                alpha[t, 0] = float32(1.0)
                alpha[t, 1] = float32(1.0)
                if EARLY:
                    l_[t, 0] += e0
                    l_[t, 1] += e1
                else:
                    exp_weights(s, l_, sc, m0, t, 0)
                    exp_weights(s, l_, sc, m1, t, 1)
                if STAGED:
                    pack_weights(pa, s, PB)
                return
            if EARLY:
                weights_half_early(s, m, l_, alpha, sc, t, 0, e0)
                weights_half_early(s, m, l_, alpha, sc, t, 1, e1)
                if STAGED:
                    pack_weights(pa, s, PB)
                return
        weights_half(s, m, l_, alpha, sc, t, 0)
        weights_half(s, m, l_, alpha, sc, t, 1)
        if STAGED:
            pack_weights(pa, s, PB)

    @cuda_function
    def rescale_half(o, alpha, t, h):
        """``O *= alpha`` for row half ``h`` of m-tile ``t``, where any row of the
        warp grew (a warp vote)."""
        if cuda.any_sync(FULL_MASK, alpha[t, h] != 1.0):
            for i in range(NTILE_O):
                o[t, i, 2 * h] *= alpha[t, h]
                o[t, i, 2 * h + 1] *= alpha[t, h]

    taken = ("P", "NTILE_S", "NTILE_O", "LEAN", "LAZY", "VOTE", "FMA_EVERY", "exp2", "quad_max",
             "EARLY", "WSLOT", "STAGED", "PB", "PV_STEPS", "pack")
    return SimpleNamespace(**{k: v for k, v in locals().items()
                              if not k.startswith("__") and k not in taken + ("taken",)})
