"""Block-moving benchmark: copy_blocks and swap_blocks against plain copies of the same bytes.

    python experiments/bench_blocks.py --out results/blocks_h100.csv
    python experiments/bench_blocks.py --only swap --reps 10 --out results/blocks_h100.csv
    python experiments/bench_blocks.py --quick --out /tmp/blocks_quick.csv   # simulator, < 1 min

``copy_blocks`` (op ``copy_blocks``, direction ``d2d``): fp16, 8 KV heads,
head size 128, block sizes 16 and 32, every layout ``PagedKVCache`` takes
(``paged_numba.layouts.LAYOUTS``), a one-layer cache with 1024, 4096 and
16384 pairs and a ``num_layers=32`` cache with 64, 1024 and 4096 pairs
(16384 would need 64-128 GB of cache). The cache has ``2 * pairs`` blocks;
the pairs are a random permutation of them, sources the first half and
destinations the second (no block twice). Impls:

* ``copy_blocks``: the public call (pair checks, the pairs' upload, the
  launch) from an idle device to the end of the kernel: what a caller that
  waits for it pays.
* ``copy_blocks_kernel``: the same kernel, grid and threads as
  ``copy_blocks`` launches (``paged_numba.blocks`` internals), the pairs
  already on the device: the kernel's own bandwidth.
* ``device_copy`` (the ceiling): the same bytes moved by numba
  ``copy_to_device`` on a stream (``cuMemcpyDtoDAsync``) from one part of
  each pool into another, one copy per pool.

All three run on the timer's stream (``copy_blocks(..., stream=)``).

Bytes counted: bytes read plus bytes written (``2 * pairs * num_layers *
block bytes of K and V``); every case reads at least 64 MB and writes as
much, more than the 50-60 MB L2 (which is flushed before each call anyway).

``swap_blocks`` (op ``swap_blocks``, directions ``d2h`` and ``h2d``, timed
separately): the same geometry, block size 16, layout ``"nhd"`` (a block is
one contiguous slab in every layout, so the layout does not change what
moves), 64, 512 and 4096 blocks of a one-layer and of a ``num_layers=32``
cache (64 KB and 2 MB a block), into and out of a pinned ``host_pool`` of as
many blocks (twice as many where that is at most ``HOST_POOL_LIMIT``); the
device ids are random among ``2 * blocks``, the host ids one run ``0 ..
n-1`` (``host_ids=run``), a random permutation of it (``permuted``: the
call sorts the pairs by host block, so this is one run again), or ``n``
random blocks of the ``2 n`` (``scattered``: runs of about two blocks, of
64 KB or 2 MB a block; below 256 KB a run on average, NumPy gathers or
scatters them through a pinned buffer). The call is synchronous (no stream,
as a caller that waits for it makes it). The ceiling, ``pinned_copy``: the
same bytes in one asynchronous ``copy_to_host`` / ``copy_to_device`` per
pool on the timer's stream, between the cache's pools and the pinned host
pool (``cuda.pinned_array`` memory). Bytes counted: those that cross the
bus, once.

Each kernel's result is checked once against NumPy before it is timed, on
the timed configuration: every block of the pools when the cache is at
most 2 GiB, else 64 random pairs in every layer (``verified`` says which);
a mismatch raises.

Method (GPU): after two warm-up calls, each call is timed with CUDA events
after a 256 MB memset that evicts the L2 (outside the events); the kernel
and the device copy are queued behind a ~500 us sleep kernel, so that the
events time the device's work and not numba's launch overhead; the public
calls start from an idle device and include the host's work. ``us`` is the
median; ``host_us`` the median wall-clock time for the call to return.
``reps`` is ``--reps``, fewer (at least 3) where that many would take more
than ``TIME_BUDGET_S`` seconds. Under Numba's CUDA simulator (``--quick``
there) sizes are tiny and ``us`` is wall-clock time; its numbers only show
that the script runs.

Columns: ``num_layers`` 1 for a cache made without ``num_layers``;
``num_pairs`` the pairs (blocks) moved; ``ceiling_gbps`` and
``ratio_to_ceiling`` (``gbps / ceiling_gbps``; users expect
``copy_blocks_kernel`` at 0.85 or more); versions, git revision, run id,
timestamp and command in every row; ``--out`` keeps the rows of other runs
already in the file.
"""
import argparse
import datetime
import gc
import importlib.metadata
import os
import statistics
import subprocess
import sys
import time

import numpy as np

import paged_numba as pn    # before numba.cuda: it switches the simulator on without a GPU
from numba import cuda      # noqa: I100
from bench_common import new_run_id, print_table, write_rows
from blocks_check import pools_of, verify_copy, verify_swap
from paged_numba._launch import launch
from paged_numba.blocks import _flat_pools, _vector_threads
from paged_numba.kernels.copy_blocks import copy_blocks_kernel
from paged_numba.layouts import LAYOUTS

SIM = pn.simulator_enabled()
NUM_KV_HEADS, HEAD_SIZE, DTYPE = 8, 128, "float16"
BLOCK_SIZES = (16, 32)
COPY_PAIRS = {None: (1024, 4096, 16384), 32: (64, 1024, 4096)}    # num_layers -> pairs
SWAP_BLOCK_SIZE = 16
SWAP_BLOCKS = {None: (64, 512, 4096), 32: (64, 512, 4096)}
QUICK = dict(num_kv_heads=2, head_size=16, block_sizes=(4,), copy_pairs={None: (6,), 2: (3,)},
             swap_block_size=4, swap_blocks={None: (5,), 2: (3,)})
L2_FLUSH_BYTES = 256 * 2**20
HOST_POOL_LIMIT = 8 * 2**30     # bytes: the largest host pool with room for "scattered"
SPIN_NS = 500_000               # device sleep before a queued timed call
TIME_BUDGET_S = 5.0             # at most about this long in timed calls per measurement
MIN_REPS = 3
WARMUP = 2
MEMORY_USE = 0.85               # of the free device memory a case may take
FIELDS = ["run_id", "timestamp", "gpu", "op", "impl", "direction", "host_ids", "layout",
          "block_size", "num_kv_heads", "head_size", "dtype", "num_layers", "num_pairs",
          "cache_blocks", "bytes", "us", "gbps", "ceiling_gbps", "ratio_to_ceiling", "host_us",
          "reps", "timing", "verified", "numba", "numba_cuda", "numpy", "paged_numba",
          "cuda_driver", "git_rev", "command"]
TABLE = ["op", "impl", "direction", "host_ids", "layout", "block_size", "num_layers", "num_pairs",
         "bytes", "us", "gbps", "ratio_to_ceiling", "host_us", "reps", "verified"]


# -- environment ---------------------------------------------------------------------------

def gpu_name():
    if SIM:
        return "simulator"
    name = cuda.get_current_device().name
    return name.decode() if isinstance(name, bytes) else name


def versions():
    """Package versions, the CUDA driver's version and the git revision (``-dirty``
    with uncommitted changes to tracked files; ``unknown`` outside a checkout)."""
    def dist(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return ""

    import numba

    driver = "simulator"
    if not SIM:
        from numba.cuda.cudadrv.driver import driver as drv
        driver = ".".join(map(str, drv.get_version()))
    try:
        rev = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"],
                             cwd=os.path.dirname(os.path.abspath(__file__)), text=True,
                             capture_output=True, check=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rev = "unknown"
    return dict(numba=numba.__version__, numba_cuda=dist("numba-cuda"), numpy=np.__version__,
                paged_numba=pn.__version__, cuda_driver=driver, git_rev=rev or "unknown")


def now():
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def release():
    """Free what numba still holds of dropped arrays (its deallocation is deferred)."""
    gc.collect()
    if not SIM:
        cuda.current_context().deallocations.clear()


def fits(nbytes, what):
    """Whether ``nbytes`` of device memory are free (printing a skip when not)."""
    if SIM:
        return True
    release()
    free = cuda.current_context().get_memory_info().free
    if nbytes + L2_FLUSH_BYTES <= MEMORY_USE * free:
        return True
    print(f"{what}: skipped, needs {nbytes / 2**30:.1f} GiB of {free / 2**30:.1f} GiB free",
          flush=True)
    return False


# -- kernels of the benchmark itself ---------------------------------------------------------

@cuda.jit
def _fill_bits(bits, seed):
    """``bits[i]`` (uint16, a float16 pool's bit patterns) a finite value from
    a hash of ``i`` and ``seed``: no two blocks of a pool alike."""
    for i in range(cuda.grid(1), bits.size, cuda.gridsize(1)):
        h = ((i % 2147483647) * 48271 + seed * 7919) % 2147483647
        bits[i] = h % 31744                      # below 0x7C00: no inf or NaN


@cuda.jit
def _spin(micros):
    if cuda.grid(1) == 0:
        for _ in range(micros):
            cuda.nanosleep(1000)


def fill(pools, seed):
    for n, pool in enumerate(pools):
        bits = pool.reshape(pool.size).view(np.uint16)
        grid, threads = (2, 32) if SIM else (min(8192, -(-bits.size // 256)), 256)
        _fill_bits[grid, threads](bits, seed + n)
    cuda.synchronize()


class Timer:
    """Median microseconds of calls: CUDA events on one stream with an L2 flush
    before each call (GPU), or wall-clock time (simulator)."""

    def __init__(self):
        self.flush = None if SIM else cuda.device_array(L2_FLUSH_BYTES, np.uint8)
        self.stream = 0 if SIM else cuda.stream()

    def __call__(self, call, reps, queued):
        """``(us, host_us, reps, timing)`` of ``call(stream)``, which queues its
        work on ``stream`` (or waits for it): ``queued`` behind a device sleep
        (the device's time), else started on an idle device."""
        s = self.stream
        if SIM:
            call(s)
            times = []
            for _ in range(max(1, reps)):
                start = time.perf_counter()
                call(s)
                times.append((time.perf_counter() - start) * 1e6)
            us = statistics.median(times)
            return us, us, len(times), "wall-clock (simulator)"
        from numba.cuda.cudadrv.driver import device_memset

        start = time.perf_counter()
        for _ in range(WARMUP):
            call(s)
        cuda.synchronize()
        per_call = (time.perf_counter() - start) / WARMUP
        reps = max(MIN_REPS, min(reps, int(TIME_BUDGET_S / max(per_call, 1e-9))))
        times, host = [], []
        for _ in range(reps):
            a, b = cuda.event(timing=True), cuda.event(timing=True)
            device_memset(self.flush, 0, L2_FLUSH_BYTES, stream=s)
            if queued:
                _spin[1, 32, s](SPIN_NS // 1000)
            else:
                cuda.synchronize()
            a.record(stream=s)
            start = time.perf_counter()
            call(s)
            host.append((time.perf_counter() - start) * 1e6)
            b.record(stream=s)
            b.synchronize()
            times.append(cuda.event_elapsed_time(a, b) * 1e3)
        timing = "events, queued behind a sleep" if queued else "events, from an idle device"
        return statistics.median(times), statistics.median(host), reps, timing


def bench_copy(timer, layout, block_size, num_layers, num_pairs, reps, rng, heads, head_size):
    """Rows of copy_blocks, its kernel and the device copy for one configuration."""
    layers = num_layers or 1
    num_blocks = 2 * num_pairs
    cache_bytes = 2 * num_blocks * layers * block_size * heads * head_size * 2
    what = f"copy {layout} bs={block_size} layers={layers} pairs={num_pairs}"
    if not fits(cache_bytes, what):
        return []
    cache = pn.PagedKVCache(num_blocks, block_size, heads, head_size, DTYPE, layout, num_layers)
    pools = pools_of(cache)
    fill(pools, seed=1)
    perm = rng.permutation(num_blocks)
    pairs = np.stack([perm[:num_pairs], perm[num_pairs:]], axis=1)
    verified = verify_copy(cache, pairs, rng)
    moved = sum(p.shape[2] for p in pools) * layers * num_pairs * 2      # bytes read
    nbytes = 2 * moved                                                   # + bytes written

    k, v, has_value = _flat_pools(cache)
    vec, threads = _vector_threads(k, v)
    kernel = copy_blocks_kernel(vec, has_value)
    d_pairs = cuda.to_device(pairs.astype(np.int32))
    flat = [p.reshape(p.size) for p in pools]
    m = layers * num_pairs * pools[0].shape[2]          # elements moved per pool
    calls = {
        "copy_blocks": (lambda s: pn.copy_blocks(cache, pairs, stream=s), False),
        "copy_blocks_kernel": (lambda s: launch(kernel, (num_pairs, layers), threads,
                                                (k, v, d_pairs), stream=s), True),
        "device_copy": (lambda s: [f[m:2 * m].copy_to_device(f[:m], stream=s) for f in flat],
                        True),
    }
    rows = []
    for impl, (call, queued) in calls.items():
        us, host_us, n, timing = timer(call, reps, queued)
        rows.append(dict(impl=impl, us=us, host_us=host_us, reps=n, timing=timing,
                         gbps=nbytes / us / 1e3, timestamp=now(),
                         verified=verified if impl != "device_copy" else ""))
    ceiling = rows[-1]["gbps"]
    for r in rows:
        r.update(op="copy_blocks", direction="d2d", host_ids="", layout=layout,
                 block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=DTYPE,
                 num_layers=layers, num_pairs=num_pairs, cache_blocks=num_blocks, bytes=nbytes,
                 ceiling_gbps=ceiling, ratio_to_ceiling=r["gbps"] / ceiling)
        print(f"copy {layout:>11} bs={block_size:<3} layers={layers:<3} pairs={num_pairs:<6} "
              f"{r['impl']:>18} {r['us']:10.1f} us {r['gbps']:8.1f} GB/s "
              f"x{r['ratio_to_ceiling']:.3f} of the device copy  host {r['host_us']:.1f} us",
              flush=True)
    del cache, pools, k, v, d_pairs, flat
    return rows


def bench_swap(timer, num_layers, num_blocks, reps, rng, block_size, heads, head_size):
    """Rows of swap_blocks out and in (host ids one run, and scattered) and the
    pinned copies of the same bytes, for one configuration."""
    layers = num_layers or 1
    cache_blocks = 2 * num_blocks
    block_bytes = 2 * layers * block_size * heads * head_size * 2      # K and V, every layer
    what = f"swap layers={layers} blocks={num_blocks}"
    if not fits(cache_blocks * block_bytes, what):
        return []
    cache = pn.PagedKVCache(cache_blocks, block_size, heads, head_size, DTYPE, "nhd", num_layers)
    pools = pools_of(cache)
    fill(pools, seed=3)
    # a host pool of twice the blocks where it fits: "scattered" takes half of them
    spread = 2 * num_blocks * block_bytes <= HOST_POOL_LIMIT
    host = pn.host_pool(cache, 2 * num_blocks if spread else num_blocks)
    nbytes = num_blocks * block_bytes
    dev_ids = rng.choice(cache_blocks, num_blocks, replace=False)
    permuted = rng.permutation(num_blocks)
    if num_blocks > 1 and np.array_equal(permuted, np.arange(num_blocks)):
        permuted = np.roll(permuted, 1)
    kinds = [("run", np.arange(num_blocks)), ("permuted", permuted)]
    if spread:
        kinds.append(("scattered", rng.choice(2 * num_blocks, num_blocks, replace=False)))
    host_flat = host.view(np.float16).reshape(host.size)
    dev_flat = [p.reshape(p.size) for p in pools]
    m = num_blocks * layers * pools[0].shape[2]
    parts = [(f[:m], host_flat[n * m:(n + 1) * m]) for n, f in enumerate(dev_flat)]
    rows = []
    for out in (True, False):
        direction = "d2h" if out else "h2d"
        if out:
            ceiling_call = lambda s: [d.copy_to_host(h, stream=s) for d, h in parts]    # noqa: E731
        else:
            ceiling_call = lambda s: [d.copy_to_device(h, stream=s) for d, h in parts]  # noqa: E731
        got = []
        for kind, host_ids in kinds:
            verified = verify_swap(cache, host, dev_ids, host_ids, out, rng)
            pairs = np.stack([dev_ids, host_ids] if out else [host_ids, dev_ids], axis=1)
            src, dst = (cache, host) if out else (host, cache)
            us, host_us, n, timing = timer(lambda s: pn.swap_blocks(src, dst, pairs), reps, False)
            got.append(dict(impl="swap_blocks", host_ids=kind, verified=verified, us=us,
                            host_us=host_us, reps=n, timing=timing, timestamp=now()))
        us, host_us, n, timing = timer(ceiling_call, reps, False)
        got.append(dict(impl="pinned_copy", host_ids="", verified="", us=us, host_us=host_us,
                        reps=n, timing=timing, timestamp=now()))
        ceiling = nbytes / got[-1]["us"] / 1e3
        for r in got:
            r.update(op="swap_blocks", direction=direction, layout="nhd", block_size=block_size,
                     num_kv_heads=heads, head_size=head_size, dtype=DTYPE, num_layers=layers,
                     num_pairs=num_blocks, cache_blocks=cache_blocks, bytes=nbytes,
                     gbps=nbytes / r["us"] / 1e3, ceiling_gbps=ceiling)
            r["ratio_to_ceiling"] = r["gbps"] / ceiling
            print(f"swap {direction} layers={layers:<3} blocks={num_blocks:<5} "
                  f"{r['impl']:>12} {r['host_ids']:>9} {r['us']:11.1f} us {r['gbps']:7.2f} GB/s "
                  f"x{r['ratio_to_ceiling']:.3f} of the pinned copy", flush=True)
        rows += got
    del cache, pools, host, host_flat, dev_flat, parts
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="a tiny configuration, for checking the script (e.g. on the simulator)")
    ap.add_argument("--out", default="results/blocks.csv",
                    help="CSV to add this run's rows to (rows of other runs are kept)")
    ap.add_argument("--reps", type=int, default=20,
                    help="timed calls per measurement (fewer, at least 3, for long ones)")
    ap.add_argument("--only", choices=["copy", "swap"], help="only copy_blocks or swap_blocks")
    args = ap.parse_args()
    if SIM and not args.quick:
        print("Numba's CUDA simulator is on: the full grid would take hours there; use --quick",
              flush=True)
    if args.quick:
        heads, head_size, block_sizes = QUICK["num_kv_heads"], QUICK["head_size"], QUICK["block_sizes"]
        copy_pairs, swap_bs, swap_blocks = (QUICK["copy_pairs"], QUICK["swap_block_size"],
                                            QUICK["swap_blocks"])
        reps = min(args.reps, 2)
    else:
        heads, head_size, block_sizes = NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZES
        copy_pairs, swap_bs, swap_blocks, reps = COPY_PAIRS, SWAP_BLOCK_SIZE, SWAP_BLOCKS, args.reps
    gpu, run_id = gpu_name(), new_run_id()
    common = dict(run_id=run_id, gpu=gpu, **versions(),
                  command="python experiments/bench_blocks.py " + " ".join(sys.argv[1:]))
    print(f"{gpu}; run {run_id}; " + ", ".join(f"{k} {common[k]}" for k in
                                               ("numba_cuda", "cuda_driver", "git_rev")),
          flush=True)
    rng = np.random.default_rng(0)
    timer = Timer()
    rows = []
    if args.only in (None, "copy"):
        for num_layers, counts in copy_pairs.items():
            for block_size in block_sizes:
                for layout in LAYOUTS:
                    for num_pairs in counts:
                        got = bench_copy(timer, layout, block_size, num_layers, num_pairs, reps,
                                         rng, heads, head_size)
                        rows += [dict(r, **common) for r in got]
                        if got:     # after each case: a run cut short keeps what it measured
                            write_rows(args.out, FIELDS, rows, 4, keep_runs=True)
                        release()
    if args.only in (None, "swap"):
        for num_layers, counts in swap_blocks.items():
            for num_blocks in counts:
                got = bench_swap(timer, num_layers, num_blocks, reps, rng, swap_bs, heads,
                                 head_size)
                rows += [dict(r, **common) for r in got]
                if got:
                    write_rows(args.out, FIELDS, rows, 4, keep_runs=True)
                release()
    if rows:
        print_table(rows, TABLE, 3)


if __name__ == "__main__":
    main()
