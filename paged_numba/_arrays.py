"""Moving arrays between NumPy, numba device arrays and other CUDA arrays."""
import numpy as np
from numba import config, cuda


def is_device_array(x):
    """True for numba device arrays and anything with ``__cuda_array_interface__``."""
    if config.ENABLE_CUDASIM:
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        return isinstance(x, FakeCUDAArray)
    return cuda.is_cuda_array(x)


def as_device(x, name):
    """Return ``(device_array, from_host)``: NumPy arrays are copied to the
    device, CUDA arrays (numba, PyTorch, CuPy, ...) are wrapped without a copy."""
    if isinstance(x, np.ndarray):
        return cuda.to_device(np.ascontiguousarray(x)), True
    if is_device_array(x):
        if config.ENABLE_CUDASIM or cuda.devicearray.is_cuda_ndarray(x):
            return x, False
        return cuda.as_cuda_array(x), False
    raise TypeError(
        f"{name} must be a NumPy array or a CUDA array (__cuda_array_interface__), "
        f"but got {type(x).__name__}."
    )


def to_host(x):
    """A NumPy view or copy of ``x`` (device arrays are copied to the host)."""
    if isinstance(x, np.ndarray):
        return x
    if is_device_array(x):
        dev, _ = as_device(x, "array")
        return dev.copy_to_host()
    return np.asarray(x)


def zeros(shape, dtype):
    """A zero-filled device array."""
    arr = cuda.device_array(shape, dtype=dtype)
    if config.ENABLE_CUDASIM:
        arr.copy_to_device(np.zeros(shape, dtype=dtype))
    elif arr.size:
        from numba.cuda.cudadrv.driver import device_memset

        device_memset(arr, 0, arr.nbytes)
    return arr


def sm_count(default=132):
    """Multiprocessors on the current device (``default`` under the simulator)."""
    if config.ENABLE_CUDASIM:
        return default
    return cuda.get_current_device().MULTIPROCESSOR_COUNT
