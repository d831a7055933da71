"""Scatter new keys and values into their cache slots (vLLM's reshape_and_cache).

NumPy spec, for token ``t`` with ``slot = slot_mapping[t]``::

    if slot == -1: skip                      # padding token
    block, offset = divmod(slot, block_size)
    key_cache[block, offset, :, :] = key[t]  # in "nhd"; other layouts place
    value_cache[block, offset] = value[t]    # the same elements elsewhere

One thread block per token, threads striding over ``num_kv_heads * head_size``.
"""
import functools

from numba import cuda

from .access import element_accessors


@functools.cache
def write_kv_kernel(block_size, layout, vec, num_threads=128):
    """Kernel ``(key_cache, value_cache, key, value, slot_mapping)``; grid ``(num_tokens,)``."""
    BLOCK_SIZE = block_size
    NT = num_threads
    _, _, k_put, v_put = element_accessors(layout, vec)

    @cuda.jit
    def write_kv_kernel(key_cache, value_cache, key, value, slot_mapping):
        t = cuda.blockIdx.x
        slot = slot_mapping[t]
        if slot < 0:
            return  # padding token: the cache is left untouched
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        num_kv_heads = key.shape[1]
        head_size = key.shape[2]
        for i in range(cuda.threadIdx.x, num_kv_heads * head_size, NT):
            h = i // head_size
            d = i % head_size
            k_put(key_cache, blk, h, off, d, key[t, h, d])
            v_put(value_cache, blk, h, off, d, value[t, h, d])

    return write_kv_kernel
