"""The split-K merge done by the last thread block of a work item, inside the
attention kernel (no second launch).

Each of the ``gridDim.z`` parts of a (tile, head block) item stores its
partial state (``part_out [rows, S, H, D]`` float32, ``part_lse [rows, S,
H]``) as before, then takes a ticket from the item's counter in
``tickets``. The block that takes the last ticket merges the item's rows with
the arithmetic of :func:`kernels.merge.merge_kernel`, in the same order, so
its ``out`` and ``lse`` are bit for bit the merge kernel's, and sets the
counter back to 0 for the next launch (a graph replays it). The ordering is
the threadfence reduction's: every thread fences its stores before the
block's ticket, and the last block reads the partial states only after it
holds the last ticket (no earlier read of them can sit in its L1).

The merging block's shared memory is free by then (its products and stores
are done): it holds each row's weights, ``rows x S`` float32, and a flag a
row.
"""
import math
from types import SimpleNamespace

from numba import cuda, float32, int32

from .convert import codec
from .decode import NEG_INF
from .merge import fold_states
from .prefill_tc_io import cuda_function


def merge_tail_bytes(rows, num_parts):
    """Shared memory the merging block uses: a weight a row and part, and a
    flag a row, after one word for the ticket.

    >>> merge_tail_bytes(32, 2)
    388
    """
    return 4 * (1 + rows * num_parts + rows)


def merge_tail_parts(heads_per_block, head_size, num_threads, out_dtype):
    """Device functions of the in-kernel merge for items of ``heads_per_block``
    heads of ``head_size``, in blocks of ``num_threads`` threads (all of them
    call ``merge_tail``), writing ``out`` of ``out_dtype``."""
    HPB, D, NT = heads_per_block, head_size, num_threads
    NW = NT // 32
    _, out_from_f32 = codec(out_dtype)

    @cuda_function
    def merge_tail(part_out, part_lse, out, lse, tickets, words, fw, tid, row0, q0, nq, h0):
        """Called by every thread of the block once its share of the item's
        partial state is stored; ``words`` / ``fw``: the block's dynamic
        shared memory as uint32 / float32; the item's rows are the ``nq``
        queries from ``row0 + q0`` times heads ``h0 .. h0 + HPB - 1``."""
        cuda.threadfence()              # this thread's partial stores, before the ticket
        cuda.syncthreads()
        S = cuda.gridDim.z
        key = cuda.blockIdx.x * cuda.gridDim.y + cuda.blockIdx.y
        if tid == 0:
            words[0] = 1 if cuda.atomic.add(tickets, key, 1) == S - 1 else 0
        cuda.syncthreads()
        if words[0] == 0:
            return
        if tid == 0:
            tickets[key] = 0            # the next launch starts from 0
        cuda.threadfence()
        rows = nq * HPB
        wbase = 1                       # weights [rows, S], then a flag a row
        fbase = 1 + rows * S
        lane = tid % 32
        for r in range(tid // 32, rows, NW):     # a warp a row: the weights
            row = row0 + q0 + r // HPB
            head = h0 + r % HPB
            m, total = fold_states(part_lse, row, head, lane, S)
            mu = m if m != NEG_INF else float32(0.0)
            inv = float32(0.0)
            if total != 0.0:
                inv = float32(1.0) / total
            for k in range(lane, S, 32):
                fw[wbase + r * S + k] = math.exp(float32(part_lse[row, k, head]) - mu) * inv
            if lane == 0:
                words[fbase + r] = 1 if total != 0.0 else 0
                if total != 0.0:
                    lse[row, head] = m + math.log(total)
                else:
                    lse[row, head] = NEG_INF
        cuda.syncthreads()
        for e in range(tid, rows * D, NT):       # the outputs, the parts in order
            r = int32(e // D)
            d = int32(e % D)
            row = row0 + q0 + r // HPB
            head = h0 + r % HPB
            acc = float32(0.0)
            if words[fbase + r] != 0:
                for k in range(S):
                    acc += fw[wbase + r * S + k] * part_out[row, k, head, d]
            out[row, head, d] = out_from_f32(acc)

    return SimpleNamespace(merge_tail=merge_tail)
