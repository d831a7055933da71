"""The two ways the kernels' device functions are inlined
(``PAGED_NUMBA_INLINE``, :func:`paged_numba.kernels.convert.inline_mode`):
the switch and its errors, the disk cache keeping them apart, and the same
instructions from both for a kernel compiled to PTX with no GPU present."""
import os
import pathlib
import subprocess
import sys

import pytest

from paged_numba.kernels import disk_cache
from paged_numba.kernels.convert import INLINE_ENV, inline_mode

ROOT = pathlib.Path(__file__).resolve().parent.parent

PTX = """
import re
from numba import cuda
from paged_numba.kernels.specializations import all_specializations
name, kernel, sig = next(s for s in all_specializations() if s[0].startswith("write_kv bs=16 nhd float16"))
ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0))
body = ptx[ptx.index(".entry"):]
print(" ".join(re.findall(r"^\\s+(?:@!?%p\\d+ )?([a-z][\\w.]*)", body, re.M)))
"""


def test_inline_mode_reads_the_environment_and_refuses_others(monkeypatch):
    monkeypatch.delenv(INLINE_ENV, raising=False)
    assert inline_mode() == "nvvm"
    monkeypatch.setenv(INLINE_ENV, " Numba ")
    assert inline_mode() == "numba"
    monkeypatch.setenv(INLINE_ENV, "fast")
    with pytest.raises(ValueError, match=f"{INLINE_ENV} must be one of numba, nvvm, but got 'fast'"):
        inline_mode()


def test_the_disk_cache_keeps_the_modes_apart(monkeypatch):
    monkeypatch.setenv(INLINE_ENV, "numba")
    numba_key = disk_cache._environment()
    monkeypatch.setenv(INLINE_ENV, "nvvm")
    assert disk_cache._environment() != numba_key


def _opcodes(mode):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env[INLINE_ENV] = mode
    proc = subprocess.run([sys.executable, "-c", PTX], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.split()


def test_both_modes_compile_a_kernel_to_the_same_instructions_without_a_gpu():
    # nvvm: each device function compiled on its own, which numba-cuda does for
    # the current device; with none present the toolkit gives it a default target
    numba_ops, nvvm_ops = _opcodes("numba"), _opcodes("nvvm")
    assert len(numba_ops) > 100 and any(op.startswith("st.global") for op in numba_ops)
    assert nvvm_ops == numba_ops
    assert not any(op.startswith("call") for op in nvvm_ops)     # no call left in the kernel
