"""Tests for paged_numba/_simulator.py: warp operations in the CUDA simulator.

Run with ``NUMBA_ENABLE_CUDASIM=1`` set before numba is imported; otherwise
the module is skipped.
"""

import threading

import numpy as np
import pytest

import numba

if not numba.config.ENABLE_CUDASIM:
    pytest.skip("needs NUMBA_ENABLE_CUDASIM=1", allow_module_level=True)

from hypothesis import given, settings, strategies as st  # noqa: E402
from numba import cuda  # noqa: E402

from paged_numba import _simulator as sim  # noqa: E402

assert sim.install() is True

FULL = 0xFFFFFFFF
LANES = np.arange(32)


def launch(kernel, grid, block, *args, timeout=60):
    """Launch ``kernel[grid, block](*args)`` in a thread; fail on a hang."""
    err = []

    def target():
        try:
            kernel[grid, block](*args)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            err.append(e)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        pytest.fail("simulated kernel hung (deadlock?)")
    if err:
        raise err[0]


def test_install_api():
    assert sim.simulator_enabled() is True
    assert sim.install() is True  # idempotent
    assert sim.is_installed() is True
    from numba.cuda.simulator.kernel import BlockManager
    assert BlockManager.run is sim._block_run       # the block loop that waits
    from numba.cuda.simulator.kernelapi import FakeCUDAModule
    for name in ("shfl_sync", "shfl_up_sync", "shfl_down_sync",
                 "shfl_xor_sync", "syncwarp", "activemask", "lanemask_lt",
                 "ballot_sync", "any_sync", "all_sync", "eq_sync",
                 "match_any_sync", "match_all_sync"):
        assert callable(getattr(FakeCUDAModule, name)), name


def test_shfl_xor_butterfly_sum():
    @cuda.jit
    def k(x, out):
        i = cuda.threadIdx.x
        v = x[i]
        off = 16
        while off > 0:
            v += cuda.shfl_xor_sync(FULL, v, off)
            off //= 2
        out[i] = v

    x = (LANES * 3 + 1).astype(np.int64)
    out = np.zeros(32, np.int64)
    launch(k, 1, 32, x, out)
    np.testing.assert_array_equal(out, np.full(32, x.sum()))


def test_shfl_down_tree_reduction():
    @cuda.jit
    def k(x, out):
        i = cuda.threadIdx.x
        v = x[i]
        off = 16
        while off > 0:
            v += cuda.shfl_down_sync(FULL, v, off)
            off //= 2
        out[i] = v

    x = (LANES ** 2).astype(np.int64)
    out = np.zeros(32, np.int64)
    launch(k, 1, 32, x, out)
    assert out[0] == x.sum()
    # Whole pattern: lanes whose source is >= 32 keep their own value.
    ref = x.copy()
    for off in (16, 8, 4, 2, 1):
        src = LANES + off
        ref = ref + np.where(src < 32, ref[np.minimum(src, 31)], ref)
    np.testing.assert_array_equal(out, ref)


def test_shfl_up_inclusive_scan():
    @cuda.jit
    def k(x, out):
        i = cuda.threadIdx.x
        v = x[i]
        d = 1
        while d < 32:
            n = cuda.shfl_up_sync(FULL, v, d)
            if i >= d:
                v += n
            d *= 2
        out[i] = v

    x = (LANES % 7 + 1).astype(np.int64)
    out = np.zeros(32, np.int64)
    launch(k, 1, 32, x, out)
    np.testing.assert_array_equal(out, np.cumsum(x))


def test_shfl_up_keeps_own_value_below_delta():
    @cuda.jit
    def k(x, out):
        i = cuda.threadIdx.x
        out[i] = cuda.shfl_up_sync(FULL, x[i], 5)

    x = (LANES + 100).astype(np.int64)
    out = np.zeros(32, np.int64)
    launch(k, 1, 32, x, out)
    np.testing.assert_array_equal(out, np.where(LANES < 5, x, np.roll(x, 5)))


def test_shfl_sync_broadcast_and_indexing():
    @cuda.jit
    def k(x, bcast, rev, wrap):
        i = cuda.threadIdx.x
        bcast[i] = cuda.shfl_sync(FULL, x[i], 5)
        rev[i] = cuda.shfl_sync(FULL, x[i], 31 - i)
        wrap[i] = cuda.shfl_sync(FULL, x[i], i + 33)  # src taken mod 32

    x = (LANES * 10).astype(np.int64)
    bcast, rev, wrap = (np.zeros(32, np.int64) for _ in range(3))
    launch(k, 1, 32, x, bcast, rev, wrap)
    np.testing.assert_array_equal(bcast, np.full(32, 50))
    np.testing.assert_array_equal(rev, x[::-1])
    np.testing.assert_array_equal(wrap, x[(LANES + 1) % 32])


def test_votes():
    @cuda.jit
    def k(out):
        i = cuda.threadIdx.x
        out[i, 0] = cuda.ballot_sync(FULL, i % 3 == 0)
        out[i, 1] = cuda.any_sync(FULL, i == 7)
        out[i, 2] = cuda.any_sync(FULL, i > 40)
        out[i, 3] = cuda.all_sync(FULL, i < 32)
        out[i, 4] = cuda.all_sync(FULL, i < 31)
        out[i, 5] = cuda.eq_sync(FULL, 1)
        out[i, 6] = cuda.eq_sync(FULL, i < 16)
        out[i, 7] = cuda.ballot_sync(FULL, 0)
        out[i, 8] = cuda.lanemask_lt()

    out = np.zeros((32, 9), np.int64)
    launch(k, 1, 32, out)
    ballot = sum(1 << j for j in range(0, 32, 3))
    expect = [ballot, 1, 0, 1, 0, 1, 0, 0]
    np.testing.assert_array_equal(out[:, :8], np.tile(expect, (32, 1)))
    np.testing.assert_array_equal(out[:, 8], (1 << LANES) - 1)


def test_match():
    @cuda.jit
    def k(out):
        i = cuda.threadIdx.x
        out[i, 0] = cuda.match_any_sync(FULL, i % 4)
        m, p = cuda.match_all_sync(FULL, 42)
        out[i, 1] = m
        out[i, 2] = p
        m, p = cuda.match_all_sync(FULL, i // 16)
        out[i, 3] = m
        out[i, 4] = p

    out = np.zeros((32, 5), np.int64)
    launch(k, 1, 32, out)
    residue_masks = [sum(1 << j for j in range(r, 32, 4)) for r in range(4)]
    np.testing.assert_array_equal(out[:, 0],
                                  [residue_masks[j % 4] for j in range(32)])
    np.testing.assert_array_equal(out[:, 1:],
                                  np.tile([FULL, 1, 0, 0], (32, 1)))


def test_partial_warp_activemask_and_reduction():
    @cuda.jit
    def k(x, act, total, down):
        i = cuda.threadIdx.x
        m = cuda.activemask()
        act[i] = m
        v = x[i]
        off = 16 if m == FULL else 8  # warp 1 has 16 lanes
        while off > 0:
            v += cuda.shfl_xor_sync(m, v, off)
            off //= 2
        total[i] = v
        down[i] = cuda.shfl_down_sync(m, x[i], 8)

    n = 48
    x = np.arange(n, dtype=np.int64) + 1
    act, total, down = (np.zeros(n, np.int64) for _ in range(3))
    launch(k, 1, n, x, act, total, down)
    np.testing.assert_array_equal(act, [FULL] * 32 + [0xFFFF] * 16)
    np.testing.assert_array_equal(total,
                                  [x[:32].sum()] * 32 + [x[32:].sum()] * 16)
    # Warp 1 has lanes 0..15: lanes 8..15 have no lane +8 and keep their value.
    w1 = x[32:]
    np.testing.assert_array_equal(down[32:], np.concatenate([w1[8:], w1[8:]]))
    np.testing.assert_array_equal(down[:24], x[8:32])


def test_only_warp0_reduces_while_others_syncthreads():
    @cuda.jit
    def k(x, out):
        sh = cuda.shared.array(128, numba.int64)
        res = cuda.shared.array(1, numba.int64)
        t = cuda.threadIdx.x
        sh[t] = x[t]
        cuda.syncthreads()
        if t // 32 == 0:
            v = sh[t] + sh[t + 32] + sh[t + 64] + sh[t + 96]
            off = 16
            while off > 0:
                v += cuda.shfl_down_sync(FULL, v, off)
                off //= 2
            if t == 0:
                res[0] = v
        cuda.syncthreads()
        out[t] = res[0]

    x = np.arange(128, dtype=np.int64) * 2 - 50
    out = np.zeros(128, np.int64)
    launch(k, 1, 128, x, out)
    np.testing.assert_array_equal(out, np.full(128, x.sum()))


def test_blocks_are_independent_and_relaunch():
    @cuda.jit
    def k(x, out):
        t = cuda.threadIdx.x
        b = cuda.blockIdx.x
        v = x[b, t]
        off = 16
        while off > 0:
            v += cuda.shfl_xor_sync(FULL, v, off)
            off //= 2
        if t % 32 == 0:
            out[b, t // 32] = v

    x = np.arange(128, dtype=np.int64).reshape(2, 64) ** 2
    expect = x.reshape(2, 2, 32).sum(axis=2)
    for _ in range(2):  # a second launch must not see the first one's state
        out = np.zeros((2, 2), np.int64)
        launch(k, 2, 64, x, out)
        np.testing.assert_array_equal(out, expect)


def test_two_warps_different_ops_concurrently_3d_block():
    @cuda.jit
    def k(a, b, out):
        t = cuda.threadIdx.x + 8 * (cuda.threadIdx.y + 4 * cuda.threadIdx.z)
        lane = t % 32
        if t < 32:
            v = a[lane]
            off = 16
            while off > 0:
                v = max(v, cuda.shfl_xor_sync(FULL, v, off))
                off //= 2
        else:
            v = b[lane]
            d = 1
            while d < 32:
                n = cuda.shfl_up_sync(FULL, v, d)
                if lane >= d:
                    v += n
                d *= 2
        out[t] = v

    rng = np.random.default_rng(0)
    a = rng.integers(-1000, 1000, 32)
    b = rng.integers(0, 50, 32)
    out = np.zeros(64, np.int64)
    launch(k, 1, (8, 4, 2), a, b, out)
    np.testing.assert_array_equal(out[:32], np.full(32, a.max()))
    np.testing.assert_array_equal(out[32:], np.cumsum(b))


def test_float32_and_int64_values_unchanged():
    seen = []

    @cuda.jit
    def k(f, i, fo, io):
        t = cuda.threadIdx.x
        a = cuda.shfl_xor_sync(FULL, f[t], 1)
        b = cuda.shfl_down_sync(FULL, i[t], 1)
        if t == 0:
            seen.append((type(a), type(b)))
        fo[t] = a
        io[t] = b

    f = (LANES * np.float32(0.1) + np.float32(1e-3)).astype(np.float32)
    i = (LANES.astype(np.int64) << 40) + 7
    fo = np.zeros(32, np.float32)
    io = np.zeros(32, np.int64)
    launch(k, 1, 32, f, i, fo, io)
    np.testing.assert_array_equal(fo.view(np.uint32),
                                  f[LANES ^ 1].view(np.uint32))
    below = i[np.minimum(LANES + 1, 31)]
    np.testing.assert_array_equal(io, np.where(LANES < 31, below, i))
    assert seen == [(np.float32, np.int64)]


def test_float32_butterfly_sum_matches_numpy():
    @cuda.jit
    def k(x, out):
        t = cuda.threadIdx.x
        v = x[t]
        off = 16
        while off > 0:
            v += cuda.shfl_xor_sync(FULL, v, off)
            off //= 2
        out[t] = v

    x = np.linspace(-1, 1, 32, dtype=np.float32)
    out = np.zeros(32, np.float32)
    launch(k, 1, 32, x, out)
    np.testing.assert_allclose(out, np.full(32, x.sum(dtype=np.float32)),
                               atol=1e-6)


def test_syncwarp_orders_shared_memory_and_back_to_back_reuse():
    @cuda.jit
    def k(out):
        sh = cuda.shared.array(32, numba.int64)
        t = cuda.threadIdx.x
        acc = 0
        for it in range(30):
            sh[t] = t * it
            cuda.syncwarp()
            acc += sh[(t + 1) % 32] + cuda.shfl_sync(FULL, it + t, 31 - t)
            cuda.syncwarp(FULL)
        out[t] = acc

    out = np.zeros(32, np.int64)
    launch(k, 1, 32, out)
    its = np.arange(30)
    expect = [(((t + 1) % 32) * its).sum() + (its + 31 - t).sum()
              for t in range(32)]
    np.testing.assert_array_equal(out, expect)


def test_disjoint_half_warp_masks():
    @cuda.jit
    def k(x, out):
        t = cuda.threadIdx.x
        m = 0xFFFF if t < 16 else 0xFFFF0000
        v = x[t]
        off = 8
        while off > 0:
            v += cuda.shfl_xor_sync(m, v, off)
            off //= 2
        out[t] = v

    x = np.arange(32, dtype=np.int64)
    out = np.zeros(32, np.int64)
    launch(k, 1, 32, x, out)
    np.testing.assert_array_equal(out,
                                  [x[:16].sum()] * 16 + [x[16:].sum()] * 16)


def test_lane_not_in_mask_raises():
    @cuda.jit
    def k(out):
        t = cuda.threadIdx.x
        out[t] = cuda.shfl_sync(0x1, t, 0)  # only lane 0 may call this

    with pytest.raises(RuntimeError, match="not in mask"):
        launch(k, 1, 32, np.zeros(32, np.int64))


def test_mixed_ops_in_one_warp_raise():
    @cuda.jit
    def k(out):
        t = cuda.threadIdx.x
        if t < 16:
            out[t] = cuda.shfl_up_sync(FULL, t, 1)
        else:
            out[t] = cuda.shfl_down_sync(FULL, t, 1)

    with pytest.raises(RuntimeError, match="different warp operations"):
        launch(k, 1, 32, np.zeros(32, np.int64))


def test_exception_in_other_lane_aborts_waiters():
    @cuda.jit
    def k(out):
        t = cuda.threadIdx.x
        if t == 31:
            raise ValueError("boom")
        out[t] = cuda.shfl_xor_sync(FULL, t, 1)  # lane 31 never arrives

    with pytest.raises(ValueError, match="boom"):
        launch(k, 1, 32, np.zeros(32, np.int64), timeout=30)


def test_syncthreads_counts_the_threads_still_running():
    @cuda.jit
    def k(out):
        sm = cuda.shared.array(64, numba.int64)
        t = cuda.threadIdx.x
        if t >= 48:                       # these return before the barriers
            return
        for r in range(3):
            sm[t] = t * (r + 1)
            cuda.syncthreads()
            out[r, t] = sm[47 - t]
            cuda.syncthreads()

    out = np.full((3, 64), -1, np.int64)
    launch(k, 1, 64, out)
    want = np.array([[(47 - t) * (r + 1) if t < 48 else -1 for t in range(64)]
                     for r in range(3)])
    np.testing.assert_array_equal(out, want)


def test_exception_aborts_threads_in_syncthreads_and_is_the_one_raised():
    @cuda.jit
    def k(out):
        t = cuda.threadIdx.x
        if t == 40:
            raise ValueError("boom")
        cuda.syncthreads()              # thread 40 never arrives: the others abort
        out[t] = t

    with pytest.raises(ValueError, match="boom"):
        launch(k, 2, 64, np.zeros(64, np.int64), timeout=30)


def _reference_shfl(mode, x, arg, n):
    """NumPy model of one width-32 shuffle over a block of ``n`` lanes."""
    out = x.copy()
    for t in range(n):
        w, lane = divmod(t, 32)
        size = min(32, n - 32 * w)
        src = {"idx": arg % 32, "up": lane - arg,
               "down": lane + arg, "xor": lane ^ arg}[mode]
        if 0 <= src < size:
            out[t] = x[32 * w + src]
    return out


@settings(max_examples=25, deadline=None)
@given(mode=st.sampled_from(["idx", "up", "down", "xor"]),
       arg=st.integers(0, 40), n=st.integers(1, 80),
       seed=st.integers(0, 2**16))
def test_shuffles_match_reference(mode, arg, n, seed):
    @cuda.jit
    def k(x, out, arg, mode):
        t = cuda.threadIdx.x
        m = cuda.activemask()
        if mode == 0:
            out[t] = cuda.shfl_sync(m, x[t], arg)
        elif mode == 1:
            out[t] = cuda.shfl_up_sync(m, x[t], arg)
        elif mode == 2:
            out[t] = cuda.shfl_down_sync(m, x[t], arg)
        else:
            out[t] = cuda.shfl_xor_sync(m, x[t], arg)

    x = np.random.default_rng(seed).integers(-10**6, 10**6, n)
    out = np.zeros(n, np.int64)
    code = ["idx", "up", "down", "xor"].index(mode)
    launch(k, 1, n, x, out, arg, code)
    np.testing.assert_array_equal(out, _reference_shfl(mode, x, arg, n))


def test_shared_array_is_one_array_per_block_and_poisoned():
    """Every thread of a block gets the same shared array (the simulator's own
    look-up is not atomic), and shared memory nothing wrote reads as NaN."""
    @cuda.jit
    def k(out, unwritten):
        buf = cuda.shared.array(256, np.float32)
        never = cuda.shared.array(4, np.float32)
        i = cuda.threadIdx.x
        buf[i] = i
        cuda.syncthreads()
        total = 0.0
        for j in range(256):
            total += buf[j]
        out[i] = total
        if i == 0:
            unwritten[0] = never[0]

    for _ in range(3):
        out = np.zeros(256, np.float32)
        unwritten = np.zeros(1, np.float32)
        launch(k, 1, 256, out, unwritten)
        assert np.all(out == 255 * 256 / 2)     # 0 + 1 + ... + 255
        assert np.isnan(unwritten[0])
