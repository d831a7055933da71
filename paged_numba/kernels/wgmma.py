"""Warpgroup tensor-core products (``wgmma.mma_async``, sm_90a).

A *warpgroup* is four consecutive warps (128 threads, warp ``4 g .. 4 g + 3``
of warpgroup ``g``). One ``wgmma`` computes ``D = A @ B (+ D)`` for a
``64 x 16`` ``A``, a ``16 x N`` ``B`` and a ``64 x N`` float32 ``D``; all 128
threads issue it together, and it runs asynchronously: issue, then
:func:`commit`, then wait (:func:`wait_pin`) before touching ``D``.

**Accumulators.** ``D`` lives in registers exactly as ``N / 8`` side-by-side
``mma.m16n8k16`` accumulators per warp: warp ``w`` of the group owns rows
``16 w .. 16 w + 15``, and with ``r = lane // 4``, ``c = lane % 4`` its lane
holds, for n-tile ``j``, ``acc[j, 0:2] = D[16 w + r, 8 j + 2 c : + 2]`` and
``acc[j, 2:4] = D[16 w + r + 8, 8 j + 2 c : + 2]``. A kernel passes ``acc`` as
a ``(N // 8, 4)`` float32 local array.

**A from registers** (:func:`wgmma_rs`): words ``a0..a3`` of two elements, the
``mma.m16n8k16`` A fragment of the warp's 16 rows (see :mod:`.mma`); an
accumulator pair of n-tiles ``2 k, 2 k + 1`` rounded to the input dtype is
the A fragment of keys ``16 k ..`` as it lies.

**Operands in shared memory** are *core matrices* of 8 rows x 16 bytes
stored as 128 contiguous bytes (row ``i`` at byte ``16 i``), placed by two
byte strides (no swizzle). For a K-major operand (``A[m, k]`` or
``B[k, n]`` with ``k`` contiguous, as for ``Q`` and ``K`` rows)::

    byte(x, k) = 16 (x % 8) + SBO (x // 8) + 2 (k % 8) + LBO (k // 8)

with ``x`` the row (``m`` or ``n``); for an MN-major ``B`` (``trans_b``:
``n`` contiguous, as for ``V`` rows whose ``n`` is the head dimension)::

    byte(k, n) = 2 (n % 8) + SBO (n // 8) + 16 (k % 8) + LBO (k // 8)

(``LBO`` steps along ``K``, ``SBO`` along ``M``/``N``, both multiples of 16).
With a *swizzle* of ``S`` = 32, 64 or 128 bytes (``swizzle=S``; the operand's
base 1024-byte aligned) each row of an 8-row atom holds ``S`` contiguous bytes
and chunk bits 4.. of every address are XORed with its bits 7.. (see
:func:`swizzled`): K-major ``byte(x, k) = S (x % 8) + SBO (x // 8) + 2 k``
(``k`` within one atom row; ``LBO`` unused), MN-major ``byte(k, n) = 2 (n %
(S / 2)) + LBO (n // (S / 2)) + S (k % 8) + SBO (k // 8)``,
each from the operand's first element. A kernel names that element by
``matrix_start(arr, flat)`` (element ``flat`` of a shared array): the
operand's start address in 16-byte units, to which adding ``n`` moves the
operand ``16 n`` bytes on (an integer on a GPU, so a loop computes it once
and adds constants). The instruction reads the operand through a 64-bit
*matrix descriptor*: that start plus the constant ``LBO``, ``SBO`` and
swizzle fields (:func:`descriptor_fields`). Writes to those bytes by ordinary or
``cp.async`` stores reach the tensor cores only after the writing thread's
:func:`fence_proxy_async` and a barrier.

**Ordering.** :func:`fence` must separate register writes to an
accumulator or A fragment from the ``wgmma`` that reads it. ``pin(count)``
returns a device function passing the first ``count`` elements of a local
array through an empty volatile instruction, so that the compiler cannot
move their computation past the fence; ``wait_pin(n, count)`` waits until
at most ``n`` committed groups are in flight and pins the array the same
way, so that nothing reads an accumulator before its product has landed
(``tag`` gives the same wait as a distinct instruction, for the two arms of a
branch that the compiler must not merge). Note that ptxas orders a wait only
after what it depends on: it hoists a wait above independent arithmetic.

**Warp specialisation.** ``bar_sync(count)`` / ``bar_arrive(count)`` give
named barriers (``bar.sync`` / ``bar.arrive`` on a runtime barrier id, ``count``
threads) and ``setmaxnreg(increase, count)`` moves registers between
warpgroups (``setmaxnreg.inc/dec``); under the simulator the barriers are
``paged_numba._simulator.named_barrier`` and ``setmaxnreg`` does nothing.

Under the simulator the products are computed at once, per thread, in
float64 from the shared array (rounded to float32), the A fragments of the
register form exchanged in the warp-operation rendezvous of
``paged_numba._simulator``; fences, commits and waits do nothing.
"""
import functools

import numpy as np
from numba import config, types

KINDS = {"float16": "f16", "bfloat16": "bf16"}


SWIZZLE_MODES = {0: 0, 128: 1, 64: 2, 32: 3}     # swizzle span in bytes -> layout type


def descriptor_fields(lbo, sbo, swizzle=0):
    """The constant part of a matrix descriptor: ``LBO`` and ``SBO`` (bytes,
    multiples of 16 below 2**18) and the swizzle span (0, 32, 64 or 128
    bytes) in their fields.

    >>> hex(descriptor_fields(128, 2048))
    '0x8000080000'
    >>> hex(descriptor_fields(16, 2048, 128))
    '0x4000008000010000'
    """
    for name, v in (("lbo", lbo), ("sbo", sbo)):
        if v % 16 or not 0 <= v < 2 ** 18:
            raise ValueError(f"{name}={v} must be a multiple of 16 below 2**18")
    if swizzle not in SWIZZLE_MODES:
        raise ValueError(f"swizzle={swizzle} must be one of {sorted(SWIZZLE_MODES)} (bytes)")
    return ((lbo >> 4) << 16) | ((sbo >> 4) << 32) | (SWIZZLE_MODES[swizzle] << 62)


def swizzled(byte, swizzle):
    """Where a ``wgmma`` operand's logical ``byte`` (from a 1024-byte aligned
    base) lies in a ``swizzle``-byte swizzled layout: its 16-byte chunk index
    XORed with bits 7 and up of the address (``Swizzle<b, 4, 3>``).

    >>> [swizzled(b, 128) // 16 for b in (0, 16, 128, 144, 896)]
    [0, 1, 9, 8, 63]
    """
    if not swizzle:
        return byte
    return byte ^ (((byte >> 7) & (swizzle // 16 - 1)) << 4)


if config.ENABLE_CUDASIM:
    from .vector import _host_flat

    class _Start:
        """A shared operand's first element (the array and its flat index);
        ``+ n`` moves it ``16 n`` bytes (8 two-byte elements) on."""

        def __init__(self, arr, flat):
            self.arr, self.flat = arr, int(flat)

        def __add__(self, n):
            return _Start(self.arr, self.flat + 8 * int(n))

        __radd__ = __add__

    def matrix_start(arr, flat):
        return _Start(arr, flat)

    def _values(arr, dtype):
        # The whole shared array, of which an operand reads a part: other parts
        # may hold other words (a warpgroup's float32 hand-over, say), whose
        # halves read as bfloat16 can be signalling NaNs; converting those is
        # no error (the operand's own elements convert exactly).
        a = _host_flat(arr)
        if dtype == "bfloat16":
            with np.errstate(invalid="ignore"):
                return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        return a.astype(np.float64)

    def _kmajor(vals, flat, rows, k, lbo, sbo, swizzle=0):
        """``M[x, kk]`` (``rows x k``) of a K-major operand at ``flat``."""
        x = np.arange(rows)[:, None]
        kk = np.arange(k)[None, :]
        if swizzle:
            byte = swizzle * (x % 8) + sbo * (x // 8) + 2 * kk
        else:
            byte = 16 * (x % 8) + sbo * (x // 8) + 2 * (kk % 8) + lbo * (kk // 8)
        return vals[swizzled(2 * flat + byte, swizzle) // 2]

    def _mnmajor(vals, flat, k, n, lbo, sbo, swizzle=0):
        """``B[kk, y]`` (``k x n``) of an MN-major operand at ``flat``."""
        kk = np.arange(k)[:, None]
        y = np.arange(n)[None, :]
        if swizzle:
            span = swizzle // 2                      # elements of an atom's row
            byte = 2 * (y % span) + lbo * (y // span) + swizzle * (kk % 8) + sbo * (kk // 8)
        else:
            byte = 2 * (y % 8) + sbo * (y // 8) + 16 * (kk % 8) + lbo * (kk // 8)
        return vals[swizzled(2 * flat + byte, swizzle) // 2]

    def _b_matrix(b, b_flat, dtype, n, lbo, sbo, trans_b, swizzle=0):
        vals = _values(b, dtype)
        if trans_b:
            return _mnmajor(vals, b_flat, 16, n, lbo, sbo, swizzle)
        return _kmajor(vals, b_flat, n, 16, lbo, sbo, swizzle).T

    def _thread():
        import threading
        return threading.current_thread().thread_id

    def _accumulate(acc, rows, B, accumulate, n):
        """``acc`` of this thread += its rows ``rows`` (2 x 16) times ``B``."""
        lane = _thread() % 32
        c = lane % 4
        d = rows @ B                                  # 2 x n
        flat = acc.reshape(-1)                        # a view: acc[j, e] is flat[4 j + e]
        for j in range(n // 8):
            for e in range(4):
                col = 8 * j + 2 * c + (e & 1)
                prev = float(flat[4 * j + e]) if accumulate else 0.0
                flat[4 * j + e] = np.float32(prev + d[e >> 1, col])

    @functools.cache
    def wgmma_ss(dtype, n, a_lbo, a_sbo, b_lbo, b_sbo, trans_b=False, swizzle=0):
        """``mma(acc, a, b, accumulate)``: ``acc += A @ B`` (or ``=`` where
        ``accumulate`` is false), ``A`` and ``B`` in shared memory at the
        :func:`matrix_start` ``a`` and ``b``."""
        descriptor_fields(a_lbo, a_sbo, swizzle), descriptor_fields(b_lbo, b_sbo, swizzle)

        def mma(acc, a, b, accumulate):
            tid = _thread()
            r0 = 16 * ((tid // 32) % 4) + (tid % 32) // 4
            A = _kmajor(_values(a.arr, dtype), a.flat, 64, 16, a_lbo, a_sbo, swizzle)
            B = _b_matrix(b.arr, b.flat, dtype, n, b_lbo, b_sbo, trans_b, swizzle)
            _accumulate(acc, A[[r0, r0 + 8]], B, accumulate, n)
        return mma

    @functools.cache
    def wgmma_rs(dtype, n, b_lbo, b_sbo, trans_b=False, swizzle=0):
        """``mma(acc, a0, a1, a2, a3, b, accumulate)``: as :func:`wgmma_ss`
        with ``A`` from the warps' registers."""
        from .._simulator import _rendezvous
        from .mma import _halves
        descriptor_fields(b_lbo, b_sbo, swizzle)

        def mma(acc, a0, a1, a2, a3, b, accumulate):
            lane, _, frags = _rendezvous(0xFFFFFFFF, "wgmma", (a0, a1, a2, a3))
            A = np.zeros((16, 16))
            for ln, a in frags.items():
                r, c = divmod(ln, 4)
                A[r, 2 * c:2 * c + 2] = _halves(a[0], dtype)
                A[r + 8, 2 * c:2 * c + 2] = _halves(a[1], dtype)
                A[r, 2 * c + 8:2 * c + 10] = _halves(a[2], dtype)
                A[r + 8, 2 * c + 8:2 * c + 10] = _halves(a[3], dtype)
            r = lane // 4
            B = _b_matrix(b.arr, b.flat, dtype, n, b_lbo, b_sbo, trans_b, swizzle)
            _accumulate(acc, A[[r, r + 8]], B, accumulate, n)
        return mma

    def fence():
        pass

    def commit():
        pass

    def fence_proxy_async():
        pass

    @functools.cache
    def pin(count):
        def pin_(arr):
            pass
        return pin_

    def opaque(x):
        return x

    @functools.cache
    def bar_sync(count):
        def sync(barrier):
            from .._simulator import named_barrier
            named_barrier(int(barrier), count, True)
        return sync

    @functools.cache
    def bar_arrive(count):
        def arrive(barrier):
            from .._simulator import named_barrier
            named_barrier(int(barrier), count, False)
        return arrive

    @functools.cache
    def setmaxnreg(increase, count):
        def setmaxnreg_():
            pass
        return setmaxnreg_

    @functools.cache
    def wait_pin(n, count, tag=0):
        def wait(arr):
            pass
        return wait

else:
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    from .async_copy import _shared_address

    _I32 = ir.IntType(32)
    _I64 = ir.IntType(64)

    def _void_asm(builder, text):
        fnty = ir.FunctionType(ir.VoidType(), [])
        builder.call(ir.InlineAsm(fnty, text, "~{memory}", side_effect=True), [])

    def _plain(text, name):
        def typer(typingctx):
            def codegen(context, builder, sig, args):
                _void_asm(builder, text)
                return context.get_dummy_value()
            return types.void(), codegen
        typer.__name__ = name
        return intrinsic(typer)

    fence = _plain("wgmma.fence.sync.aligned;", "fence")
    commit = _plain("wgmma.commit_group.sync.aligned;", "commit")
    fence_proxy_async = _plain("fence.proxy.async.shared::cta;", "fence_proxy_async")

    def _barrier(text, name):
        def typer(typingctx, barrier):
            if not isinstance(barrier, types.Integer):
                return None

            def codegen(context, builder, sig, args):
                b = builder.trunc(context.cast(builder, args[0], sig.args[0], types.int64), _I32)
                fnty = ir.FunctionType(ir.VoidType(), [_I32])
                builder.call(ir.InlineAsm(fnty, text, "r,~{memory}", side_effect=True), [b])
                return context.get_dummy_value()
            return types.void(barrier), codegen
        typer.__name__ = name
        return intrinsic(typer)

    @functools.cache
    def bar_sync(count):
        return _barrier(f"bar.sync $0, {int(count)};", "bar_sync")

    @functools.cache
    def bar_arrive(count):
        return _barrier(f"bar.arrive $0, {int(count)};", "bar_arrive")

    @functools.cache
    def setmaxnreg(increase, count):
        kind = "inc" if increase else "dec"
        return _plain(f"setmaxnreg.{kind}.sync.aligned.u32 {int(count)};", "setmaxnreg")

    def _through(text, count):
        """Codegen passing the first ``count`` elements of a local array through
        the volatile ``text`` (tied operands: the values stay, their order with
        respect to other volatile instructions is fixed)."""
        def codegen(context, builder, sig, args):
            data = context.make_array(sig.args[0])(context, builder, args[0]).data
            elt = data.type.pointee
            code = "f" if isinstance(elt, ir.FloatType) else "r"
            ptrs = [builder.gep(data, [ir.Constant(_I64, e)]) for e in range(count)]
            vals = [builder.load(p) for p in ptrs]
            fnty = ir.FunctionType(ir.LiteralStructType([elt] * count), [elt] * count)
            cons = ",".join([f"={code}"] * count + [str(e) for e in range(count)] + ["~{memory}"])
            res = builder.call(ir.InlineAsm(fnty, text, cons, side_effect=True), vals)
            for e, p in enumerate(ptrs):
                builder.store(builder.extract_value(res, e), p)
            return context.get_dummy_value()
        return codegen

    def _local_array(arr_ty):
        return isinstance(arr_ty, types.Array) and arr_ty.dtype in (types.float32, types.uint32)

    @intrinsic
    def opaque(typingctx, x):
        """``x`` (an int32) through an empty volatile instruction: the same
        value, which the compiler cannot compute before the call, so what is
        derived from it is not hoisted out of the loop around the call."""
        if not isinstance(x, types.Integer):
            return None

        def codegen(context, builder, sig, args):
            v = context.cast(builder, args[0], sig.args[0], types.int32)
            fnty = ir.FunctionType(_I32, [_I32])
            return builder.call(ir.InlineAsm(fnty, "mov.b32 $0, $1;", "=r,r", side_effect=True),
                                [v])
        return types.int32(x), codegen

    @functools.cache
    def pin(count):
        @intrinsic
        def pin_(typingctx, arr):
            if not _local_array(arr):
                return None
            return types.void(arr), _through("", count)
        return pin_

    @functools.cache
    def wait_pin(n, count, tag=0):
        text = f"wgmma.wait_group.sync.aligned {int(n)};" + (f" // {int(tag)}" if tag else "")

        @intrinsic
        def wait(typingctx, arr):
            if not _local_array(arr):
                return None
            return types.void(arr), _through(text, count)
        return wait

    @intrinsic
    def matrix_start(typingctx, arr, flat):
        if not (isinstance(arr, types.Array) and arr.dtype.bitwidth == 16
                and isinstance(flat, types.Integer)):
            return None
        sig = types.int64(arr, flat)

        def codegen(context, builder, sig, args):
            data = context.make_array(sig.args[0])(context, builder, args[0]).data
            base = _shared_address(builder, data)
            i = builder.trunc(context.cast(builder, args[1], sig.args[1], types.intp), _I32)
            addr = builder.add(base, builder.mul(i, ir.Constant(_I32, 2)))
            start = builder.lshr(builder.and_(addr, ir.Constant(_I32, 0x3FFFF)),
                                 ir.Constant(_I32, 4))
            return builder.zext(start, _I64)
        return sig, codegen

    def _descriptor(context, builder, start_ty, start, fields):
        # an add, not an or: start + constant offsets + fields fold into one add
        return builder.add(context.cast(builder, start, start_ty, types.int64),
                           ir.Constant(_I64, fields))

    def _mma_codegen(text, nr, n_a_regs, a_fields, b_fields):
        """Codegen of a ``wgmma`` over ``acc`` (nr float32) with either a shared
        A (``n_a_regs == 0``: its start) or four A words, then ``b``'s start and
        the ``accumulate`` flag."""
        def codegen(context, builder, sig, args):
            acc_ty = sig.args[0]
            data = context.make_array(acc_ty)(context, builder, args[0]).data
            ptrs = [builder.gep(data, [ir.Constant(_I64, e)]) for e in range(nr)]
            vals = [builder.load(p) for p in ptrs]
            pos = 1
            ins = []
            if n_a_regs:
                for k in range(4):
                    ins.append(context.cast(builder, args[pos + k], sig.args[pos + k], types.uint32))
                pos += 4
            else:
                ins.append(_descriptor(context, builder, sig.args[1], args[1], a_fields))
                pos += 1
            ins.append(_descriptor(context, builder, sig.args[pos], args[pos], b_fields))
            flag = context.cast(builder, args[pos + 1], sig.args[pos + 1], types.int32)
            ins.append(flag)
            fnty = ir.FunctionType(ir.LiteralStructType([ir.FloatType()] * nr),
                                   [v.type for v in ins] + [ir.FloatType()] * nr)
            kinds = (["r"] * 4 if n_a_regs else ["l"]) + ["l", "r"]
            cons = ",".join(["=f"] * nr + kinds + [str(e) for e in range(nr)] + ["~{memory}"])
            res = builder.call(ir.InlineAsm(fnty, text, cons, side_effect=True), ins + vals)
            for e, p in enumerate(ptrs):
                builder.store(builder.extract_value(res, e), p)
            return context.get_dummy_value()
        return codegen

    def _text(dtype, n, a_regs, trans_b):
        nr = n // 2
        kind = KINDS[dtype]
        d = ", ".join(f"${e}" for e in range(nr))
        if a_regs:
            a = "{" + ", ".join(f"${nr + k}" for k in range(4)) + "}"
            b, flag, tail = f"${nr + 4}", f"${nr + 5}", f"1, 1, {int(trans_b)}"
        else:
            a, b, flag, tail = f"${nr}", f"${nr + 1}", f"${nr + 2}", f"1, 1, 0, {int(trans_b)}"
        return ("{\n\t.reg .pred p;\n\t"
                f"setp.ne.b32 p, {flag}, 0;\n\t"
                f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{kind}.{kind} "
                f"{{{d}}}, {a}, {b}, p, {tail};\n}}")

    def _check_acc(acc, n):
        return isinstance(acc, types.Array) and acc.dtype == types.float32 and acc.layout == "C"

    @functools.cache
    def wgmma_ss(dtype, n, a_lbo, a_sbo, b_lbo, b_sbo, trans_b=False, swizzle=0):
        a_fields = descriptor_fields(a_lbo, a_sbo, swizzle)
        b_fields = descriptor_fields(b_lbo, b_sbo, swizzle)
        text = _text(dtype, n, False, trans_b)

        @intrinsic
        def mma(typingctx, acc, a, b, accumulate):
            if not _check_acc(acc, n):
                return None
            sig = types.void(acc, a, b, accumulate)
            return sig, _mma_codegen(text, n // 2, 0, a_fields, b_fields)
        return mma

    @functools.cache
    def wgmma_rs(dtype, n, b_lbo, b_sbo, trans_b=False, swizzle=0):
        b_fields = descriptor_fields(b_lbo, b_sbo, swizzle)
        text = _text(dtype, n, True, trans_b)

        @intrinsic
        def mma(typingctx, acc, a0, a1, a2, a3, b, accumulate):
            if not _check_acc(acc, n):
                return None
            sig = types.void(acc, a0, a1, a2, a3, b, accumulate)
            return sig, _mma_codegen(text, n // 2, 4, None, b_fields)
        return mma
