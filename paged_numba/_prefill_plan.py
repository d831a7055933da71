"""The host side of prefill planning: integer inputs, which kernel runs, the
tile list, and the tensor-core kernel's ``kernel_options``
(:mod:`paged_numba.prefill` plans and launches with them)."""
import numpy as np

from . import _arrays, _simulator
from . import _checks as C
from .fp8 import is_fp8
from .kernels import prefill_tc
from .kernels.prefill import SHARED_LIMIT, prefill_config, shared_bytes
from .kernels.prefill_fp8 import staging_bytes
from .kernels.prefill_wgmma import wgmma_shared_bytes
from .kernels.prefill_wgmma_ws import STAGES as WS_STAGES, ws_shared_bytes

def _host_int(name, x, stream=0):
    """A host int64 copy of an integer array (device arrays are copied, after
    the work on numba stream ``stream``), its entries checked against the
    int32 range the kernels narrow them to. Lists and tuples are checked entry
    by entry (:func:`_checks.int_sequence`)."""
    host = x if isinstance(x, (list, tuple)) else _arrays.to_host(x, None, stream)
    return C.int_array(name, host, dtype=np.int64)


def _compute_capability():
    """The current GPU's compute capability, ``(major, minor)``."""
    from numba import cuda
    return tuple(cuda.get_current_device().compute_capability)


def uses_tensor_cores(cache, tensor_cores=None, query_dtype=None):
    """Whether prefill over ``cache`` runs on tensor cores
    (:mod:`paged_numba.kernels.prefill_tc`): by default where that kernel
    applies (fp16/bf16 caches, head sizes 16, 32, 64, 128, 256; an fp8 cache
    with ``query_dtype`` float16 or bfloat16 queries (default float16) at head
    size 64 or 128 in the producer kernel, on an sm_90 GPU; under the
    simulator only when asked, where that kernel is slow); ``True`` insists
    (``ValueError`` where it does not apply), ``False`` declines.

    >>> from paged_numba import PagedKVCache
    >>> uses_tensor_cores(PagedKVCache(2, 4, 1, 64)), uses_tensor_cores(PagedKVCache(2, 4, 1, 72))
    (True, False)
    """
    if is_fp8(cache.dtype):
        q = "float16" if query_dtype is None else np.dtype(query_dtype).name
        usable = prefill_tc.supports_fp8(cache.head_size, cache.layout, q)
        sim = _simulator.simulator_enabled()
        if usable and not sim and _compute_capability() != (9, 0):
            usable = False
        need = (f"tensor_cores=True needs, for an fp8 cache, float16/bfloat16 queries, head "
                f"size 64 or 128, a layout other than 'vllm' and an sm_90 GPU, but got {q} "
                f"queries, head_size={cache.head_size}, layout={cache.layout!r}")
        if tensor_cores is None:
            return usable and not sim
    else:
        usable = prefill_tc.supports(cache.head_size, cache.dtype.name, cache.layout)
        need = (f"tensor_cores=True needs a float16/bfloat16 cache and a head size in "
                f"(16, 32, 64, 128, 256), but got {cache.dtype.name}, head_size="
                f"{cache.head_size}")
        if tensor_cores is None:
            return usable
    if not isinstance(tensor_cores, (bool, np.bool_)):
        raise ValueError(f"tensor_cores must be None, True or False, but got {tensor_cores!r}.")
    if tensor_cores and not usable:
        raise ValueError(need + ".")
    return bool(tensor_cores)


# the bytes of K/V a group of sequences' tiles may read: a quarter of the 50 MB L2
# of an H100 or H200, so that the tiles in flight hit in it (prefill v36)
TILE_GROUP_BYTES = 12 << 20


def plan_tiles(q_lens, seq_lens, block_q, causal=True, sliding_window=None, group_keys=None):
    """The tile list: ``(tile_seq, tile_q0)`` int32 ``[num_tiles]``.

    Sequence ``s`` gets tiles at ``q0 = 0, block_q, 2 * block_q, ...`` below
    its query length. Tiles are ordered by the keys they read, most first,
    so that the long tiles of a mixed batch start early and short ones fill
    the gaps at the end. With ``group_keys`` that order holds within groups
    of sequences that run one group after the other: sequences taken by
    their heaviest tile (most keys first, ties in sequence order), a group
    filled while the keys its sequences' tiles read stay within
    ``group_keys`` (a sequence that reads more is a group alone). The tiles
    that run at the same time then read the keys of few sequences, which
    the L2 cache can hold (:class:`PrefillPlan` sizes the groups to a
    quarter of it).

    Parameters
    ----------
    q_lens, seq_lens : array of int, ``[num_seqs]``
        Query rows and cached tokens (this step's included) of each sequence.
    block_q : int
        Query tokens per tile.
    causal : bool
        A tile reads keys up to its last query's position; ``False``: all keys.
    sliding_window : int, optional
        A tile reads no key older than its first query's window.
    group_keys : int, optional
        The keys a group of sequences may read (None: one group).

    Returns
    -------
    tile_seq, tile_q0 : numpy.ndarray of int32, ``[num_tiles]``
        Sequence and first query row (within the sequence) of each tile.

    Examples
    --------
    >>> # sequence 0: a 5-token prompt; sequence 1: 2 new tokens after 8 cached
    >>> plan_tiles([5, 2], [5, 10], block_q=2)
    (array([1, 0, 0, 0], dtype=int32), array([0, 4, 2, 0], dtype=int32))
    >>> # keys read, causal: (1, 0) -> 10; (0, 4) -> 5; (0, 2) -> 4; (0, 0) -> 2
    >>> plan_tiles([5, 2], [5, 10], block_q=2, sliding_window=3)
    (array([0, 1, 0, 0], dtype=int32), array([2, 0, 4, 0], dtype=int32))
    >>> # keys 0..3 (4 keys), 6..9 (4, ties keep their order), 2..4 (3), 0..1 (2)
    >>> plan_tiles([4, 4], [4, 4], block_q=2)
    (array([0, 1, 0, 1], dtype=int32), array([2, 2, 0, 0], dtype=int32))
    >>> plan_tiles([4, 4], [4, 4], block_q=2, group_keys=4)   # each sequence reads 4 keys
    (array([0, 0, 1, 1], dtype=int32), array([2, 0, 2, 0], dtype=int32))
    """
    seqs, starts, work, spans = [], [], [], {}
    for s, (n, kv) in enumerate(zip(np.asarray(q_lens).tolist(), np.asarray(seq_lens).tolist())):
        for q0 in range(0, n, block_q):
            last = kv - n + min(q0 + block_q, n) - 1          # position of the tile's last query
            hi = last + 1 if causal else kv
            lo = 0 if sliding_window is None else max(kv - n + q0 - sliding_window + 1, 0)
            seqs.append(s)
            starts.append(q0)
            work.append(hi - lo)
            span = spans.get(s, (lo, hi, 0))
            spans[s] = (min(span[0], lo), max(span[1], hi), max(span[2], hi - lo))
    group = np.zeros(len(seqs), np.int64)
    if group_keys is not None:
        # sequences by their heaviest tile (stable), then greedy groups
        by_weight = sorted(spans, key=lambda s: -spans[s][2])
        gid, used, of = 0, 0, {}
        for s in by_weight:
            keys = spans[s][1] - spans[s][0]
            if used and used + keys > group_keys:
                gid, used = gid + 1, 0
            of[s], used = gid, used + keys
        group = np.array([of[s] for s in seqs], np.int64)
    order = np.lexsort((-np.asarray(work, np.int64), group))
    return (np.asarray(seqs, np.int32)[order].reshape(-1),
            np.asarray(starts, np.int32)[order].reshape(-1))


def _knob(name, value, default, hi=None):
    return default if value is None else C.integer(name, value, lo=1, hi=hi)


# kernel_options: each key's check (the tensor-core kernel factory's keyword arguments)
_OPTION_CHECKS = {
    "q_in_regs": C.optional_flag, "fast_exp2": C.flag, "fma_softmax": C.flag,
    "token_copies": C.flag, "m_tiles": lambda name, v: C.integer(name, v, lo=1, hi=2),
    "wgmma": C.flag, "producer": C.flag, "swizzle": C.flag, "pingpong": C.flag,
    "lazy_rescale": C.flag, "lane_vote": C.flag, "early_weights": C.flag, "staged_p": C.flag,
    "prefetch_queries": C.flag,
    "prefetch_ranges": C.flag,
    "deferred_stores": C.flag,
    # True (a quarter of the n-tiles) or every k-th n-tile, k a power of two up to 8
    "fma_exp2": lambda name, v: (bool(v) if isinstance(v, (bool, np.bool_))
                                 else C.power_of_two(name, v, hi=8)),
    "split_halves": C.flag, "mbarriers": C.flag, "tensor_maps": C.flag, "lean_loop": C.flag,
    "split_rings": C.flag,
    "stages": lambda name, v: None if v is None else C.integer(name, v, lo=2, hi=7),
    "max_registers": lambda name, v: None if v is None else C.integer(name, v, lo=1, hi=255),
    "producer_registers": lambda name, v: None if v is None else C.integer(name, v, lo=24, hi=160),
    # True (one block a multiprocessor) or a number of blocks
    "persistent": lambda name, v: (bool(v) if isinstance(v, (bool, np.bool_))
                                   else C.integer(name, v, lo=1, hi=2**31 - 1)),
}


def persistent_blocks(persistent, items, sm_count):
    """The grid's blocks of the persistent kernel: ``persistent`` blocks (or,
    for ``True``, one a multiprocessor), no more than there are work items.

    >>> [persistent_blocks(*a) for a in ((True, 4096, 132), (3, 8, 132), (True, 5, 132))]
    [132, 3, 5]
    """
    want = sm_count if persistent is True else int(persistent)
    return max(1, min(want, items))


def _kernel_options(kernel_options):
    """``kernel_options`` (None or a dict) with known keys and checked values."""
    if kernel_options is None:
        return {}
    if not isinstance(kernel_options, dict):
        raise ValueError(f"kernel_options must be a dict or None, but got {kernel_options!r}.")
    unknown = set(kernel_options) - set(_OPTION_CHECKS)
    if unknown:
        raise ValueError(f"kernel_options may hold {sorted(_OPTION_CHECKS)}, but got "
                         f"{sorted(unknown)}.")
    return {key: _OPTION_CHECKS[key](f"kernel_options['{key}']", value)
            for key, value in kernel_options.items()}


# -- tilings -------------------------------------------------------------------


def heads_per_block_of(group, value, default):
    """``heads_per_block`` (or ``default``): a power of two dividing ``group``."""
    hpb = _knob("heads_per_block", value, default)
    if group % hpb or hpb & (hpb - 1):
        raise ValueError(f"heads_per_block must be a power of two dividing the GQA group size "
                         f"{group}, but got {hpb}.")
    return hpb


def cuda_core_tiling(cache, group, max_q, heads_per_block, block_q, block_n, num_warps):
    """``(heads_per_block, block_q, block_n, num_warps)`` of the CUDA-core
    kernel over ``cache``: the caller's, else the defaults for ``group`` and
    the longest query ``max_q``; checked against shared memory."""
    d_hpb, d_bq, d_bn, d_nw = prefill_config(cache.head_size, group, max_q)
    hpb = heads_per_block_of(group, heads_per_block, d_hpb)
    bq = _knob("block_q", block_q, d_bq)
    bn = _knob("block_n", block_n, d_bn)
    nw = _knob("num_warps", num_warps, d_nw, hi=32)
    need = shared_bytes(cache.head_size, hpb * bq, bn)
    if need > SHARED_LIMIT:
        raise ValueError(f"tile of {hpb * bq} rows x {bn} keys at head "
                         f"size {cache.head_size} needs {need} bytes of shared memory, "
                         f"more than {SHARED_LIMIT}.")
    return hpb, bq, bn, nw


def tc_tiling(cache, group, max_q, heads_per_block, block_q, block_n, num_warps, m_tiles,
              wgmma=False, producer=False, stages=None, auto=False, prefetch=False,
              fp8=False):
    """``(heads_per_block, block_q, block_n, num_warps, default kernel
    options)`` of the tensor-core kernel over ``cache`` (``m_tiles`` the
    caller's, if given). ``auto``: the sm_90 default may be the warpgroup
    kernel; ``fp8``: the producer kernel's staging ring too."""
    if producer and not wgmma:
        raise ValueError("kernel_options['producer'] needs kernel_options['wgmma'] = True.")
    sim = _simulator.simulator_enabled()
    d_hpb, _, d_bn, d_nw, defaults = prefill_tc.prefill_tc_config(
        cache.head_size, group, max_q, cache.layout,
        sm90=auto and not sim and _compute_capability() == (9, 0))
    if defaults.get("wgmma"):
        wgmma, producer = True, defaults.get("producer", False)
    elif sim:
        # one warp, 16-key tiles: the simulator runs each thread in Python and
        # each mma as a rendezvous of 32 of them, so the GPU's tiles cost minutes there
        d_bn, d_nw = 16, 1
    if wgmma and not defaults.get("wgmma"):
        # warpgroups of 4 warps (64 rows each), one m-tile a warp
        d_nw = 4 if sim else 8
        d_bn = 16 if sim else 64
        defaults = {"fast_exp2": defaults["fast_exp2"], "m_tiles": 1}
        if m_tiles not in (None, 1):
            raise ValueError(f"kernel_options['wgmma'] needs m_tiles=1, but got "
                             f"m_tiles={m_tiles}.")
    if sim or num_warps is not None or block_q is not None:
        # a tiling of the caller's (or the simulator's): one m-tile a warp unless
        # kernel_options say otherwise, the kernel's own q_in_regs
        defaults = {"fast_exp2": defaults["fast_exp2"]}
    if m_tiles is None:
        m_tiles = defaults.get("m_tiles", 1)
    hpb = heads_per_block_of(group, heads_per_block, d_hpb)
    rows = 16 * m_tiles                 # rows a warp
    if block_q is not None and num_warps is not None:
        raise ValueError(f"on tensor cores block_q follows from num_warps ({rows} rows a "
                         f"warp); give one of them, but got block_q={block_q!r} and "
                         f"num_warps={num_warps!r}.")
    if block_q is not None:
        bq = _knob("block_q", block_q, None)
        if (bq * hpb) % rows:
            raise ValueError(f"on tensor cores block_q * heads_per_block must be a multiple "
                             f"of {rows} (rows of a warp), but got block_q={bq} with "
                             f"heads_per_block={hpb}.")
        num_warps = bq * hpb // rows
    nw = _knob("num_warps", num_warps, d_nw)
    if (rows * nw) % hpb:
        raise ValueError(f"heads_per_block={hpb} must divide the tile's {rows * nw} rows "
                         f"({rows} a warp x num_warps={nw}).")
    bq = rows * nw // hpb
    bn = _knob("block_n", block_n, d_bn)
    if bn % 16:
        raise ValueError(f"on tensor cores block_n must be a multiple of 16, but got {bn}.")
    if nw > 16:
        raise ValueError(f"num_warps must be at most 16, but got {nw}.")
    if wgmma and (nw % 4 or bn > 256):
        raise ValueError(f"kernel_options['wgmma'] needs num_warps a multiple of 4 (whole "
                         f"warpgroups) and block_n <= 256, but got num_warps={nw}, "
                         f"block_n={bn}.")
    if wgmma and not sim:
        cc = _compute_capability()
        if cc != (9, 0):
            raise ValueError(f"kernel_options['wgmma'] needs an sm_90 GPU (H100, H200), but "
                             f"this one has compute capability {cc}.")
    if producer:
        need = ws_shared_bytes(cache.head_size, nw, bn, stages or WS_STAGES, prefetch)
        if fp8:
            need += staging_bytes(cache.head_size, bn)
    elif wgmma:
        need = wgmma_shared_bytes(cache.head_size, nw, bn)
    else:
        need = prefill_tc.shared_bytes(cache.head_size, nw, bn, m_tiles)
    if need > prefill_tc.MAX_SHARED_BYTES:
        raise ValueError(f"tile of {rows * nw} rows x {bn} keys at head size "
                         f"{cache.head_size} needs {need} bytes of shared memory, more "
                         f"than {prefill_tc.MAX_SHARED_BYTES}.")
    return hpb, bq, bn, nw, defaults
