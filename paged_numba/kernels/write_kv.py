"""Scatter new keys and values into their cache slots (vLLM's reshape_and_cache).

NumPy spec, for token ``t`` with ``slot = slot_mapping[t]``::

    if slot == -1: skip                      # padding token
    block, offset = divmod(slot, block_size)
    key_cache[block, offset, :, :] = key[t]  # in "nhd"; other layouts place
    value_cache[block, offset] = value[t]    # the same elements elsewhere

For an fp8 cache (``fp8`` names the format) the kernel also takes
``kv_scales [2, num_kv_heads]`` float32 (K's scales, then V's) and stores
``encode(float32(key[t, h, d]) / kv_scales[0, h])`` (and the same for
values): the float32 quotient rounded to the nearest fp8 code, saturating,
NaN kept (``kernels.fp8.encoder``). The input elements may be fp16, fp32 or
bf16 bits (``uint16``): the conversion follows the array's type.

A slot that is neither -1 nor in ``[0, num_blocks * block_size)`` (possible
only when the caller skipped validation) is not written: the kernel records
it in ``errors [4]`` int64 (:mod:`.guard`) and leaves the cache untouched.

One thread block per token, threads striding over ``num_kv_heads * head_size``.
"""
import functools

from numba import cuda, int64

from .access import element_accessors
from .convert import device_function
from .fp8 import encoder, to_f32_any
from .guard import SLOT, offend


@functools.cache
def write_kv_kernel(block_size, layout, vec, num_threads=128, fp8=None):
    """Kernel ``(key_cache, value_cache, key, value, slot_mapping, errors)``,
    with ``kv_scales`` last for an ``fp8`` format; grid ``(num_tokens,)``."""
    BLOCK_SIZE = block_size
    NT = num_threads
    _, _, k_put, v_put = element_accessors(layout, vec)

    @device_function
    def slot_of(key_cache, slot_mapping, errors, t):
        """Token ``t``'s slot, or -1 for padding and for a slot outside the
        pool (recorded)."""
        slot = int64(slot_mapping[t])
        if slot < -1 or slot >= int64(key_cache.shape[0]) * BLOCK_SIZE:
            if cuda.threadIdx.x == 0:
                offend(errors, SLOT, t, t, slot)
            slot = int64(-1)
        return slot

    if fp8 is not None:
        encode = encoder(fp8)

        @cuda.jit
        def write_kv_fp8_kernel(key_cache, value_cache, key, value, slot_mapping, errors,
                                kv_scales):
            t = cuda.blockIdx.x
            slot = slot_of(key_cache, slot_mapping, errors, t)
            if slot < 0:
                return  # padding token: the cache is left untouched
            blk = slot // BLOCK_SIZE
            off = slot % BLOCK_SIZE
            num_kv_heads = key.shape[1]
            head_size = key.shape[2]
            for i in range(cuda.threadIdx.x, num_kv_heads * head_size, NT):
                h = i // head_size
                d = i % head_size
                k_put(key_cache, blk, h, off, d, encode(to_f32_any(key[t, h, d]) / kv_scales[0, h]))
                v_put(value_cache, blk, h, off, d,
                      encode(to_f32_any(value[t, h, d]) / kv_scales[1, h]))

        return write_kv_fp8_kernel

    @cuda.jit
    def write_kv_kernel(key_cache, value_cache, key, value, slot_mapping, errors):
        t = cuda.blockIdx.x
        slot = slot_of(key_cache, slot_mapping, errors, t)
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
