"""Decode launch shapes: the query heads a thread block takes, the split-K
model (how many partitions a batch's keys are split into), and the warps,
partitions and partition size of a launch, validated.
:mod:`paged_numba.attention` and :class:`paged_numba.DecodePlan` launch with
them."""
from . import _arrays
from . import _checks as C
from . import _validate as V
from .kernels import decode_tc_tiling as decode_tc
from .kernels.decode import heads_per_block
from .kernels.specializations import decode_signatures
from .kernels.tuning import (NUM_WARPS, STAGES, UNROLL, decode_launch, fitting_warps,
                             resident_blocks, tensor_cores_apply)

MIN_PARTITION = 256   # split-K never makes partitions shorter than this (tokens)
PARTITION_COST = 256  # fixed cost of a thread block in the split-K model, in tokens
MERGE_COST = 128      # fixed cost of the split's merge launch in that model, in tokens
SM_RATE_EXPONENT = 0.36   # k blocks on one SM stream k ** 0.36 times as fast as one
SPLIT_MARGIN = 0.05   # split only for a modelled gain above this
MAX_WARPS = 32        # 1024 threads, CUDA's limit per thread block
MAX_STAGES = 32       # the tensor-core kernel's ring fill reads one window of block numbers
MAX_UNROLL = 32       # tokens a lane holds a warp step (registers: unroll x head_size / 32)


def default_heads_per_block(group, cache, tensor_cores=None, pv_mma=None):
    """Query heads a decode block takes by default: 16 for groups of 16 (and
    multiples) at head size 128 on the tensor-core kernel with P @ V on tensor
    cores (the group's K/V read once, not twice: 144 against 163 us for 64
    sequences of 4096 tokens with 64 / 4 heads on the H200; at head sizes 64
    and 256 it measured no faster), else the largest divisor of the group up
    to 8.

    >>> from paged_numba import PagedKVCache
    >>> c = PagedKVCache(num_blocks=2, block_size=16, num_kv_heads=1, head_size=128,
    ...                  dtype="float16")
    >>> default_heads_per_block(16, c), default_heads_per_block(16, c, tensor_cores=False)
    (16, 8)
    >>> default_heads_per_block(12, c), default_heads_per_block(16, c, pv_mma=False)
    (6, 8)
    """
    if (group % 16 == 0 and cache.head_size == 128 and tensor_cores is not False
            and pv_mma is not False and cache.dtype.name in decode_tc.DTYPES
            and decode_tc.supports(cache.head_size, 16, cache.dtype.name, cache.layout)):
        return 16
    return heads_per_block(group)


def _heads_per_block(value, group, cache, tensor_cores, pv_mma):
    """A decode plan's query heads a block: the default
    (:func:`default_heads_per_block`), or ``value`` checked: a divisor of the
    group, at most 8, or 16 on the tensor-core kernel with P @ V on tensor
    cores."""
    if value is None:
        return default_heads_per_block(group, cache, tensor_cores, pv_mma)
    hpb = C.integer("heads_per_block", value, lo=1)
    if group % hpb or hpb > decode_tc.MAX_PV_MMA_HPB:
        raise ValueError(f"heads_per_block must divide the GQA group size {group} and be at "
                         f"most {decode_tc.MAX_PV_MMA_HPB}, but got {hpb}.")
    if hpb > decode_tc.MAX_HPB and (
            tensor_cores is False or pv_mma is False
            or not decode_tc.supports(cache.head_size, hpb, cache.dtype.name, cache.layout)):
        raise ValueError(f"heads_per_block={hpb} (more than {decode_tc.MAX_HPB}) needs the "
                         f"tensor-core kernel with pv_mma (a float16/bfloat16 cache, head_size in "
                         f"{decode_tc.HEAD_SIZES}), but got tensor_cores={tensor_cores}, "
                         f"pv_mma={pv_mma}, {cache.dtype.name}, head_size={cache.head_size}.")
    return hpb


def num_partitions_for(num_seqs, num_head_blocks, max_context, sm_count, resident=3):
    """Split-K heuristic: the fewest partitions ``P`` whose modelled time is
    within ``SPLIT_MARGIN`` of the best. The ``num_seqs * num_head_blocks * P``
    thread blocks run in ``ceil`` waves of ``sm_count * resident`` (blocks
    resident per multiprocessor); a wave with ``k`` blocks on the busiest
    multiprocessor lasts ``(max_context / P) * k ** (1 - SM_RATE_EXPONENT)
    + PARTITION_COST`` (a partition's tokens, at the rate ``k`` blocks share,
    plus a fixed cost per block in tokens: its start and its epilogue); a split
    adds ``MERGE_COST`` for the merge launch. Partitions are at least
    ``MIN_PARTITION`` tokens. Fitted to the H200: one block per SM streams at
    78% of two blocks' rate (``results/fixed_cost_h200.csv``: 3.43 against
    4.41 TB/s at batch 16), and on the grid of ``results/decode_grid_h200.csv``
    every ``MERGE_COST`` from 100 to 150 reproduces the recorded choices and
    keeps batch 16 x 512 unsplit, where two partitions were 4.5% slower.

    >>> num_partitions_for(1, 8, 32768, 132, resident=2)    # one long sequence: split it
    32
    >>> num_partitions_for(16, 8, 512, 132, resident=2)     # one wave either way: the merge loses
    1
    >>> num_partitions_for(256, 8, 2048, 132)     # a large batch fills the GPU alone
    1
    """
    blocks = max(num_seqs * num_head_blocks, 1)
    slots = max(sm_count * resident, 1)
    options = range(1, max(1, -(-max_context // MIN_PARTITION)) + 1)

    def cost(p):
        n = blocks * p
        busiest = min(resident, -(-min(n, slots) // max(sm_count, 1)))
        wave = max_context / p * busiest ** (1 - SM_RATE_EXPONENT) + PARTITION_COST
        return -(-n // slots) * wave + (MERGE_COST if p > 1 else 0)

    costs = {p: cost(p) for p in options}
    best = min(costs.values())
    return min(p for p in options if costs[p] <= best * (1 + SPLIT_MARGIN))


def _cache_launch(cache, hpb, split, tuning=(NUM_WARPS, UNROLL, STAGES), tensor_cores=None,
                  pv_mma=None, key_rows=None, query_dtype=None, qk_fp8=False, guard=True,
                  pdl=False):
    """:func:`decode_launch` for ``cache`` (``guard=False``: only to time the
    device guard)."""
    return decode_launch(cache.head_size, cache.block_size, hpb, cache.dtype.name, cache.layout,
                         split, tuning, tensor_cores, pv_mma, key_rows, _name(query_dtype),
                         qk_fp8, guard=guard, pdl=pdl)


def _name(dtype):
    """A dtype's name (None stays None)."""
    return None if dtype is None else getattr(dtype, "name", dtype)


def _partitions(num_partitions, cache, hpb, num_seqs, num_heads, max_context, tuning,
                tensor_cores=None, pv_mma=None, key_rows=None, query_dtype=None, qk_fp8=False,
                pdl=False):
    """Validated split-K ``(num_partitions, partition_size)``; the default comes
    from :func:`num_partitions_for` with the split kernel's occupancy (for the
    tensor-core kernel, at most the blocks that saturate HBM)."""
    if num_partitions is None:
        kernel, threads, tc = _cache_launch(cache, hpb, True, tuning, tensor_cores, pv_mma,
                                            key_rows, query_dtype, qk_fp8, pdl=pdl)
        split = decode_signatures(cache.dtype.name, cache.layout,
                                  _name(query_dtype) or "float16")[1]
        resident = resident_blocks(kernel, split, threads)
        if tc:   # blocks past HBM saturation only add per-partition costs
            resident = min(resident, decode_tc.saturating_blocks(cache.head_size, threads // 32))
        num_partitions = num_partitions_for(num_seqs, num_heads // hpb, max_context,
                                            _arrays.sm_count(), resident)
    num_partitions = C.integer("num_partitions", num_partitions, lo=1)
    partition_size = max(-(-max_context // num_partitions), 1)
    parts = max(-(-max_context // partition_size), 1)
    if parts > V.MAX_GRID_YZ:
        raise ValueError(f"num_partitions={num_partitions} gives {parts} partitions of "
                         f"{partition_size} tokens, more than the grid's {V.MAX_GRID_YZ}.")
    return parts, partition_size


def launch_shape(num_partitions, num_warps, cache, hpb, num_seqs, num_heads, max_context,
                 unroll=UNROLL, stages=STAGES, tensor_cores=None, pv_mma=None, key_rows=None,
                 query_dtype=None, qk_fp8=False, pdl=False):
    """``(num_warps, num_partitions, partition_size)`` of a decode launch; None
    picks: :func:`fitting_warps` (static) for the tensor-core kernel
    (``NUM_WARPS`` for the other), and :func:`num_partitions_for`'s split.
    More warps than fit the static shared memory are the caller's choice
    (the ring then lives in dynamic shared memory): on the H200 they did not
    beat the split (``docs/journal/decode_tc.md``, decode v8: wide blocks in
    place of split-K, 2026-11-30)."""
    tensor_cores = C.optional_flag("tensor_cores", tensor_cores)
    pv_mma, key_rows = C.optional_flag("pv_mma", pv_mma), C.optional_flag("key_rows", key_rows)
    unroll = C.integer("unroll", unroll, lo=1, hi=MAX_UNROLL)
    stages = C.integer("stages", stages, lo=2, hi=MAX_STAGES)
    tc = tensor_cores is not False and tensor_cores_apply(
        cache.head_size, hpb, cache.dtype.name, cache.layout, _name(query_dtype), pv_mma,
        key_rows)
    if num_warps is None:
        num_warps = fitting_warps(cache.head_size, stages) if tc else NUM_WARPS
    tuning = (C.power_of_two("num_warps", num_warps, hi=MAX_WARPS), unroll, stages)
    parts, size = _partitions(num_partitions, cache, hpb, num_seqs, num_heads, max_context,
                              tuning, tensor_cores, pv_mma, key_rows, query_dtype, qk_fp8, pdl)
    return tuning[0], parts, size
