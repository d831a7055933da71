"""Prefill (and chunked prefill) attention over a paged KV cache: validate, plan tiles, launch."""
import numpy as np

from . import _arrays, _launch
from . import _checks as C
from . import _validate as V
from ._validate import check_lengths  # noqa: F401  (prefill.check_lengths, as before)
from .attention import _int32_device, _padded, _variants
from .cache import kernel_scales
from .interop import LikeInput, Results, cache_inputs, overlaps, plan_buffer
from .kernels import prefill_tc, prefill_tma
from .fp8 import is_fp8
from .kernels.merge import merge_kernel
from .kernels.prefill import prefill_kernel
from ._prefill_plan import (  # noqa: F401  (prefill.plan_tiles etc., as before)
    _OPTION_CHECKS, TILE_GROUP_BYTES, _host_int, _kernel_options, cuda_core_tiling,
    persistent_blocks, plan_tiles, tc_tiling, uses_tensor_cores)


class PrefillPlan:
    """Prefill attention planned once per batch and run many times.

    The constructor validates the lengths, builds the tile list (which
    sequence and first query each thread block handles), allocates the output,
    compiles the kernel and packs its launch; :meth:`run` then only enqueues
    one kernel (so it can be captured in a CUDA graph). Pass the same device
    buffers to every ``run`` to keep that fast path.

    Parameters
    ----------
    cache : PagedKVCache
    cu_seqlens_q : array of int, ``[num_seqs + 1]``
        Query rows of sequence ``i`` are ``cu_seqlens_q[i]:cu_seqlens_q[i + 1]``.
    seq_lens : array of int, ``[num_seqs]``
        Tokens of each sequence in the cache, this step's included. Both may
        be NumPy or CUDA arrays, lists or tuples (read on the host).
    num_heads : int
        Query heads, a multiple of ``cache.num_kv_heads``.
    causal, scale, sliding_window, alibi_slopes, logits_soft_cap
        As in :func:`paged_prefill`.
    tensor_cores : bool, optional
        Run the tensor-core kernel (default: where it applies, see
        :func:`uses_tensor_cores`).
    heads_per_block, block_q, block_n, num_warps : int, optional
        Tiling: query heads and query tokens per tile (``M =
        heads_per_block * block_q`` rows), keys per K/V tile, warps per
        block. Defaults from :func:`paged_numba.kernels.prefill.prefill_config`,
        or :func:`paged_numba.kernels.prefill_tc.prefill_tc_config` on tensor
        cores (on the simulator: one warp and 16-key tiles; on an sm_90 GPU,
        for prompts where the caller sets no tiling, ``kernel_options`` or
        ``num_parts``, the warpgroup kernel with a producer and turns, see
        :attr:`kernel_options`). On tensor cores
        each warp owns ``16 * m_tiles`` rows (``block_q = 16 * m_tiles *
        num_warps / heads_per_block``: give ``num_warps`` or ``block_q``, not
        both; ``m_tiles`` is 2 in the default prompt tilings up to head size
        128, else 1 unless ``kernel_options`` say otherwise) and ``block_n`` is
        a multiple of 16.
    kernel_options : dict, optional
        Keyword arguments of the tensor-core kernel's factory
        (:func:`paged_numba.kernels.prefill_tc.prefill_tc_kernel`: ``q_in_regs``,
        ``max_registers``, ``fast_exp2``, ``fma_softmax``, ``token_copies``,
        ``m_tiles``, ``wgmma``, ``producer``, ``swizzle``, ``stages``,
        ``pingpong``, ``persistent``, ``lazy_rescale``, ``prefetch_queries``,
        ``deferred_stores``, ``prefetch_ranges``, ``producer_registers``, ``split_halves``,
        ``mbarriers``, ``tensor_maps``, ``lean_loop``, ``split_rings``, ``fma_exp2``,
        ``lane_vote``, ``early_weights``, ``staged_p``), for
        studying its variants; they
        replace the defaults' (``prefill_tc_config``'s options); an error on
        CUDA cores. ``wgmma=True`` runs the warpgroup kernel
        (:mod:`paged_numba.kernels.prefill_wgmma`; sm_90 GPUs and the
        simulator; ``num_warps`` a multiple of 4, default 8 on a GPU);
        ``producer=True`` with it adds a warpgroup that does all the copies
        (:mod:`paged_numba.kernels.prefill_wgmma_ws`; ``num_warps`` 4 or 8
        counts the others; ``stages`` its ring, 3 to 7, default 4;
        ``pingpong=True``: two consumer warpgroups take turns at the tensor
        cores, at most 4 stages; ``persistent``, with turns: ``True`` for one
        thread block a multiprocessor, or a number of blocks, each taking
        several tiles in turn), and ``swizzle=True`` lays the tiles out in
        the swizzled layout; ``lazy_rescale=True`` (with ``wgmma``) moves a
        row's running maximum only when it grows by more than ``2**8`` in
        the weights, so O is rarely rescaled after the first tiles;
        ``prefetch_queries=True`` (with ``persistent``, no split) copies a
        block's next item's queries into a second buffer while the current
        item runs, a few copies each time a warpgroup has issued products
        (32 KB more shared memory at head size 128); ``deferred_stores=True``
        (with ``prefetch_queries``) stores an item's output rows during the
        next item's products instead of before them; ``fma_exp2=True`` (with
        ``producer`` and ``fast_exp2``) computes a quarter of the softmax's
        exponentials on the FMA pipe instead of the special-function unit
        (``fma_exp2=k``, k = 1, 2, 4 or 8: those of every k-th 8-key n-tile);
        ``lane_vote=True`` (with ``producer``) lets a warp none of whose lanes'
        own row maxima would move its row's maximum (beyond the lazy slack
        with ``lazy_rescale``) take the weights without exchanging the maxima
        in each quad (the same results); ``early_weights=True`` (with
        ``lane_vote``) takes the weights against the kept maxima before the
        vote, beside the lanes' maxima, and keeps them where it passes (the
        same results); ``staged_p=True`` (with ``producer``) packs P's words
        in the softmax, into staging registers that are copied in once the
        last tile's ``P V`` has landed (the same results);
        ``prefetch_ranges=True`` (with ``persistent``) reads the next item's
        tile entries and sequence bounds while the current item runs;
        ``producer_registers`` (with ``producer``, 8 warps; a multiple of 8
        from 24 to 160) the producer's registers a thread, the consumers
        taking the rest of the block's (default 40, 64 when persistent);
        ``split_halves=True`` (with ``producer`` and ``swizzle``) the K/V
        tiles in the layout a tensor-map copy writes (each 128-byte column
        group's rows in turn); ``mbarriers=True`` (with ``pingpong``, not
        fp8) has the producer's copies arrive at a stage's mbarrier as they
        land, so that it never waits for them; ``tensor_maps=True`` (with
        both, an ``"nhd"`` or ``"hnd"`` cache, block size 8 or more) has the
        copy engine copy every tile whose keys are all valid, one producer
        thread issuing a box copy a page (the plan makes the pools' tensor
        maps once); ``lean_loop=True`` (with ``producer``) runs the
        consumers' key loop with 32-bit counters and each tile's mask decided
        before its scores land (the same results, fewer instructions);
        ``split_rings=True`` (with ``lean_loop``, not fp8, ``mbarriers`` or
        ``tensor_maps``) gives keys and values rings of their own, ``stages``
        each (2 with ``pingpong``; shared memory as a joint ring of
        ``stages``), so that a tile of twice the keys fits at head size 256.
    num_parts : int, optional
        Split-K on tensor cores: each tile's keys in ``num_parts`` parts run
        by separate thread blocks, their states merged by
        :func:`merge_states`'s kernel (default 1: no split). For batches of
        few tiles and long contexts (decode-like batches, MQA, large GQA
        groups), where one block a tile leaves most SMs idle.
    query_dtype : {"float16", "bfloat16", "float32"}, optional
        For an fp8 cache: the queries' and the output's dtype (default
        float16). With float16 or bfloat16 queries at head size 64 or 128
        (not the ``"vllm"`` layout) on an sm_90 GPU, the tensor-core producer
        kernel runs, widening the 8-bit codes into its tiles
        (:mod:`paged_numba.kernels.prefill_fp8`); elsewhere the CUDA-core
        kernel reads them. Either applies the cache's scales. Other caches
        take their own dtype only.
    tile_group_bytes : int, optional
        The order of the tiles: longest first within groups of sequences
        whose keys, in the cache's bytes (K and V, every KV head), fit in
        this many bytes, one group after the other (:func:`plan_tiles`), so
        that the tiles in flight read K/V that the L2 cache holds. Default
        ``TILE_GROUP_BYTES``, 12 MiB (a quarter of an H100's or H200's 50 MB
        L2); 0: one group, the longest tiles first over the whole batch.

    Examples
    --------
    >>> import numpy as np
    >>> from numba import cuda
    >>> from paged_numba import PagedKVCache, PrefillPlan
    >>> cache = PagedKVCache(num_blocks=4, block_size=8, num_kv_heads=1, head_size=16)
    >>> plan = PrefillPlan(cache, cu_seqlens_q=[0, 3], seq_lens=[5], num_heads=2)
    >>> q = cuda.to_device(np.ones((3, 2, 16), np.float16))
    >>> plan.run(q, cuda.to_device(np.array([[1]], np.int32))).copy_to_host().shape
    (3, 2, 16)
    """

    def __init__(self, cache, cu_seqlens_q, seq_lens, num_heads, *, causal=True, scale=None,
                 sliding_window=None, alibi_slopes=None, logits_soft_cap=None,
                 tensor_cores=None, heads_per_block=None, block_q=None, block_n=None,
                 num_warps=None, kernel_options=None, num_parts=None, query_dtype=None,
                 tile_group_bytes=None):
        V.check_cache(cache)
        V.check_head_size(cache.head_size)
        self.query_dtype = V.plan_query_dtype(cache, query_dtype)   # and the output's
        num_heads = C.integer("num_heads", num_heads, lo=1, hi=V.MAX_HEADS)
        V.check_heads(num_heads, cache)
        self.causal = C.flag("causal", causal)
        options = _kernel_options(kernel_options)
        self.cache, self.num_heads = cache, num_heads
        lens = _host_int("seq_lens", seq_lens)
        if lens.ndim != 1:
            raise ValueError(f"seq_lens must be [num_seqs], but got shape {V.shape_of(lens)}.")
        bad = np.flatnonzero(lens < 0)
        if bad.size:
            raise ValueError(f"seq_lens[{int(bad[0])}] is {int(lens[bad[0]])}; sequence lengths "
                             f"must be >= 0.")
        cu = _host_int("cu_seqlens_q", cu_seqlens_q)
        self.total_q = int(cu[-1]) if cu.ndim == 1 and cu.size else 0
        self.q_lens = check_lengths(cu, lens, self.total_q)
        self.num_seqs = int(lens.size)
        self.scale = V.scale_of(scale, cache.head_size)
        V.check_fp8_scale(cache, self.scale)
        # the plan's uploads and fills go on the default stream, waited for once at
        # the end (paged_prefill makes a plan a call), so any stream may run it
        self._variants = _variants(num_heads, sliding_window, alibi_slopes, logits_soft_cap, 0)
        window = int(self._variants[2]) or None
        group = num_heads // cache.num_kv_heads
        max_q = int(self.q_lens.max(initial=1))
        self.tensor_cores = uses_tensor_cores(cache, tensor_cores, self.query_dtype)
        fp8 = is_fp8(cache.dtype)
        if options and not self.tensor_cores:
            raise ValueError(f"kernel_options apply to the tensor-core kernel, but this plan runs "
                             f"on CUDA cores; got {options!r}.")
        self.num_parts = 1 if num_parts is None else C.integer("num_parts", num_parts, lo=1,
                                                               hi=1024)
        if self.num_parts > 1 and not self.tensor_cores:
            raise ValueError(f"num_parts (split-K) applies to the tensor-core kernel, but this "
                             f"plan runs on CUDA cores; got num_parts={self.num_parts}.")
        if self.tensor_cores:
            # the defaults' options, then the caller's; the warpgroup default only
            # where the caller chose no tiling, option or split
            auto = (not options and self.num_parts == 1 and
                    (heads_per_block, block_q, block_n, num_warps) == (None,) * 4)
            if fp8:     # the producer kernel widens the codes; its prompt tiling
                # (the lean loop, the default's, not yet checked on a GPU with fp8 pools)
                # (and without the head size 128 default's lazy rescaling and vote)
                options = {"wgmma": True, "producer": True, "lean_loop": False,
                           "lazy_rescale": False, "lane_vote": False, **options}
                max_q = None
            *tiling, defaults = tc_tiling(
                cache, group, max_q, heads_per_block, block_q, block_n, num_warps,
                options.get("m_tiles"), options.get("wgmma", False),
                options.get("producer", False), options.get("stages"), auto,
                options.get("prefetch_queries", False), fp8)
            options = {**defaults, **options}
        else:
            tiling = cuda_core_tiling(cache, group, max_q, heads_per_block, block_q, block_n,
                                      num_warps)
        self.heads_per_block, self.block_q, self.block_n, self.num_warps = tiling
        self.tile_group_bytes = group = (
            TILE_GROUP_BYTES if tile_group_bytes is None else
            C.integer("tile_group_bytes", tile_group_bytes, lo=0))
        key_bytes = 2 * cache.num_kv_heads * cache.head_size * cache.dtype.itemsize
        tile_seq, tile_q0 = plan_tiles(self.q_lens, lens, self.block_q, self.causal, window,
                                       group // key_bytes if group else None)
        self.num_tiles = int(tile_seq.size)
        self._cu = _arrays.as_device(cu.astype(np.int32), "cu_seqlens_q", 0)[0]
        self._lens = _arrays.as_device(lens.astype(np.int32), "seq_lens", 0)[0]
        self._lens_host = lens.astype(np.int32)
        self._tiles = (_arrays.as_device(tile_seq, "tile_seq", 0)[0],
                       _arrays.as_device(tile_q0, "tile_q0", 0)[0])
        d = cache.head_size
        self.out = _arrays.zeros((self.total_q, num_heads, d), self.query_dtype, 0)
        self.lse = _arrays.zeros((self.total_q, num_heads), np.float32, 0)
        self._parts = None
        if self.num_parts > 1:          # split-K partial states, merged into out and lse
            self._parts = (_arrays.zeros((self.total_q, self.num_parts, num_heads, d), np.float32,
                                         0),
                           _arrays.zeros((self.total_q, self.num_parts, num_heads), np.float32, 0))
            options["split_k"] = True
        persistent = options.get("persistent", False)
        if persistent is not False:     # the factory takes a flag, the grid the blocks
            options["persistent"] = True
        #: the tensor-core kernel factory's keyword arguments ({} on CUDA cores)
        self.kernel_options = dict(options) if self.tensor_cores else {}
        self._maps = ()                 # the tensor maps a kernel with tensor_maps takes
        if self.tensor_cores:
            fp8_args = dict(kv_dtype=cache.dtype.name) if fp8 else {}
            self._kernel = prefill_tc.prefill_tc_kernel(
                d, cache.block_size, self.heads_per_block, self.block_n,
                np.dtype(self.query_dtype).name, cache.layout, self.num_warps, **options,
                **fp8_args)
            if options.get("tensor_maps"):      # the pools' maps, made once a plan
                self._maps = prefill_tma.pool_maps(cache.key_cache, cache.value_cache,
                                                   cache.layout, self.block_n)
        else:
            self._kernel = prefill_kernel(d, cache.block_size, self.heads_per_block, self.block_q,
                                          self.block_n, cache.dtype.name, cache.layout,
                                          self.num_warps)
        self._grid = (self.num_tiles, num_heads // self.heads_per_block, self.num_parts)
        if persistent is not False:     # (tile, head block) items, taken in turn
            items = self.num_tiles * (num_heads // self.heads_per_block)
            self._grid = (persistent_blocks(persistent, items, _arrays.sm_count()), 1,
                          self.num_parts)
        self._inputs = None
        self._launch = None
        self._like = LikeInput()
        _arrays.default_stream_done()

    def run(self, query, block_tables, *, out=None, lse=None, stream=None, validate=False):
        """Launch prefill attention.

        Parameters
        ----------
        query : device array, ``[total_q, num_heads, head_size]``
        block_tables : device array of int32, ``[num_seqs, max_blocks]``
            Either may also be a host array (``block_tables`` a list of rows):
            it is copied to the device and the launch packed again at every
            call, as for any new buffer; keep device buffers to replay.
        out : device array, ``[total_q, num_heads, head_size]``, optional
            Write the output here (the cache's dtype, C-contiguous, sharing no
            memory with the query) and return it.
        lse : device array of float32, ``[total_q, num_heads]``, optional
            Write the log-sum-exps here (else into :attr:`lse`).
        stream : optional
            A numba, PyTorch or CuPy stream, a raw ``cudaStream_t`` int, or
            None (the default stream); ignored under the simulator.
        validate : bool
            Check the query's shape and dtype and the table's entries (copies it
            to the host) even when the buffers are the ones already packed.
            Without it new contents of a packed table are not checked: a block
            id outside the pool is read as block 0 and recorded, for
            :meth:`check` to raise.

        Returns
        -------
        out : device array, ``[total_q, num_heads, head_size]``
            ``out`` when given; else the plan's own :attr:`out`, overwritten
            by the next ``run`` (seen as a torch tensor for a torch query, a
            CuPy array for a CuPy one, without a copy). :attr:`lse`
            ``[total_q, num_heads]`` float32 holds the log-sum-exps unless
            ``lse`` is given. New ``out``/``lse`` buffers are packed like new inputs.
        """
        validate = C.flag("validate", validate)
        handle = _launch.stream_handle(stream)
        ns = _launch.numba_stream(handle)
        inputs = (query, block_tables, out, lse)
        if self._inputs is None or any(a is not b for a, b in zip(inputs, self._inputs)):
            self._pack(inputs, stream=ns)
        elif validate:
            self._check(inputs, True, ns)
        if self.num_tiles:
            self._launch(handle)
        if out is not None:
            return out
        return self._like(self.out, query, self.query_dtype)

    def check(self):
        """Raise ``ValueError`` for the first block id outside the pool that a
        run without validation met (``PagedKVCache.check`` of the plan's
        cache, whose error word every kernel on it shares), and clear it."""
        self.cache.check()

    def _check(self, inputs, validate=True, stream=0):
        query, block_tables, out, lse = inputs
        V.check_fp8_scale(self.cache, self.scale)         # k_scale may have changed since
        q = _arrays.as_device(query, "query", stream)[0]
        expect = (self.total_q, self.num_heads, self.cache.head_size)
        if V.shape_of(q) != expect:
            raise ValueError(f"query must be [total_q, num_heads, head_size] = {list(expect)}, "
                             f"but got {V.shape_of(q)}.")
        V.check_dtype("query", q, self.query_dtype)
        tables, tables_host = _int32_device("block_tables", block_tables, validate, stream)
        V.check_ndim("block_tables", tables, 2, "[num_seqs, max_blocks]")
        if tables.shape[0] != self.num_seqs:
            raise ValueError(f"block_tables must have num_seqs = {self.num_seqs} rows, but got "
                             f"shape {V.shape_of(tables)}.")
        if validate:
            V.check_tables(tables_host, self._lens_host, self.cache.num_blocks,
                           self.cache.block_size)
        inputs = (("query", q),) + cache_inputs(self.cache)
        out = plan_buffer("out", out, expect, self.query_dtype, query, inputs)
        lse = plan_buffer("lse", lse, expect[:2], np.float32, query, inputs)
        if out is not None and lse is not None and overlaps(out, lse):
            raise ValueError("out and lse share memory; they must be separate buffers.")
        return q, tables, out, lse

    def _pack(self, inputs, validate=True, stream=0):
        """Check ``inputs`` and pack the launch; ``stream`` (numba's) is the
        one the uploads and host copies of host or new inputs go on: the launch's."""
        q, tables, out, lse = self._check(inputs, validate, stream)
        out = self.out if out is None else out
        lse = self.lse if lse is None else lse
        c = self.cache
        outs = self._parts or (out, lse)
        args = (*outs, q, c.key_cache, c.value_cache, tables, self._cu, self._lens,
                *self._tiles, np.float32(self.scale), np.int32(self.causal), *self._variants,
                c.errors, *kernel_scales(c), *self._maps)
        threads = getattr(self._kernel, "block_threads", 32 * self.num_warps)
        launch = _launch.PackedLaunch(self._kernel, self._grid, threads, args)
        if self._parts is None:
            self._launch = launch
        else:
            merge = _launch.PackedLaunch(merge_kernel(np.dtype(self.query_dtype).name),
                                         (self.num_heads, self.total_q),
                                         128, (out, lse, *self._parts))

            def both(stream):
                launch(stream)
                merge(stream)
            self._launch = both
        self._inputs = inputs

    def __repr__(self):
        return (f"PrefillPlan(num_seqs={self.num_seqs}, total_q={self.total_q}, "
                f"num_heads={self.num_heads}, head_size={self.cache.head_size}, "
                f"heads_per_block={self.heads_per_block}, block_q={self.block_q}, "
                f"block_n={self.block_n}, num_warps={self.num_warps}, num_tiles={self.num_tiles}, "
                f"num_parts={self.num_parts}, "
                f"tensor_cores={self.tensor_cores})")


def paged_prefill(query, cache, block_tables, cu_seqlens_q, seq_lens=None, causal=True,
                  scale=None, sliding_window=None, alibi_slopes=None, logits_soft_cap=None, *,
                  return_lse=False, validate=True, tensor_cores=None, out=None, lse=None,
                  stream=None, **tiling):
    """Prefill attention over a paged KV cache: many query tokens per sequence.

    A batch may mix whole prompts, chunks of prompts that follow cached
    tokens (chunked prefill) and single decode tokens. The queries' own keys
    and values must already be in the cache (``write_kv`` first).

    Parameters
    ----------
    query : array, ``[total_q, num_heads, head_size]``
        The query tokens of all sequences, packed by ``cu_seqlens_q``; NumPy
        or CUDA array (numba, PyTorch, CuPy) of the cache's dtype (over an fp8
        cache: float16, bfloat16 or float32, the output's dtype too).
    cache : PagedKVCache
        Holds ``num_kv_heads`` heads; ``num_heads`` must be a multiple of it.
    block_tables : array of int32, ``[num_seqs, max_blocks]``, or CSRTable
        Physical block of each logical block, ``-1`` past the used ones (an
        array, or a list of rows); or FlashInfer's CSR page table as
        :class:`~paged_numba.CSRTable` ``(kv_indptr [num_seqs + 1],
        kv_indices [nnz], kv_last_page_len [num_seqs])``, as in
        :func:`~paged_numba.paged_decode`. Integer arrays here
        (``cu_seqlens_q``, ``seq_lens``) may also be lists or tuples.
    cu_seqlens_q : array of int32, ``[num_seqs + 1]``
        Query rows of sequence ``i`` are ``cu_seqlens_q[i]:cu_seqlens_q[i + 1]``
        (query lengths ``[10, 3, 1]`` give ``[0, 10, 13, 14]``). A sequence
        may have no query rows (it is skipped).
    seq_lens : array of int32, ``[num_seqs]``
        Tokens of each sequence in the cache, this step's included, so
        ``q_len <= seq_len`` (None with a CSR table). Query ``j`` of
        sequence ``i`` sits at position ``seq_lens[i] - q_len_i + j``.
    causal : bool
        Each query attends to keys at positions up to its own; ``False``:
        to all ``seq_len`` keys.
    scale : float, optional
        Logit scale, default ``1 / sqrt(head_size)``.
    sliding_window : int, optional
        Admit only keys ``k`` with ``p - k < sliding_window`` (``p``: the
        query's position).
    alibi_slopes : array of float32, ``[num_heads]``, optional
        Add ``slope_h * (k - p)`` to the logits (after the soft cap).
    logits_soft_cap : float, optional
        Replace each logit ``s`` by ``c * tanh(s / c)`` first.
    return_lse : bool
        Also return the log-sum-exps ``[total_q, num_heads]`` float32.
    tensor_cores : bool, optional
        As in :class:`PrefillPlan`: default, tensor cores where they apply.
    validate : bool
        Check shapes, dtypes and table entries first. The lengths are always
        read on the host (the tile list is built from them); use
        :class:`PrefillPlan` to plan once and launch without host copies.
    out : array, ``[total_q, num_heads, head_size]``, optional
        Write the output here and return it: the query's dtype, C-contiguous,
        a NumPy array for a NumPy query (filled after the launch), else a
        device array (numba, PyTorch, CuPy; a tensor on the query's device)
        sharing no memory with the query. Checked before any launch.
    lse : array of float32, ``[total_q, num_heads]``, optional
        Write the log-sum-exps here, as ``out`` (returned with ``return_lse``).
    stream : optional
        A numba, PyTorch or CuPy stream, a raw ``cudaStream_t`` int, or None
        (the default stream); ignored under the simulator.
    **tiling
        ``heads_per_block``, ``block_q``, ``block_n``, ``num_warps``,
        ``kernel_options``, ``num_parts`` as in :class:`PrefillPlan`.

    Returns
    -------
    out : array, ``[total_q, num_heads, head_size]``
        In the query's dtype and library: ``out`` when given, else NumPy for
        a NumPy query, a torch tensor for a torch one (CuPy for CuPy), a
        numba device array otherwise. A query that admits no key gets zeros
        (lse ``-inf``).

    Notes
    -----
    Arguments are checked as in :func:`paged_numba.paged_decode` (``causal``,
    ``return_lse`` and ``validate`` must be bools). NaN and Inf in the data
    give what the float64 reference gives (:mod:`paged_numba.reference`): a
    masked key's value reaches no output on CUDA cores. The tensor-core
    kernels (the default on fp16 and bf16) follow that rule for queries and
    keys but not for values: they multiply a tile of weights by a tile of
    values in one product, so a NaN or ``inf`` in a value reaches, as NaN
    (``0 * NaN``), the rows of its tile that do not attend it (a causal
    diagonal tile's later keys, a partial tile's padding).

    Examples
    --------
    >>> import numpy as np
    >>> from paged_numba import PagedKVCache, paged_prefill, write_kv
    >>> cache = PagedKVCache(num_blocks=4, block_size=4, num_kv_heads=1, head_size=8)
    >>> rng = np.random.default_rng(0)
    >>> kv = rng.standard_normal((6, 1, 8)).astype(np.float16)
    >>> write_kv(cache, kv, kv, slot_mapping=np.array([8, 9, 10, 11, 4, 5]))  # blocks 2, 1
    >>> q = rng.standard_normal((2, 2, 8)).astype(np.float16)   # the 2 newest tokens
    >>> out = paged_prefill(q, cache, np.array([[2, 1]], np.int32), np.array([0, 2], np.int32),
    ...                     np.array([6], np.int32))
    >>> out.shape, out.dtype
    ((2, 2, 8), dtype('float16'))
    """
    V.check_cache(cache)
    return_lse, validate = C.flag("return_lse", return_lse), C.flag("validate", validate)
    handle = _launch.stream_handle(stream)
    ns = _launch.numba_stream(handle)    # every copy and fill goes ahead of the kernels on it
    q, from_host = _arrays.as_device(query, "query", ns)
    total_q, num_heads, head_size = V.check_query(query, q, cache,
                                                  "[total_q, num_heads, head_size]")
    block_tables, seq_lens = _padded(block_tables, seq_lens, cache, validate, ns)
    cu = _host_int("cu_seqlens_q", cu_seqlens_q, ns)
    if seq_lens is not None and not isinstance(seq_lens, (list, tuple)):
        seq_lens = _host_int("seq_lens", seq_lens, ns)       # read after the caller's writes
    if cu.ndim != 1 or cu.size == 0:
        raise ValueError(f"cu_seqlens_q must be [num_seqs + 1], but got shape {V.shape_of(cu)}.")
    if int(cu[-1]) != total_q:
        raise ValueError(f"cu_seqlens_q[-1] must equal total_q = {total_q} (query rows), but got "
                         f"{int(cu[-1])}.")
    plan = PrefillPlan(cache, cu, seq_lens, num_heads, causal=causal, scale=scale,
                       sliding_window=sliding_window, alibi_slopes=alibi_slopes,
                       logits_soft_cap=logits_soft_cap, tensor_cores=tensor_cores,
                       query_dtype=V.compute_dtype("query", query, cache), **tiling)
    results = Results(query, out, lse, (total_q, num_heads, head_size), plan.query_dtype,
                      (total_q, num_heads),
                      (() if from_host else (("query", q),)) + cache_inputs(cache),
                      spare=(plan.out, plan.lse), stream=ns)
    plan._pack((q, block_tables, results.out, results.lse), validate, ns)
    if plan.num_tiles:
        plan._launch(handle)
    return results.finish(return_lse)
