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
from numba import cuda, int64

from .convert import device_function

#: ``write_kv``: ``slot_mapping[entry]`` (token ``where = entry``) is ``value``,
#: neither -1 (padding) nor a slot of the pool; that token is not written
SLOT = 1
WORDS = 4


@device_function
def offend(errors, code, where, entry, value):
    """Record an offence in ``errors`` unless one is already there."""
    if cuda.atomic.cas(errors, 0, int64(0), int64(code)) == 0:
        errors[1] = int64(where)
        errors[2] = int64(entry)
        errors[3] = int64(value)
