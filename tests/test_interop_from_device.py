"""Caches over the caller's pools: ``PagedKVCache.from_device``.

* A cache over the caller's pools (NumPy under the simulator, numba device
  arrays, objects known through DLPack alone) gives bit-for-bit what a
  regular cache with the same contents gives (same kernels, same data), and
  what the kernels write shows in the caller's arrays; every bad pool raises
  and nothing is made.
* fp8 pools take ``k_scale``/``v_scale`` (their codes are a regular cache's
  with the same scales), as float8 arrays or as uint8 codes with ``dtype=``;
  bad scales, and scales for pools that are not fp8, raise as in the
  constructor.

Torch pools are tested with torch in, torch out in ``test_interop.py``, whose
geometry and helpers this module shares.
"""
import numpy as np
import pytest
from numba import cuda

import paged_numba as pn
from paged_numba import _launch
from test_interop import (BF16, BS, D, F32, H, I32, LENS, NB, SIM, SLOTS, TABLE, _bits,
                          _filled, _query, _same)


def _pools(layout, dtype, lead=()):
    """Zero host pools of the test geometry in ``layout`` (one pool twice for
    "interleaved")."""
    k_shape, v_shape = pn.layouts.cache_shapes(layout, NB, BS, H, D, dtype)
    k = np.zeros(lead + k_shape, dtype)
    return (k, k) if layout == "interleaved" else (k, np.zeros(lead + v_shape, dtype))


def _wrapped(kind, layout, dtype):
    """``(caller's key pool, caller's value pool, host view of each)`` of ``kind``."""
    k, v = _pools(layout, dtype)
    if kind == "numpy":
        return k, v, lambda: (k, v)
    dk = cuda.to_device(k.view(np.uint16) if dtype == BF16 else k)
    dv = dk if layout == "interleaved" else cuda.to_device(v.view(np.uint16) if dtype == BF16
                                                            else v)
    return dk, dv, lambda: (dk.copy_to_host(), dv.copy_to_host())


@pytest.mark.parametrize("kind", ["numpy", "numba"])
@pytest.mark.parametrize("layout,dtype", [("nhd", "float32"), ("vllm", "float32"),
                                          ("hnd", "bfloat16"), ("interleaved", "float16")])
def test_from_device_writes_land_in_the_callers_pools(kind, layout, dtype):
    if kind == "numpy" and not SIM:
        k, v = _pools(layout, dtype)
        with pytest.raises(TypeError, match="key_cache must be a device array"):
            pn.PagedKVCache.from_device(k, v, layout)
        return
    dtype = np.dtype(dtype)
    key, value, host = _wrapped(kind, layout, dtype)
    cache = _filled(pn.PagedKVCache.from_device(key, value, layout), dtype)
    regular = _filled(pn.PagedKVCache(NB, BS, H, D, dtype=dtype.name, layout=layout), dtype)
    assert (cache.num_blocks, cache.block_size, cache.num_kv_heads, cache.head_size,
            cache.dtype, cache.layout) == (NB, BS, H, D, dtype, layout)
    hk, hv = host()
    assert _same(hk, regular.key_cache) and _same(hv, regular.value_cache)
    assert np.abs(_bits(hk)).sum() > 0                  # the writes are there
    assert _same(cache.to_host()[0], regular.to_host()[0])


@pytest.mark.parametrize("kind", ["numpy", "numba"])
def test_from_device_decode_and_prefill_equal_a_regular_cache(kind):
    if kind == "numpy" and not SIM:
        pytest.skip("NumPy pools are device pools under the simulator only")
    key, value, _ = _wrapped(kind, "nhd", np.dtype(F32))
    cache = _filled(pn.PagedKVCache.from_device(key, value), F32)
    regular = _filled(pn.PagedKVCache(NB, BS, H, D, dtype="float32"), F32)
    q = _query(F32)
    for c in (cache, regular):
        c.results = (pn.paged_decode(q, c, TABLE, LENS, return_lse=True),
                     pn.paged_prefill(q, c, [[0, 2]], [0, 2], [6], return_lse=True))
    for a, b in zip(cache.results, regular.results):
        assert _same(a[0], b[0]) and _same(a[1], b[1])


def test_from_device_layered_pools_and_their_layers():
    k, v = _pools("nhd", F32, lead=(2,))
    key, value = cuda.to_device(k), cuda.to_device(v)
    cache = pn.PagedKVCache.from_device(key, value, num_layers=2)
    regular = pn.PagedKVCache(NB, BS, H, D, dtype="float32", num_layers=2)
    assert cache.num_layers == 2 and cache.key_cache.shape == regular.key_cache.shape
    _filled(cache.layer(1), F32)
    _filled(regular.layer(1), F32)
    hk = key.copy_to_host()
    assert not hk[0].any() and hk[1].any()              # layer 1 written, layer 0 not
    assert _same(hk, regular.key_cache) and _same(value, regular.value_cache)
    q = _query(F32)
    assert _same(pn.paged_decode(q, cache.layer(1), TABLE, LENS),
                 pn.paged_decode(q, regular.layer(1), TABLE, LENS))


def _misaligned(shape, dtype):
    """A C-contiguous device array ``shape`` starting one element past 16 bytes."""
    n = int(np.prod(shape))
    base = cuda.to_device(np.zeros(n + 16, dtype))
    return base[1:n + 1].reshape(*shape)


def _bad_pools():
    """``(id, key, value, kwargs, error, message)`` of pools from_device must refuse."""
    s = (NB, BS, H, D)
    dev = lambda a: cuda.to_device(np.ascontiguousarray(a))     # noqa: E731
    z = lambda shape=s, dt=F32: dev(np.zeros(shape, dt))        # noqa: E731
    one = z((NB, 2, BS, H, D))
    same = z()
    wide = cuda.to_device(np.zeros((NB, BS, H, 2 * D), F32))
    return [
        ("ndim", z((NB, BS, D)), z((NB, BS, D)), {}, ValueError, "nhd"),
        ("shapes differ", z(), z((NB, BS, 2, D)), {}, ValueError,
         "same shape in layout 'nhd'"),
        ("vllm shapes", z(), z(), {"layout": "vllm"}, ValueError, "vllm"),
        ("int32", z(dt=I32), z(dt=I32), {}, ValueError, "dtype must be one of"),
        ("float64", z(dt=np.float64), z(dt=np.float64), {}, ValueError, "dtype must be one of"),
        ("dtypes differ", z(), z(dt=np.float16), {}, ValueError, "same dtype"),
        ("strided", wide[:, :, :, :D], z(), {}, ValueError, "key_cache must be C-contiguous"),
        ("every other element", z(), wide[:, :, :, ::2], {}, ValueError,
         "value_cache must be C-contiguous"),
        ("misaligned", z(), _misaligned(s, F32), {}, ValueError,
         "value_cache must start on a 16-byte boundary"),
        ("one pool twice", one, one, {"layout": "nhd"}, ValueError, "nhd"),
        ("same memory", same, same, {}, ValueError, "share memory"),
        ("two interleaved pools", one, z((NB, 2, BS, H, D)), {"layout": "interleaved"},
         ValueError, "one pool"),
        ("num_layers", z(), z(), {"num_layers": 2}, ValueError, "leading \\[num_layers\\]"),
        ("num_layers value", z(), z(), {"num_layers": 0}, ValueError, "num_layers"),
        ("layout", z(), z(), {"layout": "NHD"}, ValueError, "layout must be one of"),
        ("list", [[0.0]], z(), {}, TypeError, "key_cache must be a device array"),
        ("empty", z((0, BS, H, D)), z((0, BS, H, D)), {}, ValueError, "num_blocks"),
    ]


@pytest.mark.parametrize("case", _bad_pools(), ids=lambda c: c[0])
def test_from_device_refuses_bad_pools_and_touches_nothing(case):
    _, key, value, kwargs, error, message = case
    before = [np.array(pn._arrays.to_host(x), copy=True) if not isinstance(x, list) else x
              for x in (key, value)]
    launches = _launch.launch_count()
    with pytest.raises(error, match=message):
        pn.PagedKVCache.from_device(key, value, **kwargs)
    assert _launch.launch_count() == launches
    for x, b in zip((key, value), before):
        if not isinstance(x, list):
            assert _same(x, b)


def test_from_device_keeps_the_callers_objects_alive():
    import gc
    import weakref

    key, value = cuda.to_device(np.zeros((NB, BS, H, D), F32)), cuda.to_device(
        np.zeros((NB, BS, H, D), F32))
    cache = pn.PagedKVCache.from_device(key, value)
    ref = weakref.ref(key)
    del key
    gc.collect()
    assert ref() is not None and cache._owners[0] is ref()
    del cache
    gc.collect()
    assert ref() is None


class _DLPackOnly:                   # an array known to the calls through DLPack alone
    def __init__(self, host):
        self._host = host

    def __dlpack__(self, **kwargs):
        return self._host.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._host.__dlpack_device__()


def test_from_device_takes_dlpack_objects():
    k, v = _pools("nhd", F32)
    if not SIM:                      # host memory through DLPack is not a device pool
        with pytest.raises(TypeError, match="key_cache must be"):
            pn.PagedKVCache.from_device(_DLPackOnly(k), _DLPackOnly(v))
        return
    _filled(pn.PagedKVCache.from_device(_DLPackOnly(k), _DLPackOnly(v)), F32)
    regular = _filled(pn.PagedKVCache(NB, BS, H, D, dtype="float32"), F32)
    assert k.any() and _same(k, regular.key_cache) and _same(v, regular.value_cache)


# fp8 pools: their codes as float8 arrays, NumPy ones being device arrays under the simulator
FP8_HEADS = 2                       # per-head scales need more than one KV head


def _fp8_pools(dtype="float8_e4m3fn", head_size=D):
    shape = (NB, BS, FP8_HEADS, head_size)
    return np.zeros(shape, np.dtype(dtype)), np.zeros(shape, np.dtype(dtype))


@pytest.mark.skipif(not SIM, reason="float8 pools are device arrays here under the simulator only")
@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("scales", [{}, {"k_scale": 0.25, "v_scale": 3.0},
                                    {"k_scale": [0.5, 2.0], "v_scale": [4.0, 0.125]}],
                         ids=["default", "per-tensor", "per-head"])
def test_from_device_fp8_pools_take_their_scales(dtype, scales):
    """An fp8 cache over the caller's pools stores ``fp8(x / scale)`` with the
    scales given to from_device, bit for bit as a regular cache with those
    scales, and decode reads them back the same way."""
    key, value = _fp8_pools(dtype)
    cache = pn.PagedKVCache.from_device(key, value, **scales)
    regular = pn.PagedKVCache(NB, BS, FP8_HEADS, D, dtype=dtype, **scales)
    k_scale, v_scale = scales.get("k_scale", 1.0), scales.get("v_scale", 1.0)
    assert np.array_equal(cache.k_scale, k_scale) and np.array_equal(cache.v_scale, v_scale)
    assert _same(cache.kv_scales, regular.kv_scales)
    kv = np.random.default_rng(2).standard_normal((len(SLOTS), FP8_HEADS, D)).astype(np.float16)
    for c in (cache, regular):
        pn.write_kv(c, 4 * kv, -kv, SLOTS)
    rows = np.array(SLOTS) // BS, np.array(SLOTS) % BS
    assert _same(key[rows], pn.fp8.quantize(4 * kv, k_scale, dtype))
    assert _same(value[rows], pn.fp8.quantize(-kv, v_scale, dtype))
    assert _same(key, regular.to_host()[0]) and _same(value, regular.to_host()[1])
    q = _query(np.float16, heads=2 * FP8_HEADS)
    assert _same(pn.paged_decode(q, cache, TABLE, LENS), pn.paged_decode(q, regular, TABLE, LENS))


@pytest.mark.skipif(not SIM, reason="float8 pools are device arrays here under the simulator only")
@pytest.mark.parametrize("kwargs,message", [
    ({"k_scale": 0.0}, r"k_scale is 0.0; fp8 scales must be finite and positive"),
    ({"v_scale": -1.0}, r"v_scale is -1.0; fp8 scales"),
    ({"k_scale": float("nan")}, r"k_scale is nan; fp8 scales"),
    ({"v_scale": float("inf")}, r"v_scale is inf; fp8 scales"),
    ({"k_scale": 1e39}, r"k_scale is 1e\+39; fp8 scales"),          # inf in float32
    ({"v_scale": [1.0, 0.0]}, r"v_scale\[1\] is 0.0; fp8 scales"),
    ({"k_scale": [1.0, 2.0, 3.0]},
     r"k_scale must be a number or an array \[num_kv_heads\] = \[2\], but got shape \(3,\)"),
    ({"v_scale": "1.0"}, r"v_scale must be a positive number"),
    ({"head_size": 8}, r"fp8 cache needs head_size to be a multiple of 16.*head_size=8"),
], ids=["zero", "negative", "nan", "inf", "float32 overflow", "one head zero", "shape", "str",
        "head size"])
def test_from_device_refuses_bad_fp8_scales_and_touches_nothing(kwargs, message):
    kwargs = dict(kwargs)
    key, value = _fp8_pools(head_size=kwargs.pop("head_size", D))
    key[:] = 1.5                        # the caller's codes, left as they are
    before = key.copy(), value.copy()
    with pytest.raises(ValueError, match=message):
        pn.PagedKVCache.from_device(key, value, **kwargs)
    assert _same(key, before[0]) and _same(value, before[1])


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_from_device_takes_fp8_codes_as_uint8_with_their_dtype(dtype):
    """uint8 pools (numba's way to hold fp8 codes on a GPU) with ``dtype=``
    name the format: the cache writes and reads the same codes as a cache
    over float8 pools; without ``dtype`` or with another one, a ValueError
    before anything is touched."""
    codes = [np.zeros((NB, BS, FP8_HEADS, D), np.uint8) for _ in range(2)]
    pools = codes if SIM else [cuda.to_device(c) for c in codes]
    cache = pn.PagedKVCache.from_device(*pools, dtype=dtype, k_scale=0.5, v_scale=2.0)
    regular = pn.PagedKVCache(NB, BS, FP8_HEADS, D, dtype=dtype, k_scale=0.5, v_scale=2.0)
    assert cache.dtype == np.dtype(dtype)
    kv = np.random.default_rng(3).standard_normal((len(SLOTS), FP8_HEADS, D)).astype(np.float16)
    for c in (cache, regular):
        pn.write_kv(c, 4 * kv, -kv, SLOTS)
    host = [np.asarray(p) if SIM else p.copy_to_host() for p in pools]
    want = [x.view(np.uint8) for x in regular.to_host()]
    assert np.array_equal(host[0], want[0]) and np.array_equal(host[1], want[1])
    assert host[0].any()
    q = _query(np.float16, heads=2 * FP8_HEADS)
    assert _same(pn.paged_decode(q, cache, TABLE, LENS), pn.paged_decode(q, regular, TABLE, LENS))
    other = "float8_e5m2" if dtype == "float8_e4m3fn" else "float8_e4m3fn"
    typed = np.zeros((NB, BS, FP8_HEADS, D), np.dtype(other))
    refusals = [(pools, {}, "hold uint8: pass dtype='float8_e4m3fn' or dtype='float8_e5m2'"),
                (pools, {"dtype": "float16"}, "key_cache must hold float16 for dtype=float16, "
                                             "but got uint8"),
                (pools, {"dtype": "int8"}, "dtype must be one of")]
    if SIM:         # float8 arrays are device arrays only here
        refusals.append(([typed, typed.copy()], {"dtype": dtype},
                         f"key_cache must hold {dtype} or its uint8 bits for dtype={dtype}, but "
                         f"got {other}"))
    for args, kw, message in refusals:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            pn.PagedKVCache.from_device(*args, **kw)
    after = [np.asarray(p) if SIM else p.copy_to_host() for p in pools]
    assert np.array_equal(after[0], host[0]) and np.array_equal(after[1], host[1])


@pytest.mark.parametrize("kwargs", [{"k_scale": 0.5}, {"v_scale": [1.0]}, {"k_scale": 0.0}])
def test_from_device_refuses_scales_for_pools_that_are_not_fp8(kwargs):
    """As the constructor does: scales on a float32 pool are a ValueError,
    whatever their value."""
    key, value, _ = _wrapped("numpy" if SIM else "numba", "nhd", np.dtype(F32))
    with pytest.raises(ValueError, match="k_scale and v_scale apply to fp8 caches only, but "
                                         "dtype is float32"):
        pn.PagedKVCache.from_device(key, value, **kwargs)
    with pytest.raises(ValueError, match="k_scale and v_scale apply to fp8 caches only"):
        pn.PagedKVCache(NB, BS, H, D, dtype="float32", **kwargs)
