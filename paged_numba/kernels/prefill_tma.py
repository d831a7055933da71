"""K/V tiles through the copy engine for the warp-specialised prefill kernel
(:func:`kernels.prefill_wgmma_ws.prefill_wgmma_ws_kernel` with
``tensor_maps``).

A tile of ``BN`` keys whose rows all lie in ``[lo, last]`` (a *whole* tile)
is ``BN / R`` runs of ``R = min(block_size, BN)`` consecutive tokens, each
within one page. With a tensor map over the pool (:func:`pool_maps`: the
cache's 4-d array as it lies, a box of ``R`` tokens of one KV head and 64
elements), each run is one box copy a 128-byte column group, and the box
lands as the tile's rows of that group with the 128-byte swizzle: the layout
of ``tile_parts``' ``"swizzle-split"`` (``kv_slot``), which the products
read. So one thread issues ``2 * (BN / R) * (2 D / 128)`` copies a tile
(16 for 64 keys at block size 16, head size 128), announces the tile's bytes
on the stage's mbarrier and arrives; the producer's other threads only
arrive. The copy engine computes the addresses, so the producer warpgroup
spends neither registers nor issue slots on them.

A tile that is not whole (the last of a sequence, or the first after a
window's start) is copied as before, with ``cp.async`` (rows outside
``[lo, last]`` repeat the nearest valid token, so no row past a sequence's
end, whose values may be anything, NaN included, reaches ``P V``), and its
copies arrive at the same mbarrier (``cp.async.mbarrier.arrive.noinc``).
Either way the stage's mbarrier completes once 128 threads arrived and the
announced bytes landed.

A block id outside the pool is read as block 0 and recorded, as by the
``cp.async`` path (:mod:`.guard`); a box reaching past the pool would be
zero-filled by the copy engine, and none does.
"""
from types import SimpleNamespace

import numpy as np
from numba import cuda, int32

from . import tma
from .access import device_function
from .prefill_tc_parts import FULL_MASK

LAYOUTS = ("nhd", "hnd")
GROUP = 64                  # elements of a 128-byte column group (fp16 / bf16)


def run_rows(block_size, block_n):
    """Tokens of one box: a page's, or the tile's when a page holds more.

    >>> run_rows(16, 64), run_rows(128, 64)
    (16, 64)
    """
    return min(int(block_size), int(block_n))


def check(head_size, block_size, block_n, dtype, layout):
    """Raise ``ValueError`` unless tiles of this kind can be box copies."""
    r = run_rows(block_size, block_n)
    if (layout not in LAYOUTS or dtype not in ("float16", "bfloat16") or head_size % GROUP
            or r % 8 or block_n % r or (block_n - 1) // block_size + 2 > 32):
        raise ValueError(
            f"tensor_maps needs a {' or '.join(map(repr, LAYOUTS))} cache of float16 or "
            f"bfloat16, head_size a multiple of {GROUP}, and boxes of whole 8-row swizzle atoms "
            f"(block_size >= 8, block_n a multiple of min(block_size, block_n), at most 31 "
            f"pages a tile), but got {layout!r}, {dtype}, head_size={head_size}, "
            f"block_size={block_size}, block_n={block_n}")


def pool_box(layout, block_size, block_n):
    """The box of one run in a pool of ``layout`` (outermost first).

    >>> pool_box("nhd", 16, 64), pool_box("hnd", 16, 64)
    ((1, 16, 1, 64), (1, 1, 16, 64))
    """
    r = run_rows(block_size, block_n)
    return (1, r, 1, GROUP) if layout == "nhd" else (1, 1, r, GROUP)


def pool_maps(key_cache, value_cache, layout, block_n):
    """``(key map, value map)``: tensor maps (:func:`kernels.tma.tensor_map`) of
    the pools ``[num_blocks, block_size, num_kv_heads, head_size]`` (``"nhd"``)
    or ``[num_blocks, num_kv_heads, block_size, head_size]`` (``"hnd"``) for
    boxes of one run's tokens, one KV head and 64 elements."""
    block_size = key_cache.shape[1 if layout == "nhd" else 2]
    box = pool_box(layout, block_size, block_n)
    return tma.tensor_map(key_cache, box), tma.tensor_map(value_cache, box)


def tma_parts(P, bar_at):
    """The box copies of a whole tile for tile parts ``P`` (the layout
    ``"swizzle-split"``), whose stage ``s`` has its mbarrier at
    ``bars[bar_at + s]`` (initialised for the 128 producer threads):

    * ``whole_tiles(kv_first, kv_hi)``: how many of an item's tiles, from the
      first (keys ``kv_first ..``, ``kv_first`` at or after its first valid
      key), go by boxes: those that end by ``kv_hi``, if they start runs;
    * ``issue_boxes(sm, maps, key_cache, value_cache, tables, seq, kvh, kt,
      stage, tid, entries, bars)``: every producer thread calls it; warp 0
      takes the tile's blocks from its table lanes (``entries``:
      :func:`tile_parts`' ``tile_entries``), thread 0 announces the bytes and
      issues the boxes, the other threads arrive."""
    D, BN, BLOCK_SIZE = P.D, P.BN, P.BLOCK_SIZE
    check(D, BLOCK_SIZE, BN, P.dtype, P.layout)
    R = run_rows(BLOCK_SIZE, BN)
    RUNS = BN // R
    GROUPS = D // GROUP
    NHD = P.layout == "nhd"
    TILE_BYTES = 2 * BN * D * np.dtype(P.dtype).itemsize     # K and V
    KV_OFF = P.KV_OFF
    record = P.record_
    load = tma.tma_load(4)

    @device_function
    def whole_tiles(kv_first, kv_hi):
        if kv_first % R != 0 or kv_hi <= kv_first:
            return int32(0)
        return int32((kv_hi - kv_first) // BN)

    @device_function
    def issue_boxes(sm, maps, key_cache, value_cache, tables, seq, kvh, kt, stage, tid,
                    entries, bars):
        e0, mine, bad = entries
        bar = int32(bar_at + stage)
        if tid < 32:
            kbase = int32(KV_OFF + 2 * stage * BN * D)
            if tid == 0:
                tma.mbarrier_arrive_expect_tx(bars, bar, TILE_BYTES)
            for p in range(RUNS):
                t = int32(kt + p * R)
                b = int32(t // BLOCK_SIZE)
                blk = cuda.shfl_sync(FULL_MASK, mine, int32(b - e0))
                off = int32(t - b * BLOCK_SIZE)
                if tid == 0:
                    for h in range(GROUPS):
                        dk = int32(kbase + (h * BN + p * R) * GROUP)
                        if NHD:
                            at = (int32(h * GROUP), int32(kvh), off, blk)
                        else:
                            at = (int32(h * GROUP), off, int32(kvh), blk)
                        load(sm, dk, maps[0], key_cache, at, bars, bar)
                        load(sm, int32(dk + BN * D), maps[1], value_cache, at, bars, bar)
        if tid != 0:
            tma.mbarrier_arrive(bars, bar)
        record(tables[0], tables[1], seq, bad)

    return SimpleNamespace(whole_tiles=whole_tiles, issue_boxes=issue_boxes, RUNS=RUNS, R=R,
                           TILE_BYTES=TILE_BYTES)
