"""Compile kernel specialisations to PTX for compute capability 9.0 with the
real compiler (libNVVM), which needs no GPU. It catches code that the
simulator runs but Numba's CUDA compiler rejects.

By default a sample (``specializations.sample``: the first specialisation of
each kernel and cache dtype, 29 of 249, one to two minutes on two cores
with NVVM inlining the device functions, some 6 with
``PAGED_NUMBA_INLINE=numba``, started first by ``conftest.py``);
``PAGED_NUMBA_PTX=all`` compiles every one (5.4 minutes there, 20 with
Numba's inlining)."""
import os
import subprocess
import sys

from paged_numba.kernels.specializations import all_specializations, sample


def test_specialisations_compile_to_ptx():
    everything = os.environ.get("PAGED_NUMBA_PTX") == "all"
    specs = all_specializations()
    expected = sum(1 for _ in (specs if everything else sample(specs)))
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")   # compile_ptx is not real in the simulator
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "paged_numba.kernels.specializations"]
                          + ([] if everything else ["--sample"]),
                          cwd=root, env=env, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    assert f"compiled {expected} specialisations" in proc.stdout, proc.stdout[-2000:]
