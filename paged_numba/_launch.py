"""Kernel launches with arguments packed once, for plan/run.

Numba's ``kernel[grid, block](*args)`` types and flattens every argument on
every call (tens of microseconds of host time, more with PyTorch tensors).
``PackedLaunch`` does that once: it flattens the arguments the way numba
does (``_Kernel._prepare_args``), keeps them in ctypes storage with an array
of pointers to them, and then each call is one ``cuLaunchKernel`` through
``cuda.bindings``. It relies on numba-cuda 0.30's ``_Kernel`` internals,
which is why numba-cuda is pinned to 0.30.x. Under the simulator it falls
back to an ordinary launch.
"""
import ctypes

from numba import config, cuda


def stream_handle(stream):
    """The ``cudaStream_t`` (an int) of ``None`` (the default stream), an int,
    a numba stream, or an object with ``.cuda_stream`` (PyTorch)."""
    if stream is None:
        return 0
    if isinstance(stream, int):
        return stream
    if hasattr(stream, "cuda_stream"):
        return int(stream.cuda_stream)
    return int(getattr(stream, "handle", None) or 0)


REGS_PER_SM = 65536
SHARED_PER_SM = 228 * 1024
SIMULATED_RESIDENT_BLOCKS = 3    # what resident_blocks says under the simulator


def resident_blocks(dispatcher, argtypes, threads):
    """Thread blocks of ``dispatcher``, compiled for the numba types
    ``argtypes``, that fit on one multiprocessor at once, from its registers
    and static shared memory (sm_80/90 limits: 64 K registers, 228 KB shared
    memory, 64 warps, 32 blocks)."""
    if config.ENABLE_CUDASIM:
        return SIMULATED_RESIDENT_BLOCKS
    kernel = dispatcher.compile(tuple(argtypes))
    regs = -(-kernel.regs_per_thread * 32 // 256) * 256 * (threads // 32)   # per-warp granule
    by_regs = REGS_PER_SM // max(regs, 1)
    by_shared = SHARED_PER_SM // max(kernel.shared_mem_per_block + 1024, 1)   # + driver reserve
    return max(1, min(by_regs, by_shared, 64 * 32 // threads, 32))


class PackedLaunch:
    """``dispatcher[grid, block, stream](*args)`` with ``args`` frozen at construction.

    Call it with a stream (anything :func:`stream_handle` accepts)."""

    def __init__(self, dispatcher, grid, block, args):
        self.dispatcher, self.grid, self.block, self.args = dispatcher, grid, block, args
        if config.ENABLE_CUDASIM:
            return
        from cuda.bindings import driver as drv

        argtypes = tuple(dispatcher.typeof_pyval(a) for a in args)
        kernel = dispatcher.compile(argtypes)
        kernel.bind()
        params, retr = [], []
        for ty, val in zip(kernel.argument_types, args):
            kernel._prepare_args(ty, val, 0, retr, params)
        # numba passes plain ints (array pointers, shapes, strides) as intptr_t
        self._storage = [p if isinstance(p, ctypes._SimpleCData) else ctypes.c_ssize_t(p)
                         for p in params]
        self._pointers = (ctypes.c_void_p * len(self._storage))(
            *[ctypes.addressof(p) for p in self._storage])
        self._address = ctypes.addressof(self._pointers)
        grid3 = tuple(grid) + (1,) * (3 - len(grid)) if isinstance(grid, tuple) else (grid, 1, 1)
        self._dims = (*grid3, block, 1, 1)
        self._function = drv.CUfunction(int(kernel._codelibrary.get_cufunc().handle))
        self._launch = drv.cuLaunchKernel
        self._ok = drv.CUresult.CUDA_SUCCESS

    def __call__(self, stream=None):
        if config.ENABLE_CUDASIM:
            # the simulator runs kernels synchronously: any stream is the default one
            self.dispatcher[self.grid, self.block, cuda.default_stream()](*self.args)
            return
        err, = self._launch(self._function, *self._dims, 0, stream_handle(stream),
                            self._address, 0)
        if err != self._ok:
            raise RuntimeError(f"cuLaunchKernel failed: {err!r}")
