"""Public attention entry points: validate inputs, pick a launch, run the kernels."""
import numpy as np

from . import _arrays, _launch
from . import _checks as C
from . import _validate as V
from ._group_decode import GroupDecode, group_parts, group_tile
from ._group_decode import group_kernel as group_kernel_of
from .cache import kernel_scales
from .interop import Results, cache_inputs
from .kernels.merge import merge_kernel
from ._decode_launch import (  # noqa: F401  (attention.launch_shape etc., as before)
    MAX_STAGES, MAX_WARPS, MERGE_COST, MIN_PARTITION, PARTITION_COST, SM_RATE_EXPONENT,
    SPLIT_MARGIN, _cache_launch, _partitions, default_heads_per_block, launch_shape,
    num_partitions_for)
from ._decode_plan import DecodePlan  # noqa: F401  (attention.DecodePlan, as before)
from .kernels.tuning import STAGES, UNROLL, decode_launch  # noqa: F401  (attention.decode_launch)

# kept under their old names: other API modules import them from here
_int32_device, _padded, _variants = V.int32_device, V.padded_tables, V.variants


def paged_decode(query, cache, block_tables, seq_lens=None, scale=None, *,
                 sliding_window=None, alibi_slopes=None, logits_soft_cap=None,
                 num_partitions=None, return_lse=False, validate=True, pv_mma=None,
                 key_rows=None, out=None, lse=None, stream=None):
    """Decode attention over a paged KV cache: one query token per sequence.

    Parameters
    ----------
    query : array, ``[num_seqs, num_heads, head_size]``
        NumPy or CUDA array (numba, PyTorch, CuPy) of the cache's dtype; over
        an fp8 cache, float16, bfloat16 or float32 (the output's dtype too):
        the CUDA-core kernel reads the 8-bit codes and applies the cache's
        ``k_scale``/``v_scale`` (:mod:`paged_numba.fp8`).
    cache : PagedKVCache
        Holds ``num_kv_heads`` heads; ``num_heads`` must be a multiple of it
        (GQA; ``num_kv_heads = 1`` is MQA).
    block_tables : array of int32, ``[num_seqs, max_blocks]``, or CSRTable
        Physical block of each logical block, ``-1`` past the used ones (an
        array, or a list of rows); or FlashInfer's CSR page table as
        :class:`~paged_numba.CSRTable` ``(kv_indptr [num_seqs + 1],
        kv_indices [nnz], kv_last_page_len [num_seqs])``, converted on the
        host (a plain tuple of three arrays is read as CSR too; a list never is).
    seq_lens : array of int32, ``[num_seqs]``
        Tokens of each sequence in the cache, the new one included (may be
        None with a CSR table). Integer arrays may also be lists or tuples.
    scale : float, optional
        Logit scale, default ``1 / sqrt(head_size)``.
    sliding_window : int, optional
        Attend only to keys ``k`` with ``p - k < sliding_window``, where
        ``p = seq_len - 1`` is the query's position.
    alibi_slopes : array of float32, ``[num_heads]``, optional
        Add ``slope_h * (k - p)`` to the logits (after the soft cap).
    logits_soft_cap : float, optional
        Replace each logit ``s`` by ``c * tanh(s / c)`` (Gemma 2, Grok) first.
    num_partitions : int, optional
        Split-K: partitions per sequence, each handled by its own thread
        blocks and merged with :func:`merge_states`. Default: chosen from the
        batch, the table's capacity and the GPU's multiprocessor count.
    return_lse : bool
        Also return the log-sum-exp of the logits, ``[num_seqs, num_heads]``
        float32 (``-inf`` for an empty sequence).
    validate : bool
        Check shapes, dtypes and table entries first (copies device tables to
        the host). Turn off only in benchmarks: without it a device table
        entry outside the pool or a length outside its table row is not
        followed (the kernel reads block 0, or clamps the length) but
        recorded, for :meth:`PagedKVCache.check` to raise.
    pv_mma, key_rows : bool, optional
        Variants of the tensor-core kernel (other rounding; ignored where the
        other kernels run: the CUDA-core kernel, and the prefill tile that MQA
        and groups of 32 or more heads run on): P @ V on tensor cores (default True), and the keys
        copied in whole rows and read by ``ldmatrix`` (default: in the unsplit
        kernel only). Both False give the kernel with P @ V in fp32 FMAs.
    out : array, ``[num_seqs, num_heads, head_size]``, optional
        Write the output here and return it: the query's dtype, C-contiguous,
        a NumPy array for a NumPy query (filled after the launch), else a
        device array (numba, PyTorch, CuPy; a tensor on the query's device)
        sharing no memory with the query. Checked before any launch.
    lse : array of float32, ``[num_seqs, num_heads]``, optional
        Write the log-sum-exps here, as ``out`` (returned with ``return_lse``).
    stream : optional
        Launch on this stream: a numba, PyTorch (``torch.cuda.Stream``) or
        CuPy stream, a raw ``cudaStream_t`` int, or None (the default stream).
        Ignored under the simulator, which runs every kernel synchronously.

    Returns
    -------
    out : array, ``[num_seqs, num_heads, head_size]``
        In the query's dtype and library: ``out`` when given, else NumPy for
        a NumPy query, a torch tensor for a torch one (CuPy for CuPy), a
        numba device array otherwise. A sequence with ``seq_len == 0`` gets zeros.

    Notes
    -----
    Bad arguments raise ``ValueError`` (``TypeError`` for an object that is
    not an array or a cache) naming the argument and the value, before any
    launch: integers that are bools, floats or outside the int32 range, flags
    that are not bools, and a scale, soft cap or slopes that are not finite in
    the kernels' float32 (at most 2.36e38, the float32 range over ``log2(e)``).
    NaN and Inf in the data give what the float64 reference gives, with or
    without split-K (the rule is in :mod:`paged_numba.reference`).

    Examples
    --------
    >>> import numpy as np
    >>> from paged_numba import PagedKVCache, paged_decode, write_kv
    >>> cache = PagedKVCache(num_blocks=4, block_size=8, num_kv_heads=1, head_size=16)
    >>> rng = np.random.default_rng(0)
    >>> k = rng.standard_normal((10, 1, 16)).astype(np.float16)
    >>> write_kv(cache, k, k, slot_mapping=np.arange(16, 26))  # blocks 2 and 3
    >>> q = rng.standard_normal((1, 2, 16)).astype(np.float16)
    >>> out = paged_decode(q, cache, np.array([[2, 3]], np.int32), np.array([10], np.int32))
    >>> out.shape, out.dtype
    ((1, 2, 16), dtype('float16'))
    """
    V.check_cache(cache)
    return_lse, validate = C.flag("return_lse", return_lse), C.flag("validate", validate)
    pv_mma, key_rows = C.optional_flag("pv_mma", pv_mma), C.optional_flag("key_rows", key_rows)
    handle = _launch.stream_handle(stream)
    ns = _launch.numba_stream(handle)    # every copy and fill goes ahead of the kernels on it
    q, from_host = _arrays.as_device(query, "query", ns)
    num_seqs, num_heads, head_size = V.check_query(query, q, cache,
                                                   "[num_seqs, num_heads, head_size]")
    if num_seqs > V.MAX_GRID_YZ:
        raise ValueError(f"paged_decode takes at most {V.MAX_GRID_YZ} sequences (the grid's "
                         f"limit), but got {num_seqs}.")
    block_tables, seq_lens = _padded(block_tables, seq_lens, cache, validate, ns)
    tables, tables_host = _int32_device("block_tables", block_tables, validate, ns)
    lens, lens_host = _int32_device("seq_lens", seq_lens, validate, ns)
    V.check_ndim("block_tables", tables, 2, "[num_seqs, max_blocks]")
    if tables.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables must have num_seqs = {num_seqs} rows, but got shape {V.shape_of(tables)}.")
    V.check_context(tables.shape[1], cache.block_size)
    if validate:
        V.check_tables(tables_host, lens_host, cache.num_blocks, cache.block_size)
    scale = V.scale_of(scale, head_size)
    V.check_fp8_scale(cache, scale)
    variants = _variants(num_heads, sliding_window, alibi_slopes, logits_soft_cap, ns)
    out_dtype = V.compute_dtype("query", query, cache)     # the cache's; fp8: the query's
    results = Results(query, out, lse, (num_seqs, num_heads, head_size), out_dtype,
                      (num_seqs, num_heads),
                      (() if from_host else (("query", q),)) + cache_inputs(cache), stream=ns)
    out, lse = results.out, results.lse
    tile = group_tile(cache, num_heads)
    if tile is not None:       # MQA and groups of 32 or more: the prefill tile
        parts = group_parts(num_seqs, num_heads // tile, tables.shape[1] * cache.block_size,
                            _arrays.sm_count(), group_kernel_of(cache)) if (
                                num_partitions is None) else C.integer(
                                "num_partitions", num_partitions, lo=1, hi=V.MAX_GRID_YZ)
        if num_seqs:
            for launch in GroupDecode(cache, num_seqs, num_heads, tile, parts, scale, variants,
                                      out, lse, stream=ns).launches(q, tables, lens):
                launch(handle)
        return results.finish(return_lse)
    hpb = default_heads_per_block(num_heads // cache.num_kv_heads, cache, None, pv_mma)
    max_context = tables.shape[1] * cache.block_size
    num_warps, num_partitions, partition_size = launch_shape(
        num_partitions, None, cache, hpb, num_seqs, num_heads, max_context, pv_mma=pv_mma,
        key_rows=key_rows, query_dtype=out_dtype)

    if num_seqs:
        kernel, threads, _ = _cache_launch(cache, hpb, num_partitions > 1,
                                           (num_warps, UNROLL, STAGES), pv_mma=pv_mma,
                                           key_rows=key_rows, query_dtype=out_dtype)
        grid = (num_heads // hpb, num_seqs, num_partitions)
        args = (q, cache.key_cache, cache.value_cache, tables, lens, np.float32(scale),
                np.int32(partition_size), *variants, cache.errors, *kernel_scales(cache))
        if num_partitions == 1:
            _launch.PackedLaunch(kernel, grid, threads,
                                 (out.reshape(num_seqs, 1, num_heads, head_size),
                                  lse.reshape(num_seqs, 1, num_heads), *args))(handle)
        else:
            part_out = _arrays.zeros((num_seqs, num_partitions, num_heads, head_size),
                                     np.float32, ns)
            part_lse = _arrays.zeros((num_seqs, num_partitions, num_heads), np.float32, ns)
            _launch.PackedLaunch(kernel, grid, threads, (part_out, part_lse, *args))(handle)
            _launch.launch(merge_kernel(out_dtype.name), (num_heads, num_seqs), 128,
                           (out, lse, part_out, part_lse), stream=handle)
    return results.finish(return_lse)
