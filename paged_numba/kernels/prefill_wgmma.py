"""Paged prefill attention with warpgroup products (``wgmma``, sm_90a).

The tile, its arguments, grid and outputs are those of
:func:`kernels.prefill_tc.prefill_tc_kernel` (its gathers, logits, softmax and
epilogue come from :mod:`kernels.prefill_tc_parts`); what differs is how the
two products run and how they overlap:

* each four warps form a *warpgroup* owning 64 rows of the tile (warp ``w``
  rows ``16 w .. 16 w + 15``, as before). ``S = Q K^T`` is ``D / 16``
  ``wgmma.m64nBNk16`` products reading Q and K straight from shared memory;
  ``O += P V`` is ``BN / 16`` ``wgmma.m64nDk16`` products with P in registers
  (the S accumulators rounded to the cache dtype are the A fragments as they
  lie) and V from shared memory (MN-major: no transposing load);
* the tiles sit in shared memory as *core matrices* (rows ``8 i .. 8 i + 7`` of
  16-byte chunk ``ch`` at ``(i * D / 8 + ch) * 128`` bytes), which the
  ``cp.async`` gathers write in address order;
* the loop is software-pipelined across key tiles
  (:mod:`kernels.prefill_key_loop`): iteration ``j`` issues
  ``S_j = Q K_j^T`` and ``O += P_{j-1} V_{j-1}`` back to back, waits for
  ``S_j`` only, computes the softmax of tile ``j`` (maxima, weights, row sums)
  while ``P V`` still runs on the tensor cores, then waits for ``P V`` and
  rounds ``P_j`` into the A registers (which the product in flight was
  reading). O is rescaled to tile ``j``'s maxima in the next iteration, between
  issuing ``S_{j+1}`` and ``P_j V_j``. A three-stage K/V ring keeps tile
  ``j - 1``'s values resident while tile ``j + 1`` is copied in; one barrier a
  tile;
* each operand's start (:func:`kernels.wgmma.matrix_start`) is computed once,
  and a product adds a constant to it; without soft cap or ALiBi (and with a
  positive scale) the scale goes into the exponent's FFMA, as the
  ``mma.sync`` kernel's ``fma_softmax`` does.

The arithmetic of every row is that of the ``mma.sync`` kernel (with
``fma_softmax`` where it applies), up to the
tensor cores' order of accumulation, and the same bound holds
(``testing.prefill_error_bound(tensor_cores=dtype)``).
"""
import functools
from types import SimpleNamespace

from numba import config, cuda, float32, int32, uint32

from . import wgmma as wg
from .access import device_function
from .async_copy import commit_group
from .decode import LOG2E
from .prefill_key_loop import key_loop
from .prefill_tc_parts import FULL_MASK, tile_parts
from .prefill_tc_tiling import supports

STAGES = 3            # K/V tiles in the ring: j - 1 (values), j (keys), j + 1 (in flight)


def wgmma_shared_bytes(head_size, num_warps, block_n):
    """Dynamic shared memory of one block: 16 query rows a warp and a
    three-stage K/V ring, 2 bytes an element.

    >>> wgmma_shared_bytes(128, 8, 64)
    131072
    """
    return 2 * head_size * (16 * num_warps + STAGES * 2 * block_n)


def product_parts(P, q_regs=False, split_rings=False):
    """The products and softmax steps of a warpgroup's loop, for the tile of
    :func:`kernels.prefill_tc_parts.tile_parts` ``P``: ``issue_s``,
    ``issue_pv``, ``tile_weights``, ``pack_p`` and the fences and waits.

    ``q_regs``: ``issue_s(s, qa, kvs, stage)`` takes the queries as register
    A words ``qa [D / 16, 4]`` (``load_q_words`` reads them from the warp's
    query rows), so that shared memory serves only the K tile in ``S = Q
    K^T``; otherwise ``issue_s(s, qs, kvs, stage)`` reads them from shared
    memory at start ``qs``.

    ``split_rings``: ``issue_s`` takes a stage of the K ring and ``issue_pv``
    one of the V ring (:mod:`kernels.prefill_split_ring`), not a stage of
    the joint ring."""
    D, BN, NCH, KSTEPS, PV_STEPS, KV_OFF = P.D, P.BN, P.NCH, P.KSTEPS, P.PV_STEPS, P.KV_OFF
    logits, tile_weights_rows, dtype = P.logits, P.tile_weights_rows, P.dtype
    STAGED, PB, pack_weights = P.STAGED, P.PB, P.pack_weights
    logits_masked = P.logits_masked
    # S: Q and K K-major (next 16-byte chunk 128 bytes on, next 8 rows D * 16);
    # O: P from registers, V MN-major (next 8 keys D * 16 bytes on, next 8 dims 128)
    SPLIT_KV = P.KV_SPLIT
    if P.SWIZZLED:      # atoms of 8 rows x SPAN bytes; a row group (8 rows) 16 D bytes
        SPAN = P.SPAN
        if SPLIT_KV:    # K/V: a column group's rows in turn, 8 SPAN bytes a row group
            mma_s = wg.wgmma_ss(dtype, BN, 16, 16 * D, 16, 8 * SPAN, False, SPAN)
            mma_o = wg.wgmma_rs(dtype, D, BN * SPAN, 8 * SPAN, True, SPAN)
        else:
            mma_s = wg.wgmma_ss(dtype, BN, 16, 16 * D, 16, 16 * D, False, SPAN)
            mma_o = wg.wgmma_rs(dtype, D, 8 * SPAN, 16 * D, True, SPAN)
    else:
        SPAN = 0
        mma_s = wg.wgmma_ss(dtype, BN, 128, NCH * 128, 128, NCH * 128, False)
        mma_o = wg.wgmma_rs(dtype, D, NCH * 128, 128, True)
    pin_s, wait_s = wg.pin(BN // 2), wg.wait_pin(1, BN // 2)
    wait_s_alone = wg.wait_pin(0, BN // 2)
    pin_o, wait_o = wg.pin(D // 2), wg.wait_pin(0, D // 2)
    wait_o_twin = wg.wait_pin(0, D // 2, tag=1)     # the same wait, another instruction
    pin_p = wg.pin(4 * PV_STEPS)
    fence, commit = wg.fence, wg.commit

    # operand starts move in 16-byte units (8 elements): a stage of K and V tiles
    STAGE_UNITS, V_UNITS = 2 * BN * D // 8, BN * D // 8
    # (split_rings: K stage s at s V_UNITS, V stage s after the K ring's P.STAGES)
    K_STEP, V_STEP, V_AT = ((V_UNITS, V_UNITS, P.STAGES * V_UNITS) if split_rings else
                            (STAGE_UNITS, STAGE_UNITS, V_UNITS))
    # 16 keys of V on: two row groups
    PV_UNITS = SPAN if SPLIT_KV else 2 * D

    @device_function
    def k_units(kk):
        """16-byte units from a K-major operand's start to its k-step ``kk`` (16
        columns): two core matrices on, or 32 bytes into the atom row (the next
        atom after SPAN bytes)."""
        if SPAN:
            return (32 * kk // SPAN) * (SPAN // 2) + (32 * kk % SPAN) // 16
        return 16 * kk

    @device_function
    def kb_units(kk):
        """:func:`k_units` of the K tile (with ``SPLIT_KV`` the next column
        group is ``BN`` rows on, not the next atom)."""
        if SPLIT_KV:
            return (32 * kk // SPAN) * (BN * SPAN // 16) + (32 * kk % SPAN) // 16
        return k_units(kk)

    @device_function
    def starts(sm, qbase):
        """The ``wgmma`` starts of this warpgroup's queries (at flat ``qbase``)
        and of the K/V ring, computed once: each product adds a constant."""
        return wg.matrix_start(sm, qbase), wg.matrix_start(sm, KV_OFF)

    if q_regs:
        # the same K operand with A from registers (K-major B: the descriptors of mma_s's B)
        if P.SWIZZLED:
            mma_s_rs = wg.wgmma_rs(dtype, BN, 16, 8 * SPAN if SPLIT_KV else 16 * D, False, SPAN)
        else:
            mma_s_rs = wg.wgmma_rs(dtype, BN, 128, NCH * 128, False)

        @device_function
        def issue_s(s, qa, kvs, stage):
            """Issue ``S = Q K^T`` on the keys of ``stage`` (D / 16 products, one
            group), the queries from this warp's A words ``qa``."""
            ks = kvs + stage * K_STEP
            for kk in range(KSTEPS):
                mma_s_rs(s, qa[kk, 0], qa[kk, 1], qa[kk, 2], qa[kk, 3], ks + kb_units(kk), kk > 0)
            commit()
    else:
        @device_function
        def issue_s(s, qs, kvs, stage):
            """Issue ``S = Q K^T`` on the keys of ``stage`` (D / 16 products, one group)."""
            ks = kvs + stage * K_STEP
            for kk in range(KSTEPS):
                mma_s(s, qs + k_units(kk), ks + kb_units(kk), kk > 0)
            commit()

    slot = P.slot

    @device_function
    def load_q_words(qa, words, qbase, warp, r, c):
        """This lane's A words of ``S = Q K^T`` (the ``mma.m16n8k16`` A fragment
        of each k-step: rows ``r`` and ``r + 8`` of the warp's 16, columns
        ``2 c`` and ``8 + 2 c`` of the step) from the query rows at flat
        ``qbase``, which the warp's lanes have written and synchronised on."""
        r0 = 16 * warp + r
        for kk in range(KSTEPS):
            for e in range(4):
                row = r0 + 8 * (e % 2)
                qa[kk, e] = words[(slot(qbase, row, 2 * kk + e // 2) + 2 * c) // 2]

    @device_function
    def issue_pv(o, pa, kvs, stage):
        """Issue ``O += P V`` on the values of ``stage`` (BN / 16 products, one group)."""
        vs = kvs + stage * V_STEP + V_AT
        for ks in range(PV_STEPS):                 # keys 16 ks .. 16 ks + 15: 16 D bytes on
            mma_o(o, pa[ks, 0], pa[ks, 1], pa[ks, 2], pa[ks, 3], vs + ks * PV_UNITS, True)
        commit()

    @device_function
    def tile_weights(s, m, l_, alpha, pos, slope, kt, c, pos0, nq, kv_hi, causal, window,
                     qscale, soft_cap, cap2, alibi, sc, plain, pa):
        """Logits, mask and softmax weights of the tile at keys ``kt ..`` (O
        untouched); ``plain``: the scale is left to the exponent's FFMA (``sc``)."""
        logits(s, pos, slope, kt, c, pos0, nq, kv_hi, causal, window, qscale, soft_cap, cap2,
               alibi, plain)
        tile_weights_rows(s, m, l_, alpha, sc, 0, pa)

    @device_function
    def tile_weights_masked(s, m, l_, alpha, pos, slope, kt, c, kv_hi, causal, window, qscale,
                            soft_cap, cap2, alibi, sc, plain, masked, pa):
        """:func:`tile_weights` with the tile's mask decided by the caller
        (``masked``, from ``mask_limits``: lean key loops)."""
        logits_masked(s, pos, slope, kt, c, kv_hi, causal, window, qscale, soft_cap, cap2,
                      alibi, plain, masked)
        tile_weights_rows(s, m, l_, alpha, sc, 0, pa)

    @device_function
    def pack_p(pa, s):
        """P's A words for the next ``P V``: the weights rounded to the cache
        dtype (:func:`pack_weights`), or with ``staged_p`` the words the
        softmax packed, copied from the staging rows."""
        if STAGED:
            # each word through a volatile move here, after the last P V's
            # wait: forwarded, the words the softmax defines would be the next
            # P V's operands, defined while the last one runs, and ptxas
            # serialises every wgmma (its C7513)
            for ks in range(PB):
                for e in range(4):
                    pa[ks, e] = uint32(wg.opaque(pa[PB + ks, e]))
        else:
            pack_weights(pa, s, 0)

    return SimpleNamespace(**{k: v for k, v in locals().items() if not k.startswith("__")})


@functools.cache
def prefill_wgmma_kernel(head_size, block_size, heads_per_block, block_n, dtype, layout,
                         num_warps=8, max_registers=None, fast_exp2=False, split_k=False,
                         swizzle=False, guard=True, lazy_rescale=False):
    """Compile-time specialised warpgroup prefill kernel: arguments, grid,
    outputs and ``split_k`` as for :func:`kernels.prefill_tc.prefill_tc_kernel`
    with one m-tile a warp; ``num_warps`` a multiple of 4 (whole warpgroups),
    ``block_n`` a multiple of 16 up to 256. The launch needs
    ``dynamic_shared_bytes`` (set on the kernel) of dynamic shared memory;
    ``swizzle=True`` lays the tiles out in ``wgmma``'s swizzled layout
    (:func:`kernels.prefill_tc_parts.tile_parts`) instead of core matrices;
    ``guard`` and ``lazy_rescale`` as there. Runs on sm_90a GPUs (H100, H200) and under the
    simulator."""
    if not supports(head_size, dtype, layout):
        raise ValueError(f"no tensor-core prefill kernel for head_size={head_size}, {dtype}, "
                         f"{layout}")
    if num_warps % 4 or not 16 <= block_n <= 256 or block_n % 16:
        raise ValueError(f"wgmma needs num_warps a multiple of 4 and block_n a multiple of 16 "
                         f"up to 256, but got num_warps={num_warps}, block_n={block_n}")
    P = tile_parts(head_size, block_size, heads_per_block, block_n, dtype, layout, num_warps,
                   1, split_k, "swizzle" if swizzle else True, fast_exp2, False, False, STAGES,
                   guard=guard, lazy_rescale=lazy_rescale)
    ALIGN = 1024 if swizzle else 16
    D, BN, PV_STEPS, NTILE_S, NTILE_O = P.D, P.BN, P.PV_STEPS, P.NTILE_S, P.NTILE_O
    STAGE_V, KV_HEAD_AXIS, SMEM_T, HPB = P.STAGE_V, P.KV_HEAD_AXIS, P.SMEM_T, P.HPB
    Q_OFF = P.Q_OFF
    wait_all, kv_slot, row_of, chunk_of = P.wait_all, P.kv_slot, P.row_of, P.chunk_of
    k_strides, v_strides = P.k_strides, P.v_strides
    issue_tile, load_queries = P.issue_tile, P.load_queries
    tile_range, init_rows, exponent_scale = P.tile_range, P.init_rows, P.exponent_scale
    store_half = P.store_half
    W = product_parts(P)
    starts = W.starts
    fence_proxy = wg.fence_proxy_async

    @device_function
    def acquire(j, ntiles, a):
        """Wait for tile ``j``'s copies, make them visible to the tensor cores, and
        start copying tile ``j + 1`` (into the stage tile ``j - 2`` used)."""
        sm, key_cache, value_cache, tables, seq, kvh, kv_first, kv_lo, last, tid, \
            kstr, vstr, tid_slot = a
        wait_all()
        fence_proxy()       # this thread's copies, visible to the tensor cores' reads
        cuda.syncthreads()  # everyone's copies landed; everyone is done with tile j - 2
        if j + 1 < ntiles:
            issue_tile(sm, key_cache, value_cache, tables, seq, kvh,
                       kv_first + (j + 1) * BN, kv_lo, last, (j + 1) % STAGES, tid, kstr, vstr,
                       tid_slot)

    @device_function
    def release(j, ntiles, a):
        """Nothing: the next ``acquire``'s barrier frees the stage."""

    run_keys = key_loop(P, W, STAGES, acquire, release)

    @cuda.jit(**({} if max_registers is None or config.ENABLE_CUDASIM
                 else dict(max_registers=max_registers)))
    def paged_prefill_wgmma_kernel(out, lse, query, key_cache, value_cache, block_tables,
                                   cu_seqlens_q, seq_lens, tile_seq, tile_q0, scale, causal,
                                   alibi_slopes, soft_cap, window, errors):
        tid = int32(cuda.threadIdx.x)
        lane = int32(tid % 32)
        warp = int32(tid // 32)
        r = int32(lane // 4)
        c = int32(lane % 4)
        num_heads = query.shape[1]
        group = num_heads // key_cache.shape[KV_HEAD_AXIS]
        h0 = cuda.blockIdx.y * HPB
        kvh = h0 // group
        tables = (block_tables, errors)
        seq, row0, q0, nq, pos0, kv_lo, kv_hi, ntiles, kv_first = tile_range(
            cuda.blockIdx.x, cu_seqlens_q, seq_lens, tile_seq, tile_q0, causal, window, tables)
        last = int32(kv_hi - 1)

        sm = cuda.shared.array(0, SMEM_T, alignment=ALIGN)
        kstr = k_strides(key_cache, kvh, chunk_of(tid))
        vstr = v_strides(value_cache if STAGE_V else key_cache, kvh, chunk_of(tid))
        tid_slot = kv_slot(0, row_of(tid), chunk_of(tid))
        # this warpgroup's 64 query rows (the index through a shuffle: uniform to ptxas)
        qs, kvs = starts(sm, Q_OFF + cuda.shfl_sync(FULL_MASK, warp >> 2, 0) * 64 * D)

        load_queries(sm, query, tid, row0, q0, nq, h0, num_heads)
        if ntiles > 0:
            issue_tile(sm, key_cache, value_cache, tables, seq, kvh, kv_first, kv_lo, last,
                       0, tid, kstr, vstr, tid_slot)
        else:
            commit_group()

        pos = cuda.local.array((1, 2), int32)
        slope = cuda.local.array((1, 2), float32)
        m = cuda.local.array((1, 2), float32)
        l_ = cuda.local.array((1, 2), float32)
        alpha = cuda.local.array((1, 2), float32)
        qscale = scale * float32(LOG2E)
        cap2 = soft_cap * float32(LOG2E)
        any_slope = init_rows(pos, slope, m, l_, warp, r, pos0, nq, h0, alibi_slopes)
        alibi = cuda.any_sync(FULL_MASK, any_slope)
        # without soft cap or ALiBi the scale goes into the exponent's FFMA
        plain, sc = exponent_scale(True, qscale, soft_cap, alibi)
        s = cuda.local.array((1, NTILE_S, 4), float32)
        o = cuda.local.array((1, NTILE_O, 4), float32)
        pa = cuda.local.array((PV_STEPS, 4), uint32)      # P_{j-1} as A words
        for i in range(NTILE_O):
            for e in range(4):
                o[0, i, e] = 0.0

        tiles = (sm, key_cache, value_cache, tables, seq, kvh, kv_first, kv_lo, last,
                 tid, kstr, vstr, tid_slot)
        run_keys(qs, kvs, s, o, pa, m, l_, alpha, pos, slope, c, pos0, nq, kv_first, kv_hi,
                 ntiles, int32(0), int32(0), causal, window, qscale, soft_cap, cap2, alibi, sc,
                 plain, tiles)

        store_half(out, lse, o, m, l_, sc, warp, r, c, nq, row0, q0, h0, 0, 0)
        store_half(out, lse, o, m, l_, sc, warp, r, c, nq, row0, q0, h0, 0, 1)

    paged_prefill_wgmma_kernel.dynamic_shared_bytes = P.DYNAMIC_BYTES
    return paged_prefill_wgmma_kernel
