set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/numpy*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu3.log
HYPOTHESIS_PROFILE=gpu GPU_EXAMPLES=3 timeout -s INT 200 python3 -m pytest -p no:cacheprovider -v -n 12 tests/test_prefill.py -k "matches_reference and (head_size256 or head_size64)" > $OUT/pytest3.log 2>&1
grep -E "passed|failed" $OUT/pytest3.log | tail -3 | tee -a $OUT/gpu3.log
timeout 170 python3 experiments/bench_prefill.py --cases causal-8x2048-hs64 causal-8x2048-hs256 --impls paged_numba torch_sdpa --out $OUT/prefill.csv 2>&1 | grep -v Warn | tail -12 | tee -a $OUT/gpu3.log
