"""PagedKVCache layouts, write_kv and gather."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import paged_numba as pn
from paged_numba.layouts import from_nhd, to_nhd


@st.composite
def writes(draw):
    """A cache geometry and a batch of tokens with distinct slots, some padding."""
    block_size = draw(st.sampled_from([1, 5, 8, 16, 32]))
    num_blocks = draw(st.integers(1, 6))
    num_kv_heads = draw(st.integers(1, 3))
    head_size = draw(st.sampled_from([8, 16, 64, 80]))
    slots = draw(st.lists(st.integers(0, num_blocks * block_size - 1), unique=True,
                          min_size=0, max_size=min(12, num_blocks * block_size)))
    pads = draw(st.lists(st.integers(0, len(slots)), max_size=3))
    for i in sorted(pads, reverse=True):
        slots.insert(i, -1)
    return dict(num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_kv_heads,
                head_size=head_size,
                dtype=draw(st.sampled_from(["float16", "float32", "bfloat16"])),
                layout=draw(st.sampled_from(["nhd", "vllm", "hnd", "interleaved"])),
                slots=np.array(slots, np.int64), seed=draw(st.integers(0, 2**32 - 1)))


@given(writes())
def test_write_then_gather_returns_what_was_written(w):
    rng = np.random.default_rng(w["seed"])
    before_k, before_v = (rng.standard_normal((w["num_blocks"], w["block_size"], w["num_kv_heads"],
                                               w["head_size"])).astype(w["dtype"]) for _ in "kv")
    cache = pn.PagedKVCache.from_host(*from_nhd(before_k, before_v, w["layout"]), w["layout"])
    assert cache.dtype == np.dtype(w["dtype"])
    n = len(w["slots"])
    key = rng.standard_normal((n, w["num_kv_heads"], w["head_size"])).astype(w["dtype"])
    value = rng.standard_normal(key.shape).astype(w["dtype"])
    pn.write_kv(cache, key, value, w["slots"])

    expect_k, expect_v = before_k.reshape(-1, *key.shape[1:]), before_v.reshape(-1, *key.shape[1:])
    real = w["slots"] >= 0
    expect_k[w["slots"][real]] = key[real]       # padding tokens change nothing
    expect_v[w["slots"][real]] = value[real]
    got_k, got_v = cache.to_host("nhd")
    assert np.array_equal(got_k.reshape(expect_k.shape), expect_k)
    assert np.array_equal(got_v.reshape(expect_v.shape), expect_v)
    # gather un-pages the written tokens in table order
    table = np.arange(w["num_blocks"])[::-1]
    K, V = cache.gather(table, w["num_blocks"] * w["block_size"])
    order = (table[:, None] * w["block_size"] + np.arange(w["block_size"])).reshape(-1)
    assert np.array_equal(K, expect_k[order]) and np.array_equal(V, expect_v[order])


def test_prefill_and_decode_in_one_launch():
    # sequence A prefills 5 tokens into block 2 (slots 16..20 with block 8);
    # sequences B and C decode one token each, into slots 3 and 9 (block 1, offset 1).
    cache = pn.PagedKVCache(4, 8, 1, 8, "float32")
    key = np.arange(7 * 8, dtype=np.float32).reshape(7, 1, 8)
    pn.write_kv(cache, key, -key, np.array([16, 17, 18, 19, 20, 3, 9]))
    K, V = cache.gather([2], 5)
    assert np.array_equal(K, key[:5]) and np.array_equal(V, -key[:5])
    K, _ = cache.gather([0, 1], 10)
    assert np.array_equal(K[3], key[5]) and np.array_equal(K[9], key[6])
    assert not K[[0, 1, 2, 4, 5, 6, 7, 8]].any()


def test_new_cache_is_zero_and_repr_shows_bytes():
    cache = pn.PagedKVCache(3, 16, 2, 64, layout="vllm")
    k, v = cache.to_host()
    assert not k.any() and not v.any()
    assert cache.key_cache.shape == (3, 2, 8, 16, 8) and cache.value_cache.shape == (3, 2, 64, 16)
    # 2 pools * 3 blocks * 16 tokens * 2 heads * 64 elements * 2 bytes
    assert cache.nbytes == 2 * 3 * 16 * 2 * 64 * 2
    assert f"{cache.nbytes} bytes" in repr(cache) and "layout='vllm'" in repr(cache)


@given(st.sampled_from(["float16", "float32", "bfloat16"]), st.integers(1, 3), st.integers(1, 4),
       st.sampled_from([8, 16, 24]), st.integers(1, 9))
def test_layout_round_trip(dtype, nb, nkv, hd, bs):
    rng = np.random.default_rng(0)
    k = rng.standard_normal((nb, bs, nkv, hd)).astype(dtype)
    v = rng.standard_normal((nb, bs, nkv, hd)).astype(dtype)
    k2, v2 = to_nhd(*from_nhd(k, v, "vllm"), "vllm")
    assert np.array_equal(k, k2) and np.array_equal(v, v2)


def test_layered_cache_layers_share_block_ids_and_not_memory():
    """A model-wide cache: one allocator's block table serves every layer,
    each layer's tokens land in that layer only, and decode on a layer view
    matches the reference on that layer's pools."""
    from paged_numba.reference import paged_decode_reference
    from paged_numba.testing import check_close, decode_bounds, DecodeProblem

    num_layers, bs, kvh, hs = 3, 8, 2, 16
    cache = pn.PagedKVCache(6, bs, kvh, hs, "float32", "hnd", num_layers=num_layers)
    assert cache.key_cache.shape == (num_layers, 6, kvh, bs, hs)
    assert cache.nbytes == 2 * num_layers * 6 * bs * kvh * hs * 4
    assert "num_layers=3 x" in repr(cache)
    alloc = pn.BlockAllocator(6, bs)
    alloc.allocate("a", 13)                      # 13 = 8 + 5: two blocks
    table, lens, slots = alloc.block_table(), alloc.seq_lens(), alloc.slot_mapping("a", 0, 13)
    rng = np.random.default_rng(1)
    kv = [rng.standard_normal((2, 13, kvh, hs)).astype(np.float32) for _ in range(num_layers)]
    for layer, (k, v) in enumerate(kv):
        pn.write_kv(cache.layer(layer), k, v, slots)
    host_k, host_v = cache.to_host()             # [num_layers, num_blocks, bs, kvh, hs] ("nhd")
    q = rng.standard_normal((1, 4, hs)).astype(np.float32)
    p = DecodeProblem(num_seqs=1, num_heads=4, num_kv_heads=kvh, head_size=hs, block_size=bs,
                      num_blocks=6, layout="hnd", dtype="float32", seq_lens=lens,
                      block_tables=table, seed=0)
    for layer, (k, v) in enumerate(kv):
        got_k, got_v = cache.layer(layer).gather(table[0], 13)
        assert np.array_equal(got_k, k) and np.array_equal(got_v, v)   # no layer leaks into another
        out = pn.paged_decode(q, cache.layer(layer), table, lens)
        ref, _ = paged_decode_reference(q, host_k[layer], host_v[layer], table, lens)
        check_close(out, ref, decode_bounds(p, q, host_k[layer], host_v[layer])[0])
    with pytest.raises(ValueError, match="num_layers=3; kernels take one layer"):
        pn.paged_decode(q, cache, table, lens)
    with pytest.raises(ValueError, match=r"layer must be an integer in \[0, 3\), but got 3"):
        cache.layer(3)
