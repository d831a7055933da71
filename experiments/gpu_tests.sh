#!/usr/bin/env bash
# The test suite on a GPU machine with the `gpu` hypothesis profile.
# Usage (repository root): bash experiments/gpu_tests.sh [pytest args]
# (the whole suite, or only the files or test ids among the arguments)
# Expects a numpy<2.5 wheel in .whl/ when the machine's numpy is too new.
set -uo pipefail
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0 HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-gpu}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import numba, numba_cuda, numpy, numba.cuda as c; print('numba', numba.__version__, 'numba-cuda', numba_cuda.__version__, 'numpy', numpy.__version__, c.get_current_device().name)"
# each worker compiles the kernels of the parameter combinations it is given
paths=(paged_numba tests)
for a in "$@"; do [ -e "${a%%::*}" ] && paths=(); done
python3 -m pytest -p no:cacheprovider -n "$(nproc)" "${paths[@]}" "$@"
