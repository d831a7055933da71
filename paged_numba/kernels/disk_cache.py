"""Compiled kernels kept on disk, so that a new process does not compile them again.

Numba compiles a kernel on its first launch with a new signature: typing,
lowering, NVVM and ``ptxas``, seconds to tens of seconds for the tensor-core
kernels. Every kernel the package launches goes through ``_launch``, which
gives its dispatcher a :class:`DiskCache` before the first launch. On a
compile, Numba's dispatcher asks that cache first (``load_overload``) and hands
it what it compiled (``save_overload``): the kernel's PTX and cubin, as
Numba's own ``cache=True`` stores them.

A kernel is found again under a key made of

* its :func:`fingerprint`: the kernel function's code, the constants and
  device functions its closure captured (the factory's arguments, in effect),
  and the globals it reads, followed through every device function it calls;
* the argument types of the launch;
* the source of every module of the package, the versions of the package,
  numba, numba-cuda and Python, the ``NUMBA_*`` environment, the way device
  functions are inlined (``PAGED_NUMBA_INLINE``) and the device's compute
  capability.

So an edited kernel, another numba or another GPU compiles afresh. Entries
are written to a temporary file and renamed into place, so processes that
compile the same kernel at once (test workers, a sweep's workers) never see a
half-written file; the last writer wins and every entry is complete. An
entry that cannot be read is a miss. Numba's own ``cache=True`` is not used:
it keys a closure by pickling its cells, which the kernels' device functions
do not survive, and it keeps its index per source file, which concurrent
writers of many specialisations rewrite.

The directory is ``$PAGED_NUMBA_CACHE_DIR``, else
``$XDG_CACHE_HOME/paged_numba/kernels`` (``~/.cache/paged_numba/kernels``);
``PAGED_NUMBA_CACHE=0`` turns the cache off. ``python -m paged_numba cache``
shows it and ``--clear`` empties it. Under the simulator nothing compiles and
nothing is kept.

A kernel compiled again with only a register limit added (``tuning``'s
decode launch does that where a few registers fewer buy one more resident
block) need not go through Numba again: :func:`relink` links the first
compile's PTX under the limit.
"""
import functools
import hashlib
import importlib.metadata
import os
import pathlib
import pickle
import sys
import tempfile
import types as pytypes

import numpy as np

DIR_ENV, SWITCH_ENV = "PAGED_NUMBA_CACHE_DIR", "PAGED_NUMBA_CACHE"
SUFFIX = ".nbk"
PACKAGE = pathlib.Path(__file__).resolve().parent.parent      # paged_numba/


def cache_dir():
    """The directory the kernels are kept in (see the module's text)."""
    if os.environ.get(DIR_ENV):
        return pathlib.Path(os.environ[DIR_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "paged_numba" / "kernels"


def enabled():
    """False when ``PAGED_NUMBA_CACHE`` is ``0``, ``false``, ``no`` or ``off``."""
    return os.environ.get(SWITCH_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


class Unkeyable(TypeError):
    """A kernel captured an object :func:`fingerprint` cannot describe; it is
    compiled as usual and not kept."""


def fingerprint(fn):
    """A hex digest that tells compiled kernels apart: equal for two kernel
    functions (or Numba dispatchers) with the same code, the same captured
    values and the same globals, followed through every function and device
    function they reach; different when any of those differ. Raises
    :class:`Unkeyable` for a captured object it cannot describe.

    >>> def factory(n):
    ...     def kernel(x):
    ...         return x * n
    ...     return kernel
    >>> fingerprint(factory(2)) == fingerprint(factory(2)), fingerprint(factory(2)) == fingerprint(factory(3))
    (True, False)
    """
    text = repr(_Canon().of(fn))
    return hashlib.sha256(text.encode()).hexdigest()


class _Canon:
    """Nested tuples of strings standing for an object, for :func:`fingerprint`.
    Shared objects are described once (later mentions name the first), and a
    function reached again while it is being described (recursion) is named."""

    def __init__(self):
        self.seen = {}          # id -> its index in the order described
        self.keep = []          # the objects of those ids, kept alive

    def of(self, obj):
        if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes)):
            return (type(obj).__name__, repr(obj))
        if isinstance(obj, (tuple, list)):
            return (type(obj).__name__,) + tuple(self.of(x) for x in obj)
        if isinstance(obj, (set, frozenset)):
            return ("set",) + tuple(sorted(repr(self.of(x)) for x in obj))
        if isinstance(obj, dict):
            return ("dict",) + tuple(sorted((repr(self.of(k)), self.of(v)) for k, v in obj.items()))
        if isinstance(obj, np.dtype):
            return ("dtype", obj.name, obj.str)
        if isinstance(obj, np.generic):
            return ("np", obj.dtype.name, repr(obj.item()))
        if isinstance(obj, pytypes.ModuleType):
            return ("module", obj.__name__)
        if isinstance(obj, type):
            return ("class", obj.__module__, obj.__qualname__)
        if isinstance(obj, (pytypes.BuiltinFunctionType, pytypes.MethodDescriptorType)):
            return ("builtin", getattr(obj, "__module__", None) or "", obj.__qualname__)
        key = id(obj)
        if key in self.seen:
            return ("again", str(self.seen[key]))
        self.seen[key] = len(self.seen)
        self.keep.append(obj)
        return self._compound(obj)

    def _compound(self, obj):
        from numba.core import types as nbtypes

        if isinstance(obj, nbtypes.Type):
            return ("numba type", type(obj).__name__, str(obj))
        if type(obj).__module__.startswith("llvmlite.ir"):           # an intrinsic's IR types
            return ("llvm", type(obj).__name__, str(obj))
        if isinstance(obj, np.ndarray):
            return ("ndarray", obj.dtype.str, str(obj.shape),
                    hashlib.sha256(np.ascontiguousarray(obj).tobytes()).hexdigest())
        if isinstance(obj, pytypes.CodeType):
            return ("code", obj.co_name, obj.co_code.hex(), obj.co_names, obj.co_varnames,
                    obj.co_freevars, self.of(obj.co_consts))
        if isinstance(obj, pytypes.FunctionType):
            cells = ("cells",) + tuple(self._cell(c) for c in obj.__closure__ or ())
            return ("function", obj.__module__, obj.__qualname__, self.of(obj.__code__),
                    self.of(obj.__defaults__), self.of(obj.__kwdefaults__), cells,
                    self.of(self._globals(obj)))
        if isinstance(obj, functools.partial):
            return ("partial", self.of(obj.func), self.of(obj.args), self.of(obj.keywords))
        if isinstance(obj, pytypes.SimpleNamespace):
            return ("namespace", self.of(vars(obj)))
        if hasattr(obj, "py_func") and hasattr(obj, "targetoptions"):      # a numba dispatcher
            return ("jit", type(obj).__name__, self.of(obj.py_func), self.of(obj.targetoptions))
        if hasattr(obj, "_defn") and type(obj).__name__ == "_Intrinsic":    # numba @intrinsic
            return ("intrinsic", obj._name, self.of(obj._defn))
        raise Unkeyable(f"cannot fingerprint a {type(obj).__module__}.{type(obj).__qualname__}")

    def _cell(self, cell):
        """A closure cell's value, or a cell never filled: a name the
        enclosing factory binds only on a branch it did not take."""
        try:
            value = cell.cell_contents
        except ValueError:
            return ("empty cell",)
        return self.of(value)

    @staticmethod
    def _globals(fn):
        """The globals ``fn``'s code (and the code nested in it) reads, by name."""
        names, todo = set(), [fn.__code__]
        while todo:
            code = todo.pop()
            names.update(code.co_names)
            todo += [c for c in code.co_consts if isinstance(c, pytypes.CodeType)]
        return {n: fn.__globals__[n] for n in sorted(names) if n in fn.__globals__}


@functools.cache
def _source_digest():
    """A digest of every module of the package (``*.py`` under it)."""
    h = hashlib.sha256()
    for path in sorted(PACKAGE.rglob("*.py")):
        h.update(str(path.relative_to(PACKAGE)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _version(dist):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _environment():
    """The versions and settings besides the kernel that change what compiles."""
    from numba import cuda

    from .convert import inline_mode

    numba_env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("NUMBA_")))
    return (_source_digest(), _version("paged-numba"), _version("numba"),
            _version("numba-cuda"), sys.version_info[:2],
            cuda.get_current_device().compute_capability, numba_env, inline_mode())


class DiskCache:
    """What a Numba ``CUDADispatcher`` asks before it compiles and tells after
    (its ``_cache``): ``load_overload(sig, target_context)`` gives a kept
    kernel or None, ``save_overload(sig, kernel)`` keeps one.
    ``directory`` defaults to :func:`cache_dir` at each call, ``environment``
    (any value with a stable ``repr``) to the versions, sources and device of
    this process; ``options`` (the dispatcher's ``targetoptions``:
    ``max_registers``, ``fastmath``, ...) are part of the key, as they change
    the compiled code and not the function."""

    def __init__(self, py_func, directory=None, environment=None, options=None):
        self.py_func, self.directory, self.environment = py_func, directory, environment
        self.options = dict(options or {})      # the dispatcher's jit options: part of the key
        self._digest = None

    @property
    def cache_path(self):
        return str(self.directory or cache_dir())

    def path(self, sig):
        """The file of signature ``sig`` (argument types), or None when the
        kernel is :class:`Unkeyable`."""
        if self._digest is None:
            try:
                self._digest = fingerprint((self.py_func, self.options))
            except Unkeyable:
                self._digest = False
        if not self._digest:
            return None
        env = _environment() if self.environment is None else self.environment
        key = repr((self._digest, tuple(str(t) for t in sig), env))
        name = hashlib.sha256(key.encode()).hexdigest()[:40] + SUFFIX
        return pathlib.Path(self.cache_path) / name

    def load_overload(self, sig, target_context=None):
        path = self.path(sig)
        if path is None:
            return None
        try:
            states = pickle.loads(path.read_bytes())
        except FileNotFoundError:
            return None
        except Exception:               # an entry from elsewhere, or damaged: a miss
            return None
        return self.rebuild(states)

    def save_overload(self, sig, kernel):
        if getattr(kernel, "launch_config_sensitive", False):
            return                      # its code depends on the launch: not kept
        path = self.path(sig)
        if path is None:
            return
        try:
            data = pickle.dumps(kernel._reduce_states(), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:               # Numba refuses some kernels (captured device arrays)
            return
        write_atomic(path, data)

    @staticmethod
    def rebuild(states):
        from numba.cuda.dispatcher import _Kernel

        return _Kernel._rebuild(**states)

    def flush(self):
        """Numba's ``recompile`` flushes the cache; entries are keyed by their
        code, so there is nothing stale to drop."""


def write_atomic(path, data):
    """Write ``data`` to ``path`` through a temporary file in the same directory
    and a rename, so a reader sees the old file, no file or all of the new one.
    Failing to write (a read-only disk, a full one) is not an error: the
    kernel was compiled and runs; it is only not kept."""
    path = pathlib.Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        return False
    return True


def attach(dispatcher):
    """Give a Numba ``CUDADispatcher`` a :class:`DiskCache` (once; nothing
    under the simulator or with the cache turned off)."""
    cache = getattr(dispatcher, "_cache", None)
    if cache is None or isinstance(cache, DiskCache) or not enabled():
        return
    if type(cache).__name__ != "NullCache":     # the caller turned on numba's own cache
        return
    # the options (max_registers, say) change the compiled code, not the function
    dispatcher._cache = DiskCache(dispatcher.py_func, options=dispatcher.targetoptions)


def relink(source, target, argtypes):
    """Give ``target`` (the dispatcher of ``source``'s kernel built with a
    ``max_registers`` limit, nothing else changed) its kernel for
    ``argtypes`` without compiling it again: ``source``'s compiled PTX, which
    the limit does not change (Numba hands it to the linker only), linked
    under ``target``'s limit. Only ptxas runs, in place of Numba's typing,
    lowering and NVVM. The kernel is kept on disk as a compiled one would be.
    Nothing under the simulator, where ``target`` has the kernel already (in
    memory, or on disk: it loads it from there), or where Numba's objects are
    not as expected (``target`` then compiles on its first launch). Returns
    whether it relinked."""
    from numba import config

    argtypes = tuple(argtypes)
    # the decode launch asks on every call: after the first, the kernel is in memory
    if config.ENABLE_CUDASIM or argtypes in target.overloads:
        return False
    attach(target)
    cache = getattr(target, "_cache", None)
    path = cache.path(argtypes) if isinstance(cache, DiskCache) else None
    if path is not None and path.exists():
        return False
    try:
        compiled = source.compile(argtypes)
        states = pickle.loads(pickle.dumps(compiled._reduce_states()))
        library = states["codelibrary"]
        library._max_registers = target.targetoptions["max_registers"]
        library._cubin_cache, library._linkerinfo_cache = {}, {}
        kernel = type(compiled)._rebuild(**states)
        kernel.bind()                   # ptxas, under the limit
    except Exception:                   # another numba: compile as usual
        return False
    if isinstance(cache, DiskCache):
        cache.save_overload(argtypes, kernel)
    target.add_overload(kernel, argtypes)
    return True


def entries(directory=None):
    """The kept kernels' files."""
    d = pathlib.Path(directory or cache_dir())
    return sorted(d.glob("*" + SUFFIX)) if d.is_dir() else []


def clear(directory=None):
    """Remove every kept kernel (and leftover temporary files); return how many
    files were removed."""
    d = pathlib.Path(directory or cache_dir())
    files = entries(d) + (sorted(d.glob("*" + SUFFIX + "*.tmp")) if d.is_dir() else [])
    for f in files:
        f.unlink(missing_ok=True)
    return len(files)
