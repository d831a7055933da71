"""Warps per block and copy-ring depth against split-K partitions for the
decode kernel, on the shapes where one is traded for the other (few
(sequence, KV head) pairs).

    python experiments/tune_warps.py [--reps 20]

Times fp16, 32/8 heads, block size 16, random tables, each ``(num_warps,
num_partitions, stages)`` given explicitly (more than 4 warps or 2 stages at
head size 128 put the copy ring in dynamic shared memory), the default
choice (``attention.launch_shape``) and SDPA on the same shapes, all with
``bench_decode.bench_config``'s method; prints one line per timing.
``nocap`` compiles without the register cap that buys a second resident block,
``cap128`` with a cap of 128 registers whatever it buys.
"""
import argparse
import sys

sys.path.insert(0, "experiments")
import bench_decode  # noqa: E402
from bench_decode import bench_config, copy_gbps  # noqa: E402

from paged_numba.kernels import tuning  # noqa: E402

# (batch, context, head size): [(num_warps, num_partitions, stages[, "nocap" | "cap128"]), ...]
CASES = {
    (64, 4096, 128): [(4, 1, 2), (2, 1, 2, "cap128"), (2, 1, 3, "cap128"), (2, 1, 4, "cap128")],
    (256, 2048, 128): [(4, 1, 2), (2, 1, 2, "cap128"), (2, 1, 3, "cap128"), (2, 1, 4, "cap128")],
    (128, 8192, 128): [(4, 1, 2), (2, 1, 2, "cap128"), (2, 1, 3, "cap128")],
    (16, 4096, 128): [(4, 2, 2), (2, 4, 2, "cap128"), (2, 2, 3, "cap128"), (2, 4, 3, "cap128")],
    (1, 32768, 128): [(4, 32, 2), (2, 32, 3, "cap128")],
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--idle-start", action="store_true", help="as bench_decode.py's")
    args = ap.parse_args()
    bench_decode.QUEUED = not args.idle_start
    print(f"copy {copy_gbps():.0f} GB/s; queued start: {bench_decode.QUEUED}", flush=True)
    for (b, c, hs), combos in CASES.items():
        rows = bench_config(b, c, 32, 8, hs, 16, "float16", tables=("random",), reps=args.reps)
        auto, sdpa = rows[0], rows[-1]
        print(f"b={b:<3} ctx={c:<6} hs={hs:<4} SDPA {sdpa['us']:7.1f} us | default P="
              f"{auto['num_partitions']} {auto['us']:7.1f} us regs {auto['regs']}", flush=True)
        for combo in combos:
            w, p, stages = combo[:3]
            saved = tuning.register_cap
            if "nocap" in combo:
                tuning.register_cap = lambda *a: None
            if "cap128" in combo:
                tuning.register_cap = lambda *a: 128
            try:
                r = bench_config(b, c, 32, 8, hs, 16, "float16", tables=("random",), sdpa=False,
                                 partitions=(p,), reps=args.reps,
                                 tuning=dict(num_warps=w, stages=stages))[0]
            finally:
                tuning.register_cap = saved
            merge = "-" if r["merge_us"] == "" else f"{r['merge_us']:.1f} us"
            print(f"    warps {w:<2} P={p:<3} stages {stages} {' '.join(combo[3:]):6} "
                  f"{r['us']:7.1f} us (x{r['us'] / sdpa['us']:.3f} SDPA) merge {merge} "
                  f"regs {r['regs']} err {r['max_err']:.1e}", flush=True)


if __name__ == "__main__":
    main()
