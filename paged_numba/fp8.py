"""8-bit floating-point KV caches on the host: formats, scales, quantisation.

Two formats, as ``ml_dtypes`` and PyTorch name them:

==================  ============  ====  =======  ============  ================
name                bits (s/e/m)  bias  max      smallest      inf / NaN
==================  ============  ====  =======  ============  ================
``float8_e4m3fn``   1 / 4 / 3     7     448      2**-9         no inf; S.1111.111
``float8_e5m2``     1 / 5 / 2     15    57344    2**-16        S.11111.00 / .xx
==================  ============  ====  =======  ============  ================

A cache of either format stores ``q = fp8(x / scale)`` and means ``q *
scale``, with one float32 ``scale`` per tensor (K or V of every layer) or
one per KV head ``[num_kv_heads]``. The rounding, here and in the device
``write_kv`` (``paged_numba.kernels.fp8``), is bit for bit the same:

* ``x / scale`` is computed in float32 (``x`` in fp16, bf16 or fp32);
* it is rounded to the nearest fp8 value, ties to even (mantissa bit 0);
* a result beyond the largest finite value, and ``+-inf``, *saturate* to
  ``+-max`` (448 or 57344), as CUDA's ``cvt.rn.satfinite`` and vLLM's
  ``scaled_fp8_conversion`` do (``ml_dtypes`` itself gives NaN for E4M3FN
  and inf for E5M2 there): a cache never holds an inf, so no outlier turns a
  whole attention row into NaN;
* NaN stays NaN with its sign (``0x7F`` / ``0xFF`` in E4M3FN, ``0x7E`` /
  ``0xFE`` in E5M2, the patterns ``ml_dtypes`` uses).

So ``quantize(x, s, fmt) == ml_dtypes_cast(clip(float32(x) / float32(s),
-max, max))``, which :func:`quantize` computes and the tests check the
device conversion against on every fp16 and bf16 bit pattern.

This module is plain NumPy (no numba).

Examples
--------
>>> import numpy as np
>>> q = quantize(np.array([1.0, 0.3, 500.0, -np.inf, np.nan], np.float32), 1.0, "float8_e4m3fn")
>>> q.dtype, q.astype(np.float32).tolist()       # 0.3 -> 0.3125 (nearest); 500 and -inf saturate
(dtype(float8_e4m3fn), [1.0, 0.3125, 448.0, -448.0, nan])
>>> dequantize(quantize([3.0, 0.1], 0.5, "float8_e5m2"), 0.5)   # 3 / 0.5 = 6 is exact; 0.2 is not
array([3.     , 0.09375])
"""
import math
import reprlib

import ml_dtypes
import numpy as np

FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
FP8_NUMPY = {name: np.dtype(getattr(ml_dtypes, name)) for name in FP8_DTYPES}   # host dtypes
QUERY_DTYPES = ("float16", "bfloat16", "float32")   # what attends over an fp8 cache


def fp8_name(dtype):
    """The format's name if ``dtype`` is one of :data:`FP8_DTYPES`, else None.

    >>> fp8_name("float8_e5m2"), fp8_name(np.float16), fp8_name("foo")
    ('float8_e5m2', None, None)
    """
    try:
        name = np.dtype(dtype).name
    except TypeError:
        return None
    return name if name in FP8_DTYPES else None


def is_fp8(dtype):
    """True for the two fp8 cache dtypes (a name or a NumPy dtype)."""
    return fp8_name(dtype) is not None


def _format(dtype):
    name = fp8_name(dtype)
    if name is None:
        raise ValueError(f"dtype must be one of {FP8_DTYPES}, but got {dtype!r}.")
    return name


def check_scale(name, value, num_kv_heads):
    """``value`` as a float32 scalar (one scale for the tensor) or a float32
    ``[num_kv_heads]`` array (one per KV head), checked: every entry finite
    and positive in float32.

    Parameters
    ----------
    name : str
        ``"k_scale"`` or ``"v_scale"``, for the message.
    value : float or array_like, ``[]`` or ``[num_kv_heads]``
    num_kv_heads : int

    Returns
    -------
    numpy.float32 or numpy.ndarray of float32 ``[num_kv_heads]`` (a copy)

    Examples
    --------
    >>> check_scale("k_scale", 0.5, 2), check_scale("v_scale", [1, 2], 2)
    (np.float32(0.5), array([1., 2.], dtype=float32))
    >>> check_scale("k_scale", [1.0, 0.0], 2)
    Traceback (most recent call last):
        ...
    ValueError: k_scale[1] is 0.0; fp8 scales must be finite and positive in float32.
    >>> check_scale("v_scale", [1.0, 2.0, 3.0], 2)
    Traceback (most recent call last):
        ...
    ValueError: v_scale must be a number or an array [num_kv_heads] = [2], but got shape (3,).
    """
    if isinstance(value, (bool, np.bool_, str, bytes)) or value is None:
        raise ValueError(f"{name} must be a positive number or an array [num_kv_heads], but got "
                         f"{value!r}.")
    try:
        arr = np.array(value, dtype=np.float64)
    except (TypeError, ValueError, OverflowError):      # (OverflowError: an int past float64)
        raise ValueError(f"{name} must be a positive number or an array [num_kv_heads] of "
                         f"them, finite in float32, but got {reprlib.repr(value)}.") from None
    if arr.shape not in ((), (num_kv_heads,)):
        raise ValueError(f"{name} must be a number or an array [num_kv_heads] = [{num_kv_heads}], "
                         f"but got shape {arr.shape}.")
    with np.errstate(over="ignore"):
        f32 = arr.astype(np.float32)
    bad = np.flatnonzero(~(np.isfinite(f32) & (f32 > 0)).reshape(-1))
    if bad.size:
        where = "" if arr.ndim == 0 else f"[{int(bad[0])}]"
        got = float(arr.reshape(-1)[bad[0]])
        raise ValueError(f"{name}{where} is {got!r}; fp8 scales must be finite and positive in "
                         f"float32.")
    return f32[()] if arr.ndim == 0 else f32


def _head_scale(scale, x):
    """``scale`` (a scalar or ``[num_kv_heads]``) shaped to broadcast against
    ``x [..., num_kv_heads, head_size]``."""
    s = np.asarray(scale, np.float32)
    return s if s.ndim == 0 else s[:, None]


def quantize(x, scale, dtype):
    """``fp8(x / scale)`` as the device ``write_kv`` computes it (see the module
    docstring): float32 division, round to nearest even, saturation at the
    format's max, NaN kept.

    Parameters
    ----------
    x : array_like, ``[..., num_kv_heads, head_size]`` (any shape for a scalar scale)
        fp16, bf16 or fp32 values (others are first cast to float32).
    scale : float or array, ``[num_kv_heads]``
    dtype : {"float8_e4m3fn", "float8_e5m2"}

    Returns
    -------
    numpy.ndarray of ``ml_dtypes.float8_*``, ``x``'s shape

    Examples
    --------
    >>> quantize(np.array([[1.0, 1.0], [1.0, 1.0]]), [1.0, 4.0], "float8_e5m2").astype(float)
    array([[1.  , 1.  ],
           [0.25, 0.25]])
    """
    name = _format(dtype)
    x = np.asarray(x)
    if x.dtype != np.float32:
        x = x.astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        return _saturated(x / _head_scale(scale, x), name)


def _saturated(y, name):
    """float32 ``y`` rounded to format ``name``, saturating at its max, NaN kept."""
    m = np.float32(FP8_MAX[name])
    with np.errstate(invalid="ignore"):
        return np.where(np.isnan(y), y, np.clip(y, -m, m)).astype(FP8_NUMPY[name])


def dequantize(x, scale, dtype=np.float64):
    """``x * scale`` in ``dtype`` (float64 by default, where every product of an
    fp8 value and a float32 scale is exact).

    Parameters
    ----------
    x : array, ``[..., num_kv_heads, head_size]``
        Stored fp8 values (``ml_dtypes`` arrays, e.g. from
        ``PagedKVCache.gather`` or ``to_host("nhd")``).
    scale : float or array, ``[num_kv_heads]``
        The cache's ``k_scale`` or ``v_scale``.
    dtype : numpy float dtype

    Returns
    -------
    numpy.ndarray of ``dtype``, ``x``'s shape

    Examples
    --------
    >>> q = np.array([[1.5, -2.0]], ml_dtypes.float8_e4m3fn)       # [num_kv_heads=1, head_size=2]
    >>> dequantize(q, [0.25]).tolist()
    [[0.375, -0.5]]
    """
    x = np.asarray(x)
    return x.astype(dtype) * _head_scale(scale, x).astype(dtype)


def fp8_scales(x, dtype, per_head=False):
    """Scales that map the largest magnitude of ``x`` onto the format's max:
    ``max |x| / FP8_MAX[dtype]`` over the whole tensor, or over each KV head.

    A head (or tensor) of zeros gets scale 1; NaN and inf are left out of the
    maximum (inf saturates anyway).

    Parameters
    ----------
    x : array, ``[..., num_kv_heads, head_size]``
        Keys or values (e.g. a calibration batch ``[num_tokens, num_kv_heads,
        head_size]``); fp16, bf16 or fp32.
    dtype : {"float8_e4m3fn", "float8_e5m2"}
    per_head : bool
        One scale per KV head (axis ``-2``) instead of one for the tensor.

    Returns
    -------
    float or numpy.ndarray of float32, ``[num_kv_heads]``
        Ready for ``PagedKVCache(k_scale=...)`` or ``cache.k_scale = ...``.

    Examples
    --------
    >>> x = np.array([[[1.0, -896.0]], [[2.0, 3.0]]], np.float32)   # [2 tokens, 1 head, 2]
    >>> fp8_scales(x, "float8_e4m3fn")                            # 896 / 448
    2.0
    >>> fp8_scales(np.zeros((3, 2, 4)), "float8_e5m2", per_head=True)
    array([1., 1.], dtype=float32)
    """
    name = _format(dtype)
    x = np.asarray(x).astype(np.float64)
    a = np.where(np.isfinite(x), np.abs(x), 0.0)
    if per_head:
        if a.ndim < 2:
            raise ValueError(f"per_head scales need x [..., num_kv_heads, head_size], but got "
                             f"shape {a.shape}.")
        amax = np.moveaxis(a, -2, 0).reshape(a.shape[-2], -1).max(axis=1, initial=0.0)
    else:
        amax = np.array(a.max(initial=0.0))
    s = np.where(amax > 0, amax / FP8_MAX[name], 1.0)
    s = np.maximum(s, np.finfo(np.float32).tiny).astype(np.float32)   # no 0 from underflow
    # the float32 rounding may land just below amax / max: round up so |x| / s <= max
    s = np.where((amax > 0) & (s.astype(np.float64) * FP8_MAX[name] < amax),
                 np.nextafter(s, np.float32(math.inf)), s).astype(np.float32)
    return s if per_head else float(s)


def quantize_rows(x, dtype="float8_e4m3fn"):
    """Each row (the last axis) of ``x`` quantised with a scale of its own, as
    ``DecodePlan(qk_fp8=True)`` quantises each query head before ``Q K^T``:
    ``s = max |x| / FP8_MAX[dtype]`` in float32 (1 for a row of zeros, NaN
    for a row holding a NaN or an infinity, 2**-149 where the division
    underflows to 0), then :func:`quantize` ``(x, s)``.

    Parameters
    ----------
    x : array, ``[..., head_size]``
        fp16, bf16 or fp32 values.
    dtype : {"float8_e4m3fn", "float8_e5m2"}

    Returns
    -------
    codes : numpy.ndarray of ``ml_dtypes.float8_*``, ``x``'s shape
    scales : numpy.ndarray of float32, ``x.shape[:-1]``
        ``codes * scales[..., None]`` (in float64, exactly) is what the
        product sees.

    Examples
    --------
    >>> codes, s = quantize_rows(np.array([[896.0, 1.0, -3.0], [0.0, 0.0, 0.0]], np.float32))
    >>> s.tolist(), codes.astype(float).tolist()                  # 896 / 448; 1 / 2 = 0.5
    ([2.0, 1.0], [[448.0, 0.5, -1.5], [0.0, 0.0, 0.0]])
    """
    name = _format(dtype)
    x = np.asarray(x).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        amax = np.abs(x).max(axis=-1, initial=np.float32(0.0))
        s = np.where(amax > 0, amax / np.float32(FP8_MAX[name]), np.float32(1.0))
        s = np.where(s > 0, s, np.float32(2.0 ** -149))      # (float32 subnormal rows)
        s = np.where(np.isfinite(x).all(axis=-1), s, np.float32(np.nan)).astype(np.float32)
        return _saturated(x / s[..., None], name), s
