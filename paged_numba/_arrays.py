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

PyTorch and CuPy results are allocated in the caller's library
(:func:`zeros_like_input`) or viewed as its arrays without a copy
(:func:`view_like_input`); neither library is imported unless the caller's
array comes from it. Under the simulator, "device" memory is host memory:
a CPU torch tensor there is taken as a device array (wrapped without a copy),
as a CUDA tensor is on a GPU.

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

from ._launch import stream_handle

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
_BITS = np.dtype(np.uint16)     # how bfloat16 is stored on the device


def storage_dtype(dtype):
    """The dtype of device arrays holding logical ``dtype``: uint16 for bfloat16,
    uint8 for the fp8 formats (their codes)."""
    dtype = np.dtype(dtype)
    if dtype == BFLOAT16:
        return _BITS
    if dtype.name in ("float8_e4m3fn", "float8_e5m2"):
        return np.dtype(np.uint8)
    return dtype


def _is_torch(x):
    return type(x).__module__.split(".")[0] == "torch" and hasattr(x, "dtype")


def _is_cupy(x):
    return type(x).__module__.split(".")[0] == "cupy" and hasattr(x, "dtype")


def _torch_on_device(x):
    """A torch tensor the kernels can read in place: a CUDA tensor, or under
    the simulator a CPU one (the simulator's device memory is host memory)."""
    return bool(getattr(x, "is_cuda", False)) or (
        bool(config.ENABLE_CUDASIM) and getattr(x.device, "type", None) == "cpu")


def _fake_device(host):
    """A simulator device array viewing NumPy array ``host`` (no copy)."""
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    return FakeCUDAArray(host)


def _torch_host_view(x):
    """A NumPy view of CPU tensor ``x``'s memory (bfloat16 as its uint16 bits)."""
    import torch

    x = x.detach()
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(_BITS)
    return x.numpy()


def torch_dtype(dtype):
    """The torch dtype of logical NumPy ``dtype`` (bfloat16 included)."""
    import torch

    return getattr(torch, np.dtype(dtype).name)


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
        return _torch_on_device(x)
    if config.ENABLE_CUDASIM:
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        return isinstance(x, FakeCUDAArray)
    return cuda.is_cuda_array(x)


def require_device(caller, **arrays):
    """Raise a ``TypeError`` naming ``caller`` and the first of ``arrays``
    (name: value) that is not a device array (:func:`is_device_array`)."""
    for name, x in arrays.items():
        if not is_device_array(x):
            raise TypeError(f"{caller} needs device arrays, but {name} is {type(x).__name__}.")


def as_device(x, name, stream=None):
    """Return ``(device_array, from_host)``: NumPy arrays are copied to the
    device, CUDA arrays (numba, PyTorch, CuPy, ...) are wrapped without a copy.
    The copy goes on numba stream ``stream`` (0: the legacy default stream),
    ahead of the kernels launched next on it; with ``stream`` None it has
    landed when this returns (a pageable ``cuMemcpyHtoD`` may return before
    its DMA is done), so kernels on any stream may read it.
    bfloat16 arrives as uint16 bit patterns: a NumPy ``ml_dtypes.bfloat16``
    array is copied as its uint16 view, a ``torch.bfloat16`` tensor is wrapped
    through an int16 view of the same memory (``__cuda_array_interface__`` has
    no bf16) that the returned array keeps alive. Under the simulator a CPU
    torch tensor is wrapped without a copy too."""
    if isinstance(x, np.ndarray):
        dev = cuda.to_device(host_bits(x), stream=0 if stream is None else stream)
        if stream is None:
            default_stream_done()
        return dev, True
    if _is_torch(x) and config.ENABLE_CUDASIM and _torch_on_device(x):
        return _fake_device(_torch_host_view(x)), False
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


def to_host(x, dtype=None, stream=0):
    """A NumPy view or copy of ``x`` (device arrays are copied to the host,
    after the work enqueued before on numba stream ``stream``).

    With ``dtype`` bfloat16, uint16 bit patterns come back viewed as
    ``ml_dtypes.bfloat16``; other dtypes leave the array as it is. A torch
    tensor comes back in its own logical dtype unless ``dtype`` says otherwise."""
    if dtype is None and _is_torch(x):
        dtype = logical_dtype(x)
    if isinstance(x, np.ndarray):
        host = x
    elif is_device_array(x):
        dev, _ = as_device(x, "array")
        host = dev.copy_to_host(stream=stream)
        if stream:
            stream.synchronize()
    elif _is_torch(x) and logical_dtype(x) == BFLOAT16:     # a CPU tensor; NumPy has no bf16
        import torch

        host = x.detach().contiguous().view(torch.int16).numpy().view(BFLOAT16)
    else:
        host = np.asarray(x)
    if dtype is not None and np.dtype(dtype) == BFLOAT16 and host.dtype == _BITS:
        host = host.view(BFLOAT16)
    return host


def host_bits(x):
    """A C-contiguous host array as the device stores it (:func:`storage_dtype`:
    bfloat16 as uint16, fp8 as its uint8 codes), for ``copy_to_device``."""
    x = np.ascontiguousarray(x)
    return x.view(storage_dtype(x.dtype))


def zeros(shape, dtype, stream=None):
    """A zero-filled device array for logical ``dtype`` (uint16 for bfloat16).

    With ``stream`` None the zeros have landed when this returns, so kernels
    on any stream may use the array (a plan's buffers, a cache's pools);
    with a numba stream (0: the legacy default stream) the fill is enqueued
    there, ahead of the kernels the caller launches next on it. (``cuMemsetD8``
    returns before it is done, and a non-blocking stream, which every torch
    stream is, does not wait for the default one.)"""
    dtype = storage_dtype(dtype)
    arr = cuda.device_array(shape, dtype=dtype)
    if config.ENABLE_CUDASIM:
        arr.copy_to_device(np.zeros(shape, dtype=dtype))
    elif arr.size:
        from numba.cuda.cudadrv.driver import device_memset

        device_memset(arr, 0, arr.nbytes, stream=0 if stream is None else stream)
        if stream is None:
            default_stream_done()
    return arr


def zeros_like_input(x, shape, dtype, stream=0):
    """A zero-filled result ``shape`` of logical ``dtype`` in the library of
    input ``x``: ``(device array the kernels write, the caller's result)``.
    A torch tensor (on ``x``'s device) for torch input, a CuPy array for CuPy
    input, else a numba device array (both members the same array). The fill
    is enqueued on numba stream ``stream`` (0: the default stream), the one
    the kernels that write the result launch on; the torch and CuPy
    allocators then also tie the memory to that stream."""
    handle = stream_handle(stream)
    if _is_torch(x) and _torch_on_device(x):
        import torch

        if config.ENABLE_CUDASIM:       # a CPU tensor: no streams
            result = torch.zeros(tuple(shape), dtype=torch_dtype(dtype), device=x.device)
        else:
            on = (torch.cuda.ExternalStream(handle, device=x.device) if handle
                  else torch.cuda.default_stream(x.device))
            with torch.cuda.stream(on):
                result = torch.zeros(tuple(shape), dtype=torch_dtype(dtype), device=x.device)
        return as_device(result, "out")[0], result
    if _is_cupy(x):
        import cupy

        with cupy.cuda.Device(x.device.id), (cupy.cuda.ExternalStream(handle) if handle
                                             else cupy.cuda.Stream.null):
            result = cupy.zeros(tuple(shape), storage_dtype(dtype))
        return as_device(result, "out")[0], result
    dev = zeros(shape, dtype, stream)
    return dev, dev


def default_stream_done():
    """Wait for the work on the default stream (uploads and fills made there
    with stream 0), so that kernels on any stream may use what it made; a
    no-op under the simulator."""
    if not config.ENABLE_CUDASIM:
        cuda.default_stream().synchronize()


def synchronize():
    """Wait for all work on the current device, on every stream (a no-op
    under the simulator, where kernels run as they are called)."""
    if not config.ENABLE_CUDASIM:
        cuda.synchronize()


def view_like_input(dev, x, dtype):
    """Device array ``dev`` (logical ``dtype``) seen, without a copy, as an
    array of input ``x``'s library: a torch tensor for torch input (sharing
    ``dev``'s memory, which it keeps alive), a CuPy array for CuPy input, else
    ``dev`` itself."""
    bf16 = np.dtype(dtype) == BFLOAT16
    if _is_torch(x) and _torch_on_device(x):
        import torch

        if config.ENABLE_CUDASIM:
            host = dev._ary
            t = torch.from_numpy(host.view(np.int16) if bf16 else host)
        else:
            t = torch.as_tensor(dev.view(np.int16) if bf16 else dev, device=x.device)
        return t.view(torch.bfloat16) if bf16 else t
    if _is_cupy(x):
        import cupy

        return cupy.asarray(dev)
    return dev


def sm_count(default=132):
    """Multiprocessors on the current device (``default`` under the simulator)."""
    if config.ENABLE_CUDASIM:
        return default
    return cuda.get_current_device().MULTIPROCESSOR_COUNT
