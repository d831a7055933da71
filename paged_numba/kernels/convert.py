"""Conversions between a cache/query storage dtype and float32 inside kernels.

``codec(dtype)`` returns device functions ``(to_f32, from_f32)``: ``to_f32(x)``
turns one stored element into float32, ``from_f32(x)`` turns a float32 into
the value to store in an array of ``dtype``. Kernels do all arithmetic in
float32 and go through these two functions at the edges, so a new storage
type only needs a new pair here (and in ``vector.load16``).

bfloat16 is stored as its 16-bit pattern in a ``uint16`` array (numba has no
bf16 type, and its simulator none at all). bf16 is the upper half of a
float32, so::

    to_f32(u)   = float32 with bits u << 16                    (exact)
    from_f32(x) = upper 16 bits of x, rounded to nearest even:
                  (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
                  NaN -> the quiet NaN 0x7FC0 with x's sign     (as ml_dtypes does)

The rounding carries into the exponent when the mantissa rounds up, which
gives the next power of two, or inf above the largest finite bf16. On the GPU
the bit reinterpretations are one-instruction intrinsics; under the
simulator NumPy scalar views stand in.
"""
import functools
import os

import numpy as np
from numba import config, cuda, float32, types, uint16

DTYPES = ("float16", "float32", "bfloat16")

INLINE_ENV = "PAGED_NUMBA_INLINE"
INLINE_MODES = ("numba", "nvvm")


def inline_mode():
    """How the kernels' device functions are inlined, from the environment
    variable ``PAGED_NUMBA_INLINE`` (read when a function is decorated, so
    set it before ``import paged_numba``):

    * ``"nvvm"`` (the default): each device function is typed and lowered
      once (for each signature) and NVVM inlines it (``forceinline=True``,
      the LLVM ``alwaysinline`` attribute);
    * ``"numba"``: Numba's own inlining (``inline="always"``), which copies
      each callee's Numba IR into its caller before typing.

    The two give the same machine code to within a few instructions; NVVM's
    compiles several times faster, the copies of Numba IR being most of a
    large kernel's compile time (on an H100, the first decode call of a
    fresh process 10 s against 21, the first prefill call 13 s against 50).

    >>> inline_mode() in INLINE_MODES
    True
    """
    mode = os.environ.get(INLINE_ENV, "nvvm").strip().lower()
    if mode not in INLINE_MODES:
        raise ValueError(f"{INLINE_ENV} must be one of {', '.join(INLINE_MODES)}, "
                         f"but got {os.environ[INLINE_ENV]!r}")
    return mode


@functools.cache
def _device_functions_compile_without_a_gpu():
    """Let device functions compiled on their own (``forceinline``) compile
    where no GPU is present (``compile_ptx`` on a CPU machine). numba-cuda
    0.30 compiles such a function for the current device's compute
    capability; without a device it fails before anything is compiled. The
    capability only names the function's target in its LLVM module: NVVM
    compiles the kernel that inlines it for the kernel's own target, and the
    PTX is the same whichever capability the function was given. Where no
    device answers, this gives the function ``NUMBA_CUDA_DEFAULT_PTX_CC``."""
    from numba.cuda import dispatcher
    from numba.cuda.cudadrv.error import CudaSupportError

    current = dispatcher.get_current_device

    class _NoDevice:
        compute_capability = config.CUDA_DEFAULT_PTX_CC

    def current_or_default():
        try:
            return current()
        except CudaSupportError:
            return _NoDevice()

    dispatcher.get_current_device = current_or_default


def device_jit(fn):
    """``fn`` as an inlined device function of a compiled kernel, inlined the
    way :func:`inline_mode` says."""
    if not config.ENABLE_CUDASIM and inline_mode() == "nvvm":
        _device_functions_compile_without_a_gpu()
        return cuda.jit(device=True, forceinline=True)(fn)
    return cuda.jit(device=True, inline=True)(fn)


def device_function(fn):
    """Compile ``fn`` as an inlined device function (:func:`device_jit`);
    under the simulator keep the plain Python function (the simulator's
    device-call wrapper costs more than the element access it wraps)."""
    if config.ENABLE_CUDASIM:
        return fn
    return device_jit(fn)


def _round_to_bf16_bits(b):
    """The bf16 pattern nearest (ties to even) to the float32 with bits ``b``
    (an unsigned 32-bit value); NaN gives a quiet NaN of the same sign."""
    if (b & 0x7FFFFFFF) > 0x7F800000:
        return ((b >> 16) & 0x8000) | 0x7FC0
    return (b + 0x7FFF + ((b >> 16) & 1)) >> 16


if config.ENABLE_CUDASIM:

    def bf16_bits_to_f32(u):
        """float32 whose bits are ``u << 16``."""
        return np.uint32((int(u) & 0xFFFF) << 16).view(np.float32)

    def f32_bits(x):
        """The bits of float32 ``x`` as an unsigned integer."""
        return int(np.float32(x).view(np.uint32))

else:
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    @intrinsic
    def bf16_bits_to_f32(typingctx, u):
        if not isinstance(u, types.Integer):
            return None

        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            x = args[0]
            if u.bitwidth < 32:
                x = builder.zext(x, i32)
            elif u.bitwidth > 32:
                x = builder.trunc(x, i32)
            x = builder.shl(builder.and_(x, ir.Constant(i32, 0xFFFF)), ir.Constant(i32, 16))
            return builder.bitcast(x, ir.FloatType())

        return types.float32(u), codegen

    @intrinsic
    def f32_bits(typingctx, x):
        if not isinstance(x, (types.Float, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            f = context.cast(builder, args[0], sig.args[0], types.float32)
            return builder.bitcast(f, ir.IntType(32))

        return types.uint32(x), codegen


@functools.cache
def codec(dtype):
    """``(to_f32, from_f32)`` device functions for storage ``dtype`` (a name)."""
    dtype = getattr(dtype, "name", dtype)
    if dtype not in DTYPES:
        raise ValueError(f"no kernel codec for dtype {dtype!r}; supported: {DTYPES}")

    if dtype == "bfloat16":
        round_bits = device_function(_round_to_bf16_bits)

        @device_function
        def to_f32(x):
            return bf16_bits_to_f32(x)

        @device_function
        def from_f32(x):
            return uint16(round_bits(f32_bits(x)))

        return to_f32, from_f32

    @device_function
    def to_f32(x):
        return float32(x)

    @device_function
    def from_f32(x):
        return x          # numba rounds float32 to the array's float type on store

    return to_f32, from_f32
