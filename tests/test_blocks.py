"""Tests for paged_numba/blocks.py (copy_blocks, swap_blocks, host_pool) on
tiny caches, and a short run of the real kernels with a BlockManager: write,
fork, copy-on-write, decode, compared with the reference over each
sequence's own tokens."""
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import paged_numba as pn
from numba import cuda
from paged_numba import BlockManager, PagedKVCache, copy_blocks, host_pool, swap_blocks
from paged_numba.reference import attention

LAYOUTS = ("nhd", "vllm", "hnd", "interleaved")
DTYPES = ("float16", "float32", "bfloat16")


def random_cache(layout, dtype, num_blocks=5, block_size=2, num_kv_heads=1, head_size=8,
                 num_layers=None, seed=0):
    """A cache filled with random values, and its pools on the host (in storage bits)."""
    cache = PagedKVCache(num_blocks, block_size, num_kv_heads, head_size, dtype=dtype,
                         layout=layout, num_layers=num_layers)
    rng = np.random.default_rng(seed)
    k = rng.standard_normal(cache.key_cache.shape).astype(np.float32).astype(cache.dtype)
    cache.key_cache.copy_to_device(pn._arrays.host_bits(k))
    if layout != "interleaved":
        v = rng.standard_normal(cache.value_cache.shape).astype(np.float32).astype(cache.dtype)
        cache.value_cache.copy_to_device(pn._arrays.host_bits(v))
    return cache


def pools(cache):
    """Host copies of the pools, the block axis first after the layer axis."""
    return cache.key_cache.copy_to_host(), cache.value_cache.copy_to_host()


def expected_after_copy(pool, pairs, layered):
    out = pool.copy()
    for s, d in pairs:
        if layered:
            out[:, d] = pool[:, s]
        else:
            out[d] = pool[s]
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_every_layout_and_dtype(layout, dtype):
    cache = random_cache(layout, dtype)
    k0, v0 = pools(cache)
    pairs = [(1, 0), (1, 4), (3, 2)]        # one source to two destinations
    copy_blocks(cache, pairs)
    k1, v1 = pools(cache)
    np.testing.assert_array_equal(k1, expected_after_copy(k0, pairs, False))
    np.testing.assert_array_equal(v1, expected_after_copy(v0, pairs, False))


@pytest.mark.parametrize("layout", ["vllm", "interleaved"])
def test_copy_blocks_layered_copies_every_layer(layout):
    cache = random_cache(layout, "bfloat16", num_layers=3, seed=1)
    k0, v0 = pools(cache)
    pairs = np.array([[4, 0], [2, 3]])
    stream = cuda.stream()
    copy_blocks(cache, pairs, stream=stream)
    stream.synchronize()
    k1, v1 = pools(cache)
    np.testing.assert_array_equal(k1, expected_after_copy(k0, pairs, True))
    np.testing.assert_array_equal(v1, expected_after_copy(v0, pairs, True))


def test_copy_blocks_without_16_byte_blocks():
    # 1 * 1 * 4 * 2 = 8 bytes per block: element copies
    cache = random_cache("nhd", "float16", num_blocks=3, block_size=1, head_size=4)
    k0, v0 = pools(cache)
    copy_blocks(cache, [(2, 0)])
    k1, v1 = pools(cache)
    np.testing.assert_array_equal(k1, expected_after_copy(k0, [(2, 0)], False))
    np.testing.assert_array_equal(v1, expected_after_copy(v0, [(2, 0)], False))


@settings(max_examples=5) if pn.simulator_enabled() else (lambda f: f)   # GPU: the profile's
@given(data=st.data(), layout=st.sampled_from(LAYOUTS))
def test_copy_blocks_random_pairs(data, layout):
    num_blocks = 6
    dsts = data.draw(st.lists(st.integers(0, num_blocks - 1), min_size=1, max_size=3, unique=True))
    others = [b for b in range(num_blocks) if b not in dsts]
    srcs = data.draw(st.lists(st.sampled_from(others), min_size=len(dsts), max_size=len(dsts)))
    pairs = list(zip(srcs, dsts))
    cache = random_cache(layout, "float32", num_blocks=num_blocks, seed=2)
    k0, v0 = pools(cache)
    copy_blocks(cache, pairs)
    k1, v1 = pools(cache)
    np.testing.assert_array_equal(k1, expected_after_copy(k0, pairs, False))
    np.testing.assert_array_equal(v1, expected_after_copy(v0, pairs, False))


def test_copy_blocks_many_calls_in_a_row():
    """Back-to-back calls (more than the launcher's buffers, growing past their
    first size, on two streams in turn on a GPU, with no waits between them)
    each copy their own pairs: a buffer rewritten before its kernel read it
    would copy another call's. The calls' blocks are disjoint, so the streams
    may run them in any order."""
    sizes = [3, 200, 7, 300, 1, 260, 5, 2]
    num_blocks = 2 * sum(sizes)
    cache = random_cache("nhd", "float16", num_blocks=num_blocks, block_size=1, head_size=8,
                         seed=5)
    k, v = pools(cache)
    perm = np.random.default_rng(5).permutation(num_blocks)
    streams = [None] if pn.simulator_enabled() else [cuda.stream(), cuda.stream()]
    at = 0
    for call, n in enumerate(sizes):
        pairs = np.stack([perm[at:at + n], perm[at + n:at + 2 * n]], axis=1)
        at += 2 * n
        copy_blocks(cache, pairs, stream=streams[call % len(streams)])
        k, v = expected_after_copy(k, pairs, False), expected_after_copy(v, pairs, False)
    cuda.synchronize()
    k1, v1 = pools(cache)
    np.testing.assert_array_equal(k1, k)
    np.testing.assert_array_equal(v1, v)


@pytest.mark.parametrize("pairs, match", [
    ([(0, 1, 2)], r"pairs must be \[num_pairs, 2\] .* \(1, 3\)"),
    ([[0.0, 1.0]], "integer block ids, but got dtype float64"),
    ([(5, 1)], r"pairs\[0, 0\] \(source block\) is 5, outside \[0, 5\)"),
    ([(0, 1), (0, -1)], r"pairs\[1, 1\] \(destination block\) is -1, outside \[0, 5\)"),
    ([(0, 2), (1, 2)], r"destination block 2 appears twice in pairs \(pairs\[0, 1\] and pairs\[1, 1\]\)"),
    ([(0, 1), (1, 3)], r"block 1 is both a source \(pairs\[1, 0\]\) and a destination \(pairs\[0, 1\]\)"),
    ([(2, 2)], "block 2 is both a source"),
])
def test_copy_blocks_bad_pairs_change_nothing(pairs, match):
    cache = random_cache("nhd", "float16")
    k0, v0 = pools(cache)
    with pytest.raises(ValueError, match=match):
        copy_blocks(cache, pairs)
    k1, v1 = pools(cache)
    np.testing.assert_array_equal(k0, k1)
    np.testing.assert_array_equal(v0, v1)


def test_copy_blocks_empty_and_not_a_cache():
    cache = random_cache("hnd", "float16")
    k0, _ = pools(cache)
    copy_blocks(cache, [])
    copy_blocks(cache, np.zeros((0, 2), np.int32))
    np.testing.assert_array_equal(pools(cache)[0], k0)
    with pytest.raises(TypeError, match="cache must be a PagedKVCache, but got ndarray"):
        copy_blocks(k0, [(0, 1)])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_layers", [None, 2])
def test_swap_round_trip(layout, dtype, num_layers):
    cache = random_cache(layout, dtype, num_layers=num_layers, seed=3)
    k0, v0 = pools(cache)
    host = host_pool(cache, 3)
    assert host.dtype == cache.dtype and host.shape == (3,) + ((num_layers,) if num_layers else ()) + (2, 16)
    swap_blocks(cache, host, [(4, 0), (1, 2)])            # out
    lead = (slice(None),) if num_layers else ()
    expect_k4 = k0[lead + (4,)].reshape(*(k0.shape[:1] if num_layers else ()), -1)
    if layout == "interleaved":                          # one pool: K then V of each block
        got = host[0].reshape(*expect_k4.shape)
    else:
        got = host[0][..., 0, :]
    np.testing.assert_array_equal(pn._arrays.host_bits(got), expect_k4)
    swap_blocks(host, cache, [(0, 0), (2, 3)], stream=cuda.stream())   # in, on a stream
    cuda.synchronize()
    k1, v1 = pools(cache)
    moved = [(4, 0), (1, 3)]
    np.testing.assert_array_equal(k1, expected_after_copy(k0, moved, num_layers is not None))
    np.testing.assert_array_equal(v1, expected_after_copy(v0, moved, num_layers is not None))


@pytest.mark.parametrize("staging_blocks", [1, 2, None])      # None: every block in one chunk
@pytest.mark.parametrize("host_ids", [[1, 2, 3], [3, 0, 2], [2, 1, 3]])  # runs once sorted, or not
@pytest.mark.parametrize("min_run", [0, None])                # None: every run through NumPy
def test_swap_chunks_and_runs(monkeypatch, staging_blocks, host_ids, min_run):
    """Swapping through a staging array of a few blocks (several chunks, the
    last one short) moves the same bytes as through one chunk, whether the
    host blocks' runs are copied straight into (or from) the pool's slices
    or gathered and scattered by NumPy through the pinned buffer."""
    cache = random_cache("nhd", "bfloat16", num_layers=2, seed=5)
    k0, v0 = pools(cache)
    host = host_pool(cache, 4)
    if staging_blocks:
        monkeypatch.setattr(pn.blocks, "STAGING_BYTES", staging_blocks * host[0].nbytes)
    monkeypatch.setattr(pn.blocks, "MIN_RUN_BYTES", 2**62 if min_run is None else min_run)
    dev_ids = [4, 0, 2]
    swap_blocks(cache, host, list(zip(dev_ids, host_ids)))
    bits = pn._arrays.host_bits(host)                      # [4, layers, 2, 16]
    for d, h in zip(dev_ids, host_ids):
        np.testing.assert_array_equal(bits[h, :, 0], k0[:, d].reshape(2, -1))
        np.testing.assert_array_equal(bits[h, :, 1], v0[:, d].reshape(2, -1))
    untouched = sorted(set(range(4)) - set(host_ids))
    assert not bits[untouched].any()
    back = [1, 3, 0]                                       # into other device blocks
    swap_blocks(host, cache, list(zip(host_ids, back)))
    k1, v1 = pools(cache)
    moved = list(zip(dev_ids, back))
    np.testing.assert_array_equal(k1, expected_after_copy(k0, moved, True))
    np.testing.assert_array_equal(v1, expected_after_copy(v0, moved, True))


def test_runs_of_sorted_ids():
    runs = pn.blocks._runs
    assert runs(np.array([1, 2, 3, 7, 8, 10])) == [(0, 3), (3, 5), (5, 6)]
    assert runs(np.array([4])) == [(0, 1)]
    assert runs(np.array([0, 1, 2, 3])) == [(0, 4)]


def test_swap_blocks_bad_inputs_change_nothing():
    cache = random_cache("vllm", "bfloat16")
    host = host_pool(cache, 2)
    host[:] = ml_dtypes.bfloat16(1.5)
    k0, v0 = pools(cache)
    h0 = host.copy()
    bad = [
        (lambda: swap_blocks(cache, host, [(0, 2)]), ValueError, r"pairs\[0, 1\] \(host block\) is 2, outside \[0, 2\)"),
        (lambda: swap_blocks(cache, host, [(5, 0)]), ValueError, r"pairs\[0, 0\] \(device block\) is 5, outside \[0, 5\)"),
        (lambda: swap_blocks(host, cache, [(0, 1), (1, 1)]), ValueError, "destination block 1 appears twice"),
        (lambda: swap_blocks(host, cache, [(0, 9)]), ValueError, r"\(device block\) is 9, outside \[0, 5\)"),
        (lambda: swap_blocks(cache, host.astype(np.float16), [(0, 0)]), ValueError,
         "dst must have the same dtype as the cache, but got float16 and bfloat16"),
        (lambda: swap_blocks(host[:, :1], cache, [(0, 0)]), ValueError,
         r"src must be \[num_host_blocks, 2, 16\] for this cache, but got shape \(2, 1, 16\)"),
        (lambda: swap_blocks(cache, host[:0], [(0, 0)]), ValueError, r"but got shape \(0, 2, 16\)"),
        (lambda: swap_blocks(cache, host[:, :, ::-1], [(0, 0)]), ValueError, "dst must be C-contiguous"),
        (lambda: swap_blocks(cache, cache, [(0, 0)]), TypeError, "got PagedKVCache and PagedKVCache"),
        (lambda: swap_blocks(host, host, [(0, 0)]), TypeError, "cache must be a PagedKVCache, but got HostPool"),
        (lambda: swap_blocks(cache, host, [(0.5, 0)]), ValueError, "integer block ids"),
        (lambda: host_pool(cache, 0), ValueError, "num_blocks must be a positive integer, but got 0"),
        (lambda: host_pool(cache, 2.0), ValueError, "but got 2.0"),
        (lambda: host_pool("cache", 2), TypeError, "cache must be a PagedKVCache, but got str"),
    ]
    for call, error, match in bad:
        with pytest.raises(error, match=match):
            call()
    k1, v1 = pools(cache)
    np.testing.assert_array_equal(k0, k1)
    np.testing.assert_array_equal(v0, v1)
    np.testing.assert_array_equal(host.view(np.uint16), h0.view(np.uint16))


def test_swap_refuses_a_pool_of_another_geometry():
    """A host pool records the geometry of the cache it was made for: swapping
    it into a cache whose blocks have the same size but another element order
    (another layout; 4 tokens of 2 heads against 8 tokens of 1) is refused
    before anything is copied; the same geometry, a slice of the pool, and a
    plain NumPy array (which records nothing) are taken."""
    cache = random_cache("nhd", "float16", block_size=4, num_kv_heads=2)
    host = host_pool(cache, 3)
    swap_blocks(cache, host, [(1, 2)])
    assert host.geometry == ("nhd", 4, 2, 8) and host[1:].geometry == host.geometry
    for other in (dict(layout="hnd"), dict(layout="vllm"), dict(block_size=8, num_kv_heads=1)):
        geo = dict(dict(layout="nhd", block_size=4, num_kv_heads=2), **other)
        target = random_cache(geo.pop("layout"), "float16", **geo, seed=1)
        k0, v0 = pools(target)
        with pytest.raises(ValueError, match=r"src was made for a cache of \(layout, block_size, "
                                             r"num_kv_heads, head_size\) = \('nhd', 4, 2, 8\)"):
            swap_blocks(host, target, [(2, 0)])
        with pytest.raises(ValueError, match="dst was made for"):
            swap_blocks(target, host[1:], [(0, 0)])
        k1, v1 = pools(target)
        np.testing.assert_array_equal(k0, k1)
        np.testing.assert_array_equal(v0, v1)
    twin = random_cache("nhd", "float16", block_size=4, num_kv_heads=2, seed=2)
    swap_blocks(host, twin, [(2, 0)])
    np.testing.assert_array_equal(pools(twin)[0][0], pools(cache)[0][1])
    swap_blocks(np.asarray(host), random_cache("hnd", "float16", block_size=4, num_kv_heads=2),
                [(2, 0)])


def test_manager_and_kernels_fork_copy_on_write_decode():
    """write_kv the prompts, fork, append with copy-on-write (copy_blocks), swap a
    sequence out and in (swap_blocks), then paged_decode over the tables,
    against the reference over each sequence's own tokens."""
    bs, H, D, heads = 4, 1, 16, 2
    cache = PagedKVCache(num_blocks=10, block_size=bs, num_kv_heads=H, head_size=D)
    host = host_pool(cache, 4)
    m = BlockManager(num_blocks=10, block_size=bs, enable_prefix_caching=True, num_host_blocks=4)
    rng = np.random.default_rng(4)
    kv = {}                                         # each sequence's own K, V [len, H, D]

    def new_kv(n):
        return (rng.standard_normal((n, H, D)).astype(np.float16),
                rng.standard_normal((n, H, D)).astype(np.float16))

    def write(seq, k, v, start):
        pn.write_kv(cache, k, v, m.slot_mapping(seq, start, start + len(k)))

    prompt = list(range(6))                         # 6 = 4 + 2: block 1 partly full
    m.allocate("a", 6, token_ids=prompt)
    kv["a"] = new_kv(6)
    write("a", *kv["a"], 0)
    m.fork("a", "b")                                # a beam: shares both blocks
    kv["b"] = tuple(x.copy() for x in kv["a"])
    _, cached = m.allocate("c", 7, token_ids=prompt[:4] + [9, 9, 9])   # block 0 from the cache
    assert cached == 4
    k, v = new_kv(3)
    kv["c"] = (np.concatenate([kv["a"][0][:4], k]), np.concatenate([kv["a"][1][:4], v]))
    write("c", k, v, 4)
    def step(seq):
        slots, copies = m.append_slots(seq, 1, token_ids=[42])
        copy_blocks(cache, copies)                  # before writing the new token
        k, v = new_kv(1)
        pn.write_kv(cache, k, v, slots)
        kv[seq] = (np.concatenate([kv[seq][0], k]), np.concatenate([kv[seq][1], v]))
        return copies

    assert step("b") == [(1, m.blocks_of("b")[1])]  # b's token 6 goes into shared block 1: copy
    assert step("a") == [] and step("b") == []      # each writes its own block now
    swap_blocks(cache, host, m.swap_out("c"))       # preempt c ...
    m.allocate("d", 8)                              # ... its blocks are reused meanwhile
    pn.write_kv(cache, *new_kv(8), m.slot_mapping("d", 0, 8))
    swap_blocks(host, cache, m.swap_in("c"))        # ... and back
    m.free("d")
    seqs = m.seq_ids
    assert sorted(seqs) == ["a", "b", "c"] and m.num_shared_blocks == 1   # block 0 (a, b, c)
    q = rng.standard_normal((len(seqs), heads, D)).astype(np.float16)
    out = pn.paged_decode(q, cache, m.block_table(), m.seq_lens())
    for i, s in enumerate(seqs):
        ref, _ = attention(q[i:i + 1], kv[s][0], kv[s][1], scale=D ** -0.5)
        np.testing.assert_allclose(out[i], ref[0], atol=2e-3, rtol=0)
