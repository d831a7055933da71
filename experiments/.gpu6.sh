set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu6.log
G=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && echo h200 || echo h100)
cp results/prefill_$G.csv $OUT/prefill_$G.csv
timeout 560 python3 experiments/bench_prefill.py --cases causal-8x2048-hs64 causal-8x2048-hs256 --out $OUT/prefill_$G.csv 2>&1 | grep -v Warn | tail -20 | tee -a $OUT/gpu6.log
