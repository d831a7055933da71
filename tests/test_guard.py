"""The device guard (``paged_numba.kernels.guard``): with validation off, an
index outside the pools is not followed; the kernel records the first one,
and ``PagedKVCache.check`` raises it."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


@settings(max_examples=15) if pn.simulator_enabled() else (lambda f: f)   # GPU: the profile's
@given(data=st.data(), dtype=st.sampled_from(["float16", "float8_e4m3fn"]))
def test_write_kv_with_any_slot_mapping_writes_the_good_tokens_and_reports_a_bad_one(data, dtype):
    """Any mix of slots in the pool (distinct), padding (-1), and ids past either
    end (up to 2**40 away), written without validation: the pools end as a
    validated write of the good tokens alone leaves them, and ``check`` names
    one of the bad entries with its value (the first the device met), then
    nothing."""
    num_blocks, block_size = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 8))
    size = num_blocks * block_size
    n = data.draw(st.integers(1, 12))
    kinds = data.draw(st.lists(st.sampled_from(["good", "pad", "high", "low"]), min_size=n,
                               max_size=n))
    free = iter(data.draw(st.permutations(range(size))))
    mapping = []
    for kind in kinds:
        if kind == "good":
            kind = next(free, None)
        mapping.append(kind if isinstance(kind, int) else
                       -1 if kind in ("pad", None) else
                       data.draw(st.sampled_from([size, size + 1, 2 ** 31, 2 ** 32 + 1])
                                 | st.integers(size, size + 2 ** 40)) if kind == "high" else
                       data.draw(st.sampled_from([-2, -size - 1, -(2 ** 31), -(2 ** 32) + 1])
                                 | st.integers(-(2 ** 40), -2)))
    mapping = np.array(mapping, np.int64)
    k, v = _tokens(n, seed=data.draw(st.integers(0, 2 ** 16)))
    cache = pn.PagedKVCache(num_blocks, block_size, 2, 16, dtype)
    expect = pn.PagedKVCache(num_blocks, block_size, 2, 16, dtype)
    old_k, old_v = _tokens(size, seed=1)
    for c in (cache, expect):                                 # the same contents before
        pn.write_kv(c, old_k, old_v, list(range(size)))
    pn.write_kv(cache, k, v, _device(mapping), validate=False)
    good = (mapping >= 0) & (mapping < size)
    if good.any():
        pn.write_kv(expect, k[good], v[good], mapping[good].tolist())
    bad = np.flatnonzero(~good & (mapping != -1))
    if len(bad):
        named = "|".join(rf"{i}\] = {mapping[i]}" for i in bad)
        with pytest.raises(ValueError, match=rf"slot_mapping\[({named}) \(validate=False\)"):
            cache.check()
    cache.check()                                             # nothing (more) to say
    for got, want in zip(cache.to_host(), expect.to_host()):
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8))


# -- prefill: a table with ids outside the pool, run without validation --------
def _prefill_case(dtype):
    """Two sequences (5 new tokens after 3 cached; 4 new) over a pool of 6
    blocks of 4 tokens, 2 query heads on 1 KV head, head size 16."""
    rng = np.random.default_rng(5)
    k = rng.standard_normal((6, 4, 1, 16)).astype(dtype)
    v = rng.standard_normal((6, 4, 1, 16)).astype(dtype)
    cache = pn.PagedKVCache.from_host(k, v)
    q = _device(rng.standard_normal((9, 2, 16)).astype(dtype))
    table = np.array([[4, 0, -1], [2, 5, -1]], np.int32)
    return cache, q, table


TILINGS = {
    "cuda-cores": ("float32", dict(tensor_cores=False, block_q=2, block_n=4, num_warps=1)),
    "mma-sync": ("float16", dict(tensor_cores=True, block_n=16, num_warps=1)),
    "producer": ("float16", dict(tensor_cores=True, block_n=16, num_warps=4,
                                 kernel_options=dict(wgmma=True, producer=True))),
}


@pytest.mark.parametrize("kernel", TILINGS)
@pytest.mark.parametrize("bad", [6, 2 ** 31 - 1, -1, -9])
def test_prefill_plan_reads_block_zero_for_an_id_outside_the_pool(kernel, bad):
    """A plan validates the buffers it is first given; new contents of the same
    buffer it does not (that is what makes ``run`` cheap)."""
    dtype, tiling = TILINGS[kernel]
    cache, q, table = _prefill_case(dtype)
    plan = pn.PrefillPlan(cache, [0, 5, 9], [8, 4], 2, **tiling)
    dt = _device(table)

    def run(entry):
        table[0, 1] = entry                                   # sequence 0's second block
        dt.copy_to_device(table)
        return np.asarray(pn._arrays.to_host(plan.run(q, dt))).copy()

    want = run(0)
    clean = run(5)
    cache.check()                                             # good ids: nothing recorded
    got = run(bad)
    with pytest.raises(ValueError, match=rf"block_tables\[0, 1\] = {bad} \(validate=False\), "
                                         r"outside \[0, 6\); it read block 0"):
        plan.cache.check()
    assert np.array_equal(got[5:], clean[5:])                 # sequence 1 as before
    assert np.array_equal(got[:5], want[:5])                  # 0 as if its block were block 0
    assert not np.array_equal(got[:5], clean[:5])
    cache.check()


def test_group_decode_clamps_a_length_beyond_the_table():
    """MQA decode (32 heads on one KV head) runs on the prefill tile with the
    lengths given at run time: one longer than its table row holds is taken
    as the row's capacity, a negative one as 0."""
    rng = np.random.default_rng(6)
    k = rng.standard_normal((4, 16, 1, 32)).astype(np.float16)
    cache = pn.PagedKVCache.from_host(k, -k)
    q = _device(rng.standard_normal((3, 32, 32)).astype(np.float16))
    table = _device(np.array([[1, 3], [0, 2], [2, -1]], np.int32))
    lens = _device(np.array([20, 32, 9], np.int32))
    plan = pn.DecodePlan(cache, 3, 32, 2)
    assert plan.heads_per_block in (16, 32)                   # the prefill tile

    def run(*values):
        lens.copy_to_device(np.array(values, np.int32))
        return np.asarray(pn._arrays.to_host(plan.run(q, table, lens))).copy()

    clean = run(20, 32, 9)
    cache.check()
    got = run(20, 40, 9)
    with pytest.raises(ValueError, match=r"seq_lens\[1\] = 40 \(validate=False\)"):
        cache.check()
    assert np.array_equal(got, clean)                         # 40 taken as 32: the same
    got = run(20, 32, -3)
    with pytest.raises(ValueError, match=r"seq_lens\[2\] = -3 "):
        cache.check()
    assert np.array_equal(got[:2], clean[:2]) and not got[2].any()    # no keys: zeros
