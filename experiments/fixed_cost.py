"""Where the decode kernel's fixed cost per call goes: fit ``us = c + bytes / BW``
over a context sweep, for paged_numba at fixed partition counts and for SDPA.

    python experiments/fixed_cost.py --out results/fixed_cost_h200.csv

On the headline shapes, paged_numba streams within a few percent of SDPA's
rate but pays 5-8 us more per call (``docs/journal/decode_tc.md``, decode v8,
2026-11-30: "What is left of the gap").
This times fp16, 32/8 heads, head size 128, block size 16, random tables,
at ``--batches`` x ``--contexts`` with each of ``--partitions`` forced, and
SDPA on the same shapes (``bench_decode.bench_config``, so the same method:
rotated inputs, CUDA graphs, medians); then fits ``c`` and ``BW`` per
(implementation, batch, partitions) by least squares and prints them with
the time of replaying graphs of 1 and 4 tiny kernels, timed the same way.
That is not a floor of a long kernel's replay: with the idle-start timing
of run 20261130T121639Z-621ff5 it was 19.6 us for one kernel and 4.7 us a
kernel for four, the host's submission of the replay
(``docs/journal/decode_tc.md``, "decode v8: where the fixed cost goes").
One CSV row per timing, plus the fits (``context`` empty).

    python experiments/fixed_cost.py --kernels       # print only

lists, for the headline shapes, the kernels that one paged_numba call and
one SDPA call launch, with their device times from the PyTorch profiler
(CUPTI): how many kernels SDPA uses (a split-KV kernel and a combine, or
one), and how our call's time splits between the decode and merge kernels.
"""
import argparse
import sys

import numpy as np
import torch

sys.path.insert(0, "experiments")
from bench_common import new_run_id, write_rows  # noqa: E402
from bench_decode import bench_config, copy_gbps, graph_time, kv_bytes  # noqa: E402

FIELDS = ["run_id", "gpu", "impl", "batch", "context", "num_partitions", "us", "merge_us",
          "fit_c_us", "fit_tbps", "copy_gbps", "command"]


def fit(rows):
    """``(c_us, TB/s)`` of ``us = c + bytes / BW`` over ``rows``."""
    x = np.array([kv_bytes(r["batch"], r["context"], 8, 128, 2) for r in rows], float)
    y = np.array([r["us"] for r in rows], float)
    slope, c = np.polyfit(x, y, 1)                  # us per byte
    return c, 1e-6 / slope


def floor_us(reps):
    """Microseconds per call of graphs of 1 and 4 tiny kernels (one per call)."""
    x = torch.zeros(1, device="cuda")
    return {n: graph_time([lambda: x.add_(1)] * n, reps)
            for n in (1, 4)}


def kernel_times(call):
    """``[(kernel name, device us)]`` of one ``call()`` (after one warm-up call)."""
    from torch.profiler import DeviceType, ProfilerActivity, profile
    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return [(e.name, e.time_range.elapsed_us()) for e in prof.events()
            if e.device_type == DeviceType.CUDA]


def list_kernels(shapes):
    """Print :func:`kernel_times` of a paged_numba call and an SDPA call per shape."""
    import paged_numba as pn
    from numba import cuda
    for b, c in shapes:
        nb = b * -(-c // 16)
        cache = pn.PagedKVCache(nb, 16, 8, 128, "float16", "nhd")
        for pool in (cache.key_cache, cache.value_cache):
            torch.as_tensor(pool, device="cuda").normal_()
        table = cuda.as_cuda_array(torch.randperm(nb, device="cuda").reshape(b, -1)
                                   .to(torch.int32).contiguous())
        q = cuda.as_cuda_array(torch.randn(b, 32, 128, dtype=torch.float16, device="cuda"))
        lens = cuda.as_cuda_array(torch.full((b,), c, dtype=torch.int32, device="cuda"))
        plan = pn.DecodePlan(cache, b, 32, nb // b)
        ks = torch.randn(b, 8, c, 128, dtype=torch.float16, device="cuda")
        vs, qs = torch.randn_like(ks), torch.randn(b, 32, 1, 128, dtype=torch.float16,
                                                   device="cuda")
        sdpa = torch.nn.functional.scaled_dot_product_attention
        for name, call in (
                (f"paged_numba P={plan.num_partitions}",
                 lambda: plan.run(q, table, lens, stream=torch.cuda.current_stream())),
                ("torch_sdpa_contiguous", lambda: sdpa(qs, ks, vs, enable_gqa=True))):
            got = kernel_times(call)
            print(f"b={b:<4} ctx={c:<6} {name}: {sum(t for _, t in got):.1f} us in "
                  f"{len(got)} kernel(s): "
                  + "; ".join(f"{n[:60]} {t:.1f} us" for n, t in got), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--partitions", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="results/fixed_cost_h200.csv")
    ap.add_argument("--kernels", action="store_true",
                    help="list each call's kernels and device times on the headline shapes")
    a = ap.parse_args()
    if a.kernels:
        from bench_decode import HEADLINE
        return list_kernels(HEADLINE)
    gpu, run_id, bw = torch.cuda.get_device_name(), new_run_id(), copy_gbps()
    command = "python experiments/fixed_cost.py " + " ".join(sys.argv[1:])
    print(f"{gpu}: copy {bw:.0f} GB/s; run {run_id}; empty graph replay per call: "
          + ", ".join(f"{n} a graph {us:.1f} us" for n, us in floor_us(a.reps).items()), flush=True)
    rows, fits = [], []
    for b in a.batches:
        groups = {}
        for c in a.contexts:
            got = bench_config(b, c, 32, 8, 128, 16, "float16", tables=("random",),
                               partitions=a.partitions, reps=a.reps)
            for r in got:
                r.update(run_id=run_id, gpu=gpu, batch=b, context=c, copy_gbps=bw,
                         command=command)
                groups.setdefault((r["impl"], r["num_partitions"]), []).append(r)
                print(f"{r['impl']:>22} b={b:<4} ctx={c:<6} P={r['num_partitions']!s:<3} "
                      f"{r['us']:8.1f} us  merge alone {r.get('merge_us') or '-'}", flush=True)
            rows += got
        for (impl, p), grp in groups.items():
            c_us, tbps = fit(grp)
            fits.append(dict(run_id=run_id, gpu=gpu, impl=impl, batch=b, context="",
                             num_partitions=p, fit_c_us=c_us, fit_tbps=tbps, copy_gbps=bw,
                             command=command))
            print(f"fit {impl:>22} b={b:<4} P={p!s:<3} c = {c_us:6.1f} us, BW = {tbps:5.2f} TB/s",
                  flush=True)
    write_rows(a.out, FIELDS, rows + fits, 3)


if __name__ == "__main__":
    main()
