"""Decode attention planned once per batch shape (:class:`DecodePlan`): the
checks, the launch, the split-K merge and the CUDA graph, packed once and
replayed by :meth:`DecodePlan.run`."""
import numpy as np

from . import _arrays, _launch
from . import _checks as C
from . import _validate as V
from ._decode_launch import _cache_launch, _heads_per_block, launch_shape
from ._group_decode import GroupDecode, group_parts, group_tile
from ._group_decode import group_kernel as group_kernel_of
from .cache import kernel_scales
from .interop import LikeInput, cache_inputs, plan_buffer
from .interop import overlaps as _overlaps
from .kernels.tuning import STAGES, UNROLL

_int32_device, _variants = V.int32_device, V.variants


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
    pdl : bool
        Split-K on the tensor-core kernels or the prefill tile (sm_90): launch
        the merge with programmatic dependent launch, so that it starts while
        the decode blocks finish and waits for their partial states itself
        (``kernels/pdl.py``); the same outputs. Default False; :attr:`pdl`
        says whether it applies to this plan.

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
                 heads_per_block=None, group_kernel=None, qk_fp8=False, pdl=False):
        V.check_cache(cache)
        V.check_head_size(cache.head_size)
        self.query_dtype = V.plan_query_dtype(cache, query_dtype)   # and the output's
        tensor_cores = C.optional_flag("tensor_cores", tensor_cores)
        pv_mma, key_rows = C.optional_flag("pv_mma", pv_mma), C.optional_flag("key_rows", key_rows)
        self.qk_fp8 = qk_fp8 = C.flag("qk_fp8", qk_fp8)
        self.pdl = C.flag("pdl", pdl)
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
            unroll, stages, tensor_cores, pv_mma, key_rows, self.query_dtype, qk_fp8, self.pdl)
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
        self._kernel, self._threads, self.tensor_cores = _cache_launch(
            cache, *self._launch_args, pdl=self.pdl)
        self.pdl = self.pdl and self.tensor_cores and p > 1     # where it applies
        self._grid = (h // hpb, n, p)
        self._merge = (self._merge_launch(self.out, self.lse) if p > 1 and n else None)

    def _merge_launch(self, out, lse):
        """The split-K merge of the partial states into ``out`` and ``lse``."""
        return _launch.merge_launch(self.query_dtype.name, out, lse, self.part_out,
                                    self.part_lse, self.pdl)

    def _plan_group(self, tile, num_partitions, max_context, kernel):
        n, h, d = self.num_seqs, self.num_heads, self.cache.head_size
        parts = group_parts(n, h // tile, max_context, _arrays.sm_count(), kernel) if (
            num_partitions is None) else C.integer("num_partitions", num_partitions, lo=1,
                                                   hi=V.MAX_GRID_YZ)
        self.heads_per_block, self.num_partitions, self.tensor_cores = tile, parts, True
        self.out = _arrays.zeros((n, h, d), self.cache.dtype)
        self.lse = _arrays.zeros((n, h), np.float32)
        self._group = GroupDecode(self.cache, n, h, tile, parts, self.scale, self._variants,
                                  self.out, self.lse, kernel=kernel, pdl=self.pdl)
        self.pdl = self._group.pdl
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
        _arrays.require_device("DecodePlan.run", query=query, block_tables=block_tables,
                               seq_lens=seq_lens)
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
            merge = self._merge_launch(out, lse)
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
