# gpu profile on the prefill kernels (split rings first), H100 or H200 (carry .whl)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/numpy*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0 HYPOTHESIS_PROFILE=gpu GPU_EXAMPLES=3
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu13.log
timeout 150 python3 -m pytest -p no:cacheprovider -q -n 4 tests/test_prefill_wgmma.py -k split_rings 2>&1 | tail -5 | tee -a $OUT/gpu13.log
timeout 380 python3 -m pytest -p no:cacheprovider -q -n 14 -rfE tests/test_prefill.py tests/test_prefill_wgmma.py tests/test_fp8_prefill_tc.py tests/test_prefill_tma.py -k "not split_rings" 2>&1 | tail -15 | tee -a $OUT/gpu13.log
