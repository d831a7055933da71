"""The paged KV cache: one pool of fixed-size blocks for keys and one for values."""
import numpy as np

from . import _arrays
from . import _checks as C
from . import fp8 as _fp8
from ._guard import offence_message
from .kernels.guard import WORDS
from .layouts import DTYPES, cache_shapes, check_layout, from_nhd, infer_geometry, to_nhd

CACHE_DTYPES = DTYPES + _fp8.FP8_DTYPES     # fp8: uint8 codes on the device, with scales


def _positive_int(name, value):
    return C.integer(name, value, lo=1, hi=C.INT32_MAX)


def _cache_dtype(dtype):
    """The numpy dtype of ``dtype`` if it names one of :data:`CACHE_DTYPES` in
    the machine's byte order (the kernels read native values)."""
    try:
        dt = np.dtype(dtype)
    except Exception:                # not a dtype at all ("foo", "f4,(2", an object)
        dt = None
    if dtype is None or dt is None or dt.name not in CACHE_DTYPES:
        raise ValueError(f"dtype must be one of {CACHE_DTYPES}, but got {dtype!r}.")
    if not dt.isnative:
        raise ValueError(f"dtype must be in the machine's byte order, but got {dt.name} with "
                         f"byte order {dt.byteorder!r} ({dt.str}); convert the pools first, "
                         f"e.g. with arr.astype(arr.dtype.newbyteorder('='))")
    return dt


def kernel_scales(cache):
    """The kernels' trailing scale arguments for ``cache``: ``(kv_scales,)``, the
    device array ``[2, num_kv_heads]`` float32 of K's and V's scales, for an
    fp8 cache; ``()`` for the others."""
    return (cache.kv_scales,) if _fp8.is_fp8(cache.dtype) else ()


def checked_scales(dtype, num_kv_heads, k_scale=None, v_scale=None):
    """The fp8 scales of a cache of ``dtype`` as :func:`paged_numba.fp8.check_scale`
    returns them, ``(k, v)`` (1.0 where not given), or None for a dtype that
    is not fp8, for which giving either is a ``ValueError``.

    Parameters
    ----------
    dtype : numpy.dtype
    num_kv_heads : int
    k_scale, v_scale : float or array of float, ``[num_kv_heads]``, optional
    """
    if not _fp8.is_fp8(dtype):
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale and v_scale apply to fp8 caches only, but dtype is "
                             f"{np.dtype(dtype).name}.")
        return None
    return (_fp8.check_scale("k_scale", 1.0 if k_scale is None else k_scale, num_kv_heads),
            _fp8.check_scale("v_scale", 1.0 if v_scale is None else v_scale, num_kv_heads))


class PagedKVCache:
    """A KV cache split into ``num_blocks`` blocks of ``block_size`` tokens.

    Parameters
    ----------
    num_blocks : int
        Physical blocks in the pool.
    block_size : int
        Tokens per block.
    num_kv_heads : int
        Key/value heads.
    head_size : int
        Elements per head.
    dtype : {"float16", "float32", "bfloat16", "float8_e4m3fn", "float8_e5m2"}
        Element type of keys and values. ``"bfloat16"`` pools hold the bf16 bit
        patterns in ``uint16`` device arrays; on the host (``to_host``,
        ``gather``, ``from_host``) they are ``ml_dtypes.bfloat16`` arrays.
        The fp8 formats (:mod:`paged_numba.fp8`) hold ``uint8`` codes on the
        device and ``ml_dtypes.float8_*`` arrays on the host: the *stored*
        values ``q``, meaning ``q * scale`` (:func:`paged_numba.fp8.dequantize`);
        ``head_size`` must be a multiple of 16 (one 16-byte vector is 16
        elements). ``write_kv`` quantises fp16/bf16/fp32 input, and decode
        reads the codes and takes fp16/bf16/fp32 queries.
    layout : {"nhd", "vllm", "hnd", "interleaved"}
        ``"nhd"``: key and value ``[num_blocks, block_size, num_kv_heads, head_size]``.
        ``"vllm"``: key ``[num_blocks, num_kv_heads, head_size // x, block_size, x]``
        with ``x = 16 // itemsize``, value ``[num_blocks, num_kv_heads, head_size, block_size]``.
        ``"hnd"``: key and value ``[num_blocks, num_kv_heads, block_size, head_size]``.
        ``"interleaved"``: one pool ``[num_blocks, 2, block_size, num_kv_heads, head_size]``
        (each block's K, then its V at ``V_OFFSET = block_size * num_kv_heads *
        head_size`` elements); ``key_cache`` and ``value_cache`` are that pool.
    num_layers : int, optional
        A cache for a whole model: every pool gets a leading ``[num_layers]``
        axis and the layers share one set of block ids (one allocator, one
        block table for every layer, as in vLLM). Kernels take one layer at
        a time: :meth:`layer` returns a cache that views layer ``i``'s pools
        without a copy.
    k_scale, v_scale : float or array of float32, ``[num_kv_heads]``, keyword-only
        fp8 caches only: the scale of keys and of values, one for the tensor
        (default 1.0) or one per KV head; finite and positive in float32.
        Shared by every layer of a layered cache. They can be set later (the
        same checks apply; plans see the new values), but stored codes are
        not re-quantised: set them before writing.

    Attributes
    ----------
    key_cache, value_cache : device arrays
        The pools, zero-initialised, in ``layout`` (``uint16`` for bfloat16).
    dtype : numpy.dtype
        The logical element type (``ml_dtypes.bfloat16`` for bfloat16,
        ``ml_dtypes.float8_e4m3fn`` / ``float8_e5m2`` for fp8).
    kv_scales : device array, ``[2, num_kv_heads]`` float32
        fp8 caches: ``k_scale`` and ``v_scale`` per KV head, as the kernels read them.

    Examples
    --------
    >>> from paged_numba import PagedKVCache
    >>> cache = PagedKVCache(num_blocks=4, block_size=16, num_kv_heads=2, head_size=64)
    >>> cache.key_cache.shape
    (4, 16, 2, 64)
    >>> cache.nbytes
    32768
    >>> bf = PagedKVCache(4, 16, 2, 64, dtype="bfloat16", layout="vllm")   # x = 16 // 2 = 8
    >>> bf.dtype, bf.key_cache.dtype, bf.key_cache.shape
    (dtype(bfloat16), dtype('uint16'), (4, 2, 8, 16, 8))
    >>> bf.to_host()[0].dtype
    dtype(bfloat16)
    >>> model = PagedKVCache(4, 16, 2, 64, num_layers=3)      # [num_layers, num_blocks, ...]
    >>> model.key_cache.shape, model.layer(2).key_cache.shape
    ((3, 4, 16, 2, 64), (4, 16, 2, 64))
    >>> f8 = PagedKVCache(4, 16, 2, 64, dtype="float8_e4m3fn", layout="vllm", k_scale=0.5)
    >>> f8.key_cache.dtype, f8.key_cache.shape, f8.nbytes           # x = 16 // 1 = 16
    (dtype('uint8'), (4, 2, 4, 16, 16), 16384)
    >>> f8.k_scale, f8.v_scale
    (0.5, 1.0)
    >>> f8.v_scale = [0.25, 2.0]                                    # one per KV head
    >>> f8.kv_scales.copy_to_host().tolist()
    [[0.5, 0.5], [0.25, 2.0]]
    """

    def __init__(self, num_blocks, block_size, num_kv_heads, head_size,
                 dtype="float16", layout="nhd", num_layers=None, *, k_scale=None, v_scale=None):
        self.num_blocks = _positive_int("num_blocks", num_blocks)
        self.block_size = _positive_int("block_size", block_size)
        self.num_kv_heads = _positive_int("num_kv_heads", num_kv_heads)
        self.head_size = _positive_int("head_size", head_size)
        self.dtype = _cache_dtype(dtype)
        check_layout(layout)
        self.layout = layout
        fp8 = _fp8.is_fp8(self.dtype)
        if fp8 and self.head_size % 16:
            raise ValueError(f"an fp8 cache needs head_size to be a multiple of 16 (one 16-byte "
                             f"vector), but got head_size={self.head_size}.")
        scales = checked_scales(self.dtype, self.num_kv_heads, k_scale, v_scale)
        self.key_shape, self.value_shape = cache_shapes(
            layout, self.num_blocks, self.block_size, self.num_kv_heads, self.head_size, self.dtype)
        self.num_layers = None if num_layers is None else _positive_int("num_layers", num_layers)
        lead = () if num_layers is None else (self.num_layers,)
        store = np.uint8 if fp8 else self.dtype
        self.key_cache = _arrays.zeros(lead + self.key_shape, store)
        # "interleaved" keeps K and V of a block in one buffer: both names share the pool
        self.value_cache = (self.key_cache if layout == "interleaved"
                            else _arrays.zeros(lead + self.value_shape, store))
        if scales is not None:
            self._set_scales(*scales)

    def layer(self, i):
        """The cache of layer ``i`` of a ``num_layers`` cache: same geometry,
        pools that are views of layer ``i`` (writes go to this cache)."""
        if self.num_layers is None:
            raise ValueError("layer() needs a cache made with num_layers.")
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) \
                or not 0 <= i < self.num_layers:
            raise ValueError(f"layer must be an integer in [0, {self.num_layers}), but got {i!r}.")
        self.errors                                  # one error word for every layer
        view = object.__new__(type(self))
        view.__dict__.update(self.__dict__)
        view.num_layers = None
        view.key_cache = self.key_cache[int(i)]
        view.value_cache = self.value_cache[int(i)]
        return view

    @classmethod
    def from_host(cls, key_cache, value_cache, layout="nhd", *, k_scale=None, v_scale=None):
        """A cache holding copies of host pools ``key_cache``/``value_cache`` in ``layout``
        (for fp8 pools, the stored codes as ``ml_dtypes`` arrays, and their scales).

        The pools' shapes are those of ``layout`` (:mod:`paged_numba.layouts`):
        ``"nhd"`` key and value ``[num_blocks, block_size, num_kv_heads,
        head_size]``; ``"vllm"`` key ``[num_blocks, num_kv_heads, head_size //
        x, block_size, x]`` (``x = 16 // itemsize``), value ``[num_blocks,
        num_kv_heads, head_size, block_size]``; ``"hnd"`` ``[num_blocks,
        num_kv_heads, block_size, head_size]``; ``"interleaved"`` one pool
        ``[num_blocks, 2, block_size, num_kv_heads, head_size]`` passed as
        both. The geometry is read from them."""
        key_cache, value_cache = np.asarray(key_cache), np.asarray(value_cache)
        if key_cache.dtype != value_cache.dtype:
            raise ValueError(
                "key_cache and value_cache must have the same dtype, but got "
                f"{key_cache.dtype} and {value_cache.dtype}.")
        if layout == "interleaved" and not (value_cache is key_cache
                                            or np.array_equal(value_cache, key_cache)):
            raise ValueError("layout 'interleaved' has one pool: pass it as both key_cache and "
                             "value_cache.")
        geometry = infer_geometry(key_cache.shape, value_cache.shape, layout, key_cache.dtype)
        cache = cls(*geometry, dtype=key_cache.dtype, layout=layout, k_scale=k_scale,
                    v_scale=v_scale)
        cache.key_cache.copy_to_device(_arrays.host_bits(key_cache))
        if layout != "interleaved":      # there the one pool holds both
            cache.value_cache.copy_to_device(_arrays.host_bits(value_cache))
        return cache

    @classmethod
    def from_device(cls, key_cache, value_cache, layout="nhd", num_layers=None, *, k_scale=None,
                    v_scale=None, dtype=None):
        """A cache over existing device pools, without a copy.

        Parameters
        ----------
        key_cache, value_cache : device arrays
            The pools in ``layout``'s shapes (see the class docstring), with a
            leading ``[num_layers]`` axis when ``num_layers`` is given:
            numba device arrays, PyTorch or CuPy tensors, or anything with
            ``__cuda_array_interface__`` or DLPack; float16, float32,
            bfloat16 (``torch.bfloat16``, or uint16 device arrays of its
            bits) or fp8 (arrays of a float8 dtype holding the stored codes,
            ``head_size`` a multiple of 16), C-contiguous, 16-byte aligned,
            both of one dtype (and of one shape but in ``"vllm"``).
            ``"interleaved"``: the one pool twice. Under the simulator NumPy
            arrays and CPU torch tensors are the device arrays.
        layout : {"nhd", "vllm", "hnd", "interleaved"}
        num_layers : int, optional
            A layered cache, as ``PagedKVCache(..., num_layers=L)``.
        k_scale, v_scale : float or array of float32, ``[num_kv_heads]``, keyword-only
            fp8 pools only: what their codes are scaled by, as in the
            constructor (default 1.0; finite and positive in float32, else a
            ``ValueError`` naming the argument). Settable later too.
        dtype : str or numpy.dtype, optional, keyword-only
            The cache's dtype, for pools that hold its bits rather than
            say it: uint8 device arrays of ``"float8_e4m3fn"`` or
            ``"float8_e5m2"`` codes (numba has no float8 type, and a uint8
            array cannot tell the two formats apart), uint16 ones of
            bfloat16. Pools of the dtype itself are taken too; any other is a
            ``ValueError``. Default: the pools' own dtype.

        Returns
        -------
        PagedKVCache
            Its ``key_cache``/``value_cache`` view the caller's memory, so
            writes through the kernels land there; it keeps references to
            the caller's objects, which keep ownership.

        Examples
        --------
        >>> import numpy as np
        >>> from numba import cuda
        >>> from paged_numba import PagedKVCache, write_kv
        >>> k = cuda.to_device(np.zeros((4, 8, 1, 16), np.float16))   # [num_blocks, block_size, kv_heads, head]
        >>> v = cuda.to_device(np.zeros((4, 8, 1, 16), np.float16))
        >>> cache = PagedKVCache.from_device(k, v)
        >>> cache.num_blocks, cache.block_size, cache.num_kv_heads, cache.head_size
        (4, 8, 1, 16)
        >>> write_kv(cache, np.ones((1, 1, 16), np.float16), np.ones((1, 1, 16), np.float16), [9])
        >>> float(k.copy_to_host()[1, 1, 0, 0])                    # slot 9 = block 1, offset 1
        1.0
        >>> PagedKVCache.from_device(k, v, k_scale=0.5)         # scales are for fp8 pools
        Traceback (most recent call last):
        ...
        ValueError: k_scale and v_scale apply to fp8 caches only, but dtype is float16.
        """
        from .interop import from_device

        return from_device(cls, key_cache, value_cache, layout, num_layers, k_scale=k_scale,
                           v_scale=v_scale, dtype=dtype)

    @property
    def errors(self):
        """The device error word ``[code, where, entry, value]`` int64
        (:mod:`paged_numba.kernels.guard`) into which the kernels record the
        first out-of-range index they were given (only possible with
        ``validate=False``); shared by the layers of a layered cache."""
        if self.__dict__.get("_errors") is None:
            self._errors = _arrays.zeros((WORDS,), np.int64)
        return self._errors

    def check(self):
        """Raise ``ValueError`` for the first out-of-range index a kernel was
        given on this cache since the last check (it skipped that index:
        see :mod:`paged_numba.kernels.guard`), and clear the record.
        Synchronises with the device.

        >>> import numpy as np
        >>> from numba import cuda
        >>> from paged_numba import PagedKVCache, write_kv
        >>> cache = PagedKVCache(num_blocks=2, block_size=4, num_kv_heads=1, head_size=16)
        >>> kv = np.ones((2, 1, 16), np.float16)
        >>> write_kv(cache, kv, kv, cuda.to_device(np.array([3, 8])), validate=False)
        >>> cache.check()
        Traceback (most recent call last):
        ...
        ValueError: write_kv was given slot_mapping[1] = 8 (validate=False), outside [0, 8) (-1 marks padding); that token was not written.
        >>> cache.check()                               # cleared
        """
        _arrays.synchronize()       # the kernels may run on any stream
        word = _arrays.to_host(self.errors)
        if word[0]:
            self.errors.copy_to_device(np.zeros(WORDS, np.int64))
            _arrays.synchronize()
            raise ValueError(offence_message(word, self))

    @property
    def num_slots(self):
        """Token slots in the pool (``num_blocks * block_size``)."""
        return self.num_blocks * self.block_size

    @property
    def nbytes(self):
        """Bytes held by both pools (all layers)."""
        return (2 * self.num_slots * self.num_kv_heads * self.head_size * self.dtype.itemsize
                * (self.num_layers or 1))

    def to_host(self, layout="nhd"):
        """Copy both pools to the host, converted to ``layout``, in :attr:`dtype`
        (with the leading ``[num_layers]`` axis of a layered cache)."""
        layered = self.num_layers is not None
        k, v = to_nhd(self._host(self.key_cache), self._host(self.value_cache), self.layout,
                      layered=layered)
        return from_nhd(k, v, layout, layered=layered)

    def _host(self, pool):
        """A copy of device ``pool`` (or a slice of it) in the logical dtype."""
        if _fp8.is_fp8(self.dtype):
            return _arrays.to_host(pool).view(self.dtype)
        return _arrays.to_host(pool, self.dtype)

    # -- fp8 scales: host values and their device copy, shared by layer views

    def _scale_state(self):
        if not _fp8.is_fp8(self.dtype):
            return None
        if "_scales" not in self.__dict__:       # a cache made without __init__
            self._set_scales(np.float32(1.0), np.float32(1.0))
        return self._scales

    def _set_scales(self, k, v):
        """Store checked scales ``k``, ``v`` (float32 scalars or ``[num_kv_heads]``)
        and copy them into :attr:`kv_scales` (in place, so packed launches see them)."""
        state = self.__dict__.get("_scales")
        rows = np.empty((2, self.num_kv_heads), np.float32)
        rows[0], rows[1] = k, v
        if state is None:
            # one dict for the cache and its layer views: a setter on either updates both
            self._scales = {"k": k, "v": v, "device": _arrays.as_device(rows, "kv_scales")[0]}
        else:
            state["device"].copy_to_device(rows)
            state["k"], state["v"] = k, v

    def _scale_value(self, which):
        state = self._scale_state()
        if state is None:
            return 1.0
        s = state[which]
        return float(s) if np.ndim(s) == 0 else s.copy()

    def _put_scale(self, which, value):
        state = self._scale_state()
        name = f"{which}_scale"
        if state is None:
            raise ValueError(f"{name} applies to fp8 caches only, but dtype is {self.dtype.name}.")
        s = _fp8.check_scale(name, value, self.num_kv_heads)
        self._set_scales(*((s, state["v"]) if which == "k" else (state["k"], s)))

    @property
    def k_scale(self):
        """Scale of the stored keys (fp8): a float, or float32 ``[num_kv_heads]``;
        1.0 for other dtypes. Settable on fp8 caches (``ValueError`` for a
        value that is not finite and positive, or of the wrong shape)."""
        return self._scale_value("k")

    @k_scale.setter
    def k_scale(self, value):
        self._put_scale("k", value)

    @property
    def v_scale(self):
        """Scale of the stored values; as :attr:`k_scale`."""
        return self._scale_value("v")

    @v_scale.setter
    def v_scale(self, value):
        self._put_scale("v", value)

    @property
    def kv_scales(self):
        """Device array ``[2, num_kv_heads]`` float32: row 0 K's scale of each KV
        head, row 1 V's (fp8 caches; None for others)."""
        state = self._scale_state()
        return None if state is None else state["device"]

    def gather(self, block_table_row, seq_len):
        """Un-page one sequence: its keys and values in token order.

        Parameters
        ----------
        block_table_row : array_like of int, ``[max_blocks]``
            Physical block of each logical block (``-1`` past the used ones).
        seq_len : int
            Tokens to return.

        Returns
        -------
        K, V : numpy.ndarray, each ``[seq_len, num_kv_heads, head_size]``
        """
        if self.num_layers is not None:
            raise ValueError("gather() works on one layer: call cache.layer(i).gather(...).")
        row = np.asarray(_arrays.to_host(block_table_row))
        if row.ndim != 1:
            raise ValueError(f"block_table_row must be one row [max_blocks], but got shape "
                             f"{row.shape}.")
        seq_len = C.integer("seq_len", seq_len, lo=0)
        if row.size and not np.issubdtype(row.dtype, np.integer):
            raise TypeError(f"block_table_row must hold integers, but got dtype {row.dtype}.")
        used = -(-seq_len // self.block_size)
        if used > row.size:
            raise ValueError(
                f"seq_len={seq_len} needs {used} blocks, but the block table row has {row.size}.")
        blocks = [int(b) for b in row[:used]]
        for j, b in enumerate(blocks):
            if not 0 <= b < self.num_blocks:
                raise ValueError(
                    f"block table entry {j} is {b}, outside [0, {self.num_blocks}).")
        shape = (seq_len, self.num_kv_heads, self.head_size)
        if used == 0:
            return np.zeros(shape, self.dtype), np.zeros(shape, self.dtype)
        ks, vs = [], []
        for b in blocks:  # one small copy per block: this is a debugging aid
            k, v = to_nhd(self._host(self.key_cache[b:b + 1]),
                          self._host(self.value_cache[b:b + 1]), self.layout)
            ks.append(k[0])
            vs.append(v[0])
        k = np.concatenate(ks)[:seq_len]
        v = np.concatenate(vs)[:seq_len]
        return k, v

    def __repr__(self):
        mib = self.nbytes / 2**20
        return (f"PagedKVCache(num_blocks={self.num_blocks}, block_size={self.block_size}, "
                f"num_kv_heads={self.num_kv_heads}, head_size={self.head_size}, "
                f"dtype={self.dtype.name}, layout={self.layout!r}, slots={self.num_slots}, "
                + (f"k_scale={self.k_scale}, v_scale={self.v_scale}, "
                   if _fp8.is_fp8(self.dtype) else "")
                + (f"num_layers={self.num_layers} x " if self.num_layers else "")
                + f"key{list(self.key_shape)} + value{list(self.value_shape)} = "
                f"{self.nbytes} bytes ({mib:.2f} MiB))")
