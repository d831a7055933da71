"""State machine for the block manager (plain Python): ``BlockManager``
driven by random valid and invalid calls, checked against a model written here.

The model predicts every result exactly from the documented rules: free
blocks are taken from the front of the free list and returned to its back,
last logical block first; a new block comes from the free list first, then
from the least recently used evictable cached block; a full block of a
prompt is cached under its whole token prefix (and extra key), first block
to fill a prefix wins; a lookup reuses the longest cached run of full prompt
blocks, never the block of the last token.

The test plays the caller: it writes each new token into its slot (only into
blocks held by one sequence), makes the copies that copy-on-write and
swapping return, and after every step reads every sequence back through its
table. A call with a bad argument must raise ``ValueError``/``TypeError``
naming the argument, and any failed call must leave the bookkeeping exactly
as it was (a deep snapshot).
"""
from collections import OrderedDict, deque

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from paged_numba.allocator import OutOfBlocksError
from paged_numba.block_manager import BlockManager
from test_bookkeeping_machines import BAD_COUNTS, BAD_POSITIONS, UNHASHABLE, ceil_div, expect_unchanged

PROMPTS = [(), (1, 2, 3, 4, 5, 6), (1, 2, 3, 4, 0, 0), (7, 7, 7)]


class ManagerMachine(RuleBasedStateMachine):
    """The model: the device and host free lists (deques), the tables, the
    tokens of every sequence, the prefix cache as ``{(extra_key, token
    prefix): block}`` and its LRU evictable set; reference counts are counted
    from the model's tables. ``dev``/``host`` are the pools' contents (one
    token per slot), written by the test as a caller would."""

    @initialize(num_blocks=st.integers(1, 9), block_size=st.sampled_from([1, 2, 3]),
                caching=st.booleans(), num_host=st.integers(0, 6))
    def setup(self, num_blocks, block_size, caching, num_host):
        self.m = BlockManager(num_blocks, block_size, enable_prefix_caching=caching, num_host_blocks=num_host)
        self.nb, self.bs, self.caching, self.nh = num_blocks, block_size, caching, num_host
        self.free, self.host_free = deque(range(num_blocks)), deque(range(num_host))
        self.tables: dict[int, list[int]] = {}       # resident sequences
        self.host_tables: dict[int, list[int]] = {}  # swapped-out sequences
        self.tokens: dict[int, list[int]] = {}
        self.tracked: dict[int, bool] = {}           # takes part in prefix caching
        self.extra: dict[int, object] = {}
        self.cache: dict[tuple, int] = {}            # (extra_key, prefix tokens) -> block
        self.prefix_of: dict[int, tuple] = {}        # block -> its cache entry
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.dev = [[None] * block_size for _ in range(num_blocks)]
        self.host = [[None] * block_size for _ in range(num_host)]
        self.next_id = 0

    # -- model ---
    def _new_id(self):
        self.next_id += 1
        return self.next_id

    def ref(self, b):
        return sum(t.count(b) for t in self.tables.values())

    def _available(self, reused=()):
        return len(self.free) + len(self.lru) - sum(b in self.lru for b in reused)

    def _take(self, n):
        out = []
        for _ in range(n):
            if self.free:
                out.append(self.free.popleft())
            else:                                     # evict the least recently used cached block
                b, _ = self.lru.popitem(last=False)
                del self.cache[self.prefix_of.pop(b)]
                out.append(b)
        return out

    def _claim(self, blocks):
        for b in blocks:
            self.lru.pop(b, None)

    def _drop(self, blocks):
        """The references of ``blocks`` are gone, last logical block first."""
        for b in reversed(blocks):
            if self.ref(b) == 0:
                if b in self.prefix_of:
                    self.lru[b] = None
                else:
                    self.free.append(b)

    def _prefix(self, seq, i):
        return (self.extra[seq], tuple(self.tokens[seq][:(i + 1) * self.bs]))

    def _register(self, seq, block, i):
        p = self._prefix(seq, i)
        if p not in self.cache:
            self.cache[p], self.prefix_of[block] = block, p

    def _write(self, seq, positions):
        table, bs = self.m.blocks_of(seq), self.bs
        for t in positions:
            b = table[t // bs]
            assert self.m.ref_count(b) == 1, f"block {b} written while shared"
            self.dev[b][t % bs] = self.tokens[seq][t]

    def _resident(self, data):
        return data.draw(st.sampled_from(sorted(self.tables)))

    # -- valid calls ---
    @rule(prompt=st.sampled_from(PROMPTS), suffix=st.lists(st.integers(0, 2), max_size=5),
          use_ids=st.booleans(), as_numpy=st.booleans(), extra=st.sampled_from([None, "x"]))
    def allocate(self, prompt, suffix, use_ids, as_numpy, extra):
        seq, tokens = self._new_id(), list(prompt) + suffix
        n, bs = len(tokens), self.bs
        ids = (np.array(tokens, dtype=np.int64) if as_numpy else tokens) if use_ids else None
        tracked = self.caching and use_ids
        hits = []
        if tracked:
            self.tokens[seq], self.extra[seq] = tokens, extra
            for i in range((n - 1) // bs if n else 0):
                if self._prefix(seq, i) not in self.cache:
                    break
                hits.append(self.cache[self._prefix(seq, i)])
        new = ceil_div(n, bs) - len(hits)
        fits = new <= self._available(hits)
        assert self.m.can_allocate(n, ids, extra) == fits
        if not fits:
            self.tokens.pop(seq, None), self.extra.pop(seq, None)
            return expect_unchanged(self.m, lambda: self.m.allocate(seq, n, ids, extra), OutOfBlocksError,
                                    f"needs {new} new blocks")
        self._claim(hits)
        table = hits + self._take(new)
        assert self.m.allocate(seq, n, token_ids=ids, extra_key=extra) == (table, len(hits) * bs)
        self.tables[seq], self.tokens[seq], self.tracked[seq], self.extra[seq] = table, tokens, tracked, extra
        if tracked:
            for i in range(len(hits), n // bs):
                self._register(seq, table[i], i)
        for t in range(len(hits) * bs):              # reused blocks already hold the prompt
            assert self.dev[table[t // bs]][t % bs] == tokens[t]
        self._write(seq, range(len(hits) * bs, n))

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def fork(self, data):
        parent, child = self._resident(data), self._new_id()
        self.m.fork(parent, child)
        self.tables[child] = list(self.tables[parent])
        self.tokens[child] = list(self.tokens[parent])
        self.tracked[child], self.extra[child] = self.tracked[parent], self.extra[parent]

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), new_tokens=st.lists(st.integers(0, 2), max_size=4), slots=st.booleans())
    def append(self, data, new_tokens, slots):
        seq = self._resident(data)
        k, old, bs, table = len(new_tokens), len(self.tokens[seq]), self.bs, self.tables[seq]
        ids = new_tokens if self.tracked[seq] else None
        cow = k > 0 and old % bs != 0 and self.ref(table[-1]) > 1
        new = ceil_div(old + k, bs) - len(table) + cow
        fits = new <= self._available()
        assert self.m.can_append(seq, k) == fits
        if not fits:
            return expect_unchanged(self.m, lambda: self.m.append(seq, k, ids), OutOfBlocksError)
        fresh = self._take(new)
        expected_copies = []
        if cow:
            src, dst = table[-1], fresh.pop(0)
            table[-1] = dst
            expected_copies = [(src, dst)]
        table += fresh
        if slots:
            got_slots, copies = self.m.append_slots(seq, k, token_ids=ids)
        else:
            copies = self.m.append(seq, k, token_ids=ids)
        assert copies == expected_copies
        for src, dst in copies:                      # from a shared block to a fresh private one
            assert self.m.ref_count(src) >= 1 and self.m.ref_count(dst) == 1 and self.ref(dst) == 1
            assert src not in self.tables[seq] and dst not in self.free and dst not in self.lru
            self.dev[dst] = list(self.dev[src])
        self.tokens[seq] += new_tokens
        if self.tracked[seq]:
            for i in range(old // bs, (old + k) // bs):
                self._register(seq, table[i], i)
        if slots:
            pos = np.arange(old, old + k)
            np.testing.assert_array_equal(got_slots, np.array(table, np.int64)[pos // bs] * bs + pos % bs)
        self._write(seq, range(old, old + k))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.m.free(seq)
        if seq in self.host_tables:
            self.host_free.extend(self.host_tables.pop(seq))
        else:
            self._drop(self.tables.pop(seq))
        del self.tokens[seq], self.tracked[seq], self.extra[seq]

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def swap_out(self, data):
        seq = self._resident(data)
        table = self.tables[seq]
        fits = len(table) <= len(self.host_free)
        assert self.m.can_swap_out(seq) == fits
        if not fits:
            return expect_unchanged(self.m, lambda: self.m.swap_out(seq), OutOfBlocksError,
                                    f"needs {len(table)} host blocks")
        host = [self.host_free.popleft() for _ in table]
        assert self.m.swap_out(seq) == list(zip(table, host))
        for d, h in zip(table, host):
            self.host[h] = list(self.dev[d])
        self.host_tables[seq] = host
        self._drop(self.tables.pop(seq))

    @precondition(lambda self: self.host_tables)
    @rule(data=st.data())
    def swap_in(self, data):
        seq = data.draw(st.sampled_from(sorted(self.host_tables)))
        host = self.host_tables[seq]
        full = len(self.tokens[seq]) // self.bs if self.tracked[seq] else 0
        hits = [self.cache.get(self._prefix(seq, i)) if i < full else None for i in range(len(host))]
        reused = [b for b in hits if b is not None]
        new = len(host) - len(reused)
        fits = new <= self._available(reused)
        assert self.m.can_swap_in(seq) == fits
        if not fits:
            return expect_unchanged(self.m, lambda: self.m.swap_in(seq), OutOfBlocksError,
                                    f"needs {new} new blocks")
        self._claim(reused)
        fresh = iter(self._take(new))
        table, expected = [], []
        for i, (h, b) in enumerate(zip(host, hits)):
            if b is None:
                b = next(fresh)
                expected.append((h, b))
            table.append(b)
        assert self.m.swap_in(seq) == expected
        self.tables[seq] = table
        for i, b in enumerate(table):
            if hits[i] is None and i < full:
                self._register(seq, b, i)
        for h, d in expected:
            self.dev[d] = list(self.host[h])
        self.host_free.extend(self.host_tables.pop(seq))

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def slot_mapping(self, data):
        seq = self._resident(data)
        n = len(self.tokens[seq])
        start, end = data.draw(st.integers(-1, n + 1)), data.draw(st.integers(-1, n + 1))
        if not 0 <= start <= end <= n:
            return expect_unchanged(self.m, lambda: self.m.slot_mapping(seq, start, end), ValueError,
                                    f"start={start}, end={end}, seq_len={n}")
        want = [self.tables[seq][t // self.bs] * self.bs + t % self.bs for t in range(start, end)]
        assert self.m.slot_mapping(seq, start, end).tolist() == want

    # -- invalid calls ---
    @rule(data=st.data(), kind=st.sampled_from(["unhashable_seq_id", "wrong_seq_id", "token_ids", "count", "extra_key",
                                                "wrong_token_count", "position", "append_without_token_ids"]))
    def bad_call(self, data, kind):
        """One call with a bad argument (one rule, so that valid calls get most steps)."""
        getattr(self, f"_bad_{kind}")(data)

    def _bad_unhashable_seq_id(self, data):
        bad = data.draw(st.sampled_from(UNHASHABLE))
        op = data.draw(st.sampled_from(["allocate", "fork-parent", "fork-child", "append", "append_slots", "free",
                                        "swap_out", "swap_in", "seq_len", "token_ids", "slot_mapping", "blocks_of",
                                        "can_append", "can_swap_out", "can_swap_in", "is_swapped", "host_blocks_of",
                                        "block_table", "seq_lens"]))
        m = self.m
        other = sorted(self.tables)[0] if self.tables else self._new_id()
        name = {"fork-parent": "parent", "fork-child": "child"}.get(op, "seq_id")
        calls = {"allocate": lambda: m.allocate(bad, 1), "fork-parent": lambda: m.fork(bad, self._new_id()),
                 "fork-child": lambda: m.fork(other, bad), "append": lambda: m.append(bad),
                 "append_slots": lambda: m.append_slots(bad), "free": lambda: m.free(bad),
                 "swap_out": lambda: m.swap_out(bad), "swap_in": lambda: m.swap_in(bad),
                 "seq_len": lambda: m.seq_len(bad), "token_ids": lambda: m.token_ids(bad),
                 "slot_mapping": lambda: m.slot_mapping(bad, 0, 0), "blocks_of": lambda: m.blocks_of(bad),
                 "can_append": lambda: m.can_append(bad), "can_swap_out": lambda: m.can_swap_out(bad),
                 "can_swap_in": lambda: m.can_swap_in(bad), "is_swapped": lambda: m.is_swapped(bad),
                 "host_blocks_of": lambda: m.host_blocks_of(bad), "block_table": lambda: m.block_table([bad]),
                 "seq_lens": lambda: m.seq_lens([bad])}
        if op == "fork-child" and not self.tables:
            return
        expect_unchanged(m, calls[op], ValueError, f"{name} must be hashable")
        assert bad not in m

    def _bad_wrong_seq_id(self, data):
        op = data.draw(st.sampled_from(["append", "fork", "free", "swap_out", "swap_in", "seq_len", "slot_mapping",
                                        "allocate-taken", "fork-taken", "swap_in-resident", "swapped-append",
                                        "swapped-fork", "block_table-str"]))
        m, new = self.m, self._new_id()
        unknown = {"append": lambda: m.append(new), "fork": lambda: m.fork(new, self._new_id()),
                   "free": lambda: m.free(new), "swap_out": lambda: m.swap_out(new),
                   "swap_in": lambda: m.swap_in(new), "seq_len": lambda: m.seq_len(new),
                   "slot_mapping": lambda: m.slot_mapping(new, 0, 0)}
        if op in unknown:
            return expect_unchanged(m, unknown[op], ValueError, f"unknown sequence id {new!r}")
        if op == "block_table-str":
            return expect_unchanged(m, lambda: m.block_table("ab"), ValueError, "seq_ids must be a list")
        if op.startswith("swapped-"):
            if not self.host_tables:
                return
            s = data.draw(st.sampled_from(sorted(self.host_tables)))
            call = (lambda: m.append(s, 1, [0])) if op == "swapped-append" else (lambda: m.fork(s, new))
            return expect_unchanged(m, call, ValueError, f"{s!r} is swapped out")
        if not self.tables:
            return
        s = self._resident(data)
        if op == "allocate-taken":
            return expect_unchanged(m, lambda: m.allocate(s, 0), ValueError, f"{s!r} is already allocated")
        if op == "fork-taken":
            return expect_unchanged(m, lambda: m.fork(s, s), ValueError, f"{s!r} is already allocated")
        expect_unchanged(m, lambda: m.swap_in(s), ValueError, f"{s!r} is not swapped out")

    def _bad_token_ids(self, data):
        bad = data.draw(st.sampled_from([[1.5, 2.0], np.array([1.0, 2.0]), np.array([[1], [2]]), [True, 1], "ab",
                                         12, [1, None], np.array([True, False])]))
        op = data.draw(st.sampled_from(["allocate", "can_allocate", "append"]))
        m = self.m
        n = 2 if not isinstance(bad, (str, int)) else 1
        if op == "allocate":
            return expect_unchanged(m, lambda: m.allocate(self._new_id(), n, token_ids=bad), TypeError,
                                    "token_ids")
        if op == "can_allocate":
            return expect_unchanged(m, lambda: m.can_allocate(n, token_ids=bad), TypeError, "token_ids")
        if self.tables:
            s = self._resident(data)
            if m.can_append(s, n):
                expect_unchanged(m, lambda: m.append(s, n, token_ids=bad), TypeError, "token_ids")

    def _bad_count(self, data):
        bad = data.draw(st.sampled_from(BAD_COUNTS))
        op = data.draw(st.sampled_from(["allocate", "append", "slots"]))
        m = self.m
        if op == "allocate":
            return expect_unchanged(m, lambda: m.allocate(self._new_id(), bad), ValueError, "num_tokens")
        if self.tables:
            s = self._resident(data)
            call = (lambda: m.append(s, bad)) if op == "append" else (lambda: m.append_slots(s, bad))
            expect_unchanged(m, call, ValueError, "num_new_tokens")

    def _bad_extra_key(self, data):
        extra = data.draw(st.sampled_from([[1], {"k": 2}]))
        expect_unchanged(self.m, lambda: self.m.allocate(self._new_id(), 1, [0], extra), ValueError,
                         "extra_key must be hashable")

    def _bad_wrong_token_count(self, data):
        bad = data.draw(st.sampled_from([2, 0, 5]))
        m = self.m
        if self.tables and data.draw(st.booleans()):
            s = self._resident(data)
            return expect_unchanged(m, lambda: m.append(s, 1, token_ids=[0] * bad),
                                    (ValueError, OutOfBlocksError))
        expect_unchanged(m, lambda: m.allocate(self._new_id(), 1, token_ids=[0] * bad), ValueError,
                         f"token_ids must have 1 entries .* got {bad}")

    def _bad_position(self, data):
        if not self.tables:
            return
        bad = data.draw(st.sampled_from(BAD_POSITIONS))
        which = data.draw(st.sampled_from(["start", "end"]))
        s = self._resident(data)
        args = (bad, len(self.tokens[s])) if which == "start" else (0, bad)
        expect_unchanged(self.m, lambda: self.m.slot_mapping(s, *args), ValueError, f"{which} must be an integer")

    def _bad_append_without_token_ids(self, data):
        if not any(self.tracked[s] for s in self.tables):
            return
        s = data.draw(st.sampled_from(sorted(s for s in self.tables if self.tracked[s])))
        if self.m.can_append(s, 1):
            expect_unchanged(self.m, lambda: self.m.append(s, 1), ValueError, "token_ids=None")

    # -- invariants ---
    @invariant()
    def counts_match_tables(self):
        m = self.m
        for b in range(self.nb):
            assert m.ref_count(b) == self.ref(b), f"block {b}"
        assert m.num_shared_blocks == sum(self.ref(b) > 1 for b in range(self.nb))

    @invariant()
    def pools_match_model(self):
        m = self.m
        assert list(m.free_block_ids) == list(self.free)
        assert m.cached_block_ids == list(self.lru)
        assert list(m.free_host_block_ids) == list(self.host_free)
        owned = {b for t in self.tables.values() for b in t}
        assert sorted(list(self.free) + list(self.lru) + sorted(owned)) == list(range(self.nb))
        assert m.num_free_blocks + m.num_cached_blocks + m.num_owned_blocks == self.nb
        assert m.num_owned_blocks == len(owned)
        swapped = [h for t in self.host_tables.values() for h in t]
        assert sorted(swapped + list(self.host_free)) == list(range(self.nh))
        assert m.num_free_host_blocks + m.num_swapped_blocks == self.nh

    @invariant()
    def tables_cover_their_tokens(self):
        m, bs = self.m, self.bs
        assert m.seq_ids == list(self.tables) and m.swapped_seq_ids == list(self.host_tables)
        for s, tokens in self.tokens.items():
            assert m.seq_len(s) == len(tokens)
            assert m.token_ids(s) == (tokens if self.tracked[s] else None)
            if s in self.host_tables:
                table, pool = m.host_blocks_of(s), self.host
                assert table == self.host_tables[s]
            else:
                table, pool = m.blocks_of(s), self.dev
                assert table == self.tables[s]
            assert len(table) == ceil_div(len(tokens), bs)
            assert [pool[table[t // bs]][t % bs] for t in range(len(tokens))] == tokens, f"sequence {s}"
        np.testing.assert_array_equal(m.seq_lens(), [len(self.tokens[s]) for s in self.tables])

    @invariant()
    def slots_collide_only_in_shared_blocks(self):
        m, bs = self.m, self.bs
        users: dict[int, list[tuple[int, int]]] = {}
        for s in self.tables:
            for t, slot in enumerate(m.slot_mapping(s, 0, len(self.tokens[s])).tolist()):
                users.setdefault(slot, []).append((s, t))
        for slot, who in users.items():
            if len(who) > 1:
                b = slot // bs
                assert m.ref_count(b) >= len({s for s, _ in who}), f"slot {slot} of an unshared block"
                assert len({t for _, t in who}) == 1        # same logical position in every holder
        for b in range(self.nb):                           # a shared block is full, or the same
            holders = [s for s, t in self.tables.items() if b in t]   # last block of equal-length holders
            if len(holders) > 1:
                fills = {min(bs, len(self.tokens[s]) - self.tables[s].index(b) * bs) for s in holders}
                index = {self.tables[s].index(b) for s in holders}
                assert len(index) == 1 and (fills == {bs} or len(fills) == 1)

    @invariant()
    def cache_holds_whole_prefixes(self):
        m, bs = self.m, self.bs
        got = {b: key[1] for key, b in m.prefix_cache.items()}
        want = {b: p[1][-bs:] for p, b in self.cache.items()}
        assert got == want
        for p, b in self.cache.items():                    # the block holds its prefix's last tokens
            assert tuple(self.dev[b]) == p[1][-bs:]
        if not self.caching:
            assert not got and not m.cached_block_ids
        assert 0.0 <= m.hit_rate <= 1.0


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
