"""Registers, local memory and SASS size of tensor-core prefill variants, read
offline (no GPU): ``compile_ptx`` for sm_90a, then the CUDA toolkit's
``ptxas -v`` (and ``cuobjdump -sass`` or ``nvdisasm`` where found).

    NUMBA_ENABLE_CUDASIM=0 python experiments/ptxas_prefill.py \
        default w8n64-fx-wg-ws-sw-pp w8n128-fx-wg-ws-sw-s3-pp --dump /tmp/sass

A variant is named as in ``tune_prefill.py`` (``default``: the sm_90 default
tiling and options at head size 128, fp16, ``"nhd"``, block size 16, group 4).
``--dump DIR`` writes each variant's PTX and SASS there.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")

from numba import cuda  # noqa: E402

from paged_numba.kernels.prefill import prefill_signature  # noqa: E402
from paged_numba.kernels.prefill_tc import prefill_tc_kernel  # noqa: E402
from paged_numba.kernels.prefill_tc_tiling import prefill_tc_config  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from variants import parse_variant  # noqa: E402


def variant_kernel(name, head_size, block_size, group, dtype, layout):
    """The kernel of variant ``name`` (``-ng``: built without the device guard)."""
    guard = not name.endswith("-ng")
    name = name.removesuffix("-ng")
    if name == "default":
        hpb, _, bn, nw, opts = prefill_tc_config(head_size, group, None, layout, sm90=True)
    else:
        nw, bn, opts, heads, _ = parse_variant(name)
        hpb = heads or prefill_tc_config(head_size, group, None, layout, sm90=True)[0]
    return prefill_tc_kernel(head_size, block_size, hpb, bn, dtype, layout, nw, **opts,
                             guard=guard)


def ptxas(ptx, dump=None, name="k"):
    with tempfile.TemporaryDirectory() as d:
        src, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        info = subprocess.run(["ptxas", "-v", "-arch=sm_90a", "-O3", src, "-o", cubin],
                              capture_output=True, text=True, check=True).stderr
        sass = ""
        for tool in ("cuobjdump", "nvdisasm"):
            if shutil.which(tool):
                args = [tool, "-sass", cubin] if tool == "cuobjdump" else [tool, cubin]
                sass = subprocess.run(args, capture_output=True, text=True).stdout
                break
        if dump:
            os.makedirs(dump, exist_ok=True)
            with open(os.path.join(dump, f"{name}.ptx"), "w") as f:
                f.write(ptx)
            if sass:
                with open(os.path.join(dump, f"{name}.sass"), "w") as f:
                    f.write(sass)
    return info, sass


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--layout", default="nhd")
    ap.add_argument("--dump")
    a = ap.parse_args()
    print(f"{'variant':>28} {'regs':>5} {'stack':>6} {'spill st':>9} {'spill ld':>9} "
          f"{'SASS':>6}")
    for name in a.variants:
        kernel = variant_kernel(name, a.head_size, a.block_size, a.group, a.dtype, a.layout)
        sig = prefill_signature(a.dtype, a.layout, tensor_maps="-tm" in name)
        # the producer kernel is launched with launch_bounds (its threads, 1 block)
        threads = getattr(kernel, "block_threads", None)
        ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0),
                                  launch_bounds=(threads, 1) if threads else None)
        # the libNVVM of numba-cuda may write a newer PTX version than this ptxas reads
        ptx = re.sub(r"\.version \d+\.\d+", ".version 9.0", ptx)
        ptx = re.sub(r"\.target sm_90\b", ".target sm_90a", ptx)
        info, sass = ptxas(ptx, a.dump, name)
        nums = [int(m.group(1)) if (m := re.search(pat, info)) else -1 for pat in (
            r"Used (\d+) registers", r"(\d+) bytes stack frame", r"(\d+) bytes spill stores",
            r"(\d+) bytes spill loads")]
        count = len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", sass, re.M))
        print(f"{name:>28} {nums[0]:>5} {nums[1]:>6} {nums[2]:>9} {nums[3]:>9} {count:>6}")


if __name__ == "__main__":
    main()
