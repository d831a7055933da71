"""Compile every kernel specialisation to PTX for compute capability 9.0 with
the real compiler (libNVVM), which needs no GPU. It catches code that the
simulator runs but Numba's CUDA compiler rejects."""
import os
import subprocess
import sys

from paged_numba.kernels.specializations import all_specializations


def test_every_specialisation_compiles_to_ptx():
    expected = sum(1 for _ in all_specializations())
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")   # compile_ptx is not real in the simulator
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "paged_numba.kernels.specializations"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    assert f"compiled {expected} specialisations" in proc.stdout, proc.stdout[-2000:]
