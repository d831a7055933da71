"""bfloat16: the conversions (bit-exact against ml_dtypes), the cache and
write_kv with bf16 data, the vector loads, and merge with bf16 output.

On the device a bf16 array is a uint16 array of bit patterns; on the host it
is an ``ml_dtypes.bfloat16`` array."""
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from numba import config, cuda

import paged_numba as pn
from paged_numba import _arrays
from paged_numba.kernels.access import vector_accessors
from paged_numba.kernels.convert import codec
from paged_numba.kernels.merge import merge_kernel
from paged_numba.layouts import LAYOUTS, from_nhd
from paged_numba.testing import U32, check_close, gamma, ulp

BF16 = np.dtype(ml_dtypes.bfloat16)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def f32(bits):
    return np.array(bits, np.uint32).view(np.float32)


# float32 bit patterns at the edges of rounding to bf16 (the kept half | the dropped half)
EDGES = f32([
    0x3F800000, 0x3F808000, 0x3F818000,              # 1.0; ties to even: down to 0x3F80, up to 0x3F82
    0x3F807FFF, 0x3F808001, 0x3F80FFFF,              # just under / over a tie; carry into 0x3F81
    0x3FFFFFFF, 0x3FFF8000, 0xBFFF8000,              # carry into the exponent: 2.0 and -2.0
    0x00000000, 0x80000000,                          # +-0
    0x00000001, 0x00008000, 0x00018000, 0x00007FFF,  # subnormals: smallest, ties, under a tie
    0x007FFFFF, 0x807FFFFF, 0x00800000,              # largest subnormal rounds to the smallest normal
    0x7F7F0000, 0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF,  # max finite bf16; tie and above overflow to inf
    0xFF7F8000, 0x7F800000, 0xFF800000,              # -overflow; +-inf
    0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001,  # NaNs: quiet, signalling, both signs,
    0x7FBFFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 0x7F808000,  # payloads that would round into inf or wrap
])


def random_floats(n, seed=0):
    """Every kind of float32: uniform random bit patterns."""
    return np.random.default_rng(seed).integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)


def expected_bits(x):
    """ml_dtypes' float32 -> bfloat16 (round to nearest even), as uint16."""
    with np.errstate(invalid="ignore", over="ignore"):
        return x.astype(BF16).view(np.uint16)


ALL_BF16 = np.arange(2**16, dtype=np.uint32).astype(np.uint16)


# -- conversions ------------------------------------------------------------------------------

@pytest.mark.skipif(not config.ENABLE_CUDASIM,
                    reason="the Python fallbacks exist only under the simulator; on a GPU "
                           "test_conversions_in_a_kernel checks the compiled forms")
def test_simulator_fallbacks_match_ml_dtypes_bit_for_bit():
    to_f32, from_f32 = codec("bfloat16")
    xs = np.concatenate([EDGES, random_floats(20000)])
    got = np.array([from_f32(x) for x in xs], np.uint16)
    want = expected_bits(xs)
    bad = np.flatnonzero(got != want)
    assert not bad.size, [(hex(int(xs[i:i + 1].view(np.uint32)[0])), hex(got[i]), hex(want[i]))
                          for i in bad[:5]]
    back = np.array([to_f32(u) for u in ALL_BF16], np.float32)
    assert np.array_equal(back.view(np.uint32), ALL_BF16.view(BF16).astype(np.float32).view(np.uint32))


def _conversion_kernel():
    to_f32, from_f32 = codec("bfloat16")

    @cuda.jit
    def convert(out_f32, out_bits, bits, xs):
        start = cuda.grid(1)
        stride = cuda.gridsize(1)
        for i in range(start, bits.shape[0], stride):
            out_f32[i] = to_f32(bits[i])
        for i in range(start, xs.shape[0], stride):
            out_bits[i] = from_f32(xs[i])

    return convert


def test_conversions_in_a_kernel():
    # every bf16 pattern up, edge cases and random floats down; fewer on the simulator
    bits = ALL_BF16 if not config.ENABLE_CUDASIM else np.ascontiguousarray(ALL_BF16[::7])
    xs = np.concatenate([EDGES, random_floats(1 << 20 if not config.ENABLE_CUDASIM else 2000, 1)])
    out_f32, out_bits = cuda.device_array(bits.shape, np.float32), cuda.device_array(xs.shape, np.uint16)
    blocks = 1 if config.ENABLE_CUDASIM else 256
    _conversion_kernel()[blocks, 64](out_f32, out_bits, cuda.to_device(bits), cuda.to_device(xs))
    assert np.array_equal(out_f32.copy_to_host().view(np.uint32), bits.astype(np.uint32) << 16)
    assert np.array_equal(out_bits.copy_to_host(), expected_bits(xs))


def test_gpu_forms_compile_to_ptx():
    """The intrinsics (bitcasts, the vector load of uint16) and every bf16 kernel
    form compile with the real compiler, in a process without the simulator."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", PYTHONPATH=ROOT + os.pathsep
               + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", PTX_SCRIPT], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "compiled 11" in proc.stdout, proc.stdout


PTX_SCRIPT = r"""
from numba import cuda, float32, types
from paged_numba.kernels.access import vector_accessors
from paged_numba.kernels.convert import codec
from paged_numba.kernels.merge import merge_kernel
from paged_numba.kernels.write_kv import write_kv_kernel

def arr(dt, nd):
    return types.Array(dt, nd, "C")

U16, F32 = types.uint16, types.float32
to_f32, from_f32 = codec("bfloat16")

def conv(out_f, out_b, bits, xs):
    i = cuda.grid(1)
    if i < xs.shape[0]:
        out_f[i] = to_f32(bits[i])
        out_b[i] = from_f32(xs[i])

compiled = 0
ptx, _ = cuda.compile_ptx(conv, (arr(F32, 1), arr(U16, 1), arr(U16, 1), arr(F32, 1)), cc=(9, 0))
assert "shl.b32" in ptx, ptx
compiled += 1
NDIM = {"nhd": (4, 4), "vllm": (5, 4), "hnd": (4, 4), "interleaved": (5, 5)}
for layout, (kd, vd) in NDIM.items():
    k_vec, v_vec = vector_accessors(layout, "bfloat16")

    def vecs(out, kc, vc):
        k_vec(kc, 1, 0, 2, 1, out, 0)
        v_vec(vc, 1, 0, 2, 1, out, 8)

    ptx, _ = cuda.compile_ptx(vecs, (arr(F32, 1), arr(U16, kd), arr(U16, vd)), cc=(9, 0))
    assert "ld.global.v4" in ptx, (layout, ptx)                 # the 16-byte key load
    wk = write_kv_kernel(16, layout, 8)
    cuda.compile_ptx(wk.py_func, (arr(U16, kd), arr(U16, vd), arr(U16, 3), arr(U16, 3),
                                  arr(types.int64, 1), arr(types.int64, 1)), cc=(9, 0))
    compiled += 2
for v_dt, v_ty in (("float32", F32), ("bfloat16", U16)):
    cuda.compile_ptx(merge_kernel("bfloat16", v_dt).py_func,
                     (arr(U16, 3), arr(F32, 2), arr(v_ty, 4), arr(F32, 3)), cc=(9, 0))
    compiled += 1
print("compiled", compiled)
"""


def test_ulp_matches_the_bf16_grid():
    # one bf16 ulp is the gap to the next bf16 above (at the rounded value), as np.spacing
    # gives for float16: compare with ml_dtypes' nextafter-free arithmetic on the bits
    finite = ALL_BF16[(ALL_BF16 & 0x7FFF) < 0x7F7F]          # positive and negative, below max
    r = finite.view(BF16).astype(np.float64)
    nxt = ((finite & 0x7FFF) + 1).astype(np.uint16).view(BF16).astype(np.float64)
    assert np.array_equal(ulp(r, "bfloat16"), nxt - np.abs(r))
    assert ulp(np.array([3.3895313892515355e38]), "bfloat16")[0] == 2.0 ** 120   # max finite
    assert np.isnan(ulp(np.array([np.inf, np.nan]), "bfloat16")).all()
    assert np.array_equal(ulp(np.array([1.0, 1e-6]), "float16"), np.spacing(np.float16([1.0, 1e-6])))


# -- host side: dtypes and arrays -------------------------------------------------------------

def test_logical_dtypes_and_device_bits():
    x = np.array([[1.0, -2.5, np.inf, 3.0e38]], BF16)
    d, from_host = _arrays.as_device(x, "x")
    assert from_host and np.dtype(d.dtype) == np.uint16 and _arrays.logical_dtype(x) == BF16
    assert np.array_equal(d.copy_to_host(), x.view(np.uint16))
    back = _arrays.to_host(d, BF16)
    assert back.dtype == BF16 and np.array_equal(back.view(np.uint16), x.view(np.uint16))
    assert _arrays.to_host(d).dtype == np.uint16                  # no logical dtype: the bits
    assert _arrays.storage_dtype("bfloat16") == np.uint16
    assert _arrays.storage_dtype("float16") == np.float16
    z = _arrays.zeros((2, 3), "bfloat16")
    assert np.dtype(z.dtype) == np.uint16 and not z.copy_to_host().any()


def test_cache_holds_bits_and_returns_bfloat16():
    cache = pn.PagedKVCache(3, 4, 2, 16, dtype="bfloat16", layout="vllm")
    assert cache.dtype == BF16 and np.dtype(cache.key_cache.dtype) == np.uint16
    assert cache.key_cache.shape == (3, 2, 2, 4, 8)                # x = 16 // 2 = 8
    assert cache.nbytes == 2 * 3 * 4 * 2 * 16 * 2
    assert "dtype=bfloat16" in repr(cache)
    k, v = cache.to_host()
    assert k.dtype == v.dtype == BF16 and not k.astype(np.float32).any()
    K, V = cache.gather([2, 0], 0)
    assert K.dtype == V.dtype == BF16 and K.shape == (0, 2, 16)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_write_kv_from_host_round_trip_is_bit_exact(layout):
    rng = np.random.default_rng(3)
    nb, bs, nkv, hd = 3, 4, 2, 16
    # random bf16 bit patterns: every sign, exponent and NaN payload must survive unchanged
    before_k, before_v = (rng.integers(0, 2**16, (nb, bs, nkv, hd)).astype(np.uint16).view(BF16)
                          for _ in "kv")
    cache = pn.PagedKVCache.from_host(*from_nhd(before_k, before_v, layout), layout)
    got_k, got_v = cache.to_host()
    assert got_k.dtype == BF16
    assert np.array_equal(got_k.view(np.uint16), before_k.view(np.uint16))
    assert np.array_equal(got_v.view(np.uint16), before_v.view(np.uint16))

    slots = np.array([5, -1, 0, 11, 6])                          # 4 real tokens, 1 padding
    key = rng.integers(0, 2**16, (5, nkv, hd)).astype(np.uint16).view(BF16)
    value = rng.standard_normal((5, nkv, hd)).astype(BF16)
    pn.write_kv(cache, key, value, slots)
    expect_k, expect_v = (a.reshape(nb * bs, nkv, hd).copy() for a in (before_k, before_v))
    real = slots >= 0
    expect_k[slots[real]], expect_v[slots[real]] = key[real], value[real]
    got_k, got_v = cache.to_host(layout)
    want_k, want_v = from_nhd(expect_k.reshape(before_k.shape), expect_v.reshape(before_k.shape),
                              layout)
    assert got_k.dtype == BF16
    assert np.array_equal(got_k.view(np.uint16), want_k.view(np.uint16))
    assert np.array_equal(got_v.view(np.uint16), want_v.view(np.uint16))
    K, V = cache.gather([1, 2], 7)                               # slots 4..10: token 5 is key[0]
    assert K.dtype == BF16
    assert np.array_equal(K.view(np.uint16), expect_k[4:11].view(np.uint16))
    assert np.array_equal(V.view(np.uint16), expect_v[4:11].view(np.uint16))


def test_write_kv_checks_logical_dtypes():
    cache = pn.PagedKVCache(2, 4, 1, 8, dtype="bfloat16")
    key = np.ones((2, 1, 8), BF16)
    with pytest.raises(ValueError, match="key must have the same dtype as the cache, but got "
                                         "float16 and bfloat16"):
        pn.write_kv(cache, key.astype(np.float16), key, np.arange(2))
    with pytest.raises(ValueError, match="value must have the same dtype as the cache, but got "
                                         "uint16 and bfloat16"):           # NumPy bits are not bf16
        pn.write_kv(cache, key, key.view(np.uint16), np.arange(2))
    # a device array of bf16 bits is what the kernels take: accepted
    pn.write_kv(cache, cuda.to_device(key.view(np.uint16)), key * 3, np.array([1, 6]))
    K, V = cache.gather([0, 1], 8)
    assert K[[1, 6], 0, 0].tolist() == [1.0, 1.0] and V[[1, 6], 0, 0].tolist() == [3.0, 3.0]


# -- kernels reading bf16 -----------------------------------------------------------------------

def _vector_read_kernel(layout, head_size):
    k_vec, v_vec = vector_accessors(layout, "bfloat16")
    NV = head_size // 8

    @cuda.jit
    def read(out_k, out_v, kc, vc):
        t = cuda.threadIdx.x                                     # one token per thread
        blk = t // out_k.shape[1]
        off = t % out_k.shape[1]
        if blk < out_k.shape[0]:
            for h in range(out_k.shape[2]):
                for v in range(NV):
                    k_vec(kc, blk, h, off, v, out_k[blk, off, h], v * 8)
                    v_vec(vc, blk, h, off, v, out_v[blk, off, h], v * 8)

    return read


@pytest.mark.parametrize("layout", LAYOUTS)
def test_vector_accessors_read_bf16_exactly(layout):
    nb, bs, nkv, hd = 2, 4, 2, 16
    rng = np.random.default_rng(5)
    k = rng.integers(0, 2**16, (nb, bs, nkv, hd)).astype(np.uint16).view(BF16)
    v = rng.integers(0, 2**16, (nb, bs, nkv, hd)).astype(np.uint16).view(BF16)
    cache = pn.PagedKVCache.from_host(*from_nhd(k, v, layout), layout)
    out_k, out_v = (cuda.to_device(np.zeros((nb, bs, nkv, hd), np.float32)) for _ in "kv")
    _vector_read_kernel(layout, hd)[1, nb * bs](out_k, out_v, cache.key_cache, cache.value_cache)
    for out, want in ((out_k, k), (out_v, v)):
        assert np.array_equal(out.copy_to_host().view(np.uint32),
                              want.astype(np.float32).view(np.uint32))


def test_vector_accessors_keep_the_old_vec_signature():
    # (layout, 8) and (layout, 4) mean float16 and float32, as before bfloat16
    assert vector_accessors("nhd", 8) is not None and vector_accessors("vllm", 4) is not None
    with pytest.raises(ValueError, match="no vector accessors for dtype 'int8'"):
        vector_accessors("nhd", "int8")


# -- merge with bf16 output -------------------------------------------------------------------

TRANSCENDENTAL_ULPS = 8


def merge_reference(v, s):
    """float64 merge and its fp32 rounding-error bounds.

    With ``M = max_k s_k``, each weight ``w_k = exp(s_k - M)`` is computed with
    relative error ``e_k <= u (|s_k - M| + TRANSCENDENTAL_ULPS)`` (the subtraction's
    rounding, amplified by exp, plus exp's own ulps); the sums of ``S`` terms add
    ``gamma(S)``. With ``N = sum_k w_k v_k`` and ``D = sum_k w_k``::

        |dN| <= sum_k w_k |v_k| (e_k + gamma(S + 1)),  |dD| <= sum_k w_k (e_k + gamma(S))
        |d out| <= (|dN| + |out| |dD|) / (D - |dD|) + 2u |out|   (1 / D and the product)
        |d lse| <= -log(1 - |dD| / D) + u (TRANSCENDENTAL_ULPS |log D| + |lse|)
    """
    v, s = np.asarray(v, np.float64), np.asarray(s, np.float64)
    S = s.shape[1]
    m = s.max(axis=1, keepdims=True)                                    # [n, 1, H]
    w = np.exp(s - m)
    e = U32 * (np.abs(s - m) + TRANSCENDENTAL_ULPS)
    D = w.sum(axis=1)
    out = np.einsum("nkh,nkhd->nhd", w, v) / D[..., None]
    lse = m[:, 0] + np.log(D)
    dN = np.einsum("nkh,nkhd->nhd", w * (e + gamma(S + 1)), np.abs(v))
    dD = (w * (e + gamma(S))).sum(axis=1)
    bound = (dN + np.abs(out) * dD[..., None]) / (D - dD)[..., None] + 2 * U32 * np.abs(out)
    bound_lse = -np.log1p(-dD / D) + U32 * (TRANSCENDENTAL_ULPS * np.abs(np.log(D)) + np.abs(lse))
    return out, lse, bound, bound_lse


@pytest.mark.parametrize("v_dtype", ["float32", "bfloat16"])
def test_merge_with_bf16_output_within_the_error_model(v_dtype):
    rng = np.random.default_rng(11)
    n, S, H, D = 2, 3, 2, 16
    v = rng.standard_normal((n, S, H, D)).astype(np.dtype(v_dtype))
    s = (rng.standard_normal((n, S, H)) * 4).astype(np.float32)
    out = _arrays.zeros((n, H, D), "bfloat16")
    lse = cuda.device_array((n, H), np.float32)
    merge_kernel("bfloat16", v_dtype)[(H, n), 32](out, lse, _arrays.as_device(v, "v")[0],
                                                   cuda.to_device(s))
    got = _arrays.to_host(out, "bfloat16")
    assert got.dtype == BF16
    ref, ref_lse, bound, bound_lse = merge_reference(v, s)
    check_close(got, ref, bound)
    check_close(lse.copy_to_host(), ref_lse, bound_lse, "lse")
    # the bound is an ulp of bf16 in practice, and a wrong weight breaks it: drop state 0
    wrong = merge_reference(v[:, 1:], s[:, 1:])[0]
    assert not np.all(np.abs(got.astype(np.float64) - wrong) <= bound + ulp(wrong, BF16))


# -- PyTorch (GPU only) -----------------------------------------------------------------------

def test_torch_bf16_cuda_tensors():
    if config.ENABLE_CUDASIM:
        pytest.skip("needs a CUDA GPU: torch tensors on the device cannot exist under the simulator")
    torch = pytest.importorskip("torch", reason="torch is not installed")
    g = torch.Generator(device="cuda").manual_seed(0)
    key = torch.randn(5, 2, 16, device="cuda", dtype=torch.bfloat16, generator=g)
    value = torch.randn(5, 2, 16, device="cuda", dtype=torch.bfloat16, generator=g)
    assert _arrays.logical_dtype(key) == BF16
    d, from_host = _arrays.as_device(key, "key")
    assert not from_host and np.dtype(d.dtype) == np.uint16
    assert d.device_ctypes_pointer.value == key.data_ptr()          # no copy
    host_bits = key.view(torch.int16).cpu().numpy().view(np.uint16)
    assert np.array_equal(d.copy_to_host(), host_bits)
    assert np.array_equal(_arrays.to_host(key).view(np.uint16), host_bits)   # bf16 from torch
    assert _arrays.to_host(key).dtype == BF16

    cache = pn.PagedKVCache(3, 4, 2, 16, dtype="bfloat16", layout="vllm")
    slots = torch.tensor([5, -1, 0, 11, 6], device="cuda")
    pn.write_kv(cache, key, value, slots)
    K, V = cache.gather([0, 1, 2], 12)
    real = np.array([5, 0, 11, 6])
    assert np.array_equal(K[real].view(np.uint16), host_bits[[0, 2, 3, 4]])
    assert np.array_equal(V[real].view(np.uint16),
                          value.view(torch.int16).cpu().numpy().view(np.uint16)[[0, 2, 3, 4]])
    with pytest.raises(ValueError, match="same dtype as the cache, but got float16 and bfloat16"):
        pn.write_kv(cache, key.half(), value, slots)
