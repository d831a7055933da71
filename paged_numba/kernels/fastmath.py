"""One-instruction transcendental functions for the kernels' inner loops.

``exp2_approx(x)`` is ``2 ** x`` in float32 by the special-function unit alone
(PTX ``ex2.approx.ftz.f32``: at most 2 ulp of error; subnormal inputs and
results are flushed to zero). ``math.exp2`` compiles to the same instruction
wrapped in a range check and two multiplies that keep subnormal results; where
those results do not matter (softmax weights below ``2 ** -126`` of the row's
largest) this is a third of the instructions. Under the simulator a NumPy
stand-in computes the same function in float32 with the same flushing.
"""
import numpy as np
from numba import config, types

TINY = np.float32(2.0 ** -126)      # the smallest normal float32

if config.ENABLE_CUDASIM:

    def exp2_approx(x):
        x = np.float32(x)
        if abs(x) < TINY:
            x = np.float32(0.0)
        y = np.float32(np.exp2(x))
        return np.float32(0.0) if y < TINY else y

else:
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    @intrinsic
    def exp2_approx(typingctx, x):
        sig = types.float32(types.float32)

        def codegen(context, builder, sig_, args):
            v = context.cast(builder, args[0], sig_.args[0], types.float32)
            fnty = ir.FunctionType(ir.FloatType(), [ir.FloatType()])
            return builder.call(ir.InlineAsm(fnty, "ex2.approx.ftz.f32 $0, $1;", "=f,f"), [v])

        return types.float32(x), codegen
