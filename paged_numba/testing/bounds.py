"""Error bounds for paged-attention kernels and the float64 references they
are checked against.

Error bounds come from the data, never from a hand-tuned tolerance: a
first-order rounding-error analysis of fp32 attention (see
:func:`attention_error_bound`) is evaluated on the very inputs of the test,
and one unit in the last place of the output dtype is added for the final
rounding. An fp16 result may therefore be off by one fp16 ulp plus a tiny
fp32 term; anything larger is a bug.
"""
import math

import numpy as np

from .._group_decode import NAMED_MIN_GROUP, tile_heads
from ..kernels import decode_tc
from ..fp8 import is_fp8
from ..kernels.decode import heads_per_block
from ..reference import gather_kv, logits
from .strategies import DecodeProblem, PrefillProblem  # noqa: F401  (the problems bounded here)

U32 = 2.0 ** -24   # unit roundoff of float32, the precision every kernel computes in
# Tensor-core products (``mma.sync``, fp16/bf16 in, fp32 accumulate) are exact, but
# the accumulation aligns each block of products to the largest exponent and
# truncates instead of rounding to nearest (Fasi, Higham, Mikaitis and Pranesh,
# "Numerical behavior of NVIDIA tensor cores", PeerJ CS 2021): the dot products
# of the tensor-core decode kernel are bounded with 4 units of fp32 roundoff.
TENSOR_CORE_U = 4 * U32
# fp8 products (``mma.m16n8k32`` of E4M3 / E5M2 codes, ``DecodePlan(qk_fp8=True)``):
# each product of two codes is exact, but Hopper's tensor cores keep about 14
# bits when they add fp8 products into the fp32 accumulator (DeepSeek-AI,
# "DeepSeek-V3 Technical Report", 2024, section 3.3.2), so each term is
# bounded with a unit of 2**-13 of the largest one.
FP8_TENSOR_CORE_U = 2.0 ** -13
# P @ V on tensor cores (``decode_tc_kernel(pv_mma=True)``, the default): each
# 8-token step is two ``mma.m16n8k8`` into the running output, one with the
# hi and one with the lo half of the weights (``kernels.mma.split_pack``).
# Each mma adds its nonzero products and C with TENSOR_CORE_U per term, so a
# sequence of n tokens in ``steps`` steps is a sum of at most 2 n + 4 steps
# terms; the split leaves the weights within (relative, absolute) of these:
PV_WEIGHT_ERROR = {"float16": (2.0 ** -22, 2.0 ** -40), "bfloat16": (2.0 ** -16, 0.0)}
# The tensor-core prefill kernel (``kernels.prefill_tc``) rounds each weight
# p = exp2(z - m) <= 1 once to the cache's dtype before P @ V, to nearest:
# relative error at most 2**-11 (fp16) or 2**-8 (bf16) of p, plus an absolute
# error for the smallest weights: half the subnormal spacing of fp16 (2**-25);
# bf16 shares fp32's range, and its weights below 2**-126 may be flushed to 0
# (``fast_exp2``). The row sums use the unrounded fp32 weights.
P_ROUNDING = {"float16": (2.0 ** -11, 2.0 ** -25), "bfloat16": (2.0 ** -8, 2.0 ** -126)}


def gamma(n, u=U32):
    """Higham's gamma_n = n u / (1 - n u): the relative error bound of a
    float32 sum or product chain of ``n`` terms.

    Parameters
    ----------
    n : int or numpy.ndarray of int (any shape)
    u : float
        Unit roundoff, default that of float32.

    Returns
    -------
    float or numpy.ndarray (``n``'s shape)
        With ``u = 2 ** -24`` (:data:`U32`) unless ``u`` is given.

    Examples
    --------
    >>> gamma(1) / U32                 # 1 / (1 - 2**-24): just over 1
    1.0000000596046483
    >>> round(gamma(64) / U32, 5)      # 64 / (1 - 64 * 2**-24)
    64.00024
    >>> gamma(np.array([1, 2])).shape
    (2,)
    """
    return n * u / (1.0 - n * u)


def attention_error_bound(q, k, v, scale, num_merges=1, transcendental_ulps=8, dot_u=U32,
                          pv=None, scale_roundings=0, **variants):
    """Rounding-error bounds for fp32 softmax attention of one query row.

    A first-order forward error analysis of what any fp32 kernel computes,
    evaluated on the data (``q [num_heads, head_size]``, ``k, v [L,
    num_kv_heads, head_size]`` as stored, in float64; ``variants`` as in
    :func:`paged_numba.reference.logits`, the query at position ``L - 1``):

    * a logit is a ``head_size``-term dot product plus the scaling:
      ``|ds| <= E_s = gamma(head_size + 2) * scale * max_j sum_d |q_d k_jd|``;
      a soft cap ``c`` adds the tanh's few ulps of ``c`` (tanh is 1-Lipschitz),
      ALiBi adds ``2u |slope (j - p)|`` (the slope is rounded to fp32);
    * shifting logits by at most ``E_s`` moves each softmax weight by a factor
      within ``exp(+-2 E_s)``; the exp-sum and ``sum_j p_j v_j`` add up ``L``
      terms, each exp/log is off by a few ulps, and every merge of partial
      states adds two more roundings:
      ``|d out_d| <= (2 E_s + gamma(L + 2 num_merges + transcendental_ulps)) * sum_j w_j |v_jd|``;
    * ``|d lse| <= E_s + gamma(L + 2 num_merges + transcendental_ulps) + u |lse|``;
    * with ``pv = (steps, w_rel, w_abs)`` (P @ V on tensor cores in ``steps``
      8-token steps, weights within ``w_rel`` relative and ``w_abs`` absolute),
      the output's ``gamma(L)`` share becomes ``gamma(2 L + 4 steps,
      TENSOR_CORE_U) + w_rel``, and ``w_abs * sum_j |v_jd|`` is added;
    * ``scale_roundings`` more float32 roundings of the logit scale and of the
      output (an fp8 cache: ``k_scale`` folded into the query's scale, the
      output times ``v_scale``) add as many to the ``gamma`` of each.

    Returns ``(bound_out [num_heads, head_size], bound_lse [num_heads])``; the
    final rounding to the output dtype is added by :func:`check_close`.

    Parameters
    ----------
    q : array, ``[num_heads, head_size]``
        One query token.
    k, v : array, ``[L, num_kv_heads, head_size]`` each
        Its keys and values (``num_heads`` a multiple of ``num_kv_heads``).
    scale : float
    num_merges : int
        Merges of partial softmax states (online-softmax chunks, split-K parts).
    transcendental_ulps : int
        Ulps of error allowed for each exp, log or tanh.
    dot_u : float
        Unit roundoff of the q.k accumulation (:data:`TENSOR_CORE_U` for
        tensor cores).
    pv : tuple, optional
        ``(steps, w_rel, w_abs)`` for P @ V on tensor cores
        (:data:`PV_WEIGHT_ERROR`); None for fp32 FMAs.
    scale_roundings : int
        Extra roundings of the logit scale and of the output (1 for an fp8 cache).
    **variants
        ``sliding_window``, ``alibi_slopes``, ``logits_soft_cap``.

    Examples
    --------
    >>> from paged_numba.reference import attention
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((2, 8))                       # 2 heads share 1 KV head
    >>> k, v = rng.standard_normal((2, 5, 1, 8))              # L = 5 keys
    >>> bound, bound_lse = attention_error_bound(q, k, v, scale=8 ** -0.5)
    >>> bound.shape, bound_lse.shape
    ((2, 8), (2,))
    >>> out64 = attention(q[None], k, v, 8 ** -0.5)[0][0]     # float64 reference
    >>> out32 = attention(q[None].astype(np.float32), k.astype(np.float32),
    ...                   v.astype(np.float32), 8 ** -0.5, np.float32)[0][0]
    >>> bool((np.abs(out32 - out64) <= bound).all())         # float32 NumPy stays inside
    True
    """
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    num_heads, head_size = q.shape
    if k.shape[0] == 0:
        return np.zeros(q.shape), np.zeros(num_heads)
    group = num_heads // k.shape[1]
    z = logits(q[None], k, scale, **variants)[:, 0]                 # [num_heads, L]
    mags = np.einsum("hd,khd->hk", np.abs(q), np.abs(np.repeat(k, group, axis=1))) * abs(scale)
    e_s = gamma(head_size + 2 + scale_roundings, dot_u) * mags.max(axis=1)   # [num_heads]
    if variants.get("logits_soft_cap") is not None:
        e_s = e_s + transcendental_ulps * U32 * variants["logits_soft_cap"]
    if variants.get("alibi_slopes") is not None:
        dist = np.abs(np.arange(k.shape[0]) - (k.shape[0] - 1))
        e_s = e_s + 2 * U32 * np.abs(np.asarray(variants["alibi_slopes"])) * dist.max()
    zmax = z.max(axis=1, keepdims=True)
    if np.isneginf(zmax).all():
        return np.zeros(q.shape), np.zeros(num_heads)
    w = np.exp(z - zmax)
    lse = np.log(w.sum(axis=1)) + zmax[:, 0]
    w /= w.sum(axis=1, keepdims=True)
    spread = np.einsum("hk,khd->hd", w, np.abs(np.repeat(v, group, axis=1)))  # sum_j w_j |v_jd|
    g = gamma(k.shape[0] + 2 * num_merges + transcendental_ulps + scale_roundings)
    if pv is None:
        bound = (2 * e_s + g)[:, None] * spread
    else:
        steps, w_rel, w_abs = pv
        g_pv = (gamma(2 * num_merges + transcendental_ulps)
                + gamma(2 * k.shape[0] + 4 * steps, TENSOR_CORE_U) + w_rel)
        bound = ((2 * e_s + g_pv)[:, None] * spread
                 + w_abs * np.abs(np.repeat(v, group, axis=1)).sum(axis=0))
    return bound, e_s + g + U32 * np.abs(lse)


def decode_bounds(problem, q, k, v, scale=None, num_partitions=None, pv_mma=None,
                  group_kernel=None, qk_fp8=False, **variants):
    """:func:`attention_error_bound` for every sequence of a :class:`DecodeProblem`.

    Merges counted: one per token (the decode kernel rescales its running
    output at most once per warp step of several tokens, and merges at most
    one non-empty state per warp that saw tokens) plus one per split-K
    partition (at most the table's capacity in tokens when
    ``num_partitions`` is None). Where ``paged_decode`` runs the tensor-core
    kernel, the logits are bounded with :data:`TENSOR_CORE_U`; where it does
    P @ V on tensor cores (``pv_mma``, as in ``paged_decode``: None means
    True), P @ V as in :data:`PV_WEIGHT_ERROR`, with at most
    ``min(n, ceil(n / 8) + 2 num_partitions)`` 8-token steps for ``n`` tokens.
    Where it runs MQA or a large group on the tensor-core prefill tile
    (``_group_decode.tile_heads``), each row is bounded as that kernel's query
    at position ``n - 1`` (:func:`prefill_error_bound` with ``tensor_cores``;
    its merges, one per key, cover the split-K parts and the
    ``alternate_tiles`` hand-over: one merge a row, made only after two
    tiles of keys or more). For an fp8 problem
    ``k`` and ``v`` are the dequantised pools (``stored * scale``, float64) and
    the kernel's two scale multiplications count as ``scale_roundings=1``; with
    float16 or bfloat16 queries at the head sizes the tensor-core kernel takes,
    its products are in the query's type (the codes convert exactly). With
    ``qk_fp8`` (``q`` the quantised queries, e.g. from
    :func:`paged_numba.fp8.quantize_rows`) the logits are bounded with
    :data:`FP8_TENSOR_CORE_U`, and the row's own scale is one rounding more.

    Parameters
    ----------
    problem : DecodeProblem
    q : array, ``[num_seqs, num_heads, head_size]``
    k, v : array, ``[num_blocks, block_size, num_kv_heads, head_size]`` each (``"nhd"`` pools)
    scale : float, optional
        Default ``1 / sqrt(head_size)``.
    num_partitions : int, optional
    pv_mma : bool, optional
        The tensor-core kernel's variant given to ``paged_decode`` (default True).
    group_kernel : {"tile", "wgmma"}, optional
        As given to :class:`~paged_numba.DecodePlan`: named, groups of 16 run
        on the prefill tile too (either tile: the same arithmetic).
    qk_fp8 : bool
        As given to :class:`~paged_numba.DecodePlan` (an fp8 problem).
    **variants
        As in :func:`attention_error_bound`.

    Returns
    -------
    bound : numpy.ndarray, ``[num_seqs, num_heads, head_size]``
    bound_lse : numpy.ndarray, ``[num_seqs, num_heads]``

    Examples
    --------
    >>> p = DecodeProblem(num_seqs=2, num_heads=2, num_kv_heads=1, head_size=8, block_size=4,
    ...                   num_blocks=3, layout="nhd", dtype="float16",
    ...                   seq_lens=np.array([5, 2], np.int32),
    ...                   block_tables=np.array([[2, 0], [1, -1]], np.int32), seed=0)
    >>> q, k, v = p.arrays()
    >>> bound, bound_lse = decode_bounds(p, q, k, v)   # merges: 5 + 2 * 4 (seq 0), 2 + 8 (seq 1)
    >>> bound.shape, bound_lse.shape
    ((2, 2, 8), (2, 2))
    >>> bool((decode_bounds(p, q, k, v, num_partitions=1)[0] < bound).all())   # fewer merges
    True
    """
    if num_partitions is None:
        num_partitions = problem.max_blocks * problem.block_size
    if scale is None:
        scale = 1.0 / math.sqrt(problem.head_size)
    group = problem.num_heads // problem.num_kv_heads
    hpb = heads_per_block(group)
    fp8 = is_fp8(problem.dtype)           # the scales folded in: one rounding more
    # an fp8 cache: the tensor-core kernel for fp16 and bf16 queries, in their type
    mma_dtype = str(problem.query_dtype) if fp8 else problem.dtype
    tc = decode_tc.supports(problem.head_size, hpb, problem.dtype, problem.layout, mma_dtype)
    # MQA and groups of 32 or more run on the tensor-core prefill tile: its bound
    tile = tile_heads(group, problem.head_size, problem.dtype, problem.layout,
                      *(() if group_kernel is None else (NAMED_MIN_GROUP,)))
    dot_u = FP8_TENSOR_CORE_U if qk_fp8 else TENSOR_CORE_U if tc else U32
    bound = np.zeros(q.shape)
    bound_lse = np.zeros(q.shape[:2])
    for i, n in enumerate(problem.seq_lens):
        kk, vv = gather_kv(k, v, problem.block_tables[i], n)
        if tile is not None:
            b, b_lse = prefill_error_bound(q[i][None], kk, vv, scale, [int(n) - 1],
                                           tensor_cores=problem.dtype, **variants)
            bound[i], bound_lse[i] = b[0], b_lse[0]
            continue
        pv = None
        if tc and (pv_mma is None or pv_mma):
            steps = min(int(n), -(-int(n) // 8) + 2 * num_partitions)
            pv = (steps, *PV_WEIGHT_ERROR[mma_dtype])
        bound[i], bound_lse[i] = attention_error_bound(q[i], kk, vv, scale, int(n) + num_partitions,
                                                       dot_u=dot_u, pv=pv,
                                                       scale_roundings=int(fp8) + int(qk_fp8),
                                                       **variants)
    return bound, bound_lse


def prefill_error_bound(q, k, v, scale, q_positions, causal=True, num_merges=None,
                        transcendental_ulps=8, tensor_cores=None, scale_roundings=0, **variants):
    """:func:`attention_error_bound` for query rows at arbitrary positions.

    ``q [num_q, num_heads, head_size]`` at ``q_positions [num_q]``; ``k, v
    [L, num_kv_heads, head_size]`` at positions ``0 .. L - 1``; ``causal`` and
    ``variants`` as in :func:`paged_numba.reference.logits`. The same
    first-order model, taken over each row's *admitted* keys only (``n`` of
    them): ``E_s = gamma(head_size + 2) scale max_j sum_d |q_d k_jd|`` plus
    the soft cap's and ALiBi's terms, and
    ``|d out| <= (2 E_s + gamma(n + 2 num_merges + transcendental_ulps)) sum_j w_j |v_j|``,
    ``|d lse| <= E_s + gamma(...) + u |lse|``. ``num_merges`` (online-softmax
    rescalings, at most one per K/V tile) defaults to ``n``. For one row at
    position ``L - 1`` that admits every key it equals
    :func:`attention_error_bound`.

    With ``tensor_cores`` (the cache's dtype name, for
    :mod:`paged_numba.kernels.prefill_tc`) the logits' dot products use
    :data:`TENSOR_CORE_U`; each weight is rounded to that dtype before
    ``P V`` (:data:`P_ROUNDING` ``(w_rel, w_abs)``: ``p (1 + d) + e``), which
    moves the output by at most ``w_rel sum_j w_j |v_j| + w_abs sum_j |v_j|``
    (the running rescales are at most 1 and the final row sum at least 1);
    ``P V`` adds ``n`` products in at most ``n // 16 + 2`` mma k-steps, each
    rounding its sum with C: ``gamma(n + 2 (n // 16 + 2), TENSOR_CORE_U)``,
    beside the fp32 row sums' ``gamma(n + 2 num_merges + transcendental_ulps)``.
    The log-sum-exp is ``(m + log2 l) ln 2``: two more roundings of ``|lse|``.
    ``scale_roundings`` (1 for an fp8 cache) adds to both ``gamma`` terms, as
    in :func:`attention_error_bound`.

    Returns ``(bound [num_q, num_heads, head_size], bound_lse [num_q, num_heads])``;
    rows that admit no key get 0 (the kernel must return exact zeros there).

    Parameters
    ----------
    q : array, ``[num_q, num_heads, head_size]``
    k, v : array, ``[L, num_kv_heads, head_size]`` each
    scale : float
    q_positions : array of int, ``[num_q]``
    causal : bool
    num_merges : int or array of int ``[num_q]``, optional
    transcendental_ulps : int
    tensor_cores : {"float16", "bfloat16"}, optional
        The dtype the tensor-core kernel rounds P to; None for fp32 products.
    scale_roundings : int
        Extra roundings of the logit scale and of the output.
    **variants
        ``sliding_window``, ``alibi_slopes``, ``logits_soft_cap``.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((3, 2, 8))                    # 3 queries, 2 heads
    >>> k, v = rng.standard_normal((2, 5, 1, 8))              # L = 5 keys, 1 KV head
    >>> bound, bound_lse = prefill_error_bound(q, k, v, 8 ** -0.5, q_positions=[2, 3, 4])
    >>> bound.shape, bound_lse.shape
    ((3, 2, 8), (3, 2))
    >>> # the row at L - 1 = 4 sees every key: the decode bound with the same merges
    >>> one = prefill_error_bound(q[2:], k, v, 8 ** -0.5, [4], num_merges=1)[0][0]
    >>> bool(np.allclose(one, attention_error_bound(q[2], k, v, 8 ** -0.5)[0]))
    True
    """
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    num_q, num_heads, head_size = q.shape
    bound = np.zeros(q.shape)
    bound_lse = np.zeros((num_q, num_heads))
    if k.shape[0] == 0 or num_q == 0:
        return bound, bound_lse
    group = num_heads // k.shape[1]
    kr, vr = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    qpos = np.asarray(q_positions, np.int64)
    z = logits(q, k, scale, q_positions=qpos, causal=causal, **variants)     # [H, num_q, L]
    admitted = np.isfinite(z[0])                                             # [num_q, L]
    mags = np.einsum("qhd,khd->hqk", np.abs(q), np.abs(kr)) * abs(scale)
    dot_u = U32 if tensor_cores is None else TENSOR_CORE_U
    e_s = gamma(head_size + 2 + scale_roundings, dot_u) * np.where(admitted[None], mags,
                                                                   0).max(axis=2)  # [H, num_q]
    if variants.get("logits_soft_cap") is not None:
        e_s = e_s + transcendental_ulps * U32 * variants["logits_soft_cap"]
    if variants.get("alibi_slopes") is not None:
        dist = np.abs(np.arange(k.shape[0])[None, :] - qpos[:, None])
        far = np.where(admitted, dist, 0).max(axis=1)                        # [num_q]
        e_s = e_s + 2 * U32 * np.abs(np.asarray(variants["alibi_slopes"], np.float64))[:, None] \
            * far[None, :]
    n = admitted.sum(axis=1)                                                 # [num_q]
    merges = n if num_merges is None else num_merges
    zmax = z.max(axis=2, keepdims=True)
    empty = np.isneginf(zmax)
    w = np.exp(z - np.where(empty, 0, zmax))
    total = np.where(empty, 1, w.sum(axis=2, keepdims=True))
    lse = (np.log(total) + np.where(empty, 0, zmax))[..., 0]                # [H, num_q]
    spread = np.einsum("hqk,khd->qhd", w / total, np.abs(vr))              # sum_j w_j |v_jd|
    g = gamma(n + 2 * np.asarray(merges) + transcendental_ulps + scale_roundings)   # [num_q]
    if tensor_cores is None:
        bound = (2 * e_s.T + g[:, None])[..., None] * spread
        bound_lse = e_s.T + g[:, None] + U32 * np.abs(lse.T)
    else:
        w_rel, w_abs = P_ROUNDING[tensor_cores]
        g_pv = g + gamma(n + 2 * (n // 16 + 2), TENSOR_CORE_U) + w_rel       # [num_q]
        reach = np.einsum("hqk,khd->qhd", np.isfinite(z), np.abs(vr))       # sum_j |v_j|
        bound = (2 * e_s.T + g_pv[:, None])[..., None] * spread + w_abs * reach
        bound_lse = e_s.T + g[:, None] + 3 * U32 * np.abs(lse.T)
    dead = empty[..., 0].T                                                   # [num_q, H]
    bound[dead] = 0
    bound_lse[dead] = 0
    return bound, bound_lse


def prefill_bounds(problem, q, k, v, scale=None, causal=True, tensor_cores=None, **variants):
    """:func:`prefill_error_bound` for every query row of a :class:`PrefillProblem`
    (``k``, ``v`` are ``"nhd"`` pools; for an fp8 problem the dequantised ones,
    bounded with ``scale_roundings=1``).

    Parameters
    ----------
    problem : PrefillProblem
    q : array, ``[total_q, num_heads, head_size]``
    k, v : array, ``[num_blocks, block_size, num_kv_heads, head_size]`` each
    scale : float, optional
        Default ``1 / sqrt(head_size)``.
    causal : bool
    tensor_cores : {"float16", "bfloat16"}, optional
        As in :func:`prefill_error_bound`.
    **variants
        As in :func:`prefill_error_bound`.

    Returns
    -------
    bound : numpy.ndarray, ``[total_q, num_heads, head_size]``
    bound_lse : numpy.ndarray, ``[total_q, num_heads]``

    Examples
    --------
    >>> p = PrefillProblem(num_seqs=2, num_heads=2, num_kv_heads=1, head_size=8, block_size=4,
    ...                    num_blocks=3, layout="nhd", dtype="float32",
    ...                    q_lens=np.array([2, 1], np.int32), seq_lens=np.array([5, 1], np.int32),
    ...                    block_tables=np.array([[2, 0], [1, -1]], np.int32), seed=0)
    >>> q, k, v = p.arrays()
    >>> bound, bound_lse = prefill_bounds(p, q, k, v)
    >>> bound.shape, bound_lse.shape
    ((3, 2, 8), (3, 2))
    >>> bool((bound > 0).all() and (bound < 1e-5).all())     # a few float32 ulps
    True
    """
    if scale is None:
        scale = 1.0 / math.sqrt(problem.head_size)
    fp8 = is_fp8(problem.dtype)
    bound = np.zeros(q.shape)
    bound_lse = np.zeros(q.shape[:2])
    cu = problem.cu_seqlens_q
    for i, n in enumerate(problem.seq_lens):
        a, b = int(cu[i]), int(cu[i + 1])
        kk, vv = gather_kv(k, v, problem.block_tables[i], n)
        pos = int(n) - (b - a) + np.arange(b - a)
        bound[a:b], bound_lse[a:b] = prefill_error_bound(q[a:b], kk, vv, scale, pos, causal,
                                                         tensor_cores=tensor_cores,
                                                         scale_roundings=int(fp8), **variants)
    return bound, bound_lse




def merge_error_bound(v_states, s_states, bound_v, bound_s, transcendental_ulps=8):
    """Rounding-error bounds for :func:`paged_numba.merge_states` of states that
    carry errors of their own.

    The exact states are ``v_states`` (each normalised by its own exp-sum) and
    their log-sum-exps ``s_states``; the merge gets them off by at most
    ``bound_v`` and ``bound_s`` (``-inf`` states are empty and weigh nothing).
    With ``w_k = exp(s_k - L)`` the exact merge weights, ``L`` the exact merged
    log-sum-exp and ``D = max_k bound_s_k`` over the non-empty states:

    * each computed weight is ``w_k exp(d_k - d_L)`` with ``|d_k - d_L| <= 2 D``,
      so it is within ``w_k (e^(2D) - 1)`` of ``w_k``;
    * the fp32 merge of ``S`` states (one exp each, a sum, a division) adds
      ``gamma(2 S + transcendental_ulps)`` of ``sum_k w_k |v_k|``;
    * ``|d out| <= e^(2D) sum_k w_k bound_v_k
      + (e^(2D) - 1 + gamma(2 S + transcendental_ulps)) sum_k w_k (|v_k| + bound_v_k)``,
      ``|d lse| <= D + gamma(2 S + transcendental_ulps) + u |L|``.

    Returns ``(bound_out [num_rows, num_heads, head_size], bound_lse [num_rows,
    num_heads])``; the final rounding of the output is added by
    :func:`~paged_numba.testing.check_close`.

    Parameters
    ----------
    v_states : array, ``[num_rows, num_states, num_heads, head_size]``
    s_states : array, ``[num_rows, num_states, num_heads]``
        Natural-log log-sum-exps; ``-inf`` for an empty state.
    bound_v : array, ``v_states``' shape
        Error of each state as the merge reads it (its own rounding included).
    bound_s : array, ``s_states``' shape
    transcendental_ulps : int

    Examples
    --------
    >>> v = np.array([[[[1.0]], [[3.0]]]])                     # two states, [1, 2, 1, 1]
    >>> s = np.array([[[0.0], [0.0]]])                         # equal weights: out 2, lse log 2
    >>> exact = merge_error_bound(v, s, np.zeros(v.shape), np.zeros(s.shape))
    >>> bool(exact[0][0, 0, 0] == 2.0 * gamma(12))             # only the merge's own rounding
    True
    >>> loose = merge_error_bound(v, s, np.full(v.shape, 1e-3), np.full(s.shape, 1e-3))
    >>> round(float(loose[0][0, 0, 0]), 6)                     # 1e-3 e^2e-3 + (e^2e-3 - 1) 2.001
    0.005009
    """
    v_states, s_states = np.asarray(v_states, np.float64), np.asarray(s_states, np.float64)
    bound_v, bound_s = np.asarray(bound_v, np.float64), np.asarray(bound_s, np.float64)
    finite = np.isfinite(s_states)
    m = np.where(finite, s_states, -np.inf).max(axis=1, keepdims=True)       # [rows, 1, H]
    empty = ~np.isfinite(m)
    w = np.where(finite, np.exp(s_states - np.where(empty, 0, m)), 0.0)
    total = w.sum(axis=1, keepdims=True)
    lse = np.where(empty, -np.inf, m + np.log(np.where(empty, 1, total)))[:, 0]
    w = w / np.where(empty, 1, total)                                        # [rows, S, H]
    d = np.where(finite, bound_s, 0).max(axis=1)                             # [rows, H]
    grow = np.exp(2 * d)[..., None]
    g = gamma(2 * s_states.shape[1] + transcendental_ulps)
    carried = np.einsum("rsh,rshd->rhd", w, bound_v)
    spread = np.einsum("rsh,rshd->rhd", w, np.abs(v_states) + bound_v)
    bound = grow * carried + (grow - 1 + g) * spread
    bound_lse = np.where(empty[:, 0], 0, d + g + U32 * np.where(empty[:, 0], 0, np.abs(lse)))
    return bound, bound_lse
