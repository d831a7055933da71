"""Warp-wide tensor-core product and 16-byte word loads (sm_80+).

``load_words(arr, flat)`` returns the 16 bytes of ``arr`` at flat element
index ``flat`` (16-byte aligned) as four ``uint32`` words, without
conversion: two fp16 or bf16 values per word, the lower index in the low
half. ``store_words(arr, flat, w0, w1, w2, w3)`` writes four words there
(one ``st.v4.u32``).

``mma_m16n8k16(dtype)`` returns a device function
``mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3) -> (d0, d1, d2, d3)``: the warp
computes ``D = A @ B + C`` for a 16 x 16 ``A`` and a 16 x 8 ``B`` of
``dtype`` ("float16" or "bfloat16") and a 16 x 8 float32 ``C``, each lane
holding the fragments PTX's ``mma.sync.aligned.m16n8k16.row.col`` assigns
it. With ``r = lane // 4`` and ``c = lane % 4``::

    a0 = A[r, 2c:2c+2]      a1 = A[r+8, 2c:2c+2]
    a2 = A[r, 2c+8:2c+10]   a3 = A[r+8, 2c+8:2c+10]
    b0 = B[2c:2c+2, r]      b1 = B[2c+8:2c+10, r]
    c0, c1 = C[r, 2c], C[r, 2c+1]      c2, c3 = C[r+8, 2c], C[r+8, 2c+1]

(``a*`` and ``b*`` are words of two elements; the products are exact in
float32 and accumulated in float32.) All 32 lanes must call it together.

``mma_m16n8k8(dtype)`` is the same with ``K = 8``: ``mma(a0, a1, b0, c0, c1,
c2, c3)`` with ``a0 = A[r, 2c:2c+2]``, ``a1 = A[r+8, 2c:2c+2]``, ``b0 =
B[2c:2c+2, r]`` and ``C`` as above.

``ldmatrix_x4_trans(arr, flat)`` (``arr`` a shared array of 16-bit elements):
lanes ``8j .. 8j+7`` each name one 16-byte row (8 elements at flat index
``flat``, 16-byte aligned) of an 8 x 8 matrix ``M_j``; every lane gets four
words, word ``j`` holding ``M_j[2c, r]`` (low half) and ``M_j[2c+1, r]``: the
transposed fragment, which is ``a0``/``a1`` of ``mma_m16n8k8`` when the rows
of ``M_j`` are its ``K`` index. All 32 lanes must call it together.
``ldmatrix_x4(arr, flat)`` is the same without the transpose: word ``j`` holds
``M_j[r, 2c]`` and ``M_j[r, 2c+1]`` (the ``B`` fragment of ``mma_m16n8k16``
when the rows of ``M_j`` are its ``N`` index).

``stmatrix_x4(arr, flat, w0, w1, w2, w3)`` (sm_90) is ``ldmatrix_x4`` the other
way: word ``j`` of every lane holds ``M_j[r, 2c]`` (low half) and ``M_j[r,
2c+1]``, and lanes ``8j .. 8j+7`` name the 16-byte rows of ``M_j`` that the
warp writes (row ``lane % 8`` of ``M_{lane // 8}`` at the lane's ``flat``). A
warp's accumulator fragments, rounded and packed, are such words: four 8 x 8
tiles of output in one instruction, one address a lane.

``pack_pair(dtype)`` returns ``pack(x0, x1) -> word``: the two float32 values
rounded to nearest (even) in ``dtype`` and packed into one ``uint32``, ``x0`` in
the low half (an mma A or B fragment word).

``split_pack(dtype)`` returns ``split(x0, x1) -> (hi, lo)``: the words of
``y = x * 2**15`` in ``dtype``, ``hi = round(y)`` and ``lo = round(y - hi)``,
``x0`` in the low half. ``hi + lo`` is ``y`` within ``2**-22 |y| + 2**-25``
(fp16) or ``2**-16 |y|`` (bf16) for ``0 <= x <= 1``; the scale keeps small
fp16 weights out of the subnormal range.

On the GPU these are inline PTX (``ld.*.v4.u32`` through an LLVM vector load,
``mma.sync``, ``ldmatrix``, ``cvt.rn.f16x2.f32``); under the simulator the
lanes meet in the warp-operation rendezvous of ``paged_numba._simulator`` and
each computes its own outputs from every lane's fragments in float64 (rounded to
float32 for the mma).
"""
import functools

import numpy as np
from numba import config, types

if config.ENABLE_CUDASIM:
    from .vector import _host_flat

    def load_words(arr, flat):
        a = _host_flat(arr)
        n = 16 // a.itemsize
        w = np.ascontiguousarray(a[flat:flat + n]).view(np.uint32)
        return int(w[0]), int(w[1]), int(w[2]), int(w[3])

    def store_words(arr, flat, w0, w1, w2, w3):
        a = _host_flat(arr)
        a[flat:flat + 16 // a.itemsize].view(np.uint32)[:] = (w0, w1, w2, w3)

    def _halves(word, dtype):
        lo, hi = int(word) & 0xFFFF, (int(word) >> 16) & 0xFFFF
        if dtype == "bfloat16":
            return [float(np.uint32(x << 16).view(np.float32)) for x in (lo, hi)]
        return [float(np.uint16(x).view(np.float16)) for x in (lo, hi)]

    @functools.cache
    def mma_m16n8k16(dtype):
        from .._simulator import _rendezvous

        def mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            lane, _, frags = _rendezvous(0xFFFFFFFF, "mma", ((a0, a1, a2, a3), (b0, b1)))
            A = np.zeros((16, 16))
            B = np.zeros((16, 8))
            for ln, (a, b) in frags.items():
                r, c = divmod(ln, 4)
                A[r, 2 * c:2 * c + 2] = _halves(a[0], dtype)
                A[r + 8, 2 * c:2 * c + 2] = _halves(a[1], dtype)
                A[r, 2 * c + 8:2 * c + 10] = _halves(a[2], dtype)
                A[r + 8, 2 * c + 8:2 * c + 10] = _halves(a[3], dtype)
                B[2 * c:2 * c + 2, r] = _halves(b[0], dtype)
                B[2 * c + 8:2 * c + 10, r] = _halves(b[1], dtype)
            r, c = divmod(lane, 4)
            d = A[[r, r, r + 8, r + 8]] @ B[:, [2 * c, 2 * c + 1, 2 * c, 2 * c + 1]]
            out = np.diagonal(d) + np.array([c0, c1, c2, c3], dtype=np.float64)
            return tuple(np.float32(x) for x in out)
        return mma

    @functools.cache
    def mma_m16n8k8(dtype):
        k16 = mma_m16n8k16(dtype)

        def mma(a0, a1, b0, c0, c1, c2, c3):
            # the k16 product with the upper half of K zero: the same sum, exactly
            return k16(a0, a1, 0, 0, b0, 0, c0, c1, c2, c3)
        return mma

    def _ldmatrix_rows(arr, flat):
        from .._simulator import _rendezvous
        a = _host_flat(arr)
        row = tuple(int(x) for x in a[flat:flat + 8].view(np.uint16))
        lane, _, rows = _rendezvous(0xFFFFFFFF, "ldmatrix", row)
        return divmod(lane, 4), rows

    def ldmatrix_x4_trans(arr, flat):
        (r, c), rows = _ldmatrix_rows(arr, flat)
        return tuple(rows[8 * j + 2 * c][r] | (rows[8 * j + 2 * c + 1][r] << 16)
                     for j in range(4))

    def ldmatrix_x4(arr, flat):
        (r, c), rows = _ldmatrix_rows(arr, flat)
        return tuple(rows[8 * j + r][2 * c] | (rows[8 * j + r][2 * c + 1] << 16)
                     for j in range(4))

    def stmatrix_x4(arr, flat, w0, w1, w2, w3):
        from .._simulator import _rendezvous
        lane, _, got = _rendezvous(0xFFFFFFFF, "stmatrix", (int(flat), (w0, w1, w2, w3)))
        # every lane writes the row it names: row i of matrix j, whose words
        # are word j of lanes 4i .. 4i + 3
        j, i = divmod(lane, 8)
        words = [int(got[4 * i + c][1][j]) & 0xFFFFFFFF for c in range(4)]
        a = _host_flat(arr)
        a[flat:flat + 8].view(np.uint32)[:] = words

    def _round_half(y, dtype):
        """(bits, value) of float32 ``y`` rounded to ``dtype``."""
        if dtype == "bfloat16":
            from .convert import _round_to_bf16_bits
            bits = _round_to_bf16_bits(int(np.float32(y).view(np.uint32)))
            return bits, np.uint32(bits << 16).view(np.float32)
        h = np.float16(y)
        return int(h.view(np.uint16)), np.float32(h)

    @functools.cache
    def pack_pair(dtype):
        def pack(x0, x1):
            lo, hi = (_round_half(np.float32(x), dtype)[0] for x in (x0, x1))
            return lo | (hi << 16)
        return pack

    @functools.cache
    def split_pack(dtype):
        def split(x0, x1):
            y = [np.float32(x0) * np.float32(2.0 ** 15), np.float32(x1) * np.float32(2.0 ** 15)]
            hi = [_round_half(v, dtype) for v in y]
            lo = [_round_half(np.float32(v - h[1]), dtype) for v, h in zip(y, hi)]
            return hi[0][0] | (hi[1][0] << 16), lo[0][0] | (lo[1][0] << 16)
        return split

else:
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    _U32 = ir.IntType(32)
    _F32 = ir.FloatType()

    @intrinsic
    def load_words(typingctx, arr, flat):
        if not (isinstance(arr, types.Array) and arr.dtype.bitwidth in (16, 32)):
            return None
        sig = types.UniTuple(types.uint32, 4)(arr, flat)

        def codegen(context, builder, sig, args):
            arr_ty, flat_ty = sig.args
            data = context.make_array(arr_ty)(context, builder, args[0]).data
            i = context.cast(builder, args[1], flat_ty, types.intp)
            ptr = builder.bitcast(builder.gep(data, [i]), ir.VectorType(_U32, 4).as_pointer())
            vec = builder.load(ptr, align=16)
            words = [builder.extract_element(vec, ir.Constant(_U32, e)) for e in range(4)]
            return context.make_tuple(builder, sig.return_type, words)

        return sig, codegen

    @intrinsic
    def store_words(typingctx, arr, flat, w0, w1, w2, w3):
        if not (isinstance(arr, types.Array) and arr.dtype.bitwidth in (16, 32)):
            return None
        sig = types.void(arr, flat, types.uint32, types.uint32, types.uint32, types.uint32)

        def codegen(context, builder, sig_, args):
            arr_ty, flat_ty = sig_.args[:2]
            data = context.make_array(arr_ty)(context, builder, args[0]).data
            i = context.cast(builder, args[1], flat_ty, types.intp)
            ptr = builder.bitcast(builder.gep(data, [i]), ir.VectorType(_U32, 4).as_pointer())
            vec = ir.Constant(ir.VectorType(_U32, 4), ir.Undefined)
            for e, w in enumerate(args[2:]):
                vec = builder.insert_element(vec, w, ir.Constant(_U32, e))
            builder.store(vec, ptr, align=16)
            return context.get_dummy_value()

        return sig, codegen

    _KINDS = {"float16": "f16", "bfloat16": "bf16", "float8_e4m3fn": "e4m3",
              "float8_e5m2": "e5m2"}

    def _mma_intrinsic(shape, dtype, words, btype=None):
        """An ``mma.sync.aligned.<shape>.row.col`` f32 += ``dtype`` intrinsic taking
        ``words`` uint32 fragment words (A then B) and four float32 C values
        (``btype``: B's type where it differs from A's, fp8 formats)."""
        kind, bkind = _KINDS[dtype], _KINDS[btype or dtype]
        na = words - (1 if shape == "m16n8k8" else 2)
        ops = [f"${e}" for e in range(4 + words + 4)]
        text = (f"mma.sync.aligned.{shape}.row.col.f32.{kind}.{bkind}.f32 "
                f"{{{','.join(ops[:4])}}}, {{{','.join(ops[4:4 + na])}}}, "
                f"{{{','.join(ops[4 + na:4 + words])}}}, {{{','.join(ops[4 + words:])}}};")
        constraints = ",".join(["=f"] * 4 + ["r"] * words + ["f"] * 4)
        sig = types.UniTuple(types.float32, 4)(*([types.uint32] * words + [types.float32] * 4))

        def typer(typingctx, *args):
            def codegen(context, builder, sig_, vals):
                vals = [context.cast(builder, v, t, s)
                        for v, t, s in zip(vals, sig_.args, sig.args)]
                fnty = ir.FunctionType(ir.LiteralStructType([_F32] * 4),
                                       [_U32] * words + [_F32] * 4)
                res = builder.call(ir.InlineAsm(fnty, text, constraints), vals)
                outs = [builder.extract_value(res, e) for e in range(4)]
                return context.make_tuple(builder, sig.return_type, outs)

            return types.UniTuple(types.float32, 4)(*args), codegen

        return typer

    @functools.cache
    def mma_m16n8k16(dtype):
        @intrinsic
        def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            return _mma_intrinsic("m16n8k16", dtype, 6)(typingctx, a0, a1, a2, a3, b0, b1,
                                                        c0, c1, c2, c3)
        return mma

    @functools.cache
    def mma_m16n8k8(dtype):
        @intrinsic
        def mma(typingctx, a0, a1, b0, c0, c1, c2, c3):
            return _mma_intrinsic("m16n8k8", dtype, 3)(typingctx, a0, a1, b0, c0, c1, c2, c3)
        return mma

    def _ldmatrix(trans):
        text = (f"ldmatrix.sync.aligned.m8n8.x4{'.trans' if trans else ''}.shared.b16 "
                "{$0,$1,$2,$3}, [$4];")

        def typer(typingctx, arr, flat):
            if not (isinstance(arr, types.Array) and arr.dtype.bitwidth == 16):
                return None
            return types.UniTuple(types.uint32, 4)(arr, flat), _ldmatrix_codegen(text)
        typer.__name__ = "ldmatrix_x4_trans" if trans else "ldmatrix_x4"
        return typer

    def _ldmatrix_codegen(text):
        def codegen(context, builder, sig, args):
            from .async_copy import _shared_address
            arr_ty, flat_ty = sig.args
            base = _shared_address(builder, context.make_array(arr_ty)(context, builder,
                                                                       args[0]).data)
            i = builder.trunc(context.cast(builder, args[1], flat_ty, types.intp), _U32)
            addr = builder.add(base, builder.mul(i, ir.Constant(_U32, 2)))
            fnty = ir.FunctionType(ir.LiteralStructType([_U32] * 4), [_U32])
            res = builder.call(ir.InlineAsm(fnty, text, "=r,=r,=r,=r,r,~{memory}",
                                            side_effect=True), [addr])
            words = [builder.extract_value(res, e) for e in range(4)]
            return context.make_tuple(builder, sig.return_type, words)

        return codegen

    ldmatrix_x4_trans = intrinsic(_ldmatrix(True))
    ldmatrix_x4 = intrinsic(_ldmatrix(False))

    @intrinsic
    def stmatrix_x4(typingctx, arr, flat, w0, w1, w2, w3):
        if not (isinstance(arr, types.Array) and arr.dtype.bitwidth == 16):
            return None
        sig = types.void(arr, flat, types.uint32, types.uint32, types.uint32, types.uint32)

        def codegen(context, builder, sig_, args):
            from .async_copy import _shared_address
            arr_ty, flat_ty = sig_.args[:2]
            base = _shared_address(builder, context.make_array(arr_ty)(context, builder,
                                                                       args[0]).data)
            i = builder.trunc(context.cast(builder, args[1], flat_ty, types.intp), _U32)
            addr = builder.add(base, builder.mul(i, ir.Constant(_U32, 2)))
            words = [context.cast(builder, v, t, types.uint32)
                     for v, t in zip(args[2:], sig_.args[2:])]
            fnty = ir.FunctionType(ir.VoidType(), [_U32] * 5)
            builder.call(ir.InlineAsm(
                fnty, "stmatrix.sync.aligned.m8n8.x4.shared.b16 [$0], {$1,$2,$3,$4};",
                "r,r,r,r,r,~{memory}", side_effect=True), [addr] + words)
            return context.get_dummy_value()

        return sig, codegen

    _SPLIT = {
        "float16": ("cvt.rn.f16x2.f32 $0, b, a;\n\tmov.b32 {h, k}, $0;\n"
                    "\tcvt.f32.f16 x, h;\n\tcvt.f32.f16 y, k;\n"),
        "bfloat16": ("cvt.rn.bf16x2.f32 $0, b, a;\n\tshl.b32 t, $0, 16;\n"
                     "\tand.b32 u, $0, 0xFFFF0000;\n\tmov.b32 x, t;\n\tmov.b32 y, u;\n"),
    }

    @functools.cache
    def pack_pair(dtype):
        cvt = "cvt.rn.f16x2.f32" if dtype == "float16" else "cvt.rn.bf16x2.f32"
        text = f"{cvt} $0, $2, $1;"      # the first source goes to the upper half

        @intrinsic
        def pack(typingctx, x0, x1):
            sig = types.uint32(types.float32, types.float32)

            def codegen(context, builder, sig_, args):
                vals = [context.cast(builder, v, t, s)
                        for v, t, s in zip(args, sig_.args, sig.args)]
                fnty = ir.FunctionType(_U32, [_F32] * 2)
                return builder.call(ir.InlineAsm(fnty, text, "=r,f,f"), vals)

            return types.uint32(x0, x1), codegen

        return pack

    @functools.cache
    def split_pack(dtype):
        cvt = "cvt.rn.f16x2.f32" if dtype == "float16" else "cvt.rn.bf16x2.f32"
        text = ("{\n\t.reg .f32 a, b, x, y;\n\t.reg .b16 h, k;\n\t.reg .b32 t, u;\n"
                "\tmul.f32 a, $2, 0f47000000;\n\tmul.f32 b, $3, 0f47000000;\n\t"
                + _SPLIT[dtype]
                + f"\tsub.f32 a, a, x;\n\tsub.f32 b, b, y;\n\t{cvt} $1, b, a;\n}}")

        @intrinsic
        def split(typingctx, x0, x1):
            sig = types.UniTuple(types.uint32, 2)(types.float32, types.float32)

            def codegen(context, builder, sig_, args):
                vals = [context.cast(builder, v, t, s)
                        for v, t, s in zip(args, sig_.args, sig.args)]
                fnty = ir.FunctionType(ir.LiteralStructType([_U32] * 2), [_F32] * 2)
                res = builder.call(ir.InlineAsm(fnty, text, "=r,=r,f,f"), vals)
                return context.make_tuple(builder, sig.return_type,
                                          [builder.extract_value(res, e) for e in range(2)])

            return types.UniTuple(types.uint32, 2)(x0, x1), codegen

        return split
