"""Working on the caller's arrays: ``out=``/``lse=`` buffers, results in the
caller's library, and ``stream=`` arguments (caches over the caller's pools,
``PagedKVCache.from_device``: ``test_interop_from_device.py``, which imports
this module's geometry and helpers).

* ``out=``/``lse=`` are written in place, returned, and equal the allocating
  call bit for bit, even when filled with NaN first (the kernels write every
  element, the zeros of an empty sequence included); a bad buffer raises
  before any launch and is left as it was.
* Every accepted kind of stream is accepted by every launching call, and a
  bad one raises before any launch.
* torch in, torch out: a cache over torch pools, and the calls on torch
  tensors, return torch tensors without copies (skipped where torch is not
  installed).

Shapes are tiny and caches float32 where the dtype does not matter: the
CUDA-core decode kernel is the quick one on the simulator.
"""
import ml_dtypes
import numpy as np
import pytest
from numba import cuda

import paged_numba as pn
from paged_numba import _launch

SIM = pn.simulator_enabled()
F32 = np.float32
I32 = np.int32
BF16 = np.dtype(ml_dtypes.bfloat16)

NB, BS, H, D = 4, 4, 1, 16          # blocks, block size, KV heads, head size
SLOTS = [0, 1, 2, 3, 8, 9]          # 6 tokens: block 0 whole, block 2 offsets 0 and 1
TABLE = [[0, 2], [1, -1]]           # sequence 1 is empty: 6 = 4 + 2 tokens and 0
LENS = [6, 0]


def _kv(dtype, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((len(SLOTS), H, D)).astype(dtype)


def _query(dtype, rows=2, heads=2, seed=1):
    return np.random.default_rng(seed).standard_normal((rows, heads, D)).astype(dtype)


def _filled(cache, dtype):
    kv = _kv(dtype)
    pn.write_kv(cache, kv, -kv, SLOTS)
    return cache


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint16) if x.dtype == BF16 else x


def _same(a, b):
    """Bit-for-bit equal arrays (NaN included), or tuples of them."""
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    a, b = _bits(pn._arrays.to_host(a)), _bits(pn._arrays.to_host(b))
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


# -- out= and lse=


def _env(dtype=F32):
    cache = _filled(pn.PagedKVCache(NB, BS, H, D, dtype=np.dtype(dtype).name), dtype)
    return cache, _query(dtype)


def _nan(shape, dtype, device):
    a = np.full(shape, np.nan, dtype)
    if device:
        return cuda.to_device(a.view(np.uint16) if np.dtype(dtype) == BF16 else a)
    return a


def _calls():
    """``(id, call(query, **kw) -> result, out shape, lse shape)``."""
    return [
        ("decode", lambda c, q, **kw: pn.paged_decode(q, c, TABLE, LENS, **kw), (2, 2, D), (2, 2)),
        ("decode-split", lambda c, q, **kw: pn.paged_decode(q, c, TABLE, LENS, num_partitions=2,
                                                            **kw), (2, 2, D), (2, 2)),
        ("prefill", lambda c, q, **kw: pn.paged_prefill(q, c, [[0, 2]], [0, 2], [6], **kw),
         (2, 2, D), (2, 2)),
        ("cascade", lambda c, q, **kw: pn.cascade_decode(q, c, [0], 4, [[2], [1]], [2, 0], **kw),
         (2, 2, D), (2, 2)),
    ]


@pytest.mark.parametrize("device", [False, True], ids=["numpy", "numba"])
@pytest.mark.parametrize("call", _calls(), ids=lambda c: c[0])
def test_out_and_lse_are_written_in_place_and_equal_the_allocating_call(call, device):
    _, fn, out_shape, lse_shape = call
    cache, q = _env()
    query = cuda.to_device(q) if device else q
    want_out, want_lse = fn(cache, query, return_lse=True)
    out, lse = _nan(out_shape, F32, device), _nan(lse_shape, F32, device)
    got = fn(cache, query, out=out, lse=lse, return_lse=True)
    assert got[0] is out and got[1] is lse
    assert _same(out, want_out) and _same(lse, want_lse)
    out2 = _nan(out_shape, F32, device)
    assert fn(cache, query, out=out2) is out2 and _same(out2, want_out)   # out alone


@pytest.mark.parametrize("device", [False, True], ids=["numpy", "numba"])
def test_merge_states_out_and_lse_in_place(device):
    rng = np.random.default_rng(4)
    v = rng.standard_normal((3, 2, 2, D)).astype(np.float16)
    s = rng.standard_normal((3, 2, 2)).astype(F32)
    s[1, 0] = -np.inf
    if device:
        v, s = cuda.to_device(v), cuda.to_device(s)
    want = pn.merge_states(v, s)
    out, lse = _nan((3, 2, D), np.float16, device), _nan((3, 2), F32, device)
    got = pn.merge_states(v, s, out=out, lse=lse)
    assert got[0] is out and got[1] is lse and _same(out, want[0]) and _same(lse, want[1])


def test_plans_write_out_and_lse_in_place_and_repack_for_new_buffers():
    cache, q = _env()
    dq = cuda.to_device(q)
    tables, lens = cuda.to_device(np.array(TABLE, I32)), cuda.to_device(np.array(LENS, I32))
    for parts in (1, 2):
        want_out, want_lse = pn.paged_decode(q, cache, TABLE, LENS, return_lse=True,
                                             num_partitions=parts)
        plan = pn.DecodePlan(cache, num_seqs=2, num_heads=2, max_blocks=2, num_partitions=parts)
        own = plan.run(dq, tables, lens)
        assert own is plan.out and _same(own, want_out)
        out, lse = _nan((2, 2, D), F32, True), _nan((2, 2), F32, True)
        assert plan.run(dq, tables, lens, out=out, lse=lse) is out
        assert _same(out, want_out) and _same(lse, want_lse)
        plan.out.copy_to_device(np.full((2, 2, D), 7, F32))
        out2 = _nan((2, 2, D), F32, True)
        assert plan.run(dq, tables, lens, out=out2) is out2 and _same(out2, want_out)
        assert _same(plan.out, np.full((2, 2, D), 7, F32))       # the plan's own untouched
    prefill_out, prefill_lse = pn.paged_prefill(q, cache, [[0, 2]], [0, 2], [6], return_lse=True)
    plan = pn.PrefillPlan(cache, [0, 2], [6], num_heads=2)
    t = cuda.to_device(np.array([[0, 2]], I32))
    out, lse = _nan((2, 2, D), F32, True), _nan((2, 2), F32, True)
    assert plan.run(dq, t, out=out, lse=lse) is out
    assert _same(out, prefill_out) and _same(lse, prefill_lse)
    cascade_want = pn.cascade_decode(q, cache, [0], 4, [[2], [1]], [2, 0], return_lse=True)
    plan = pn.CascadeDecodePlan(cache, [0], 4, num_seqs=2, num_heads=2, max_blocks=1)
    out, lse = _nan((2, 2, D), F32, True), _nan((2, 2), F32, True)
    assert plan.run(dq, cuda.to_device(np.array([[2], [1]], I32)),
                    cuda.to_device(np.array([2, 0], I32)), out=out, lse=lse) is out
    assert _same(out, cascade_want[0]) and _same(lse, cascade_want[1])


@pytest.mark.parametrize("parts", [1, 2])
def test_large_group_decode_writes_out_and_lse_in_place(parts):
    """MQA with 32 query heads runs on the prefill tile (``_group_decode``)."""
    cache = _filled(pn.PagedKVCache(NB, BS, H, D), np.float16)
    q = cuda.to_device(_query(np.float16, rows=1, heads=32))
    table, lens = [[0, 2]], [6]
    want = pn.paged_decode(q, cache, table, lens, num_partitions=parts, return_lse=True)
    out, lse = _nan((1, 32, D), np.float16, True), _nan((1, 32), F32, True)
    got = pn.paged_decode(q, cache, table, lens, num_partitions=parts, out=out, lse=lse,
                          return_lse=True)
    assert got[0] is out and got[1] is lse and _same(got, want)
    plan = pn.DecodePlan(cache, num_seqs=1, num_heads=32, max_blocks=2, num_partitions=parts)
    assert plan._group is not None
    out, lse = _nan((1, 32, D), np.float16, True), _nan((1, 32), F32, True)
    t, n = cuda.to_device(np.array(table, I32)), cuda.to_device(np.array(lens, I32))
    assert plan.run(q, t, n, out=out, lse=lse) is out and _same((out, lse), want)


def _bad_buffers(device):
    """``(id, out, lse, error, message)`` that every call must refuse."""
    other = (lambda a: np.asarray(a)) if device else cuda.to_device
    mk = (lambda a: cuda.to_device(a)) if device else (lambda a: a)
    wide = mk(np.zeros((2, 2, 2 * D), F32))
    shared = mk(np.zeros(2 * 2 * D + 2, F32))       # out: [0, 64), lse: [62, 66)
    return [
        ("out shape", mk(np.zeros((2, 2, D + 8), F32)), None, ValueError, "out must be"),
        ("out dtype", mk(np.zeros((2, 2, D), np.float16)), None, ValueError,
         "out must be float32"),
        ("lse shape", None, mk(np.zeros((2, 3), F32)), ValueError, "lse must be"),
        ("lse dtype", None, mk(np.zeros((2, 2), np.float64)), ValueError, "lse must be float32"),
        ("out strided", wide[:, :, :D], None, ValueError, "out must be C-contiguous"),
        ("out kind", other(np.zeros((2, 2, D), F32)), None, TypeError, "out must be a"),
        ("out list", [[0.0]], None, TypeError, "out must be a"),
        ("out and lse overlap", shared[:2 * 2 * D].reshape(2, 2, D),
         shared[2 * 2 * D - 2:].reshape(2, 2), ValueError, "out and lse share memory"),
    ]


@pytest.mark.parametrize("device", [False, True], ids=["numpy", "numba"])
@pytest.mark.parametrize("call", _calls(), ids=lambda c: c[0])
def test_bad_out_or_lse_raises_before_any_launch_and_is_untouched(call, device):
    _, fn, _, _ = call
    cache, q = _env()
    query = cuda.to_device(q) if device else q
    for name, out, lse, error, message in _bad_buffers(device):
        before = [None if x is None or isinstance(x, list) else np.array(pn._arrays.to_host(x))
                  for x in (out, lse)]
        launches = _launch.launch_count()
        with pytest.raises(error, match=message):
            fn(cache, query, out=out, lse=lse)
        assert _launch.launch_count() == launches, name
        for x, b in zip((out, lse), before):
            if b is not None:
                assert _same(x, b), name


def test_out_sharing_memory_with_the_query_is_refused():
    cache, q = _env()
    dq = cuda.to_device(q)
    launches = _launch.launch_count()
    with pytest.raises(ValueError, match="out shares memory with query"):
        pn.paged_decode(dq, cache, TABLE, LENS, out=dq)
    plan = pn.DecodePlan(cache, num_seqs=2, num_heads=2, max_blocks=2)
    with pytest.raises(ValueError, match="out shares memory with query"):
        plan.run(dq, cuda.to_device(np.array(TABLE, I32)), cuda.to_device(np.array(LENS, I32)),
                 out=dq)
    assert _launch.launch_count() == launches
    assert _same(dq, q)


# -- streams


class _TorchLike:                     # what the calls read of a torch.cuda.Stream
    def __init__(self, handle):
        self.cuda_stream = handle


class _CupyLike:                      # ... and of a cupy.cuda.Stream
    def __init__(self, handle):
        self.ptr = handle


class _Protocol:                      # the __cuda_stream__ protocol (cuda.core)
    def __init__(self, handle):
        self.handle_ = handle

    def __cuda_stream__(self):
        return (0, self.handle_)


def _streams():
    """One stream of each accepted kind (on a GPU, of one real stream)."""
    numba_stream = cuda.stream()
    handle = 0 if SIM else int(numba_stream.handle)
    return {"none": None, "zero": 0, "int": handle, "numba": numba_stream,
            "numba-default": cuda.default_stream(), "torch-like": _TorchLike(handle),
            "cupy-like": _CupyLike(handle), "protocol": _Protocol(handle)}


def _launching_calls():
    cache, q = _env()
    dq = cuda.to_device(q)
    tables, lens = cuda.to_device(np.array(TABLE, I32)), cuda.to_device(np.array(LENS, I32))
    dplan = pn.DecodePlan(cache, num_seqs=2, num_heads=2, max_blocks=2)
    pplan = pn.PrefillPlan(cache, [0, 2], [6], num_heads=2)
    pool = pn.host_pool(cache, 1)
    kv = _kv(F32)[:1]
    v, s = np.zeros((1, 2, 2, D), F32), np.zeros((1, 2, 2), F32)
    return {
        "write_kv": lambda st: pn.write_kv(cache, kv, kv, [15], stream=st),
        "paged_decode": lambda st: pn.paged_decode(dq, cache, TABLE, LENS, stream=st),
        "paged_prefill": lambda st: pn.paged_prefill(dq, cache, [[0, 2]], [0, 2], [6], stream=st),
        "merge_states": lambda st: pn.merge_states(v, s, stream=st),
        "copy_blocks": lambda st: pn.copy_blocks(cache, [(0, 3)], stream=st),
        "swap_blocks": lambda st: pn.swap_blocks(cache, pool, [(0, 0)], stream=st),
        "DecodePlan.run": lambda st: dplan.run(dq, tables, lens, stream=st),
        "PrefillPlan.run": lambda st: pplan.run(dq, cuda.to_device(np.array([[0, 2]], I32)),
                                                stream=st),
        "cascade_decode": lambda st: pn.cascade_decode(dq, cache, [0], 4, [[2], [1]], [2, 0],
                                                       stream=st),
    }


CHEAP = ("write_kv", "merge_states", "copy_blocks", "swap_blocks")


def test_every_launching_call_takes_every_kind_of_stream():
    """The cheap calls take every kind; the attention calls (seconds each on
    the simulator) take the kinds in turn, two each, every kind at least once."""
    calls = _launching_calls()
    want = {name: fn(None) for name, fn in calls.items()}
    attention = [name for name in calls if name not in CHEAP]
    for k, (kind, stream) in enumerate(_streams().items()):
        names = list(CHEAP) + [attention[k % len(attention)],
                               attention[(k + 2) % len(attention)]]
        for name in names:
            got = calls[name](stream)
            cuda.synchronize()
            if want[name] is not None:
                assert _same(got, want[name]), (kind, name)


@pytest.mark.parametrize("stream,error", [("s0", TypeError), (1.5, TypeError), (True, TypeError),
                                          (-1, ValueError), (object(), TypeError)],
                         ids=["str", "float", "bool", "negative", "object"])
def test_a_bad_stream_raises_before_any_launch(stream, error):
    for name, fn in _launching_calls().items():
        launches = _launch.launch_count()
        with pytest.raises(error, match="stream must be"):
            fn(stream)
        assert _launch.launch_count() == launches, name


# -- torch in, torch out (skipped where torch is not installed)


def _torch_device():
    return "cpu" if SIM else "cuda"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_in_torch_out_without_copies(dtype):
    torch = pytest.importorskip("torch")
    tdt, dev = getattr(torch, dtype), _torch_device()
    key = torch.zeros((NB, BS, H, D), dtype=tdt, device=dev)
    value = torch.zeros_like(key)
    cache = pn.PagedKVCache.from_device(key, value)
    regular = pn.PagedKVCache(NB, BS, H, D, dtype=dtype)
    kv = torch.from_numpy(_kv(F32)).to(tdt)
    for c in (cache, regular):
        pn.write_kv(c, kv.to(dev), (-kv).to(dev), SLOTS)
    assert torch.equal(key[2, 1].cpu(), kv[5]) and torch.equal(value[0, 0].cpu(), -kv[0])
    q = torch.from_numpy(_query(F32)).to(tdt).to(dev)
    out, lse = pn.paged_prefill(q, cache, [[0, 2]], [0, 2], [6], return_lse=True)
    assert isinstance(out, torch.Tensor) and out.dtype == tdt and out.device == q.device
    assert isinstance(lse, torch.Tensor) and lse.dtype == torch.float32
    want = pn.paged_prefill(pn._arrays.to_host(q), regular, [[0, 2]], [0, 2], [6])
    assert _same(out, want)
    buf = torch.full((2, 2, D), float("nan"), dtype=tdt, device=dev)
    assert pn.paged_prefill(q, cache, [[0, 2]], [0, 2], [6], out=buf) is buf and _same(buf, want)
    with pytest.raises(ValueError, match="out must be"):
        pn.paged_prefill(q, cache, [[0, 2]], [0, 2], [6],
                         out=torch.zeros((2, 2, D), dtype=torch.float16, device=dev))
    plan = pn.PrefillPlan(cache, [0, 2], [6], num_heads=2)
    got = plan.run(q, pn._arrays.as_device(np.array([[0, 2]], I32), "t")[0])
    assert isinstance(got, torch.Tensor) and got.dtype == tdt and _same(got, want)
    assert pn.interop.address(pn._arrays.as_device(got, "got")[0]) == pn.interop.address(plan.out)


def test_torch_merge_and_decode_return_tensors():
    torch = pytest.importorskip("torch")
    dev = _torch_device()
    cache, q = _env()
    want = pn.paged_decode(q, cache, TABLE, LENS)
    got = pn.paged_decode(torch.from_numpy(q).to(dev), cache, TABLE, LENS)
    assert isinstance(got, torch.Tensor) and _same(got, want)
    v = torch.zeros((1, 2, 2, D), dtype=torch.float16, device=dev)
    s = torch.zeros((1, 2, 2), device=dev)
    out, lse = pn.merge_states(v, s)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float16
    assert abs(float(lse[0, 0]) - np.log(2)) < 1e-6
