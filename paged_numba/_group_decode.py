"""Decode for large GQA groups and MQA through the tensor-core prefill tile.

The decode kernels hold at most 8 query heads a thread block, so a KV head
shared by 16 or 32 query heads is read 2 or 4 times. Here one query token of
each sequence is a "prompt" of length 1 for
:func:`paged_numba.kernels.prefill_tc.prefill_tc_kernel`: the tile's 16 rows a
warp are the group's heads (16 a warp, 32 in two warps), so each K/V byte is
read once, and split-K (``split_k=True``) spreads a sequence's keys over
``num_parts`` thread blocks, merged by the split-K merge kernel as decode's
partitions are. :func:`paged_numba.paged_decode` and
:class:`paged_numba.DecodePlan` take this path by themselves where
:func:`group_tile` says it applies.
"""
import numpy as np

from . import _arrays, _launch, _simulator
from .kernels import prefill_tc
from .kernels.merge import merge_kernel

MIN_GROUP = 32      # below, the decode kernels (8 heads a block) were faster on the H200
MAX_TILE_HEADS = 32  # two warps of 16 rows
BLOCK_N = 64        # keys a K/V tile
PART_TILES = 4      # at least this many K/V tiles a part


def group_tile(cache, num_heads, tensor_cores=None):
    """``heads_per_block`` of the prefill-tile decode for this cache and head
    count, or None where the decode kernels apply (``tensor_cores=False``, or
    where :func:`tile_heads` says so).

    >>> from paged_numba import PagedKVCache
    >>> mqa = PagedKVCache(num_blocks=2, block_size=16, num_kv_heads=1, head_size=64)
    >>> group_tile(mqa, 32), group_tile(mqa, 8), group_tile(mqa, 32, tensor_cores=False)
    (32, None, None)
    """
    if tensor_cores is False:
        return None
    return tile_heads(num_heads // cache.num_kv_heads, cache.head_size, cache.dtype.name,
                      cache.layout)


def tile_heads(group, head_size, dtype, layout):
    """Query heads a prefill tile takes in decode: the largest power of two
    dividing the GQA group, at most ``MAX_TILE_HEADS``; None where that is
    below ``MIN_GROUP`` (the decode kernels' 8 heads a block do as well) or the
    tensor-core prefill kernel does not take the cache.

    >>> tile_heads(32, 128, "float16", "nhd"), tile_heads(64, 128, "bfloat16", "vllm")
    (32, 32)
    >>> tile_heads(24, 128, "float16", "nhd"), tile_heads(16, 128, "float32", "nhd")
    (None, None)
    """
    if group < MIN_GROUP or not prefill_tc.supports(head_size, dtype, layout):
        return None
    hpb = 1
    while hpb * 2 <= min(group, MAX_TILE_HEADS) and group % (hpb * 2) == 0:
        hpb *= 2
    return hpb if hpb >= MIN_GROUP else None


def group_parts(num_seqs, num_head_blocks, max_context, sm_count):
    """Split-K parts: about two thread blocks a multiprocessor (one wave; at 64
    x 4096 MQA on the H200 4 parts took 64.7 us, 9 and 16 parts 73.5 and 71.4),
    each part at least ``PART_TILES`` K/V tiles.

    >>> group_parts(64, 1, 4096, 132), group_parts(1, 1, 32768, 132), group_parts(512, 2, 512, 132)
    (4, 128, 1)
    """
    blocks = max(num_seqs * num_head_blocks, 1)
    want = 2 * sm_count // blocks
    most = max(1, max_context // (BLOCK_N * PART_TILES))
    return int(max(1, min(want, most)))


class GroupDecode:
    """The launches of one decode batch on the prefill tile: ``run(q, tables,
    lens, stream)`` enqueues the kernel (and the merge when split) writing
    ``out [num_seqs, num_heads, head_size]`` and ``lse [num_seqs, num_heads]``.
    ``part_out [num_seqs, num_parts, num_heads, head_size]`` and ``part_lse
    [num_seqs, num_parts, num_heads]`` float32 hold the split's partial states."""

    BLOCK_N = BLOCK_N

    def __init__(self, cache, num_seqs, num_heads, hpb, num_parts, scale, variants, out, lse):
        self.cache, self.num_seqs, self.num_heads = cache, num_seqs, num_heads
        self.heads_per_block, self.num_parts = hpb, num_parts
        if _simulator.simulator_enabled():
            # one warp and 16-key tiles: the GPU's tile costs minutes on the simulator
            hpb, block_n = min(hpb, 16), 16
        else:
            block_n = BLOCK_N
        self.heads_per_block = hpb
        self.num_warps = max(1, hpb // 16)
        self.kernel = prefill_tc.prefill_tc_kernel(
            cache.head_size, cache.block_size, hpb, block_n, cache.dtype.name, cache.layout,
            self.num_warps, fast_exp2=True, split_k=num_parts > 1)
        self.grid = (num_seqs, num_heads // hpb, num_parts)
        self.out, self.lse = out, lse
        n, d = num_seqs, cache.head_size
        if num_parts > 1:
            self.part_out = _arrays.zeros((n, num_parts, num_heads, d), np.float32)
            self.part_lse = _arrays.zeros((n, num_parts, num_heads), np.float32)
        else:
            self.part_out, self.part_lse = out, lse
        seqs = np.arange(n + 1, dtype=np.int32)
        self._fixed = (_arrays.as_device(seqs, "cu_seqlens_q")[0],)
        self._tiles = (_arrays.as_device(seqs[:n], "tile_seq")[0],
                       _arrays.as_device(np.zeros(n, np.int32), "tile_q0")[0])
        self._scale, self._variants = np.float32(scale), variants
        self.merge = None
        if num_parts > 1 and num_seqs:
            self.merge = _launch.PackedLaunch(merge_kernel(cache.dtype.name),
                                              (num_heads, num_seqs), 128,
                                              (out, lse, self.part_out, self.part_lse))

    def launches(self, q, tables, lens, out=None, lse=None):
        """The packed launches (kernel, then merge where split) for these
        buffers, writing ``out``/``lse`` (default: the ones given at construction)."""
        c = self.cache
        out = self.out if out is None else out
        lse = self.lse if lse is None else lse
        part_out, part_lse, merge = self.part_out, self.part_lse, self.merge
        if self.num_parts == 1:
            part_out, part_lse = out, lse
        elif merge is not None and (out is not self.out or lse is not self.lse):
            merge = _launch.PackedLaunch(merge_kernel(c.dtype.name), (self.num_heads,
                                                                      self.num_seqs), 128,
                                         (out, lse, part_out, part_lse))
        args = (part_out, part_lse, q, c.key_cache, c.value_cache, tables,
                *self._fixed, lens, *self._tiles, self._scale, np.int32(0), *self._variants,
                c.errors)
        main = _launch.PackedLaunch(self.kernel, self.grid, 32 * self.num_warps, args)
        return [main] + ([merge] if merge is not None else [])

    @property
    def scratch_bytes(self):
        """Device bytes of the split's partial states."""
        return 0 if self.num_parts == 1 else (self.part_out.size + self.part_lse.size) * 4
