"""Tensor-map copies and transaction barriers (``kernels/tma.py``): a block
gathers the pages of a paged pool into a swizzled tile, one box a page and
64-element half row, round after round on one mbarrier, and the tile must
hold each page's bytes where the 128-byte swizzle puts them (zeros for what a
box reaches past the pool); threads whose ``cp.async`` copies arrive at an
mbarrier as they land. The same tests run the stand-ins under the simulator
and the hardware on a GPU; another assembles the PTX for sm_90a."""
import os
import pathlib
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import paged_numba
from numba import cuda, uint64                  # after paged_numba: the simulator's on a CPU
from numba.core.types import float16
from paged_numba.kernels import tma

ROOT = pathlib.Path(__file__).resolve().parent.parent
SIM = paged_numba.simulator_enabled()
HALF = 64                       # fp16 elements in a 128-byte row


def gather_kernel(block_n, head_size, arrivals=1):
    """``kernel(tmap, pool, starts, head, out)``: for each round ``r``, the
    pool's rows ``starts[r, p] ..`` (``block_n / len(starts[r])`` each) of
    KV head ``head`` into a ``block_n x head_size`` tile (half ``h`` of the
    head dimension at ``h * block_n`` rows, a page's rows in turn), then the
    tile as it lies in shared memory into ``out[r]``. ``arrivals`` threads
    (0, 32, ...) arrive at the barrier each round, the first announcing the
    bytes."""
    tile = block_n * head_size
    halves = head_size // HALF
    load = tma.tma_load(3)

    @cuda.jit
    def kernel(tmap, pool, starts, head, out):
        smem = cuda.shared.array(tile, float16, alignment=1024)
        bars = cuda.shared.array(2, uint64, alignment=8)
        tid = cuda.threadIdx.x
        if tid == 0:
            tma.mbarrier_init(bars, 1, arrivals)
            tma.mbarrier_init_fence()
        cuda.syncthreads()
        pages = starts.shape[1]
        rows = block_n // pages
        for r in range(starts.shape[0]):
            if tid == 0:
                tma.mbarrier_arrive_expect_tx(bars, 1, 2 * tile)
                for p in range(pages):
                    for h in range(halves):
                        load(smem, (h * block_n + p * rows) * HALF, tmap, pool,
                             (h * HALF, head, starts[r, p]), bars, 1)
            elif tid % 32 == 0 and tid // 32 < arrivals:
                tma.mbarrier_arrive(bars, 1)
            tma.mbarrier_wait(bars, 1, r & 1)
            for e in range(tid, tile, cuda.blockDim.x):
                out[r, e] = smem[e]
            cuda.syncthreads()          # the tile is read before the next round's copies
    return kernel


def staged_kernel():
    """``kernel(src, out)``: each of 64 threads copies its 16 bytes of round
    ``r`` with ``cp.async`` and arrives through ``copies_arrive``; every
    thread waits for the phase and reads its neighbour's bytes."""
    from paged_numba.kernels.async_copy import commit_group, copy16_async

    @cuda.jit
    def kernel(src, out):
        smem = cuda.shared.array(512, float16, alignment=1024)
        bars = cuda.shared.array(1, uint64, alignment=8)
        tid = cuda.threadIdx.x
        if tid == 0:
            tma.mbarrier_init(bars, 0, 64)
            tma.mbarrier_init_fence()
        cuda.syncthreads()
        for r in range(src.shape[0]):
            copy16_async(smem, 8 * tid, src[r], 8 * tid)
            commit_group()
            tma.copies_arrive(bars, 0)
            tma.mbarrier_wait(bars, 0, r & 1)
            other = (tid + 1) % 64
            for e in range(8):
                out[r, 8 * other + e] = smem[8 * other + e]
            cuda.syncthreads()          # read before the next round overwrites
    return kernel


def test_copies_arrive_when_they_land():
    src = np.random.default_rng(1).standard_normal((3, 512)).astype(np.float16)
    out = cuda.to_device(np.zeros((3, 512), np.float16))
    staged_kernel()[1, 64](cuda.to_device(src), out)
    np.testing.assert_array_equal(out.copy_to_host(), src)


def expected_tile(rows_of, starts, head, block_n, head_size):
    """The tile's bytes: row ``t`` of a page's box, 16-byte chunk ``c`` of half
    ``h``, at logical byte ``(h block_n + p rows + t) 128 + 16 c`` with bits
    4-6 XORed with bits 7-9."""
    total = rows_of.shape[0]
    pages = len(starts)
    rows = block_n // pages
    tile = np.zeros(block_n * head_size * 2, np.uint8)
    for p, s in enumerate(starts):
        for t in range(rows):
            row = rows_of[s + t, head] if s + t < total else np.zeros(head_size, np.float16)
            for h in range(head_size // HALF):
                raw = np.ascontiguousarray(row[h * HALF:(h + 1) * HALF]).view(np.uint8)
                for c in range(8):
                    logical = (h * block_n + p * rows + t) * 128 + 16 * c
                    at = logical ^ (((logical >> 7) & 7) << 4)
                    tile[at:at + 16] = raw[16 * c:16 * c + 16]
    return tile.view(np.float16)


@pytest.mark.parametrize("block_size, block_n, head_size, arrivals",
                         [(16, 32, 128, 1), (8, 32, 64, 2)])
def test_pages_land_swizzled_round_after_round(block_size, block_n, head_size, arrivals):
    rng = np.random.default_rng(block_size)
    num_blocks, heads = 6, 2
    pool = rng.standard_normal((num_blocks, block_size, heads, head_size)).astype(np.float16)
    rows_of = pool.reshape(-1, heads, head_size)
    pages = block_n // block_size
    starts = np.array([rng.permutation(num_blocks)[:pages] * block_size for _ in range(3)],
                      np.int32)
    starts[2, -1] = rows_of.shape[0] - 2          # a box reaching past the pool: zero-filled
    d_pool = cuda.to_device(rows_of)
    tmap = tma.tensor_map(d_pool, (block_size, 1, HALF))
    out = cuda.to_device(np.full((3, block_n * head_size), np.nan, np.float16))
    head = 1
    gather_kernel(block_n, head_size, arrivals)[1, 64](tmap, d_pool, cuda.to_device(starts),
                                                      head, out)
    got = out.copy_to_host()
    for r in range(3):
        want = expected_tile(rows_of, starts[r], head, block_n, head_size)
        np.testing.assert_array_equal(got[r].view(np.uint16), want.view(np.uint16))


def test_bad_maps_are_refused():
    pool = cuda.to_device(np.zeros((64, 2, 128), np.float16))
    with pytest.raises(ValueError, match="box must give 1 to 256 elements"):
        tma.tensor_map(pool, (16, 1))
    with pytest.raises(ValueError, match="swizzle must be one of"):
        tma.tensor_map(pool, (16, 1, 64), swizzle=16)
    with pytest.raises(ValueError, match="at most the swizzle"):
        tma.tensor_map(pool, (16, 1, 128))
    with pytest.raises(ValueError, match="last dimension contiguous"):
        tma.tensor_map(pool[:, :, ::2], (16, 1, 32))


PTX = """
import os, runpy
from numba import cuda, int32, uint64
from numba.core.types import float16
ns = runpy.run_path(os.path.join("tests", "test_tma.py"))
kernel = ns["gather_kernel"](32, 128, 2)
sig = (uint64[::1], float16[:, :, ::1], int32[:, ::1], int32, float16[:, ::1])
ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0))
print(ptx)
print("//// next module")
staged = ns["staged_kernel"]()
ptx, _ = cuda.compile_ptx(staged.py_func, (float16[:, ::1], float16[:, ::1]), cc=(9, 0))
print(ptx)
"""


def test_ptx_assembles_for_sm90a(tmp_path):
    """The inline PTX as NVVM emits it, assembled by ptxas for sm_90a (a
    compile check that needs no GPU: labels, operand kinds, state spaces)."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", PTX], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # sm_90a for the copies; the pip libNVVM may write a newer PTX version than ptxas reads
    ptx = re.sub(r"\.version \d+\.\d+", ".version 9.0",
                 proc.stdout.replace(".target sm_90", ".target sm_90a"))
    for text in ("mbarrier.init.shared::cta.b64", "mbarrier.arrive.expect_tx.shared::cta.b64",
                 "mbarrier.try_wait.parity.shared::cta.b64",
                 "cp.async.mbarrier.arrive.noinc.shared::cta.b64",
                 "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"):
        assert text in ptx
    if shutil.which("ptxas") is None:
        pytest.skip("no ptxas here: the PTX was checked for its instructions only")
    for n, module in enumerate(ptx.split("//// next module")):
        src = tmp_path / f"k{n}.ptx"
        src.write_text(module)
        run = subprocess.run(["ptxas", "-arch=sm_90a", str(src), "-o", str(tmp_path / "k.cubin")],
                             capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-3000:]
