"""The consumers' key loop of the warpgroup prefill kernels
(:func:`kernels.prefill_wgmma.prefill_wgmma_kernel` and
:func:`kernels.prefill_wgmma_ws.prefill_wgmma_ws_kernel`).

:func:`key_loop` builds a warpgroup's software-pipelined loop over a tile's
key tiles from the products of :func:`kernels.prefill_wgmma.product_parts`:
iteration ``j`` issues ``S_j = Q K_j^T`` and ``O += P_{j-1} V_{j-1}`` back to
back and computes tile ``j``'s softmax while ``P V`` still runs. It returns
one of two loops:

* ``run``: the tiles counted by Numba's 64-bit loop index, each tile's mask
  decided with its logits;
* ``run_lean`` (``lean=True``, the tile of ``tile_parts(lean=True)``):
  32-bit counters, each tile's mask decided from ``mask_limits`` before its
  scores land.

The kernel brings the hooks: ``acquire`` and ``release`` of a tile's stage
(the block's barrier and the next tile's copies in the ``wgmma`` kernel, the
full and empty barriers of :mod:`kernels.prefill_ring` in the producer
kernel), and ``take_turn`` and ``pass_turn`` around each issue of products,
for warpgroups that take turns.
Separate K and V rings (:mod:`kernels.prefill_split_ring`, lean loop only)
come as ``split``, whose ``acquire`` and ``release`` take the ring: iteration
``j`` waits for ``K_j`` and ``V_{j-1}``, hands ``K_j`` back once ``S_j`` has
landed and ``V_{j-1}`` once ``P_{j-1} V_{j-1}`` has.
"""
from numba import cuda, float32, int32, int64, uint32

from .access import device_function
from .prefill_tc_parts import FULL_MASK, cuda_function
from .timeline import LOOP_PHASES, LOOP_START

# the loop clocks' steps (timeline="loop"), in loop order
(ACQUIRE, TURN, ISSUE_S, ISSUE_PV, SCORES, SOFTMAX, PV, PACK) = range(len(LOOP_PHASES))


@device_function
def _no_turn(a):
    """No turns: the warpgroups issue their products when they are ready."""


@device_function
def _no_pass(last, a):
    """No turns to pass on."""


@device_function
def _no_tick(k, a):
    """No loop clocks."""


def key_loop(P, W, stages, acquire, release, take_turn=_no_turn, pass_turn=_no_pass,
             lean=False, split=None, step=1, tick=None):
    """The software-pipelined loop over a tile's key tiles, shared by both
    warpgroup kernels: prologue ``S_0``; steady state ``j``: ``S_j`` with
    ``P_{j-1} V_{j-1}`` in flight; epilogue ``P_{n-1} V_{n-1}`` (no branch
    between a product's issue and its wait). ``acquire(j, ntiles, a)`` makes
    tile ``j``'s stage (of ``stages``) readable, ``release(j, ntiles, a)`` hands
    it back once its products are done; ``a`` is the kernel's tuple for them.
    ``take_turn(a)`` and ``pass_turn(last, a)`` bracket each issue of products
    (``last``: the loop's final one), for warpgroups that take turns. The
    tiles are counted from ``j0`` (the ring's count of the block's earlier
    tiles: stage ``(j0 + j) % stages``) and the last one is released too.
    ``lean`` (with ``P`` from ``tile_parts(lean=True)``): the same loop with
    32-bit counters and each tile's mask decided before its scores land.

    ``step`` 2 (``stages`` even): the warpgroup takes every other tile,
    ``first, first + 2, ...`` (``first`` an argument after ``j0``, 0 or 1),
    so that two warpgroups with the same query rows share an item's tiles,
    each with a softmax of its own; a stage's tiles then always go to the
    same warpgroup. ``ntiles`` still counts all of them.

    ``split`` (lean only): the barriers of separate K and V rings
    (:func:`kernels.prefill_split_ring.split_ring_parts`; ``acquire`` and
    ``release`` are unused, the turns are theirs): iteration ``j``
    acquires ``K_j`` and ``V_{j-1}``, releases ``K_j`` as soon as ``S_j``
    has landed and ``V_{j-1}`` once ``P_{j-1} V_{j-1}`` has; ``W`` from
    ``product_parts(P, split_rings=True)``.

    ``tick(k, a)`` (lean only; the kernel's ``timeline="loop"``,
    :mod:`kernels.timeline`) is called once before the steady-state tiles
    (``k = LOOP_START``) and after each step ``k`` of
    :data:`kernels.timeline.LOOP_PHASES` of each of them, to sum the cycles of
    each step."""
    STEP = int(step)
    if tick is not None and not lean:
        raise ValueError("the loop clocks time the lean key loop only")
    tick = _no_tick if tick is None else tick
    if STEP not in (1, 2) or stages % STEP:
        raise ValueError(f"the key loop takes every tile or every other one (step 1 or 2, "
                         f"with an even number of stages), but got step={step}, "
                         f"stages={stages}")
    BN, rescale_half = P.BN, P.rescale_half
    SPLIT = split is not None
    ring_acquire, ring_release = (split.acquire, split.release) if SPLIT else (None, None)

    # what a lean iteration waits for and hands back: a joint stage is acquired
    # with its keys and released with its values; split rings do each on its own
    @device_function
    def keys_in(g, ntiles, a):
        if SPLIT:
            ring_acquire(0, g, a)
        else:
            acquire(g, ntiles, a)

    @device_function
    def values_in(g, ntiles, a):
        if SPLIT:
            ring_acquire(1, g, a)

    @device_function
    def keys_read(g, ntiles, a):
        if SPLIT:
            ring_release(0, g, ntiles, a)

    @device_function
    def values_read(g, ntiles, a):
        if SPLIT:
            ring_release(1, g, ntiles, a)
        else:
            release(g, ntiles, a)

    pin_s, wait_s, wait_s_alone, pin_o, wait_o, wait_o_twin, pin_p = (
        W.pin_s, W.wait_s, W.wait_s_alone, W.pin_o, W.wait_o, W.wait_o_twin, W.pin_p)
    fence, issue_s, issue_pv, tile_weights, pack_p = (
        W.fence, W.issue_s, W.issue_pv, W.tile_weights, W.pack_p)
    tile_weights_masked, mask_limits = W.tile_weights_masked, P.mask_limits

    @cuda_function
    def run(qs, kvs, s, o, pa, m, l_, alpha, pos, slope, c, pos0, nq, kv_first, kv_hi,
            ntiles, j0, first, causal, window, qscale, soft_cap, cap2, alibi, sc, plain, a):
        first = int32(first if STEP == 2 else 0)    # (a constant for every tile)
        cur = int32((j0 + first) % stages)  # tile j's stage ((j0 + j) % stages, counted)
        if first < ntiles:
            acquire(j0 + first, ntiles, a)
            pin_s(s)
            take_turn(a)
            fence()
            issue_s(s, qs, kvs, cur)
            pass_turn(False, a)
            wait_s_alone(s)
            tile_weights(s, m, l_, alpha, pos, slope, kv_first + first * BN, c, pos0, nq,
                         kv_hi, causal, window, qscale, soft_cap, cap2, alibi, sc, plain, pa)
            pack_p(pa, s)
        for j in range(first + STEP, ntiles, STEP):
            prev = cur
            if STEP == 1:
                cur = cur + 1 if cur + 1 < stages else int32(0)
            else:
                cur = cur + STEP if cur + STEP < stages else cur + STEP - stages
            acquire(j0 + j, ntiles, a)
            pin_s(s)
            take_turn(a)
            fence()
            issue_s(s, qs, kvs, cur)
            rescale_half(o, alpha, 0, 0)    # O to tile j - 1's maxima, while S_j runs
            rescale_half(o, alpha, 0, 1)
            pin_p(pa)
            pin_o(o)
            fence()
            issue_pv(o, pa, kvs, prev)
            pass_turn(False, a)
            wait_s(s)                   # S_j landed; P V may still run
            tile_weights(s, m, l_, alpha, pos, slope, kv_first + j * BN, c, pos0, nq, kv_hi,
                         causal, window, qscale, soft_cap, cap2, alibi, sc, plain, pa)
            # P_{j-1} V_{j-1} landed: P's registers are free. ptxas would hoist a
            # plain wait above the softmax (nothing ties them), serialising it
            # with P V; a branch on the row sums (always taken: a sum is >= 0 or
            # NaN) keeps it after them.
            if cuda.any_sync(FULL_MASK, not (l_[0, 0] + l_[0, 1] < float32(0.0))):
                wait_o(o)
            else:
                wait_o_twin(o)
            release(j0 + j - STEP, ntiles, a)
            pack_p(pa, s)
        if first < ntiles:
            rescale_half(o, alpha, 0, 0)
            rescale_half(o, alpha, 0, 1)
            pin_p(pa)
            pin_o(o)
            take_turn(a)
            fence()
            issue_pv(o, pa, kvs, cur)
            pass_turn(True, a)
            wait_o(o)
            release(j0 + ntiles - 1 - (ntiles - 1 - first) % STEP, ntiles, a)

    @cuda_function
    def run_lean(qs, kvs, s, o, pa, m, l_, alpha, pos, slope, c, pos0, nq, kv_first, kv_hi,
                 ntiles, j0, first, causal, window, qscale, soft_cap, cap2, alibi, sc, plain, a):
        first = int32(first if STEP == 2 else 0)
        # The counters stay 32-bit: Numba's int64 loop index and int64 constants
        # made the ring's count, its stage and barrier ids, and the keys' start
        # 64-bit chains of uniform instructions (with signed % and //) in every
        # tile. The ring's count g = j0 + j is unsigned (never negative), so the
        # ring's g % stages and g // stages are masks and shifts.
        g = uint32(j0 + first)
        # tile j's stage ((j0 + j) % stages, counted), 64-bit as in ``run``: an
        # int32 stage made the K operand's start a mul.wide.s32, and ptxas (12.9,
        # 13.0) then dropped the high word of the descriptor's constant fields
        # (SBO, swizzle) from the steady state's S = Q K^T products (not the
        # prologue's): wrong scores for keys 8.. of each later tile, on the GPU only
        cur = int64(g % stages)
        kt = int32(kv_first + first * BN)   # tile j's first key
        # tile j needs a mask where kt <= mlo or kt > mhi: two compares a tile,
        # before the wait for its scores (the branch after it waits for nothing)
        mlo, mhi = mask_limits(pos0, nq, kv_hi, causal, window)
        if first < ntiles:
            keys_in(g, ntiles, a)
            pin_s(s)
            take_turn(a)
            fence()
            issue_s(s, qs, kvs, cur)
            pass_turn(False, a)
            masked = (kt <= mlo) | (kt > mhi)
            wait_s_alone(s)
            keys_read(g, ntiles, a)
            tile_weights_masked(s, m, l_, alpha, pos, slope, kt, c, kv_hi, causal, window,
                                qscale, soft_cap, cap2, alibi, sc, plain, masked, pa)
            pack_p(pa, s)
        tick(LOOP_START, a)
        for _ in range(int32(first + STEP), ntiles, int32(STEP)):
            prev = cur
            if STEP == 1:
                cur = cur + 1 if cur < stages - 1 else int64(0)
            else:
                cur = cur + STEP if cur < stages - STEP else cur + STEP - stages
            g = uint32(g + STEP)
            kt = int32(kt + STEP * BN)
            keys_in(g, ntiles, a)
            values_in(uint32(g - STEP), ntiles, a)
            tick(ACQUIRE, a)
            pin_s(s)
            take_turn(a)
            tick(TURN, a)
            fence()
            issue_s(s, qs, kvs, cur)
            tick(ISSUE_S, a)
            rescale_half(o, alpha, 0, 0)    # O to tile j - 1's maxima, while S_j runs
            rescale_half(o, alpha, 0, 1)
            pin_p(pa)
            pin_o(o)
            fence()
            issue_pv(o, pa, kvs, prev)
            pass_turn(False, a)
            tick(ISSUE_PV, a)
            masked = (kt <= mlo) | (kt > mhi)
            wait_s(s)                   # S_j landed; P V may still run
            tick(SCORES, a)
            keys_read(g, ntiles, a)     # (split rings: K_j's stage may be refilled)
            tile_weights_masked(s, m, l_, alpha, pos, slope, kt, c, kv_hi, causal, window,
                                qscale, soft_cap, cap2, alibi, sc, plain, masked, pa)
            tick(SOFTMAX, a)
            # P_{j-1} V_{j-1} landed: P's registers are free. ptxas would hoist a
            # plain wait above the softmax (nothing ties them), serialising it
            # with P V; a branch on the row sums (always taken: a sum is >= 0 or
            # NaN) keeps it after them.
            if cuda.any_sync(FULL_MASK, not (l_[0, 0] + l_[0, 1] < float32(0.0))):
                wait_o(o)
            else:
                wait_o_twin(o)
            tick(PV, a)
            values_read(uint32(g - STEP), ntiles, a)
            pack_p(pa, s)
            tick(PACK, a)
        if first < ntiles:
            values_in(g, ntiles, a)
            rescale_half(o, alpha, 0, 0)
            rescale_half(o, alpha, 0, 1)
            pin_p(pa)
            pin_o(o)
            take_turn(a)
            fence()
            issue_pv(o, pa, kvs, cur)
            pass_turn(True, a)
            wait_o(o)
            values_read(g, ntiles, a)   # the last tile: j0 + ntiles - 1

    if SPLIT and not lean:
        raise ValueError("split rings run the lean key loop only")
    return run_lean if lean else run
