"""The device guard in the decode kernels (``paged_numba.kernels.guard``): with
validation off, a block id outside the pool or a length outside its table row
is not followed; the kernel records the first one, ``check`` raises it, and
the other sequence comes out as from a clean run, bit for bit. The tensor-core
kernel built without the guard (``guard=False``, only to time it) gives the
same bits on valid inputs and records nothing."""
import re

import numpy as np
import pytest
from numba import cuda

import paged_numba as pn

NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS = 4, 8, 2
CAP = 2 * BLOCK_SIZE                      # tokens a table row of two blocks holds
# The bad entries below are block 0 in the clean table, and sequence 1 fills its row:
# where the kernel reads block 0 in place of a bad id, or clamps a long length to the
# row, it reads what the clean run reads.
TABLES = np.array([[3, 0], [0, 2]], np.int32)
LENS = np.array([13, CAP], np.int32)
# (argument, index, bad value): an id in a whole 8-token step (the tensor-core kernel's
# prefetched block numbers), one in the step the length cuts short, two lengths
CASES = [("block_tables", (1, 0), NUM_BLOCKS), ("block_tables", (0, 1), -1),
         ("seq_lens", 1, CAP + 5), ("seq_lens", 1, -7)]
HEAD_SIZE = {"float32": 16, "float16": 32, "float8_e4m3fn": 16}
# (cache dtype, entry point, partitions, cases, layout, plan options): the CUDA-core kernel
# (fp32) and the tensor-core one (fp16), unsplit and split-K. Four warps (paged_decode's)
# and the split's merge (128 threads) are slow on the simulator: those runs take some of
# the cases each.
RUNS = [(dt, "paged_decode", 1, CASES[0::2], "nhd", {}) for dt in ("float32", "float16")]
RUNS += [(dt, "paged_decode", 2, CASES[1::2], "nhd", {}) for dt in ("float32", "float16")]
RUNS += [(dt, "plan", 1, CASES, "nhd", {}) for dt in ("float32", "float16")]
RUNS += [(dt, "plan", 2, CASES[:2], "nhd", {}) for dt in ("float32", "float16")]
# the fp8 form of the CUDA-core kernel (its scales after the error word); "vllm" value
# rows, read without the copy ring by lookups of their own (in the tensor-core kernel
# where P @ V is in FMAs)
RUNS += [("float8_e4m3fn", "plan", 1, CASES[:1], "nhd", {}),
         ("float32", "plan", 1, CASES[:1], "vllm", {}),
         ("float16", "plan", 1, CASES[:1], "vllm", dict(pv_mma=False))]


def _cache(dtype, layout):
    head_size = HEAD_SIZE[dtype]
    rng = np.random.default_rng(0)
    store = np.float32 if dtype == "float32" else np.float16       # fp8: written from fp16
    k, v = (rng.standard_normal((NUM_BLOCKS, BLOCK_SIZE, 1, head_size)).astype(store)
            for _ in range(2))
    q = rng.standard_normal((len(LENS), NUM_HEADS, head_size)).astype(store)
    if dtype.startswith("float8"):            # quantised by write_kv
        cache = pn.PagedKVCache(NUM_BLOCKS, BLOCK_SIZE, 1, head_size, dtype, layout)
        pn.write_kv(cache, k.reshape(-1, 1, head_size), v.reshape(-1, 1, head_size),
                    np.arange(NUM_BLOCKS * BLOCK_SIZE))
        return cache, q
    return pn.PagedKVCache.from_host(*pn.layouts.from_nhd(k, v, layout), layout), q


def _decode_runner(cache, q, parts):
    """``(run, check)``: ``run(tables, lens) -> (out, lse)`` (host arrays) is
    ``paged_decode`` of device tables and lengths with validation off."""
    def run(tables, lens):
        return pn.paged_decode(q, cache, cuda.to_device(tables), cuda.to_device(lens),
                               num_partitions=parts, return_lse=True, validate=False)
    return run, cache.check


def _plan_runner(cache, q, parts, **options):
    """The same through one ``DecodePlan`` of one warp: the first run packs (and
    checks) the buffers, with clean contents; later runs overwrite them in place."""
    plan = pn.DecodePlan(cache, len(LENS), NUM_HEADS, TABLES.shape[1], num_partitions=parts,
                         num_warps=1, **options)
    assert plan.num_partitions == parts
    assert plan.tensor_cores == (cache.dtype.name == "float16")
    bufs = [cuda.to_device(a) for a in (q, TABLES, LENS)]

    def run(tables, lens):
        bufs[1].copy_to_device(tables)
        bufs[2].copy_to_device(lens)
        return plan.run(*bufs).copy_to_host(), plan.lse.copy_to_host()
    return run, plan.check


@pytest.mark.parametrize("dtype, entry, parts, cases, layout, options", RUNS,
                         ids=[f"{r[0]}-{r[1]}-{r[2]}-{r[4]}" for r in RUNS])
def test_decode_records_bad_ids_and_lengths_and_leaves_the_others_alone(
        dtype, entry, parts, cases, layout, options):
    cache, q = _cache(dtype, layout)
    run, check = (_decode_runner(cache, q, parts) if entry == "paged_decode"
                  else _plan_runner(cache, q, parts, **options))
    out, lse = run(TABLES, LENS)
    check()                                   # good inputs: nothing recorded
    assert (lse > -np.inf).all()
    for name, index, bad in cases:
        tables, lens = TABLES.copy(), LENS.copy()
        (tables if name == "block_tables" else lens)[index] = bad
        got, got_lse = run(tables, lens)      # no exception from the kernel
        where = ", ".join(map(str, np.atleast_1d(index)))
        with pytest.raises(ValueError, match=re.escape(f"{name}[{where}] = {bad} (validate=")):
            check()
        check()                               # cleared
        s = int(np.atleast_1d(index)[0])      # the sequence given the bad value
        assert np.array_equal(got[1 - s], out[1 - s])
        assert np.array_equal(got_lse[1 - s], lse[1 - s])
        if bad < 0 and name == "seq_lens":    # taken as an empty sequence
            assert not got[s].any() and np.isneginf(got_lse[s]).all()
        else:                                 # block 0 read in place, or the whole row
            assert np.array_equal(got[s], out[s]) and np.array_equal(got_lse[s], lse[s])
    if entry == "plan" and cases == CASES:    # good contents again in the packed buffers
        again = run(TABLES, LENS)
        assert np.array_equal(again[0], out) and np.array_equal(again[1], lse)
        check()


def _halved(cache):
    """The same tokens in blocks of half the size: ``(cache, tables)``."""
    k, v = (x.reshape(2 * NUM_BLOCKS, BLOCK_SIZE // 2, *x.shape[2:]) for x in cache.to_host())
    return pn.PagedKVCache.from_host(k, v), np.stack([2 * TABLES, 2 * TABLES + 1], -1).reshape(
        len(LENS), -1).astype(np.int32)


# (partitions, plan options, blocks of 4 tokens: no prefetched block numbers)
BARE = {"unsplit": (1, {}, False), "split": (2, {}, False), "fma": (1, dict(pv_mma=False), False),
        "blocks-of-4": (1, {}, True)}


@pytest.mark.parametrize("name", BARE)
def test_decode_tc_kernel_without_the_guard_changes_no_bit_and_records_nothing(name,
                                                                              monkeypatch):
    """``guard=False`` (only to time the guard): the tensor-core kernel of a
    plan's launch built without it is another kernel, and on valid inputs gives
    the guarded one's outputs bit for bit; under the simulator it is seen to
    make none of the guard's compares. A negative length (which neither
    follows outside the buffers) the guarded kernel records, the other not; an
    id outside the pool the guarded one records (the other would read there)."""
    from paged_numba._decode_launch import _cache_launch
    from paged_numba.kernels import decode_tc_parts, guard as guard_module

    def compare(x, n):
        raise AssertionError(f"the kernel built with guard=False compares {x} with {n}")

    parts, options, halved = BARE[name]
    cache, q = _cache("float16", "nhd")
    tables = TABLES
    if halved:
        cache, tables = _halved(cache)
    got = []
    for guard in (True, False):
        plan = pn.DecodePlan(cache, len(LENS), NUM_HEADS, tables.shape[1], num_partitions=parts,
                             num_warps=1, **options)
        kernel, threads, tc = _cache_launch(cache, *plan._launch_args, guard=guard)
        assert tc and threads == plan._threads and (kernel is plan._kernel) == guard
        plan._kernel = kernel                 # before the first run packs the launch
        if not guard and pn.simulator_enabled():     # (run, not compiled: globals looked up)
            for module in (guard_module, decode_tc_parts):
                monkeypatch.setattr(module, "outside", compare)
        bufs = [cuda.to_device(a) for a in (q, tables, LENS)]
        got.append((plan.run(*bufs).copy_to_host(), plan.lse.copy_to_host()))
        cache.check()                         # good inputs: nothing recorded
        bufs[2].copy_to_device(np.array([LENS[0], -7], np.int32))
        plan.run(*bufs)
        if guard:
            with pytest.raises(ValueError, match=re.escape("seq_lens[1] = -7 (validate=")):
                cache.check()
            bad = tables.copy()
            bad[1, 0] = cache.num_blocks
            bufs[1].copy_to_device(bad)
            bufs[2].copy_to_device(LENS)
            plan.run(*bufs)
            with pytest.raises(ValueError, match=re.escape(f"block_tables[1, 0] = {bad[1, 0]} ")):
                cache.check()
        cache.check()                         # (without the guard: nothing to raise)
    (out, lse), (bare_out, bare_lse) = got
    assert np.array_equal(out.view(np.uint16), bare_out.view(np.uint16))
    assert np.array_equal(lse.view(np.uint32), bare_lse.view(np.uint32))


def test_the_cuda_core_decode_kernel_has_no_form_without_the_guard():
    from paged_numba._decode_launch import _cache_launch
    cache = pn.PagedKVCache(NUM_BLOCKS, BLOCK_SIZE, 1, 16, "float32")
    plan = pn.DecodePlan(cache, len(LENS), NUM_HEADS, TABLES.shape[1])
    assert not plan.tensor_cores
    with pytest.raises(ValueError, match="guard=False applies to the tensor-core decode kernel"):
        _cache_launch(cache, *plan._launch_args, guard=False)
