"""What the Dask engine costs a sweep on one GPU: the same grid measured in one
process and on a local cluster of one worker, each in a fresh process, the
wall-clock time of each run and the points' timings side by side.

    python experiments/sweep_workers.py run single  --work /tmp/sw   # cold kernel cache
    python experiments/sweep_workers.py run workers --work /tmp/sw   # cache the first run filled
    python experiments/sweep_workers.py run single  --work /tmp/sw   # warm, for the comparison
    python experiments/sweep_workers.py compare --work /tmp/sw --out results/sweep_workers_h200.csv

``run MODE`` calls ``python -m paged_numba sweep NAME`` (``--workers 1`` for
``workers``) with ``--out <work>/<mode>-<n>`` and the kernel cache in
``<work>/kernels`` (the first run of a work directory starts it empty), and
appends the run's wall-clock seconds to ``<work>/runs.csv``. ``compare``
writes one row per point (``us`` of each run, their ratios to the last
single-process run, ``sdpa_us`` of each) and prints the runs' wall times; the
engine's overhead is the warm ``workers`` run's wall time against the warm
``single`` run's, and its effect on the measurements the spread of a point's
``us`` between them (timing noise included: compare with two single runs).
The grid is the registered sweep's (``--sweep``, default ``decode``;
``--quick`` its small grid, which runs on the simulator).
"""
import argparse
import datetime
import os
import pathlib
import subprocess
import sys
import time

import pandas as pd

ROOT = pathlib.Path(__file__).resolve().parent.parent


def run(mode, work, sweep, quick=False):
    work = pathlib.Path(work)
    work.mkdir(parents=True, exist_ok=True)
    log = work / "runs.csv"
    n = len(pd.read_csv(log)) if log.exists() else 0
    out = work / f"{mode}-{n}"
    kernels = work / "kernels"
    cache_state = "warm" if kernels.exists() and any(kernels.iterdir()) else "cold"
    cmd = [sys.executable, "-m", "paged_numba", "sweep", sweep, "--out", str(out), "--no-progress"]
    if mode == "workers":
        cmd += ["--workers", "1"]
    if quick:
        cmd += ["--quick"]
    env = dict(os.environ, PAGED_NUMBA_CACHE_DIR=str(kernels))
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env)
    wall = time.perf_counter() - start
    row = dict(run=n, mode=mode, kernel_cache=cache_state, wall_s=round(wall, 2), rc=proc.returncode,
               out=out.name, timestamp=datetime.datetime.now(datetime.timezone.utc)
               .isoformat(timespec="seconds"), command=" ".join(cmd[1:]))
    pd.DataFrame([row]).to_csv(log, mode="a", header=not log.exists(), index=False)
    print(row)
    return proc.returncode


def compare(work, sweep, out, quick=False):
    from paged_numba.sweeps import SWEEPS

    work = pathlib.Path(work)
    runs = pd.read_csv(work / "runs.csv")
    print(runs[["run", "mode", "kernel_cache", "wall_s", "rc"]].to_string(index=False))
    params = list(SWEEPS[sweep].quick_grid if quick else SWEEPS[sweep].grid)
    stem = sweep + ("_quick" if quick else "")
    table = None
    for r in runs.itertuples():
        df = pd.read_csv(work / r.out / f"{stem}.csv")
        cols = {c: f"{c}_{r.run}_{r.mode}" for c in ("us", "sdpa_us") if c in df}
        df = df[params + list(cols)].rename(columns=cols)
        table = df if table is None else table.merge(df, on=params, how="outer")
    base = [r for r in runs.itertuples() if r.mode == "single"][-1]    # the last single run
    for r in runs.itertuples():
        if r.run != base.run:
            col = f"ratio_{r.run}_{r.mode}"
            table[col] = table[f"us_{r.run}_{r.mode}"] / table[f"us_{base.run}_single"]
            q = table[col].quantile([0.05, 0.5, 0.95])
            print(f"run {r.run} ({r.mode}, {r.kernel_cache}) / run {base.run} (single, {base.kernel_cache}): "
                  f"median {q[0.5]:.3f}, 5-95 % {q[0.05]:.3f}-{q[0.95]:.3f}")
    gpu = pd.read_csv(work / base.out / f"{stem}.csv")["gpu"].iloc[0]
    table["gpu"] = gpu
    if out:
        table.to_csv(out, index=False)
        runs.to_csv(pathlib.Path(out).with_suffix(".runs.csv"), index=False)
        print("wrote", out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run")
    r.add_argument("mode", choices=["single", "workers"])
    c = sub.add_parser("compare")
    c.add_argument("--out", help="CSV of the points side by side (and <stem>.runs.csv)")
    for p in (r, c):
        p.add_argument("--work", required=True)
        p.add_argument("--sweep", default="decode")
        p.add_argument("--quick", action="store_true", help="the sweep's small grid")
    a = ap.parse_args()
    if a.what == "run":
        sys.exit(run(a.mode, a.work, a.sweep, a.quick))
    compare(a.work, a.sweep, a.out, a.quick)


if __name__ == "__main__":
    main()
