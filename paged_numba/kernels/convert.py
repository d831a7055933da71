"""Conversions between a cache/query storage dtype and float32 inside kernels.

``codec(dtype)`` returns device functions ``(to_f32, from_f32)``: ``to_f32(x)``
turns one stored element into float32, ``from_f32(x)`` turns a float32 into
the value to store in an array of ``dtype``. Kernels do all arithmetic in
float32 and go through these two functions at the edges, so a new storage
type only needs a new pair here (and in ``vector.load16``).
"""
import functools

from numba import float32

from .access import device_function

DTYPES = ("float16", "float32")


@functools.cache
def codec(dtype):
    """``(to_f32, from_f32)`` device functions for storage ``dtype`` (a name)."""
    if dtype not in DTYPES:
        raise ValueError(f"no kernel codec for dtype {dtype!r}; supported: {DTYPES}")

    @device_function
    def to_f32(x):
        return float32(x)

    @device_function
    def from_f32(x):
        return x          # numba rounds float32 to the array's float type on store

    return to_f32, from_f32
