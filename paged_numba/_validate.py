"""Input checks shared by the public functions. Each raises before any launch
with a message that names the offending value. Scalar and integer-array
checks (types, ranges before narrowing to int32) are in ``_checks``."""
import math

import numpy as np

from . import _arrays
from . import _checks as C
from ._arrays import BFLOAT16, logical_dtype, storage_dtype
from .page_tables import CSRTable, check_offsets


MAX_HEAD_SIZE = 256
MAX_GRID_YZ = 65535     # CUDA's limit on gridDim.y and gridDim.z
MAX_HEADS = 65535       # query heads of a plan (more than any model has; a plan allocates them)


def shape_of(x):
    return tuple(int(s) for s in x.shape)


def check_ndim(name, x, ndim, meaning):
    if len(x.shape) != ndim:
        raise ValueError(f"{name} must be {meaning}, but got shape {shape_of(x)}.")


def dtype_matches(x, expected):
    """True when array ``x`` holds logical dtype ``expected``: its own dtype is
    ``expected``, or ``expected`` is bfloat16 and ``x`` is a device array of
    its uint16 bit patterns (a NumPy uint16 array is not taken as bf16)."""
    expected = np.dtype(expected)
    got = logical_dtype(x)
    if got == expected:
        return True
    return (expected == BFLOAT16 and got == storage_dtype(expected)
            and not isinstance(x, np.ndarray))


def dtype_text(dtype):
    """``dtype``'s name, with its byte order where that is not the machine's
    (``float16`` against ``float16 (>f2)``)."""
    dtype = np.dtype(dtype)
    return dtype.name if dtype.isnative else f"{dtype.name} ({dtype.str})"


def check_dtype(name, x, expected, what="the cache"):
    """``x`` (the caller's array, or its device array) holds logical dtype ``expected``."""
    if not dtype_matches(x, expected):
        raise ValueError(
            f"{name} must have the same dtype as {what}, but got {dtype_text(logical_dtype(x))} "
            f"and {dtype_text(expected)}.")


def compute_dtype(name, x, cache):
    """The logical dtype of the caller's array ``x`` (a query, or keys/values
    to write) for ``cache``, checked: the cache's own dtype, except that an
    fp8 cache takes float16, bfloat16 or float32 (a device ``uint16`` array
    is bf16 bits)."""
    from .fp8 import QUERY_DTYPES, is_fp8

    if not is_fp8(cache.dtype):
        check_dtype(name, x, cache.dtype)
        return np.dtype(cache.dtype)
    got = logical_dtype(x)
    if got == storage_dtype(BFLOAT16) and not isinstance(x, np.ndarray):
        got = BFLOAT16
    if got.name not in QUERY_DTYPES:
        raise ValueError(f"{name} for a {np.dtype(cache.dtype).name} cache must be one of "
                         f"{QUERY_DTYPES}, but got {got.name}.")
    return got


def plan_query_dtype(cache, query_dtype):
    """The query dtype a plan over ``cache`` takes (its output's dtype): the
    cache's dtype; for an fp8 cache ``query_dtype`` (float16, bfloat16 or
    float32; default float16)."""
    from .fp8 import QUERY_DTYPES, is_fp8

    if not is_fp8(cache.dtype):
        if query_dtype is not None and not _is_dtype(query_dtype, cache.dtype):
            raise ValueError(f"query_dtype must be the cache's dtype {np.dtype(cache.dtype).name} "
                             f"(or None), but got {query_dtype!r}.")
        return np.dtype(cache.dtype)
    if query_dtype is None:
        return np.dtype(np.float16)
    if not any(_is_dtype(query_dtype, name) for name in QUERY_DTYPES):
        raise ValueError(f"query_dtype for a {np.dtype(cache.dtype).name} cache must be one of "
                         f"{QUERY_DTYPES}, but got {query_dtype!r}.")
    return np.dtype(query_dtype)


def _is_dtype(value, dtype):
    try:
        return np.dtype(value) == np.dtype(dtype)
    except TypeError:
        return False


def check_head_size(head_size):
    if head_size % 8 or not 8 <= head_size <= MAX_HEAD_SIZE:
        raise ValueError(
            f"head_size must be a multiple of 8 in [8, {MAX_HEAD_SIZE}], but got {head_size}.")


def check_heads(num_heads, cache):
    """``num_heads`` query heads can share the cache's KV heads (GQA/MQA)."""
    if num_heads % cache.num_kv_heads:
        raise ValueError(f"num_heads must be a multiple of num_kv_heads, but got {num_heads} and "
                         f"{cache.num_kv_heads}.")


def check_query(query, q, cache, meaning):
    """The caller's ``query`` (``q``: its device array) is ``[rows, num_heads,
    head_size]`` (``meaning`` names the rows) and fits ``cache``; returns its shape."""
    check_ndim("query", q, 3, meaning)
    rows, num_heads, head_size = shape_of(q)
    if num_heads < 1:
        raise ValueError(f"query must have at least one head, but got shape {shape_of(q)}.")
    compute_dtype("query", query, cache)
    if head_size != cache.head_size:
        raise ValueError(
            f"query head_size must equal the cache's, but got {head_size} and {cache.head_size}.")
    check_head_size(head_size)
    check_heads(num_heads, cache)
    if not q.is_c_contiguous():
        raise ValueError(f"query must be C-contiguous, but got strides {q.strides}.")
    return rows, num_heads, head_size


def check_cache(cache):
    for attr in ("key_cache", "value_cache", "block_size", "num_blocks", "num_kv_heads",
                 "head_size", "dtype", "layout"):
        if not hasattr(cache, attr):
            raise TypeError(f"cache must be a PagedKVCache, but got {type(cache).__name__}.")
    if getattr(cache, "num_layers", None) is not None:
        raise ValueError(f"cache has num_layers={cache.num_layers}; kernels take one layer: "
                         f"pass cache.layer(i).")


def check_int_array(name, x):
    dtype = logical_dtype(x)
    if not np.issubdtype(dtype, np.integer):
        raise ValueError(f"{name} must hold integers, but got dtype {dtype.name}.")


def int32_device(name, x, validate, stream=0):
    """``(device int32 array, host copy)`` of a kernel's integer array argument
    ``x`` (any shape: a table ``[num_seqs, max_blocks]``, lengths ``[num_seqs]``).

    A NumPy array, list or tuple (nested for a table) is checked against the
    int32 range before it is narrowed (always: it is on the host anyway) and
    copied to the device; a CUDA array must already be int32, and its host
    copy is made only when ``validate`` (else None). Both copies go on numba
    stream ``stream``, the launch's: the upload lands before the kernels, the
    host copy sees what the caller wrote there."""
    if isinstance(x, (np.ndarray, list, tuple)):
        host = np.ascontiguousarray(C.int_array(name, x))
        return _arrays.as_device(host, name, stream)[0], host
    dev, _ = _arrays.as_device(x, name)      # a TypeError naming it if x is not an array
    check_int_array(name, x)
    if np.dtype(dev.dtype) != np.int32:
        raise ValueError(f"{name} on the device must be int32, but got {np.dtype(dev.dtype).name}.")
    return dev, (dev.copy_to_host(stream=stream) if validate else None)


def is_csr(block_tables):
    """True when ``block_tables`` is a CSR page table: a :class:`~paged_numba.page_tables.CSRTable`,
    or a plain tuple of three arrays (NumPy or CUDA). A list, or a tuple
    holding lists or numbers, is a padded table given row by row, whatever
    its length."""
    if isinstance(block_tables, CSRTable):
        return True
    return (type(block_tables) is tuple and len(block_tables) == 3
            and all(isinstance(a, np.ndarray) or _arrays.is_device_array(a)
                    for a in block_tables))


def padded_tables(block_tables, seq_lens, cache, validate, stream=0):
    """Accept a padded table or a CSR page table; return ``(block_tables, seq_lens)``.

    A CSR page table (:func:`is_csr`: ``CSRTable(kv_indptr [num_seqs + 1],
    kv_indices [nnz], kv_last_page_len [num_seqs])``) is converted to the
    padded ``[num_seqs, max_blocks]`` form on the host (``seq_lens`` may then
    be None: it follows from the CSR arrays; device CSR arrays are read on
    numba stream ``stream``). Anything else is a padded table, returned as it is
    (an empty list or tuple of rows as a ``[0, 0]`` table)."""
    if not is_csr(block_tables):
        if isinstance(block_tables, (list, tuple)) and not len(block_tables):
            block_tables = np.zeros((0, 0), np.int32)
        if seq_lens is None:
            raise ValueError("seq_lens is required with a padded block table (pass a CSR page "
                             "table as paged_numba.CSRTable(kv_indptr, kv_indices, "
                             "kv_last_page_len)).")
        return block_tables, seq_lens
    from .page_tables import csr_to_padded, validate_csr

    indptr, indices, last = (a if isinstance(a, (list, tuple)) else _arrays.to_host(a, None, stream)
                             for a in block_tables)
    if validate:
        validate_csr(indptr, indices, last, cache.num_blocks, cache.block_size)
    tables, lens = csr_to_padded(indptr, indices, last, cache.block_size)
    if seq_lens is not None:
        given = (C.int_array("seq_lens", seq_lens, dtype=np.int64)
                 if isinstance(seq_lens, (list, tuple))
                 else np.asarray(_arrays.to_host(seq_lens, None, stream)))
        if given.shape != lens.shape or not np.array_equal(given, lens):
            raise ValueError(f"seq_lens {given.tolist()} disagree with the CSR page table, "
                             f"which gives {lens.tolist()}.")
    return tables, lens


def check_context(max_blocks, block_size):
    """A table of ``max_blocks`` columns addresses fewer tokens than int32 holds."""
    if max_blocks * block_size > C.INT32_MAX:
        raise ValueError(f"max_blocks * block_size = {max_blocks} * {block_size} tokens must "
                         f"be at most {C.INT32_MAX} (int32 positions).")


def check_fp8_scale(cache, scale):
    """An fp8 cache's kernels fold the logit ``scale``, K's scale and log2(e)
    into one float32 factor: refuse a pair whose product float32 cannot hold
    (each may be finite on its own)."""
    from .fp8 import is_fp8

    if not is_fp8(cache.dtype):
        return
    k = float(np.max(cache.k_scale))
    if not abs(scale) * k <= C.KERNEL_FLOAT_MAX:
        raise ValueError(f"scale x k_scale = {scale:.4g} x {k:.4g} must be at most "
                         f"{C.KERNEL_FLOAT_MAX:.4g} in magnitude (an fp8 cache's kernels "
                         f"multiply them in float32).")


def scale_of(scale, head_size):
    """The logit scale as a float: ``1 / sqrt(head_size)`` for None, else checked."""
    return 1.0 / math.sqrt(head_size) if scale is None else C.real("scale", scale)


def variants(num_heads, sliding_window, alibi_slopes, logits_soft_cap, stream=None):
    """Checked ``(alibi_slopes device [num_heads] float32, soft_cap, window)`` kernel
    arguments: zeros, 0.0 and 0 for None. The slopes are read and uploaded
    on numba stream ``stream`` (:func:`_arrays.as_device`; None for a plan's).

    The window is an integer in ``[1, 2**31 - 1]``; the soft cap a positive
    finite number; the slopes ``[num_heads]`` floats, finite, and (like the
    scale) at most :data:`_checks.KERNEL_FLOAT_MAX` in magnitude."""
    window = 0
    if sliding_window is not None:
        window = C.integer("sliding_window", sliding_window, lo=1, hi=C.INT32_MAX)
    soft_cap = 0.0
    if logits_soft_cap is not None:
        soft_cap = C.real("logits_soft_cap", logits_soft_cap, positive=True)
    if alibi_slopes is None:
        slopes = np.zeros(num_heads, np.float32)
    else:
        slopes = np.asarray(_arrays.to_host(alibi_slopes, None, stream or 0))
        if slopes.shape != (num_heads,) or not np.issubdtype(slopes.dtype, np.floating):
            raise ValueError(f"alibi_slopes must be float [num_heads] = [{num_heads}], but got "
                             f"{slopes.dtype} {shape_of(slopes)}.")
        slopes = slopes.astype(np.float64)
        bad = np.flatnonzero(~(np.abs(slopes) <= C.KERNEL_FLOAT_MAX))    # NaN, Inf, too large
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"alibi_slopes[{i}] is {float(slopes[i])!r}; slopes must be finite and at "
                             f"most {C.KERNEL_FLOAT_MAX:.4g} in magnitude (the kernels compute "
                             f"in float32).")
        slopes = slopes.astype(np.float32)
    return (_arrays.as_device(slopes, "alibi_slopes", stream)[0], np.float32(soft_cap),
            np.int32(window))


def check_tables(block_tables, seq_lens, num_blocks, block_size):
    """Check a padded block table ``[num_seqs, max_blocks]`` against ``seq_lens``
    ``[num_seqs]`` (host arrays): every used entry is a block id in
    ``[0, num_blocks)`` and every sequence fits in its row."""
    num_seqs, max_blocks = block_tables.shape
    if seq_lens.shape != (num_seqs,):
        raise ValueError(
            f"seq_lens must be [num_seqs] = [{num_seqs}], but got shape {shape_of(seq_lens)}.")
    if num_seqs == 0:
        return
    bad = np.flatnonzero(seq_lens < 0)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"seq_lens[{i}] is {int(seq_lens[i])}; sequence lengths must be >= 0.")
    used = -(-seq_lens.astype(np.int64) // block_size)
    over = np.flatnonzero(used > max_blocks)
    if over.size:
        i = int(over[0])
        raise ValueError(
            f"seq_lens[{i}] = {int(seq_lens[i])} needs {int(used[i])} blocks of {block_size} "
            f"tokens, but the block table has only {max_blocks} columns.")
    in_use = np.arange(max_blocks)[None, :] < used[:, None]
    bad_entry = in_use & ((block_tables < 0) | (block_tables >= num_blocks))
    if bad_entry.any():
        i, j = (int(a[0]) for a in np.nonzero(bad_entry))
        raise ValueError(
            f"block_tables[{i}, {j}] is {int(block_tables[i, j])}, but sequence {i} "
            f"(seq_len {int(seq_lens[i])}) uses its first {int(used[i])} entries, which must "
            f"be block ids in [0, {num_blocks}).")


def check_lengths(cu_seqlens_q, seq_lens, total_q):
    """Check ``cu_seqlens_q [num_seqs + 1]`` against ``seq_lens [num_seqs]``
    and ``total_q`` query rows (host arrays): it starts at 0, never
    decreases, ends at ``total_q``, and no sequence has more queries than
    tokens in the cache. Returns the query lengths ``[num_seqs]``.

    Parameters
    ----------
    cu_seqlens_q : array of int, ``[num_seqs + 1]``
        Query rows of sequence ``i`` are ``cu_seqlens_q[i]:cu_seqlens_q[i + 1]``.
    seq_lens : numpy.ndarray of int, ``[num_seqs]``
        Tokens of each sequence in the cache, this step's included.
    total_q : int
        Query rows in all.

    Returns
    -------
    q_lens : numpy.ndarray, ``[num_seqs]``
        ``numpy.diff(cu_seqlens_q)``; ``ValueError`` names the first problem.

    Examples
    --------
    >>> import numpy as np
    >>> check_lengths(np.array([0, 10, 13, 14]), np.array([10, 20, 1]), total_q=14)
    array([10,  3,  1])
    >>> check_lengths(np.array([0, 4, 5]), np.array([3, 9]), total_q=5)
    Traceback (most recent call last):
        ...
    ValueError: sequence 0 has q_len 4 query tokens but seq_lens[0] = 3; seq_lens must count the cached tokens plus this step's, so q_len <= seq_len.
    """
    cu = np.asarray(cu_seqlens_q)
    if cu.ndim != 1 or cu.size != seq_lens.size + 1:
        raise ValueError(f"cu_seqlens_q must be [num_seqs + 1] = [{seq_lens.size + 1}], but got "
                         f"shape {shape_of(cu)}.")
    q_lens = check_offsets("cu_seqlens_q", cu)
    if cu[-1] != total_q:
        raise ValueError(f"cu_seqlens_q[-1] must equal total_q = {total_q} (query rows), but got "
                         f"{int(cu[-1])}.")
    over = np.flatnonzero(q_lens > seq_lens)
    if over.size:
        i = int(over[0])
        raise ValueError(f"sequence {i} has q_len {int(q_lens[i])} query tokens but seq_lens[{i}] "
                         f"= {int(seq_lens[i])}; seq_lens must count the cached tokens plus this "
                         f"step's, so q_len <= seq_len.")
    return q_lens
