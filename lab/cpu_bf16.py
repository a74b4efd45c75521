"""
lab/cpu_bf16.py: the pi_old gap of a bf16 run. A bf16 rollout records log pi_old from the
engine on the bf16 rollout copy (bf16 weights, bf16 residual stream, the engine's kernels); the
trainer's first update recomputes the same tokens' log-probs from the fp32 master weights under
torch.autocast (steps.compute_context: bf16 products, float32 residual stream and norms, Hugging
Face's kernels). Where both were exact the importance ratio would be 1; what it is instead:

    rho_t = exp(log pi_trainer(a_t | s_t) - log pi_old(a_t | s_t))      a_t a sampled token
    GapStats: max and mean |log rho|, mean rho, the share of rho outside the surrogate's clip
    [1 - rpo.CLIP_LOW, 1 + rpo.CLIP_HIGH] (a token clipped at the first update, which would
    otherwise be on-policy), over every sampled token.

The same in float32 is the control: the engine against the fp32 forward, kernels apart alone.
Beside it, the products' rate on this CPU (product_rates): x @ W^T at SmolLM2's fused q/k/v shape
(576 -> 4,608), one thread, 8 and 512 rows, float32 and bf16, plain and oneDNN-packed
(lab.cpu_products; bf16 packed only where oneDNN runs bf16), the median of five timings.

    python -m lab.cpu_bf16 --json          # SmolLM2, 8 held-out openings, 32 tokens, T 0.7
    python -m lab.cpu_bf16 --products-only --json   # the products' rates alone (seconds)
    python -m pytest -q tests/test_cpu_bf16.py
"""
import argparse
import copy
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from persuarena import arena
from persuarena import engine
from persuarena import models
from persuarena import rollout
from persuarena import rpo
from lab import cli, cpu_products, presets

OPENINGS = 8          # held-out scenarios whose persuader openings are sampled
MAX_NEW_TOKENS = 32   # the cpu preset's message length
TEMPERATURE = 0.7     # the cpu preset's persuader temperature (rollout.SAMPLING["cpu"])


@dataclass
class GapStats:
    """The importance ratio at a first update, over every sampled token (module docstring)."""
    dtype: str
    tokens: int
    max_abs_log_ratio: float
    mean_abs_log_ratio: float
    mean_ratio: float
    outside_clip_share: float


def gap_stats(dtype, old, new, clip_low=None, clip_high=None):
    """GapStats of the recorded log-probs `old` and the trainer's `new` (1-D, one a token)."""
    clip_low = rpo.CLIP_LOW if clip_low is None else clip_low
    clip_high = rpo.CLIP_HIGH if clip_high is None else clip_high
    log_ratio = new.double() - old.double()
    ratio = log_ratio.exp()
    outside = (ratio < 1 - clip_low) | (ratio > 1 + clip_high)
    n = len(log_ratio)
    return GapStats(str(dtype).removeprefix("torch."), n, float(log_ratio.abs().max()) if n else 0.0,
                    float(log_ratio.abs().mean()) if n else 0.0,
                    float(ratio.mean()) if n else 1.0, float(outside.double().mean()) if n else 0.0)


def rollout_logprobs(rollout_copy, prompts, max_new_tokens, temperature, seed=0):
    """(sampled ids, the log-probs the engine recorded) of each prompt, sampled at `temperature`
    from the keyed stream engine.stream_key(seed, i), as a rollout records them."""
    eng = engine.Engine(rollout_copy)
    sids = [eng.new(p) for p in prompts]
    outs = eng.generate(sids, max_new_tokens, engine.Sampling(temperature),
                        [engine.stream_key(seed, i) for i in range(len(sids))], [])
    for s in sids:
        eng.free(s)
    return [(ids, torch.tensor(logps)) for ids, logps, _ in outs]


def trainer_logprobs(policy, prompt, ids, temperature, dtype):
    """The trainer's log-probs of `ids` after `prompt`: a full forward of the fp32 policy, under
    autocast to `dtype` unless it is float32 (steps.compute_context), log softmax(logits / T)."""
    from lab import steps
    context = steps.compute_context(policy, argparse.Namespace(dtype=str(dtype).removeprefix(
        "torch.")), world=1)
    full = torch.tensor([prompt + ids])
    with torch.no_grad(), context:
        logits = policy(full, use_cache=False).logits[:, len(prompt) - 1:-1]
    return rpo.target_logprobs(logits, torch.tensor([ids]), temperature)[0]


def pi_old_gap(policy, prompts, dtype, max_new_tokens=MAX_NEW_TOKENS, temperature=TEMPERATURE,
               seed=0):
    """GapStats of a `dtype` rollout copy of the fp32 `policy` (as train.py makes it) against
    the trainer's log-probs of the same tokens."""
    rollout_copy = copy.deepcopy(policy).to(dtype)
    old, new = [], []
    for prompt, (ids, logps) in zip(prompts, rollout_logprobs(rollout_copy, prompts,
                                                              max_new_tokens, temperature, seed)):
        old.append(logps)
        new.append(trainer_logprobs(policy, prompt, ids, temperature, dtype))
    return gap_stats(dtype, torch.cat(old), torch.cat(new))


def product_rates(rows=(8, 512), repeats=5):
    """{"DTYPE LAYOUT, N rows": GFLOP/s} of x @ W^T, W [4,608, 576], on one thread: the median
    of `repeats` timings of a loop sized to take a fraction of a second at float32's rate."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        w, out = torch.randn(4608, 576, generator=torch.Generator().manual_seed(0)), {}
        for n in rows:
            x = torch.randn(n, 576)
            cases = {"float32 plain": (lambda a: a @ w.t(), x)}
            if cpu_products.packs("cpu", torch.float32):
                cases["float32 packed"] = (cpu_products.Packed(w), x)
            wb = w.bfloat16()
            cases["bf16 plain"] = (lambda a: a @ wb.t(), x.bfloat16())
            if cpu_products.packs("cpu", torch.bfloat16):
                cases["bf16 packed"] = (cpu_products.Packed(wb), x.bfloat16())
            for name, (product, a) in cases.items():
                loops = max(1, 2000 // n) if "bf16 plain" not in name or cpu_products.onednn_bf16() \
                    else max(1, 200 // n)
                product(a)
                timings = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    for _ in range(loops):
                        product(a)
                    timings.append(2 * n * w.numel() * loops / (time.perf_counter() - start) / 1e9)
                out[f"{name}, {n} rows"] = round(statistics.median(timings), 1)
        return out
    finally:
        torch.set_num_threads(threads)


def opening_prompts(tokenizer, n):
    """The persuader prompts of the first n held-out scenarios, stratified (arena.stratified)."""
    instances = arena.stratified(arena.heldout_instances(arena.load_scenarios()), n)
    return [rollout.prompt_ids(tokenizer, tokenizer, inst)[0] for inst in instances]


def main(argv=None):
    p = cli.new_parser("python -m lab.cpu_bf16", __doc__)
    p.add_argument("--model", default="smollm2", help="the policy (loaded in float32)")
    p.add_argument("--openings", type=int, default=OPENINGS, help="held-out openings sampled")
    p.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS, help="tokens sampled each")
    p.add_argument("--temperature", type=float, default=TEMPERATURE, help="the persuader's T")
    p.add_argument("--products-only", action="store_true",
                   help="measure the products' rates alone (no model, no pi_old gap)")
    p.add_argument("--json", action="store_true", help="print the results as one JSON line")
    args = p.parse_args(argv)
    if args.openings < 1 or args.max_new_tokens < 1 or not args.temperature > 0:
        p.exit(2, "lab.cpu_bf16: --openings, --max-new-tokens and --temperature must be positive; "
                  "pass e.g. --openings 4 --max-new-tokens 16 --temperature 0.7\n")
    out = dict(load_before=os.getloadavg()[0], bf16_units=presets.bf16_units(),
               onednn_bf16=cpu_products.onednn_bf16(), default_dtype=presets.cpu_dtype()[0],
               products_gflop_s=product_rates())
    if not args.json:
        print("x @ W^T, 576 -> 4,608, one thread (GFLOP/s): " + ", ".join(
            f"{k} {v}" for k, v in out["products_gflop_s"].items()))
    if not args.products_only:
        out.update(model=args.model, openings=args.openings, max_new_tokens=args.max_new_tokens,
                   temperature=args.temperature)
        policy, tok = models.load_model(args.model, dtype=torch.float32)
        prompts = opening_prompts(tok, args.openings)
        for dtype in (torch.float32, torch.bfloat16):
            stats = pi_old_gap(policy, prompts, dtype, args.max_new_tokens, args.temperature)
            out[stats.dtype] = asdict(stats)
            if not args.json:
                print(f"{stats.dtype}: {stats.tokens} tokens, |log rho| max "
                      f"{stats.max_abs_log_ratio:.4f} mean {stats.mean_abs_log_ratio:.4f}, mean rho "
                      f"{stats.mean_ratio:.4f}, outside the clip {stats.outside_clip_share:.2%}")
    out["load_after"] = os.getloadavg()[0]
    if args.json:
        print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
