"""The serving-feature sweeps (no GPU): ``sharing`` (parallel sampling and
beam search on the block manager, :mod:`paged_numba.sharing_sim`) and
``prefix-cache`` (system prompts and a multi-turn chat with prefix caching
on and off, :mod:`paged_numba.caching_sim`), each a grid, a quick grid, a
``measure`` and a figure handed to :func:`paged_numba.sweeps.runner.register`.
"""
import functools

import numpy as np

from .. import caching_sim, sharing_sim
from .figures import MARKERS, _title
from .runner import Sweep, register

# -- sharing: parallel sampling and beam search ---------------------------------------

# The pool per trace: about 100 concurrent Alpaca requests of 2 samples, 60 of
# ShareGPT's, so that memory limits the batch (block size 16, as in the paper).
SHARING_BLOCKS = {"alpaca": 1024, "sharegpt": 4096}
BLOCK_SIZE = 16
LM_ALPHA = 0.1                 # the beam search's language model (sharing_sim): top-1 p ~ 0.27
LM_ALPHA_RANGE = (0.02, 0.5)   # ... and a confident (top-1 p ~ 0.58) and a flat one (~ 0.1)
# the vLLM paper's memory saving on its Alpaca trace (Kwon et al., SOSP 2023, section 6.3)
PAPER_ALPACA = {"parallel": (6.1, 9.8), "beam": (37.6, 55.2)}


@functools.lru_cache(maxsize=16)
def _sharing_requests(dataset, num_requests, seed):
    return sharing_sim.make_requests(dataset, num_requests, seed)


@functools.lru_cache(maxsize=64)
def _sharing_run(dataset, mode, width, num_requests, seed, share, lm_alpha):
    return sharing_sim.simulate(mode, width, _sharing_requests(dataset, num_requests, seed),
                                SHARING_BLOCKS[dataset], BLOCK_SIZE, share=share, seed=seed,
                                lm_alpha=lm_alpha)


def measure_sharing(p):
    """:func:`sharing_sim.simulate` with sharing (fork + copy-on-write) and
    without (private copies) on the same requests.

    Parameters
    ----------
    p : dict
        ``dataset`` (``"alpaca"`` or ``"sharegpt"``), ``mode`` (``"parallel"``
        or ``"beam"``), ``width``, ``num_requests``, ``seed``.

    Returns
    -------
    dict
        The shared run's metrics (``saving`` and the rest), ``batch_gain``
        (its ``mean_running`` over the unshared run's), ``mean_running_unshared``,
        ``preemptions_unshared``, the pool (``num_blocks``, ``block_size``),
        and for Alpaca beam search ``saving_lm_alpha_0.02`` and
        ``saving_lm_alpha_0.5`` (other language models, :data:`LM_ALPHA_RANGE`).

    Examples
    --------
    >>> r = measure_sharing(dict(dataset="alpaca", mode="parallel", width=2,
    ...                          num_requests=30, seed=0))
    >>> 0 < r["saving"] < 0.5, r["batch_gain"] >= 1, r["num_blocks"]
    (True, True, 1024)
    """
    key = (p["dataset"], p["mode"], int(p["width"]), int(p["num_requests"]), int(p["seed"]))
    on = dict(_sharing_run(*key, True, LM_ALPHA))
    off = _sharing_run(*key, False, LM_ALPHA)
    on.update(batch_gain=on["mean_running"] / off["mean_running"] if off["mean_running"] else 1.0,
              mean_running_unshared=off["mean_running"], preemptions_unshared=off["preemptions"],
              num_blocks=SHARING_BLOCKS[p["dataset"]], block_size=BLOCK_SIZE)
    if p["mode"] == "beam" and p["dataset"] == "alpaca":
        for alpha in LM_ALPHA_RANGE:
            on[f"saving_lm_alpha_{alpha}"] = _sharing_run(*key, True, alpha)["saving"]
    return on


def sharing_figure(df, path):
    """Memory saved by sharing (left) and the concurrent batch it buys (right)
    over the number of samples or beams, one line per trace and mode (mean
    over the random draws, bars from the lowest to the highest, and for Alpaca
    beam search the language models of :data:`LM_ALPHA_RANGE`); the paper's Alpaca
    ranges as shaded bands."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11.5, 4.8), layout="constrained")
    left, right = fig.subplots(1, 2)
    names = {"parallel": "parallel sampling", "beam": "beam search"}
    colors = {"parallel": "C0", "beam": "C3"}
    styles = {"alpaca": "-", "sharegpt": "--"}
    for (mode, lo_hi) in PAPER_ALPACA.items():
        left.axhspan(*lo_hi, color=colors[mode], alpha=0.12, linewidth=0,
                     label=f"vLLM paper, Alpaca, {names[mode]} ({lo_hi[0]}-{lo_hi[1]}%)")
    k = 0
    for (dataset, mode), g in df.groupby(["dataset", "mode"], sort=True):
        spread = [c for c in g if c == "saving" or c.startswith("saving_lm_alpha_")]
        by_w = g.groupby("width")
        w = np.array(sorted(g["width"].unique()))
        mean = 100 * by_w["saving"].mean().loc[w].to_numpy()
        vals = 100 * g.set_index("width")[spread]
        lo = vals.groupby(level=0).min().min(axis=1).loc[w].to_numpy()
        hi = vals.groupby(level=0).max().max(axis=1).loc[w].to_numpy()
        label = f"{dataset}, {names[mode]}"
        left.errorbar(w, mean, yerr=[mean - lo, hi - mean], color=colors[mode],
                      linestyle=styles.get(dataset, ":"), marker=MARKERS[k % len(MARKERS)],
                      capsize=3, label=f"simulation: {label}")
        gain = by_w["batch_gain"].mean().loc[w].to_numpy()
        right.plot(w, gain, color=colors[mode], linestyle=styles.get(dataset, ":"),
                   marker=MARKERS[k % len(MARKERS)], label=label)
        k += 1
    for ax in (left, right):
        ax.set_xlabel("samples (parallel sampling) or beams (beam search) per request")
        ax.set_xticks(sorted(df["width"].unique()))
        ax.grid(alpha=0.3)
    left.set_ylabel("KV memory saved by sharing\n(% of blocks without sharing)")
    left.set_ylim(0, max(100.0, left.get_ylim()[1]) * 1.05)      # room for the legend
    left.set_title("memory saved (bars: random draws, and for Alpaca beam search\n"
                   f"next-token Dirichlet alpha {LM_ALPHA_RANGE[0]}-{LM_ALPHA_RANGE[1]})",
                   fontsize=9)
    right.set_ylabel("concurrent requests, sharing / private copies (x)")
    right.axhline(1, color="0.3", linewidth=0.8)
    right.set_title("concurrent batch under the same block budget", fontsize=9)
    left.legend(fontsize=7, loc="upper left")
    right.legend(fontsize=7, loc="upper left")
    n = df["num_requests"].iloc[0]
    pools = ", ".join(f"{d} {SHARING_BLOCKS.get(d, '?')} blocks"
                      for d in sorted(df["dataset"].unique()))
    _title(fig, f"Sharing KV blocks within a request (BlockManager.fork + copy-on-write) against "
                f"private copies: serving simulation, {n} requests, block size {BLOCK_SIZE} "
                f"({pools}), mean of {df['seed'].nunique()} random draw(s)", df, 120)
    fig.savefig(path, dpi=120)


register(Sweep(
    "sharing",
    grid=dict(dataset=["alpaca", "sharegpt"], mode=["parallel", "beam"], width=[2, 4, 6],
              num_requests=[600], seed=[0, 1]),
    quick_grid=dict(dataset=["alpaca"], mode=["parallel", "beam"], width=[2], num_requests=[40],
                    seed=[0]),
    measure=measure_sharing,
    description="KV memory saved by sharing blocks in parallel sampling and beam search "
                "(block manager fork + copy-on-write, serving simulation, no GPU)",
    figure=sharing_figure,
    device=False))


# -- prefix-cache: system prompts and multi-turn chat ---------------------------------

TRACES = ("system-128", "system-512", "system-1024", "chat-16", "chat-64")


def _trace_args(trace):
    """``(make_trace name, users)`` of a trace name (``"chat-<users>"``: that
    many conversations under way at once)."""
    if trace.startswith("chat-"):
        return "chat", int(trace.removeprefix("chat-"))
    return trace, None


@functools.lru_cache(maxsize=16)
def _trace(trace, num_requests, seed):
    return caching_sim.make_trace(_trace_args(trace)[0], num_requests, seed)


@functools.lru_cache(maxsize=64)
def _caching_run(trace, num_blocks, num_requests, seed, caching):
    return caching_sim.simulate(_trace(trace, num_requests, seed), num_blocks, BLOCK_SIZE,
                                caching=caching, users=_trace_args(trace)[1])


def measure_prefix_cache(p):
    """:func:`caching_sim.simulate` with prefix caching ``"on"`` or ``"off"``;
    adds ``batch_gain`` (concurrent requests over those with caching off, on
    the same trace and pool) and ``prefill_ratio`` (prefill tokens computed
    over those with caching off).

    Parameters
    ----------
    p : dict
        ``trace`` (``"system-<L>"`` or ``"chat-<users>"``), ``caching``,
        ``num_blocks``, ``num_requests``, ``seed``.

    Returns
    -------
    dict

    Examples
    --------
    >>> p = dict(trace="system-128", caching="on", num_blocks=256, num_requests=30, seed=0)
    >>> r = measure_prefix_cache(p)
    >>> r["hit_rate"] > 0.3, r["batch_gain"] > 1, r["prefill_ratio"] < 1
    (True, True, True)
    >>> measure_prefix_cache(dict(p, caching="off"))["hit_rate"]
    0.0
    """
    if p["caching"] not in ("on", "off"):
        raise ValueError(f"caching must be 'on' or 'off', but got {p['caching']!r}.")
    key = (p["trace"], int(p["num_blocks"]), int(p["num_requests"]), int(p["seed"]))
    r = dict(_caching_run(*key, p["caching"] == "on"))
    off = _caching_run(*key, False)
    r["batch_gain"] = r["mean_running"] / off["mean_running"] if off["mean_running"] else 1.0
    r["prefill_ratio"] = r["prefill_tokens"] / off["prefill_tokens"] if off["prefill_tokens"] \
        else 1.0
    return r


def prefix_cache_figure(df, path):
    """Per trace (x), one bar per KV pool: the prefix cache's hit rate and the
    prefill tokens it saves (caching on), and the concurrent requests with
    caching off and on (means over the random draws)."""
    from matplotlib.figure import Figure

    traces = [t for t in TRACES if t in set(df["trace"])] + \
        sorted(set(df["trace"]) - set(TRACES))
    pools = sorted(df["num_blocks"].unique())
    mean = df.groupby(["trace", "num_blocks", "caching"])[
        ["hit_rate", "prefill_saved", "mean_running"]].mean()
    fig = Figure(figsize=(13.5, 4.8), layout="constrained")
    axes = fig.subplots(1, 3)
    x = np.arange(len(traces))
    width = 0.8 / len(pools)
    for j, nb in enumerate(pools):
        off = x - 0.4 + (j + 0.5) * width
        pool = f"pool {nb} blocks ({nb * BLOCK_SIZE:,} tokens)"

        def values(col, caching, scale=1.0):
            return [scale * mean.loc[(t, nb, caching), col] if (t, nb, caching) in mean.index
                    else np.nan for t in traces]

        axes[0].bar(off, values("hit_rate", "on", 100), width, color=f"C{j}", label=pool)
        axes[1].bar(off, values("prefill_saved", "on", 100), width, color=f"C{j}", label=pool)
        axes[2].bar(off, values("mean_running", "off"), width, color=f"C{j}", alpha=0.35,
                    hatch="//", edgecolor=f"C{j}", label=f"{pool}, caching off")
        axes[2].plot(off, values("mean_running", "on"), linestyle="none", marker=MARKERS[j],
                     color=f"C{j}", markersize=8, label=f"{pool}, caching on")
    labels = ["hit rate (% of full prompt blocks found cached)",
              "prompt tokens not recomputed (%)", "concurrent requests (mean, saturated steps)"]
    titles = ["prefix-cache hit rate (caching on)", "prefill tokens saved (caching on)",
              "concurrent batch: bars caching off, markers on"]
    for ax, label, title in zip(axes, labels, titles):
        ax.set_xticks(x, traces, rotation=20, ha="right")
        ax.set_xlabel("trace")
        ax.set_ylabel(label)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    axes[0].set_ylim(0, 100)
    axes[1].set_ylim(0, 100)
    axes[2].set_ylim(0, 1.6 * np.nanmax(mean["mean_running"].to_numpy()))   # room for the legend
    axes[2].legend(fontsize=7, loc="upper right")
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="outside lower center", ncols=len(pools), fontsize=8)
    n = df["num_requests"].iloc[0]
    _title(fig, f"Prefix caching on vs off (BlockManager, LRU eviction): {n} requests, block "
                f"size {BLOCK_SIZE}, mean of {df['seed'].nunique()} random draw(s)\n"
                f"system-L: one of {caching_sim.NUM_SYSTEM_PROMPTS} system prompts of L tokens, "
                f"then the user's message; chat-U: multi-turn conversations, U under way at "
                f"once", df, 160)
    fig.savefig(path, dpi=120)


register(Sweep(
    "prefix-cache",
    grid=dict(trace=list(TRACES), caching=["off", "on"], num_blocks=[512, 2048],
              num_requests=[1000], seed=[0, 1]),
    quick_grid=dict(trace=["system-128", "chat-4"], caching=["off", "on"], num_blocks=[256],
                    num_requests=[40], seed=[0]),
    measure=measure_prefix_cache,
    description="prefix caching on vs off: hit rate, prefill tokens saved and concurrent batch "
                "for shared system prompts and multi-turn chat (serving simulation, no GPU)",
    figure=prefix_cache_figure,
    device=False))
