set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/numpy*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu7.log
timeout 280 python3 experiments/tune_prefill.py --head-size 256 --case causal-8x2048 causal-2x8192 --variants default w8n64-fx-wg-ws-sw-s2-pp-ps-ll-lz-sr w8n64-fx-wg-ws-sw-s2-pp-ps-ll-lz-sr-pg40 --rounds 2 --jobs 3 2>&1 | grep -v Warn | tail -12 | tee -a $OUT/gpu7.log
timeout 280 python3 experiments/tune_prefill.py --case causal-8x2048 causal-2x8192 --variants default w8n128-fx-wg-ws-sw-s2-pp-ps-ll-sr w8n128-fx-wg-ws-sw-s2-pp-ps-ll-sr-pg40 --rounds 2 --jobs 3 2>&1 | grep -v Warn | tail -12 | tee -a $OUT/gpu7.log
