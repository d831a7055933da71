"""Every kernel specialisation the public functions can launch, with the
argument types they launch it with, for compiling ahead of time
(``numba.cuda.compile_ptx``) without a GPU."""
import itertools

import numpy as np
from numba.core import types
from numba.np.numpy_support import from_dtype

from ..layouts import vector_width
from .decode import decode_kernel
from .merge import merge_kernel
from .write_kv import write_kv_kernel

HEAD_SIZES = (64, 80, 96, 112, 128, 256)
BLOCK_SIZES = (8, 16, 32)
HEADS_PER_BLOCK = (1, 2, 4, 8)
LAYOUTS = ("nhd", "vllm", "hnd", "interleaved")
DTYPES = ("float16", "float32")


def _arr(dtype, ndim):
    return types.Array(from_dtype(np.dtype(dtype)), ndim, "C")


def _pools(layout, dtype):
    ndim = {"nhd": (4, 4), "vllm": (5, 4), "hnd": (4, 4), "interleaved": (5, 5)}[layout]
    return (_arr(dtype, ndim[0]), _arr(dtype, ndim[1]))


def decode_signatures(dtype, layout):
    """Argument types of the decode kernel: unsplit (output in ``dtype``) and split (fp32 partials)."""
    tail = (_arr(dtype, 3), *_pools(layout, dtype), _arr("int32", 2), _arr("int32", 1),
            types.float32, types.int32, _arr("float32", 1), types.float32, types.int32)
    return [(_arr(out_dtype, 4), _arr("float32", 3), *tail) for out_dtype in (dtype, "float32")]


def all_specializations(head_sizes=HEAD_SIZES, block_sizes=BLOCK_SIZES,
                        heads_per_block=HEADS_PER_BLOCK, layouts=LAYOUTS, dtypes=DTYPES):
    """Yield ``(name, kernel, signature)`` for the kernel specialisations.

    Decode: every (head size, heads per block, layout, dtype) at the middle
    block size; every block size for one head size (``128``) with the
    smallest and largest heads per block. Block size only enters the kernel
    as the divisor of ``t // BLOCK_SIZE``, so this covers each factory
    parameter against every other one the code branches on without
    compiling the full product (about 2.5 s per compile). The split form
    (fp32 partial output) is compiled for the smallest and largest heads per
    block. write_kv and merge: every specialisation.
    """
    from ..attention import CHUNK, NUM_WARPS

    mid_bs = block_sizes[len(block_sizes) // 2]
    edge_hpb = (heads_per_block[0], heads_per_block[-1])
    points = [(hs, mid_bs, hpb, lay, dt) for hs, hpb, lay, dt in
              itertools.product(head_sizes, heads_per_block, layouts, dtypes)]
    points += [(128, bs, hpb, lay, dt) for bs, hpb, lay, dt in
               itertools.product(block_sizes, edge_hpb, layouts, dtypes) if bs != mid_bs]
    for hs, bs, hpb, layout, dtype in points:
        kernel = decode_kernel(hs, bs, hpb, np.dtype(dtype).itemsize, layout, NUM_WARPS, CHUNK)
        unsplit, split = decode_signatures(dtype, layout)
        for sig in (unsplit, split) if hpb in edge_hpb and bs == mid_bs else (unsplit,):
            yield f"decode hs={hs} bs={bs} hpb={hpb} {layout} {dtype} out={sig[0].dtype}", kernel, sig
    for bs, layout, dtype in itertools.product(block_sizes, layouts, dtypes):
        kernel = write_kv_kernel(bs, layout, vector_width(dtype))
        for slot_dtype in ("int64", "int32"):
            sig = (*_pools(layout, dtype), _arr(dtype, 3), _arr(dtype, 3), _arr(slot_dtype, 1))
            yield f"write_kv bs={bs} {layout} {dtype} slots={slot_dtype}", kernel, sig
    for dtype in DTYPES:
        sig = (_arr(dtype, 3), _arr("float32", 2), _arr("float32", 4), _arr("float32", 3))
        yield f"merge out={dtype}", merge_kernel(), sig


def _compile_slice(args):
    """Compile every ``step``-th specialisation from ``first``; return failures."""
    first, step, cc = args
    from numba import cuda

    failures, count = [], 0
    for i, (name, kernel, sig) in enumerate(all_specializations()):
        if i % step != first:
            continue
        try:
            cuda.compile_ptx(kernel.py_func, sig, cc=cc)
        except Exception as exc:  # noqa: BLE001 - reported with the specialisation's name
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
        count += 1
    return count, failures


def compile_all(jobs=1, cc=(9, 0)):
    """Compile every specialisation to PTX for ``cc`` in ``jobs`` processes.

    Returns ``(count, failures)``. Needs libNVVM (the numba-cuda ``cu12``/``cu13``
    extra), not a GPU; the simulator must be off.
    """
    if jobs == 1:
        return _compile_slice((0, 1, cc))
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        results = pool.map(_compile_slice, [(i, jobs, cc) for i in range(jobs)])
    return sum(c for c, _ in results), [f for _, fs in results for f in fs]


if __name__ == "__main__":
    import os
    import sys
    import time

    start = time.time()
    count, failures = compile_all(jobs=int(sys.argv[1]) if len(sys.argv) > 1 else os.cpu_count())
    print("\n".join(failures))
    print(f"compiled {count} specialisations to PTX for sm_90 in {time.time() - start:.0f} s, "
          f"{len(failures)} failed")
    sys.exit(1 if failures else 0)
