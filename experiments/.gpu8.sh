set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/numpy*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu8.log
timeout 230 python3 experiments/tune_prefill.py --head-size 256 --case causal-8x2048 causal-2x8192 --variants default w8n64-fx-wg-ws-sw-s2-pp-ps-ll-lz-sr w8n64-fx-wg-ws-sw-s2-pp-ps-ll-lz-sr-pg40 w8n64-fx-wg-ws-sw-s2-pp-ll-lz-sr-pg40 --rounds 2 --jobs 4 2>&1 | grep -v Warn | tail -12 | tee -a $OUT/gpu8.log
timeout 200 python3 experiments/tune_prefill.py --case causal-8x2048 causal-2x8192 --variants default w8n128-fx-wg-ws-sw-s2-pp-ps-ll-sr --rounds 2 --jobs 2 2>&1 | grep -v Warn | tail -12 | tee -a $OUT/gpu8.log
HYPOTHESIS_PROFILE=gpu GPU_EXAMPLES=3 timeout 120 python3 -m pytest -n 4 -q -p no:cacheprovider tests/test_prefill_wgmma.py -k split_rings 2>&1 | tail -3 | tee -a $OUT/gpu8.log
