"""Hypothesis strategies for fuzzing paged-attention kernels.

A strategy draws a *problem* (shapes, block tables, sequence lengths and a
seed for the data) rather than the data itself, so that examples stay cheap
to draw and shrink, and the arrays come from ``numpy.random`` with that seed.
:mod:`paged_numba.testing.bounds` holds the error bounds the results are
held to.
"""
import dataclasses

import numpy as np
from hypothesis import strategies as st

from ..fp8 import FP8_DTYPES, QUERY_DTYPES, fp8_scales, is_fp8, quantize
from ..layouts import from_nhd

GQA_GROUPS = (1, 2, 4, 8)
ALL_DTYPES = ("float16", "float32", "bfloat16")   # every 16/32-bit dtype the kernels store
__all__ = ["ALL_DTYPES", "FP8_DTYPES", "GQA_GROUPS", "DecodeProblem", "PrefillProblem",
           "block_tables", "config_id", "decode_problems", "lengths", "prefill_problems",
           "variants"]


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
        (``ml_dtypes.bfloat16`` arrays for ``"bfloat16"``).

        For an fp8 ``dtype`` the query is in :attr:`query_dtype` and the pools
        hold the *stored* fp8 values: standard normal keys and values times a
        magnitude of each KV head (``4 ** h``, so that per-head scales differ),
        quantised with :meth:`scales` (see :func:`paged_numba.fp8.quantize`)."""
        rng = np.random.default_rng(self.seed)
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_size)
        q = rng.standard_normal((self.query_rows, self.num_heads, self.head_size))
        k = rng.standard_normal(shape)
        v = rng.standard_normal(shape)
        if not is_fp8(self.dtype):
            return tuple(a.astype(np.dtype(self.dtype)) for a in (q, k, v))
        k_scale, v_scale = self.scales()
        k, v = self._fp8_inputs(k, v)
        return (q.astype(np.dtype(self.query_dtype)), quantize(k, k_scale, self.dtype),
                quantize(v, v_scale, self.dtype))

    def _fp8_inputs(self, k, v):
        """The float32 keys and values an fp8 problem quantises."""
        mag = 4.0 ** np.arange(self.num_kv_heads)[:, None]
        return (k * mag).astype(np.float32), (v * mag).astype(np.float32)

    def scales(self):
        """``(k_scale, v_scale)`` of an fp8 problem: ``paged_numba.fp8_scales`` of
        its data, per KV head when :attr:`per_head_scales` (1.0 and 1.0 for
        other dtypes)."""
        if not is_fp8(self.dtype):
            return 1.0, 1.0
        rng = np.random.default_rng(self.seed)
        rng.standard_normal((self.query_rows, self.num_heads, self.head_size))
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_size)
        k, v = self._fp8_inputs(rng.standard_normal(shape), rng.standard_normal(shape))
        return (fp8_scales(k, self.dtype, self.per_head_scales),
                fp8_scales(v, self.dtype, self.per_head_scales))

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

    An fp8 problem draws its query in ``query_dtype`` and stores its keys and
    values in fp8 with the scales of :meth:`scales`:

    >>> f8 = DecodeProblem(**{**p.__dict__, "head_size": 16, "dtype": "float8_e5m2",
    ...                       "query_dtype": "bfloat16", "per_head_scales": True})
    >>> q, k, v = f8.arrays()
    >>> q.dtype, k.dtype, [s.shape for s in f8.scales()]
    (dtype(bfloat16), dtype(float8_e5m2), [(1,), (1,)])
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
    query_dtype: str = None     # fp8 dtype: the query's (float16, bfloat16 or float32)
    per_head_scales: bool = False   # fp8 dtype: one scale per KV head, not one per tensor

    def __post_init__(self):
        if self.query_dtype is None:
            self.query_dtype = "float16" if is_fp8(self.dtype) else self.dtype

    @property
    def query_rows(self):
        return self.num_seqs


@st.composite
def decode_problems(draw, head_sizes=(64, 80, 96, 112, 128, 256), block_sizes=(8, 16, 32),
                    layouts=("nhd", "vllm", "hnd", "interleaved"), dtypes=ALL_DTYPES,
                    groups=GQA_GROUPS, max_kv_heads=2, max_seqs=3, max_seq_len=200,
                    query_dtypes=QUERY_DTYPES):
    """Draw a :class:`DecodeProblem`.

    GQA group sizes come from ``groups`` and MQA (one KV head) is drawn
    as often as the other head counts. An fp8 dtype (``FP8_DTYPES``) also
    draws the query's dtype from ``query_dtypes`` and per-tensor or per-head
    scales (and needs head sizes that are multiples of 16).

    Parameters
    ----------
    head_sizes, block_sizes, layouts, dtypes, groups : sequence
        Values to sample from (``num_heads = num_kv_heads * group``).
    query_dtypes : sequence
        Query dtypes of fp8 problems.
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
    p = DecodeProblem(
        num_seqs=num_seqs, num_heads=num_kv_heads * group, num_kv_heads=num_kv_heads,
        head_size=draw(st.sampled_from(head_sizes)), block_size=block_size,
        num_blocks=max(num_blocks, 1), layout=draw(st.sampled_from(layouts)),
        dtype=draw(st.sampled_from(dtypes)), seq_lens=seq_lens, block_tables=table,
        seed=draw(st.integers(0, 2**32 - 1)))
    if is_fp8(p.dtype):     # (drawn only here: other problems draw what they always drew)
        p.query_dtype = draw(st.sampled_from(query_dtypes))
        p.per_head_scales = draw(st.booleans())
    return p


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
    query_dtype: str = None     # fp8 dtype: the query's, as in DecodeProblem
    per_head_scales: bool = False

    def __post_init__(self):
        if self.query_dtype is None:
            self.query_dtype = "float16" if is_fp8(self.dtype) else self.dtype

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
                     groups=GQA_GROUPS, max_kv_heads=2, max_seqs=3, max_q_len=40, max_cached=60,
                     query_dtypes=QUERY_DTYPES):
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
    query_dtypes : sequence
        Query dtypes of fp8 problems (which also draw per-tensor or per-head
        scales), as in :func:`decode_problems`.
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
    p = PrefillProblem(
        num_seqs=num_seqs, num_heads=num_kv_heads * group, num_kv_heads=num_kv_heads,
        head_size=draw(st.sampled_from(head_sizes)), block_size=block_size,
        num_blocks=max(num_blocks, 1), layout=draw(st.sampled_from(layouts)),
        dtype=draw(st.sampled_from(dtypes)), q_lens=q_lens, seq_lens=seq_lens,
        block_tables=table, seed=draw(st.integers(0, 2**32 - 1)))
    if is_fp8(p.dtype):
        p.query_dtype = draw(st.sampled_from(query_dtypes))
        p.per_head_scales = draw(st.booleans())
    return p


def config_id(config):
    """pytest id of a test configuration (keyword arguments of
    :func:`decode_problems` or :func:`prefill_problems`): the first value of
    each drawn parameter; the size limits (``max_*``) are left out.

    >>> config_id(dict(head_sizes=(64,), dtypes=("float16",), max_seqs=4)), config_id({})
    ('head_size64-dtypefloat16', 'drawn')
    """
    return "-".join(f"{k[:-1]}{v[0]}" for k, v in config.items()
                    if not k.startswith("max")) or "drawn"
