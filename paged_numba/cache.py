"""The paged KV cache: one pool of fixed-size blocks for keys and one for values."""
import numpy as np

from . import _arrays
from . import _checks as C
from .layouts import DTYPES, cache_shapes, check_layout, from_nhd, infer_geometry, to_nhd


def _positive_int(name, value):
    return C.integer(name, value, lo=1, hi=C.INT32_MAX)


def _cache_dtype(dtype):
    """The numpy dtype of ``dtype`` if it names one of :data:`layouts.DTYPES`."""
    try:
        dt = np.dtype(dtype)
    except TypeError:                # not a dtype at all ("foo", an object)
        dt = None
    if dtype is None or dt is None or dt.name not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, but got {dtype!r}.")
    return dt


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
    dtype : {"float16", "float32", "bfloat16"}
        Element type of keys and values. ``"bfloat16"`` pools hold the bf16 bit
        patterns in ``uint16`` device arrays; on the host (``to_host``,
        ``gather``, ``from_host``) they are ``ml_dtypes.bfloat16`` arrays.
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

    Attributes
    ----------
    key_cache, value_cache : device arrays
        The pools, zero-initialised, in ``layout`` (``uint16`` for bfloat16).
    dtype : numpy.dtype
        The logical element type (``ml_dtypes.bfloat16`` for bfloat16).

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
    """

    def __init__(self, num_blocks, block_size, num_kv_heads, head_size,
                 dtype="float16", layout="nhd", num_layers=None):
        self.num_blocks = _positive_int("num_blocks", num_blocks)
        self.block_size = _positive_int("block_size", block_size)
        self.num_kv_heads = _positive_int("num_kv_heads", num_kv_heads)
        self.head_size = _positive_int("head_size", head_size)
        self.dtype = _cache_dtype(dtype)
        check_layout(layout)
        self.layout = layout
        self.key_shape, self.value_shape = cache_shapes(
            layout, self.num_blocks, self.block_size, self.num_kv_heads, self.head_size, self.dtype)
        self.num_layers = None if num_layers is None else _positive_int("num_layers", num_layers)
        lead = () if num_layers is None else (self.num_layers,)
        self.key_cache = _arrays.zeros(lead + self.key_shape, self.dtype)
        # "interleaved" keeps K and V of a block in one buffer: both names share the pool
        self.value_cache = (self.key_cache if layout == "interleaved"
                            else _arrays.zeros(lead + self.value_shape, self.dtype))

    def layer(self, i):
        """The cache of layer ``i`` of a ``num_layers`` cache: same geometry,
        pools that are views of layer ``i`` (writes go to this cache)."""
        if self.num_layers is None:
            raise ValueError("layer() needs a cache made with num_layers.")
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) \
                or not 0 <= i < self.num_layers:
            raise ValueError(f"layer must be an integer in [0, {self.num_layers}), but got {i!r}.")
        view = object.__new__(type(self))
        view.__dict__.update(self.__dict__)
        view.num_layers = None
        view.key_cache = self.key_cache[int(i)]
        view.value_cache = self.value_cache[int(i)]
        return view

    @classmethod
    def from_host(cls, key_cache, value_cache, layout="nhd"):
        """A cache holding copies of host pools ``key_cache``/``value_cache`` in ``layout``."""
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
        cache = cls(*geometry, dtype=key_cache.dtype, layout=layout)
        cache.key_cache.copy_to_device(_arrays.host_bits(key_cache))
        if layout != "interleaved":      # there the one pool holds both
            cache.value_cache.copy_to_device(_arrays.host_bits(value_cache))
        return cache

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
        return _arrays.to_host(pool, self.dtype)

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
        row = np.asarray(_arrays.to_host(block_table_row)).reshape(-1)
        seq_len = int(seq_len)
        used = -(-seq_len // self.block_size)
        if seq_len < 0 or used > row.size:
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
                + (f"num_layers={self.num_layers} x " if self.num_layers else "")
                + f"key{list(self.key_shape)} + value{list(self.value_shape)} = "
                f"{self.nbytes} bytes ({mib:.2f} MiB))")
