#!/usr/bin/env bash
# Selections of the gpu-profile suite side by side on a 2-GPU machine
# (nvidia-h200-x2: 32 cores): lane A's selections one after the other on GPU 0
# with cores 0-15, lane B's on GPU 1 with cores 16-31, each with pytest -n 16.
# A lane is one argument, its selections separated by spaces. Logs go to $OUT/selN.log.
# Usage (repository root, .whl carried as for gpu_tests.sh); as timed on tree ddd1dc4,
# 2026-11-30 (seconds, one GPU and 16 cores each): 1 ~550 (~470 on bcfd38b: leave it a
# lane of its own), 2 ~310, 3 ~230, 4 ~170, 5 ~190, 6 ~170:
#   CHECK=1 bash experiments/gpu_pair.sh 1 "2 4"; bash experiments/gpu_pair.sh "5 6" 3
set -uo pipefail
OUT=${OUT:-/tmp}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0 HYPOTHESIS_PROFILE=gpu \
       GPU_EXAMPLES=${GPU_EXAMPLES:-10}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import numba, numba_cuda, numpy; print('numba', numba.__version__, 'numba-cuda', numba_cuda.__version__, 'numpy', numpy.__version__)"
[ "${CHECK:-0}" = 1 ] && bash experiments/gpu_selections.sh check
lane() { # gpu cores selection
  local t0
  t0=$(date +%s)
  CUDA_VISIBLE_DEVICES=$1 taskset -c "$2" python3 -m pytest -p no:cacheprovider -p no:benchmark \
    -n 16 -v -rfEs paged_numba tests \
    --deselect tests/test_ptx.py::test_specialisations_compile_to_ptx \
    -k "$(bash experiments/gpu_selections.sh "$3")" > "$OUT/sel$3.log" 2>&1
  echo "selection $3 rc=$? wall=$(( $(date +%s) - t0 ))s" >> "$OUT/sel$3.log"
}
lanes() { # gpu cores "selections"
  local n
  for n in $3; do lane "$1" "$2" "$n"; done
}
lanes 0 0-15 "$1" & lanes 1 16-31 "$2" & wait
for n in $1 $2; do echo "== $OUT/sel$n.log"; tail -3 "$OUT/sel$n.log"; done
