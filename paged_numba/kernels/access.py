"""Where a token's key and value elements sit in each cache layout, as
device functions the kernels share (decode, prefill, write_kv).

Each layout is defined once, by the index of element ``d`` of KV head ``h``
of the token at ``offset`` in physical block ``blk``; the scalar and the
16-byte vector accessors are built from it.
"""
import functools

from numba import int32, int64, uint32

from .convert import codec, device_function
from .vector import load16

_ITEMSIZE = {"float16": 2, "float32": 4, "bfloat16": 2}


@functools.cache
def element_accessors(layout, vec):
    """Device functions ``(k_at, v_at, k_put, v_put)`` for one cache layout.

    ``k_at(key_cache, block, kv_head, offset, d)`` reads element ``d`` of the
    token at ``offset`` in physical ``block``; the ``put`` forms write one.
    Each layout is defined by where that element sits in the K and V pools.
    """
    X = vec
    if layout == "nhd":
        def k_index(blk, h, off, d):
            return (blk, off, h, d)
        v_index = k_index
    elif layout == "vllm":
        def k_index(blk, h, off, d):
            return (blk, h, d // X, off, d % X)

        def v_index(blk, h, off, d):
            return (blk, h, d, off)
    elif layout == "hnd":
        def k_index(blk, h, off, d):
            return (blk, h, off, d)
        v_index = k_index
    elif layout == "interleaved":   # one pool [num_blocks, 2, block_size, heads, head_size]
        def k_index(blk, h, off, d):
            return (blk, 0, off, h, d)

        def v_index(blk, h, off, d):
            return (blk, 1, off, h, d)
    else:
        raise ValueError(f"unknown layout {layout!r}")
    k_index, v_index = device_function(k_index), device_function(v_index)

    @device_function
    def k_at(kc, blk, h, off, d):
        return kc[k_index(blk, h, off, d)]

    @device_function
    def v_at(vc, blk, h, off, d):
        return vc[v_index(blk, h, off, d)]

    @device_function
    def k_put(kc, blk, h, off, d, x):
        kc[k_index(blk, h, off, d)] = x

    @device_function
    def v_put(vc, blk, h, off, d, x):
        vc[v_index(blk, h, off, d)] = x

    return k_at, v_at, k_put, v_put


@functools.cache
def vector_offsets(layout, vec, block_size=None, head_size=None):
    """Device functions ``(k_flat, v_flat)``: ``k_flat(key_cache, blk, kv_head,
    offset, v)`` is the flat element index of vector ``v`` (elements ``v * vec
    ... v * vec + vec - 1``) of a token's key row, 16-byte aligned in a
    C-contiguous pool. ``v_flat`` is the same for values, or None in
    ``"vllm"``, whose value rows are strided by ``block_size``.

    With ``block_size`` and ``head_size`` given, those pool dimensions are
    compile-time constants (cheaper index arithmetic); otherwise they are read
    from the pool's shape."""
    X = vec
    BS = block_size
    D = head_size
    static = BS is not None and D is not None
    if layout in ("nhd", "hnd", "interleaved"):
        # the pool's (block, [K/V,] token, head) or (block, head, token) axes
        tok_ax, head_ax, dim_ax = {"nhd": (1, 2, 3), "hnd": (2, 1, 3),
                                   "interleaved": (2, 3, 4)}[layout]
        kv_pair = 2 if layout == "interleaved" else 1

        @device_function
        def dims(pool):
            if static:
                return BS, pool.shape[head_ax], D
            return pool.shape[tok_ax], pool.shape[head_ax], pool.shape[dim_ax]

        if layout == "hnd":

            @device_function
            def row(pool, blk, h, off, which):
                bs, nh, d = dims(pool)
                return ((blk * nh + h) * bs + off) * d
        else:

            @device_function
            def row(pool, blk, h, off, which):
                bs, nh, d = dims(pool)
                return (((blk * kv_pair + which) * bs + off) * nh + h) * d

        @device_function
        def k_flat(kc, blk, h, off, v):
            return row(kc, blk, h, off, 0) + v * X

        if layout == "interleaved":

            @device_function
            def v_flat(vc, blk, h, off, v):
                return row(vc, blk, h, off, 1) + v * X
        else:
            v_flat = k_flat

    elif layout == "vllm":

        @device_function
        def k_flat(kc, blk, h, off, v):
            bs = BS if static else kc.shape[3]
            return (((blk * kc.shape[1] + h) * kc.shape[2] + v) * bs + off) * X
        v_flat = None

    else:
        raise ValueError(f"unknown layout {layout!r}")
    return k_flat, v_flat


@functools.cache
def vector_accessors(layout, dtype):
    """Device functions ``(k_vec, v_vec)`` that copy one 16-byte vector (``vec =
    16 // itemsize`` elements of a head row) of a token's key or value into a
    float32 array, converted with ``codec(dtype)``.

    ``dtype`` is the storage dtype's name: ``"float16"``, ``"float32"`` or
    ``"bfloat16"`` (pools of bf16 bit patterns in ``uint16``; ``vec = 8``).
    For callers written before bfloat16, an int is taken as ``vec`` of a
    float16 (8) or float32 (4) cache, whose conversion is the same
    ``float32(x)``.

    ``k_vec(key_cache, blk, kv_head, offset, v, out, out_off)`` reads elements
    ``v * vec ... v * vec + vec - 1``. Keys are contiguous 16-byte vectors in
    every layout; values too, except in ``"vllm"``, where they are strided by
    ``block_size`` and read one by one.
    """
    if isinstance(dtype, int):          # the old (layout, vec) signature
        vec, dtype = dtype, {8: "float16", 4: "float32"}[dtype]
    else:
        dtype = getattr(dtype, "name", dtype)
        if dtype not in _ITEMSIZE:
            raise ValueError(f"no vector accessors for dtype {dtype!r}; supported: "
                             f"{tuple(_ITEMSIZE)}")
        vec = 16 // _ITEMSIZE[dtype]
    to_f32, _ = codec(dtype)
    _, v_at, _, _ = element_accessors(layout, vec)
    k_flat, v_flat = vector_offsets(layout, vec)

    @device_function
    def k_vec(kc, blk, h, off, v, out, o):
        load16(kc, k_flat(kc, blk, h, off, v), out, o)

    if v_flat is not None:

        @device_function
        def v_vec(vc, blk, h, off, v, out, o):
            load16(vc, v_flat(vc, blk, h, off, v), out, o)

    else:

        @device_function
        def v_vec(vc, blk, h, off, v, out, o):
            for e in range(vec):
                out[o + e] = to_f32(v_at(vc, blk, h, off, v * vec + e))

    return k_vec, v_vec


@device_function
def wide(block, stride):
    """``block * stride`` (both non-negative int32) as int64: one 32 x 32 -> 64
    multiply."""
    return int64(uint32(block)) * int64(uint32(stride))


@functools.cache
def row_strides(flat, step):
    """Device function ``strides(pool, kvh, v) -> (base, block stride, token
    stride, stride to vector v + step)``, in elements and int32 (a block's
    elements fit), of vector ``v`` of KV head ``kvh`` in ``pool``, where
    ``flat`` is a ``vector_offsets`` function: the element offset of vector
    ``v`` of the token at ``off`` in block ``blk`` is then ``wide(blk, block
    stride) + base + off * token stride``."""

    @device_function
    def strides(pool, kvh, v):
        b0 = flat(pool, 0, kvh, 0, v)
        return (int32(b0), int32(flat(pool, 1, kvh, 0, v) - b0),
                int32(flat(pool, 0, kvh, 1, v) - b0), int32(flat(pool, 0, kvh, 0, v + step) - b0))
    return strides
