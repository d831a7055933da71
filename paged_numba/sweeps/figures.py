"""Figures of the sweeps: :func:`line_figure` (lines by series, one panel per
facet) and the figures that need more than lines (:func:`timing_figure`,
:func:`paging_overhead_figure`, :func:`memory_waste_figure`,
:func:`merge_rule_figure`).

Every figure says in its title what is compared and where it ran (the GPU,
"Numba CUDA simulator" or "CPU"), labels its axes with units, and draws a
log axis only where every value on it is positive. Timing sweeps run on the
simulator are drawn as the simulator's wall time and say that it is not a
kernel timing. matplotlib (the ``plots`` extra) is imported only here.
"""
import textwrap

import numpy as np

from .runner import require

MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")
LINESTYLES = ("-", "--", ":", "-.")

# axis labels, with units, of the columns that the sweeps plot
LABELS = {
    "context": "context (tokens per sequence)",
    "num_partitions": "split-K partitions",
    "parts": "partial softmaxes merged",
    "allocator": "allocator",
    "block_size": "block size (tokens)",
    "us": "time per call (µs)",
}
# names of series columns in legends and panel titles
NAMES = {"batch": "batch", "block_size": "block size", "table": "table", "scale": "logit scale",
         "group": "GQA group", "context": "context", "budget_tokens": "budget (token slots)",
         "dtype": "K/V dtype", "kind": "kind"}
GROUP_NAMES = {1: "MHA (32 query / 32 KV heads)", 4: "GQA (32 query / 8 KV heads)",
               32: "MQA (32 query heads / 1 KV head)"}


def source(df):
    """Where the rows ran, for a figure's title: the GPU's name, ``"Numba CUDA
    simulator"`` or ``"CPU"``, and the commit(s).

    Examples
    --------
    >>> import pandas as pd
    >>> source(pd.DataFrame({"gpu": ["NVIDIA H200"] * 2, "git_rev": ["e5fcc54"] * 2}))
    'NVIDIA H200, git e5fcc54'
    >>> source(pd.DataFrame({"gpu": ["simulator"], "git_rev": ["abc1234"]}))
    'Numba CUDA simulator, git abc1234'
    """
    names = {"simulator": "Numba CUDA simulator", "cpu": "CPU"}
    where = sorted({names.get(g, g) for g in df["gpu"].dropna().astype(str)}) if "gpu" in df else []
    revs = sorted(set(df["git_rev"].dropna().astype(str))) if "git_rev" in df else []
    parts = [" / ".join(where)] if where else []
    if revs:
        parts.append("git " + " ".join(revs))
    return ", ".join(parts)


def on_simulator(df):
    """Whether the rows were measured on Numba's CUDA simulator."""
    return "gpu" in df and (df["gpu"].astype(str) == "simulator").any()


def _name(col, value):
    return f"{NAMES.get(col, col)} {value}"


def _positive(values):
    values = np.asarray(values, dtype=float)
    values = values[np.isfinite(values)]
    return values.size > 0 and (values > 0).all()


def _plain_log_y(ax, values):
    """Log y ticks written as plain numbers; minor ticks labelled at 2 and 5 x 10^k
    when the axis spans less than two decades."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    values = np.asarray(values, dtype=float)
    if np.nanmax(values) / np.nanmin(values) < 100:
        def minor(v, _):
            lead = v / 10 ** np.floor(np.log10(v))
            return f"{v:g}" if round(lead) in (2, 5) and abs(lead - round(lead)) < 1e-6 else ""
        ax.yaxis.set_minor_formatter(FuncFormatter(minor))
    else:
        ax.yaxis.set_minor_formatter(NullFormatter())


def _title(fig, text, df, width):
    """The figure's title, wrapped to ``width`` characters, and where the rows ran."""
    where_from = source(df)
    lines = [textwrap.fill(t, width) for t in text.split("\n")]
    fig.suptitle("\n".join(lines + ([where_from] if where_from else [])), fontsize=10)


def _value_ticks(ax, values):
    """Ticks at the swept x values, written as numbers, when there are few of them."""
    values = sorted(set(float(v) for v in values))
    if len(values) <= 12:
        ax.set_xticks(values, [f"{v:g}" for v in values])
        ax.minorticks_off()


def line_figure(df, path, x, y, series=(), facet=None, where=None, agg="median", order=None,
                logx=False, logy=False, title="", xlabel=None, ylabel=None, facet_label=None,
                hline=None):
    """Save a line plot: ``y`` against ``x``, one line per value of the
    ``series`` columns (colour and marker), one panel per value of ``facet``,
    ``agg`` over rows that share them.

    ``y`` may be a dict ``{column: legend label}``: each column is then drawn
    in its own line style for every series. Rows measured on several boards
    (:func:`boards`) are never aggregated together: each board gets its own
    panel (or, where ``facet`` is given, its own lines). ``where`` (``{column: value}``)
    keeps matching rows when any match; ``order`` lists the x values of a
    categorical axis in plotting order.

    Parameters
    ----------
    df : pandas.DataFrame
        A sweep's rows.
    path : str
        The PNG to write (nothing is written if ``y`` has no values).
    x : str
        Column of the x axis.
    y : str or dict of str -> str
        Column(s) of the y axis.
    series : sequence of str
        Columns whose value combinations get one line each.
    facet : str, optional
        Column whose values get one panel each.
    where : dict, optional
    agg : str
        pandas aggregation over rows sharing ``x``, the facet and the series values.
    order : list, optional
    logx, logy : bool
        Log axes (x in base 2), each only where every value on it is positive.
    title : str
        What is compared; the device and commit are added below it.
    xlabel, ylabel : str, optional
        Axis labels (default: :data:`LABELS` or the column name).
    facet_label : callable(value, rows) -> str, optional
        A panel's title (default: ``"<facet> <value>"``).
    hline : float, optional
        A thin horizontal reference line (e.g. 0).

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
    >>> if matplotlib is not None:     # two lines, kind a and kind b, on a log2 x axis
    ...     line_figure(df, path, "n", "t", series=["kind"], logx=True, title="t by n")
    >>> os.path.exists(path) == (matplotlib is not None)
    True
    >>> shutil.rmtree(os.path.dirname(path))
    """
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    pd = require("pandas", "sweeps")

    ys = {y: None} if isinstance(y, str) else dict(y)
    series = list(series)
    board = boards(df)
    if board is not None:
        df = df.assign(board=board)
        if facet is None:
            facet = "board"
        else:
            series.append("board")
    if where:
        mask = np.logical_and.reduce([df[c] == v for c, v in where.items()])
        if mask.any():
            df = df[mask]
            title += " (" + ", ".join(_name(c, v) for c, v in where.items()) + ")"
    ys = {c: label for c, label in ys.items() if c in df and not df[c].isna().all()}
    if not ys:
        return                                  # nothing measured (e.g. every point skipped)
    df = df[df[list(ys)].notna().any(axis=1)]
    panels = [(None, df)] if facet is None else list(df.groupby(facet, sort=True))
    keys = sorted(set(df[series].itertuples(index=False, name=None))) if series else [()]
    style = {k: (f"C{i % 10}", MARKERS[i % len(MARKERS)]) for i, k in enumerate(keys)}

    fig = Figure(figsize=(max(6.4, 1.0 + 4.2 * len(panels)), 4.8), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False, sharex=True)[0]
    for ax, (value, rows) in zip(axes, panels):
        drawn = []
        for key in keys:
            g = rows
            for c, v in zip(series, key):
                g = g[g[c] == v]
            for j, col in enumerate(ys):
                line = g.groupby(x)[col].agg(agg).dropna()
                if line.empty:
                    continue
                xs = line.index if order is None else [order.index(v) for v in line.index]
                line = pd.Series(line.values, index=xs).sort_index()
                color, marker = style[key]
                # the first quantity wide and pale, the others thin with hollow markers on
                # top of it, so that equal values still show both lines
                ax.plot(line.index, line.values, color=color, marker=marker,
                        linestyle=LINESTYLES[j % len(LINESTYLES)],
                        linewidth=2.4 if j == 0 and len(ys) > 1 else 1.4,
                        alpha=0.55 if j == 0 and len(ys) > 1 else 1.0,
                        markersize=6 if j == 0 else 4.5, zorder=2 + j,
                        markerfacecolor=color if j == 0 else "white")
                drawn.extend(line.values)
        if order is not None:
            ax.set_xticks(range(len(order)), order, rotation=45, ha="right")
        if logx and order is None and _positive(rows[x]):
            ax.set_xscale("log", base=2)
            _value_ticks(ax, rows[x])
        if logy and _positive(drawn):
            ax.set_yscale("log")
            _plain_log_y(ax, drawn)
        else:                                  # numbers on the ticks, no offset text
            from matplotlib.ticker import FuncFormatter
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.3g}"))
        if hline is not None:
            ax.axhline(hline, color="0.3", linewidth=0.8)
        ax.set_xlabel(xlabel or LABELS.get(x, x))
        ax.grid(alpha=0.3)
        if facet is not None:
            ax.set_title(facet_label(value, rows) if facet_label else _name(facet, value),
                         fontsize=9)
    axes[0].set_ylabel(ylabel or LABELS.get(next(iter(ys)), next(iter(ys))))
    handles = []
    if series:
        handles += [Line2D([], [], color=c, marker=m, linestyle="-",
                           label=", ".join(_name(s, v) for s, v in zip(series, key)))
                    for key, (c, m) in style.items()]
    if len(ys) > 1 or next(iter(ys.values())) is not None:
        handles += [Line2D([], [], color="0.2", linestyle=LINESTYLES[j % len(LINESTYLES)],
                           label=label or col) for j, (col, label) in enumerate(ys.items())]
    if handles:
        fig.legend(handles=handles, loc="outside lower center", fontsize=8,
                   ncols=min(len(handles), 3 if len(panels) == 1 else 5))
    _title(fig, title, df, 70 * len(panels) if len(panels) > 1 else 80)
    fig.savefig(path, dpi=120)


def boards(df):
    """Where several boards measured ``df``'s rows: a label a row naming its
    board (``"NVIDIA H200 #3 on host"``, from the ``gpu``, ``gpu_index`` and
    ``host`` columns); else None (one board, a CPU sweep, or rows from
    before those columns).

    >>> import pandas as pd
    >>> df = pd.DataFrame({"gpu": ["H200", "H200"], "gpu_index": [0.0, 1.0], "host": ["a", "a"]})
    >>> boards(df).tolist(), boards(df.iloc[:1])
    (['H200 #0 on a', 'H200 #1 on a'], None)
    """
    if not {"gpu", "gpu_index", "host"} <= set(df.columns):
        return None
    index = df["gpu_index"].map(lambda v: "" if v is None or v != v or v == ""
                                else str(int(v)) if isinstance(v, float) else str(v))
    label = (df["gpu"].astype(str) + index.map(lambda i: f" #{i}" if i else "")
             + " on " + df["host"].astype(str))
    return label if label.nunique() > 1 else None


def fixed_params(df):
    """The decode parameters that one timing figure holds fixed, in words.

    Examples
    --------
    >>> import pandas as pd
    >>> fixed_params(pd.DataFrame({"dtype": ["float16"] * 2, "head_size": [128, 128],
    ...                            "num_heads": [32, 32], "group": [4, 4], "batch": [1, 16]}))
    'float16, 32 query / 8 KV heads, head size 128'
    """
    def one(col):
        return col in df and df[col].nunique() == 1 and df[col].iloc[0]

    words = [str(one("dtype"))] if one("dtype") else []
    if one("num_heads"):
        h = int(one("num_heads"))
        words.append(f"{h} query / {h // int(one('group'))} KV heads" if one("group")
                     else f"{h} query heads")
    words += [f"{name} {one(col)}" for col, name in (("head_size", "head size"),
                                                     ("block_size", "block size"),
                                                     ("context", "context"),
                                                     ("batch", "batch")) if one(col)]
    return ", ".join(words)


def timing_figure(df, path, x, series=(), facet=None, sdpa=False, title="", **kwargs):
    """:func:`line_figure` of a timing sweep's ``us`` (and torch SDPA's ``sdpa_us``
    with ``sdpa``), the fixed parameters added to ``title``. On the simulator
    the figure shows the wall time of the simulation in seconds and says that
    it is not a kernel timing."""
    fixed = fixed_params(df)
    if on_simulator(df):
        df = df.assign(sim_s=df["us"] / 1e6)
        kwargs["logy"] = False
        return line_figure(df, path, x, "sim_s", series, facet,
                           title=f"{title} ({fixed})\nsimulator run: wall time of the Python "
                                 "simulation, NOT a kernel timing",
                           ylabel="simulator wall time per call (s)", **kwargs)
    ys = {"us": "paged_numba DecodePlan.run"}
    if sdpa and "sdpa_us" in df and df["sdpa_us"].notna().any():
        ys["sdpa_us"] = "torch SDPA on contiguous K/V"
        title += " against torch SDPA"
    return line_figure(df, path, x, ys, series, facet, title=f"{title} ({fixed})",
                       ylabel="time per call (µs; CUDA events, host launch included)", **kwargs)


def paging_overhead_figure(df, path):
    """Random against identity block tables: ``us(random) / us(identity) - 1`` in
    percent over context, a line per block size (the times themselves when
    there are no identity rows, or on the simulator)."""
    title = "Paging overhead: DecodePlan.run with a random vs an identity (contiguous) block table"
    if on_simulator(df) or set(df["table"]) != {"random", "identity"}:
        return timing_figure(df, path, "context", ["block_size", "table"], title=title,
                             logx=True, logy=True)
    t = df.pivot_table(index=["block_size", "context"], columns="table", values="us",
                       aggfunc="median").dropna()
    t["overhead_pct"] = 100 * (t["random"] / t["identity"] - 1)
    t = t.reset_index()
    for c in ("gpu", "git_rev"):
        t[c] = df[c].iloc[0] if df[c].nunique() == 1 else " / ".join(sorted(set(df[c].astype(str))))
    line_figure(t, path, "context", "overhead_pct", ["block_size"], logx=True, hline=0,
                title=f"{title} ({fixed_params(df)})",
                ylabel="random-table time / identity-table time - 1 (%)")


def memory_waste_figure(df, path):
    """Paged allocation over block size against the two contiguous reservations,
    one panel column per KV budget: the share of reserved slots that hold
    token states (top) and the concurrent batch against ``contiguous-max``
    (bottom), means over seeds."""
    from matplotlib.figure import Figure

    budgets = sorted(df["budget_tokens"].unique())
    mean = df.groupby(["budget_tokens", "allocator"])[["useful_frac", "batch_ratio"]].mean()
    fig = Figure(figsize=(1.0 + 3.6 * len(budgets), 6.4), layout="constrained")
    axes = fig.subplots(2, len(budgets), squeeze=False, sharex=True, sharey="row")
    rows = (("useful_frac", 100, "KV slots holding token states\n(% of reserved slots)"),
            ("batch_ratio", 1, "concurrent requests\n(x contiguous-max)"))
    contiguous = (("contiguous-max", "C1", "--", "contiguous, maximum length reserved"),
                  ("contiguous-oracle", "C2", ":", "contiguous, true final length reserved"))
    for j, budget in enumerate(budgets):
        m = mean.loc[budget]
        paged = sorted((int(a.removeprefix("paged-")), a) for a in m.index
                       if a.startswith("paged-"))
        for i, (col, scale, label) in enumerate(rows):
            ax = axes[i][j]
            ax.plot([b for b, _ in paged], [scale * m.loc[a, col] for _, a in paged], color="C0",
                    marker="o", label="paged, block size on the x axis")
            for alloc, color, ls, name in contiguous:
                if alloc in m.index:
                    ax.axhline(scale * m.loc[alloc, col], color=color, linestyle=ls, label=name)
            if paged:
                ax.set_xscale("log", base=2)
                _value_ticks(ax, [b for b, _ in paged])
            ax.grid(alpha=0.3)
            if j == 0:
                ax.set_ylabel(label)
            if i == 0:
                ax.set_title(f"KV budget {budget:,} token slots", fontsize=9)
            else:
                ax.set_xlabel("block size (tokens)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=3 if len(budgets) > 1 else 1,
               fontsize=8)
    n, seeds = df["num_requests"].iloc[0], df["seed"].nunique()
    _title(fig, f"Memory waste: paged vs contiguous KV allocation (serving simulation, {n} "
                f"requests, mean of {seeds} seed{'s' * (seeds > 1)})", df, 60 * len(budgets))
    fig.savefig(path, dpi=120)


def merge_rule_figure(df, path):
    """Error of merged partial softmaxes and of one pass, in units of each
    dtype's machine epsilon, one panel per dtype; the panel title says where
    the naive softmax (no max subtraction) overflows."""
    eps = df["dtype"].map(lambda d: float(np.finfo(d).eps))
    df = df.assign(merged_eps=df["err_merged"] / eps, single_eps=df["err_single"] / eps)

    def label(dtype, rows):
        over = sorted(rows.loc[rows["naive_overflows"].astype(str) == "True", "scale"].unique())
        said = ("naive softmax overflows at logit scale " + ", ".join(map(str, over))
                if over else "naive softmax does not overflow")
        return f"{dtype} (eps {np.finfo(dtype).eps:.2g})\n{said}"

    line_figure(df, path, "parts", {"merged_eps": "merged by the (m, l) rule",
                                    "single_eps": "single pass"},
                ["scale"], facet="dtype", agg="max", logx=True, facet_label=label,
                title="Merging partial softmaxes: max abs error against a float64 single pass",
                ylabel="max abs error (units of the dtype's eps)")
