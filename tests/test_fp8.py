"""fp8 KV caches (float8_e4m3fn, float8_e5m2): the device conversion, the
cache's scales, write_kv's quantisation, decode over fp8 pools, and bad input.

* The device encoder (``kernels.fp8.encoder``, called as a Python function
  under the simulator, in a kernel on a GPU) is bit-exact against ``ml_dtypes`` on every fp16 and
  every bf16 bit pattern divided by several float32 scales, with saturation
  at the format's max in place of ml_dtypes' NaN/inf; the decoder on every
  code.
* ``write_kv`` stores what :func:`paged_numba.fp8.quantize` computes, in
  every layout, from fp16, bf16 and fp32 keys, with per-tensor and per-head
  scales.
* Decode and prefill over fp8 pools (here the CUDA-core kernels) match the
  float64 reference of the dequantised values within the error model
  (hypothesis: both formats, both scale granularities, every query dtype and
  layout, the variants, split-K for decode).
"""
import functools

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import cuda, float32

import paged_numba as pn
from paged_numba import fp8 as F
from paged_numba.kernels import fp8 as K
from paged_numba.testing import (check_attention, decode_problems, decode_reference,
                                 prefill_problems, prefill_reference, variants)

FORMATS = F.FP8_DTYPES
BF16 = np.dtype(ml_dtypes.bfloat16)
SIM = pn.simulator_enabled()


@functools.cache
def _mapper(fn):
    @cuda.jit
    def each(x, out):
        i = cuda.grid(1)
        if i < x.size:
            out[i] = fn(x[i])
    return each


def _map(fn, x, dtype):
    """``fn`` (a device function) on every element of ``x``: called from Python
    under the simulator (a kernel of 262,144 simulated threads would take
    minutes), in a kernel on a GPU."""
    if SIM:
        return np.fromiter((fn(v) for v in x), dtype, count=x.size)
    out = cuda.device_array(x.size, dtype)
    _mapper(fn)[(x.size + 255) // 256, 256](cuda.to_device(x), out)
    return out.copy_to_host()


@functools.cache
def _loader(fmt):
    load = K.load16_fp8(fmt)

    @cuda.jit
    def one(buf, flat, out):
        load(buf, flat, out, 0)
    return one


@cuda.jit
def _query_conversions(bits, halves, out_bits, out_halves, got):
    got[0] = K.to_f32_any(bits[1])
    got[1] = K.to_f32_any(halves[0])
    out_bits[0] = K.store_as(float32(1.0 + 2.0 ** -9), out_bits)
    out_halves[0] = K.store_as(float32(0.1), out_halves)


def _all_fp16():
    return np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(np.float16)


def _all_bf16():
    return np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(BF16)


def _expected(y, fmt):
    """ml_dtypes' conversion of float32 ``y``, saturated: finite overflow and
    inf clipped to the format's max first (NaN left as it is)."""
    m = np.float32(F.FP8_MAX[fmt])
    with np.errstate(invalid="ignore"):
        return np.where(np.isnan(y), y, np.clip(y, -m, m)).astype(F.FP8_NUMPY[fmt]).view(np.uint8)


# -- the device conversion -------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("source", ["float16", "bfloat16"])
def test_encoder_bit_exact_on_every_16_bit_pattern(fmt, source):
    x = (_all_fp16() if source == "float16" else _all_bf16()).astype(np.float32)
    encode = K.encoder(fmt)
    # 1: the patterns themselves; 0.37: rounding everywhere; 2**-12 pushes most of fp16
    # into saturation; 3e4 most of it into fp8 subnormals and zero
    for scale in (np.float32(1.0), np.float32(0.37), np.float32(2.0 ** -12), np.float32(3e4)):
        with np.errstate(over="ignore", invalid="ignore"):
            y = x / scale                               # float32, as write_kv divides
        got = _map(encode, y, np.uint8)
        want = _expected(y, fmt)
        bad = np.flatnonzero(got != want)
        assert bad.size == 0, (f"{bad.size} mismatches at scale {scale}, first: {y[bad[0]]!r} -> "
                               f"{got[bad[0]]:#04x}, expected {want[bad[0]]:#04x}")
        assert np.array_equal(F.quantize(x, scale, fmt).view(np.uint8), want)


@pytest.mark.parametrize("fmt", FORMATS)
def test_encoder_specials(fmt):
    encode, m = K.encoder(fmt), F.FP8_MAX[fmt]
    nan = 0x7F if fmt == "float8_e4m3fn" else 0x7E
    cases = [(np.inf, 0x7E if fmt == "float8_e4m3fn" else 0x7B), (2.0 * m, None), (np.nan, nan),
             (-np.nan, 0x80 | nan), (-0.0, 0x80), (0.0, 0x00)]
    xs = np.array([x for x, _ in cases] + [m, -np.inf], np.float32)
    got = _map(encode, xs, np.uint8)
    for (x, code), g in zip(cases, got):
        code = got[-2] if code is None else code     # 2 max saturates to max
        assert g == code, x
    assert got[-1] == 0x80 | got[0]                  # -inf and inf
    assert F.quantize(np.float32(np.inf), 1.0, fmt).astype(np.float64) == m


@pytest.mark.parametrize("fmt", FORMATS)
def test_decoder_exact_on_every_code(fmt):
    codes = np.arange(256, dtype=np.uint8)
    want = codes.view(F.FP8_NUMPY[fmt]).astype(np.float32).view(np.uint32)
    decode = K.decoder(fmt)
    got = _map(decode, codes, np.float32).view(np.uint32)
    assert np.array_equal(got, want)                       # NaN patterns and signs included
    assert np.array_equal(K.decode_table(fmt).view(np.uint32), want)
    # the 16-byte load (the simulator's table stand-in; on a GPU the device's
    # conversion) on an aligned buffer, every code included
    buf = np.concatenate([np.random.default_rng(1).integers(0, 256, 32, dtype=np.uint8),
                          codes])
    for flat in range(0, buf.size, 16):
        out = np.zeros(16, np.float32)
        if SIM:
            K.load16_fp8(fmt)(buf, flat, out, 0)
        else:
            d_out = cuda.to_device(out)
            _loader(fmt)[1, 1](cuda.to_device(buf), flat, d_out)
            out = d_out.copy_to_host()
        assert np.array_equal(out.view(np.uint32), want[buf[flat:flat + 16]]), flat


def test_query_conversions_follow_the_array_type():
    x = np.array([1.5, -2.25], BF16).view(np.uint16)
    got = np.zeros(4, np.float64)
    d_got = cuda.to_device(got)
    out_bits, out_halves = cuda.to_device(np.zeros(1, np.uint16)), cuda.to_device(np.zeros(1, np.float16))
    _query_conversions[1, 1](cuda.to_device(x), cuda.to_device(np.array([0.5], np.float16)),
                             out_bits, out_halves, d_got)
    got = d_got.copy_to_host()
    assert got[0] == -2.25 and got[1] == 0.5
    assert out_bits.copy_to_host()[0] == 0x3F80                 # 1 + 2**-9 to bf16: nearest even
    assert out_halves.copy_to_host()[0] == np.float16(0.1)      # an fp16 array: rounded by the store


# -- the cache and its scales -----------------------------------------------------

@pytest.mark.parametrize("layout", ["nhd", "vllm", "hnd", "interleaved"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_cache_pools_scales_and_host_copies(fmt, layout):
    c = pn.PagedKVCache(3, 4, 2, 32, dtype=fmt, layout=layout, k_scale=[0.5, 2.0])
    assert c.dtype == F.FP8_NUMPY[fmt] and c.key_cache.dtype == np.uint8
    assert c.nbytes == 2 * 3 * 4 * 2 * 32
    if layout == "vllm":
        assert c.key_cache.shape == (3, 2, 2, 4, 16)              # x = 16 // 1
    np.testing.assert_array_equal(c.k_scale, [0.5, 2.0])
    assert c.v_scale == 1.0
    k, v = c.to_host()
    assert k.dtype == F.FP8_NUMPY[fmt] and k.shape == (3, 4, 2, 32)
    # a round trip through from_host keeps the codes and the scales
    codes = np.random.default_rng(0).integers(0, 0x70, size=k.shape, dtype=np.uint8).view(k.dtype)
    pools = pn.layouts.from_nhd(codes, codes, layout)
    d = pn.PagedKVCache.from_host(*pools, layout, k_scale=3.0, v_scale=[1.0, 4.0])
    assert d.k_scale == 3.0 and d.dtype == F.FP8_NUMPY[fmt]
    np.testing.assert_array_equal(d.kv_scales.copy_to_host(), [[3.0, 3.0], [1.0, 4.0]])
    assert np.array_equal(d.to_host()[0].view(np.uint8), codes.view(np.uint8))
    assert np.array_equal(d.gather([2, 0], 5)[1].view(np.uint8),
                          np.concatenate([codes[2], codes[0]])[:5].view(np.uint8))
    assert f"dtype={fmt}" in repr(d) and "k_scale=3.0" in repr(d)


def test_layered_cache_shares_its_scales_with_layer_views():
    c = pn.PagedKVCache(2, 4, 2, 16, dtype="float8_e5m2", num_layers=3, v_scale=0.25)
    assert c.key_cache.shape == (3, 2, 4, 2, 16)
    view = c.layer(1)
    assert view.v_scale == 0.25
    view.k_scale = [2.0, 8.0]                          # through a view: the whole cache
    np.testing.assert_array_equal(c.k_scale, [2.0, 8.0])
    assert c.kv_scales is view.kv_scales
    np.testing.assert_array_equal(c.layer(2).kv_scales.copy_to_host(), [[2, 8], [0.25, 0.25]])


def test_fp8_scales_from_data():
    x = np.zeros((5, 2, 16), np.float32)
    x[3, 0, 7], x[1, 1, 2] = -896.0, 28.0
    assert F.fp8_scales(x, "float8_e4m3fn") == 2.0                   # 896 / 448
    np.testing.assert_array_equal(F.fp8_scales(x, "float8_e4m3fn", per_head=True),
                                  [2.0, 0.0625])                     # 28 / 448
    # the scale never lets |x| / scale exceed the max, whatever float32 rounding does
    y = np.random.default_rng(3).standard_normal((50, 4, 16)) * 7.3
    for fmt in FORMATS:
        s = F.fp8_scales(y, fmt, per_head=True)
        assert (np.abs(y.astype(np.float32)) / s[:, None] <= F.FP8_MAX[fmt]).all()


# -- write_kv ---------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["nhd", "vllm", "hnd", "interleaved"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_write_kv_quantises_like_the_host(fmt, layout):
    rng = np.random.default_rng(7)
    m = F.FP8_MAX[fmt]
    for src in ("float16", "bfloat16", "float32"):
        k = rng.standard_normal((3, 2, 16)) * np.array([1.0, 300.0])[:, None]
        k[0, 0, :6] = [np.nan, np.inf, -np.inf, 4 * m, 1e-30, -0.0]    # specials
        v = rng.standard_normal((3, 2, 16))
        with np.errstate(over="ignore"):                # 4 * 57344 is inf in fp16
            k, v = k.astype(np.dtype(src)), v.astype(np.dtype(src))
        ks, vs = F.fp8_scales(k, fmt, per_head=True), 0.75
        c = pn.PagedKVCache(4, 2, 2, 16, dtype=fmt, layout=layout, k_scale=ks, v_scale=vs)
        pn.write_kv(c, k, v, [5, -1, 2])               # token 1 is padding
        K_, V_ = c.gather([2, 1], 4)                   # slots 4, 5, 2, 3
        assert np.array_equal(K_[1].view(np.uint8), F.quantize(k[0], ks, fmt).view(np.uint8))
        assert np.array_equal(V_[2].view(np.uint8), F.quantize(v[2], vs, fmt).view(np.uint8))
        assert not K_[[0, 3]].view(np.uint8).any()     # untouched slots stay zero
        assert np.isnan(K_[1, 0, 0].astype(np.float32))
        assert K_[1, 0, 1].astype(np.float32) == m and K_[1, 0, 2].astype(np.float32) == -m


# -- decode -----------------------------------------------------------------------

# small: the simulator runs a thread block of 128 Python threads per head group and part
SHAPES = dict(head_sizes=(16, 32), block_sizes=(1, 4, 8), max_seq_len=20, max_seqs=2,
              max_kv_heads=2, groups=(1, 2, 3))


def run_fp8_decode(p, num_partitions=None, **extra):
    q, k, v = p.arrays()
    ks, vs = p.scales()
    cache = pn.PagedKVCache.from_host(*p.layout_pools(k, v), p.layout, k_scale=ks, v_scale=vs)
    out, lse = pn.paged_decode(q, cache, p.block_tables, p.seq_lens, return_lse=True,
                               num_partitions=num_partitions, **extra)
    # the reference and the bound see the stored values times their scales, in float64
    ref = decode_reference(p, q, F.dequantize(k, ks), F.dequantize(v, vs),
                           num_partitions=num_partitions, **extra)
    return q, out, lse, ref


@pytest.mark.parametrize("fmt", FORMATS)
@settings(max_examples=4)
@given(data=st.data())
def test_fp8_decode_matches_reference(fmt, data):
    p = data.draw(decode_problems(dtypes=(fmt,), **SHAPES), label="problem")
    extra = data.draw(variants(p.num_heads, max_window=int(p.seq_lens.max()) + 2), label="variants")
    parts = data.draw(st.sampled_from([None, 1, 2]), label="num_partitions")
    q, out, lse, ref = run_fp8_decode(p, parts, **extra)
    assert out.dtype == np.dtype(p.query_dtype)
    check_attention(q, out, lse, *ref)


@pytest.mark.parametrize("fmt", FORMATS)
@settings(max_examples=6)
@given(data=st.data())
def test_fp8_prefill_matches_reference(fmt, data):
    p = data.draw(prefill_problems(head_sizes=(16, 32), block_sizes=(1, 4, 8), dtypes=(fmt,),
                                   groups=(1, 2), max_seqs=2, max_q_len=6, max_cached=10),
                  label="problem")
    extra = data.draw(variants(p.num_heads, max_window=int(p.seq_lens.max()) + 2), label="variants")
    causal = data.draw(st.booleans(), label="causal")
    q, k, v = p.arrays()
    ks, vs = p.scales()
    cache = pn.PagedKVCache.from_host(*p.layout_pools(k, v), p.layout, k_scale=ks, v_scale=vs)
    out, lse = pn.paged_prefill(q, cache, p.block_tables, p.cu_seqlens_q, p.seq_lens,
                                causal=causal, return_lse=True, **extra)
    assert out.dtype == np.dtype(p.query_dtype)
    check_attention(q, out, lse, *prefill_reference(p, q, F.dequantize(k, ks),
                                                    F.dequantize(v, vs), causal=causal, **extra))


def test_fp8_plan_follows_scale_changes():
    from numba import cuda

    p = pn.testing.DecodeProblem(
        num_seqs=1, num_heads=2, num_kv_heads=2, head_size=16, block_size=4, num_blocks=6,
        layout="hnd", dtype="float8_e4m3fn", seq_lens=np.array([9], np.int32),
        block_tables=np.array([[4, 0, 5]], np.int32), seed=5,
        query_dtype="float32", per_head_scales=True)
    q, k, v = p.arrays()
    ks, vs = p.scales()
    cache = pn.PagedKVCache.from_host(*p.layout_pools(k, v), p.layout, k_scale=ks, v_scale=vs)
    plan = pn.DecodePlan(cache, 1, 2, 3, query_dtype="float32")
    args = [cuda.to_device(a) for a in (q, p.block_tables, p.seq_lens)]
    first = plan.run(*args).copy_to_host()
    check_attention(q, first, plan.lse.copy_to_host(),
                    *decode_reference(p, q, F.dequantize(k, ks), F.dequantize(v, vs),
                                      num_partitions=plan.num_partitions))
    cache.v_scale = vs * 2                              # the packed launch reads the new scales
    assert np.array_equal(plan.run(*args).copy_to_host(), 2 * first)    # a power of two: exact


# -- bad input --------------------------------------------------------------------

@pytest.mark.parametrize("value, message", [
    (0.0, "k_scale is 0.0"), (-1.0, "k_scale is -1.0"), (float("nan"), "k_scale is nan"),
    (float("inf"), "k_scale is inf"), (1e39, r"k_scale is 1e\+39"),      # inf in float32
    ([1.0, -2.0], r"k_scale\[1\] is -2.0"), ([1.0, 2.0, 3.0], r"got shape \(3,\)"),
    ([[1.0, 2.0]], r"got shape \(1, 2\)"), ("1.0", "positive number"), (True, "positive number"),
])
def test_bad_scales_are_refused(value, message):
    with pytest.raises(ValueError, match=message):
        pn.PagedKVCache(2, 4, 2, 16, dtype="float8_e4m3fn", k_scale=value)
    c = pn.PagedKVCache(2, 4, 2, 16, dtype="float8_e4m3fn", k_scale=0.5)
    with pytest.raises(ValueError, match=message):
        c.k_scale = value
    assert c.k_scale == 0.5 and c.kv_scales.copy_to_host()[0].tolist() == [0.5, 0.5]  # unchanged
    with pytest.raises(ValueError, match=message.replace("k_scale", "v_scale")):
        c.v_scale = value


def test_bad_fp8_caches_and_inputs():
    with pytest.raises(ValueError, match="multiple of 16"):
        pn.PagedKVCache(2, 4, 1, 8, dtype="float8_e5m2")
    with pytest.raises(ValueError, match="fp8 caches only"):
        pn.PagedKVCache(2, 4, 1, 16, k_scale=0.5)
    with pytest.raises(ValueError, match="fp8 caches only"):
        pn.PagedKVCache(2, 4, 1, 16).v_scale = 2.0
    c = pn.PagedKVCache(2, 4, 1, 16, dtype="float8_e4m3fn")
    table, lens = np.array([[1]], np.int32), np.array([3], np.int32)
    for dt in (np.float64, np.int8, np.uint8):
        with pytest.raises(ValueError, match=r"query for a float8_e4m3fn cache must be one of"):
            pn.paged_decode(np.zeros((1, 2, 16), dt), c, table, lens)
        with pytest.raises(ValueError, match=r"key for a float8_e4m3fn cache must be one of"):
            pn.write_kv(c, np.zeros((1, 1, 16), dt), np.zeros((1, 1, 16), dt), [0])
    with pytest.raises(ValueError, match="key and value must have the same dtype"):
        pn.write_kv(c, np.zeros((1, 1, 16), np.float16), np.zeros((1, 1, 16), np.float32), [0])
    assert not c.key_cache.copy_to_host().any()         # nothing was written
    with pytest.raises(ValueError, match="tensor_cores=True with an fp8 cache needs"):
        pn.DecodePlan(c, 1, 2, 1, tensor_cores=True)       # head size 16
    with pytest.raises(ValueError, match="tensor_cores=True needs"):
        pn.paged_prefill(np.zeros((1, 2, 16), np.float16), c, table, [0, 1], lens,
                         tensor_cores=True)
    with pytest.raises(ValueError, match="query_dtype for a float8_e4m3fn cache"):
        pn.DecodePlan(c, 1, 2, 1, query_dtype="float64")
    with pytest.raises(ValueError, match="cascade decode does not take fp8 caches"):
        pn.cascade_decode(np.zeros((1, 2, 16), np.float16), c, [0], 4, [[1]], [2])
    with pytest.raises(ValueError, match="query_dtype for a float8_e4m3fn cache"):
        pn.PrefillPlan(c, [0, 1], [3], 2, query_dtype=np.int8)
    with pytest.raises(ValueError, match="query_dtype must be the cache's dtype"):
        pn.DecodePlan(pn.PagedKVCache(2, 4, 1, 16), 1, 2, 1, query_dtype="float32")


# -- the fp8 sweep's measure ------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
def test_fp8_blocks_swap_out_and_back_bit_for_bit(fmt):
    """``host_pool`` / ``swap_blocks`` / ``copy_blocks`` move an fp8 cache's codes as they are."""
    cache = pn.PagedKVCache(4, 8, 1, 16, dtype=fmt, k_scale=0.5, v_scale=2.0)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, 1, 16)).astype(np.float16)
    pn.write_kv(cache, x, -x, np.arange(8, 16))                # block 1
    host = pn.host_pool(cache, 2)
    pn.swap_blocks(cache, host, [(1, 0)])
    pn.swap_blocks(host, cache, [(0, 3)])
    pn.copy_blocks(cache, [(3, 2)])
    k, v = cache.to_host()
    for b in (2, 3):
        np.testing.assert_array_equal(k[b].view(np.uint8), k[1].view(np.uint8))
        np.testing.assert_array_equal(v[b].view(np.uint8), v[1].view(np.uint8))
    assert np.any(k[1].view(np.uint8) != 0)


def test_fp8_sweep_orders_the_formats():
    from paged_numba.sweeps.fp8 import measure_fp8

    point = dict(dist="gaussian", head_size=32, context=64, seed=1)
    r = {c: measure_fp8(dict(point, kv_cache=c)) for c in
         ("float16", "float8_e4m3fn/head", "float8_e5m2/head")}
    err = {c: m["rel_err"] for c, m in r.items()}
    # fp16 keeps 11 bits, E4M3 4 and E5M2 3
    assert err["float16"] * 20 < err["float8_e4m3fn/head"] < err["float8_e5m2/head"]
    assert r["float8_e4m3fn/head"]["bytes_per_token"] * 2 == r["float16"]["bytes_per_token"]
    # the storage error of a 3-bit mantissa: at most 2**-4 relative, about 2.5% in norm
    assert 0.01 < r["float8_e4m3fn/head"]["k_rel_err"] < 2.0 ** -4
    # heads 2**16 apart in size: one scale for the tensor pushes the small heads into
    # E4M3's subnormals and zero, one per head keeps them
    wide = dict(point, dist="wide-heads")
    per_tensor = measure_fp8(dict(wide, kv_cache="float8_e4m3fn/tensor"))["rel_err"]
    per_head = measure_fp8(dict(wide, kv_cache="float8_e4m3fn/head"))["rel_err"]
    assert per_head * 4 < per_tensor
