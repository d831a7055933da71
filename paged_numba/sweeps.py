"""Experiments declared as data: a grid, a measure, one tidy CSV per sweep.

A :class:`Sweep` names a grid of parameters (the cartesian product of value
lists), a small ``quick_grid`` that runs on Numba's CUDA simulator in
seconds, and a ``measure`` that turns one point into a dict of metrics.
:func:`run_sweep` runs the points not yet in ``<out_dir>/<name>.csv``
(``<name>_quick.csv`` in quick mode), adds environment columns, saves after
every point (so an interrupted sweep resumes where it stopped) and draws the
sweep's figure when matplotlib is installed. From the shell::

    python -m paged_numba sweep --list
    python -m paged_numba sweep merge-rule --quick --out results/

Registered sweeps (:data:`SWEEPS`): ``memory-waste`` and ``merge-rule`` need
no GPU; ``exactness`` checks kernels against the float64 reference;
``decode``, ``paging-overhead`` and ``split-k`` time kernels (CUDA events on
a GPU; on the simulator one wall-clock call per point, which measures the
simulator, not a kernel).

Examples
--------
>>> s = Sweep("squares", grid={"x": [1, 2, 3]}, quick_grid={"x": [2]},
...           measure=lambda p: {"y": p["x"] ** 2}, device=False)
>>> s.points(quick=True)
[{'x': 2}]
>>> import tempfile
>>> with tempfile.TemporaryDirectory() as out:      # writes out/squares.csv
...     df = run_sweep(s, out_dir=out, progress=False)
>>> df[["x", "y", "gpu"]].values.tolist()
[[1, 1, 'cpu'], [2, 4, 'cpu'], [3, 9, 'cpu']]
"""
import dataclasses
import datetime
import functools
import importlib.metadata
import itertools
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np
import pandas as pd

from . import serving_sim

ENV_COLUMNS = ("gpu", "numba", "numba_cuda", "numpy", "git_rev", "timestamp", "command")
L2_BYTES = 60 * 2**20          # inputs of timed kernels are rotated past ~4x this (H200: 60 MB L2)
MAX_ROTATIONS = 64             # ... in at most this many copies (tiny shapes are host-bound anyway)


@dataclasses.dataclass
class Sweep:
    """One experiment: a parameter grid and a function measuring one point.

    Parameters
    ----------
    name : str
        Registry key and CSV file name.
    grid, quick_grid : dict of str -> list
        Parameter values; the points are the cartesian product. ``quick_grid``
        should run on the simulator in well under a minute.
    measure : callable(point: dict) -> dict
        Metrics of one point. Values must be scalars (written to CSV).
    description : str
    figure : callable(df, path), optional
        Draws one figure of the sweep's DataFrame into the PNG ``path``.
    device : bool
        Whether ``measure`` runs kernels (the ``gpu`` column then names the
        device or ``"simulator"``; otherwise it says ``"cpu"``).

    Examples
    --------
    >>> s = Sweep("sums", grid={"a": [1, 2], "b": [10, 20]}, quick_grid={"a": [1], "b": [10]},
    ...           measure=lambda p: {"total": p["a"] + p["b"]}, device=False)
    >>> s.points()                        # 2 x 2 points, the last parameter varying fastest
    [{'a': 1, 'b': 10}, {'a': 1, 'b': 20}, {'a': 2, 'b': 10}, {'a': 2, 'b': 20}]
    >>> [s.measure(p) for p in s.points(quick=True)]
    [{'total': 11}]
    """

    name: str
    grid: dict
    quick_grid: dict
    measure: Callable[[dict], dict]
    description: str = ""
    figure: Callable | None = None
    device: bool = True

    def points(self, quick=False):
        """The grid's points, as dicts ``{param: value}`` in row-major order."""
        grid = self.quick_grid if quick else self.grid
        return [dict(zip(grid, values)) for values in itertools.product(*grid.values())]


SWEEPS: dict[str, Sweep] = {}


def register(sweep):
    """Add ``sweep`` to :data:`SWEEPS` (replacing one of the same name); return it.

    Parameters
    ----------
    sweep : Sweep

    Returns
    -------
    Sweep
        ``sweep`` itself, so that ``s = register(Sweep(...))`` keeps a handle.

    Examples
    --------
    >>> import shutil, tempfile
    >>> s = register(Sweep("cubes", grid={"x": [2, 3]}, quick_grid={"x": [2]},
    ...                    measure=lambda p: {"y": p["x"] ** 3}, device=False))
    >>> SWEEPS["cubes"] is s, "merge-rule" in SWEEPS
    (True, True)
    >>> out = tempfile.mkdtemp()
    >>> run_sweep("cubes", quick=True, out_dir=out, progress=False)["y"].tolist()   # by name
    [8]
    >>> del SWEEPS["cubes"]; shutil.rmtree(out)      # leave the registry as it was
    """
    SWEEPS[sweep.name] = sweep
    return sweep


# -- running ------------------------------------------------------------------

def _git_rev():
    """Short commit of the repository holding this package, or ``"unknown"``."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10, cwd=os.path.dirname(os.path.abspath(__file__)))
        return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_name():
    """The CUDA device's name, or ``"simulator"`` under Numba's CUDA simulator.

    Returns
    -------
    str
        E.g. ``"NVIDIA H200"`` on a GPU.

    Examples
    --------
    >>> from paged_numba import simulator_enabled
    >>> (device_name() == "simulator") == simulator_enabled()   # "simulator" on a CPU-only machine
    True
    """
    from . import simulator_enabled

    if simulator_enabled():
        return "simulator"
    from numba import cuda

    name = cuda.get_current_device().name
    return name.decode() if isinstance(name, bytes) else str(name)


def _version(dist):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def environment(device=True):
    """Environment columns (all but ``timestamp``) for a sweep's rows.

    Parameters
    ----------
    device : bool
        Name the device in ``gpu`` (:func:`device_name`); ``False`` gives ``"cpu"``.

    Returns
    -------
    dict of str -> str
        ``gpu``, ``numba``, ``numba_cuda``, ``numpy`` (versions, ``"unknown"``
        if not installed) and ``git_rev`` (short commit or ``"unknown"``).

    Examples
    --------
    >>> env = environment(device=False)
    >>> sorted(env)
    ['git_rev', 'gpu', 'numba', 'numba_cuda', 'numpy']
    >>> env["gpu"], env["numpy"] == np.__version__
    ('cpu', True)
    """
    return dict(gpu=device_name() if device else "cpu", numba=_version("numba"),
                numba_cuda=_version("numba-cuda"), numpy=np.__version__, git_rev=_git_rev())


class _Progress:
    """A progress bar with ETA on stderr: redrawn in place on a terminal, one
    line per point otherwise."""

    def __init__(self, total, label, enabled=True, width=24):
        self.total, self.label, self.enabled, self.width = total, label, enabled, width
        self.done, self.start = 0, time.perf_counter()
        self.tty = sys.stderr.isatty()

    def step(self):
        self.done += 1
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.start
        eta = elapsed / self.done * (self.total - self.done)
        fill = self.width * self.done // max(self.total, 1)
        line = (f"{self.label} [{'#' * fill}{'.' * (self.width - fill)}] {self.done}/{self.total}"
                f"  {_hms(elapsed)} elapsed, ETA {_hms(eta)}")
        sys.stderr.write(f"\r{line}" if self.tty else f"{line}\n")
        if self.tty and self.done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _hms(seconds):
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def _save(rows, path, params):
    """Write ``rows`` (list of dicts) to ``path`` atomically: parameters first,
    then metrics, then environment columns."""
    df = pd.DataFrame(rows)
    rest = [c for c in df.columns if c not in params and c not in ENV_COLUMNS]
    df = df[[c for c in params if c in df] + rest + [c for c in ENV_COLUMNS if c in df]]
    df.to_csv(path + ".tmp", index=False)
    os.replace(path + ".tmp", path)


def run_sweep(sweep, quick=False, out_dir="results", progress=True):
    """Run the points of ``sweep`` missing from its CSV; return all its rows.

    Parameters
    ----------
    sweep : Sweep or str
        A sweep or the name of a registered one.
    quick : bool
        Run ``quick_grid`` into ``<out_dir>/<name>_quick.csv`` instead of
        ``grid`` into ``<out_dir>/<name>.csv``.
    out_dir : str
        Created if missing.
    progress : bool
        Print a progress bar with ETA to stderr.

    Returns
    -------
    pandas.DataFrame
        One row per point: the parameters, the metrics, and ``gpu`` (device
        name, ``"simulator"`` or ``"cpu"``), ``numba``, ``numba_cuda``,
        ``numpy`` (versions), ``git_rev``, ``timestamp`` (UTC, ISO 8601) and
        ``command`` (the CLI call that reproduces the row).

    Notes
    -----
    Resume: a point whose parameter values (compared as strings) already have
    a row in the CSV is not measured again; its row is kept as it is, whatever
    environment produced it (delete the CSV to measure afresh). The CSV is
    rewritten after every point. If matplotlib imports, ``sweep.figure``
    draws ``<out_dir>/<name>[_quick].png`` from all rows.

    Examples
    --------
    >>> import os, shutil, tempfile
    >>> calls = []
    >>> def halve(p):
    ...     calls.append(p["x"])
    ...     return {"half": p["x"] / 2}
    >>> s = Sweep("halves", grid={"x": [1, 2, 4]}, quick_grid={"x": [2]}, measure=halve,
    ...           device=False)
    >>> out = tempfile.mkdtemp()
    >>> run_sweep(s, quick=True, out_dir=out, progress=False)["half"].tolist()
    [1.0]
    >>> df = run_sweep(s, out_dir=out, progress=False)     # the full grid, a separate CSV
    >>> df["x"].tolist(), df["half"].tolist(), df["gpu"].tolist()
    ([1, 2, 4], [0.5, 1.0, 2.0], ['cpu', 'cpu', 'cpu'])
    >>> len(run_sweep(s, out_dir=out, progress=False)), calls   # resumed: nothing re-measured
    (3, [2, 1, 2, 4])
    >>> sorted(os.listdir(out))
    ['halves.csv', 'halves_quick.csv']
    >>> shutil.rmtree(out)
    """
    if isinstance(sweep, str):
        sweep = SWEEPS[sweep]
    points = sweep.points(quick)
    params = list((sweep.quick_grid if quick else sweep.grid))
    stem = sweep.name + ("_quick" if quick else "")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, stem + ".csv")
    rows = []
    if os.path.exists(path) and os.path.getsize(path):
        rows = pd.read_csv(path, dtype=str, keep_default_na=False).to_dict("records")
    have = {tuple(str(r.get(p, "")) for p in params) for r in rows}
    todo = [p for p in points if tuple(str(p[k]) for k in params) not in have]
    bar = _Progress(len(todo), stem, progress)
    if progress:
        print(f"{stem}: {len(todo)} of {len(points)} points to run -> {path}", file=sys.stderr)
    if todo:
        env = environment(sweep.device)
        env["command"] = f"python -m paged_numba sweep {sweep.name}" + (" --quick" if quick else "")
        for point in todo:
            metrics = sweep.measure(dict(point))
            stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
            rows.append({**point, **metrics, **env, "timestamp": stamp})
            _save(rows, path, params)
            bar.step()
    df = pd.read_csv(path) if rows else pd.DataFrame(columns=params)
    if sweep.figure is not None and len(df):
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return df
        sweep.figure(df, os.path.join(out_dir, stem + ".png"))
    return df


# -- figures --------------------------------------------------------------------

def line_figure(df, path, x, y, series=(), where=None, agg="median", order=None,
                logx=False, logy=False, title=""):
    """Save one line plot: ``y`` against ``x``, one line per value of the
    ``series`` columns, ``agg`` over rows that share them.

    ``where`` (``{column: value}``) keeps matching rows when any match;
    ``order`` lists the x values of a categorical axis in plotting order.

    Parameters
    ----------
    df : pandas.DataFrame
        A sweep's rows.
    path : str
        The PNG to write (nothing is written if ``y`` has no values).
    x, y : str
        Columns of the axes.
    series : sequence of str
        Columns whose value combinations get one line each.
    where : dict, optional
    agg : str
        pandas aggregation over rows sharing ``x`` and the series values.
    order : list, optional
    logx, logy : bool
        Log axes (x in base 2).
    title : str

    Examples
    --------
    >>> import os, shutil, tempfile
    >>> import pandas as pd
    >>> df = pd.DataFrame({"n": [1, 2, 4, 1, 2, 4], "t": [1.0, 2.0, 4.0, 3.0, 2.0, 1.0],
    ...                    "kind": ["a", "a", "a", "b", "b", "b"]})
    >>> path = os.path.join(tempfile.mkdtemp(), "t.png")
    >>> try:
    ...     import matplotlib
    ... except ImportError:            # without the "plots" extra there is nothing to draw
    ...     matplotlib = None
    >>> if matplotlib is not None:     # two lines, kind=a and kind=b, on a log2 x axis
    ...     line_figure(df, path, "n", "t", series=["kind"], logx=True, title="t by n")
    >>> os.path.exists(path) == (matplotlib is not None)
    True
    >>> shutil.rmtree(os.path.dirname(path))
    """
    from matplotlib.figure import Figure

    if where:
        mask = np.logical_and.reduce([df[c] == v for c, v in where.items()])
        if mask.any():
            df = df[mask]
            title += " (" + ", ".join(f"{c}={v}" for c, v in where.items()) + ")"
    if y not in df or df[y].isna().all():
        return                                  # nothing measured (e.g. every point skipped)
    df = df[df[y].notna()]
    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.subplots()
    groups = df.groupby(list(series)) if series else [((), df)]
    for key, g in groups:
        key = key if isinstance(key, tuple) else (key,)
        line = g.groupby(x)[y].agg(agg)
        xs = line.index if order is None else [order.index(v) for v in line.index]
        line = pd.Series(line.values, index=xs).sort_index()
        label = ", ".join(f"{c}={v}" for c, v in zip(series, key)) or None
        ax.plot(line.index, line.values, marker="o", label=label)
    if order is not None:
        ax.set_xticks(range(len(order)), order, rotation=45, ha="right")
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    if series:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# -- memory-waste: serving_sim ----------------------------------------------------

PAGED_BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
ALLOCATORS = ("contiguous-max", "contiguous-oracle", *(f"paged-{b}" for b in PAGED_BLOCK_SIZES))


@functools.lru_cache(maxsize=16)
def _requests(num_requests, seed, max_len):
    return serving_sim.make_requests(num_requests, seed, max_len=max_len)


@functools.lru_cache(maxsize=64)
def _max_running(num_requests, seed, max_len, budget_tokens):
    r = serving_sim.simulate("contiguous-max", None, _requests(num_requests, seed, max_len),
                             budget_tokens, max_len)
    return r["mean_running"]


def measure_memory_waste(p):
    """:func:`serving_sim.simulate` one allocator (``"contiguous-max"``,
    ``"contiguous-oracle"`` or ``"paged-<block_size>"``) on the default
    request distribution; adds ``batch_ratio`` against ``"contiguous-max"``.

    Parameters
    ----------
    p : dict
        ``allocator``, ``num_requests``, ``seed``, ``max_len``, ``budget_tokens``.

    Returns
    -------
    dict
        :func:`serving_sim.simulate`'s metrics and ``batch_ratio``.

    Examples
    --------
    >>> point = dict(num_requests=20, seed=0, max_len=2048, budget_tokens=8192)
    >>> r = measure_memory_waste(dict(point, allocator="contiguous-max"))
    >>> r["mean_running"], r["mean_reserved_slots"], r["batch_ratio"]  # 8192 // 2048 = 4 at once
    (4.0, 8192.0, 1.0)
    >>> r = measure_memory_waste(dict(point, allocator="paged-16"))
    >>> round(r["batch_ratio"], 2), r["preemptions"]
    (1.87, 0)
    """
    alloc, block_size = p["allocator"], None
    if alloc.startswith("paged-"):
        alloc, block_size = "paged", int(alloc.removeprefix("paged-"))
    args = (p["num_requests"], p["seed"], p["max_len"])
    r = serving_sim.simulate(alloc, block_size, _requests(*args), p["budget_tokens"], p["max_len"])
    r["batch_ratio"] = r["mean_running"] / _max_running(*args, p["budget_tokens"])
    return r


register(Sweep(
    "memory-waste",
    grid=dict(budget_tokens=[8192, 32768, 131072], allocator=list(ALLOCATORS),
              num_requests=[2000], max_len=[2048], seed=[0, 1, 2]),
    quick_grid=dict(budget_tokens=[8192], allocator=["contiguous-max", "contiguous-oracle",
                                                     "paged-1", "paged-16", "paged-256"],
                    num_requests=[100], max_len=[2048], seed=[0]),
    measure=measure_memory_waste,
    description="KV slots holding real tokens under contiguous vs paged allocation "
                "(serving simulation, no GPU)",
    figure=lambda df, path: line_figure(
        df, path, "allocator", "useful_frac", ["budget_tokens"], agg="mean",
        order=[a for a in ALLOCATORS if a in set(df["allocator"])],
        title="token states / reserved KV slots"),
    device=False))


# -- merge-rule: (m, l) merge vs one pass, in numpy ----------------------------------

def softmax_average(x, v, num_parts):
    """Softmax-weighted average of values, computed over ``num_parts`` parts of
    the keys merged with the (m, l) rule; ``num_parts = 1`` is a single pass.

    Every elementwise operation rounds to the inputs' dtype; sums use NumPy's
    pairwise summation along a contiguous axis (for float16 NumPy accumulates
    those in float32 and rounds the result).

    Parameters
    ----------
    x : ndarray, ``[n]``
        Logits.
    v : ndarray, ``[head_size, n]``
        Values, transposed so that sums run along the contiguous axis.

    Returns
    -------
    ndarray, ``[head_size]``
        ``sum_j softmax(x)_j v[:, j]``, in ``x``'s dtype.

    Examples
    --------
    >>> x = np.array([1000.0, 1000.0, 0.0])          # exp(1000) overflows; x - max does not
    >>> v = np.array([[1.0, 3.0, 100.0]])           # head_size 1
    >>> softmax_average(x, v, 1)                     # weights 1/2, 1/2, e^-1000 / 2 ~ 0
    array([2.])
    >>> softmax_average(x, v, 3)                     # 3 parts of 1 key, merged
    array([2.])
    """
    m = l = acc = None
    for xs, vs in zip(np.array_split(x, num_parts), np.array_split(v, num_parts, axis=1)):
        if xs.size == 0:
            continue
        mi = xs.max()
        p = np.exp(xs - mi)
        li, ai = p.sum(), (vs * p).sum(axis=1)
        if m is None:
            m, l, acc = mi, li, ai
            continue
        # -- merge: m = max(m1, m2), l = l1 e^(m1 - m) + l2 e^(m2 - m), same for acc
        new = max(m, mi)
        a, b = np.exp(m - new), np.exp(mi - new)
        m, l, acc = new, l * a + li * b, acc * a + ai * b
    return acc / l


def measure_merge_rule(p):
    """Max abs error of the single-pass, merged and naive (no max subtraction)
    softmax averages in ``p["dtype"]`` against a float64 single pass on the
    same (rounded) inputs.

    Parameters
    ----------
    p : dict
        ``dtype``, ``scale`` (logits are ``scale * N(0, 1)``), ``parts``,
        ``length`` (keys), ``head_size``, ``seed``.

    Returns
    -------
    dict
        ``err_single``, ``err_merged``, ``err_naive`` (NaN when the naive
        sum overflows), ``naive_overflows`` and ``max_logit``.

    Examples
    --------
    >>> p = dict(dtype="float32", scale=1, parts=8, length=256, head_size=16, seed=0)
    >>> r = measure_merge_rule(p)
    >>> sorted(r)
    ['err_merged', 'err_naive', 'err_single', 'max_logit', 'naive_overflows']
    >>> r["err_merged"] < 1e-6, r["naive_overflows"]
    (True, False)
    >>> r = measure_merge_rule(dict(p, dtype="float16", scale=100))   # exp(310) > 65504
    >>> r["naive_overflows"], math.isnan(r["err_naive"]), r["max_logit"]
    (True, True, 310.75)
    """
    dt = np.dtype(p["dtype"])
    rng = np.random.default_rng(p["seed"])
    x = (p["scale"] * rng.standard_normal(p["length"])).astype(dt)
    v = rng.standard_normal((p["head_size"], p["length"])).astype(dt)
    ref = softmax_average(x.astype(np.float64), v.astype(np.float64), 1)

    def err(out):
        return float(np.abs(out.astype(np.float64) - ref).max())

    with np.errstate(over="ignore", invalid="ignore"):
        e = np.exp(x)
        total = e.sum()
        naive = (v * e).sum(axis=1) / total
    overflow = not (np.isfinite(e).all() and np.isfinite(total) and np.isfinite(naive).all())
    return dict(err_single=err(softmax_average(x, v, 1)),
                err_merged=err(softmax_average(x, v, p["parts"])),
                err_naive=math.nan if overflow else err(naive), naive_overflows=overflow,
                max_logit=float(np.abs(x).max()))


register(Sweep(
    "merge-rule",
    grid=dict(dtype=["float64", "float32", "float16"], scale=[1, 10, 100],
              parts=[1, 2, 4, 8, 16, 32, 64], length=[4096], head_size=[64], seed=[0, 1, 2]),
    quick_grid=dict(dtype=["float32", "float16"], scale=[1, 100], parts=[1, 8], length=[256],
                    head_size=[16], seed=[0]),
    measure=measure_merge_rule,
    description="error of the (m, l) merge of k partial softmaxes vs one pass, and naive "
                "overflow, in float64/32/16 NumPy (no GPU)",
    figure=lambda df, path: line_figure(
        df, path, "parts", "err_merged", ["dtype", "scale"], agg="max", logx=True, logy=True,
        title="max abs error vs float64, merged partial softmaxes"),
    device=False))


# -- exactness: kernels vs the float64 reference --------------------------------------

def measure_exactness(p):
    """Max abs error of :func:`paged_numba.paged_decode` and of a contiguous
    float32 NumPy computation against the float64 reference, and the kernel's
    error over the bound of :mod:`paged_numba.testing` (<= 1 passes).

    Parameters
    ----------
    p : dict
        ``num_seqs``, ``context`` (tokens per sequence), ``block_size``,
        ``table`` (``"random"`` or ``"identity"``), ``num_heads``,
        ``num_kv_heads``, ``head_size``, ``layout``, ``dtype``,
        ``num_partitions`` (``"auto"`` or an int) and ``seed``.

    Returns
    -------
    dict
        ``err_kernel``, ``err_numpy_fp32``, ``err_over_bound``, ``max_abs_out``.

    Examples
    --------
    >>> p = dict(num_seqs=1, context=6, block_size=4, table="random", num_heads=2,
    ...          num_kv_heads=1, head_size=8, layout="nhd", dtype="float16",
    ...          num_partitions="auto", seed=0)          # 2 blocks, one decode launch
    >>> r = measure_exactness(p)
    >>> sorted(r)
    ['err_kernel', 'err_numpy_fp32', 'err_over_bound', 'max_abs_out']
    >>> r["err_over_bound"] <= 1, r["err_numpy_fp32"] < r["err_kernel"] < 1e-2
    (True, True)
    """
    from . import PagedKVCache, paged_decode
    from .reference import paged_decode_reference
    from .testing import DecodeProblem, decode_reference, ulp

    n, ctx, bs = p["num_seqs"], p["context"], p["block_size"]
    blocks_per_seq = -(-ctx // bs)
    num_blocks = n * blocks_per_seq
    rng = np.random.default_rng(p["seed"])
    order = rng.permutation(num_blocks) if p["table"] == "random" else np.arange(num_blocks)
    prob = DecodeProblem(num_seqs=n, num_heads=p["num_heads"], num_kv_heads=p["num_kv_heads"],
                         head_size=p["head_size"], block_size=bs, num_blocks=num_blocks,
                         layout=p["layout"], dtype=p["dtype"],
                         seq_lens=np.full(n, ctx, np.int32),
                         block_tables=order.reshape(n, blocks_per_seq).astype(np.int32),
                         seed=p["seed"])
    q, k, v = prob.arrays()
    cache = PagedKVCache.from_host(*prob.layout_pools(k, v), layout=prob.layout)
    parts = None if p["num_partitions"] == "auto" else int(p["num_partitions"])
    out = paged_decode(q, cache, prob.block_tables, prob.seq_lens, num_partitions=parts)
    ref, _, bound, _ = decode_reference(prob, q, k, v, num_partitions=parts)
    ref32, _ = paged_decode_reference(q, k, v, prob.block_tables, prob.seq_lens, dtype=np.float32)
    err = np.abs(out.astype(np.float64) - ref)
    allowed = bound + ulp(ref, out.dtype)
    return dict(err_kernel=float(err.max()),
                err_numpy_fp32=float(np.abs(ref32.astype(np.float64) - ref).max()),
                err_over_bound=float((err / allowed).max()), max_abs_out=float(np.abs(ref).max()))


register(Sweep(
    "exactness",
    grid=dict(block_size=[8, 32], table=["random", "identity"],
              dtype=["float16", "bfloat16", "float32"], layout=["nhd"],
              context=[1, 15, 257, 4097], num_partitions=["auto", 1],
              num_seqs=[4], num_heads=[8], num_kv_heads=[2], head_size=[128], seed=[0]),
    quick_grid=dict(block_size=[16], table=["random"], dtype=["float16"], layout=["nhd"],
                    context=[40], num_partitions=["auto"], num_seqs=[1], num_heads=[2],
                    num_kv_heads=[1], head_size=[16], seed=[0]),
    measure=measure_exactness,
    description="error of paged_decode vs the float64 reference (and of float32 NumPy, for "
                "comparison) across block sizes, tables, dtypes, layouts",
    figure=lambda df, path: line_figure(
        df, path, "context", "err_kernel", ["dtype", "table"], agg="max", logx=True, logy=True,
        title="paged_decode: max abs error vs float64 reference"),
    device=True))


# -- timing: decode, paging-overhead, split-k -------------------------------------------

def _event_us(calls, reps=20, warmup=3):
    """Median over ``reps`` of CUDA-event time around all ``calls``, per call (µs)."""
    from numba import cuda

    for _ in range(warmup):
        for call in calls:
            call()
    cuda.synchronize()
    start, end = cuda.event(timing=True), cuda.event(timing=True)
    times = []
    for _ in range(reps):
        start.record()
        for call in calls:
            call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times)


def _release_device_memory():
    """Free the device arrays numba has queued for deallocation."""
    import gc

    from numba import cuda

    gc.collect()
    ctx = cuda.current_context()
    for owner in (ctx, getattr(ctx, "memory_manager", None)):
        pending = getattr(owner, "deallocations", None)
        if pending is not None:
            pending.clear()


def measure_decode_time(p, sdpa=False):
    """Time :meth:`paged_numba.DecodePlan.run` on one batch shape.

    On a GPU: CUDA events around ``DecodePlan.run`` calls (3 warm-up rounds,
    median of 20), inputs rotated over up to :data:`MAX_ROTATIONS` block
    ranges so that one round reads more than 4x the L2 where that takes no
    more copies (K/V are zeros: values do not change the kernel's memory
    traffic). Host launch time is included, so shapes whose
    kernel is shorter than a launch (~50 µs) are host-bound; for kernel-only
    times use ``experiments/bench_decode.py`` (CUDA graphs). On the
    simulator: one call's wall-clock time (``timer = "perf_counter"``).
    With ``sdpa`` and PyTorch on a GPU, also ``sdpa_us`` and ``ratio_to_sdpa``
    for ``scaled_dot_product_attention(q, k, v, enable_gqa=True)`` on
    contiguous K/V. Points too big for the free device memory get a ``note``.

    Bytes counted in ``gbps``: one read of K and V
    (``2 * batch * context * num_kv_heads * head_size * itemsize``) plus the
    query and the output.

    Parameters
    ----------
    p : dict
        ``batch``, ``context``, ``num_heads``, ``group`` (query heads per KV
        head), ``head_size``, ``block_size``, ``dtype``, ``table``
        (``"random"`` or ``"identity"``), optional ``num_partitions``.
    sdpa : bool

    Returns
    -------
    dict
        ``us``, ``timer``, ``num_partitions_used``, ``gbps`` (plus ``sdpa_us``
        and ``ratio_to_sdpa``, or only ``note`` for a skipped point).

    Examples
    --------
    >>> p = dict(batch=1, context=6, num_heads=2, group=2, head_size=8, block_size=4,
    ...          dtype="float16", table="random")      # kv_bytes = 2 * 1 * 6 * 1 * 8 * 2 = 192
    >>> r = measure_decode_time(p)
    >>> sorted(r), r["us"] > 0
    (['gbps', 'num_partitions_used', 'timer', 'us'], True)
    """
    from numba import cuda

    from . import DecodePlan, PagedKVCache, simulator_enabled

    b, ctx, h, d, bs = p["batch"], p["context"], p["num_heads"], p["head_size"], p["block_size"]
    kvh = h // p["group"]
    itemsize = np.dtype(p["dtype"]).itemsize
    kv_bytes = 2 * b * ctx * kvh * d * itemsize
    sim = simulator_enabled()
    rot = 1 if sim else min(MAX_ROTATIONS, math.ceil(4 * L2_BYTES / kv_bytes))
    if not sim:
        _release_device_memory()                # the previous point's arrays
        free = cuda.current_context().get_memory_info()[0]
        need = rot * kv_bytes * (2 if sdpa else 1)
        if need > 0.8 * free:
            return dict(note=f"skipped: needs {need / 1e9:.1f} GB, {free / 1e9:.1f} GB free")
    blocks_per_seq = -(-ctx // bs)
    num_blocks = rot * b * blocks_per_seq
    rng = np.random.default_rng(0)
    cache = PagedKVCache(num_blocks, bs, kvh, d, p["dtype"])
    order = rng.permutation(num_blocks) if p["table"] == "random" else np.arange(num_blocks)
    tables = [cuda.to_device(t.reshape(b, blocks_per_seq).astype(np.int32))
              for t in np.split(order, rot)]
    lens = cuda.to_device(np.full(b, ctx, np.int32))
    queries = [cuda.to_device(rng.standard_normal((b, h, d)).astype(p["dtype"]))
               for _ in range(rot)]
    parts = p.get("num_partitions", "auto")
    plans = [DecodePlan(cache, b, h, blocks_per_seq,
                        num_partitions=None if parts == "auto" else int(parts)) for _ in range(rot)]
    calls = [functools.partial(plan.run, q, t, lens) for plan, q, t in zip(plans, queries, tables)]
    if sim:
        start = time.perf_counter()
        calls[0]()
        us, timer = (time.perf_counter() - start) * 1e6, "perf_counter"
    else:
        us, timer = _event_us(calls), "cuda_event"
    row = dict(us=us, timer=timer, num_partitions_used=plans[0].num_partitions,
               gbps=(kv_bytes + 2 * b * h * d * itemsize) / us / 1e3)
    del cache, plans, calls, tables, queries
    if sdpa and not sim:
        row.update(_sdpa_us(b, ctx, h, kvh, d, p["dtype"], rot))
        if "sdpa_us" in row:
            row["ratio_to_sdpa"] = us / row["sdpa_us"]
    return row


def _sdpa_us(b, ctx, h, kvh, d, dtype, rot):
    """CUDA-event time of torch's SDPA on contiguous K/V, or {} without torch."""
    try:
        import torch
    except ImportError:
        return {}
    if not torch.cuda.is_available():
        return {}
    f, tdt = torch.nn.functional.scaled_dot_product_attention, getattr(torch, dtype)
    qs = [torch.randn(b, h, 1, d, dtype=tdt, device="cuda") for _ in range(rot)]
    ks = [torch.randn(b, kvh, ctx, d, dtype=tdt, device="cuda") for _ in range(rot)]
    vs = [torch.randn_like(k) for k in ks]
    calls = [functools.partial(f, q, k, v, enable_gqa=True) for q, k, v in zip(qs, ks, vs)]
    us = _event_us(calls)
    del qs, ks, vs, calls
    torch.cuda.empty_cache()
    return dict(sdpa_us=us)


_TINY = dict(num_heads=[2], group=[2], head_size=[16], block_size=[16], dtype=["float16"])

register(Sweep(
    "decode",
    grid=dict(batch=[1, 16, 64, 256], context=[512, 2048, 8192, 32768], group=[1, 4, 32],
              head_size=[128], num_heads=[32], block_size=[16], dtype=["float16"],
              table=["random"]),
    quick_grid=dict(batch=[1], context=[48], table=["random"], **_TINY),
    measure=functools.partial(measure_decode_time, sdpa=True),
    description="decode time over batch, context, GQA group (32 = MQA) and head size; "
                "ratio to torch SDPA when torch is on a GPU (full grid needs a GPU)",
    figure=lambda df, path: line_figure(
        df, path, "context", "us", ["batch"], where=dict(group=4, head_size=128),
        logx=True, logy=True, title="DecodePlan.run time"),
    device=True))

register(Sweep(
    "paging-overhead",
    grid=dict(block_size=[8, 16, 32], context=[512, 2048, 8192, 32768],
              table=["random", "identity"], batch=[16], num_heads=[32], group=[4],
              head_size=[128], dtype=["float16"]),
    quick_grid=dict(batch=[1], context=[48], table=["random"], **_TINY),
    measure=measure_decode_time,
    description="decode time with random vs identity (contiguous) block tables, over block "
                "size and context (full grid needs a GPU)",
    figure=lambda df, path: line_figure(
        df, path, "context", "us", ["block_size", "table"], logx=True, logy=True,
        title="DecodePlan.run time by block table"),
    device=True))

register(Sweep(
    "split-k",
    grid=dict(num_partitions=[1, 2, 4, 8, 16, 32, 64], batch=[1, 4, 16], context=[4096, 32768],
              num_heads=[32], group=[4], head_size=[128], block_size=[16], dtype=["float16"],
              table=["random"]),
    quick_grid=dict(num_partitions=[2], batch=[1], context=[48], table=["random"], **_TINY),
    measure=measure_decode_time,
    description="decode time over split-K partitions for a few (batch, context) "
                "(full grid needs a GPU)",
    figure=lambda df, path: line_figure(
        df, path, "num_partitions", "us", ["batch", "context"], logx=True, logy=True,
        title="DecodePlan.run time by split-K partitions"),
    device=True))
