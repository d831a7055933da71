"""The options of the warp-specialised prefill kernel
(:func:`kernels.prefill_wgmma_ws.prefill_wgmma_ws_kernel`): what each does,
which combinations it takes, and how the block's registers are split
between its producer and consumer warpgroups.

``prefetch_queries=True`` (with ``persistent``, not split): a second
buffer of query rows after the K/V ring (``ws_shared_bytes``); while a
consumer warp works on an item it copies the queries of its block's next
item into the other buffer, a copy a lane each time its warpgroup passes
its turn (:mod:`kernels.item_handover`), so that the next item need not
wait for them. The items use the two buffers in turn.

``deferred_stores=True`` (with ``prefetch_queries``): a warp stages an
item's output rows in its query buffer as before, but stores them to
``out`` during the next item's key loop, a 16-byte store a lane each time
its warpgroup passes its turn, before that buffer takes the following
item's queries (the block's last item's rows after its loop).

``prefetch_ranges=True`` (with ``persistent``): each warpgroup reads the
next item's tile entries (``tile_seq``, ``tile_q0``) when it starts an
item, and that sequence's bounds (``cu_seqlens_q``, ``seq_lens``) once
this item's copies (producer) or products (consumers) are issued, so that
the next item starts without a chain of two dependent loads.

``timeline=True`` (with ``persistent``), for experiments: the kernel
stamps each of its block's items in the error array, which must then have
:func:`kernels.timeline.timeline_words` words; the producer at the item's
start, after its registers' set-up, after its range, after its first
tile's copies are issued and after its last; a consumer warpgroup at the
item's start, after its range, after its query copies are issued, when they
have landed, after the fence that follows, after its products, before its
stores and after them (:mod:`kernels.timeline` numbers the points).

``kv_dtype`` ("float8_e4m3fn" or "float8_e5m2"; ``dtype`` is then the
queries', fp16 or bf16): an fp8 cache, whose codes the producer copies
into a staging ring and widens into the tiles (:mod:`kernels.prefill_fp8`);
the kernel then takes ``kv_scales [2, num_kv_heads]`` float32 last (K's
scale multiplies the logits' scale, V's the output). Not with
``prefetch_queries``.

``producer_registers`` (8 consumer warps): the producer's registers a
thread after ``setmaxnreg`` (:func:`register_split` gives the consumers
the rest); default 40, or 64 with ``persistent``.

``split_halves=True`` (with ``swizzle``): the K/V tiles in the layout a
tensor-map copy writes (``tile_parts``' ``"swizzle-split"``: each
128-byte column group's rows one after another), the products'
descriptors to match; the arithmetic is unchanged.

``mbarriers=True`` (with ``pingpong`` or one consumer warpgroup, not fp8):
each stage's *full* barrier is an mbarrier (:mod:`kernels.tma`) at which every producer
thread arrives through ``cp.async.mbarrier.arrive.noinc`` right after
issuing its copies of the stage, so the hardware arrives for it once
they land: the producer never waits for its own copies and runs ahead
until the ring is full. The consumers wait on the stage's phase
(``(tile // stages) & 1``; both warpgroups on the same barrier) and
then fence the copies into the tensor cores' view.

``tensor_maps=True`` (with ``split_halves`` and ``mbarriers``; ``"nhd"``
or ``"hnd"``, block size 8 or more): the tiles whose keys are all
valid go through the copy engine, one thread issuing a box copy a page
and 128-byte column group (:mod:`kernels.prefill_tma`); the others as
before. The kernel then takes the pools' tensor maps (``key_map,
value_map``: :func:`kernels.prefill_tma.pool_maps`) last.

``merge_parts=True`` (with ``split_k``, not ``persistent``, fp8 or
``tensor_maps``): the last part of each item to finish merges the item's
partial states (:mod:`kernels.merge_tail`), so no merge kernel follows.
The kernel then takes ``final_out [rows, num_heads, head_size]`` (the
output dtype), ``final_lse [rows, num_heads]`` float32 and ``tickets
[tiles * head blocks]`` int32 (zeros; left zero) last; ``out`` and
``lse`` are the partial states as with ``split_k``.

``lean_loop=True``: the consumers' key loop with 32-bit counters, each
tile's mask decided before its scores land and the softmax unseeded
(``tile_parts(lean=True)``, :func:`kernels.prefill_key_loop.key_loop`): the
same results in fewer instructions.

``q_in_regs=True`` (head size 128 or less): each consumer lane reads its
warp's queries once an item as the register A operand of ``S = Q K^T``
(``wgmma`` with A from registers, :func:`kernels.prefill_wgmma.product_parts`),
so that shared memory serves only K there: at 64-key tiles the shared
operands of ``S`` take 128 bytes a clock at the tensor cores' full rate,
all a multiprocessor's shared memory gives. Same products, same results.

``split_rings=True`` (with ``lean_loop``; not fp8, ``mbarriers`` or
``tensor_maps``): a K ring and a V ring of ``stages`` stages each (2
with ``pingpong``) in the joint ring's memory, warps 0-1 of the producer
copying keys and warps 2-3 values (:mod:`kernels.prefill_split_ring`):
the loop never needs a tile's keys and values at once, so two stages a
ring keep the lookahead of a joint ring of three, and a tile of twice
the keys fits at head size 256.

``pdl=True`` (with ``split_k``, not ``merge_parts``): each block lets the
merge kernel launched after it start early (:mod:`.pdl`).

``alternate_tiles=True`` (8 consumer warps, an even number of stages; not
``pingpong``, ``persistent``, fp8, ``mbarriers``, ``tensor_maps``,
``merge_parts`` or ``split_rings``): a tile has 64 rows, and both consumer
warpgroups take them, each its own copy of the queries (the second after
the ring) and every other K/V tile (warpgroup ``w`` tiles ``w, w + 2,
...``), with a softmax of its own; at the end warpgroup 1 hands its state
to warpgroup 0 through shared memory (:mod:`kernels.warpgroup_merge`),
which stores the rows. Two softmax chains run on one item at once: for
decode with large groups, whose one warpgroup a block otherwise works
through its tiles one after another.
"""
from .prefill_tc_tiling import supports


# setmaxnreg moves registers within the block's launch allocation: 384 threads
# start with 168 registers each (65536 / 384, rounded down to a multiple of 8),
# so 128 x producer + 256 x consumer may not pass 168 x 384 = 64512 (more hangs)
REGISTER_POOL = 168 * 384
PRODUCER_REGS, CONSUMER_REGS = 40, 232   # 128 x 40 + 256 x 232 = 64512
# a persistent block's producer keeps its item's state across the ring's tiles:
# 40 registers spill it (228 bytes with 64-key tiles, ptxas 13.0), 64 do not,
# nor 216 the consumers'
PERSISTENT_REGS = 64, 216


def register_split(producer_registers):
    """``(producer, consumer)`` registers a thread of the 8-consumer-warp
    kernel: the consumers take the most (a multiple of 8, at most 256) that
    the pool leaves them.

    >>> [register_split(p) for p in (40, 48, 56, 64)]
    [(40, 232), (48, 224), (56, 224), (64, 216)]
    """
    p = int(producer_registers)
    if p % 8 or not 24 <= p <= 160:
        raise ValueError(f"producer_registers must be a multiple of 8 from 24 to 160, but got "
                         f"{producer_registers!r}")
    return p, min(256, (REGISTER_POOL - 128 * p) // 256 // 8 * 8)


def check_options(head_size, dtype, layout, num_warps, block_n, split_k, swizzle, stages,
                  pingpong, persistent, timeline, prefetch_queries, prefetch_ranges, kv_dtype,
                  split_halves, mbarriers, tensor_maps, merge_parts, q_in_regs=False,
                  split_rings=False, lean_loop=False, pdl=False, alternate_tiles=False,
                  deferred_stores=False):
    """Raise ``ValueError`` naming the option for a combination the producer
    kernel does not take (its factory's arguments, as given there)."""
    if not supports(head_size, dtype, layout):
        raise ValueError(f"no tensor-core prefill kernel for head_size={head_size}, {dtype}, "
                         f"{layout}")
    if q_in_regs and head_size > 128:      # D / 2 registers a consumer thread
        raise ValueError(f"q_in_regs on the producer kernel holds head_size / 2 registers a "
                         f"thread: head size 128 at most, but got head_size={head_size}")
    if kv_dtype is not None and prefetch_queries:
        raise ValueError("an fp8 cache's staging ring takes the place of prefetch_queries' "
                         "second query buffer: not both")
    if num_warps not in (4, 8) or not 16 <= block_n <= 256 or block_n % 16:
        raise ValueError(f"the producer kernel needs num_warps 4 or 8 (consumer warpgroups) and "
                         f"block_n a multiple of 16 up to 256, but got num_warps={num_warps}, "
                         f"block_n={block_n}")
    if split_rings and (not lean_loop or kv_dtype is not None or mbarriers or tensor_maps):
        raise ValueError(f"split_rings=True needs lean_loop=True and not an fp8 cache, "
                         f"mbarriers or tensor_maps, but got lean_loop={lean_loop}, "
                         f"kv_dtype={kv_dtype!r}, mbarriers={mbarriers}, "
                         f"tensor_maps={tensor_maps}")
    # 3 at least: the producer publishes tile j - 1 only after claiming the stage of
    # tile j, which the consumers free after tile j - 1 with 2 stages (a deadlock;
    # not so for split rings, whose K stage is free once S_j has landed);
    # 7 at most: two named barriers a stage, 15 besides __syncthreads'
    if split_rings and not (2 <= stages <= (2 if pingpong else 3)):
        raise ValueError(f"split rings take 2 stages each with pingpong, 2 or 3 without (their "
                         f"named barriers), but got stages={stages}, pingpong={pingpong}")
    if not split_rings and not 3 <= stages <= 7:
        raise ValueError(f"the producer kernel takes 3 to 7 stages, but got stages={stages}")
    if pingpong and (num_warps != 8 or stages > 4):
        raise ValueError(f"pingpong needs two consumer warpgroups (num_warps=8) and at most 4 "
                         f"stages, but got num_warps={num_warps}, stages={stages}")
    if prefetch_queries and (not persistent or split_k):
        raise ValueError(f"prefetch_queries=True needs persistent=True and no split-K, but got "
                         f"persistent={persistent}, split_k={split_k}")
    if deferred_stores and not prefetch_queries:
        raise ValueError("deferred_stores=True needs prefetch_queries=True (an item's rows wait "
                         "for their stores in the buffer the next item does not use)")
    if prefetch_ranges and not persistent:
        raise ValueError("prefetch_ranges=True needs persistent=True (a block's next item)")
    if timeline and not persistent:
        raise ValueError("timeline=True needs persistent=True (it stamps a block's items)")
    if persistent and not pingpong:
        raise ValueError("persistent=True needs pingpong=True (the turns order the warpgroups' "
                         "reuse of their query rows)")
    if mbarriers and (not (pingpong or num_warps == 4) or kv_dtype is not None):
        raise ValueError(f"mbarriers=True needs pingpong=True (its turns order the warpgroups' "
                         f"query rows) or one consumer warpgroup (num_warps=4), and no fp8 "
                         f"cache (whose producer widens the tiles itself), but got "
                         f"pingpong={pingpong}, num_warps={num_warps}, kv_dtype={kv_dtype!r}")
    if pdl and not (split_k and not merge_parts):
        raise ValueError(f"pdl=True lets a separate split-K merge start early: it needs "
                         f"split_k=True and merge_parts=False, but got split_k={split_k}, "
                         f"merge_parts={merge_parts}")
    if alternate_tiles and (num_warps != 8 or stages % 2 or pingpong or persistent
                            or kv_dtype is not None or mbarriers or tensor_maps or merge_parts
                            or split_rings):
        raise ValueError(f"alternate_tiles=True needs two consumer warpgroups (num_warps=8) and "
                         f"an even number of stages, and not pingpong, persistent, an fp8 cache, "
                         f"mbarriers, tensor_maps, merge_parts or split_rings, but got "
                         f"num_warps={num_warps}, stages={stages}, pingpong={pingpong}, "
                         f"persistent={persistent}, kv_dtype={kv_dtype!r}, "
                         f"mbarriers={mbarriers}, tensor_maps={tensor_maps}, "
                         f"merge_parts={merge_parts}, split_rings={split_rings}")
    if split_halves and not swizzle:
        raise ValueError("split_halves=True needs swizzle=True (it splits the swizzled layout)")
    if merge_parts and (not split_k or persistent or kv_dtype is not None or tensor_maps):
        raise ValueError(f"merge_parts=True needs split_k=True and not persistent, fp8 or "
                         f"tensor_maps, but got split_k={split_k}, persistent={persistent}, "
                         f"kv_dtype={kv_dtype!r}, tensor_maps={tensor_maps}")
    if tensor_maps and not (split_halves and mbarriers):
        raise ValueError(f"tensor_maps=True needs split_halves=True (the layout the boxes land "
                         f"in) and mbarriers=True (which count their bytes), but got "
                         f"split_halves={split_halves}, mbarriers={mbarriers}")
