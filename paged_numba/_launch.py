"""Kernel launches with arguments packed once, for plan/run.

Numba's ``kernel[grid, block](*args)`` types and flattens every argument on
every call (tens of microseconds of host time, more with PyTorch tensors).
``PackedLaunch`` does that once and then calls ``cuda.core.launch`` directly.
It relies on numba-cuda 0.30's ``_Kernel`` internals (``_prepare_args``,
``_codelibrary``), which is why numba-cuda is pinned to 0.30.x. Under the
simulator it falls back to an ordinary launch.
"""
from numba import config, cuda


def as_stream(stream):
    """A numba stream from ``None`` (the default stream), a numba stream, an
    integer ``cudaStream_t`` or an object with ``.cuda_stream`` (PyTorch)."""
    if stream is None or config.ENABLE_CUDASIM:
        return cuda.default_stream()
    if hasattr(stream, "cuda_stream"):
        return cuda.external_stream(stream.cuda_stream)
    if isinstance(stream, int):
        return cuda.external_stream(stream) if stream else cuda.default_stream()
    return stream


class PackedLaunch:
    """``dispatcher[grid, block](*args)`` with ``args`` frozen at construction."""

    def __init__(self, dispatcher, grid, block, args):
        self.dispatcher, self.grid, self.block, self.args = dispatcher, grid, block, args
        if config.ENABLE_CUDASIM:
            return
        from cuda.core import LaunchConfig
        from numba.cuda._compat import CUDA_CORE_GE_1_0

        argtypes = tuple(dispatcher.typeof_pyval(a) for a in args)
        kernel = dispatcher.compile(argtypes)
        kernel.bind()
        self._kernel = kernel._codelibrary.get_cufunc().kernel
        self._params = []
        retr = []
        for ty, val in zip(kernel.argument_types, args):
            kernel._prepare_args(ty, val, 0, retr, self._params)
        grid3 = tuple(grid) + (1,) * (3 - len(grid)) if isinstance(grid, tuple) else (grid, 1, 1)
        coop = "is_cooperative" if CUDA_CORE_GE_1_0 else "cooperative_launch"
        self._config = LaunchConfig(grid=grid3, block=block, shmem_size=0, **{coop: False})

    def __call__(self, stream):
        if config.ENABLE_CUDASIM:
            self.dispatcher[self.grid, self.block, stream](*self.args)
            return
        from cuda.core import launch

        from numba.cuda.cudadrv import driver

        launch(driver._to_core_stream(stream), self._config, self._kernel, *self._params)
