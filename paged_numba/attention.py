"""Public attention entry points: validate inputs, pick a launch, run the kernels."""
import math

import numpy as np

from . import _arrays, _launch
from . import _validate as V
from .kernels import decode_tc
from .kernels.decode import heads_per_block
from .kernels.merge import merge_kernel
from .kernels.specializations import decode_signatures
from .kernels.tuning import (NUM_WARPS, STAGES, UNROLL, decode_launch, fitting_warps,
                             resident_blocks)

MIN_PARTITION = 256   # split-K never makes partitions shorter than this (tokens)
PARTITION_COST = 256  # fixed cost of a thread block in the split-K model, in tokens
MERGE_COST = 128      # fixed cost of the split's merge launch in that model, in tokens
SM_RATE_EXPONENT = 0.36   # k blocks on one SM stream k ** 0.36 times as fast as one
SPLIT_MARGIN = 0.05   # split only for a modelled gain above this


def _int32_device(name, x, validate):
    """Device int32 array for a kernel argument plus a host copy when validating."""
    V.check_int_array(name, x)
    if isinstance(x, np.ndarray):
        host = np.ascontiguousarray(x, dtype=np.int32)
        if validate and not np.array_equal(host, x):
            raise ValueError(f"{name} does not fit in int32.")
        return _arrays.as_device(host, name)[0], host
    dev, _ = _arrays.as_device(x, name)
    if np.dtype(dev.dtype) != np.int32:
        raise ValueError(f"{name} on the device must be int32, but got {np.dtype(dev.dtype).name}.")
    return dev, (dev.copy_to_host() if validate else None)


def _padded(block_tables, seq_lens, cache, validate):
    """Accept a padded table or FlashInfer's CSR triple; return ``(block_tables, seq_lens)``.

    A CSR page table ``(kv_indptr [num_seqs + 1], kv_indices [nnz],
    kv_last_page_len [num_seqs])`` is converted to the padded ``[num_seqs,
    max_blocks]`` form on the host (``seq_lens`` may then be None: it follows
    from the CSR arrays)."""
    if not (isinstance(block_tables, (tuple, list)) and len(block_tables) == 3):
        if seq_lens is None:
            raise ValueError("seq_lens is required with a padded block table.")
        return block_tables, seq_lens
    from .page_tables import csr_to_padded, validate_csr

    indptr, indices, last = (np.asarray(_arrays.to_host(a)) for a in block_tables)
    if validate:
        validate_csr(indptr, indices, last, cache.num_blocks, cache.block_size)
    tables, lens = csr_to_padded(indptr, indices, last, cache.block_size)
    if seq_lens is not None:
        given = np.asarray(_arrays.to_host(seq_lens))
        if given.shape != lens.shape or not np.array_equal(given, lens):
            raise ValueError(f"seq_lens {given.tolist()} disagree with the CSR page table, "
                             f"which gives {lens.tolist()}.")
    return tables, lens


def _variants(num_heads, sliding_window, alibi_slopes, logits_soft_cap):
    """Validated ``(alibi_slopes device [num_heads] float32, soft_cap, window)`` kernel arguments."""
    window = 0
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or int(sliding_window) != sliding_window \
                or sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive integer, but got {sliding_window!r}.")
        window = int(sliding_window)
    soft_cap = 0.0
    if logits_soft_cap is not None:
        soft_cap = float(logits_soft_cap)
        if not (math.isfinite(soft_cap) and soft_cap > 0):
            raise ValueError(f"logits_soft_cap must be a positive number, but got {logits_soft_cap!r}.")
    if alibi_slopes is None:
        slopes = np.zeros(num_heads, np.float32)
    else:
        slopes = np.asarray(_arrays.to_host(alibi_slopes))
        if slopes.shape != (num_heads,) or not np.issubdtype(slopes.dtype, np.floating):
            raise ValueError(f"alibi_slopes must be float [num_heads] = [{num_heads}], but got "
                             f"{slopes.dtype} {V.shape_of(slopes)}.")
        if not np.isfinite(slopes).all():
            raise ValueError("alibi_slopes must be finite.")
        slopes = slopes.astype(np.float32)
    return _arrays.as_device(slopes, "alibi_slopes")[0], np.float32(soft_cap), np.int32(window)


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
                  pv_mma=None, key_rows=None):
    return decode_launch(cache.head_size, cache.block_size, hpb, cache.dtype.name, cache.layout,
                         split, tuning, tensor_cores, pv_mma, key_rows)


def _partitions(num_partitions, cache, hpb, num_seqs, num_heads, max_context, tuning,
                tensor_cores=None, pv_mma=None, key_rows=None):
    """Validated split-K ``(num_partitions, partition_size)``; the default comes
    from :func:`num_partitions_for` with the split kernel's occupancy (for the
    tensor-core kernel, at most the blocks that saturate HBM)."""
    if num_partitions is None:
        kernel, threads, tc = _cache_launch(cache, hpb, True, tuning, tensor_cores, pv_mma,
                                            key_rows)
        split = decode_signatures(cache.dtype.name, cache.layout)[1]
        resident = resident_blocks(kernel, split, threads)
        if tc:   # blocks past HBM saturation only add per-partition costs
            resident = min(resident, decode_tc.saturating_blocks(cache.head_size, threads // 32))
        num_partitions = num_partitions_for(num_seqs, num_heads // hpb, max_context,
                                            _arrays.sm_count(), resident)
    if isinstance(num_partitions, bool) or int(num_partitions) != num_partitions \
            or num_partitions < 1:
        raise ValueError(f"num_partitions must be a positive integer, but got {num_partitions!r}.")
    partition_size = max(-(-max_context // int(num_partitions)), 1)
    return max(-(-max_context // partition_size), 1), partition_size


def launch_shape(num_partitions, num_warps, cache, hpb, num_seqs, num_heads, max_context,
                 unroll=UNROLL, stages=STAGES, tensor_cores=None, pv_mma=None, key_rows=None):
    """``(num_warps, num_partitions, partition_size)`` of a decode launch; None
    picks: :func:`fitting_warps` (static) for the tensor-core kernel
    (``NUM_WARPS`` for the other), and :func:`num_partitions_for`'s split.
    More warps than fit the static shared memory are the caller's choice
    (the ring then lives in dynamic shared memory): on the H200 they did not
    beat the split (``experiments/NOTES.md``, session 9)."""
    tc = tensor_cores is not False and decode_tc.supports(cache.head_size, hpb,
                                                          cache.dtype.name, cache.layout)
    if num_warps is None:
        num_warps = fitting_warps(cache.head_size, stages) if tc else NUM_WARPS
    tuning = (int(num_warps), int(unroll), int(stages))
    parts, size = _partitions(num_partitions, cache, hpb, num_seqs, num_heads, max_context,
                              tuning, tensor_cores, pv_mma, key_rows)
    return tuning[0], parts, size


def paged_decode(query, cache, block_tables, seq_lens=None, scale=None, *,
                 sliding_window=None, alibi_slopes=None, logits_soft_cap=None,
                 num_partitions=None, return_lse=False, validate=True, pv_mma=None,
                 key_rows=None):
    """Decode attention over a paged KV cache: one query token per sequence.

    Parameters
    ----------
    query : array, ``[num_seqs, num_heads, head_size]``
        NumPy or CUDA array (numba, PyTorch, CuPy) of the cache's dtype.
    cache : PagedKVCache
        Holds ``num_kv_heads`` heads; ``num_heads`` must be a multiple of it
        (GQA; ``num_kv_heads = 1`` is MQA).
    block_tables : array of int32, ``[num_seqs, max_blocks]``, or CSR triple
        Physical block of each logical block, ``-1`` past the used ones; or
        FlashInfer's ``(kv_indptr [num_seqs + 1], kv_indices [nnz],
        kv_last_page_len [num_seqs])`` (converted on the host).
    seq_lens : array of int32, ``[num_seqs]``
        Tokens of each sequence in the cache, the new one included (may be
        None with a CSR table).
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
        the host). Turn off only in benchmarks.
    pv_mma, key_rows : bool, optional
        Variants of the tensor-core kernel (other rounding; ignored where the
        other kernel runs): P @ V on tensor cores (default True), and the keys
        copied in whole rows and read by ``ldmatrix`` (default: in the unsplit
        kernel only). Both False give the kernel with P @ V in fp32 FMAs.

    Returns
    -------
    out : array, ``[num_seqs, num_heads, head_size]``
        In the query's dtype; NumPy when the query is NumPy, else a numba
        device array. A sequence with ``seq_len == 0`` gets zeros.

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
    q, from_host = _arrays.as_device(query, "query")
    num_seqs, num_heads, head_size = V.check_query(query, q, cache,
                                                   "[num_seqs, num_heads, head_size]")
    block_tables, seq_lens = _padded(block_tables, seq_lens, cache, validate)
    tables, tables_host = _int32_device("block_tables", block_tables, validate)
    lens, lens_host = _int32_device("seq_lens", seq_lens, validate)
    V.check_ndim("block_tables", tables, 2, "[num_seqs, max_blocks]")
    if tables.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables must have num_seqs = {num_seqs} rows, but got shape {V.shape_of(tables)}.")
    if validate:
        V.check_tables(tables_host, lens_host, cache.num_blocks, cache.block_size)
    if scale is None:
        scale = 1.0 / math.sqrt(head_size)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, but got {scale}.")
    variants = _variants(num_heads, sliding_window, alibi_slopes, logits_soft_cap)
    hpb = heads_per_block(num_heads // cache.num_kv_heads)
    max_context = tables.shape[1] * cache.block_size
    num_warps, num_partitions, partition_size = launch_shape(
        num_partitions, None, cache, hpb, num_seqs, num_heads, max_context, pv_mma=pv_mma,
        key_rows=key_rows)

    out = _arrays.zeros((num_seqs, num_heads, head_size), cache.dtype)
    lse = _arrays.zeros((num_seqs, num_heads), np.float32)
    if num_seqs:
        kernel, threads, _ = _cache_launch(cache, hpb, num_partitions > 1,
                                           (num_warps, UNROLL, STAGES), pv_mma=pv_mma,
                                           key_rows=key_rows)
        grid = (num_heads // hpb, num_seqs, num_partitions)
        args = (q, cache.key_cache, cache.value_cache, tables, lens, np.float32(scale),
                np.int32(partition_size), *variants)
        if num_partitions == 1:
            _launch.PackedLaunch(kernel, grid, threads,
                                 (out.reshape(num_seqs, 1, num_heads, head_size),
                                  lse.reshape(num_seqs, 1, num_heads), *args))()
        else:
            part_out = _arrays.zeros((num_seqs, num_partitions, num_heads, head_size), np.float32)
            part_lse = _arrays.zeros((num_seqs, num_partitions, num_heads), np.float32)
            _launch.PackedLaunch(kernel, grid, threads, (part_out, part_lse, *args))()
            merge_kernel(cache.dtype.name)[(num_heads, num_seqs), 128](out, lse, part_out,
                                                                       part_lse)
    if from_host:
        out, lse = _arrays.to_host(out, cache.dtype), lse.copy_to_host()
    return (out, lse) if return_lse else out


def merge_states(v, s, *, validate=True):
    """Merge partial attention states with the (m, l) rule.

    State ``k`` of row ``i`` is attention over one part of the keys: its
    output ``v[i, k]`` (normalised by its own exp-sum) and its log-sum-exp
    ``s[i, k]`` (natural log). The merged state is attention over all parts.

    Parameters
    ----------
    v : array, ``[num_rows, num_states, num_heads, head_size]``
        float16, float32 or bfloat16 partial outputs.
    s : array of float32, ``[num_rows, num_states, num_heads]``
        Their log-sum-exps; ``-inf`` marks an empty state.

    Returns
    -------
    out : array, ``[num_rows, num_heads, head_size]`` in ``v``'s dtype
    lse : array of float32, ``[num_rows, num_heads]``

    Examples
    --------
    >>> import numpy as np
    >>> from paged_numba import merge_states
    >>> v = np.array([[[[1.0]], [[3.0]]]], np.float32)        # two states, [1, 2, 1, 1]
    >>> s = np.array([[[0.0], [0.0]]], np.float32)            # equal weights
    >>> out, lse = merge_states(v, s)
    >>> float(out[0, 0, 0]), round(float(lse[0, 0]), 4)      # (1 + 3) / 2, log(2)
    (2.0, 0.6931)
    """
    vd, from_host = _arrays.as_device(v, "v")
    sd, _ = _arrays.as_device(s, "s")
    if validate:
        V.check_ndim("v", vd, 4, "[num_rows, num_states, num_heads, head_size]")
        V.check_ndim("s", sd, 3, "[num_rows, num_states, num_heads]")
        if V.shape_of(sd) != V.shape_of(vd)[:3]:
            raise ValueError(
                f"s must be [num_rows, num_states, num_heads] = {V.shape_of(vd)[:3]}, but got "
                f"{V.shape_of(sd)}.")
        if np.dtype(sd.dtype) != np.float32:
            raise ValueError(f"s must be float32, but got {np.dtype(sd.dtype).name}.")
    dt = _arrays.logical_dtype(v)
    if dt == np.uint16 and not isinstance(v, np.ndarray):   # bf16 bits on the device
        dt = _arrays.BFLOAT16
    if validate and dt.name not in ("float16", "float32", "bfloat16"):
        raise ValueError(f"v must be float16, float32 or bfloat16, but got {dt.name}.")
    n, _, h, d = V.shape_of(vd)
    out = _arrays.zeros((n, h, d), dt)
    lse = _arrays.zeros((n, h), np.float32)
    if n and h:
        merge_kernel(dt.name, dt.name)[(h, n), 128](out, lse, vd, sd)
    if from_host:
        return _arrays.to_host(out, dt), lse.copy_to_host()
    return out, lse


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
                 tensor_cores=None, pv_mma=None, key_rows=None):
        V.check_cache(cache)
        V.check_head_size(cache.head_size)
        V.check_heads(num_heads, cache)
        self.cache, self.num_seqs, self.num_heads = cache, int(num_seqs), int(num_heads)
        self.max_blocks = int(max_blocks)
        head_size = cache.head_size
        self.scale = 1.0 / math.sqrt(head_size) if scale is None else float(scale)
        if not math.isfinite(self.scale):
            raise ValueError(f"scale must be finite, but got {scale}.")
        self._variants = _variants(self.num_heads, sliding_window, alibi_slopes, logits_soft_cap)
        self.heads_per_block = hpb = heads_per_block(num_heads // cache.num_kv_heads)
        max_context = max(self.max_blocks * cache.block_size, 1)
        self.num_warps, self.num_partitions, self.partition_size = launch_shape(
            num_partitions, num_warps, cache, hpb, self.num_seqs, num_heads, max_context,
            unroll, stages, tensor_cores, pv_mma, key_rows)
        tuning = (self.num_warps, int(unroll), int(stages))
        n, h, d, p = self.num_seqs, num_heads, head_size, self.num_partitions
        self.out = _arrays.zeros((n, h, d), cache.dtype)
        self.lse = _arrays.zeros((n, h), np.float32)
        if p > 1:
            self.part_out = _arrays.zeros((n, p, h, d), np.float32)
            self.part_lse = _arrays.zeros((n, p, h), np.float32)
        else:
            self.part_out = self.out.reshape(n, 1, h, d)
            self.part_lse = self.lse.reshape(n, 1, h)
        self._kernel, self._threads, self.tensor_cores = _cache_launch(
            cache, hpb, p > 1, tuning, tensor_cores, pv_mma, key_rows)
        self._grid = (h // hpb, n, p)
        self._merge = (_launch.PackedLaunch(merge_kernel(cache.dtype.name), (h, n), 128,
                                            (self.out, self.lse, self.part_out, self.part_lse))
                       if p > 1 and n else None)
        self._inputs = None
        self._decode = self._graph = None

    @property
    def scratch_bytes(self):
        """Device bytes of split-K partial outputs and log-sum-exps."""
        if self.num_partitions == 1:
            return 0
        return (self.part_out.size + self.part_lse.size) * 4

    def run(self, query, block_tables, seq_lens, *, stream=None, validate=False):
        """Launch decode attention for this step.

        Parameters
        ----------
        query : device array, ``[num_seqs, num_heads, head_size]``
        block_tables : device array of int32, ``[num_seqs, max_blocks]``
        seq_lens : device array of int32, ``[num_seqs]``
        stream : optional
            numba stream, PyTorch stream, or raw ``cudaStream_t``; default stream if None.
        validate : bool
            Run :func:`paged_decode`'s checks first (copies tables to the host).

        Returns
        -------
        out : device array, ``[num_seqs, num_heads, head_size]``
            Owned by the plan and overwritten by the next ``run``. With
            split-K, :attr:`lse` holds the log-sum-exps ``[num_seqs, num_heads]``.
        """
        inputs = (query, block_tables, seq_lens)
        if self._inputs is None or any(a is not b for a, b in zip(inputs, self._inputs)):
            self._pack(inputs)   # new buffers: checked (host copies) and packed once
        elif validate:
            self._check(inputs)
        if self.num_seqs:
            self._graph(stream)
        return self.out

    def _check(self, inputs):
        query, block_tables, seq_lens = inputs
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
        V.check_dtype("query", query, self.cache.dtype)
        tables, tables_host = _int32_device("block_tables", block_tables, True)
        lens, lens_host = _int32_device("seq_lens", seq_lens, True)
        if V.shape_of(tables) != (self.num_seqs, self.max_blocks):
            raise ValueError(f"block_tables must be [{self.num_seqs}, {self.max_blocks}] for this "
                             f"plan, but got {V.shape_of(tables)}.")
        V.check_tables(tables_host, lens_host, self.cache.num_blocks, self.cache.block_size)
        return q, tables, lens

    def _pack(self, inputs):
        q, tables, lens = self._check(inputs)
        args = (self.part_out, self.part_lse, q, self.cache.key_cache, self.cache.value_cache,
                tables, lens, np.float32(self.scale), np.int32(self.partition_size),
                *self._variants)
        self._decode = _launch.PackedLaunch(self._kernel, self._grid, self._threads, args)
        # one graph launch per run (decode, then the split-K merge): less host time
        self._graph = _launch.GraphLaunch(
            [self._decode] + ([self._merge] if self._merge is not None else []))
        self._inputs = inputs

    def __repr__(self):
        return (f"DecodePlan(num_seqs={self.num_seqs}, num_heads={self.num_heads}, "
                f"head_size={self.cache.head_size}, heads_per_block={self.heads_per_block}, "
                f"num_partitions={self.num_partitions}, partition_size={self.partition_size}, "
                f"scratch_bytes={self.scratch_bytes}, tensor_cores={self.tensor_cores})")
