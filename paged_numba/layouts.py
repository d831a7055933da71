"""KV-cache layouts: shapes and host-side conversions (plain NumPy, no numba).

A layout fixes where token ``t`` of block ``b``, KV head ``h``, element ``d``
lives in the key and value pools:

``"nhd"`` (FlashAttention / FlashInfer)
    key and value ``[num_blocks, block_size, num_kv_heads, head_size]``.
``"vllm"`` (vLLM's paged-attention kernels)
    key ``[num_blocks, num_kv_heads, head_size // x, block_size, x]`` with
    ``x = 16 // itemsize`` (one 16-byte vector of a token's key), and value
    ``[num_blocks, num_kv_heads, head_size, block_size]``.

``to_nhd`` / ``from_nhd`` move whole pools between a layout and ``"nhd"``;
the dense reference and ``PagedKVCache.gather`` work in ``"nhd"``.
"""
import numpy as np

LAYOUTS = ("nhd", "vllm")
DTYPES = ("float16", "float32")


def vector_width(dtype):
    """Elements in one 16-byte vector of ``dtype`` (vLLM's ``x``)."""
    return 16 // np.dtype(dtype).itemsize


def check_layout(layout):
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, but got {layout!r}.")


def cache_shapes(layout, num_blocks, block_size, num_kv_heads, head_size, dtype):
    """Return ``(key_shape, value_shape)`` of a pool in ``layout``."""
    check_layout(layout)
    if layout == "nhd":
        shape = (num_blocks, block_size, num_kv_heads, head_size)
        return shape, shape
    x = vector_width(dtype)
    if head_size % x:
        raise ValueError(
            f"layout 'vllm' needs head_size to be a multiple of x = {x} for "
            f"{np.dtype(dtype).name}, but got head_size={head_size}."
        )
    return ((num_blocks, num_kv_heads, head_size // x, block_size, x),
            (num_blocks, num_kv_heads, head_size, block_size))


def to_nhd(key_cache, value_cache, layout):
    """Convert host pools in ``layout`` to ``"nhd"`` ``[num_blocks, block_size, num_kv_heads, head_size]``."""
    check_layout(layout)
    if layout == "nhd":
        return np.ascontiguousarray(key_cache), np.ascontiguousarray(value_cache)
    nb, nkv, hx, bs, x = key_cache.shape
    k = key_cache.transpose(0, 3, 1, 2, 4).reshape(nb, bs, nkv, hx * x)
    v = value_cache.transpose(0, 3, 1, 2)
    return np.ascontiguousarray(k), np.ascontiguousarray(v)


def from_nhd(key_cache, value_cache, layout):
    """Convert ``"nhd"`` host pools to ``layout`` (inverse of :func:`to_nhd`)."""
    check_layout(layout)
    if layout == "nhd":
        return np.ascontiguousarray(key_cache), np.ascontiguousarray(value_cache)
    nb, bs, nkv, hd = key_cache.shape
    x = vector_width(key_cache.dtype)
    k = key_cache.reshape(nb, bs, nkv, hd // x, x).transpose(0, 2, 3, 1, 4)
    v = value_cache.transpose(0, 2, 3, 1)
    return np.ascontiguousarray(k), np.ascontiguousarray(v)


def infer_geometry(key_shape, value_shape, layout, dtype):
    """Return ``(num_blocks, block_size, num_kv_heads, head_size)`` from pool shapes."""
    check_layout(layout)
    if layout == "nhd":
        if len(key_shape) != 4 or tuple(key_shape) != tuple(value_shape):
            raise ValueError(
                "layout 'nhd' needs key and value of one shape [num_blocks, block_size, "
                f"num_kv_heads, head_size], but got {tuple(key_shape)} and {tuple(value_shape)}."
            )
        return tuple(int(s) for s in key_shape)
    if len(key_shape) != 5 or len(value_shape) != 4:
        raise ValueError(
            "layout 'vllm' needs key [num_blocks, num_kv_heads, head_size // x, block_size, x] "
            f"and value [num_blocks, num_kv_heads, head_size, block_size], but got "
            f"{tuple(key_shape)} and {tuple(value_shape)}."
        )
    nb, nkv, hx, bs, x = (int(s) for s in key_shape)
    geometry = (nb, bs, nkv, hx * x)
    expected = cache_shapes(layout, *geometry, dtype)
    if x != vector_width(dtype) or expected != (tuple(key_shape), tuple(value_shape)):
        raise ValueError(
            f"pool shapes {tuple(key_shape)} and {tuple(value_shape)} are not a 'vllm' "
            f"layout for {np.dtype(dtype).name}; expected {expected[0]} and {expected[1]}."
        )
    return geometry
