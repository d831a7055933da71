"""Seconds from a fresh Python process to the first result of ``paged_decode``
and ``paged_prefill``, with an empty kernel cache (everything compiles) and
with the kernels kept on disk by an earlier process.

    python experiments/startup.py --out results/startup_h200.csv

Each row is one fresh process (``python -c``): ``import_s`` (``import
paged_numba`` and building the inputs), ``first_s`` (the first call, to its
result on the host), ``second_s`` (the same call again) and the number of
kernels the cache holds afterwards (-1 with the cache off). ``cold`` runs in an empty cache
directory, ``warm`` in the directory the cold run filled, ``off`` with
``PAGED_NUMBA_CACHE=0``. fp16, 32 / 8 heads, head size 128, block size 16.
``PAGED_NUMBA_INLINE=numba python experiments/startup.py`` measures the
kernels with Numba, not NVVM, inlining their device functions (the command
column names the mode).
"""
import argparse
import datetime
import os
import pathlib
import subprocess
import sys
import tempfile
import uuid

import pandas as pd

from paged_numba.kernels.convert import inline_mode

ROOT = pathlib.Path(__file__).resolve().parent.parent

CALL = {
    "decode": "pn.paged_decode(q[:, 0], cache, tables, lens)",
    "prefill": "pn.paged_prefill(q.reshape(-1, 32, 128), cache, tables, q_starts, lens, causal=True)",
}

SCRIPT = """
import time
t0 = time.perf_counter()
import numpy as np, paged_numba as pn
from paged_numba.kernels import disk_cache
rng = np.random.default_rng(0)
B, L, QL = 4, 1024, 256
cache = pn.PagedKVCache(num_blocks=B * L // 16, block_size=16, num_kv_heads=8, head_size=128)
kv = rng.standard_normal((B * L, 8, 128)).astype(np.float16)
pn.write_kv(cache, kv, kv, np.arange(B * L))
tables = np.arange(B * L // 16, dtype=np.int32).reshape(B, L // 16)
lens = np.full(B, L, np.int32)
q = rng.standard_normal((B, QL, 32, 128)).astype(np.float16)
q_starts = np.arange(0, (B + 1) * QL, QL, dtype=np.int32)
t1 = time.perf_counter()
np.asarray({call})
t2 = time.perf_counter()
np.asarray({call})
t3 = time.perf_counter()
print(t1 - t0, t2 - t1, t3 - t2, len(disk_cache.entries()) if disk_cache.enabled() else -1)
"""


def run(call, env):
    code = SCRIPT.format(call=CALL[call])
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               **env)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    return dict(zip(("import_s", "first_s", "second_s", "kept_kernels"),
                    (*map(float, out[:3]), int(out[3]))))


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="CSV to append the rows to")
    ap.add_argument("--calls", nargs="+", default=list(CALL), choices=list(CALL))
    args = ap.parse_args()
    import paged_numba
    from numba import cuda

    if paged_numba.simulator_enabled():
        ap.exit(2, "startup.py measures compiling on a GPU; the simulator compiles nothing\n")
    gpu = cuda.get_current_device().name
    gpu = gpu.decode() if isinstance(gpu, bytes) else gpu
    run_id = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ-")
    run_id += uuid.uuid4().hex[:6]
    rows = []
    for call in args.calls:
        with tempfile.TemporaryDirectory() as d:
            for state, env in (("cold", {"PAGED_NUMBA_CACHE_DIR": d}),
                               ("warm", {"PAGED_NUMBA_CACHE_DIR": d}),
                               ("off", {"PAGED_NUMBA_CACHE": "0"})):
                row = dict(run_id=run_id, gpu=gpu, call=call, cache=state, **run(call, env))
                print(row, flush=True)
                rows.append(row)
    df = pd.DataFrame(rows)
    df["command"] = (f"PAGED_NUMBA_INLINE={inline_mode()} "    # how the device functions were inlined
                     + "python experiments/startup.py" + (f" --out {args.out}" if args.out else ""))
    print(df.to_string(index=False))
    if args.out:
        header = not os.path.exists(args.out)
        df.to_csv(args.out, mode="a", header=header, index=False)


if __name__ == "__main__":
    main()
