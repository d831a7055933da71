"""Warp-level operations for Numba's CUDA simulator.

Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) runs each CUDA thread of a
block as a Python thread but implements no warp operations (``shfl_*_sync``,
votes, ``syncwarp``, ...), so kernels that use them cannot be tested without a
GPU. :func:`install` adds them to the simulator's fake ``cuda`` module.

Each call is a rendezvous of the lanes named in ``mask`` that exist in the
caller's warp (warp = linear thread id // 32). Only that warp waits, so other
warps may be in ``cuda.syncthreads()`` or doing anything else meanwhile. The
state lives on the block's ``BlockManager``, so blocks and launches never
share it.
"""

import functools
import sys
import threading

import numba
import numba.np.numpy_support
import numpy as np

__all__ = ["install", "is_installed", "simulator_enabled"]

_WARP = 32
_FULL = 0xFFFFFFFF
_POLL_S = 0.05
_CREATE_LOCK = threading.Lock()
_installed = False
_SHARED_LOCK = threading.Lock()
_ORIG_SHARED_ARRAY = None


def simulator_enabled():
    """Return whether Numba's CUDA simulator is switched on.

    Returns
    -------
    bool
        The value of ``numba.config.ENABLE_CUDASIM``.
    """
    return bool(numba.config.ENABLE_CUDASIM)


def is_installed():
    """Return whether :func:`install` has patched the simulator.

    Returns
    -------
    bool
        True once the warp operations are on ``FakeCUDAModule``.
    """
    return _installed


class _Exchange:
    """Reusable rendezvous of a fixed set of lanes of one warp.

    Parameters
    ----------
    lanes : int
        Bit mask of the lanes that take part.
    """

    def __init__(self, lanes):
        self.count = bin(lanes).count("1")
        self.lock = threading.Lock()
        self.pending = {}
        self.done = threading.Event()

    def swap(self, lane, op, value):
        """Deposit ``(op, value)`` for ``lane``; return all lanes' deposits."""
        with self.lock:
            self.pending[lane] = (op, value)
            done = self.done
            if len(self.pending) == self.count:
                # The last lane publishes this generation's deposits on its
                # event and starts the next generation with a fresh one, so
                # a slow reader never sees a later generation's values.
                ops = {o for o, _ in self.pending.values()}
                done.error = None if len(ops) == 1 else (
                    "lanes of one warp met in different warp operations: %s" % sorted(ops))
                done.values = {ln: v for ln, (_, v) in self.pending.items()}
                self.pending = {}
                self.done = threading.Event()
                done.set()
        if not done.is_set():
            thread = threading.current_thread()
            while not done.wait(_POLL_S):
                if getattr(thread, "abort", False):
                    raise RuntimeError("abort flag set in a warp operation")
        if done.error:
            raise RuntimeError(done.error)
        return done.values


def _rendezvous(mask, op, value):
    """Exchange ``value`` with the lanes of ``mask`` in the caller's warp.

    Returns
    -------
    tuple
        ``(lane, lanes, values)``: the caller's lane, the mask of lanes that
        took part and a dict lane -> value.
    """
    thread = threading.current_thread()
    manager = getattr(thread, "_manager", None)
    if manager is None:
        raise RuntimeError("warp operations need a simulated CUDA thread")
    warp, lane = divmod(thread.thread_id, _WARP)
    lanes = int(mask) & _FULL & _lanes_present(manager, warp)
    if not (lanes >> lane) & 1:
        raise RuntimeError("lane %d of warp %d is not in mask %#x"
                           % (lane, warp, int(mask) & _FULL))
    exchanges = getattr(manager, "_paged_numba_warps", None)
    key = (warp, lanes)
    if exchanges is None or key not in exchanges:
        with _CREATE_LOCK:
            exchanges = manager.__dict__.setdefault("_paged_numba_warps", {})
            if key not in exchanges:
                exchanges[key] = _Exchange(lanes)
    return lane, lanes, exchanges[key].swap(lane, op, value)


class _NamedBarrier:
    """One of a block's named barriers (``bar.sync`` / ``bar.arrive``): it
    completes when ``count`` threads have arrived, then starts over."""

    def __init__(self, count):
        self.count = count
        self.lock = threading.Lock()
        self.arrived = 0
        self.done = threading.Event()

    def arrive(self, count, wait):
        if count != self.count:
            raise RuntimeError("named barrier used with thread counts %d and %d"
                               % (self.count, count))
        with self.lock:
            self.arrived += 1
            done = self.done
            if self.arrived == self.count:
                self.arrived = 0
                self.done = threading.Event()
                done.set()
        if wait:
            thread = threading.current_thread()
            while not done.wait(_POLL_S):
                if getattr(thread, "abort", False):
                    raise RuntimeError("abort flag set in a named barrier")


class _BlockBarrier:
    """``__syncthreads`` of one simulated block, without polling: it
    completes when every thread still running has arrived (a thread that has
    returned no longer counts, as in Numba's own simulator). A thread that
    raises aborts the others."""

    def __init__(self, threads):
        self.cond = threading.Condition()
        self.live = threads
        self.arrived = 0
        self.generation = 0
        self.failed = None          # the first thread that raised
        self.threads = []

    def _release(self):
        self.arrived = 0
        self.generation += 1
        self.cond.notify_all()

    def wait(self, thread):
        with self.cond:
            if thread.abort:
                raise RuntimeError("abort flag set on syncthreads call")
            self.arrived += 1
            generation = self.generation
            if self.arrived == self.live:
                self._release()
            while generation == self.generation and not thread.abort:
                self.cond.wait(_POLL_S)
            if thread.abort:
                raise RuntimeError("abort flag set on syncthreads clear")

    def exit(self, thread, ok):
        with self.cond:
            self.live -= 1
            if not ok and self.failed is None:
                self.failed = thread
                for t in self.threads:
                    t.abort = True
                self.cond.notify_all()
            elif self.live and self.arrived == self.live:
                self._release()


def _block_run(self, grid_point, *args):
    """``BlockManager.run`` without its busy loop: threads wait on one
    condition per block (:class:`_BlockBarrier`) and the manager only joins
    them. Raises the first thread's exception, and raises if the block ends
    with a named barrier partly arrived at (an arrival no thread waited for:
    a barrier the next use would complete early, undefined on the GPU)."""
    from numba.cuda.simulator.kernel import BlockThread

    barrier = _BlockBarrier(int(np.prod(self._block_dim)))
    self._paged_numba_block = barrier

    def target():
        ok = False
        try:
            self._f(*args)
            ok = True
        finally:
            barrier.exit(threading.current_thread(), ok)

    for block_point in np.ndindex(*self._block_dim):
        barrier.threads.append(BlockThread(target, self, grid_point, block_point, self._debug))
    for t in barrier.threads:
        t.start()
    for t in barrier.threads:
        t.join()
    if barrier.failed is not None:   # (every thread that raises is seen by exit)
        exc, tb = barrier.failed.exception
        raise exc.with_traceback(tb)
    for name, state in sorted(getattr(self, "_paged_numba_barriers", {}).items()):
        if state.arrived:
            raise RuntimeError(f"block {tuple(int(g) for g in grid_point)} ended with "
                               f"named barrier {name} at {state.arrived} of "
                               f"{state.count} arrivals")


def _syncthreads(self):
    """``BlockThread.syncthreads`` on the block's :class:`_BlockBarrier`."""
    self._manager._paged_numba_block.wait(self)


def named_barrier(barrier, count, wait):
    """Arrive at the caller's block's named barrier ``barrier`` of ``count``
    threads; with ``wait``, also wait for it to complete (``bar.sync``), else
    go on (``bar.arrive``)."""
    thread = threading.current_thread()
    manager = getattr(thread, "_manager", None)
    if manager is None:
        raise RuntimeError("named barriers need a simulated CUDA thread")
    barriers = getattr(manager, "_paged_numba_barriers", None)
    if barriers is None or barrier not in barriers:
        with _CREATE_LOCK:
            barriers = manager.__dict__.setdefault("_paged_numba_barriers", {})
            barriers.setdefault(barrier, _NamedBarrier(count))
    barriers[barrier].arrive(count, wait)


def _lanes_present(manager, warp):
    """Mask of the lanes of ``warp`` that exist in the block."""
    bx, by, bz = manager._block_dim
    n = min(_WARP, bx * by * bz - warp * _WARP)
    return (1 << n) - 1


def _shfl(mode):
    def shfl(self, mask, value, arg):
        lane, _, values = _rendezvous(mask, "shfl_" + mode, value)
        if mode == "idx":
            src = int(arg) & (_WARP - 1)
        elif mode == "up":
            src = lane - int(arg)
        elif mode == "down":
            src = lane + int(arg)
        else:
            src = lane ^ int(arg)
        return values.get(src, value)
    shfl.__name__ = {"idx": "shfl_sync"}.get(mode, "shfl_%s_sync" % mode)
    shfl.__doc__ = "Simulated ``cuda.%s`` (width 32)." % shfl.__name__
    return shfl


def syncwarp(self, mask=_FULL):
    """Simulated ``cuda.syncwarp``: wait for the lanes of ``mask``."""
    _rendezvous(mask, "syncwarp", None)


def activemask(self):
    """Simulated ``cuda.activemask``: the lanes present in this warp."""
    thread = threading.current_thread()
    return _lanes_present(thread._manager, thread.thread_id // _WARP)


def lanemask_lt(self):
    """Simulated ``cuda.lanemask_lt``: the lanes below the caller's."""
    return (1 << (threading.current_thread().thread_id % _WARP)) - 1


def ballot_sync(self, mask, predicate):
    """Simulated ``cuda.ballot_sync`` (returns a non-negative int)."""
    _, _, values = _rendezvous(mask, "vote", bool(predicate))
    return sum(1 << ln for ln, p in values.items() if p)


def any_sync(self, mask, predicate):
    """Simulated ``cuda.any_sync``."""
    return any(_rendezvous(mask, "vote", bool(predicate))[2].values())


def all_sync(self, mask, predicate):
    """Simulated ``cuda.all_sync``."""
    return all(_rendezvous(mask, "vote", bool(predicate))[2].values())


def eq_sync(self, mask, predicate):
    """Simulated ``cuda.eq_sync``."""
    values = _rendezvous(mask, "vote", bool(predicate))[2].values()
    return len(set(values)) == 1


def match_any_sync(self, mask, value):
    """Simulated ``cuda.match_any_sync``: lanes holding the caller's value."""
    _, _, values = _rendezvous(mask, "match", value)
    return sum(1 << ln for ln, v in values.items() if v == value)


def match_all_sync(self, mask, value):
    """Simulated ``cuda.match_all_sync``: ``(lanes or 0, all equal)``."""
    _, lanes, values = _rendezvous(mask, "match", value)
    same = all(v == value for v in values.values())
    return (lanes if same else 0), same


def _shared_array(self, shape, dtype, alignment=None):
    """Thread-safe ``cuda.shared.array`` for the simulator.

    The simulator finds a block's shared array by the caller's file and line,
    but its look-up and insertion are not atomic: two threads that race
    through a declaration can get two different arrays (seen with a short
    switch interval). Here the look-up holds a lock. New float arrays are
    filled with NaN, so a read of shared memory that nothing wrote shows up
    in the results instead of passing silently. ``alignment`` is accepted and
    ignored (the simulator's own version refuses it): NumPy arrays are
    addressed by index, so placement cannot matter.
    """
    if shape == 0:
        return _ORIG_SHARED_ARRAY(self, shape, dtype)
    frame = sys._getframe(1)
    caller = (frame.f_code.co_filename, frame.f_lineno)
    with _SHARED_LOCK:
        res = self._allocations.get(caller)
        if res is None:
            if isinstance(dtype, numba.types.Type):
                dtype = numba.np.numpy_support.as_dtype(dtype)
            res = np.empty(shape, dtype)
            if res.dtype.kind == "f":
                res.fill(np.nan)
            self._allocations[caller] = res
    return res


def install():
    """Add warp operations to the simulator's fake ``cuda`` module.

    Patches ``numba.cuda.simulator.kernelapi.FakeCUDAModule`` with
    ``shfl_sync``, ``shfl_up_sync``, ``shfl_down_sync``, ``shfl_xor_sync``,
    ``syncwarp``, ``activemask``, ``lanemask_lt``, ``ballot_sync``,
    ``any_sync``, ``all_sync``, ``eq_sync``, ``match_any_sync`` and
    ``match_all_sync`` (on ``numba.cuda`` as well, with ``syncthreads`` and
    ``atomic``, for
    device functions that live outside the kernel's module), has a block that
    ends with a named barrier partly arrived at raise, makes ``cuda.shared.array`` thread-safe (see
    :func:`_shared_array`), and replaces the simulator's block loop, which
    busy-polls its threads, with one that waits (:func:`_block_run`). Calling
    it again does nothing.

    Returns
    -------
    bool
        True if the simulator is on and patched, False if it is off.
    """
    global _installed
    if not simulator_enabled():
        return False
    if _installed:
        return True
    global _ORIG_SHARED_ARRAY
    from numba.cuda.simulator.kernelapi import FakeCUDAModule, FakeCUDAShared

    _ORIG_SHARED_ARRAY = FakeCUDAShared.array
    FakeCUDAShared.array = _shared_array

    funcs = [_shfl(m) for m in ("idx", "up", "down", "xor")] + [
        syncwarp, activemask, lanemask_lt, ballot_sync, any_sync, all_sync,
        eq_sync, match_any_sync, match_all_sync]
    for fn in funcs:
        setattr(FakeCUDAModule, fn.__name__, fn)
        # The simulator swaps in its per-block fake module only in the module of
        # the kernel it runs; device helpers in other modules see numba.cuda.
        if not hasattr(numba.cuda, fn.__name__):
            setattr(numba.cuda, fn.__name__, functools.partial(fn, None))
    if not hasattr(numba.cuda, "syncthreads"):
        numba.cuda.syncthreads = lambda: threading.current_thread().syncthreads()
    from numba.cuda.simulator.kernel import BlockManager, BlockThread
    BlockManager.run = _block_run
    BlockThread.syncthreads = _syncthreads
    if not hasattr(numba.cuda, "atomic"):           # the simulator's atomics lock globally
        from numba.cuda.simulator.kernelapi import FakeCUDAAtomic
        numba.cuda.atomic = FakeCUDAAtomic()
    _installed = True
    return True
