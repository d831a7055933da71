"""The host side of prefill planning: integer inputs, which kernel runs, the
tile list, and the tensor-core kernel's ``kernel_options``
(:mod:`paged_numba.prefill` plans and launches with them)."""
import numpy as np

from . import _arrays, _simulator
from . import _checks as C
from .fp8 import is_fp8
from .kernels import prefill_tc

def _host_int(name, x):
    """A host int64 copy of an integer array (device arrays are copied), its
    entries checked against the int32 range the kernels narrow them to. Lists
    and tuples are checked entry by entry (:func:`_checks.int_sequence`)."""
    host = x if isinstance(x, (list, tuple)) else _arrays.to_host(x)
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


def plan_tiles(q_lens, seq_lens, block_q, causal=True, sliding_window=None):
    """The tile list: ``(tile_seq, tile_q0)`` int32 ``[num_tiles]``.

    Sequence ``s`` gets tiles at ``q0 = 0, block_q, 2 * block_q, ...`` below
    its query length. Tiles are ordered by the keys they read, most first,
    so that the long tiles of a mixed batch start early and short ones fill
    the gaps at the end.

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
    """
    seqs, starts, work = [], [], []
    for s, (n, kv) in enumerate(zip(np.asarray(q_lens).tolist(), np.asarray(seq_lens).tolist())):
        for q0 in range(0, n, block_q):
            last = kv - n + min(q0 + block_q, n) - 1          # position of the tile's last query
            hi = last + 1 if causal else kv
            lo = 0 if sliding_window is None else max(kv - n + q0 - sliding_window + 1, 0)
            seqs.append(s)
            starts.append(q0)
            work.append(hi - lo)
    order = np.argsort(-np.asarray(work, np.int64), kind="stable")
    return (np.asarray(seqs, np.int32)[order].reshape(-1),
            np.asarray(starts, np.int32)[order].reshape(-1))


def _knob(name, value, default, hi=None):
    return default if value is None else C.integer(name, value, lo=1, hi=hi)


# kernel_options: each key's check (the tensor-core kernel factory's keyword arguments)
_OPTION_CHECKS = {
    "q_in_regs": C.optional_flag, "fast_exp2": C.flag, "fma_softmax": C.flag,
    "token_copies": C.flag, "m_tiles": lambda name, v: C.integer(name, v, lo=1, hi=2),
    "wgmma": C.flag, "producer": C.flag, "swizzle": C.flag, "pingpong": C.flag,
    "lazy_rescale": C.flag, "prefetch_queries": C.flag, "prefetch_ranges": C.flag,
    "split_halves": C.flag, "mbarriers": C.flag, "tensor_maps": C.flag,
    "stages": lambda name, v: None if v is None else C.integer(name, v, lo=3, hi=7),
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
