"""The device guard (``paged_numba.kernels.guard``): with validation off, an
index outside the pools is not followed; the kernel records the first one,
and ``PagedKVCache.check`` raises it."""
import numpy as np
import pytest

import paged_numba as pn


def _device(x):
    return pn._arrays.as_device(np.asarray(x), "x")[0]


def _tokens(n, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, 2, 16)).astype(np.float16),
            rng.standard_normal((n, 2, 16)).astype(np.float16))


@pytest.mark.parametrize("bad", [8 * 3, 10 ** 12, -2, -(2 ** 40)])
@pytest.mark.parametrize("dtype", ["float16", "float8_e4m3fn"])
def test_write_kv_skips_and_records_a_slot_outside_the_pool(bad, dtype):
    cache = pn.PagedKVCache(3, 8, 2, 16, dtype)
    k, v = _tokens(3)
    pn.write_kv(cache, k, v, [5, 17, 0])                       # the contents before
    before = cache.to_host()
    k2, v2 = _tokens(3, seed=1)
    pn.write_kv(cache, k2, v2, _device(np.array([2, bad, -1])), validate=False)
    with pytest.raises(ValueError, match=rf"write_kv was given slot_mapping\[1\] = {bad} "
                                         r"\(validate=False\), outside \[0, 24\)"):
        cache.check()
    cache.check()                                             # cleared: nothing more to say
    # token 0 went to slot 2; the bad token and the padding token wrote nothing
    after = cache.to_host()
    expect = pn.PagedKVCache(3, 8, 2, 16, dtype)
    pn.write_kv(expect, k, v, [5, 17, 0])
    pn.write_kv(expect, k2[:1], v2[:1], [2])
    for got, want, old in zip(after, expect.to_host(), before):
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8))
        assert not np.array_equal(got.view(np.uint8), old.view(np.uint8))   # slot 2 changed


def test_the_first_of_several_offences_is_recorded_and_the_good_tokens_written():
    cache = pn.PagedKVCache(2, 4, 2, 16)
    k, v = _tokens(4)
    pn.write_kv(cache, k, v, _device(np.array([9, 1, -7, 6], np.int32)), validate=False)
    with pytest.raises(ValueError, match=r"slot_mapping\[(0\] = 9|2\] = -7) "):
        cache.check()
    K, V = cache.to_host()
    assert np.array_equal(K[0, 1], k[1]) and np.array_equal(V[1, 2], v[3])
    assert not K[0, 0].any() and not K[1, 3].any()


def test_layers_share_one_error_word_and_good_writes_record_nothing():
    cache = pn.PagedKVCache(2, 4, 2, 16, num_layers=3)
    k, v = _tokens(2)
    pn.write_kv(cache.layer(0), k, v, _device(np.array([0, 7])), validate=False)
    cache.check()                                             # all in the pool
    pn.write_kv(cache.layer(2), k, v, _device(np.array([3, 8])), validate=False)
    with pytest.raises(ValueError, match=r"slot_mapping\[1\] = 8 .*outside \[0, 8\)"):
        cache.layer(1).check()
    cache.check()
    assert not cache.to_host()[0][2, 1].any()                 # layer 2 of the 8th slot: none
