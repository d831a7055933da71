"""Memory saved by sharing KV blocks between the sequences of one request:
parallel sampling and beam search served on the block manager (plain Python
+ NumPy, no numba, no kernels).

A request asks for ``width`` sequences from one prompt. Its prompt is
allocated once; with sharing the other sequences are
:meth:`~paged_numba.BlockManager.fork`\\ s of it, so they hold the prompt's
full blocks by reference, and the first token each appends into a shared,
partly full block copies that block (copy-on-write). Without sharing each
sequence holds its own copy of everything. The serving loop is the one of
:mod:`paged_numba.serving_sim`, in decode steps over a fixed pool of
``num_blocks`` blocks:

1. every running request advances one token (all its sequences); before it
   does, it needs one free block per sequence (the most one step can take:
   a new block at a block boundary, or the copy of a shared partial block),
   and while there are too few the most recently admitted request is
   preempted (all its blocks freed, back to the front of the queue, restarted
   from its prompt later);
2. if nobody was preempted, waiting requests are admitted first come, first
   served while their prompt and one block per sequence fit; an admitted
   request runs its prefill and its first step at once;
3. the step is measured: *physical* blocks (held by at least one sequence)
   against *logical* blocks (the sum of the sequences' table lengths, what
   the same sequences would hold without sharing);
4. sequences that have generated all their tokens are freed.

**Parallel sampling** (``mode="parallel"``): ``width`` samples of the
prompt, each with its own output length (drawn like the request's), decoded
independently: only the prompt is shared.

**Beam search** (``mode="beam"``): ``width`` beams, all as long as the
request's output. Each step every beam proposes its continuations with the
log-probabilities of a synthetic language model (a next-token distribution
drawn from a symmetric Dirichlet over ``VOCAB`` tokens with concentration
``lm_alpha``: small values make a confident model), and the ``width`` best
(beam score + token log-probability) of all candidates survive. A beam
chosen ``k`` times is forked ``k - 1`` times before it appends; a beam not
chosen is freed. So beams keep sharing the blocks of their common ancestry,
as in vLLM (Kwon et al., SOSP 2023, section 4.4).

The saving is ``1 - sum(physical) / sum(logical)`` over the saturated steps
(those where requests are still waiting: memory limits the batch), as in
the paper's Figure 15 ("blocks saved by sharing / blocks without sharing").
"""
from collections import deque

import numpy as np

from . import serving_sim
from .block_manager import BlockManager

MODES = ("parallel", "beam")
VOCAB = 64          # candidate tokens a beam proposes from (only the best ``width`` matter)
# Prompt and output lengths of the paper's two traces (Kwon et al., Figure 11:
# Alpaca input mean 19.31, output mean 58.45; ShareGPT 161.31 and 337.99 tokens),
# as log-normal distributions with those means (median * exp(sigma^2 / 2)).
DATASETS = {
    "alpaca": dict(prompt_median=16.1, prompt_sigma=0.6, output_median=39.0, output_sigma=0.9),
    "sharegpt": dict(prompt_median=97.8, prompt_sigma=1.0, output_median=245.0,
                     output_sigma=0.8),
}
MAX_LEN = 2048


def make_requests(dataset, num_requests, seed=0, max_len=MAX_LEN):
    """``(prompt_len, output_len)`` ``[num_requests, 2]`` int64 drawn like one of
    :data:`DATASETS` (``serving_sim.make_requests`` with its parameters).

    >>> r = make_requests("alpaca", 4000, seed=0)
    >>> bool(17 < r[:, 0].mean() < 22), bool(50 < r[:, 1].mean() < 65)   # means 19.3, 58.5
    (True, True)
    """
    if dataset not in DATASETS:
        raise ValueError(f"dataset must be one of {sorted(DATASETS)}, but got {dataset!r}.")
    return serving_sim.make_requests(num_requests, seed, max_len=max_len, **DATASETS[dataset])


class _Request:
    """One admitted request: its sequences (ids), tokens left per sequence, beam scores."""

    def __init__(self, index, seqs, left, scores=None):
        self.index, self.seqs, self.left, self.scores = index, seqs, left, scores


class _Server:
    """The serving loop's state: block manager, queue, running requests, counters."""

    def __init__(self, mode, width, requests, num_blocks, block_size, share, rng, lm_alpha,
                 sample_lens):
        self.mode, self.width, self.share, self.rng, self.alpha = mode, width, share, rng, lm_alpha
        self.requests, self.sample_lens = requests, sample_lens
        self.m = BlockManager(num_blocks, block_size)
        self.bs = block_size
        self.waiting = deque(range(len(requests)))
        self.running = []
        self.next_id = 0
        self.preemptions = self.copies = 0

    def _new_id(self):
        self.next_id += 1
        return self.next_id

    def _branch(self, parent):
        """A new sequence continuing ``parent``: a fork with sharing, else its own copy."""
        child = self._new_id()
        if self.share:
            self.m.fork(parent, child)
        else:
            self.m.allocate(child, self.m.seq_len(parent))
        return child

    def _append(self, seqs):
        for s in seqs:
            self.copies += len(self.m.append(s))

    def _prompt_need(self, i):
        """Blocks to admit request ``i``: its prompt (``width`` copies without
        sharing) plus one block per sequence for the first step."""
        n = -(-int(self.requests[i, 0]) // self.bs)
        return (n if self.share else self.width * n) + self.width

    def admit(self, i):
        prompt, output = (int(x) for x in self.requests[i])
        root = self._new_id()
        self.m.allocate(root, prompt)
        if self.mode == "parallel":
            seqs = [root] + [self._branch(root) for _ in range(self.width - 1)]
            req = _Request(i, seqs, [int(x) for x in self.sample_lens[i]])
            self._append(seqs)
            req.left = [n - 1 for n in req.left]
        else:
            req = _Request(i, [root], [output], np.zeros(1))
            self._beam_step(req)
            req.left = [output - 1] * len(req.seqs)
        self.running.append(req)

    def _beam_step(self, req):
        """One step of beam search: keep the ``width`` best continuations."""
        # Dirichlet(alpha) next-token distributions, by normalised gamma draws
        g = self.rng.standard_gamma(self.alpha, size=(len(req.seqs), VOCAB)) + 1e-300
        logp = np.log(g / g.sum(axis=1, keepdims=True))
        cand = (req.scores[:, None] + logp).ravel()
        best = np.argpartition(-cand, self.width - 1)[:self.width]
        parents = best // VOCAB
        counts = np.bincount(parents, minlength=len(req.seqs))
        seqs, scores = [], []
        for b, seq in enumerate(req.seqs):          # the beams nobody chose leave first
            if counts[b] == 0:
                self.m.free(seq)
        for b, seq in enumerate(req.seqs):          # forks, from the parent's state
            chosen = cand[best[parents == b]]
            for j in range(counts[b]):
                seqs.append(seq if j == 0 else self._branch(seq))
                scores.append(chosen[j])
        self._append(seqs)
        req.seqs, req.scores = seqs, np.array(scores)

    def step_need(self, req):
        """Free blocks a step of ``req`` may take: one a sequence after it (a new
        block at a boundary, or the copy of a shared partial block). A beam that
        replaces one nobody chose takes the blocks that one frees."""
        return len(req.seqs) if self.mode == "parallel" else self.width

    def step_request(self, req):
        if self.mode == "parallel":
            self._append(req.seqs)
        else:
            self._beam_step(req)
        req.left = [n - 1 for n in req.left]

    def preempt(self):
        req = self.running.pop()
        for s in req.seqs:
            self.m.free(s)
        self.waiting.appendleft(req.index)
        self.preemptions += 1

    def retire(self):
        for req in self.running:
            done = [s for s, n in zip(req.seqs, req.left) if n <= 0]
            for s in done:
                self.m.free(s)
            keep = [n > 0 for n in req.left]
            req.seqs = [s for s, k in zip(req.seqs, keep) if k]
            req.left = [n for n, k in zip(req.left, keep) if k]
        self.running = [r for r in self.running if r.seqs]


def simulate(mode, width, requests, num_blocks, block_size=16, share=True, seed=0,
             lm_alpha=0.1, max_len=MAX_LEN):
    """Serve ``requests`` with ``width`` sequences each on ``num_blocks`` blocks;
    report the memory that sharing saves.

    Parameters
    ----------
    mode : {"parallel", "beam"}
    width : int
        Samples (parallel sampling) or beams (beam search) per request (>= 1).
    requests : array of int, ``[num_requests, 2]``
        ``(prompt_len, output_len)`` in arrival (FCFS) order, all waiting at step 0.
    num_blocks, block_size : int
        The pool (every request must fit it alone).
    share : bool
        Fork with shared blocks and copy-on-write (True), or give every
        sequence its own copy (False).
    seed : int
        Random state of the samples' output lengths and the beam search's
        language model.
    lm_alpha : float
        Concentration of the beam search's next-token distributions.
    max_len : int
        Samples' output lengths are clipped to ``max_len - prompt_len``.

    Returns
    -------
    dict
        ``saving`` (1 - physical / logical blocks, saturated steps),
        ``mean_physical_blocks``, ``mean_logical_blocks``, ``mean_running``
        (requests), ``mean_seqs``, ``steps``, ``preemptions``, ``cow_copies``
        (blocks copied on write), ``window`` and ``window_steps``.

    Examples
    --------
    One request, a 40-token prompt (2 full blocks of 16 + 8 tokens), 2 samples
    of 1 token each: during its one step the samples hold 41 tokens, 3 blocks
    each; the 2 full prompt blocks are shared and the partial one was copied:

    >>> r = simulate("parallel", 2, [[40, 1]], num_blocks=16, seed=0)
    >>> r["mean_logical_blocks"], r["mean_physical_blocks"], r["cow_copies"]
    (6.0, 4.0, 1)
    >>> round(r["saving"], 4)                                # 1 - 4 / 6
    0.3333
    >>> simulate("parallel", 2, [[40, 1]], num_blocks=16, share=False)["saving"]
    0.0
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, but got {mode!r}.")
    if isinstance(width, bool) or not isinstance(width, (int, np.integer)) or width < 1:
        raise ValueError(f"width must be a positive int, but got {width!r}.")
    req = np.asarray(requests, dtype=np.int64).reshape(-1, 2)
    rng = np.random.default_rng(seed)
    # each sample's own output length, drawn around the request's (log-normal, sigma 0.5)
    jitter = np.exp(0.5 * rng.standard_normal((len(req), width)))
    samples = np.clip(np.rint(req[:, 1:2] * jitter), 1, max_len - req[:, :1]).astype(np.int64)
    if mode == "beam" or width == 1:
        samples[:] = req[:, 1:2]
    srv = _Server(mode, int(width), req, num_blocks, block_size, bool(share), rng, lm_alpha,
                  samples)
    longest = max((srv._prompt_need(i) + int(width) * -(-int(samples[i].max()) // block_size)
                   for i in range(len(req))), default=0)
    if longest > num_blocks:
        raise ValueError(f"a request needs up to {longest} blocks alone, but num_blocks is "
                         f"{num_blocks}.")
    totals = {w: dict(physical=0, logical=0, running=0, seqs=0, steps=0)
              for w in ("saturated", "all")}
    steps = 0
    while srv.waiting or srv.running:
        steps += 1
        # -- 1. advance the running requests, preempting the newest while blocks run short
        preempted = False
        i = 0
        while i < len(srv.running):
            req_i = srv.running[i]
            while srv.m.num_available_blocks < srv.step_need(req_i):
                preempted = True
                srv.preempt()
                if req_i not in srv.running:
                    break
            if req_i in srv.running:
                srv.step_request(req_i)
                i += 1
        # -- 2. admit FCFS while the head of the queue fits
        while srv.waiting and not preempted:
            head = srv.waiting[0]
            if srv._prompt_need(head) > srv.m.num_available_blocks:
                break
            srv.waiting.popleft()
            srv.admit(head)
        # -- 3. measure
        physical = srv.m.num_owned_blocks
        logical = sum(-(-srv.m.seq_len(s) // block_size) for r in srv.running for s in r.seqs)
        for w in ("saturated", "all") if srv.waiting else ("all",):
            t = totals[w]
            t["steps"] += 1
            t["physical"] += physical
            t["logical"] += logical
            t["running"] += len(srv.running)
            t["seqs"] += sum(len(r.seqs) for r in srv.running)
        # -- 4. retire finished sequences
        srv.retire()
    name = "saturated" if totals["saturated"]["steps"] else "all"
    t = totals[name]
    n = max(t["steps"], 1)
    return dict(saving=1 - t["physical"] / t["logical"] if t["logical"] else 0.0,
                mean_physical_blocks=t["physical"] / n, mean_logical_blocks=t["logical"] / n,
                mean_running=t["running"] / n, mean_seqs=t["seqs"] / n, steps=steps,
                preemptions=srv.preemptions, cow_copies=srv.copies, window=name,
                window_steps=t["steps"])
