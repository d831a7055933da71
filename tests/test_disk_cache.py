"""The disk cache of compiled kernels (``kernels/disk_cache.py``): keys that
tell every specialisation apart and stay the same from one process to the
next, entries that are complete whatever the concurrent writers, misses for
anything damaged, and (on a GPU) a second process that compiles nothing."""
import json
import os
import pathlib
import pickle
import subprocess
import sys
import threading

import numpy as np
import pytest

import paged_numba
from paged_numba.kernels import disk_cache
from paged_numba.kernels.disk_cache import DiskCache, Unkeyable, fingerprint

ROOT = pathlib.Path(__file__).resolve().parent.parent
SIM = paged_numba.simulator_enabled()

KEYS = """
import json, os
from paged_numba.kernels.specializations import all_specializations
from paged_numba.kernels.disk_cache import fingerprint
print(json.dumps([[name, fingerprint(k), str(sig)] for name, k, sig in all_specializations()]))
"""


def _python(code, **env):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               **env)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_keys_tell_every_specialisation_apart_and_last():
    """Every kernel specialisation (real numba dispatchers, whose device
    functions the keys follow) gets its own key, and two fresh processes give
    the same keys. The GPU is hidden: with one, choosing the decode launches
    compiles kernels to read their register counts."""
    hidden = dict(NUMBA_ENABLE_CUDASIM="0", CUDA_VISIBLE_DEVICES="")
    first = json.loads(_python(KEYS, **hidden))
    second = json.loads(_python(KEYS, **hidden))
    assert first == second
    names = {name for name, _, _ in first}
    keys = {(fp, sig) for _, fp, sig in first}
    pairs = {(name, fp, sig) for name, fp, sig in first}
    assert len(names) > 200 and len(keys) == len(names) == len(pairs)


def _factory(n, helper):
    def kernel(x):
        return helper(x) * n + SCALE
    return kernel


SCALE = 2.0


def _plus_one(x):
    return x + 1


def _plus_two(x):
    return x + 2


def test_fingerprint_follows_captures_globals_and_called_code(monkeypatch):
    base = fingerprint(_factory(3, _plus_one))
    assert fingerprint(_factory(3, _plus_one)) == base
    assert fingerprint(_factory(4, _plus_one)) != base                # a captured value
    assert fingerprint(_factory(3, _plus_two)) != base                # a called function's code
    assert fingerprint(_factory(np.int32(3), _plus_one)) != base      # the value's type
    monkeypatch.setitem(globals(), "SCALE", 2.5)
    assert fingerprint(_factory(3, _plus_one)) != base                # a global read
    with pytest.raises(Unkeyable, match="threading.Lock|lock"):
        fingerprint(_factory(3, threading.Lock()))
    # a name the factory binds only on one branch: an empty cell on the other
    assert fingerprint(_branchy(False)) == fingerprint(_branchy(False))
    assert fingerprint(_branchy(False)) != fingerprint(_branchy(True))


def _branchy(on):
    if on:
        extra = 1

    def kernel(x):
        return x + extra if on else x
    return kernel


class _Kernel:
    """What the cache needs of a compiled kernel."""

    def __init__(self, payload):
        self.payload = payload

    def _reduce_states(self):
        return {"payload": self.payload}


class _Cache(DiskCache):
    rebuild = staticmethod(lambda states: states["payload"])


def _cache(tmp_path, fn=_plus_one, env=("test",), options=None):
    return _Cache(fn, directory=tmp_path, environment=env, options=options)


def test_entries_round_trip_and_are_keyed(tmp_path):
    cache = _cache(tmp_path)
    sig = ("float32", "array(float16, 4d, C)")
    assert cache.load_overload(sig) is None
    cache.save_overload(sig, _Kernel("compiled"))
    assert cache.load_overload(sig) == "compiled"
    assert _cache(tmp_path).load_overload(sig) == "compiled"              # another process
    assert cache.load_overload(("float64",) + sig[1:]) is None            # another signature
    assert _cache(tmp_path, fn=_plus_two).load_overload(sig) is None      # another kernel
    assert _cache(tmp_path, env=("other numba",)).load_overload(sig) is None
    # the same function under other jit options (a register limit) compiles to other code
    assert _cache(tmp_path, options={"max_registers": 128}).load_overload(sig) is None
    assert len(disk_cache.entries(tmp_path)) == 1
    assert disk_cache.clear(tmp_path) == 1 and cache.load_overload(sig) is None


def test_damaged_entries_and_unwritable_directories_are_misses(tmp_path):
    cache, sig = _cache(tmp_path), ("int32",)
    cache.save_overload(sig, _Kernel("x" * 1000))
    path = cache.path(sig)
    path.write_bytes(path.read_bytes()[:100])                  # cut short
    assert cache.load_overload(sig) is None
    path.write_bytes(b"not a pickle")
    assert cache.load_overload(sig) is None
    cache.save_overload(sig, _Kernel("again"))                 # replaced by the next compile
    assert cache.load_overload(sig) == "again"
    blocked = tmp_path / "file"
    blocked.write_text("")
    stuck = _cache(blocked / "sub")                            # its directory cannot be made
    stuck.save_overload(sig, _Kernel("y"))
    assert stuck.load_overload(sig) is None
    lcs = _Kernel("z")
    lcs.launch_config_sensitive = True
    cache.save_overload(("int64",), lcs)
    assert cache.load_overload(("int64",)) is None


def test_concurrent_writers_leave_whole_entries(tmp_path):
    """Writers of the same key (different sizes, as two compilers' pickles may
    differ) and a reader at once: each read is a miss or a whole entry."""
    path = tmp_path / "k.nbk"
    stop, seen, bad = threading.Event(), [], []

    def write(n):
        data = pickle.dumps(bytes([n]) * (50_000 * n))
        for _ in range(40):
            disk_cache.write_atomic(path, data)

    def read():
        while not stop.is_set():
            try:
                value = pickle.loads(path.read_bytes())
            except FileNotFoundError:
                continue
            except Exception as e:          # a torn file would land here
                bad.append(repr(e))
                continue
            if value != bytes([value[0]]) * len(value):
                bad.append("mixed")
            seen.append(len(value))

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=write, args=(n,)) for n in (1, 2, 3)]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    stop.set()
    reader.join()
    assert not bad and seen
    assert sorted(os.listdir(tmp_path)) == ["k.nbk"]           # no temporary file left


def test_attach_only_to_dispatchers_without_a_cache(monkeypatch):
    from numba.core.caching import NullCache

    class Dispatcher:
        py_func = staticmethod(_plus_one)
        targetoptions = {"max_registers": 64}

    d = Dispatcher()
    d._cache = NullCache()
    disk_cache.attach(d)
    assert isinstance(d._cache, DiskCache) and d._cache.py_func is _plus_one
    assert d._cache.options == {"max_registers": 64}
    kept = d._cache
    disk_cache.attach(d)
    assert d._cache is kept
    own = Dispatcher()
    own._cache = object()                   # numba's cache=True, chosen by the caller
    disk_cache.attach(own)
    assert not isinstance(own._cache, DiskCache)
    monkeypatch.setenv("PAGED_NUMBA_CACHE", "off")
    off = Dispatcher()
    off._cache = NullCache()
    disk_cache.attach(off)
    assert isinstance(off._cache, NullCache)
    disk_cache.attach(object())             # the simulator's kernels have no cache


def test_cache_directory_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGED_NUMBA_CACHE_DIR", str(tmp_path / "k"))
    assert disk_cache.cache_dir() == tmp_path / "k"
    monkeypatch.delenv("PAGED_NUMBA_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert disk_cache.cache_dir() == tmp_path / "paged_numba" / "kernels"


def test_command_line_shows_and_clears(monkeypatch, tmp_path, capsys):
    from paged_numba.__main__ import main

    monkeypatch.setenv("PAGED_NUMBA_CACHE_DIR", str(tmp_path))
    _cache(tmp_path).save_overload(("int32",), _Kernel("x"))
    assert main(["cache"]) == 0
    assert capsys.readouterr().out.startswith(f"{tmp_path}: 1 kernels, ")
    assert main(["cache", "--clear"]) == 0
    assert capsys.readouterr().out == f"removed 1 files from {tmp_path}\n"
    assert disk_cache.entries(tmp_path) == []


FIRST_CALL = """
import time, hashlib
t0 = time.perf_counter()
import numpy as np, paged_numba as pn
rng = np.random.default_rng(0)
cache = pn.PagedKVCache(num_blocks=64, block_size=16, num_kv_heads=8, head_size=128, dtype="float16")
k = rng.standard_normal((300, 8, 128)).astype(np.float16)
pn.write_kv(cache, k, k, np.arange(300))
q = rng.standard_normal((2, 32, 128)).astype(np.float16)
tables = np.arange(40, dtype=np.int32).reshape(2, 20)
out = pn.paged_decode(q, cache, tables, np.array([300, 120], np.int32))
out = np.asarray(out)
print(time.perf_counter() - t0, hashlib.sha256(out.tobytes()).hexdigest())
"""


@pytest.mark.skipif(SIM, reason="compiling needs a GPU; the simulator compiles nothing")
def test_a_second_process_compiles_nothing(tmp_path):
    env = {"PAGED_NUMBA_CACHE_DIR": str(tmp_path)}
    cold, out_cold = _python(FIRST_CALL, **env).split()
    files = {p: p.stat().st_mtime_ns for p in disk_cache.entries(tmp_path)}
    warm, out_warm = _python(FIRST_CALL, **env).split()
    assert files and out_warm == out_cold
    assert {p: p.stat().st_mtime_ns for p in disk_cache.entries(tmp_path)} == files
    assert float(warm) < float(cold)


@pytest.mark.skipif(SIM, reason="linking needs a GPU; the simulator compiles nothing")
def test_a_register_limit_is_linked_not_compiled(tmp_path, monkeypatch):
    """``relink`` gives the dispatcher built with a register limit the PTX of
    the one without, linked under the limit: the registers and local memory
    of Numba compiling it afresh, no compile of its own, and an entry on
    disk."""
    from numba import cuda
    from paged_numba.kernels import decode_tc
    from paged_numba.kernels.specializations import decode_signatures

    monkeypatch.setenv("PAGED_NUMBA_CACHE_DIR", str(tmp_path))
    sig = tuple(decode_signatures("float16", "nhd")[0])
    args = (128, 16, 4, "float16", "nhd", 4, 2, False)
    source = decode_tc.decode_tc_kernel(*args, pv_mma=True, key_rows=True)
    disk_cache.attach(source)                                 # kept on disk, as the launch does
    limit = source.compile(sig).regs_per_thread // 8 * 8 - 24     # a limit no other test uses
    target = decode_tc.decode_tc_kernel(*args, pv_mma=True, key_rows=True, max_registers=limit)
    disk_cache.attach(target)
    assert target._cache.path(sig) != source._cache.path(sig)    # not the unlimited kernel
    assert disk_cache.relink(source, target, sig)
    linked = target.compile(sig)
    assert sum(target._cache_misses.values()) == 0           # numba compiled nothing
    fresh = cuda.jit(max_registers=limit)(target.py_func).compile(sig)
    assert linked.regs_per_thread == fresh.regs_per_thread <= limit
    assert linked.local_mem_per_thread == fresh.local_mem_per_thread
    ptx = linked._codelibrary.get_asm_str()
    assert ptx == source.compile(sig)._codelibrary.get_asm_str()
    assert target._cache.path(sig).exists()                    # kept on disk
    assert not disk_cache.relink(source, target, sig)         # it has the kernel already
