"""What the cross-proxy fence waits for: clock cycles of one
``fence.proxy.async.shared::cta`` (what the producer kernel executes before
publishing a tile, and each consumer warpgroup after its query copies) with
different memory operations of the same thread still in flight. GPU only.

    python3 experiments/fence_probe.py

Each case runs one block of 128 threads (a warpgroup) that first issues some
memory operations, then reads ``%clock64``, executes the fence (or nothing,
``none``), reads ``%clock64`` again, and only then waits for what it issued.
The sources are far apart in a 1 GB array, so every copy misses the caches
and takes a DRAM round trip (about 1 us on an idle H100 / H200). If the fence
takes about as long as that round trip with copies in flight, and a few tens
of cycles without, it waits for them; then a producer that issues tile ``g``'s
copies, waits for tile ``g - 1``'s (``cp.async.wait_group 1``) and fences
before publishing ``g - 1`` in fact waits for tile ``g`` as well, and keeps
one tile in flight, not two. Printed: the median over threads and 20 launches
of the cycles between the two clock reads, per case.
"""
import statistics

import numpy as np
from llvmlite import ir
from numba import cuda, float32, types
from numba.cuda.extending import intrinsic

from paged_numba.kernels.async_copy import commit_group, copy16_async, wait_group
from paged_numba.kernels.pdl import _statement     # an inline-PTX statement (GPU only)

STRIDE = 1 << 16        # elements (float32) between two sources: 256 KB apart


@intrinsic
def clock64(typingctx):
    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(ir.IntType(64), [])
        asm = ir.InlineAsm(fnty, "mov.u64 $0, %clock64;", "=l,~{memory}", side_effect=True)
        return builder.call(asm, [])
    return types.int64(), codegen


@intrinsic
def load_now(typingctx, arr, idx):
    """``arr[idx]`` (float32) by a volatile ``ld.global.cg``: issued here, not moved."""
    sig = types.float32(arr, idx)

    def codegen(context, builder, sig, args):
        a = context.make_array(sig.args[0])(context, builder, args[0])
        i = context.cast(builder, args[1], sig.args[1], types.intp)
        ptr = builder.ptrtoint(builder.gep(a.data, [i]), ir.IntType(64))
        fnty = ir.FunctionType(ir.FloatType(), [ir.IntType(64)])
        asm = ir.InlineAsm(fnty, "ld.volatile.global.f32 $0, [$1];", "=f,l,~{memory}",
                           side_effect=True)
        return builder.call(asm, [ptr])
    return sig, codegen


FENCES = {"none": _statement(""),
          "proxy.async.shared::cta": _statement("fence.proxy.async.shared::cta;"),
          "membar.cta": _statement("membar.cta;")}
# what is in flight when the clock starts: (name, copies (16 B each), a plain load,
# a plain store, the copies waited for before the clock)
CASES = [("nothing", 0, False, False, False),
         ("8 cp.async in flight", 8, False, False, False),
         ("8 cp.async landed (wait_group 0)", 8, False, False, True),
         ("1 plain load in flight", 0, True, False, False),
         ("1 plain store in flight", 0, False, True, False)]


def probe_kernel(fence, copies, load, store, waited):
    wait0 = wait_group(0)

    @cuda.jit
    def probe(src, dst, out, cycles):
        sm = cuda.shared.array(4096, float32)
        t = cuda.threadIdx.x
        base = (cuda.blockIdx.x * 128 + t) * 8 * STRIDE % (src.shape[0] - 64)
        acc = float32(0.0)
        for i in range(copies):
            copy16_async(sm, (t * 8 + i) * 4 % 4096, src, base + i * STRIDE)
        if copies:
            commit_group()
        if waited:
            wait0()
        x = float32(0.0)
        if load:
            x = load_now(src, base + 3)
        if store:
            dst[base % dst.shape[0]] = float32(t)
        t0 = clock64()
        fence()
        t1 = clock64()
        wait0()
        cuda.syncthreads()
        acc += sm[t * 4 % 4096] + x
        out[cuda.blockIdx.x * 128 + t] = acc
        cycles[cuda.blockIdx.x * 128 + t] = t1 - t0

    return probe


def main():
    n = 1 << 28                                   # 1 GB of float32
    src = cuda.to_device(np.ones(n, np.float32))
    dst = cuda.device_array(1 << 20, np.float32)
    out = cuda.device_array(128, np.float32)
    cycles = cuda.device_array(128, np.int64)
    name = cuda.get_current_device().name
    name = name.decode() if isinstance(name, bytes) else name
    print(f"{name}: cycles between two %clock64 reads around the fence "
          f"(median of 128 threads x 20 launches)")
    print(f"{'in flight':>34} " + " ".join(f"{f:>24}" for f in FENCES))
    for name, copies, load, store, waited in CASES:
        row = []
        for fname, fence in FENCES.items():
            k = probe_kernel(fence, copies, load, store, waited)
            got = []
            for rep in range(21):
                # a different window of the array each launch: cold lines
                k[1, 128](src[rep * 64:], dst, out, cycles)
                if rep:
                    got += list(cycles.copy_to_host())
            row.append(statistics.median(got))
        print(f"{name:>34} " + " ".join(f"{v:>24.0f}" for v in row), flush=True)


if __name__ == "__main__":
    main()
