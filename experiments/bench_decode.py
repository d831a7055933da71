"""Decode benchmark: paged_numba against torch SDPA (same K/V made contiguous) and FlashInfer.

    python experiments/bench_decode.py --grid headline --out results/decode_h200.csv
    python experiments/bench_decode.py --grid groups --impls paged_numba flashinfer
    python experiments/bench_decode.py --grid fp8 --out results/decode_fp8_h200.csv
    python experiments/bench_decode.py --tuning --only pdl --cases group4-1x32768 group4-16x4096

Cases (``--grid headline``; fp16, head size 128, block size 16): the five
``group4-BxC`` rows (B sequences of C tokens, 32 query / 8 KV heads), then
``mqa-64x4096`` (32 query heads / 1 KV head) and ``group16-64x4096`` (64 query
/ 4 KV heads); ``--grid groups`` has only the last two, ``--cases`` picks some.
``--grid fp8`` has the five ``group4-BxC`` rows twice, with an fp16 cache and
with an E4M3 one (``group4-BxC-e4m3``: fp16 queries, scales 1, the pools
filled with fp16 normals rounded to E4M3), and ``--grid fp8-all`` adds E5M2
(``-e5m2``); SDPA is the fp16 one on contiguous K/V in every row, and
FlashInfer reads the same fp8 pools (``kv_data_type`` float8, ``k_scale`` and
``v_scale``).

FlashInfer (``flashinfer``, when it imports): ``BatchDecodeWithPagedKVCacheWrapper``
(``"NHD"``) on the same pools, queries and random block tables (as CSR
pages), ``plan()`` outside the graph, ``run()`` captured and timed like the
others (``timing`` says ``events`` where capturing it failed and it ran
eagerly). Impl ``flashinfer`` has the ``use_tensor_cores`` of FlashInfer's
own rule (tensor cores from a GQA group of 4 up, as its sparse wrapper
decides); the other setting is timed too, as ``flashinfer_tc`` or
``flashinfer_cc``, except where its CUDA-core kernel has no such group
(it has 1, 2, 3, 4 and 8). ``impl_detail`` says which backend ran.

The device guard's cost (``--guard-cost``, with ``paged_numba``): next to each
``paged_numba`` row a ``paged_numba_noguard`` row, the same plans on the same
data with the tensor-core kernel built with ``guard=False`` (``impl_detail``
says so; its output is checked bit for bit against the guarded one's), timed
right after it the same way; ``ratio_to_noguard`` of the ``paged_numba`` row
minus 1 is the guard's cost, printed in percent after each case. Plans on the
prefill tile (MQA, large groups) or the CUDA-core kernel get no such row (a
printed note says why).

Method: inputs are rotated so that the bytes touched per timed pass exceed
the L2 several times; each implementation's calls are captured in a CUDA
graph (one call per rotation) and the graph is replayed, timed with CUDA
events; the median over replays, divided by the calls per replay, is the
time per call. Each timed replay is queued behind a short spin kernel, so
that the start event fires when the graph is already waiting on the device
and the time is the graph's own, not the host's submission of it
(``--idle-start`` times from an idle device instead, as before 2026-11-30;
on the H200 machine that measured 0.2-1 us more per call on the two small
headline rows, for SDPA and for ours, and no difference past the noise on
the large ones: ``docs/journal/tooling.md``, "The replay queued behind a spin
kernel, 2026-11-30").
The device's copy bandwidth is measured in the same run.
Bytes counted: one read of K and V (``2 * seq_len * num_kv_heads *
head_size * itemsize`` per sequence, the cache's itemsize: 1 for fp8, and 2
for SDPA's fp16 copy) plus the query and the output.
"""
import argparse
import math
import statistics
import sys
import time
import traceback

import numpy as np
import torch
from numba import cuda

import paged_numba as pn
from bench_common import (  # noqa: F401 (copy_gbps: other scripts import it from here)
    check_against_sdpa, copy_gbps, csr_pages, decode_without_guard, flashinfer_workspace,
    guard_cost, import_flashinfer, new_run_id, ratio, torch_pools, write_rows)

HEADLINE = [(1, 32768), (16, 4096), (64, 4096), (256, 2048), (128, 8192)]
GROUPS = {"mqa-64x4096": (64, 4096, 32, 1), "group16-64x4096": (64, 4096, 64, 4)}
IMPLS = ["paged_numba", "torch_sdpa", "flashinfer"]
FI_CUDA_CORE_GROUPS = (1, 2, 3, 4, 8)     # FlashInfer's DISPATCH_GQA_GROUP_SIZE (utils.cuh)
L2_BYTES = 60 * 2**20
WARM_S = 0.1       # seconds of graph replays before each timing
QUEUE_CYCLES = 200_000   # spin before each timed replay (~0.1 ms, longer than submitting it)
QUEUED = True      # False: --idle-start
FIELDS = ["run_id", "gpu", "impl", "case", "batch", "context", "num_heads", "num_kv_heads",
          "head_size", "block_size", "dtype", "kv_dtype", "layout", "table", "num_partitions", "us", "gbps",
          "pct_copy_bw", "ratio_to_sdpa", "ratio_to_flashinfer", "ratio_to_noguard", "host_us",
          "copy_gbps", "impl_detail", "timing", "max_err", "command"]


def graph_time(calls, reps):
    """Median microseconds per call of ``calls`` captured in one CUDA graph."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(2):                      # warm-up (module load, caches)
            for call in calls:
                call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for call in calls:
            call()
    # replay for WARM_S first: after the host-side set-up between configurations
    # the clocks have dropped, and a few replays are not enough to raise them
    # (the first of two identical configurations measured up to 7% slower)
    start = time.perf_counter()
    while time.perf_counter() - start < WARM_S:
        for _ in range(10):
            graph.replay()
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if QUEUED:      # the device is busy until the replay has been submitted
            torch.cuda._sleep(QUEUE_CYCLES)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(calls))
    return statistics.median(times)


def event_time(calls, reps):
    """Median microseconds per call of ``calls`` run eagerly (no graph), each
    pass timed with CUDA events behind the same spin as :func:`graph_time`."""
    start = time.perf_counter()
    while time.perf_counter() - start < WARM_S:
        for call in calls:
            call()
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if QUEUED:
            torch.cuda._sleep(QUEUE_CYCLES)
        a.record()
        for call in calls:
            call()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(calls))
    return statistics.median(times)


def kv_bytes(batch, context, num_kv_heads, head_size, itemsize):
    return 2 * batch * context * num_kv_heads * head_size * itemsize


def flashinfer_rows(fi, cache, qts, tab_ts, context, reps):
    """FlashInfer's paged decode over the same pools, queries and tables: one
    wrapper per rotation (``plan()`` here), ``run()`` into preallocated outputs,
    captured in a CUDA graph like the others (eagerly with events if that fails)."""
    batch, num_heads = qts[0].shape[:2]
    group = num_heads // cache.num_kv_heads
    pools = torch_pools(cache)
    fp8 = cache.dtype.name.startswith("float8")
    scales = dict(k_scale=float(cache.k_scale), v_scale=float(cache.v_scale)) if fp8 else {}
    rule = group >= 4       # FlashInfer's own rule (sparse.py: R * group < 4 -> CUDA cores)
    rows = []
    for tc in (rule, not rule):
        impl = "flashinfer" if tc == rule else ("flashinfer_tc" if tc else "flashinfer_cc")
        if not tc and group not in FI_CUDA_CORE_GROUPS:
            print(f"{impl}: skipped (FlashInfer's CUDA-core decode has no GQA group {group})",
                  flush=True)
            continue
        try:
            wrappers = []
            for t in tab_ts:
                # tensor cores: the fa2 prefill kernels (FlashInfer's "auto" picks fa3 on
                # sm90, which ran decode 8-20x slower than fa2's CUDA-core decode here)
                w = fi.BatchDecodeWithPagedKVCacheWrapper(flashinfer_workspace(), "NHD",
                                                          use_tensor_cores=tc,
                                                          **(dict(backend="fa2") if tc else {}))
                w.plan(*csr_pages(t, [context] * batch, cache.block_size), num_heads,
                       cache.num_kv_heads, cache.head_size, cache.block_size,
                       pos_encoding_mode="NONE", q_data_type=qts[0].dtype,
                       kv_data_type=pools[0].dtype)
                wrappers.append(w)
            outs = [torch.empty_like(q) for q in qts]
            calls = [lambda w=w, q=q, o=o: w.run(q, pools, out=o, **scales)
                     for w, q, o in zip(wrappers, qts, outs)]
            for call in calls:
                call()
            torch.cuda.synchronize()
            err = check_against_sdpa(cache, qts[0], tab_ts[0], context, outs[0])
            if not err < 2e-2:
                print(f"{impl}: check against SDPA FAILED, max error {err:.3g}", flush=True)
            start = time.perf_counter()
            for _ in range(200):
                calls[0]()
            host_us = (time.perf_counter() - start) / 200 * 1e6
            torch.cuda.synchronize()
            try:
                us, timing = graph_time(calls, reps), "graph"
            except Exception as e:  # noqa: BLE001 - not capturable: time it eagerly
                print(f"{impl}: graph capture failed ({type(e).__name__}: {e}); timing it "
                      f"eagerly with events", flush=True)
                us, timing = event_time(calls, reps), "events"
        except Exception as e:  # noqa: BLE001 - e.g. a shape this FlashInfer does not support
            print(f"{impl}: skipped ({type(e).__name__}: {e})", flush=True)
            continue
        detail = f"use_tensor_cores={tc}" + (f" backend={wrappers[0]._backend}" if tc else "")
        rows.append(dict(impl=impl, impl_detail=detail, table="random", num_partitions="", us=us,
                         host_us=host_us, timing=timing, max_err=err))
    return rows


def bench_config(batch, context, num_heads, num_kv_heads, head_size, block_size, dtype,
                 kv_dtype=None, layout="nhd", tables=("random", "identity"), partitions=(None,),
                 reps=30, sdpa=True, tuning=None, numba=True, fi=None, guard_cost=False):
    """Time one configuration; return a list of result dicts. ``dtype`` is the
    queries' (and SDPA's), ``kv_dtype`` the cache's (default ``dtype``; fp8: the
    pools hold fp16 normals rounded to it, scales 1). ``numba=False`` leaves
    paged_numba out; ``fi``, the flashinfer module, adds its rows (on the
    random table of an "nhd" cache); ``guard_cost`` a ``paged_numba_noguard``
    row after each ``paged_numba`` one where the plan can drop the guard."""
    kv_dtype = kv_dtype or dtype
    tdtype = getattr(torch, dtype)
    itemsize = torch.finfo(tdtype).bits // 8
    kv_itemsize = torch.finfo(getattr(torch, kv_dtype)).bits // 8
    per_set = kv_bytes(batch, context, num_kv_heads, head_size, kv_itemsize)
    rot = max(1, math.ceil(4 * L2_BYTES / per_set))
    blocks_per_seq = -(-context // block_size)
    num_blocks = rot * batch * blocks_per_seq
    cache = pn.PagedKVCache(num_blocks, block_size, num_kv_heads, head_size, kv_dtype, layout)
    for pool in (cache.key_cache, cache.value_cache):
        pool = torch.as_tensor(pool, device="cuda")
        if kv_itemsize == 1:        # fp8 codes (uint8): fp16 normals rounded to the format
            for chunk in pool.view(pool.shape[0], -1).split(4096):
                chunk.copy_(torch.randn(chunk.shape, dtype=torch.float16, device="cuda")
                            .to(getattr(torch, kv_dtype)).view(torch.uint8))
        else:                       # bf16 pools hold bit patterns (uint16): fill them as bf16
            pool.view(getattr(torch, kv_dtype)).normal_()
    lens = cuda.to_device(np.full(batch, context, np.int32))
    qts = [torch.randn(batch, num_heads, head_size, dtype=tdtype, device="cuda")
           for _ in range(rot)]
    queries = [cuda.as_cuda_array(q) for q in qts]
    rows = []

    def new_plans(parts):
        return [pn.DecodePlan(cache, batch, num_heads, blocks_per_seq, num_partitions=parts,
                              **(tuning or {})) for _ in range(rot)]

    def time_plans(plans, tabs):
        """``(us, host_us, max_err)`` of the plans' runs (the first packs them)."""
        for plan, q, t in zip(plans, queries, tabs):
            plan.run(q, t, lens, validate=True)
        torch.cuda.synchronize()
        err = check_against_sdpa(cache, queries[0], tabs[0], context, plans[0].out)
        start = time.perf_counter()
        for _ in range(200):
            plans[0].run(queries[0], tabs[0], lens)
        host_us = (time.perf_counter() - start) / 200 * 1e6
        torch.cuda.synchronize()
        calls = [lambda p=p, q=q, t=t: p.run(q, t, lens, stream=torch.cuda.current_stream())
                 for p, q, t in zip(plans, queries, tabs)]
        return graph_time(calls, reps), host_us, err

    for table_kind in tables:
        order = (torch.randperm(num_blocks, device="cuda") if table_kind == "random"
                 else torch.arange(num_blocks, device="cuda"))
        tab_ts = [order[r * batch * blocks_per_seq:(r + 1) * batch * blocks_per_seq]
                  .reshape(batch, blocks_per_seq).to(torch.int32).contiguous() for r in range(rot)]
        tabs = [cuda.as_cuda_array(t) for t in tab_ts]
        for parts in (partitions if numba else ()):
            plans = new_plans(parts)
            us, host_us, err = time_plans(plans, tabs)
            merge_us = ""
            if plans[0]._merge is not None:     # the split-K merge alone
                merge_us = graph_time([lambda p=p: p._merge(torch.cuda.current_stream())
                                       for p in plans], reps)
            kern = plans[0]._decode
            regs = ("" if not hasattr(kern, "dispatcher") else
                    [getattr(k, "regs_per_thread", "") for k in kern.dispatcher.overloads.values()])
            kind = ("decode kernel" if plans[0]._group is None else
                    f"prefill tile ({plans[0]._group.kind})")
            rows.append(dict(impl="paged_numba", table=table_kind,
                             impl_detail=f"{kind}, heads_per_block={plans[0].heads_per_block}",
                             num_partitions=plans[0].num_partitions, us=us, host_us=host_us,
                             merge_us=merge_us,
                             regs=regs, tuning=tuning, max_err=err))
            bare = new_plans(parts) if guard_cost else []
            why = bare and decode_without_guard(bare)
            if why:
                print(f"paged_numba_noguard: skipped ({why})", flush=True)
            elif bare:      # the same plans, the kernel without the guard: the same bits
                us, host_us, err = time_plans(bare, tabs)
                same = np.array_equal(*(p.out.copy_to_host().view(np.uint8)
                                        for p in (plans[0], bare[0])))
                detail = ", guard=False" + ("" if same else ", OUTPUT DIFFERS")
                rows.append(dict(rows[-1], impl="paged_numba_noguard", us=us, host_us=host_us,
                                 max_err=err, merge_us="", regs="",
                                 impl_detail=rows[-1]["impl_detail"] + detail))
        if fi is not None and table_kind == "random" and layout == "nhd":
            rows += flashinfer_rows(fi, cache, qts, tab_ts, context, reps)
    if sdpa:
        ks = [torch.randn(batch, num_kv_heads, context, head_size, dtype=tdtype, device="cuda")
              for _ in range(rot)]
        vs = [torch.randn_like(k) for k in ks]
        qs = [torch.randn(batch, num_heads, 1, head_size, dtype=tdtype, device="cuda")
              for _ in range(rot)]
        f = torch.nn.functional.scaled_dot_product_attention
        calls = [lambda q=q, k=k, v=v: f(q, k, v, enable_gqa=True) for q, k, v in zip(qs, ks, vs)]
        us = graph_time(calls, reps)
        rows.append(dict(impl="torch_sdpa_contiguous", table="contiguous", num_partitions="",
                         us=us, host_us="", kv_dtype=dtype))
        del ks, vs
    for r in rows:
        r.setdefault("kv_dtype", kv_dtype)
        kv_size = torch.finfo(getattr(torch, r["kv_dtype"])).bits // 8
        nbytes = (kv_bytes(batch, context, num_kv_heads, head_size, kv_size)
                  + 2 * batch * num_heads * head_size * itemsize)
        r.update(batch=batch, context=context, num_heads=num_heads, num_kv_heads=num_kv_heads,
                 head_size=head_size, block_size=block_size, dtype=dtype, layout=layout,
                 gbps=nbytes / r["us"] / 1e3)
    return rows


def cases(name):
    """Named configurations ``{case: (batch, context, num_heads, num_kv_heads,
    head_size, block_size, dtype[, kv_dtype])}`` of the headline, groups, fp8
    and quick grids."""
    group4 = {f"group4-{b}x{c}": (b, c, 32, 8, 128, 16, "float16") for b, c in HEADLINE}
    groups = {case: (*g, 128, 16, "float16") for case, g in GROUPS.items()}
    if name == "headline":
        return {**group4, **groups}
    if name in ("fp8", "fp8-all"):
        formats = {"e4m3": "float8_e4m3fn"} | ({"e5m2": "float8_e5m2"} if name == "fp8-all"
                                               else {})
        return {**group4, **{f"{case}-{short}": (*cfg, fmt) for case, cfg in group4.items()
                             for short, fmt in formats.items()}}
    if name == "groups":
        return groups
    if name == "quick":
        return {"group4-4x2048": (4, 2048, 32, 8, 128, 16, "float16")}
    raise SystemExit(f"unknown grid {name!r}")


def grid(name):
    """Configurations ``(batch, context, num_heads, num_kv_heads, head_size, block_size, dtype)``."""
    if name == "full":
        # batch x context at the headline model shape, then one factor at a
        # time (head size, block size, GQA group incl. MHA and MQA, fp32) at two shapes
        cfgs = [(b, c, 32, 8, 128, 16, "float16") for b in (1, 4, 16, 64, 128, 256)
                for c in (512, 2048, 4096, 8192, 32768) if b * c <= 2**21]
        for b, c in ((16, 4096), (64, 2048)):
            cfgs += [(b, c, 32, 8, hs, 16, "float16") for hs in (64, 256)]
            cfgs += [(b, c, 32, 8, 128, bs, "float16") for bs in (8, 32)]
            cfgs += [(b, c, 32, kvh, 128, 16, "float16") for kvh in (32, 4, 1)]
            cfgs += [(b, c, 32, 8, 128, 16, "float32")]
        return cfgs
    raise SystemExit(f"unknown grid {name!r}")


GRID_FIELDS = ["run_id", "gpu", "impl", "batch", "context", "num_heads", "num_kv_heads",
               "head_size", "block_size", "dtype", "num_partitions", "heuristic_partitions",
               "us", "gbps", "pct_copy_bw", "ratio_to_sdpa", "ratio_to_best", "copy_gbps",
               "command"]


def full_grid(args):
    """The full grid: per configuration, the default (heuristic) partition count,
    the unsplit kernel (P = 1), the best P of a sweep, and SDPA."""
    gpu = torch.cuda.get_device_name()
    run_id = new_run_id()
    command = "python experiments/bench_decode.py " + " ".join(sys.argv[1:])
    bw = copy_gbps()
    print(f"{gpu}: device copy {bw:.0f} GB/s; run {run_id}", flush=True)
    out = []
    for cfg in grid("full"):
        b, c = cfg[0], cfg[1]
        parts = [p for p in (1, 2, 3, 4, 6, 8, 16, 32, 64) if p * 256 <= c or p == 1]
        rows = bench_config(*cfg, tables=("random",), partitions=[None] + parts, reps=args.reps)
        heur, sweep, sdpa = rows[0], rows[1:-1], rows[-1]
        best = min(sweep, key=lambda r: r["us"])
        unsplit = [r for r in sweep if r["num_partitions"] == 1][0]
        picked = []
        for impl, r in (("paged_numba", heur), ("paged_numba_unsplit", unsplit),
                        ("paged_numba_best_partitions", best), ("torch_sdpa_contiguous", sdpa)):
            picked.append(dict(r, impl=impl, run_id=run_id, gpu=gpu, copy_gbps=bw, command=command,
                               heuristic_partitions=heur["num_partitions"],
                               pct_copy_bw=100 * r["gbps"] / bw, ratio_to_sdpa=r["us"] / sdpa["us"],
                               ratio_to_best=r["us"] / best["us"]))
        print(f"b={b:<4} ctx={c:<6} kvh={cfg[3]:<3} hs={cfg[4]:<4} bs={cfg[5]:<3} {cfg[6]:8} "
              f"P={heur['num_partitions']:<3} {heur['us']:8.1f} us | unsplit {unsplit['us']:8.1f} | "
              f"best P={best['num_partitions']:<3} {best['us']:8.1f} | SDPA {sdpa['us']:7.1f} | "
              f"x{heur['us'] / sdpa['us']:.2f} SDPA, {heur['us'] / best['us']:.3f} of best, "
              f"err {heur['max_err']:.1e}", flush=True)
        out += picked
        write_rows(args.out, GRID_FIELDS, out, 4)   # after each configuration: a run cut
                                                    # short keeps what it measured


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grid", default="headline",
                    choices=["headline", "groups", "fp8", "fp8-all", "quick", "full"])
    ap.add_argument("--cases", nargs="+", metavar="NAME", help="only these cases of the grid")
    ap.add_argument("--impls", nargs="+", default=IMPLS, choices=IMPLS, metavar="IMPL",
                    help=f"only these implementations (of {' '.join(IMPLS)}; not for --grid full)")
    ap.add_argument("--out", default="results/decode_h200.csv")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--heads-per-block", type=int, metavar="N",
                    help="DecodePlan(heads_per_block=N) for paged_numba (default: the plan's "
                         "choice; impl_detail says which kernel ran with how many)")
    ap.add_argument("--group-kernel", choices=["tile", "wgmma"],
                    help="DecodePlan(group_kernel=...) for paged_numba: the prefill tile that "
                         "runs MQA and large groups")
    ap.add_argument("--tuning", action="store_true",
                    help="time kernel variants (v4 and tensor-core kernels, warps, ring depth, "
                         "the merge launched early (pdl); with an fp8 --kv-dtype also qk_fp8) "
                         "on the headline shapes, print only")
    ap.add_argument("--only", nargs="+", default=None, metavar="KEY",
                    help="with --tuning: only the variants that set one of these knobs "
                         "(e.g. pdl qk_fp8 stages), and with --cases only those headline "
                         "rows (group4-BxC)")
    ap.add_argument("--kv-dtype", default=None, metavar="DTYPE",
                    help="with --tuning: the cache's dtype (e.g. float8_e4m3fn; default the "
                         "queries' float16)")
    ap.add_argument("--partitions", action="store_true",
                    help="time split-K partition counts on the headline shapes, and the merge "
                         "kernel alone, print only")
    ap.add_argument("--once", type=int, nargs=2, metavar=("BATCH", "CONTEXT"),
                    help="build and run one headline-style configuration (for a profiler)")
    ap.add_argument("--guard-cost", action="store_true",
                    help="with paged_numba: also time it without the device guard "
                         "(paged_numba_noguard rows), not for --grid full")
    ap.add_argument("--idle-start", action="store_true",
                    help="start each timed replay on an idle device (the method before "
                         "2026-11-30; counts the host's graph submission)")
    args = ap.parse_args()
    global QUEUED
    QUEUED = not args.idle_start
    if args.tuning:
        variants = [dict(tensor_cores=False, num_warps=4, unroll=4, stages=2)]
        variants += [dict(tensor_cores=True, num_warps=w, stages=st)
                     for w, st in ((4, 2), (2, 2), (2, 4), (1, 4), (1, 8))]
        if args.kv_dtype and args.kv_dtype.startswith("float8"):   # Q K^T in fp8 too
            variants += [dict(tensor_cores=True, num_warps=4, stages=2, qk_fp8=True)]
        variants += [dict(pdl=False), dict(pdl=True)]   # the plan's defaults, merge early or not
        if args.only:
            variants = [v for v in variants if set(v) & set(args.only)]
        rows = [(b, c) for b, c in HEADLINE if not args.cases or f"group4-{b}x{c}" in args.cases]
        for tuning in variants:
            for b, c in rows:
                r = bench_config(b, c, 32, 8, 128, 16, "float16", args.kv_dtype,
                                 tables=("random",), sdpa=False, reps=15, tuning=tuning)[0]
                print(" ".join(f"{k}={v}" for k, v in tuning.items()) + f" b={b} ctx={c} "
                      f"P={r['num_partitions']} {r['us']:.1f} us {r['gbps']:.0f} GB/s "
                      f"regs={r['regs']} host={r['host_us']:.1f} us err={r['max_err']:.2e}",
                      flush=True)
        return
    if args.partitions:
        for b, c in HEADLINE:
            parts = [p for p in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 46, 64, 128) if p * 256 <= c]
            rows = bench_config(b, c, 32, 8, 128, 16, "float16", tables=("random",), sdpa=False,
                                reps=15, partitions=[None] + parts)
            print(f"b={b} ctx={c} heuristic P={rows[0]['num_partitions']} {rows[0]['us']:.1f} us; "
                  + " ".join(f"P={r['num_partitions']}:{r['us']:.1f}" for r in rows[1:])
                  + "; merge alone: " + " ".join(f"P={r['num_partitions']}:{r['merge_us']:.1f}"
                                                 for r in rows[1:] if r["merge_us"] != ""),
                  flush=True)
        return
    if args.once:
        b, c = args.once
        bench_config(b, c, 32, 8, 128, 16, "float16", tables=("random",), sdpa=False, reps=1)
        return
    if args.grid == "full":
        if args.guard_cost:
            raise SystemExit("--guard-cost is for the case grids, not --grid full")
        return full_grid(args)
    todo = cases(args.grid)
    plan_args = {k: v for k, v in (("heads_per_block", args.heads_per_block),
                                   ("group_kernel", args.group_kernel)) if v is not None} or None
    unknown = sorted(set(args.cases or []) - set(todo))
    if unknown:
        raise SystemExit(f"no case {unknown} in grid {args.grid!r}; it has {list(todo)}")
    gpu = torch.cuda.get_device_name()
    run_id = new_run_id()
    command = "python experiments/bench_decode.py " + " ".join(sys.argv[1:])
    bw = copy_gbps()
    print(f"{gpu}: device copy {bw:.0f} GB/s (read + write); run {run_id}")
    fi = import_flashinfer() if "flashinfer" in args.impls else None
    rows = []
    for case, cfg in todo.items():
        if args.cases and case not in args.cases:
            continue
        try:
            got = bench_config(*cfg, reps=args.reps, sdpa="torch_sdpa" in args.impls,
                               numba="paged_numba" in args.impls, fi=fi, tuning=plan_args,
                               guard_cost=args.guard_cost)
        except Exception:  # noqa: BLE001 - keep the other cases' rows
            traceback.print_exc()
            continue
        peer = {r["impl"]: r["us"] for r in got}
        bare = {r["table"]: r["us"] for r in got if r["impl"] == "paged_numba_noguard"}
        for r in got:
            r.update(run_id=run_id, gpu=gpu, case=case, pct_copy_bw=100 * r["gbps"] / bw,
                     copy_gbps=bw, ratio_to_sdpa=ratio(r["us"], peer.get("torch_sdpa_contiguous")),
                     ratio_to_flashinfer=ratio(r["us"], peer.get("flashinfer")), command=command,
                     ratio_to_noguard=(ratio(r["us"], bare.get(r["table"]))
                                       if r["impl"].startswith("paged_numba") else ""))
            r.setdefault("timing", "graph")
            print(f"{r['impl']:>22} {case:>16} {r['table']:>10} P={r['num_partitions']!s:<3} "
                  f"{r['us']:8.1f} us {r['gbps']:7.0f} GB/s {r['pct_copy_bw']:5.1f}% copy  "
                  f"x{fmt(r['ratio_to_sdpa'])} SDPA  x{fmt(r['ratio_to_flashinfer'])} FlashInfer  "
                  f"host {fmt(r['host_us'], 1)} us err {r.get('max_err', '')} "
                  f"{r.get('impl_detail', '')}", flush=True)
        for r in got:
            if r["impl"] == "paged_numba" and r["table"] in bare:
                print(f"guard cost {case} {r['table']}: {guard_cost(r['us'], bare[r['table']])}",
                      flush=True)
        rows += got
        write_rows(args.out, FIELDS, rows, 3)   # after each case: a run cut short keeps them


def fmt(x, digits=3):
    return "-" if x == "" else round(x, digits)


if __name__ == "__main__":
    main()
