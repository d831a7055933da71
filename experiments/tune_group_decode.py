"""Time MQA and large-group decode on the prefill tiles, print only: for each
case of ``bench_decode.py --grid groups``, torch SDPA (contiguous K/V) and
``DecodePlan(group_kernel=K, num_partitions=P)`` for each tile ``K`` and part
count ``P``, one process, random block tables.

    python experiments/tune_group_decode.py --kernels default tile wgmma --parts 0 1 2 4

``--parts 0`` is the plan's own choice; kernel ``default`` is the plan's
without ``group_kernel`` (the 16-head decode kernel for groups of 16);
``--wgmma-tilings 64x4 128x3`` times the ``"wgmma"`` tile with those keys a
tile and ring stages (``_group_decode.WGMMA_TILING``), and ``--fused-merge``
adds it with the split-K merge inside the kernel
(``_group_decode.WGMMA_FUSED_MERGE``); ``--wgmma-options mbarriers`` (or
``alternate_tiles``, ``lean_loop``) times the ``"wgmma"`` tile also with those
options of its producer kernel (``_group_decode.WGMMA_OPTIONS``, rows marked
with them); ``--pdl`` times each split
configuration again with the merge launched early (``DecodePlan(pdl=True)``,
rows marked ``pdl``).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from bench_decode import GROUPS, bench_config, copy_gbps  # noqa: E402

from paged_numba import _group_decode  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="+", default=list(GROUPS), choices=list(GROUPS))
    ap.add_argument("--kernels", nargs="+", default=["default", "tile", "wgmma"],
                    choices=["default", "tile", "wgmma"])
    ap.add_argument("--parts", nargs="+", type=int, default=[0, 1, 2, 4])
    ap.add_argument("--wgmma-tilings", nargs="+", default=["64x4"], metavar="NxS")
    ap.add_argument("--fused-merge", action="store_true")
    ap.add_argument("--wgmma-options", nargs="+", default=[], metavar="OPTION",
                    help="also time the wgmma tile with these producer-kernel options on "
                         "(e.g. mbarriers)")
    ap.add_argument("--pdl", action="store_true",
                    help="also time each configuration with DecodePlan(pdl=True)")
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    import torch
    print(f"{torch.cuda.get_device_name()}: device copy {copy_gbps():.0f} GB/s (read + write)")
    parts = [None if p == 0 else p for p in args.parts]
    default_tiling = "x".join(map(str, _group_decode.WGMMA_TILING))
    for case in args.cases:
        batch, context, heads, kv_heads = GROUPS[case]
        cfg = (batch, context, heads, kv_heads, args.head_size, 16, args.dtype)
        sdpa = bench_config(*cfg, tables=("random",), numba=False, reps=args.reps)[0]
        print(f"{case} hs={args.head_size} {args.dtype}: torch_sdpa {sdpa['us']:.1f} us "
              f"{sdpa['gbps']:.0f} GB/s", flush=True)
        runs = [(k, None) for k in args.kernels if k != "wgmma"]
        runs += [("wgmma", t) for t in args.wgmma_tilings if "wgmma" in args.kernels]
        runs += [("wgmma", t + "+" + "+".join(args.wgmma_options))
                 for t in args.wgmma_tilings if "wgmma" in args.kernels and args.wgmma_options]
        runs += [("wgmma", t + "+merge") for t in args.wgmma_tilings
                 if "wgmma" in args.kernels and args.fused_merge]
        runs = [(k, t, pdl) for k, t in runs      # each with and without pdl, one after the other
                for pdl in ((False, True) if args.pdl and not (t or "").endswith("+merge")
                            else (False,))]
        for kernel, tiling, pdl in runs:
            size, *extra = (tiling or default_tiling).split("+")    # the knobs of this run
            _group_decode.WGMMA_FUSED_MERGE = "merge" in extra
            _group_decode.WGMMA_OPTIONS = {o: True for o in extra if o != "merge"}
            _group_decode.WGMMA_TILING = tuple(int(x) for x in size.split("x"))
            tuning = {} if kernel == "default" else {"group_kernel": kernel}
            if pdl:
                tuning["pdl"] = True
            rows = bench_config(*cfg, tables=("random",), sdpa=False, reps=args.reps,
                                partitions=parts, tuning=tuning or None)
            for r in rows:
                name = (r['impl_detail'] + (' ' + tiling if tiling else '')
                        + (' pdl' if pdl else ''))
                print(f"  {name:>50} "
                      f"P={r['num_partitions']:<3} {r['us']:7.1f} us "
                      f"{r['gbps']:5.0f} GB/s {r['us'] / sdpa['us']:.3f}x SDPA "
                      f"merge {r['merge_us'] if r['merge_us'] == '' else round(r['merge_us'], 1)}"
                      f" err {r['max_err']:.1e}", flush=True)


if __name__ == "__main__":
    main()
