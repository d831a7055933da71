"""Prefill benchmark: paged_numba.PrefillPlan against torch SDPA on the same K/V made contiguous.

    python3 experiments/bench_prefill.py --check          # check against SDPA, then time
    python3 experiments/bench_prefill.py --tuning         # time tilings of the prefill kernel
    python3 experiments/bench_prefill.py --selftest       # no GPU: FLOP formula and arguments

Cases (fp16, 32 query / 8 KV heads, head size 128, block size 16, random
block tables):

* ``causal-8x2048``: 8 prompts of 2048 tokens, nothing cached;
* ``chunked-mix``: 4 sequences each with a 512-token chunk after 1024-3072
  cached tokens, plus 64 decode tokens with 1024-4096 tokens of context.

Method: each implementation is warmed up, then each call is timed with CUDA
events; the median over ``--reps`` calls is reported. paged_numba runs
``PrefillPlan.run`` (tile list and launch packed once, as a serving engine
would per step). SDPA gets the same tokens gathered into contiguous
``[batch, heads, seq, head_size]`` tensors (the gather is not timed): one
batched call with ``is_causal`` when every sequence is a whole prompt of the
same length; else one call per chunk with a bottom-right causal mask plus one
batched call for all decode tokens (K/V padded to the longest context, with a
key mask), so its time includes a few launches.

FLOPs: ``4 * head_size * num_heads * pairs``, where ``pairs`` counts the
admitted (query, key) pairs: a sequence with ``n`` queries over ``L`` keys
admits ``n * (L - n) + n * (n + 1) / 2`` causally (QK^T and PV, 2 FLOPs per
multiply-add each).
"""
import argparse
import os
import statistics
import sys
import traceback

import numpy as np

from bench_common import new_run_id, write_rows

FIELDS = ["run_id", "gpu", "impl", "case", "batch", "q_tokens", "kv_tokens", "pairs", "num_heads",
          "num_kv_heads", "head_size", "block_size", "dtype", "us", "tflops", "ratio_to_sdpa",
          "check_max_err", "tiling", "regs", "command"]


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
    """``{case: (q_lens, kv_lens)}`` for a grid name."""
    rng = np.random.default_rng(0)
    mix_cached = [1024, 2048, 3072, 1536]
    decode_ctx = rng.integers(1024, 4097, size=64).tolist()
    mix = ([512] * 4 + [1] * 64, [c + 512 for c in mix_cached] + decode_ctx)
    if name == "headline":
        return {"causal-8x2048": ([2048] * 8, [2048] * 8), "chunked-mix": mix}
    if name == "quick":
        return {"causal-2x512": ([512] * 2, [512] * 2),
                "chunked-mix-small": ([128, 1, 1], [640, 300, 1000])}
    raise SystemExit(f"unknown grid {name!r}")


def selftest():
    """Checks of the parts that need no GPU."""
    # brute force: count k <= p for p = kv - n + j
    for q_lens, kv_lens in [([3, 1, 5], [3, 9, 12]), ([1], [1]), ([7], [20])]:
        brute = sum(1 for n, kv in zip(q_lens, kv_lens) for j in range(n)
                    for k in range(kv) if k <= kv - n + j)
        assert admitted_pairs(q_lens, kv_lens) == brute, (q_lens, kv_lens)
        assert admitted_pairs(q_lens, kv_lens, causal=False) == sum(
            n * kv for n, kv in zip(q_lens, kv_lens))
    # 8 x 2048 causal at 32 heads, head 128: 4 * 128 * 32 * 8 * 2048 * 2049 / 2
    assert flops([2048] * 8, [2048] * 8, 32, 128) == 4 * 128 * 32 * 8 * 2048 * 2049 // 2
    q, kv = cases("headline")["chunked-mix"]
    assert len(q) == len(kv) == 68 and sum(q) == 4 * 512 + 64 and all(a <= b for a, b in zip(q, kv))
    args = parse_args(["--check", "--reps", "5", "--grid", "quick"])
    assert args.check and args.reps == 5 and args.grid == "quick"
    print("selftest ok:", {c: f"{flops(*ql, 32, 128) / 1e9:.1f} GFLOP"
                           for c, ql in cases("headline").items()})


# -- timing (GPU) -------------------------------------------------------------------------

def event_time(call, reps, warmup=3):
    """Median microseconds of ``call()`` over ``reps`` calls, each timed with CUDA events."""
    import torch

    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        call()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def kernel_regs(plan):
    try:
        return ";".join(str(getattr(k, "regs_per_thread", ""))
                        for k in plan._kernel.overloads.values())
    except Exception:  # noqa: BLE001 - informational column only
        return ""


class Problem:
    """A paged cache holding the batch's K/V, the queries, and the same tokens contiguous."""

    def __init__(self, q_lens, kv_lens, num_heads, num_kv_heads, head_size, block_size, dtype,
                 seed=0):
        import torch
        from numba import cuda

        import paged_numba as pn

        self.q_lens, self.kv_lens = list(q_lens), list(kv_lens)
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.block_size, self.dtype = block_size, dtype
        tdtype = getattr(torch, dtype)
        gen = torch.Generator(device="cuda").manual_seed(seed)
        used = [-(-kv // block_size) for kv in kv_lens]
        num_blocks = sum(used)
        self.cache = pn.PagedKVCache(num_blocks, block_size, num_kv_heads, head_size, dtype, "nhd")
        self.k_pool = torch.as_tensor(self.cache.key_cache, device="cuda")
        self.v_pool = torch.as_tensor(self.cache.value_cache, device="cuda")
        self.k_pool.normal_(generator=gen)
        self.v_pool.normal_(generator=gen)
        perm = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32)
        table = torch.full((len(kv_lens), max(used)), -1, dtype=torch.int32, device="cuda")
        pos = 0
        for i, u in enumerate(used):
            table[i, :u] = perm[pos:pos + u]
            pos += u
        self.table_t = table
        self.table = cuda.as_cuda_array(table)
        self.cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        self.total_q = int(self.cu[-1])
        self.query_t = torch.randn(self.total_q, num_heads, head_size, dtype=tdtype,
                                   device="cuda", generator=gen)
        self.query = cuda.as_cuda_array(self.query_t)

    def contiguous(self, i):
        """``(q [1, H, n, D], k, v [1, Hkv, L, D])`` of sequence ``i``, gathered."""
        a, b, kv = int(self.cu[i]), int(self.cu[i + 1]), self.kv_lens[i]
        used = -(-kv // self.block_size)
        blocks = self.table_t[i, :used].long()
        k = self.k_pool[blocks].reshape(-1, self.num_kv_heads, self.head_size)[:kv]
        v = self.v_pool[blocks].reshape(-1, self.num_kv_heads, self.head_size)[:kv]
        q = self.query_t[a:b]
        return (q.transpose(0, 1).unsqueeze(0).contiguous(),
                k.transpose(0, 1).unsqueeze(0).contiguous(),
                v.transpose(0, 1).unsqueeze(0).contiguous())


def bias_lower_right(n, kv):
    """Bottom-right causal mask: query ``j`` of ``n`` sees keys ``<= kv - n + j``."""
    from torch.nn.attention.bias import causal_lower_right

    return causal_lower_right(n, kv)


def sdpa_caller(prob):
    """A function running SDPA over the whole batch, and one returning its output
    ``[total_q, H, D]`` (for --check)."""
    import torch
    import torch.nn.functional as F

    same = (len(set(prob.q_lens)) == 1 and prob.q_lens == prob.kv_lens)
    if same:
        parts = [prob.contiguous(i) for i in range(len(prob.q_lens))]
        q = torch.cat([p[0] for p in parts])
        k = torch.cat([p[1] for p in parts])
        v = torch.cat([p[2] for p in parts])
        del parts

        def run():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        def output():
            return run().permute(0, 2, 1, 3).reshape(prob.total_q, prob.num_heads, -1)
        return run, output, "torch_sdpa_contiguous_batched"

    # decode tokens (q_len 1 sees every key): one batched call, K/V padded to the
    # longest context with a key mask; chunks: one call each, bottom-right causal
    items, dec = [], [i for i, n in enumerate(prob.q_lens) if n == 1]
    for i, (n, kv) in enumerate(zip(prob.q_lens, prob.kv_lens)):
        if n == 1:
            continue
        q, k, v = prob.contiguous(i)
        items.append((i, q, k, v, None if n == kv else bias_lower_right(n, kv), n == kv))
    if dec:
        longest = max(prob.kv_lens[i] for i in dec)
        dq, dk, dv = [], [], []
        mask = torch.zeros(len(dec), 1, 1, longest, dtype=torch.bool, device="cuda")
        for j, i in enumerate(dec):
            q, k, v = prob.contiguous(i)
            dq.append(q)
            dk.append(F.pad(k, (0, 0, 0, longest - k.shape[2])))
            dv.append(F.pad(v, (0, 0, 0, longest - v.shape[2])))
            mask[j, ..., :prob.kv_lens[i]] = True
        items.append((dec, torch.cat(dq), torch.cat(dk), torch.cat(dv), mask, False))

    def call(q, k, v, m, c):
        if gqa[0]:
            try:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=c,
                                                      enable_gqa=True)
            except Exception:  # noqa: BLE001 - e.g. a mask type without GQA support
                gqa[0] = False
        g = q.shape[1] // k.shape[1]
        if m is not None and not isinstance(m, torch.Tensor):    # CausalBias -> bool mask
            n, kv = q.shape[2], k.shape[2]
            m = torch.ones(n, kv, dtype=torch.bool, device=q.device).tril(kv - n)
        return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1),
                                              v.repeat_interleave(g, 1), attn_mask=m, is_causal=c)

    gqa = [True]

    def run():
        return [call(q, k, v, m, c) for _, q, k, v, m, c in items]

    def output():
        out = torch.empty(prob.total_q, prob.num_heads, prob.head_size, dtype=prob.query_t.dtype,
                          device="cuda")
        for (idx, *_), o in zip(items, run()):
            rows = [int(prob.cu[i]) for i in idx] if isinstance(idx, list) else None
            if rows is None:
                out[int(prob.cu[idx]):int(prob.cu[idx + 1])] = o[0].transpose(0, 1)
            else:
                out[rows] = o[:, :, 0]
        return out
    run()                                   # settle the GQA fallback before timing
    return run, output, "torch_sdpa_contiguous_grouped"


def bench_case(case, q_lens, kv_lens, args, num_heads=32, num_kv_heads=8, head_size=128,
               block_size=16, dtype="float16", tiling=None, sdpa=True):
    import torch

    import paged_numba as pn

    prob = Problem(q_lens, kv_lens, num_heads, num_kv_heads, head_size, block_size, dtype)
    plan = pn.PrefillPlan(prob.cache, prob.cu, np.asarray(kv_lens, np.int32), num_heads,
                          causal=True, **(tiling or {}))
    stream = torch.cuda.current_stream()
    plan.run(prob.query, prob.table, stream=stream, validate=True)
    torch.cuda.synchronize()
    fl = flops(q_lens, kv_lens, num_heads, head_size)
    common = dict(case=case, batch=len(q_lens), q_tokens=sum(q_lens), kv_tokens=sum(kv_lens),
                  pairs=admitted_pairs(q_lens, kv_lens), num_heads=num_heads,
                  num_kv_heads=num_kv_heads, head_size=head_size, block_size=block_size,
                  dtype=dtype)
    rows = []
    err = ""
    sdpa_run = None
    if sdpa or args.check:
        try:
            sdpa_run, sdpa_out, sdpa_name = sdpa_caller(prob)
        except Exception:  # noqa: BLE001 - keep the paged_numba numbers
            traceback.print_exc()
    if args.check and sdpa_run is not None:
        try:
            ours = torch.as_tensor(plan.run(prob.query, prob.table, stream=stream), device="cuda")
            ref = sdpa_out()
            torch.cuda.synchronize()
            err = float((ours.float() - ref.float()).abs().max())
            ok = err < 2e-2 if dtype != "float32" else err < 1e-4
            print(f"check {case}: max |paged_numba - SDPA| = {err:.3g} "
                  f"{'ok' if ok else 'FAILED'}", flush=True)
        except Exception:  # noqa: BLE001 - still time it
            traceback.print_exc()
    us = event_time(lambda: plan.run(prob.query, prob.table, stream=stream), args.reps)
    tiling_s = (f"hpb={plan.heads_per_block} bq={plan.block_q} bn={plan.block_n} "
                f"warps={plan.num_warps} tiles={plan.num_tiles}")
    rows.append(dict(common, impl="paged_numba", us=us, tflops=fl / us / 1e6,
                     check_max_err=err, tiling=tiling_s, regs=kernel_regs(plan)))
    if sdpa and sdpa_run is not None:
        try:
            us_s = event_time(sdpa_run, args.reps)
            rows.append(dict(common, impl=sdpa_name, us=us_s, tflops=fl / us_s / 1e6,
                             check_max_err="", tiling="", regs=""))
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    torch.cuda.empty_cache()
    return rows


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grid", default="headline", choices=["headline", "quick"])
    ap.add_argument("--out", default="results/prefill_h200.csv")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--check", action="store_true",
                    help="compare each case's output with torch SDPA before timing")
    ap.add_argument("--tuning", action="store_true",
                    help="time tilings (block_q, block_n, num_warps) on the cases, print only")
    ap.add_argument("--selftest", action="store_true", help="check the FLOP formula; no GPU")
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
    if args.tuning:
        for case, (q_lens, kv_lens) in cases(args.grid).items():
            for tiling in TILINGS:
                try:
                    r = bench_case(case, q_lens, kv_lens, args, tiling=tiling, sdpa=False)[0]
                    print(f"{case:>20} {r['tiling']:<40} {r['us']:10.1f} us "
                          f"{r['tflops']:6.2f} TFLOP/s regs={r['regs']}", flush=True)
                except Exception:  # noqa: BLE001 - try the next tiling
                    traceback.print_exc()
        return
    rows = []
    for case, (q_lens, kv_lens) in cases(args.grid).items():
        try:
            got = bench_case(case, q_lens, kv_lens, args)
        except Exception:  # noqa: BLE001 - keep the other cases' rows
            traceback.print_exc()
            continue
        sdpa = [r["us"] for r in got if r["impl"].startswith("torch_sdpa")]
        for r in got:
            r.update(run_id=run_id, gpu=gpu, command=command,
                     ratio_to_sdpa=r["us"] / sdpa[0] if sdpa else "")
            ratio = r["ratio_to_sdpa"]
            print(f"{r['impl']:>32} {case:>18} q={r['q_tokens']:<6} kv={r['kv_tokens']:<7} "
                  f"{r['us']:10.1f} us {r['tflops']:7.2f} TFLOP/s "
                  f"x{ratio if ratio == '' else round(ratio, 2)} SDPA  {r['tiling']} "
                  f"regs={r['regs']}", flush=True)
        rows += got
    write_rows(args.out, FIELDS, rows, 3)


if __name__ == "__main__":
    main()
