"""Public attention entry points: validate inputs, pick a launch, run the kernels."""
import math

import numpy as np

from . import _arrays
from . import _validate as V
from .kernels.decode import decode_kernel, heads_per_block
from .kernels.merge import merge_kernel

NUM_WARPS = 4
CHUNK = 256  # tokens whose logits sit in shared memory at once


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


def num_partitions_for(num_seqs, num_head_blocks, max_context, sm_count, chunk=CHUNK):
    """Split-K heuristic: split each sequence into partitions only when there
    are too few thread blocks to fill the GPU (about two waves of ``sm_count``
    multiprocessors), never into partitions shorter than one chunk."""
    blocks = max(num_seqs * num_head_blocks, 1)
    wanted = -(-2 * sm_count // blocks)
    return max(1, min(wanted, -(-max_context // chunk)))


def paged_decode(query, cache, block_tables, seq_lens, scale=None, *,
                 num_partitions=None, return_lse=False, validate=True):
    """Decode attention over a paged KV cache: one query token per sequence.

    Parameters
    ----------
    query : array, ``[num_seqs, num_heads, head_size]``
        NumPy or CUDA array (numba, PyTorch, CuPy) of the cache's dtype.
    cache : PagedKVCache
        Holds ``num_kv_heads`` heads; ``num_heads`` must be a multiple of it
        (GQA; ``num_kv_heads = 1`` is MQA).
    block_tables : array of int32, ``[num_seqs, max_blocks]``
        Physical block of each logical block, ``-1`` past the used ones.
    seq_lens : array of int32, ``[num_seqs]``
        Tokens of each sequence in the cache, the new one included.
    scale : float, optional
        Logit scale, default ``1 / sqrt(head_size)``.
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
    V.check_ndim("query", q, 3, "[num_seqs, num_heads, head_size]")
    num_seqs, num_heads, head_size = V.shape_of(q)
    V.check_dtype("query", q, cache.dtype)
    if head_size != cache.head_size:
        raise ValueError(
            f"query head_size must equal the cache's, but got {head_size} and {cache.head_size}.")
    V.check_head_size(head_size)
    if num_heads % cache.num_kv_heads:
        raise ValueError(
            f"num_heads must be a multiple of num_kv_heads, but got {num_heads} and "
            f"{cache.num_kv_heads}.")
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
    hpb = heads_per_block(num_heads // cache.num_kv_heads)
    max_context = tables.shape[1] * cache.block_size
    if num_partitions is None:
        num_partitions = num_partitions_for(num_seqs, num_heads // hpb, max_context,
                                            _arrays.sm_count())
    if isinstance(num_partitions, bool) or int(num_partitions) != num_partitions or num_partitions < 1:
        raise ValueError(f"num_partitions must be a positive integer, but got {num_partitions!r}.")
    num_partitions = int(num_partitions)
    partition_size = max(-(-max_context // num_partitions), 1)
    num_partitions = max(-(-max_context // partition_size), 1)

    out = _arrays.zeros((num_seqs, num_heads, head_size), q.dtype)
    lse = _arrays.zeros((num_seqs, num_heads), np.float32)
    if num_seqs:
        kernel = decode_kernel(head_size, cache.block_size, hpb, cache.dtype.itemsize,
                               cache.layout, NUM_WARPS, CHUNK)
        grid = (num_heads // hpb, num_seqs, num_partitions)
        args = (q, cache.key_cache, cache.value_cache, tables, lens,
                np.float32(scale), np.int32(partition_size))
        if num_partitions == 1:
            kernel[grid, 32 * NUM_WARPS](out.reshape(num_seqs, 1, num_heads, head_size),
                                         lse.reshape(num_seqs, 1, num_heads), *args)
        else:
            part_out = _arrays.zeros((num_seqs, num_partitions, num_heads, head_size), np.float32)
            part_lse = _arrays.zeros((num_seqs, num_partitions, num_heads), np.float32)
            kernel[grid, 32 * NUM_WARPS](part_out, part_lse, *args)
            merge_kernel()[(num_heads, num_seqs), 128](out, lse, part_out, part_lse)
    if from_host:
        out, lse = out.copy_to_host(), lse.copy_to_host()
    return (out, lse) if return_lse else out


def merge_states(v, s, *, validate=True):
    """Merge partial attention states with the (m, l) rule.

    State ``k`` of row ``i`` is attention over one part of the keys: its
    output ``v[i, k]`` (normalised by its own exp-sum) and its log-sum-exp
    ``s[i, k]`` (natural log). The merged state is attention over all parts.

    Parameters
    ----------
    v : array, ``[num_rows, num_states, num_heads, head_size]``
        float16 or float32 partial outputs.
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
        if np.dtype(vd.dtype).name not in ("float16", "float32"):
            raise ValueError(f"v must be float16 or float32, but got {np.dtype(vd.dtype).name}.")
    n, _, h, d = V.shape_of(vd)
    out = _arrays.zeros((n, h, d), vd.dtype)
    lse = _arrays.zeros((n, h), np.float32)
    if n and h:
        merge_kernel()[(h, n), 128](out, lse, vd, sd)
    if from_host:
        return out.copy_to_host(), lse.copy_to_host()
    return out, lse
