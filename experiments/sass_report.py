"""Compile one decode specialisation to SASS without a GPU and count its instructions.

Needs ptxas (CUDA toolkit) and cuobjdump (the ``nvidia-cuda-cuobjdump`` wheel, or
the toolkit's). Prints registers/spills from ``ptxas -v`` and, for the innermost
loop bodies (the blocks between a label and the backward branch to it), the number
of SASS instructions per opcode.

Usage: PYTHONPATH=. CUDA_TOOLS=DIR python experiments/sass_report.py [--tensor-cores] [--hs 128 --bs 16
       --hpb 4 --dtype float16 --layout nhd --warps 4 --unroll 2 --stages 2 --split]
       [--dump FILE]

DIR holds ptxas and cuobjdump of a CUDA toolkit at least as new as the libNVVM that
numba-cuda uses (the PTX version must be one ptxas knows): e.g. the ``bin`` folders of the
``nvidia-cuda-nvcc`` and ``nvidia-cuda-cuobjdump`` wheels unpacked into one place.
"""
import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

from numba import cuda

from paged_numba.kernels.decode import decode_kernel
from paged_numba.kernels.decode_tc import decode_tc_kernel
from paged_numba.kernels.specializations import decode_signatures


def tool(name):
    path = os.path.join(os.environ.get("CUDA_TOOLS", ""), name)
    return path if os.path.exists(path) else (
        shutil.which(name) or sys.exit(f"{name} not found (set CUDA_TOOLS)"))


def sass(ptx, arch="sm_90", max_registers=None):
    with tempfile.TemporaryDirectory() as d:
        src, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        info = subprocess.run([tool("ptxas"), "-v", f"-arch={arch}", "-O3", src, "-o", cubin]
                              + ([f"-maxrregcount={max_registers}"] if max_registers else []),
                              capture_output=True, text=True, check=True).stderr
        dump = subprocess.run([tool("cuobjdump"), "-sass", cubin], capture_output=True,
                              text=True, check=True).stdout
    return info, dump


def loops(dump):
    """Innermost loops: for each backward branch, the instructions from its target to it."""
    lines = [ln for ln in dump.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", ln)]
    addr = [int(re.match(r"\s+/\*([0-9a-f]+)\*/", ln).group(1), 16) for ln in lines]
    found = []
    for i, ln in enumerate(lines):
        m = re.search(r"BRA\s.*?(0x[0-9a-f]+)", ln)
        if m and int(m.group(1), 16) < addr[i]:
            j = addr.index(int(m.group(1), 16))
            found.append((j, i))
    inner = [(j, i) for j, i in found if not any(j < j2 and i2 < i for j2, i2 in found)]
    out = []
    for j, i in inner:
        ops = collections.Counter()
        for ln in lines[j:i + 1]:
            op = re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", ln)
            if op:
                ops[op.group(1).split(".")[0]] += 1
        out.append((j, i, ops))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hs", type=int, default=128)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--hpb", type=int, default=4)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--layout", default="nhd")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--unroll", type=int, default=2)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--split", action="store_true")
    ap.add_argument("--tensor-cores", action="store_true", help="kernels/decode_tc.py")
    ap.add_argument("--max-registers", type=int, help="ptxas -maxrregcount")
    ap.add_argument("--rolled-pv", action="store_true", help="tensor-core kernel's P @ V as a loop")
    ap.add_argument("--no-prefetch", action="store_true",
                    help="tensor-core kernel without its block-number prefetch")
    ap.add_argument("--pv-mma", action="store_true", help="tensor-core kernel's P @ V on mma")
    ap.add_argument("--key-rows", action="store_true", help="tensor-core kernel's key_rows")
    ap.add_argument("--dump")
    a = ap.parse_args()
    if a.tensor_cores:
        k = decode_tc_kernel(a.hs, a.bs, a.hpb, a.dtype, a.layout, a.warps, a.stages, a.split,
                             unroll_pv=not a.rolled_pv, prefetch=not a.no_prefetch,
                             max_registers=a.max_registers, pv_mma=a.pv_mma,
                             key_rows=a.key_rows)
    else:
        k = decode_kernel(a.hs, a.bs, a.hpb, a.dtype, a.layout, a.warps, a.unroll, a.stages,
                          a.split)
    ptx, _ = cuda.compile_ptx(k.py_func, decode_signatures(a.dtype, a.layout)[int(a.split)],
                              cc=(9, 0))
    info, dump = sass(ptx, max_registers=a.max_registers)
    print(" ".join(ln.strip() for ln in info.splitlines() if "registers" in ln or "spill" in ln))
    if a.dump:
        with open(a.dump, "w") as f:
            f.write(dump)
    for j, i, ops in loops(dump):
        total = sum(ops.values())
        top = ", ".join(f"{k} {v}" for k, v in ops.most_common(14))
        print(f"loop [{j}, {i}]: {total} instructions: {top}")


if __name__ == "__main__":
    main()
