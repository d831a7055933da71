"""Input checks shared by the public functions. Each raises before any launch
with a message that names the offending value."""
import numpy as np

from ._arrays import BFLOAT16, logical_dtype, storage_dtype


MAX_HEAD_SIZE = 256


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


def check_dtype(name, x, expected, what="the cache"):
    """``x`` (the caller's array, or its device array) holds logical dtype ``expected``."""
    if not dtype_matches(x, expected):
        raise ValueError(
            f"{name} must have the same dtype as {what}, but got {logical_dtype(x).name} "
            f"and {np.dtype(expected).name}.")


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
    check_dtype("query", query, cache.dtype)
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
