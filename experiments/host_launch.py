"""Where the host time of ``DecodePlan.run`` goes (needs a GPU; prints only).

    python experiments/host_launch.py

Times, per call, on a tiny decode (one sequence of 16 tokens, so that the GPU
drains the queue faster than the host fills it): ``plan.run``; its one
``cuGraphLaunch`` (decode and merge) alone; the packed decode launch alone
(``cuda.bindings`` ``cuLaunchKernel``); the same launch through ``ctypes``
straight into ``libcuda``; and a PyTorch in-place add as a floor for any
launch from Python. Each is the median of 7 rounds of 2000 calls.
"""
import ctypes
import statistics
import time

import numpy as np
import torch
from numba import cuda

import paged_numba as pn


def per_call_us(fn, calls=2000, rounds=7):
    out = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(out)


def main():
    for parts in (1, 2):
        cache = pn.PagedKVCache(64, 16, 8, 128, "float16")
        plan = pn.DecodePlan(cache, 1, 32, 1, num_partitions=parts)
        q = cuda.as_cuda_array(torch.randn(1, 32, 128, dtype=torch.float16, device="cuda"))
        tab = cuda.to_device(np.zeros((1, 1), np.int32))
        lens = cuda.to_device(np.full(1, 16, np.int32))
        plan.run(q, tab, lens)
        launch = plan._decode
        lib = ctypes.CDLL("libcuda.so.1")
        raw = lib.cuLaunchKernel
        raw.restype = ctypes.c_int
        raw.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        func, dims, params = int(launch._function), launch._dims, launch._address
        x = torch.zeros(1, device="cuda")
        rows = {
            "plan.run": lambda: plan.run(q, tab, lens),
            "plan.run's graph launch": lambda: plan._graph(None),
            "packed launch (cuda.bindings)": lambda: launch(None),
            "ctypes cuLaunchKernel": lambda: raw(func, *dims, 0, None, params, None),
            "torch x.add_(1)": lambda: x.add_(1),
            "empty Python call": lambda: None,
        }
        print(f"num_partitions={parts}:")
        for name, fn in rows.items():
            print(f"  {name:32s} {per_call_us(fn):6.2f} us", flush=True)


if __name__ == "__main__":
    main()
