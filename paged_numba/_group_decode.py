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

Two tiles can run it (``GroupDecode(kernel=...)``): ``"tile"``, the
``mma.sync`` kernel with one warp of 16 heads (two for 32), whose own warps
copy the keys; and ``"wgmma"`` (sm_90 GPUs), the producer kernel of
:mod:`paged_numba.kernels.prefill_wgmma_ws` with one consumer warpgroup (64
rows: the group's heads for one or more query positions, of which decode
fills the first) and a producer warpgroup that keeps ``stages - 1`` K/V
tiles in flight.
"""
import numpy as np

from . import _arrays, _launch, _simulator
from .kernels import prefill_tc, prefill_wgmma_ws
from .kernels.merge_tail import merge_tail_bytes

MIN_GROUP = 32      # below, the decode kernels (8 heads a block) were faster on the H200
MAX_TILE_HEADS = 32  # two warps of 16 rows
BLOCK_N = 64        # keys a K/V tile
PART_TILES = 4      # at least this many K/V tiles a part
KERNELS = ("tile", "wgmma")
DEFAULT_KERNEL = "tile"
# keys a tile and ring stages of the "wgmma" tile (at head size 128 a 64-key
# stage is 32 KB; the producer keeps two tiles' copies in flight)
WGMMA_TILING = (64, prefill_wgmma_ws.STAGES)
# the "wgmma" tile's split-K merge by the last part of each item, in the kernel
# (kernels.merge_tail) rather than by a second launch; an experiment's knob
WGMMA_FUSED_MERGE = False
# more options of the "wgmma" tile's producer kernel (e.g. {"mbarriers": True}:
# the copies arrive at the stages' mbarriers as they land); an experiment's knob
WGMMA_OPTIONS = {}
NAMED_MIN_GROUP = 16  # a kernel named by the caller: groups from 16


def group_tile(cache, num_heads, tensor_cores=None, kernel=None):
    """``heads_per_block`` of the prefill-tile decode for this cache and head
    count, or None where the decode kernels apply (``tensor_cores=False``, or
    where :func:`tile_heads` says so). ``kernel`` (``"tile"`` or ``"wgmma"``)
    named by the caller also takes groups of 16 to the tile.

    >>> from paged_numba import PagedKVCache
    >>> mqa = PagedKVCache(num_blocks=2, block_size=16, num_kv_heads=1, head_size=64)
    >>> group_tile(mqa, 32), group_tile(mqa, 8), group_tile(mqa, 32, tensor_cores=False)
    (32, None, None)
    >>> group_tile(mqa, 16), group_tile(mqa, 16, kernel="wgmma")
    (None, 16)
    """
    if tensor_cores is False:
        return None
    return tile_heads(num_heads // cache.num_kv_heads, cache.head_size, cache.dtype.name,
                      cache.layout, MIN_GROUP if kernel is None else NAMED_MIN_GROUP)


def tile_heads(group, head_size, dtype, layout, min_group=MIN_GROUP):
    """Query heads a prefill tile takes in decode: the largest power of two
    dividing the GQA group, at most ``MAX_TILE_HEADS``; None where that is
    below ``min_group`` (by default ``MIN_GROUP``: the decode kernels' 8 heads
    a block do as well) or the tensor-core prefill kernel does not take the
    cache.

    >>> tile_heads(32, 128, "float16", "nhd"), tile_heads(64, 128, "bfloat16", "vllm")
    (32, 32)
    >>> tile_heads(24, 128, "float16", "nhd"), tile_heads(16, 128, "float32", "nhd")
    (None, None)
    """
    if group < min_group or not prefill_tc.supports(head_size, dtype, layout):
        return None
    hpb = 1
    while hpb * 2 <= min(group, MAX_TILE_HEADS) and group % (hpb * 2) == 0:
        hpb *= 2
    return hpb if hpb >= min_group else None


def group_kernel(cache, kernel=None):
    """The tile that runs group decode over ``cache``: ``kernel`` if given
    (``"wgmma"`` where the producer kernel does not take the cache or the GPU
    is not sm_90 raises), else ``DEFAULT_KERNEL``."""
    if kernel is None:
        return DEFAULT_KERNEL
    if kernel not in KERNELS:
        raise ValueError(f"group_kernel must be one of {KERNELS}, but got {kernel!r}")
    if kernel == "wgmma":
        ok = (cache.head_size in (64, 128) and cache.layout != "vllm"
              and cache.dtype.name in ("float16", "bfloat16"))
        if ok and not _simulator.simulator_enabled():
            from numba import cuda
            ok = tuple(cuda.get_current_device().compute_capability) == (9, 0)
        if not ok:
            raise ValueError(f"group_kernel='wgmma' needs a float16/bfloat16 cache of head size "
                             f"64 or 128 in a layout other than 'vllm', on an sm_90 GPU, but got "
                             f"{cache.dtype.name}, head_size={cache.head_size}, "
                             f"layout={cache.layout!r}")
    return kernel


def group_parts(num_seqs, num_head_blocks, max_context, sm_count, kernel="tile"):
    """Split-K parts: about one wave of thread blocks (two a multiprocessor for
    ``"tile"``: at 64 x 4096 MQA on the H200 4 parts took 64.7 us, 9 and 16
    parts 73.5 and 71.4; one for ``"wgmma"``, whose shared memory takes a
    multiprocessor's), each part at least ``PART_TILES`` K/V tiles.

    >>> group_parts(64, 1, 4096, 132), group_parts(1, 1, 32768, 132), group_parts(512, 2, 512, 132)
    (4, 128, 1)
    >>> group_parts(64, 1, 4096, 132, "wgmma")
    2
    """
    blocks = max(num_seqs * num_head_blocks, 1)
    want = (1 if kernel == "wgmma" else 2) * sm_count // blocks
    most = max(1, max_context // (BLOCK_N * PART_TILES))
    return int(max(1, min(want, most)))


class GroupDecode:
    """The launches of one decode batch on the prefill tile: ``run(q, tables,
    lens, stream)`` enqueues the kernel (and the merge when split) writing
    ``out [num_seqs, num_heads, head_size]`` and ``lse [num_seqs, num_heads]``.
    ``part_out [num_seqs, num_parts, num_heads, head_size]`` and ``part_lse
    [num_seqs, num_parts, num_heads]`` float32 hold the split's partial states.
    The scratch is zeroed and the fixed index arrays uploaded on numba stream
    ``stream``, the launches' (None, for a plan: done when the constructor returns).
    ``pdl`` (split, with the merge a kernel of its own): the merge is launched
    to start early (:mod:`paged_numba.kernels.pdl`); ``self.pdl`` says whether
    it applies."""

    BLOCK_N = BLOCK_N

    def __init__(self, cache, num_seqs, num_heads, hpb, num_parts, scale, variants, out, lse,
                 kernel=None, stream=None, pdl=False):
        self.cache, self.num_seqs, self.num_heads = cache, num_seqs, num_heads
        self.heads_per_block, self.num_parts = hpb, num_parts
        kernel = DEFAULT_KERNEL if kernel is None else kernel     # checked by group_kernel
        self.kind = kernel
        fused = False
        # the merge launched early: split, with the merge a kernel of its own
        self.pdl = bool(pdl) and num_parts > 1
        sim = _simulator.simulator_enabled()
        if kernel == "wgmma":
            # one consumer warpgroup: 64 rows, the heads of each query position
            block_n, stages = (16, prefill_wgmma_ws.STAGES) if sim else WGMMA_TILING
            # (alternate_tiles: two consumer warpgroups take every other tile of the rows)
            self.num_warps = 8 if WGMMA_OPTIONS.get("alternate_tiles") else 4
            fused = (WGMMA_FUSED_MERGE and num_parts > 1
                     and merge_tail_bytes(hpb * (64 // hpb), num_parts) <= prefill_wgmma_ws
                     .ws_shared_bytes(cache.head_size, 4, block_n, stages))
            self.pdl = self.pdl and not fused
            self.kernel = prefill_wgmma_ws.prefill_wgmma_ws_kernel(
                cache.head_size, cache.block_size, hpb, block_n, cache.dtype.name, cache.layout,
                self.num_warps, fast_exp2=True, split_k=num_parts > 1, swizzle=True, stages=stages,
                merge_parts=fused, pdl=self.pdl, **WGMMA_OPTIONS)
            self.threads = self.kernel.block_threads
        else:
            if sim:
                # one warp and 16-key tiles: the GPU's tile costs minutes on the simulator
                hpb, block_n = min(hpb, 16), 16
            else:
                block_n = BLOCK_N
            self.heads_per_block = hpb
            self.num_warps = max(1, hpb // 16)
            self.kernel = prefill_tc.prefill_tc_kernel(
                cache.head_size, cache.block_size, hpb, block_n, cache.dtype.name, cache.layout,
                self.num_warps, fast_exp2=True, split_k=num_parts > 1, pdl=self.pdl)
            self.threads = 32 * self.num_warps
        self.block_n = block_n
        self.grid = (num_seqs, num_heads // hpb, num_parts)
        self.out, self.lse = out, lse
        n, d = num_seqs, cache.head_size
        if num_parts > 1:
            self.part_out = _arrays.zeros((n, num_parts, num_heads, d), np.float32, stream)
            self.part_lse = _arrays.zeros((n, num_parts, num_heads), np.float32, stream)
        else:
            self.part_out, self.part_lse = out, lse
        seqs = np.arange(n + 1, dtype=np.int32)
        self._fixed = (_arrays.as_device(seqs, "cu_seqlens_q", stream)[0],)
        self._tiles = (_arrays.as_device(seqs[:n], "tile_seq", stream)[0],
                       _arrays.as_device(np.zeros(n, np.int32), "tile_q0", stream)[0])
        self._scale, self._variants = np.float32(scale), variants
        self.merge = None
        self.fused_merge = fused
        self._tickets = ()
        if fused:       # the kernel's last part of each item merges: no merge launch
            self._tickets = (_arrays.zeros(num_seqs * (num_heads // hpb), np.int32, stream),)
        elif num_parts > 1 and num_seqs:
            self.merge = self._merge_launch(out, lse)

    def _merge_launch(self, out, lse):
        """The split-K merge of the partial states into ``out`` and ``lse``."""
        return _launch.merge_launch(self.cache.dtype.name, out, lse, self.part_out,
                                    self.part_lse, self.pdl)

    def launches(self, q, tables, lens, out=None, lse=None):
        """The packed launches (kernel, then merge where split) for these
        buffers, writing ``out``/``lse`` (default: the ones given at construction)."""
        c = self.cache
        out = self.out if out is None else out
        lse = self.lse if lse is None else lse
        part_out, part_lse, merge = self.part_out, self.part_lse, self.merge
        if self.num_parts == 1:
            part_out, part_lse = out, lse
        elif self.fused_merge:
            merge = None
        elif merge is not None and (out is not self.out or lse is not self.lse):
            merge = self._merge_launch(out, lse)
        args = (part_out, part_lse, q, c.key_cache, c.value_cache, tables,
                *self._fixed, lens, *self._tiles, self._scale, np.int32(0), *self._variants,
                c.errors)
        if self.fused_merge:
            args += (out, lse, *self._tickets)
        main = _launch.PackedLaunch(self.kernel, self.grid, self.threads, args)
        return [main] + ([merge] if merge is not None else [])

    @property
    def scratch_bytes(self):
        """Device bytes of the split's partial states."""
        return 0 if self.num_parts == 1 else (self.part_out.size + self.part_lse.size) * 4
