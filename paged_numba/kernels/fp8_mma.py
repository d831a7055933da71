"""fp8 codes -> tensor-core fragment words (sm_89+), for the decode kernel's
fp8 caches.

A 32-bit word read from an fp8 tile holds four codes ``b0 .. b3`` (``b0`` in
the lowest byte). The tensor-core products take words of two 16-bit
elements (the lower index in the low half), so each fp8 word becomes two:

``pairs(fmt, mma)(w) -> (lo, hi)``: ``lo = (b0, b1)``, ``hi = (b2, b3)``,
for a word of four consecutive elements of one row (``ldmatrix`` without
the transpose: a key row's dims ``4c .. 4c + 3``);

``crossed(fmt, mma)(w) -> (even, odd)``: ``even = (b0, b2)``, ``odd = (b1,
b3)``, for a word ``ldmatrix.trans`` made of 16-bit pairs of two rows
(``b0, b1`` of row ``2c``, ``b2, b3`` of row ``2c + 1``): each half is then
one column's two rows, the ``A`` fragment of ``mma.m16n8k8`` when the rows
are its ``K`` index.

``mma_m16n8k32(afmt, bfmt)`` returns ``mma(a0, a1, a2, a3, b0, b1, c0, c1, c2,
c3) -> (d0, d1, d2, d3)``: ``D = A @ B + C`` for a 16 x 32 ``A`` of
``afmt`` codes, a 32 x 8 ``B`` of ``bfmt`` codes and float32 ``C``, ``D``
(``mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32``, sm_89+). Each
word holds four codes, the lowest index in the lowest byte; with ``r =
lane // 4`` and ``c = lane % 4``::

    a0 = A[r, 4c:4c+4]      a1 = A[r+8, 4c:4c+4]
    a2 = A[r, 4c+16:4c+20]  a3 = A[r+8, 4c+16:4c+20]
    b0 = B[4c:4c+4, r]      b1 = B[4c+16:4c+20, r]

and ``C``, ``D`` as in :func:`paged_numba.kernels.mma.mma_m16n8k16`. A key
``ldmatrix`` word of a row of codes (dims ``4c .. 4c + 3`` of a 16-dim
vector) is therefore a B word as it stands: no conversion. The products of
two codes are exact; the tensor cores add them to ``C`` with fewer bits
than float32 (see :data:`paged_numba.testing.bounds.FP8_TENSOR_CORE_U`).
Under the simulator the lanes' codes are decoded and the product taken in
float64, rounded to float32.

``mma`` ("float16" or "bfloat16") is the fragment type. The conversion is
exact for both formats (every E4M3 and E5M2 value is an fp16 and a bf16
value, NaN stays NaN, E5M2's infinities stay infinite). On the GPU one
``prmt`` (crossed only) and two ``cvt.rn.f16x2.e4m3x2`` / ``.e5m2x2``; for
bf16 each half then goes through float32 (``cvt.f32.f16``,
``cvt.rn.bf16x2.f32``, both exact here). Under the simulator the codes go
through :func:`paged_numba.kernels.fp8.decoder`'s table.

Examples
--------
>>> from numba import cuda
>>> pairs_h = pairs("float8_e4m3fn", "float16")
>>> @cuda.jit
... def convert(words, out):
...     i = cuda.grid(1)
...     if i < words.size:
...         out[2 * i], out[2 * i + 1] = pairs_h(words[i])
>>> words = np.array([0x7E_38_B8_00], np.uint32)   # codes 0x00, 0xB8 (-1), 0x38 (1), 0x7E (448)
>>> out = cuda.device_array(2, np.uint32)
>>> convert[1, 32](cuda.to_device(words), out)
>>> out.copy_to_host().view(np.float16).tolist()
[0.0, -1.0, 1.0, 448.0]
"""
import functools

import numpy as np
from numba import config, types

from .fp8 import FORMATS, decode_table

MMA_TYPES = ("float16", "bfloat16")


def _check(fmt, mma):
    if fmt not in FORMATS or mma not in MMA_TYPES:
        raise ValueError(f"no fp8 fragment conversion from {fmt!r} to {mma!r}; formats "
                         f"{tuple(FORMATS)}, fragment types {MMA_TYPES}")


def _check_formats(afmt, bfmt):
    if afmt not in FORMATS or bfmt not in FORMATS:
        raise ValueError(f"no fp8 tensor-core product of {afmt!r} and {bfmt!r}; formats "
                         f"{tuple(FORMATS)}")


if config.ENABLE_CUDASIM:

    @functools.cache
    def _table(fmt, mma):
        """The 16-bit pattern of each code's value in ``mma``."""
        values = np.asarray(decode_table(fmt), np.float32)
        if mma == "float16":
            return values.astype(np.float16).view(np.uint16).astype(np.uint32)
        return (values.view(np.uint32) >> 16).astype(np.uint32)   # exact: 3 or 2 mantissa bits

    @functools.cache
    def mma_m16n8k32(afmt, bfmt):
        _check_formats(afmt, bfmt)
        from .._simulator import _rendezvous
        ta = np.asarray(decode_table(afmt), np.float64)
        tb = np.asarray(decode_table(bfmt), np.float64)

        def codes(w):
            return [(int(w) >> (8 * i)) & 0xFF for i in range(4)]

        def mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            lane, _, frags = _rendezvous(0xFFFFFFFF, "mma", ((a0, a1, a2, a3), (b0, b1)))
            A = np.zeros((16, 32))
            B = np.zeros((32, 8))
            for ln, (a, b) in frags.items():
                r, c = divmod(ln, 4)
                A[r, 4 * c:4 * c + 4] = ta[codes(a[0])]
                A[r + 8, 4 * c:4 * c + 4] = ta[codes(a[1])]
                A[r, 4 * c + 16:4 * c + 20] = ta[codes(a[2])]
                A[r + 8, 4 * c + 16:4 * c + 20] = ta[codes(a[3])]
                B[4 * c:4 * c + 4, r] = tb[codes(b[0])]
                B[4 * c + 16:4 * c + 20, r] = tb[codes(b[1])]
            r, c = divmod(lane, 4)
            with np.errstate(invalid="ignore", over="ignore"):
                d = A[[r, r, r + 8, r + 8]] @ B[:, [2 * c, 2 * c + 1, 2 * c, 2 * c + 1]]
                out = np.diagonal(d) + np.array([c0, c1, c2, c3], dtype=np.float64)
                return tuple(np.float32(x) for x in out)
        return mma

    def _converter(fmt, mma, cross):
        _check(fmt, mma)
        t = _table(fmt, mma)
        lo, hi = ((0, 2), (1, 3)) if cross else ((0, 1), (2, 3))   # bytes of each half

        def convert(w):
            b = [(int(w) >> (8 * i)) & 0xFF for i in range(4)]
            return (int(t[b[lo[0]]]) | (int(t[b[lo[1]]]) << 16),
                    int(t[b[hi[0]]]) | (int(t[b[hi[1]]]) << 16))
        return convert

else:
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    _U32 = ir.IntType(32)

    def _half_to_bf16(src, dst):
        """PTX turning the f16x2 word ``src`` into the bf16x2 word ``dst``."""
        return (f"\tmov.b32 {{e, f}}, {src};\n\tcvt.f32.f16 x, e;\n\tcvt.f32.f16 y, f;\n"
                f"\tcvt.rn.bf16x2.f32 {dst}, y, x;\n")

    def _text(fmt, mma, cross):
        kind = {"float8_e4m3fn": "e4m3x2", "float8_e5m2": "e5m2x2"}[fmt]
        # prmt selector 0x3120: bytes (b0, b2, b1, b3) from the low byte up
        body = ("\tprmt.b32 t, $2, 0, 0x3120;\n" if cross else "\tmov.b32 t, $2;\n")
        body += "\tmov.b32 {l, h}, t;\n"
        if mma == "float16":
            body += f"\tcvt.rn.f16x2.{kind} $0, l;\n\tcvt.rn.f16x2.{kind} $1, h;\n"
        else:
            body += (f"\tcvt.rn.f16x2.{kind} a, l;\n\tcvt.rn.f16x2.{kind} b, h;\n"
                     + _half_to_bf16("a", "$0") + _half_to_bf16("b", "$1"))
        return ("{\n\t.reg .b16 l, h, e, f;\n\t.reg .b32 t, a, b;\n\t.reg .f32 x, y;\n"
                + body + "}")

    @functools.cache
    def mma_m16n8k32(afmt, bfmt):
        _check_formats(afmt, bfmt)
        from .mma import _mma_intrinsic

        @intrinsic
        def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            return _mma_intrinsic("m16n8k32", afmt, 6, bfmt)(typingctx, a0, a1, a2, a3, b0, b1,
                                                             c0, c1, c2, c3)
        return mma

    def _converter(fmt, mma, cross):
        _check(fmt, mma)
        text = _text(fmt, mma, cross)

        @intrinsic
        def convert(typingctx, w):
            if not isinstance(w, types.Integer):
                return None
            sig = types.UniTuple(types.uint32, 2)(w)

            def codegen(context, builder, sig_, args):
                x = context.cast(builder, args[0], w, types.uint32)
                fnty = ir.FunctionType(ir.LiteralStructType([_U32] * 2), [_U32])
                res = builder.call(ir.InlineAsm(fnty, text, "=r,=r,r"), [x])
                return context.make_tuple(builder, sig.return_type,
                                          [builder.extract_value(res, e) for e in range(2)])

            return sig, codegen

        return convert


@functools.cache
def pairs(fmt, mma):
    """``convert(w) -> (lo, hi)``: ``lo = (b0, b1)``, ``hi = (b2, b3)`` as
    ``mma`` words (see the module's docstring)."""
    return _converter(fmt, mma, False)


@functools.cache
def crossed(fmt, mma):
    """``convert(w) -> (even, odd)``: ``even = (b0, b2)``, ``odd = (b1, b3)``."""
    return _converter(fmt, mma, True)
