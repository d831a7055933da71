# sweep_workers: single process against --workers 1 (carry .whl and .whl_dask)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/numpy*.whl .whl_dask/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
python3 -c "import dask_cuda, distributed; print('dask_cuda', dask_cuda.__version__)" 2>&1 | tail -1 | tee $OUT/gpu11.log
W=/tmp/sw
for m in single workers single; do timeout 170 python3 experiments/sweep_workers.py run $m --work $W 2>&1 | grep -v -i warn | tail -3 | tee -a $OUT/gpu11.log; done
python3 experiments/sweep_workers.py compare --work $W --out $OUT/sweep_workers_h100.csv 2>&1 | tail -8 | tee -a $OUT/gpu11.log
