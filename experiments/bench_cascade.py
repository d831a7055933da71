"""Cascade (shared-prefix) decode against plain paged decode on the same cache.

    python3 experiments/bench_cascade.py --out results/cascade_h200.csv
    python3 experiments/bench_cascade.py --quick       # tiny case, runs on the simulator

Case (default): 64 sequences share a 4096-token prefix and own 256 tokens
each (4096 + 256 = 4352 tokens of context), fp16, 32 query / 8 KV heads,
head size 128, block size 16, random block tables (the prefix's 256 blocks
and each suffix's 16 drawn from one shuffled pool).

Implementations (``--impls``; one CSV row each):

* ``paged_decode``: :class:`paged_numba.DecodePlan` over each sequence's
  whole context (the shared blocks, then its own): the prefix is read once
  per sequence;
* ``cascade``: :class:`paged_numba.CascadeDecodePlan`: the prefix once for
  all 64 query rows (one prefill launch, non-causal, its keys split in
  ``prefix_parts`` parts), the suffixes by decode, merged by log-sum-exp;
  ``--parts 1 4 16`` adds rows with those splits of the prefix;
* ``flashinfer_cascade`` (when ``flashinfer`` imports): FlashInfer's
  ``MultiLevelCascadeAttentionWrapper`` with two levels on the same pools
  (``plan()`` once, ``run()`` timed); it compiles its kernels on first use.

Method (GPU): each implementation's call is captured in a CUDA graph where
it can be (``timing`` says ``graph``, else ``eager``), warmed up (3 calls),
then ``--reps`` calls are timed with CUDA events, each after a 256 MB write
that evicts the L2 (``bench_common.flushed_time``); the median is reported
(``us``). ``eager_us`` times the plain ``run()`` calls the same way (host
launches included), ``host_us`` the host time of one ``run()``. ``max_err``
is the largest difference from ``paged_decode``'s output.
Bytes counted in ``gbps``: the K/V bytes the implementation must read at
least once (``paged_decode``: every sequence's whole context; the cascades:
the prefix once plus the suffixes) plus the query and the output.

``--quick`` runs 3 sequences over a 20-token prefix with 2/1 heads of size
16 and blocks of 4 on Numba's CUDA simulator (one wall-clock call each,
``timing`` says ``perf_counter``), to check that the script runs; its CSV
defaults to ``results/cascade_quick.csv``.
"""
import argparse
import sys
import time
import traceback

import numpy as np

import paged_numba as pn  # noqa: I001  (first: it picks the simulator where there is no GPU)
from numba import cuda
from bench_common import flashinfer_workspace, flushed_time, import_flashinfer, new_run_id, \
    write_rows

IMPLS = ["paged_decode", "cascade", "flashinfer_cascade"]
CASE = dict(num_seqs=64, shared_len=4096, suffix_len=256, num_heads=32, num_kv_heads=8,
            head_size=128, block_size=16, dtype="float16")
QUICK = dict(num_seqs=3, shared_len=20, suffix_len=5, num_heads=2, num_kv_heads=1,
             head_size=16, block_size=4, dtype="float16")
FIELDS = ["run_id", "gpu", "impl", "num_seqs", "shared_len", "suffix_len", "num_heads",
          "num_kv_heads", "head_size", "block_size", "dtype", "prefix_parts", "us", "gbps",
          "speedup_vs_decode", "eager_us", "host_us", "timing", "impl_detail", "max_err",
          "command"]


def make_case(c, seed=0):
    """Pools, queries and tables of case ``c``: ``(cache, q, shared, tables, whole)``
    with ``shared [shared_blocks]``, ``tables [num_seqs, suffix_blocks]`` (the
    suffixes) and ``whole [num_seqs, shared_blocks + suffix_blocks]`` (both)."""
    bs, n = c["block_size"], c["num_seqs"]
    shared_blocks = -(-c["shared_len"] // bs)
    suffix_blocks = -(-c["suffix_len"] // bs)
    num_blocks = shared_blocks + n * suffix_blocks
    rng = np.random.default_rng(seed)
    order = rng.permutation(num_blocks).astype(np.int32)
    shared = order[:shared_blocks]
    tables = order[shared_blocks:].reshape(n, suffix_blocks)
    if c["shared_len"] % bs:
        raise ValueError("the prefix must fill whole blocks for the paged_decode tables")
    whole = np.concatenate([np.repeat(shared[None], n, axis=0), tables], axis=1)
    shape = (num_blocks, bs, c["num_kv_heads"], c["head_size"])
    k = rng.standard_normal(shape).astype(c["dtype"])
    v = rng.standard_normal(shape).astype(c["dtype"])
    cache = pn.PagedKVCache.from_host(k, v)
    q = rng.standard_normal((n, c["num_heads"], c["head_size"])).astype(c["dtype"])
    return cache, q, shared, tables, whole


def kv_bytes(c, impl):
    """K/V bytes read at least once: every whole context for plain decode,
    the prefix once plus the suffixes for a cascade."""
    per_token = 2 * c["num_kv_heads"] * c["head_size"] * np.dtype(c["dtype"]).itemsize
    n = c["num_seqs"]
    tokens = n * (c["shared_len"] + c["suffix_len"]) if impl == "paged_decode" else \
        c["shared_len"] + n * c["suffix_len"]
    return tokens * per_token + 2 * n * c["num_heads"] * c["head_size"] * \
        np.dtype(c["dtype"]).itemsize


def ours(impl, c, cache, q, shared, tables, whole, parts=None):
    """``(call, detail, prefix_parts)`` for ``paged_decode`` or ``cascade`` (its
    prefix in ``parts`` parts, default the plan's choice) on device arrays."""
    n, h = c["num_seqs"], c["num_heads"]
    dq = cuda.to_device(q)
    if impl == "paged_decode":
        dt = cuda.to_device(whole)
        dl = cuda.to_device(np.full(n, c["shared_len"] + c["suffix_len"], np.int32))
        plan = pn.DecodePlan(cache, n, h, whole.shape[1])
        return (lambda stream=None: plan.run(dq, dt, dl, stream=stream)), repr(plan), ""
    dt = cuda.to_device(tables)
    dl = cuda.to_device(np.full(n, c["suffix_len"], np.int32))
    plan = pn.CascadeDecodePlan(cache, shared, c["shared_len"], n, h, tables.shape[1],
                                prefix_parts=parts)
    return (lambda stream=None: plan.run(dq, dt, dl, stream=stream)), repr(plan), \
        plan.prefix_parts


def flashinfer_call(fi, c, cache, q, shared, tables):
    """FlashInfer's two-level cascade wrapper over the same pools."""
    import torch

    n, bs = c["num_seqs"], c["block_size"]
    dev = dict(dtype=torch.int32, device="cuda")

    def last(length):           # tokens in the last page
        return length - (-(-length // bs) - 1) * bs

    w = fi.MultiLevelCascadeAttentionWrapper(2, flashinfer_workspace(), "NHD")
    w.plan([torch.tensor([0, n], **dev), torch.arange(n + 1, **dev)],
           [torch.tensor([0, shared.size], **dev),
            torch.arange(n + 1, **dev) * tables.shape[1]],
           [torch.as_tensor(shared, **dev), torch.as_tensor(tables.reshape(-1), **dev)],
           [torch.tensor([last(c["shared_len"])], **dev),
            torch.full((n,), last(c["suffix_len"]), **dev)],
           c["num_heads"], c["num_kv_heads"], c["head_size"], bs, causal=False,
           q_data_type=torch.float16, kv_data_type=torch.float16)
    pools = tuple(torch.as_tensor(p, device="cuda") for p in (cache.key_cache, cache.value_cache))
    tq = torch.as_tensor(q, device="cuda")
    return lambda stream=None: w.run(tq, pools)


def graph_of(call):
    """A CUDA graph replaying ``call`` on a side stream, or None if capture fails."""
    import torch

    stream = torch.cuda.Stream()
    try:
        with torch.cuda.stream(stream):
            call(stream)                 # warm-up on the capture stream
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            call(stream)
        torch.cuda.synchronize()
        return graph
    except Exception as e:  # noqa: BLE001 - not capturable: time it eagerly
        print(f"  graph capture failed ({type(e).__name__}: {e}); timing eagerly", flush=True)
        return None


def time_gpu(call, reps):
    """``(us, eager_us, host_us, timing)`` of ``call`` on the GPU."""
    import torch

    eager = flushed_time(call, reps)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        call()
    host = (time.perf_counter() - start) / 20 * 1e6
    torch.cuda.synchronize()
    graph = graph_of(call)
    if graph is None:
        return eager, eager, host, "eager"
    return flushed_time(graph.replay, reps), eager, host, "graph"


def to_numpy(out):
    return out.copy_to_host() if hasattr(out, "copy_to_host") else out.float().cpu().numpy()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impls", nargs="+", default=IMPLS, choices=IMPLS, metavar="IMPL")
    ap.add_argument("--out", default=None,
                    help="CSV (default results/cascade_h200.csv; --quick: "
                         "results/cascade_quick.csv)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help="tiny case, for the simulator")
    ap.add_argument("--parts", nargs="*", type=int, default=[], metavar="P",
                    help="also time the cascade with its prefix in P parts (tensor cores)")
    args = ap.parse_args()
    c = QUICK if args.quick else CASE
    out_path = args.out or f"results/cascade_{'quick' if args.quick else 'h200'}.csv"
    sim = pn.simulator_enabled()
    if sim and not args.quick:
        sys.exit("no GPU: Numba's CUDA simulator would take hours on this case; add --quick")
    gpu = "simulator" if sim else str(cuda.get_current_device().name.decode()
                                      if isinstance(cuda.get_current_device().name, bytes)
                                      else cuda.get_current_device().name)
    run_id = new_run_id()
    command = "python3 experiments/bench_cascade.py " + " ".join(sys.argv[1:])
    print(f"{gpu}: run {run_id}; case {c}", flush=True)
    cache, q, shared, tables, whole = make_case(c)
    rows, ref, base_us = [], None, None
    runs = [(impl, None) for impl in args.impls]
    runs += [("cascade", p) for p in args.parts if "cascade" in args.impls]
    for impl, parts in runs:
        try:
            if impl == "flashinfer_cascade":
                fi = None if sim else import_flashinfer()
                if fi is None:
                    print("flashinfer_cascade: skipped", flush=True)
                    continue
                call = flashinfer_call(fi, c, cache, q, shared, tables)
                detail, parts = "MultiLevelCascadeAttentionWrapper(2 levels)", ""
            else:
                call, detail, parts = ours(impl, c, cache, q, shared, tables, whole, parts)
            if sim:
                start = time.perf_counter()
                out = to_numpy(call())
                us = eager = host = (time.perf_counter() - start) * 1e6
                timing = "perf_counter"
            else:
                out = to_numpy(call())
                us, eager, host, timing = time_gpu(call, args.reps)
        except Exception:  # noqa: BLE001 - report and go on with the next implementation
            print(f"{impl}: FAILED\n{traceback.format_exc()}", flush=True)
            continue
        if ref is None:
            ref = out.astype(np.float64)
        base_us = us if impl == "paged_decode" else base_us
        rows.append(dict(run_id=run_id, gpu=gpu, impl=impl, **c, prefix_parts=parts, us=us,
                         gbps=kv_bytes(c, impl) / us / 1e3, eager_us=eager, host_us=host,
                         timing=timing, impl_detail=detail,
                         max_err=f"{np.abs(out.astype(np.float64) - ref).max():.3g}",
                         command=command))
        print(f"{impl} {detail}: {us:.1f} us ({timing}), eager {eager:.1f} us, host {host:.1f} us, "
              f"max_err {rows[-1]['max_err']}", flush=True)
    for r in rows:
        r["speedup_vs_decode"] = base_us / r["us"] if base_us else ""
    write_rows(out_path, FIELDS, rows)


if __name__ == "__main__":
    main()
