"""How the block movers see a cache: its pools as ``[num_layers, num_blocks,
elems]`` views, the vector width and threads of their kernels, and the
per-cache launcher that ``copy_blocks`` uses on a GPU (pinned pair buffers,
an asynchronous upload and a packed launch: no numba dispatch a call)."""
import weakref

import numpy as np
from numba import config, cuda

from ._launch import PackedLaunch
from .kernels.copy_blocks import copy_blocks_kernel

MAX_THREADS = 128


def _block_elems(cache):
    """Elements of one block of one token row pool: ``block_size * num_kv_heads * head_size``."""
    return cache.block_size * cache.num_kv_heads * cache.head_size


def _flat_pools(cache):
    """The pools as ``[num_layers, num_blocks, elems]`` device views (``num_layers`` 1
    for a one-layer cache) and whether there is a separate value pool."""
    layers = cache.num_layers or 1
    has_value = cache.layout != "interleaved"
    elems = _block_elems(cache) * (1 if has_value else 2)
    shape = (layers, cache.num_blocks, elems)
    k = cache.key_cache.reshape(*shape)
    return k, (cache.value_cache.reshape(*shape) if has_value else k), has_value


def _aligned16(pool):
    if config.ENABLE_CUDASIM:
        return True
    return pool.__cuda_array_interface__["data"][0] % 16 == 0


def _vector_threads(k, v):
    """``(elements a vector, threads a block)`` of the kernels that move blocks of
    the ``[num_layers, num_blocks, elems]`` pools ``k``, ``v``: 16-byte vectors
    where a block's bytes are a multiple of 16 and the pools 16-byte aligned,
    else single elements; a warp multiple of threads up to ``MAX_THREADS``."""
    itemsize, elems = k.dtype.itemsize, k.shape[2]
    vec = 16 // itemsize
    if (elems * itemsize) % 16 or not (_aligned16(k) and _aligned16(v)):
        vec = 1
    return vec, min(MAX_THREADS, 32 * -(-(elems // vec) // 32))


# a cache's copy_blocks launcher (its pair buffers), made at its first copy
_copy_launchers = weakref.WeakKeyDictionary()


class _CopyLaunch:
    """``copy_blocks`` of one cache without numba's dispatch or a synchronous
    upload: the pairs go into one of ``SLOTS`` pinned buffers, up to the
    device by an asynchronous copy on the launch's stream, and the kernel is
    a :class:`PackedLaunch` over that slot's device buffer (the grid set per
    call: the kernel reads only its own pair). A slot is written again only
    after its last upload has left the pinned buffer (an event, waited on
    the host: at once unless the stream is ``SLOTS`` calls behind) and its
    device buffer is rewritten only after the kernel that read it (an event
    the stream waits on, a no-op on the same stream)."""

    SLOTS = 4

    def __init__(self, cache, num_pairs, old=None):
        from cuda.bindings import driver as drv

        self._drv = drv
        self.capacity = max(256, num_pairs, 2 * (old.capacity if old else 0))
        k, v, has_value = _flat_pools(cache)
        vec, threads = _vector_threads(k, v)
        kernel = copy_blocks_kernel(vec, has_value)
        self.layers = k.shape[0]
        self._pools = (cache.key_cache, cache.value_cache)
        flags = drv.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self._slots = []
        for _ in range(self.SLOTS):
            host = cuda.pinned_array((self.capacity, 2), np.int32)
            dev = cuda.device_array((self.capacity, 2), np.int32)
            packed = PackedLaunch(kernel, (self.capacity, self.layers), threads, (k, v, dev))
            uploaded, read = (self._check(drv.cuEventCreate(flags)) for _ in range(2))
            self._slots.append([host, dev, packed, uploaded, read, False])
        self._next = 0

    def fits(self, cache, num_pairs):
        """True while ``cache`` has the pools this was made for and ``num_pairs`` fit."""
        return (num_pairs <= self.capacity and cache.key_cache is self._pools[0]
                and cache.value_cache is self._pools[1])

    def __del__(self):
        try:
            for slot in self._slots:
                self._drv.cuEventDestroy(slot[3])
                self._drv.cuEventDestroy(slot[4])
        except Exception:       # interpreter shutdown: the driver may be gone
            pass

    def _check(self, result):
        err, *value = result
        if err != self._drv.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"copy_blocks: a CUDA driver call failed: {err!r}")
        return value[0] if value else None

    def __call__(self, arr, handle):
        drv, check = self._drv, self._check
        slot = self._slots[self._next]
        self._next = (self._next + 1) % self.SLOTS
        host, dev, packed, uploaded, read, used = slot
        n = arr.shape[0]
        if used:
            check(drv.cuEventSynchronize(uploaded))
            check(drv.cuStreamWaitEvent(handle, read, 0))
        host[:n] = arr
        check(drv.cuMemcpyHtoDAsync(dev.device_ctypes_pointer.value, host.ctypes.data,
                                    n * 8, handle))
        check(drv.cuEventRecord(uploaded, handle))
        packed.launch_grid((n, self.layers), handle)
        check(drv.cuEventRecord(read, handle))
        slot[5] = True


def copy_launcher(cache, num_pairs):
    """The :class:`_CopyLaunch` of ``cache`` that takes ``num_pairs`` pairs
    (made, or remade larger or for new pools, as needed)."""
    launcher = _copy_launchers.get(cache)
    if launcher is None or not launcher.fits(cache, num_pairs):
        launcher = _copy_launchers[cache] = _CopyLaunch(cache, num_pairs, launcher)
    return launcher
