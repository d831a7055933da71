"""The tensor-core product and word loads (``kernels/mma.py``) against NumPy,
with the fragment layout written out independently of the decode kernel. On
the simulator this checks the stand-in; on a GPU, the hardware."""
import numpy as np
import pytest
from numba import cuda, float32, uint32

import paged_numba  # noqa: F401  (simulator warp operations)
from paged_numba.kernels.mma import load_words, mma_m16n8k16
from paged_numba.testing import TENSOR_CORE_U


def _words(pairs):
    """Pack ``[..., 2]`` 16-bit patterns into uint32 words, lower index low."""
    pairs = pairs.astype(np.uint32)
    return pairs[..., 0] | (pairs[..., 1] << 16)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_mma_m16n8k16_is_a_times_b_plus_c(dtype):
    import ml_dtypes
    rng = np.random.default_rng(7)
    host_t = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    a = rng.standard_normal((16, 16)).astype(host_t)
    b = rng.standard_normal((16, 8)).astype(host_t)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    bits_a, bits_b = a.view(np.uint16), b.view(np.uint16)
    # per lane (r, c4) = divmod(lane, 4): the PTX fragment layout of m16n8k16 .row.col
    frag_a = np.zeros((32, 4), np.uint32)
    frag_b = np.zeros((32, 2), np.uint32)
    frag_c = np.zeros((32, 4), np.float32)
    for lane in range(32):
        r, q = divmod(lane, 4)
        frag_a[lane] = _words(np.stack([bits_a[r, 2 * q:2 * q + 2], bits_a[r + 8, 2 * q:2 * q + 2],
                                        bits_a[r, 2 * q + 8:2 * q + 10],
                                        bits_a[r + 8, 2 * q + 8:2 * q + 10]]))
        frag_b[lane] = _words(np.stack([bits_b[2 * q:2 * q + 2, r], bits_b[2 * q + 8:2 * q + 10, r]]))
        frag_c[lane] = [c[r, 2 * q], c[r, 2 * q + 1], c[r + 8, 2 * q], c[r + 8, 2 * q + 1]]
    mma = mma_m16n8k16(dtype)

    @cuda.jit
    def kernel(fa, fb, fc, out):
        lane = cuda.threadIdx.x
        d0, d1, d2, d3 = mma(uint32(fa[lane, 0]), uint32(fa[lane, 1]), uint32(fa[lane, 2]),
                             uint32(fa[lane, 3]), uint32(fb[lane, 0]), uint32(fb[lane, 1]),
                             float32(fc[lane, 0]), float32(fc[lane, 1]), float32(fc[lane, 2]),
                             float32(fc[lane, 3]))
        out[lane, 0] = d0
        out[lane, 1] = d1
        out[lane, 2] = d2
        out[lane, 3] = d3

    out = cuda.to_device(np.zeros((32, 4), np.float32))
    kernel[1, 32](cuda.to_device(frag_a), cuda.to_device(frag_b), cuda.to_device(frag_c), out)
    got = out.copy_to_host()
    d = np.zeros((16, 8))
    for lane in range(32):
        r, q = divmod(lane, 4)
        d[r, 2 * q:2 * q + 2], d[r + 8, 2 * q:2 * q + 2] = got[lane, :2], got[lane, 2:]
    exact = a.astype(np.float64) @ b.astype(np.float64) + c
    # products are exact in fp32; 16 terms + C summed with at most TENSOR_CORE_U each
    mags = np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64)) + np.abs(c)
    assert (np.abs(d - exact) <= 17 * TENSOR_CORE_U * mags).all()


def test_load_words_returns_the_raw_16_bytes():
    data = np.arange(24, dtype=np.uint16) * 0x0101

    @cuda.jit
    def kernel(src, out):
        w0, w1, w2, w3 = load_words(src, 8)
        out[0] = w0
        out[1] = w1
        out[2] = w2
        out[3] = w3

    out = cuda.to_device(np.zeros(4, np.uint32))
    kernel[1, 1](cuda.to_device(data), out)
    assert (out.copy_to_host() == data[8:16].view(np.uint32)).all()
