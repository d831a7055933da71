"""What the benchmark scripts share: run ids, CSV output, an L2-flushing timer,
the device's copy bandwidth, decode's check against SDPA, FlashInfer as a
peer, and the plans' kernels built without the device guard (``--guard-cost``:
:func:`decode_without_guard`, :func:`prefill_without_guard`).

FlashInfer is a benchmark-only, optional import: :func:`import_flashinfer`
returns None (and prints why) when it is missing, and the scripts then skip
its rows. Its paged kernels read the project's ``"nhd"`` pools as they are
(``[num_blocks, block_size, num_kv_heads, head_size]`` is FlashInfer's NHD
paged layout); only the page table is converted, padded rows to CSR.
"""
import csv
import datetime
import os
import statistics
import uuid

L2_FLUSH_BYTES = 256 * 2**20                # several times an H200's 60 MB L2
FLASHINFER_WORKSPACE_BYTES = 256 * 2**20    # FlashInfer recommends 128 MB; twice that, to spare


def new_run_id():
    """A UTC timestamp plus a random suffix, e.g. ``20261129T115548Z-b7ac13``."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ-")
    return stamp + uuid.uuid4().hex[:6]


def write_rows(path, fields, rows, digits=3, keep_runs=False):
    """Write ``rows`` (dicts) to CSV ``path``: only ``fields``, floats rounded
    to ``digits``; print where they went. ``keep_runs``: the rows an existing
    file holds from other runs (another ``run_id`` than the new rows') stay,
    before the new ones, so that a CSV gathers runs."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    kept = []
    if keep_runs and os.path.exists(path):
        ours = {r.get("run_id") for r in rows}
        with open(path, newline="") as fh:
            kept = [r for r in csv.DictReader(fh) if r.get("run_id") not in ours]
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore", restval="",
                           lineterminator="\n")
        w.writeheader()
        w.writerows(kept)
        for r in rows:
            w.writerow({k: (round(v, digits) if isinstance(v, float) else v)
                        for k, v in r.items() if k in fields})
    print(f"wrote {len(rows)} rows to {path}" + (f" ({len(kept)} of other runs kept)"
                                                  if kept else ""))


def print_table(rows, columns, digits=3):
    """The rows' ``columns`` as one table (pandas), after a run."""
    import pandas as pd

    df = pd.DataFrame(rows).reindex(columns=columns)
    print(df.round(digits).to_string(index=False))


def ratio(us, peer_us):
    """``us / peer_us``, or "" when the peer did not run."""
    return us / peer_us if peer_us else ""


# -- timing (GPU) ------------------------------------------------------------------------

def gpu_state():
    """``{"sm_mhz": ..., "power_w": ...}`` of GPU 0 now, from ``nvidia-smi`` (read
    only; empty strings where it is missing). Taken right after a timed loop,
    it says at what clock and power the loop ended: runs that differ by more
    than their spread may differ there (a warmer card clocks lower)."""
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--id=0", "--query-gpu=clocks.sm,power.draw",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=10).stdout.split(",")
        return {"sm_mhz": int(float(out[0])), "power_w": round(float(out[1]))}
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return {"sm_mhz": "", "power_w": ""}


def flushed_samples(call, reps, warmup=3):
    """Microseconds of each of ``reps`` calls of ``call()``, each timed with CUDA
    events after a 256 MB write that evicts the L2 (outside the events). The
    calls are queued back to back, then synchronised once."""
    import torch

    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device="cuda")
    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    for a, b in events:
        flush.zero_()
        a.record()
        call()
        b.record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) * 1e3 for a, b in events]


def flushed_time(call, reps, warmup=3):
    """Median microseconds of :func:`flushed_samples`."""
    return statistics.median(flushed_samples(call, reps, warmup))


def alternation(n, rounds):
    """The order of ``n`` calls in each of ``rounds`` rounds: forwards, then
    backwards, and so on.

    >>> alternation(2, 4)
    [[0, 1], [1, 0], [0, 1], [1, 0]]
    """
    return [list(range(n))[::1 if r % 2 == 0 else -1] for r in range(rounds)]


def alternating_times(calls, reps, rounds=4):
    """Median microseconds of each of ``calls``, timed as :func:`flushed_time`
    does but in ``rounds`` rounds of about ``reps / rounds`` calls each, in the
    order :func:`alternation` gives: a card that warms and clocks down during
    the run weighs on every call alike, where timing one after the other
    charges it to the later one (on an H100, 2 x 8192 causal prefill clocks
    from 1,980 to about 1,750 MHz within a few timed loops)."""
    samples = [[] for _ in calls]
    per = max(1, -(-reps // rounds))
    for r, order in enumerate(alternation(len(calls), rounds)):
        for i in order:
            samples[i] += flushed_samples(calls[i], per, warmup=3 if r == 0 else 1)
    return [statistics.median(s) for s in samples]


def copy_gbps(nbytes=2**31, reps=20):
    """Device-to-device copy bandwidth, bytes read plus bytes written."""
    import torch

    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").normal_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps + 3):   # plain stream ops: a graph's memcpy node is slower than the copy
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return 2 * nbytes / statistics.median(times[3:]) / 1e3


# -- decode against SDPA (GPU) -----------------------------------------------------------

def torch_pools(cache):
    """The cache's K and V pools as torch tensors of its dtype (fp8 pools hold
    uint8 codes: viewed as torch's float8 of the same format)."""
    import torch

    pools = tuple(torch.as_tensor(p, device="cuda") for p in (cache.key_cache, cache.value_cache))
    if cache.dtype.name.startswith("float8"):
        pools = tuple(p.view(getattr(torch, cache.dtype.name)) for p in pools)
    return pools


def check_against_sdpa(cache, query, table, context, out, seqs=2):
    """Largest |paged_numba - SDPA in fp32| over the first ``seqs`` sequences
    (an "nhd" cache gathered through the table, fp8 codes times their scales): a
    sanity check of the timed kernel on the timed shapes; the test suite does
    the real checking."""
    import torch

    if cache.layout != "nhd":
        return float("nan")
    kpool, vpool = (p.float() for p in torch_pools(cache))
    if cache.dtype.name.startswith("float8"):
        scales = torch.as_tensor(cache.kv_scales, device="cuda")        # [2, num_kv_heads]
        kpool, vpool = kpool * scales[0, :, None], vpool * scales[1, :, None]
    q = torch.as_tensor(query, device="cuda")[:seqs].float()
    tab = torch.as_tensor(table, device="cuda")[:seqs].long()
    k = kpool[tab].flatten(1, 2)[:, :context].float().transpose(1, 2)   # [s, kvh, ctx, d]
    v = vpool[tab].flatten(1, 2)[:, :context].float().transpose(1, 2)
    ref = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)
    got = torch.as_tensor(out, device="cuda")[:seqs].float()
    return float((got - ref[:, :, 0]).abs().max())


# -- FlashInfer (GPU) ---------------------------------------------------------------------

def import_flashinfer():
    """The ``flashinfer`` module, or None after printing why it did not import."""
    try:
        import flashinfer
    except Exception as e:  # noqa: BLE001 - ImportError, or one of its own dependencies failing
        print(f"flashinfer: not importable ({type(e).__name__}: {e}); its rows are skipped",
              flush=True)
        return None
    print(f"flashinfer {getattr(flashinfer, '__version__', '?')}", flush=True)
    return flashinfer


def csr_pages(block_table, kv_lens, block_size):
    """FlashInfer's ``(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)``
    of a padded block table (a torch tensor or array ``[num_seqs, max_blocks]``,
    ``-1`` past each sequence's blocks), as int32 CUDA tensors."""
    import numpy as np
    import torch

    from paged_numba.page_tables import padded_to_csr

    table = block_table.cpu().numpy() if torch.is_tensor(block_table) else np.asarray(block_table)
    return tuple(torch.as_tensor(a, dtype=torch.int32, device="cuda")
                 for a in padded_to_csr(table, np.asarray(kv_lens), block_size))


def flashinfer_workspace():
    """A zeroed float workspace for one wrapper (FlashInfer asks for zeros on first use)."""
    import torch

    return torch.zeros(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")


# -- the device guard's cost (GPU) --------------------------------------------------------

def decode_without_guard(plans):
    """Give ``DecodePlan`` s that have not run yet the kernel of their launch
    built with ``guard=False`` (table ids and lengths taken as they are: only
    valid inputs); return None, or why not (the prefill tile of MQA and large
    groups, or the CUDA-core kernel: neither has that form)."""
    from paged_numba._decode_launch import _cache_launch

    for plan in plans:
        if plan._group is not None:
            return f"the prefill tile ({plan._group.kind}) runs this decode"
        if not plan.tensor_cores:
            return "the CUDA-core decode kernel runs this plan"
        if plan._inputs is not None:
            return "the plan has run (its launch is packed)"
        if _cache_launch(plan.cache, *plan._launch_args)[0] is not plan._kernel:
            return "the plan's kernel is not the one its launch arguments build"
        kernel, threads, _ = _cache_launch(plan.cache, *plan._launch_args, guard=False)
        assert threads == plan._threads and kernel is not plan._kernel
        plan._kernel = kernel
    return None


def prefill_without_guard(plan):
    """Give a ``PrefillPlan`` that has not run yet its tensor-core kernel built
    with ``guard=False`` (as the plan builds it: query dtype, fp8 cache,
    ``kernel_options``); return None, or why it cannot (the CUDA-core kernel
    has no such form)."""
    import numpy as np

    from paged_numba.fp8 import is_fp8
    from paged_numba.kernels import prefill_tc

    if not plan.tensor_cores:
        return "the CUDA-core prefill kernel runs this plan"
    if plan._inputs is not None:
        return "the plan has run (its launch is packed)"
    c = plan.cache
    args = (c.head_size, c.block_size, plan.heads_per_block, plan.block_n,
            np.dtype(plan.query_dtype).name, c.layout, plan.num_warps)
    options = dict(plan.kernel_options, **(dict(kv_dtype=c.dtype.name) if is_fp8(c.dtype)
                                           else {}))
    if prefill_tc.prefill_tc_kernel(*args, **options) is not plan._kernel:
        return "the plan's kernel is not the one its options build"
    plan._kernel = prefill_tc.prefill_tc_kernel(*args, **options, guard=False)
    return None


def guard_cost(us, noguard_us):
    """The guard's cost in percent, ``100 * (us / noguard_us - 1)``, as text."""
    return f"{100 * (us / noguard_us - 1):+.2f} %"
