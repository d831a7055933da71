"""The registered sweeps, declared as data: ``memory-waste`` and
``merge-rule`` need no GPU; ``exactness`` checks kernels against the
float64 reference; ``decode``, ``paging-overhead`` and ``split-k`` time
kernels (CUDA events on a GPU; on the simulator one wall-clock call per
point, which measures the simulator, not a kernel).

Each is a grid, a quick grid, a ``measure`` of one point and a figure,
handed to :func:`paged_numba.sweeps.runner.register`.
"""
import functools
import math
import statistics
import time

import numpy as np

from .. import serving_sim
from .figures import (GROUP_NAMES, line_figure, memory_waste_figure, merge_rule_figure,
                      paging_overhead_figure, timing_figure)
from .runner import Sweep, register


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
    figure=memory_waste_figure,
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
    figure=merge_rule_figure,
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
    from .. import PagedKVCache, paged_decode
    from ..reference import paged_decode_reference
    from ..testing import DecodeProblem, decode_reference, ulp   # needs hypothesis

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
        df, path, "context",
        {"err_kernel": "paged_decode",
         "err_numpy_fp32": "float32 NumPy, contiguous (not rounded to the dtype)"},
        ["table"], facet="dtype", agg="max", logx=True, logy=True,
        facet_label=lambda d, rows: (f"{d} K/V: kernel error at most "
                                     f"{rows['err_over_bound'].max():.2g} of its bound"),
        title="Exactness: paged_decode against the float64 reference (max over block sizes, "
              "split-K on/off)",
        ylabel="max abs error vs float64 reference"),
    device=True))


# -- timing: decode, paging-overhead, split-k -------------------------------------------

L2_BYTES = 60 * 2**20          # inputs of timed kernels are rotated past ~4x this (H200: 60 MB L2)
MAX_ROTATIONS = 64             # ... in at most this many copies (tiny shapes are host-bound anyway)


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

    from .. import DecodePlan, PagedKVCache, simulator_enabled

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
    figure=lambda df, path: timing_figure(
        df, path, "context", ["batch"], facet="group", sdpa=True, logx=True, logy=True,
        facet_label=lambda g, rows: GROUP_NAMES.get(g, f"GQA group {g}"),
        title="Decode time: paged_numba"),
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
    figure=paging_overhead_figure,
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
    figure=lambda df, path: timing_figure(
        df, path, "num_partitions", ["batch"], facet="context", logx=True, logy=True,
        facet_label=lambda c, rows: f"context {c} tokens",
        title="Split-K: DecodePlan.run time over partitions"),
    device=True))
