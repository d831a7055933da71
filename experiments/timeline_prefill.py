"""Where a persistent prefill block's time goes, item by item: the tensor-core
prefill kernel built with ``timeline=True`` (:mod:`paged_numba.kernels.timeline`)
stamps each work item's phases with the GPU's nanosecond clock; this prints
the mean of each phase over the items, and the kernel's time with and
without the stamps (the cost of observing it).

    python3 experiments/timeline_prefill.py --case full-128x128 causal-8x2048
    python3 experiments/timeline_prefill.py --case causal-8x2048 --prefetch-queries

Phases of a consumer warpgroup's item (``kernels.timeline.POINTS``): ``range``
(its sequence and rows), ``copy`` (its query copies issued), ``wait`` (until
they landed), ``fence`` (the cross-proxy fence after them), ``keys`` (its
products and softmax over the item's key tiles), ``bounds`` (the next item's
bounds read ahead, where asked), ``store`` (the output stores issued), ``gap``
(from the end of its stores to its next item's start); ``query`` sums the
four phases before ``keys``. The producer's: ``setup`` (its copy strides),
``range`` (the item's sequence and key range), ``first`` (the first tile's
table lookups and copies issued: it waits there for a free ring stage),
``rest`` (the other tiles'), ``gap``. ``keys/tile`` divides ``keys`` by the
item's key tiles.
Cases and inputs as in ``tune_prefill.py`` (default tiling and options, or
``--variant`` one of its variants;
``--prefetch-queries``, ``--deferred-stores``, ``--prefetch-ranges`` and
``--fma-exp2 K``, ``--lazy-rescale`` and ``--lane-vote`` add those kernel options, timed
and stamped).

``--loop-clocks`` builds the stamped kernel with ``timeline="loop"``: each
consumer warpgroup also sums its multiprocessor's cycles in each step of its
steady-state key loop (``kernels.timeline.LOOP_PHASES``: waiting for the
tile's stage, for its turn, issuing the products, waiting for the scores,
the softmax, waiting for ``P V``, packing P), printed as cycles a tile.
"""
import argparse
import statistics

import numpy as np
import torch
from numba import cuda

import paged_numba as pn
from paged_numba.kernels import prefill_tc
from paged_numba.kernels.timeline import (LOOP_PHASES, POINTS, read_loop_clocks, read_timeline,
                                          timeline_words)
from tune_prefill import CASES, make, timed, variant_plan

# the kernel options a flag of the same name turns on
FLAGS = ("prefetch_queries", "prefetch_ranges", "deferred_stores", "lazy_rescale", "lane_vote",
         "early_weights", "staged_p")


def item_tiles(plan, cu, lens):
    """Key tiles of each work item, in the kernel's item order (tile-major,
    head blocks inner), from the plan's tile list (as ``tile_range`` counts)."""
    seq = plan._tiles[0].copy_to_host()
    q0 = plan._tiles[1].copy_to_host()
    tiles = []
    for s, q in zip(seq, q0):
        q_len, kv_len = cu[s + 1] - cu[s], lens[s]
        nq = min(plan.block_q, q_len - q)
        kv_hi = min(kv_len - q_len + q + nq, kv_len) if plan.causal else kv_len
        tiles.append(-(-kv_hi // plan.block_n))
    return np.repeat(np.array(tiles), plan.num_heads // plan.heads_per_block)


def summarise(stamps, plan, items_tiles):
    blocks = stamps.shape[0]
    grid = plan._grid[0]
    out = {}
    for role, points in enumerate(POINTS):
        order = [k for k, _ in points]
        names = [n for _, n in points[1:]]
        rows = {n: [] for n in ("query", *names, "gap") if role > 0 or n != "query"}
        per_tile = []
        for b in range(blocks):
            t = stamps[b, :, role, :]
            real = np.flatnonzero(t[:, 0])
            for i, rnd in enumerate(real):
                a = t[rnd]
                if not a[order].all():
                    continue
                for k0, k1, n in zip(order, order[1:], names):
                    rows[n].append((a[k1] - a[k0]) / 1e3)
                if role > 0:
                    rows["query"].append((a[1] - a[0]) / 1e3)
                if i + 1 < len(real):
                    rows["gap"].append((t[real[i + 1], 0] - a[3]) / 1e3)
                if role > 0:
                    bb = b if rnd % 2 == 0 else grid - 1 - b
                    w = rnd * grid + bb
                    if w < len(items_tiles) and items_tiles[w] > 0:
                        per_tile.append((a[2] - a[1]) / 1e3 / items_tiles[w])
        out[role] = {n: (statistics.mean(v) if v else float("nan")) for n, v in rows.items()}
        if per_tile:
            out[role]["keys/tile"] = statistics.mean(per_tile)
    first = stamps[..., 0][stamps[..., 0] > 0].min()
    last = stamps[..., 3].max()
    return out, (last - first) / 1e3


def run_case(case, args):
    batch, q_len, kv_len = CASES[case]
    lens = [kv_len] * batch
    H, Hk = args.heads
    cache, _, _, table, q = make(q_len, lens, H, Hk, args.head_size, args.block_size, args.dtype)
    cu = (np.arange(batch + 1) * q_len).astype(np.int32)
    causal = not case.startswith("full-")
    plan = variant_plan(args.variant, cache, cu, np.asarray(lens, np.int32), H, causal)
    extra = {name: True for name in FLAGS if getattr(args, name)}
    if args.fma_exp2:
        extra["fma_exp2"] = args.fma_exp2
    if extra:
        plan = pn.PrefillPlan(cache, cu, np.asarray(lens, np.int32), H, causal=causal,
                              tensor_cores=True, num_warps=plan.num_warps, block_n=plan.block_n,
                              heads_per_block=plan.heads_per_block,
                              kernel_options=dict(plan.kernel_options, **extra),
                              tile_group_bytes=plan.tile_group_bytes)
    opts = plan.kernel_options
    if not opts.get("persistent"):
        raise SystemExit(f"the plan of {args.variant} on {case} is not persistent: {opts}")
    store = torch.uint16 if args.dtype == "bfloat16" else q.dtype
    dq, dt = cuda.as_cuda_array(q.view(store)), cuda.as_cuda_array(table)
    flush = torch.empty(2**28 // 4, dtype=torch.float32, device="cuda")
    plain_us = timed(lambda: plan.run(dq, dt), args.reps, flush)
    blocks = plan._grid[0]
    plan._kernel = prefill_tc.prefill_tc_kernel(
        cache.head_size, cache.block_size, plan.heads_per_block, plan.block_n,
        cache.dtype.name, cache.layout, plan.num_warps, **opts,
        timeline="loop" if args.loop_clocks else True)
    cache._errors = cuda.to_device(np.zeros(timeline_words(blocks), np.int64))
    plan._inputs = None                 # repack with the new kernel and error array
    stamped_us = timed(lambda: plan.run(dq, dt), args.reps, flush)
    cache._errors.copy_to_device(np.zeros(timeline_words(blocks), np.int64))
    flush.zero_()
    plan.run(dq, dt)
    torch.cuda.synchronize()
    errors = cache._errors.copy_to_host()
    stamps = read_timeline(errors, blocks)
    tiles = item_tiles(plan, cu, lens)
    phases, span = summarise(stamps, plan, tiles)
    items = len(tiles)
    print(f"{case}: {items} items on {blocks} blocks ({items / blocks:.1f} a block); kernel "
          f"{plain_us:.1f} us, with stamps {stamped_us:.1f} us; stamped span {span:.1f} us; "
          f"{tiles.mean():.1f} key tiles an item")
    for role, ph in phases.items():
        who = "producer" if role == 0 else f"consumer {role - 1}"
        print(f"  {who:>10}: " + "  ".join(f"{n} {v:.2f}" for n, v in ph.items()) + "  (us)")
    if args.loop_clocks:
        clocks = read_loop_clocks(errors, blocks)         # [blocks, rounds, 2, phases + 1]
        for wg in range(2):
            c = clocks[:, :, wg].reshape(-1, len(LOOP_PHASES) + 1).astype(np.float64)
            n = c[:, -1].sum()
            per = c[:, :-1].sum(axis=0) / max(n, 1)
            print(f"  consumer {wg} loop, cycles a tile over {int(n)} tiles: "
                  + "  ".join(f"{name} {v:.0f}" for name, v in zip(LOOP_PHASES, per))
                  + f"  (sum {per.sum():.0f})")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", nargs="+", default=["full-128x128"], choices=sorted(CASES))
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--heads", type=int, nargs=2, default=(32, 8))
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--reps", type=int, default=20)
    for name in FLAGS:                  # each adds kernel_options[name] = True
        ap.add_argument("--" + name.replace("_", "-"), action="store_true",
                        help=f"kernel_options['{name}'] = True on the plan"
                             + (" (with --prefetch-queries)" if name == "deferred_stores" else ""))
    ap.add_argument("--fma-exp2", type=int, default=0, metavar="K",
                    help="the default with kernel_options['fma_exp2'] = K: every K-th "
                         "n-tile's exponentials on the FMA pipe (4: a quarter)")
    ap.add_argument("--variant", default="default",
                    help="tune_prefill.py's variant name (default: the plan's default), "
                         "e.g. w8n96-fx-wg-ws-sw-pp-ps-ll-lz-lv or default-g0")
    ap.add_argument("--loop-clocks", action="store_true",
                    help="also sum each consumer's cycles in each step of its key loop")
    args = ap.parse_args()
    for case in args.case:
        run_case(case, args)


if __name__ == "__main__":
    main()
