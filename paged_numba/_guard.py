"""Host side of the device guard (:mod:`paged_numba.kernels.guard`): what an
error word says, in words."""
from .kernels import guard as G


def offence_message(word, cache):
    """The message for error word ``word`` (``[code, where, entry, value]``)
    recorded on ``cache``."""
    code, where, entry, value = (int(x) for x in word)
    if code == G.SLOT:
        return (f"write_kv was given slot_mapping[{entry}] = {value} (validate=False), outside "
                f"[0, {cache.num_slots}) (-1 marks padding); that token was not written.")
    return (f"a kernel recorded an offence of kind {code} (at {where}, entry {entry}, value "
            f"{value}).")
