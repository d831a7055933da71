"""Public KV scatter: validate, then launch ``kernels.write_kv``."""
import numpy as np

from . import _arrays, _launch
from . import _checks as C
from . import _validate as V
from .cache import kernel_scales
from .fp8 import is_fp8
from .kernels.write_kv import write_kv_kernel
from .layouts import vector_width


def write_kv(cache, key, value, slot_mapping, *, validate=True, stream=None):
    """Write new tokens' keys and values into their cache slots, in place.

    One launch covers prefill (many tokens of one sequence) and decode (one
    token for each of many sequences): token ``t`` goes to slot
    ``slot_mapping[t] = physical_block * block_size + offset``.

    Parameters
    ----------
    cache : PagedKVCache
    key, value : arrays, ``[num_tokens, num_kv_heads, head_size]``
        NumPy or CUDA arrays of the cache's dtype. For a bfloat16 cache: NumPy
        ``ml_dtypes.bfloat16`` arrays, ``torch.bfloat16`` CUDA tensors, or
        device arrays of the bf16 bit patterns (``uint16``). For an fp8
        cache: float16, bfloat16 or float32 (both of one dtype), stored as
        ``fp8(float32(x) / scale)`` with the cache's ``k_scale``/``v_scale``,
        rounded to nearest even and saturated at the format's largest finite
        value (:mod:`paged_numba.fp8`).
    slot_mapping : array of int, ``[num_tokens]``
        Slot of each token; ``-1`` marks a padding token, which is skipped.
        A NumPy or CUDA array, a list or a tuple.
    validate : bool
        Check shapes, dtypes and slots (in ``[-1, num_slots)``, no slot twice)
        before launching; device slot mappings are copied to the host for it.
        Without it a device slot outside the pool is not written but recorded,
        for :meth:`PagedKVCache.check` to raise.
    stream : optional
        Launch on this stream: a numba, PyTorch (``torch.cuda.Stream``) or
        CuPy stream, a raw ``cudaStream_t`` int, or None (the default stream).
        Ignored under the simulator, which runs every kernel synchronously.

    Examples
    --------
    >>> import numpy as np
    >>> from paged_numba import PagedKVCache, write_kv
    >>> cache = PagedKVCache(num_blocks=2, block_size=4, num_kv_heads=1, head_size=8)
    >>> k = np.ones((3, 1, 8), np.float16)
    >>> write_kv(cache, k, 2 * k, np.array([5, -1, 0]))   # block 1 offset 1; skip; block 0 offset 0
    >>> K, V = cache.gather([1, 0], 8)                    # logical order: block 1 then block 0
    >>> K[:, 0, 0].tolist(), V[:, 0, 0].tolist()
    ([0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0], [0.0, 2.0, 0.0, 0.0, 2.0, 0.0, 0.0, 0.0])

    bfloat16 goes in and comes out as ``ml_dtypes.bfloat16``:

    >>> import ml_dtypes
    >>> bf = PagedKVCache(num_blocks=1, block_size=4, num_kv_heads=1, head_size=8, dtype="bfloat16")
    >>> write_kv(bf, np.full((1, 1, 8), 1.5, ml_dtypes.bfloat16), np.zeros((1, 1, 8), ml_dtypes.bfloat16),
    ...          np.array([2]))
    >>> K, _ = bf.gather([0], 3)
    >>> K.dtype, K[:, 0, 0].tolist()
    (dtype(bfloat16), [0.0, 0.0, 1.5])

    An fp8 cache stores ``x / scale`` rounded to fp8 (1.3 / 0.5 = 2.6 -> 2.5):

    >>> f8 = PagedKVCache(num_blocks=1, block_size=4, num_kv_heads=1, head_size=16,
    ...                   dtype="float8_e4m3fn", k_scale=0.5)
    >>> write_kv(f8, np.full((1, 1, 16), 1.3, np.float16), np.zeros((1, 1, 16), np.float16), [1])
    >>> K, _ = f8.gather([0], 2)
    >>> K.dtype, K[:, 0, 0].astype(float).tolist()
    (dtype(float8_e4m3fn), [0.0, 2.5])
    """
    V.check_cache(cache)
    validate = C.flag("validate", validate)
    handle = _launch.stream_handle(stream)
    ns = _launch.numba_stream(handle)    # uploads go ahead of the kernel, reads after the caller's writes
    k, _ = _arrays.as_device(key, "key", ns)
    v, _ = _arrays.as_device(value, "value", ns)
    expected = (cache.num_kv_heads, cache.head_size)
    dtypes = []
    for name, x, given in (("key", k, key), ("value", v, value)):
        V.check_ndim(name, x, 3, "[num_tokens, num_kv_heads, head_size]")
        if V.shape_of(x)[1:] != expected:
            raise ValueError(
                f"{name} must be [num_tokens, {expected[0]}, {expected[1]}] for this cache, "
                f"but got {V.shape_of(x)}.")
        # the caller's array: bf16 is uint16 on device
        dtypes.append(V.compute_dtype(name, given, cache))
    if dtypes[0] != dtypes[1]:
        raise ValueError(f"key and value must have the same dtype, but got "
                         f"{dtypes[0].name} and {dtypes[1].name}.")
    if V.shape_of(k) != V.shape_of(v):
        raise ValueError(
            f"key and value must have the same shape, but got {V.shape_of(k)} and {V.shape_of(v)}.")
    num_tokens = k.shape[0]
    if isinstance(slot_mapping, (list, tuple)):
        slot_mapping = C.int_sequence("slot_mapping", slot_mapping)
    host = isinstance(slot_mapping, np.ndarray)
    if not host:
        slots, _ = _arrays.as_device(slot_mapping, "slot_mapping", ns)   # TypeError if no array
    V.check_int_array("slot_mapping", slot_mapping)
    if not host and _arrays.logical_dtype(slot_mapping) == np.uint64:
        # the kernel reads slots as int64: 2**64 - 1 would be -1, padding, unrecorded
        raise ValueError("slot_mapping on the device must be signed (int64 or int32: -1 marks "
                         "padding), but got dtype uint64.")
    if len(slot_mapping.shape) != 1 or slot_mapping.shape[0] != num_tokens:
        raise ValueError(
            f"slot_mapping must be [num_tokens] = [{num_tokens}], but got shape "
            f"{V.shape_of(slot_mapping)}.")
    slots_host = slot_mapping if host else (slots.copy_to_host(stream=ns) if validate else None)
    if (validate or host) and num_tokens:
        # compared in the array's own dtype, before any cast (a uint64 2**64 - 1 is not -1)
        bad = np.flatnonzero((slots_host < -1) | (slots_host >= cache.num_slots))
        if bad.size:
            t = int(bad[0])
            raise ValueError(
                f"slot_mapping[{t}] is {int(slots_host[t])}, outside [0, {cache.num_slots}) "
                f"(-1 marks padding).")
    if host:
        slots_host = slots_host.astype(np.int64)
        slots, _ = _arrays.as_device(slots_host, "slot_mapping", ns)
    if validate and num_tokens:
        real = slots_host[slots_host >= 0]
        uniq, counts = np.unique(real, return_counts=True)
        if (counts > 1).any():
            raise ValueError(
                f"slot {int(uniq[counts > 1][0])} appears more than once in slot_mapping.")
    if num_tokens:
        fmt = cache.dtype.name if is_fp8(cache.dtype) else None     # fp8: quantise on the way
        kernel = write_kv_kernel(cache.block_size, cache.layout, vector_width(cache.dtype), fp8=fmt)
        _launch.launch(kernel, num_tokens, 128,
                       (cache.key_cache, cache.value_cache, k, v, slots, cache.errors,
                        *kernel_scales(cache)),
                       stream=handle)
