"""The kernels compiled with Numba inlining their device functions and with
NVVM inlining them (``PAGED_NUMBA_INLINE``), side by side, without a GPU:
for each specialisation the seconds ``compile_ptx`` took, and from the CUDA
toolkit's ``ptxas -v`` (sm_90a) its registers, stack and spills and its SASS
instruction count (with cuobjdump or nvdisasm).

    NUMBA_ENABLE_CUDASIM=0 python experiments/inline_modes.py --out results/inline_modes.csv
    NUMBA_ENABLE_CUDASIM=0 python experiments/inline_modes.py --match prefill_tc --all

By default the sample of ``python -m paged_numba.kernels.specializations
--sample`` (the first specialisation of each kernel and cache dtype);
``--all`` takes every one, ``--match TEXT`` those whose name contains TEXT.
Each mode compiles in a process of its own (the mode is read when the device
functions are declared). The producer kernels compile with their launch
bounds, as they launch.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = ("numba", "nvvm")


def worker(args):
    """Compile the selected specialisations in this process's mode; one JSON
    line each."""
    from numba import cuda

    sys.path.insert(0, HERE)
    from ptxas_prefill import code, ptxas
    from paged_numba.kernels.specializations import all_specializations, sample

    specs = all_specializations()
    for name, kernel, sig in (specs if args.all else sample(specs)):
        if args.match and args.match not in name:
            continue
        threads = getattr(kernel, "block_threads", None)
        start = time.perf_counter()
        ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0),
                                  launch_bounds=(threads, 1) if threads else None)
        seconds = time.perf_counter() - start
        # the libNVVM of numba-cuda may write a newer PTX version than the toolkit's ptxas reads
        ptx = re.sub(r"\.version \d+\.\d+", ".version 9.0", ptx)
        ptx = re.sub(r"\.target sm_90\b", ".target sm_90a", ptx)
        info, sass = ptxas(ptx)
        nums = [int(m.group(1)) if (m := re.search(pat, info)) else -1 for pat in (
            r"Used (\d+) registers", r"(\d+) bytes stack frame", r"(\d+) bytes spill stores")]
        print(json.dumps(dict(name=name, seconds=round(seconds, 2), registers=nums[0],
                              stack=nums[1], spill_stores=nums[2],
                              sass=len(code(sass)[0]) if sass else -1)), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--all", action="store_true", help="every specialisation, not the sample")
    ap.add_argument("--match", help="only the specialisations whose name contains this")
    ap.add_argument("--out", help="CSV to write the table to")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    import pandas as pd

    frames = []
    for mode in MODES:
        env = dict(os.environ, PAGED_NUMBA_INLINE=mode, NUMBA_ENABLE_CUDASIM="0")
        cmd = [sys.executable, __file__, "--worker"] + (["--all"] if args.all else []) + (
            ["--match", args.match] if args.match else [])
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
        rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        if not rows:
            ap.exit(2, f"no specialisation {'matches ' + repr(args.match) if args.match else ''}\n")
        frames.append(pd.DataFrame(rows).set_index("name").add_suffix(f"_{mode}"))
        print(f"{mode}: {len(rows)} specialisations, {frames[-1][f'seconds_{mode}'].sum():.0f} s",
              flush=True)
    table = frames[0].join(frames[1], how="outer")
    table = table[[f"{col}_{mode}" for col in ("seconds", "registers", "stack", "spill_stores",
                                               "sass") for mode in MODES]]
    with pd.option_context("display.width", 200, "display.max_rows", None):
        print(table.to_string())
    same = (table["registers_numba"] == table["registers_nvvm"]).sum()
    print(f"registers equal in {same} of {len(table)}; SASS instructions nvvm / numba: "
          f"{(table['sass_nvvm'] / table['sass_numba']).min():.3f} to "
          f"{(table['sass_nvvm'] / table['sass_numba']).max():.3f}")
    if args.out:
        table.assign(command="NUMBA_ENABLE_CUDASIM=0 python experiments/inline_modes.py"
                     + (" --all" if args.all else "") + (f" --match {args.match}" if args.match
                                                         else "")
                     + f" --out {args.out}").to_csv(args.out)


if __name__ == "__main__":
    main()
