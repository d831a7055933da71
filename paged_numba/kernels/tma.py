"""Tensor-memory-accelerator copies and transaction barriers (sm_90).

A *tensor map* (:func:`tensor_map`) describes a global array of rank 1 to 5
to the copy engine: its dimensions, strides, the *box* one copy moves and the
swizzle the box lands in. :func:`tma_load` (a factory: ``rank`` is a
compile-time constant) gives the device function
``load(dst, dst_flat, tmap, src, coords, bars, bar)``: one thread starts
copying the box at ``coords`` (element coordinates, innermost first; boxes
that reach past the array are zero-filled there) into the shared array
``dst`` from flat element ``dst_flat`` on (the box's rows of
``box[0] * itemsize`` bytes one after another, 16-byte chunks swizzled as
``wgmma.swizzled`` does, from a 1024-byte aligned base), and the copy engine
counts its bytes on the *mbarrier* ``bars[bar]`` when they have landed.
``src`` is the array the map describes (the simulator checks its shape
against the map's; both read the array the map was made of).

An mbarrier (a ``uint64`` in shared memory) completes a *phase* when the
threads it was initialised for have arrived and the bytes announced with
``arrive_expect_tx`` have landed (:func:`copies_arrive`: a thread's arrival
once all the ``cp.async`` copies it started so far have landed, without
waiting for them); ``mbarrier_wait(bars, i, parity)`` returns
once the phase of that parity (0, 1, 0, ... in turn) has completed. One
thread initialises it (:func:`mbarrier_init`); then
:func:`mbarrier_init_fence` and a block barrier make it visible to every
thread and to the copy engine. One copy thread a stage typically announces
the stage's bytes and issues its boxes, while the consumers wait on the
parity; the copies take no registers and no instructions of the other
threads, which is what lets a producer give its registers away.

On the GPU these are inline PTX (``mbarrier.*.shared::cta.b64``,
``cp.async.bulk.tensor.<rank>d.shared::cluster.global.tile.mbarrier::complete_tx::bytes``),
and the tensor map is the driver's 128-byte ``CUtensorMap``
(``cuTensorMapEncodeTiled``) in global memory. Under the simulator the map
holds the same description as plain words, the barriers are Python objects
of the simulated block, and a copy counts its bytes at once but lands only
when the phase it counts towards completes (its destination holds ``0xFF``
bytes, NaN, until then), as do the ``cp.async`` copies of a
:func:`copies_arrive` arrival: a thread that reads a stage without waiting
for its phase reads NaN.
"""
import functools
import threading

import numpy as np
from numba import config, types

SWIZZLES = (0, 32, 64, 128)
MAP_WORDS = 16                    # a CUtensorMap: 128 bytes


def _check_map(shape, strides, itemsize, box, swizzle):
    rank = len(shape)
    if not 1 <= rank <= 5:
        raise ValueError(f"a tensor map has rank 1 to 5, but the array has {rank} dimensions")
    if len(box) != rank or any(not 1 <= int(b) <= 256 for b in box):
        raise ValueError(f"box must give 1 to 256 elements for each of the {rank} dimensions, "
                         f"but got {tuple(box)}")
    if swizzle not in SWIZZLES:
        raise ValueError(f"swizzle must be one of {SWIZZLES}, but got {swizzle!r}")
    inner = int(box[-1]) * itemsize
    if inner % 16 or (swizzle and inner > swizzle):
        raise ValueError(f"a box's rows must be a multiple of 16 bytes and at most the swizzle "
                         f"({swizzle} bytes), but got {box[-1]} elements of {itemsize} bytes")
    if strides[-1] != itemsize or any(s % 16 for s in strides[:-1]):
        raise ValueError(f"a tensor map needs the last dimension contiguous and the other "
                         f"strides multiples of 16 bytes, but got strides {tuple(strides)}")


def tensor_map(array, box, swizzle=128):
    """The tensor map of ``array`` (a device array, dimensions outermost first,
    the last one contiguous) for copies of ``box`` elements (outermost first,
    one count a dimension): a device array of 16 ``uint64``. ``swizzle`` (0,
    32, 64 or 128 bytes) is the layout a box lands in; a box's rows
    (``box[-1]`` elements) must be a multiple of 16 bytes and at most
    ``swizzle`` bytes.

    >>> from numba import cuda
    >>> pool = cuda.to_device(np.zeros((4, 16, 2, 64), np.float16))
    >>> tensor_map(pool.reshape(64, 2, 64), (16, 1, 64)).shape
    (16,)
    >>> tensor_map(pool.reshape(64, 2, 64), (16, 1, 128))
    Traceback (most recent call last):
        ...
    ValueError: a box's rows must be a multiple of 16 bytes and at most the swizzle (128 bytes), but got 128 elements of 2 bytes
    """
    from numba import cuda

    shape, strides = tuple(array.shape), tuple(array.strides)
    itemsize = array.dtype.itemsize
    _check_map(shape, strides, itemsize, box, swizzle)
    rank = len(shape)
    if config.ENABLE_CUDASIM:
        words = np.zeros(MAP_WORDS, np.uint64)
        words[:3] = rank, swizzle, itemsize
        for d in range(rank):        # innermost first, as the GPU's map
            words[3 + d] = shape[rank - 1 - d]
            words[8 + d] = box[rank - 1 - d]
        words[MAP_WORDS - 1] = _remember(array)     # where the GPU's map holds the address
        return cuda.to_device(words)
    from cuda.bindings import driver as drv

    kinds = {1: drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8,
             2: drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT16,
             4: drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT32,
             8: drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT64}
    modes = {0: "NONE", 32: "32B", 64: "64B", 128: "128B"}
    u32, u64 = drv.cuuint32_t, drv.cuuint64_t      # the binding takes no plain ints
    err, tmap = drv.cuTensorMapEncodeTiled(
        kinds[itemsize], u32(rank), array.__cuda_array_interface__["data"][0],
        [u64(shape[rank - 1 - d]) for d in range(rank)],
        [u64(strides[rank - 1 - d]) for d in range(1, rank)],
        [u32(int(box[rank - 1 - d])) for d in range(rank)], [u32(1)] * rank,
        drv.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        getattr(drv.CUtensorMapSwizzle, "CU_TENSOR_MAP_SWIZZLE_" + modes[swizzle]),
        drv.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        drv.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise ValueError(f"cuTensorMapEncodeTiled failed ({err.name}) for shape {shape}, "
                         f"strides {strides}, box {tuple(box)}, swizzle {swizzle}")
    return cuda.to_device(np.array(tmap.opaque, np.uint64))


if config.ENABLE_CUDASIM:
    import itertools
    import weakref

    from .async_copy import POISON, _Copy, in_flight
    from .vector import _host_flat
    from .wgmma import swizzled

    # a simulated map's number -> the array it describes (gone with the array, as
    # a GPU map's address is left dangling when its memory is freed)
    _MAPPED = weakref.WeakValueDictionary()
    _NUMBERS = itertools.count(1)

    def _remember(array):
        number = next(_NUMBERS)
        _MAPPED[number] = array
        return number

    class _Mbarrier:
        """One mbarrier of a simulated block."""

        def __init__(self, count):
            self.count, self.pending, self.tx, self.phase = count, count, 0, 0
            self.landing = []       # copies that land when this phase completes
            self.cond = threading.Condition()

        def _maybe_complete(self):
            if self.pending == 0 and self.tx == 0:
                for copy in self.landing:
                    copy.land()
                self.landing = []
                self.pending, self.phase = self.count, self.phase + 1
                self.cond.notify_all()

        def arrive(self, tx=0, landing=()):
            with self.cond:
                if self.pending == 0:
                    raise RuntimeError("mbarrier: more arrivals than its count in one phase")
                self.landing.extend(landing)
                self.pending -= 1
                self.tx += tx
                self._maybe_complete()

        def complete_tx(self, nbytes, landing=()):
            with self.cond:
                self.landing.extend(landing)
                self.tx -= nbytes
                self._maybe_complete()

        def wait(self, parity, thread):
            with self.cond:
                while self.phase % 2 == parity:
                    if getattr(thread, "abort", False):
                        raise RuntimeError("abort flag set in an mbarrier wait")
                    self.cond.wait(0.05)

    def _barriers():
        thread = threading.current_thread()
        manager = getattr(thread, "_manager", None)
        if manager is None:
            raise RuntimeError("mbarriers need a simulated CUDA thread")
        return manager.__dict__.setdefault("_paged_numba_mbarriers", {}), thread

    def _key(bars, i):
        a = _host_flat(bars)
        return a.__array_interface__["data"][0] + int(i) * a.itemsize

    def mbarrier_init(bars, i, count):
        table, _ = _barriers()
        table[_key(bars, i)] = _Mbarrier(int(count))

    def mbarrier_init_fence():
        pass

    def _get(bars, i):
        table, thread = _barriers()
        try:
            return table[_key(bars, i)], thread
        except KeyError:
            raise RuntimeError("mbarrier used before mbarrier_init") from None

    def mbarrier_arrive(bars, i):
        _get(bars, i)[0].arrive()

    def mbarrier_arrive_expect_tx(bars, i, nbytes):
        _get(bars, i)[0].arrive(int(nbytes))

    def mbarrier_wait(bars, i, parity):
        barrier, thread = _get(bars, i)
        barrier.wait(int(parity), thread)

    def copies_arrive(bars, i):
        # this thread's copies land when the phase completes (as late as they may)
        _get(bars, i)[0].arrive(landing=in_flight())

    @functools.cache
    def tma_load(rank):
        def load(dst, dst_flat, tmap, src, coords, bars, bar):
            words = _host_flat(tmap)
            r, swizzle, itemsize = (int(w) for w in words[:3])
            if r != rank:
                raise RuntimeError(f"a rank-{rank} copy through a rank-{r} tensor map")
            dims = [int(w) for w in words[3:3 + r]][::-1]         # outermost first
            box = [int(w) for w in words[8:8 + r]][::-1]
            # the array the map was made of (as the GPU reads its address from the
            # map), as it lies: its own strides
            mapped = _MAPPED[int(words[MAP_WORDS - 1])]
            item = getattr(mapped, "_item", mapped)
            data = getattr(item, "_ary", item)
            if list(data.shape) != dims or tuple(src.shape) != tuple(data.shape):
                raise RuntimeError(f"a copy through the tensor map of shape {dims} reads an "
                                   f"array of shape {list(data.shape)}")
            flat = _host_flat(dst)
            out = flat.view(np.uint8)
            start = [int(coords[r - 1 - d]) for d in range(r)]    # outermost first
            block = np.zeros(box, data.dtype)
            lo = [max(s, 0) for s in start]
            hi = [min(s + b, n) for s, b, n in zip(start, box, dims)]
            if all(h > l for l, h in zip(lo, hi)):
                block[tuple(slice(l - s, h - s) for l, h, s in zip(lo, hi, start))] = \
                    data[tuple(slice(l, h) for l, h in zip(lo, hi))]
            raw = block.reshape(-1).view(np.uint8)
            base = int(dst_flat) * flat.itemsize
            copies = []
            for c in range(raw.size // 16):     # the swizzle of the shared address
                at = swizzled(base + 16 * c, swizzle)
                copies.append(_Copy(out, at, raw[16 * c:16 * c + 16]))
                out[at:at + 16] = POISON        # until the phase completes
            _get(bars, bar)[0].complete_tx(raw.size, landing=copies)
        return load

else:
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    from .async_copy import _asm, _element_address

    _I32 = ir.IntType(32)
    _I64 = ir.IntType(64)

    def _u32(context, builder, ty, val):
        return builder.trunc(context.cast(builder, val, ty, types.int64), _I32)

    def _barrier_op(text, value=False):
        """An intrinsic ``op(bars, i)``, or ``op(bars, i, value)``, running
        ``text`` on the 32-bit shared address of ``bars[i]`` (``$0``) and the
        value as a u32 (``$1``)."""
        def codegen(context, builder, sig, args):
            addr = _element_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            if value:
                _asm(builder, text, (addr, _u32(context, builder, sig.args[2], args[2])), "r,r")
            else:
                _asm(builder, text, (addr,), "r")
            return context.get_dummy_value()

        if value:
            @intrinsic
            def op(typingctx, bars, i, v):
                return types.void(bars, i, v), codegen
        else:
            @intrinsic
            def op(typingctx, bars, i):
                return types.void(bars, i), codegen
        return op

    @intrinsic
    def mbarrier_init_fence(typingctx):
        def codegen(context, builder, sig, args):
            _asm(builder, "fence.mbarrier_init.release.cluster;")
            return context.get_dummy_value()
        return types.void(), codegen

    mbarrier_init = _barrier_op("mbarrier.init.shared::cta.b64 [$0], $1;", value=True)
    mbarrier_arrive = _barrier_op("mbarrier.arrive.shared::cta.b64 _, [$0];")
    mbarrier_arrive_expect_tx = _barrier_op(
        "mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;", value=True)
    copies_arrive = _barrier_op("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [$0];")
    # a label is local to its braces, so every copy of the loop may use the same name
    mbarrier_wait = _barrier_op(
        "{\n\t.reg .pred pn_done;\n\tpn_wait:\n"
        "\tmbarrier.try_wait.parity.shared::cta.b64 pn_done, [$0], $1;\n"
        "\t@!pn_done bra pn_wait;\n}", value=True)

    @functools.cache
    def tma_load(rank):
        rank = int(rank)
        coords = ", ".join(f"${3 + d}" for d in range(rank))
        text = (f"cp.async.bulk.tensor.{rank}d.shared::cluster.global.tile"
                f".mbarrier::complete_tx::bytes [$0], [$1, {{{coords}}}], [$2];")

        @intrinsic
        def load(typingctx, dst, dst_flat, tmap, src, coords_, bars, bar):
            if not (isinstance(coords_, types.BaseTuple) and len(coords_) == rank):
                return None
            sig = types.void(dst, dst_flat, tmap, src, coords_, bars, bar)

            def codegen(context, builder, sig, args):
                d = _element_address(context, builder, sig.args[0], args[0], sig.args[1],
                                     args[1])
                m = context.make_array(sig.args[2])(context, builder, args[2]).data
                b = _element_address(context, builder, sig.args[5], args[5], sig.args[6],
                                     args[6])
                cs = [_u32(context, builder, sig.args[4][e], builder.extract_value(args[4], e))
                      for e in range(rank)]
                _asm(builder, text, (d, builder.ptrtoint(m, _I64), b, *cs),
                     "r,l,r" + ",r" * rank)
                return context.get_dummy_value()
            return sig, codegen
        return load
