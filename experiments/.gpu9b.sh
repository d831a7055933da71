set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/numpy*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu9b.log
timeout 58 python3 experiments/tune_prefill.py --case causal-8x2048 causal-2x8192 --variants default w8n128-fx-wg-ws-sw-s2-pp-ps-ll-sr --rounds 1 --reps 10 --jobs 2 2>&1 | grep -v Warn | tail -7 | tee -a $OUT/gpu9b.log
