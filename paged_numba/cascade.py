"""Cascade (shared-prefix) decode: the shared prefix once for the whole batch,
each sequence's own suffix alone, then the (m, l) merge.

When ``num_seqs`` sequences share the KV cache of a long prefix (a system
prompt, the prompt of parallel sampling or beam search), plain decode reads
the prefix's K/V once per sequence. Cascade decode splits every sequence's
keys into two parts, as FlashInfer's cascade wrappers do:

1. **prefix**: one prefill-style launch in which the batch's decode queries,
   taken as the query rows of one sequence, attend the shared blocks without
   a causal mask (:class:`~paged_numba.prefill.PrefillPlan`, ``causal=False``).
   A thread block holds many query rows, so each K/V tile of the prefix is
   read once per tile of rows rather than once per sequence. A batch fills
   few such tiles, so on tensor cores the prefix's keys are also split into
   ``prefix_parts`` parts run by separate thread blocks (the prefill plan's
   split-K, merged inside it);
2. **suffix**: ordinary decode over each sequence's own blocks
   (:class:`~paged_numba.attention.DecodePlan`);
3. **merge**: both passes return their log-sum-exps, and
   ``merge_states``'s kernel combines the two states of every row exactly:
   ``out = (e^(s1 - M) o1 + e^(s2 - M) o2) / (e^(s1 - M) + e^(s2 - M))``.

Sequence ``i`` holds ``shared_len + seq_lens[i]`` tokens: positions
``0 .. shared_len - 1`` in ``shared_block_table`` and the rest in its own
``block_tables[i]`` (whose first block starts at position ``shared_len``,
so the prefix need not end on a block boundary). Its query is its newest
token, at position ``shared_len + seq_lens[i] - 1``.

The prefill kernel requires ``q_len <= seq_len``; when the batch has more
sequences than the prefix has tokens, the rows are cut into chunks of at
most ``shared_len`` rows over the same table, still in one launch. Only
position-free variants apply to both parts (``scale``, ``logits_soft_cap``):
the prefix pass does not know each row's position, so there is no sliding
window or ALiBi here.

Each part's output is rounded to the cache's dtype before the merge (as in
FlashInfer); ``paged_numba.testing.cascade_reference`` bounds that.
"""

import numpy as np
from numba import config, cuda

from . import _arrays, _launch
from . import _checks as C
from . import _validate as V
from .attention import DecodePlan, _int32_device
from .interop import LikeInput, Results, cache_inputs, overlaps, plan_buffer
from .kernels.merge import merge_kernel
from .prefill import PrefillPlan, uses_tensor_cores

MIN_PREFIX_PART = 256   # the prefix split never makes parts shorter than this (tokens)

__all__ = ["CascadeDecodePlan", "cascade_decode"]


def _count(name, value, allow_zero=True):
    """``value`` as an int, after checking it is a non-negative (positive) integer."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) \
            or value < (0 if allow_zero else 1):
        kind = "a non-negative integer" if allow_zero else "a positive integer"
        raise ValueError(f"{name} must be {kind}, but got {value!r}.")
    return int(value)


def check_shared_table(shared_block_table, shared_len, cache, stream=0):
    """The used entries of ``shared_block_table`` as host int32 ``[ceil(shared_len /
    block_size)]``, after checking that it is a 1-D integer array long enough for
    ``shared_len`` tokens whose used entries are block ids of ``cache`` (a
    device table is read after the work on numba stream ``stream``).

    >>> from paged_numba import PagedKVCache
    >>> cache = PagedKVCache(num_blocks=4, block_size=4, num_kv_heads=1, head_size=8)
    >>> check_shared_table(np.array([3, 1, -1], np.int32), 6, cache)    # 6 = 4 + 2: 2 blocks
    array([3, 1], dtype=int32)
    >>> check_shared_table(np.array([3, -1], np.int32), 6, cache)
    Traceback (most recent call last):
        ...
    ValueError: shared_block_table[1] is -1, but shared_len = 6 uses its first 2 entries, which must be block ids in [0, 4).
    """
    shared_len = _count("shared_len", shared_len)
    if isinstance(shared_block_table, (list, tuple)):
        shared_block_table = C.int_sequence("shared_block_table", shared_block_table)
    table = np.asarray(_arrays.to_host(shared_block_table, None, stream))
    V.check_int_array("shared_block_table", table)
    if table.ndim != 1:
        raise ValueError(f"shared_block_table must be [max_shared_blocks], but got shape "
                         f"{V.shape_of(table)}.")
    used = -(-shared_len // cache.block_size)
    if used > table.size:
        raise ValueError(f"shared_len = {shared_len} needs {used} blocks of {cache.block_size} "
                         f"tokens, but shared_block_table has only {table.size} entries.")
    bad = np.flatnonzero((table[:used] < 0) | (table[:used] >= cache.num_blocks))
    if bad.size:
        j = int(bad[0])
        raise ValueError(f"shared_block_table[{j}] is {int(table[j])}, but shared_len = "
                         f"{shared_len} uses its first {used} entries, which must be block ids "
                         f"in [0, {cache.num_blocks}).")
    return table[:used].astype(np.int32)


def _pair_view(base):
    """``base [2, n, ...]`` seen as ``[n, 2, ...]`` (no copy): the state axis second,
    as the merge kernel reads it."""
    if config.ENABLE_CUDASIM:
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        return FakeCUDAArray(base._ary.swapaxes(0, 1))
    shape, strides = list(base.shape), list(base.strides)
    shape[0], shape[1], strides[0], strides[1] = shape[1], shape[0], strides[1], strides[0]
    return cuda.devicearray.DeviceNDArray(tuple(shape), tuple(strides), base.dtype,
                                          gpu_data=base.gpu_data)


class _Copy:
    """``dst[...] = src`` between two C-contiguous device arrays of the same size,
    enqueued on a stream (``cuMemcpyDtoDAsync`` with the pointers taken once)."""

    def __init__(self, dst, src):
        if dst.nbytes != src.nbytes:
            raise ValueError(f"copy of {src.nbytes} bytes into {dst.nbytes}")
        self.dst, self.src = dst, src
        if config.ENABLE_CUDASIM:
            return
        from cuda.bindings import driver as drv

        self._copy, self._ok = drv.cuMemcpyDtoDAsync, drv.CUresult.CUDA_SUCCESS
        self._args = (dst.__cuda_array_interface__["data"][0],
                      src.__cuda_array_interface__["data"][0], dst.nbytes)

    def __call__(self, stream=None):
        if config.ENABLE_CUDASIM:
            self.dst.copy_to_device(self.src)
            return
        err, = self._copy(*self._args, _launch.stream_handle(stream))
        if err != self._ok:
            raise RuntimeError(f"cuMemcpyDtoDAsync failed: {err!r}")


def prefix_parts_for(tiles, shared_len, sm_count):
    """Parts of the prefix's keys (split-K of the prefix pass): enough for
    ``tiles`` thread-block tiles times the parts to fill ``sm_count``
    multiprocessors, with parts of at least :data:`MIN_PREFIX_PART` tokens.

    >>> prefix_parts_for(16, 4096, 132)      # 64 rows x 8 KV heads: 16 tiles -> 9 parts
    9
    >>> prefix_parts_for(16, 300, 132)       # too short to split
    1
    """
    return max(1, min(-(-sm_count // max(tiles, 1)), shared_len // MIN_PREFIX_PART, 1024))


class CascadeDecodePlan:
    """Cascade decode planned once per shared prefix and batch shape, run every step.

    The constructor checks the shared prefix, builds the prefix pass's tile
    list (a :class:`~paged_numba.prefill.PrefillPlan` over the shared blocks),
    the suffixes' :class:`~paged_numba.attention.DecodePlan` and the merge,
    and allocates their buffers. The prefix stays fixed while the suffixes
    grow by one token a step, so a plan serves a whole decode phase (as
    FlashInfer's ``plan()`` serves every layer of a step): :meth:`run` only
    enqueues the two passes, four device-to-device copies that gather both
    states into the merge's input, and the merge; it can be captured in a
    CUDA graph.

    Parameters
    ----------
    cache : PagedKVCache
        One layer's cache (``cache.layer(i)`` of a layered one).
    shared_block_table : array of int, ``[max_shared_blocks]``
        Physical blocks of the shared prefix in order; the first
        ``ceil(shared_len / block_size)`` are used (``-1`` may pad the rest).
    shared_len : int
        Tokens in the shared prefix (>= 0; 0 leaves only the suffix pass).
    num_seqs, num_heads : int
        Batch size and query heads of the queries :meth:`run` will get.
    max_blocks : int
        Columns of the suffix block tables :meth:`run` will get.
    scale : float, optional
        Logit scale, default ``1 / sqrt(head_size)``.
    logits_soft_cap : float, optional
        Replace each logit ``s`` by ``c tanh(s / c)`` in both parts.
    num_partitions : int, optional
        Split-K partitions of the suffix pass (default: the decode heuristic).
    prefix_parts : int, optional
        Split-K parts of the prefix pass (tensor cores only; default
        :func:`prefix_parts_for` of its tile count, 1 on CUDA cores).
    tensor_cores : bool, optional
        Passed to both plans: default, tensor cores where they apply.

    Notes
    -----
    The shared blocks' K/V must be written before :meth:`run`, and stay put
    while the plan is in use (a :class:`~paged_numba.BlockManager` fork keeps
    them: they are full or never appended to by the forks, see
    :meth:`~paged_numba.BlockManager.append`).

    Examples
    --------
    >>> import numpy as np
    >>> from numba import cuda
    >>> from paged_numba import CascadeDecodePlan, PagedKVCache
    >>> cache = PagedKVCache(num_blocks=6, block_size=4, num_kv_heads=1, head_size=8)
    >>> plan = CascadeDecodePlan(cache, [0, 1], shared_len=7, num_seqs=2, num_heads=2,
    ...                          max_blocks=1)                 # 7 = 4 + 3: blocks 0, 1
    >>> plan
    CascadeDecodePlan(num_seqs=2, num_heads=2, head_size=8, shared_len=7, prefix_chunks=1, prefix_tiles=1, prefix_parts=1, suffix_partitions=1)
    >>> q = cuda.to_device(np.ones((2, 2, 8), np.float16))
    >>> tables = cuda.to_device(np.array([[2], [3]], np.int32))
    >>> lens = cuda.to_device(np.array([1, 2], np.int32))     # 7 + 1 and 7 + 2 tokens
    >>> plan.run(q, tables, lens).copy_to_host().shape        # [num_seqs, num_heads, head_size]
    (2, 2, 8)
    """

    def __init__(self, cache, shared_block_table, shared_len, num_seqs, num_heads, max_blocks,
                 *, scale=None, logits_soft_cap=None, num_partitions=None, prefix_parts=None,
                 tensor_cores=None):
        V.check_cache(cache)
        V.check_head_size(cache.head_size)
        if cache.dtype.name.startswith("float8"):
            raise ValueError(f"cascade decode does not take fp8 caches yet, but dtype is "
                             f"{cache.dtype.name}; paged_decode and paged_prefill do.")
        self.num_seqs = n = C.integer("num_seqs", num_seqs, lo=0, hi=V.MAX_GRID_YZ)
        self.num_heads = h = C.integer("num_heads", num_heads, lo=1, hi=V.MAX_HEADS)
        V.check_heads(h, cache)
        self.max_blocks = _count("max_blocks", max_blocks)
        table = check_shared_table(shared_block_table, shared_len, cache)
        tc = uses_tensor_cores(cache, tensor_cores)
        if prefix_parts is not None:
            prefix_parts = C.integer("prefix_parts", prefix_parts, lo=1, hi=1024)
            if prefix_parts > 1 and not tc:
                raise ValueError(f"prefix_parts (split-K of the prefix pass) needs the tensor-core "
                                 f"prefill kernel, but this cache ({cache.dtype.name}, head_size "
                                 f"{cache.head_size}) runs on CUDA cores; got "
                                 f"prefix_parts={prefix_parts}.")
        self.cache, self.shared_len = cache, int(shared_len)
        d = cache.head_size
        self._suffix = DecodePlan(cache, n, h, self.max_blocks, scale=scale,
                                  logits_soft_cap=logits_soft_cap, num_partitions=num_partitions,
                                  tensor_cores=tensor_cores)
        self._prefix = None
        self._like, self._targets = LikeInput(), None
        self.prefix_chunks = self.prefix_parts = 0
        if not (self.shared_len and n):
            self.out, self.lse = self._suffix.out, self._suffix.lse
            return
        # rows in chunks of at most shared_len (the prefill kernel needs q_len <= seq_len)
        chunk = min(n, self.shared_len)
        self.prefix_chunks = chunks = -(-n // chunk)
        cu = np.minimum(np.arange(chunks + 1) * chunk, n).astype(np.int32)
        lens = np.full(chunks, self.shared_len, np.int32)

        def prefix_plan(parts):
            return PrefillPlan(cache, cu, lens, h, causal=False, scale=scale,
                               logits_soft_cap=logits_soft_cap, tensor_cores=tensor_cores,
                               num_parts=parts)

        self._prefix = prefix_plan(prefix_parts)
        if prefix_parts is None and tc:
            parts = prefix_parts_for(self.prefix_tiles, self.shared_len, _arrays.sm_count())
            if parts > 1:
                self._prefix = prefix_plan(parts)
        self.prefix_parts = self._prefix.num_parts
        self._shared_tables = _arrays.as_device(np.repeat(table[None], chunks, axis=0),
                                                "shared_block_table")[0]
        # -- the merge's input: state 0 the prefix, state 1 the suffix
        self._states_v = _arrays.zeros((2, n, h, d), cache.dtype)
        self._states_s = _arrays.zeros((2, n, h), np.float32)
        self.out = _arrays.zeros((n, h, d), cache.dtype)
        self.lse = _arrays.zeros((n, h), np.float32)
        threads = 32 * min(4, -(-d // 32))     # a thread per output element, up to 128
        self._merge = _launch.PackedLaunch(
            merge_kernel(cache.dtype.name, cache.dtype.name, threads), (h, n), threads,
            (self.out, self.lse, _pair_view(self._states_v), _pair_view(self._states_s)))
        self._gather = [_Copy(self._states_v[0], self._prefix.out),
                        _Copy(self._states_s[0], self._prefix.lse),
                        _Copy(self._states_v[1], self._suffix.out),
                        _Copy(self._states_s[1], self._suffix.lse)]

    @property
    def prefix_tiles(self):
        """Thread-block tiles of the prefix pass's launch (0 without one)."""
        if self._prefix is None:
            return 0
        return self._prefix.num_tiles * (self.num_heads // self._prefix.heads_per_block)

    def run(self, query, block_tables, seq_lens, *, out=None, lse=None, stream=None,
            validate=False):
        """Launch cascade decode for this step.

        Parameters
        ----------
        query : device array, ``[num_seqs, num_heads, head_size]``
        block_tables : device array of int32, ``[num_seqs, max_blocks]``
            Each sequence's own blocks (its suffix), ``-1`` past the used ones.
        seq_lens : device array of int32, ``[num_seqs]``
            Suffix tokens of each sequence, the new one included (0: the
            sequence attends the prefix alone).
        out : device array, ``[num_seqs, num_heads, head_size]``, optional
            Write the output here (the cache's dtype, C-contiguous, sharing no
            memory with the query) and return it.
        lse : device array of float32, ``[num_seqs, num_heads]``, optional
            Write the log-sum-exps here (else into :attr:`lse`).
        stream : optional
            A numba, PyTorch or CuPy stream, a raw ``cudaStream_t`` int, or
            None (the default stream); ignored under the simulator.
        validate : bool
            Check the suffix tables again (host copies) even when the buffers
            are the ones already packed.

        Returns
        -------
        out : device array, ``[num_seqs, num_heads, head_size]``
            ``out`` when given; else the plan's own, overwritten by the next
            ``run`` (seen as a torch tensor for a torch query, CuPy for CuPy);
            :attr:`lse` ``[num_seqs, num_heads]`` float32 holds the
            log-sum-exps over prefix and suffix unless ``lse`` is given.
        """
        _arrays.require_device("CascadeDecodePlan.run", query=query, block_tables=block_tables,
                               seq_lens=seq_lens)
        handle = _launch.stream_handle(stream)
        if self._prefix is None:
            return self._suffix.run(query, block_tables, seq_lens, out=out, lse=lse,
                                    stream=handle, validate=validate)
        merge = self._merge_into(query, out, lse)
        self._suffix.run(query, block_tables, seq_lens, stream=handle, validate=validate)
        self._prefix.run(query, self._shared_tables, stream=handle)
        # -- gather both states (the plans own their outputs), then merge them
        for copy in self._gather:
            copy(handle)
        merge(handle)
        if out is not None:
            return out
        return self._like(self.out, query, self.cache.dtype)

    def _merge_into(self, query, out, lse):
        """The merge launch writing ``out``/``lse`` (checked when they change)."""
        if (out is None or out is self.out) and (lse is None or lse is self.lse):
            return self._merge
        if self._targets is not None and self._targets[0] is out and self._targets[1] is lse:
            return self._targets[2]
        q = _arrays.as_device(query, "query")[0]
        n, h, d = self.num_seqs, self.num_heads, self.cache.head_size
        inputs = (("query", q),) + cache_inputs(self.cache)
        out_dev = plan_buffer("out", out, (n, h, d), self.cache.dtype, query, inputs)
        lse_dev = plan_buffer("lse", lse, (n, h), np.float32, query, inputs)
        if out_dev is not None and lse_dev is not None and overlaps(out_dev, lse_dev):
            raise ValueError("out and lse share memory; they must be separate buffers.")
        threads = self._merge.block
        merge = _launch.PackedLaunch(
            merge_kernel(self.cache.dtype.name, self.cache.dtype.name, threads), (h, n), threads,
            (self.out if out_dev is None else out_dev, self.lse if lse_dev is None else lse_dev,
             *self._merge.args[2:]))
        self._targets = (out, lse, merge)
        return merge

    def __repr__(self):
        return (f"CascadeDecodePlan(num_seqs={self.num_seqs}, num_heads={self.num_heads}, "
                f"head_size={self.cache.head_size}, shared_len={self.shared_len}, "
                f"prefix_chunks={self.prefix_chunks}, prefix_tiles={self.prefix_tiles}, "
                f"prefix_parts={self.prefix_parts}, "
                f"suffix_partitions={self._suffix.num_partitions})")


def cascade_decode(query, cache, shared_block_table, shared_len, block_tables, seq_lens,
                   scale=None, *, logits_soft_cap=None, num_partitions=None, prefix_parts=None,
                   return_lse=False, validate=True, tensor_cores=None, out=None, lse=None,
                   stream=None):
    """Decode attention for a batch that shares a prefix: the prefix once, the
    suffixes apart, merged by log-sum-exp (see the module docstring).

    Equal, up to rounding, to :func:`~paged_numba.paged_decode` over each
    sequence's whole context (the shared blocks followed by its own).

    Parameters
    ----------
    query : array, ``[num_seqs, num_heads, head_size]``
        One query token a sequence; NumPy or CUDA array of the cache's dtype.
    cache : PagedKVCache
        Holds ``num_kv_heads`` heads; ``num_heads`` must be a multiple of it.
    shared_block_table : array of int, ``[max_shared_blocks]``
        Blocks of the shared prefix; the first ``ceil(shared_len / block_size)`` are used.
    shared_len : int
        Tokens of the shared prefix (>= 0), at positions ``0 .. shared_len - 1``.
    block_tables : array of int32, ``[num_seqs, max_blocks]``
        Each sequence's own blocks, holding its positions from ``shared_len``
        on; ``-1`` past the used ones.
    seq_lens : array of int32, ``[num_seqs]``
        Tokens of each suffix, the new one included (>= 0; 0: the query
        attends the prefix alone). Sequence ``i``'s query sits at position
        ``shared_len + seq_lens[i] - 1``.
        The integer arrays (``shared_block_table``, ``block_tables``,
        ``seq_lens``) may also be lists or tuples (a table: a list of rows).
    scale : float, optional
        Logit scale, default ``1 / sqrt(head_size)``.
    logits_soft_cap : float, optional
        Replace each logit ``s`` by ``c tanh(s / c)`` first.
    num_partitions : int, optional
        Split-K partitions of the suffix pass.
    prefix_parts : int, optional
        Split-K parts of the prefix pass, as in :class:`CascadeDecodePlan`.
    return_lse : bool
        Also return the log-sum-exps over both parts, ``[num_seqs, num_heads]``
        float32 (``-inf`` where a sequence has no token at all).
    validate : bool
        Check shapes, dtypes and table entries before anything is launched
        (copies device tables to the host). Turn off only in benchmarks.
    tensor_cores : bool, optional
        As in :class:`CascadeDecodePlan`.
    out, lse : arrays, optional
        ``[num_seqs, num_heads, head_size]`` and float32 ``[num_seqs,
        num_heads]``: written in place and returned, as in
        :func:`~paged_numba.paged_decode`.
    stream : optional
        A numba, PyTorch or CuPy stream, a raw ``cudaStream_t`` int, or None
        (the default stream); ignored under the simulator.

    Returns
    -------
    out : array, ``[num_seqs, num_heads, head_size]``
        In the query's dtype and library: ``out`` when given, else NumPy for
        a NumPy query, a torch tensor for a torch one (CuPy for CuPy), a
        numba device array otherwise.

    Notes
    -----
    ``ValueError`` (naming the argument and its value) before any launch for:
    a query that does not fit the cache, a ``shared_len`` the shared table
    cannot hold or a bad entry in its used part, suffix tables or lengths of
    the wrong shape, negative lengths, or bad entries in their used parts.

    Examples
    --------
    Two sequences share an 8-token prefix (blocks 0 and 1) and own 3 and 1
    tokens (blocks 2 and 3). The cascade equals plain decode over the whole
    contexts (tables ``[0, 1, 2]`` and ``[0, 1, 3]``, 11 = 2 * 4 + 3 and 9 tokens):

    >>> import numpy as np
    >>> from paged_numba import PagedKVCache, cascade_decode, paged_decode, write_kv
    >>> cache = PagedKVCache(num_blocks=4, block_size=4, num_kv_heads=1, head_size=8,
    ...                      dtype="float32")
    >>> rng = np.random.default_rng(0)
    >>> kv = rng.standard_normal((16, 1, 8)).astype(np.float32)
    >>> write_kv(cache, kv, kv, slot_mapping=np.arange(16))
    >>> q = rng.standard_normal((2, 2, 8)).astype(np.float32)
    >>> out = cascade_decode(q, cache, np.array([0, 1], np.int32), 8,
    ...                      np.array([[2], [3]], np.int32), np.array([3, 1], np.int32))
    >>> whole = paged_decode(q, cache, np.array([[0, 1, 2], [0, 1, 3]], np.int32),
    ...                      np.array([11, 9], np.int32))
    >>> out.shape, bool(np.abs(out - whole).max() < 1e-5)
    ((2, 2, 8), True)
    >>> cascade_decode(q, cache, np.array([0], np.int32), 8, np.array([[2], [3]], np.int32),
    ...                np.array([3, 1], np.int32))
    Traceback (most recent call last):
        ...
    ValueError: shared_len = 8 needs 2 blocks of 4 tokens, but shared_block_table has only 1 entries.
    """
    V.check_cache(cache)
    validate, return_lse = C.flag("validate", validate), C.flag("return_lse", return_lse)
    handle = _launch.stream_handle(stream)
    ns = _launch.numba_stream(handle)    # every copy and fill goes ahead of the kernels on it
    q, from_host = _arrays.as_device(query, "query", ns)
    num_seqs, num_heads, _ = V.check_query(query, q, cache, "[num_seqs, num_heads, head_size]")
    table = check_shared_table(shared_block_table, shared_len, cache, ns)
    tables, tables_host = _int32_device("block_tables", block_tables, validate, ns)
    lens, lens_host = _int32_device("seq_lens", seq_lens, validate, ns)
    V.check_ndim("block_tables", tables, 2, "[num_seqs, max_blocks]")
    if tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must have num_seqs = {num_seqs} rows, but got shape "
                         f"{V.shape_of(tables)}.")
    if validate:
        V.check_tables(tables_host, lens_host, cache.num_blocks, cache.block_size)
    if scale is not None:
        C.real("scale", scale)
    plan = CascadeDecodePlan(cache, table, shared_len, num_seqs, num_heads, tables.shape[1],
                             scale=scale, logits_soft_cap=logits_soft_cap,
                             num_partitions=num_partitions, prefix_parts=prefix_parts,
                             tensor_cores=tensor_cores)
    results = Results(query, out, lse, (num_seqs, num_heads, cache.head_size), cache.dtype,
                      (num_seqs, num_heads),
                      (() if from_host else (("query", q),)) + cache_inputs(cache),
                      spare=(plan.out, plan.lse), stream=ns)
    plan.run(q, tables, lens, out=results.out, lse=results.lse, stream=handle)
    return results.finish(return_lse)
