"""Every kernel specialisation the public functions can launch, with the
argument types they launch it with, for compiling ahead of time
(``numba.cuda.compile_ptx``) without a GPU."""
import itertools

import numpy as np
from numba.core import types
from numba.np.numpy_support import from_dtype

from . import decode_tc
from .decode import decode_kernel
from .merge import merge_kernel
from .write_kv import write_kv_kernel

BLOCK_SIZES = (8, 16, 32)
LAYOUTS = ("nhd", "vllm", "hnd", "interleaved")
DTYPES = ("float16", "float32", "bfloat16")
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")


def _arr(dtype, ndim):
    # bf16 travels as its bit patterns, fp8 as its codes
    store = {"bfloat16": "uint16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}.get(dtype, dtype)
    return types.Array(from_dtype(np.dtype(store)), ndim, "C")


def _vector_width(dtype):
    """Elements in one 16-byte vector of ``dtype`` (a name; vLLM's ``x``)."""
    return 16 // np.dtype("uint16" if dtype == "bfloat16" else dtype).itemsize


def _pools(layout, dtype):
    ndim = {"nhd": (4, 4), "vllm": (5, 4), "hnd": (4, 4), "interleaved": (5, 5)}[layout]
    return (_arr(dtype, ndim[0]), _arr(dtype, ndim[1]))


def decode_signatures(dtype, layout, query_dtype="float16"):
    """Argument types of the decode kernel: unsplit (output in ``dtype``) and split (fp32 partials).
    The error word (int64) comes last, but for an fp8 cache, which takes ``query_dtype``
    queries (the unsplit output's dtype) and its scales after it."""
    fp8 = dtype.startswith("float8")
    q_dtype = query_dtype if fp8 else dtype
    tail = (_arr(q_dtype, 3), *_pools(layout, dtype), _arr("int32", 2), _arr("int32", 1),
            types.float32, types.int32, _arr("float32", 1), types.float32, types.int32,
            _arr("int64", 1))
    tail += (_arr("float32", 2),) if fp8 else ()
    return [(_arr(out_dtype, 4), _arr("float32", 3), *tail) for out_dtype in (q_dtype, "float32")]


def decode_points(layouts=LAYOUTS, dtypes=DTYPES):
    """``(head_size, block_size, heads_per_block, layout, dtype, split)`` decode
    kernels to compile: one factor at a time around head size 128, block
    size 16, four heads per block. Every layout x dtype at that point (unsplit
    and split); every head size (including rows that are not a power of two
    vectors wide: 8, 24, 72), every heads-per-block (including 3, 5, 6, 7,
    which pad the transposing reduction) and every block size (1 and 5
    included) in "nhd" fp16, plus the extremes in fp32 and "vllm". A full
    product would take hours at about 10 s per compile."""
    points = [(128, 16, 4, lay, dt, split) for lay, dt in itertools.product(layouts, dtypes)
              for split in (False, True)]
    points += [(hs, 16, 4, "nhd", "float16", False) for hs in (8, 24, 64, 72, 80, 96, 112, 256)]
    points += [(128, 16, hpb, "nhd", "float16", False) for hpb in (1, 2, 3, 5, 6, 7, 8)]
    points += [(128, bs, 4, "nhd", "float16", False) for bs in (1, 5, 8, 32)]
    points += [(hs, 16, hpb, lay, dt, False) for hs, hpb, lay, dt in
               itertools.product((8, 256), (1, 8), ("vllm",), ("float32",))]
    return points


def decode_tc_points():
    """``(head_size, block_size, heads_per_block, layout, dtype, split)`` of the
    tensor-core decode kernel, one factor at a time around head size 128, block
    size 16, four heads per block: every layout x dtype (unsplit and split),
    the other head sizes (256 also split, bf16, "hnd": two warps per block),
    block sizes 1, 5, 8, 32 and heads per block 1, 3, 8 in "nhd" fp16."""
    points = [(128, 16, 4, lay, dt, split) for lay, dt, split in itertools.product(
        decode_tc.LAYOUTS, decode_tc.DTYPES, (False, True))]
    points += [(hs, 16, 4, "nhd", "float16", False) for hs in decode_tc.HEAD_SIZES if hs != 128]
    points += [(256, 16, 4, "hnd", "bfloat16", True)]
    points += [(128, bs, 4, "nhd", "float16", False) for bs in (1, 5, 8, 32)]
    points += [(128, 16, hpb, "nhd", "float16", False) for hpb in (1, 3, 8)]
    return points


def all_specializations(layouts=LAYOUTS, dtypes=DTYPES, block_sizes=BLOCK_SIZES):
    """Yield ``(name, kernel, signature)`` for the kernel specialisations:
    decode at :func:`decode_points` and :func:`decode_tc_points` (with the
    warps :func:`tuning.decode_launch` gives them); write_kv and merge: every
    specialisation."""
    from .tuning import NUM_WARPS, STAGES, UNROLL, decode_launch   # tuning imports this module

    for hs, bs, hpb, layout, dtype, split in decode_points(layouts, dtypes):
        kernel = decode_kernel(hs, bs, hpb, dtype, layout, NUM_WARPS, UNROLL, STAGES, split)
        sig = decode_signatures(dtype, layout)[1 if split else 0]
        yield f"decode hs={hs} bs={bs} hpb={hpb} {layout} {dtype} out={sig[0].dtype}", kernel, sig
    # fp8 caches (CUDA-core kernel only): both formats, a contiguous and the strided value
    # layout, split and unsplit with fp16 queries, and the other query types once
    for fmt, layout, split, q_dtype in (
            [(f, lay, sp, "float16") for f in FP8_DTYPES for lay in ("nhd", "vllm")
             for sp in (False, True)]
            + [("float8_e4m3fn", "hnd", False, "bfloat16"), ("float8_e5m2", "interleaved", False,
                                                             "float32")]):
        kernel = decode_kernel(128, 16, 4, fmt, layout, NUM_WARPS, UNROLL, STAGES, split)
        sig = decode_signatures(fmt, layout, q_dtype)[int(split)]
        yield f"decode hs=128 bs=16 hpb=4 {layout} {fmt} q={q_dtype} out={sig[0].dtype}", kernel, sig
    for hs, bs, hpb, layout, dtype, split in decode_tc_points():
        kernel, threads, _ = decode_launch(hs, bs, hpb, dtype, layout, split, tensor_cores=True)
        sig = decode_signatures(dtype, layout)[1 if split else 0]
        yield (f"decode_tc hs={hs} bs={bs} hpb={hpb} {layout} {dtype} out={sig[0].dtype} "
               f"threads={threads}"), kernel, sig
    # fp8 caches on the tensor-core kernel: unsplit with fp16 queries, split with bf16
    # queries, and head size 64 in the interleaved layout
    for hs, fmt, layout, split, q_dtype in ((128, "float8_e4m3fn", "nhd", False, "float16"),
                                            (128, "float8_e5m2", "hnd", True, "bfloat16"),
                                            (64, "float8_e4m3fn", "interleaved", False,
                                             "float16")):
        kernel, threads, _ = decode_launch(hs, 16, 4, fmt, layout, split, tensor_cores=True,
                                           query_dtype=q_dtype)
        sig = decode_signatures(fmt, layout, q_dtype)[int(split)]
        yield (f"decode_tc hs={hs} bs=16 hpb=4 {layout} {fmt} q={q_dtype} out={sig[0].dtype} "
               f"threads={threads}"), kernel, sig
    # ... and with Q K^T in fp8 (E4M3 queries times the codes), unsplit and split
    for fmt, split, q_dtype in (("float8_e4m3fn", False, "float16"),
                                ("float8_e5m2", True, "bfloat16")):
        kernel, threads, _ = decode_launch(128, 16, 4, fmt, "nhd", split, tensor_cores=True,
                                           query_dtype=q_dtype, qk_fp8=True)
        sig = decode_signatures(fmt, "nhd", q_dtype)[int(split)]
        yield (f"decode_tc hs=128 bs=16 hpb=4 nhd {fmt} q={q_dtype} out={sig[0].dtype} "
               f"qk_fp8 threads={threads}"), kernel, sig
    # the split kernel that lets its merge start early (programmatic dependent launch)
    kernel, threads, _ = decode_launch(128, 16, 4, "float16", "nhd", True, tensor_cores=True,
                                       pdl=True)
    yield (f"decode_tc hs=128 bs=16 hpb=4 nhd float16 split pdl threads={threads}", kernel,
           decode_signatures("float16", "nhd")[1])
    for bs, layout, dtype in itertools.product(block_sizes, layouts, dtypes):
        kernel = write_kv_kernel(bs, layout, _vector_width(dtype))
        for slot_dtype in ("int64", "int32"):
            sig = (*_pools(layout, dtype), _arr(dtype, 3), _arr(dtype, 3), _arr(slot_dtype, 1),
                   _arr("int64", 1))
            yield f"write_kv bs={bs} {layout} {dtype} slots={slot_dtype}", kernel, sig
    for layout, fmt in itertools.product(layouts, FP8_DTYPES):     # quantising writes
        kernel = write_kv_kernel(16, layout, 16, fp8=fmt)
        for src in DTYPES:
            sig = (*_pools(layout, fmt), _arr(src, 3), _arr(src, 3), _arr("int64", 1),
                   _arr("int64", 1), _arr("float32", 2))
            yield f"write_kv bs=16 {layout} {fmt} from={src}", kernel, sig
    for dtype in DTYPES:
        for v_dtype in sorted({"float32", dtype}):      # split-K partials; merge_states input
            sig = (_arr(dtype, 3), _arr("float32", 2), _arr(v_dtype, 4), _arr("float32", 3))
            yield f"merge out={dtype} v={v_dtype}", merge_kernel(dtype, v_dtype), sig
            if v_dtype == "float32":    # ... waiting for the decode it follows
                yield (f"merge out={dtype} v={v_dtype} pdl",
                       merge_kernel(dtype, v_dtype, pdl=True), sig)
    from .prefill import prefill_signature, prefill_specializations
    from .prefill_tc import prefill_tc_config, prefill_tc_kernel

    yield from prefill_specializations()
    # the tensor-core prefill kernel at its default tilings: each head size, both
    # dtypes, every layout, GQA groups 1 and 8, block sizes 1 and 16, and decode-like
    # tiles (one warp; 32 rows with the query fragments in shared memory)
    points = [(hs, 4, "float16", "nhd", 16, None, {}) for hs in (64, 128, 256)]
    points += [(128, 4, dt, lay, 16, None, {}) for dt, lay in itertools.product(
        ("float16", "bfloat16"), LAYOUTS) if (dt, lay) != ("float16", "nhd")]
    points += [(128, 1, "float16", "nhd", 1, None, {}), (64, 8, "bfloat16", "hnd", 16, None, {}),
               (128, 4, "float16", "nhd", 16, 1, {}),
               (128, 4, "float16", "vllm", 16, 8, dict(q_in_regs=False))]
    for hs, group, dtype, layout, bs, max_q, extra in points:
        hpb, _, bn, nw, opts = prefill_tc_config(hs, group, max_q)
        opts = dict(opts, **extra)
        yield (f"prefill_tc hs={hs} group={group} {dtype} {layout} bs={bs} hpb={hpb} bn={bn} "
               f"warps={nw} {opts}"), prefill_tc_kernel(hs, bs, hpb, bn, dtype, layout, nw,
                                                        **opts), prefill_signature(dtype, layout)
    # its research options (PrefillPlan(kernel_options=...)): all of them at one
    # m-tile a warp, 8 warps and 64-key tiles, in both dtypes and the strided-value
    # layout; two m-tiles a warp with every option; all 32 heads of an MQA group in
    # one 2-warp decode tile; the warpgroup (wgmma) products, and with a producer
    # warpgroup, the swizzled layout and turns (the queries in registers)
    fast = dict(fast_exp2=True, fma_softmax=True, token_copies=True)
    for hs, hpb, bn, nw, dtype, layout, opts in [
            (128, 4, 64, 8, "float16", "nhd", fast), (128, 4, 64, 8, "bfloat16", "vllm", fast),
            (128, 4, 32, 4, "float16", "nhd", dict(fast, m_tiles=2, q_in_regs=False)),
            (128, 32, 64, 2, "float16", "hnd", {}),
            (128, 4, 64, 8, "bfloat16", "vllm", dict(fast_exp2=True, wgmma=True)),
            (128, 4, 64, 8, "float16", "nhd", dict(fast_exp2=True, wgmma=True, producer=True,
                                                   swizzle=True, pingpong=True,
                                                   q_in_regs=True))]:
        yield (f"prefill_tc hs={hs} {dtype} {layout} hpb={hpb} bn={bn} warps={nw} {opts}",
               prefill_tc_kernel(hs, 16, hpb, bn, dtype, layout, nw, **opts),
               prefill_signature(dtype, layout))
    # the producer kernel with its copies counted on mbarriers, whole tiles by box
    # copies through the pools' tensor maps (taken last)
    tm = dict(fast_exp2=True, wgmma=True, producer=True, swizzle=True, pingpong=True,
              persistent=True, split_halves=True, mbarriers=True, tensor_maps=True)
    yield (f"prefill_tc hs=128 float16 hnd hpb=4 bn=64 warps=8 {tm}",
           prefill_tc_kernel(128, 16, 4, 64, "float16", "hnd", 8, **tm),
           prefill_signature("float16", "hnd", tensor_maps=True))
    # MQA decode on the producer kernel (one consumer warpgroup, 32 heads), split,
    # its last part of each item merging the partial states (kernels.merge_tail)
    from .prefill_wgmma_ws import prefill_wgmma_ws_kernel
    sig = prefill_signature("float16", "nhd")
    split_sig = (_arr("float32", 4), _arr("float32", 3)) + sig[2:] + (
        _arr("float16", 3), _arr("float32", 2), _arr("int32", 1))
    yield ("prefill_wgmma_ws hs=128 float16 nhd hpb=32 bn=64 warps=4 split merge_parts",
           prefill_wgmma_ws_kernel(128, 16, 32, 64, "float16", "nhd", 4, fast_exp2=True,
                                   split_k=True, swizzle=True, merge_parts=True), split_sig)
    # ... and both MQA tiles, split, letting the merge kernel start early
    yield ("prefill_wgmma_ws hs=128 float16 nhd hpb=32 bn=64 warps=4 split pdl",
           prefill_wgmma_ws_kernel(128, 16, 32, 64, "float16", "nhd", 4, fast_exp2=True,
                                   split_k=True, swizzle=True, pdl=True), split_sig[:16])
    yield ("prefill_tc hs=128 float16 nhd hpb=32 bn=64 warps=2 split pdl",
           prefill_tc_kernel(128, 16, 32, 64, "float16", "nhd", 2, fast_exp2=True,
                             split_k=True, pdl=True), split_sig[:16])
    # an fp8 cache on the producer kernel at sm_90's default tiling (fp16 queries)
    hpb, _, bn, nw, opts = prefill_tc_config(128, 4, None, "nhd", sm90=True)
    yield (f"prefill_tc hs=128 float8_e4m3fn queries=float16 nhd hpb={hpb} bn={bn} warps={nw} "
           f"{opts}"), prefill_tc_kernel(128, 16, hpb, bn, "float16", "nhd", nw, **opts,
                                         kv_dtype="float8_e4m3fn"), \
        prefill_signature("float8_e4m3fn", "nhd", "float16")
    # the producer kernel at sm_90's default tilings of head sizes 64 and 256
    for hs in (64, 256):
        hpb, _, bn, nw, opts = prefill_tc_config(hs, 4, None, "nhd", sm90=True)
        yield (f"prefill_tc hs={hs} float16 nhd sm_90 default hpb={hpb} bn={bn} warps={nw} "
               f"{opts}"), prefill_tc_kernel(hs, 16, hpb, bn, "float16", "nhd", nw, **opts), \
            prefill_signature("float16", "nhd")
    from .copy_blocks import copy_blocks_kernel

    for dtype in DTYPES:
        pool = _arr(dtype, 3)                       # [num_layers, num_blocks, block_elems]
        for vec in (_vector_width(dtype), 1):
            for has_value in (True, False):         # False: "interleaved" (one pool)
                yield (f"copy_blocks {dtype} vec={vec} value={has_value}",
                       copy_blocks_kernel(vec, has_value), (pool, pool, _arr("int32", 2)))


def family(name):
    """A specialisation's kernel and cache dtype, e.g. ``"decode float8_e4m3fn"``
    (``"prefill_tc bfloat16 wgmma"`` for the warpgroup kernel)."""
    words = name.split()
    dtypes = [w for w in words if w in DTYPES + FP8_DTYPES]
    return " ".join(words[:1] + dtypes[:1] + (["wgmma"] if "'wgmma': True" in name else []))


def sample(specs, every=None):
    """The first specialisation of each :func:`family` (every kernel factory in
    every cache dtype compiles at least once), and with ``every`` each
    ``every``-th one as well."""
    seen = set()
    for i, spec in enumerate(specs):
        fam = family(spec[0])
        if (every and i % every == 0) or fam not in seen:
            seen.add(fam)
            yield spec


def _specs(everything):
    specs = all_specializations()
    return specs if everything else sample(specs)


def _compile_slice(args):
    """Compile every ``step``-th specialisation from ``first``; return failures."""
    first, step, cc, everything = args
    from numba import cuda

    failures, count = [], 0
    for i, (name, kernel, sig) in enumerate(_specs(everything)):
        if i % step != first:
            continue
        try:
            cuda.compile_ptx(kernel.py_func, sig, cc=cc)
        except Exception as exc:  # noqa: BLE001 - reported with the specialisation's name
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
        count += 1
    return count, failures


def compile_all(jobs=1, cc=(9, 0), everything=True):
    """Compile every specialisation (or, ``everything=False``, the :func:`sample`)
    to PTX for ``cc`` in ``jobs`` processes.

    Returns ``(count, failures)``. Needs libNVVM (the numba-cuda ``cu12``/``cu13``
    extra), not a GPU; the simulator must be off.
    """
    if jobs == 1:
        return _compile_slice((0, 1, cc, everything))
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        results = pool.map(_compile_slice, [(i, jobs, cc, everything) for i in range(jobs)])
    return sum(c for c, _ in results), [f for _, fs in results for f in fs]


if __name__ == "__main__":
    import os
    import sys
    import time

    # python -m paged_numba.kernels.specializations [JOBS] [--sample]
    start = time.time()
    args = [a for a in sys.argv[1:] if a != "--sample"]
    count, failures = compile_all(jobs=int(args[0]) if args else os.cpu_count(),
                                  everything="--sample" not in sys.argv[1:])
    print("\n".join(failures))
    print(f"compiled {count} specialisations to PTX for sm_90 in {time.time() - start:.0f} s, "
          f"{len(failures)} failed")
    sys.exit(1 if failures else 0)
