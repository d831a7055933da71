"""Demo: a paged cache, three sequences, one decode step, checked against the reference.

    python experiments/demo.py

Runs on a GPU when there is one, otherwise on Numba's CUDA simulator (small
shapes there). On a GPU it also times the decode kernel with CUDA events.
"""
import time

import numpy as np

import paged_numba as pn
from paged_numba.reference import paged_decode_reference

SIM = pn.simulator_enabled()
BLOCK_SIZE, NUM_KV_HEADS, NUM_HEADS = 16, 2, 8
HEAD_SIZE = 64 if SIM else 128
PROMPTS = [60, 17, 33] if SIM else [1500, 3000, 700]


def main():
    rng = np.random.default_rng(0)
    num_blocks = 2 * sum(-(-(n + 1) // BLOCK_SIZE) for n in PROMPTS)
    cache = pn.PagedKVCache(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, "float16")
    alloc = pn.BlockAllocator(num_blocks, BLOCK_SIZE)
    # scatter the free list so that sequences get non-contiguous blocks
    alloc.free_block_ids.rotate(num_blocks // 3)

    def kv(n):
        return (rng.standard_normal((n, NUM_KV_HEADS, HEAD_SIZE)).astype(np.float16) for _ in "kv")

    # prefill: all prompts' tokens in one write_kv launch
    slots = []
    for i, n in enumerate(PROMPTS):
        alloc.allocate(i, n)
        slots.append(alloc.slot_mapping(i, 0, n))
    k, v = kv(sum(PROMPTS))
    pn.write_kv(cache, k, v, np.concatenate(slots))
    # decode step: one new token per sequence, then attention for its query
    slots = np.concatenate([alloc.append_slots(i, 1) for i in range(len(PROMPTS))])
    k, v = kv(len(PROMPTS))
    pn.write_kv(cache, k, v, slots)
    tables, seq_lens = alloc.block_table(), alloc.seq_lens()
    print(cache)
    print(alloc)
    print("block table:\n", tables)

    q = rng.standard_normal((len(PROMPTS), NUM_HEADS, HEAD_SIZE)).astype(np.float16)
    start = time.perf_counter()
    out = pn.paged_decode(q, cache, tables, seq_lens)
    elapsed = time.perf_counter() - start
    key_cache, value_cache = cache.to_host()
    ref, _ = paged_decode_reference(q, key_cache, value_cache, tables, seq_lens)
    err = np.abs(out.astype(np.float64) - ref).max()
    print(f"paged_decode on {'the CUDA simulator' if SIM else 'the GPU'}: out {out.shape} "
          f"{out.dtype}, max |out - float64 reference| = {err:.2e} "
          f"(fp16 output spacing near 1 is {np.spacing(np.float16(1)):.1e})")
    if SIM:
        print(f"simulated in {elapsed:.1f} s")
    else:
        time_on_gpu(q, cache, tables, seq_lens)
    assert err < 4 * float(np.spacing(np.float16(max(1.0, np.abs(ref).max())))), err


def time_on_gpu(q, cache, tables, seq_lens, reps=50):
    from numba import cuda

    dq, dt, dl = (cuda.to_device(a) for a in (q, tables, seq_lens))
    for _ in range(3):
        pn.paged_decode(dq, cache, dt, dl, validate=False)
    times = []
    for _ in range(reps):
        a, b = cuda.event(), cuda.event()
        a.record()
        pn.paged_decode(dq, cache, dt, dl, validate=False)
        b.record()
        b.synchronize()
        times.append(cuda.event_elapsed_time(a, b) * 1e3)
    kv_bytes = 2 * int(seq_lens.sum()) * cache.num_kv_heads * cache.head_size * 2
    us = float(np.median(times))
    print(f"decode time (median of {reps}, CUDA events, includes host launch): {us:.1f} us, "
          f"{kv_bytes / us / 1e3:.1f} GB/s of K/V")


if __name__ == "__main__":
    main()
