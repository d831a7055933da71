"""Hugging Face transformers on paged_numba's kernels.

Two ways in, both registered in transformers' ``AttentionInterface`` by
:func:`register`:

* ``"paged_numba"``: the attention of this package's own continuous-batching
  loop, :func:`generate` (in :mod:`paged_numba.integrations.hf_loop`, its
  steps from :mod:`paged_numba.integrations.scheduler`): the K/V of every
  layer in a :class:`paged_numba.PagedKVCache` with a
  :class:`paged_numba.BlockAllocator`, chunked prefill, mixed steps.
* ``"paged|paged_numba"``: a backend for transformers' own continuous-batching
  engine (``model.generate_batch``, ``ContinuousBatchingManager``). Its
  :class:`~transformers.generation.continuous_batching.PagedAttentionCache`
  keeps, per layer, key and value tensors ``[(num_blocks + 2) * block_size,
  num_kv_heads, head_size]`` (two padding blocks at the end: a zeroed one
  padding rows read, and one they write); :func:`hf_paged_attention` views
  them as ``"nhd"`` pools ``[num_blocks + 2, block_size, num_kv_heads,
  head_size]`` without a copy, writes the step's keys and values into them
  in place with :func:`paged_numba.write_kv`, and attends with
  :func:`paged_numba.paged_prefill` (or :func:`paged_numba.paged_decode`)
  over block tables rebuilt from the engine's read indices
  (:func:`tables_from_hf_indices`).

Usage::

    from paged_numba.integrations.transformers import generate, register
    new_tokens = generate(model, prompts, max_new_tokens=32)     # this package's loop
    model.set_attn_implementation(register())                    # "paged|paged_numba"
    outputs = model.generate_batch(prompts, generation_config=...)

Only full causal attention is covered (Llama and its relatives): layers
with a sliding window or a logit soft cap raise ``NotImplementedError``.
The engine's CUDA graphs must stay off (``ContinuousBatchingConfig(
use_cuda_graph=False)``): the backend reads the engine's indices on the host
each step. The backend runs in the engines of transformers 5.0 to 5.17
(:func:`engine_admits_backends`): 5.18's engine keeps every layer's cache in
one byte tensor this backend does not read, and from 5.19 on the engine runs
only its own attention (``"paged|eager"``, ``"sdpa"``, flash attention);
:func:`register` warns there. :func:`generate` runs on any 5.x. This module
imports torch and transformers only when a function that needs them runs.
"""
import importlib.metadata
import re
import warnings
import weakref
from dataclasses import dataclass

import numpy as np

from .. import _checks as C
from ..allocator import padded_block_table
from .hf_loop import ATTENTION_NAME, generate, run_attention, step_attention

HF_ENGINE_NAME = "paged|paged_numba"   # for transformers' continuous-batching engine
# the last transformers whose engine runs this backend (5.18 changed the cache's layout,
# 5.19 stopped running registered attention functions)
LAST_ENGINE_VERSION = (5, 17)

__all__ = ["ATTENTION_NAME", "HF_ENGINE_NAME", "HFBatch", "engine_admits_backends", "generate",
           "hf_paged_attention", "register", "tables_from_hf_indices"]


def engine_admits_backends(version=None):
    """Whether transformers' continuous-batching engine (``generate_batch``,
    ``ContinuousBatchingManager``) of ``version`` (default: the installed
    one) can run ``"paged|paged_numba"``: 5.0 to 5.17 do. 5.18 keeps every
    layer's cache in one byte tensor of sectors, which the backend does not
    read; from 5.19 on the engine accepts only ``"paged|eager"``, ``"sdpa"``
    and flash attention, and raises ``ValueError`` for others.

    >>> engine_admits_backends("5.17.0"), engine_admits_backends("5.24.0.dev0")
    (True, False)
    """
    if version is None:
        version = importlib.metadata.version("transformers")
    parts = re.match(r"(\d+)\.(\d+)", str(version))
    if parts is None:
        raise ValueError(f"version must look like 'MAJOR.MINOR...', but got {version!r}.")
    return (int(parts[1]), int(parts[2])) <= LAST_ENGINE_VERSION


def register():
    """Register ``"paged_numba"`` (:func:`generate`'s) and ``"paged|paged_numba"``
    (:func:`hf_paged_attention`, for transformers' engine) in transformers'
    ``AttentionInterface``; returns ``"paged|paged_numba"``. Calling it again
    is harmless. Where the installed transformers' engine no longer admits
    registered functions (:func:`engine_admits_backends`) it warns
    (``UserWarning``) that ``"paged|paged_numba"`` cannot run there;
    :func:`generate` still can.

    >>> import pytest
    >>> _ = pytest.importorskip("torch"), pytest.importorskip("transformers")
    >>> from transformers import AttentionInterface
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore")     # transformers >= 5.18: the engine warning
    ...     name = register()
    >>> name, "paged_numba" in AttentionInterface._global_mapping
    ('paged|paged_numba', True)
    """
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, step_attention)
    AttentionInterface.register(HF_ENGINE_NAME, hf_paged_attention)
    if not engine_admits_backends():
        version = importlib.metadata.version("transformers")
        warnings.warn(f"transformers {version}'s continuous-batching engine cannot run "
                      f"{HF_ENGINE_NAME!r} (5.18 lays its cache out in sectors the backend does "
                      f"not read; from 5.19 on the engine runs only its own attention), so "
                      f"generate_batch cannot use it there (transformers 5.0-5.17 can); "
                      f"paged_numba.integrations.transformers.generate runs this package's "
                      f"loop with any 5.x.", UserWarning, stacklevel=2)
    return HF_ENGINE_NAME


@dataclass
class HFBatch:
    """One forward of transformers' engine in paged_numba's terms.

    Attributes
    ----------
    num_tokens : int
        Real query rows (the engine may pad the batch past them).
    cu_seqlens_q : numpy.ndarray of int32, ``[num_seqs + 1]``
    seq_lens : numpy.ndarray of int32, ``[num_seqs]``
        Keys of each sequence, this step's included.
    block_tables : numpy.ndarray of int32, ``[num_seqs, max_blocks]``
    slot_mapping : numpy.ndarray of int64, ``[num_tokens]``
        Where each row's key and value go (the engine's write indices).
    """
    num_tokens: int
    cu_seqlens_q: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray
    slot_mapping: np.ndarray


def tables_from_hf_indices(cu_seq_lens_q, cu_seq_lens_k, read_index, write_index, block_size,
                           num_pages):
    """Block tables and slots of one forward of transformers' engine, from
    its flat cache indices (``page = block * block_size + offset``).

    Sequence ``i`` reads its keys, position by position, at
    ``read_index[cu_seq_lens_k[i]:cu_seq_lens_k[i + 1]]`` (an empty
    ``read_index``: nothing cached yet, and its keys are its query rows,
    written at ``write_index[cu_seq_lens_q[i]:cu_seq_lens_q[i + 1]]``). Its
    block table is every ``block_size``-th of those pages divided by
    ``block_size``; the pages are checked to follow the table (token ``t`` at
    ``table[t // block_size] * block_size + t % block_size``) and the write
    indices to be the pages of the sequence's last ``q_len`` positions.
    Padding sequences (no query rows) are dropped, and write indices at or
    past ``num_pages`` (the engine's padding block) become ``-1`` (skipped).

    Parameters
    ----------
    cu_seq_lens_q, cu_seq_lens_k : array of int, ``[num_seqs + 1]``
    read_index : array of int, ``[total_k]`` or ``[0]``
    write_index : array of int, ``[total_q]`` (padding rows included)
    block_size : int
    num_pages : int
        ``num_blocks * block_size`` of the engine's cache (its own blocks).

    Returns
    -------
    HFBatch

    Examples
    --------
    >>> # sequence 0: 2 cached tokens, 3 new, blocks [2, 0]: pages 8, 9, 10, 11, 0
    >>> # sequence 1: 5 cached, 1 new, blocks [1, 3]: pages 4..7, 12, 13; then a padding row
    >>> b = tables_from_hf_indices([0, 3, 4, 4], [0, 5, 11, 11],
    ...                            read_index=[8, 9, 10, 11, 0, 4, 5, 6, 7, 12, 13],
    ...                            write_index=[10, 11, 0, 13, 20], block_size=4, num_pages=16)
    >>> b.block_tables.tolist(), b.seq_lens.tolist(), b.slot_mapping.tolist(), b.num_tokens
    ([[2, 0], [1, 3]], [5, 6], [10, 11, 0, 13], 4)
    """
    block_size = C.integer("block_size", block_size, lo=1)
    cu_q = C.int_array("cu_seq_lens_q", cu_seq_lens_q, ndim=1, dtype=np.int64)
    cu_k = C.int_array("cu_seq_lens_k", cu_seq_lens_k, ndim=1, dtype=np.int64)
    read = C.int_array("read_index", read_index, ndim=1, hi=C.INT64_MAX, dtype=np.int64)
    write = C.int_array("write_index", write_index, ndim=1, hi=C.INT64_MAX, dtype=np.int64)
    if cu_q.shape != cu_k.shape or cu_q.size == 0:
        raise ValueError(f"cu_seq_lens_q and cu_seq_lens_k must both be [num_seqs + 1], but got "
                         f"shapes {cu_q.shape} and {cu_k.shape}.")
    num_tokens = int(cu_q[-1])
    if write.size < num_tokens:
        raise ValueError(f"write_index has {write.size} entries for {num_tokens} query rows.")
    slots = write[:num_tokens].copy()
    slots[slots >= num_pages] = -1
    rows, lens, cu = [], [], [0]
    for i in range(cu_q.size - 1):
        q0, q1, k0, k1 = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        q_len, k_len = q1 - q0, k1 - k0
        if q_len == 0:                        # a padding sequence
            continue
        pages = read[k0:k1] if read.size else write[q0:q1]
        if pages.size != k_len or q_len > k_len:
            raise ValueError(f"sequence {i}: {q_len} query rows and {k_len} keys, but "
                             f"{pages.size} read indices.")
        row = pages[::block_size] // block_size
        pos = np.arange(k_len)
        if not np.array_equal(pages, row[pos // block_size] * block_size + pos % block_size):
            raise ValueError(f"sequence {i}: the read indices {pages.tolist()} do not follow "
                             f"blocks of {block_size} tokens.")
        if not np.array_equal(pages[k_len - q_len:], write[q0:q1]):
            raise ValueError(f"sequence {i}: its write indices {write[q0:q1].tolist()} are not "
                             f"the pages of its last {q_len} positions {pages[k_len - q_len:].tolist()}.")
        rows.append(row)
        lens.append(k_len)
        cu.append(cu[-1] + q_len)
    return HFBatch(num_tokens, np.asarray(cu, np.int32), np.asarray(lens, np.int32),
                   padded_block_table(rows), slots)


# per engine cache: its pools as PagedKVCaches, and the batch of the forward in progress
_ENGINE_STATE = weakref.WeakKeyDictionary()


class _EngineState:
    def __init__(self):
        self.pools = {}        # index in group -> (key tensor, value tensor, PagedKVCache)
        self.batch_key = None  # the engine's index tensors of the forward in progress
        self.batch = None      # (HFBatch, device slots, tables, lens, layers checked)


def _pools(state, hf_cache, j):
    """Layer ``j`` (of its group) of the engine's cache as a PagedKVCache over its tensors."""
    from ._tensors import wrap_nhd

    k, v = hf_cache.key_cache[j], hf_cache.value_cache[j]
    held = state.pools.get(j)
    if held is None or held[0] is not k or held[1] is not v:
        shape = (-1, hf_cache.block_size, k.shape[-2], k.shape[-1])
        held = (k, v, wrap_nhd(k.view(shape), v.view(shape)))
        state.pools[j] = held
    return held[2]


def _batch(state, hf_cache, group, kwargs, stream):
    """The forward's :class:`HFBatch`, built at its first layer and kept for the
    others; its integer arrays go to the device for the kernels on ``stream``."""
    from ._tensors import host_array, kernel_ints

    cu_k = kwargs["cu_seq_lens_k"]
    if isinstance(cu_k, dict):
        cu_k = cu_k["full_attention"]
    read, write = kwargs["read_index"][group], kwargs["write_index"][group]
    key = (kwargs["cu_seq_lens_q"], cu_k, read, write)
    if state.batch_key is None or any(a is not b for a, b in zip(key, state.batch_key)):
        batch = tables_from_hf_indices(*(host_array(t) for t in key), hf_cache.block_size,
                                       hf_cache.num_blocks * hf_cache.block_size)
        state.batch_key = key
        state.batch = (batch, kernel_ints(batch.slot_mapping, stream),
                       kernel_ints(batch.block_tables, stream), kernel_ints(batch.seq_lens, stream),
                       set())
    return state.batch


def hf_paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                       **kwargs):
    """The ``"paged|paged_numba"`` attention function for transformers'
    continuous-batching engine.

    Parameters
    ----------
    module : the attention layer (its ``layer_idx`` picks the cache tensors)
    query : tensor, ``[1, num_heads, total_q, head_size]``
    key, value : tensors, ``[1, num_kv_heads, total_q, head_size]``
        This step's rows, packed request after request (``total_q`` may
        include the engine's padding rows past ``cu_seq_lens_q[-1]``).
    attention_mask : not used (the kernels mask causally by position)
    scaling : float
    **kwargs
        The engine's: ``cache`` (its ``PagedAttentionCache``),
        ``cu_seq_lens_q`` ``[num_seqs + 1]``, ``cu_seq_lens_k``
        ``[num_seqs + 1]`` (or a dict by layer type), ``read_index`` and
        ``write_index`` (one index tensor per layer group).

    Returns
    -------
    out : tensor, ``[total_q, num_heads, head_size]`` (zeros in padding rows)
    None
        (no attention weights)

    The kernels launch on torch's current stream (the engine's own, on a
    GPU), ordered after the work that made ``query``/``key``/``value`` and
    before the work that reads ``out``; the host does not wait.
    """
    import torch

    from .. import write_kv
    from ._tensors import kernel_array, launch_stream, to_torch

    hf_cache = kwargs.get("cache")
    if hf_cache is None:
        raise ValueError(f"{HF_ENGINE_NAME!r} runs inside transformers' continuous-batching "
                         f"engine (generate_batch), which passes its cache; for paged_numba's "
                         f"own loop use paged_numba.integrations.transformers.generate.")
    layer = module.layer_idx
    group, j = hf_cache.layer_index_to_group_indices[layer]
    if hf_cache.sliding_windows.get(layer, 1) != 1 or "softcap" in kwargs or "s_aux" in kwargs:
        raise NotImplementedError(f"{HF_ENGINE_NAME!r} covers full causal attention; layer "
                                  f"{layer} has a sliding window, a soft cap or sinks.")
    if kwargs.get("block_table") is not None:
        raise NotImplementedError(f"{HF_ENGINE_NAME!r} reads the engine's read indices; its "
                                  f"block-table decode path (flash attention only) is not covered.")
    stream = launch_stream(query)                        # the engine's, on a GPU
    state = _ENGINE_STATE.setdefault(hf_cache, _EngineState())
    batch, slots, tables, lens, checked = _batch(state, hf_cache, group, kwargs, stream)
    cache = _pools(state, hf_cache, j)
    validate = not checked                               # the first layer of the forward
    checked.add(layer)
    n = batch.num_tokens
    q = kernel_array(query[0, :, :n].transpose(0, 1))
    k = kernel_array(key[0, :, :n].transpose(0, 1))
    v = kernel_array(value[0, :, :n].transpose(0, 1))
    write_kv(cache, k, v, slots, validate=validate, stream=stream)
    out = run_attention(q, cache, tables, lens, batch.cu_seqlens_q, batch.seq_lens, scaling,
                        validate, stream)
    out = to_torch(out, query)
    total = query.shape[2]
    if n < total:                                         # the engine's padding rows
        out = torch.cat([out, out.new_zeros((total - n,) + tuple(out.shape[1:]))])
    return out, None
