"""Transcendental functions for the kernels' inner loops.

``exp2_approx(x)`` is ``2 ** x`` in float32 by the special-function unit alone
(PTX ``ex2.approx.ftz.f32``: at most 2 ulp of error; subnormal inputs and
results are flushed to zero). ``math.exp2`` compiles to the same instruction
wrapped in a range check and two multiplies that keep subnormal results; where
those results do not matter (softmax weights below ``2 ** -126`` of the row's
largest) this is a third of the instructions. Under the simulator a NumPy
stand-in computes the same function in float32 with the same flushing.

``exp2_fma(x)`` is ``2 ** x`` for ``x <= 0`` (and NaN) on the FMA and integer
pipes instead of the special-function unit, whose 16 results a clock on an
SM (a warp's instruction every 8 clocks on each quarter) can bound a softmax:
``x`` is clamped to -127 (NaN kept), split into the nearest integer ``n``
(added to and taken from ``1.5 * 2 ** 23``, so no conversion instruction)
and ``f`` in [-0.5, 0.5], ``2 ** f`` is a degree-5 polynomial with ``1``
as its constant term (relative error under ``1.7e-7``, about the 2 ulp of
``ex2.approx``), ``n`` is added to its exponent field, and a last
``max.NaN`` with ``x`` keeps a NaN (the canonical NaN's low bits, shifted
into the exponent field, would make it the largest float; ``2 ** x > x``
leaves every other result as it is). Twelve instructions. -inf and
everything at or below -127 give exactly +0 (``2 ** 0`` is 1 exactly,
whose exponent then becomes 0); results below ``2 ** -126``
are subnormal and within ``2 ** -126`` of the true value, where
``exp2_approx`` flushes them. The stand-in (``exp2_fma_steps``, which the
host can call in both modes) evaluates the same steps in
float32, each fused multiply-add as a float64 product and sum rounded once
(which can differ from a true fma in the last place).

``fma(a, b, c)`` is ``a * b + c`` rounded once (``fma.rn.f32``: ``cuda.fma``),
for an expression the compiler would otherwise split (a product shared with
another expression is computed once and each sum added after it); under the
simulator it is the float32 expression, as there before.
"""
import numpy as np
from numba import config, types

TINY = np.float32(2.0 ** -126)      # the smallest normal float32
ROUNDER = np.float32(1.5 * 2.0 ** 23)   # x + ROUNDER rounds x to an integer in its low bits
# 2 ** f on [-0.5, 0.5], f ** 1 .. f ** 5 (the constant term is 1), float32
EXP2_POLY = tuple(np.array([0x3F317215, 0x3E75FCDE, 0x3D635BA9, 0x3C1E7544, 0x3AADDD0A],
                           np.uint32).view(np.float32).tolist())


def exp2_fma_steps(x):
    """``exp2_fma``'s steps on the host, in NumPy float32 (the simulator's
    ``exp2_fma``; on a GPU what its instructions are checked against)."""
    x = np.float32(x)
    xc = x if np.isnan(x) else max(x, np.float32(-127.0))
    t = np.float32(xc + ROUNDER)
    f = np.float32(xc - np.float32(t - ROUNDER))
    p = np.float32(EXP2_POLY[4])
    for c in EXP2_POLY[3::-1] + (1.0,):
        p = np.float32(float(p) * float(f) + c)
    bits = (int(p.view(np.uint32)) + (int(t.view(np.uint32)) << 23)) & 0xFFFFFFFF
    # the last step, max.NaN with x (2 ** x > x: only a NaN changes it), keeps a
    # NaN whatever its bits (a NaN's low bits shifted into the exponent do not)
    return np.float32(np.nan) if np.isnan(x) else np.uint32(bits).view(np.float32)


if config.ENABLE_CUDASIM:

    def exp2_approx(x):
        x = np.float32(x)
        if abs(x) < TINY:
            x = np.float32(0.0)
        y = np.float32(np.exp2(x))
        return np.float32(0.0) if y < TINY else y

    exp2_fma = exp2_fma_steps

    def fma(a, b, c):
        return a * b + c

else:
    from llvmlite import ir
    from numba import cuda
    from numba.cuda.extending import intrinsic

    from .convert import device_function

    @device_function
    def fma(a, b, c):
        return cuda.fma(a, b, c)

    def _float_asm(name, text):
        """An intrinsic ``name(x) -> float32`` running PTX ``text`` on a
        float32 (``$1`` in, ``$0`` out)."""
        def typer(typingctx, x):
            def codegen(context, builder, sig_, args):
                v = context.cast(builder, args[0], sig_.args[0], types.float32)
                fnty = ir.FunctionType(ir.FloatType(), [ir.FloatType()])
                return builder.call(ir.InlineAsm(fnty, text, "=f,f"), [v])

            return types.float32(x), codegen
        typer.__name__ = name
        return intrinsic(typer)

    exp2_approx = _float_asm("exp2_approx", "ex2.approx.ftz.f32 $0, $1;")

    def _hex(v):
        return "0f%08X" % int(np.float32(v).view(np.uint32))

    _EXP2_FMA = ("{\n\t.reg .f32 x, t, n, f, p;\n\t.reg .b32 tb, pb;\n"
                 "\tmax.NaN.f32 x, $1, 0fC2FE0000;\n"          # -127, NaN kept
                 f"\tadd.rn.f32 t, x, {_hex(ROUNDER)};\n"
                 f"\tsub.rn.f32 n, t, {_hex(ROUNDER)};\n"
                 "\tsub.rn.f32 f, x, n;\n"
                 f"\tfma.rn.f32 p, {_hex(EXP2_POLY[4])}, f, {_hex(EXP2_POLY[3])};\n"
                 + "".join(f"\tfma.rn.f32 p, p, f, {_hex(c)};\n"
                           for c in EXP2_POLY[2::-1] + (1.0,))
                 + "\tmov.b32 tb, t;\n\tshl.b32 tb, tb, 23;\n\tmov.b32 pb, p;\n"
                 "\tadd.s32 pb, pb, tb;\n\tmov.b32 p, pb;\n"
                 "\tmax.NaN.f32 $0, p, x;\n}")        # NaN kept (2 ** x > x otherwise)

    exp2_fma = _float_asm("exp2_fma", _EXP2_FMA)
