"""How much of a fixed KV-cache budget holds real tokens: contiguous vs paged.

A step-level simulation of LLM serving (plain Python + NumPy, no numba, no
kernels). ``budget_tokens`` KV slots are shared by a queue of requests, each
with a prompt length and an output length. Time advances in decode steps:

1. every running request grows by one token (the one generated this step);
   under ``"paged"``, one that needs a new block when none is free preempts
   the most recently admitted running request (LIFO, as vLLM does), which
   frees all its blocks and goes back to the front of the queue to be
   recomputed later (its prompt plus the tokens generated so far);
2. if nobody was preempted, waiting requests are admitted first come, first
   served while their initial need fits (a request blocked at the head of the
   queue blocks everyone behind it); an admitted request generates its first
   token in that same step;
3. memory is measured: during a step a request holds ``prompt + generated``
   token states (the new token included), in a reservation of
   ``max_len`` slots (``"contiguous-max"``), exactly ``prompt + output``
   slots (``"contiguous-oracle"``) or ``ceil(length / block_size)`` blocks
   (``"paged"``);
4. requests that generated all their output tokens free their memory.

Simplifications: a step costs the same whatever it does (prefill and the
recomputation of preempted requests are free, which favours ``"paged"``; the
result's ``preemptions`` says how often that happened), and the contiguous
allocators are charged no external fragmentation (holes between
reservations), which favours them.
"""
import math

import numpy as np

ALLOCATORS = ("contiguous-max", "contiguous-oracle", "paged")

# Defaults of make_requests: roughly the shape of chat traces (ShareGPT-like),
# not a fit to any dataset.
PROMPT_MEDIAN, PROMPT_SIGMA = 160, 1.0     # log-normal: mean ~ 160 * e^0.5 ~ 264 before clipping
OUTPUT_MEDIAN, OUTPUT_SIGMA = 200, 0.8     # mean ~ 200 * e^0.32 ~ 275 before clipping
MAX_LEN = 2048                             # the model's maximum sequence length


def make_requests(num_requests, seed=0, *, prompt_median=PROMPT_MEDIAN, prompt_sigma=PROMPT_SIGMA,
                  output_median=OUTPUT_MEDIAN, output_sigma=OUTPUT_SIGMA, max_len=MAX_LEN):
    """Draw requests with log-normal prompt and output lengths.

    ``length = round(median * exp(sigma * z))`` with ``z ~ N(0, 1)`` (so
    ``median`` is the median and ``sigma`` the spread of ``log length``: 1.0
    puts 16% of prompts above ``2.7 * median``). Prompts are clipped to
    ``[1, max_len - 1]``, outputs to ``[1, max_len - prompt]``, so every
    request fits the model's ``max_len``.

    Parameters
    ----------
    num_requests : int
    seed : int
        Seed of ``numpy.random.default_rng``; equal seeds give equal requests.
    prompt_median, prompt_sigma, output_median, output_sigma : float
    max_len : int
        Maximum sequence length (prompt + output).

    Returns
    -------
    requests : ndarray of int64, ``[num_requests, 2]``
        Columns ``(prompt_len, output_len)``.

    Examples
    --------
    >>> r = make_requests(1000, seed=1)
    >>> r.shape, bool((r.sum(axis=1) <= 2048).all()), 120 < int(np.median(r[:, 0])) < 200
    ((1000, 2), True, True)
    """
    if max_len < 2:
        raise ValueError(f"max_len must be >= 2, but got {max_len}.")
    rng = np.random.default_rng(seed)
    prompt = np.rint(prompt_median * np.exp(prompt_sigma * rng.standard_normal(num_requests)))
    output = np.rint(output_median * np.exp(output_sigma * rng.standard_normal(num_requests)))
    prompt = np.clip(prompt, 1, max_len - 1).astype(np.int64)
    output = np.clip(output, 1, max_len - prompt).astype(np.int64)
    return np.stack([prompt, output], axis=1)


def _check(allocator, block_size, requests, budget_tokens, max_len):
    if allocator not in ALLOCATORS:
        raise ValueError(f"allocator must be one of {ALLOCATORS}, but got {allocator!r}.")
    if allocator == "paged" and (not isinstance(block_size, (int, np.integer)) or block_size < 1):
        raise ValueError(f"paged needs a positive integer block_size, but got {block_size!r}.")
    req = np.asarray(requests, dtype=np.int64).reshape(-1, 2)
    if req.size and (req[:, 0].min() < 0 or req[:, 1].min() < 1):
        raise ValueError("requests need prompt_len >= 0 and output_len >= 1.")
    longest = int(req.sum(axis=1).max(initial=0))
    if longest > max_len:
        raise ValueError(f"a request of {longest} tokens exceeds max_len = {max_len}.")
    need = {"contiguous-max": max_len, "contiguous-oracle": longest,
            "paged": -(-longest // (block_size or 1)) * (block_size or 1)}[allocator]
    if need > budget_tokens:
        raise ValueError(f"{allocator} needs {need} slots for one request, but budget_tokens is "
                         f"{budget_tokens}.")
    return req


def simulate(allocator, block_size, requests, budget_tokens, max_len=MAX_LEN):
    """Serve ``requests`` within ``budget_tokens`` KV slots; report memory use.

    Averages are over the *saturated* steps (those where requests are still
    waiting after admission, i.e. memory limits the batch), or over all steps
    if there are none (``window`` says which).

    Parameters
    ----------
    allocator : {"contiguous-max", "contiguous-oracle", "paged"}
    block_size : int or None
        Slots per block for ``"paged"`` (its pool has
        ``budget_tokens // block_size`` blocks); ignored otherwise.
    requests : array of int, ``[num_requests, 2]``
        ``(prompt_len, output_len)`` in arrival (FCFS) order, all waiting at step 0.
    budget_tokens : int
        KV slots (token states) available in all.
    max_len : int
        The model's maximum sequence length, what ``"contiguous-max"`` reserves.

    Returns
    -------
    dict
        ``useful_frac``: token states / reserved slots. Fractions of the
        budget, summing to 1: ``used_frac`` (token states), ``internal_frac``
        (reserved but empty, of which ``future_frac`` is filled later by the
        same request and the rest never), ``unreserved_frac``. Also
        ``mean_running`` (requests decoding per step), ``mean_used_slots``,
        ``mean_reserved_slots``, ``peak_reserved_slots``, ``steps`` (to serve
        everything), ``tokens_per_step`` (output tokens / steps, whole run),
        ``preemptions``, ``window`` and ``window_steps``.

    Examples
    --------
    >>> one = [[32, 1]]             # 33 tokens during its only step
    >>> r = simulate("paged", 16, one, budget_tokens=64, max_len=100)
    >>> r["mean_reserved_slots"], r["mean_used_slots"]     # 48 = 3 * 16, 15 empty
    (48.0, 33.0)
    >>> simulate("contiguous-max", None, one, 100, max_len=100)["mean_reserved_slots"]
    100.0
    """
    req = _check(allocator, block_size, requests, budget_tokens, max_len)
    paged = allocator == "paged"
    bs = int(block_size) if paged else 1
    capacity = budget_tokens // bs * bs if paged else budget_tokens   # reservable slots
    prompt, output = req[:, 0], req[:, 1]
    final = prompt + output
    generated = np.zeros(len(req), np.int64)
    waiting = list(range(len(req)))[::-1]          # a stack: the next request is last
    run = np.zeros(0, np.int64)                    # running request ids, in admission order
    res = np.zeros(0, np.int64)                    # their reservations (slots)
    totals = dict.fromkeys(("used", "reserved", "future", "running"), 0.0)
    window = {"saturated": dict(totals, steps=0), "all": dict(totals, steps=0)}
    steps = preemptions = 0
    peak = 0

    def reservation(i, length):
        if allocator == "contiguous-max":
            return max_len
        return int(final[i]) if allocator == "contiguous-oracle" else -(-length // bs) * bs

    while waiting or run.size:
        steps += 1
        # -- 1. grow the running requests by one token (paged: preempt if needed)
        length = prompt[run] + generated[run] + 1
        preempted = False
        if paged and run.size:
            need = np.maximum(-(-length // bs) * bs - res, 0)
            # keep the longest admission-order prefix whose growth fits in the
            # free slots plus the slots freed by preempting everyone after it
            free = capacity - res.sum()
            freed_after = np.concatenate([np.cumsum(res[::-1])[::-1][1:], [0]])
            fits = np.cumsum(need) <= free + freed_after
            keep = int(np.argmin(fits)) if not fits.all() else run.size
            if keep < run.size:
                preempted = True
                preemptions += run.size - keep
                waiting.extend(run[keep:][::-1].tolist())   # earliest admitted is next
                run, res, length, need = run[:keep], res[:keep], length[:keep], need[:keep]
            res = res + need
        generated[run] += 1
        # -- 2. admit FCFS while the head of the queue fits
        reserved = int(res.sum())
        while waiting and not preempted:
            i = waiting[-1]
            n = int(prompt[i] + generated[i] + 1)
            r = reservation(i, n)
            if reserved + r > capacity:
                break
            waiting.pop()
            generated[i] += 1
            run, res, length = np.append(run, i), np.append(res, r), np.append(length, n)
            reserved += r
        # -- 3. measure
        fill = np.minimum(res, final[run])             # slots this reservation will ever hold
        peak = max(peak, reserved)
        for w in (window["all"], window["saturated"]) if waiting else (window["all"],):
            w["steps"] += 1
            w["used"] += int(length.sum())
            w["reserved"] += reserved
            w["future"] += int((fill - length).sum())
            w["running"] += run.size
        # -- 4. retire finished requests
        done = generated[run] >= output[run]
        run, res = run[~done], res[~done]
    name = "saturated" if window["saturated"]["steps"] else "all"
    w = window[name]
    n = max(w["steps"], 1)
    slots = n * budget_tokens
    return dict(
        useful_frac=float(w["used"] / w["reserved"]) if w["reserved"] else 1.0,
        used_frac=w["used"] / slots, internal_frac=(w["reserved"] - w["used"]) / slots,
        future_frac=w["future"] / slots, unreserved_frac=1 - w["reserved"] / slots,
        mean_running=w["running"] / n, mean_used_slots=w["used"] / n,
        mean_reserved_slots=w["reserved"] / n, peak_reserved_slots=peak, steps=steps,
        tokens_per_step=float(output.sum()) / max(steps, 1), preemptions=preemptions,
        window=name, window_steps=w["steps"])


def compare(requests, budget_tokens, max_len=MAX_LEN, block_sizes=(1, 16, 256)):
    """:func:`simulate` every allocator on the same requests.

    Returns
    -------
    list of dict
        One per allocator (``"contiguous-max"``, ``"contiguous-oracle"``,
        then ``"paged"`` for each block size), each with ``allocator``,
        ``block_size`` and ``batch_ratio``: its ``mean_running`` over that of
        ``"contiguous-max"`` (the larger batch behind paging's throughput gain).

    Parameters
    ----------
    requests : array of int, ``[num_requests, 2]``
        ``(prompt_len, output_len)``, as in :func:`simulate`.
    budget_tokens, max_len : int
        As in :func:`simulate`.
    block_sizes : sequence of int
        One ``"paged"`` run per block size.

    Examples
    --------
    >>> four = [[10, 5]] * 4        # each holds 11, 12, ..., 15 tokens over its 5 steps
    >>> rows = compare(four, budget_tokens=64, max_len=32, block_sizes=(1, 16))
    >>> for r in rows:              # useful: mean 13 tokens in 32, 15, 13 and 16 slots
    ...     print(r["allocator"], r["block_size"], r["mean_running"], r["batch_ratio"],
    ...           round(r["useful_frac"], 4))
    contiguous-max None 2.0 1.0 0.4062
    contiguous-oracle None 4.0 2.0 0.8667
    paged 1 4.0 2.0 1.0
    paged 16 4.0 2.0 0.8125
    >>> # contiguous-max: 64 // 32 = 2 requests at a time; the others fit all 4
    """
    runs = [("contiguous-max", None), ("contiguous-oracle", None)]
    runs += [("paged", b) for b in block_sizes]
    rows = [dict(allocator=a, block_size=b, **simulate(a, b, requests, budget_tokens, max_len))
            for a, b in runs]
    base = rows[0]["mean_running"]
    for r in rows:
        r["batch_ratio"] = r["mean_running"] / base if base else math.nan
    return rows
