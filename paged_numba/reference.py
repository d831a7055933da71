"""Dense reference attention in NumPy: the oracle for every kernel test.

It un-pages each sequence through its block table, then runs plain softmax
attention with GQA (query head ``h`` reads KV head ``h // (num_heads //
num_kv_heads)``). Everything is computed in ``dtype`` (float64 by default;
float32 gives the "independent low-precision computation" whose error sets
the kernels' tolerances). No kernel imports this module.
"""
import math

import numpy as np

from .layouts import to_nhd


def gather_kv(key_cache, value_cache, block_table_row, seq_len):
    """Keys and values of one sequence, ``[seq_len, num_kv_heads, head_size]`` each,
    from ``"nhd"`` pools ``[num_blocks, block_size, num_kv_heads, head_size]``."""
    block_size = key_cache.shape[1]
    used = -(-int(seq_len) // block_size)
    blocks = np.asarray(block_table_row[:used], dtype=np.int64)
    if (blocks < 0).any() or (blocks >= key_cache.shape[0]).any():
        raise ValueError(f"block table row {list(blocks)} has ids outside [0, {key_cache.shape[0]}).")
    k = key_cache[blocks].reshape(-1, *key_cache.shape[2:])[:seq_len]
    v = value_cache[blocks].reshape(-1, *value_cache.shape[2:])[:seq_len]
    return k, v


def attention(q, k, v, scale, dtype=np.float64):
    """Softmax attention of ``q [num_q, num_heads, head_size]`` over
    ``k, v [num_kv, num_kv_heads, head_size]`` (every query sees every key).

    Returns ``out [num_q, num_heads, head_size]`` and ``lse [num_q, num_heads]``;
    with no keys, zeros and ``-inf``."""
    q, k, v = (np.asarray(a, dtype=dtype) for a in (q, k, v))
    num_q, num_heads, head_size = q.shape
    if k.shape[0] == 0:
        return np.zeros(q.shape, dtype), np.full((num_q, num_heads), -np.inf, dtype)
    group = num_heads // k.shape[1]
    k = np.repeat(k, group, axis=1)            # [num_kv, num_heads, head_size]
    v = np.repeat(v, group, axis=1)
    logits = np.einsum("qhd,khd->hqk", q, k) * dtype(scale)
    m = logits.max(axis=-1, keepdims=True)
    p = np.exp(logits - m)
    l = p.sum(axis=-1, keepdims=True)
    out = np.einsum("hqk,khd->qhd", p / l, v)
    lse = (m + np.log(l))[..., 0].T
    return out, lse


def paged_decode_reference(query, key_cache, value_cache, block_tables, seq_lens,
                           scale=None, layout="nhd", dtype=np.float64):
    """Reference for :func:`paged_numba.paged_decode` on host arrays.

    Parameters
    ----------
    query : ``[num_seqs, num_heads, head_size]``
    key_cache, value_cache : pools in ``layout``
    block_tables : ``[num_seqs, max_blocks]``
    seq_lens : ``[num_seqs]``

    Returns
    -------
    out : ``[num_seqs, num_heads, head_size]`` and lse : ``[num_seqs, num_heads]``, in ``dtype``
    """
    query = np.asarray(query)
    key_cache, value_cache = to_nhd(np.asarray(key_cache), np.asarray(value_cache), layout)
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    out = np.zeros(query.shape, dtype)
    lse = np.full(query.shape[:2], -np.inf, dtype)
    for i, n in enumerate(np.asarray(seq_lens)):
        k, v = gather_kv(key_cache, value_cache, np.asarray(block_tables)[i], n)
        o, s = attention(query[i:i + 1], k, v, scale, dtype)
        out[i], lse[i] = o[0], s[0]
    return out, lse
