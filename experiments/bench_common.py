"""What the benchmark scripts share: run ids, CSV output, an L2-flushing timer,
and FlashInfer as a peer.

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

def flushed_time(call, reps, warmup=3):
    """Median microseconds of ``call()`` over ``reps`` calls, each timed with CUDA
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
    return statistics.median(a.elapsed_time(b) * 1e3 for a, b in events)


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
