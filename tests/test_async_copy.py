"""The simulator's copies in flight: a ``cp.async`` copy or a box copy lands as
late as the GPU may let it (its destination NaN until then), so a kernel
that reads a copy before waiting for it fails on the simulator too."""
import numpy as np
import pytest
from numba import cuda, float32, uint64

import paged_numba as pn
from paged_numba.kernels import tma
from paged_numba.kernels.async_copy import commit_group, copy16_async, wait_group

pytestmark = pytest.mark.skipif(not pn.simulator_enabled(),
                                reason="on a GPU a copy lands when it lands: nothing to pin")


def groups_kernel():
    wait_newest, wait_all = wait_group(1), wait_group(0)

    @cuda.jit
    def kernel(src, out):
        sm = cuda.shared.array(8, float32)
        copy16_async(sm, 0, src, 0)
        commit_group()                  # group A: elements 0-3
        copy16_async(sm, 4, src, 4)
        commit_group()                  # group B: elements 4-7
        for e in range(8):
            out[0, e] = sm[e]           # neither waited for
        wait_newest()                   # A has landed, B need not have
        for e in range(8):
            out[1, e] = sm[e]
        wait_all()
        for e in range(8):
            out[2, e] = sm[e]
    return kernel


def test_copies_land_at_their_wait():
    src = np.arange(1, 9, dtype=np.float32)
    out = np.zeros((3, 8), np.float32)
    groups_kernel()[1, 1](src, out)
    assert np.isnan(out[0]).all()
    np.testing.assert_array_equal(out[1, :4], src[:4])
    assert np.isnan(out[1, 4:]).all()
    np.testing.assert_array_equal(out[2], src)


@cuda.jit
def arrival_kernel(src, out):
    sm = cuda.shared.array(4, float32)
    bars = cuda.shared.array(1, uint64)
    tma.mbarrier_init(bars, 0, 2)       # two arrivals complete a phase
    tma.mbarrier_init_fence()
    copy16_async(sm, 0, src, 0)
    tma.copies_arrive(bars, 0)          # arrives once the copy lands
    for e in range(4):
        out[0, e] = sm[e]               # the phase is not complete: not yet
    tma.mbarrier_arrive(bars, 0)        # the second arrival completes it
    tma.mbarrier_wait(bars, 0, 0)
    for e in range(4):
        out[1, e] = sm[e]


def test_copies_arriving_at_an_mbarrier_land_with_its_phase():
    src = np.arange(1, 5, dtype=np.float32)
    out = np.zeros((2, 4), np.float32)
    arrival_kernel[1, 1](src, out)
    assert np.isnan(out[0]).all()
    np.testing.assert_array_equal(out[1], src)
