#!/usr/bin/env bash
# One GPU machine's decode measurements: headline table, tuning, partition sweep,
# a slice of the gpu-profile tests, and an ncu profile of the default kernel.
# Usage (repository root, numpy<2.5 wheel in .whl/): bash experiments/device_bench.sh OUTDIR [STEPS]
set -uo pipefail
OUT=${1:-/tmp/out}
STEPS=${2:-headline,tuning,partitions,tests,prefill,ncu}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
has() { [[ ",$STEPS," == *",$1,"* ]]; }
has headline && python3 experiments/bench_decode.py --grid headline --out "$OUT/decode_h200.csv" 2>&1 | tee "$OUT/headline.txt"
has tuning && python3 experiments/bench_decode.py --tuning 2>&1 | tee "$OUT/tuning.txt"
has grid && python3 experiments/bench_decode.py --grid full --reps 10 --out "$OUT/decode_grid_h200.csv" 2>&1 | tee "$OUT/grid.txt"
has partitions && python3 experiments/bench_decode.py --partitions 2>&1 | tee "$OUT/partitions.txt"
has tests && GPU_EXAMPLES=${GPU_EXAMPLES:-5} HYPOTHESIS_PROFILE=gpu timeout 240 python3 -m pytest -q -x -p no:cacheprovider -n "$(nproc)" tests/test_decode.py tests/test_decode_tensor_cores.py -k "${TEST_K:-head_size128-block_size16}" 2>&1 | tail -15 | tee "$OUT/tests.txt"
has prefill && python3 experiments/bench_prefill.py --check --out "$OUT/prefill_h200.csv" 2>&1 | tail -40 | tee "$OUT/prefill.txt"
has sweeps && for s in exactness decode paging-overhead split-k; do timeout 200 python3 -m paged_numba sweep $s --out "$OUT" 2>&1 | tail -3; done
has ncu && ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats -k regex:paged_decode -c 1 python3 experiments/bench_decode.py --once 64 4096 > "$OUT/ncu.txt" 2>&1; tail -5 "$OUT/ncu.txt"
true
