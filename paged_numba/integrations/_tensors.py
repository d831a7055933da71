"""PyTorch tensors in and out of the kernels, on two separate paths.

* Host path (CPU tensors; every tensor under Numba's CUDA simulator, whose
  "device" is the host): a tensor goes to the kernels as a NumPy view of its
  memory, and NumPy results come back as tensors viewing them.
* Device path (CUDA tensors on a GPU): a tensor goes to the kernels as a
  numba device array made by ``numba.cuda.as_cuda_array`` over its memory
  (``__cuda_array_interface__``), and device results come back through
  ``torch.as_tensor`` on the same memory: no host copy either way.

bfloat16 travels as its uint16 bit patterns on both paths (the kernels'
storage type; NumPy's side is ``ml_dtypes.bfloat16``).

On the device path the kernels launch on torch's current stream
(:func:`launch_stream`): after torch's work that made their inputs, before
torch's work that reads their results, with no wait on the host.

Plain functions of tensors; torch is imported only where a tensor is made.
"""
import ml_dtypes
import numpy as np
from numba import config, cuda

from .. import _launch

_BF16 = np.dtype(ml_dtypes.bfloat16)


def on_device(t):
    """Whether tensor ``t`` takes the device path: a CUDA tensor, simulator off."""
    return bool(getattr(t, "is_cuda", False)) and not config.ENABLE_CUDASIM


def _is_bf16(t):
    return str(t.dtype) == "torch.bfloat16"


# -- into the kernels


def host_array(t):
    """A NumPy view of CPU tensor ``t`` (a copy if it is not contiguous or on
    a GPU), ``ml_dtypes.bfloat16`` for a bf16 tensor."""
    t = t.detach()
    if t.is_cuda:
        t = t.cpu()
    t = t.contiguous()
    if _is_bf16(t):
        import torch

        return t.view(torch.int16).numpy().view(_BF16)
    return t.numpy()


def device_array(t):
    """A numba device array over CUDA tensor ``t``'s memory (made contiguous
    on the device first), uint16 bits for a bf16 tensor. The array's owner
    keeps the tensor alive. ``sync=False``: importing does not wait for
    torch's stream (the kernels that read the array are ordered after torch's
    work by launching on its current stream, :func:`launch_stream`)."""
    t = t.detach().contiguous()
    if _is_bf16(t):
        import torch

        return cuda.as_cuda_array(t.view(torch.int16), sync=False).view(np.uint16)
    return cuda.as_cuda_array(t, sync=False)


def kernel_array(t):
    """Tensor ``t`` as the kernels take it: :func:`device_array` on the
    device path, :func:`host_array` on the host path."""
    return device_array(t) if on_device(t) else host_array(t)


def launch_stream(like):
    """The stream for the kernels of tensor ``like``: torch's current stream
    on its device on the device path (transformers' engine computes on a
    stream of its own), None (the default stream) on the host path, where
    the simulator runs every kernel at once."""
    if not on_device(like):
        return None
    import torch

    return torch.cuda.current_stream(like.device)


def kernel_ints(x, stream=None):
    """Host integer array ``x`` (slots, a block table, lengths) as an int32
    device array, uploaded once a step so that every layer's launches read
    the same copy (under the simulator a copy in host memory).

    The copy goes through the default stream, where the kernels' validation
    reads it back; a ``stream`` other than the default one (anything
    :func:`paged_numba._launch.stream_handle` takes) then waits for it on
    the device (an event; the host does not wait)."""
    dev = cuda.to_device(np.ascontiguousarray(x, dtype=np.int32))
    if _launch.stream_handle(stream):              # 0: the default stream, or the simulator
        copied = cuda.event(timing=False)
        copied.record()
        copied.wait(_launch.numba_stream(stream))
    return dev


# -- out of the kernels


def to_torch(x, like):
    """Kernel result ``x`` as a tensor on ``like``'s device and in its dtype:
    a NumPy array is viewed (``torch.from_numpy``) and moved if ``like`` is on
    a GPU; a numba device array is viewed in place (``torch.as_tensor``) for
    a CUDA ``like``, copied to the host for a CPU one."""
    import torch

    if isinstance(x, torch.Tensor):
        return x
    bf16 = _is_bf16(like)
    if isinstance(x, np.ndarray):
        host = x.view(np.int16) if bf16 or x.dtype == _BF16 else x
        out = torch.from_numpy(np.ascontiguousarray(host))
        out = out.view(torch.bfloat16) if bf16 else out
        return out.to(like.device) if out.device != like.device else out
    if config.ENABLE_CUDASIM or not like.is_cuda:   # to host memory (the simulator's is)
        return to_torch(x.copy_to_host(), like)
    out = torch.as_tensor(x.view(np.int16) if bf16 else x, device=like.device)
    return out.view(torch.bfloat16) if bf16 else out


# -- the caller's pools as a cache


def wrap_nhd(key_pool, value_pool):
    """A :class:`paged_numba.PagedKVCache` (layout ``"nhd"``) whose pools are
    the tensors ``key_pool``/``value_pool`` ``[num_blocks, block_size,
    num_kv_heads, head_size]`` themselves: writes through the kernels land in
    them (``PagedKVCache.from_device``, no copy)."""
    from ..cache import PagedKVCache

    if tuple(key_pool.shape) != tuple(value_pool.shape) or key_pool.dtype != value_pool.dtype:
        raise ValueError(f"key and value pools must match, but got {tuple(key_pool.shape)} "
                         f"{key_pool.dtype} and {tuple(value_pool.shape)} {value_pool.dtype}.")
    if not (key_pool.is_contiguous() and value_pool.is_contiguous()):
        raise ValueError("the pools must be contiguous tensors (a copy would not be written back).")
    return PagedKVCache.from_device(key_pool, value_pool, layout="nhd")
