# hf_generate on the GPU (carry .whl)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/numpy*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
timeout 280 python3 experiments/hf_generate.py --device cuda --dtypes float32 --preset medium --new-tokens 64 --engine --out $OUT/hf_fp32.csv 2>&1 | grep -v -i warn | tail -14 | tee $OUT/gpu12.log
timeout 280 python3 experiments/hf_generate.py --device cuda --dtypes float16,bfloat16 --preset medium --new-tokens 64 --engine --out $OUT/hf_half.csv 2>&1 | grep -v -i warn | tail -14 | tee -a $OUT/gpu12.log
