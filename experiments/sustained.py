"""Decode under sustained load: ours and SDPA replayed back to back for a few
seconds each, to set against the device's clocks and power over the same
seconds (log them alongside, e.g. ``nvidia-smi --query-gpu=timestamp,clocks.sm,
power.draw --format=csv -lms 50``).

    python experiments/sustained.py --shape 128x8192 --seconds 3

Prints, per implementation, its wall-clock window (in nvidia-smi's timestamp
format) and the median, first-decile and last-decile microseconds per call of
graph replays timed with CUDA events, one after another with no gap.
fp16, 32/8 heads, head size 128, block size 16, random tables, as
``bench_decode.py``.
"""
import argparse
import datetime
import statistics

import numpy as np
import torch
from numba import cuda

import paged_numba as pn


def stamp():
    return datetime.datetime.now().strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]


def sustained(call, seconds):
    """Per-replay microseconds of ``call`` captured in a graph, replayed for
    ``seconds`` with no idle gap between replays."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        call()
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        call()
    events = []
    start = stamp()
    t0 = torch.cuda.Event(enable_timing=True)
    t0.record()
    t_end = datetime.datetime.now() + datetime.timedelta(seconds=seconds)
    while datetime.datetime.now() < t_end:
        for _ in range(20):
            graph.replay()
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            events.append(e)
        events[-1].synchronize()
    end = stamp()
    times = [a.elapsed_time(b) * 1e3 for a, b in zip([t0] + events[:-1], events)]
    return start, end, times


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="128x8192", help="BATCHxCONTEXT")
    ap.add_argument("--seconds", type=float, default=3.0)
    a = ap.parse_args()
    batch, context = map(int, a.shape.split("x"))
    bs, kvh, hs = 16, 8, 128
    nb = batch * -(-context // bs)
    cache = pn.PagedKVCache(nb, bs, kvh, hs, "float16")
    for pool in (cache.key_cache, cache.value_cache):
        torch.as_tensor(pool, device="cuda").normal_()
    table = cuda.as_cuda_array(torch.randperm(nb, device="cuda").reshape(batch, -1)
                               .to(torch.int32).contiguous())
    q = cuda.as_cuda_array(torch.randn(batch, 32, hs, dtype=torch.float16, device="cuda"))
    lens = cuda.to_device(np.full(batch, context, np.int32))
    plan = pn.DecodePlan(cache, batch, 32, nb // batch)
    plan.run(q, table, lens, validate=True)
    ours = lambda: plan.run(q, table, lens, stream=torch.cuda.current_stream())  # noqa: E731
    k = torch.randn(batch, kvh, context, hs, dtype=torch.float16, device="cuda")
    v = torch.randn_like(k)
    qt = torch.randn(batch, 32, 1, hs, dtype=torch.float16, device="cuda")
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
        qt, k, v, enable_gqa=True)
    for name, call in (("paged_numba", ours), ("torch_sdpa", sdpa), ("paged_numba", ours)):
        start, end, t = sustained(call, a.seconds)
        n = len(t)
        print(f"{name:12} {a.shape} {start} .. {end}: {n} calls, median "
              f"{statistics.median(t):7.1f} us, first tenth {statistics.median(t[:n // 10]):7.1f}"
              f", last tenth {statistics.median(t[-n // 10:]):7.1f}", flush=True)


if __name__ == "__main__":
    main()
