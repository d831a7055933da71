"""Asynchronous 16-byte copies from global to shared memory (``cp.async``, sm_80+).

``copy16_async(dst, dst_flat, src, src_flat)`` starts copying the 16 bytes
of ``src`` at flat element index ``src_flat`` to ``dst`` (a shared array) at
``dst_flat``; both must be 16-byte aligned (the two arrays' element types
may differ: the bytes are copied as they are). ``commit_group()`` closes the
group of copies this thread started since the last commit, and
``wait_group(n)`` (a factory: ``n`` is a compile-time constant) returns a
device function that waits until at most ``n`` of this thread's committed
groups are still in flight. A thread may read what *it* copied once the
group is complete; other threads' copies need a barrier as well.

The copies need no registers while in flight, which is how a kernel keeps
many loads outstanding without lowering its occupancy. On the GPU these are
inline PTX (``cp.async.cg.shared.global``, ``cp.async.commit_group``,
``cp.async.wait_group``). Under the simulator a copy reads its source when
it is issued but lands as late as the GPU may let it: its destination holds
``0xFF`` bytes (NaN in every float format a tile holds) until the issuing
thread's ``wait_group`` lets it land, or the mbarrier phase its
``kernels.tma.copies_arrive`` arrival belongs to completes. So a thread that
reads a copy before it was waited for reads NaN there, as it could read
stale data on the GPU.
"""
import functools
import threading

import numpy as np
from numba import config, types

from .vector import _host_flat

POISON = 0xFF               # a simulated copy's bytes until it lands

if config.ENABLE_CUDASIM:
    _local = threading.local()      # a simulated thread's copies in flight

    class _Copy:
        """16 bytes read at issue, to land at ``out[at:at + 16]`` once."""
        __slots__ = ("out", "at", "data", "landed")

        def __init__(self, out, at, data):
            self.out, self.at, self.data, self.landed = out, at, data, False

        def land(self):
            if not self.landed:
                self.out[self.at:self.at + 16] = self.data
                self.landed = True

    def _flight():
        """This thread's ``(open copies, committed groups)``."""
        f = getattr(_local, "flight", None)
        if f is None:
            f = _local.flight = ([], [])
        return f

    def copy16_async(dst, dst_flat, src, src_flat):
        d, s = _host_flat(dst), _host_flat(src)     # the 16 bytes as they are
        i, j = dst_flat * d.itemsize, src_flat * s.itemsize
        out = d.view(np.uint8)
        copy = _Copy(out, i, s.view(np.uint8)[j:j + 16].copy())
        out[i:i + 16] = POISON
        _flight()[0].append(copy)

    def commit_group():
        opened, groups = _flight()
        groups.append(list(opened))     # an empty group counts too, as on the GPU
        opened.clear()

    @functools.cache
    def wait_group(n):
        def wait():
            groups = _flight()[1]
            while len(groups) > n:
                for copy in groups.pop(0):
                    copy.land()
        return wait

    def in_flight():
        """Every copy this thread started that has not landed (for an arrival
        that lands them when its phase completes)."""
        opened, groups = _flight()
        return [c for g in groups for c in g if not c.landed] + \
            [c for c in opened if not c.landed]

else:
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    _I32 = ir.IntType(32)
    _I64 = ir.IntType(64)
    # the destination is a 32-bit shared-window address (an address-space cast of
    # the array's base, which NVVM folds), and the element offset stays 32-bit
    # arithmetic that ptxas folds into the copy's immediate offset
    _COPY = ("{\n\t.reg .u64 pn_g;\n\tcvta.to.global.u64 pn_g, $1;\n"
             "\tcp.async.cg.shared.global [$0], [pn_g], 16;\n}")

    def _asm(builder, text, operands=(), constraints=None):
        fnty = ir.FunctionType(ir.VoidType(), [o.type for o in operands])
        if constraints is None:
            constraints = ",".join(["l"] * len(operands))
        constraints += ",~{memory}" if operands else "~{memory}"
        builder.call(ir.InlineAsm(fnty, text, constraints, side_effect=True), list(operands))

    def _shared_address(builder, pointer):
        # generic -> shared address space: for a shared array NVVM folds the round
        # trip (the array's own address is a constant of the shared window)
        shared = builder.addrspacecast(pointer, ir.PointerType(pointer.type.pointee, 3))
        return builder.ptrtoint(shared, _I32)

    def _element_address(context, builder, arr_ty, arr, idx_ty, idx):
        """32-bit shared-window address of element ``idx`` of a shared array."""
        base = _shared_address(builder, context.make_array(arr_ty)(context, builder, arr).data)
        i = builder.trunc(context.cast(builder, idx, idx_ty, types.intp), _I32)
        size = context.get_abi_sizeof(context.get_data_type(arr_ty.dtype))
        return builder.add(base, builder.mul(i, ir.Constant(_I32, size)))

    @intrinsic
    def copy16_async(typingctx, dst, dst_flat, src, src_flat):
        if not (isinstance(dst, types.Array) and isinstance(src, types.Array)):
            return None
        sig = types.void(dst, dst_flat, src, src_flat)

        def codegen(context, builder, sig, args):
            dst_addr = _element_address(context, builder, sig.args[0], args[0], sig.args[1],
                                        args[1])
            data = context.make_array(sig.args[2])(context, builder, args[2]).data
            j = context.cast(builder, args[3], sig.args[3], types.intp)
            src_addr = builder.ptrtoint(builder.gep(data, [j]), _I64)
            _asm(builder, _COPY, (dst_addr, src_addr), "r,l")
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def commit_group(typingctx):
        def codegen(context, builder, sig, args):
            _asm(builder, "cp.async.commit_group;")
            return context.get_dummy_value()

        return types.void(), codegen

    @functools.cache
    def wait_group(n):
        n = int(n)

        @intrinsic
        def wait(typingctx):
            def codegen(context, builder, sig, args):
                _asm(builder, f"cp.async.wait_group {n};")
                return context.get_dummy_value()

            return types.void(), codegen

        return wait
