"""Variants of the tensor-core decode kernel (``kernels/decode_tc.py``): check
that each gives the default's outputs, then time them on the headline shapes.

    python experiments/tune_tc.py --check            # check only (small shapes on the simulator)
    python experiments/tune_tc.py                    # GPU: check, then time (prints only)

A variant is a set of extra keyword arguments of ``decode_tc_kernel`` (and
optionally a cache layout), patched in for the plans it builds.
"""
import argparse
import contextlib
import sys

import numpy as np

import paged_numba as pn
from paged_numba.kernels import decode_tc

VARIANTS = {
    "default": {},                                   # what the launcher picks
    "v7.1": dict(pv_mma=False, key_rows=False),      # P @ V in FMAs, keys by lane (decode v7.1)
    "v5": dict(prefetch=False, unroll_pv=False, max_registers=None, pv_mma=False,
               key_rows=False),
    "no-register-cap": dict(max_registers=None),
    "no-prefetch": dict(prefetch=False),
    "default-hnd": dict(layout="hnd"),
    "default-vllm": dict(layout="vllm"),
    "pv-mma": dict(pv_mma=True, key_rows=False),     # P @ V on tensor cores
    "key-rows": dict(key_rows=True, pv_mma=False),   # keys copied in rows, read by ldmatrix
    "key-rows+pv-mma": dict(key_rows=True, pv_mma=True),
    "key-rows-regs128": dict(key_rows=True, pv_mma=False, max_registers=128),
}
# variants whose rounding differs from the default's: compared, not required equal
OTHER_ROUNDING = {"v7.1", "v5", "pv-mma", "key-rows", "key-rows+pv-mma", "key-rows-regs128"}

_factory = decode_tc.decode_tc_kernel


@contextlib.contextmanager
def patched(extra):
    kw = {k: v for k, v in extra.items() if k != "layout"}
    decode_tc.decode_tc_kernel = lambda *a, **k: _factory(*a, **{**k, **kw})
    try:
        yield
    finally:
        decode_tc.decode_tc_kernel = _factory


def check(head_size, num_kv_heads, group, block_size, lens, parts=(None, 3), seed=0):
    """Every variant's output against the default's on one random problem."""
    rng = np.random.default_rng(seed)
    mb = -(-max(lens) // block_size)
    num_blocks = len(lens) * mb + 3
    table = rng.permutation(num_blocks)[:len(lens) * mb].reshape(len(lens), mb).astype(np.int32)
    q = rng.standard_normal((len(lens), num_kv_heads * group, head_size)).astype(np.float16)
    k = rng.standard_normal((num_blocks * block_size, num_kv_heads, head_size)).astype(np.float16)
    v = rng.standard_normal(k.shape).astype(np.float16)
    lens = np.asarray(lens, np.int32)
    outs = {}
    for name, extra in VARIANTS.items():
        cache = pn.PagedKVCache(num_blocks, block_size, num_kv_heads, head_size, "float16",
                                extra.get("layout", "nhd"))
        slots = np.arange(num_blocks * block_size, dtype=np.int64)
        pn.write_kv(cache, k, v, slots)
        with patched(extra):
            outs[name] = [np.asarray(pn.paged_decode(q, cache, table, lens, num_partitions=p))
                          for p in parts]
    ok = True
    for name, extra in VARIANTS.items():
        for p, a, b in zip(parts, outs["default"], outs[name]):
            diff = float(np.abs(a.astype(np.float32) - b.astype(np.float32)).max())
            exact = name not in OTHER_ROUNDING
            good = diff == 0 or not exact    # the other knobs leave the arithmetic as it is
            ok &= good
            print(f"{name:28} P={p}: max |diff| to the default = {diff:.2e} "
                  f"({'bit-identical required' if exact else 'other rounding'}) "
                  f"{'ok' if good else 'FAIL'}", flush=True)
    return ok


def time_variants(reps, shapes, rounds=1):
    """Each shape, then each variant on it (``rounds`` times), so that drifts of
    the machine fall on every variant alike."""
    import torch
    sys.path.insert(0, "experiments")
    from bench_decode import HEADLINE, bench_config, copy_gbps
    print(f"{torch.cuda.get_device_name()}: copy {copy_gbps():.0f} GB/s", flush=True)
    for b, c in shapes or HEADLINE:
        for _ in range(rounds):
            for name, extra in VARIANTS.items():
                with patched(extra):
                    r = bench_config(b, c, 32, 8, 128, 16, "float16", extra.get("layout", "nhd"),
                                     tables=("random",), sdpa=False, reps=reps)[0]
                print(f"{name:28} b={b:<4} ctx={c:<6} P={r['num_partitions']:<3} "
                      f"{r['us']:8.1f} us {r['gbps']:6.0f} GB/s regs={r['regs']} "
                      f"err={r['max_err']:.1e}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="check only")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), help="default: all")
    ap.add_argument("--shapes", nargs="+", help="BATCHxCONTEXT, default: the headline shapes")
    ap.add_argument("--rounds", type=int, default=1, help="timings of each variant per shape")
    a = ap.parse_args()
    for name in list(VARIANTS):
        if a.variants and name not in a.variants and name != "default":
            del VARIANTS[name]
    small = pn.simulator_enabled()
    lens = [120, 37] if small else [5000, 1100, 37, 16]   # the simulator: a few minutes
    ok = check(32 if small else 128, 1, 2 if small else 4, 16, lens)
    if not ok:
        sys.exit("a variant's outputs differ from the default's")
    if not a.check:
        time_variants(a.reps, [tuple(map(int, x.split("x"))) for x in a.shapes or []],
                      a.rounds)


if __name__ == "__main__":
    main()
