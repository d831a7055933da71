"""paged_decode's tensor-core kernels against the float64 dense reference: the
variants (P @ V on tensor cores, keys by ldmatrix), the copy ring in dynamic shared
memory and the launch shape, the block-number prefetch, the choice of kernel and
its register cap, and MQA and large groups on the prefill tile."""
import itertools
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import paged_numba as pn
from paged_numba.kernels.decode_tc import SATURATING_WARP_DIMS
from paged_numba.testing import (GQA_GROUPS, check_attention, check_close, config_id,
                                 decode_problems, decode_reference, variants)
from test_decode import LAYOUTS, SHAPES, SIM, _layouts_agree, _problem, check_decode, run_decode


# The tensor-core kernel's variants (paged_decode's pv_mma and key_rows), each forced for
# split and unsplit launches alike. By default paged_decode runs pv_mma, with key_rows for
# the unsplit kernel only, which the other tests cover; these four cover every kernel
# either launch can be given.
TC_VARIANTS = {"FMA": dict(pv_mma=False, key_rows=False),
               "FMA+KEY_ROWS": dict(pv_mma=False, key_rows=True),
               "PV_MMA": dict(pv_mma=True, key_rows=False),
               "PV_MMA+KEY_ROWS": dict(pv_mma=True, key_rows=True)}
# ... on fp16/bf16 caches, head sizes 32-256, every layout. On a GPU each configuration
# has one group (heads per thread block are compile-time, as in CONFIGS), rotated so that
# every (layout, dtype) pair meets every group over the four (head size, block size) pairs.
PV_CONFIGS = ([dict(head_sizes=(32,), dtypes=("float16", "bfloat16"), groups=(1, 2, 4))] if SIM
              else [dict(head_sizes=(hs,), block_sizes=(bs,), layouts=(lay,), dtypes=(dt,),
                         groups=(GQA_GROUPS[(a + b + 2 * c) % 4],))
                    for a, (hs, bs) in enumerate(((64, 16), (128, 16), (256, 16), (128, 5)))
                    for b, lay in enumerate(LAYOUTS)
                    for c, dt in enumerate(("float16", "bfloat16"))])


@pytest.mark.parametrize("flags", list(TC_VARIANTS))
@pytest.mark.parametrize("config", PV_CONFIGS, ids=config_id)
@settings(max_examples=2 if SIM else settings().max_examples)
@given(data=st.data())
def test_decode_tensor_core_variants_match_reference(config, flags, data):
    """Every variant: P @ V on tensor cores (weights as hi + lo halves), held
    to its own bound (``testing.attention_error_bound(pv=...)``; the bound
    fails it when the lo half is dropped, checked on the simulator) or in fp32
    FMAs, and the keys read by ldmatrix (the head dimension in another order)
    or not."""
    p = data.draw(decode_problems(**{**SHAPES, **config}), label="problem")
    extra = data.draw(variants(p.num_heads, max_window=int(p.seq_lens.max()) + 2), label="variants")
    check_decode(p, data.draw(st.one_of(st.none(), st.integers(1, 4)), label="num_partitions"),
                 **extra, **TC_VARIANTS[flags])


# The copy ring in dynamic shared memory: wide blocks (as many warps as saturate HBM
# from one block, ``decode_tc.SATURATING_WARP_DIMS`` over the head size; above 48 KB
# where a block has more than 4 warps at head size 128) and deep rings (4 stages). On a
# GPU: wide blocks at head size 128 in every layout and dtype, 64 and 256 in two each;
# deep rings at head size 128 in every layout (and 3 stages once) and at 256 once;
# groups rotated.
def _ring_case(hs, lay, dt, group, warps, stages):
    config = dict(head_sizes=(hs,), block_sizes=(16,), layouts=(lay,), dtypes=(dt,),
                  groups=(group,))
    return pytest.param(config, warps, stages,
                        id=f"{config_id(config)}-warps{warps}-stages{stages}")


SIM_RING = dict(head_sizes=(128,), block_sizes=(16,), layouts=("nhd",), dtypes=("float16",),
                groups=(4,), max_seqs=2, max_kv_heads=1, max_seq_len=200)   # the rings wrap
RING_CASES = (
    [pytest.param(SIM_RING, w, st, id=f"warps{w}-stages{st}") for w, st in ((8, 2), (4, 4))]
    if SIM else
    [_ring_case(hs, lay, dt, GQA_GROUPS[i % 4], SATURATING_WARP_DIMS // hs, 2)
     for i, (hs, lay, dt) in enumerate(
         [(128, lay, dt) for lay in LAYOUTS for dt in ("float16", "bfloat16")]
         + [(64, "nhd", "float16"), (64, "vllm", "bfloat16"), (256, "hnd", "float16"),
            (256, "interleaved", "bfloat16")])]
    + [_ring_case(hs, lay, dt, GQA_GROUPS[(i + 1) % 4], w, st)
       for i, (hs, lay, dt, w, st) in enumerate(
        [(128, "nhd", "float16", 4, 4), (128, "vllm", "bfloat16", 4, 4),
         (128, "hnd", "float16", 4, 4), (128, "interleaved", "bfloat16", 4, 4),
         (256, "nhd", "bfloat16", 2, 4),
         # 48 KB of ring: only static + dynamic is over the 48 KB a launch may take unasked
         (128, "nhd", "float16", 4, 3)])])


@pytest.mark.parametrize("config, warps, stages", RING_CASES)
@settings(max_examples=2 if SIM else settings().max_examples)
@given(data=st.data())
def test_decode_dynamic_ring_matches_reference(config, warps, stages, data):
    """``DecodePlan`` with its copy ring in dynamic shared memory (``num_warps``,
    ``stages``), unsplit and split, against the reference."""
    from paged_numba import _arrays
    from paged_numba.kernels import decode_tc
    p = data.draw(decode_problems(**{**SHAPES, **config}), label="problem")
    extra = data.draw(variants(p.num_heads, max_window=int(p.seq_lens.max()) + 2), label="variants")
    parts = data.draw(st.integers(1, 2), label="num_partitions")
    q, k, v = p.arrays()
    cache = pn.PagedKVCache.from_host(*p.layout_pools(k, v), p.layout)
    plan = pn.DecodePlan(cache, p.num_seqs, p.num_heads, p.max_blocks, num_partitions=parts,
                         num_warps=warps, stages=stages, **extra)
    assert plan._threads == 32 * warps
    assert plan._kernel.dynamic_shared_bytes == decode_tc.dynamic_ring_bytes(
        p.head_size, warps, stages, p.layout, pv_mma=True) > 0
    dev = [_arrays.as_device(a, name)[0] for a, name in
           ((q, "query"), (p.block_tables, "block_tables"), (p.seq_lens, "seq_lens"))]
    out = _arrays.to_host(plan.run(*dev), cache.dtype)
    check_attention(q, out, plan.lse.copy_to_host(),
                    *decode_reference(p, q, k, v, num_partitions=parts, **extra))


def test_default_warps_fit_static_shared_memory_and_more_are_kept():
    """``launch_shape``: 4 warps by default (2 at head size 256, where 4 do not fit
    the static 48 KB), which paged_decode and DecodePlan both take; a caller's 8 at
    head size 128 are kept, with the ring in 64 KB of dynamic shared memory."""
    from paged_numba.attention import launch_shape
    for hs, warps in ((64, 4), (128, 4), (256, 2)):
        cache = pn.PagedKVCache(8, 16, 8, hs, "float16")
        assert launch_shape(None, None, cache, 4, 16, 32, 4096)[0] == warps
        plan = pn.DecodePlan(cache, 16, 32, 256)
        assert plan._threads == 32 * warps and plan._kernel.dynamic_shared_bytes == 0
    fp32 = pn.PagedKVCache(8, 16, 8, 256, "float32")     # the CUDA-core kernel: NUM_WARPS
    assert launch_shape(None, None, fp32, 4, 16, 32, 4096)[0] == 4
    plan = pn.DecodePlan(pn.PagedKVCache(8, 16, 8, 128, "float16"), 16, 32, 256, num_warps=8)
    assert plan._threads == 256 and plan._kernel.dynamic_shared_bytes == 65536


@pytest.mark.parametrize("num_partitions", [1, 2])
def test_tensor_core_block_prefetch_crosses_windows(num_partitions, monkeypatch):
    """The tensor-core kernel's lanes hold the block numbers of the warp's next
    32 steps. With one warp per thread block that warp takes every 8-token
    step, so 300 tokens cross a window (two partitions put an edge at token
    150, inside a step): within the reference's bound, and bit for bit the
    kernel that reads every block number from the table."""
    from numba import cuda
    from paged_numba.kernels import decode_tc
    table = np.random.default_rng(3).permutation(21)[:19].reshape(1, 19)
    p = _problem([300], table, 16, head_size=32, num_heads=2, num_kv_heads=1)
    q, k, v = p.arrays()
    cache = pn.PagedKVCache.from_host(k, v, "nhd")
    args = [cuda.to_device(a) for a in (q, p.block_tables, p.seq_lens)]

    def run():
        plan = pn.DecodePlan(cache, 1, 2, 19, num_partitions=num_partitions, num_warps=1)
        assert plan.tensor_cores and plan.num_partitions == num_partitions
        return plan.run(*args).copy_to_host()

    out = run()
    ref, _, bound, _ = decode_reference(p, q, k, v, num_partitions=num_partitions)
    check_close(out, ref, bound)
    factory = decode_tc.decode_tc_kernel
    monkeypatch.setattr(decode_tc, "decode_tc_kernel", lambda *a, **kw: factory(
        *a, **{**kw, "prefetch": False}))
    assert np.array_equal(run(), out)


# on a GPU: one compile-time combination per test, between them every head size, three
# block sizes (one not a multiple of the 8-token step), both dtypes and groups 1, 2, 4
AGREE_CONFIGS = ([{}] if SIM else
                 [dict(head_sizes=(hs,), block_sizes=(bs,), dtypes=(dt,), groups=(g,))
                  for hs, bs, dt, g in ((64, 5, "float16", 4), (128, 8, "bfloat16", 2),
                                        (256, 16, "float16", 1), (128, 16, "bfloat16", 4))])


@pytest.mark.parametrize("flags", list(TC_VARIANTS))
@pytest.mark.parametrize("config", AGREE_CONFIGS, ids=config_id)
@settings(max_examples=2 if SIM else 20)
@given(data=st.data())
def test_tensor_core_variants_agree_across_layouts(config, flags, data):
    """Every tensor-core variant gives every layout (and the CSR table) the
    same bits ("vllm" values are gathered into the P @ V ring)."""
    p = data.draw(decode_problems(**{**dict(
        max_kv_heads=2, layouts=("nhd",), dtypes=("float16", "bfloat16"), head_sizes=(32,),
        block_sizes=(5, 8, 16), max_seq_len=40 if SIM else 600, max_seqs=2 if SIM else 4,
        groups=(1, 2, 4)), **config}), label="problem")
    _layouts_agree(p, **TC_VARIANTS[flags])


def test_tensor_core_kernel_is_chosen_where_it_applies_and_refused_elsewhere():
    p = _problem([20], [[0, 1]], 16, head_size=32, num_heads=4, num_kv_heads=1)
    q, k, v = p.arrays()
    cache = pn.PagedKVCache.from_host(k, v, "nhd")
    assert pn.DecodePlan(cache, 1, 4, 2).tensor_cores
    assert not pn.DecodePlan(cache, 1, 4, 2, tensor_cores=False).tensor_cores
    cache32 = pn.PagedKVCache.from_host(k.astype(np.float32), v.astype(np.float32), "nhd")
    assert not pn.DecodePlan(cache32, 1, 4, 2).tensor_cores
    with pytest.raises(ValueError, match=r"tensor_cores=True needs .* but got float32, 'nhd', "
                                         r"head_size=32, heads_per_block=4"):
        pn.DecodePlan(cache32, 1, 4, 2, tensor_cores=True)
    # both kernels, same inputs: each within the bound of its own arithmetic
    from numba import cuda
    ref, _, bound, _ = decode_reference(p, q, k, v, num_partitions=1)
    dq, dt, dl = cuda.to_device(q), cuda.to_device(p.block_tables), cuda.to_device(p.seq_lens)
    for tc in (True, False):
        plan = pn.DecodePlan(cache, 1, 4, 2, num_partitions=1, tensor_cores=tc)
        check_close(plan.run(dq, dt, dl).copy_to_host(), ref, bound)


def test_register_cap_reaches_the_tensor_core_kernel(monkeypatch):
    """Where ``tuning.register_cap`` finds a limit (on a GPU, from the compiled
    kernel's registers), the launcher compiles the kernel with it; and the
    limit is the one that buys one more resident block within 12 registers."""
    from paged_numba.kernels import tuning
    from paged_numba.kernels.decode_tc import decode_tc_kernel
    args = (128, 16, 4, "float16", "nhd")
    unsplit = dict(pv_mma=True, key_rows=True)      # the default variants: key_rows unsplit only
    monkeypatch.setattr(tuning, "register_cap", lambda *a: 128)
    kernel, threads, tc = pn.attention.decode_launch(*args, split=False)
    assert tc and threads == 128 and kernel is decode_tc_kernel(*args, 4, 2, False,
                                                                max_registers=128, **unsplit)
    monkeypatch.setattr(tuning, "register_cap", lambda *a: None)
    assert pn.attention.decode_launch(*args, split=False)[0] is decode_tc_kernel(
        *args, 4, 2, False, **unsplit)
    assert pn.attention.decode_launch(*args, split=True)[0] is decode_tc_kernel(
        *args, 4, 2, True, pv_mma=True, key_rows=False)
    assert [tuning.register_limit(r, 128, 6) for r in (128, 131, 140, 141)] == [None, 128, 128, None]
    assert tuning.register_limit(131, 128, by_shared=3) is None   # shared memory is the limit


def test_tensor_core_variants_are_options_of_the_call():
    """``pv_mma`` and ``key_rows`` of ``DecodePlan`` (and ``paged_decode``) pick
    the tensor-core kernel's variant; None keeps the default (pv_mma, and
    key_rows in the unsplit kernel only); the CUDA-core kernel ignores them.
    On a GPU the variant may come with a register cap (``register_cap``: a few
    registers fewer for one more resident block), built from the same kernel."""
    from paged_numba.kernels.decode_tc import decode_tc_kernel
    from paged_numba.kernels.specializations import decode_signatures
    from paged_numba.kernels.tuning import register_cap
    cache = pn.PagedKVCache(8, 16, 1, 128, "float16")
    args = (128, 16, 4, "float16", "nhd", 4, 2)

    def variant(split, **options):
        kernel = decode_tc_kernel(*args, split, **options)
        cap = register_cap(kernel, decode_signatures("float16", "nhd")[int(split)], 128)
        return kernel if cap is None else decode_tc_kernel(*args, split, max_registers=cap,
                                                            **options)

    for parts, split in ((1, False), (2, True)):
        plan = pn.DecodePlan(cache, 1, 4, 4, num_partitions=parts)
        assert plan._kernel is variant(split, pv_mma=True, key_rows=not split)
        for pv, kr in itertools.product((False, True), repeat=2):
            plan = pn.DecodePlan(cache, 1, 4, 4, num_partitions=parts, pv_mma=pv, key_rows=kr)
            assert plan._kernel is variant(split, pv_mma=pv, key_rows=kr)
    plan = pn.DecodePlan(cache, 1, 4, 4, tensor_cores=False, pv_mma=False, key_rows=True)
    assert not plan.tensor_cores


# MQA and groups of 32 or more run on the tensor-core prefill tile (one query
# token a "prompt", 32 heads of a KV head in one tile; 16 on the simulator) with
# split-K parts.
MQA_32 = _problem([23, 70, 0], [[3, 0, -1, -1, -1], [1, 4, 6, 2, 5], [-1] * 5], 16,
                  head_size=32, num_heads=32, num_kv_heads=1)
GROUP_32_BF16 = _problem([41, 9], [[2, 0, 5], [1, -1, -1]], 16, head_size=16, num_heads=64,
                         num_kv_heads=2, layout="vllm", dtype="bfloat16")


@pytest.mark.parametrize("p, num_partitions, variants", [
    (MQA_32, 1, {}), (MQA_32, 3, dict(sliding_window=30)),
    (GROUP_32_BF16, None, dict(logits_soft_cap=2.0, alibi_slopes=np.linspace(-1, 1, 64)))],
    ids=["mqa-unsplit", "mqa-three-parts-window", "group32-bf16-vllm-default-split"])
def test_large_group_decode_on_the_prefill_tile(p, num_partitions, variants):
    """The prefill-tile path agrees with the reference (an empty sequence gets
    zeros and lse -inf), and ``DecodePlan`` takes the same path with the same
    bits."""
    from numba import cuda
    from paged_numba._arrays import host_bits
    from paged_numba._group_decode import group_tile
    (q, k, v), out, lse = run_decode(p, num_partitions, **variants)
    cache = pn.PagedKVCache.from_host(*p.layout_pools(k, v), p.layout)
    assert group_tile(cache, p.num_heads) == 32
    check_attention(q, out, lse, *decode_reference(p, q, k, v, **variants))
    empty = p.seq_lens == 0
    assert (out[empty] == 0).all() and np.isneginf(lse[empty]).all()
    plan = pn.DecodePlan(cache, p.num_seqs, p.num_heads, p.max_blocks,
                         num_partitions=num_partitions, **variants)
    assert plan.heads_per_block in (16, 32)
    got = plan.run(cuda.to_device(host_bits(q)), cuda.to_device(p.block_tables),
                   cuda.to_device(p.seq_lens)).copy_to_host()
    assert np.array_equal(got.view(np.uint16), np.asarray(out).view(np.uint16))


@pytest.mark.parametrize("kernel", ["tile", "wgmma", "wgmma+alternate_tiles"])
@settings(max_examples=2) if SIM else (lambda f: f)
@given(data=st.data())
def test_group_decode_kernels_match_reference(kernel, data):
    """Either prefill tile named by ``DecodePlan(group_kernel=...)`` (which
    takes groups of 16 too) agrees with the float64 reference within the
    prefill tile's bound, split or not; so does the ``"wgmma"`` tile whose two
    consumer warpgroups take alternate K/V tiles (``alternate_tiles``, through
    ``_group_decode.WGMMA_OPTIONS``)."""
    from paged_numba import _arrays, _group_decode
    kernel, *options = kernel.split("+")
    p = data.draw(decode_problems(head_sizes=(64,) if SIM else (64, 128), block_sizes=(8, 16),
                                  layouts=("nhd", "hnd", "interleaved"),
                                  dtypes=("float16", "bfloat16"), groups=(16, 32), max_kv_heads=2,
                                  max_seqs=3, max_seq_len=70 if SIM else 3000), label="problem")
    extra = data.draw(variants(p.num_heads, max_window=int(p.seq_lens.max()) + 2), label="variants")
    parts = data.draw(st.one_of(st.none(), st.integers(1, 3)), label="num_partitions")
    q, k, v = p.arrays()
    cache = pn.PagedKVCache.from_host(*p.layout_pools(k, v), p.layout)
    with mock.patch.object(_group_decode, "WGMMA_OPTIONS", {o: True for o in options}):
        plan = pn.DecodePlan(cache, p.num_seqs, p.num_heads, p.max_blocks,
                             num_partitions=parts, group_kernel=kernel, **extra)
    assert plan._group is not None and plan._group.kind == kernel
    if kernel == "wgmma":
        assert plan._group.num_warps == (8 if options else 4)
    dev = [_arrays.as_device(a, name)[0] for a, name in
           ((q, "query"), (p.block_tables, "block_tables"), (p.seq_lens, "seq_lens"))]
    out = _arrays.to_host(plan.run(*dev), cache.dtype)
    check_attention(q, out, plan.lse.copy_to_host(),
                    *decode_reference(p, q, k, v, num_partitions=plan.num_partitions,
                                      group_kernel=kernel, **extra))


def test_alternate_tiles_refuses_what_it_does_not_take():
    """``alternate_tiles`` needs two consumer warpgroups and an even ring (a
    stage's tiles always go to the same warpgroup), and takes none of the
    options that schedule the warpgroups otherwise; the key loop takes every
    tile or every other one. Each refusal names the values, before compiling."""
    from paged_numba.kernels.prefill_key_loop import key_loop
    from paged_numba.kernels.prefill_wgmma_ws import prefill_wgmma_ws_kernel
    args = (64, 16, 32, 16, "float16", "nhd")
    for nw, extra, named in ((4, {}, "num_warps=4"), (8, dict(stages=3), "stages=3"),
                             (8, dict(pingpong=True), "pingpong=True"),
                             (8, dict(merge_parts=True), "merge_parts=True")):
        options = dict(dict(swizzle=True, split_k=True, stages=4), **extra)
        with pytest.raises(ValueError, match="alternate_tiles=True needs two consumer .*" + named):
            prefill_wgmma_ws_kernel(*args, nw, alternate_tiles=True, **options)
    with pytest.raises(ValueError, match="step 1 or 2, with an even number of stages.*step=2, "
                                         "stages=3"):
        key_loop(None, None, 3, None, None, step=2)


def test_wgmma_group_decode_merges_in_the_kernel_bit_for_bit(monkeypatch):
    """With ``_group_decode.WGMMA_FUSED_MERGE`` the last part of each item
    merges inside the kernel (one launch): the same bits as the merge kernel,
    launch after launch on new queries (the tickets go back to zero), an empty
    sequence included."""
    from paged_numba import _arrays, _group_decode
    rng = np.random.default_rng(11)
    p = _problem([70, 0, 33], [[3, 0, 6, 2, 9], [-1] * 5, [1, 8, 4, -1, -1]], 16,
                 head_size=64, num_heads=32, num_kv_heads=2)
    q, k, v = p.arrays()
    cache = pn.PagedKVCache.from_host(*p.layout_pools(k, v), p.layout)
    tables, lens = (_arrays.as_device(a, n)[0] for a, n in
                    ((p.block_tables, "block_tables"), (p.seq_lens, "seq_lens")))
    queries = [q, rng.standard_normal(q.shape).astype(q.dtype)]
    got = {}
    for fused in (False, True):
        monkeypatch.setattr(_group_decode, "WGMMA_FUSED_MERGE", fused)
        plan = pn.DecodePlan(cache, p.num_seqs, p.num_heads, p.max_blocks, num_partitions=3,
                             group_kernel="wgmma")
        assert plan._group.fused_merge == fused and (plan._merge is None) == fused
        got[fused] = []
        for qq in queries:
            out = plan.run(_arrays.as_device(qq, "query")[0], tables, lens).copy_to_host()
            got[fused].append((out.view(np.uint16), plan.lse.copy_to_host()))
        if fused:
            assert not plan._group._tickets[0].copy_to_host().any()
    for (a, a_lse), (b, b_lse) in zip(got[False], got[True]):
        assert np.array_equal(a, b) and np.array_equal(a_lse, b_lse)
    assert np.isneginf(got[True][1][1][1]).all()
    assert not np.array_equal(got[True][0][0], got[True][1][0])


def test_wgmma_group_decode_with_mbarriers_bit_for_bit(monkeypatch):
    """The ``"wgmma"`` tile's producer with its copies arriving at the stages'
    mbarriers (one consumer warpgroup: ``_group_decode.WGMMA_OPTIONS``) gives
    the same bits as with the named full barriers, split and not."""
    from paged_numba import _arrays, _group_decode
    p = _problem([70, 0, 33], [[3, 0, 6, 2, 9], [-1] * 5, [1, 8, 4, -1, -1]], 16,
                 head_size=64, num_heads=32, num_kv_heads=2)
    q, k, v = p.arrays()
    cache = pn.PagedKVCache.from_host(*p.layout_pools(k, v), p.layout)
    dev = [_arrays.as_device(a, n)[0] for a, n in
           ((q, "query"), (p.block_tables, "block_tables"), (p.seq_lens, "seq_lens"))]
    for parts in (1, 3):
        got = []
        for options in ({}, {"mbarriers": True}):
            monkeypatch.setattr(_group_decode, "WGMMA_OPTIONS", options)
            plan = pn.DecodePlan(cache, p.num_seqs, p.num_heads, p.max_blocks,
                                 num_partitions=parts, group_kernel="wgmma")
            got.append((plan.run(*dev).copy_to_host().view(np.uint16), plan.lse.copy_to_host()))
        assert np.array_equal(got[0][0], got[1][0]) and np.array_equal(got[0][1], got[1][1])
