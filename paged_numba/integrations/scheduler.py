"""Which tokens each step of the continuous-batching loop runs (plain Python and NumPy).

:class:`Scheduler` keeps the requests (:class:`Request`) waiting, running and
finished, takes their blocks from a :class:`paged_numba.BlockAllocator`, and
gives each step as a :class:`Step`: the packed token ids, positions, cache
slots, ``cu_seqlens_q``, ``seq_lens`` and block tables that the model's
forward and the kernels need. :mod:`paged_numba.integrations.hf_loop` runs
the steps on a transformers model.
"""
from collections import deque
from dataclasses import dataclass

import numpy as np

from .. import _checks as C
from ..allocator import num_blocks_for, padded_block_table


@dataclass
class Request:
    """One request: its tokens so far (prompt, then generated) and how many
    of them have their keys and values in the cache."""
    index: int
    tokens: list
    prompt_len: int
    num_computed: int = 0

    @property
    def generated(self):
        return self.tokens[self.prompt_len:]

    @property
    def num_pending(self):
        """Tokens still to run through the model (1 while decoding)."""
        return len(self.tokens) - self.num_computed


@dataclass
class Step:
    """The batch of one forward pass: ``num_seqs`` requests, ``num_tokens``
    query rows packed request after request.

    Attributes
    ----------
    requests : list of Request, ``[num_seqs]``
    input_ids, positions, slot_mapping : numpy.ndarray of int64, ``[num_tokens]``
        Token ids, their positions in their sequences, their cache slots.
    cu_seqlens_q : numpy.ndarray of int32, ``[num_seqs + 1]``
    seq_lens : numpy.ndarray of int32, ``[num_seqs]``
        Tokens in the cache once this step's are written.
    block_tables : numpy.ndarray of int32, ``[num_seqs, max_blocks]``
    sample_rows : numpy.ndarray of int64, ``[num_samples]``
        Rows whose logits give a request its next token (the last row of a
        request whose pending tokens all run in this step).
    sampled : list of Request, ``[num_samples]``
    """
    requests: list
    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    cu_seqlens_q: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray
    sample_rows: np.ndarray
    sampled: list

    @property
    def q_lens(self):
        return np.diff(self.cu_seqlens_q)


class Scheduler:
    """Chooses the tokens of each step: decoding requests first (one token
    each), then chunks of the prompts in progress, then new requests, within
    ``max_batch_tokens`` tokens and ``max_num_seqs`` requests a step.

    Parameters
    ----------
    prompts : list of list of int
        Token ids of each request's prompt (each non-empty).
    max_new_tokens : int
        Tokens to generate per request (fewer if it emits an ``eos_token_ids`` token).
    allocator : BlockAllocator
        The cache's block bookkeeping; request ``i`` is sequence id ``i``.
    chunk_size : int
        Most prompt tokens of one request in a step.
    max_batch_tokens : int
        Most tokens in a step.
    max_num_seqs : int, optional
        Most requests running at once (default: no limit).
    eos_token_ids : collection of int
        Tokens that end a request (kept in its output).

    Examples
    --------
    >>> from paged_numba import BlockAllocator
    >>> s = Scheduler([[5, 6, 7, 8, 9], [3]], max_new_tokens=2,
    ...               allocator=BlockAllocator(num_blocks=4, block_size=4),
    ...               chunk_size=3, max_batch_tokens=4)
    >>> step = s.schedule()              # 3 prompt tokens of request 0, the prompt of request 1
    >>> step.cu_seqlens_q.tolist(), step.positions.tolist(), step.sample_rows.tolist()
    ([0, 3, 4], [0, 1, 2, 0], [3])
    >>> s.complete(step, [42])           # request 1 got its first token
    >>> step = s.schedule()              # request 1 decodes; request 0's last 2 prompt tokens
    >>> [r.index for r in step.requests], step.q_lens.tolist(), step.seq_lens.tolist()
    ([1, 0], [1, 2], [2, 5])
    >>> step.slot_mapping.tolist()       # request 1: block 1 offset 1; request 0: 3, block 2 offset 0
    [5, 3, 8]
    """

    def __init__(self, prompts, max_new_tokens, allocator, chunk_size, max_batch_tokens,
                 max_num_seqs=None, eos_token_ids=()):
        self.max_new_tokens = C.integer("max_new_tokens", max_new_tokens, lo=0)
        self.chunk_size = C.integer("chunk_size", chunk_size, lo=1)
        self.max_batch_tokens = C.integer("max_batch_tokens", max_batch_tokens, lo=1)
        self.max_num_seqs = (None if max_num_seqs is None
                             else C.integer("max_num_seqs", max_num_seqs, lo=1))
        self.allocator = allocator
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.waiting = deque()
        for i, prompt in enumerate(prompts):
            prompt = [int(t) for t in C.int_array(f"prompts[{i}]", prompt, ndim=1,
                                                  lo=0, hi=C.INT64_MAX, dtype=np.int64)]
            if not prompt:
                raise ValueError(f"prompts[{i}] is empty; every prompt needs a token.")
            need = num_blocks_for(len(prompt) + self.max_new_tokens, allocator.block_size)
            if need > allocator.num_blocks:
                raise ValueError(f"prompts[{i}] ({len(prompt)} tokens) plus max_new_tokens="
                                 f"{self.max_new_tokens} need {need} blocks of "
                                 f"{allocator.block_size}, but the cache has "
                                 f"{allocator.num_blocks}.")
            self.waiting.append(Request(i, prompt, len(prompt)))
        self.running = []
        self.finished = {}
        self._pending = []              # (request, tokens) of the step in flight
        self.num_steps = self.num_preemptions = self.num_mixed_steps = 0
        if self.max_new_tokens == 0:          # nothing to generate
            self.finished = {r.index: [] for r in self.waiting}
            self.waiting.clear()

    def has_work(self):
        return bool(self.waiting or self.running)

    # -- choosing a step

    def schedule(self):
        """The next :class:`Step` (blocks for its tokens taken from the allocator)."""
        while True:
            rows = self._rows()
            if rows:
                return self._step(rows)
            if not self.running:
                raise RuntimeError("no request can be scheduled (the cache is too small).")
            self._preempt(self.running[-1])   # every running request is stuck: make room

    def _rows(self):
        rows, budget = [], self.max_batch_tokens
        scheduled = set()
        # decoding requests first, then prompts in progress (sorted is stable: oldest first)
        for req in sorted(self.running, key=lambda r: r.num_pending > 1):
            if budget == 0:
                break
            if req not in self.running:        # preempted while this step was planned
                continue
            n = min(req.num_pending, self.chunk_size, budget)
            if req.num_pending == 1:           # decoding: preempt the newest others for a block
                while not self.allocator.can_append(req.index, 1):
                    victims = [r for r in self.running if r is not req and r.index not in scheduled]
                    if not victims:
                        break
                    self._preempt(victims[-1])
                n = n if self.allocator.can_append(req.index, 1) else 0
            else:                              # a prompt chunk: as much as fits
                n = min(n, self._room(req))
            if n:
                self.allocator.append(req.index, n)
                rows.append((req, n))
                scheduled.add(req.index)
                budget -= n
        while (self.waiting and budget and
               (self.max_num_seqs is None or len(self.running) < self.max_num_seqs)):
            req = self.waiting[0]
            n = min(req.num_pending, self.chunk_size, budget)
            if not self.allocator.can_allocate(n):
                break
            self.waiting.popleft()
            self.allocator.allocate(req.index, n)
            self.running.append(req)
            rows.append((req, n))
            budget -= n
        return rows

    def _room(self, req):
        """Tokens ``req`` can add without taking more blocks than are free."""
        a = self.allocator
        spare = len(a.blocks_of(req.index)) * a.block_size - a.seq_len(req.index)
        return spare + a.num_free_blocks * a.block_size

    def _preempt(self, req):
        """Give ``req``'s blocks back; it waits at the front and computes its
        tokens again when it returns."""
        self.allocator.free(req.index)
        self.running.remove(req)
        req.num_computed = 0
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def _step(self, rows):
        ids, positions, slots, cu, lens, sample_rows, sampled = [], [], [], [0], [], [], []
        for req, n in rows:
            start = req.num_computed
            ids += req.tokens[start:start + n]
            positions += range(start, start + n)
            slots.append(self.allocator.slot_mapping(req.index, start, start + n))
            cu.append(cu[-1] + n)
            lens.append(start + n)
            if start + n == len(req.tokens):
                sample_rows.append(cu[-1] - 1)
                sampled.append(req)
        requests = [req for req, _ in rows]
        tables = padded_block_table([self.allocator.blocks_of(r.index) for r in requests])
        self._pending = rows
        return Step(requests, np.asarray(ids, np.int64), np.asarray(positions, np.int64),
                    np.concatenate(slots).astype(np.int64), np.asarray(cu, np.int32),
                    np.asarray(lens, np.int32), tables, np.asarray(sample_rows, np.int64),
                    sampled)

    # -- after the forward

    def complete(self, step, next_tokens):
        """Record a step's results: ``next_tokens`` ``[num_samples]`` are the
        tokens picked for ``step.sampled``. Finished requests leave (their
        blocks go back to the allocator)."""
        for req, n in self._pending:
            req.num_computed += n
        for req, token in zip(step.sampled, next_tokens, strict=True):
            req.tokens.append(int(token))
            if len(req.generated) >= self.max_new_tokens or int(token) in self.eos_token_ids:
                self.allocator.free(req.index)
                self.running.remove(req)
                self.finished[req.index] = req.generated
        q_lens = step.q_lens
        self.num_mixed_steps += bool((q_lens == 1).any() and (q_lens > 1).any())
        self.num_steps += 1
