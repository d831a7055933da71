"""Moving arrays between NumPy, numba device arrays and other CUDA arrays.

bfloat16 has no numba type, so on the device a bf16 array is a ``uint16``
array of its bit patterns. Each array therefore has a *logical* dtype (what
the caller means: ``ml_dtypes.bfloat16`` for a NumPy bf16 array or a
``torch.bfloat16`` tensor) and a *storage* dtype (what the kernels see:
``uint16``). A public function

* asks :func:`logical_dtype` of its input what the caller passed (before or
  instead of looking at the device array's dtype),
* gets the device array from :func:`as_device` (bf16 arrives as uint16),
* allocates results with :func:`zeros` (which takes the logical dtype), and
* hands NumPy results back with :func:`to_host` ``(x, dtype)``, which views
  uint16 bits as bfloat16 when the logical dtype is bfloat16.

>>> import ml_dtypes, numpy as np
>>> x = np.array([1.0, -2.5], ml_dtypes.bfloat16)
>>> d, from_host = as_device(x, "x")
>>> np.dtype(d.dtype).name, logical_dtype(x).name, from_host
('uint16', 'bfloat16', True)
>>> y = to_host(d, logical_dtype(x))
>>> y.dtype.name, y.astype(np.float32).tolist()
('bfloat16', [1.0, -2.5])
"""
import ml_dtypes
import numpy as np
from numba import config, cuda

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
_BITS = np.dtype(np.uint16)     # how bfloat16 is stored on the device


def storage_dtype(dtype):
    """The dtype of device arrays holding logical ``dtype``: uint16 for bfloat16."""
    dtype = np.dtype(dtype)
    return _BITS if dtype == BFLOAT16 else dtype


def _is_torch(x):
    return type(x).__module__.split(".")[0] == "torch" and hasattr(x, "dtype")


def logical_dtype(x):
    """The NumPy dtype ``x`` stands for: its own dtype, ``BFLOAT16`` for a
    ``torch.bfloat16`` tensor (and the NumPy dtype of the same name for other
    torch tensors). A numba device array of bf16 bits says ``uint16``."""
    if _is_torch(x):
        name = str(x.dtype).rsplit(".", 1)[-1]
        try:
            return np.dtype(name)
        except TypeError:
            raise TypeError(f"torch dtype {x.dtype} has no NumPy counterpart.") from None
    return np.dtype(x.dtype)


def is_device_array(x):
    """True for numba device arrays and anything with ``__cuda_array_interface__``."""
    if _is_torch(x):     # (a bf16 tensor's __cuda_array_interface__ raises, not says no)
        return bool(getattr(x, "is_cuda", False))
    if config.ENABLE_CUDASIM:
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        return isinstance(x, FakeCUDAArray)
    return cuda.is_cuda_array(x)


def as_device(x, name):
    """Return ``(device_array, from_host)``: NumPy arrays are copied to the
    device, CUDA arrays (numba, PyTorch, CuPy, ...) are wrapped without a copy.
    bfloat16 arrives as uint16 bit patterns: a NumPy ``ml_dtypes.bfloat16``
    array is copied as its uint16 view, a ``torch.bfloat16`` tensor is wrapped
    through an int16 view of the same memory (``__cuda_array_interface__`` has
    no bf16) that the returned array keeps alive."""
    if isinstance(x, np.ndarray):
        return cuda.to_device(host_bits(x)), True
    if _is_torch(x) and logical_dtype(x) == BFLOAT16 and getattr(x, "is_cuda", False):
        import torch

        # the wrapper's memory pointer owns the int16 view, which holds the storage
        return cuda.as_cuda_array(x.view(torch.int16)).view(_BITS), False
    if is_device_array(x):
        if config.ENABLE_CUDASIM or cuda.devicearray.is_cuda_ndarray(x):
            return x, False
        return cuda.as_cuda_array(x), False
    raise TypeError(
        f"{name} must be a NumPy array or a CUDA array (__cuda_array_interface__), "
        f"but got {type(x).__name__}."
    )


def to_host(x, dtype=None):
    """A NumPy view or copy of ``x`` (device arrays are copied to the host).

    With ``dtype`` bfloat16, uint16 bit patterns come back viewed as
    ``ml_dtypes.bfloat16``; other dtypes leave the array as it is. A torch
    tensor comes back in its own logical dtype unless ``dtype`` says otherwise."""
    if dtype is None and _is_torch(x):
        dtype = logical_dtype(x)
    if isinstance(x, np.ndarray):
        host = x
    elif is_device_array(x):
        dev, _ = as_device(x, "array")
        host = dev.copy_to_host()
    elif _is_torch(x) and logical_dtype(x) == BFLOAT16:     # a CPU tensor; NumPy has no bf16
        import torch

        host = x.detach().contiguous().view(torch.int16).numpy().view(BFLOAT16)
    else:
        host = np.asarray(x)
    if dtype is not None and np.dtype(dtype) == BFLOAT16 and host.dtype == _BITS:
        host = host.view(BFLOAT16)
    return host


def host_bits(x):
    """A C-contiguous host array as the device stores it (bfloat16 as uint16),
    for ``copy_to_device``."""
    x = np.ascontiguousarray(x)
    return x.view(_BITS) if x.dtype == BFLOAT16 else x


def zeros(shape, dtype):
    """A zero-filled device array for logical ``dtype`` (uint16 for bfloat16)."""
    dtype = storage_dtype(dtype)
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
