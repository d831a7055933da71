"""The kernels' transcendental functions (:mod:`paged_numba.kernels.fastmath`)
against float64: the error bound of ``exp2_fma``'s steps, its zeros and NaN,
and the kernel's instructions (on a GPU; on the simulator the steps are the
kernel's function) against those steps."""
import numpy as np
import pytest
from numba import config, cuda

import paged_numba  # noqa: F401  (the simulator where there is no GPU)
from paged_numba.kernels import fastmath
from paged_numba.kernels.fastmath import exp2_fma, exp2_fma_steps

# every softmax exponent range: 0 down past the clamp, the rounding's ties, the ends
XS = np.concatenate([-np.linspace(0.0, 130.0, 4001), -np.arange(0.0, 128.0) - 0.5,
                     [-np.inf, np.nan, -0.0, -127.0, -126.0, -1e-30, -2.0 ** -20]]
                    ).astype(np.float32)


def test_exp2_fma_is_within_its_bound_of_exp2():
    # relative error under 1.7e-7 where 2**x is a normal float32; below that
    # a non-negative value within 2**-126; -inf and <= -127 exactly +0; NaN kept
    for x in XS:
        y = float(exp2_fma_steps(x))
        want = np.exp2(np.float64(x))
        if np.isnan(x):
            assert np.isnan(y)
        elif want >= 2.0 ** -126:
            assert abs(y / want - 1.0) < 1.7e-7, (x, y, want)
        else:
            assert 0.0 <= y and abs(y - want) <= 2.0 ** -126, (x, y, want)
            if x <= -127.0:
                assert y == 0.0 and not np.signbit(np.float32(y)), x
    assert len(fastmath.EXP2_POLY) == 5


@pytest.mark.skipif(config.ENABLE_CUDASIM,
                    reason="the simulator's exp2_fma is exp2_fma_steps itself")
def test_exp2_fma_on_the_device_matches_the_steps():
    @cuda.jit
    def kernel(x, y):
        i = cuda.grid(1)
        if i < x.size:
            y[i] = exp2_fma(x[i])

    y = cuda.to_device(np.zeros_like(XS))
    kernel[-(-XS.size // 128), 128](cuda.to_device(XS), y)
    got = y.copy_to_host()
    want = np.array([exp2_fma_steps(x) for x in XS], np.float32)
    nan = np.isnan(want)
    assert (np.isnan(got) == nan).all()
    # one place apart at most: the stand-in's fused multiply-adds round twice
    ulps = np.abs(got[~nan].view(np.int32).astype(np.int64) - want[~nan].view(np.int32))
    assert ulps.max() <= 1, XS[~nan][ulps.argmax()]
