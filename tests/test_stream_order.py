"""Stream order: a call given ``stream=`` puts every copy, fill and host read
of its own on that stream, so nothing races the kernels on a non-blocking
stream (every torch stream is one; it does not wait for the default stream).

Each test holds one stream busy with ``torch.cuda._sleep`` and calls with the
other, or the same, and checks what a race would break:

* results allocated for the caller (torch or NumPy) are zeroed on the
  launch's stream, not after the kernels wrote them;
* NumPy results are copied back after the kernels on that stream;
* with ``validate=True`` a device table is read after the caller's writes
  on that stream.

GPU only: the simulator runs every kernel as it is called.
"""
import numpy as np
import pytest

import paged_numba as pn
from paged_numba import reference as ref

pytestmark = pytest.mark.skipif(pn.simulator_enabled(), reason="streams need a GPU")
torch = pytest.importorskip("torch")

NB, BS, H, D = 80, 16, 2, 64
HEADS = 8
SLEEP = 200_000_000         # GPU clock cycles: about 0.1 s on an H100 or H200


def _cache_and_batch(seed=0):
    rng = np.random.default_rng(seed)
    cache = pn.PagedKVCache(num_blocks=NB, block_size=BS, num_kv_heads=H, head_size=D)
    lens = np.array([300, 177, 512, 40], np.int32)
    blocks = rng.permutation(NB)
    need = -(-lens // BS)
    tables = np.full((lens.size, need.max()), -1, np.int32)
    at = 0
    for i, n in enumerate(need):
        tables[i, :n] = blocks[at:at + n]
        at += n
    slots = np.concatenate([tables[i, np.arange(L) // BS] * BS + np.arange(L) % BS
                            for i, L in enumerate(lens)])
    kv = rng.standard_normal((2, slots.size, H, D)).astype(np.float16)
    pn.write_kv(cache, kv[0], kv[1], slots)
    q = rng.standard_normal((lens.size, HEADS, D)).astype(np.float16)
    return cache, q, tables, lens


def _expected(cache, q, tables, lens):
    """The float64 reference, and the error bound of an fp16 result: its own
    rounding (2**-11 of the largest output), the probabilities rounded to
    fp16 before P @ V (they sum to 1: 2**-11 of the largest value, twice for
    the score's rounding through exp), and float32 sums."""
    K, V = cache.to_host()
    want, _ = ref.paged_decode_reference(q, K, V, tables, lens)
    vmax = float(np.abs(V.astype(np.float64)).max())
    return want, 2 ** -11 * float(np.abs(want).max()) + 2 ** -10 * vmax + 1e-6


def _close(got, expected):
    want, tol = expected
    got = np.asarray(got, np.float64)
    assert np.all(np.isfinite(got))
    assert np.max(np.abs(got - want)) <= tol


@pytest.fixture
def side():
    s = torch.cuda.Stream()
    yield s
    torch.cuda.synchronize()


@pytest.mark.parametrize("parts", [1, 4], ids=["one-pass", "split-k"])
def test_torch_results_are_zeroed_on_the_launch_stream(side, parts):
    """Torch's current stream busy: a result zeroed there would land after
    the kernels on ``side`` wrote it."""
    cache, q, tables, lens = _cache_and_batch()
    tq = torch.from_numpy(q).cuda()
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP)                      # the current (default) stream
    out = pn.paged_decode(tq, cache, tables, lens, num_partitions=parts, stream=side)
    torch.cuda.synchronize()
    _close(out.cpu().numpy(), _expected(cache, q, tables, lens))


def test_numpy_results_come_back_after_the_kernels(side):
    """``side`` busy before the call: the kernels wait behind it, so a copy
    back on any other stream would return zeros."""
    cache, q, tables, lens = _cache_and_batch(1)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP)
    out = pn.paged_decode(q, cache, tables, lens, num_partitions=4, stream=side)
    _close(out, _expected(cache, q, tables, lens))


def test_prefill_numpy_results_come_back_after_the_kernels(side):
    cache, q, tables, lens = _cache_and_batch(2)
    cu = np.arange(lens.size + 1, dtype=np.int32)   # one query row each: the newest token
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP)
    out = pn.paged_prefill(q, cache, tables, cu, lens, causal=True, stream=side)
    _close(out, _expected(cache, q, tables, lens))


def test_validation_reads_the_table_after_the_callers_writes(side):
    """A bad block id written on ``side`` (behind a sleep) is seen by the
    validating call on ``side``: it raises before any launch."""
    cache, q, tables, lens = _cache_and_batch(3)
    bad = tables.copy()
    bad[2, 3] = NB + 5
    table = torch.from_numpy(tables).cuda()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP)
        table.copy_(torch.from_numpy(bad).cuda(non_blocking=False))
    with pytest.raises(ValueError, match=str(NB + 5)):
        pn.paged_decode(torch.from_numpy(q).cuda(), cache, table, torch.from_numpy(lens).cuda(),
                        validate=True, stream=side)
