"""Prefix caching in serving: requests whose prompts start alike, served on the
block manager with its prefix cache on or off (plain Python + NumPy, no
numba, no kernels).

Two kinds of trace (:func:`make_trace`):

* ``"system-<L>"``: every request is one of :data:`NUM_SYSTEM_PROMPTS`
  system prompts of ``L`` tokens (drawn uniformly), then a user message of
  its own, then an output; all waiting at step 0;
* ``"chat"``: conversations of several turns; turn ``t``'s prompt is the
  whole conversation so far (every earlier message and answer) and a new
  user message, and it joins the back of the queue when turn ``t - 1`` has
  finished. :func:`simulate`'s ``users`` conversations are under way at a
  time: when one ends, the next one's first turn is queued.

Token ids are unique except where a prompt repeats another's tokens (the
same system prompt, a conversation's history), so a prefix-cache hit is a
real reuse. The serving loop is the one of :mod:`paged_numba.sharing_sim`
with one sequence per request: each step every running request appends
one token (needing one free or evictable block, else the newest request is
preempted and later restarted from its prompt), then waiting requests are
admitted first come, first served while their prompt's new blocks plus one
fit. With caching on, an admitted prompt reuses the longest cached prefix of
full blocks (:meth:`~paged_numba.BlockManager.allocate`), whether another
running request holds those blocks or a finished one left them in the LRU
cache; only the rest is prefilled.
"""
from collections import deque

import numpy as np

from .block_manager import BlockManager

NUM_SYSTEM_PROMPTS = 4
MAX_LEN = 4096
USER_MEDIAN, USER_SIGMA = 64, 1.0            # user messages: log-normal, mean ~106 tokens
OUTPUT_MEDIAN, OUTPUT_SIGMA = 128, 0.8       # answers: mean ~176 tokens
CHAT_TURNS = 4                               # mean turns of a conversation (geometric)


def _lognormal(rng, median, sigma, size, lo, hi):
    return np.clip(np.rint(median * np.exp(sigma * rng.standard_normal(size))), lo, hi).astype(int)


class Request:
    """One request of a trace: its prompt's token ids, its answer's token ids,
    and (chat) the request that must finish before it is queued.

    >>> Request([1, 2, 3], [9], after=None)
    Request(prompt=3 tokens, output=1 tokens, after=None)
    """

    def __init__(self, prompt, output, after=None):
        self.prompt, self.output, self.after = list(prompt), list(output), after

    def __repr__(self):
        return (f"Request(prompt={len(self.prompt)} tokens, output={len(self.output)} tokens, "
                f"after={self.after})")


def make_trace(trace, num_requests, seed=0, max_len=MAX_LEN):
    """The requests of ``trace`` (``"system-<L>"`` or ``"chat"``), in queue order.

    Parameters
    ----------
    trace : str
    num_requests : int
        Requests (chat: turns, over as many conversations as it takes).
    seed : int
    max_len : int
        Prompt + output of a request (a conversation ends before a turn
        would exceed it).

    Returns
    -------
    list of Request

    Examples
    --------
    >>> reqs = make_trace("system-32", 3, seed=0)
    >>> [len(r.prompt) > 32 for r in reqs], reqs[0].after
    ([True, True, True], None)
    >>> chat = make_trace("chat", 6, seed=1)
    >>> later = [r for r in chat if r.after is not None][0]
    >>> first = chat[later.after]                  # its prompt repeats the previous turn
    >>> later.prompt[:len(first.prompt) + len(first.output)] == first.prompt + first.output
    True
    """
    rng = np.random.default_rng(seed)
    counter = iter(range(10**9, 2 * 10**9))      # unique token ids
    fresh = lambda n: [next(counter) for _ in range(n)]   # noqa: E731
    if trace.startswith("system-"):
        length = int(trace.removeprefix("system-"))
        if not 0 < length < max_len // 2:
            raise ValueError(f"system prompt length must be in [1, {max_len // 2}), but got "
                             f"{length}.")
        prompts = [[p * 10**7 + j for j in range(length)] for p in range(NUM_SYSTEM_PROMPTS)]
        rest = max_len - length
        users = _lognormal(rng, USER_MEDIAN, USER_SIGMA, num_requests, 1, rest // 2)
        outs = _lognormal(rng, OUTPUT_MEDIAN, OUTPUT_SIGMA, num_requests, 1, rest // 2)
        which = rng.integers(NUM_SYSTEM_PROMPTS, size=num_requests)
        return [Request(prompts[w] + fresh(u), fresh(o)) for w, u, o in zip(which, users, outs)]
    if trace != "chat":
        raise ValueError(f"trace must be 'system-<length>' or 'chat', but got {trace!r}.")
    reqs = []
    while len(reqs) < num_requests:
        history, prev = [], None
        for _ in range(int(rng.geometric(1 / CHAT_TURNS))):
            u = int(_lognormal(rng, USER_MEDIAN, USER_SIGMA, 1, 1, max_len)[0])
            o = int(_lognormal(rng, OUTPUT_MEDIAN, OUTPUT_SIGMA, 1, 1, max_len)[0])
            if len(history) + u + o > max_len or len(reqs) == num_requests:
                break
            req = Request(history + fresh(u), fresh(o), after=prev)
            reqs.append(req)
            history, prev = req.prompt + req.output, len(reqs) - 1
    return reqs


def simulate(requests, num_blocks, block_size=16, caching=True, users=None):
    """Serve ``requests`` on ``num_blocks`` blocks with prefix caching on or off.

    Averages are over the saturated steps (requests waiting after admission),
    or over all steps if there are none (``window`` says which).

    Parameters
    ----------
    requests : list of Request
        In queue order (:func:`make_trace`).
    num_blocks, block_size : int
        The pool; every request must fit it alone.
    caching : bool
    users : int, optional
        Conversations (chains of requests linked by ``after``) under way at
        once; None: every first turn waits at step 0. A request of its own
        is a conversation of one turn.

    Returns
    -------
    dict
        ``hit_rate`` (full prompt blocks found in the cache / looked up),
        ``prefill_saved`` (prompt tokens taken from the cache / prompt tokens
        admitted, re-admissions after preemption included),
        ``prefill_tokens`` (computed), ``mean_running`` (requests decoding
        per step), ``mean_owned_blocks``, ``steps``, ``tokens_per_step``
        (output tokens / steps), ``preemptions``, ``evictions``, ``window``
        and ``window_steps``.

    Examples
    --------
    Two requests share a 32-token prefix (2 blocks of 16) and add 4 tokens
    each; the second finds both blocks cached and prefills only its 4:

    >>> shared = list(range(32))
    >>> reqs = [Request(shared + [100, 101, 102, 103], [7]),
    ...         Request(shared + [200, 201, 202, 203], [8])]
    >>> r = simulate(reqs, num_blocks=8)
    >>> r["hit_rate"], r["prefill_tokens"], r["prefill_saved"]     # 2 hits of 4 lookups
    (0.5, 40, 0.4444)
    >>> simulate(reqs, num_blocks=8, caching=False)["prefill_tokens"]
    72
    """
    m = BlockManager(num_blocks, block_size, enable_prefix_caching=bool(caching))
    longest = max((-(-(len(r.prompt) + len(r.output)) // block_size) for r in requests),
                  default=0)
    if longest > num_blocks:
        raise ValueError(f"a request needs {longest} blocks alone, but num_blocks is {num_blocks}.")
    followers = {}
    for i, r in enumerate(requests):
        if r.after is not None:
            followers.setdefault(r.after, []).append(i)
    heads = deque(i for i, r in enumerate(requests) if r.after is None)   # conversations
    waiting = deque(heads.popleft() for _ in range(len(heads) if users is None
                                                   else min(int(users), len(heads))))
    running = []                                 # (request, tokens generated), admission order
    generated = {}
    prompt_tokens = cached_tokens = preemptions = steps = 0
    totals = {w: dict(running=0, owned=0, steps=0) for w in ("saturated", "all")}
    while waiting or running:
        steps += 1
        # -- 1. every running request appends one token; preempt the newest while short
        preempted = False
        k = 0
        while k < len(running):
            i = running[k]
            while m.num_available_blocks < 1:
                preempted = True
                victim = running.pop()
                m.free(victim)
                waiting.appendleft(victim)
                preemptions += 1
                if victim == i:
                    break
            if k < len(running) and running[k] == i:
                m.append(i, 1, token_ids=[requests[i].output[generated[i]]] if caching else None)
                generated[i] += 1
                k += 1
        # -- 2. admit FCFS while the head's new blocks (and one to grow) fit
        while waiting and not preempted:
            i = waiting[0]
            prompt = requests[i].prompt
            ids = prompt if caching else None
            # the prompt and one block more: probe with a block of tokens no prompt has
            spare = None if ids is None else ids + [-1 - j for j in range(block_size)]
            if not m.can_allocate(len(prompt) + block_size, spare):
                break
            waiting.popleft()
            _, cached = m.allocate(i, len(prompt), token_ids=ids)
            prompt_tokens += len(prompt)
            cached_tokens += cached
            generated[i] = 0
            m.append(i, 1, token_ids=[requests[i].output[0]] if caching else None)
            generated[i] = 1
            running.append(i)
        # -- 3. measure
        for w in ("saturated", "all") if waiting else ("all",):
            t = totals[w]
            t["steps"] += 1
            t["running"] += len(running)
            t["owned"] += m.num_owned_blocks
        # -- 4. retire finished requests; queue the turns that waited for them
        done = [i for i in running if generated[i] >= len(requests[i].output)]
        for i in done:
            running.remove(i)
            m.free(i)
            nxt = followers.get(i, [])
            waiting.extend(nxt if nxt or not heads else [heads.popleft()])
    name = "saturated" if totals["saturated"]["steps"] else "all"
    t = totals[name]
    n = max(t["steps"], 1)
    return dict(hit_rate=round(m.hit_rate, 4),
                prefill_saved=round(cached_tokens / prompt_tokens, 4) if prompt_tokens else 0.0,
                prefill_tokens=prompt_tokens - cached_tokens, mean_running=t["running"] / n,
                mean_owned_blocks=t["owned"] / n, steps=steps,
                tokens_per_step=sum(len(r.output) for r in requests) / max(steps, 1),
                preemptions=preemptions, evictions=m.num_evictions, window=name,
                window_steps=t["steps"])
