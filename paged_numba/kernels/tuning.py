"""Launch tuning of the kernels: the default warps, unroll and copy-ring depth,
the occupancy model (registers and shared memory per multiprocessor) and the
choice of decode kernel for a cache (:func:`decode_launch`).

Kernel-layer code: it imports only numba and the kernel modules; the API
layer (``paged_numba.attention``, ``paged_numba._launch``) imports it, never
the other way round.
"""
import functools

from numba import config, cuda

from . import decode_tc
from .decode import decode_kernel
from .disk_cache import attach as keep_on_disk, relink
from .specializations import decode_signatures

NUM_WARPS = 4
UNROLL = 4            # tokens per lane and warp step
STAGES = 2            # warp steps whose K/V copies are in flight (the copy ring's depth)


# -- occupancy -------------------------------------------------------------------

REGS_PER_SM = 65536
SHARED_PER_SM = 228 * 1024
SIMULATED_RESIDENT_BLOCKS = 3    # what resident_blocks says under the simulator
REGISTER_SLACK = 12              # registers per thread register_cap may take away


def blocks_by_registers(regs, threads):
    """Thread blocks of ``threads`` threads using ``regs`` registers each that
    the register file holds (allocated per warp in units of 256).

    >>> blocks_by_registers(131, 128), blocks_by_registers(128, 128)
    (3, 4)
    """
    return REGS_PER_SM // max(-(-regs * 32 // 256) * 256 * (threads // 32), 1)


def dynamic_shared(dispatcher):
    """Bytes of dynamic shared memory a launch of ``dispatcher`` needs: the
    ``dynamic_shared_bytes`` its kernel factory set on it, else 0."""
    return int(getattr(dispatcher, "dynamic_shared_bytes", 0))


def _blocks_by_shared(kernel, dispatcher):
    used = kernel.shared_mem_per_block + dynamic_shared(dispatcher) + 1024   # + driver reserve
    return SHARED_PER_SM // used


def resident_blocks(dispatcher, argtypes, threads):
    """Thread blocks of ``dispatcher``, compiled for the numba types
    ``argtypes``, that fit on one multiprocessor at once, from its registers
    and shared memory (sm_80/90 limits: 64 K registers, 228 KB shared
    memory, 64 warps, 32 blocks)."""
    if config.ENABLE_CUDASIM:
        return SIMULATED_RESIDENT_BLOCKS
    keep_on_disk(dispatcher)
    kernel = dispatcher.compile(tuple(argtypes))
    by_regs = blocks_by_registers(kernel.regs_per_thread, threads)
    return max(1, min(by_regs, _blocks_by_shared(kernel, dispatcher), 64 * 32 // threads, 32))


def register_limit(regs, threads, by_shared, slack=REGISTER_SLACK):
    """The register limit at which one more thread block of ``threads``
    threads, now using ``regs`` registers each, fits on a multiprocessor, or
    None: only when the register file is what limits it, ``by_shared`` (the
    blocks shared memory allows) and the warp limit have room for one more,
    and the limit is at most ``slack`` registers below ``regs`` (a few spills).

    >>> register_limit(131, 128, by_shared=6)      # 3 -> 4 blocks of 4 warps
    128
    >>> register_limit(131, 128, by_shared=3) is None, register_limit(184, 64, 6) is None
    (True, True)

    Where not even one block fits (512 threads of 142 registers), the cap that
    lets one fit, however many registers below: without it the launch fails.

    >>> register_limit(142, 512, by_shared=3), register_limit(128, 512, by_shared=3) is None
    (128, True)
    """
    more = blocks_by_registers(regs, threads) + 1
    cap = REGS_PER_SM // (more * threads) // 8 * 8
    if more == 1:
        return cap if cap < regs else None
    fits = by_shared >= more and more * threads <= 64 * 32 and more <= 32
    return cap if fits and regs - slack <= cap < regs else None


@functools.cache
def register_cap(dispatcher, argtypes, threads):
    """:func:`register_limit` of ``dispatcher`` compiled for ``argtypes`` (a
    tuple; None under the simulator and where no GPU is present, e.g. when
    compiling PTX only)."""
    if config.ENABLE_CUDASIM or not cuda.is_available():
        return None
    keep_on_disk(dispatcher)
    kernel = dispatcher.compile(tuple(argtypes))
    return register_limit(kernel.regs_per_thread, threads, _blocks_by_shared(kernel, dispatcher))


# -- decode kernel choice ---------------------------------------------------------

def fitting_warps(head_size, stages=STAGES, num_warps=NUM_WARPS, dynamic=False):
    """``num_warps``, halved until two stages of the tensor-core kernel's copy
    ring fit the static 48 KB of shared memory (the default warps: 2 at head
    size 256), or with ``dynamic`` the most a block may have."""
    while num_warps > 1 and not decode_tc.ring_stages(head_size, num_warps, stages, "nhd",
                                                      dynamic=dynamic):
        num_warps //= 2
    return num_warps


def tensor_cores_apply(head_size, hpb, dtype, layout, query_dtype=None, pv_mma=None,
                       key_rows=None):
    """Whether :func:`decode_launch` can take the tensor-core kernel: where
    ``decode_tc.supports`` says so, for an fp8 cache unless ``pv_mma`` or
    ``key_rows`` is False.

    >>> tensor_cores_apply(128, 4, "float8_e4m3fn", "nhd", "bfloat16")
    True
    >>> tensor_cores_apply(128, 4, "float8_e4m3fn", "nhd", pv_mma=False)
    False
    """
    fp8 = dtype in decode_tc.FP8_DTYPES
    return decode_tc.supports(head_size, hpb, dtype, layout, query_dtype) and (
        not fp8 or (pv_mma is not False and key_rows is not False))


def decode_launch(head_size, block_size, hpb, dtype, layout, split,
                  tuning=(NUM_WARPS, UNROLL, STAGES), tensor_cores=None, pv_mma=None,
                  key_rows=None, query_dtype=None, qk_fp8=False, guard=True, pdl=False):
    """``(kernel, threads, tensor_cores)``: the decode kernel for a cache of
    ``dtype`` (a name) in ``layout`` with ``hpb`` query heads per thread block.
    The tensor-core kernel (``kernels.decode_tc``) where it applies (fp16/bf16,
    head size 32/64/128/256) unless ``tensor_cores`` is
    False, else ``kernels.decode``. ``tuning`` is ``(num_warps, unroll,
    stages)``; the tensor-core kernel has no ``unroll``, halves
    ``num_warps`` until two ring stages fit in shared memory (dynamic shared
    memory where the static 48 KB do not hold them), and is compiled
    with a register limit where a few registers fewer buy one more resident
    thread block (:func:`register_cap`). Its variants (other rounding:
    ``decode_tc.decode_tc_kernel``'s ``pv_mma`` and ``key_rows``): ``pv_mma``
    None means True (P @ V on tensor cores), ``key_rows`` None means
    ``not split`` (keys by ldmatrix in the unsplit kernel only, where it is
    faster); the CUDA-core kernel ignores both. An fp8 cache (``query_dtype``
    the queries' dtype name) takes the tensor-core kernel with both variants,
    for float16 and bfloat16 queries; with float32 queries, or either variant
    False, the CUDA-core kernel. ``qk_fp8`` (fp8 caches on the tensor-core
    kernel only): ``Q K^T`` of E4M3 queries and the codes as stored.
    ``guard=False`` builds the tensor-core kernel without the device guard
    (``decode_tc.decode_tc_kernel``'s), only to time it; the CUDA-core kernel
    has no such form (``ValueError``). ``pdl`` (the split tensor-core kernel):
    its blocks let the merge launched after it start early (the CUDA-core
    kernel ignores it)."""
    num_warps, unroll, stages = tuning
    args = (head_size, block_size, hpb, dtype, layout)
    fp8 = dtype in decode_tc.FP8_DTYPES
    usable = tensor_cores_apply(head_size, hpb, dtype, layout, query_dtype, pv_mma, key_rows)
    if tensor_cores and fp8 and not usable:
        raise ValueError(f"tensor_cores=True with an fp8 cache needs float16 or bfloat16 "
                         f"queries, head_size in {decode_tc.FP8_HEAD_SIZES}, a layout in "
                         f"{decode_tc.FP8_LAYOUTS} and pv_mma, key_rows not False, but got "
                         f"{query_dtype} queries, head_size={head_size}, {layout!r}, "
                         f"pv_mma={pv_mma}, key_rows={key_rows}.")
    if qk_fp8 and not (fp8 and usable and tensor_cores is not False):
        raise ValueError(f"qk_fp8=True needs an fp8 cache on the tensor-core decode kernel, but "
                         f"got {dtype}, {query_dtype} queries, {layout!r}, "
                         f"head_size={head_size}, tensor_cores={tensor_cores}.")
    if hpb > decode_tc.MAX_HPB and (not usable or tensor_cores is False):
        raise ValueError(f"heads_per_block={hpb} needs the tensor-core kernel, which does not "
                         f"take this launch ({dtype}, {query_dtype} queries, {layout!r}, "
                         f"head_size={head_size}, tensor_cores={tensor_cores}).")
    if tensor_cores and not usable:
        raise ValueError(f"tensor_cores=True needs a float16/bfloat16 cache in one of the layouts "
                         f"{decode_tc.LAYOUTS}, head_size in {decode_tc.HEAD_SIZES} and at most "
                         f"{decode_tc.MAX_HPB} query heads per block (16 with pv_mma), but got "
                         f"{dtype}, {layout!r}, head_size={head_size}, heads_per_block={hpb}.")
    if usable and tensor_cores is not False:
        # the warps split the tokens, so they decide the rounding: choose them as for
        # a layout that stages values too, so that every layout gives the same bits
        num_warps = fitting_warps(head_size, stages, num_warps, dynamic=True)
        variant = dict(pv_mma=True if pv_mma is None else bool(pv_mma),
                       key_rows=not split if key_rows is None else bool(key_rows))
        if fp8:
            variant = dict(pv_mma=True, key_rows=True, query_dtype=query_dtype,
                           **({"qk_fp8": True} if qk_fp8 else {}))
        if not guard:   # (named only when off: the default keeps its factory cache entry)
            variant["guard"] = False
        if pdl and split:
            variant["pdl"] = True
        kernel = decode_tc.decode_tc_kernel(*args, num_warps, stages, split, **variant)
        # a few registers fewer can buy one more resident block (e.g. 131 -> 128)
        signature = decode_signatures(dtype, layout, query_dtype or "float16")[int(split)]
        cap = register_cap(kernel, signature, 32 * num_warps)
        if cap is not None:
            capped = decode_tc.decode_tc_kernel(*args, num_warps, stages, split,
                                                max_registers=cap, **variant)
            relink(kernel, capped, signature)     # the same PTX: ptxas only, not a new compile
            kernel = capped
        return kernel, 32 * num_warps, True
    if not guard:
        raise ValueError(f"guard=False applies to the tensor-core decode kernel, which does not "
                         f"take this launch ({dtype}, {query_dtype} queries, {layout!r}, "
                         f"head_size={head_size}, tensor_cores={tensor_cores}).")
    return decode_kernel(*args, num_warps, unroll, stages, split), 32 * num_warps, False
