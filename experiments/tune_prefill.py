"""Tune the tensor-core prefill kernel: time tilings and kernel options on one
problem, check each against an fp32 SDPA of the same tokens, print a table.

    python3 experiments/tune_prefill.py --case causal-8x2048 \
        --variants w8n64 w4n64 w8n32 w8n64-qsmem w8n128 cuda-cores

A variant is ``w<warps>n<block_n>`` plus options of the tensor-core kernel:
``-qsmem`` / ``-qregs`` (query fragments re-read from shared memory each tile,
or kept in registers), ``-r<N>`` (at most N registers a thread), ``-fx``
(``fast_exp2``), ``-fma`` (``fma_softmax``), ``-tok`` (``token_copies``),
``-mt2`` (``m_tiles=2``: 32 rows a warp), ``-wg`` (``wgmma``: warpgroup
products, sm_90a, warps a multiple of 4), ``-ws`` (with ``-wg``: a
producer warpgroup does the copies, ``w<N>`` counts the other warps), ``-sw``
(with ``-wg``: the swizzled tile layout), ``-s<N>`` (with ``-ws``: N ring
stages), ``-pp`` (with ``-ws``, 8 warps: the consumer warpgroups take turns), ``-h<N>`` (N query heads a tile,
up to 16 a warp: all 32 heads of an MQA group in a 2-warp tile, say, for
decode), ``-p<N>`` (split-K in N parts), ``-ps`` (with ``-pp``: persistent blocks, one a
multiprocessor), ``-lz`` (with ``-wg``: ``lazy_rescale``), ``-pq`` (with ``-ps``:
``prefetch_queries``), ``-ds`` (with ``-pq``: the stores during the next item,
``deferred_stores``), ``-pr`` (with ``-ps``: ``prefetch_ranges``), ``-pg<N>`` (with ``-ws``,
8 warps: N registers a producer thread, the rest to the consumers), ``-sh`` (with ``-ws -sw``:
the K/V tiles in the layout of tensor-map copies, ``split_halves``), ``-mb`` (with ``-pp``:
the copies arrive at mbarriers as they land, ``mbarriers``), ``-tm`` (with ``-sh -mb``: whole tiles
through the copy engine, ``tensor_maps``), ``-ll`` (with ``-ws``: the consumers' lean key loop,
``lean_loop``), ``-sr`` (with ``-ll``: separate K and V rings, ``split_rings``), ``-fe``
(with ``-fx -ws``: a quarter of the exponentials on the FMA pipe, ``fma_exp2``; ``-fe<K>``
those of every K-th n-tile), ``-lv`` (with ``-ws``: the warp's vote on its lanes'
own row maxima, ``lane_vote``), ``-ew`` (with ``-lv``: the weights against the kept
maxima before the vote, ``early_weights``), ``-sp`` (with ``-ws``: P packed by the softmax into
staging registers, ``staged_p``), ``-ng``
(the kernel built without the device guard, to time
what the guard costs: only for valid tables), ``-g<N>`` (last: the plan's
tiles in groups of sequences whose K/V fits N MiB, ``tile_group_bytes``; ``-g0``
longest first over the whole batch); ``default`` (the plan's default
tiling and options, ``default-ng`` without the guard, ``default-g0`` in the
ungrouped order) or ``cuda-cores`` (the fp32 CUDA-core kernel, default tiling).

Cases: causal prompts (fp16, 32 query / 8 KV heads, head size 128, block size
16, random block tables, as in ``bench_prefill.py``), the same not causal
(``full-8x2048``: every work item as long as the next), and ``decode-64x4096``
(one query a sequence, e.g. ``--heads 32 1`` for MQA), with ``--head-size``,
``--dtype``, ``--block-size``, ``--heads``.

    python3 experiments/tune_prefill.py --case decode-64x4096 --heads 32 1 \
        --variants w1n64 w2n64-h32 w2n128-h32

Timing: CUDA events around each launch, a 256 MB write between launches to
flush L2, the median of ``--reps``; SDPA (contiguous K/V, ``is_causal``) is
timed in the same process the same way. ``--rounds N`` times every variant N
times in turn, the order reversed every other round, and reports the median
of the rounds (for differences of a few percent, such as the guard's:
``--variants default default-ng``).
``--jobs N`` compiles the variants in N processes first (each kernel lands
in the disk cache), so that a run of several variants waits for one
compile, not one after another.
"""
import argparse
import functools
import re
import statistics

import numpy as np
import torch
import torch.nn.functional as F
from numba import cuda

import paged_numba as pn
from bench_common import alternation, gpu_state, prefill_without_guard
from paged_numba import _launch
from variants import parse_variant

# case: (number of sequences, query tokens each, keys each); a decode case's one
# query sees every key (bottom-right causal); "full-" cases are not causal (every
# query sees every key: work items of one length, no diagonal tiles)
CASES = {"causal-8x2048": (8, 2048, 2048), "causal-2x8192": (2, 8192, 8192),
         "causal-1x16384": (1, 16384, 16384), "causal-4x512": (4, 512, 512),
         "full-128x128": (128, 128, 128), "full-32x512": (32, 512, 512),
         "full-8x2048": (8, 2048, 2048), "full-2x8192": (2, 8192, 8192),
         "decode-64x4096": (64, 1, 4096), "decode-16x4096": (16, 1, 4096),
         "decode-1x32768": (1, 1, 32768)}


def timed(call, reps, flush):
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        call()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def make(q_len, lens, num_heads, num_kv_heads, head_size, block_size, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    used = [-(-n // block_size) for n in lens]
    cache = pn.PagedKVCache(sum(used), block_size, num_kv_heads, head_size, dtype, "nhd")
    tdtype = getattr(torch, dtype)
    # bf16 pools hold bit patterns (uint16): view them as bf16 to fill them
    k_pool = torch.as_tensor(cache.key_cache, device="cuda").view(tdtype)
    v_pool = torch.as_tensor(cache.value_cache, device="cuda").view(tdtype)
    k_pool.normal_(generator=gen)
    v_pool.normal_(generator=gen)
    perm = torch.randperm(sum(used), device="cuda", generator=gen).to(torch.int32)
    table = torch.full((len(lens), max(used)), -1, dtype=torch.int32, device="cuda")
    pos = 0
    for i, u in enumerate(used):
        table[i, :u] = perm[pos:pos + u]
        pos += u
    q = torch.randn(q_len * len(lens), num_heads, head_size, dtype=tdtype, device="cuda",
                    generator=gen)
    return cache, k_pool, v_pool, table, q


def sdpa_inputs(q_len, lens, k_pool, v_pool, table, q, block_size):
    """Contiguous ``[batch, heads, seq, D]`` tensors (every sequence the same length)."""
    n = lens[0]
    used = -(-n // block_size)
    ks, vs = [], []
    for i in range(len(lens)):
        blocks = table[i, :used].long()
        ks.append(k_pool[blocks].reshape(-1, *k_pool.shape[2:])[:n].transpose(0, 1))
        vs.append(v_pool[blocks].reshape(-1, *v_pool.shape[2:])[:n].transpose(0, 1))
    qq = q.reshape(len(lens), q_len, *q.shape[1:]).transpose(1, 2).contiguous()
    return qq, torch.stack(ks).contiguous(), torch.stack(vs).contiguous()


def variant_plan(name, cache, cu, lens, num_heads, causal=True, group=None):
    """The plan of variant ``name``; ``-ng`` swaps in its kernel built without
    the device guard; ``-g<N>`` sets the tiles' groups to N MiB of K/V."""
    m = re.fullmatch(r"(.+)-g(\d+)", name)
    if m:
        return variant_plan(m.group(1), cache, cu, lens, num_heads, causal,
                            int(m.group(2)) << 20)
    if name.endswith("-ng"):
        plan = variant_plan(name[:-3], cache, cu, lens, num_heads, causal, group)
        why = prefill_without_guard(plan)
        if why:
            raise SystemExit(f"-ng does not apply to {name!r}: {why}")
        return plan
    if name == "cuda-cores":
        return pn.PrefillPlan(cache, cu, lens, num_heads, causal=causal, tensor_cores=False,
                              tile_group_bytes=group)
    if name == "default":
        return pn.PrefillPlan(cache, cu, lens, num_heads, causal=causal, tile_group_bytes=group)
    nw, bn, options, hpb, parts = parse_variant(name)
    return pn.PrefillPlan(cache, cu, lens, num_heads, causal=causal, tensor_cores=True,
                          num_warps=nw,
                          block_n=bn, heads_per_block=hpb, kernel_options=options,
                          num_parts=parts, tile_group_bytes=group)


def run_case(case, args):
    """Time SDPA and every variant on ``case``: ``args.rounds`` rounds, each
    variant once a round in turn, the order reversed every other round (so
    that a drift of the clocks spreads over all of them alike), the median of
    the rounds' medians, and the SM clock each round's loop ended at."""
    batch, q_len, kv_len = CASES[case]
    lens = [kv_len] * batch
    H, Hk = args.heads
    cache, k_pool, v_pool, table, q = make(q_len, lens, H, Hk, args.head_size, args.block_size,
                                           args.dtype)
    cu = (np.arange(batch + 1) * q_len).astype(np.int32)
    seq_lens = np.asarray(lens, np.int32)
    causal = q_len > 1 and not case.startswith("full-")   # (one query sees every key)
    pairs = batch * (q_len * (kv_len - q_len) + q_len * (q_len + 1) // 2 if causal
                     else q_len * kv_len)
    flops = 4 * args.head_size * H * pairs
    flush = torch.empty(2**28 // 4, dtype=torch.float32, device="cuda")
    qq, kk, vv = sdpa_inputs(q_len, lens, k_pool, v_pool, table, q, args.block_size)
    ref = F.scaled_dot_product_attention(qq.float(), kk.float(), vv.float(), is_causal=causal,
                                         enable_gqa=True)
    ref = ref.transpose(1, 2).reshape(q.shape)
    print(f"{torch.cuda.get_device_name()} {case} hs={args.head_size} {args.dtype} "
          f"bs={args.block_size} heads={H}/{Hk}: {flops / 1e9:.1f} GFLOP, "
          f"{args.rounds} round(s) of {args.reps}", flush=True)
    store = torch.uint16 if args.dtype == "bfloat16" else q.dtype
    dq, dt = cuda.as_cuda_array(q.view(store)), cuda.as_cuda_array(table)
    calls = {"torch_sdpa": lambda: F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal,
                                                                  enable_gqa=True)}
    notes = {"torch_sdpa": ""}
    for name in args.variants:
        try:
            plan = variant_plan(name, cache, cu, seq_lens, H, causal or q_len == 1)
            out = torch.as_tensor(plan.run(dq, dt, validate=True), device="cuda").view(q.dtype)
            torch.cuda.synchronize()
            rel = float((out.float() - ref).norm() / ref.norm())
            worst = float((out.float() - ref).abs().max())
            kern = next(iter(plan._kernel.overloads.values()))
            spill = getattr(kern, "local_mem_per_thread", "")
            calls[name] = functools.partial(plan.run, dq, dt)
            notes[name] = (f" rel {rel:.2e} max {worst:.2e}  regs {kern.regs_per_thread} "
                           f"local {spill} smem {_launch.dynamic_shared(plan._kernel)}")
        except Exception as exc:  # noqa: BLE001 - try the next variant
            print(f"{name:>24} failed: {exc!r}", flush=True)
    times = {name: [] for name in calls}
    mhz = {name: [] for name in calls}     # the SM clock each loop ended at
    names = list(calls)
    for order in alternation(len(names), args.rounds):     # forwards, backwards, ...
        for name in (names[i] for i in order):
            times[name].append(timed(calls[name], args.reps, flush))
            mhz[name].append(gpu_state()["sm_mhz"])
    for name, ts in times.items():
        us = statistics.median(ts)
        spread = f" (rounds {min(ts):.1f}-{max(ts):.1f})" if len(ts) > 1 else ""
        clocks = "/".join(str(m) for m in mhz[name])
        print(f"{name:>24} {us:10.1f} us {flops / us / 1e6:7.1f} TFLOP/s{spread}{notes[name]}"
              f"  sm {clocks} MHz", flush=True)


def precompile(args):
    """Run this script on each variant alone (first case, one repetition) in
    ``args.jobs`` processes at once, so that the timing run finds every kernel
    in the disk cache (``paged_numba.kernels.disk_cache``)."""
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    def one(variant):
        cmd = [sys.executable, __file__, "--case", args.case[0], "--variants", variant,
               "--head-size", str(args.head_size), "--heads", *map(str, args.heads),
               "--block-size", str(args.block_size), "--dtype", args.dtype, "--reps", "1"]
        return variant, subprocess.run(cmd, capture_output=True, text=True).returncode

    with ThreadPoolExecutor(args.jobs) as pool:
        for variant, rc in pool.map(one, args.variants):
            print(f"precompiled {variant}" + ("" if rc == 0 else f" (exit {rc})"), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", nargs="+", default=["causal-8x2048"], choices=sorted(CASES),
                    help="one or more (the kernels compile once)")
    ap.add_argument("--variants", nargs="+", default=["w8n64", "w4n64"])
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--heads", type=int, nargs=2, default=(32, 8))
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=1,
                    help="compile the variants in this many processes first (each times its "
                         "variant once on the first case, into the kernel cache on disk), "
                         "then time them all here: Numba compiles one kernel at a time a "
                         "process")
    args = ap.parse_args()
    if args.jobs > 1:
        precompile(args)
    for case in args.case:
        run_case(case, args)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
