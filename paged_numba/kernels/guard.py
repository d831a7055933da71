"""The device-side guard: what a kernel does with an index it was given that
would take it outside its buffers, when the caller skipped validation.

The kernel does not follow the index (it skips the write, or reads
something that is in bounds instead) and records the first offence in the
cache's error word, ``errors [4]`` int64::

    errors = [code, where, entry, value]

``code`` names the kind (below), ``where`` the token or sequence, ``entry``
the index into the argument, ``value`` what was there. The first offence
wins (a compare-and-swap on ``code``); the host reads the word when asked
(:meth:`paged_numba.PagedKVCache.check`).
"""
from numba import config, cuda, int32, int64, uint32

from .convert import device_function

#: ``write_kv``: ``slot_mapping[entry]`` (token ``where = entry``) is ``value``,
#: neither -1 (padding) nor a slot of the pool; that token is not written
SLOT = 1
#: a table lookup: ``block_tables[where, entry]`` is ``value``, not a block of the
#: pool; the kernel reads block 0 instead (sequence ``where``'s output is wrong)
BLOCK = 2
#: ``seq_lens[where]`` (``entry = where``) is ``value``, negative or more tokens
#: than the table's row holds; the kernel takes it as 0 or as the row's capacity
SEQ_LEN = 3
WORDS = 4


@device_function
def offend(errors, code, where, entry, value):
    """Record an offence in ``errors`` unless one is already there."""
    if cuda.atomic.cas(errors, 0, int64(0), int64(code)) == 0:
        errors[1] = int64(where)
        errors[2] = int64(entry)
        errors[3] = int64(value)


if config.ENABLE_CUDASIM:
    def outside(x, n):
        """Whether ``x`` is outside ``[0, n)`` (``n >= 0``); under the simulator
        as two Python compares (its ``uint32`` casts cost microseconds)."""
        return x < 0 or x >= n
else:
    @device_function
    def outside(x, n):
        """Whether ``x`` is outside ``[0, n)`` (``n >= 0``): one unsigned compare."""
        return uint32(x) >= uint32(n)


@device_function
def block_of(block_tables, errors, seq, b, num_blocks):
    """``block_tables[seq, b]`` if it is a block of the pool (``[0,
    num_blocks)``); else 0, the offence recorded."""
    blk = block_tables[seq, b]
    if outside(blk, num_blocks):
        offend(errors, BLOCK, seq, b, blk)
        blk = int32(0)
    return blk


@device_function
def checked_block(block_tables, seq, b, num_blocks, bad):
    """``(block, bad)``: ``block_tables[seq, b]`` if it is a block of the pool,
    else 0 and ``bad = b`` (``bad`` as given otherwise). Selects, no branch:
    a loop of gathers can issue all its table loads at once and record an
    offence after its copies (:func:`record_block`), where a branch with a
    store to ``errors`` after each load would make the loads wait in turn."""
    blk = block_tables[seq, b]
    out = outside(blk, num_blocks)
    return (int32(0) if out else blk), (int32(b) if out else bad)


@device_function
def record_block(block_tables, errors, seq, bad):
    """Record the offence :func:`checked_block` found at entry ``bad`` (if
    ``bad >= 0``)."""
    if bad >= 0:
        offend(errors, BLOCK, seq, bad, block_tables[seq, bad])


@device_function
def length_of(seq_lens, errors, seq, cap):
    """``seq_lens[seq]`` clamped into ``[0, cap]`` (``cap``: the tokens a table
    row holds), the offence recorded where it had to be."""
    return clamped_length(seq_lens[seq], errors, seq, cap)


@device_function
def clamped_length(n, errors, seq, cap):
    """:func:`length_of` of a length ``n`` already read from ``seq_lens[seq]``."""
    if outside(n, cap + 1):
        offend(errors, SEQ_LEN, seq, seq, n)
        n = int32(0) if n < 0 else int32(cap)
    return n


@device_function
def checked_unchecked(block_tables, seq, b, num_blocks, bad):
    """``(block_tables[seq, b], bad)`` as they are: :func:`checked_block`
    without the guard, for kernels built with ``guard=False`` to time what the
    guard costs (an id outside the pool is then followed outside it)."""
    return block_tables[seq, b], bad


@device_function
def record_nothing(block_tables, errors, seq, bad):
    """:func:`record_block` without the guard."""


@device_function
def clamped_unchecked(n, errors, seq, cap):
    """``n`` as it is: :func:`clamped_length` without the guard (see
    :func:`checked_unchecked`)."""
    return n


@device_function
def length_unchecked(seq_lens, errors, seq, cap):
    """``seq_lens[seq]`` as it is: :func:`length_of` without the guard (see
    :func:`checked_unchecked`)."""
    return seq_lens[seq]


@device_function
def block_unchecked(block_tables, errors, seq, b, num_blocks):
    """``block_tables[seq, b]`` as it is: :func:`block_of` without the guard."""
    return block_tables[seq, b]


@device_function
def outside_unchecked(x, n):
    """False: :func:`outside` without the guard (every id taken as in the pool)."""
    return False
