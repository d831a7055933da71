"""Tests for paged_numba/layouts.py (bookkeeping: it must import without numba)."""
import itertools
import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import paged_numba.layouts as lay


ALL = lay.HOST_LAYOUTS
PAIRS = list(itertools.product(ALL, ALL))
DTYPES = ["float16", "float32", "bfloat16"]


def test_layout_lists():
    # the kernels, PagedKVCache and the host converters all take the four layouts
    assert set(lay.LAYOUTS) == set(ALL) == {"nhd", "vllm", "hnd", "interleaved"}


@st.composite
def geometries(draw):
    """``(num_blocks, block_size, num_kv_heads, head_size, dtype)``, small and awkward."""
    return (draw(st.integers(1, 4)), draw(st.integers(1, 9)), draw(st.integers(1, 3)),
            draw(st.sampled_from([8, 16, 24, 32])), draw(st.sampled_from(DTYPES)))


def nhd_pools(geometry, seed, num_layers=None):
    nb, bs, nkv, hd, dtype = geometry
    shape = (nb, bs, nkv, hd) if num_layers is None else (num_layers, nb, bs, nkv, hd)
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(shape).astype(dtype) for _ in "kv")


# -- round trips ------------------------------------------------------------------------------

@pytest.mark.parametrize("src, dst", PAIRS)
@given(geometry=geometries(), seed=st.integers(0, 2**32 - 1))
def test_convert_round_trip_every_pair(src, dst, geometry, seed):
    nb, bs, nkv, hd, dtype = geometry
    k, v = nhd_pools(geometry, seed)
    src_k, src_v = lay.from_nhd(k, v, src)
    assert (src_k.shape, src_v.shape) == lay.cache_shapes(src, nb, bs, nkv, hd, dtype)
    dst_k, dst_v = lay.convert(src_k, src_v, src, dst)
    assert (dst_k.shape, dst_v.shape) == lay.cache_shapes(dst, nb, bs, nkv, hd, dtype)
    assert dst_k.dtype == dst_v.dtype == np.dtype(dtype)
    assert dst_k.flags.c_contiguous and dst_v.flags.c_contiguous
    assert (dst_k is dst_v) == (dst == "interleaved")
    back_k, back_v = lay.to_nhd(dst_k, dst_v, dst)
    assert np.array_equal(back_k, k) and np.array_equal(back_v, v)
    again_k, again_v = lay.convert(dst_k, dst_v, dst, src)
    assert np.array_equal(again_k, src_k) and np.array_equal(again_v, src_v)
    assert lay.infer_geometry(dst_k.shape, dst_v.shape, dst, dtype) == (nb, bs, nkv, hd)


@pytest.mark.parametrize("src, dst", PAIRS)
@given(geometry=geometries(), num_layers=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_layered_round_trip(src, dst, geometry, num_layers, seed):
    nb, bs, nkv, hd, dtype = geometry
    k, v = nhd_pools(geometry, seed, num_layers)
    src_k, src_v = lay.from_nhd(k, v, src, layered=True)
    assert (src_k.shape, src_v.shape) == lay.cache_shapes_layered(src, num_layers, nb, bs, nkv, hd, dtype)
    for layer in range(num_layers):  # each layer is converted on its own
        one_k, one_v = lay.from_nhd(k[layer], v[layer], src)
        assert np.array_equal(src_k[layer], one_k) and np.array_equal(src_v[layer], one_v)
    dst_k, dst_v = lay.convert(src_k, src_v, src, dst, layered=True)
    assert (dst_k.shape, dst_v.shape) == lay.cache_shapes_layered(dst, num_layers, nb, bs, nkv, hd, dtype)
    assert (dst_k is dst_v) == (dst == "interleaved")
    back_k, back_v = lay.to_nhd(dst_k, dst_v, dst, layered=True)
    assert np.array_equal(back_k, k) and np.array_equal(back_v, v)


def test_layered_pools_share_block_ids():
    # 2 layers, 3 blocks of 2 tokens, 1 head of 8: block 1 of layer 1 holds the same
    # logical block in every layout, so one block table serves every layer
    k = np.arange(2 * 3 * 2 * 1 * 8, dtype=np.float32).reshape(2, 3, 2, 1, 8)
    for layout in ALL:
        kc, vc = lay.from_nhd(k, -k, layout, layered=True)
        one_k, one_v = lay.from_nhd(k[1, 1:2], -k[1, 1:2], layout)   # block 1 of layer 1 alone
        assert np.array_equal(kc[1, 1:2], one_k) and np.array_equal(vc[1, 1:2], one_v)


# -- where a token lands -------------------------------------------------------------------

@st.composite
def token_writes(draw):
    geometry = draw(geometries())
    nb, bs, nkv, _, _ = geometry
    return geometry, draw(st.integers(0, nb - 1)), draw(st.integers(0, bs - 1)), draw(st.integers(0, nkv - 1))


@pytest.mark.parametrize("layout", ALL)
@given(write=token_writes())
def test_token_lands_where_the_documented_shape_says(layout, write):
    (nb, bs, nkv, hd, dtype), b, o, h = write
    k = np.zeros((nb, bs, nkv, hd), dtype)
    v = np.zeros_like(k)
    k[b, o, h] = np.arange(1, hd + 1)         # nonzero, distinct, exact in float16
    v[b, o, h] = -np.arange(1, hd + 1)
    kc, vc = lay.from_nhd(k, v, layout)
    d = np.arange(hd)
    if layout == "nhd":                       # [num_blocks, block_size, num_kv_heads, head_size]
        got_k, got_v = kc[b, o, h], vc[b, o, h]
    elif layout == "hnd":                     # [num_blocks, num_kv_heads, block_size, head_size]
        got_k, got_v = kc[b, h, o], vc[b, h, o]
    elif layout == "vllm":                    # K [nb, H, D // x, B, x], V [nb, H, D, B]
        x = 16 // np.dtype(dtype).itemsize
        got_k, got_v = kc[b, h, d // x, o, d % x], vc[b, h, d, o]
    else:                                     # one pool [nb, 2, B, H, D]: K at 0, V at 1
        assert kc is vc
        got_k, got_v = kc[b, 0, o, h], kc[b, 1, o, h]
        v_offset = lay.interleaved_v_offset(bs, nkv, hd)
        assert v_offset == bs * nkv * hd
        block = kc[b].reshape(-1)            # one buffer per block: K rows, then V rows
        row = (o * nkv + h) * hd              # each token row is H * D wide
        assert np.array_equal(block[row:row + hd], k[b, o, h])
        assert np.array_equal(block[v_offset + row:v_offset + row + hd], v[b, o, h])
        assert np.count_nonzero(block) == 2 * hd and np.count_nonzero(kc) == 2 * hd
    assert np.array_equal(got_k, k[b, o, h]) and np.array_equal(got_v, v[b, o, h])
    assert np.count_nonzero(kc) + (0 if vc is kc else np.count_nonzero(vc)) == 2 * hd  # nothing else moved


def test_interleaved_v_offset_arithmetic():
    assert lay.interleaved_v_offset(16, 2, 64) == 2048   # 16 * 2 * 64
    assert lay.interleaved_v_offset(1, 1, 8) == 8
    # in a [4, 2, 16, 2, 64] pool, V of (block 3, offset 5, head 1) starts at
    # 3 * 4096 + 2048 + (5 * 2 + 1) * 64 = 15104 elements from the pool's start
    pool = np.zeros((4, 2, 16, 2, 64), np.float16)
    pool[3, 1, 5, 1, 0] = 1
    assert int(np.flatnonzero(pool.reshape(-1))[0]) == 3 * 4096 + 2048 + (5 * 2 + 1) * 64


def test_interleaved_pair_api():
    k = np.ones((2, 3, 1, 8), np.float32)
    pool, same = lay.from_nhd(k, 2 * k, "interleaved")
    assert pool is same and pool.shape == (2, 2, 3, 1, 8)
    assert lay.cache_shapes("interleaved", 2, 3, 1, 8, "float32") == ((2, 2, 3, 1, 8),) * 2
    # two separate copies of the pool (e.g. key_cache and value_cache copied off a device) work too
    back_k, back_v = lay.to_nhd(pool.copy(), pool.copy(), "interleaved")
    assert np.array_equal(back_k, k) and np.array_equal(back_v, 2 * k)
    lpool, lsame = lay.from_nhd(k[None], 2 * k[None], "interleaved", layered=True)
    assert lpool is lsame and lpool.shape == (1, 2, 2, 3, 1, 8)


def test_shapes_of_each_layout():
    # 5 blocks of 16 tokens, 2 KV heads of 64: vLLM's x = 16 // 2 = 8 for float16, 4 for float32
    geometry = (5, 16, 2, 64)
    assert lay.cache_shapes("nhd", *geometry, "float16") == ((5, 16, 2, 64),) * 2
    assert lay.cache_shapes("hnd", *geometry, "float16") == ((5, 2, 16, 64),) * 2
    assert lay.cache_shapes("vllm", *geometry, "float16") == ((5, 2, 8, 16, 8), (5, 2, 64, 16))
    assert lay.cache_shapes("vllm", *geometry, "float32") == ((5, 2, 16, 16, 4), (5, 2, 64, 16))
    assert lay.cache_shapes("interleaved", *geometry, "float16") == ((5, 2, 16, 2, 64),) * 2
    assert lay.cache_shapes_layered("vllm", 3, *geometry, "float32") == ((3, 5, 2, 16, 16, 4), (3, 5, 2, 64, 16))
    for layout in ALL:
        for dtype in DTYPES:
            assert lay.infer_geometry(*lay.cache_shapes(layout, *geometry, dtype), layout, dtype) == geometry


def test_nhd_to_nhd_keeps_contiguous_arrays():
    k = np.zeros((1, 2, 1, 8), np.float16)
    assert lay.to_nhd(k, k, "nhd")[0] is k   # the long-standing no-copy behaviour


# -- errors ----------------------------------------------------------------------------------

def test_check_layout_names_the_unknown_layout():
    with pytest.raises(ValueError, match=r"layout must be one of \('nhd', 'vllm', 'hnd', "
                                         r"'interleaved'\), but got 'nchw'"):
        lay.check_layout("nchw")
    lay.check_layout("hnd")
    for call in (lambda: lay.to_nhd(np.zeros(1), np.zeros(1), "nchw"),
                 lambda: lay.convert(np.zeros(1), np.zeros(1), "nhd", "nchw"),
                 lambda: lay.cache_shapes("nchw", 1, 1, 1, 8, "float16")):
        with pytest.raises(ValueError, match="but got 'nchw'"):
            call()


@pytest.mark.parametrize("layout, key_shape, value_shape", [
    ("nhd", (2, 3, 8), (2, 3, 8)),                  # 3-D
    ("nhd", (2, 3, 1, 8), (2, 3, 1, 16)),           # key and value differ
    ("hnd", (2, 1, 3, 8, 1), (2, 1, 3, 8, 1)),      # 5-D
    ("interleaved", (2, 3, 4, 1, 8), (2, 3, 4, 1, 8)),   # axis 1 must be 2 (K, V)
    ("interleaved", (2, 2, 4, 1, 8), (2, 2, 4, 1, 16)),
    ("vllm", (2, 1, 1, 4, 8), (2, 1, 16, 4)),       # value head_size 16 != 1 * 8
    ("vllm", (2, 1, 1, 4, 8), (2, 1, 8, 4, 1)),     # value 5-D
])
def test_to_nhd_names_bad_shapes(layout, key_shape, value_shape):
    k, v = np.zeros(key_shape, np.float16), np.zeros(value_shape, np.float16)
    pattern = re.escape(f"layout {layout!r} needs") + ".*" + re.escape(f"but got {key_shape} and {value_shape}")
    with pytest.raises(ValueError, match=pattern):
        lay.to_nhd(k, v, layout)
    with pytest.raises(ValueError, match=re.escape(f"{key_shape} and {value_shape}")):
        lay.infer_geometry(key_shape, value_shape, layout, "float16")


def test_from_nhd_names_bad_shapes_and_dtypes():
    with pytest.raises(ValueError, match=re.escape("layout 'nhd' needs") + ".*" + re.escape("(1, 4, 8) and (1, 4, 8)")):
        lay.from_nhd(np.zeros((1, 4, 8)), np.zeros((1, 4, 8)), "hnd")
    with pytest.raises(ValueError, match="multiple of x = 8 for float16, but got head_size=12"):
        lay.from_nhd(np.zeros((1, 4, 1, 12), np.float16), np.zeros((1, 4, 1, 12), np.float16), "vllm")
    with pytest.raises(ValueError, match="same dtype, but got float16 and float32"):
        lay.from_nhd(np.zeros((1, 4, 1, 8), np.float16), np.zeros((1, 4, 1, 8), np.float32), "interleaved")


def test_layered_errors_name_the_shapes():
    k = np.zeros((2, 3, 4, 1, 8), np.float16)     # 2 layers of nhd [3, 4, 1, 8]
    with pytest.raises(ValueError, match=re.escape("one leading num_layers axis") + ".*"
                       + re.escape("(2, 3, 4, 1, 8) and (3, 3, 4, 1, 8)")):
        lay.from_nhd(k, np.zeros((3, 3, 4, 1, 8), np.float16), "hnd", layered=True)
    with pytest.raises(ValueError, match=re.escape("(3, 4, 1, 8) and (3, 4, 1, 8)")):
        lay.to_nhd(k[0], k[0], "nhd", layered=True)   # no layer axis: 3 layers of 3-D pools
    with pytest.raises(ValueError, match=re.escape("() and ()")):
        lay.to_nhd(np.float16(0), np.float16(0), "nhd", layered=True)


def test_infer_geometry_vllm_messages_unchanged():
    with pytest.raises(ValueError, match=r"layout 'vllm' needs key .* but got \(1, 2, 3, 4\)"):
        lay.infer_geometry((1, 2, 3, 4), (1, 2, 3, 4), "vllm", "float16")
    with pytest.raises(ValueError, match="are not a 'vllm' layout for float32; expected"):
        lay.infer_geometry((1, 2, 8, 4, 8), (1, 2, 64, 4), "vllm", "float32")   # x = 8 is float16's
