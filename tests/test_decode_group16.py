"""Decode with 16 query heads a thread block (``DecodePlan(heads_per_block=16)``):
the tensor-core kernel puts all 16 rows of its ``mma`` to use, heads 8..15 of
the block in rows 8..15, so a GQA group of 16 reads its K/V once.

Its output is held to the float64 reference's bound, and is bit for bit the
8-heads-a-block kernel's: the rows of the products are independent, and the
two plans split the tokens between warps and partitions alike."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import cuda

import paged_numba as pn
from paged_numba._arrays import host_bits
from paged_numba.testing import check_attention, config_id, decode_problems, decode_reference
from paged_numba.testing import variants as variant_strategy

SIM = pn.simulator_enabled()
CONFIGS = ([dict(head_sizes=(32,), dtypes=("float16", "bfloat16"), max_seq_len=40, max_seqs=2,
                 block_sizes=(5, 8, 16))] if SIM else
           [dict(head_sizes=(hs,), dtypes=(dt,), layouts=(lay,), block_sizes=(16,),
                 max_seq_len=3000, max_seqs=6)
            for hs, dt, lay in ((64, "float16", "nhd"), (128, "bfloat16", "vllm"),
                                (128, "float16", "hnd"), (256, "float16", "interleaved"))])


def _plans(p, num_partitions, key_rows, **extra):
    """The plan with 16 heads a block and the one with 8, over the problem's cache."""
    q, k, v = p.arrays()
    cache = pn.PagedKVCache.from_host(*p.layout_pools(k, v), p.layout)
    common = dict(num_partitions=num_partitions, pv_mma=True, key_rows=key_rows, **extra)
    return (q, k, v), [pn.DecodePlan(cache, p.num_seqs, p.num_heads, p.max_blocks,
                                     heads_per_block=hpb, **common) for hpb in (16, 8)]


@pytest.mark.parametrize("key_rows", [False, True], ids=["keys", "key-rows"])
@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
@settings(max_examples=2 if SIM else 10, deadline=None)
@given(data=st.data())
def test_sixteen_heads_a_block_match_reference_and_eight(config, key_rows, data):
    p = data.draw(decode_problems(groups=(16,), max_kv_heads=2, **config), label="problem")
    extra = data.draw(variant_strategy(p.num_heads, max_window=int(p.seq_lens.max()) + 2),
                      label="variants")
    parts = data.draw(st.integers(1, 3), label="num_partitions")
    (q, k, v), plans = _plans(p, parts, key_rows, **extra)
    assert [plan.heads_per_block for plan in plans] == [16, 8]
    dq = cuda.to_device(host_bits(q))
    table, lens = cuda.to_device(p.block_tables), cuda.to_device(p.seq_lens)
    got = []
    for plan in plans:
        out = plan.run(dq, table, lens).copy_to_host().view(q.dtype)   # bf16: from its bits
        got.append((out, plan.lse.copy_to_host()))
    (out, lse), (out8, lse8) = got
    assert np.array_equal(out.view(np.uint16), out8.view(np.uint16))
    assert np.array_equal(lse, lse8, equal_nan=True)
    if not key_rows:        # key_rows reorders the head dimension: no bound of its own
        check_attention(q, out, lse, *decode_reference(p, q, k, v, num_partitions=parts,
                                                       pv_mma=True, **extra))


def test_sixteen_heads_need_the_tensor_core_products():
    cache = pn.PagedKVCache(4, 16, 1, 64, "float16")
    for kwargs, message in [
            (dict(heads_per_block=16, pv_mma=False), "needs the tensor-core kernel with pv_mma"),
            (dict(heads_per_block=16, tensor_cores=False), "tensor_cores=False"),
            (dict(heads_per_block=32), "at most 16, but got 32"),
            (dict(heads_per_block=3), "must divide the GQA group size 16"),
            (dict(heads_per_block=0), "heads_per_block")]:
        with pytest.raises(ValueError, match=message):
            pn.DecodePlan(cache, 1, 16, 2, **kwargs)
    f32 = pn.PagedKVCache(4, 16, 1, 64, "float32")
    with pytest.raises(ValueError, match="float32"):
        pn.DecodePlan(f32, 1, 16, 2, heads_per_block=16)


def test_second_half_keeps_its_own_maxima_and_slopes():
    """Keys ever more aligned with the queries of heads 8..15 only: their running
    maxima grow at every warp step while those of heads 0..7 hardly move, so
    the second half's rescale must use its own factors; ALiBi slopes differ
    between a head and the head 8 rows below it. Mutation-checked: the first
    half's factors or slopes in the second half both fail it."""
    n, bs, hs, heads = 200, 16, 32, 16
    rng = np.random.default_rng(11)
    q = rng.standard_normal((1, heads, hs))
    ramp = np.linspace(0.0, 3.0, n)[:, None, None]
    k = ramp * q[0, 8:].mean(0)[None, None] + 0.1 * rng.standard_normal((n, 1, hs))
    v = rng.standard_normal((n, 1, hs))
    blocks = -(-n // bs)
    perm = rng.permutation(blocks)
    kp, vp = np.zeros((blocks, bs, 1, hs)), np.zeros((blocks, bs, 1, hs))
    for j in range(blocks):
        kp[perm[j], :min(bs, n - j * bs)] = k[j * bs:(j + 1) * bs]
        vp[perm[j], :min(bs, n - j * bs)] = v[j * bs:(j + 1) * bs]
    p = pn.testing.DecodeProblem(num_seqs=1, num_heads=heads, num_kv_heads=1, head_size=hs,
                                 block_size=bs, num_blocks=blocks, layout="nhd",
                                 dtype="float16", seq_lens=np.array([n], np.int32),
                                 block_tables=perm[None].astype(np.int32), seed=0)
    q, kp, vp = (a.astype(np.float16) for a in (q, kp, vp))
    cache = pn.PagedKVCache.from_host(kp, vp)
    slopes = np.linspace(-0.05, 0.1, heads).astype(np.float32)
    dq = cuda.to_device(q)
    table, lens = cuda.to_device(p.block_tables), cuda.to_device(p.seq_lens)
    outs = []
    for hpb in (16, 8):
        plan = pn.DecodePlan(cache, 1, heads, blocks, num_partitions=1, heads_per_block=hpb,
                             pv_mma=True, key_rows=False, alibi_slopes=slopes)
        outs.append((plan.run(dq, table, lens).copy_to_host(), plan.lse.copy_to_host()))
    (out, lse), (out8, lse8) = outs
    assert np.array_equal(out.view(np.uint16), out8.view(np.uint16))
    check_attention(q, out, lse, *decode_reference(p, q, kp, vp, num_partitions=1, pv_mma=True,
                                                   alibi_slopes=slopes))
