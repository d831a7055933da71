"""Checks of scalar and integer-array arguments, shared by every public function.

Plain Python and NumPy (no numba), so that the host-only modules
(``allocator``, ``page_tables``, ``layouts``) can use them when they are
loaded on their own by file path.

The rules:

* an integer argument is a Python ``int`` or a NumPy integer, never a
  ``bool``, a float (not even ``2.0``), ``None`` or a string; its range is
  checked before it is narrowed to int32 for a kernel;
* a flag is ``True`` or ``False`` (Python or NumPy bools), nothing else;
* a float argument is a real number, finite, and small enough that the
  kernels' float32 arithmetic (base-2 logits: the value times ``log2(e)``)
  does not overflow;
* an integer array holds an integer dtype (not bool) and every entry lies in
  the range of what it becomes (int32 for kernel arguments), checked on the
  original values, before any cast can wrap them.

Every failure is a ``ValueError`` whose message names the argument and the
value (and, for arrays, the index of the first bad entry).

>>> integer("num_tokens", 3, lo=0)
3
>>> integer("num_tokens", 2.7, lo=0)
Traceback (most recent call last):
    ...
ValueError: num_tokens must be an integer, but got 2.7 (float).
>>> int_array("seq_lens", np.array([5, 4294967299]))
Traceback (most recent call last):
    ...
ValueError: seq_lens[1] is 4294967299, outside [-2147483648, 2147483647] (int32).
"""
import math
import reprlib
from collections.abc import Hashable

import numpy as np

INT32_MIN = -2**31
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)
LOG2E = 1.4426950408889634
# the kernels multiply scale, soft cap and ALiBi slopes by log2(e) in float32
KERNEL_FLOAT_MAX = FLOAT32_MAX / LOG2E


def _is_int(value):
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))




def integer(name, value, lo=None, hi=None):
    """``value`` as a Python int, after checking that it is an integer (not a
    bool, float, None or string) in ``[lo, hi]`` (``None``: unbounded). The
    message for a value below ``lo`` says "a positive integer" when ``lo``
    is 1, else ">= lo"; above ``hi``, "at most hi".

    Parameters
    ----------
    name : str
        The argument's name, for the message.
    value : object
    lo, hi : int, optional
        Inclusive bounds.

    Returns
    -------
    int

    Examples
    --------
    >>> integer("num_warps", np.int64(4), lo=1)
    4
    >>> integer("max_blocks", -3, lo=0)
    Traceback (most recent call last):
        ...
    ValueError: max_blocks must be >= 0, but got -3.
    >>> integer("num_seqs", True, lo=0)
    Traceback (most recent call last):
        ...
    ValueError: num_seqs must be an integer, but got True (bool).
    """
    if not _is_int(value):
        raise ValueError(f"{name} must be an integer, but got {value!r} "
                         f"({type(value).__name__}).")
    v = int(value)
    if lo is not None and v < lo:
        raise ValueError(f"{name} must be {'a positive integer' if lo == 1 else f'>= {lo}'}, "
                         f"but got {v}.")
    if hi is not None and v > hi:
        raise ValueError(f"{name} must be at most {hi}, but got {v}.")
    return v


def power_of_two(name, value, hi):
    """``value`` as an int, after checking that it is a power of two in ``[1, hi]``.

    >>> power_of_two("num_warps", 8, hi=32)
    8
    >>> power_of_two("num_warps", 3, hi=32)
    Traceback (most recent call last):
        ...
    ValueError: num_warps must be a power of two in [1, 32], but got 3.
    """
    v = integer(name, value)
    if not 1 <= v <= hi or v & (v - 1):
        raise ValueError(f"{name} must be a power of two in [1, {hi}], but got {v}.")
    return v


def flag(name, value):
    """``value`` as a bool, after checking that it is ``True`` or ``False``.

    >>> flag("causal", np.bool_(False))
    False
    >>> flag("causal", None)
    Traceback (most recent call last):
        ...
    ValueError: causal must be True or False, but got None (NoneType).
    """
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False, but got {value!r} "
                         f"({type(value).__name__}).")
    return bool(value)


def optional_flag(name, value):
    """``None``, or ``value`` as a bool after :func:`flag`'s check."""
    if value is None:
        return None
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be None, True or False, but got {value!r} "
                         f"({type(value).__name__}).")
    return bool(value)


def real(name, value, positive=False, limit=KERNEL_FLOAT_MAX):
    """``value`` as a float, after checking that it is a real number (not a
    bool or string), finite, at most ``limit`` in magnitude, and with
    ``positive`` greater than 0 also once rounded to float32.

    The default ``limit`` is the largest magnitude whose product with
    ``log2(e)`` is finite in float32 (the kernels' base-2 logits).

    Examples
    --------
    >>> real("scale", 0.125)
    0.125
    >>> real("scale", 1e39)
    Traceback (most recent call last):
        ...
    ValueError: scale must be at most 2.359e+38 in magnitude (the kernels compute in float32), but got 1e+39.
    >>> real("logits_soft_cap", 1e-46, positive=True)
    Traceback (most recent call last):
        ...
    ValueError: logits_soft_cap must be a positive number, but got 1e-46, which is 0 in float32.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer,
                                                                      np.floating)):
        raise ValueError(f"{name} must be a real number, but got {value!r} "
                         f"({type(value).__name__}).")
    try:
        x = float(value)
    except OverflowError:            # a Python int past the float range
        x = math.inf
    if math.isnan(x) or (math.isinf(x) and not isinstance(value, (int, np.integer))):
        raise ValueError(f"{name} must be finite, but got {value!r}.")
    if abs(x) > limit:
        shown = f"{x:.4g}" if math.isfinite(x) else reprlib.repr(value)   # (a huge int)
        raise ValueError(f"{name} must be at most {limit:.4g} in magnitude (the kernels compute "
                         f"in float32), but got {shown}.")
    if positive and not x > 0:
        raise ValueError(f"{name} must be a positive number, but got {value!r}.")
    if positive and not np.float32(x) > 0:
        raise ValueError(f"{name} must be a positive number, but got {value!r}, which is 0 in "
                         f"float32.")
    return x


def hashable(name, value):
    """``value``, after checking that it can be a dict key (a sequence id).

    >>> hashable("seq_id", [1, 2])
    Traceback (most recent call last):
        ...
    ValueError: seq_id must be hashable, but got [1, 2] (list).
    """
    if not isinstance(value, Hashable):
        raise ValueError(f"{name} must be hashable, but got {value!r} ({type(value).__name__}).")
    try:
        hash(value)
    except TypeError:                # e.g. a tuple holding a list
        raise ValueError(f"{name} must be hashable, but got {value!r} "
                         f"({type(value).__name__}).") from None
    return value


def int_sequence(name, x):
    """A Python list or tuple of integers (nested lists for a table: rows of one
    length) as a NumPy int64 array, after checking that every entry is an
    integer (not a bool, float, string or None) within int64; a bare ``[]``
    counts. Raises ``ValueError`` naming ``name`` and the first bad entry.

    >>> int_sequence("seq_lens", (5, np.int32(3)))
    array([5, 3])
    >>> int_sequence("block_tables", [[0, 1], [2]])
    Traceback (most recent call last):
        ...
    ValueError: block_tables must be a list of integers or of rows of one length, but got a ragged list: [[0, 1], [2]].
    >>> int_sequence("seq_lens", [5, True])
    Traceback (most recent call last):
        ...
    ValueError: seq_lens[1] must be an integer, but got True (bool).
    """
    try:
        a = np.array(x, dtype=object)
    except ValueError:               # rows whose own rows differ in length
        a = None
    if a is None or any(isinstance(v, (list, tuple, np.ndarray)) for v in a.reshape(-1)):
        raise ValueError(f"{name} must be a list of integers or of rows of one length, but got "
                         f"a ragged list: {reprlib.repr(x)}.")
    for index, v in np.ndenumerate(a):
        if not _is_int(v):
            raise ValueError(f"{name}[{', '.join(map(str, index))}] must be an integer, but got "
                             f"{v!r} ({type(v).__name__}).")
        if not INT64_MIN <= v <= INT64_MAX:
            raise ValueError(f"{name}[{', '.join(map(str, index))}] is {int(v)}, outside "
                             f"[{INT64_MIN}, {INT64_MAX}] (int64).")
    return a.astype(np.int64)


def int_array(name, x, ndim=None, lo=INT32_MIN, hi=INT32_MAX, dtype=np.int32, what="int32"):
    """Host array ``x`` (anything ``numpy.asarray`` takes) as ``dtype``, after
    checking that it holds integers (a bare ``[]`` counts) with ``ndim``
    dimensions (None: any) and entries in ``[lo, hi]``. The entries are
    compared in their own dtype, so nothing wraps before the check (a
    uint64 ``2**64 - 1`` is not taken for ``-1``).

    Parameters
    ----------
    name : str
    x : array of int, or list or tuple of ints (nested: rows of one length)
        Lists and tuples go through :func:`int_sequence` first.
    ndim : int, optional
    lo, hi : int
        Inclusive bounds (default: the int32 range).
    dtype : numpy dtype
        What the result is cast to.
    what : str
        Describes the bounds in the message.

    Returns
    -------
    numpy.ndarray of ``dtype``, ``x``'s shape

    Examples
    --------
    >>> int_array("slot_mapping", np.array([3, 2**64 - 1], np.uint64), lo=-1, hi=31,
    ...           dtype=np.int64, what="slots of the cache, -1 for padding")
    Traceback (most recent call last):
        ...
    ValueError: slot_mapping[1] is 18446744073709551615, outside [-1, 31] (slots of the cache, -1 for padding).
    """
    a = int_sequence(name, x) if isinstance(x, (list, tuple)) else np.asarray(x)
    if a.dtype == np.bool_ or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"{name} must hold integers, but got dtype {a.dtype.name}.")
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimension{'s' * (ndim != 1)}, but got shape "
                         f"{a.shape}.")
    if a.size:
        bad = np.flatnonzero(((a < lo) | (a > hi)).reshape(-1))
        if bad.size:
            index = np.unravel_index(int(bad[0]), a.shape)
            where = f"[{', '.join(str(int(i)) for i in index)}]" if a.ndim else ""
            raise ValueError(f"{name}{where} is {int(a[index])}, outside [{lo}, {hi}] ({what}).")
    return a.astype(dtype)
