"""Copy whole physical blocks inside a KV pool (vLLM's ``copy_blocks``).

NumPy spec, for each pair ``p`` and each layer ``l``::

    src, dst = pairs[p]
    key_cache[l, dst] = key_cache[l, src]        # and the same for value_cache
                                                 # (not for "interleaved": one pool)

In every layout a physical block is the contiguous slab ``pool[l, b]`` (the
block axis comes first, after the layer axis), so the kernel sees each pool
as ``[num_layers, num_blocks, block_elems]`` and does not depend on the
layout. Blocks whose size is a multiple of 16 bytes move as 16-byte vectors
(``vector.copy16``), others element by element.

One thread block per (pair, layer); its threads stride over the block's
vectors. The wrapper (``paged_numba.blocks``) checks that no destination is
written twice and that no destination is also a source, so the thread
blocks are independent.
"""
import functools

from numba import cuda

from .convert import device_function
from .vector import copy16


@functools.cache
def copy_blocks_kernel(vec, has_value):
    """Kernel ``(key_cache, value_cache, pairs)``; grid ``(num_pairs, num_layers)``.

    ``key_cache``/``value_cache`` are ``[num_layers, num_blocks, block_elems]``
    (C-contiguous), ``pairs`` is ``[num_pairs, 2]`` int (source, destination).
    ``vec`` is the elements per 16-byte vector (``block_elems`` a multiple of
    it, 16-byte aligned pools), or 1 for element copies. With ``has_value``
    False only ``key_cache`` is copied (the one pool of "interleaved").
    """
    VEC = vec

    if VEC == 1:
        @device_function
        def move(pool, layer, src, dst, i):
            pool[layer, dst, i] = pool[layer, src, i]
    else:
        @device_function
        def move(pool, layer, src, dst, i):
            num_blocks = pool.shape[1]
            elems = pool.shape[2]
            copy16(pool, (layer * num_blocks + src) * elems + i * VEC,
                   pool, (layer * num_blocks + dst) * elems + i * VEC)

    if has_value:
        @device_function
        def move_kv(kc, vc, layer, src, dst, i):
            move(kc, layer, src, dst, i)
            move(vc, layer, src, dst, i)
    else:
        @device_function
        def move_kv(kc, vc, layer, src, dst, i):
            move(kc, layer, src, dst, i)

    @cuda.jit
    def copy_blocks_kernel(key_cache, value_cache, pairs):
        p = cuda.blockIdx.x
        layer = cuda.blockIdx.y
        src = pairs[p, 0]
        dst = pairs[p, 1]
        for i in range(cuda.threadIdx.x, key_cache.shape[2] // VEC, cuda.blockDim.x):
            move_kv(key_cache, value_cache, layer, src, dst, i)

    return copy_blocks_kernel


@functools.cache
def stage_blocks_kernel(vec, has_value, gather):
    """Kernel ``(key_cache, value_cache, ids, staging)``; grid ``(num_ids, num_layers)``:
    the blocks ``ids`` of the pools and a contiguous staging array, for swaps
    between a device cache and a host pool (one DMA a chunk of blocks).

    NumPy spec, for each ``i`` and layer ``l`` (``half = block_elems``)::

        staging[i, l, :half] = key_cache[l, ids[i]]    # gather; scatter the other way
        staging[i, l, half:] = value_cache[l, ids[i]]  # (not for "interleaved": one pool,
                                                       #  staging[i, l] = key_cache[l, ids[i]])

    ``key_cache``/``value_cache`` are ``[num_layers, num_blocks, block_elems]``,
    ``staging`` ``[num_ids, num_layers, 2 * block_elems]`` (``block_elems`` for
    "interleaved"), all C-contiguous; ``ids`` int, no id twice when scattering.
    ``vec`` as for :func:`copy_blocks_kernel`.
    """
    VEC = vec
    GATHER = gather

    @device_function
    def move(pool, layer, b, staging, i, at, e):
        if VEC == 1:
            if GATHER:
                staging[i, layer, at + e] = pool[layer, b, e]
            else:
                pool[layer, b, e] = staging[i, layer, at + e]
        else:
            p = (layer * pool.shape[1] + b) * pool.shape[2] + e * VEC
            q = (i * staging.shape[1] + layer) * staging.shape[2] + at + e * VEC
            if GATHER:
                copy16(pool, p, staging, q)
            else:
                copy16(staging, q, pool, p)

    @cuda.jit
    def stage_blocks_kernel(key_cache, value_cache, ids, staging):
        i = cuda.blockIdx.x
        layer = cuda.blockIdx.y
        b = ids[i]
        half = key_cache.shape[2]
        for e in range(cuda.threadIdx.x, half // VEC, cuda.blockDim.x):
            move(key_cache, layer, b, staging, i, 0, e)
            if has_value:
                move(value_cache, layer, b, staging, i, half, e)

    return stage_blocks_kernel
