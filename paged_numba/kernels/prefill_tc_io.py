"""The query copies and the output stores of the tensor-core prefill tile:
the part of :func:`kernels.prefill_tc_parts.tile_parts` that moves a tile's
queries into shared memory and its outputs out.

:func:`query_parts` takes the namespace of one tile specialisation (its
constants and layout functions) and returns the device functions; the
fragment conventions are those of :mod:`.prefill_tc_parts`.
"""
import math
from types import SimpleNamespace

from numba import cuda, float32, uint16, uint32

from .access import device_function
from .async_copy import copy16_async
from .convert import device_jit
from .mma import stmatrix_x4
from .vector import copy16
from .wgmma import opaque

NEG_INF = float32(-math.inf)
LN2 = 0.6931471805599453


def cuda_function(fn):
    """An inlined device function that uses the ``cuda`` module (warp votes,
    block indices): under the simulator a device function proper, whose call
    gives the calling module the simulated ``cuda`` as well."""
    return device_jit(fn)


def query_parts(P):
    """Device functions that copy queries in and store outputs for the tile of
    namespace ``P`` (:func:`kernels.prefill_tc_parts.tile_parts`' constants:
    ``D``, ``HPB``, ``MT``, ``NT``, ``NCH``, ``SWZ``, ``Q_OFF``, ``QCHUNKS``,
    ``QCPT``, ``NTILE_O``, ``SPLIT``, ``BF16``; its ``slot``, ``row_of``,
    ``chunk_of``, ``quad_sum``, ``pack`` and ``from_f32``)."""
    D, HPB, MT, NT, NCH, SWZ = P.D, P.HPB, P.MT, P.NT, P.NCH, P.SWZ
    Q_OFF, QCHUNKS, QCPT, NTILE_O, SPLIT, BF16 = (P.Q_OFF, P.QCHUNKS, P.QCPT, P.NTILE_O,
                                                  P.SPLIT, P.BF16)
    slot, row_of, chunk_of = P.slot, P.row_of, P.chunk_of
    quad_sum, pack, from_f32 = P.quad_sum, P.pack, P.from_f32

    @cuda_function
    def store_half(out, lse, o, m, l_, sc, warp, r, c, nq, row0, q0, h0, t, h):
        """Epilogue of row half ``h`` of m-tile ``t``: ``out = O / l`` in the
        output dtype and ``lse = (m + log2 l) ln 2``, for rows of a valid query."""
        rr = 16 * (MT * warp + t) + r + 8 * h
        lsum = quad_sum(l_[t, h])
        inv = float32(0.0)
        if lsum != 0.0:
            inv = float32(1.0) / lsum
        if rr // HPB < nq:
            row = row0 + q0 + rr // HPB
            head = h0 + rr % HPB
            part = cuda.blockIdx.z
            for i in range(NTILE_O):
                d = 8 * i + 2 * c
                if SPLIT:
                    out[row, part, head, d] = o[t, i, 2 * h] * inv
                    out[row, part, head, d + 1] = o[t, i, 2 * h + 1] * inv
                elif BF16:      # one conversion a pair, rounded to nearest even
                    w = pack(o[t, i, 2 * h] * inv, o[t, i, 2 * h + 1] * inv)
                    out[row, head, d] = uint16(w & 0xFFFF)
                    out[row, head, d + 1] = uint16(w >> 16)
                else:
                    out[row, head, d] = from_f32(o[t, i, 2 * h] * inv)
                    out[row, head, d + 1] = from_f32(o[t, i, 2 * h + 1] * inv)
            if c == 0:
                x = NEG_INF
                if lsum != 0.0:
                    x = (m[t, h] * sc + math.log2(lsum)) * float32(LN2)
                if SPLIT:
                    lse[row, part, head] = x
                else:
                    lse[row, head] = x


    @device_function
    def load_query_chunk_at(sm, qbase, query, idx, row0, q0, nq, h0, num_heads):
        """Start copying the tile's ``idx``-th query chunk into the query rows
        at flat ``qbase`` of shared memory (rows past ``nq`` repeat the last
        query). ``idx`` and ``qbase`` are taken as unsigned: the compiler then
        knows them non-negative, and the divisions by the tile's powers of two
        are shifts and masks (signed, each took a sign fix-up)."""
        idx = uint32(idx)
        qbase = uint32(qbase)
        row = row_of(idx)
        ch = chunk_of(idx)
        qi = min(row // HPB, nq - 1)
        src = ((row0 + q0 + qi) * num_heads + h0 + row % HPB) * D + ch * 8
        copy16_async(sm, slot(qbase, row, ch), query, src)

    @device_function
    def load_query_chunk(sm, query, idx, row0, q0, nq, h0, num_heads):
        """Start copying the tile's ``idx``-th query chunk into shared memory."""
        load_query_chunk_at(sm, Q_OFF, query, idx, row0, q0, nq, h0, num_heads)

    @device_function
    def load_queries(sm, query, tid, row0, q0, nq, h0, num_heads):
        """Start copying the tile's queries into shared memory."""
        for u in range(QCPT):
            idx = tid + u * NT
            if QCHUNKS % NT == 0 or idx < QCHUNKS:
                load_query_chunk(sm, query, idx, row0, q0, nq, h0, num_heads)

    WG_QCHUNKS = 64 * NCH                 # query chunks of a warpgroup's 64 rows

    @device_function
    def load_warpgroup_queries(sm, query, t, wg, row0, q0, nq, h0, num_heads):
        """Start copying the queries of warpgroup ``wg``'s rows (``64 wg ..
        64 wg + 63``), thread ``t`` of its 128 (the chunks lie in row order in
        every layout, 8 rows at a time)."""
        for u in range(-(-WG_QCHUNKS // 128)):
            idx = t + u * 128
            if WG_QCHUNKS % 128 == 0 or idx < WG_QCHUNKS:
                load_query_chunk(sm, query, wg * WG_QCHUNKS + idx, row0, q0, nq, h0, num_heads)

    WARP_QCHUNKS = 16 * NCH               # query chunks of a warp's 16 rows

    @device_function
    def load_warp_queries(sm, qbase, query, lane, warp, row0, q0, nq, h0, num_heads):
        """Start copying the queries of warp ``warp``'s 16 rows (``16 warp ..
        16 warp + 15``) into the query rows at flat ``qbase`` (``Q_OFF``, or a
        second buffer laid out alike), lane ``lane`` of its 32: the chunks of
        :func:`load_warpgroup_queries`, but each warp writes only the rows it
        owns, so that it can reuse them (:func:`store_staged`) with no barrier
        but its own."""
        for u in range(-(-WARP_QCHUNKS // 32)):
            idx = lane + u * 32
            if WARP_QCHUNKS % 32 == 0 or idx < WARP_QCHUNKS:
                load_query_chunk_at(sm, qbase, query, warp * WARP_QCHUNKS + idx, row0, q0, nq,
                                    h0, num_heads)

    @cuda_function
    def stage_rows(lse, o, m, l_, sc, warp, lane, nq, row0, q0, h0, sm, qbase):
        """The first half of :func:`store_staged`: the rows' ``O / l`` into
        shared memory and their log-sum-exps into ``lse``; the warp then
        synchronises. The rows go out by ``stmatrix``, four 8 x 8 tiles an
        instruction: the halves ``h`` = 0, 1 (rows ``r`` and ``r + 8``) of
        n-tiles ``j`` and ``j + 1``, so that lane ``8 g + e`` names row ``e +
        8 (g % 2)``, at chunk ``j + g // 2`` (swizzled) of it. The lane, warp
        and ``qbase`` are taken as unsigned (see :func:`load_query_chunk_at`)."""
        lane = uint32(lane)
        warp = uint32(warp)
        qbase = uint32(qbase)
        r = lane // 4
        c = lane % 4
        g = lane // 8
        i = lane % 8 + 8 * (g % 2)          # the staged row this lane names
        row = qbase + 16 * warp * D + i * D
        sw = i & SWZ
        half = g // 2
        inv0 = float32(0.0)
        inv1 = float32(0.0)
        for h in range(2):
            lsum = quad_sum(l_[0, h])
            inv = float32(0.0)
            if lsum != 0.0:
                inv = float32(1.0) / lsum
            if h == 0:
                inv0 = inv
            else:
                inv1 = inv
            rr = 16 * warp + r + 8 * h
            if c == 0 and rr // HPB < nq:
                x = NEG_INF
                if lsum != 0.0:
                    x = (m[0, h] * sc + math.log2(lsum)) * float32(LN2)
                lse[row0 + q0 + rr // HPB, h0 + rr % HPB] = x
        for j in range(0, NTILE_O, 2):
            stmatrix_x4(sm, row + ((j + half) ^ sw) * 8,
                        pack(o[0, j, 0] * inv0, o[0, j, 1] * inv0),
                        pack(o[0, j, 2] * inv1, o[0, j, 3] * inv1),
                        pack(o[0, j + 1, 0] * inv0, o[0, j + 1, 1] * inv0),
                        pack(o[0, j + 1, 2] * inv1, o[0, j + 1, 3] * inv1))
        cuda.syncwarp()

    @device_function
    def store_chunk(out, sm, qbase, warp, idx, nq, row0, q0, h0):
        """The second half of :func:`store_staged` where its rows are not
        regular, and the deferred stores: chunk ``idx`` (of ``WARP_QCHUNKS``)
        of warp ``warp``'s staged rows at flat ``qbase`` into ``out``, if its
        row is one of the ``nq`` tokens (unsigned indices, as in
        :func:`load_query_chunk_at`)."""
        idx = uint32(idx)
        warp = uint32(warp)
        qbase = uint32(qbase)
        i = idx // NCH
        ch = idx % NCH
        rr = 16 * warp + i
        if rr // HPB < nq:
            copy16(sm, qbase + 16 * warp * D + i * D + (ch ^ (i & SWZ)) * 8, out,
                   ((row0 + q0 + rr // HPB) * out.shape[1] + h0 + rr % HPB) * D + ch * 8)

    # the lanes store ROW_STEP whole staged rows a step; where that is a power
    # of two (``NCH`` divides 32), a lane's later rows are its first plus
    # constants: ``ROW_STEP u`` rows on, the token ``ROW_STEP u // HPB`` on and
    # the head ``ROW_STEP u % HPB`` on (a step stays within the warp's 16 rows
    # and never carries into the next token), and the chunk's swizzle XORed
    # with ``ROW_STEP u & SWZ`` (the first row's bits lie below ROW_STEP's)
    REGULAR = 32 % NCH == 0
    ROW_STEP = 32 // NCH if REGULAR else 0

    @cuda_function
    def store_staged(out, lse, o, m, l_, sc, warp, lane, nq, row0, q0, h0, sm, qbase):
        """Epilogue of warp ``warp``'s 16 rows (one m-tile, not split) through
        its query rows in shared memory (elements ``qbase + 16 warp D .. qbase +
        16 (warp + 1) D`` in every layout), which its products must be done
        with: the warp rounds ``O / l`` as :func:`store_half` does and writes
        it there by ``stmatrix`` (:func:`stage_rows`); after the warp
        synchronises, each lane stores 16-byte chunks of whole output rows
        (``NCH`` lanes a row), where :func:`store_half` stores 2-byte elements,
        8 rows an instruction, at offsets from the lane's first row computed
        once (see ``ROW_STEP``), each behind one compare for a row past the
        item's queries. Chunk ``ch`` of staged row ``i`` lies at
        chunk ``ch ^ (i & SWZ)``, so the 16-byte rows of 8 staged rows fall in
        32 banks. The lane goes through :func:`kernels.wgmma.opaque` first:
        otherwise the compiler hoists the shared-memory offsets, which depend
        on the lane only, out of a persistent block's loop over its items, and
        they spill."""
        lane = opaque(lane)
        stage_rows(lse, o, m, l_, sc, warp, lane, nq, row0, q0, h0, sm, qbase)
        if REGULAR:
            lane = uint32(lane)
            warp = uint32(warp)
            i0 = lane // NCH                # the lane's first staged row, and its chunk
            ch = lane % NCH
            x = ch ^ (i0 & SWZ)
            sh0 = uint32(qbase) + 16 * warp * D + i0 * D
            rr0 = 16 * warp + i0
            t0 = rr0 // HPB
            heads = out.shape[1]
            o0 = ((row0 + q0 + t0) * heads + h0 + rr0 % HPB) * D + ch * 8
            for u in range(WARP_QCHUNKS // 32):
                a, b = ROW_STEP * u // HPB, ROW_STEP * u % HPB
                if t0 + a < nq:
                    copy16(sm, sh0 + ROW_STEP * u * D + (x ^ (ROW_STEP * u & SWZ)) * 8, out,
                           o0 + (a * heads + b) * D)
        else:
            for u in range(WARP_QCHUNKS // 32):
                store_chunk(out, sm, qbase, warp, lane + 32 * u, nq, row0, q0, h0)
        cuda.syncwarp()

    return SimpleNamespace(
        WG_QCHUNKS=WG_QCHUNKS, WARP_QCHUNKS=WARP_QCHUNKS, store_half=store_half,
        load_query_chunk_at=load_query_chunk_at, load_query_chunk=load_query_chunk,
        load_queries=load_queries, load_warpgroup_queries=load_warpgroup_queries,
        load_warp_queries=load_warp_queries, store_staged=store_staged, stage_rows=stage_rows,
        store_chunk=store_chunk)
