"""One launch each of paged_numba's prefill and FlashInfer's, on the same
pages, inside a profiler range, for Nsight Compute.

    ncu --profile-from-start off --set full --import-source no \\
        --export $OUT/prefill python3 experiments/ncu_prefill.py --impls paged_numba flashinfer_fa3
    ncu --import $OUT/prefill.ncu-rep --page details --print-units base > details.txt
    ncu --import $OUT/prefill.ncu-rep --page source --print-source sass --csv \\
        -k regex:paged_prefill > paged_source.csv
    python experiments/ncu_stalls.py paged_source.csv --top 20

builds ``bench_prefill.py``'s case (causal 8 x 2048 by default: fp16, 32
query / 8 KV heads, head size 128, block size 16, a random block table),
runs each implementation three times outside the range (compiled and warm;
FlashInfer compiles its module on first use, 1-2 minutes), then once each
between ``torch.cuda.profiler.start()`` and ``stop()``, so only those
launches are profiled (with ``--profile-from-start off``): ``paged_numba``
(``PrefillPlan.run``, the plan's kernel and its options; ``--options`` adds
kernel options to the default plan's, as JSON, e.g. ``'{"lane_vote":
true}'``), and FlashInfer's ``fa3`` and ``fa2`` backends where asked and
importable. The details page
gives each kernel's pipe utilisation (``ComputeWorkloadAnalysis``), issue and
stall reasons (``WarpStateStats``, ``SchedulerStats``) and instruction mix
(``InstructionStats``) side by side; the source page, per SASS instruction,
feeds ``ncu_stalls.py``.
"""
import argparse
import json
import sys

import numpy as np

sys.path.insert(0, "experiments")
from bench_common import import_flashinfer  # noqa: E402
from bench_prefill import MODEL, cases  # noqa: E402
from prefill_problem import Problem, flashinfer_caller, numba_caller  # noqa: E402

IMPLS = ("paged_numba", "flashinfer_fa3", "flashinfer_fa2")


def tiling(prob, options):
    """The plan's default tiling with ``options`` added to its kernel options
    (None: the default plan)."""
    if not options:
        return None
    import paged_numba as pn

    plan = pn.PrefillPlan(prob.cache, prob.cu, np.asarray(prob.kv_lens, np.int32),
                          prob.num_heads, causal=True)
    return dict(tensor_cores=True, num_warps=plan.num_warps, block_n=plan.block_n,
                heads_per_block=plan.heads_per_block,
                kernel_options=dict(plan.kernel_options, **options))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", default="causal-8x2048", help="a case of bench_prefill.py's grids")
    ap.add_argument("--impls", nargs="+", default=["paged_numba", "flashinfer_fa3"],
                    choices=IMPLS)
    ap.add_argument("--options", default="{}",
                    help="kernel_options for paged_numba's plan, as JSON")
    a = ap.parse_args()
    import torch

    grid = {**cases("headline"), **cases("quick")}
    if a.case not in grid:
        raise SystemExit(f"no case {a.case!r}; cases: {sorted(grid)}")
    spec = grid[a.case]
    prob = Problem(spec["q_lens"], spec["kv_lens"], **{k: spec[k] for k in MODEL})
    fi = import_flashinfer() if any(i.startswith("flashinfer") for i in a.impls) else None
    runs = {}
    for impl in a.impls:
        if impl == "paged_numba":
            runs[impl] = numba_caller(prob, tiling(prob, json.loads(a.options)))[0]
        elif fi is None:
            print(f"{impl}: skipped (flashinfer is not importable)")
        else:
            runs[impl] = flashinfer_caller(fi, prob, impl.split("_")[1])[0]
    for run in runs.values():
        for _ in range(3):
            run()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for run in runs.values():
        run()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"{a.case}: profiled {list(runs)}")


if __name__ == "__main__":
    main()
