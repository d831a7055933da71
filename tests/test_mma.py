"""The tensor-core product and word loads (``kernels/mma.py``) against NumPy,
with the fragment layout written out independently of the decode kernel. On
the simulator this checks the stand-in; on a GPU, the hardware."""
import numpy as np
import pytest
from numba import config, cuda, float32, uint32

import paged_numba  # noqa: F401  (simulator warp operations; NumPy's "bfloat16" dtype)
from paged_numba.kernels.mma import load_words, mma_m16n8k16
from paged_numba.testing import TENSOR_CORE_U


def _words(pairs):
    """Pack ``[..., 2]`` 16-bit patterns into uint32 words, lower index low."""
    pairs = pairs.astype(np.uint32)
    return pairs[..., 0] | (pairs[..., 1] << 16)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_mma_m16n8k16_is_a_times_b_plus_c(dtype):
    rng = np.random.default_rng(7)
    a = rng.standard_normal((16, 16)).astype(dtype)   # "bfloat16": registered by ml_dtypes
    b = rng.standard_normal((16, 8)).astype(dtype)
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
        d = mma(uint32(fa[lane, 0]), uint32(fa[lane, 1]), uint32(fa[lane, 2]),
                uint32(fa[lane, 3]), uint32(fb[lane, 0]), uint32(fb[lane, 1]),
                float32(fc[lane, 0]), float32(fc[lane, 1]), float32(fc[lane, 2]),
                float32(fc[lane, 3]))
        for e in range(4):
            out[lane, e] = d[e]

    out = cuda.to_device(np.zeros((32, 4), np.float32))
    kernel[1, 32](cuda.to_device(frag_a), cuda.to_device(frag_b), cuda.to_device(frag_c), out)
    # products are exact in fp32; 16 terms + C summed with at most TENSOR_CORE_U each
    _check_tile(out.copy_to_host(), a, b, c, 17)


def _check_tile(got, a, b, c, terms):
    """Lane outputs ``got [32, 4]`` (the C/D fragment layout) against ``a @ b + c``,
    each of the ``terms`` summands off by at most TENSOR_CORE_U."""
    d = np.zeros((16, 8))
    for lane in range(32):
        r, q = divmod(lane, 4)
        d[r, 2 * q:2 * q + 2], d[r + 8, 2 * q:2 * q + 2] = got[lane, :2], got[lane, 2:]
    exact = a.astype(np.float64) @ b.astype(np.float64) + c
    mags = np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64)) + np.abs(c)
    assert (np.abs(d - exact) <= terms * TENSOR_CORE_U * mags).all()


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


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_mma_m16n8k8_is_a_times_b_plus_c(dtype):
    from paged_numba.kernels.mma import mma_m16n8k8
    rng = np.random.default_rng(8)
    a = rng.standard_normal((16, 8)).astype(dtype)
    b = rng.standard_normal((8, 8)).astype(dtype)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    bits_a, bits_b = a.view(np.uint16), b.view(np.uint16)
    frag = np.zeros((32, 3), np.uint32)           # m16n8k8 .row.col: a0, a1, b0
    frag_c = np.zeros((32, 4), np.float32)
    for lane in range(32):
        r, q = divmod(lane, 4)
        frag[lane] = _words(np.stack([bits_a[r, 2 * q:2 * q + 2], bits_a[r + 8, 2 * q:2 * q + 2],
                                      bits_b[2 * q:2 * q + 2, r]]))
        frag_c[lane] = [c[r, 2 * q], c[r, 2 * q + 1], c[r + 8, 2 * q], c[r + 8, 2 * q + 1]]
    mma = mma_m16n8k8(dtype)

    @cuda.jit
    def kernel(f, fc, out):
        lane = cuda.threadIdx.x
        d = mma(uint32(f[lane, 0]), uint32(f[lane, 1]), uint32(f[lane, 2]),
                float32(fc[lane, 0]), float32(fc[lane, 1]), float32(fc[lane, 2]),
                float32(fc[lane, 3]))
        for e in range(4):
            out[lane, e] = d[e]

    out = cuda.to_device(np.zeros((32, 4), np.float32))
    kernel[1, 32](cuda.to_device(frag), cuda.to_device(frag_c), out)
    _check_tile(out.copy_to_host(), a, b, c, 9)


@pytest.mark.parametrize("trans", [True, False])
def test_ldmatrix_x4_gives_each_lane_its_pairs(trans):
    from paged_numba.kernels.mma import ldmatrix_x4, ldmatrix_x4_trans
    load = ldmatrix_x4_trans if trans else ldmatrix_x4
    # four 8 x 8 matrices of distinct 16-bit patterns; lane 8j + t names row t of
    # matrix j, stored at a lane-dependent (non-sequential) place
    m = (np.arange(4 * 64, dtype=np.uint16) * 7 + 3).reshape(4, 8, 8)
    slot = (np.arange(32) * 5) % 32                # lane -> 16-byte slot
    pool = np.zeros((32, 8), np.uint16)
    for lane in range(32):
        pool[slot[lane]] = m[lane // 8, lane % 8]

    @cuda.jit
    def kernel(src, slots, out):
        lane = cuda.threadIdx.x
        sh = cuda.shared.array(256, np.float16)
        for e in range(8):
            sh[lane * 8 + e] = src[lane * 8 + e]
        cuda.syncthreads()
        w0, w1, w2, w3 = load(sh, slots[lane] * 8)
        out[lane, 0] = w0
        out[lane, 1] = w1
        out[lane, 2] = w2
        out[lane, 3] = w3

    out = cuda.to_device(np.zeros((32, 4), np.uint32))
    kernel[1, 32](cuda.to_device(pool.reshape(-1).view(np.float16)),
                  cuda.to_device(slot.astype(np.int32)), out)
    got = out.copy_to_host()
    for lane in range(32):
        r, q = divmod(lane, 4)
        mats = m.transpose(0, 2, 1) if trans else m     # trans: (M_j[2q, r], M_j[2q+1, r])
        want = [int(mats[j, r, 2 * q]) | (int(mats[j, r, 2 * q + 1]) << 16) for j in range(4)]
        assert got[lane].tolist() == want, lane


@pytest.mark.skipif(not config.ENABLE_CUDASIM
                    and cuda.get_current_device().compute_capability[0] < 9,
                    reason="stmatrix needs sm_90")
def test_stmatrix_x4_writes_each_lanes_row():
    from paged_numba.kernels.mma import stmatrix_x4
    # lane 4r + q holds, in word j, the pair (M_j[r, 2q], M_j[r, 2q + 1]); lane
    # 8j + t names where row t of matrix j goes (a lane-dependent slot)
    m = (np.arange(4 * 64, dtype=np.uint16) * 7 + 3).reshape(4, 8, 8)
    words = np.zeros((32, 4), np.uint32)
    for lane in range(32):
        r, q = divmod(lane, 4)
        for j in range(4):
            words[lane, j] = int(m[j, r, 2 * q]) | (int(m[j, r, 2 * q + 1]) << 16)
    slot = (np.arange(32) * 5 + 3) % 32

    @cuda.jit
    def kernel(w, slots, out):
        lane = cuda.threadIdx.x
        sh = cuda.shared.array(256, np.float16)
        stmatrix_x4(sh, slots[lane] * 8, w[lane, 0], w[lane, 1], w[lane, 2], w[lane, 3])
        cuda.syncthreads()
        for e in range(8):
            out[lane * 8 + e] = sh[lane * 8 + e]

    out = cuda.to_device(np.zeros(256, np.float16))
    kernel[1, 32](cuda.to_device(words), cuda.to_device(slot.astype(np.int32)), out)
    got = out.copy_to_host().view(np.uint16).reshape(32, 8)
    for lane in range(32):
        assert got[slot[lane]].tolist() == m[lane // 8, lane % 8].tolist(), lane


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_split_pack_keeps_the_weights_to_the_stated_precision(dtype):
    from paged_numba.kernels.mma import split_pack
    rng = np.random.default_rng(9)
    x = np.concatenate([rng.random(400), 2.0 ** rng.uniform(-60, 0, 400),
                        [0.0, 1.0, 2.0 ** -29, 2.0 ** -40]]).astype(np.float32)
    x = x[:len(x) // 2 * 2].reshape(-1, 2)
    split = split_pack(dtype)

    @cuda.jit
    def kernel(xs, out):
        i = cuda.grid(1)
        if i < xs.shape[0]:
            out[i, 0], out[i, 1] = split(xs[i, 0], xs[i, 1])

    out = cuda.to_device(np.zeros((len(x), 2), np.uint32))
    kernel[(len(x) + 63) // 64, 64](cuda.to_device(x), out)
    words = out.copy_to_host()
    halves = words[..., None] >> np.array([0, 16], np.uint32) & 0xFFFF     # [n, hi/lo, x0/x1]
    vals = halves.astype(np.uint16).view(dtype).astype(np.float64)
    y = x.astype(np.float64) * 2.0 ** 15
    rel, absolute = (2.0 ** -22, 2.0 ** -25) if dtype == "float16" else (2.0 ** -16, 0.0)
    err = np.abs(vals[:, 0] + vals[:, 1] - y)
    assert (err <= rel * y + absolute).all()
    # the hi half alone is the one-rounding value: the lo half is what carries the rest
    assert (np.abs(vals[:, 0] - y) > rel * y + absolute).any()
