"""Where a kernel's warps wait, by SASS instruction, from Nsight Compute's
source counters.

On the GPU machine, profile one launch with source counters and export the
source page as CSV (here the warpgroup prefill kernel, the third launch of
``tune_prefill.py``: compiled and warm):

    ncu --section WarpStateStats --section SourceCounters -k regex:paged_prefill \\
        --launch-skip 2 --launch-count 1 --export wg \\
        python3 experiments/tune_prefill.py --case causal-8x2048 --reps 1 --variants w8n64-fx-wg
    ncu --import wg.ncu-rep --page source --print-source sass --csv > wg_source.csv

then, anywhere (pandas only):

    python experiments/ncu_stalls.py wg_source.csv --top 20

prints the stall reasons over the whole kernel (share of all warp samples),
the instructions with the most samples and their main reasons, and the
shared-memory wavefronts by opcode against the ideal (bank conflicts and
scattered ``cp.async`` writes show up there).
"""
import argparse

import pandas as pd


def load(path):
    """The source page as a frame: one row per SASS instruction."""
    with open(path) as f:
        lines = f.readlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"Address"'))
    df = pd.read_csv(path, skiprows=start, thousands=",", low_memory=False)
    df["opcode"] = df["Source"].str.replace(r"^@!?U?P\w+\s+", "", regex=True).str.split().str[0]
    return df


def numeric(df, cols):
    return df[cols].apply(pd.to_numeric, errors="coerce").fillna(0.0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="ncu --page source --print-source sass --csv output")
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args()
    df = load(a.csv)
    samples = numeric(df, ["Warp Stall Sampling (All Samples)"]).iloc[:, 0]
    total = samples.sum()
    reasons = [c for c in df.columns if c.startswith("stall_") and "Not Issued" not in c]
    stalls = numeric(df, reasons)
    share = (stalls.sum() / total * 100).sort_values(ascending=False)
    print(f"{len(df)} instructions, {int(total)} warp samples")
    print("stall reasons, % of samples:")
    print(share[share >= 0.5].round(1).rename(lambda c: c[len("stall_"):]).to_string())
    print(f"\nthe {a.top} instructions with the most samples:")
    rows = []
    for i in samples.sort_values(ascending=False).index[:a.top]:
        top3 = stalls.loc[i].sort_values(ascending=False)[:3]
        why = ", ".join(f"{c[len('stall_'):]} {v / samples[i] * 100:.0f}%" for c, v in top3.items()
                        if v > 0)
        rows.append({"%": round(samples[i] / total * 100, 1), "instruction": df["Source"][i][:60],
                     "reasons": why})
    print(pd.DataFrame(rows).to_string(index=False))
    cols = ["L1 Wavefronts Shared", "L1 Wavefronts Shared Ideal"]
    if all(c in df.columns for c in cols):
        w = numeric(df, cols).groupby(df["opcode"]).sum()
        w = w[w.iloc[:, 0] > 0].sort_values(cols[0], ascending=False)
        w["excess"] = (w[cols[0]] / w[cols[1]].where(w[cols[1]] > 0)).round(2)
        print("\nshared-memory wavefronts by opcode (excess: actual / ideal):")
        print(w.rename(columns={cols[0]: "wavefronts", cols[1]: "ideal"}).to_string())


if __name__ == "__main__":
    main()
