"""A Hugging Face transformers model on paged_numba's kernels.

* The scheduler of the continuous-batching loop (plain Python, no torch):
  under random prompts, pool sizes, chunk sizes and token budgets, every
  step respects its budgets and every sampled request's block table holds
  exactly its own tokens at every position (what the attention kernels read),
  across chunked prefill, waiting, preemption and block reuse.
* The loop on a model: a Llama-architecture model with random weights
  (fixed seed, float32, no download) generates greedily through
  :func:`paged_numba.integrations.transformers.generate` the same token ids
  as ``model.generate(do_sample=False)`` with ``sdpa`` attention, with mixed
  decode/prefill steps, and with preemption.
* transformers' own continuous-batching engine with the ``paged|paged_numba``
  backend generates what it generates with ``paged|sdpa``; one call of the
  backend on a stand-in engine cache writes the new rows in place, at their
  pages only, and attends within the error bound of the float64 reference.
* Both backends hand torch's current stream to every launching call (a side
  stream on a GPU gives the default stream's output).

On the simulator the model runs on the CPU with 16 new tokens; on a GPU
(the ``gpu`` profile) on CUDA with 64.
"""
import numpy as np
import pytest
from hypothesis import given, strategies as st
from numba import cuda

import paged_numba as pn
from paged_numba import BlockAllocator
from paged_numba.integrations.scheduler import Scheduler
from paged_numba.integrations.transformers import tables_from_hf_indices

SIM = pn.simulator_enabled()
NEW_TOKENS = 16 if SIM else 64
PROMPT_LENS = (5, 11, 23)


# -- the scheduler, with a stand-in model


def _fake_next(tokens):
    """The stand-in model's greedy token: a function of the whole history."""
    return (sum((i + 1) * t for i, t in enumerate(tokens)) * 7 + len(tokens)) % 97


@st.composite
def workloads(draw):
    lens = draw(st.lists(st.integers(1, 30), min_size=1, max_size=5))
    new = draw(st.integers(1, 8))
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    need = [-(-(n + new) // block_size) for n in lens]
    num_blocks = draw(st.integers(max(need), sum(need) + 2))
    prompts = [draw(st.lists(st.integers(0, 96), min_size=n, max_size=n)) for n in lens]
    return dict(prompts=prompts, max_new_tokens=new, block_size=block_size,
                num_blocks=num_blocks, chunk_size=draw(st.integers(1, 16)),
                max_batch_tokens=draw(st.integers(1, 24)),
                max_num_seqs=draw(st.one_of(st.none(), st.integers(1, 4))))


@given(workloads())
def test_scheduler_steps_read_each_requests_own_tokens(w):
    a = BlockAllocator(w["num_blocks"], w["block_size"])
    s = Scheduler(w["prompts"], w["max_new_tokens"], a, w["chunk_size"], w["max_batch_tokens"],
                  w["max_num_seqs"])
    slots = {}                    # slot -> token id written there (the cache's contents)
    for _ in range(10_000):
        if not s.has_work():
            break
        step = s.schedule()
        n = len(step.input_ids)
        assert 0 < n <= w["max_batch_tokens"]
        assert w["max_num_seqs"] is None or len(s.running) <= w["max_num_seqs"]
        assert step.cu_seqlens_q[-1] == n and len(step.slot_mapping) == n
        for t, slot in zip(step.input_ids.tolist(), step.slot_mapping.tolist()):
            slots[slot] = t
        next_tokens = []
        for i, req in enumerate(step.requests):
            lo, hi = step.cu_seqlens_q[i], step.cu_seqlens_q[i + 1]
            seq_len = int(step.seq_lens[i])
            assert step.positions[lo:hi].tolist() == list(range(seq_len - (hi - lo), seq_len))
            table = step.block_tables[i]
            bs = w["block_size"]
            cached = [slots.get(int(table[p // bs]) * bs + p % bs) for p in range(seq_len)]
            assert cached == req.tokens[:seq_len]      # what attention reads is its own history
            if req in step.sampled:
                assert step.sample_rows[step.sampled.index(req)] == hi - 1
                assert seq_len == len(req.tokens)
                next_tokens.append(_fake_next(req.tokens))
        s.complete(step, next_tokens)
    assert not s.has_work() and a.num_free_blocks == w["num_blocks"]
    for i, prompt in enumerate(w["prompts"]):
        expect = list(prompt)
        for _ in range(w["max_new_tokens"]):
            expect.append(_fake_next(expect))
        assert s.finished[i] == expect[len(prompt):]


def test_scheduler_refuses_a_request_that_cannot_fit():
    with pytest.raises(ValueError, match=r"prompts\[1\] \(9 tokens\) plus max_new_tokens=4 need 4"):
        Scheduler([[1], [2] * 9], 4, BlockAllocator(3, 4), chunk_size=4, max_batch_tokens=8)
    with pytest.raises(ValueError, match=r"prompts\[0\] is empty"):
        Scheduler([[]], 4, BlockAllocator(3, 4), chunk_size=4, max_batch_tokens=8)


def test_tables_from_hf_indices_refuses_indices_off_the_blocks():
    # position 1 of the one sequence should be page 9 (block 2, offset 1), not 7
    with pytest.raises(ValueError, match="do not follow blocks of 4 tokens"):
        tables_from_hf_indices([0, 1], [0, 3], [8, 7, 10], [10], block_size=4, num_pages=16)
    with pytest.raises(ValueError, match="are not the pages of its last 1 positions"):
        tables_from_hf_indices([0, 1], [0, 3], [8, 9, 10], [11], block_size=4, num_pages=16)


# -- a model


@pytest.fixture(scope="module")
def llama():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=256,
        eos_token_id=None, pad_token_id=0)
    model = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
    if not SIM:
        model = model.to("cuda")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in PROMPT_LENS]
    return model, prompts


def _sdpa_generate(model, prompts, new_tokens):
    """``model.generate`` (greedy, sdpa), one prompt at a time: the reference."""
    import torch

    model.set_attn_implementation("sdpa")
    out = []
    for p in prompts:
        ids = torch.tensor([p], device=model.device)
        gen = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0)
        out.append(gen[0, len(p):].tolist())
    return out


@pytest.mark.slow
def test_generate_matches_model_generate(llama):
    """Three prompts of 5, 11 and 23 tokens in 8-token chunks, 16 tokens a
    step: the long prompt's chunks share steps with the others' decodes."""
    from paged_numba.integrations.transformers import generate

    model, prompts = llama
    stats = {}
    ours = generate(model, prompts, NEW_TOKENS, block_size=8, chunk_size=8, max_batch_tokens=16,
                    stats=stats)
    assert stats["num_mixed_steps"] > 0 and stats["num_preemptions"] == 0
    assert model.config._attn_implementation != "paged_numba"      # restored
    assert ours == _sdpa_generate(model, prompts, NEW_TOKENS)


@pytest.mark.slow
def test_generate_with_preemption_matches_model_generate(llama):
    """A pool of 7 blocks of 4 tokens for prompts of 3, 6 and 9 tokens:
    requests wait for blocks, and a decoding request preempts the newest,
    which computes its prompt and generated tokens again when it returns."""
    from paged_numba.integrations.transformers import generate

    model, prompts = llama
    prompts = [prompts[2][:3], prompts[2][3:9], prompts[1][:9]]
    stats = {}
    ours = generate(model, prompts, 4, block_size=4, num_blocks=7, chunk_size=8,
                    max_batch_tokens=16, stats=stats)
    assert stats["num_preemptions"] >= 1
    assert ours == _sdpa_generate(model, prompts, 4)


@pytest.mark.slow
def test_hf_engine_backend_matches_paged_sdpa(llama):
    """transformers' generate_batch with ``paged|paged_numba`` (its cache
    written in place by write_kv, block tables from its read indices) gives
    the tokens it gives with ``paged|sdpa``."""
    transformers = pytest.importorskip("transformers")
    if SIM:
        pytest.importorskip("psutil")     # the engine sizes its cache on the CPU with it
    from paged_numba.integrations.transformers import engine_admits_backends, register

    if not engine_admits_backends():
        pytest.skip(f"transformers {transformers.__version__}'s engine runs only its own "
                    f"attention (5.19 on); test_register_warns_where_the_engine_refuses_it "
                    f"covers it")

    model, prompts = llama
    new_tokens = 4 if SIM else NEW_TOKENS
    num_blocks = sum(-(-(len(p) + new_tokens) // 8) for p in prompts)
    gen = transformers.GenerationConfig(max_new_tokens=new_tokens, do_sample=False,
                                        eos_token_id=None, pad_token_id=0)

    def run(attn):
        model.set_attn_implementation(attn)
        cb = transformers.ContinuousBatchingConfig(block_size=8, num_blocks=num_blocks,
                                                   max_batch_tokens=16, max_requests_per_batch=4,
                                                   use_cuda_graph=False)
        out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb,
                                   progress_bar=False)
        return [out[f"req_{i}"].generated_tokens for i in range(len(prompts))]

    try:
        ours, theirs = run(register()), run("paged|sdpa")
    finally:
        model.set_attn_implementation("sdpa")
    assert all(len(t) == new_tokens for t in theirs)
    assert ours == theirs


@pytest.mark.parametrize("version", ["5.0.0", "5.17.0", "5.18.2", "5.19.0", "5.24.0", "6.1.0"])
def test_register_warns_where_the_engine_refuses_it(version, monkeypatch):
    """``register()`` registers both names under any transformers 5.x and
    warns, naming the installed version, exactly where the engine no longer
    runs this backend (from 5.18 on)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import warnings

    from transformers import AttentionInterface

    from paged_numba.integrations import transformers as integration

    monkeypatch.setattr(integration.importlib.metadata, "version", lambda name: version)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert integration.register() == integration.HF_ENGINE_NAME
    assert {integration.ATTENTION_NAME, integration.HF_ENGINE_NAME} <= set(
        AttentionInterface._global_mapping)
    refused = version in ("5.18.2", "5.19.0", "5.24.0", "6.1.0")
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert len(messages) == int(refused), messages
    assert all(f"transformers {version}'s" in m for m in messages)


def test_engine_admits_backends_reads_versions():
    from paged_numba.integrations.transformers import engine_admits_backends

    assert [engine_admits_backends(v) for v in ("5.17.3", "5.18.0", "5.19.0rc1", "4.57.0", "5.100.0")] == [
        True, False, False, True, False]
    with pytest.raises(ValueError, match="version must look like"):
        engine_admits_backends("latest")


def test_step_attention_needs_its_step(llama):
    import torch
    from paged_numba.integrations.transformers import ATTENTION_NAME, register

    model, prompts = llama
    register()
    model.set_attn_implementation(ATTENTION_NAME)
    try:
        with pytest.raises(ValueError, match="paged_numba_step"):
            model(torch.tensor([prompts[0]], device=model.device))
    finally:
        model.set_attn_implementation("sdpa")


# a stand-in engine cache of 4 blocks of 4 tokens, 2 KV heads of 16; 4 query heads
NB, BS, HKV, H, D = 4, 4, 2, 4, 16
# the engine's indices of one forward (see the test below), and of one that only decodes:
# request 0 has 4 cached tokens in block 2 and decodes position 4 into block 0 (page 0),
# request 1 has 4 cached in block 1 and decodes position 4 into block 3 (page 12)
MIXED = dict(cu_q=[0, 2, 3], cu_k=[0, 5, 10], read=[8, 9, 10, 11, 0, 4, 5, 6, 7, 12],
             write=[11, 0, 12])
DECODE = dict(cu_q=[0, 1, 2], cu_k=[0, 5, 10], read=[8, 9, 10, 11, 0, 4, 5, 6, 7, 12],
              write=[0, 12])


def _engine_call(batch, seed=3):
    """``(engine cache, query, key, value, keyword arguments)`` of one layer's
    call of the backend as transformers' engine makes it for ``batch`` (one of
    :data:`MIXED`, :data:`DECODE`), random values, on the engine's device."""
    import torch

    class EngineCache:                      # the attributes the backend reads
        block_size, num_blocks = BS, NB
        layer_index_to_group_indices, sliding_windows = {0: (0, 0)}, {0: 1}

    g = torch.Generator().manual_seed(seed)
    dev = "cpu" if SIM else "cuda"          # the backend takes the engine's device tensors

    def randn(*shape):
        return torch.randn(shape, generator=g).to(dev)

    def ints(x, dtype=torch.int64):
        return torch.tensor(x, dtype=dtype, device=dev)

    engine = EngineCache()
    engine.key_cache = [randn((NB + 2) * BS, HKV, D)]
    engine.value_cache = [randn((NB + 2) * BS, HKV, D)]
    rows = len(batch["write"])
    q, k, v = randn(1, H, rows, D), randn(1, HKV, rows, D), randn(1, HKV, rows, D)
    kwargs = dict(cache=engine, cu_seq_lens_q=ints(batch["cu_q"], torch.int32),
                  cu_seq_lens_k=ints(batch["cu_k"], torch.int32),
                  read_index=[ints(batch["read"])], write_index=[ints(batch["write"])])
    return engine, q, k, v, kwargs


def test_hf_paged_attention_writes_the_engines_cache_in_place():
    """One layer's call as transformers' engine makes it (:data:`MIXED`):
    request 0 has 3 cached tokens in blocks [2, 0] and 2 new rows (positions
    3 and 4: pages 11 and 0); request 1 has 4 cached in block 1 and decodes
    position 4 into block 3 (page 12). The new keys and values land in the
    engine's tensors at those pages and nowhere else, and the output is
    attention over them."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from types import SimpleNamespace

    from paged_numba.integrations.transformers import hf_paged_attention
    from paged_numba.reference import gather_kv, paged_prefill_reference
    from paged_numba.testing import check_close, prefill_error_bound

    scale = 0.3                             # not 1 / sqrt(16): the scale must arrive
    engine, q, k, v, kwargs = _engine_call(MIXED)
    before = engine.key_cache[0].clone(), engine.value_cache[0].clone()
    write = MIXED["write"]
    out, weights = hf_paged_attention(SimpleNamespace(layer_idx=0), q, k, v, None, scaling=scale,
                                      **kwargs)
    assert weights is None and out.shape == (3, H, D)
    others = torch.ones((NB + 2) * BS, dtype=torch.bool, device=q.device)
    others[write] = False
    for pool, new, old in zip((engine.key_cache[0], engine.value_cache[0]), (k, v), before):
        assert torch.equal(pool[write], new[0].transpose(0, 1))
        assert torch.equal(pool[others], old[others])
    kpool, vpool = (p.view(NB + 2, BS, HKV, D).cpu().numpy() for p in (engine.key_cache[0],
                                                                 engine.value_cache[0]))
    tables, lens, cu = [[2, 0], [1, 3]], [5, 5], [0, 2, 3]
    qs = q[0].transpose(0, 1).cpu().numpy()
    ref, _ = paged_prefill_reference(qs, kpool, vpool, tables, cu, lens, scale=scale)
    for i, positions in enumerate(([3, 4], [4])):
        keys, values = gather_kv(kpool, vpool, tables[i], lens[i])
        bound, _ = prefill_error_bound(qs[cu[i]:cu[i + 1]], keys, values, scale, positions)
        check_close(out[cu[i]:cu[i + 1]].cpu().numpy(), ref[cu[i]:cu[i + 1]], bound)


def _record_streams(monkeypatch):
    """Wrap every function the backends launch through (and the upload of the
    step's integers) to record the ``stream`` each call gets: a list of
    ``(name, stream)``."""
    from paged_numba.integrations import _tensors

    seen = []

    def recording(name, fn, position=None):
        def call(*args, **kwargs):
            stream = args[position] if position is not None and len(args) > position \
                else kwargs.get("stream")
            seen.append((name, stream))
            return fn(*args, **kwargs)
        return call

    for name in ("write_kv", "paged_prefill", "paged_decode"):
        monkeypatch.setattr(pn, name, recording(name, getattr(pn, name)))
    monkeypatch.setattr(pn.DecodePlan, "run", recording("DecodePlan.run", pn.DecodePlan.run))
    monkeypatch.setattr(_tensors, "kernel_ints", recording("kernel_ints", _tensors.kernel_ints, 1))
    return seen


@pytest.mark.parametrize("backend,batch", [("engine", MIXED), ("engine", DECODE),
                                           ("loop", MIXED), ("loop", DECODE)],
                         ids=["engine-mixed", "engine-decode", "loop-mixed", "loop-decode"])
def test_backends_launch_on_the_current_stream(backend, batch, monkeypatch):
    """The backends launch every kernel (write_kv and the attention) on
    torch's current stream and upload the step's integers for it: on a GPU a
    side stream, as transformers' engine computes on, gives the output of
    the default stream; on the simulator, CPU tensors take no stream, and
    the stream ``launch_stream`` names is the one every call gets."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from types import SimpleNamespace

    from paged_numba.integrations import _tensors
    from paged_numba.integrations.hf_loop import StepAttention
    from paged_numba.integrations.transformers import hf_paged_attention

    def attend():
        engine, q, k, v, kwargs = _engine_call(batch)
        if backend == "engine":
            out, _ = hf_paged_attention(SimpleNamespace(layer_idx=0), q, k, v, None, scaling=0.3,
                                        **kwargs)
            return out
        tables, lens = [[2, 0], [1, 3]], [5, 5]
        cache = pn.PagedKVCache(NB, BS, HKV, D, dtype="float32", num_layers=1)
        step = SimpleNamespace(slot_mapping=np.array(batch["write"]),
                               block_tables=np.array(tables, np.int32),
                               seq_lens=np.array(lens, np.int32),
                               cu_seqlens_q=np.array(batch["cu_q"], np.int32))
        return StepAttention(cache, step)(0, q, k, v, 0.3)

    reference = attend()                    # the default stream
    seen = _record_streams(monkeypatch)
    if SIM:
        assert attend() is not None and {s for _, s in seen} == {None}   # CPU tensors: none
        marker = cuda.stream()              # what launch_stream names, passed on as it is
        given = []
        monkeypatch.setattr(_tensors, "launch_stream", lambda like: given.append(like) or marker)
        seen.clear()
        out = attend()
        assert given and all(t.shape[-1] == D for t in given)
        expect = marker
    else:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = attend()
        side.synchronize()
        expect = side
    names = [n for n, _ in seen]
    assert "write_kv" in names and "kernel_ints" in names
    assert {"paged_prefill", "paged_decode", "DecodePlan.run"} & set(names)
    assert all(s is expect or s == expect for _, s in seen), seen
    assert torch.equal(out, reference)


def test_tables_from_hf_indices_without_cached_keys():
    # a batch of fresh prompts: no read indices, the keys are the query rows
    b = tables_from_hf_indices([0, 2, 3], [0, 2, 3], [], [4, 5, 8, 40], block_size=4,
                               num_pages=32)
    assert b.block_tables.tolist() == [[1], [2]] and b.seq_lens.tolist() == [2, 1]
    assert b.slot_mapping.tolist() == [4, 5, 8] and b.cu_seqlens_q.tolist() == [0, 2, 3]
