"""The float64 references a kernel's results are compared with, and the
comparison: within the bounds of :mod:`paged_numba.testing.bounds` plus one
unit in the last place of the output dtype for the final rounding.
"""
import math

import ml_dtypes
import numpy as np

from ..kernels import prefill_tc
from ..reference import attention, gather_kv, paged_decode_reference, paged_prefill_reference
from .bounds import decode_bounds, merge_error_bound, prefill_bounds, prefill_error_bound
from .strategies import DecodeProblem, PrefillProblem  # noqa: F401  (what the references take)

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


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



def decode_reference(problem, q, k, v, scale=None, num_partitions=None, pv_mma=None,
                     group_kernel=None, qk_fp8=False, **variants):
    """float64 ``(out, lse)`` and their error bounds ``(bound, bound_lse)`` for a
    :class:`DecodeProblem` (``k``, ``v`` are ``"nhd"`` pools); ``variants`` as in
    :func:`paged_numba.reference.logits`.

    Parameters
    ----------
    problem : DecodeProblem
    q : array, ``[num_seqs, num_heads, head_size]``
    k, v : array, ``[num_blocks, block_size, num_kv_heads, head_size]`` each
    scale : float, optional
    num_partitions, pv_mma, group_kernel, qk_fp8 : optional
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
    return out, lse, *decode_bounds(problem, q, k, v, scale, num_partitions, pv_mma,
                                    group_kernel, qk_fp8, **variants)



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
    if scale is None:
        scale = 1.0 / math.sqrt(problem.head_size)
    out, lse = paged_prefill_reference(q, k, v, problem.block_tables, problem.cu_seqlens_q,
                                       problem.seq_lens, scale, "nhd", causal=causal, **variants)
    return out, lse, *prefill_bounds(problem, q, k, v, scale, causal, tensor_cores, **variants)



def cascade_reference(suffix, q, k, v, shared_block_table, shared_len, scale=None,
                      logits_soft_cap=None):
    """float64 ``(out, lse)`` of :func:`paged_numba.cascade_decode` over whole
    contexts (the shared prefix, then each suffix) and the bounds ``(bound,
    bound_lse)`` of its two passes and their merge (``k``, ``v`` are ``"nhd"``
    pools).

    The model composes the project's bounds: the prefix pass is bounded by
    :func:`prefill_error_bound` (non-causal, tensor cores where
    ``paged_prefill`` uses them), the suffix pass by :func:`decode_bounds`;
    each pass's output is rounded to the cache's dtype before the merge (one
    ulp at ``|out| + bound`` is added), and :func:`merge_error_bound` carries
    both errors through the merge. With ``shared_len == 0`` only the decode
    bounds remain.

    Parameters
    ----------
    suffix : DecodeProblem
        Shapes, dtype, layout, and the suffixes' ``block_tables`` and ``seq_lens``.
    q : array, ``[num_seqs, num_heads, head_size]``
    k, v : array, ``[num_blocks, block_size, num_kv_heads, head_size]`` each
    shared_block_table : array of int, ``[max_shared_blocks]``
    shared_len : int
    scale : float, optional
    logits_soft_cap : float, optional

    Returns
    -------
    out, bound : numpy.ndarray, ``[num_seqs, num_heads, head_size]`` each
    lse, bound_lse : numpy.ndarray, ``[num_seqs, num_heads]`` each

    Examples
    --------
    >>> p = DecodeProblem(num_seqs=2, num_heads=2, num_kv_heads=1, head_size=8, block_size=4,
    ...                   num_blocks=4, layout="nhd", dtype="float16",
    ...                   seq_lens=np.array([3, 0], np.int32),          # seq 1: no suffix
    ...                   block_tables=np.array([[2], [-1]], np.int32), seed=0)
    >>> q, k, v = p.arrays()
    >>> out, lse, bound, bound_lse = cascade_reference(p, q, k, v, [0, 3], shared_len=6)
    >>> out.shape, bound.shape, lse.shape
    ((2, 2, 8), (2, 2, 8), (2, 2))
    >>> # seq 1 sees the 6 prefix tokens alone (slots 0..3 and 12..13)
    >>> kk = np.concatenate([k[0], k[3, :2]]); vv = np.concatenate([v[0], v[3, :2]])
    >>> bool(np.allclose(out[1], attention(q[1:], kk, vv, 8 ** -0.5)[0][0]))
    True
    >>> check_close(out.astype(np.float16), out, bound) <= 1
    True
    """
    if scale is None:
        scale = 1.0 / math.sqrt(suffix.head_size)
    variants = {} if logits_soft_cap is None else dict(logits_soft_cap=logits_soft_cap)
    shared_len = int(shared_len)
    ks, vs = gather_kv(k, v, np.asarray(shared_block_table), shared_len)
    out = np.zeros(q.shape)
    lse = np.full(q.shape[:2], -np.inf)
    for i, n in enumerate(suffix.seq_lens):
        kt, vt = gather_kv(k, v, suffix.block_tables[i], n)
        o, s = attention(q[i:i + 1], np.concatenate([ks, kt]), np.concatenate([vs, vt]), scale,
                         **variants)
        out[i], lse[i] = o[0], s[0]
    bound_s, bound_lse_s = decode_bounds(suffix, q, k, v, scale, **variants)
    if shared_len == 0:
        return out, lse, bound_s, bound_lse_s
    # -- the two states as the merge reads them, each rounded to the cache's dtype
    out_p, lse_p = attention(q, ks, vs, scale, **variants)
    tc = suffix.dtype if prefill_tc.supports(suffix.head_size, suffix.dtype, suffix.layout) \
        else None
    bound_p, bound_lse_p = prefill_error_bound(q, ks, vs, scale, np.full(len(q), shared_len - 1),
                                               causal=False, tensor_cores=tc, **variants)
    out_s, lse_s = paged_decode_reference(q, k, v, suffix.block_tables, suffix.seq_lens, scale,
                                          "nhd", **variants)
    states = np.stack([out_p, out_s], axis=1)
    read = np.stack([bound_p, bound_s], axis=1)
    read = read + ulp(np.abs(states) + read, suffix.dtype)
    bound, bound_lse = merge_error_bound(states, np.stack([lse_p, lse_s], axis=1), read,
                                         np.stack([bound_lse_p, bound_lse_s], axis=1))
    return out, lse, bound, bound_lse
