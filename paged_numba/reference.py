"""Dense reference attention in NumPy: the oracle for every kernel test.

It un-pages each sequence through its block table, then runs plain softmax
attention with GQA (query head ``h`` reads KV head ``h // (num_heads //
num_kv_heads)``). Everything is computed in ``dtype`` (float64 by default;
float32 gives the "independent low-precision computation" whose error sets
the kernels' tolerances). No kernel imports this module.

Inputs may be any float dtype NumPy can cast, ``ml_dtypes.bfloat16`` included:
every function converts with ``np.asarray(x, dtype)``, which is exact from bf16.

Non-finite inputs follow IEEE arithmetic in float64, and every kernel gives
the same (with and without split-K). A query row *attends* the keys its mask
admits (its sequence's tokens, up to its own position when causal, inside
the sliding window); the others are never read for it. Then:

* a NaN in the row's query, or in the key of a token it attends (its KV
  head's), makes that logit NaN, and a NaN logit makes the row's whole output
  and its log-sum-exp NaN (``numpy.max`` propagates NaN into the running max);
* ``+inf`` or ``-inf`` in the query or a key gives logits of ``+-inf``, or NaN
  where it meets a zero (``inf * 0``). A ``+inf`` logit makes the row NaN
  (``exp(inf - inf)``); ``-inf`` logits weigh 0, and a row whose every
  attended logit is ``-inf`` is empty: zeros and a log-sum-exp of ``-inf``,
  as for a row that attends no key. The soft cap maps ``+-inf`` logits to
  ``+-c`` (``tanh``), so with it only NaN spreads;
* a NaN (or an ``inf``) in element ``d`` of an attended token's value makes
  ``out[row, d]`` NaN (or ``+-inf``; NaN where its weight is 0, ``0 * inf``)
  and leaves the log-sum-exp alone. A masked token's value reaches no output.

One exception, in the values only: the tensor-core kernels multiply a tile
of weights by a tile of values in one product, so a NaN or an ``inf`` in
element ``d`` of a value in that tile reaches ``out[row, d]`` of every row
of the product, as NaN where the row's weight for it is 0 (``0 * NaN``,
``0 * inf``): masked tokens of a causal diagonal tile, keys past the end
of a partial tile. Queries and keys follow the rules above in every kernel.

Scalars (scale, soft cap, ALiBi slopes) are finite: the public functions
reject the others.

fp8 caches: the paged references take the *stored* fp8 pools and their
``k_scale``/``v_scale`` (one per tensor or ``[num_kv_heads]``) and attend
over ``stored * scale``, computed in float64, where it is exact (an fp8 value
has at most 4 significant bits, a float32 scale 24). A NaN code is a NaN
element as above; E5M2's inf codes never come from ``write_kv``, which
saturates.
"""
import math

import numpy as np

from .fp8 import dequantize
from .layouts import to_nhd


def _dequantized(key_cache, value_cache, k_scale, v_scale):
    """``"nhd"`` pools times their scales in float64 (unchanged without scales)."""
    if k_scale is not None:
        key_cache = dequantize(key_cache, k_scale)
    if v_scale is not None:
        value_cache = dequantize(value_cache, v_scale)
    return key_cache, value_cache


def gather_kv(key_cache, value_cache, block_table_row, seq_len):
    """Keys and values of one sequence, ``[seq_len, num_kv_heads, head_size]`` each,
    from ``"nhd"`` pools ``[num_blocks, block_size, num_kv_heads, head_size]``.

    Parameters
    ----------
    key_cache, value_cache : numpy.ndarray, ``[num_blocks, block_size, num_kv_heads, head_size]``
    block_table_row : array of int, ``[max_blocks]``
        The sequence's physical blocks; only the first ``ceil(seq_len /
        block_size)`` are read (they must be valid ids), so ``-1`` padding may follow.
    seq_len : int

    Returns
    -------
    k, v : numpy.ndarray, ``[seq_len, num_kv_heads, head_size]`` each

    Examples
    --------
    >>> import numpy as np
    >>> kc = np.arange(3 * 2 * 1 * 8.0).reshape(3, 2, 1, 8)   # 3 blocks of 2 tokens, H=1, D=8
    >>> k, v = gather_kv(kc, -kc, [2, 0, -1], seq_len=3)       # blocks 2 then 0, 3 tokens
    >>> k.shape, v.shape
    ((3, 1, 8), (3, 1, 8))
    >>> k[:, 0, 0]            # slots 4, 5, 0 -> first elements 4 * 8, 5 * 8, 0 * 8
    array([32., 40.,  0.])
    """
    block_size = key_cache.shape[1]
    used = -(-int(seq_len) // block_size)
    blocks = np.asarray(block_table_row[:used], dtype=np.int64)
    if (blocks < 0).any() or (blocks >= key_cache.shape[0]).any():
        raise ValueError(f"block table row {list(blocks)} has ids outside [0, {key_cache.shape[0]}).")
    k = key_cache[blocks].reshape(-1, *key_cache.shape[2:])[:seq_len]
    v = value_cache[blocks].reshape(-1, *value_cache.shape[2:])[:seq_len]
    return k, v


def logits(q, k, scale, dtype=np.float64, *, q_positions=None, causal=False,
           sliding_window=None, alibi_slopes=None, logits_soft_cap=None):
    """Attention logits ``[num_heads, num_q, num_kv]`` with masked entries ``-inf``.

    ``q [num_q, num_heads, head_size]``, ``k [num_kv, num_kv_heads, head_size]``;
    key ``j`` sits at position ``j`` and query ``i`` at ``q_positions[i]``
    (default ``num_kv - num_q + i``: the queries are the newest tokens). For a
    query at ``p``, key at ``j`` and ``s = scale * q.k``, in this order:
    ``s = c tanh(s / c)`` (soft cap ``c``), ``s += slope_h * (j - p)`` (ALiBi),
    key admitted only if ``p - j < sliding_window``, and with ``causal`` only
    if ``j <= p``.

    Parameters
    ----------
    q : array, ``[num_q, num_heads, head_size]``
    k : array, ``[num_kv, num_kv_heads, head_size]``
        ``num_heads`` must be a multiple of ``num_kv_heads`` (GQA).
    scale : float
    dtype : numpy float type
        What everything is computed in.
    q_positions : array of int, ``[num_q]``, optional
    causal : bool
    sliding_window : int, optional
    alibi_slopes : array of float, ``[num_heads]``, optional
    logits_soft_cap : float, optional

    Returns
    -------
    numpy.ndarray, ``[num_heads, num_q, num_kv]``

    Examples
    --------
    >>> import numpy as np
    >>> q = np.ones((2, 1, 2))                          # 2 queries, at positions 1 and 2
    >>> k = np.array([[[1.0, 0.0]], [[2.0, 0.0]], [[3.0, 0.0]]])   # q.k = 1, 2, 3
    >>> logits(q, k, scale=0.5, causal=True)            # the query at 1 cannot see key 2
    array([[[ 0.5,  1. , -inf],
            [ 0.5,  1. ,  1.5]]])
    >>> # window 2 drops key 0 for the query at 2; ALiBi adds 0.5 * (j - p): 2 + 0.5 * (1 - 2) = 1.5
    >>> logits(q, k, 1.0, causal=True, sliding_window=2, alibi_slopes=[0.5])
    array([[[ 0.5,  2. , -inf],
            [-inf,  1.5,  3. ]]])
    """
    z, keep = _logits(q, k, scale, dtype, q_positions, causal, sliding_window, alibi_slopes,
                      logits_soft_cap)
    return np.where(keep[None], z, -np.inf)


def _logits(q, k, scale, dtype, q_positions, causal, sliding_window, alibi_slopes,
            logits_soft_cap):
    """:func:`logits` before masking, ``[num_heads, num_q, num_kv]``, and the
    mask ``[num_q, num_kv]`` (True where query ``i`` attends key ``j``)."""
    q, k = np.asarray(q, dtype=dtype), np.asarray(k, dtype=dtype)
    num_q, num_heads, _ = q.shape
    num_kv = k.shape[0]
    qpos = (np.arange(num_q) + num_kv - num_q) if q_positions is None else np.asarray(q_positions)
    kpos = np.arange(num_kv)
    k = np.repeat(k, num_heads // k.shape[1], axis=1)          # [num_kv, num_heads, head_size]
    z = np.einsum("qhd,khd->hqk", q, k) * dtype(scale)
    if logits_soft_cap is not None:
        c = dtype(logits_soft_cap)
        z = c * np.tanh(z / c)
    if alibi_slopes is not None:
        dist = (kpos[None, :] - qpos[:, None]).astype(dtype)    # [num_q, num_kv]
        z = z + np.asarray(alibi_slopes, dtype)[:, None, None] * dist[None]
    keep = np.ones((num_q, num_kv), bool)
    if sliding_window is not None:
        keep &= (qpos[:, None] - kpos[None, :]) < sliding_window
    if causal:
        keep &= kpos[None, :] <= qpos[:, None]
    return z, keep


def attention(q, k, v, scale, dtype=np.float64, **variants):
    """Softmax attention of ``q [num_q, num_heads, head_size]`` over
    ``k, v [num_kv, num_kv_heads, head_size]``; ``variants`` as in :func:`logits`.

    Returns ``out [num_q, num_heads, head_size]`` and ``lse [num_q, num_heads]``;
    a query with no admissible key gets zeros and ``-inf``.

    Parameters
    ----------
    q : array, ``[num_q, num_heads, head_size]``
    k, v : array, ``[num_kv, num_kv_heads, head_size]`` each
    scale : float
    dtype : numpy float type
    **variants
        ``q_positions``, ``causal``, ``sliding_window``, ``alibi_slopes``,
        ``logits_soft_cap`` as in :func:`logits`.

    Returns
    -------
    out : numpy.ndarray, ``[num_q, num_heads, head_size]``
    lse : numpy.ndarray, ``[num_q, num_heads]``
        ``log sum_j exp(logit_j)``.

    Examples
    --------
    >>> import numpy as np
    >>> k = np.zeros((3, 1, 2))                        # equal logits: a plain mean of v
    >>> v = np.array([[[0.0, 1.0]], [[2.0, 3.0]], [[4.0, 5.0]]])
    >>> out, lse = attention(np.ones((1, 2, 2)), k, v, scale=1.0)   # 2 heads share KV head 0
    >>> out                                            # (0 + 2 + 4) / 3 = 2, (1 + 3 + 5) / 3 = 3
    array([[[2., 3.],
            [2., 3.]]])
    >>> lse.round(4)                                   # log(e^0 + e^0 + e^0) = log 3
    array([[1.0986, 1.0986]])
    >>> out, lse = attention(np.ones((1, 1, 2)), k, v, 1.0, causal=True, q_positions=[0])
    >>> out, lse                                       # only key 0 is at or before position 0
    (array([[[0., 1.]]]), array([[0.]]))
    """
    q, v = np.asarray(q, dtype=dtype), np.asarray(v, dtype=dtype)
    num_heads = q.shape[1]
    variants = {"q_positions": None, "causal": False, "sliding_window": None,
                "alibi_slopes": None, "logits_soft_cap": None, **variants}
    z, keep = _logits(q, k, scale, dtype, **variants)
    z = np.where(keep[None], z, -np.inf)                       # [num_heads, num_q, num_kv]
    m = z.max(axis=-1, keepdims=True, initial=-np.inf)
    empty = np.isneginf(m)
    p = np.exp(z - np.where(empty, 0, m))
    l = p.sum(axis=-1, keepdims=True)
    v = np.repeat(v, num_heads // v.shape[1], axis=1)
    w = p / np.where(empty, 1, l)
    finite = np.isfinite(v)
    out = np.einsum("hqk,khd->qhd", w, np.where(finite, v, 0))
    for j, h, d in zip(*np.nonzero(~finite)):   # a non-finite value: only where attended
        rows = keep[:, j]
        out[rows, h, d] += w[h, rows, j] * v[j, h, d]
    with np.errstate(divide="ignore"):
        lse = np.where(empty, -np.inf, m + np.log(np.where(empty, 1, l)))[..., 0].T
    return out.astype(dtype), lse.astype(dtype)


def paged_decode_reference(query, key_cache, value_cache, block_tables, seq_lens,
                           scale=None, layout="nhd", dtype=np.float64, k_scale=None,
                           v_scale=None, **variants):
    """Reference for :func:`paged_numba.paged_decode` on host arrays.

    Parameters
    ----------
    query : ``[num_seqs, num_heads, head_size]``
    key_cache, value_cache : pools in ``layout``
    block_tables : ``[num_seqs, max_blocks]``
    seq_lens : ``[num_seqs]``
    k_scale, v_scale : float or ``[num_kv_heads]``, optional
        Scales of fp8 pools: the keys are ``key_cache * k_scale`` (in float64),
        the values ``value_cache * v_scale``.

    variants : ``sliding_window``, ``alibi_slopes``, ``logits_soft_cap`` as in :func:`logits`
        (the query sits at position ``seq_len - 1``).

    Returns
    -------
    out : ``[num_seqs, num_heads, head_size]`` and lse : ``[num_seqs, num_heads]``, in ``dtype``

    Examples
    --------
    >>> import numpy as np
    >>> k = np.zeros((3, 2, 1, 2))                     # 3 blocks of 2 slots, H=1, D=2
    >>> v = np.arange(6.0).repeat(2).reshape(3, 2, 1, 2)   # every element of slot s is s
    >>> tables = np.array([[2, 0], [1, -1]])
    >>> out, lse = paged_decode_reference(np.ones((2, 1, 2)), k, v, tables, [3, 1])
    >>> out[:, 0]            # seq 0: slots 4, 5, 0 -> mean 3; seq 1: slot 2
    array([[3., 3.],
           [2., 2.]])
    >>> lse.round(4)         # log 3, log 1
    array([[1.0986],
           [0.    ]])
    >>> from paged_numba.layouts import from_nhd
    >>> kh, vh = from_nhd(k, v, "hnd")                 # the same pools in another layout
    >>> bool((paged_decode_reference(np.ones((2, 1, 2)), kh, vh, tables, [3, 1],
    ...                              layout="hnd")[0] == out).all())
    True
    >>> import ml_dtypes                               # fp8 codes and a scale: values 0.5 * s
    >>> v8 = v.astype(ml_dtypes.float8_e4m3fn)
    >>> paged_decode_reference(np.ones((2, 1, 2)), k, v8, tables, [3, 1], v_scale=0.5)[0][:, 0]
    array([[1.5, 1.5],
           [1. , 1. ]])
    """
    query = np.asarray(query)
    key_cache, value_cache = to_nhd(np.asarray(key_cache), np.asarray(value_cache), layout)
    key_cache, value_cache = _dequantized(key_cache, value_cache, k_scale, v_scale)
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    out = np.zeros(query.shape, dtype)
    lse = np.full(query.shape[:2], -np.inf, dtype)
    for i, n in enumerate(np.asarray(seq_lens)):
        k, v = gather_kv(key_cache, value_cache, np.asarray(block_tables)[i], n)
        o, s = attention(query[i:i + 1], k, v, scale, dtype, **variants)
        out[i], lse[i] = o[0], s[0]
    return out, lse


def paged_prefill_reference(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                            scale=None, layout="nhd", dtype=np.float64, causal=True,
                            k_scale=None, v_scale=None, **variants):
    """Reference for :func:`paged_numba.paged_prefill` on host arrays.

    Parameters
    ----------
    query : ``[total_q, num_heads, head_size]``, packed by ``cu_seqlens_q``
    key_cache, value_cache : pools in ``layout``
    block_tables : ``[num_seqs, max_blocks]``
    cu_seqlens_q : ``[num_seqs + 1]``
    seq_lens : ``[num_seqs]``, cached tokens plus this step's

    causal : query ``j`` of sequence ``i`` sits at position
        ``seq_lens[i] - q_len_i + j`` and, if True, attends to keys up to it.
    k_scale, v_scale : optional
        Scales of fp8 pools, as in :func:`paged_decode_reference`.
    variants : ``sliding_window``, ``alibi_slopes``, ``logits_soft_cap`` as in :func:`logits`.

    Returns
    -------
    out : ``[total_q, num_heads, head_size]`` and lse : ``[total_q, num_heads]``, in ``dtype``

    Examples
    --------
    >>> import numpy as np
    >>> k = np.zeros((3, 2, 1, 2))                     # 3 blocks of 2 slots, H=1, D=2
    >>> v = np.arange(6.0).repeat(2).reshape(3, 2, 1, 2)   # every element of slot s is s
    >>> tables = np.array([[2, 0], [1, -1]])
    >>> # seq 0: 2 queries at positions 1, 2 of 3 tokens; seq 1: 1 query at position 0
    >>> out, lse = paged_prefill_reference(np.ones((3, 1, 2)), k, v, tables,
    ...                                    cu_seqlens_q=[0, 2, 3], seq_lens=[3, 1])
    >>> out[:, 0, 0]         # slots 4, 5 -> 4.5; slots 4, 5, 0 -> 3; slot 2 -> 2
    array([4.5, 3. , 2. ])
    >>> lse[:, 0].round(4)   # log 2, log 3, log 1
    array([0.6931, 1.0986, 0.    ])
    >>> paged_prefill_reference(np.ones((3, 1, 2)), k, v, tables, [0, 2, 3], [3, 1],
    ...                         causal=False)[0][:, 0, 0]      # both queries see all 3 keys
    array([3., 3., 2.])
    """
    query = np.asarray(query)
    key_cache, value_cache = to_nhd(np.asarray(key_cache), np.asarray(value_cache), layout)
    key_cache, value_cache = _dequantized(key_cache, value_cache, k_scale, v_scale)
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    cu = np.asarray(cu_seqlens_q)
    out = np.zeros(query.shape, dtype)
    lse = np.full(query.shape[:2], -np.inf, dtype)
    for i, n in enumerate(np.asarray(seq_lens)):
        a, b = int(cu[i]), int(cu[i + 1])
        if a == b:
            continue
        k, v = gather_kv(key_cache, value_cache, np.asarray(block_tables)[i], n)
        pos = int(n) - (b - a) + np.arange(b - a)
        out[a:b], lse[a:b] = attention(query[a:b], k, v, scale, dtype, q_positions=pos,
                                       causal=causal, **variants)
    return out, lse
