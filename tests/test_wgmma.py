"""The warpgroup products of ``kernels.wgmma`` against NumPy.

Each case builds the shared-memory image of ``A`` and ``B`` from random
matrices with the layout formulas of the module's docstring (core matrices
placed by ``LBO`` and ``SBO``), runs one warpgroup through a kernel that
copies the images into shared memory and multiplies, reads each thread's
accumulators back through the documented accumulator layout and compares
with ``A @ B`` in float64. Under the simulator this checks the stand-ins
against the formulas; on an H100/H200 (sm_90) it checks the formulas, the
descriptors and the fragment layouts against the hardware."""
import functools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import config, cuda, float32
from numba.core.types import float16, uint16

import paged_numba  # noqa: F401  (switches the simulator on without a GPU)
from paged_numba.kernels import wgmma as W
from paged_numba.kernels.async_copy import commit_group, copy16_async, wait_group

if not config.ENABLE_CUDASIM and cuda.get_current_device().compute_capability[0] != 9:
    pytest.skip("wgmma needs compute capability 9.0 (sm_90a)", allow_module_level=True)


def kmajor_image(M, lbo, sbo, size, swizzle=0, koff=0):
    """Flat image (``size`` elements) of ``M[x, k]`` stored K-major (swizzled:
    starting ``koff`` bytes into each atom row)."""
    img = np.zeros(size, M.dtype)
    x, k = np.meshgrid(np.arange(M.shape[0]), np.arange(M.shape[1]), indexing="ij")
    if swizzle:
        byte = swizzle * (x % 8) + sbo * (x // 8) + koff + 2 * k
    else:
        byte = 16 * (x % 8) + sbo * (x // 8) + 2 * (k % 8) + lbo * (k // 8)
    img[W.swizzled(byte, swizzle) // 2] = M
    return img


def mnmajor_image(B, lbo, sbo, size, swizzle=0):
    """Flat image of ``B[k, n]`` stored MN-major (``n`` contiguous)."""
    img = np.zeros(size, B.dtype)
    k, n = np.meshgrid(np.arange(B.shape[0]), np.arange(B.shape[1]), indexing="ij")
    if swizzle:
        span = swizzle // 2
        byte = 2 * (n % span) + lbo * (n // span) + swizzle * (k % 8) + sbo * (k // 8)
    else:
        byte = 2 * (n % 8) + sbo * (n // 8) + 16 * (k % 8) + lbo * (k // 8)
    img[W.swizzled(byte, swizzle) // 2] = B
    return img


def accumulators_to_matrix(out, n):
    """``D[64, n]`` from each thread's ``acc[j, e]`` (``out[tid, 4 j + e]``)."""
    D = np.full((64, n), np.nan)
    for tid in range(128):
        w, lane = divmod(tid, 32)
        r, c = divmod(lane, 4)
        for j in range(n // 8):
            for e in range(4):
                D[16 * w + r + 8 * (e >> 1), 8 * j + 2 * c + (e & 1)] = out[tid, 4 * j + e]
    return D


@functools.cache
def product_kernel(dtype, n, trans_b, a_regs, steps, swizzle=0, koff=0):
    """One warpgroup: ``D = sum_s A_s @ B_s`` over ``steps`` k-steps (A images
    at ``a_img[s * A_SIZE:]``, B at ``b_img[s * B_SIZE:]``), A from shared memory
    or (``a_regs``) from each warp's registers, loaded as mma A fragments;
    ``swizzle`` bytes (K-major operands ``koff`` bytes into their atom rows)."""
    store = float16 if dtype == "float16" else uint16
    if swizzle:
        a_lbo, a_sbo = 16, 8 * swizzle            # A: 8 rows an atom, atoms one after another
        if trans_b:                               # B: n atoms side by side, then the next 8 k
            b_lbo, b_sbo = 8 * swizzle, 8 * swizzle * (2 * n // swizzle)
        else:
            b_lbo, b_sbo = 16, 8 * swizzle
        A_SIZE = 64 * swizzle // 2
        B_SIZE = 16 * n if trans_b else n * swizzle // 2
    else:
        a_lbo, a_sbo = 128, 256                   # A: two K halves, then the next 8 rows
        if trans_b:
            b_lbo, b_sbo = 128 * (n // 8), 128    # B: 8 n a core matrix, next 8 k after n / 8
        else:
            b_lbo, b_sbo = 128, 256
        A_SIZE, B_SIZE = 64 * 16, 16 * n
    NJ = n // 8
    ss = W.wgmma_ss(dtype, n, a_lbo, a_sbo, b_lbo, b_sbo, trans_b, swizzle)
    rs = W.wgmma_rs(dtype, n, b_lbo, b_sbo, trans_b, swizzle)
    A_AT = koff // 2                              # where a K-major operand starts
    B_AT = 0 if trans_b else koff // 2
    pin = W.pin(n // 2)
    wait = W.wait_pin(0, n // 2)
    wait_copies = wait_group(0)
    B_OFF = steps * A_SIZE

    @cuda.jit
    def kernel(out, a_img, a_rows, b_img):
        sm = cuda.shared.array(0, store, alignment=1024)
        tid = cuda.threadIdx.x
        total = (B_OFF + steps * B_SIZE) // 8
        for u in range((total + 127) // 128):
            idx = tid + u * 128
            if idx < B_OFF // 8:
                copy16_async(sm, idx * 8, a_img, idx * 8)
            elif idx < total:
                copy16_async(sm, idx * 8, b_img, idx * 8 - B_OFF)
        commit_group()
        wait_copies()
        W.fence_proxy_async()
        cuda.syncthreads()
        acc = cuda.local.array((NJ, 4), float32)
        for j in range(NJ):
            for e in range(4):
                acc[j, e] = 0.0
        pin(acc)
        W.fence()
        a0, b0 = W.matrix_start(sm, A_AT), W.matrix_start(sm, B_OFF + B_AT)
        for s in range(steps):          # step s: the starts moved on by whole images
            if a_regs:
                base = (s * 128 + tid) * 4
                rs(acc, a_rows[base], a_rows[base + 1], a_rows[base + 2], a_rows[base + 3],
                   b0 + s * (B_SIZE // 8), s > 0)
            else:
                ss(acc, a0 + s * (A_SIZE // 8), b0 + s * (B_SIZE // 8), s > 0)
        W.commit()
        wait(acc)
        for j in range(NJ):
            for e in range(4):
                out[tid, 4 * j + e] = acc[j, e]

    kernel_bytes = 2 * (B_OFF + steps * B_SIZE)
    return kernel, kernel_bytes, (a_lbo, a_sbo, b_lbo, b_sbo, A_SIZE, B_SIZE)


def a_fragments(A):
    """Each thread's four mma A words of its warp's 16 rows of ``A`` (64 x 16),
    as ``uint32`` ``[128, 4]`` (low half the lower column)."""
    bits = A.view(np.uint16).astype(np.uint32)
    words = np.zeros((128, 4), np.uint32)
    for tid in range(128):
        w, lane = divmod(tid, 32)
        r, c = divmod(lane, 4)
        for q, (dr, dk) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
            row, k = 16 * w + r + dr, 2 * c + dk
            words[tid, q] = bits[row, k] | (bits[row, k + 1] << 16)
    return words


def _run(dtype, n, trans_b, a_regs, steps, seed, swizzle=0, koff=0):
    rng = np.random.default_rng(seed)
    host = np.float16 if dtype == "float16" else np.dtype("uint16")
    As = [rng.standard_normal((64, 16)).astype(np.float16) for _ in range(steps)]
    Bs = [rng.standard_normal((16, n)).astype(np.float16) for _ in range(steps)]
    if dtype == "bfloat16":       # the same values, exactly representable in bf16
        As = [a.astype(np.float32) for a in As]
        Bs = [b.astype(np.float32) for b in Bs]
        As = [np.asarray(_bf16_round(a)) for a in As]
        Bs = [np.asarray(_bf16_round(b)) for b in Bs]
    kernel, nbytes, (a_lbo, a_sbo, b_lbo, b_sbo, a_size, b_size) = product_kernel(
        dtype, n, trans_b, a_regs, steps, swizzle, koff)
    bits = (lambda x: _bf16_bits(x)) if dtype == "bfloat16" else (lambda x: x)
    a_img = np.concatenate([kmajor_image(bits(a), a_lbo, a_sbo, a_size, swizzle, koff)
                            for a in As]).astype(host)
    b_img = np.concatenate([mnmajor_image(bits(b), b_lbo, b_sbo, b_size, swizzle) if trans_b
                            else kmajor_image(bits(b).T.copy(), b_lbo, b_sbo, b_size, swizzle,
                                              koff)
                            for b in Bs]).astype(host)
    a_rows = np.concatenate([a_fragments(bits(a).view(np.uint16) if dtype == "bfloat16"
                                         else a) for a in As], axis=0).reshape(-1)
    out = np.zeros((128, n // 2), np.float32)
    d_out = cuda.to_device(out)
    kernel[1, 128, 0, nbytes](d_out, cuda.to_device(a_img), cuda.to_device(a_rows),
                              cuda.to_device(b_img))
    D = accumulators_to_matrix(d_out.copy_to_host(), n)
    want = sum(a.astype(np.float64) @ b.astype(np.float64) for a, b in zip(As, Bs))
    # fp16/bf16 products are exact in float32; the accumulation rounds at most
    # once a k-step and a term: 16 steps x (2**-23 relative of the running sum)
    bound = 16 * steps * 2.0 ** -22 * sum(np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64))
                                          for a, b in zip(As, Bs))
    err = np.abs(D - want)
    assert np.all(err <= bound + 1e-30), (float(np.nanmax(err - bound)), D[:2, :8], want[:2, :8])


def _bf16_round(x):
    u = np.asarray(x, np.float32).view(np.uint32)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.view(np.float32)


def _bf16_bits(x):
    return (np.asarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)


@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("a_regs", [False, True])
def test_product_fp16(trans_b, a_regs):
    _run("float16", 16 if config.ENABLE_CUDASIM else 64, trans_b, a_regs, 2, 1)


@pytest.mark.parametrize("trans_b", [False, True])
def test_product_bf16(trans_b):
    _run("bfloat16", 16 if config.ENABLE_CUDASIM else 128, trans_b, True, 1, 2)


@settings(max_examples=2 if config.ENABLE_CUDASIM else 40, deadline=None)
@given(n=st.sampled_from([8, 16, 24] if config.ENABLE_CUDASIM else [8, 16, 32, 64, 128, 256]),
       trans_b=st.booleans(), a_regs=st.booleans(), steps=st.integers(1, 2),
       seed=st.integers(0, 2 ** 16))
def test_product_shapes(n, trans_b, a_regs, steps, seed):
    _run("float16", n, trans_b, a_regs, steps, seed)


@pytest.mark.parametrize("swizzle, koff", [(128, 0), (128, 32), (128, 96), (64, 32), (32, 0)])
@pytest.mark.parametrize("trans_b, a_regs", [(False, False), (True, True), (True, False)])
def test_product_swizzled(swizzle, koff, trans_b, a_regs):
    """Swizzled operands (``swizzle`` bytes, each K-major row read ``koff``
    bytes into its atom row, as a kernel's later k-steps are): an MN-major B
    spans whole atoms (``n`` a multiple of ``swizzle / 2``)."""
    n = max(swizzle // 2, 16 if config.ENABLE_CUDASIM else 64)
    _run("float16", n, trans_b, a_regs, 2, swizzle + koff, swizzle, koff)


def test_descriptor_fields_rejects_bad_strides():
    with pytest.raises(ValueError, match="lbo=8"):
        W.descriptor_fields(8, 128)
    with pytest.raises(ValueError, match="sbo=262144"):
        W.descriptor_fields(16, 2 ** 18)

