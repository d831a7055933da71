"""Working on the caller's own arrays: caches over existing device pools,
results in the caller's library and buffers.

* :func:`from_device` (``PagedKVCache.from_device``) makes a cache whose
  pools *are* the caller's device arrays (numba device arrays, PyTorch or
  CuPy tensors, anything with ``__cuda_array_interface__`` or DLPack): no
  copy, and every write through the kernels lands in the caller's memory.
  The cache keeps references to the caller's objects, so they stay alive as
  long as the cache does; the caller keeps ownership.
* :class:`Results` gives a public function its result arrays: a NumPy
  input gets NumPy results, a torch tensor torch tensors (on its device), a
  CuPy array CuPy arrays, a numba device array numba device arrays; and
  the caller's ``out=``/``lse=`` buffers, checked before any launch, are
  written in place and returned.

Neither torch nor CuPy is imported unless the caller's array comes from it.

Under Numba's CUDA simulator the "device" is the host: NumPy arrays, numba
simulator device arrays and CPU torch tensors are the device arrays there
(wrapped without a copy), so what the kernels write shows in them at once.
On a GPU a NumPy pool is refused by :func:`from_device`
(:meth:`PagedKVCache.from_host` copies host pools).

>>> import numpy as np
>>> from paged_numba import merge_states
>>> v, s = np.ones((1, 2, 1, 8), np.float32), np.zeros((1, 2, 1), np.float32)  # two equal states
>>> out, lse = np.empty((1, 1, 8), np.float32), np.empty((1, 1), np.float32)
>>> got = merge_states(v, s, out=out, lse=lse)
>>> got[0] is out, got[1] is lse, float(out[0, 0, 0])
(True, True, 1.0)
>>> merge_states(v, s, out=np.empty((1, 1, 4), np.float32))
Traceback (most recent call last):
    ...
ValueError: out must be [1, 1, 8], but got shape (1, 1, 4).
"""
import numpy as np
from numba import config, cuda

from . import _arrays
from . import _checks as C
from . import _validate as V
from .fp8 import is_fp8
from .layouts import cache_shapes, check_layout, infer_geometry

ALIGNMENT = 16      # bytes: the kernels' vector loads need 16-byte aligned pools


# -- device views of the caller's arrays


def _simulator_view(x, name):
    """Under the simulator: a simulator device array viewing ``x``'s memory."""
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    if isinstance(x, FakeCUDAArray):
        return x
    if _arrays._is_torch(x):
        if not _arrays._torch_on_device(x):
            raise TypeError(f"{name} must be a CPU tensor under the simulator, but it is on "
                            f"{x.device}.")
        return _arrays.as_device(x, name)[0]
    if isinstance(x, np.ndarray):
        return FakeCUDAArray(x.view(_arrays.storage_dtype(x.dtype)))
    if hasattr(x, "__dlpack__"):
        return FakeCUDAArray(np.from_dlpack(x))
    raise TypeError(f"{name} must be a device array (under the simulator: a NumPy array, a "
                    f"numba device array or a CPU torch tensor), but got {type(x).__name__}.")


def _dlpack_view(x, name):
    """A numba device array viewing DLPack object ``x`` (on a GPU)."""
    from cuda.core.utils import StridedMemoryView

    smv = StridedMemoryView.from_dlpack(x, stream_ptr=-1)
    if not smv.is_device_accessible:
        raise TypeError(f"{name} must be in device memory, but its DLPack capsule is host memory.")
    dtype = np.dtype(smv.dtype)
    strides = None if smv.strides is None else tuple(s * dtype.itemsize for s in smv.strides)
    desc = {"shape": tuple(smv.shape), "strides": strides, "typestr": dtype.str,
            "data": (int(smv.ptr), bool(smv.readonly)), "version": 3}
    return cuda.from_cuda_array_interface(desc, owner=x)


def device_view(x, name):
    """A device array viewing ``x``'s memory without a copy (bfloat16 as
    uint16 bits), or ``TypeError`` naming ``name`` when ``x`` is not device
    memory. Under the simulator NumPy arrays and CPU torch tensors count."""
    if config.ENABLE_CUDASIM:
        return _simulator_view(x, name)
    if isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a device array, but got a NumPy array (host memory; "
                        f"PagedKVCache.from_host copies host pools).")
    if _arrays._is_torch(x) and not _arrays._torch_on_device(x):
        raise TypeError(f"{name} must be a CUDA tensor, but it is on {x.device}.")
    if _arrays.is_device_array(x):
        return _arrays.as_device(x, name)[0]
    if hasattr(x, "__dlpack__"):
        return _dlpack_view(x, name)
    raise TypeError(f"{name} must be a device array (__cuda_array_interface__ or DLPack), but got "
                    f"{type(x).__name__}.")


def _logical(x, dev):
    """The logical dtype of the caller's pool ``x``: its own, bfloat16 for
    torch.bfloat16, and bfloat16 for a device array of uint16 bits (as the
    caches store it)."""
    try:
        dt = _arrays.logical_dtype(x)
    except (AttributeError, TypeError):   # no dtype (DLPack alone), or one NumPy does not know
        dt = np.dtype(dev.dtype)
    if dt == np.uint16 and not isinstance(x, np.ndarray):
        return _arrays.BFLOAT16
    return dt


def address(dev):
    """The device address of the first element of device array ``dev``."""
    if config.ENABLE_CUDASIM:
        return int(dev._ary.__array_interface__["data"][0])
    return int(dev.__cuda_array_interface__["data"][0])


def _span(dev):
    start = address(dev)
    return start, start + int(dev.size) * np.dtype(dev.dtype).itemsize


def overlaps(a, b):
    """Whether device arrays ``a`` and ``b`` share any byte (by address ranges)."""
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1 and a1 > a0 and b1 > b0


def _check_pool(name, dev):
    if not dev.is_c_contiguous():
        raise ValueError(f"{name} must be C-contiguous, but got shape {V.shape_of(dev)} with "
                         f"strides {tuple(dev.strides)}.")
    if address(dev) % ALIGNMENT:
        raise ValueError(f"{name} must start on a {ALIGNMENT}-byte boundary, but its address is "
                         f"{address(dev)} ({address(dev) % ALIGNMENT} bytes past one).")


def from_device(cls, key_cache, value_cache, layout="nhd", num_layers=None, *, k_scale=None,
                v_scale=None, dtype=None):
    """A ``cls`` (PagedKVCache) whose pools are the caller's device arrays.

    See :meth:`paged_numba.PagedKVCache.from_device` for the parameters.
    Every check (the fp8 scales' too) runs before the cache exists, so a
    refused pool is left as it was.
    """
    check_layout(layout)
    for name, pool in (("key_cache", key_cache), ("value_cache", value_cache)):
        if isinstance(pool, np.ndarray) and not pool.flags.writeable:
            raise ValueError(f"{name} must be writeable (write_kv and the block movers write "
                             f"the pools), but got a read-only array.")
    k = device_view(key_cache, "key_cache")
    v = device_view(value_cache, "value_cache")
    kdt, vdt = _logical(key_cache, k), _logical(value_cache, v)
    from .cache import _cache_dtype, checked_scales

    if dtype is not None:       # the pools hold it, or its bits (uint8 codes, uint16)
        dtype = _cache_dtype(dtype)
        bits = _arrays.storage_dtype(dtype)
        for name, got in (("key_cache", kdt), ("value_cache", vdt)):
            if got not in (dtype, bits):
                held = dtype.name if bits == dtype else f"{dtype.name} or its {bits.name} bits"
                raise ValueError(f"{name} must hold {held} for dtype={dtype.name}, but got "
                                 f"{got.name}.")
    elif kdt != vdt:
        raise ValueError(f"key_cache and value_cache must have the same dtype, but got {kdt.name} "
                         f"and {vdt.name}.")
    elif kdt == np.uint8:
        raise ValueError("key_cache and value_cache hold uint8: pass dtype='float8_e4m3fn' or "
                         "dtype='float8_e5m2' to say which fp8 format their codes are in.")
    else:
        dtype = _cache_dtype(kdt)
    for name, dev in (("key_cache", k), ("value_cache", v)):
        if np.dtype(dev.dtype) != _arrays.storage_dtype(dtype):
            raise ValueError(f"{name} must hold {dtype.name} as "
                             f"{_arrays.storage_dtype(dtype).name}, but got "
                             f"{np.dtype(dev.dtype).name}.")
    kshape, vshape = V.shape_of(k), V.shape_of(v)
    if layout != "vllm" and kshape != vshape:
        raise ValueError(f"key_cache and value_cache must have the same shape in layout "
                         f"{layout!r}, but got {kshape} and {vshape}.")
    if num_layers is not None:
        num_layers = C.integer("num_layers", num_layers, lo=1, hi=C.INT32_MAX)
        for name, shape in (("key_cache", kshape), ("value_cache", vshape)):
            if not shape or shape[0] != num_layers:
                raise ValueError(f"{name} must have a leading [num_layers] = [{num_layers}] axis, "
                                 f"but got shape {shape}.")
        kshape, vshape = kshape[1:], vshape[1:]
    geometry = infer_geometry(kshape, vshape, layout, dtype)
    for what, n in zip(("num_blocks", "block_size", "num_kv_heads", "head_size"), geometry):
        if n < 1:
            raise ValueError(f"the pools give {what} = {n}; it must be at least 1 (shape "
                             f"{V.shape_of(k)}).")
    if is_fp8(dtype) and geometry[3] % 16:
        raise ValueError(f"an fp8 cache needs head_size to be a multiple of 16 (one 16-byte "
                         f"vector), but the pools give head_size={geometry[3]}.")
    scales = checked_scales(dtype, geometry[2], k_scale, v_scale)
    _check_pool("key_cache", k)
    _check_pool("value_cache", v)
    if layout == "interleaved":
        if address(k) != address(v):
            raise ValueError("layout 'interleaved' has one pool: pass the same array as key_cache "
                             "and value_cache, but they are different memory.")
    elif overlaps(k, v):
        raise ValueError("key_cache and value_cache share memory; they must be two separate "
                         "pools (only layout 'interleaved' has one).")
    cache = object.__new__(cls)
    cache.num_blocks, cache.block_size, cache.num_kv_heads, cache.head_size = geometry
    cache.dtype, cache.layout, cache.num_layers = dtype, layout, num_layers
    cache.key_shape, cache.value_shape = cache_shapes(layout, *geometry, dtype)
    cache.key_cache = k
    cache.value_cache = k if layout == "interleaved" else v
    cache._owners = (key_cache, value_cache)     # the caller's objects, kept alive
    if scales is not None:
        cache._set_scales(*scales)
    return cache


# -- result arrays in the caller's library and buffers


def _check_buffer(name, given, shape, dtype, like, host):
    """The device view of the caller's result buffer ``given`` (None for a
    NumPy one: it is filled after the launch), after checking its kind,
    shape, dtype, contiguity and device."""
    what = ("a NumPy array (the input is NumPy)" if host
            else "a device array (the input is one): numba, PyTorch or CuPy")
    if host != isinstance(given, np.ndarray) or not (host or _arrays.is_device_array(given)):
        raise TypeError(f"{name} must be {what}, but got {type(given).__name__}.")
    got_shape = V.shape_of(given)
    if got_shape != tuple(shape):
        raise ValueError(f"{name} must be {list(shape)}, but got shape {got_shape}.")
    if not V.dtype_matches(given, dtype):
        raise ValueError(f"{name} must be {np.dtype(dtype).name}, but got "
                         f"{_arrays.logical_dtype(given).name}.")
    if host:
        if not given.flags.c_contiguous:
            raise ValueError(f"{name} must be C-contiguous, but got strides {given.strides}.")
        if not given.flags.writeable:
            raise ValueError(f"{name} must be writeable.")
        return None
    dev = _arrays.as_device(given, name)[0]
    if not dev.is_c_contiguous():
        raise ValueError(f"{name} must be C-contiguous, but got strides {tuple(dev.strides)}.")
    if _arrays._is_torch(given) and _arrays._is_torch(like) and given.device != like.device:
        raise ValueError(f"{name} must be on the input's device {like.device}, but it is on "
                         f"{given.device}.")
    return dev


class Results:
    """The result arrays of one call: ``out`` ``out_shape`` in ``out_dtype``
    and ``lse`` ``lse_shape`` float32, for input ``like`` (the caller's array
    whose library the results follow).

    ``out``/``lse`` given by the caller are checked here (kind, shape, dtype,
    C-contiguity, device, no memory shared with each other or with the
    device arrays ``inputs``), before any launch; the kernels then write
    device buffers in place, and NumPy buffers get the results copied in
    after the launch. Those not given are allocated in ``like``'s library,
    or are ``spare``'s numba device arrays ``(out, lse)`` (a plan's own,
    say) where the caller gets NumPy or numba results. New arrays are zeroed,
    and NumPy results copied back, on numba stream ``stream``: the launch's.

    Attributes
    ----------
    out, lse : device arrays
        What the kernels write.
    """

    def __init__(self, like, out, lse, out_shape, out_dtype, lse_shape, inputs=(), spare=None,
                 stream=0):
        self.host = isinstance(like, np.ndarray)
        self._stream = stream
        self.dtype = np.dtype(out_dtype)
        self._given = (out, lse)
        views = []
        for name, given, shape, dt in (("out", out, out_shape, out_dtype),
                                       ("lse", lse, lse_shape, np.float32)):
            views.append(None if given is None
                         else _check_buffer(name, given, shape, dt, like, self.host))
        if out is not None and lse is not None:
            shared = (np.shares_memory(out, lse) if self.host
                      else overlaps(views[0], views[1]))
            if shared:
                raise ValueError("out and lse share memory; they must be separate buffers.")
        for name, view in zip(("out", "lse"), views):
            for inp_name, inp in inputs:
                if view is not None and overlaps(view, inp):
                    raise ValueError(f"{name} shares memory with {inp_name}; the kernels read "
                                     f"{inp_name} while they write {name}.")
        self._results = [None, None]
        plain = not (_arrays._is_torch(like) or _arrays._is_cupy(like))
        devs = []
        for j, (view, shape, dt) in enumerate(zip(views, (out_shape, lse_shape),
                                                  (out_dtype, np.float32))):
            if view is not None:
                devs.append(view)
            elif spare is not None and plain:
                devs.append(spare[j])
                self._results[j] = spare[j]
            elif self.host:
                devs.append(_arrays.zeros(shape, dt, stream))
            else:
                dev, self._results[j] = _arrays.zeros_like_input(like, shape, dt, stream)
                devs.append(dev)
        self.out, self.lse = devs

    def finish(self, return_lse):
        """The results as the caller gets them: the caller's own buffers where
        given (NumPy ones filled now), else the new arrays."""
        results = []
        for given, dev, made, dt in zip(self._given, (self.out, self.lse), self._results,
                                        (self.dtype, np.float32)):
            if not self.host:
                results.append(given if given is not None else made)
            elif given is not None:
                dev.copy_to_host(given.view(_arrays.storage_dtype(dt)), stream=self._stream)
                results.append(given)
            else:
                results.append(_arrays.to_host(dev, dt, self._stream))
        return tuple(results) if return_lse else results[0]


def cache_inputs(cache):
    """``(name, device array)`` of ``cache``'s pools, for the overlap checks of
    ``out=``/``lse=`` (a result written over the pools would corrupt them)."""
    return (("the cache's key pool", cache.key_cache),
            ("the cache's value pool", cache.value_cache))


def plan_buffer(name, given, shape, dtype, like, inputs=()):
    """The device view of ``out=``/``lse=`` given to a plan's ``run`` (None
    for None), checked as :class:`Results` checks them (device arrays only)."""
    if given is None:
        return None
    dev = _check_buffer(name, given, shape, dtype, like, False)
    for inp_name, inp in inputs:
        if overlaps(dev, inp):
            raise ValueError(f"{name} shares memory with {inp_name}; the kernels read "
                             f"{inp_name} while they write {name}.")
    return dev


class LikeInput:
    """Plan-owned device results seen as arrays of the caller's library
    (:func:`paged_numba._arrays.view_like_input`), made once per library."""

    def __init__(self):
        self._views = {}

    def __call__(self, dev, like, dtype):
        key = (type(like), id(dev))         # a plan's buffers live on one device
        view = self._views.get(key)
        if view is None:
            if not (_arrays._is_torch(like) or _arrays._is_cupy(like)):
                return dev
            view = self._views[key] = (dev, _arrays.view_like_input(dev, like, dtype))
        return view[1]
