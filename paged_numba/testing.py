"""Hypothesis strategies and error bounds for fuzzing paged-attention kernels.

A strategy draws a *problem* (shapes, block tables, sequence lengths and a
seed for the data) rather than the data itself, so that examples stay cheap
to draw and shrink, and the arrays come from ``numpy.random`` with that seed.

Error bounds come from the data, never from a hand-tuned tolerance: a
first-order rounding-error analysis of fp32 attention (see
:func:`attention_error_bound`) is evaluated on the very inputs of the test,
and one unit in the last place of the output dtype is added for the final
rounding. An fp16 result may therefore be off by one fp16 ulp plus a tiny
fp32 term; anything larger is a bug.

Examples
--------
>>> from hypothesis import given
>>> from paged_numba.testing import decode_problems
>>> @given(decode_problems(head_sizes=(16,), max_seq_len=40))
... def test_shapes(p):
...     assert p.block_tables.shape == (p.num_seqs, p.max_blocks)
>>> test_shapes()
"""
import dataclasses
import math

import ml_dtypes
import numpy as np
from hypothesis import strategies as st

from .kernels.decode import heads_per_block
from .kernels import decode_tc
from .layouts import from_nhd
from .reference import gather_kv, logits, paged_decode_reference

GQA_GROUPS = (1, 2, 4, 8)
ALL_DTYPES = ("float16", "float32", "bfloat16")   # every dtype the kernels store
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def lengths(block_size, max_len):
    """Sequence lengths that stress block boundaries: 1, exact multiples of
    ``block_size``, multiples +-1, and anything up to ``max_len``.

    Parameters
    ----------
    block_size : int
    max_len : int
        The largest length drawn (>= 1).

    Returns
    -------
    hypothesis strategy of int
        Half of the draws come from the boundary values, half from
        ``integers(1, max_len)``.

    Examples
    --------
    >>> from hypothesis import given, settings
    >>> seen = set()
    >>> @given(lengths(block_size=16, max_len=40))    # boundaries: 1, 15, 16, 17, 31, 32, 33, 40
    ... @settings(max_examples=20, database=None)
    ... def check(n):
    ...     assert 1 <= n <= 40
    ...     seen.add(n)
    >>> check()
    >>> seen <= set(range(1, 41))
    True
    """
    specials = sorted({n for k in range(1, max_len // block_size + 2)
                       for n in (k * block_size - 1, k * block_size, k * block_size + 1)
                       if 1 <= n <= max_len} | {1, max_len})
    return st.one_of(st.sampled_from(specials), st.integers(1, max_len))


@st.composite
def block_tables(draw, seq_lens, block_size, num_blocks=None, extra_columns=2, share=True):
    """A padded ``[num_seqs, max_blocks]`` int32 table for ``seq_lens``.

    Physical blocks are a random permutation of the pool (so a sequence's
    blocks are neither contiguous nor ordered); with ``share`` some sequences
    reuse another sequence's blocks (prefix sharing); ``-1`` pads each row and
    ``extra_columns`` unused columns follow the longest row. Returns
    ``(table, num_blocks)``.

    Parameters
    ----------
    seq_lens : sequence of int, ``[num_seqs]``
    block_size : int
    num_blocks : int, optional
        Blocks in the pool; by default the blocks used plus 0 to 3 spare ones.
    extra_columns : int
        At most this many all-``-1`` columns after the longest row.
    share : bool
        Let a sequence reuse a prefix of the previous sequence's blocks.

    Returns
    -------
    hypothesis strategy of ``(numpy.ndarray of int32 [num_seqs, max_blocks], int)``

    Examples
    --------
    >>> from hypothesis import given, settings
    >>> @given(block_tables([5, 9], block_size=4, share=False))
    ... @settings(max_examples=10, database=None)
    ... def check(drawn):
    ...     table, num_blocks = drawn
    ...     used = (table >= 0).sum(axis=1)
    ...     assert used.tolist() == [2, 3]               # ceil(5 / 4) = 2, ceil(9 / 4) = 3
    ...     assert 3 <= table.shape[1] <= 3 + 2          # longest row + 0..2 extra columns
    ...     assert 5 <= num_blocks <= 5 + 3              # 2 + 3 used + 0..3 spare
    ...     assert len(set(table[table >= 0].tolist())) == 5    # no block used twice
    >>> check()
    """
    used = [-(-int(n) // block_size) for n in seq_lens]
    total = sum(used)
    if num_blocks is None:
        num_blocks = total + draw(st.integers(0, 3))
    perm = draw(st.permutations(range(num_blocks))) if num_blocks else []
    max_blocks = max(used, default=0) + draw(st.integers(0, extra_columns))
    table = np.full((len(seq_lens), max(max_blocks, 1)), -1, np.int32)
    pos = 0
    for i, u in enumerate(used):
        if share and i > 0 and u and used[i - 1] and draw(st.booleans()):
            # share a prefix of the previous sequence's blocks
            k = draw(st.integers(1, min(u, used[i - 1])))
            table[i, :k] = table[i - 1, :k]
            rest = u - k
        else:
            k, rest = 0, u
        table[i, k:k + rest] = perm[pos:pos + rest]
        pos += rest
    return table, num_blocks


class _PagedProblem:
    """What decode and prefill problems share: their data and table helpers."""

    @property
    def max_blocks(self):
        return self.block_tables.shape[1]

    def arrays(self):
        """Random ``query [query_rows, num_heads, head_size]`` and ``"nhd"`` pools
        ``[num_blocks, block_size, num_kv_heads, head_size]``, in ``dtype``
        (``ml_dtypes.bfloat16`` arrays for ``"bfloat16"``)."""
        rng = np.random.default_rng(self.seed)
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_size)
        q = rng.standard_normal((self.query_rows, self.num_heads, self.head_size))
        k = rng.standard_normal(shape)
        v = rng.standard_normal(shape)
        return tuple(a.astype(np.dtype(self.dtype)) for a in (q, k, v))

    def layout_pools(self, k, v):
        """``(key_cache, value_cache)`` host pools in this problem's layout."""
        return from_nhd(k, v, self.layout)


@dataclasses.dataclass
class DecodeProblem(_PagedProblem):
    """One paged-decode case: shapes, tables and a seed for the data.

    ``seq_lens`` is int32 ``[num_seqs]``, ``block_tables`` int32 ``[num_seqs,
    max_blocks]`` (``-1``-padded); :meth:`arrays` draws the query and
    ``"nhd"`` pools from ``seed``, :meth:`layout_pools` converts the pools
    to ``layout``. Usually drawn by :func:`decode_problems`.

    Examples
    --------
    >>> import numpy as np
    >>> p = DecodeProblem(num_seqs=2, num_heads=2, num_kv_heads=1, head_size=8, block_size=4,
    ...                   num_blocks=3, layout="vllm", dtype="float16",
    ...                   seq_lens=np.array([5, 2], np.int32),
    ...                   block_tables=np.array([[2, 0], [1, -1]], np.int32), seed=0)
    >>> p.max_blocks
    2
    >>> q, k, v = p.arrays()
    >>> q.shape, k.shape, k.dtype                      # [num_seqs, num_heads, D], [nb, B, H, D]
    ((2, 2, 8), (3, 4, 1, 8), dtype('float16'))
    >>> [a.shape for a in p.layout_pools(k, v)]        # "vllm", x = 16 // 2 = 8
    [(3, 1, 1, 4, 8), (3, 1, 8, 4)]
    """

    num_seqs: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    num_blocks: int
    layout: str
    dtype: str
    seq_lens: np.ndarray        # [num_seqs] int32
    block_tables: np.ndarray    # [num_seqs, max_blocks] int32
    seed: int

    @property
    def query_rows(self):
        return self.num_seqs


@st.composite
def decode_problems(draw, head_sizes=(64, 80, 96, 112, 128, 256), block_sizes=(8, 16, 32),
                    layouts=("nhd", "vllm", "hnd", "interleaved"), dtypes=ALL_DTYPES,
                    groups=GQA_GROUPS, max_kv_heads=2, max_seqs=3, max_seq_len=200):
    """Draw a :class:`DecodeProblem`.

    GQA group sizes come from ``groups`` and MQA (one KV head) is drawn
    as often as the other head counts.

    Parameters
    ----------
    head_sizes, block_sizes, layouts, dtypes, groups : sequence
        Values to sample from (``num_heads = num_kv_heads * group``).
    max_kv_heads, max_seqs, max_seq_len : int
        Upper bounds of ``num_kv_heads``, ``num_seqs`` and each sequence length
        (drawn by :func:`lengths`).

    Returns
    -------
    hypothesis strategy of :class:`DecodeProblem`

    Examples
    --------
    >>> from hypothesis import given, settings
    >>> @given(decode_problems(head_sizes=(8,), block_sizes=(4,), layouts=("hnd",),
    ...                        dtypes=("float32",), max_seqs=2, max_seq_len=10))
    ... @settings(max_examples=10, database=None)
    ... def check(p):
    ...     assert p.head_size == 8 and p.block_size == 4 and p.layout == "hnd"
    ...     assert p.num_heads % p.num_kv_heads == 0 and 1 <= p.num_seqs <= 2
    ...     assert p.block_tables.shape[0] == p.seq_lens.size == p.num_seqs
    ...     assert ((p.block_tables >= 0).sum(axis=1) >= -(-p.seq_lens // 4)).all()
    >>> check()
    """
    block_size = draw(st.sampled_from(block_sizes))
    num_kv_heads = draw(st.integers(1, max_kv_heads))
    group = draw(st.sampled_from(groups))
    num_seqs = draw(st.integers(1, max_seqs))
    seq_lens = np.array(draw(st.lists(lengths(block_size, max_seq_len),
                                      min_size=num_seqs, max_size=num_seqs)), np.int32)
    table, num_blocks = draw(block_tables(seq_lens, block_size))
    return DecodeProblem(
        num_seqs=num_seqs, num_heads=num_kv_heads * group, num_kv_heads=num_kv_heads,
        head_size=draw(st.sampled_from(head_sizes)), block_size=block_size,
        num_blocks=max(num_blocks, 1), layout=draw(st.sampled_from(layouts)),
        dtype=draw(st.sampled_from(dtypes)), seq_lens=seq_lens, block_tables=table,
        seed=draw(st.integers(0, 2**32 - 1)))


U32 = 2.0 ** -24   # unit roundoff of float32, the precision every kernel computes in
# Tensor-core products (``mma.sync``, fp16/bf16 in, fp32 accumulate) are exact, but
# the accumulation aligns each block of products to the largest exponent and
# truncates instead of rounding to nearest (Fasi, Higham, Mikaitis and Pranesh,
# "Numerical behavior of NVIDIA tensor cores", PeerJ CS 2021): the dot products
# of the tensor-core decode kernel are bounded with 4 units of fp32 roundoff.
TENSOR_CORE_U = 4 * U32
# P @ V on tensor cores (``decode_tc_kernel(pv_mma=True)``, the default): each
# 8-token step is two ``mma.m16n8k8`` into the running output, one with the
# hi and one with the lo half of the weights (``kernels.mma.split_pack``).
# Each mma adds its nonzero products and C with TENSOR_CORE_U per term, so a
# sequence of n tokens in ``steps`` steps is a sum of at most 2 n + 4 steps
# terms; the split leaves the weights within (relative, absolute) of these:
PV_WEIGHT_ERROR = {"float16": (2.0 ** -22, 2.0 ** -40), "bfloat16": (2.0 ** -16, 0.0)}
# The tensor-core prefill kernel (``kernels.prefill_tc``) rounds each weight
# p = exp2(z - m) <= 1 once to the cache's dtype before P @ V, to nearest:
# relative error at most 2**-11 (fp16) or 2**-8 (bf16) of p, plus half the
# subnormal spacing below the smallest normal (fp16: 2**-25; bf16 shares fp32's
# range: 2**-134). The row sums use the unrounded fp32 weights.
P_ROUNDING = {"float16": (2.0 ** -11, 2.0 ** -25), "bfloat16": (2.0 ** -8, 2.0 ** -134)}


def config_id(config):
    """pytest id of a test configuration (keyword arguments of
    :func:`decode_problems` or :func:`prefill_problems`): the first value of
    each drawn parameter; the size limits (``max_*``) are left out.

    >>> config_id(dict(head_sizes=(64,), dtypes=("float16",), max_seqs=4)), config_id({})
    ('head_size64-dtypefloat16', 'drawn')
    """
    return "-".join(f"{k[:-1]}{v[0]}" for k, v in config.items()
                    if not k.startswith("max")) or "drawn"


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
                          pv=None, **variants):
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
      TENSOR_CORE_U) + w_rel``, and ``w_abs * sum_j |v_jd|`` is added.

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
    e_s = gamma(head_size + 2, dot_u) * mags.max(axis=1)            # [num_heads]
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
    g = gamma(k.shape[0] + 2 * num_merges + transcendental_ulps)
    if pv is None:
        bound = (2 * e_s + g)[:, None] * spread
    else:
        steps, w_rel, w_abs = pv
        g_pv = (gamma(2 * num_merges + transcendental_ulps)
                + gamma(2 * k.shape[0] + 4 * steps, TENSOR_CORE_U) + w_rel)
        bound = ((2 * e_s + g_pv)[:, None] * spread
                 + w_abs * np.abs(np.repeat(v, group, axis=1)).sum(axis=0))
    return bound, e_s + g + U32 * np.abs(lse)


def decode_bounds(problem, q, k, v, scale=None, num_partitions=None, **variants):
    """:func:`attention_error_bound` for every sequence of a :class:`DecodeProblem`.

    Merges counted: one per token (the decode kernel rescales its running
    output at most once per warp step of several tokens, and merges at most
    one non-empty state per warp that saw tokens) plus one per split-K
    partition (at most the table's capacity in tokens when
    ``num_partitions`` is None). Where ``paged_decode`` runs the tensor-core
    kernel, the logits are bounded with :data:`TENSOR_CORE_U`; where it does
    P @ V on tensor cores (``kernels.decode_tc.PV_MMA``, read at call time as
    the launcher reads it), P @ V as in :data:`PV_WEIGHT_ERROR`, with at most
    ``min(n, ceil(n / 8) + 2 num_partitions)`` 8-token steps for ``n`` tokens.

    Parameters
    ----------
    problem : DecodeProblem
    q : array, ``[num_seqs, num_heads, head_size]``
    k, v : array, ``[num_blocks, block_size, num_kv_heads, head_size]`` each (``"nhd"`` pools)
    scale : float, optional
        Default ``1 / sqrt(head_size)``.
    num_partitions : int, optional
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
    hpb = heads_per_block(problem.num_heads // problem.num_kv_heads)
    tc = decode_tc.supports(problem.head_size, hpb, problem.dtype, problem.layout)
    dot_u = TENSOR_CORE_U if tc else U32
    bound = np.zeros(q.shape)
    bound_lse = np.zeros(q.shape[:2])
    for i, n in enumerate(problem.seq_lens):
        kk, vv = gather_kv(k, v, problem.block_tables[i], n)
        pv = None
        if tc and decode_tc.PV_MMA:
            steps = min(int(n), -(-int(n) // 8) + 2 * num_partitions)
            pv = (steps, *PV_WEIGHT_ERROR[problem.dtype])
        bound[i], bound_lse[i] = attention_error_bound(q[i], kk, vv, scale, int(n) + num_partitions,
                                                       dot_u=dot_u, pv=pv, **variants)
    return bound, bound_lse


def ulp(x, dtype):
    """One unit in the last place of ``dtype`` at ``|x|`` rounded to ``dtype``
    (``np.spacing`` of it), as float64.

    bfloat16 (8 significant bits, exponents -126..127) is computed here:
    ``2 ** (e - 7)`` for a value in ``[2**e, 2**(e + 1))``, and ``2 ** -133``
    (the smallest subnormal) below ``2 ** -126`` and at zero; inf and NaN give NaN.

    >>> ulp(np.array([1.0, 1.5, 0.0, 3.0e38]), "bfloat16").tolist()   # 2**-7, 2**-7, 2**-133, 2**120
    [0.0078125, 0.0078125, 9.183549615799121e-41, 1.329227995784916e+36]
    """
    dtype = np.dtype(dtype)
    r = np.abs(np.asarray(x, np.float64)).astype(dtype)
    if dtype != BFLOAT16:
        return np.spacing(r).astype(np.float64)
    r = r.astype(np.float64)
    # r = m 2**e with m in [0.5, 1): leading bit 2**(e - 1), 7 more bits below it;
    # subnormals and zero have the spacing of the smallest normal, 2**-126
    _, e = np.frexp(np.maximum(r, 2.0 ** -126))
    return np.where(np.isfinite(r), np.ldexp(1.0, e - 8), np.nan)


def check_close(out, ref64, bound, what="output"):
    """Assert ``|out - ref64| <= bound + ulp(ref64)`` everywhere, where the
    ulp (one unit in the last place of ``out``'s dtype at the reference value,
    :func:`ulp`) covers the final rounding to that dtype. Returns the largest
    error over its bound.

    Parameters
    ----------
    out : array, any shape
        The result under test, in its own dtype (NaN fails at once).
    ref64 : numpy.ndarray of float64, ``out``'s shape
    bound : numpy.ndarray, ``out``'s shape (or broadcastable to it)
        Allowed error before the final rounding.
    what : str
        Name of ``out`` in the error message.

    Returns
    -------
    float
        ``max |out - ref64| / (bound + ulp(ref64))``, at most 1.

    Examples
    --------
    >>> ref = np.array([1.0, 2.01])
    >>> out = ref.astype(np.float16)              # rounding to float16 is always allowed
    >>> check_close(out, ref, bound=np.zeros(2)) <= 1
    True
    >>> check_close(np.array([1.0, 2.0], np.float16), ref, np.zeros(2))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
        ...
    AssertionError: output differs from the float64 reference at (1,): ...
    """
    out = np.asarray(out)
    assert not np.isnan(out).any(), f"{what} has NaN"
    err = np.abs(out.astype(np.float64) - ref64)
    allowed = bound + ulp(ref64, out.dtype)
    bad = err > allowed
    if bad.any():
        i = tuple(int(a[0]) for a in np.nonzero(bad))
        raise AssertionError(
            f"{what} differs from the float64 reference at {i}: {out[i]!r} vs {ref64[i]!r} "
            f"(error {err[i]:.3g} > bound {allowed[i]:.3g}; max error {err.max():.3g}, "
            f"{int(bad.sum())} of {bad.size} elements out of bounds)")
    return float(np.max(err / allowed, initial=0.0))


def check_attention(q, out, lse, ref, ref_lse, bound, bound_lse):
    """Check a kernel's ``out`` (``[rows, num_heads, head_size]``, the query's
    shape and dtype) and ``lse`` (``[rows, num_heads]``) against the float64
    reference and its bounds (from :func:`decode_reference` or
    :func:`prefill_reference`): :func:`check_close` on both, ``-inf`` exactly
    where the reference has no admissible key. Returns the output's largest
    error over its bound (also noted in a hypothesis test).

    Examples
    --------
    >>> q = np.zeros((1, 1, 2), np.float32)
    >>> ref, ref_lse = np.array([[[1.0, 2.0]]]), np.array([[0.5]])
    >>> check_attention(q, ref.astype(np.float32), ref_lse.astype(np.float32), ref, ref_lse,
    ...                 np.zeros((1, 1, 2)), np.zeros((1, 1)))
    0.0
    """
    from hypothesis import currently_in_test_context, note

    assert out.shape == q.shape and out.dtype == q.dtype
    ratio = check_close(out, ref, bound)
    if currently_in_test_context():
        note(f"max error / bound: {ratio:.3g}")
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), finite)
    check_close(lse[finite], ref_lse[finite], bound_lse[finite], "lse")
    return ratio


def decode_reference(problem, q, k, v, scale=None, num_partitions=None, **variants):
    """float64 ``(out, lse)`` and their error bounds ``(bound, bound_lse)`` for a
    :class:`DecodeProblem` (``k``, ``v`` are ``"nhd"`` pools); ``variants`` as in
    :func:`paged_numba.reference.logits`.

    Parameters
    ----------
    problem : DecodeProblem
    q : array, ``[num_seqs, num_heads, head_size]``
    k, v : array, ``[num_blocks, block_size, num_kv_heads, head_size]`` each
    scale : float, optional
    num_partitions : int, optional
        As in :func:`decode_bounds`.

    Returns
    -------
    out, bound : numpy.ndarray, ``[num_seqs, num_heads, head_size]`` each
    lse, bound_lse : numpy.ndarray, ``[num_seqs, num_heads]`` each

    Examples
    --------
    >>> p = DecodeProblem(num_seqs=2, num_heads=2, num_kv_heads=1, head_size=8, block_size=4,
    ...                   num_blocks=3, layout="nhd", dtype="float16",
    ...                   seq_lens=np.array([5, 2], np.int32),
    ...                   block_tables=np.array([[2, 0], [1, -1]], np.int32), seed=0)
    >>> q, k, v = p.arrays()
    >>> out, lse, bound, bound_lse = decode_reference(p, q, k, v, sliding_window=3)
    >>> out.dtype, out.shape, lse.shape
    (dtype('float64'), (2, 2, 8), (2, 2))
    >>> check_close(out.astype(np.float16), out, bound) <= 1     # what a kernel is held to
    True
    """
    if scale is None:
        scale = 1.0 / math.sqrt(problem.head_size)
    out, lse = paged_decode_reference(q, k, v, problem.block_tables, problem.seq_lens, scale,
                                      "nhd", **variants)
    return out, lse, *decode_bounds(problem, q, k, v, scale, num_partitions, **variants)


@st.composite
def variants(draw, num_heads, max_window=64):
    """Keyword arguments for the attention variants: each of ``sliding_window``,
    ``alibi_slopes`` (ALiBi's geometric slopes or random ones) and
    ``logits_soft_cap`` is present or absent.

    Parameters
    ----------
    num_heads : int
        Length of ``alibi_slopes``.
    max_window : int
        Largest ``sliding_window``.

    Returns
    -------
    hypothesis strategy of dict
        Keyword arguments for :func:`paged_numba.reference.attention` and the kernels.

    Examples
    --------
    >>> from hypothesis import given, settings
    >>> from paged_numba.reference import attention
    >>> @given(variants(num_heads=2, max_window=4))
    ... @settings(max_examples=10, database=None)
    ... def check(kw):
    ...     assert set(kw) <= {"sliding_window", "alibi_slopes", "logits_soft_cap"}
    ...     assert 1 <= kw.get("sliding_window", 1) <= 4
    ...     assert len(kw.get("alibi_slopes", [0, 0])) == 2
    ...     out, lse = attention(np.ones((1, 2, 8)), np.ones((6, 1, 8)), np.ones((6, 1, 8)),
    ...                          1.0, **kw)
    ...     assert out.shape == (1, 2, 8) and np.isfinite(lse).all()
    >>> check()
    """
    out = {}
    if draw(st.booleans()):
        out["sliding_window"] = draw(st.integers(1, max_window))
    if draw(st.booleans()):
        if draw(st.booleans()):
            out["alibi_slopes"] = 2.0 ** (-8.0 * (np.arange(num_heads) + 1) / num_heads)
        else:
            out["alibi_slopes"] = np.array(draw(st.lists(
                st.floats(-1, 1, width=32), min_size=num_heads, max_size=num_heads)), np.float32)
    if draw(st.booleans()):
        out["logits_soft_cap"] = draw(st.sampled_from([0.5, 5.0, 30.0, 50.0]))
    return out


# -- prefill ---------------------------------------------------------------------------

@dataclasses.dataclass
class PrefillProblem(_PagedProblem):
    """One paged-prefill case: query lengths, cache lengths, tables and a seed.

    Sequence ``i`` has ``q_lens[i] >= 1`` query tokens, the newest of its
    ``seq_lens[i] >= q_lens[i]`` tokens in the cache (so ``seq_lens[i] -
    q_lens[i]`` were cached before this step).

    ``q_lens`` and ``seq_lens`` are int32 ``[num_seqs]``, ``block_tables``
    int32 ``[num_seqs, max_blocks]``; :meth:`arrays` draws the query
    ``[total_q, num_heads, head_size]`` and ``"nhd"`` pools from ``seed``.
    Usually drawn by :func:`prefill_problems`.

    Examples
    --------
    >>> p = PrefillProblem(num_seqs=2, num_heads=2, num_kv_heads=1, head_size=8, block_size=4,
    ...                    num_blocks=3, layout="hnd", dtype="float32",
    ...                    q_lens=np.array([2, 1], np.int32), seq_lens=np.array([5, 1], np.int32),
    ...                    block_tables=np.array([[2, 0], [1, -1]], np.int32), seed=0)
    >>> p.cu_seqlens_q, p.total_q, p.max_blocks   # seq 0: rows 0..1 (positions 3, 4); seq 1: row 2
    (array([0, 2, 3], dtype=int32), 3, 2)
    >>> [a.shape for a in p.arrays()]
    [(3, 2, 8), (3, 4, 1, 8), (3, 4, 1, 8)]
    """

    num_seqs: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    num_blocks: int
    layout: str
    dtype: str
    q_lens: np.ndarray          # [num_seqs] int32
    seq_lens: np.ndarray        # [num_seqs] int32
    block_tables: np.ndarray    # [num_seqs, max_blocks] int32
    seed: int

    @property
    def cu_seqlens_q(self):
        """``[num_seqs + 1]`` int32: query rows of sequence ``i`` are ``cu[i]:cu[i + 1]``."""
        return np.concatenate([[0], np.cumsum(self.q_lens)]).astype(np.int32)

    @property
    def total_q(self):
        return int(np.sum(self.q_lens))

    @property
    def query_rows(self):
        return self.total_q


@st.composite
def prefill_problems(draw, head_sizes=(16, 32, 64, 128), block_sizes=(1, 4, 8, 16),
                     layouts=("nhd", "vllm", "hnd", "interleaved"), dtypes=("float16", "float32"),
                     groups=GQA_GROUPS, max_kv_heads=2, max_seqs=3, max_q_len=40, max_cached=60):
    """Draw a :class:`PrefillProblem`.

    Query lengths are >= 1 (a sequence with no query rows is allowed by
    ``paged_prefill`` but does nothing; tests cover it by hand). Cached
    lengths are 0 (a whole prompt), lengths next to block boundaries, or
    anything up to ``max_cached``, so chunks often start inside a block and
    straddle block boundaries.

    Parameters
    ----------
    head_sizes, block_sizes, layouts, dtypes, groups : sequence
        Values to sample from.
    max_kv_heads, max_seqs : int
    max_q_len, max_cached : int
        Upper bounds of each query length and each cached length.

    Returns
    -------
    hypothesis strategy of :class:`PrefillProblem`

    Examples
    --------
    >>> from hypothesis import given, settings
    >>> @given(prefill_problems(head_sizes=(16,), block_sizes=(4,), max_q_len=6, max_cached=9))
    ... @settings(max_examples=10, database=None)
    ... def check(p):
    ...     assert (p.q_lens >= 1).all() and (p.q_lens <= 6).all()
    ...     assert (p.q_lens <= p.seq_lens).all() and (p.seq_lens <= 6 + 9).all()
    ...     assert p.cu_seqlens_q[-1] == p.total_q
    >>> check()
    """
    block_size = draw(st.sampled_from(block_sizes))
    num_kv_heads = draw(st.integers(1, max_kv_heads))
    group = draw(st.sampled_from(groups))
    num_seqs = draw(st.integers(1, max_seqs))
    q_lens = np.array(draw(st.lists(lengths(block_size, max_q_len), min_size=num_seqs,
                                    max_size=num_seqs)), np.int32)
    cached = np.array(draw(st.lists(st.one_of(st.just(0), lengths(block_size, max_cached)),
                                    min_size=num_seqs, max_size=num_seqs)), np.int32)
    seq_lens = (q_lens + cached).astype(np.int32)
    table, num_blocks = draw(block_tables(seq_lens, block_size))
    return PrefillProblem(
        num_seqs=num_seqs, num_heads=num_kv_heads * group, num_kv_heads=num_kv_heads,
        head_size=draw(st.sampled_from(head_sizes)), block_size=block_size,
        num_blocks=max(num_blocks, 1), layout=draw(st.sampled_from(layouts)),
        dtype=draw(st.sampled_from(dtypes)), q_lens=q_lens, seq_lens=seq_lens,
        block_tables=table, seed=draw(st.integers(0, 2**32 - 1)))


def prefill_error_bound(q, k, v, scale, q_positions, causal=True, num_merges=None,
                        transcendental_ulps=8, tensor_cores=None, **variants):
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
    e_s = gamma(head_size + 2, dot_u) * np.where(admitted[None], mags, 0).max(axis=2)  # [H, num_q]
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
    g = gamma(n + 2 * np.asarray(merges) + transcendental_ulps)             # [num_q]
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
    (``k``, ``v`` are ``"nhd"`` pools).

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
    bound = np.zeros(q.shape)
    bound_lse = np.zeros(q.shape[:2])
    cu = problem.cu_seqlens_q
    for i, n in enumerate(problem.seq_lens):
        a, b = int(cu[i]), int(cu[i + 1])
        kk, vv = gather_kv(k, v, problem.block_tables[i], n)
        pos = int(n) - (b - a) + np.arange(b - a)
        bound[a:b], bound_lse[a:b] = prefill_error_bound(q[a:b], kk, vv, scale, pos, causal,
                                                         tensor_cores=tensor_cores, **variants)
    return bound, bound_lse


def prefill_reference(problem, q, k, v, scale=None, causal=True, tensor_cores=None, **variants):
    """float64 ``(out, lse)`` and their error bounds ``(bound, bound_lse)`` for a
    :class:`PrefillProblem` (``k``, ``v`` are ``"nhd"`` pools); ``variants`` as
    in :func:`paged_numba.reference.logits`.

    Parameters
    ----------
    problem : PrefillProblem
    q : array, ``[total_q, num_heads, head_size]``
    k, v : array, ``[num_blocks, block_size, num_kv_heads, head_size]`` each
    scale : float, optional
    causal : bool
    tensor_cores : {"float16", "bfloat16"}, optional
        Bounds for the tensor-core kernel (see :func:`prefill_error_bound`).

    Returns
    -------
    out, bound : numpy.ndarray, ``[total_q, num_heads, head_size]`` each
    lse, bound_lse : numpy.ndarray, ``[total_q, num_heads]`` each

    Examples
    --------
    >>> p = PrefillProblem(num_seqs=2, num_heads=2, num_kv_heads=1, head_size=8, block_size=4,
    ...                    num_blocks=3, layout="nhd", dtype="float16",
    ...                    q_lens=np.array([2, 1], np.int32), seq_lens=np.array([5, 1], np.int32),
    ...                    block_tables=np.array([[2, 0], [1, -1]], np.int32), seed=0)
    >>> q, k, v = p.arrays()
    >>> out, lse, bound, bound_lse = prefill_reference(p, q, k, v)
    >>> out.shape, lse.shape
    ((3, 2, 8), (3, 2))
    >>> # seq 1 holds one token (slot 1 * 4 + 0): its weight is 1, so its row is that value row
    >>> bool((out[2] == v[1, 0].astype(np.float64)).all())
    True
    >>> check_close(out.astype(np.float16), out, bound) <= 1
    True
    """
    from .reference import paged_prefill_reference

    if scale is None:
        scale = 1.0 / math.sqrt(problem.head_size)
    out, lse = paged_prefill_reference(q, k, v, problem.block_tables, problem.cu_seqlens_q,
                                       problem.seq_lens, scale, "nhd", causal=causal, **variants)
    return out, lse, *prefill_bounds(problem, q, k, v, scale, causal, tensor_cores, **variants)
