"""paged_prefill against the float64 dense reference (the warpgroup kernels:
test_prefill_wgmma)."""
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import paged_numba as pn
from paged_numba.page_tables import padded_to_csr
from paged_numba.reference import attention, gather_kv
from paged_numba.testing import (PrefillProblem, attention_error_bound, check_attention, config_id,
                                 check_close, prefill_error_bound, prefill_problems,
                                 prefill_reference, variants)

SIM = pn.simulator_enabled()
LAYOUTS = ("nhd", "vllm", "hnd", "interleaved")
# The simulator runs every CUDA thread as a Python thread: tiny head sizes,
# short sequences and one-warp tiles there (the tiling knobs are drawn, so the
# kernel's guards for partial micro-tiles are exercised too). On a GPU each
# compile-time configuration is its own test and the default tiling is used.
if SIM:
    SHAPES = dict(head_sizes=(8, 16, 32), block_sizes=(1, 3, 4, 8), max_q_len=20,
                  max_cached=24, max_seqs=3, max_kv_heads=2, groups=(1, 2, 4),
                  dtypes=("float16", "float32", "bfloat16"))
    CONFIGS = [{}]
    # a CUDA-core tiling, or a tensor-core one (which the CUDA-core kernel also
    # takes, with its default block_q, where tensor cores do not apply)
    TILINGS = st.one_of(
        st.fixed_dictionaries(dict(tensor_cores=st.just(False), block_q=st.sampled_from([1, 2, 4]),
                                   block_n=st.sampled_from([4, 8]), num_warps=st.just(1))),
        st.fixed_dictionaries(dict(block_n=st.sampled_from([16, 32]), num_warps=st.just(1))))
    EXAMPLES = 6
else:
    # (the float64 reference and bound cost num_q x seq_len x head_size per head on the host)
    SHAPES = dict(block_sizes=(1, 16, 32), max_q_len=256, max_cached=512, max_seqs=4,
                  max_kv_heads=2)
    CONFIGS = [dict(head_sizes=(hs,), dtypes=(dt,), layouts=(lay,), groups=(g,))
               for hs, dt, lay, g in itertools.product(
                   (64, 72, 128, 256), ("float16", "float32", "bfloat16"), ("nhd", "vllm"),
                   (1, 4, 8))]     # the layouts agree bit for bit (test below), so two suffice
    TILINGS = st.sampled_from([{}, dict(tensor_cores=False)])   # the default kernel, or CUDA cores
    EXAMPLES = None          # the profile's count
# one-warp tiles on the simulator: CUDA cores, tensor cores
SMALL = dict(block_q=2, block_n=4, num_warps=1, tensor_cores=False) if SIM else dict(
    tensor_cores=False)
SMALL_TC = dict(block_n=16, num_warps=1, tensor_cores=True) if SIM else dict(tensor_cores=True)


def _problem(q_lens, seq_lens, table, block_size, head_size=16, num_heads=2, num_kv_heads=1,
             layout="nhd", dtype="float32", seed=0):
    table = np.asarray(table, np.int32)
    return PrefillProblem(
        num_seqs=len(q_lens), num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_size=head_size, block_size=block_size, num_blocks=int(table.max()) + 1,
        layout=layout, dtype=dtype, q_lens=np.asarray(q_lens, np.int32),
        seq_lens=np.asarray(seq_lens, np.int32), block_tables=table, seed=seed)


# transformers' continuous-batching example's mixed batch: query lengths [10, 3, 1] with
# 0, 1 and 7 tokens cached, so kv lengths [10, 4, 8] and cu_seqlens_q
# [0, 10, 13, 14]; blocks of 4 (10 = 2 * 4 + 2 needs 3 blocks, 4 one, 8 two).
SEED_MIX = _problem([10, 3, 1], [10, 4, 8], [[5, 0, 3], [1, -1, -1], [4, 2, -1]], 4,
                    num_heads=4, num_kv_heads=2)
# A chunk of 9 after 6 cached tokens in blocks of 4: positions 6..14 straddle
# blocks 1, 2 and 3 (15 = 3 * 4 + 3).
STRADDLE = _problem([9], [15], [[3, 0, 2, 1]], 4, dtype="float16")
# Block size 1: every token is its own block, in scrambled order.
BLOCK_ONE = _problem([3, 2], [5, 2], [[4, 1, 6, 0, 3], [2, 5, -1, -1, -1]], 1)
# Head size 72: not a power of two (9 vectors of 8 fp16 elements).
HEAD_72 = _problem([4], [6], [[1, 0]], 4, head_size=72, num_heads=1, dtype="float16")
SEED_MIX_BF16 = _problem([10, 3, 1], [10, 4, 8], [[5, 0, 3], [1, -1, -1], [4, 2, -1]], 4,
                         num_heads=4, num_kv_heads=2, dtype="bfloat16", layout="vllm")
SEED_MIX_F16 = _problem([10, 3, 1], [10, 4, 8], [[5, 0, 3], [1, -1, -1], [4, 2, -1]], 4,
                        num_heads=4, num_kv_heads=2, dtype="float16", layout="hnd")
# MQA-like decode: 16 query heads on one KV head, one query token a sequence, all
# 16 heads in the 16 rows of one warp's tile (each K/V element read once)
MQA_DECODE_F16 = _problem([1, 1], [23, 9], [[3, 0, 5], [1, 4, -1]], 8, num_heads=16,
                          dtype="float16")
# Tensor cores: 40 keys in 16-key tiles (3 tiles, the last partial), the diagonal
# in the middle of a tile, a sliding window starting inside the first one.
LONG_F16 = _problem([21, 1], [40, 33], [[9, 3, 0, 7, 5], [1, 8, 2, 4, 6]], 8, head_size=32,
                    num_heads=2, dtype="float16")


# the producer kernel's, shared with test_prefill_wgmma and test_prefill_timeline:
# two KV heads of 2 query heads, a tile a sequence: 8 (tile, head block) items
# at one head a tile, 4 at two
WS_HEADS = _problem([40, 3], [40, 20], [[9, 3, 0, 7, 5], [1, 8, 2, -1, -1]], 8,
                    head_size=32, num_heads=4, num_kv_heads=2, dtype="float16")
WS = dict(tensor_cores=True, kernel_options=dict(wgmma=True, producer=True))
WS_TWO = dict(WS, block_n=16, num_warps=8)


def rounding(cache, tiling):
    """``tensor_cores`` argument of the bounds: the dtype P is rounded to where
    the tensor-core kernel runs, else None."""
    tc = pn.prefill.uses_tensor_cores(cache, (tiling or {}).get("tensor_cores"))
    return cache.dtype.name if tc else None


def run_prefill(p, causal=True, tiling=None, **variants):
    q, k, v = p.arrays()
    kc, vc = p.layout_pools(k, v)
    cache = pn.PagedKVCache.from_host(kc, vc, p.layout)
    out, lse = pn.paged_prefill(q, cache, p.block_tables, p.cu_seqlens_q, p.seq_lens,
                                causal=causal, return_lse=True, **variants, **(tiling or {}))
    return (q, k, v), out, lse, rounding(cache, tiling)


def check_prefill(p, causal=True, tiling=None, **variants):
    (q, k, v), out, lse, tc = run_prefill(p, causal, tiling, **variants)
    check_attention(q, out, lse, *prefill_reference(p, q, k, v, causal=causal, tensor_cores=tc,
                                                    **variants))
    return out


@pytest.mark.parametrize("p, causal, tiling", [
    (SEED_MIX, True, SMALL), (SEED_MIX, False, SMALL), (STRADDLE, True, SMALL),
    (BLOCK_ONE, True, SMALL), (BLOCK_ONE, False, SMALL), (HEAD_72, True, SMALL),
    (SEED_MIX_BF16, True, SMALL), (SEED_MIX_BF16, True, SMALL_TC), (SEED_MIX_F16, False, SMALL_TC),
    (STRADDLE, True, SMALL_TC), (LONG_F16, True, SMALL_TC),
    (LONG_F16, True, dict(SMALL_TC, block_n=32, num_warps=2) if SIM else SMALL_TC),
    (MQA_DECODE_F16, True, dict(SMALL_TC, heads_per_block=16, num_warps=1))],
    ids=["seed-mix", "seed-mix-noncausal", "straddle", "block1", "block1-noncausal", "head72",
         "seed-mix-bf16-vllm", "tc-seed-mix-bf16-vllm", "tc-seed-mix-f16-hnd-noncausal",
         "tc-straddle", "tc-long", "tc-long-two-warps", "tc-mqa-decode-16-heads-a-tile"])
def test_prefill_explicit_cases(p, causal, tiling):
    check_prefill(p, causal, tiling)


def test_tc_prefill_window_and_variants():
    """Sliding window, ALiBi and soft cap on the tensor-core kernel; the window
    starts inside a key tile, so the tiles before it are skipped and the first
    one is masked."""
    check_prefill(LONG_F16, True, SMALL_TC, sliding_window=19,
                  alibi_slopes=np.array([0.25, -0.5]), logits_soft_cap=3.0)
    check_prefill(LONG_F16, False, SMALL_TC, sliding_window=5)


@pytest.mark.parametrize("options", [
    dict(fast_exp2=True), dict(fma_softmax=True), dict(token_copies=True), dict(q_in_regs=True),
    dict(m_tiles=2), dict(fast_exp2=True, fma_softmax=True, token_copies=True, m_tiles=2)],
    ids=["fast-exp2", "fma-softmax", "token-copies", "q-in-regs", "two-m-tiles", "all"])
def test_tc_prefill_kernel_options(options):
    """The tensor-core kernel's research options stay within the same bound; all
    of them together also with the variants that turn ``fma_softmax`` off, and
    in bf16."""
    tiling = dict(SMALL_TC, kernel_options=options)
    check_prefill(LONG_F16, True, tiling)
    if len(options) > 1:
        check_prefill(SEED_MIX_BF16, False, tiling)
        check_prefill(LONG_F16, True, tiling, sliding_window=19,
                      alibi_slopes=np.array([0.25, -0.5]), logits_soft_cap=3.0)
    with pytest.raises(ValueError, match=r"kernel_options may hold .* but got \['unrolled'\]"):
        check_prefill(LONG_F16, True, dict(SMALL_TC, kernel_options=dict(unrolled=True)))
    with pytest.raises(ValueError, match="kernel_options apply to the tensor-core kernel"):
        check_prefill(SEED_MIX, True, dict(SMALL, kernel_options=options))


def test_default_kernel_follows_the_gpu_and_the_batch():
    """On an sm_90 GPU a prompt's default is the warpgroup kernel (with a
    producer, turns and persistent blocks, except for the ``"vllm"`` layout's
    values); a
    decode-like batch, a caller's tiling or split-K keeps ``mma.sync``; the
    simulator always runs ``mma.sync`` with one warp."""
    sm90 = not SIM and tuple(cuda_device().compute_capability) == (9, 0)

    def options(layout="nhd", q_len=256, **kw):
        cache = pn.PagedKVCache(4, 16, 2, 128, "float16", layout)
        return pn.PrefillPlan(cache, [0, q_len], [q_len], 8, **kw).kernel_options

    assert options().get("pingpong", False) is sm90
    assert options().get("producer", False) is sm90
    assert options().get("persistent", False) is sm90
    assert not options("vllm").get("persistent", False)
    assert options("hnd").get("pingpong", False) is sm90
    assert options("vllm").get("wgmma", False) is sm90
    assert not options("vllm").get("producer", False)
    for kw in (dict(q_len=1), dict(num_warps=4), dict(block_n=32), dict(num_parts=2),
               dict(kernel_options=dict(fast_exp2=False))):
        assert not options(**kw).get("wgmma", False), kw
    assert options().get("m_tiles", 1) == (1 if sm90 or SIM else 2)


def cuda_device():
    from numba import cuda
    return cuda.get_current_device()


@pytest.mark.parametrize("p, parts, extra", [
    (LONG_F16, 2, {}), (LONG_F16, 5, {}), (MQA_DECODE_F16, 3, dict(heads_per_block=16))],
    ids=["two-parts", "more-parts-than-tiles", "mqa-decode"])
def test_tc_prefill_split_k(p, parts, extra):
    """Split-K (``num_parts``): each tile's key tiles in parts, merged. With more
    parts than a tile has key tiles (3 at 16-key tiles of 40 keys), some parts
    hold no key; causal rows of the first tokens admit fewer tiles still."""
    tiling = dict(SMALL_TC, num_parts=parts, **extra)
    check_prefill(p, True, tiling)
    if parts == 2:
        check_prefill(p, False, tiling, sliding_window=19, alibi_slopes=np.array([0.25, -0.5]),
                      logits_soft_cap=3.0)
    with pytest.raises(ValueError, match="num_parts .split-K. applies to the tensor-core kernel"):
        check_prefill(SEED_MIX, True, dict(SMALL, num_parts=parts))


@pytest.mark.parametrize("bad", [0, -2, 2.5, True, "4", 1025])
def test_split_k_rejects_bad_num_parts(bad):
    with pytest.raises((ValueError, TypeError), match="num_parts"):
        check_prefill(LONG_F16, True, dict(SMALL_TC, num_parts=bad))


def test_seed_mix_default_tiling_and_variants():
    out = check_prefill(SEED_MIX, tiling=dict(tensor_cores=False))
    # the last query of the 10-token prompt sees all 10 keys, the decode token all 8
    assert SEED_MIX.cu_seqlens_q.tolist() == [0, 10, 13, 14]
    assert np.abs(out).max() > 0
    check_prefill(SEED_MIX, True, SMALL, sliding_window=3,
                  alibi_slopes=np.array([0.5, -0.25, 1, 0]), logits_soft_cap=2.0)


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
@settings(max_examples=EXAMPLES) if EXAMPLES else (lambda f: f)
@given(data=st.data())
def test_prefill_matches_reference(config, data):
    p = data.draw(prefill_problems(**SHAPES, **config), label="problem")
    extra = data.draw(variants(p.num_heads, max_window=int(p.seq_lens.max()) + 2), label="variants")
    causal = data.draw(st.booleans(), label="causal") if data.draw(st.integers(0, 3)) == 0 else True
    check_prefill(p, causal, data.draw(TILINGS, label="tiling"), **extra)


# On a GPU the two properties below are one test per compile-time configuration
# (drawing those per example compiled hundreds of kernels in one test)
ONE_QUERY_CONFIGS = ([dict(head_sizes=(16,), max_cached=30, max_seqs=2)] if SIM else
                     [dict(head_sizes=(hs,), block_sizes=(bs,), dtypes=(dt,), layouts=(lay,),
                           groups=(1, 4))
                      for hs, bs, dt, lay in itertools.product(
                          (64, 128), (1, 16), ("float16", "float32"), ("nhd", "hnd"))])
LAYOUT_CONFIGS = ([dict(head_sizes=(16,), max_q_len=12, max_cached=12)] if SIM else
                  [dict(head_sizes=(hs,), block_sizes=(bs,), dtypes=(dt,), groups=(1, 4))
                   for hs, bs, dt in itertools.product((64, 72, 128, 256), (1, 16),
                                                       ("float16", "bfloat16", "float32"))])


def _shapes(config, **fixed):
    return {**SHAPES, **fixed, **config}


@pytest.mark.parametrize("config", ONE_QUERY_CONFIGS, ids=config_id)
@settings(max_examples=3) if SIM else (lambda f: f)
@given(data=st.data())
def test_one_query_per_sequence_matches_decode(config, data):
    """With one query per sequence, prefill is decode: both within their bounds
    of the same reference, hence within the sum of the bounds of each other."""
    p = data.draw(prefill_problems(**_shapes(config, max_q_len=1, dtypes=("float16", "float32"))),
                  label="problem")
    windowed = data.draw(st.booleans(), label="windowed")
    q, k, v = p.arrays()
    kc, vc = p.layout_pools(k, v)
    cache = pn.PagedKVCache.from_host(kc, vc, p.layout)
    extra = dict(sliding_window=3) if windowed else {}
    pre = pn.paged_prefill(q, cache, p.block_tables, p.cu_seqlens_q, p.seq_lens, **extra)
    dec = pn.paged_decode(q, cache, p.block_tables, p.seq_lens, **extra)
    ref, _, bound, _ = prefill_reference(p, q, k, v, **extra)
    bound_pre = prefill_reference(p, q, k, v, tensor_cores=rounding(cache, {}), **extra)[2]
    check_close(pre, ref, bound_pre)
    check_close(dec, ref, bound * 2)   # decode's own bound counts its split-K merges too
    check_close(pre, dec.astype(np.float64),
                bound_pre + 2 * bound + np.spacing(np.abs(ref)).astype(np.float64))


@pytest.mark.parametrize("config", LAYOUT_CONFIGS, ids=config_id)
@settings(max_examples=3) if SIM else (lambda f: f)   # five launches per example
@given(data=st.data())
def test_layouts_and_page_table_forms_agree(config, data):
    """The same tokens in every layout, and the table in padded or CSR form,
    give the same output bit for bit."""
    p = data.draw(prefill_problems(**_shapes(config, layouts=("nhd",))), label="problem")
    tiling = data.draw(TILINGS, label="tiling")
    q, k, v = p.arrays()
    outs = []
    for layout in LAYOUTS:
        kc, vc = pn.layouts.from_nhd(k, v, layout)
        cache = pn.PagedKVCache.from_host(kc, vc, layout)
        outs.append(pn.paged_prefill(q, cache, p.block_tables, p.cu_seqlens_q, p.seq_lens,
                                     **tiling))
    csr = padded_to_csr(p.block_tables, p.seq_lens, p.block_size)
    outs.append(pn.paged_prefill(q, cache, csr, p.cu_seqlens_q, None, **tiling))
    for other in outs[1:]:
        assert np.array_equal(outs[0], other)


def test_empty_query_sequence_is_skipped_and_device_arrays_stay_on_device():
    from numba import cuda
    p = _problem([2, 0, 3], [5, 4, 3], [[0, 1], [2, -1], [3, -1]], 4, num_heads=2)
    q, k, v = p.arrays()
    cache = pn.PagedKVCache.from_host(k, v, "nhd")
    out = pn.paged_prefill(cuda.to_device(q), cache, cuda.to_device(p.block_tables),
                           cuda.to_device(p.cu_seqlens_q), cuda.to_device(p.seq_lens), **SMALL)
    assert not isinstance(out, np.ndarray)
    ref, _, bound, _ = prefill_reference(p, q, k, v)
    check_close(out.copy_to_host(), ref, bound)


def test_plan_runs_again_on_new_contents():
    from numba import cuda
    p = _problem([3, 5], [3, 9], [[2, -1, -1], [0, 3, 1]], 4, num_heads=4, num_kv_heads=2)
    q, k, v = p.arrays()
    cache = pn.PagedKVCache.from_host(k, v, "nhd")
    plan = pn.PrefillPlan(cache, p.cu_seqlens_q, p.seq_lens, 4, **SMALL)
    assert plan.num_tiles == (2 + 3 if SIM else 2) and "num_tiles" in repr(plan)
    dq, dt = cuda.to_device(q), cuda.to_device(p.block_tables)
    plan.run(dq, dt)
    dq.copy_to_device(-q)                       # same buffer, new contents
    ref, _, bound, _ = prefill_reference(p, -q, k, v)
    check_close(plan.run(dq, dt).copy_to_host(), ref, bound)
    with pytest.raises(ValueError, match=r"query must be \[total_q, num_heads, head_size\] = "
                                         r"\[8, 4, 16\], but got \(7, 4, 16\)"):
        plan.run(cuda.to_device(q[:7]), dt)


class _NoLaunch:
    def __init__(self, *args, **kwargs):
        raise AssertionError("a kernel launch was prepared before validation finished")


@pytest.mark.parametrize("change, message", [
    (dict(seq_lens=[10, 2, 8]), r"sequence 1 has q_len 3 query tokens but seq_lens\[1\] = 2"),
    (dict(cu=[1, 10, 13, 14]), r"cu_seqlens_q\[0\] must be 0, but got 1"),
    (dict(cu=[0, 10, 9, 14]),
     r"non-decreasing, but cu_seqlens_q\[2\] = 9 < cu_seqlens_q\[1\] = 10"),
    (dict(cu=[0, 10, 13, 15]), r"cu_seqlens_q\[-1\] must equal total_q = 14 \(query rows\), but "
                               r"got 15"),
    (dict(cu=[0, 10, 14]), r"cu_seqlens_q must be \[num_seqs \+ 1\] = \[4\], but got shape \(3,\)"),
    (dict(table=[[5, 0, 3], [1, -1, -1], [4, -1, -1]]),
     r"block_tables\[2, 1\] is -1, but sequence 2 \(seq_len 8\) uses its first 2 entries"),
    (dict(query_dtype="float16"), "query must have the same dtype as the cache, but got float16"),
    (dict(sliding_window=0), "sliding_window must be a positive integer, but got 0"),
])
def test_invalid_inputs_raise_before_any_launch(monkeypatch, change, message):
    p = SEED_MIX
    q, k, v = p.arrays()
    cache = pn.PagedKVCache.from_host(k, v, "nhd")
    before = cache.key_cache.copy_to_host()
    monkeypatch.setattr(pn._launch, "PackedLaunch", _NoLaunch)
    with pytest.raises(ValueError, match=message):
        pn.paged_prefill(q.astype(change.get("query_dtype", q.dtype)), cache,
                         np.asarray(change.get("table", p.block_tables), np.int32),
                         np.asarray(change.get("cu", p.cu_seqlens_q), np.int32),
                         np.asarray(change.get("seq_lens", p.seq_lens), np.int32),
                         sliding_window=change.get("sliding_window"))
    assert np.array_equal(cache.key_cache.copy_to_host(), before)


# -- the error bound itself (NumPy only) ------------------------------------------------

@settings(max_examples=30)
@given(st.integers(0, 2**32 - 1), st.integers(2, 40), st.sampled_from([8, 16, 64]),
       st.sampled_from([1, 2]))
def test_bound_is_attention_error_bound_at_the_last_position(seed, n, head_size, group):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, 2 * group, head_size))
    k, v = rng.standard_normal((2, n, 2, head_size))
    slopes = rng.uniform(-1, 1, 2 * group)
    for extra in ({}, dict(alibi_slopes=slopes, logits_soft_cap=5.0)):
        b, bl = prefill_error_bound(q, k, v, 0.3, [n - 1], causal=True, num_merges=3, **extra)
        a, al = attention_error_bound(q[0], k, v, 0.3, num_merges=3, **extra)
        assert np.allclose(b[0], a, rtol=1e-12, atol=0) and np.allclose(bl[0], al, rtol=1e-12)


@settings(max_examples=30)
@given(prefill_problems(head_sizes=(16, 64), max_q_len=12, max_cached=40, dtypes=("float32",)),
       st.data())
def test_dropping_one_key_exceeds_the_bound(p, data):
    """Mutation check of the bound: causal attention that loses one key (the
    kernel skipping a token) is out of bounds in some row that admits it."""
    q, k, v = p.arrays()
    ref, _, bound, _ = prefill_reference(p, q, k, v)
    i = data.draw(st.integers(0, p.num_seqs - 1), label="sequence")
    j = data.draw(st.integers(0, int(p.seq_lens[i]) - 1), label="dropped key")
    a, b = int(p.cu_seqlens_q[i]), int(p.cu_seqlens_q[i + 1])
    kk, vv = gather_kv(k, v, p.block_tables[i], p.seq_lens[i])
    pos = int(p.seq_lens[i]) - (b - a) + np.arange(b - a)
    exceeded = []
    for r in np.flatnonzero((pos >= j) & (pos > 0)):     # rows that admit key j and another
        sel = (np.arange(kk.shape[0]) != j) & (np.arange(kk.shape[0]) <= pos[r])
        mutated, _ = attention(q[a + r:a + r + 1], kk[sel], vv[sel], 1 / np.sqrt(p.head_size))
        exceeded.append((np.abs(mutated[0] - ref[a + r]) > bound[a + r]).any())
    assert not exceeded or any(exceeded)
