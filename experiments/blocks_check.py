"""The checks of ``bench_blocks.py``: after each timed ``copy_blocks`` or
``swap_blocks`` the bytes that moved are compared with what should have moved,
every block of a small cache or a random sample of a large one (every layer)."""
import numpy as np
from numba import cuda

import paged_numba as pn
from paged_numba.blocks import _flat_pools

FULL_CHECK_BYTES = 2 * 2**30    # caches up to this size are checked block by block, entirely
CHECK_PAIRS = 64                # else this many random pairs, every layer


def pools_of(cache):
    """The cache's distinct pools (one for "interleaved") as ``[layers, blocks, elems]``."""
    k, v, has_value = _flat_pools(cache)
    return [k, v] if has_value else [k]


def bits_of(pools, ids=None):
    """Host copies of the pools' blocks ``ids`` (all when None), as uint16
    ``[layers, len(ids), elems]`` each."""
    out = []
    for p in pools:
        if ids is None:
            out.append(p.copy_to_host().view(np.uint16))
            continue
        a = np.empty((p.shape[0], len(ids), p.shape[2]), np.uint16)
        for layer in range(p.shape[0]):
            for j, b in enumerate(ids):
                a[layer, j] = p[layer, int(b)].copy_to_host().view(np.uint16)
        out.append(a)
    return out


def check(ok, what):
    if not ok:
        raise AssertionError(f"{what}: the moved blocks differ from their sources")


def verify_copy(cache, pairs, rng):
    """Run ``copy_blocks(cache, pairs)`` once and compare with NumPy's copy."""
    pools = pools_of(cache)
    src, dst = pairs[:, 0], pairs[:, 1]
    if cache.nbytes <= FULL_CHECK_BYTES:
        before = bits_of(pools)
        pn.copy_blocks(cache, pairs)
        cuda.synchronize()
        for b, a in zip(before, bits_of(pools)):
            want = b.copy()
            want[:, dst] = b[:, src]
            check(np.array_equal(a, want), "copy_blocks")
        return "all blocks"
    n = min(CHECK_PAIRS, len(pairs))
    pick = rng.choice(len(pairs), n, replace=False)
    ids = np.concatenate([src[pick], dst[pick]])
    before = bits_of(pools, ids)
    check(not any(np.array_equal(b[:, :n], b[:, n:]) for b in before),
          "copy_blocks (sources equal destinations before the copy)")
    pn.copy_blocks(cache, pairs)
    cuda.synchronize()
    for b, a in zip(before, bits_of(pools, ids)):
        check(np.array_equal(a[:, :n], b[:, :n]) and np.array_equal(a[:, n:], b[:, :n]),
              "copy_blocks")
    return f"{n} pairs"


def host_bits(host, layers):
    """The host pool as uint16 ``[host_blocks, layers, K | V]``."""
    return host.view(np.uint16).reshape(host.shape[0], layers, -1)


def verify_swap(cache, host, dev_ids, host_ids, out, rng):
    """Swap ``dev_ids`` out to ``host_ids`` (``out``) or in from them once, and
    compare with NumPy: host block ``h`` is K then V of device block ``d``,
    every layer. The checked host blocks are changed first (swapping out: to
    NaNs, which the fill never writes; in: their lowest bit flipped), so that
    blocks already equal cannot pass."""
    pools = pools_of(cache)
    layers = pools[0].shape[0]
    hb = host_bits(host, layers)
    full = cache.nbytes <= FULL_CHECK_BYTES
    pick = (np.arange(len(dev_ids)) if full
            else rng.choice(len(dev_ids), min(CHECK_PAIRS, len(dev_ids)), replace=False))
    d, h = dev_ids[pick], host_ids[pick]
    pairs = np.stack([dev_ids, host_ids] if out else [host_ids, dev_ids], axis=1)
    name = f"swap_blocks {'out' if out else 'in'}"
    if out:
        if full:
            hb.fill(0x7E00)
        else:
            hb[h] = 0x7E00
        pn.swap_blocks(cache, host, pairs)
        dev = [b[:, d] for b in bits_of(pools)] if full else bits_of(pools, d)
        check(np.array_equal(hb[h], np.concatenate(dev, axis=2).transpose(1, 0, 2)), name)
    else:
        if full:
            np.bitwise_xor(hb, 1, out=hb)
        else:
            hb[h] ^= 1
        before = bits_of(pools) if full else None
        pn.swap_blocks(host, cache, pairs)
        cuda.synchronize()
        got = bits_of(pools) if full else bits_of(pools, d)
        at = 0
        for n, p in enumerate(pools):
            sent = hb[h][:, :, at:at + p.shape[2]].transpose(1, 0, 2)   # [layers, picked, elems]
            at += p.shape[2]
            if full:
                want = before[n].copy()
                want[:, d] = sent
                check(np.array_equal(got[n], want), name)
            else:
                check(np.array_equal(got[n], sent), name)
    return "all blocks" if full else f"{len(pick)} pairs"


# -- cases -----------------------------------------------------------------------------------
