"""A transformers Llama model generating through paged_numba's kernels.

    python experiments/hf_generate.py --new-tokens 3 --prompt-lens 5,11   # tiny model, simulator
    python experiments/hf_generate.py --device cuda --dtypes float32,float16,bfloat16 \\
        --preset medium --new-tokens 128 --engine --out results/hf_generate_h100.csv

Builds a Llama-architecture model with random weights (fixed seed, nothing
downloaded) and, for each dtype of ``--dtypes`` (the same weights cast),
generates greedily for several prompts of different lengths with
paged_numba's continuous-batching loop
(``paged_numba.integrations.transformers.generate``) and with transformers'
``model.generate`` with ``sdpa`` and with ``eager`` attention (one prompt
at a time). ``--engine`` also runs transformers' continuous-batching engine
(``generate_batch``) with ``paged|paged_numba`` and ``paged|sdpa``.

For each pair (paged_numba against sdpa; eager against sdpa, the yardstick:
two attention implementations transformers ships; with ``--engine``,
``paged|paged_numba`` against ``paged|sdpa``) it prints:

* how many new tokens agree (each run picking its own tokens);
* the largest absolute difference of the final-layer logits at each
  generated step, and its maximum and mean over the steps. Every backend is
  fed sdpa's tokens here (teacher forcing), so the logits of a step are
  those of the same context; paged_numba's come from its own loop (its
  picks replaced by sdpa's), sdpa's and eager's from a prefill of the prompt
  and then one decode step a token with transformers' cache. Not for the
  engine pair;
* the new tokens per second of each run (after a warm-up run that compiles
  the kernels, on a GPU; under the simulator the rate is the simulator's).

``--out CSV`` writes one row per (dtype, pair) with the GPU, the package
versions, the git revision, a timestamp and the command (pandas). Under the
simulator keep the model tiny and the runs short: a step costs seconds there.

Token agreement in float16/bfloat16 is not expected to be total: the
kernels round differently from sdpa (tensor-core prefill rounds the softmax
weights to the cache dtype), and one flipped argmax changes every later
token of that prompt; eager against sdpa shows how far two correct
implementations drift in the same dtype. In float32 the tokens match.
"""
import argparse
import copy
import datetime
import importlib.metadata
import shlex
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import paged_numba as pn     # first: it picks the simulator or the GPU before numba.cuda loads
import torch
import transformers

from paged_numba.integrations.hf_loop import STEP_KWARG
from paged_numba.integrations.transformers import generate, register

PRESETS = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128),
    "medium": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                   num_attention_heads=16, num_key_value_heads=4, head_dim=64, vocab_size=32000),
}
DTYPES = ("float32", "float16", "bfloat16")
REFERENCE = "sdpa"
# (backend, the reference it is compared with)
PAIRS = (("paged_numba", REFERENCE), ("eager", REFERENCE))
ENGINE_PAIR = ("paged|paged_numba", "paged|sdpa")
COLUMNS = ["run_id", "timestamp", "dtype", "backend", "reference", "tokens_equal", "tokens_total",
           "first_difference", "logit_diff_max", "logit_diff_mean", "logit_diff_per_step",
           "backend_tokens_per_s", "reference_tokens_per_s", "backend_s", "reference_s",
           "new_tokens", "prompt_lens", "preset", "device", "kernels", "gpu", "paged_numba",
           "numba_cuda", "torch", "transformers", "git_rev", "command"]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--new-tokens", type=int, default=16, help="tokens generated per prompt")
    p.add_argument("--dtypes", default="float32",
                   help=f"comma-separated model dtypes, of {', '.join(DTYPES)}")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the model runs (cpu: kernels on the simulator without a GPU)")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--prompt-lens", default="5,11,23", help="comma-separated prompt lengths")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--max-batch-tokens", type=int, default=256)
    p.add_argument("--engine", action="store_true",
                   help="also run transformers' generate_batch with paged|paged_numba and paged|sdpa")
    p.add_argument("--out", metavar="CSV", help="write one row per (dtype, pair) here")
    args = p.parse_args()
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in args.dtypes if d not in DTYPES]
    if bad or not args.dtypes:
        p.error(f"--dtypes must name some of {', '.join(DTYPES)}, but got {bad or args.dtypes}")
    return args


def timed(fn, device):
    """``(result, seconds)`` of ``fn()``, the GPU synchronised on both sides."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return result, time.perf_counter() - start


# -- free-running generation: tokens and time


def hf_generate(model, prompts, new_tokens, attn):
    """``model.generate`` (greedy, attention ``attn``), one prompt at a time."""
    model.set_attn_implementation(attn)
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
        model.set_attn_implementation(REFERENCE)
    return [out[f"req_{i}"].generated_tokens for i in range(len(prompts))]


def agreement(a, b):
    """``(equal new tokens, all new tokens, first differing index of each prompt)``;
    where one run has fewer tokens (a failed run has none), the first index it lacks
    differs."""
    same = total = 0
    first = []
    for x, y in zip(a, b):
        diff = [i for i, (s, t) in enumerate(zip(x, y)) if s != t]
        if len(x) != len(y):
            diff.append(min(len(x), len(y)))
        first.append(diff[0] if diff else None)
        same += sum(s == t for s, t in zip(x, y))
        total += max(len(x), len(y))
    return same, total, first


# -- teacher-forced logits: every backend on the same tokens


class Forced:
    """``model`` as :func:`generate` calls it, except that each step's picks
    are ``tokens`` (``[num_prompts][new_tokens]``) instead of the argmax, and
    the logits ``[vocab]`` behind every pick are kept in ``logits``
    (``[num_prompts][new_tokens]``, float32 on the CPU)."""

    def __init__(self, model, tokens):
        self._model, self.tokens = model, tokens
        self.logits = [[None] * len(t) for t in tokens]

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, **kwargs):
        out = self._model(**kwargs)
        picks = torch.zeros_like(out.logits)            # [1, sampled rows, vocab]
        for row, req in enumerate(kwargs[STEP_KWARG].step.sampled):
            j = len(req.generated)                       # the generated step this row makes
            self.logits[req.index][j] = out.logits[0, row].float().cpu()
            picks[0, row, self.tokens[req.index][j]] = 1
        return SimpleNamespace(logits=picks)


def paged_step_logits(model, prompts, tokens, options):
    """paged_numba's loop fed ``tokens``: ``[new_tokens, vocab]`` float32 a prompt."""
    forced = Forced(model, tokens)
    generate(forced, prompts, len(tokens[0]), **options)
    return [torch.stack(rows) for rows in forced.logits]


def hf_step_logits(model, prompts, tokens, attn):
    """transformers with attention ``attn`` fed ``tokens``, as ``model.generate``
    runs: a prefill of the prompt, then one decode step a token on its cache.
    ``[new_tokens, vocab]`` float32 a prompt."""
    model.set_attn_implementation(attn)
    out = []
    with torch.inference_mode():
        for p, toks in zip(prompts, tokens):
            res = model(input_ids=torch.tensor([p], device=model.device), use_cache=True)
            rows = [res.logits[0, -1]]
            for t in toks[:-1]:
                res = model(input_ids=torch.tensor([[t]], device=model.device),
                            past_key_values=res.past_key_values, use_cache=True)
                rows.append(res.logits[0, -1])
            out.append(torch.stack(rows).float().cpu())
    return out


def step_differences(a, b):
    """The largest ``|a - b|`` at each generated step, over prompts and the
    vocabulary: a list ``[new_tokens]`` of floats."""
    per_prompt = torch.stack([(x - y).abs().amax(dim=-1) for x, y in zip(a, b)])
    return per_prompt.amax(dim=0).tolist()


# -- provenance


def git_rev():
    """The checkout's short revision, ``+dirty`` with uncommitted changes; "" without git."""
    root = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True,
                             capture_output=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, text=True, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return ""
    return rev + ("+dirty" if dirty.strip() else "")


def provenance(args, device):
    def version(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return ""

    now = datetime.datetime.now(datetime.timezone.utc)
    return dict(run_id=now.strftime("%Y%m%dT%H%M%SZ"), timestamp=now.isoformat(timespec="seconds"),
                new_tokens=args.new_tokens, prompt_lens=args.prompt_lens, preset=args.preset,
                device=str(device), kernels="simulator" if pn.simulator_enabled() else "gpu",
                gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else "",
                paged_numba=version("paged-numba"), numba_cuda=version("numba-cuda"),
                torch=torch.__version__, transformers=transformers.__version__,
                git_rev=git_rev(),
                command="python experiments/hf_generate.py " + shlex.join(sys.argv[1:]))


# -- one dtype


def run_dtype(master, dtype, prompts, args, device, on_gpu):
    """The rows of one dtype: a copy of ``master`` cast to it, every run."""
    model = copy.deepcopy(master).to(getattr(torch, dtype)).to(device).eval()
    new = args.new_tokens
    n_tokens = new * len(prompts)
    options = dict(block_size=args.block_size, chunk_size=args.chunk_size,
                   max_batch_tokens=args.max_batch_tokens)
    if on_gpu:                              # compile the kernels and load their modules first
        generate(model, prompts, 2, **options)
        for attn in (REFERENCE, "eager"):
            hf_generate(model, prompts[:1], 2, attn)
    stats = {}
    runs = {"paged_numba": timed(lambda: generate(model, prompts, new, stats=stats, **options),
                                 device)}
    for attn in (REFERENCE, "eager"):
        runs[attn] = timed(lambda: hf_generate(model, prompts, new, attn), device)
    forced = runs[REFERENCE][0]             # every backend's logits on sdpa's tokens
    logits = {"paged_numba": paged_step_logits(model, prompts, forced, options)}
    for attn in (REFERENCE, "eager"):
        logits[attn] = hf_step_logits(model, prompts, forced, attn)
    pairs = list(PAIRS)
    if args.engine:
        register()                          # "paged|paged_numba"
        for name in ENGINE_PAIR:
            if on_gpu:
                engine_generate(model, prompts, 2, name, args.block_size)
            runs[name] = timed(lambda: engine_generate(model, prompts, new, name, args.block_size),
                               device)
        pairs.append(ENGINE_PAIR)
    model.set_attn_implementation(REFERENCE)
    print(f"{dtype}: paged_numba loop {stats}")
    rows = []
    for backend, reference in pairs:
        (ours, t_ours), (theirs, t_theirs) = runs[backend], runs[reference]
        same, total, first = agreement(ours, theirs)
        row = dict(dtype=dtype, backend=backend, reference=reference, tokens_equal=same,
                   tokens_total=total,
                   first_difference=";".join("-" if i is None else str(i) for i in first),
                   backend_tokens_per_s=n_tokens / t_ours,
                   reference_tokens_per_s=n_tokens / t_theirs, backend_s=t_ours,
                   reference_s=t_theirs)
        if backend in logits:
            steps = step_differences(logits[backend], logits[reference])
            row.update(logit_diff_max=max(steps), logit_diff_mean=sum(steps) / len(steps),
                       logit_diff_per_step=";".join(f"{d:.4g}" for d in steps))
        rows.append(row)
    return rows


def main():
    import pandas as pd     # (the table; checked before the minutes of generation)
    args = parse_args()
    device = torch.device(args.device)
    on_gpu = device.type == "cuda" and not pn.simulator_enabled()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**PRESETS[args.preset], max_position_embeddings=4096,
                                      eos_token_id=None, pad_token_id=0)
    master = transformers.LlamaForCausalLM(config).to(torch.float32).eval()     # on the CPU
    g = torch.Generator().manual_seed(1)
    lens = [int(n) for n in args.prompt_lens.split(",")]
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=g).tolist() for n in lens]
    print(f"{args.preset} Llama ({config.num_hidden_layers} layers, {config.num_attention_heads} "
          f"heads, {config.num_key_value_heads} KV heads, head_dim {config.head_dim}) on {device}, "
          f"kernels on {'the simulator' if pn.simulator_enabled() else 'the GPU'}; "
          f"prompts {lens}, {args.new_tokens} new tokens each; dtypes {args.dtypes}")
    rows = []
    for dtype in args.dtypes:
        rows += run_dtype(master, dtype, prompts, args, device, on_gpu)

    meta = provenance(args, device)
    df = pd.DataFrame([dict(meta, **r) for r in rows]).reindex(columns=COLUMNS)
    shown = ["dtype", "backend", "reference", "tokens_equal", "tokens_total", "first_difference",
             "logit_diff_max", "logit_diff_mean", "backend_tokens_per_s", "reference_tokens_per_s"]
    with pd.option_context("display.width", 200, "display.max_columns", None):
        print(df[shown].to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    for r in rows:
        if "logit_diff_per_step" in r:
            print(f"{r['dtype']} {r['backend']} vs {r['reference']}, largest |logit difference| "
                  f"per step: {r['logit_diff_per_step']}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        df.to_csv(args.out, index=False)
        print(f"wrote {len(df)} rows to {args.out}")


if __name__ == "__main__":
    main()
