"""A continuous-batching generation loop over a transformers causal LM.

The loop keeps every layer's keys and values in one
:class:`paged_numba.PagedKVCache` (``num_layers`` = the model's layers, one
:class:`paged_numba.BlockAllocator` for all of them), and runs the model's
own modules for everything but attention, which goes through the attention
function ``"paged_numba"`` (registered in transformers' ``AttentionInterface``
by :func:`paged_numba.integrations.transformers.register`).

Each step packs the tokens of several requests into one ``[1, num_tokens]``
forward: one token for each request that is decoding, and a chunk of the
prompt for each request that is still being prefilled (chunked prefill), so
decode and prefill rows share a step. Requests join when blocks are free and
leave when they finish; a decoding request that finds no free block preempts
the newest request, which gives its blocks back and later computes its
tokens again (prompt and generated so far). Sampling is greedy.

:class:`~paged_numba.integrations.scheduler.Scheduler` (plain Python and
NumPy, in :mod:`~paged_numba.integrations.scheduler`) decides the steps;
:class:`StepAttention` runs one step's attention on the kernels;
:func:`generate` ties them to the model.
"""
import numpy as np

from .. import _checks as C
from ..allocator import BlockAllocator, num_blocks_for
from .scheduler import Scheduler

ATTENTION_NAME = "paged_numba"    # the attention function this loop's forwards use
STEP_KWARG = "paged_numba_step"   # the forward's keyword argument that carries the step


# Under the simulator every CUDA thread is a Python thread: one warp a thread block
# runs the tiny test models' attention several times faster than the GPU's defaults.
SIMULATOR_WARPS = 1


def run_attention(q, cache, tables, lens, cu_seqlens_q, seq_lens, scale, validate, stream=None):
    """Attention of one layer's step on the kernels, launched on ``stream``.

    Parameters
    ----------
    q : array, ``[num_tokens, num_heads, head_size]`` (NumPy or device)
    cache : PagedKVCache (one layer), this step's keys and values written
    tables, lens : device arrays of int32, ``[num_seqs, max_blocks]`` and ``[num_seqs]``
    cu_seqlens_q, seq_lens : host arrays of int, ``[num_seqs + 1]`` and ``[num_seqs]``
    scale : float
    validate : bool
    stream : optional
        Anything the public functions' ``stream=`` takes; None: the default stream.

    Returns
    -------
    out : array, ``[num_tokens, num_heads, head_size]`` (NumPy for NumPy ``q``)

    Every sequence with one query row: decode (:func:`paged_numba.paged_decode`;
    under the simulator a :class:`paged_numba.DecodePlan` of
    :data:`SIMULATOR_WARPS` warps); else :func:`paged_numba.paged_prefill`
    over ``cu_seqlens_q`` (decode rows and prompt chunks in one launch).
    """
    from numba import cuda

    from .. import DecodePlan, paged_decode, paged_prefill, simulator_enabled

    sim = simulator_enabled()
    if bool(np.all(np.diff(cu_seqlens_q) == 1)):
        if not sim:
            return paged_decode(q, cache, tables, lens, scale=scale, validate=validate,
                                stream=stream)
        plan = DecodePlan(cache, len(seq_lens), q.shape[1], tables.shape[1], scale=scale,
                          num_warps=SIMULATOR_WARPS)
        dev = cuda.to_device(q) if isinstance(q, np.ndarray) else q
        out = plan.run(dev, tables, lens, stream=stream)    # checked when packed (new buffers)
        return out.copy_to_host() if isinstance(q, np.ndarray) else out
    tiling = {"num_warps": SIMULATOR_WARPS} if sim else {}
    return paged_prefill(q, cache, tables, cu_seqlens_q, seq_lens, scale=scale,
                         validate=validate, stream=stream, **tiling)


class StepAttention:
    """One step's attention on the kernels, called once per layer.

    Writes the step's keys and values into layer ``i`` of ``cache`` (its
    :meth:`~paged_numba.PagedKVCache.layer` view) at ``step.slot_mapping``,
    then attends with :func:`run_attention`, both on torch's current stream
    (:func:`~paged_numba.integrations._tensors.launch_stream`). The slots,
    tables and lengths go to the device once per step, at the first layer,
    where they are checked.

    Parameters
    ----------
    cache : PagedKVCache
        With ``num_layers``; its dtype is the model's.
    step : Step
    """

    def __init__(self, cache, step):
        self.cache, self.step = cache, step
        self.slots = self.tables = self.lens = None     # device copies, from the first layer

    def __call__(self, layer, query, key, value, scale):
        """Attention of layer ``layer``: query ``[1, num_heads, num_tokens,
        head_size]``, key and value ``[1, num_kv_heads, num_tokens,
        head_size]`` (the model's layout) give ``[num_tokens, num_heads,
        head_size]`` in the query's dtype and device."""
        from .. import write_kv
        from ._tensors import kernel_array, kernel_ints, launch_stream, to_torch

        cache = self.cache.layer(layer)
        stream = launch_stream(query)
        validate = self.slots is None                   # the same tables for every layer
        if validate:
            step = self.step
            self.slots, self.tables, self.lens = (
                kernel_ints(x, stream) for x in (step.slot_mapping, step.block_tables,
                                                 step.seq_lens))
        q = kernel_array(query[0].transpose(0, 1))
        k, v = kernel_array(key[0].transpose(0, 1)), kernel_array(value[0].transpose(0, 1))
        write_kv(cache, k, v, self.slots, validate=validate, stream=stream)
        out = run_attention(q, cache, self.tables, self.lens, self.step.cu_seqlens_q,
                            self.step.seq_lens, scale, validate, stream)
        return to_torch(out, query)


def step_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                   **kwargs):
    """The ``"paged_numba"`` attention function (transformers' signature):
    hands layer ``module.layer_idx`` to the forward's :class:`StepAttention`
    (keyword argument ``paged_numba_step``). ``attention_mask`` is not used:
    the kernels mask causally by position."""
    step = kwargs.get(STEP_KWARG)
    if step is None:
        raise ValueError(f"attention {ATTENTION_NAME!r} needs the forward's {STEP_KWARG!r} "
                         f"keyword argument (paged_numba.integrations.transformers.generate "
                         f"passes it); for a plain forward use another attn_implementation.")
    if getattr(module, "sliding_window", None) is not None or "softcap" in kwargs:
        raise NotImplementedError("paged_numba's transformers loop covers full causal attention "
                                  "(Llama-like models); this layer has a sliding window or a "
                                  "logit soft cap.")
    return step(module.layer_idx, query, key, value, scaling), None


def generate(model, prompts, max_new_tokens, *, block_size=16, num_blocks=None, chunk_size=64,
             max_batch_tokens=256, max_num_seqs=None, eos_token_id=None, stats=None):
    """Greedy generation for many prompts at once, continuously batched, with
    attention on paged_numba's kernels.

    Parameters
    ----------
    model : transformers causal LM
        A decoder-only model whose attention layers call transformers'
        ``AttentionInterface`` (Llama and its relatives), in eval mode. Its
        ``attn_implementation`` is switched to ``"paged_numba"`` for the
        call and restored after.
    prompts : list of list of int
        Token ids of each prompt.
    max_new_tokens : int
        Tokens to generate for each prompt.
    block_size : int
        Tokens per cache block.
    num_blocks : int, optional
        Blocks in the cache; default: enough for every request at full
        length at once. Fewer make requests wait, and decoding requests
        preempt newer ones when the pool runs out.
    chunk_size : int
        Most prompt tokens of one request per step (chunked prefill).
    max_batch_tokens : int
        Most tokens per step (decode and prefill rows together).
    max_num_seqs : int, optional
        Most requests running at once.
    eos_token_id : int or list of int, optional
        Tokens that end a request early (kept in its output).
    stats : dict, optional
        Filled with ``num_steps``, ``num_preemptions``, ``num_mixed_steps`` (steps
        with decode and prefill rows) and ``num_tokens`` (rows run).

    Returns
    -------
    list of list of int, ``[len(prompts)]``
        The generated tokens of each prompt (the prompt not included).

    Notes
    -----
    The cache has the model's dtype (float16, bfloat16 or float32) and
    lives where the model does: on a GPU the tensors reach the kernels as
    numba device arrays over their own memory, on the CPU (and under the
    simulator) as NumPy views. Rotary embeddings, projections and the MLP
    are the model's own modules; :func:`step_attention` replaces only
    attention. ``tests/test_transformers.py`` checks that the tokens equal
    ``model.generate(..., do_sample=False)`` with ``sdpa`` attention.

    Examples
    --------
    >>> import pytest
    >>> torch = pytest.importorskip("torch")
    >>> transformers = pytest.importorskip("transformers")
    >>> from paged_numba.integrations.transformers import generate
    >>> _ = torch.manual_seed(0)
    >>> config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64,
    ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    ...     vocab_size=64, eos_token_id=None)
    >>> model = transformers.LlamaForCausalLM(config).eval()
    >>> ours = generate(model, [[1, 2, 3]], max_new_tokens=2)
    >>> model.set_attn_implementation("sdpa")
    >>> theirs = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False,
    ...                         pad_token_id=0)
    >>> ours == theirs[:, 3:].tolist()
    True
    """
    import torch
    from transformers import AttentionInterface

    from .. import PagedKVCache

    AttentionInterface.register(ATTENTION_NAME, step_attention)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
        else model.config
    num_layers = config.num_hidden_layers
    num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    block_size = C.integer("block_size", block_size, lo=1)
    max_new_tokens = C.integer("max_new_tokens", max_new_tokens, lo=0)
    if num_blocks is None:
        num_blocks = sum(num_blocks_for(len(p) + max_new_tokens, block_size) for p in prompts) or 1
    eos = [] if eos_token_id is None else (
        [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
    allocator = BlockAllocator(num_blocks, block_size)
    scheduler = Scheduler(prompts, max_new_tokens, allocator, chunk_size, max_batch_tokens,
                          max_num_seqs, eos)
    dtype = str(model.dtype).split(".")[-1]
    device = model.device
    cache = PagedKVCache(num_blocks, block_size, num_kv_heads, head_size, dtype=dtype,
                         num_layers=num_layers)
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
    num_tokens = 0
    try:
        with torch.inference_mode():
            while scheduler.has_work():
                step = scheduler.schedule()
                rows = torch.as_tensor(step.sample_rows, device=device)
                out = model(input_ids=torch.as_tensor(step.input_ids, device=device)[None],
                            position_ids=torch.as_tensor(step.positions, device=device)[None],
                            use_cache=False, logits_to_keep=rows,
                            **{STEP_KWARG: StepAttention(cache, step)})
                scheduler.complete(step, out.logits[0].argmax(-1).tolist())
                num_tokens += len(step.input_ids)
    finally:
        model.set_attn_implementation(previous)
    if stats is not None:
        stats.update(num_steps=scheduler.num_steps, num_preemptions=scheduler.num_preemptions,
                     num_mixed_steps=scheduler.num_mixed_steps, num_tokens=num_tokens)
    return [scheduler.finished[i] for i in range(len(prompts))]
