"""A transformers Llama model generating through paged_numba's kernels.

    python experiments/hf_generate.py                          # tiny model, simulator or GPU
    python experiments/hf_generate.py --device cuda --dtype float16 --preset medium \\
        --new-tokens 128 --engine

Builds a Llama-architecture model with random weights (fixed seed, nothing
downloaded), generates greedily for several prompts of different lengths
with paged_numba's continuous-batching loop
(``paged_numba.integrations.transformers.generate``) and with transformers'
``model.generate`` (sdpa, one prompt at a time), and prints how many new
tokens agree. ``--engine`` also runs transformers' continuous-batching
engine (``generate_batch``) with ``paged|paged_numba`` and ``paged|sdpa``.
On a GPU it prints the tokens per second of each path (after a warm-up
run that compiles the kernels). Under the simulator keep the defaults: a
step costs seconds there.

Token agreement in float16/bfloat16 is not expected to be total: the
kernels round differently from sdpa (tensor-core prefill rounds the softmax
weights to the cache dtype), and one flipped argmax changes every later
token of that prompt. In float32 the tokens match.
"""
import argparse
import time

import paged_numba as pn     # first: it picks the simulator or the GPU before numba.cuda loads
import torch
import transformers

from paged_numba.integrations.transformers import generate, register

PRESETS = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128),
    "medium": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                   num_attention_heads=16, num_key_value_heads=4, head_dim=64, vocab_size=32000),
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--new-tokens", type=int, default=16, help="tokens generated per prompt")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the model runs (cpu: kernels on the simulator without a GPU)")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--prompt-lens", default="5,11,23", help="comma-separated prompt lengths")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--max-batch-tokens", type=int, default=256)
    p.add_argument("--engine", action="store_true",
                   help="also run transformers' generate_batch with paged|paged_numba and paged|sdpa")
    return p.parse_args()


def timed(fn, device):
    """``(result, seconds)`` of ``fn()``, the GPU synchronised on both sides."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return result, time.perf_counter() - start


def sdpa_generate(model, prompts, new_tokens):
    model.set_attn_implementation("sdpa")
    out = []
    for p in prompts:
        ids = torch.tensor([p], device=model.device)
        gen = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0)
        out.append(gen[0, len(p):].tolist())
    return out


def engine_generate(model, prompts, new_tokens, attn, block_size):
    model.set_attn_implementation(attn)
    gen = transformers.GenerationConfig(max_new_tokens=new_tokens, do_sample=False,
                                        eos_token_id=None, pad_token_id=0)
    cb = transformers.ContinuousBatchingConfig(
        block_size=block_size,
        num_blocks=sum(-(-(len(p) + new_tokens) // block_size) for p in prompts) + 4,
        max_batch_tokens=256, max_requests_per_batch=len(prompts), use_cuda_graph=False)
    try:
        out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb,
                                   progress_bar=False)
    finally:
        model.set_attn_implementation("sdpa")
    return [out[f"req_{i}"].generated_tokens for i in range(len(prompts))]


def agreement(a, b):
    """``(equal new tokens, all new tokens, first differing index of each prompt)``."""
    same = total = 0
    first = []
    for x, y in zip(a, b):
        diff = [i for i, (s, t) in enumerate(zip(x, y)) if s != t]
        first.append(diff[0] if diff else None)
        same += sum(s == t for s, t in zip(x, y))
        total += max(len(x), len(y))
    return same, total, first


def report(name, tokens, seconds, on_gpu):
    rate = f", {tokens / seconds:,.0f} tokens/s" if on_gpu else ""
    print(f"{name:<44} {seconds:8.2f} s{rate}")


def main():
    args = parse_args()
    device = torch.device(args.device)
    on_gpu = device.type == "cuda" and not pn.simulator_enabled()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**PRESETS[args.preset], max_position_embeddings=4096,
                                      eos_token_id=None, pad_token_id=0)
    model = transformers.LlamaForCausalLM(config).to(getattr(torch, args.dtype)).to(device).eval()
    g = torch.Generator().manual_seed(1)
    lens = [int(n) for n in args.prompt_lens.split(",")]
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=g).tolist() for n in lens]
    new = args.new_tokens
    n_tokens = new * len(prompts)
    print(f"{args.preset} Llama ({config.num_hidden_layers} layers, {config.num_attention_heads} "
          f"heads, {config.num_key_value_heads} KV heads, head_dim {config.head_dim}), "
          f"{args.dtype} on {device}, kernels on {'the simulator' if pn.simulator_enabled() else 'the GPU'}; "
          f"prompts {lens}, {new} new tokens each")
    options = dict(block_size=args.block_size, chunk_size=args.chunk_size,
                   max_batch_tokens=args.max_batch_tokens)
    if on_gpu:                              # compile the kernels and load their modules first
        generate(model, prompts, 2, **options)
        sdpa_generate(model, prompts[:1], 2)
    stats = {}
    ours, t_ours = timed(lambda: generate(model, prompts, new, stats=stats, **options), device)
    theirs, t_theirs = timed(lambda: sdpa_generate(model, prompts, new), device)
    same, total, first = agreement(ours, theirs)
    print(f"paged_numba loop vs model.generate (sdpa): {same}/{total} new tokens equal; first "
          f"difference per prompt: {first}; {stats}")
    report("paged_numba loop (continuous batching)", n_tokens, t_ours, on_gpu)
    report("model.generate, sdpa, one prompt at a time", n_tokens, t_theirs, on_gpu)
    if args.engine:
        attn = register()
        if on_gpu:
            engine_generate(model, prompts, 2, attn, args.block_size)
        mine, t_mine = timed(lambda: engine_generate(model, prompts, new, attn, args.block_size),
                             device)
        ref, t_ref = timed(lambda: engine_generate(model, prompts, new, "paged|sdpa",
                                                   args.block_size), device)
        same, total, first = agreement(mine, ref)
        print(f"generate_batch paged|paged_numba vs paged|sdpa: {same}/{total} new tokens equal; "
              f"first difference per prompt: {first}")
        report("generate_batch, paged|paged_numba", n_tokens, t_mine, on_gpu)
        report("generate_batch, paged|sdpa", n_tokens, t_ref, on_gpu)


if __name__ == "__main__":
    main()
