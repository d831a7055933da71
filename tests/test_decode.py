"""paged_decode and merge_states against the float64 dense reference (the
tensor-core kernels' variants and the prefill-tile path: test_decode_tensor_cores.py)."""
import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import paged_numba as pn
from paged_numba.reference import attention
from paged_numba.testing import (U32, DecodeProblem, check_attention, check_close, config_id,
                                 decode_problems, decode_reference, gamma, variants)

SIM = pn.simulator_enabled()
# The simulator runs every CUDA thread as a Python thread: keep its shapes small,
# and let hypothesis draw the compile-time parameters too. On a GPU each
# combination of compile-time parameters is its own test (each compiles its
# kernels once; run them in parallel with pytest-xdist) and hypothesis draws
# batch, lengths, tables, KV heads and partitions within it.
LAYOUTS = ("nhd", "vllm", "hnd", "interleaved")
DTYPES = ("float16", "float32")
if SIM:
    SHAPES = dict(head_sizes=(8, 16, 24, 32, 64), max_seq_len=80, max_seqs=3, max_kv_heads=2,
                  groups=(1, 2, 3, 4))
    CONFIGS = [{}]
else:
    SHAPES = dict(max_seq_len=3000, max_seqs=8, max_kv_heads=4)
    # head sizes 64, 72 (not a power-of-two number of vectors), 128, 256 x layout
    # x dtype x group at block size 16 (80-112 are compiled in test_ptx); every block size
    # (1 and 5 included) at head size 128; odd group sizes (3, 7: heads per
    # thread block that are not powers of two) and odd row widths (8, 24)
    POINTS = (list(itertools.product((64, 72, 128, 256), (16,), LAYOUTS,
                                     ("float16", "float32", "bfloat16"), (1, 2, 4, 8)))
              + list(itertools.product((128,), (1, 5, 8, 32), LAYOUTS, DTYPES, (1, 8)))
              + list(itertools.product((8, 24, 128), (16,), ("nhd", "vllm"), DTYPES, (3, 7))))
    CONFIGS = [dict(head_sizes=(hs,), block_sizes=(bs,), layouts=(lay,), dtypes=(dt,), groups=(g,))
               for hs, bs, lay, dt, g in POINTS]
# bit-for-bit invariance under moving blocks: one head size and block size suffice
PLACEMENT_CONFIGS = [c for c in CONFIGS if c.get("head_sizes", (128,)) == (128,)
                     and c.get("block_sizes", (16,)) == (16,)]


def _problem(seq_lens, table, block_size, head_size=64, num_heads=2, num_kv_heads=1,
             layout="nhd", dtype="float16", seed=0):
    table = np.asarray(table, np.int32)
    return DecodeProblem(
        num_seqs=len(seq_lens), num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_size=head_size, block_size=block_size, num_blocks=int(table.max()) + 1,
        layout=layout, dtype=dtype, seq_lens=np.asarray(seq_lens, np.int32),
        block_tables=table, seed=seed)


# Worked examples of published PagedAttention lessons: a 60-token request in
# blocks [7, 1, 12, 4] of 16 tokens (60 = 3 * 16 + 12), and three sequences with 30, 32 and 70 cached tokens
# plus one new token each in blocks of 32 (31 fits block 2; 33 = 32 + 1 needs
# blocks 0 and 1; 71 = 2 * 32 + 7 needs blocks 3, 5 and 6).
SEED_60 = _problem([60], [[7, 1, 12, 4]], 16)
SEED_BATCH = _problem([31, 33, 71], [[2, -1, -1, -1], [0, 1, -1, -1], [3, 5, 6, -1]], 32,
                      num_heads=4, num_kv_heads=2)


def run_decode(p, num_partitions=None, **variants):
    q, k, v = p.arrays()
    kc, vc = p.layout_pools(k, v)
    cache = pn.PagedKVCache.from_host(kc, vc, p.layout)
    out, lse = pn.paged_decode(q, cache, p.block_tables, p.seq_lens,
                               num_partitions=num_partitions, return_lse=True, **variants)
    return (q, k, v), out, lse


def check_decode(p, num_partitions, **variants):
    (q, k, v), out, lse = run_decode(p, num_partitions, **variants)
    variants.pop("key_rows", None)          # reorders the head dimension: no other bound
    check_attention(q, out, lse, *decode_reference(p, q, k, v, num_partitions=num_partitions,
                                                   **variants))


@pytest.mark.parametrize("p, num_partitions", [(SEED_60, None), (SEED_60, 3), (SEED_BATCH, 1),
                                               (SEED_BATCH, 2)])
def test_decode_seed_examples(p, num_partitions):
    check_decode(p, num_partitions)


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
@settings(max_examples=4) if SIM else (lambda f: f)   # the GPU profile draws the many
@given(data=st.data())
def test_decode_matches_reference(config, data):
    p = data.draw(decode_problems(**SHAPES, **config), label="problem")
    extra = data.draw(variants(p.num_heads, max_window=int(p.seq_lens.max()) + 2), label="variants")
    check_decode(p, data.draw(st.one_of(st.none(), st.integers(1, 4)), label="num_partitions"),
                 **extra)


@pytest.mark.parametrize("config", PLACEMENT_CONFIGS, ids=config_id)
@settings(max_examples=2 if SIM else settings().max_examples)   # two launches per example
@given(data=st.data())
def test_decode_independent_of_block_placement(config, data):
    """Moving the physical blocks (and the table with them) changes nothing, bit for bit."""
    p = data.draw(decode_problems(**SHAPES, **config), label="problem")
    rnd = data.draw(st.randoms(use_true_random=False), label="random")
    (q, k, v), out, _ = run_decode(p)
    perm = list(range(p.num_blocks))
    rnd.shuffle(perm)
    perm = np.array(perm)                       # block b moves to perm[b]
    k2, v2 = np.empty_like(k), np.empty_like(v)
    k2[perm], v2[perm] = k, v
    table = np.where(p.block_tables >= 0, perm[p.block_tables], -1).astype(np.int32)
    kc, vc = p.layout_pools(k2, v2)
    cache = pn.PagedKVCache.from_host(kc, vc, p.layout)
    out2 = pn.paged_decode(q, cache, table, p.seq_lens)
    assert np.array_equal(out, out2)


def test_empty_sequence_gets_zeros():
    p = _problem([0, 5, 0], [[-1], [3], [-1]], 8, head_size=16)
    (q, k, v), out, lse = run_decode(p)
    assert np.all(out[0] == 0) and np.all(out[2] == 0)
    assert np.all(np.isneginf(lse[[0, 2]]))
    ref, _, bound, _ = decode_reference(p, q, k, v)
    check_close(out, ref, bound)


def test_device_arrays_in_device_array_out():
    p = _problem([9, 17], [[1, 0, -1], [2, 4, 3]], 8, head_size=16, num_heads=4, num_kv_heads=4)
    q, k, v = p.arrays()
    cache = pn.PagedKVCache.from_host(k, v, "nhd")
    from numba import cuda
    out = pn.paged_decode(cuda.to_device(q), cache, cuda.to_device(p.block_tables),
                          cuda.to_device(p.seq_lens))
    assert not isinstance(out, np.ndarray)
    ref, _, bound, _ = decode_reference(p, q, k, v)
    check_close(out.copy_to_host(), ref, bound)


def test_custom_scale_and_partition_count_agree():
    p = _problem([40], [[4, 2, 0, 1, 3]], 8, head_size=32, num_heads=2, num_kv_heads=2,
                 dtype="float32")
    q, k, v = p.arrays()
    cache = pn.PagedKVCache.from_host(k, v, "nhd")
    outs = [pn.paged_decode(q, cache, p.block_tables, p.seq_lens, scale=0.3, num_partitions=n)
            for n in (1, 2, 5)]
    ref, _, bound, _ = decode_reference(p, q, k, v, scale=0.3, num_partitions=5)
    for out in outs:
        check_close(out, ref, bound)


@st.composite
def split_states(draw, min_states=1, max_states=4):
    """Attention over keys cut into parts: the parts' states, and the whole."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    rows, heads, dim = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.sampled_from([8, 16]))
    sizes = draw(st.lists(st.integers(0, 9), min_size=min_states,
                          max_size=max_states))
    q = rng.standard_normal((rows, heads, dim))
    ks = [rng.standard_normal((n, heads, dim)) * 2 for n in sizes]
    vs = [rng.standard_normal((n, heads, dim)) for n in sizes]
    parts = [[attention(q[i:i + 1], k, v, 1.0) for k, v in zip(ks, vs)] for i in range(rows)]
    v_states = np.array([[o[0] for o, _ in row] for row in parts])      # [rows, S, heads, dim]
    s_states = np.array([[s[0] for _, s in row] for row in parts])      # [rows, S, heads]
    k_all, v_all = np.concatenate(ks), np.concatenate(vs)
    whole = [attention(q[i:i + 1], k_all, v_all, 1.0) for i in range(rows)]
    return v_states, s_states, np.array([o[0] for o, _ in whole]), np.array([s[0] for _, s in whole])


@given(split_states())
def test_merge_states_equals_single_pass(case):
    check_merge(case)


@settings(max_examples=3 if SIM else settings().max_examples)
@given(split_states(min_states=33, max_states=75))
def test_merge_states_of_many_parts(case):
    # more states than one warp's lanes, and runs of UNROLL loads plus remainders
    check_merge(case)


def check_merge(case):
    v_states, s_states, out_ref, lse_ref = case
    v32, s32 = v_states.astype(np.float32), s_states.astype(np.float32)
    out, lse = pn.merge_states(v32, s32)
    # Rounding model: the inputs were rounded to fp32 (|dv| <= u|v|, |ds| <= u|s|),
    # a shift of the log-sum-exps by at most E moves each weight by exp(+-2E),
    # and the merge itself adds up S terms with one exp each.
    num_states = s32.shape[1]
    finite_s = np.where(np.isfinite(s_states), np.abs(s_states), 0)
    e_s = U32 * finite_s.max(axis=1)                                     # [rows, heads]
    with np.errstate(invalid="ignore", over="ignore"):
        w = np.exp(s_states - lse_ref[:, None])                          # exact merge weights
    w = np.where(np.isfinite(w), w, 0)
    spread = (w[..., None] * np.abs(v_states)).sum(axis=1)               # sum_k w_k |v_k|
    bound = spread * (2 * e_s + gamma(2 * num_states + 8))[..., None]
    check_close(out, out_ref, bound)
    finite = np.isfinite(lse_ref)
    assert np.array_equal(np.isfinite(lse), finite)
    check_close(lse[finite], lse_ref[finite], (e_s + gamma(2 * num_states + 8))[finite], "lse")


def test_merge_rule_by_hand():
    # state 1: m = 0, l = 1 (lse 0), output 1; state 2: lse log(3), output 5.
    # weights 1 : 3, so the merge is (1 * 1 + 3 * 5) / 4 = 4 and lse = log(4).
    v = np.array([[[[1.0]], [[5.0]]]], np.float32)
    s = np.array([[[0.0], [math.log(3.0)]]], np.float32)
    out, lse = pn.merge_states(v, s)
    assert out[0, 0, 0] == pytest.approx(4.0, rel=1e-6)
    assert lse[0, 0] == pytest.approx(math.log(4.0), rel=1e-6)


def test_plan_run_matches_paged_decode_and_repacks_new_buffers():
    from numba import cuda
    p = _problem([9, 30], [[1, 0, -1, -1], [2, 4, 3, 5]], 8, head_size=16, num_heads=4,
                 num_kv_heads=2, dtype="float32")
    q, k, v = p.arrays()
    cache = pn.PagedKVCache.from_host(k, v, "nhd")
    plan = pn.DecodePlan(cache, num_seqs=2, num_heads=4, max_blocks=4, num_partitions=2)
    assert plan.num_partitions == 2 and plan.scratch_bytes == (2 * 2 * 4 * 16 + 2 * 2 * 4) * 4
    dq, dt, dl = cuda.to_device(q), cuda.to_device(p.block_tables), cuda.to_device(p.seq_lens)
    first = plan.run(dq, dt, dl).copy_to_host()
    assert np.array_equal(first, pn.paged_decode(q, cache, p.block_tables, p.seq_lens,
                                                 num_partitions=2))
    dq.copy_to_device(2 * q)                       # same buffer, new contents: fast path
    ref, _, bound, _ = decode_reference(p, 2 * q, k, v, num_partitions=2)
    check_close(plan.run(dq, dt, dl).copy_to_host(), ref, bound)
    dq2 = cuda.to_device(-q)                       # a new buffer is packed again
    ref, _, bound, _ = decode_reference(p, -q, k, v, num_partitions=2)
    check_close(plan.run(dq2, dt, dl).copy_to_host(), ref, bound)
    with pytest.raises(ValueError, match=r"query must be \[2, 4, 16\] for this plan"):
        plan.run(cuda.to_device(q[:1]), dt, dl)
    with pytest.raises(TypeError, match="needs device arrays, but query is ndarray"):
        plan.run(q, dt, dl)


@pytest.mark.skipif(SIM, reason="CUDA graphs need a GPU")
def test_plan_run_inside_a_stream_capture_records_its_kernels():
    """``run`` is one graph launch on an idle stream, and on a stream being
    captured (as in ``torch.cuda.graph``) it launches its kernels one by one
    so that the caller's graph records them: replaying that graph gives the
    same bits as a plain ``run``."""
    from cuda.bindings import driver as drv
    from numba import cuda

    from paged_numba import _launch
    p = _problem([9, 30], [[1, 0, -1, -1], [2, 4, 3, 5]], 8, head_size=64, num_heads=4,
                 num_kv_heads=2, dtype="float16")
    q, k, v = p.arrays()
    cache = pn.PagedKVCache.from_host(k, v, "nhd")
    plan = pn.DecodePlan(cache, num_seqs=2, num_heads=4, max_blocks=4, num_partitions=2)
    dq, dt, dl = cuda.to_device(q), cuda.to_device(p.block_tables), cuda.to_device(p.seq_lens)
    want = plan.run(dq, dt, dl).copy_to_host()
    assert len(plan._graph.launches) == 2             # decode and merge, one graph launch
    stream = cuda.stream()
    plan.out.copy_to_device(np.zeros_like(want))
    ok, handle = drv.CUresult.CUDA_SUCCESS, _launch.stream_handle(stream)
    mode = drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
    assert drv.cuStreamBeginCapture(handle, mode)[0] == ok
    plan.run(dq, dt, dl, stream=stream)
    err, graph = drv.cuStreamEndCapture(handle)
    assert err == ok and not plan.out.copy_to_host().any()   # captured, not run
    err, graph_exec = drv.cuGraphInstantiate(graph, 0)
    assert err == ok and drv.cuGraphLaunch(graph_exec, handle)[0] == ok
    stream.synchronize()
    assert np.array_equal(plan.out.copy_to_host(), want)


def test_variants_by_hand():
    # one sequence of 10 tokens in blocks [2, 0] of 8; window 3 keeps keys 7, 8, 9 only
    p = _problem([10], [[2, 0]], 8, head_size=16, num_heads=2, num_kv_heads=1, dtype="float32")
    slopes = np.array([0.5, -0.25])
    for extra in (dict(sliding_window=3), dict(alibi_slopes=slopes), dict(logits_soft_cap=0.5),
                  dict(sliding_window=1, alibi_slopes=slopes, logits_soft_cap=2.0)):
        check_decode(p, None, **extra)
    # a window of 1 attends to the newest token alone: the output is its value row
    (q, k, v), out, _ = run_decode(p, None, sliding_window=1)
    newest = v[0, 1, 0]                    # token 9 = block 0 (table column 1), offset 1
    assert np.allclose(out[0], newest[None, :], rtol=0, atol=4 * U32)


@pytest.mark.parametrize("kwargs, message", [
    (dict(sliding_window=0), "sliding_window must be a positive integer, but got 0"),
    (dict(logits_soft_cap=-1.0), "logits_soft_cap must be a positive number, but got -1.0"),
    (dict(alibi_slopes=np.ones(3)), r"alibi_slopes must be float \[num_heads\] = \[2\]"),
])
def test_variant_arguments_are_checked(kwargs, message):
    p = _problem([5], [[0]], 8, head_size=16)
    q, k, v = p.arrays()
    cache = pn.PagedKVCache.from_host(k, v, "nhd")
    with pytest.raises(ValueError, match=message):
        pn.paged_decode(q, cache, p.block_tables, p.seq_lens, **kwargs)


# On a GPU one test per (head size, block size, dtype): each compiles the four
# layouts' kernels once (drawing those parameters per example compiled hundreds)
LAYOUT_CONFIGS = ([dict(head_sizes=(16, 32), max_seq_len=40, max_seqs=2, groups=(1, 2))] if SIM
                  else [dict(head_sizes=(hs,), block_sizes=(bs,), dtypes=(dt,), groups=(1, 4),
                             max_seq_len=1000, max_seqs=4)
                        for hs, bs, dt in itertools.product((64, 72, 128, 256), (1, 5, 16),
                                                            ("float16", "bfloat16", "float32"))])


@pytest.mark.parametrize("config", LAYOUT_CONFIGS, ids=config_id)
@settings(max_examples=2) if SIM else (lambda f: f)   # five launches per example
@given(data=st.data())
def test_layouts_and_page_table_forms_agree(config, data):
    """The same tokens in every layout, and the table in padded or CSR form,
    give the same output bit for bit."""
    _layouts_agree(data.draw(decode_problems(max_kv_heads=2, layouts=("nhd",), **config),
                             label="problem"))


def _layouts_agree(p, **variants):
    from paged_numba.page_tables import padded_to_csr
    q, k, v = p.arrays()
    outs = []
    for layout in LAYOUTS:
        kc, vc = pn.layouts.from_nhd(k, v, layout)
        cache = pn.PagedKVCache.from_host(kc, vc, layout)
        outs.append(pn.paged_decode(q, cache, p.block_tables, p.seq_lens, num_partitions=1,
                                    **variants))
    csr = padded_to_csr(p.block_tables, p.seq_lens, p.block_size)
    outs.append(pn.paged_decode(q, cache, csr, None, num_partitions=1, **variants))
    for other in outs[1:]:
        assert np.array_equal(outs[0], other)


@given(st.integers(1, 512), st.integers(1, 64), st.integers(1, 65536), st.integers(1, 200),
       st.integers(1, 16))
def test_partition_heuristic_is_bounded_and_hardly_splits_a_full_gpu(
        num_seqs, head_blocks, context, sm_count, resident):
    p = pn.attention.num_partitions_for(num_seqs, head_blocks, context, sm_count, resident)
    assert 1 <= p <= max(1, -(-context // pn.attention.MIN_PARTITION))
    blocks, slots = num_seqs * head_blocks, sm_count * resident
    if blocks >= 8 * slots:                 # eight waves without splitting: at most a tail fix
        assert p <= 2
        if blocks % slots == 0:             # whole waves: nothing to gain
            assert p == 1


def test_running_max_grows_every_step():
    # keys ever more aligned with the query: the running maximum grows at every
    # warp step, so each step must rescale the output accumulated so far
    # (200 tokens = about 3 steps per warp at head size 64). Mutation-checked: without
    # the rescale the error is 0.8 against a bound of 1.6e-4; short random sequences
    # (one step per warp) do not catch that.
    n, bs, hs = 200, 16, 64
    rng = np.random.default_rng(7)
    q = rng.standard_normal((1, 2, hs))
    ramp = np.linspace(0.0, 3.0, n)[:, None, None]
    k = ramp * q[0, :1][None] + 0.1 * rng.standard_normal((n, 1, hs))    # [n, 1, hs]
    v = rng.standard_normal((n, 1, hs))
    blocks = -(-n // bs)
    perm = rng.permutation(blocks)
    kp = np.zeros((blocks, bs, 1, hs))                 # logical block j -> physical perm[j]
    vp = np.zeros_like(kp)
    for j in range(blocks):
        kp[perm[j], :min(bs, n - j * bs)] = k[j * bs:(j + 1) * bs]
        vp[perm[j], :min(bs, n - j * bs)] = v[j * bs:(j + 1) * bs]
    p = DecodeProblem(num_seqs=1, num_heads=2, num_kv_heads=1, head_size=hs, block_size=bs,
                      num_blocks=blocks, layout="nhd", dtype="float32",
                      seq_lens=np.array([n], np.int32), block_tables=perm[None].astype(np.int32),
                      seed=0)
    q, kp, vp = (a.astype(np.float32) for a in (q, kp, vp))
    cache = pn.PagedKVCache.from_host(kp, vp)
    out = pn.paged_decode(q, cache, p.block_tables, p.seq_lens, num_partitions=1)
    ref, _, bound, _ = decode_reference(p, q, kp, vp, num_partitions=1)
    check_close(out, ref, bound)


def test_non_contiguous_device_query_is_refused():
    from numba import cuda
    p = _problem([5], [[0]], 8, head_size=16, num_heads=2, num_kv_heads=1)
    q, k, v = p.arrays()
    cache = pn.PagedKVCache.from_host(k, v, "nhd")
    wide = cuda.to_device(np.zeros((1, 2, 32), np.float16))
    with pytest.raises(ValueError, match="query must be C-contiguous, but got strides"):
        pn.paged_decode(wide[:, :, ::2], cache, p.block_tables, p.seq_lens)
