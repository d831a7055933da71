"""Prefill benchmark: paged_numba.PrefillPlan against torch SDPA and FlashInfer on the same data.

    python3 experiments/bench_prefill.py --check          # check against SDPA, then time
    python3 experiments/bench_prefill.py --cases causal-8x2048 --impls paged_numba torch_sdpa
    python3 experiments/bench_prefill.py --tuning         # time tilings of the prefill kernel
    python3 experiments/bench_prefill.py --guard-cost     # paged_numba with and without the guard
    python3 experiments/bench_prefill.py --plan-options \
        '{"num_warps": 8, "block_n": 64, "kernel_options": {"wgmma": true, "swizzle": true}}'
    python3 experiments/bench_prefill.py --selftest       # no GPU: FLOP formula, cases, CSR

Cases (``--grid headline``; fp16, 32 query / 8 KV heads, head size 128, block
size 16, random block tables unless the name says otherwise):

* ``causal-8x2048``, ``causal-2x8192``, ``causal-1x16384``: whole prompts
  (8 x 2048, 2 x 8192, 1 x 16384 tokens), nothing cached;
* ``chunked-mix``: 4 sequences each with a 512-token chunk after 1024-3072
  cached tokens, plus 64 decode tokens with 1024-4096 tokens of context;
* ``causal-8x2048-bf16``, ``chunked-mix-bf16``: the same in bfloat16;
* ``causal-8x2048-hs64``, ``causal-8x2048-hs256``: head size 64 and 256;
* ``causal-8x2048-bs1``, ``causal-8x2048-bs64``: block (page) size 1 and 64;
* ``causal-8x2048-e4m3``, ``chunked-mix-e4m3``: an E4M3 cache (``kv_dtype``;
  the pools hold fp16 normals rounded to E4M3, scales 1) with fp16 queries:
  FlashInfer reads the same fp8 pages (``kv_data_type`` float8), SDPA the
  codes' values in fp16.

Implementations (``--impls``; each row of the CSV is one implementation on one case):

* ``paged_numba``: ``PrefillPlan.run`` (tile list and launch packed once, as a
  serving engine would per step; ``impl_detail`` says which kernel ran,
  ``tensor_cores`` or ``cuda_cores``, and the options of ``--plan-options``,
  keyword arguments of ``PrefillPlan`` as JSON, that are true);
* ``torch_sdpa``: SDPA on the same tokens gathered into contiguous
  ``[batch, heads, seq, head_size]`` tensors (the gather is not timed): one
  batched call with ``is_causal`` when every sequence is a whole prompt of
  the same length (``impl_detail`` ``contiguous_batched``); else one call per
  chunk with a bottom-right causal mask plus one batched call for all decode
  tokens (K/V padded to the longest context, with a key mask), so its time
  includes a few launches (``contiguous_grouped``);
* ``flashinfer_fa2``, ``flashinfer_fa3``: FlashInfer's
  ``BatchPrefillWithPagedKVCacheWrapper`` (``"NHD"``, ``backend="fa2"`` /
  ``"fa3"``; fa3 needs sm90) reading the SAME paged pools, with the block
  table as CSR pages; ``plan()`` once, not timed, ``run()`` timed. Its
  causal mask is bottom-right aligned, as ours. A missing ``flashinfer`` or a
  backend that raises on a case is printed and its row skipped (fa3 over an
  fp8 cache with fp16/bf16 queries is skipped without trying: FlashInfer
  0.6.0 fails to build that kernel). Its output is
  always compared with SDPA's (a peer fed the wrong pages would time fine).
  FlashInfer compiles its kernels on first use (one module per backend,
  dtype and head size) into ``.cache/flashinfer`` below
  ``FLASHINFER_WORKSPACE_BASE`` (``$HOME`` by default);
* ``paged_numba_noguard`` (with ``--guard-cost`` and ``paged_numba``): the same
  plan on the same data with its tensor-core kernel built with ``guard=False``
  (``impl_detail`` says so); the two are timed in alternating rounds (four
  rounds of ``--reps / 4`` calls, the order reversed each round, so that the
  card's clock, which falls as it warms, weighs on both alike), and the
  outputs compared bit for bit. The ``paged_numba`` row's
  ``ratio_to_noguard`` minus 1 is the device guard's cost, printed in percent
  after each case. A plan on the CUDA-core kernel gets no such row (a printed
  note says why).

Method: each implementation is warmed up (3 calls), then ``--reps`` calls are
timed with CUDA events, each after a 256 MB write that evicts the L2 (outside
the events), as ``triton.testing.do_bench`` does; the calls are queued back
to back and the median is reported. ``ratio_to_sdpa``, ``ratio_to_fa2``,
``ratio_to_fa3`` and ``ratio_to_noguard`` are this row's time over the peer's
on the same case in the same run (blank when the peer did not run).

FLOPs: ``4 * head_size * num_heads * pairs``, where ``pairs`` counts the
admitted (query, key) pairs: a sequence with ``n`` queries over ``L`` keys
admits ``n * (L - n) + n * (n + 1) / 2`` causally (QK^T and PV, 2 FLOPs per
multiply-add each).
"""
import argparse
import json
import os
import sys
import traceback

import numpy as np

from bench_common import (alternating_times, flushed_time, gpu_state, guard_cost,
                          import_flashinfer, new_run_id, print_table, ratio, write_rows)
from prefill_problem import Problem, cu_seqlens, flashinfer_caller, numba_caller, sdpa_caller

FIELDS = ["run_id", "gpu", "impl", "impl_detail", "case", "dtype", "kv_dtype", "head_size",
          "block_size",
          "num_heads", "num_kv_heads", "batch", "q_tokens", "kv_tokens", "pairs", "us", "tflops",
          "ratio_to_sdpa", "ratio_to_fa2", "ratio_to_fa3", "ratio_to_noguard", "check_max_err",
          "tiling", "regs", "sm_mhz", "power_w", "command"]
IMPLS = ["paged_numba", "torch_sdpa", "flashinfer_fa2", "flashinfer_fa3"]
PEERS = {"ratio_to_sdpa": "torch_sdpa", "ratio_to_fa2": "flashinfer_fa2",
         "ratio_to_fa3": "flashinfer_fa3", "ratio_to_noguard": "paged_numba_noguard"}
MODEL = dict(num_heads=32, num_kv_heads=8, head_size=128, block_size=16, dtype="float16",
             kv_dtype="")     # kv_dtype: the cache's, when not dtype (fp8)
TOLERANCE = {"float16": 2e-2, "bfloat16": 6e-2, "float32": 1e-4}   # max |out - SDPA|


# -- problem definitions and the FLOP formula (no GPU needed) ---------------------------

def admitted_pairs(q_lens, kv_lens, causal=True):
    """(query, key) pairs attention computes: bottom-right causal, or all."""
    total = 0
    for n, kv in zip(q_lens, kv_lens):
        n, kv = int(n), int(kv)
        total += n * (kv - n) + n * (n + 1) // 2 if causal else n * kv
    return total


def flops(q_lens, kv_lens, num_heads, head_size, causal=True):
    """4 * head_size * num_heads * admitted pairs (QK^T and PV, 2 FLOPs per FMA each)."""
    return 4 * head_size * num_heads * admitted_pairs(q_lens, kv_lens, causal)


def cases(name):
    """``{case: spec}`` for a grid name; a spec is ``q_lens``, ``kv_lens`` and
    the shape keys of ``MODEL`` (its values unless the case changes one)."""
    def case(q_lens, kv_lens, **change):
        return dict(MODEL, q_lens=list(q_lens), kv_lens=list(kv_lens), **change)

    rng = np.random.default_rng(0)
    mix_cached = [1024, 2048, 3072, 1536]
    decode_ctx = rng.integers(1024, 4097, size=64).tolist()
    mix = ([512] * 4 + [1] * 64, [c + 512 for c in mix_cached] + decode_ctx)
    c8 = ([2048] * 8, [2048] * 8)
    if name == "headline":
        return {"causal-8x2048": case(*c8), "causal-2x8192": case([8192] * 2, [8192] * 2),
                "causal-1x16384": case([16384], [16384]), "chunked-mix": case(*mix),
                "causal-8x2048-bf16": case(*c8, dtype="bfloat16"),
                "chunked-mix-bf16": case(*mix, dtype="bfloat16"),
                "causal-8x2048-hs64": case(*c8, head_size=64),
                "causal-8x2048-hs256": case(*c8, head_size=256),
                "causal-8x2048-bs1": case(*c8, block_size=1),
                "causal-8x2048-bs64": case(*c8, block_size=64),
                "causal-8x2048-e4m3": case(*c8, kv_dtype="float8_e4m3fn"),
                "chunked-mix-e4m3": case(*mix, kv_dtype="float8_e4m3fn")}
    if name == "quick":
        small = ([128, 1, 1], [640, 300, 1000])
        return {"causal-2x512": case([512] * 2, [512] * 2), "chunked-mix-small": case(*small),
                "chunked-mix-small-bf16": case(*small, dtype="bfloat16")}
    raise SystemExit(f"unknown grid {name!r}")


def timed_impls(impls, guard_cost=False):
    """``impls`` in order, with ``paged_numba_noguard`` right after
    ``paged_numba`` when ``guard_cost`` (and ``paged_numba`` is there)."""
    out = []
    for impl in impls:
        out += [impl] + (["paged_numba_noguard"] if guard_cost and impl == "paged_numba" else [])
    return out


def selected_cases(args):
    """The grid's cases, only those named by ``--cases`` if given."""
    grid = cases(args.grid)
    unknown = sorted(set(args.cases or []) - set(grid))
    if unknown:
        raise SystemExit(f"no case {unknown} in grid {args.grid!r}; it has {list(grid)}")
    return {c: s for c, s in grid.items() if not args.cases or c in args.cases}


def selftest():
    """Checks of the parts that need no GPU."""
    from paged_numba.page_tables import padded_to_csr

    # brute force: count k <= p for p = kv - n + j
    for q_lens, kv_lens in [([3, 1, 5], [3, 9, 12]), ([1], [1]), ([7], [20])]:
        brute = sum(1 for n, kv in zip(q_lens, kv_lens) for j in range(n)
                    for k in range(kv) if k <= kv - n + j)
        assert admitted_pairs(q_lens, kv_lens) == brute, (q_lens, kv_lens)
        assert admitted_pairs(q_lens, kv_lens, causal=False) == sum(
            n * kv for n, kv in zip(q_lens, kv_lens))
    # 8 x 2048 causal at 32 heads, head 128: 4 * 128 * 32 * 8 * 2048 * 2049 / 2
    assert flops([2048] * 8, [2048] * 8, 32, 128) == 4 * 128 * 32 * 8 * 2048 * 2049 // 2
    grid = cases("headline")
    fl = {c: flops(s["q_lens"], s["kv_lens"], s["num_heads"], s["head_size"])
          for c, s in grid.items()}
    base = fl["causal-8x2048"]
    assert fl["causal-1x16384"] == 4 * 128 * 32 * 16384 * 16385 // 2      # 2.2 TFLOP
    assert fl["causal-2x8192"] == 4 * 128 * 32 * 2 * 8192 * 8193 // 2
    assert fl["causal-8x2048-hs64"] * 2 == base == fl["causal-8x2048-hs256"] // 2
    for c in ("bf16", "bs1", "bs64", "e4m3"):
        assert fl[f"causal-8x2048-{c}"] == base
    assert fl["chunked-mix-bf16"] == fl["chunked-mix"] == fl["chunked-mix-e4m3"]
    expect = {"causal-8x2048-bf16": ("dtype", "bfloat16"), "causal-8x2048-hs64": ("head_size", 64),
              "causal-8x2048-hs256": ("head_size", 256), "causal-8x2048-bs1": ("block_size", 1),
              "causal-8x2048-bs64": ("block_size", 64), "chunked-mix-bf16": ("dtype", "bfloat16"),
              "causal-8x2048-e4m3": ("kv_dtype", "float8_e4m3fn"),
              "chunked-mix-e4m3": ("kv_dtype", "float8_e4m3fn")}
    for c, s in grid.items():
        q, kv = s["q_lens"], s["kv_lens"]
        assert len(q) == len(kv) and all(1 <= a <= b for a, b in zip(q, kv)), c
        key, value = expect.get(c, ("dtype", "float16"))
        assert s[key] == value and all(s[k] == v for k, v in MODEL.items() if k != key), c
        # FlashInfer's pages of a table numbered in order: it recovers each length as
        # (pages - 1) * block_size + last_page_len
        bs = s["block_size"]
        used = [-(-n // bs) for n in kv]
        table = np.full((len(kv), max(used)), -1, np.int32)
        for i, u in enumerate(used):
            table[i, :u] = np.arange(sum(used[:i]), sum(used[:i + 1]))
        indptr, indices, last = padded_to_csr(table, kv, bs)
        assert ((np.diff(indptr) - 1) * bs + last).tolist() == kv, c
        assert indices.tolist() == list(range(sum(used))), c
    q, kv = grid["chunked-mix"]["q_lens"], grid["chunked-mix"]["kv_lens"]
    assert len(q) == len(kv) == 68 and sum(q) == 4 * 512 + 64
    # the CSR FlashInfer gets, on a hand-built table with block size 16: lengths 20, 16
    # and 33 use ceil(20/16) = 2, 1 and ceil(33/16) = 3 pages, so indptr = [0, 2, 3, 6];
    # last pages hold 20 - 16 = 4, 16 and 33 - 2 * 16 = 1 tokens; padding (-1) is dropped
    table = np.array([[5, 2, -1], [0, -1, -1], [7, 1, 3]], np.int32)
    indptr, indices, last = padded_to_csr(table, [20, 16, 33], 16)
    assert indptr.tolist() == [0, 2, 3, 6] and indices.tolist() == [5, 2, 0, 7, 1, 3]
    assert last.tolist() == [4, 16, 1]
    assert cu_seqlens([3, 1, 5]).tolist() == [0, 3, 4, 9]                   # qo_indptr
    args = parse_args(["--check", "--reps", "5", "--grid", "quick"])
    assert args.check and args.reps == 5 and args.grid == "quick" and args.impls == IMPLS
    args = parse_args(["--cases", "causal-8x2048", "causal-8x2048-bs1", "--impls", "paged_numba",
                       "torch_sdpa"])
    assert list(selected_cases(args)) == ["causal-8x2048", "causal-8x2048-bs1"]
    assert args.impls == ["paged_numba", "torch_sdpa"] and not args.guard_cost
    args = parse_args(["--guard-cost", "--impls", "torch_sdpa", "paged_numba"])
    assert args.guard_cost and timed_impls(args.impls, args.guard_cost) == [
        "torch_sdpa", "paged_numba", "paged_numba_noguard"]
    assert timed_impls(["torch_sdpa"], True) == timed_impls(["torch_sdpa"]) == ["torch_sdpa"]
    assert timed_impls(IMPLS) == IMPLS and PEERS["ratio_to_noguard"] == "paged_numba_noguard"
    assert all(col in FIELDS for col in PEERS)
    print("selftest ok:", {c: f"{f / 1e9:.1f} GFLOP" for c, f in fl.items()})


def bench_case(case, spec, args, impls=IMPLS, tiling=None, fi=None):
    """Rows (dicts) of the implementations ``impls`` on one case (and
    ``paged_numba_noguard`` with ``args.guard_cost``); the ratio columns are
    filled in by the caller."""
    shape = {k: spec[k] for k in MODEL}
    q_lens, kv_lens = spec["q_lens"], spec["kv_lens"]
    prob = Problem(q_lens, kv_lens, **shape)
    fl = flops(q_lens, kv_lens, spec["num_heads"], spec["head_size"])
    common = dict(case=case, batch=len(q_lens), q_tokens=sum(q_lens), kv_tokens=sum(kv_lens),
                  pairs=admitted_pairs(q_lens, kv_lens), **shape)
    tiling = tiling or getattr(args, "plan_options", None)
    impls = timed_impls(impls, getattr(args, "guard_cost", False))
    callers = {"paged_numba": lambda: numba_caller(prob, tiling),
               "paged_numba_noguard": lambda: numba_caller(prob, tiling, guard=False),
               "torch_sdpa": lambda: sdpa_caller(prob),
               "flashinfer_fa2": lambda: flashinfer_caller(fi, prob, "fa2"),
               "flashinfer_fa3": lambda: flashinfer_caller(fi, prob, "fa3")}
    peers = [i for i in impls if i.startswith("flashinfer") and fi is not None]
    wanted = [i for i in impls if not i.startswith("flashinfer")] + peers
    if (args.check or peers) and "torch_sdpa" not in wanted:
        wanted.insert(0, "torch_sdpa")      # the reference of the checks; timed only if asked
    got = {}
    for impl in wanted:
        try:
            got[impl] = callers[impl]()
        except Exception as e:  # noqa: BLE001 - skip this implementation, keep the others
            print(f"{impl} on {case}: skipped ({type(e).__name__}: {e})", flush=True)
            if impl == "paged_numba":
                traceback.print_exc()
    if "paged_numba" in got and "paged_numba_noguard" in got:   # valid inputs: the same bits
        import torch

        run, output, detail, extra = got["paged_numba_noguard"]
        same = torch.equal(*(got[i][1]().view(torch.uint8)
                             for i in ("paged_numba", "paged_numba_noguard")))
        print(f"check {case}: paged_numba_noguard bit-identical to paged_numba: "
              f"{'yes' if same else 'NO'}", flush=True)
        got["paged_numba_noguard"] = (run, output, detail + ("" if same else " OUTPUT DIFFERS"),
                                      extra)
    ref = None
    if "torch_sdpa" in got and (args.check or peers):
        ref = got["torch_sdpa"][1]().float()
    paired = {}
    pair = ("paged_numba", "paged_numba_noguard")
    if all(i in got for i in pair):
        try:
            times = alternating_times([got[i][0] for i in pair], args.reps)
            state = gpu_state()
            paired = {i: (us, state) for i, us in zip(pair, times)}
        except Exception:  # noqa: BLE001 - time them one after the other below
            traceback.print_exc()
    rows = []
    for impl in [i for i in impls if i in got]:
        run, output, detail, extra = got[impl]
        err = ""
        if ref is not None and impl != "torch_sdpa" and (args.check or impl in peers):
            try:
                err = float((output().float() - ref).abs().max())
                ok = err < TOLERANCE[spec["dtype"]]
                print(f"check {case}: max |{impl} - SDPA| = {err:.3g} {'ok' if ok else 'FAILED'}",
                      flush=True)
            except Exception:  # noqa: BLE001 - still time it
                traceback.print_exc()
        try:
            if impl in paired:
                us, state = paired[impl]
            else:
                us = flushed_time(run, args.reps)
                state = gpu_state()     # the clock and power the loop ended at
        except Exception:  # noqa: BLE001 - keep the other implementations' rows
            traceback.print_exc()
            continue
        rows.append(dict(common, impl=impl, impl_detail=detail, us=us, tflops=fl / us / 1e6,
                         check_max_err=err, **state, **{"tiling": "", "regs": "", **extra}))
    return rows


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grid", default="headline", choices=["headline", "quick"])
    ap.add_argument("--cases", nargs="+", metavar="NAME", help="only these cases of the grid")
    ap.add_argument("--impls", nargs="+", default=IMPLS, choices=IMPLS, metavar="IMPL",
                    help=f"only these implementations (of {' '.join(IMPLS)})")
    ap.add_argument("--out", default="results/prefill_h200.csv",
                    help="CSV to write (rows of its earlier runs are kept)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--plan-options", type=json.loads, default=None, metavar="JSON",
                    help="keyword arguments of PrefillPlan for paged_numba (a tiling, "
                         "kernel_options), e.g. '{\"kernel_options\": {\"wgmma\": true}}'")
    ap.add_argument("--check", action="store_true",
                    help="compare each implementation's output with torch SDPA before timing "
                         "(FlashInfer's is compared always)")
    ap.add_argument("--tuning", action="store_true",
                    help="time tilings (block_q, block_n, num_warps) on the cases, print only")
    ap.add_argument("--guard-cost", action="store_true",
                    help="with paged_numba: also time it without the device guard "
                         "(paged_numba_noguard rows)")
    ap.add_argument("--selftest", action="store_true",
                    help="check the FLOP formula, the cases and the CSR pages; no GPU")
    return ap.parse_args(argv)


TILINGS = [dict(block_q=8, block_n=32, num_warps=4), dict(block_q=8, block_n=32, num_warps=2),
           dict(block_q=8, block_n=16, num_warps=4), dict(block_q=16, block_n=16, num_warps=4),
           dict(block_q=4, block_n=32, num_warps=4), dict(block_q=8, block_n=32, num_warps=8)]


def main():
    args = parse_args()
    if args.selftest:
        selftest()
        return
    os.environ.setdefault("NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS", "0")
    import torch

    gpu = torch.cuda.get_device_name()
    run_id = new_run_id()
    command = "python3 experiments/bench_prefill.py " + " ".join(sys.argv[1:])
    print(f"{gpu}: run {run_id}", flush=True)
    todo = selected_cases(args)
    if args.tuning:
        import inspect

        import paged_numba as pn

        # these are CUDA-core tilings: ask for that kernel where there is a choice
        cc = ({"tensor_cores": False}
              if "tensor_cores" in inspect.signature(pn.PrefillPlan).parameters else {})
        for case, spec in todo.items():
            for tiling in [dict(t, **cc) for t in TILINGS]:
                for r in bench_case(case, spec, args, impls=["paged_numba"], tiling=tiling):
                    print(f"{case:>20} {r['tiling']:<40} {r['us']:10.1f} us "
                          f"{r['tflops']:6.2f} TFLOP/s regs={r['regs']}", flush=True)
        return
    fi = import_flashinfer() if any(i.startswith("flashinfer") for i in args.impls) else None
    rows = []
    for case, spec in todo.items():
        try:
            got = bench_case(case, spec, args, impls=args.impls, fi=fi)
        except Exception:  # noqa: BLE001 - keep the other cases' rows
            traceback.print_exc()
            continue
        finally:
            torch.cuda.empty_cache()        # the case's pools and copies are gone
        times = {r["impl"]: r["us"] for r in got}
        for r in got:
            r.update(run_id=run_id, gpu=gpu, command=command,
                     **{col: ratio(r["us"], times.get(peer)) for col, peer in PEERS.items()})
            sdpa = r["ratio_to_sdpa"]
            print(f"{r['impl']:>15} {case:>20} {r['us']:10.1f} us {r['tflops']:7.2f} TFLOP/s "
                  f"x{'-' if sdpa == '' else round(sdpa, 2)} SDPA  {r['impl_detail']} "
                  f"{r['tiling']} regs={r['regs']}", flush=True)
        if "paged_numba" in times and "paged_numba_noguard" in times:
            print(f"guard cost {case}: "
                  f"{guard_cost(times['paged_numba'], times['paged_numba_noguard'])}", flush=True)
        rows += got
        # after each case (a run cut short keeps them), after the file's earlier runs
        write_rows(args.out, FIELDS, rows, 3, keep_runs=True)
    if rows:
        print_table(rows, ["case", "impl", "us", "tflops", "ratio_to_sdpa", "ratio_to_fa2",
                           "ratio_to_fa3", "check_max_err"])


if __name__ == "__main__":
    main()
