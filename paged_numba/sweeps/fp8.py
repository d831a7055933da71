"""The ``fp8`` sweep: attention error of fp8 KV caches against fp16 ones.

No kernel runs: keys and values are drawn in float32 (what a model's
projections produce), stored as the cache would store them (rounded to fp16,
or quantised to E4M3FN / E5M2 with per-tensor or per-KV-head max-abs scales
by :func:`paged_numba.fp8.quantize`, bit for bit what ``write_kv`` stores),
and decode attention over the stored values is computed in float64
(:func:`paged_numba.reference.paged_decode_reference`, which dequantises fp8
exactly). The exact output is the same float64 attention over the float32
data, so the error measured is the storage format's alone; a kernel's own
fp32 rounding (about 1e-7, see the ``exactness`` sweep) is not included.

Value distributions (keys and values alike; every KV head ``h`` has its own
magnitude ``m_h = 2 ** u_h``, ``u`` evenly spaced in ``[-2, 2]``, so that one
scale per tensor serves heads of 16x different size):

* ``gaussian``: standard normal;
* ``student-t``: Student's t with 3 degrees of freedom (heavy tails);
* ``outliers``: standard normal with 2 channels of each KV head 20x larger,
  as LLM keys have a few large channels;
* ``wide-heads``: standard normal, head magnitudes ``2 ** u`` with ``u`` in
  ``[-8, 8]`` (a 65536x spread, past E4M3's 2**15 range of normal values).

The queries are standard normal divided by their KV head's magnitude, so
that the logits ``q.k / sqrt(head_size)`` of Gaussian keys have unit
standard deviation in every head (attention neither uniform nor one-hot);
the error of a softmax grows with the spread of its logits.

One more format, ``float8_e4m3fn/head+q8``, is the E4M3 cache with per-head
scales read by ``DecodePlan(qk_fp8=True)``: the queries too are quantised to
E4M3, each head's row with its own scale (:func:`paged_numba.fp8.quantize_rows`,
bit for bit the kernel's), before ``Q K^T``; its error against the plain
E4M3 ``/head`` rows is what quantising the queries adds.
"""
import functools

import numpy as np

from ..fp8 import FP8_DTYPES, fp8_scales, quantize, quantize_rows
from .runner import Sweep, register, require

CACHES = ("float16", *(f"{f}/{g}" for f in FP8_DTYPES for g in ("tensor", "head")),
          "float8_e4m3fn/head+q8")
Q8 = "+q8"                  # the queries quantised too (DecodePlan(qk_fp8=True))
DISTRIBUTIONS = ("gaussian", "student-t", "outliers", "wide-heads")
NUM_SEQS, NUM_KV_HEADS, GROUP = 1, 4, 2           # 8 query heads over 4 KV heads


def _magnitudes(dist, num_kv_heads):
    """Each KV head's magnitude ``[num_kv_heads]``."""
    return 2.0 ** np.linspace(*((-8, 8) if dist == "wide-heads" else (-2, 2)), num_kv_heads)


def _data(dist, shape, rng):
    """float32 ``[..., num_kv_heads, head_size]`` values of ``dist``, each KV head
    with its own magnitude."""
    if dist in ("gaussian", "wide-heads"):
        x = rng.standard_normal(shape)
    elif dist == "student-t":
        x = rng.standard_t(3, shape)
    elif dist == "outliers":
        x = rng.standard_normal(shape)
        for h in range(shape[-2]):
            x[..., h, rng.choice(shape[-1], 2, replace=False)] *= 20.0
    else:
        raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, but got {dist!r}.")
    return (x * _magnitudes(dist, shape[-2])[:, None]).astype(np.float32)


def _stored(x, cache):
    """``(pool as stored, scale)`` of float32 ``x`` in ``cache`` ("float16" or
    "<fp8 format>/<tensor|head>")."""
    if cache == "float16":
        return x.astype(np.float16), None
    fmt, granularity = cache.removesuffix(Q8).split("/")
    scale = fp8_scales(x, fmt, per_head=granularity == "head")
    return quantize(x, scale, fmt), scale


def _attend(q, k, v, **scales):
    """float64 decode attention of ``q [NUM_SEQS, heads, d]`` over ``k, v
    [NUM_SEQS * n, NUM_KV_HEADS, d]`` (sequence ``i``: tokens ``i n ..``)."""
    from ..reference import paged_decode_reference

    n = k.shape[0] // NUM_SEQS
    table = np.arange(NUM_SEQS * n, dtype=np.int32).reshape(NUM_SEQS, n)   # blocks of 1 token
    return paged_decode_reference(q, k[:, None], v[:, None], table, np.full(NUM_SEQS, n),
                                  **scales)


@functools.lru_cache(maxsize=2)
def _problem(dist, d, n, seed):
    """``(q, k, v, (exact out, exact lse))`` of one point's data (shared by its caches)."""
    rng = np.random.default_rng([seed, d, n, DISTRIBUTIONS.index(dist)])
    shape = (NUM_SEQS * n, NUM_KV_HEADS, d)
    q = rng.standard_normal((NUM_SEQS, NUM_KV_HEADS * GROUP, d))
    q = (q / np.repeat(_magnitudes(dist, NUM_KV_HEADS), GROUP)[:, None]).astype(np.float32)
    k, v = _data(dist, shape, rng), _data(dist, shape, rng)
    return q, k, v, _attend(q, k, v)


def measure_fp8(p):
    """Output error of decode attention over one KV cache format.

    Parameters
    ----------
    p : dict
        ``kv_cache`` (one of :data:`CACHES`), ``dist`` (one of
        :data:`DISTRIBUTIONS`), ``head_size``, ``context`` (tokens per
        sequence), ``seed``.

    Returns
    -------
    dict
        ``kv_dtype``, ``scales`` ("tensor", "head" or "none"), ``query_fp8``
        (whether the queries were quantised to E4M3 as well), ``rel_err``
        (the worst query head's ``||out_h - exact_h|| / ||exact_h||``),
        ``rel_err_all`` (the same over every head at once, which the large
        heads dominate),
        ``max_abs_err``, ``max_abs_out``, ``lse_max_err`` (the log-sum-exp),
        ``k_rel_err`` and ``v_rel_err`` (the stored keys' and values' own
        norm-wise error), ``bytes_per_token`` (K and V of one token, one layer).

    Examples
    --------
    >>> p = dict(kv_cache="float8_e4m3fn/head", dist="gaussian", head_size=16, context=32, seed=0)
    >>> r = measure_fp8(p)
    >>> r["kv_dtype"], r["scales"], r["bytes_per_token"]          # 2 * 4 heads * 16 * 1 byte
    ('float8_e4m3fn', 'head', 128)
    >>> 0.005 < r["k_rel_err"] < 0.05                              # 3 mantissa bits
    True
    >>> r16 = measure_fp8(dict(p, kv_cache="float16"))
    >>> r16["rel_err"] < r["rel_err"] / 50
    True
    """
    cache, d, n = p["kv_cache"], int(p["head_size"]), int(p["context"])
    q, k, v, (exact, exact_lse) = _problem(p["dist"], d, n, int(p["seed"]))
    (ks, k_scale), (vs, v_scale) = _stored(k, cache), _stored(v, cache)
    q8 = cache.endswith(Q8)
    if q8:
        codes, s = quantize_rows(q)
        q = codes.astype(np.float64) * s[..., None].astype(np.float64)
    out, lse = _attend(q, ks, vs, k_scale=k_scale, v_scale=v_scale)

    def rel(a, b):
        return float(np.linalg.norm((a - b).ravel()) / np.linalg.norm(b.ravel()))

    deq_k = ks.astype(np.float64) * (1.0 if k_scale is None else np.asarray(k_scale)[..., None])
    deq_v = vs.astype(np.float64) * (1.0 if v_scale is None else np.asarray(v_scale)[..., None])
    dtype, _, scales = cache.removesuffix(Q8).partition("/")
    worst = float((np.linalg.norm(out - exact, axis=-1) / np.linalg.norm(exact, axis=-1)).max())
    return dict(kv_dtype=dtype, scales=scales or "none", query_fp8=q8, rel_err=worst,
                rel_err_all=rel(out, exact),
                max_abs_err=float(np.abs(out - exact).max()), max_abs_out=float(np.abs(exact).max()),
                lse_max_err=float(np.abs(lse - exact_lse).max()),
                k_rel_err=rel(deq_k, k), v_rel_err=rel(deq_v, v),
                bytes_per_token=2 * NUM_KV_HEADS * d * np.dtype(dtype).itemsize)


STYLE = {  # kv_cache: (colour, marker, line style, legend label)
    "float16": ("black", "o", "-", "fp16 cache"),
    "float8_e4m3fn/tensor": ("C0", "s", "--", "E4M3, one scale per tensor"),
    "float8_e4m3fn/head": ("C0", "s", "-", "E4M3, one scale per KV head"),
    "float8_e5m2/tensor": ("C3", "^", "--", "E5M2, one scale per tensor"),
    "float8_e5m2/head": ("C3", "^", "-", "E5M2, one scale per KV head"),
    "float8_e4m3fn/head+q8": ("C2", "D", ":", "E4M3 per KV head, queries E4M3 too (qk_fp8)"),
}
DIST_NAMES = {"gaussian": "Gaussian", "student-t": "Student-t, 3 d.o.f.",
              "outliers": "Gaussian, 2 channels a head 20x",
              "wide-heads": "Gaussian, head magnitudes 2^-8 .. 2^8"}


def fp8_figure(df, path):
    """Relative output error against context length: one panel per value
    distribution (columns) and head size (rows), one line per cache format
    (median over seeds), log-log."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    from .figures import _value_ticks, source

    require("pandas", "sweeps")
    dists = [d for d in DISTRIBUTIONS if d in set(df["dist"])]
    sizes = sorted(set(int(h) for h in df["head_size"]))
    fig = Figure(figsize=(4.3 * len(dists) + 0.6, 3.2 * len(sizes) + 1.6), layout="constrained")
    axes = fig.subplots(len(sizes), len(dists), squeeze=False, sharex=True, sharey=True)
    positive = df["rel_err"][df["rel_err"] > 0]
    for r, hs in enumerate(sizes):
        for c, dist in enumerate(dists):
            ax = axes[r, c]
            rows = df[(df["dist"] == dist) & (df["head_size"] == hs)]
            for cache, (color, marker, ls, _) in STYLE.items():
                line = rows[rows["kv_cache"] == cache].groupby("context")["rel_err"].median()
                if len(line):
                    ax.plot(line.index, line.values, color=color, marker=marker, linestyle=ls,
                            markersize=5, linewidth=1.6)
            ax.set_xscale("log", base=2)
            if len(positive):
                ax.set_yscale("log")
            _value_ticks(ax, rows["context"])
            ax.grid(True, which="major", alpha=0.3)
            if r == 0:
                ax.set_title(DIST_NAMES.get(dist, dist), fontsize=10)
            if c == 0:
                ax.set_ylabel(f"head size {hs}\nworst head's ‖out − exact‖ / ‖exact‖")
            if r == len(sizes) - 1:
                ax.set_xlabel("context (tokens per sequence)")
    handles = [Line2D([], [], color=color, marker=marker, linestyle=ls, label=label)
               for color, marker, ls, label in STYLE.values()]
    fig.legend(handles=handles, loc="outside lower center", ncol=3, fontsize=9,
               frameon=False)
    where = source(df)
    fig.suptitle("Decode attention error from storing K/V in fp16 or fp8 (max-abs scales), "
                 "float64 attention over the stored values vs over the float32 data;\n"
                 f"{NUM_KV_HEADS * GROUP} query / {NUM_KV_HEADS} KV heads, KV head magnitudes "
                 f"2^-2 .. 2^2 (but where noted), Gaussian logits of unit s.d., median over "
                 f"{df['seed'].nunique()} seeds"
                 + (f" — {where}" if where else ""), fontsize=10)
    fig.savefig(path, dpi=110)


register(Sweep(
    "fp8",
    # the cache format varies fastest: consecutive points share their data (_problem)
    grid=dict(dist=list(DISTRIBUTIONS), head_size=[64, 256], context=[64, 256, 1024, 4096],
              seed=[0, 1, 2, 3], kv_cache=list(CACHES)),
    quick_grid=dict(dist=["gaussian", "wide-heads"], head_size=[16], context=[32, 128], seed=[0],
                    kv_cache=[c for c in CACHES if c != "float8_e5m2/tensor"]),
    measure=measure_fp8,
    description="decode attention error of fp8 KV caches (E4M3FN, E5M2; per-tensor and per-head "
                "scales; E4M3 with the queries quantised too) and fp16 ones vs float64, by "
                "distribution, head size, context (no GPU)",
    figure=fp8_figure,
    device=False))

__all__ = ["CACHES", "DISTRIBUTIONS", "fp8_figure", "measure_fp8"]
