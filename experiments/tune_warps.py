"""Warps per block against split-K partitions for the decode kernel, on the
shapes where one is traded for the other (few (sequence, KV head) pairs).

    python experiments/tune_warps.py [--reps 20]

Times fp16, 32/8 heads, block size 16, random tables, each ``(num_warps,
num_partitions)`` given explicitly (more than 4 warps at head size 128 put
the copy ring in dynamic shared memory), the default choice
(``attention.launch_shape``) and SDPA on the same shapes, all with
``bench_decode.bench_config``'s method; prints one line per timing.
``nocap`` compiles without the register cap that buys a second resident block.
"""
import argparse
import sys

sys.path.insert(0, "experiments")
import bench_decode  # noqa: E402
from bench_decode import bench_config, copy_gbps  # noqa: E402

import paged_numba as pn  # noqa: E402

# (batch, context, head size): [(num_warps, num_partitions), ...]
CASES = {
    (16, 4096, 128): [(4, 1), (4, 2), (8, 2), (16, 1), (8, 1, "nocap")],
    (8, 8192, 128): [(4, 4), (8, 2), (16, 1)],
    (1, 32768, 128): [(8, 16), (16, 8)],
    (16, 4096, 64): [(4, 2), (16, 1)],
    (16, 4096, 256): [(2, 2), (4, 1)],
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
            w, p = combo[:2]
            saved = pn._launch.register_cap
            if "nocap" in combo:
                pn._launch.register_cap = lambda *a: None
            try:
                r = bench_config(b, c, 32, 8, hs, 16, "float16", tables=("random",), sdpa=False,
                                 partitions=(p,), reps=args.reps, tuning=dict(num_warps=w))[0]
            finally:
                pn._launch.register_cap = saved
            print(f"    warps {w:<2} P={p:<3} {' '.join(combo[2:]):6} {r['us']:7.1f} us "
                  f"(x{r['us'] / sdpa['us']:.3f} SDPA) merge {r['merge_us'] or '-'} "
                  f"regs {r['regs']} err {r['max_err']:.1e}", flush=True)


if __name__ == "__main__":
    main()
