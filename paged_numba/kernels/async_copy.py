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
``cp.async.wait_group``); under the simulator the copy happens at once and
commit/wait do nothing.
"""
import functools

import numpy as np
from numba import config, types

from .vector import _host_flat

if config.ENABLE_CUDASIM:

    def copy16_async(dst, dst_flat, src, src_flat):
        d, s = _host_flat(dst), _host_flat(src)     # the 16 bytes as they are
        i, j = dst_flat * d.itemsize, src_flat * s.itemsize
        d.view(np.uint8)[i:i + 16] = s.view(np.uint8)[j:j + 16]

    def commit_group():
        pass

    @functools.cache
    def wait_group(n):
        def wait():
            pass
        return wait

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
