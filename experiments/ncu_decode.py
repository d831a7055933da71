"""One decode launch of a tensor-core variant, for Nsight Compute.

    ncu --section SpeedOfLight --section MemoryWorkloadAnalysis --section SchedulerStats \\
        --section WarpStateStats --section Occupancy -k regex:paged_decode_tc \\
        --launch-skip 2 --launch-count 1 python experiments/ncu_decode.py --variant pv-mma

builds a ``DecodePlan`` for fp16, 32 query / 8 KV heads, head size 128, block
size 16 and a random block table, and runs it four times (the third launch is
the one to profile: compiled and warm). ``--variant`` is a name of
``tune_tc.VARIANTS``.
"""
import argparse
import sys

import numpy as np
from numba import cuda

import paged_numba as pn

sys.path.insert(0, "experiments")
from tune_tc import VARIANTS, patched  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", default="default", choices=list(VARIANTS))
    ap.add_argument("--shape", default="64x4096", help="BATCHxCONTEXT")
    a = ap.parse_args()
    batch, context = map(int, a.shape.split("x"))
    extra = VARIANTS[a.variant]
    block_size, rng = 16, np.random.default_rng(0)
    blocks = batch * -(-context // block_size)
    cache = pn.PagedKVCache(blocks, block_size, 8, 128, "float16", extra.get("layout", "nhd"))
    table = cuda.to_device(rng.permutation(blocks).reshape(batch, -1).astype(np.int32))
    q = cuda.to_device(rng.standard_normal((batch, 32, 128)).astype(np.float16))
    lens = cuda.to_device(np.full(batch, context, np.int32))
    with patched(extra):
        plan = pn.DecodePlan(cache, batch, 32, blocks // batch)
    for _ in range(4):
        plan.run(q, table, lens)
    cuda.synchronize()
    print(f"{a.variant} {a.shape}: {plan.num_partitions} partition(s)")


if __name__ == "__main__":
    main()
