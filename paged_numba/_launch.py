"""Kernel launches with arguments packed once, for plan/run.

Numba's ``kernel[grid, block](*args)`` types and flattens every argument on
every call (tens of microseconds of host time, more with PyTorch tensors).
``PackedLaunch`` does that once: it flattens the arguments the way numba
does (``_Kernel._prepare_args``), keeps them in ctypes storage with an array
of pointers to them, and then each call is one ``cuLaunchKernel`` through
``cuda.bindings``. It relies on numba-cuda 0.30's ``_Kernel`` internals,
which is why numba-cuda is pinned to 0.30.x. Under the simulator it falls
back to an ordinary launch.

``GraphLaunch`` goes one step further for a fixed sequence of packed
launches (split-K decode and its merge): it captures them once into a CUDA
graph, and each call is one ``cuGraphLaunch``, which on the H200 machine
costs 3.3 us of host time against 5.9 us for one ``cuLaunchKernel`` and
15.8 us for two (``docs/journal/tooling.md``, "One graph launch per run,
2026-11-29").

Every kernel the public functions launch goes through :func:`launch`,
:class:`PackedLaunch` or :class:`GraphLaunch`, and :func:`launch_count`
counts them, so tests can tell that a rejected call launched nothing.
"""
import ctypes
import functools

import numpy as np
from numba import config, cuda

from .kernels.disk_cache import attach as keep_on_disk
from .kernels.merge import merge_kernel

# the occupancy model lives with the kernels; these names are kept here too
from .kernels.tuning import (  # noqa: F401
    REGISTER_SLACK, REGS_PER_SM, SHARED_PER_SM, SIMULATED_RESIDENT_BLOCKS, blocks_by_registers,
    dynamic_shared, register_cap, register_limit, resident_blocks)


_launches = [0]     # kernels launched so far, in this process


def launch_count():
    """Kernels launched through this module so far (a graph launch counts
    each kernel it holds).

    >>> before = launch_count()
    >>> launch_count() - before
    0
    """
    return _launches[0]


def launch(dispatcher, grid, block, args, stream=0, shared=0):
    """``dispatcher[grid, block, stream, shared](*args)``, counted by :func:`launch_count`;
    ``stream`` is anything :func:`stream_handle` accepts."""
    _launches[0] += 1
    keep_on_disk(dispatcher)
    dispatcher[grid, block, numba_stream(stream), shared](*args)


STREAM_KINDS = ("None (the default stream), an int cudaStream_t, a numba stream, a PyTorch "
                "stream (.cuda_stream), a CuPy stream (.ptr) or an object with __cuda_stream__")


def stream_handle(stream):
    """The ``cudaStream_t`` (an int) of a stream argument, after checking its kind.

    Accepted: ``None`` (the default stream, 0), a non-negative int (a raw
    handle), an object with ``__cuda_stream__`` (numba-cuda streams,
    ``cuda.core``, recent PyTorch), with ``.cuda_stream`` (``torch.cuda.Stream``),
    with ``.ptr`` (``cupy.cuda.Stream``), or with ``.handle`` (older numba
    streams). Anything else is a ``TypeError`` naming it. Under the
    simulator kernels run synchronously on the host, so every stream is
    accepted and stands for the default one: the handle is then 0.

    >>> stream_handle(None)
    0
    >>> stream_handle(7) == (0 if config.ENABLE_CUDASIM else 7)     # ignored by the simulator
    True
    >>> stream_handle("s0")
    Traceback (most recent call last):
        ...
    TypeError: stream must be None (the default stream), an int cudaStream_t, a numba stream, a PyTorch stream (.cuda_stream), a CuPy stream (.ptr) or an object with __cuda_stream__, but got 's0' (str).
    """
    if stream is None:
        return 0
    if isinstance(stream, (bool, np.bool_)) or isinstance(stream, (float, str, bytes)):
        handle = None
    elif isinstance(stream, (int, np.integer)):
        if not 0 <= stream < 2**64:     # a cudaStream_t is a 64-bit pointer
            raise ValueError(f"stream must be a cudaStream_t, a pointer in [0, 2**64), but got "
                             f"{int(stream)}.")
        handle = int(stream)
    elif hasattr(stream, "__cuda_stream__"):
        handle = int(stream.__cuda_stream__()[1])
    elif hasattr(stream, "cuda_stream"):
        handle = int(stream.cuda_stream)
    elif hasattr(stream, "ptr"):
        handle = int(stream.ptr)
    elif _is_simulator_stream(stream):
        handle = 0
    elif hasattr(stream, "handle"):
        handle = int(getattr(stream.handle, "value", stream.handle) or 0)
    else:
        handle = None
    if handle is None:
        raise TypeError(f"stream must be {STREAM_KINDS}, but got {stream!r} "
                        f"({type(stream).__name__}).")
    return 0 if config.ENABLE_CUDASIM else handle


def _is_simulator_stream(stream):
    if not config.ENABLE_CUDASIM:
        return False
    from numba.cuda.simulator.api import stream as simulator_stream

    return isinstance(stream, simulator_stream)


_external = {}      # handle -> numba stream object wrapping it (it owns nothing)


def numba_stream(stream):
    """``stream`` (anything :func:`stream_handle` accepts) as numba's launch
    configurations and copies take it: a numba stream as it is, 0 for the
    default stream (and for every stream under the simulator), else a numba
    wrapper of the handle (``cuda.external_stream``, made once per handle)."""
    handle = stream_handle(stream)
    if config.ENABLE_CUDASIM or handle == 0:
        return 0
    from numba.cuda.cudadrv.driver import Stream

    if isinstance(stream, Stream):
        return stream
    if handle not in _external:
        _external[handle] = cuda.external_stream(handle)
    return _external[handle]


def allow_dynamic_shared(drv, cufunc, nbytes):
    """Let ``cufunc`` (numba's loaded kernel) use ``nbytes`` of dynamic shared
    memory on its device; above 48 KB a launch fails without this. numba-cuda
    0.30 loads kernels through the library API, so the handle is a ``CUkernel``
    and the attribute is set per device (``cuKernelSetAttribute``;
    ``cuFuncSetAttribute`` on it is an invalid handle)."""
    attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    err, = drv.cuKernelSetAttribute(attr, nbytes, drv.CUkernel(int(cufunc.handle)),
                                    int(cufunc.device.id))
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"setting {nbytes} bytes of dynamic shared memory failed: {err!r}")


class PackedLaunch:
    """``dispatcher[grid, block, stream, shared](*args)`` with ``args`` frozen at
    construction, and ``shared`` the dispatcher's :func:`dynamic_shared` bytes
    (allowed on the compiled function: past 48 KB of static plus dynamic
    shared memory a launch fails without it).

    Call it with a stream (anything :func:`stream_handle` accepts).
    ``programmatic=True`` launches with the programmatic stream serialisation
    attribute (``cuLaunchKernelEx``, sm_90): the kernel may start before the
    one before it in the stream has finished, and must wait for it itself
    (:mod:`paged_numba.kernels.pdl`)."""

    def __init__(self, dispatcher, grid, block, args, programmatic=False):
        self.dispatcher, self.grid, self.block, self.args = dispatcher, grid, block, args
        self.programmatic = bool(programmatic)
        self.shared = dynamic_shared(dispatcher)
        if config.ENABLE_CUDASIM:
            return
        from cuda.bindings import driver as drv

        argtypes = tuple(dispatcher.typeof_pyval(a) for a in args)
        keep_on_disk(dispatcher)
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
        cufunc = kernel._codelibrary.get_cufunc()
        self._function = drv.CUfunction(int(cufunc.handle))
        if self.shared:     # static + dynamic over 48 KB needs it, however few are dynamic
            allow_dynamic_shared(drv, cufunc, self.shared)
        self._launch = drv.cuLaunchKernel
        self._ok = drv.CUresult.CUDA_SUCCESS
        if self.programmatic:
            attr = drv.CUlaunchAttribute()
            attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            self._config = drv.CUlaunchConfig()
            self._config.attrs, self._config.numAttrs = [attr], 1
            self._launch_ex = drv.cuLaunchKernelEx

    def __call__(self, stream=None):
        _launches[0] += 1
        self._enqueue(stream)

    def launch_grid(self, grid, stream=None):
        """The launch with another ``grid`` (a tuple; same block and
        arguments), for kernels whose arguments do not depend on it."""
        grid3 = tuple(grid) + (1,) * (3 - len(grid))
        if config.ENABLE_CUDASIM:
            self.grid = grid
        else:
            self._dims = (*grid3, *self._dims[3:])
        self(stream)

    def _enqueue(self, stream):
        """The launch itself, not counted (a graph capture calls this)."""
        if config.ENABLE_CUDASIM:
            # the simulator runs kernels synchronously: any stream is the default one
            self.dispatcher[self.grid, self.block, cuda.default_stream(), self.shared](*self.args)
            return
        if self.programmatic:
            c = self._config
            (c.gridDimX, c.gridDimY, c.gridDimZ, c.blockDimX, c.blockDimY,
             c.blockDimZ) = self._dims
            c.sharedMemBytes, c.hStream = self.shared, stream_handle(stream)
            err, = self._launch_ex(c, self._function, self._address, 0)
        else:
            err, = self._launch(self._function, *self._dims, self.shared, stream_handle(stream),
                                self._address, 0)
        if err != self._ok:
            raise RuntimeError(f"cuLaunchKernel failed: {err!r}")


def merge_launch(out_dtype, out, lse, part_out, part_lse, pdl=False):
    """The split-K merge of ``part_out [n, P, H, D]`` and ``part_lse [n, P, H]``
    into ``out [n, H, D]`` (of ``out_dtype``) and ``lse [n, H]``, packed;
    ``pdl``: launched to start early, each block waiting for the partial
    states itself (:mod:`paged_numba.kernels.pdl`)."""
    n, _, h, _ = part_out.shape
    # no pdl keyword otherwise: merge_kernel is cached on its arguments as given
    kernel = merge_kernel(out_dtype, **({"pdl": True} if pdl else {}))
    return PackedLaunch(kernel, (h, n), 128, (out, lse, part_out, part_lse),
                        programmatic=pdl)


@functools.cache
def _capture_stream():
    """A private non-blocking stream to capture graphs on (one per process)."""
    from cuda.bindings import driver as drv

    err, stream = drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuStreamCreate failed: {err!r}")
    return stream


class GraphLaunch:
    """The :class:`PackedLaunch` objects ``launches``, in order, as one CUDA graph.

    Call it with a stream (anything :func:`stream_handle` accepts): one
    ``cuGraphLaunch``. A graph cannot be launched into a stream that is
    being captured (``torch.cuda.graph``, say), so on such a stream (or one
    whose capture status cannot be read) the launches are made one by one
    instead, and the caller's graph records them. Under the simulator it
    makes the launches one by one."""

    def __init__(self, launches):
        self.launches = tuple(launches)
        self._exec = None
        if config.ENABLE_CUDASIM or not self.launches:
            return
        from cuda.bindings import driver as drv

        ok = drv.CUresult.CUDA_SUCCESS
        stream = _capture_stream()
        mode = drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        err, = drv.cuStreamBeginCapture(stream, mode)
        if err != ok:
            raise RuntimeError(f"cuStreamBeginCapture failed: {err!r}")
        try:
            for packed in self.launches:
                packed._enqueue(int(stream))
        finally:
            err, graph = drv.cuStreamEndCapture(stream)
        if err != ok:
            raise RuntimeError(f"cuStreamEndCapture failed: {err!r}")
        err, graph_exec = drv.cuGraphInstantiate(graph, 0)
        if err != ok:
            drv.cuGraphDestroy(graph)
            raise RuntimeError(f"cuGraphInstantiate failed: {err!r}")
        self._graph, self._exec, self._drv = graph, graph_exec, drv
        self._ok = ok
        self._not_capturing = drv.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE
        self._is_capturing = drv.cuStreamIsCapturing
        self._launch = drv.cuGraphLaunch

    def __call__(self, stream=None):
        if self._exec is None:
            for packed in self.launches:
                packed(stream)
            return
        handle = stream_handle(stream)
        err, status = self._is_capturing(handle)
        if err != self._ok or status != self._not_capturing:
            for packed in self.launches:
                packed(handle)
            return
        _launches[0] += len(self.launches)
        err, = self._launch(self._exec, handle)
        if err != self._ok:
            raise RuntimeError(f"cuGraphLaunch failed: {err!r}")

    def __del__(self):
        if self._exec is not None:
            try:
                self._drv.cuGraphExecDestroy(self._exec)
                self._drv.cuGraphDestroy(self._graph)
            except Exception:       # interpreter shutdown: the driver may be gone
                pass
