"""A timeline of one kernel's work items, for finding where time goes.

A kernel built with ``timeline=True`` (only the persistent producer prefill
kernel, :mod:`.prefill_wgmma_ws`, has the option) has the first thread of
each warpgroup read the GPU's nanosecond clock (``%globaltimer``) at
``STAMPS`` points of each of its block's first ``ROUNDS`` work items, and
write them after the cache's error words::

    errors[WORDS + ((block * ROUNDS + round) * ROLES + role) * STAMPS + k]

``role`` 0 is the producer warpgroup, 1 and 2 the consumer warpgroups.
:data:`POINTS` lists each role's points ``k`` in the order it passes them,
with the name of the phase that ends at each (after the first): the
producer's ``k`` 0 (the item's start), 4 (its registers set up), 1 (its range
read), 2 (its first tile's copies issued), 3 (its last tile's); a consumer's
0, 4 (its range), 5 (its query copies issued), 6 (landed), 1 (the fence
after them), 2 (its products done), 7 (ready to store), 3 (its stores
issued). Points 0-3 are the phases' old bounds (query, keys, store), so
their differences read as before.

``timeline="loop"`` also has the first thread of each consumer warpgroup
read its multiprocessor's cycle counter (``%clock``) around each step of the
steady-state key loop (the lean loop's tiles after an item's first) and sum
the cycles of each step over the item: :data:`LOOP_PHASES`, in loop order,
then the number of tiles summed, written after the stamps::

    errors[WORDS + blocks * ROUNDS * ROLES * STAMPS
           + ((block * ROUNDS + round) * 2 + warpgroup) * LOOP_WORDS + k]

``acquire`` waits for the tile's stage (the producer's copies), ``turn`` for
the other warpgroup's issue of its products, ``issue_s`` issues ``S_j``,
``issue_pv`` rescales O and issues ``P_{j-1} V_{j-1}``, ``scores`` waits for ``S_j``,
``softmax`` computes tile ``j``'s weights, ``pv`` waits for ``P_{j-1}
V_{j-1}``, ``pack`` hands back the stage and packs P (on the simulator the
counter counts microseconds). The counter reads order the code around
them, so the loop is a little slower than without them
(``experiments/timeline_prefill.py`` prints both times).

The caller gives the kernel an error array of :func:`timeline_words` words
(zero filled) instead of the cache's four, and reads it back with
:func:`read_timeline` (and :func:`read_loop_clocks`). A stamp is 0 where
that point was not reached. The timeline is for experiments
(``experiments/timeline_prefill.py``); the kernels built without it are
unchanged.
"""
import time

import numpy as np
from numba import config, int64, types, uint32

from .guard import WORDS

ROUNDS = 64       # items a block records
ROLES = 3         # producer, consumer warpgroup 0, consumer warpgroup 1
STAMPS = 8        # points an item (the producer leaves 5-7 at 0)
# each role's points in order, and the phase that ends at each point after the first
PRODUCER_POINTS = ((0, "start"), (4, "setup"), (1, "range"), (2, "first"), (3, "rest"))
CONSUMER_POINTS = ((0, "start"), (4, "range"), (5, "copy"), (6, "wait"), (1, "fence"),
                   (2, "keys"), (7, "bounds"), (3, "store"))
POINTS = (PRODUCER_POINTS, CONSUMER_POINTS, CONSUMER_POINTS)
# timeline="loop": a consumer warpgroup's cycles in each step of its key loop, and its tiles
LOOP_PHASES = ("acquire", "turn", "issue_s", "issue_pv", "scores", "softmax", "pv", "pack")
LOOP_WORDS = len(LOOP_PHASES) + 1
LOOP_START = LOOP_WORDS         # a tick that only reads the clock (before the first tile)


def timeline_words(blocks):
    """Length of an error array with room for the timeline (stamps and loop
    clocks) of ``blocks`` thread blocks.

    >>> timeline_words(2)
    5380
    """
    return WORDS + blocks * ROUNDS * (ROLES * STAMPS + 2 * LOOP_WORDS)


def read_timeline(errors, blocks):
    """The stamps of a host copy of the error array, ``[blocks, ROUNDS,
    ROLES, STAMPS]`` int64 nanoseconds (0: not reached).

    >>> read_timeline(np.arange(timeline_words(1)), 1)[0, 1, 2]
    array([44, 45, 46, 47, 48, 49, 50, 51])
    """
    errors = np.asarray(errors)
    end = WORDS + blocks * ROUNDS * ROLES * STAMPS
    return errors[WORDS:end].reshape(blocks, ROUNDS, ROLES, STAMPS)


def read_loop_clocks(errors, blocks):
    """The loop clocks of a host copy of the error array (``timeline="loop"``),
    ``[blocks, ROUNDS, 2, LOOP_WORDS]`` int64: each consumer warpgroup's
    cycles in each of :data:`LOOP_PHASES` summed over an item's steady-state
    tiles, then the number of those tiles (0 where none ran).

    >>> read_loop_clocks(np.arange(timeline_words(1)), 1)[0, 1, 0]
    array([1558, 1559, 1560, 1561, 1562, 1563, 1564, 1565, 1566])
    """
    errors = np.asarray(errors)
    start = WORDS + blocks * ROUNDS * ROLES * STAMPS
    return errors[start:timeline_words(blocks)].reshape(blocks, ROUNDS, 2, LOOP_WORDS)


if config.ENABLE_CUDASIM:
    def globaltimer():
        return int64(time.perf_counter_ns())

    def clock32():
        # microseconds: 32 bits of them wrap after 71 minutes, not 4 seconds
        return uint32((time.perf_counter_ns() // 1000) & 0xFFFFFFFF)
else:
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    def _special_register(name, register, bits, doc):
        """An intrinsic ``name()`` reading PTX special register ``register``
        (``bits`` wide) as a volatile asm that code does not move across."""
        def typer(typingctx):
            def codegen(context, builder, sig, args):
                fnty = ir.FunctionType(ir.IntType(bits), [])
                asm = ir.InlineAsm(fnty, f"mov.u{bits} $0, %{register};",
                                   f"={'l' if bits == 64 else 'r'},~{{memory}}",
                                   side_effect=True)
                return builder.call(asm, [])
            return (types.int64 if bits == 64 else types.uint32)(), codegen
        typer.__name__, typer.__doc__ = name, doc
        return intrinsic(typer)

    globaltimer = _special_register("globaltimer", "globaltimer", 64,
                                    "The GPU's clock in nanoseconds, as int64.")
    clock32 = _special_register("clock32", "clock", 32,
                                "The multiprocessor's cycle counter, as uint32.")


__all__ = ["LOOP_PHASES", "LOOP_START", "LOOP_WORDS", "POINTS", "ROLES", "ROUNDS", "STAMPS", "clock32",
           "globaltimer", "read_loop_clocks", "read_timeline", "timeline_words"]
