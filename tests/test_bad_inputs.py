"""A corpus of bad inputs for every public function.

Each bad input raises (the exception type is part of the case) with a message
that names the argument and the value, launches no kernel
(``_launch.launch_count``; ``copy_blocks``'s kernel factory is replaced by
one that fails), and leaves the cache, the allocators, the host pool and the
plans' buffers as they were. Bad *data* (NaN and Inf) is in ``test_non_finite.py``.
"""
import numpy as np
import pytest

import paged_numba as pn
from paged_numba import _launch

F32 = np.float32
I32 = np.int32


class Env:
    """The objects the calls act on: an fp32 cache [4, 8, 2, 16] with random
    contents (2 KV heads), a query [2, 4, 16] and its table, a layered cache, an
    allocator and a block manager with one sequence each, a host pool, and a
    decode plan and a prefill plan built for the query but never run. Its
    methods make the public calls with good arguments, but for those given."""

    def __init__(self):
        rng = np.random.default_rng(3)
        k = rng.standard_normal((4, 8, 2, 16)).astype(F32)
        self.cache = pn.PagedKVCache.from_host(k, -k, "nhd")
        self.q = rng.standard_normal((2, 4, 16)).astype(F32)
        self.table = np.array([[1, 3, -1], [0, -1, -1]], I32)
        self.lens = np.array([12, 5], I32)
        self.kv = np.ones((3, 2, 16), F32)          # three new tokens
        self.layered = pn.PagedKVCache(2, 4, 1, 8, num_layers=2)
        self.alloc = pn.BlockAllocator(num_blocks=4, block_size=4)
        self.alloc.allocate("a", 5)                 # blocks [0, 1]: 5 = 4 + 1
        self.manager = pn.BlockManager(6, 2, enable_prefix_caching=True, num_host_blocks=2)
        self.manager.allocate("a", 3, token_ids=[1, 2, 3])
        self.pool = pn.host_pool(self.cache, 2)
        self.dplan = pn.DecodePlan(self.cache, num_seqs=2, num_heads=4, max_blocks=3)
        self.pplan = pn.PrefillPlan(self.cache, [0, 2, 3], [12, 5], num_heads=4)

    @staticmethod
    def dev(x):
        """A device copy of host array ``x``."""
        return pn._arrays.as_device(np.ascontiguousarray(x), "x")[0]

    def new_cache(self, *args, **kw):
        geometry = dict(zip(("num_blocks", "block_size", "num_kv_heads", "head_size"), args))
        return pn.PagedKVCache(**{**dict(num_blocks=4, block_size=8, num_kv_heads=1,
                                         head_size=16), **geometry, **kw})

    def decode(self, **kw):
        args = dict(query=self.q, cache=self.cache, block_tables=self.table, seq_lens=self.lens)
        return pn.paged_decode(**{**args, **kw})

    def prefill(self, **kw):
        args = dict(query=self.q, cache=self.cache, block_tables=self.table,
                    cu_seqlens_q=np.array([0, 1, 2], I32), seq_lens=self.lens)
        return pn.paged_prefill(**{**args, **kw})

    def write(self, slots, **kw):
        return pn.write_kv(self.cache, kw.pop("key", self.kv), kw.pop("value", self.kv),
                           slots, **kw)

    def decode_plan(self, **kw):
        return pn.DecodePlan(**{**dict(cache=self.cache, num_seqs=2, num_heads=4,
                                       max_blocks=3), **kw})

    def prefill_plan(self, **kw):
        return pn.PrefillPlan(**{**dict(cache=self.cache, cu_seqlens_q=[0, 2], seq_lens=[5],
                                        num_heads=4), **kw})

    def run_decode(self, q=None, table=None, lens=None, **kw):
        q, table, lens = (self.dev(self.q if q is None else q),
                          self.dev(self.table if table is None else table),
                          self.dev(self.lens if lens is None else lens))
        return self.dplan.run(q, table, lens, **kw)

    def run_prefill(self, q=None, table=None, **kw):
        q = self.dev(np.concatenate([self.q, self.q[:1]]) if q is None else q)
        return self.pplan.run(q, self.dev(self.table if table is None else table), **kw)

    def merge(self, v=(1, 2, 1, 4), s=(1, 2, 1), v_dtype=F32, s_dtype=F32, **kw):
        v = np.zeros(v, v_dtype) if isinstance(v, tuple) else v
        return pn.merge_states(v, np.zeros(s, s_dtype), **kw)

    def state(self):
        """Everything a rejected call must leave alone."""
        a, m = self.alloc, self.manager
        plans = [(p.out.copy_to_host(), p.lse.copy_to_host(), p._inputs)
                 for p in (self.dplan, self.pplan)]
        return [*self.cache.to_host(), *self.layered.to_host(), list(a.free_block_ids),
                a.block_table(), a.seq_lens(), repr(m), m.block_table(), m.seq_lens(),
                self.pool.copy(), *[x for plan in plans for x in plan]]


def _same(a, b):
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    return a is b if a is None or isinstance(a, tuple) else a == b


def _read_only(shape):
    a = np.zeros(shape, np.float16)
    a.flags.writeable = False
    return a


def case(name, call, *fragments, error=ValueError):
    """A corpus entry: ``call(env)`` raises ``error`` with every fragment in its message."""
    return pytest.param(call, error, fragments, id=name)


BIG = 2**31             # one past int32
U64 = 2**64 - 1         # wraps to -1 in int64
CSR = (np.array([0, 2, 3]), np.array([1, 3, 0]), np.array([4, 5]))   # the env's table as CSR
AL, PT, LY = pn.allocator, pn.page_tables, pn.layouts
CASES = [
    # -- PagedKVCache -------------------------------------------------------------
    case("cache-num_blocks-0", lambda e: e.new_cache(0), "num_blocks", "0"),
    case("cache-num_blocks-float", lambda e: e.new_cache(2.5), "num_blocks", "2.5"),
    case("cache-num_blocks-bool", lambda e: e.new_cache(True), "num_blocks", "True"),
    case("cache-num_blocks-str", lambda e: e.new_cache("4"), "num_blocks", "'4'"),
    case("cache-num_blocks-none", lambda e: e.new_cache(None), "num_blocks", "None"),
    case("cache-block_size-neg", lambda e: e.new_cache(4, -8), "block_size", "-8"),
    case("cache-kv_heads-float", lambda e: e.new_cache(4, 8, 1.0), "num_kv_heads", "1.0"),
    case("cache-head_size-int32", lambda e: e.new_cache(4, 8, 1, BIG), "head_size", str(BIG)),
    case("cache-dtype-foo", lambda e: e.new_cache(dtype="foo"), "dtype", "'foo'"),
    case("cache-dtype-int8", lambda e: e.new_cache(dtype="int8"), "dtype", "'int8'"),
    case("cache-dtype-none", lambda e: e.new_cache(dtype=None), "dtype", "None"),
    case("cache-dtype-malformed", lambda e: e.new_cache(dtype="f4,(2"), "dtype", "'f4,(2'"),
    case("cache-dtype-byteorder", lambda e: e.new_cache(dtype=">f2"), "dtype", ">f2",
         "byte order"),
    case("cache-from_host-byteorder", lambda e: pn.PagedKVCache.from_host(
        np.zeros((2, 2, 1, 8), ">f2"), np.zeros((2, 2, 1, 8), ">f2")), "dtype", ">f2"),
    case("cache-k_scale-overflow", lambda e: e.new_cache(dtype="float8_e4m3fn", k_scale=10**400),
         "k_scale", "100000"),
    case("cache-gather-2d", lambda e: e.cache.gather([[1, 3]], 3), "block_table_row", "(1, 2)"),
    case("cache-layout", lambda e: e.new_cache(layout="nchw"), "layout", "'nchw'"),
    case("cache-num_layers-0", lambda e: e.new_cache(num_layers=0), "num_layers", "0"),
    case("cache-layer-past", lambda e: e.layered.layer(2), "layer", "2"),
    case("cache-layer-bool", lambda e: e.layered.layer(True), "layer", "True"),
    case("cache-from_host-dtypes", lambda e: pn.PagedKVCache.from_host(
        np.zeros((1, 4, 1, 8), F32), np.zeros((1, 4, 1, 8), np.float16)), "value_cache", "float16"),
    case("cache-gather-negative", lambda e: e.cache.gather([1], -1), "seq_len", "-1"),
    case("cache-gather-block", lambda e: e.cache.gather([9], 3), "block table entry 0", "9"),
    case("cache-gather-float", lambda e: e.cache.gather([1], 2.5), "seq_len", "2.5"),
    case("cache-gather-bool", lambda e: e.cache.gather([1], True), "seq_len", "True"),
    case("cache-gather-float-row", lambda e: e.cache.gather([1.0], 3), "block_table_row",
         "float64", error=TypeError),
    # -- BlockAllocator -----------------------------------------------------------
    case("alloc-num_blocks-0", lambda e: pn.BlockAllocator(0, 4), "num_blocks", "0"),
    case("alloc-block_size-float", lambda e: pn.BlockAllocator(4, 4.0), "block_size", "4.0"),
    case("alloc-num_blocks-bool", lambda e: pn.BlockAllocator(True, 4), "num_blocks", "True"),
    case("alloc-block_size-str", lambda e: pn.BlockAllocator(4, "16"), "block_size", "'16'"),
    case("alloc-block_size-int32", lambda e: pn.BlockAllocator(4, BIG), "block_size", str(BIG)),
    case("alloc-allocate-negative", lambda e: e.alloc.allocate("b", -1), "num_tokens", "-1"),
    case("alloc-allocate-float", lambda e: e.alloc.allocate("b", 2.7), "num_tokens", "2.7"),
    case("alloc-allocate-bool", lambda e: e.alloc.allocate("b", True), "num_tokens", "True"),
    case("alloc-allocate-none", lambda e: e.alloc.allocate("b", None), "num_tokens", "None"),
    case("alloc-allocate-str", lambda e: e.alloc.allocate("b", "3"), "num_tokens", "'3'"),
    case("alloc-allocate-unhashable", lambda e: e.alloc.allocate(["b"], 1), "seq_id", "['b']"),
    case("alloc-allocate-twice", lambda e: e.alloc.allocate("a", 1), "'a'", "already"),
    case("alloc-allocate-too-many", lambda e: e.alloc.allocate("b", 100), "'b'", "25 blocks",
         error=pn.OutOfBlocksError),
    case("alloc-append-float", lambda e: e.alloc.append("a", 3.9), "num_new_tokens", "3.9"),
    case("alloc-append-bool", lambda e: e.alloc.append("a", True), "num_new_tokens", "True"),
    case("alloc-append-negative", lambda e: e.alloc.append("a", -2), "num_new_tokens", "-2"),
    case("alloc-append-unknown", lambda e: e.alloc.append("zz", 1), "'zz'"),
    case("alloc-append-too-many", lambda e: e.alloc.append("a", 12), "'a'", "3 blocks",
         error=pn.OutOfBlocksError),
    case("alloc-append_slots-float", lambda e: e.alloc.append_slots("a", 1.5), "num_new", "1.5"),
    case("alloc-append_slots-negative", lambda e: e.alloc.append_slots("a", -1), "num_new", "-1"),
    case("alloc-can_allocate-float", lambda e: e.alloc.can_allocate(1.5), "num_tokens", "1.5"),
    case("alloc-can_append-bool", lambda e: e.alloc.can_append("a", True), "num_new", "True"),
    case("alloc-free-unknown", lambda e: e.alloc.free("zz"), "'zz'"),
    case("alloc-free-unhashable", lambda e: e.alloc.free({"a": 1}), "seq_id", "{'a': 1}"),
    case("alloc-slot_mapping-float", lambda e: e.alloc.slot_mapping("a", 0.5, 2), "start", "0.5"),
    case("alloc-slot_mapping-end", lambda e: e.alloc.slot_mapping("a", 0, 9), "end=9", "seq_len=5"),
    case("alloc-slot_mapping-reversed", lambda e: e.alloc.slot_mapping("a", 3, 1), "start=3"),
    case("alloc-block_table-float", lambda e: e.alloc.block_table(max_blocks=2.5), "max_blocks",
         "2.5"),
    case("alloc-block_table-negative", lambda e: e.alloc.block_table(max_blocks=-1), "max_blocks",
         "-1"),
    case("alloc-block_table-short", lambda e: e.alloc.block_table(max_blocks=1), "max_blocks=1"),
    case("alloc-block_table-str-ids", lambda e: e.alloc.block_table("a"), "seq_ids", "'a'"),
    case("alloc-seq_lens-unknown", lambda e: e.alloc.seq_lens(["zz"]), "'zz'"),
    case("alloc-num_blocks_for", lambda e: AL.num_blocks_for(5, 0), "block_size", "0"),
    case("alloc-num_blocks_for-float", lambda e: AL.num_blocks_for(2.5, 4), "num_tokens", "2.5"),
    case("alloc-padded-float", lambda e: AL.padded_block_table([[1.5]]), "rows[0][0]", "1.5"),
    case("alloc-padded-int32", lambda e: AL.padded_block_table([[0], [BIG]]), "rows[1][0]",
         str(BIG)),
    case("alloc-slots-positions", lambda e: AL.slots_from_table([0], [0.5], 4), "positions[0]",
         "0.5"),
    # -- BlockManager -------------------------------------------------------------
    case("manager-num_blocks-0", lambda e: pn.BlockManager(0, 2), "num_blocks", "0"),
    case("manager-prefix-flag", lambda e: pn.BlockManager(4, 2, enable_prefix_caching="yes"),
         "enable_prefix_caching", "'yes'"),
    case("manager-host-float", lambda e: pn.BlockManager(4, 2, num_host_blocks=1.5),
         "num_host_blocks", "1.5"),
    case("manager-allocate-float", lambda e: e.manager.allocate("n", 2.5), "num_tokens", "2.5"),
    case("manager-allocate-bool", lambda e: e.manager.allocate("n", True), "num_tokens", "True"),
    case("manager-allocate-tokens", lambda e: e.manager.allocate("n", 1, token_ids=[1, 2]),
         "token_ids", "2"),
    case("manager-append-float", lambda e: e.manager.append("a", 1.5, token_ids=[4]),
         "num_new_tokens", "1.5"),
    case("manager-append_slots-bool", lambda e: e.manager.append_slots("a", True, token_ids=[4]),
         "num_new_tokens", "True"),
    case("manager-fork-unknown", lambda e: e.manager.fork("zz", "n"), "'zz'"),
    case("manager-ref_count", lambda e: e.manager.ref_count(99), "block", "99"),
    case("manager-ref_count-float", lambda e: e.manager.ref_count(1.0), "block", "1.0"),
    case("manager-swap_in", lambda e: e.manager.swap_in("a"), "'a'", "not swapped"),
    case("manager-block_table-float", lambda e: e.manager.block_table(max_blocks=2.5),
         "max_blocks", "2.5"),
    # -- write_kv -----------------------------------------------------------------
    case("write-slot-uint64", lambda e: e.write(np.array([0, U64, 1], np.uint64)),
         "slot_mapping[1]", str(U64)),
    case("write-slot-device-uint64", lambda e: e.write(e.dev(np.array([0, 1, U64], np.uint64)),
                                                       validate=False), "slot_mapping", "uint64"),
    case("write-slot-range", lambda e: e.write(np.array([0, 32, 1])), "slot_mapping[1]", "32"),
    case("write-slot-below", lambda e: e.write(np.array([0, -2, 1])), "slot_mapping[1]", "-2"),
    case("write-slot-twice", lambda e: e.write(np.array([3, 5, 3])), "slot 3", "more than once"),
    case("write-slot-float", lambda e: e.write(np.arange(3.0)), "slot_mapping", "float64"),
    case("write-slot-bool", lambda e: e.write(np.ones(3, bool)), "slot_mapping", "bool"),
    case("write-slot-list-float", lambda e: e.write([0, 1.5, 2]), "slot_mapping[1]", "1.5"),
    case("write-slot-shape", lambda e: e.write(np.array([0, 1])), "slot_mapping", "[3]"),
    case("write-slot-device-uint", lambda e: e.write(e.dev(np.array([0, 1, 99], np.uint32))),
         "slot_mapping[2]", "99"),
    case("write-key-dtype", lambda e: e.write(np.arange(3), key=e.kv.astype(np.float16)), "key",
         "float16"),
    case("write-key-shape", lambda e: e.write(np.arange(3), key=e.kv[:, :1]), "key", "(3, 1, 16)"),
    case("write-value-shape", lambda e: e.write(np.arange(3), value=e.kv[:2]), "value",
         "(2, 2, 16)"),
    case("write-key-list", lambda e: e.write(np.arange(3), key=e.kv.tolist()), "key", "list",
         error=TypeError),
    case("write-validate", lambda e: e.write(np.arange(3), validate="yes"), "validate", "'yes'"),
    case("write-cache", lambda e: pn.write_kv(e.pool, e.kv, e.kv, np.arange(3)), "cache",
         "HostPool", error=TypeError),
    # -- paged_decode -------------------------------------------------------------
    case("decode-query-dtype", lambda e: e.decode(query=e.q.astype(np.float16)), "query",
         "float16"),
    case("decode-query-byteorder", lambda e: e.decode(query=e.q.astype(">f4")), "query",
         "float32 (>f4)"),
    case("decode-query-2d", lambda e: e.decode(query=e.q[0]), "query", "(4, 16)"),
    case("decode-query-0-heads", lambda e: e.decode(query=e.q[:, :0]), "query", "(2, 0, 16)"),
    case("decode-query-heads", lambda e: e.decode(query=e.q[:, :3]), "num_heads", "3"),
    case("decode-query-head_size", lambda e: e.decode(query=e.q[..., :8]), "head_size", "8"),
    case("decode-query-list", lambda e: e.decode(query=e.q.tolist()), "query", "list",
         error=TypeError),
    case("decode-table-float", lambda e: e.decode(block_tables=e.table.astype(F32)),
         "block_tables", "float32"),
    case("decode-table-int32", lambda e: e.decode(block_tables=e.table + np.array([[0, BIG + 1, 0],
                                                                                   [0, 0, 0]])),
         "block_tables[0, 1]", str(BIG + 4)),
    case("decode-table-entry", lambda e: e.decode(block_tables=e.table + [[0, 4, 0], [0, 0, 0]]),
         "block_tables[0, 1]", "7"),
    case("decode-table-rows", lambda e: e.decode(block_tables=e.table[:1]), "block_tables",
         "(1, 3)"),
    case("decode-table-tuple", lambda e: e.decode(block_tables=(e.table, e.table)),
         "block_tables", "(2, 2, 3)"),
    case("decode-lens-int64", lambda e: e.decode(seq_lens=np.array([4294967299, 5])),
         "seq_lens[0]", "4294967299"),
    case("decode-lens-negative", lambda e: e.decode(seq_lens=np.array([12, -2], I32)),
         "seq_lens[1]", "-2"),
    case("decode-lens-long", lambda e: e.decode(seq_lens=np.array([25, 5], I32)), "seq_lens[0]",
         "25"),
    case("decode-lens-none", lambda e: e.decode(seq_lens=None), "seq_lens"),
    case("decode-scale-nan", lambda e: e.decode(scale=float("nan")), "scale", "nan"),
    case("decode-scale-inf", lambda e: e.decode(scale=float("inf")), "scale", "inf"),
    case("decode-scale-f32-overflow", lambda e: e.decode(scale=1e39), "scale", "1e+39"),
    case("decode-scale-str", lambda e: e.decode(scale="0.5"), "scale", "'0.5'"),
    case("decode-scale-bool", lambda e: e.decode(scale=True), "scale", "True"),
    case("decode-window-0", lambda e: e.decode(sliding_window=0), "sliding_window", "0"),
    case("decode-window-float", lambda e: e.decode(sliding_window=2.0), "sliding_window", "2.0"),
    case("decode-window-inf", lambda e: e.decode(sliding_window=float("inf")), "sliding_window",
         "inf"),
    case("decode-window-int32", lambda e: e.decode(sliding_window=BIG), "sliding_window",
         str(BIG)),
    case("decode-window-bool", lambda e: e.decode(sliding_window=True), "sliding_window", "True"),
    case("decode-cap-negative", lambda e: e.decode(logits_soft_cap=-1.0), "soft_cap", "-1.0"),
    case("decode-cap-nan", lambda e: e.decode(logits_soft_cap=float("nan")), "soft_cap", "nan"),
    case("decode-cap-f32-overflow", lambda e: e.decode(logits_soft_cap=1e39), "soft_cap", "1e+39"),
    case("decode-cap-f32-zero", lambda e: e.decode(logits_soft_cap=1e-46), "soft_cap", "1e-46"),
    case("decode-slopes-shape", lambda e: e.decode(alibi_slopes=np.ones(3)), "alibi_slopes",
         "(3,)"),
    case("decode-slopes-int", lambda e: e.decode(alibi_slopes=np.ones(4, I32)), "alibi_slopes",
         "int32"),
    case("decode-slopes-nan", lambda e: e.decode(alibi_slopes=np.array([0, 1, np.nan, 0])),
         "alibi_slopes[2]", "nan"),
    case("decode-slopes-f32-overflow", lambda e: e.decode(alibi_slopes=np.array([1e39, 0, 0, 0])),
         "alibi_slopes[0]", "1e+39"),
    case("decode-partitions-0", lambda e: e.decode(num_partitions=0), "num_partitions", "0"),
    case("decode-partitions-float", lambda e: e.decode(num_partitions=1.5), "num_partitions",
         "1.5"),
    case("decode-partitions-bool", lambda e: e.decode(num_partitions=True), "num_partitions",
         "True"),
    case("decode-return_lse", lambda e: e.decode(return_lse="yes"), "return_lse", "'yes'"),
    case("decode-return_lse-none", lambda e: e.decode(return_lse=None), "return_lse", "None"),
    case("decode-validate", lambda e: e.decode(validate=1), "validate", "1"),
    case("decode-pv_mma", lambda e: e.decode(pv_mma="no"), "pv_mma", "'no'"),
    case("decode-key_rows", lambda e: e.decode(key_rows=0), "key_rows", "0"),
    case("decode-csr-int32", lambda e: e.decode(block_tables=(CSR[0], np.array([1, 3, 2**33]),
                                                              CSR[2]), seq_lens=None),
         "kv_indices[2]", str(2**33)),
    case("decode-csr-indptr", lambda e: e.decode(block_tables=(np.array([1, 2, 3]), *CSR[1:]),
                                                 seq_lens=None), "kv_indptr[0]", "1"),
    case("decode-csr-lens", lambda e: e.decode(block_tables=CSR, seq_lens=np.array([12, 6], I32)),
         "seq_lens", "[12, 6]"),
    case("decode-cache-type", lambda e: e.decode(cache=e.pool), "cache", "HostPool",
         error=TypeError),
    case("decode-cache-layered", lambda e: e.decode(cache=e.layered), "num_layers", "2"),
    # -- merge_states -------------------------------------------------------------
    case("merge-v-3d", lambda e: e.merge(v=(1, 2, 4)), "v", "(1, 2, 4)"),
    case("merge-s-shape", lambda e: e.merge(s=(1, 3, 1)), "s", "(1, 3, 1)"),
    case("merge-s-float64", lambda e: e.merge(s_dtype=np.float64), "s", "float64"),
    case("merge-v-int", lambda e: e.merge(v_dtype=I32), "v", "int32"),
    case("merge-validate", lambda e: e.merge(validate="no"), "validate", "'no'"),
    case("merge-v-list", lambda e: e.merge(v=[[[[0.0]]]], s=(1, 1, 1)), "v", "list",
         error=TypeError),
    # -- DecodePlan ---------------------------------------------------------------
    case("plan-num_seqs-float", lambda e: e.decode_plan(num_seqs=2.5), "num_seqs", "2.5"),
    case("plan-num_seqs-negative", lambda e: e.decode_plan(num_seqs=-1), "num_seqs", "-1"),
    case("plan-num_seqs-grid", lambda e: e.decode_plan(num_seqs=70000), "num_seqs", "70000"),
    case("plan-num_heads-0", lambda e: e.decode_plan(num_heads=0), "num_heads", "0"),
    case("plan-num_heads-float", lambda e: e.decode_plan(num_heads=4.0), "num_heads", "4.0"),
    case("plan-num_heads-group", lambda e: e.decode_plan(num_heads=3), "num_heads", "3"),
    case("plan-max_blocks-negative", lambda e: e.decode_plan(max_blocks=-3), "max_blocks", "-3"),
    case("plan-max_blocks-str", lambda e: e.decode_plan(max_blocks="3"), "max_blocks", "'3'"),
    case("plan-max_blocks-context", lambda e: e.decode_plan(max_blocks=2**28), "max_blocks",
         str(2**28)),
    case("plan-scale-f32-overflow", lambda e: e.decode_plan(scale=-1e39), "scale", "-1e+39"),
    case("plan-warps-0", lambda e: e.decode_plan(num_warps=0), "num_warps", "0"),
    case("plan-warps-3", lambda e: e.decode_plan(num_warps=3), "num_warps", "3"),
    case("plan-warps-64", lambda e: e.decode_plan(num_warps=64), "num_warps", "64"),
    case("plan-warps-float", lambda e: e.decode_plan(num_warps=4.0), "num_warps", "4.0"),
    case("plan-unroll-0", lambda e: e.decode_plan(unroll=0), "unroll", "0"),
    case("plan-unroll-huge", lambda e: e.decode_plan(unroll=BIG), "unroll", str(BIG)),
    case("decode-out-over-cache", lambda e: e.decode(
        query=e.dev(e.q), out=e.cache.key_cache.reshape(-1)[:128].reshape(2, 4, 16)), "out", "key pool"),
    case("plan-out-over-cache", lambda e: e.run_decode(
        out=e.cache.value_cache.reshape(-1)[:128].reshape(2, 4, 16)), "out", "value pool"),
    case("decode-stream-past-64-bits", lambda e: e.decode(stream=2**70), "stream", str(2**70)),
    case("fp8-scale-product", lambda e: pn.paged_decode(
        np.zeros((1, 1, 16), F32), e.new_cache(dtype="float8_e4m3fn", k_scale=1e38),
        np.array([[0]], I32), np.array([4], I32), scale=100.0), "scale x k_scale", "1e+38"),
    case("plan-stages-1", lambda e: e.decode_plan(stages=1), "stages", "1"),
    case("plan-stages-40", lambda e: e.decode_plan(stages=40), "stages", "40"),
    case("plan-tensor_cores", lambda e: e.decode_plan(tensor_cores="yes"), "tensor_cores",
         "'yes'"),
    case("plan-partitions", lambda e: e.decode_plan(num_partitions=-1), "num_partitions", "-1"),
    case("plan-run-host", lambda e: e.dplan.run(e.q, e.dev(e.table), e.dev(e.lens)), "query",
         "ndarray", error=TypeError),
    case("plan-run-query-shape", lambda e: e.run_decode(q=e.q[:1]), "query", "(1, 4, 16)"),
    case("plan-run-table-float", lambda e: e.run_decode(table=e.table.astype(F32)),
         "block_tables", "float32"),
    case("plan-run-lens-int64", lambda e: e.run_decode(lens=e.lens.astype(np.int64)), "seq_lens",
         "int64"),
    case("plan-run-entry", lambda e: e.run_decode(table=e.table + 3), "block_tables[0, 0]", "4"),
    case("plan-run-validate", lambda e: e.run_decode(validate="yes"), "validate", "'yes'"),
    # -- PrefillPlan and paged_prefill --------------------------------------------
    case("pplan-num_heads-0", lambda e: e.prefill_plan(num_heads=0), "num_heads", "0"),
    case("pplan-num_heads-float", lambda e: e.prefill_plan(num_heads=2.5), "num_heads", "2.5"),
    case("pplan-causal-none", lambda e: e.prefill_plan(causal=None), "causal", "None"),
    case("pplan-causal-str", lambda e: e.prefill_plan(causal="no"), "causal", "'no'"),
    case("pplan-causal-int", lambda e: e.prefill_plan(causal=1), "causal", "1"),
    case("pplan-scale-nan", lambda e: e.prefill_plan(scale=np.nan), "scale", "nan"),
    case("pplan-cu-start", lambda e: e.prefill_plan(cu_seqlens_q=[1, 2]), "cu_seqlens_q[0]", "1"),
    case("pplan-cu-float", lambda e: e.prefill_plan(cu_seqlens_q=[0.0, 2.0]), "cu_seqlens_q[0]",
         "0.0"),
    case("pplan-lens-int32", lambda e: e.prefill_plan(seq_lens=[4294967299]), "seq_lens[0]",
         "4294967299"),
    case("pplan-lens-uint64", lambda e: e.prefill_plan(seq_lens=np.array([U64], np.uint64)),
         "seq_lens[0]", str(U64)),
    case("pplan-lens-negative", lambda e: e.prefill_plan(cu_seqlens_q=[0, 0], seq_lens=[-1]),
         "seq_lens[0]", "-1"),
    case("pplan-q_len", lambda e: e.prefill_plan(cu_seqlens_q=[0, 6]), "q_len 6", "seq_lens[0]"),
    case("pplan-hpb", lambda e: e.prefill_plan(heads_per_block=3), "heads_per_block", "3"),
    case("pplan-block_q-0", lambda e: e.prefill_plan(block_q=0), "block_q", "0"),
    case("pplan-block_n-float", lambda e: e.prefill_plan(block_n=2.5), "block_n", "2.5"),
    case("pplan-warps-64", lambda e: e.prefill_plan(num_warps=64), "num_warps", "64"),
    case("pplan-options-str", lambda e: e.prefill_plan(kernel_options="fast"), "kernel_options",
         "'fast'"),
    case("pplan-options-cuda-cores", lambda e: e.prefill_plan(kernel_options={"fast_exp2": True}),
         "kernel_options", "fast_exp2"),
    case("pplan-options-flag", lambda e: e.prefill_plan(kernel_options={"fast_exp2": "yes"}),
         "kernel_options['fast_exp2']", "'yes'"),
    case("pplan-tensor_cores", lambda e: e.prefill_plan(tensor_cores=1), "tensor_cores", "1"),
    case("pplan-window", lambda e: e.prefill_plan(sliding_window=-4), "sliding_window", "-4"),
    case("pplan-run-validate", lambda e: e.run_prefill(validate="no"), "validate", "'no'"),
    case("pplan-run-query", lambda e: e.run_prefill(q=e.q), "query", "(2, 4, 16)"),
    case("pplan-run-table", lambda e: e.run_prefill(table=e.table.astype(F32)), "block_tables",
         "float32"),
    case("prefill-return_lse", lambda e: e.prefill(return_lse=1), "return_lse", "1"),
    case("prefill-validate", lambda e: e.prefill(validate="x"), "validate", "'x'"),
    case("prefill-causal", lambda e: e.prefill(causal=None), "causal", "None"),
    case("prefill-cu-2d", lambda e: e.prefill(cu_seqlens_q=np.array([[0, 1, 2]])),
         "cu_seqlens_q", "(1, 3)"),
    case("prefill-cu-total", lambda e: e.prefill(cu_seqlens_q=np.array([0, 1, 3])),
         "cu_seqlens_q[-1]", "3"),
    case("prefill-lens-int32", lambda e: e.prefill(seq_lens=np.array([4294967299, 5])),
         "seq_lens[0]", "4294967299"),
    case("prefill-query-0-heads", lambda e: e.prefill(query=e.q[:, :0]), "query", "(2, 0, 16)"),
    case("prefill-tiling-unknown", lambda e: e.prefill(block_m=16), "block_m", error=TypeError),
    case("prefill-table-entry", lambda e: e.prefill(block_tables=e.table + [[0, 10, 0], [0] * 3]),
         "block_tables[0, 1]", "13"),
    case("prefill-scale-f32", lambda e: e.prefill(scale=np.float64(3e38)), "scale", "3e+38"),
    # -- copy_blocks, host_pool, swap_blocks --------------------------------------
    case("copy-float", lambda e: pn.copy_blocks(e.cache, [[0.0, 1.0]]), "pairs", "float64"),
    case("copy-shape", lambda e: pn.copy_blocks(e.cache, [0, 1, 2]), "pairs", "(3,)"),
    case("copy-source", lambda e: pn.copy_blocks(e.cache, [(9, 1)]), "pairs[0, 0]", "9"),
    case("copy-twice", lambda e: pn.copy_blocks(e.cache, [(0, 1), (2, 1)]), "destination block 1"),
    case("copy-overlap", lambda e: pn.copy_blocks(e.cache, [(0, 2), (2, 3)]), "block 2"),
    case("copy-cache", lambda e: pn.copy_blocks(e.pool, [(0, 1)]), "cache", "HostPool",
         error=TypeError),
    case("host_pool-0", lambda e: pn.host_pool(e.cache, 0), "num_blocks", "0"),
    case("host_pool-float", lambda e: pn.host_pool(e.cache, 2.5), "num_blocks", "2.5"),
    case("host_pool-bool", lambda e: pn.host_pool(e.cache, True), "num_blocks", "True"),
    case("host_pool-int32", lambda e: pn.host_pool(e.cache, 2**62), "num_blocks", str(2**62)),
    case("copy-uint64", lambda e: pn.copy_blocks(e.cache, np.array([[U64, 2]], np.uint64)),
         "pairs[0, 0]", str(U64)),
    case("copy-empty-str", lambda e: pn.copy_blocks(e.cache, np.zeros((0, 2), str)), "pairs",
         "str"),
    case("swap-dtype", lambda e: pn.swap_blocks(e.cache, e.pool.astype(np.float16), [(0, 0)]),
         "dst", "float16"),
    case("swap-shape", lambda e: pn.swap_blocks(e.cache, e.pool[:, :1], [(0, 0)]), "dst",
         "(2, 1, 256)"),
    case("swap-host-block", lambda e: pn.swap_blocks(e.pool, e.cache, [(2, 0)]), "pairs[0, 0]",
         "2"),
    case("swap-two-caches", lambda e: pn.swap_blocks(e.cache, e.cache, [(0, 0)]), "PagedKVCache",
         error=TypeError),
    # -- page_tables, layouts -----------------------------------------------------
    case("csr-block_size", lambda e: PT.validate_csr(*CSR, 4, 16.0), "block_size", "16.0"),
    case("csr-indices-uint64", lambda e: PT.csr_to_padded(
        CSR[0], np.array([1, 3, U64], np.uint64), CSR[2], 8), "kv_indices[2]", str(U64)),
    case("csr-indices-int32", lambda e: PT.csr_to_padded(CSR[0], np.array([1, 3, 2**33]), CSR[2],
                                                         8), "kv_indices[2]", str(2**33)),
    case("csr-padded-int32", lambda e: PT.padded_to_csr(np.array([[2**40]]), [3], 8),
         "block_tables[0, 0]", str(2**40)),
    case("csr-max_blocks", lambda e: PT.csr_to_padded(*CSR, 8, max_blocks=-1), "max_blocks=-1"),
    case("csr-max_blocks-huge", lambda e: PT.csr_to_padded(*CSR, 8, max_blocks=2**40),
         "max_blocks", str(2**40)),
    case("csr-lens-wrap", lambda e: PT.seq_lens_from_csr([0, 2**61], [1], 8), "seq_lens[0]",
         str((2**61 - 1) * 8 + 1)),
    case("csr-lens-wrap-padded", lambda e: PT.csr_to_padded([0, 3], [0, 1, 2], [1], 2**62),
         "seq_lens[0]", str(2 * 2**62 + 1)),
    case("csr-lens-block_size", lambda e: PT.seq_lens_from_csr(CSR[0], CSR[2], 0), "block_size",
         "0"),
    case("layout-name", lambda e: LY.check_layout("NHD"), "layout", "'NHD'"),
    case("layout-array", lambda e: LY.check_layout(np.array(["nhd", "hnd"])), "layout",
         "array("),
    case("layout-geometry-negative", lambda e: LY.infer_geometry((-1, 2, 1, 16), (-1, 2, 1, 16),
                                                                 "nhd", "float16"),
         "num_blocks", "-1"),
    case("layout-geometry-float", lambda e: LY.infer_geometry((2.7, 2, 1, 16), (2.2, 2, 1, 16),
                                                              "hnd", "float16"),
         "key_shape[0]", "2.7"),
    case("layout-geometry-none", lambda e: LY.infer_geometry(None, None, "nhd", "float16"),
         "key_shape", "None"),
    case("layout-vllm-x", lambda e: LY.to_nhd(np.zeros((2, 1, 4, 2, 4), np.float16),
                                              np.zeros((2, 1, 16, 2), np.float16), "vllm"),
         "x = 16 // itemsize = 8", "4"),
    case("layout-vector_width-none", lambda e: LY.vector_width(None), "dtype", "None"),
    case("cache-from_device-read-only", lambda e: pn.PagedKVCache.from_device(
        _read_only((4, 2, 1, 16)), np.zeros((4, 2, 1, 16), np.float16)), "key_cache",
        "read-only"),
    case("layout-shapes-float", lambda e: LY.cache_shapes("nhd", 1.5, 8, 1, 16, "float16"),
         "num_blocks", "1.5"),
    case("layout-vector_width", lambda e: LY.vector_width("foo"), "dtype", "'foo'"),
    case("layout-v_offset", lambda e: LY.interleaved_v_offset(0, 1, 8), "block_size", "0"),
    case("layout-layered", lambda e: LY.to_nhd(np.zeros((1, 4, 1, 8)), np.zeros((1, 4, 1, 8)),
                                               "nhd", layered="no"), "layered", "'no'"),
    case("layout-geometry", lambda e: LY.infer_geometry((1, 4, 1, 8), (1, 4, 1, 9), "nhd",
                                                        "float16"), "(1, 4, 1, 9)"),
]


def _no_kernel(*args, **kwargs):
    raise AssertionError("a kernel was compiled for a call that should have been refused")


@pytest.mark.parametrize("call, error, fragments", CASES)
def test_bad_input_is_refused_before_any_launch_and_changes_nothing(monkeypatch, call, error,
                                                                    fragments):
    env = Env()
    monkeypatch.setattr(pn.blocks, "copy_blocks_kernel", _no_kernel)
    before, launches = env.state(), _launch.launch_count()
    with pytest.raises(error) as info:
        call(env)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert _launch.launch_count() == launches, "a kernel ran"
    changed = [i for i, (a, b) in enumerate(zip(before, env.state())) if not _same(a, b)]
    assert not changed, f"state entries {changed} changed"


def test_corpus_is_large_and_distinct():
    ids = [c.id for c in CASES]
    assert len(ids) >= 100 and len(set(ids)) == len(ids)
