"""The ``swap-vs-recompute`` sweep: bring a preempted sequence's KV cache
back by swapping its blocks out to host memory and in again, or by
recomputing them.

For one sequence of ``context`` tokens in a cache of ``num_layers`` layers:

* ``swap_us``: :func:`paged_numba.swap_blocks` of all its blocks to a pinned
  host pool (:func:`paged_numba.host_pool`) and back, every layer (the bytes
  cross the host link twice), and ``swap_gbps`` the bytes moved over it;
* ``recompute_us``: what the attention of a recompute costs, per layer
  :func:`paged_numba.write_kv` of the context's keys and values and a causal
  prefill of all its tokens (a :class:`paged_numba.PrefillPlan` a layer,
  planned before the timing as an engine plans a batch once, then only its
  launch), times the layers. A
  model's projections and MLP, which a real recompute runs too, are not in
  it, so ``recompute_us`` is a floor and ``swap_over_recompute`` (below 1:
  swapping is faster) an upper bound of swapping's advantage.

On a GPU both are CUDA-event medians (3 warm-up rounds, 20 timed); on the
simulator one call's wall-clock time each (``timer = "perf_counter"``),
which measures the simulator, not the hardware.
"""
import time

import numpy as np

from .figures import fixed_params, line_figure, on_simulator
from .definitions import _event_us, _release_device_memory
from .runner import Sweep, register


def measure_swap_vs_recompute(p):
    """Time swapping one sequence's blocks out and in against recomputing
    its attention (see the module docstring).

    Parameters
    ----------
    p : dict
        ``context``, ``num_layers``, ``num_heads``, ``group`` (query heads a
        KV head), ``head_size``, ``block_size``, ``dtype``.

    Returns
    -------
    dict
        ``swap_us``, ``recompute_us``, ``swap_over_recompute``, ``swap_gbps``,
        ``kv_bytes`` (the sequence's keys and values, all layers), ``timer``.

    Examples
    --------
    >>> p = dict(context=20, num_layers=2, num_heads=2, group=2, head_size=16, block_size=8,
    ...          dtype="float16")
    >>> r = measure_swap_vs_recompute(p)
    >>> sorted(r)
    ['kv_bytes', 'recompute_us', 'swap_gbps', 'swap_over_recompute', 'swap_us', 'timer']
    >>> r["kv_bytes"]               # 3 blocks of 8 tokens x 1 KV head x 16 x 2 bytes, K and V, 2 layers
    3072
    """
    from numba import cuda

    from .. import PagedKVCache, PrefillPlan, host_pool, simulator_enabled, swap_blocks, write_kv

    ctx, layers, h, d, bs = (p["context"], p["num_layers"], p["num_heads"], p["head_size"],
                             p["block_size"])
    kvh, dtype = h // p["group"], p["dtype"]
    sim = simulator_enabled()
    if not sim:
        _release_device_memory()
    blocks = -(-ctx // bs)
    cache = PagedKVCache(blocks, bs, kvh, d, dtype, num_layers=layers)
    pool = host_pool(cache, blocks)
    pairs = np.stack([np.arange(blocks), np.arange(blocks)], axis=1)
    rng = np.random.default_rng(0)

    def device(a):
        a = a.astype(dtype)           # "bfloat16": ml_dtypes' (imported by the cache)
        return a if sim else cuda.to_device(a)

    keys = [device(rng.standard_normal((ctx, kvh, d))) for _ in range(layers)]
    values = [device(rng.standard_normal((ctx, kvh, d))) for _ in range(layers)]
    query = device(rng.standard_normal((ctx, h, d)))
    slots = np.arange(ctx, dtype=np.int64)
    table = np.arange(blocks, dtype=np.int32)[None, :]
    cu = np.array([0, ctx], np.int32)
    lens = np.array([ctx], np.int32)
    if not sim:
        slots, table = cuda.to_device(slots), cuda.to_device(table)
    views = [cache.layer(i) for i in range(layers)]
    plans = [PrefillPlan(view, cu, lens, h, causal=True) for view in views]
    out = plans[0].run(query, table)      # one output buffer for every layer

    def swap():
        swap_blocks(cache, pool, pairs)
        swap_blocks(pool, cache, pairs)

    def recompute():
        for view, plan, k, v in zip(views, plans, keys, values):
            write_kv(view, k, v, slots, validate=False)
            plan.run(query, table, out=out)

    if sim:
        times = []
        for call in (swap, recompute):
            start = time.perf_counter()
            call()
            times.append((time.perf_counter() - start) * 1e6)
        (swap_us, recompute_us), timer = times, "perf_counter"
    else:
        swap_us, recompute_us, timer = _event_us([swap]), _event_us([recompute]), "cuda_event"
    kv_bytes = 2 * layers * blocks * bs * kvh * d * np.dtype(dtype).itemsize
    return dict(swap_us=swap_us, recompute_us=recompute_us,
                swap_over_recompute=swap_us / recompute_us,
                swap_gbps=2 * kv_bytes / swap_us / 1e3, kv_bytes=kv_bytes, timer=timer)


def swap_figure(df, path):
    """Swap-out-and-in time and the attention-only recompute time over the
    context, a line each per head count (or the simulator's wall time)."""
    fixed = fixed_params(df)
    y = {"swap_us": "swap out + in", "recompute_us": "recompute (attention only)"}
    note = ""
    if on_simulator(df):
        note = "\nsimulator run: wall time of the Python simulation, not a kernel timing"
    line_figure(df, path, "context", y, series=["group"], logx=True, logy=True,
                title=f"Swapping a sequence's KV blocks vs recomputing them ({fixed}){note}",
                ylabel="µs" if not note else "simulator wall time (µs)")


register(Sweep(
    "swap-vs-recompute",
    grid=dict(context=[512, 1024, 2048, 4096, 8192, 16384, 32768], group=[1, 4, 8],
              num_layers=[32], num_heads=[32], head_size=[128], block_size=[16],
              dtype=["float16"]),
    quick_grid=dict(context=[24], group=[2], num_layers=[2], num_heads=[2], head_size=[16],
                    block_size=[8], dtype=["float16"]),
    measure=measure_swap_vs_recompute,
    description="time to swap a sequence's KV blocks out to host memory and back against the "
                "attention of recomputing them, over context (full grid needs a GPU)",
    figure=swap_figure,
    device=True))

__all__ = ["measure_swap_vs_recompute", "swap_figure"]
