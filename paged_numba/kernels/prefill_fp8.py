"""fp8 K/V tiles for the warp-specialised prefill kernel
(:func:`kernels.prefill_wgmma_ws.prefill_wgmma_ws_kernel` with ``kv_dtype``).

The warpgroup products read K and V from shared memory in the query's type
(fp16 or bf16), so an fp8 cache's tiles are widened on the way in, by the
producer warpgroup, which has the time (prefill is bound by the products):

* ``issue(...)`` gathers tile ``g``'s codes through the block table with
  16-byte ``cp.async`` copies (16 codes each, the first of a row's ``D / 16``
  chunks at ``16 c``) into stage ``g % 2`` of a two-stage *staging* ring of
  plain rows (``BN`` rows of ``D`` bytes for K, then the same for V), after
  the kernel's fp16 ring;
* ``widen(...)`` then turns each chunk the thread copied itself (so its own
  ``cp.async.wait_group`` is all the ordering it needs) into two 16-byte
  chunks of the fp16 / bf16 tile, at the slots the fp16 kernel's copies use
  (:func:`kernels.prefill_tc_parts.tile_parts`'s ``slot``), through
  :func:`kernels.fp8_mma.pairs` (``cvt.rn.f16x2.e4m3x2`` / ``.e5m2x2``: exact):
  one 16-byte shared load and two 16-byte shared stores a chunk, in an
  order that keeps the stores free of bank conflicts.

The codes' scales do not enter the tiles: K's multiplies the logits' scale
and V's the output, as in the decode kernels. Thread ``tid`` copies chunk
``tid % (D / 16)`` of rows ``tid // (D / 16) + u * 128 / (D / 16)`` (those
below ``BN``).
"""
from types import SimpleNamespace

from numba import int32

from .access import device_function, row_strides, vector_offsets, wide
from .async_copy import commit_group, copy16_async
from .fp8 import FORMATS
from .fp8_mma import pairs
from .mma import load_words, store_words

STAGING = 2                 # tiles of codes in flight


def staging_bytes(head_size, block_n):
    """Shared memory of the staging ring: two tiles of K and V codes.

    >>> staging_bytes(128, 64)
    32768
    """
    return STAGING * 2 * block_n * head_size


def fp8_parts(P, kv_dtype, copy_threads):
    """The staging ring's copies and widening for tile parts ``P`` (the
    query's type, ``P.dtype``, is the tiles'), codes of format ``kv_dtype``,
    copied by ``copy_threads`` threads. ``P.TOTAL`` (elements of the fp16
    layout) is where the staging ring starts."""
    if kv_dtype not in FORMATS or P.dtype not in ("float16", "bfloat16"):
        raise ValueError(f"fp8 tiles need an fp8 cache and float16/bfloat16 queries, but got "
                         f"kv_dtype={kv_dtype!r}, dtype={P.dtype!r}")
    D, BN, BLOCK_SIZE = P.D, P.BN, P.BLOCK_SIZE
    NCH8 = D // 16                      # 16-byte chunks of a row of codes
    if D % 16 or copy_threads % NCH8:
        raise ValueError(f"fp8 tiles need head_size a multiple of 16 dividing "
                         f"{16 * copy_threads}, but got head_size={D}")
    if not P.STAGE_V:
        raise ValueError(f"fp8 tiles copy values row by row: not for the {P.layout} layout")
    ROWS = copy_threads // NCH8         # rows a pass of the copying threads covers
    CPT = -(-BN // ROWS)                # chunks of K (and of V) a thread copies
    ALL = BN % ROWS == 0                # every thread has a row in every pass
    STG = P.TOTAL                       # the staging ring (elements of the fp16 layout)
    STAGE_ELEMS = BN * D                # one stage: K codes then V codes, 2 codes an element
    V_ELEMS = BN * D // 2
    k8, v8 = vector_offsets(P.layout, 16, BLOCK_SIZE, D)
    k_strides, v_strides = row_strides(k8, 1), row_strides(v8, 1)
    widen_word = pairs(kv_dtype, P.dtype)
    slot, KV_OFF = P.kv_slot, P.KV_OFF       # the K/V tiles' layout
    token_block, record_ = P.token_block, P.record_

    @device_function
    def strides(key_cache, value_cache, kvh, tid):
        """This thread's (base, block, token, chunk) strides in the K and V pools."""
        return k_strides(key_cache, kvh, tid % NCH8), v_strides(value_cache, kvh, tid % NCH8)

    @device_function
    def issue(sm, key_cache, value_cache, tables, seq, kt, lo, last, g, tid, kstr, vstr,
              entries):
        """Start copying the codes of keys and values ``kt .. kt + BN - 1``
        (clamped into ``[lo, last]``) into staging stage ``g % 2``, as one
        group; ``entries`` as from ``P.tile_entries``."""
        kt = int32(kt)
        e0, mine, bad = entries
        base = STG + (g % STAGING) * STAGE_ELEMS + (tid % NCH8) * 8
        for u in range(CPT):
            n = int32(tid // NCH8 + u * ROWS)
            # (a thread past the tile's rows looks up its last one: every lane
            # takes part in the shuffle)
            t = int32(min(max(int32(kt + min(n, BN - 1)), lo), last))
            blk, off, bad = token_block(tables, seq, t, e0, mine, bad, key_cache.shape[0])
            d = base + n * (D // 2)
            if ALL or n < BN:
                copy16_async(sm, d, key_cache,
                             wide(blk, kstr[1]) + int32(kstr[0] + off * kstr[2]))
                copy16_async(sm, d + V_ELEMS, value_cache,
                             wide(blk, vstr[1]) + int32(vstr[0] + off * vstr[2]))
        commit_group()
        record_(tables[0], tables[1], seq, bad)

    @device_function
    def widen_chunk(words, src, dst0, dst1, flip):
        """The 16 codes at words ``src .. src + 3`` (one 16-byte load) -> two
        16-byte chunks of the tile at words ``dst0`` (the first 8 codes) and
        ``dst1`` (one 16-byte store each); with ``flip`` the second chunk is
        stored first."""
        c0, c1, c2, c3 = load_words(words, src)
        a0, a1 = widen_word(c2 if flip else c0)
        a2, a3 = widen_word(c3 if flip else c1)
        store_words(words, dst1 if flip else dst0, a0, a1, a2, a3)
        b0, b1 = widen_word(c0 if flip else c2)
        b2, b3 = widen_word(c1 if flip else c3)
        store_words(words, dst0 if flip else dst1, b0, b1, b2, b3)

    @device_function
    def widen(words, g, stage, tid):
        """The codes this thread copied for tile ``g`` (landed: after its own
        wait) into ``stage`` of the fp16 / bf16 ring."""
        kbase = KV_OFF + 2 * stage * BN * D
        c = tid % NCH8
        # a quarter-warp's eight 16-byte stores reach all 32 banks (no
        # conflict) when lanes 4-7 of a row store their odd chunk first (with
        # D = 128 their even chunks fall on the banks of lanes 0-3's)
        flip = (c >> 2) & 1
        src0 = (STG + (g % STAGING) * STAGE_ELEMS) // 2 + c * 4
        for u in range(CPT):
            n = int32(tid // NCH8 + u * ROWS)
            if ALL or n < BN:
                src = src0 + n * (D // 4)
                for which in range(2):          # K, then V (BN D elements later)
                    dst = kbase + which * BN * D
                    widen_chunk(words, src + which * (V_ELEMS // 2),
                                slot(dst, n, 2 * c) // 2, slot(dst, n, 2 * c + 1) // 2, flip)

    return SimpleNamespace(issue=issue, widen=widen, strides=strides,
                           STAGING_BYTES=staging_bytes(D, BN))
