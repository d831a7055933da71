"""KV-cache layouts: shapes and host-side conversions (plain NumPy, no numba).

A layout fixes where token offset ``o`` of block ``b``, KV head ``h``, element
``d`` lives in the key and value pools (``B`` = block_size, ``H`` =
num_kv_heads, ``D`` = head_size):

``"nhd"`` (FlashAttention / FlashInfer ``NHD``)
    key and value ``[num_blocks, block_size, num_kv_heads, head_size]``;
    ``key[b, o, h, d]``.
``"vllm"`` (vLLM's paged-attention kernels)
    key ``[num_blocks, num_kv_heads, head_size // x, block_size, x]`` with
    ``x = 16 // itemsize`` (one 16-byte vector of a token's key), and value
    ``[num_blocks, num_kv_heads, head_size, block_size]``;
    ``key[b, h, d // x, o, d % x]``, ``value[b, h, d, o]``.
``"hnd"`` (FlashInfer ``HND``)
    key and value ``[num_blocks, num_kv_heads, block_size, head_size]``;
    ``key[b, h, o, d]``.
``"interleaved"`` (one buffer a block, keys then values, as single-file CUDA engines keep it)
    ONE pool ``[num_blocks, 2, block_size, num_kv_heads, head_size]``: each
    block holds K for all its ``B`` tokens, then V, each token row ``H * D``
    wide. ``pool[b, 0, o, h, d]`` is K and ``pool[b, 1, o, h, d]`` is V, so
    within a block K is at flat offset ``(o * H + h) * D + d`` and V at
    ``V_OFFSET + (o * H + h) * D + d`` with
    ``V_OFFSET = B * H * D`` (:func:`interleaved_v_offset`).
    The functions here keep their ``(key_cache, value_cache)`` pairs for this
    layout: both members are that one pool. :func:`cache_shapes` gives the
    pool's shape twice, :func:`from_nhd` returns ``(pool, pool)`` (the same
    array object twice), and :func:`to_nhd` reads K from its first argument and
    V from its second, so ``to_nhd(pool, pool, "interleaved")`` is the usual
    call (two separate copies of the pool work too).

:data:`LAYOUTS` are the layouts the kernels and ``PagedKVCache`` support;
:data:`HOST_LAYOUTS` (the host converters' list) is the same list.

``to_nhd`` / ``from_nhd`` move whole pools between a layout and ``"nhd"``,
and :func:`convert` between any two layouts; the dense reference and
``PagedKVCache.gather`` work in ``"nhd"``.

Layers share one allocator: a block id indexes the same block of every
layer's pool. With ``layered=True`` the converters take and return pools
with a leading ``num_layers`` axis (shapes from :func:`cache_shapes_layered`).

Examples
--------
>>> import numpy as np
>>> k = np.arange(2 * 3 * 2 * 8, dtype=np.float16).reshape(2, 3, 2, 8)  # nb=2, B=3, H=2, D=8
>>> pool, same = from_nhd(k, -k, "interleaved")
>>> pool.shape, pool is same
((2, 2, 3, 2, 8), True)
>>> interleaved_v_offset(block_size=3, num_kv_heads=2, head_size=8)   # 3 * 2 * 8
48
>>> # V of token offset 1, head 1 of block 0: 48 + (1 * 2 + 1) * 8 = 72
>>> bool((pool[0].reshape(-1)[72:80] == -k[0, 1, 1]).all())
True
>>> [a.shape for a in convert(k, -k, "nhd", "vllm")]     # x = 16 // 2 = 8
[(2, 2, 1, 3, 8), (2, 2, 8, 3)]
"""
import ml_dtypes  # noqa: F401  (registers numpy's "bfloat16" dtype)
import numpy as np

from ._checks import flag, int_sequence, integer
LAYOUTS = ("nhd", "vllm", "hnd", "interleaved")           # kernels and PagedKVCache take these
HOST_LAYOUTS = LAYOUTS                                    # and so do the host converters
DTYPES = ("float16", "float32", "bfloat16")               # bfloat16: ml_dtypes.bfloat16 on the host

_FORMS = {  # the shapes each layout's pools must have, for error messages
    "nhd": "key and value of one shape [num_blocks, block_size, num_kv_heads, head_size]",
    "vllm": ("key [num_blocks, num_kv_heads, head_size // x, block_size, x] and value "
             "[num_blocks, num_kv_heads, head_size, block_size]"),
    "hnd": "key and value of one shape [num_blocks, num_kv_heads, block_size, head_size]",
    "interleaved": "one pool [num_blocks, 2, block_size, num_kv_heads, head_size] as key and value",
}


def vector_width(dtype):
    """Elements in one 16-byte vector of ``dtype`` (vLLM's ``x``).

    >>> vector_width("float16"), vector_width("bfloat16"), vector_width("float32")
    (8, 8, 4)
    >>> vector_width("foo")
    Traceback (most recent call last):
        ...
    ValueError: dtype must be a NumPy dtype, but got 'foo'.
    """
    try:
        dt = None if dtype is None else np.dtype(dtype)     # (np.dtype(None) is float64)
    except Exception:
        dt = None
    if dt is None or dt.kind == "O":
        raise ValueError(f"dtype must be a NumPy dtype, but got {dtype!r}.")
    itemsize = dt.itemsize
    if not 1 <= itemsize <= 16 or 16 % itemsize:
        raise ValueError(f"dtype must have 1, 2, 4, 8 or 16 bytes, but got {dtype!r}.")
    return 16 // itemsize


def check_layout(layout, layouts=LAYOUTS):
    """Raise ``ValueError`` unless ``layout`` is one of ``layouts`` (default: the kernels' :data:`LAYOUTS`).

    Parameters
    ----------
    layout : str
        The layout name to check (case-sensitive).
    layouts : tuple of str
        The accepted names.

    Examples
    --------
    >>> check_layout("hnd")                      # accepted: returns None
    >>> check_layout("NHD")
    Traceback (most recent call last):
        ...
    ValueError: layout must be one of ('nhd', 'vllm', 'hnd', 'interleaved'), but got 'NHD'.
    >>> check_layout("vllm", layouts=("nhd",))
    Traceback (most recent call last):
        ...
    ValueError: layout must be one of ('nhd',), but got 'vllm'.
    """
    if not isinstance(layout, str) or layout not in layouts:
        raise ValueError(f"layout must be one of {layouts}, but got {layout!r}.")


def interleaved_v_offset(block_size, num_kv_heads, head_size):
    """Elements from the start of an ``"interleaved"`` block to its first V element.

    ``V_OFFSET = block_size * num_kv_heads * head_size``: K of all the block's
    tokens comes first, one row of ``num_kv_heads * head_size`` per token.

    >>> interleaved_v_offset(16, 2, 64)   # 16 * 2 * 64
    2048
    """
    return (integer("block_size", block_size, lo=1) * integer("num_kv_heads", num_kv_heads, lo=1)
            * integer("head_size", head_size, lo=1))


def cache_shapes(layout, num_blocks, block_size, num_kv_heads, head_size, dtype):
    """Return ``(key_shape, value_shape)`` of a pool in ``layout``.

    For ``"interleaved"`` both are the one pool's shape
    ``[num_blocks, 2, block_size, num_kv_heads, head_size]``.

    Parameters
    ----------
    layout : str
        One of :data:`HOST_LAYOUTS`.
    num_blocks, block_size, num_kv_heads, head_size : int
    dtype : str or numpy.dtype
        Sets ``x = 16 // itemsize`` for ``"vllm"`` (``head_size`` must be a
        multiple of it); the other layouts ignore it.

    Returns
    -------
    key_shape, value_shape : tuple of int

    Examples
    --------
    >>> cache_shapes("nhd", 10, 16, 2, 64, "float16")
    ((10, 16, 2, 64), (10, 16, 2, 64))
    >>> cache_shapes("vllm", 10, 16, 2, 64, "float16")   # x = 16 // 2 = 8; 64 // 8 = 8
    ((10, 2, 8, 16, 8), (10, 2, 64, 16))
    >>> cache_shapes("interleaved", 10, 16, 2, 64, "float16")   # K and V in one pool
    ((10, 2, 16, 2, 64), (10, 2, 16, 2, 64))
    >>> cache_shapes("vllm", 10, 16, 2, 6, "float32")
    Traceback (most recent call last):
        ...
    ValueError: layout 'vllm' needs head_size to be a multiple of x = 4 for float32, but got head_size=6.
    """
    check_layout(layout, HOST_LAYOUTS)
    num_blocks, block_size, num_kv_heads, head_size = (
        integer(name, value, lo=1) for name, value in (
            ("num_blocks", num_blocks), ("block_size", block_size),
            ("num_kv_heads", num_kv_heads), ("head_size", head_size)))
    if layout == "nhd":
        shape = (num_blocks, block_size, num_kv_heads, head_size)
        return shape, shape
    if layout == "hnd":
        shape = (num_blocks, num_kv_heads, block_size, head_size)
        return shape, shape
    if layout == "interleaved":
        shape = (num_blocks, 2, block_size, num_kv_heads, head_size)
        return shape, shape
    x = vector_width(dtype)
    if head_size % x:
        raise ValueError(
            f"layout 'vllm' needs head_size to be a multiple of x = {x} for "
            f"{np.dtype(dtype).name}, but got head_size={head_size}."
        )
    return ((num_blocks, num_kv_heads, head_size // x, block_size, x),
            (num_blocks, num_kv_heads, head_size, block_size))


def cache_shapes_layered(layout, num_layers, num_blocks, block_size, num_kv_heads, head_size, dtype):
    """:func:`cache_shapes` with a leading ``num_layers`` axis on both shapes.

    All layers share one allocator: block id ``b`` indexes ``pool[layer, b]``
    in every layer.

    >>> cache_shapes_layered("hnd", 4, 10, 16, 2, 64, "float16")
    ((4, 10, 2, 16, 64), (4, 10, 2, 16, 64))
    """
    key_shape, value_shape = cache_shapes(layout, num_blocks, block_size, num_kv_heads, head_size, dtype)
    num_layers = integer("num_layers", num_layers, lo=1)
    return (num_layers, *key_shape), (num_layers, *value_shape)


def _int_shape(name, shape):
    """``shape`` as a tuple of Python ints, after checking that it is a flat
    sequence of integers (``int_sequence``: not bools, floats or strings)."""
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__len__"):
        raise ValueError(f"{name} must be a tuple of integers, but got {shape!r}.")
    dims = int_sequence(name, tuple(shape))
    if dims.ndim != 1:
        raise ValueError(f"{name} must be a tuple of integers, but got {shape!r}.")
    return tuple(int(s) for s in dims)


def _geometry(key_shape, value_shape, layout, layered=False):
    """``(num_blocks, block_size, num_kv_heads, head_size)`` read from pool
    shapes in ``layout`` (after a leading ``num_layers`` axis when ``layered``);
    ``ValueError`` naming both shapes if they do not fit the layout."""
    key_shape, value_shape = tuple(int(s) for s in key_shape), tuple(int(s) for s in value_shape)
    k, v = key_shape, value_shape
    if layered:
        k, v = (k[1:], v[1:]) if k[:1] == v[:1] and k else (None, None)
    geometry = None
    if k is None:
        pass
    elif layout in ("nhd", "hnd") and len(k) == 4 and k == v:
        nb, a, b, hd = k
        geometry = (nb, a, b, hd) if layout == "nhd" else (nb, b, a, hd)
    elif layout == "interleaved" and len(k) == 5 and k == v and k[1] == 2:
        nb, _, bs, nkv, hd = k
        geometry = (nb, bs, nkv, hd)
    elif layout == "vllm" and len(k) == 5 and len(v) == 4:
        nb, nkv, hx, bs, x = k
        if v == (nb, nkv, hx * x, bs):
            geometry = (nb, bs, nkv, hx * x)
    if geometry is None:
        form = f"one leading num_layers axis on {_FORMS[layout]}" if layered else _FORMS[layout]
        raise ValueError(f"layout {layout!r} needs {form}, but got {key_shape} and {value_shape}.")
    return geometry


def infer_geometry(key_shape, value_shape, layout, dtype):
    """Return ``(num_blocks, block_size, num_kv_heads, head_size)`` from pool shapes.

    The inverse of :func:`cache_shapes`: ``ValueError`` if the shapes are not
    a pair that layout (and, for ``"vllm"``, ``dtype``) produces.

    Parameters
    ----------
    key_shape, value_shape : tuple of int
        Shapes of the key and value pools in ``layout`` (for ``"interleaved"``,
        the one pool's shape twice).
    layout : str
        One of :data:`HOST_LAYOUTS`.
    dtype : str or numpy.dtype
        The pools' dtype; only ``"vllm"`` depends on it (``x = 16 // itemsize``).

    Returns
    -------
    tuple of int
        ``(num_blocks, block_size, num_kv_heads, head_size)``.

    Examples
    --------
    >>> infer_geometry((10, 2, 16, 64), (10, 2, 16, 64), "hnd", "float32")
    (10, 16, 2, 64)
    >>> infer_geometry((10, 2, 8, 16, 8), (10, 2, 64, 16), "vllm", "float16")   # 64 = 8 * 8
    (10, 16, 2, 64)
    >>> infer_geometry((10, 2, 16, 16, 4), (10, 2, 64, 16), "vllm", "float16")  # x = 4 is float32's
    Traceback (most recent call last):
        ...
    ValueError: pool shapes (10, 2, 16, 16, 4) and (10, 2, 64, 16) are not a 'vllm' layout for float16; expected (10, 2, 8, 16, 8) and (10, 2, 64, 16).
    """
    check_layout(layout, HOST_LAYOUTS)
    key_shape, value_shape = _int_shape("key_shape", key_shape), _int_shape("value_shape",
                                                                            value_shape)
    if layout == "vllm" and (len(key_shape) != 5 or len(value_shape) != 4):
        raise ValueError(  # the long-standing message for a wrong number of axes
            "layout 'vllm' needs key [num_blocks, num_kv_heads, head_size // x, block_size, x] "
            f"and value [num_blocks, num_kv_heads, head_size, block_size], but got "
            f"{tuple(key_shape)} and {tuple(value_shape)}."
        )
    if layout != "vllm":
        geometry = _geometry(key_shape, value_shape, layout)
        cache_shapes(layout, *geometry, dtype)        # counts >= 1 (a ValueError naming one)
        return geometry
    nb, nkv, hx, bs, x = key_shape
    geometry = (nb, bs, nkv, hx * x)
    expected = cache_shapes(layout, *geometry, dtype)
    if x != vector_width(dtype) or expected != (tuple(key_shape), tuple(value_shape)):
        raise ValueError(
            f"pool shapes {tuple(key_shape)} and {tuple(value_shape)} are not a 'vllm' "
            f"layout for {np.dtype(dtype).name}; expected {expected[0]} and {expected[1]}."
        )
    return geometry


def _per_layer(convert_one, key_cache, value_cache, layered):
    """Apply ``convert_one`` to (already validated) pools; when ``layered``,
    fold the leading layer axis into the block axis first (every layout's
    first axis is num_blocks) and unfold it after."""
    if not layered:
        return convert_one(key_cache, value_cache)
    num_layers, nb = key_cache.shape[:2]

    def fold(a):
        return a.reshape(num_layers * nb, *a.shape[2:])

    def unfold(a):
        return a.reshape(num_layers, nb, *a.shape[1:])

    k, v = convert_one(fold(key_cache), fold(value_cache))
    return (unfold(k),) * 2 if v is k else (unfold(k), unfold(v))


def to_nhd(key_cache, value_cache, layout, *, layered=False):
    """Convert host pools in ``layout`` to ``"nhd"`` ``[num_blocks, block_size, num_kv_heads, head_size]``.

    Parameters
    ----------
    key_cache, value_cache : numpy.ndarray
        Pools in ``layout`` (see the module docstring). For ``"interleaved"``
        both are the one pool ``[num_blocks, 2, block_size, num_kv_heads,
        head_size]``; K is read from ``key_cache[:, 0]`` and V from
        ``value_cache[:, 1]``.
    layout : str
        One of :data:`HOST_LAYOUTS`.
    layered : bool, keyword-only
        Pools carry a leading ``num_layers`` axis, kept in the result.

    Returns
    -------
    key, value : numpy.ndarray, each ``[num_blocks, block_size, num_kv_heads, head_size]``
        (``[num_layers, ...]`` when ``layered``), C-contiguous.

    Examples
    --------
    >>> import numpy as np
    >>> k = np.arange(2 * 2 * 3 * 8).reshape(2, 2, 3, 8)   # "hnd": nb=2, H=2, B=3, D=8
    >>> nk, nv = to_nhd(k, -k, "hnd")
    >>> nk.shape                                           # [nb, B, H, D]
    (2, 3, 2, 8)
    >>> # key[b, o, h, d] = hnd[b, h, o, d]; 69 = ((1 * 2 + 0) * 3 + 2) * 8 + 5
    >>> int(nk[1, 2, 0, 5]), int(k[1, 0, 2, 5])
    (69, 69)
    >>> pool, _ = from_nhd(nk, nv, "interleaved")
    >>> bool((to_nhd(pool, pool, "interleaved")[1] == nv).all())   # V from pool[:, 1]
    True
    >>> to_nhd(k[None], k[None], "hnd", layered=True)[0].shape      # one layer
    (1, 2, 3, 2, 8)
    """
    check_layout(layout, HOST_LAYOUTS)
    layered = flag("layered", layered)
    key_cache, value_cache = np.asarray(key_cache), np.asarray(value_cache)
    _geometry(key_cache.shape, value_cache.shape, layout, layered)
    if layout == "vllm" and key_cache.shape[-1] != vector_width(key_cache.dtype):
        raise ValueError(f"layout 'vllm' packs x = 16 // itemsize = "
                         f"{vector_width(key_cache.dtype)} elements of {key_cache.dtype} a "
                         f"vector, but key_cache's last axis is {key_cache.shape[-1]}.")

    def one(kc, vc):
        if layout == "nhd":
            k, v = kc, vc
        elif layout == "hnd":
            k, v = kc.transpose(0, 2, 1, 3), vc.transpose(0, 2, 1, 3)
        elif layout == "interleaved":
            k, v = kc[:, 0], vc[:, 1]
        else:
            nb, nkv, hx, bs, x = kc.shape
            k = kc.transpose(0, 3, 1, 2, 4).reshape(nb, bs, nkv, hx * x)
            v = vc.transpose(0, 3, 1, 2)
        return np.ascontiguousarray(k), np.ascontiguousarray(v)

    return _per_layer(one, key_cache, value_cache, layered)


def from_nhd(key_cache, value_cache, layout, *, layered=False):
    """Convert ``"nhd"`` host pools to ``layout`` (inverse of :func:`to_nhd`).

    Parameters
    ----------
    key_cache, value_cache : numpy.ndarray, each ``[num_blocks, block_size, num_kv_heads, head_size]``
        (``[num_layers, ...]`` when ``layered``).
    layout : str
        One of :data:`HOST_LAYOUTS`.
    layered : bool, keyword-only
        Pools carry a leading ``num_layers`` axis, kept in the result.

    Returns
    -------
    key_cache, value_cache : numpy.ndarray
        Pools in ``layout``, C-contiguous. For ``"interleaved"`` this is
        ``(pool, pool)``: the same array object twice (key and value must then
        have the same dtype).

    Examples
    --------
    >>> import numpy as np
    >>> k = np.arange(2 * 3 * 2 * 8, dtype=np.float32).reshape(2, 3, 2, 8)  # nb=2, B=3, H=2, D=8
    >>> vk, vv = from_nhd(k, -k, "vllm")                   # x = 16 // 4 = 4
    >>> vk.shape, vv.shape                                 # [nb, H, D // x, B, x], [nb, H, D, B]
    ((2, 2, 2, 3, 4), (2, 2, 8, 3))
    >>> # key[b, o, h, d] = vllm_key[b, h, d // 4, o, d % 4]: d = 6 -> [.., 1, o, 2]
    >>> float(k[1, 2, 0, 6]), float(vk[1, 0, 1, 2, 2])    # 86 = ((1 * 3 + 2) * 2 + 0) * 8 + 6
    (86.0, 86.0)
    >>> [bool((a == b).all()) for a, b in zip(to_nhd(vk, vv, "vllm"), (k, -k))]   # round trip
    [True, True]
    """
    check_layout(layout, HOST_LAYOUTS)
    layered = flag("layered", layered)
    key_cache, value_cache = np.asarray(key_cache), np.asarray(value_cache)
    nb, bs, nkv, hd = _geometry(key_cache.shape, value_cache.shape, "nhd", layered)
    if layout == "vllm":
        x = vector_width(key_cache.dtype)
        cache_shapes(layout, nb, bs, nkv, hd, key_cache.dtype)  # head_size must be a multiple of x
    if layout == "interleaved" and key_cache.dtype != value_cache.dtype:
        raise ValueError(
            "layout 'interleaved' holds key and value in one pool, so they must have the same "
            f"dtype, but got {key_cache.dtype} and {value_cache.dtype}.")

    def one(k, v):
        if layout == "nhd":
            kc, vc = k, v
        elif layout == "hnd":
            kc, vc = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        elif layout == "interleaved":
            pool = np.stack([k, v], axis=1)
            return pool, pool
        else:
            kc = k.reshape(k.shape[0], bs, nkv, hd // x, x).transpose(0, 2, 3, 1, 4)
            vc = v.transpose(0, 2, 3, 1)
        return np.ascontiguousarray(kc), np.ascontiguousarray(vc)

    return _per_layer(one, key_cache, value_cache, layered)


def convert(key_cache, value_cache, src_layout, dst_layout, *, layered=False):
    """Convert host pools from ``src_layout`` to ``dst_layout`` (through ``"nhd"``).

    Parameters
    ----------
    key_cache, value_cache : numpy.ndarray
        Pools in ``src_layout`` (for ``"interleaved"``, the one pool twice).
    src_layout, dst_layout : str
        Each one of :data:`HOST_LAYOUTS`.
    layered : bool, keyword-only
        Pools carry a leading ``num_layers`` axis.

    Returns
    -------
    key_cache, value_cache : numpy.ndarray
        Pools in ``dst_layout``; ``(pool, pool)`` for ``"interleaved"``.

    Examples
    --------
    >>> import numpy as np
    >>> k = np.zeros((3, 16, 2, 64), np.float32)          # nhd: 3 blocks of 16 tokens
    >>> [a.shape for a in convert(k, k, "nhd", "hnd")]
    [(3, 2, 16, 64), (3, 2, 16, 64)]
    >>> pool, _ = convert(k, k, "nhd", "interleaved")
    >>> [a.shape for a in convert(pool, pool, "interleaved", "vllm")]   # x = 16 // 4 = 4
    [(3, 2, 16, 16, 4), (3, 2, 64, 16)]
    """
    check_layout(src_layout, HOST_LAYOUTS)
    check_layout(dst_layout, HOST_LAYOUTS)
    k, v = to_nhd(key_cache, value_cache, src_layout, layered=layered)
    return from_nhd(k, v, dst_layout, layered=layered)
