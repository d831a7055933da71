"""Tiling of the tensor-core prefill kernel (:mod:`paged_numba.kernels.prefill_tc`):
which caches it takes, its shared memory, and its default tiling and options."""

DTYPES = ("float16", "bfloat16")
LAYOUTS = ("nhd", "vllm", "hnd", "interleaved")
MAX_SHARED_BYTES = 232448          # static + dynamic shared memory of one block (sm_90, opt-in)
STAGES = 2                         # K/V tiles in the ring


def supports(head_size, dtype, layout):
    """Whether :func:`prefill_tc_kernel` handles this combination: fp16 or bf16,
    a head size that is a power of two from 16 to 256 (rows of a power of two
    16-byte chunks, so the swizzle is a bijection)."""
    return (dtype in DTYPES and layout in LAYOUTS and 16 <= head_size <= 256
            and head_size & (head_size - 1) == 0)


def supports_fp8(head_size, layout, query_dtype):
    """Whether the producer kernel takes an fp8 cache here (sm_90:
    :mod:`paged_numba.kernels.prefill_fp8`): fp16 or bf16 queries, head size
    64 or 128 (those of its default tiling), values in whole rows (not
    ``"vllm"``).

    >>> supports_fp8(128, "nhd", "bfloat16"), supports_fp8(128, "vllm", "float16")
    (True, False)
    """
    return query_dtype in DTYPES and layout in LAYOUTS and layout != "vllm" and \
        head_size in (64, 128)


def shared_bytes(head_size, num_warps, block_n, m_tiles=1):
    """Dynamic shared memory of one block: the queries (``16 * m_tiles`` rows a
    warp) and the K/V ring, 2 bytes an element.

    >>> shared_bytes(128, 8, 64)           # 128 query rows + 2 stages of 64 keys and values
    98304
    """
    return 2 * head_size * (16 * m_tiles * num_warps + STAGES * 2 * block_n)


def prefill_tc_config(head_size, group_size, max_q_len=None, layout="nhd", sm90=False):
    """Default tiling ``(heads_per_block, block_q, block_n, num_warps, options)``,
    ``options`` being keyword arguments of :func:`prefill_tc_kernel`.

    ``heads_per_block`` is the largest power of two dividing the GQA group (at
    most 8), as for the CUDA-core kernel. On an sm_90 GPU (``sm90=True``), for
    prompts at head size 64 or 128 (and 256, with 32-key tiles, but for
    ``"vllm"``): the warpgroup kernel in the swizzled
    layout, 8 warps of 16 rows and 64-key tiles (128 at head size 64), with a
    producer warpgroup,
    the two consumer warpgroups taking turns and persistent blocks (one a
    multiprocessor; :mod:`paged_numba.kernels.prefill_wgmma_ws`, 4 stages) and
    the lean key loop (32-bit counters, the mask limits once an item) in
    every layout but ``"vllm"``, whose values the producer cannot copy in
    whole rows (there :mod:`paged_numba.kernels.prefill_wgmma`). Otherwise, for prompts up to
    head size 128: 4 warps of two m-tiles (32 rows a warp, 128 rows a tile)
    and 32-key tiles, the query fragments kept in registers at head size 64
    and below; at head size 256 (whose accumulators would not fit two
    m-tiles): 8 warps of one m-tile and 32-key tiles. Every tiling takes its
    exponentials as ``ex2.approx``. These were the fastest of those timed on
    the H200 (``docs/journal/prefill_tc.md``: prefill v2 options measured,
    2026-12-01; v8 and v13 measured, 2026-12-02), the lean loop on an H100
    (v26, 2026-12-05), head sizes 256 and 64 (v27 and v29, 2026-12-06; at 256
    with lazy rescaling of O), and at head size 128 lazy rescaling with the
    warp's vote on its lanes' maxima (v35, an H100, 2026-12-08). Where the
    batch's longest query fills fewer rows (decode-like batches) the tile
    shrinks to one m-tile a warp, with 64-key tiles, and fewer warps, at
    least one (16 rows).

    >>> prefill_tc_config(128, 4)
    (4, 32, 32, 4, {'fast_exp2': True, 'q_in_regs': False, 'm_tiles': 2})
    >>> prefill_tc_config(128, 4, sm90=True)[:4]
    (4, 32, 64, 8)
    >>> prefill_tc_config(128, 4, max_q_len=1, sm90=True)
    (4, 4, 64, 1, {'fast_exp2': True, 'q_in_regs': True, 'm_tiles': 1})
    >>> prefill_tc_config(64, 8)[:4], prefill_tc_config(256, 1)[:4]
    ((8, 16, 32, 4), (1, 128, 32, 8))
    >>> prefill_tc_config(64, 4, sm90=True)[2], prefill_tc_config(64, 4, layout="vllm", sm90=True)[2]
    (128, 64)
    >>> d128 = prefill_tc_config(128, 4, sm90=True)[4]
    >>> d128['lazy_rescale'], d128['lane_vote']
    (True, True)
    >>> d256 = prefill_tc_config(256, 4, sm90=True)
    >>> d256[2], d256[4]['producer'], d256[4]['lazy_rescale']
    (32, True, True)
    """
    hpb = 1
    while hpb * 2 <= min(group_size, 8) and group_size % (hpb * 2) == 0:
        hpb *= 2
    rows = None if max_q_len is None else int(max_q_len) * hpb
    if sm90 and head_size in (64, 128) and (rows is None or rows > 64):
        options = dict(fast_exp2=True, m_tiles=1, wgmma=True, swizzle=True)
        if layout == "vllm":
            return hpb, 128 // hpb, 64, 8, options
        options.update(producer=True, pingpong=True, persistent=True, lean_loop=True)
        if head_size == 128:
            # O rescaled only when a row's maximum grows by 2**8, and the warp's
            # vote on its lanes' maxima skipping the quads' exchange (v35)
            options.update(lazy_rescale=True, lane_vote=True)
        # head size 64: 128-key tiles (a 4-stage ring of 128 KB), half the per-tile work a key
        return hpb, 128 // hpb, 128 if head_size == 64 else 64, 8, options
    if sm90 and head_size == 256 and layout != "vllm" and (rows is None or rows > 64):
        # 32-key tiles: 64 KB of queries and a 4-stage ring of 128 KB; O (128
        # accumulators a thread) rescaled only when a row's maximum grows by 2**8
        options = dict(fast_exp2=True, m_tiles=1, wgmma=True, swizzle=True, producer=True,
                       pingpong=True, persistent=True, lean_loop=True, lazy_rescale=True)
        return hpb, 128 // hpb, 32, 8, options
    if head_size <= 128 and (rows is None or rows > 64):
        # two m-tiles a warp: each K/V fragment feeds two products
        options = dict(fast_exp2=True, q_in_regs=head_size <= 64, m_tiles=2)
        return hpb, 128 // hpb, 32, 4, options
    options = dict(fast_exp2=True, q_in_regs=head_size <= 128, m_tiles=1)
    block_n = 32 if head_size > 128 else 64
    num_warps = 8
    if rows is not None:
        while num_warps > 1 and 16 * (num_warps // 2) >= rows:
            num_warps //= 2
    return hpb, 16 * num_warps // hpb, block_n, num_warps, options
