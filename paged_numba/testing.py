"""Hypothesis strategies and error bounds for fuzzing paged-attention kernels.

A strategy draws a *problem* (shapes, block tables, sequence lengths and a
seed for the data) rather than the data itself, so that examples stay cheap
to draw and shrink, and the arrays come from ``numpy.random`` with that seed.

The error bound follows one rule everywhere: a kernel may differ from the
float64 oracle by at most twice the error of an independent float32 NumPy
computation of the same function, plus one unit in the last place of the
output dtype (the kernel rounds its fp32 result once to that dtype).

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

import numpy as np
from hypothesis import strategies as st

from .layouts import from_nhd
from .reference import paged_decode_reference

GQA_GROUPS = (1, 2, 4, 8)


def lengths(block_size, max_len):
    """Sequence lengths that stress block boundaries: 1, exact multiples of
    ``block_size``, multiples +-1, and anything up to ``max_len``."""
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


@dataclasses.dataclass
class DecodeProblem:
    """One paged-decode case: shapes, tables and a seed for the data."""

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
    def max_blocks(self):
        return self.block_tables.shape[1]

    def arrays(self):
        """Random ``query [num_seqs, num_heads, head_size]`` and ``"nhd"`` pools
        ``[num_blocks, block_size, num_kv_heads, head_size]``, in ``dtype``."""
        rng = np.random.default_rng(self.seed)
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_size)
        q = rng.standard_normal((self.num_seqs, self.num_heads, self.head_size))
        k = rng.standard_normal(shape)
        v = rng.standard_normal(shape)
        return tuple(a.astype(self.dtype) for a in (q, k, v))

    def layout_pools(self, k, v):
        """``(key_cache, value_cache)`` host pools in this problem's layout."""
        return from_nhd(k, v, self.layout)


@st.composite
def decode_problems(draw, head_sizes=(64, 80, 96, 112, 128, 256), block_sizes=(8, 16, 32),
                    layouts=("nhd", "vllm"), dtypes=("float16", "float32"),
                    groups=GQA_GROUPS, max_kv_heads=2, max_seqs=3, max_seq_len=200):
    """Draw a :class:`DecodeProblem`.

    GQA group sizes come from ``groups`` and MQA (one KV head) is drawn
    as often as the other head counts.
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


def error_bound(ref64, ref_low, out_dtype):
    """Per-element bound on ``|out - ref64|`` for a kernel whose output has
    ``out_dtype``: ``2 * max|ref_low - ref64| + ulp_out(|ref64|)``, where
    ``ref_low`` is an independent float32 computation of the same function."""
    low_err = float(np.max(np.abs(ref_low - ref64), initial=0.0))
    mag = np.abs(ref64).astype(out_dtype)
    ulp = np.spacing(mag).astype(np.float64)
    return 2.0 * low_err + ulp


def check_close(out, ref64, ref_low, what="output"):
    """Assert ``out`` is within :func:`error_bound` of ``ref64`` everywhere."""
    out = np.asarray(out)
    assert not np.isnan(out).any(), f"{what} has NaN"
    err = np.abs(out.astype(np.float64) - ref64)
    bound = error_bound(ref64, ref_low, out.dtype)
    bad = err > bound
    if bad.any():
        i = tuple(int(a[0]) for a in np.nonzero(bad))
        raise AssertionError(
            f"{what} differs from the float64 reference at {i}: {out[i]!r} vs {ref64[i]!r} "
            f"(error {err[i]:.3g} > bound {bound[i]:.3g}; max error {err.max():.3g}, "
            f"{int(bad.sum())} of {bad.size} elements out of bounds)")
    return float(err.max())


def decode_references(problem, q, k, v, scale=None):
    """float64 and float32 references for a :class:`DecodeProblem` (``"nhd"`` pools)."""
    if scale is None:
        scale = 1.0 / math.sqrt(problem.head_size)
    args = (q, k, v, problem.block_tables, problem.seq_lens, scale, "nhd")
    return (paged_decode_reference(*args, dtype=np.float64),
            paged_decode_reference(*args, dtype=np.float32))
