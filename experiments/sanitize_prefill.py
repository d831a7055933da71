"""Run the tensor-core prefill kernel on small mixed batches, for compute-sanitizer.

    compute-sanitizer --tool memcheck python3 experiments/sanitize_prefill.py
    compute-sanitizer --tool racecheck python3 experiments/sanitize_prefill.py
    compute-sanitizer --tool memcheck python3 experiments/sanitize_prefill.py --only float8
    compute-sanitizer --tool racecheck python3 experiments/sanitize_prefill.py \
        --only float16 --variant w8n64-fx-wg-ws-sw-pp-ps-mb

`--only TEXT` keeps the cases whose cache dtype contains TEXT (the fp8 cases
compile slowly under the sanitizer, so they can run on their own).
`--variant NAME` runs every case with that tiling (a name as
``tune_prefill.py`` takes it) instead of the plan's default.

Each case is a batch with a whole prompt, a chunk after cached tokens and a
decode token, in its own pool sized to exactly the blocks the tables use (so
a read past a pool's end is an out-of-bounds access), checked against the
float64 reference with the tensor-core error bound. Prints one line a case.
"""
import argparse

import numpy as np

import paged_numba as pn
from variants import parse_variant
from paged_numba import fp8 as F
from paged_numba.testing import PrefillProblem, check_attention, prefill_reference

CASES = [  # (head_size, block_size, layout, dtype, group, causal, sliding_window)
    (128, 16, "nhd", "float16", 4, True, None),
    (128, 16, "vllm", "bfloat16", 4, True, None),
    (64, 1, "hnd", "float16", 8, True, 37),
    (256, 16, "interleaved", "bfloat16", 1, False, None),
    (128, 64, "nhd", "float16", 2, True, None),
    # fp8 caches (fp16 / bf16 queries): the producer kernel's staging ring on sm_90
    (128, 16, "nhd", "float8_e4m3fn", 4, True, None),
    (64, 16, "interleaved", "float8_e5m2", 8, False, 37),
]
QUERY = {"float8_e4m3fn": "float16", "float8_e5m2": "bfloat16"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="keep cases whose cache dtype contains this")
    parser.add_argument("--variant", default=None, help="a tune_prefill.py variant name")
    args = parser.parse_args()
    only, tiling = args.only, {}
    if args.variant:
        nw, bn, options, hpb, parts = parse_variant(args.variant)
        tiling = dict(num_warps=nw, block_n=bn, kernel_options=options, heads_per_block=hpb,
                      num_parts=parts)
    rng = np.random.default_rng(0)
    q_lens = [150, 70, 1]
    seq_lens = [150, 230, 97]
    for hs, bs, layout, dtype, group, causal, window in CASES:
        if only not in dtype:
            continue
        used = [-(-n // bs) for n in seq_lens]
        perm = rng.permutation(sum(used)).astype(np.int32)
        table = np.full((len(used), max(used)), -1, np.int32)
        start = 0
        for i, u in enumerate(used):
            table[i, :u] = perm[start:start + u]
            start += u
        p = PrefillProblem(num_seqs=3, num_heads=2 * group, num_kv_heads=2, head_size=hs,
                           block_size=bs, num_blocks=sum(used), layout=layout, dtype=dtype,
                           q_lens=np.asarray(q_lens, np.int32),
                           seq_lens=np.asarray(seq_lens, np.int32), block_tables=table, seed=1,
                           query_dtype=QUERY.get(dtype), per_head_scales=dtype in QUERY)
        q, k, v = p.arrays()
        kc, vc = p.layout_pools(k, v)
        scales = {}
        if dtype in QUERY:          # fp8: the reference takes the codes' values
            ks, vs = p.scales()
            scales = dict(k_scale=ks, v_scale=vs)
            k, v = F.dequantize(k, ks), F.dequantize(v, vs)
        cache = pn.PagedKVCache.from_host(kc, vc, layout, **scales)
        try:            # (the plan refuses a tiling it cannot run before any launch)
            out, lse = pn.paged_prefill(q, cache, table, p.cu_seqlens_q, p.seq_lens,
                                        causal=causal, sliding_window=window, return_lse=True,
                                        tensor_cores=True, **tiling)
        except ValueError as e:
            if not tiling:
                raise
            print(f"skip hs={hs} bs={bs} {layout} {dtype}: {e}", flush=True)
            continue
        check_attention(q, out, lse, *prefill_reference(p, q, k, v, causal=causal,
                                                        sliding_window=window,
                                                        tensor_cores=QUERY.get(dtype, dtype)))
        print(f"ok hs={hs} bs={bs} {layout} {dtype} group={group} causal={causal} "
              f"window={window} variant={args.variant or 'default'}", flush=True)


if __name__ == "__main__":
    main()
