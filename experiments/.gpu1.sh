set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/numpy*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu1.log
HYPOTHESIS_PROFILE=gpu GPU_EXAMPLES=3 timeout -s INT 320 python3 -m pytest -p no:cacheprovider -q -rf -n 14 tests/test_prefill.py tests/test_fp8_prefill_tc.py tests/test_prefill_tma.py tests/test_blocks.py > $OUT/pytest1.log 2>&1
tail -15 $OUT/pytest1.log | tee -a $OUT/gpu1.log
timeout 120 python3 experiments/tune_prefill.py --head-size 256 --case causal-8x2048 causal-2x8192 --variants default w8n32-fx-wg-ws-sw-s4-pp-ps-ll-lz --rounds 2 2>&1 | grep -v Warn | tail -9 | tee -a $OUT/gpu1.log
timeout 110 python3 experiments/tune_prefill.py --head-size 64 --case causal-8x2048 causal-2x8192 --variants default w8n128-fx-wg-ws-sw-pp-ps-ll --rounds 2 2>&1 | grep -v Warn | tail -9 | tee -a $OUT/gpu1.log
