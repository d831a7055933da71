"""16-byte vector loads.

``load16(arr, flat, out, out_off)`` reads the 16 bytes of ``arr`` starting at
flat element index ``flat`` (4 float32 or 8 float16 values, which must be
16-byte aligned: ``flat * itemsize % 16 == 0`` in a C-contiguous array) and
writes them, converted to float32, to ``out[out_off:out_off + 16 // itemsize]``.

On the GPU it is a numba ``@intrinsic`` that bitcasts the element pointer to
a ``<N x T>`` vector and loads it with ``align 16``, which compiles to one
``ld.global.v4`` (``LDG.E.128``) instead of N scalar loads. Numba does not
vectorise consecutive scalar loads by itself. Under the simulator a plain
Python function with the same meaning stands in.
"""
from numba import config, float32, types


def _host_flat(arr):
    """The flat NumPy view behind a simulator array argument."""
    item = getattr(arr, "_item", arr)
    return getattr(item, "_ary", item).reshape(-1)


if config.ENABLE_CUDASIM:

    def load16(arr, flat, out, out_off):
        a = _host_flat(arr)
        for e in range(16 // a.itemsize):
            out[out_off + e] = float32(a[flat + e])

else:
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    @intrinsic
    def load16(typingctx, arr, flat, out, out_off):
        if not (isinstance(arr, types.Array) and arr.dtype in (types.float16, types.float32)
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
                if arr_ty.dtype != types.float32:
                    if not isinstance(elem, ir.HalfType):   # fp16 may be carried as i16
                        x = builder.bitcast(x, ir.HalfType())
                    x = builder.fpext(x, f32)
                slot = builder.add(off_i, ir.Constant(off_i.type, e))
                builder.store(x, builder.gep(dst.data, [slot]))
            return context.get_dummy_value()

        return sig, codegen
