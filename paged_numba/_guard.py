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
    if code == G.BLOCK:
        return (f"a kernel was given block_tables[{where}, {entry}] = {value} (validate=False), "
                f"outside [0, {cache.num_blocks}); it read block 0 in its place, so sequence "
                f"{where}'s output is wrong.")
    if code == G.SEQ_LEN:
        return (f"a kernel was given seq_lens[{where}] = {value} (validate=False), outside [0, "
                f"the tokens its block_tables row holds]; it took the nearest of those, so "
                f"sequence {where}'s output is wrong.")
    return (f"a kernel recorded an offence of kind {code} (at {where}, entry {entry}, value "
            f"{value}).")
