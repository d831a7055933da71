"""16-byte vector loads.

``load16(arr, flat, out, out_off)`` reads the 16 bytes of ``arr`` starting at
flat element index ``flat`` (4 float32, 8 float16 or 8 bfloat16 values, which
must be 16-byte aligned: ``flat * itemsize % 16 == 0`` in a C-contiguous
array) and writes them, converted to float32, to
``out[out_off:out_off + 16 // itemsize]``. A ``uint16`` array holds bfloat16
bit patterns (see ``convert.py``): each becomes the float32 with bits
``u << 16``.

On the GPU it is a numba ``@intrinsic`` that bitcasts the element pointer to
a ``<N x T>`` vector and loads it with ``align 16``, which compiles to one
``ld.global.v4`` (``LDG.E.128``) instead of N scalar loads. Numba does not
vectorise consecutive scalar loads by itself. Under the simulator a plain
Python function with the same meaning stands in.
"""
import numpy as np
from numba import config, float32, types


def _host_flat(arr):
    """The flat NumPy view behind a simulator array argument."""
    item = getattr(arr, "_item", arr)
    return getattr(item, "_ary", item).reshape(-1)


if config.ENABLE_CUDASIM:

    def load16(arr, flat, out, out_off):
        a = _host_flat(arr)
        n = 16 // a.itemsize
        if a.dtype == np.uint16:        # bfloat16 bit patterns
            vals = (a[flat:flat + n].astype(np.uint32) << 16).view(np.float32)
            for e in range(n):
                out[out_off + e] = vals[e]
        else:
            for e in range(n):
                out[out_off + e] = float32(a[flat + e])

else:
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    @intrinsic
    def load16(typingctx, arr, flat, out, out_off):
        if not (isinstance(arr, types.Array)
                and arr.dtype in (types.float16, types.float32, types.uint16)
                and isinstance(out, types.Array) and out.dtype == types.float32):
            return None
        sig = types.void(arr, flat, out, out_off)

        def codegen(context, builder, sig, args):
            arr_ty, flat_ty, out_ty, off_ty = sig.args
            src = context.make_array(arr_ty)(context, builder, args[0])
            dst = context.make_array(out_ty)(context, builder, args[2])
            flat_i = context.cast(builder, args[1], flat_ty, types.intp)
            off_i = context.cast(builder, args[3], off_ty, types.intp)
            elem = context.get_value_type(arr_ty.dtype)
            n = 16 // (arr_ty.dtype.bitwidth // 8)
            vec_ptr = builder.bitcast(builder.gep(src.data, [flat_i]), ir.VectorType(elem, n).as_pointer())
            vec = builder.load(vec_ptr, align=16)
            f32 = ir.FloatType()
            for e in range(n):
                x = builder.extract_element(vec, ir.Constant(ir.IntType(32), e))
                if arr_ty.dtype == types.uint16:            # bf16 bits: the upper half of an f32
                    x = builder.shl(builder.zext(x, ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
                    x = builder.bitcast(x, f32)
                elif arr_ty.dtype != types.float32:
                    if not isinstance(elem, ir.HalfType):   # fp16 may be carried as i16
                        x = builder.bitcast(x, ir.HalfType())
                    x = builder.fpext(x, f32)
                slot = builder.add(off_i, ir.Constant(off_i.type, e))
                builder.store(x, builder.gep(dst.data, [slot]))
            return context.get_dummy_value()

        return sig, codegen


# -- copy16: one 16-byte vector from one array to another --------------------
# ``copy16(src, src_flat, dst, dst_flat)`` copies the 16 bytes of ``src`` at
# flat element index ``src_flat`` to ``dst`` at ``dst_flat`` without
# converting them (any element type of 1, 2, 4 or 8 bytes; both offsets
# 16-byte aligned in C-contiguous arrays). On the GPU: one ``ld.global.v4.u32``
# and one ``st.global.v4.u32``.
if config.ENABLE_CUDASIM:

    def copy16(src, src_flat, dst, dst_flat):
        s, d = _host_flat(src), _host_flat(dst)
        n = 16 // s.itemsize
        d[dst_flat:dst_flat + n] = s[src_flat:src_flat + n]

else:

    @intrinsic
    def copy16(typingctx, src, src_flat, dst, dst_flat):
        if not (isinstance(src, types.Array) and isinstance(dst, types.Array)
                and src.dtype == dst.dtype and getattr(src.dtype, "bitwidth", 0) in (8, 16, 32, 64)):
            return None
        sig = types.void(src, src_flat, dst, dst_flat)

        def codegen(context, builder, sig, args):
            src_ty, src_off_ty, dst_ty, dst_off_ty = sig.args
            s = context.make_array(src_ty)(context, builder, args[0])
            d = context.make_array(dst_ty)(context, builder, args[2])
            s_i = context.cast(builder, args[1], src_off_ty, types.intp)
            d_i = context.cast(builder, args[3], dst_off_ty, types.intp)
            v4 = ir.VectorType(ir.IntType(32), 4).as_pointer()
            s_ptr = builder.bitcast(builder.gep(s.data, [s_i]), v4)
            d_ptr = builder.bitcast(builder.gep(d.data, [d_i]), v4)
            builder.store(builder.load(s_ptr, align=16), d_ptr, align=16)
            return context.get_dummy_value()

        return sig, codegen
