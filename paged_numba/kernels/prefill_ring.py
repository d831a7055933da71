"""The barriers of the warp-specialised prefill kernel's K/V ring
(:func:`kernels.prefill_wgmma_ws.prefill_wgmma_ws_kernel`).

Stage ``s`` of a ring of ``stages`` has two named barriers of the whole
block: *full* (the producer arrives once the stage's copies landed, the
consumers wait) and *empty* (the consumers arrive once the products reading
it are done, the producer waits before overwriting it). With ``pingpong``
each consumer warpgroup has its own full barriers (the two pass them at
different times) and a *turn* barrier (one waits at it, the other arrives:
their products are issued in turn). With ``mbarriers`` the full barriers are
mbarriers in shared memory instead, at which the copies arrive as they land
(:mod:`kernels.tma`). Named barrier ids: 0 is ``__syncthreads``, then the
full ones, the empty ones and the two turns (at most 16 in all).
"""
from types import SimpleNamespace

from . import tma, wgmma as wg
from .access import device_function


def turn_parts(turn, pingpong, persistent):
    """``(take_turn, pass_turn, turn_sync, turn_arrive)``: the pingpong turns
    of two consumer warpgroups (256 threads) on named barriers ``turn`` (the
    one warpgroup 0 waits at) and ``turn + 1``; ``a[0]`` is the caller's
    warpgroup. Without ``pingpong`` the turns are no-ops."""
    TURN, PINGPONG, PERSISTENT = int(turn), bool(pingpong), bool(persistent)
    turn_sync, turn_arrive = wg.bar_sync(256), wg.bar_arrive(256)

    @device_function
    def take_turn(a):
        """Wait until the other warpgroup has issued its products."""
        if PINGPONG:
            turn_sync(TURN + a[0])

    @device_function
    def pass_turn(last, a):
        """This warpgroup's products are issued: the other's turn (warpgroup 1's
        last products have no turn after them: every wait is matched; in a
        persistent block they do, and warpgroup 0 takes it at the end)."""
        if PINGPONG and (PERSISTENT or not (last and a[0] == 1)):
            turn_arrive(TURN + 1 - a[0])

    return take_turn, pass_turn, turn_sync, turn_arrive


def ring_parts(stages, pingpong, persistent, mbarriers, mbar_at, threads):
    """The ring's barrier operations for a block of ``threads`` threads (the
    producer warpgroup's 128 and the consumers'), the stages' mbarriers at
    ``bars[mbar_at + s]`` with ``mbarriers``:

    * ``acquire(j, ntiles, a)``: a consumer waits until tile ``j`` (the
      ring's count) has landed; ``a`` is ``(warpgroup, bars, boxed)``, tiles
      before the ring's count ``boxed`` having come by box copies;
    * ``release(j, ntiles, a)``: a consumer is done with tile ``j``'s stage;
    * ``take_turn(a)`` / ``pass_turn(last, a)``: the pingpong turns;
    * ``publish(j)``: the producer's copies of tile ``j`` landed (named full
      barriers only);
    * ``bar_sync``, ``bar_arrive`` (the whole block), ``turn_sync``,
      ``turn_arrive`` (the consumers) and the ids ``EMPTY``, ``TURN``."""
    STAGES, PINGPONG, PERSISTENT, MBAR = int(stages), bool(pingpong), bool(persistent), \
        bool(mbarriers)
    fence_proxy = wg.fence_proxy_async
    bar_sync, bar_arrive = wg.bar_sync(threads), wg.bar_arrive(threads)
    FULL_SETS = 2 if PINGPONG else 1
    FULL, EMPTY = 1, 1 + FULL_SETS * STAGES
    TURN = EMPTY + STAGES
    FULL_COUNT = 256 if PINGPONG else threads     # the producer and who waits
    full_sync, full_arrive = wg.bar_sync(FULL_COUNT), wg.bar_arrive(FULL_COUNT)
    take_turn, pass_turn, turn_sync, turn_arrive = turn_parts(TURN, PINGPONG, PERSISTENT)

    @device_function
    def acquire(j, ntiles, a):
        """Wait until the producer has published tile ``j`` (to this warpgroup);
        ``a`` is ``(warpgroup, mbarriers, the ring's count up to which the
        tiles came by box copies)``."""
        if MBAR:
            tma.mbarrier_wait(a[1], mbar_at + j % STAGES, (j // STAGES) & 1)
            if j >= a[2]:
                # cp.async copies landed: into the tensor cores' view (box copies
                # write through the async proxy, which the products read)
                fence_proxy()
        else:
            full_sync(FULL + (a[0] * STAGES if PINGPONG else 0) + j % STAGES)

    @device_function
    def release(j, ntiles, a):
        """Tile ``j``'s products are done: its stage is free for the producer
        (which waits for it only if it has a tile ``j + STAGES`` to copy; a
        persistent block's producer waits for every tile, the last ones at
        the end)."""
        if PERSISTENT or j + STAGES < ntiles:
            bar_arrive(EMPTY + j % STAGES)

    @device_function
    def publish(j):
        """Tile ``j``'s copies by this thread landed (all but the newest group):
        visible to the tensor cores, then arrive at the stage's full barrier(s)."""
        fence_proxy()
        full_arrive(FULL + j % STAGES)
        if PINGPONG:
            full_arrive(FULL + STAGES + j % STAGES)

    return SimpleNamespace(acquire=acquire, release=release, take_turn=take_turn,
                           pass_turn=pass_turn, publish=publish, bar_sync=bar_sync,
                           bar_arrive=bar_arrive, turn_sync=turn_sync, turn_arrive=turn_arrive,
                           EMPTY=EMPTY, TURN=TURN, PERSISTENT=PERSISTENT)
