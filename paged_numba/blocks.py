"""Moving whole blocks: ``copy_blocks`` inside a device cache (copy-on-write,
forks) and ``swap_blocks`` between a device cache and a host pool (preemption
by swapping). Both take ``(src, dst)`` block pairs, as
:class:`~paged_numba.block_manager.BlockManager` returns them, and validate
everything before anything is copied.

A physical block is the contiguous slab ``pool[b]`` (``pool[l, b]`` in a
layered cache) in every layout, so a block moves as one run of bytes per
pool: K and V in "nhd", "vllm" and "hnd", the one pool in "interleaved".
"""
import numpy as np
from numba import config, cuda

from ._arrays import logical_dtype, storage_dtype
from ._block_launch import _block_elems, _flat_pools, _vector_threads, copy_launcher
from ._checks import INT32_MAX, integer
from ._launch import launch, numba_stream, stream_handle
from ._validate import dtype_text
from .kernels.copy_blocks import copy_blocks_kernel, stage_blocks_kernel

# device memory a swap stages its blocks through, at most (one DMA per this many bytes)
STAGING_BYTES = 64 * 2**20
# a run of host blocks at least this long (on average) is copied by its own DMA
# (one driver call, a few microseconds of host time); shorter ones go through a
# pinned buffer that NumPy gathers or scatters
MIN_RUN_BYTES = 16 * 2**10


def _check_cache(cache):
    """``cache`` is a PagedKVCache (layered or not)."""
    for attr in ("key_cache", "value_cache", "block_size", "num_blocks", "num_kv_heads",
                 "head_size", "dtype", "layout"):
        if not hasattr(cache, attr):
            raise TypeError(f"cache must be a PagedKVCache, but got {type(cache).__name__}.")


def check_pairs(pairs, num_src, num_dst, same_pool, src_name="source", dst_name="destination"):
    """``pairs`` as an int64 array ``[num_pairs, 2]``, after checking that sources lie
    in ``[0, num_src)``, destinations in ``[0, num_dst)``, no destination appears
    twice and (``same_pool``) no block is both a source and a destination."""
    arr = np.asarray(pairs)
    # (an empty list is float64 to NumPy: no pairs, whatever its dtype; an empty array
    # must still hold integers)
    listed = arr.size == 0 and not isinstance(pairs, np.ndarray)
    if not listed and (arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"pairs must hold integer block ids, but got dtype {arr.dtype.name}.")
    if arr.size == 0 and arr.shape in ((0,), (0, 2)):
        return np.zeros((0, 2), np.int64)
    if arr.ndim != 2 or arr.shape[1] != 2:
        raise ValueError(f"pairs must be [num_pairs, 2] (source, destination), but got shape "
                         f"{tuple(arr.shape)}.")
    if arr.dtype.kind == "u" and arr.max() > np.iinfo(np.int64).max:
        i, col = (int(x[0]) for x in np.nonzero(arr > np.iinfo(np.int64).max))
        raise ValueError(f"pairs[{i}, {col}] ({(src_name, dst_name)[col]} block) is "
                         f"{int(arr[i, col])}, outside [0, {(num_src, num_dst)[col]}).")
    arr = arr.astype(np.int64)
    if _pairs_ok(arr, num_src, num_dst, same_pool):
        return arr
    # something is wrong: find the first offending pair, for the message
    for col, name, limit in ((0, src_name, num_src), (1, dst_name, num_dst)):
        bad = np.flatnonzero((arr[:, col] < 0) | (arr[:, col] >= limit))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"pairs[{i}, {col}] ({name} block) is {int(arr[i, col])}, outside "
                             f"[0, {limit}).")
    dst = arr[:, 1]
    _, first = np.unique(dst, return_index=True)      # each destination's first pair
    if len(first) < len(dst):
        again = np.ones(len(dst), bool)
        again[first] = False
        i = int(np.flatnonzero(again)[0])              # the first pair that repeats one
        d = int(dst[i])
        raise ValueError(f"destination block {d} appears twice in pairs (pairs["
                         f"{int(np.flatnonzero(dst == d)[0])}, 1] and pairs[{i}, 1]); each "
                         f"destination can be written once per call.")
    if same_pool:
        both = np.flatnonzero(np.isin(arr[:, 0], dst))
        if both.size:
            i = int(both[0])
            s = int(arr[i, 0])
            raise ValueError(
                f"block {s} is both a source (pairs[{i}, 0]) and a destination "
                f"(pairs[{int(np.flatnonzero(dst == s)[0])}, 1]); the pairs of one call are "
                f"copied concurrently, so split them into two calls.")
    return arr


def _pairs_ok(arr, num_src, num_dst, same_pool):
    """Whether int64 pairs ``[n, 2]`` pass :func:`check_pairs`' checks, in
    O(n + num_dst) where the destinations' counts fit (a ten-fold faster test
    than sorting; the caller finds the offending pair only when one is wrong).
    None when the pool is too large to count in: the caller checks as usual."""
    src, dst = arr[:, 0], arr[:, 1]
    if src.min() < 0 or src.max() >= num_src or dst.min() < 0 or dst.max() >= num_dst:
        return False
    if num_dst > 64 * len(dst) + 65536:
        return None
    counts = np.bincount(dst, minlength=num_dst)
    if counts.max() > 1:
        return False
    return not (same_pool and counts[src].any())


def copy_blocks(cache, pairs, *, stream=None):
    """Copy whole blocks inside ``cache``: block ``dst`` gets block ``src``'s keys
    and values, for every ``(src, dst)`` pair, in one kernel launch.

    This is the copy of copy-on-write (:meth:`BlockManager.append` returns the
    pairs) and of forks that duplicate blocks. In a layered cache every layer
    is copied. Blocks whose size is a multiple of 16 bytes move as 16-byte
    vectors.

    Parameters
    ----------
    cache : PagedKVCache
        Any layout and dtype, with or without ``num_layers``.
    pairs : array_like of int, ``[num_pairs, 2]``
        ``(src, dst)`` physical block ids, each in ``[0, num_blocks)``. No
        destination may appear twice, and no block may be both a source and
        a destination in one call (the pairs are copied concurrently).
    stream : optional
        Launch on this stream: a numba, PyTorch or CuPy stream, a raw
        ``cudaStream_t`` int, or None (the default stream); ignored under the
        simulator.

    Raises
    ------
    ValueError
        Naming the offending pair, before anything is launched.

    Examples
    --------
    >>> import numpy as np
    >>> from paged_numba import PagedKVCache, write_kv, copy_blocks
    >>> cache = PagedKVCache(num_blocks=4, block_size=2, num_kv_heads=1, head_size=8)
    >>> write_kv(cache, np.ones((2, 1, 8), np.float16), np.full((2, 1, 8), 2, np.float16),
    ...          np.array([2, 3]))                         # block 1, offsets 0 and 1
    >>> copy_blocks(cache, [(1, 0), (1, 3)])              # one launch, two copies
    >>> K, V = cache.to_host()
    >>> K[:, :, 0, 0].tolist(), V[:, :, 0, 0].tolist()    # [num_blocks, block_size]
    ([[1.0, 1.0], [1.0, 1.0], [0.0, 0.0], [1.0, 1.0]], [[2.0, 2.0], [2.0, 2.0], [0.0, 0.0], [2.0, 2.0]])
    >>> copy_blocks(cache, [(0, 2), (2, 3)])
    Traceback (most recent call last):
        ...
    ValueError: block 2 is both a source (pairs[1, 0]) and a destination (pairs[0, 1]); the pairs of one call are copied concurrently, so split them into two calls.
    """
    _check_cache(cache)
    handle = stream_handle(stream)
    arr = check_pairs(pairs, cache.num_blocks, cache.num_blocks, same_pool=True)
    if arr.shape[0] == 0:
        return
    if config.ENABLE_CUDASIM:
        k, v, has_value = _flat_pools(cache)
        vec, threads = _vector_threads(k, v)
        launch(copy_blocks_kernel(vec, has_value), (arr.shape[0], k.shape[0]), threads,
               (k, v, cuda.to_device(arr.astype(np.int32))))
        return
    copy_launcher(cache, arr.shape[0])(arr, handle)


class HostPool(np.ndarray):
    """A host pool (:func:`host_pool`): a NumPy array that also records the
    geometry of the cache it was made for, ``(layout, block_size,
    num_kv_heads, head_size)``, so that :func:`swap_blocks` refuses a cache
    whose blocks have the same size but another element order (an "nhd"
    pool swapped into an "hnd" cache, 16 tokens of 8 heads into 8 tokens of
    16). Views and slices keep it; a plain NumPy array of the right shape
    and dtype is taken as it is.

    >>> from paged_numba import PagedKVCache, HostPool, host_pool, swap_blocks
    >>> pool = host_pool(PagedKVCache(4, 16, 2, 8, layout="hnd"), 2)
    >>> isinstance(pool, HostPool), pool.geometry, pool[1:].geometry == pool.geometry
    (True, ('hnd', 16, 2, 8), True)
    >>> swap_blocks(pool, PagedKVCache(4, 16, 2, 8), [(0, 1)])     # an "nhd" cache
    Traceback (most recent call last):
        ...
    ValueError: src was made for a cache of (layout, block_size, num_kv_heads, head_size) = ('hnd', 16, 2, 8), but this cache has ('nhd', 16, 2, 8): its blocks' elements are in another order.
    """

    geometry = None

    def __array_finalize__(self, obj):
        self.geometry = getattr(obj, "geometry", None)


def _geometry(cache):
    return (cache.layout, int(cache.block_size), int(cache.num_kv_heads), int(cache.head_size))


def host_pool_shape(cache, num_blocks):
    """Shape of a host pool of ``num_blocks`` blocks for ``cache``:
    ``[num_blocks, (num_layers,) 2, block_size * num_kv_heads * head_size]``.

    Host block ``b`` holds the device block's keys (``[..., 0, :]``) and values
    (``[..., 1, :]``) in the cache layout's element order, so it can only be
    swapped back into a cache of the same geometry, layout and dtype."""
    lead = (num_blocks,) + (() if cache.num_layers is None else (cache.num_layers,))
    return lead + (2, _block_elems(cache))


def host_pool(cache, num_blocks):
    """A zero-filled host pool of ``num_blocks`` blocks for swapping ``cache``'s
    blocks out (:func:`swap_blocks`).

    Parameters
    ----------
    cache : PagedKVCache
    num_blocks : int
        Host blocks (> 0), independent of the cache's ``num_blocks``.

    Returns
    -------
    HostPool, ``[num_blocks, (num_layers,) 2, block_size * num_kv_heads * head_size]``
        A NumPy array in the cache's logical dtype (``ml_dtypes.bfloat16`` for
        bfloat16); page-locked (pinned) memory when there is a GPU, so copies on a
        stream are asynchronous. Its ``geometry`` attribute records the cache's
        ``(layout, block_size, num_kv_heads, head_size)``, which
        :func:`swap_blocks` checks.

    Examples
    --------
    >>> from paged_numba import PagedKVCache, host_pool
    >>> cache = PagedKVCache(num_blocks=4, block_size=2, num_kv_heads=1, head_size=8)
    >>> host_pool(cache, 3).shape                  # 16 = 2 * 1 * 8
    (3, 2, 16)
    >>> host_pool(PagedKVCache(4, 2, 1, 8, num_layers=5, dtype="bfloat16"), 3).dtype
    dtype(bfloat16)
    """
    _check_cache(cache)
    num_blocks = integer("num_blocks", num_blocks, lo=1, hi=INT32_MAX)   # int32 block ids
    shape = host_pool_shape(cache, num_blocks)
    bits = storage_dtype(cache.dtype)
    try:
        if config.ENABLE_CUDASIM:
            pool = np.zeros(shape, bits)
        else:
            pool = cuda.pinned_array(shape, bits)
            pool.fill(0)
    except Exception as e:          # MemoryError, NumPy's "too big", the driver's out of memory
        nbytes = int(np.prod(shape, dtype=object)) * bits.itemsize
        raise MemoryError(f"a host pool of num_blocks={num_blocks} blocks needs {nbytes} bytes "
                          f"of (pinned) host memory, which could not be allocated: {e}") from None
    pool = pool.view(cache.dtype).view(HostPool)
    pool.geometry = _geometry(cache)
    return pool


def _check_host_pool(pool, cache, name):
    if not isinstance(pool, np.ndarray):
        raise TypeError(f"{name} must be a NumPy host pool (see host_pool) or a PagedKVCache, "
                        f"but got {type(pool).__name__}.")
    if logical_dtype(pool) != cache.dtype:
        raise ValueError(f"{name} must have the same dtype as the cache, but got "
                         f"{dtype_text(pool.dtype)} and {dtype_text(cache.dtype)}.")
    expected = host_pool_shape(cache, pool.shape[0] if pool.ndim else 0)
    if pool.shape != expected or pool.shape[0] == 0:
        raise ValueError(f"{name} must be [num_host_blocks, {', '.join(map(str, expected[1:]))}] "
                         f"for this cache, but got shape {pool.shape}.")
    if not pool.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous, but got strides {pool.strides}.")
    if not pool.flags.writeable:
        raise ValueError(f"{name} must be writeable.")
    made_for = getattr(pool, "geometry", None)
    if made_for is not None and tuple(made_for) != _geometry(cache):
        fields = "(layout, block_size, num_kv_heads, head_size)"
        raise ValueError(f"{name} was made for a cache of {fields} = {tuple(made_for)}, but "
                         f"this cache has {_geometry(cache)}: its blocks' elements are in "
                         f"another order.")
    return pool.view(storage_dtype(cache.dtype))


def swap_blocks(src, dst, pairs, *, stream=None):
    """Copy whole blocks between a device cache and a host pool.

    ``swap_blocks(cache, pool, pairs)`` swaps out (device block ``src`` ->
    host block ``dst``), ``swap_blocks(pool, cache, pairs)`` swaps in, as
    :meth:`BlockManager.swap_out` and :meth:`BlockManager.swap_in` return the
    pairs. Every layer of a layered cache is copied. The blocks go through a
    device staging array of at most 64 MB at a time: one gather (or scatter)
    kernel a chunk. The pairs are taken in the order of their host blocks;
    host blocks that form runs (``h, h + 1, ...``) of 16 KB or more on
    average are copied straight into (or from) the pool, one DMA a run;
    shorter runs go through a pinned buffer (kept for the process, at most
    64 MB) that NumPy scatters into (or gathers from) the pool, and the call
    then waits for the copies.

    Parameters
    ----------
    src, dst : PagedKVCache and host pool, in either order
        The host pool is a NumPy array from :func:`host_pool`, ``[num_host_blocks,
        (num_layers,) 2, block_size * num_kv_heads * head_size]`` in the cache's dtype.
    pairs : array_like of int, ``[num_pairs, 2]``
        ``(src_block, dst_block)``: source ids in the source's range, destination
        ids in the destination's, no destination twice.
    stream : optional
        Copy asynchronously on this stream (a numba, PyTorch or CuPy stream,
        or a raw ``cudaStream_t`` int; the host pool must then be pinned, as
        :func:`host_pool` makes it, and stay alive until the stream is
        synchronised; host blocks in short runs make the call wait for the
        stream, as NumPy gathers or scatters them); default None:
        synchronous copies. Ignored under the simulator.

    Raises
    ------
    ValueError
        Naming the offending pair or array, before anything is copied.

    Examples
    --------
    >>> import numpy as np
    >>> from paged_numba import PagedKVCache, write_kv, host_pool, swap_blocks
    >>> cache = PagedKVCache(num_blocks=4, block_size=2, num_kv_heads=1, head_size=8)
    >>> write_kv(cache, np.ones((1, 1, 8), np.float16), np.zeros((1, 1, 8), np.float16),
    ...          np.array([6]))                                  # block 3, offset 0
    >>> pool = host_pool(cache, 2)
    >>> swap_blocks(cache, pool, [(3, 1)])                       # out: device 3 -> host 1
    >>> pool[1, 0, :8].tolist()                                  # K of offset 0 ("nhd" order)
    [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    >>> swap_blocks(pool, cache, [(1, 0)])                       # in: host 1 -> device 0
    >>> cache.to_host()[0][0, 0, 0].tolist()
    [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    >>> swap_blocks(pool, cache, [(2, 0)])
    Traceback (most recent call last):
        ...
    ValueError: pairs[0, 0] (host block) is 2, outside [0, 2).
    """
    if isinstance(src, np.ndarray):
        cache, out = dst, False
    elif isinstance(dst, np.ndarray):
        cache, out = src, True
    else:
        raise TypeError(f"swap_blocks copies between a PagedKVCache and a NumPy host pool, but "
                        f"got {type(src).__name__} and {type(dst).__name__}.")
    _check_cache(cache)
    stream = numba_stream(stream)
    host = _check_host_pool(dst if out else src, cache, "dst" if out else "src")
    num_host = host.shape[0]
    arr = check_pairs(pairs, cache.num_blocks if out else num_host,
                      num_host if out else cache.num_blocks, same_pool=False,
                      src_name="device" if out else "host", dst_name="host" if out else "device")
    if arr.shape[0] == 0:
        return
    k, v, has_value = _flat_pools(cache)
    host = host.reshape(num_host, k.shape[0], 2 * _block_elems(cache))   # [.., layer, K|V]
    dev_ids, host_ids = (arr[:, 0], arr[:, 1]) if out else (arr[:, 1], arr[:, 0])
    # the pairs in host order (the order of a call's pairs does not matter: no
    # destination twice), so that host blocks that are neighbours form runs
    order = np.argsort(host_ids, kind="stable")
    dev_ids, host_ids = dev_ids[order], host_ids[order]
    vec, threads = _vector_threads(k, v)
    kernel = stage_blocks_kernel(vec, has_value, out)
    block_bytes = host[0].nbytes                       # one block, every layer, K and V
    chunk = max(1, min(len(arr), STAGING_BYTES // block_bytes))
    staging = cuda.device_array((chunk,) + host.shape[1:], host.dtype, stream=stream)
    for at in range(0, len(arr), chunk):
        ids, hids = dev_ids[at:at + chunk], host_ids[at:at + chunk]
        n = len(ids)
        d_ids = cuda.to_device(ids.astype(np.int32), stream=stream)
        runs = _runs(hids)
        direct = n * block_bytes >= MIN_RUN_BYTES * len(runs)    # runs long enough
        if out:
            launch(kernel, (n, k.shape[0]), threads, (k, v, d_ids, staging[:n]), stream=stream)
            if direct:      # one DMA a run, straight into the pool
                _copy_runs(staging, host, hids, runs, True, stream)
            else:           # into pinned memory, then scattered by NumPy
                buf = _bounce(staging[:n].shape, host.dtype)
                staging[:n].copy_to_host(buf, stream=stream)
                _wait(stream)
                host[hids] = buf
        else:
            if direct:
                _copy_runs(staging, host, hids, runs, False, stream)
            else:           # gathered by NumPy into pinned memory, then one DMA
                buf = _bounce(staging[:n].shape, host.dtype)
                np.take(host, hids, axis=0, out=buf)
                staging[:n].copy_to_device(buf, stream=stream)
            launch(kernel, (n, k.shape[0]), threads, (k, v, d_ids, staging[:n]), stream=stream)
            if not direct:
                _wait(stream)       # the next chunk (or call) reuses the pinned buffer
    if isinstance(stream, int) and stream == 0 and not config.ENABLE_CUDASIM:
        cuda.default_stream().synchronize()     # no stream: the copies are done on return


def _copy_runs(staging, host, hids, runs, out, stream):
    """One DMA a run ``(a, b)``: ``staging[a:b]`` to (``out``) or from
    ``host[hids[a]:hids[a] + b - a]``, enqueued on ``stream``. On a GPU each is
    one ``cuMemcpy*Async`` on the arrays' addresses (a few microseconds of
    host time; slicing numba arrays for each run cost tens), asynchronous for
    a pinned pool; under the simulator, copies between the slices."""
    if config.ENABLE_CUDASIM:
        for a, b in runs:
            if out:
                staging[a:b].copy_to_host(host[hids[a]:hids[a] + b - a])
            else:
                staging[a:b].copy_to_device(host[hids[a]:hids[a] + b - a])
        return
    from cuda.bindings import driver as drv

    row = host[0].nbytes                    # one block, every layer, K and V: a staging row
    hbase, dbase = host.ctypes.data, staging.device_ctypes_pointer.value
    handle = stream_handle(stream)
    ok = drv.CUresult.CUDA_SUCCESS
    for a, b in runs:
        h, d, nbytes = hbase + int(hids[a]) * row, dbase + a * row, (b - a) * row
        err, = (drv.cuMemcpyDtoHAsync(h, d, nbytes, handle) if out
                else drv.cuMemcpyHtoDAsync(d, h, nbytes, handle))
        if err != ok:
            raise RuntimeError(f"swap_blocks: a block copy failed: {err!r}")


def _wait(stream):
    """Wait for ``stream``'s copies (the default stream's copies already waited)."""
    if not (isinstance(stream, int) and stream == 0):
        stream.synchronize()


_bounce_buffer = [None]     # a pinned buffer reused by swaps of short runs (<= STAGING_BYTES)


def _bounce(shape, dtype):
    """A pinned host array of ``shape`` (one chunk of blocks), over a buffer kept
    for the process and grown when a larger chunk needs it: page-locking
    memory takes milliseconds, a fresh pageable array's first touch as long
    as the copy itself."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    held = _bounce_buffer[0]
    if held is None or held.nbytes < nbytes:
        held = np.zeros(nbytes, np.uint8) if config.ENABLE_CUDASIM else \
            cuda.pinned_array(nbytes, np.uint8)
        _bounce_buffer[0] = held
    return held[:nbytes].view(dtype).reshape(shape)


def _runs(ids):
    """``(a, b)`` slices of sorted ``ids`` where ``ids[a:b]`` are consecutive
    integers: ``[1, 2, 3, 7, 8]`` -> ``[(0, 3), (3, 5)]``."""
    cuts = np.flatnonzero(np.diff(ids) != 1) + 1
    edges = [0, *cuts.tolist(), len(ids)]
    return list(zip(edges[:-1], edges[1:]))
