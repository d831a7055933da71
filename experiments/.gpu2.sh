set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu2.log
for c in causal-8x2048 causal-8x2048-hs64 causal-8x2048-hs256; do
  timeout 290 python3 experiments/bench_prefill.py --cases $c --impls flashinfer_fa2 flashinfer_fa3 --reps 1 --out /tmp/warm_$c.csv > $OUT/warm_$c.log 2>&1 &
done
HYPOTHESIS_PROFILE=gpu GPU_EXAMPLES=3 timeout -s INT 220 python3 -m pytest -p no:cacheprovider -v -n 12 tests/test_prefill.py -k "matches_reference or default or lazy or swizzled" > $OUT/pytest2.log 2>&1
grep -E "passed|failed" $OUT/pytest2.log | tail -3 | tee -a $OUT/gpu2.log
wait
timeout 265 python3 experiments/bench_prefill.py --cases causal-8x2048 causal-2x8192 causal-8x2048-hs64 causal-8x2048-hs256 --out $OUT/prefill.csv 2>&1 | grep -v Warn | tail -30 | tee -a $OUT/gpu2.log
