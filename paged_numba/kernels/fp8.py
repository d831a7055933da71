"""fp8 <-> float32 inside kernels, by integer bit manipulation.

Numba has no 8-bit float type, so an fp8 pool is a ``uint8`` array of bit
patterns (``paged_numba.fp8`` describes the two formats and the rounding).
For a format with ``M`` mantissa bits and exponent bias ``B``:

``encoder(fmt)(x)``: float32 ``x`` -> code (an int in ``[0, 256)``)::

    a = bits(x) & 0x7FFFFFFF, sign = bit 31 of bits(x) moved to bit 7
    a > 0x7F800000 (NaN)          -> sign | NAN          (0x7F or 0x7E)
    a >= bits(max) (inf included) -> sign | MAX_CODE     (0x7E = 448, 0x7B = 57344)
    exponent e = a >> 23 > 127 - B (an fp8 normal):
        r = a - ((127 - B) << 23)                  # the exponent rebiased
        code = (r + 2**(S - 1) - 1 + ((r >> S) & 1)) >> S,   S = 23 - M
    else (an fp8 subnormal or zero), with the implicit bit m = (a & 0x7FFFFF) | 2**23:
        s = 151 - B - M - e                        # x / 2**(1 - B - M) = m / 2**s
        code = 0 if s > 24 else (m + 2**(s - 1) - 1 + ((m >> s) & 1)) >> s

Adding ``2**(S-1) - 1`` plus the lowest kept bit and shifting rounds to
nearest with ties to even; a carry out of the mantissa moves to the next
binade (and from the largest subnormal to the smallest normal) by itself.

``decoder(fmt)(code)`` -> float32 (exact): ``0x7F`` (E4M3FN) or exponent
all ones (E5M2: inf when the mantissa is 0, else NaN) are the specials; a
zero exponent is the subnormal ``mantissa * 2**(1 - B - M)``; otherwise the
float32 bits are ``(code & 0x7F) << (23 - M)`` plus ``(127 - B) << 23`` and
the sign moved to bit 31. No float32 subnormal is ever formed, so the
result does not depend on flush-to-zero.

``load16_fp8(fmt)(arr, flat, out, out_off)`` reads 16 codes (one 16-byte,
16-byte aligned vector) of a ``uint8`` array and writes their float32 values
to ``out[out_off:out_off + 16]``: on the GPU one ``ld.v4.u32`` and the
decoder on each byte; under the simulator a 256-entry table made by the
decoder itself.

``to_f32_any(x)`` and ``store_as(x, arr)`` convert a query element to
float32 and a float32 to an output element by the *type* of the array (a
``uint16`` array holds bf16 bits, ``float16``/``float32`` arrays their
values), so one kernel of an fp8 cache takes queries of any of the three.

Examples
--------
Device functions run in a kernel (here one thread per value):

>>> from numba import cuda
>>> enc, dec = encoder("float8_e4m3fn"), decoder("float8_e4m3fn")
>>> @cuda.jit
... def round_trip(x, codes, back):
...     i = cuda.grid(1)
...     if i < x.size:
...         codes[i] = enc(x[i])
...         back[i] = dec(codes[i])
>>> x = np.array([1.0, -0.3, 448.0, 1e9, 2.0 ** -10, 2.0 ** -9], np.float32)
>>> codes, back = cuda.device_array(6, np.uint8), cuda.device_array(6, np.float32)
>>> round_trip[1, 32](cuda.to_device(x), codes, back)
>>> [hex(c) for c in codes.copy_to_host()]  # 1e9 saturates; 2**-10 is a tie, to 0
['0x38', '0xaa', '0x7e', '0x7e', '0x0', '0x1']
>>> back.copy_to_host().tolist()
[1.0, -0.3125, 448.0, 448.0, 0.0, 0.001953125]
"""
import functools

import numpy as np
from numba import config, float32, types

from .convert import _round_to_bf16_bits, bf16_bits_to_f32, device_function, f32_bits

# name: (mantissa bits, exponent bias, largest finite code, NaN code, largest finite value,
#        has inf)
FORMATS = {
    "float8_e4m3fn": (3, 7, 0x7E, 0x7F, 448.0, False),
    "float8_e5m2": (2, 15, 0x7B, 0x7E, 57344.0, True),
}


def _format(fmt):
    fmt = getattr(fmt, "name", fmt)
    if fmt not in FORMATS:
        raise ValueError(f"no fp8 conversion for {fmt!r}; supported: {tuple(FORMATS)}")
    return FORMATS[fmt]


if config.ENABLE_CUDASIM:

    def f32_from_bits(u):
        """The float32 whose bits are the low 32 bits of ``u``."""
        return np.uint32(int(u) & 0xFFFFFFFF).view(np.float32)

    def load_words(arr, flat):
        """Four little-endian 32-bit words: the 16 bytes of ``arr`` from flat index ``flat``."""
        from .vector import _host_flat

        w = _host_flat(arr)[flat:flat + 16].view(np.uint32)
        return int(w[0]), int(w[1]), int(w[2]), int(w[3])

    def to_f32_any(x):
        """float32 of a query element: bf16 bits (``uint16``) or an fp16/fp32 value."""
        if isinstance(x, np.uint16):
            return bf16_bits_to_f32(x)
        return np.float32(x)

    def store_as(x, arr):
        """float32 ``x`` as an element of ``arr``: bf16 bits (rounded to nearest
        even) for a ``uint16`` array, else ``x`` (rounded by the store)."""
        if arr.dtype == np.uint16:
            return np.uint16(_round_to_bf16_bits(int(np.float32(x).view(np.uint32))))
        return x

else:
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    _I32 = ir.IntType(32)

    @intrinsic
    def f32_from_bits(typingctx, u):
        if not isinstance(u, types.Integer):
            return None

        def codegen(context, builder, sig, args):
            x = args[0]
            if u.bitwidth < 32:
                x = builder.zext(x, _I32)
            elif u.bitwidth > 32:
                x = builder.trunc(x, _I32)
            return builder.bitcast(x, ir.FloatType())

        return types.float32(u), codegen

    @intrinsic
    def load_words(typingctx, arr, flat):
        if not (isinstance(arr, types.Array) and arr.dtype == types.uint8):
            return None
        sig = types.UniTuple(types.uint32, 4)(arr, flat)

        def codegen(context, builder, sig, args):
            arr_ty, flat_ty = sig.args
            a = context.make_array(arr_ty)(context, builder, args[0])
            i = context.cast(builder, args[1], flat_ty, types.intp)
            ptr = builder.bitcast(builder.gep(a.data, [i]), ir.VectorType(_I32, 4).as_pointer())
            vec = builder.load(ptr, align=16)
            words = [builder.extract_element(vec, ir.Constant(_I32, e)) for e in range(4)]
            return context.make_tuple(builder, sig.return_type, words)

        return sig, codegen

    @intrinsic
    def to_f32_any(typingctx, x):
        if x == types.uint16:
            def codegen(context, builder, sig, args):
                b = builder.shl(builder.zext(args[0], _I32), ir.Constant(_I32, 16))
                return builder.bitcast(b, ir.FloatType())
        elif isinstance(x, types.Float):
            def codegen(context, builder, sig, args):
                return context.cast(builder, args[0], x, types.float32)
        else:
            return None
        return types.float32(x), codegen

    @intrinsic
    def store_as(typingctx, x, arr):
        if not (isinstance(arr, types.Array) and isinstance(x, types.Float)
                and (arr.dtype == types.uint16 or isinstance(arr.dtype, types.Float))):
            return None
        dt = arr.dtype

        def codegen(context, builder, sig, args):
            f = context.cast(builder, args[0], x, types.float32)
            if dt != types.uint16:
                return context.cast(builder, f, types.float32, dt)
            # bf16 bits, nearest even; NaN -> quiet NaN of the same sign (convert.py's rule)
            b = builder.bitcast(f, _I32)
            hi = builder.lshr(b, ir.Constant(_I32, 16))
            r = builder.add(builder.add(b, ir.Constant(_I32, 0x7FFF)),
                            builder.and_(hi, ir.Constant(_I32, 1)))
            r = builder.lshr(r, ir.Constant(_I32, 16))
            nan = builder.or_(builder.and_(hi, ir.Constant(_I32, 0x8000)), ir.Constant(_I32, 0x7FC0))
            is_nan = builder.fcmp_unordered("uno", f, f)
            return builder.trunc(builder.select(is_nan, nan, r), ir.IntType(16))

        return dt(x, arr), codegen


@functools.cache
def encoder(fmt):
    """Device function ``encode(x)``: float32 ``x`` -> the code of the nearest
    ``fmt`` value (ties to even), saturating at the largest finite value
    (``+-inf`` included), NaN kept with its sign."""
    M, B, MAX_CODE, NAN, MAX, _ = _format(fmt)
    S = 23 - M
    HALF = (1 << (S - 1)) - 1
    REBIAS = (127 - B) << 23
    MAX_BITS = int(np.float32(MAX).view(np.uint32))
    MIN_NORMAL_E = 127 - B + 1              # float32 exponent of the smallest fp8 normal
    SUB_SHIFT = 151 - B - M

    @device_function
    def encode(x):
        b = f32_bits(x)
        sign = (b >> 24) & 0x80
        a = b & 0x7FFFFFFF
        if a > 0x7F800000:
            return sign | NAN
        if a >= MAX_BITS:
            return sign | MAX_CODE
        e = a >> 23
        if e >= MIN_NORMAL_E:
            r = a - REBIAS
            return sign | ((r + HALF + ((r >> S) & 1)) >> S)
        s = SUB_SHIFT - e
        if s > 24:
            return sign
        m = (a & 0x7FFFFF) | 0x800000
        return sign | ((m + (1 << (s - 1)) - 1 + ((m >> s) & 1)) >> s)

    return encode


@functools.cache
def decoder(fmt):
    """Device function ``decode(code)``: the float32 value of an ``fmt`` code
    (an integer whose low 8 bits are read), exactly."""
    M, B, _, NAN, _, HAS_INF = _format(fmt)
    SPECIAL = (0x7C if HAS_INF else 0x7F)   # first code (without sign) that is inf or NaN
    SUB_UNIT = float32(2.0 ** (1 - B - M))
    REBIAS = (127 - B) << 23
    LOW = 1 << M                            # first code of a normal

    @device_function
    def decode(c):
        c = int(c) & 0xFF
        em = c & 0x7F
        if em < LOW:
            x = float32(em) * SUB_UNIT
        else:
            if em >= SPECIAL:
                bits = 0x7F800000 if (HAS_INF and em == SPECIAL) else 0x7FC00000
            else:
                bits = (em << (23 - M)) + REBIAS
            x = f32_from_bits(bits)
        return -x if c >= 0x80 else x

    return decode


@functools.cache
def decode_table(fmt):
    """float32 ``[256]``: ``decoder(fmt)`` of every code (the simulator's lookup
    table; on a GPU the decoder runs in a kernel)."""
    dec = decoder(fmt)
    if config.ENABLE_CUDASIM:
        return np.array([dec(c) for c in range(256)], np.float32)
    from numba import cuda

    @cuda.jit
    def every_code(out):
        c = cuda.grid(1)
        if c < 256:
            out[c] = dec(c)

    out = cuda.device_array(256, np.float32)
    every_code[1, 256](out)
    return out.copy_to_host()


@functools.cache
def load16_fp8(fmt):
    """Device function ``load(arr, flat, out, out_off)``: the 16 ``fmt`` codes
    of ``uint8`` array ``arr`` from flat index ``flat`` (16-byte aligned) as
    float32 in ``out[out_off:out_off + 16]``."""
    if config.ENABLE_CUDASIM:
        from .vector import _host_flat

        table = decode_table(fmt)

        def load(arr, flat, out, out_off):
            vals = table[_host_flat(arr)[flat:flat + 16]]
            for e in range(16):
                out[out_off + e] = vals[e]
        return load

    dec = decoder(fmt)

    @device_function
    def load(arr, flat, out, out_off):
        w = load_words(arr, flat)
        for i in range(4):
            word = w[i]
            for j in range(4):
                out[out_off + 4 * i + j] = dec((word >> (8 * j)) & 0xFF)

    return load


@functools.cache
def element_decoder(fmt):
    """Device function ``to_f32(code)`` for single elements: the decoder on the
    GPU, the lookup table under the simulator (same values, less Python)."""
    if config.ENABLE_CUDASIM:
        table = decode_table(fmt)

        def to_f32(c):
            return table[c]
        return to_f32
    return decoder(fmt)


@functools.cache
def fp8_vector_accessors(layout, fmt):
    """``(k_vec, v_vec)`` as :func:`kernels.access.vector_accessors` gives them,
    for ``uint8`` pools of ``fmt`` codes: ``k_vec(key_cache, blk, kv_head,
    offset, v, out, out_off)`` writes the float32 values of codes ``16 v ...
    16 v + 15`` of a token's key row to ``out[out_off:out_off + 16]`` (one
    16-byte load); ``v_vec`` the same for values (code by code in
    ``"vllm"``, whose value rows are strided by ``block_size``)."""
    from .access import element_accessors, vector_offsets

    load = load16_fp8(fmt)
    to_f32 = element_decoder(fmt)
    _, v_at, _, _ = element_accessors(layout, 16)
    k_flat, v_flat = vector_offsets(layout, 16)

    @device_function
    def k_vec(kc, blk, h, off, v, out, o):
        load(kc, k_flat(kc, blk, h, off, v), out, o)

    if v_flat is not None:

        @device_function
        def v_vec(vc, blk, h, off, v, out, o):
            load(vc, v_flat(vc, blk, h, off, v), out, o)

    else:

        @device_function
        def v_vec(vc, blk, h, off, v, out, o):
            for e in range(16):
                out[o + e] = to_f32(v_at(vc, blk, h, off, v * 16 + e))

    return k_vec, v_vec


__all__ = ["FORMATS", "decode_table", "decoder", "element_decoder", "encoder", "f32_from_bits",
           "fp8_vector_accessors",
           "load16_fp8", "load_words", "store_as", "to_f32_any"]
