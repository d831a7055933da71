"""Public attention entry points: validate inputs, pick a launch, run the kernels."""
import numpy as np

from . import _arrays, _launch
from . import _checks as C
from . import _validate as V
from ._group_decode import GroupDecode, group_parts, group_tile
from ._group_decode import group_kernel as group_kernel_of
from .cache import kernel_scales
from .interop import LikeInput, Results, cache_inputs, plan_buffer
from .interop import overlaps as _overlaps
from .kernels import decode_tc_tiling as decode_tc
from .kernels.decode import heads_per_block
from .kernels.merge import merge_kernel
from ._decode_launch import (  # noqa: F401  (attention.launch_shape etc., as before)
    MAX_STAGES, MAX_WARPS, MERGE_COST, MIN_PARTITION, PARTITION_COST, SM_RATE_EXPONENT,
    SPLIT_MARGIN, _cache_launch, _partitions, launch_shape, num_partitions_for)
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


class DecodePlan:
    """Decode attention planned once per batch shape and run many times.

    ``plan`` (the constructor) validates what does not change between steps,
    picks the split-K partition count, allocates the output and the split-K
    scratch space, compiles the kernels and packs their launch arguments;
    :meth:`run` then launches with little host work: the first ``run`` with
    given buffers captures the decode kernel and the split-K merge into a
    CUDA graph, and each later one is a single ``cuGraphLaunch``. Pass the
    same device buffers to every ``run`` (as with CUDA graphs: update their
    contents, not their identity) to keep that fast path; new buffers are
    packed again. ``run`` only enqueues work, so it can itself be captured in
    a CUDA graph (e.g. ``torch.cuda.graph``, with
    ``stream=torch.cuda.current_stream()``): on a capturing stream it
    launches the kernels one by one.

    Parameters
    ----------
    cache : PagedKVCache
    num_seqs, num_heads : int
        Batch size and query heads of the queries ``run`` will get.
    max_blocks : int
        Columns of the block tables ``run`` will get.
    scale, sliding_window, alibi_slopes, logits_soft_cap : optional
        As in :func:`paged_decode`.
    num_partitions : int, optional
        Split-K partitions; default from the heuristic of :func:`paged_decode`.
    num_warps : int, optional
        Warps per thread block; default 4 (2 at head size 256, where the
        tensor-core kernel's copy ring of 4 does not fit 48 KB). More put the
        ring in dynamic shared memory.
    unroll, stages : int
        Tuning knobs of the kernel: tokens per lane and step (CUDA-core
        kernel), and steps in flight in the shared-memory copy ring (2; in
        dynamic shared memory where the static 48 KB hold fewer).
    tensor_cores : bool, optional
        Use the tensor-core kernel (``kernels.decode_tc``: q.k and, by default,
        P @ V on ``mma.sync``) or not; default: where it applies. True raises
        where it does not.
    pv_mma, key_rows : bool, optional
        The tensor-core kernel's variants, as in :func:`paged_decode`.
    query_dtype : {"float16", "bfloat16", "float32"}, optional
        For an fp8 cache: the dtype of the queries ``run`` gets and of its
        output (default float16). Other caches take queries of their own
        dtype only (None or that dtype).
    heads_per_block : int, optional
        Query heads a thread block takes (a divisor of the GQA group; default
        the largest up to 8). 16, for groups of 16 and more, needs the
        tensor-core kernel with P @ V on tensor cores: all 16 rows of its
        ``mma``, so each K/V byte of the group is read once instead of twice.
        Given, it also keeps MQA and groups of 32 or more on the decode kernels.
    group_kernel : {"tile", "wgmma"}, optional
        The prefill tile that runs MQA and large groups (below): ``"tile"``
        (``mma.sync``, its warps copying the keys) or ``"wgmma"`` (sm_90: one
        consumer warpgroup and a producer warpgroup). Named, it also takes
        groups of 16 to that tile. Default: ``"tile"``.
    qk_fp8 : bool
        For an fp8 cache on the tensor-core kernel: ``Q K^T`` in fp8 (sm_89+:
        ``mma.m16n8k32`` of E4M3 queries and the cache's codes as stored, no
        conversion of the keys). Each query head's row is quantised to E4M3
        with its own scale (``max |q| / 448``), which costs accuracy: about
        2**-4 relative in each query element (``docs/fp8.md``). Default False.

    MQA and GQA groups of 32 or more query heads run on the tensor-core
    prefill tile with split-K (``paged_numba._group_decode``) wherever it
    applies and ``tensor_cores`` is not False: ``num_partitions`` then counts
    its parts, and ``num_warps``, ``unroll``, ``stages``, ``pv_mma`` and
    ``key_rows`` do not apply.

    ``run`` checks the contents of new buffers only (or every step with
    ``validate=True``): an out-of-range block id or length written into the
    packed buffers later is not followed by the kernels but recorded, and
    :meth:`check` (or the cache's :meth:`~PagedKVCache.check`) raises it.

    Examples
    --------
    >>> import numpy as np
    >>> from numba import cuda
    >>> from paged_numba import PagedKVCache, DecodePlan
    >>> cache = PagedKVCache(num_blocks=4, block_size=8, num_kv_heads=1, head_size=16)
    >>> plan = DecodePlan(cache, num_seqs=1, num_heads=2, max_blocks=2)
    >>> plan
    DecodePlan(num_seqs=1, num_heads=2, head_size=16, heads_per_block=2, num_partitions=1, partition_size=16, scratch_bytes=0, tensor_cores=False)
    >>> q = cuda.to_device(np.ones((1, 2, 16), np.float16))
    >>> table, lens = cuda.to_device(np.array([[3, 1]], np.int32)), cuda.to_device(np.array([9], np.int32))
    >>> plan.run(q, table, lens).copy_to_host().shape        # [num_seqs, num_heads, head_size]
    (1, 2, 16)
    """

    def __init__(self, cache, num_seqs, num_heads, max_blocks, *, scale=None,
                 sliding_window=None, alibi_slopes=None, logits_soft_cap=None,
                 num_partitions=None, num_warps=None, unroll=UNROLL, stages=STAGES,
                 tensor_cores=None, pv_mma=None, key_rows=None, query_dtype=None,
                 heads_per_block=None, group_kernel=None, qk_fp8=False):
        V.check_cache(cache)
        V.check_head_size(cache.head_size)
        self.query_dtype = V.plan_query_dtype(cache, query_dtype)   # and the output's
        tensor_cores = C.optional_flag("tensor_cores", tensor_cores)
        pv_mma, key_rows = C.optional_flag("pv_mma", pv_mma), C.optional_flag("key_rows", key_rows)
        self.qk_fp8 = qk_fp8 = C.flag("qk_fp8", qk_fp8)
        num_seqs = C.integer("num_seqs", num_seqs, lo=0, hi=V.MAX_GRID_YZ)
        num_heads = C.integer("num_heads", num_heads, lo=1, hi=V.MAX_HEADS)
        V.check_heads(num_heads, cache)
        max_blocks = C.integer("max_blocks", max_blocks, lo=0)
        V.check_context(max_blocks, cache.block_size)
        self.cache, self.num_seqs, self.num_heads = cache, num_seqs, num_heads
        self.max_blocks = max_blocks
        head_size = cache.head_size
        self.scale = V.scale_of(scale, head_size)
        V.check_fp8_scale(cache, self.scale)
        self._variants = _variants(self.num_heads, sliding_window, alibi_slopes, logits_soft_cap)
        self._inputs = None
        self._like = LikeInput()
        self._decode = self._graph = self._group = None
        max_context = max(self.max_blocks * cache.block_size, 1)
        kernel = group_kernel_of(cache, group_kernel)
        tile = group_tile(cache, num_heads, C.optional_flag("tensor_cores", tensor_cores),
                          group_kernel)
        if tile is not None and heads_per_block is None:   # MQA, groups of 32 or more: the prefill tile
            self._plan_group(tile, num_partitions, max_context, kernel)
            return
        self.heads_per_block = hpb = _heads_per_block(
            heads_per_block, num_heads // cache.num_kv_heads, cache, tensor_cores, pv_mma)
        self.num_warps, self.num_partitions, self.partition_size = launch_shape(
            num_partitions, num_warps, cache, hpb, self.num_seqs, num_heads, max_context,
            unroll, stages, tensor_cores, pv_mma, key_rows, self.query_dtype, qk_fp8)
        tuning = (self.num_warps, unroll, stages)
        n, h, d, p = self.num_seqs, num_heads, head_size, self.num_partitions
        self.out = _arrays.zeros((n, h, d), self.query_dtype)
        self.lse = _arrays.zeros((n, h), np.float32)
        if p > 1:
            self.part_out = _arrays.zeros((n, p, h, d), np.float32)
            self.part_lse = _arrays.zeros((n, p, h), np.float32)
        else:
            self.part_out = self.out.reshape(n, 1, h, d)
            self.part_lse = self.lse.reshape(n, 1, h)
        # (kept: the same launch's kernel built otherwise, e.g. guard=False to time the guard)
        self._launch_args = (hpb, p > 1, tuning, tensor_cores, pv_mma, key_rows, self.query_dtype,
                             qk_fp8)
        self._kernel, self._threads, self.tensor_cores = _cache_launch(cache, *self._launch_args)
        self._grid = (h // hpb, n, p)
        self._merge = (_launch.PackedLaunch(merge_kernel(self.query_dtype.name), (h, n), 128,
                                            (self.out, self.lse, self.part_out, self.part_lse))
                       if p > 1 and n else None)

    def _plan_group(self, tile, num_partitions, max_context, kernel):
        n, h, d = self.num_seqs, self.num_heads, self.cache.head_size
        parts = group_parts(n, h // tile, max_context, _arrays.sm_count(), kernel) if (
            num_partitions is None) else C.integer("num_partitions", num_partitions, lo=1,
                                                   hi=V.MAX_GRID_YZ)
        self.heads_per_block, self.num_partitions, self.tensor_cores = tile, parts, True
        self.out = _arrays.zeros((n, h, d), self.cache.dtype)
        self.lse = _arrays.zeros((n, h), np.float32)
        self._group = GroupDecode(self.cache, n, h, tile, parts, self.scale, self._variants,
                                  self.out, self.lse, kernel=kernel)
        bn = self._group.block_n
        tiles = -(-max_context // bn)
        self.partition_size = -(-tiles // parts) * bn   # keys of a part, at most
        self.heads_per_block, self.num_warps = self._group.heads_per_block, self._group.num_warps
        self._merge = self._group.merge
        self.part_out, self.part_lse = self._group.part_out, self._group.part_lse

    @property
    def scratch_bytes(self):
        """Device bytes of split-K partial outputs and log-sum-exps."""
        if self.num_partitions == 1:
            return 0
        return (self.part_out.size + self.part_lse.size) * 4

    def run(self, query, block_tables, seq_lens, *, out=None, lse=None, stream=None,
            validate=False):
        """Launch decode attention for this step.

        Parameters
        ----------
        query : device array, ``[num_seqs, num_heads, head_size]``
        block_tables : device array of int32, ``[num_seqs, max_blocks]``
        seq_lens : device array of int32, ``[num_seqs]``
        out : device array, ``[num_seqs, num_heads, head_size]``, optional
            Write the output here (the cache's dtype, C-contiguous, sharing no
            memory with the query) and return it.
        lse : device array of float32, ``[num_seqs, num_heads]``, optional
            Write the log-sum-exps here (else into :attr:`lse`).
        stream : optional
            A numba, PyTorch or CuPy stream, a raw ``cudaStream_t`` int, or
            None (the default stream); ignored under the simulator.
        validate : bool
            Run :func:`paged_decode`'s checks first (copies tables to the host).
            Without it (the default) the contents of buffers already packed
            are not checked: a table entry outside the pool, or a length
            outside its table row, is not followed (the kernel reads block 0,
            or clamps the length; that sequence's output is wrong) but
            recorded, for :meth:`check` to raise.

        Returns
        -------
        out : device array, ``[num_seqs, num_heads, head_size]``
            ``out`` when given; else the plan's own :attr:`out`, overwritten
            by the next ``run`` (seen as a torch tensor for a torch query, a
            CuPy array for a CuPy one, without a copy). :attr:`lse` holds the
            log-sum-exps ``[num_seqs, num_heads]`` unless ``lse`` is given.

        Notes
        -----
        New ``out``/``lse`` buffers are checked and packed like new inputs:
        pass the same ones every step to keep the one-graph-launch path.
        """
        validate = C.flag("validate", validate)
        handle = _launch.stream_handle(stream)
        ns = _launch.numba_stream(handle)   # the host copies read what was written there
        inputs = (query, block_tables, seq_lens, out, lse)
        if self._inputs is None or any(a is not b for a, b in zip(inputs, self._inputs)):
            self._pack(inputs, ns)   # new buffers: checked (host copies) and packed once
        elif validate:
            self._check(inputs, ns)
        if self.num_seqs:
            self._graph(handle)
        if out is not None:
            return out
        return self._like(self.out, query, self.query_dtype)

    def check(self):
        """Raise ``ValueError`` for the first out-of-range block id or length
        the kernels were given since the last check (only possible with
        ``run(validate=False)``), and clear it: :meth:`PagedKVCache.check` of
        the plan's cache. Synchronises with the device.

        >>> import numpy as np
        >>> from numba import cuda
        >>> from paged_numba import PagedKVCache, DecodePlan
        >>> cache = PagedKVCache(num_blocks=4, block_size=8, num_kv_heads=1, head_size=16)
        >>> plan = DecodePlan(cache, num_seqs=1, num_heads=1, max_blocks=2)
        >>> q = cuda.to_device(np.ones((1, 1, 16), np.float16))
        >>> table = cuda.to_device(np.array([[3, 1]], np.int32))
        >>> lens = cuda.to_device(np.array([9], np.int32))
        >>> _ = plan.run(q, table, lens)                    # new buffers: checked, packed
        >>> table.copy_to_device(np.array([[3, 7]], np.int32))   # 7: not a block of the pool
        >>> _ = plan.run(q, table, lens)                    # the packed ones: not checked
        >>> plan.check()
        Traceback (most recent call last):
        ...
        ValueError: a kernel was given block_tables[0, 1] = 7 (validate=False), outside [0, 4);
        it read block 0 in its place, so sequence 0's output is wrong.
        >>> plan.check()                                    # cleared
        """
        self.cache.check()

    def _check(self, inputs, stream=0):
        query, block_tables, seq_lens, out, lse = inputs
        V.check_fp8_scale(self.cache, self.scale)         # k_scale may have changed since
        for name, x in zip(("query", "block_tables", "seq_lens"), inputs):
            if not _arrays.is_device_array(x):
                raise TypeError(f"DecodePlan.run needs device arrays, but {name} is "
                                f"{type(x).__name__}.")
        q = _arrays.as_device(query, "query")[0]
        expect = (self.num_seqs, self.num_heads, self.cache.head_size)
        if V.shape_of(q) != expect:
            raise ValueError(f"query must be {list(expect)} for this plan, but got {V.shape_of(q)}.")
        if not q.is_c_contiguous():
            raise ValueError(f"query must be C-contiguous, but got strides {q.strides}.")
        V.check_dtype("query", query, self.query_dtype)
        tables, tables_host = _int32_device("block_tables", block_tables, True, stream)
        lens, lens_host = _int32_device("seq_lens", seq_lens, True, stream)
        if V.shape_of(tables) != (self.num_seqs, self.max_blocks):
            raise ValueError(f"block_tables must be [{self.num_seqs}, {self.max_blocks}] for this "
                             f"plan, but got {V.shape_of(tables)}.")
        V.check_tables(tables_host, lens_host, self.cache.num_blocks, self.cache.block_size)
        n, h = self.num_seqs, self.num_heads
        inputs = (("query", q),) + cache_inputs(self.cache)
        out = plan_buffer("out", out, expect, self.query_dtype, query, inputs)
        lse = plan_buffer("lse", lse, (n, h), np.float32, query, inputs)
        if out is not None and lse is not None and _overlaps(out, lse):
            raise ValueError("out and lse share memory; they must be separate buffers.")
        return q, tables, lens, out, lse

    def _pack(self, inputs, stream=0):
        q, tables, lens, out, lse = self._check(inputs, stream)
        out = self.out if out is None else out
        lse = self.lse if lse is None else lse
        n, h, d = self.num_seqs, self.num_heads, self.cache.head_size
        if self._group is not None:
            launches = self._group.launches(q, tables, lens, out, lse)
            self._decode, self._graph = launches[0], _launch.GraphLaunch(launches)
            self._inputs = inputs
            return
        part_out, part_lse, merge = self.part_out, self.part_lse, self._merge
        if self.num_partitions == 1:
            part_out, part_lse = out.reshape(n, 1, h, d), lse.reshape(n, 1, h)
        elif merge is not None and (out is not self.out or lse is not self.lse):
            merge = _launch.PackedLaunch(merge_kernel(self.query_dtype.name), (h, n), 128,
                                         (out, lse, part_out, part_lse))
        args = (part_out, part_lse, q, self.cache.key_cache, self.cache.value_cache,
                tables, lens, np.float32(self.scale), np.int32(self.partition_size),
                *self._variants, self.cache.errors, *kernel_scales(self.cache))
        self._decode = _launch.PackedLaunch(self._kernel, self._grid, self._threads, args)
        # one graph launch per run (decode, then the split-K merge): less host time
        self._graph = _launch.GraphLaunch(
            [self._decode] + ([merge] if merge is not None else []))
        self._inputs = inputs

    def __repr__(self):
        return (f"DecodePlan(num_seqs={self.num_seqs}, num_heads={self.num_heads}, "
                f"head_size={self.cache.head_size}, heads_per_block={self.heads_per_block}, "
                f"num_partitions={self.num_partitions}, partition_size={self.partition_size}, "
                f"scratch_bytes={self.scratch_bytes}, tensor_cores={self.tensor_cores})")
