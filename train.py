"""
train.py: Probe-RPO, online RL for the persuader against a frozen persuadee.

Each step (rpo.py has the equations):
  1. sample INSTANCES scenario instances; roll out GROUP_SIZE episodes of each with the current
     policy against the frozen persuadee (rollout.py), probes read after every reply (probes.py);
  2. the strategy judge scores each transcript; R = GOAL[outcome] + STRATEGY_WEIGHT * s;
  3. A_{i,t} = A_out_i + LAMBDA * (D_{i,t} - mean D), on every token of persuader message t;
  4. one clipped-surrogate + k3-KL update on the persuader's own tokens, the loss summed over
     micro-batches and ranks and divided by the global persuader-token count; grad clipping;
  5. the rollout engine is pointed at the new weights.
Groups are sharded across ranks (torchrun). The actor's master weights, gradients and AdamW
moments are fp32, sharded with FSDP2 under a MixedPrecisionPolicy (bf16 compute, fp32 gradient
reduction; autocast in one process); its rollout copy in --dtype is the actor engine's own
weights, written in place after each step; the frozen reference is sharded too (or is the
persuadee's model when they are the same); persuadee and judge are frozen and unsharded, a
judge naming the persuadee's model sharing its engine. The memory plan (--plan, and the first
lines of every run) is arithmetic from the configs; what cannot fit is refused before loading.
Checkpoints are Hugging Face folders of the fp32 master weights (the policy loads with
AutoModelForCausalLM.from_pretrained) plus the optimizer, written to a temporary folder and
renamed, so a run killed at any moment resumes from the last one.
metrics.jsonl is the record of truth (its diagnostics pooled over ranks: counts and sums are
all-reduced before each division); rollouts.jsonl keeps one small record per training episode
(step_records), so analyses of training rollouts need no rerun. --log tensorboard (a SummaryWriter in runs/NAME) and
--log wandb (offline unless WANDB_MODE says otherwise) get the same scalars under train/, the
held-out summaries under heldout/ and a table of sample dialogues.
Guards: arguments are checked before any model loads; an existing run is refused without --resume
or --overwrite; --resume reads trainer.pt with weights_only=True and checks the saved weights name
by name and shape by shape; a non-finite log-prob, advantage, loss or gradient norm skips the step
(counted in metrics.jsonl, which is always valid JSON); a failed write leaves the last checkpoint.

    python train.py                                # cpu preset (the default without CUDA)
    python train.py --steps 50 --lam 0 --name grpo # an ablation: outcome-only GRPO
    python train.py --name NAME --resume           # continue a killed run
    python train.py --log tensorboard              # also TensorBoard events in runs/NAME
    python train.py --judge openai:MODEL@URL       # a judge served over the OpenAI API
    python train.py --persuadee openai:MODEL@URL   # a persuadee (and judge) served over the API
    torchrun --nproc_per_node 8 train.py           # paper preset on a GPU node
    python train.py --preset paper --plan          # its memory per rank on 8 x H200, on any machine
"""
import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from tqdm import tqdm

import arena
import engine
import layers
import models
from lab import lora, plan
import probes
import rollout
import rpo
from lab import runs
from lab import served

# The presets. Turns and tokens a message come from the constants that own them
# (owned_defaults: arena.T_MAX_TRAIN, arena.T_MAX_EVAL, engine.MAX_NEW_TOKENS), read when the
# arguments are parsed, so an edited constant changes every preset that does not override it;
# "cpu" and "tiny" state their overrides here, in one place.
PRESETS = {
    "paper": dict(persuader="Qwen/Qwen3-4B-Instruct-2507", persuadee="Qwen/Qwen3-14B",
                  judge=None, dtype="bfloat16", steps=200, instances=16, group_size=8, lr=1e-6,
                  micro_batch=4, eval_every=20, eval_limit=120, save_every=20, sampling="paper"),
    # cpu: SmolLM2-135M as judge wrote a verdict for 1 transcript in 56, a copy of the answer
    # template, at 30% of the step (DECISIONS.md: Small presets' judge): no judge, s = 0
    "cpu": dict(persuader="smollm2", persuadee="smollm2", judge="none", dtype="float32", steps=3,
                instances=2, group_size=4, lr=1e-5, micro_batch=4, eval_every=0, eval_limit=4,
                save_every=1, sampling="cpu",
                t_max=2, eval_t_max=3, max_new_tokens=32),  # overrides: a CPU step in about 40 s
    # tiny: a random judge never writes a verdict (s falls back to 0 on every transcript, after
    # four attempts): no judge gives the same s = 0 at no cost (DECISIONS.md: Small presets' judge)
    "tiny": dict(persuader="random:tiny-llama", persuadee="random:tiny-qwen3", judge="none",
                 dtype="float32", steps=4, instances=2, group_size=2, lr=1e-3, micro_batch=2,
                 eval_every=0, eval_limit=2, save_every=2, sampling="paper",
                 t_max=2, eval_t_max=2, max_new_tokens=4),  # overrides: tiny random models
}
LORA_RANK = 64                      # --preset one-gpu's adapter rank (train.py --lora)
PRESETS["one-gpu"] = dict(  # the paper's models and sampling on one H200, LoRA (README: Train with LoRA on one GPU)
    PRESETS["paper"], lora=LORA_RANK, lr=1e-5, instances=2, micro_batch=2, eval_limit=16,
    plan_ranks=1)


def owned_defaults():
    """The preset values other files own, as they are now."""
    return dict(t_max=arena.T_MAX_TRAIN, eval_t_max=arena.T_MAX_EVAL,
                max_new_tokens=engine.MAX_NEW_TOKENS)


def preset_values(name):
    """Every value of a preset: the owned defaults, then the preset's own (its overrides)."""
    return {**owned_defaults(), **PRESETS[name]}


GRAD_CLIP = 1.0                     # max global grad norm
WEIGHT_DECAY = 0.0                  # AdamW weight decay
SEED = 0
SAMPLE_DIALOGUES = 2                # episodes a step kept in samples-STEP.json and the loggers' table
DTYPES = ("float32", "bfloat16", "float16")  # --dtype choices
NONFINITE_CHECKS = ("logprobs", "advantages", "loss", "grad_norm")  # a non-finite one skips the step
MAX_SKIPPED_STEPS = 3               # consecutive skipped (non-finite) steps that stop the run
RESUME_MAY_CHANGE = ("steps", "eval_every", "eval_limit", "eval_fidelity", "save_every", "log")  # recorded in config.json
NOT_SETTINGS = ("name", "out", "resume", "overwrite", "skipped_instances", "resumed", "plan",
                "plan_ranks", "plan_gib", "allow_insecure_key")  # (where the key may go is no setting)
POSITIVE = ("steps", "instances", "group_size", "t_max", "eval_t_max", "max_new_tokens",
            "micro_batch", "eval_limit", "save_every")  # integer arguments that must be >= 1


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=PRESETS, default=None,
                   help="paper on CUDA, cpu otherwise; every value below overrides it")
    for key in ("persuader", "persuadee", "dtype"):
        p.add_argument(f"--{key}")
    p.add_argument("--judge", help="judge model (default: the persuadee's); 'none' gives s = 0")
    for key in ("steps", "instances", "group_size", "t_max", "eval_t_max", "max_new_tokens",
                "micro_batch", "eval_every", "eval_limit", "save_every"):
        p.add_argument(f"--{key.replace('_', '-')}", dest=key, type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--eval-fidelity", type=int, help="read-outs of each held-out evaluation checked "
                   "against a full forward (default eval.FIDELITY_SAMPLES; 0 skips the check, "
                   "which changes no result: the persuadee is frozen, one check covers the run)")
    p.add_argument("--lora", type=int, help="train rank-RANK LoRA adapters on a frozen base "
                   "(models.py, LoRA) instead of every weight; 0: full fine-tuning")
    # rpo.py owns these; read at parse time, so an edited constant changes the run
    p.add_argument("--lam", type=float, default=rpo.LAMBDA)
    p.add_argument("--anchor", action=argparse.BooleanOptionalAction, default=rpo.ANCHOR)
    probes.add_flags(p)
    p.add_argument("--kl-beta", type=float, default=rpo.KL_BETA)
    p.add_argument("--clip-low", type=float, default=rpo.CLIP_LOW)
    p.add_argument("--clip-high", type=float, default=rpo.CLIP_HIGH)
    runs.add_sampling_flags(p)
    p.add_argument("--seed", type=int, default=SEED)
    arena.add_decision_flag(p)
    p.add_argument("--name", default=None, help="run folder runs/NAME (default: preset and time)")
    p.add_argument("--out", default="runs")
    p.add_argument("--resume", action="store_true", help="continue runs/NAME from its checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace an existing runs/NAME")
    p.add_argument("--scenarios", default=arena.SCENARIOS_PATH)
    p.add_argument("--log", action="append", choices=runs.LOGGERS, default=[],
                   help="also log to TensorBoard (runs/NAME) or Weights & Biases; repeatable")
    p.add_argument("--plan", action="store_true", help="print the per-rank memory plan for "
                   "--plan-ranks GPUs of --plan-gib and exit; no model loads")
    p.add_argument("--plan-ranks", type=int, default=None,
                   help=f"default: WORLD_SIZE under torchrun, else {plan.PLAN_NODE[0]}")
    p.add_argument("--plan-gib", type=float, default=None,
                   help=f"default: this GPU's memory, else {plan.PLAN_NODE[1]} (an H200)")
    served.add_key_flag(p)
    return p


def parse_args(argv=None):
    """The run's settings: the command line over its preset (over the owning constants); with
    --resume the run's config.json over the preset, pinned. Every value is validated before any
    model loads, the values read back from config.json as a fresh command line's are."""
    p = build_parser()
    args = p.parse_args(argv)
    served.ALLOW_INSECURE_KEY = args.allow_insecure_key
    args.preset = args.preset or ("paper" if torch.cuda.is_available() else "cpu")
    for key, value in preset_values(args.preset).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.name = args.name or f"{args.preset}-{time.strftime('%Y%m%d-%H%M%S')}"
    fill_sampling(args)
    run_dir = Path(args.out) / args.name
    if args.lora and args.resume:  # before the folder is read
        _fail(f"--lora {args.lora} with --resume", "cannot resume yet", "start a new run")
    runs.check_folder(args.out, args.name, "train.py", args.resume, args.overwrite,
                      first=os.environ.get("RANK", "0") == "0")
    if args.resume:
        runs.checkpoint_folder(run_dir)
        runs.pin_settings(args, runs.read_config(run_dir, "train.py"), runs.explicit_settings(p, argv),
                          "train.py", RESUME_MAY_CHANGE, NOT_SETTINGS)
    try:
        validate(args)
    except SystemExit as e:
        raise SystemExit(f"{e.code} (the value read from {run_dir / 'config.json'})"
                         if args.resume else e.code) from None
    for kind in args.log:  # before any model loads: a missing package is a one-line exit
        runs.require(kind)
    return args


def fill_sampling(args):
    """The four sampling flags a command line leaves out, from its preset (rollout.SAMPLING):
    what config.json records and every rollout of the run, its evaluations included, uses."""
    persuader, persuadee = rollout.SAMPLING[args.sampling]
    defaults = dict(persuader_temperature=persuader.temperature,
                    persuadee_temperature=persuadee.temperature, persuadee_top_p=persuadee.top_p,
                    persuadee_top_k=persuadee.top_k)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def _model_problem(name):
    """What is wrong with a model argument, or None (a hub name cannot be checked offline)."""
    if not isinstance(name, str):
        return "is not a model name"
    if name == "smollm2":
        return None
    if name.startswith("random:"):
        known = models.RANDOM_CONFIGS
        return None if name[7:] in known else f"names no random shape (one of {', '.join(known)})"
    path = Path(name).expanduser()
    if path.exists():
        return None if (path / "config.json").is_file() else \
            "is a path but not a model folder (no config.json)"
    if name.startswith(("/", ".", "~")) or name.count("/") > 1:
        return "is no such folder"
    return None


def _fail(flag, problem, fix):
    raise SystemExit(f"train.py: {flag} {problem}; {fix}")


def validate(args):
    """Every argument checked before any model loads; one line naming the flag and the fix."""
    for key in POSITIVE:
        if getattr(args, key) < 1:
            _fail(f"--{key.replace('_', '-')} {getattr(args, key)}", "must be at least 1",
                  f"pass a positive number, e.g. --{key.replace('_', '-')} {preset_values('tiny')[key]}")
    if args.instances > arena.N_TRAIN_INSTANCES:
        _fail(f"--instances {args.instances}", f"exceeds the {arena.N_TRAIN_INSTANCES} training "
              "instances", f"pass at most --instances {arena.N_TRAIN_INSTANCES}")
    if args.eval_every < 0:
        _fail(f"--eval-every {args.eval_every}", "is negative", "pass 0 (no evaluation) or a number of steps")
    if args.eval_fidelity is not None and args.eval_fidelity < 0:
        _fail(f"--eval-fidelity {args.eval_fidelity}", "is negative", "pass 0 (no check) or a number of read-outs")
    if args.dtype not in DTYPES:
        _fail(f"--dtype {args.dtype}", "is not a dtype this loop runs", f"pass one of {', '.join(DTYPES)}")
    for flag, value, example in (("--lr", args.lr, 1e-6), ("--lam", args.lam, rpo.LAMBDA),
                                 ("--kl-beta", args.kl_beta, rpo.KL_BETA),
                                 ("--clip-high", args.clip_high, rpo.CLIP_HIGH)):
        if not math.isfinite(value) or value < 0:
            _fail(f"{flag} {value}", "must be a finite number >= 0", f"pass e.g. {flag} {example}")
    if not (math.isfinite(args.clip_low) and 0 <= args.clip_low < 1):
        _fail(f"--clip-low {args.clip_low}", "must lie in [0, 1) (the ratio is clipped at 1 - clip-low)",
              f"pass e.g. --clip-low {rpo.CLIP_LOW}")
    if problem := runs.sampling_problem(args):
        _fail(*problem)
    for role in ("persuader", "persuadee", "judge"):
        name = getattr(args, role)
        if name in (None, "none") and role == "judge" or served.is_served(name) and role != "persuader":
            continue  # a served persuadee or judge is checked at start-up (ServedModel.check)
        if problem := _model_problem(name):
            _fail(f"--{role} {name}", problem, "pass a Hugging Face model folder, a hub name, "
                  "'smollm2' or random:NAME")
    if (args.lora or 0) < 0:
        _fail(f"--lora {args.lora}", "must be >= 0", "pass a rank such as --lora 8, or 0 for full fine-tuning")
    if problem := input_problem(args, validate_scenarios(args)):
        _fail(*problem)
    if args.group_size == 1:
        print("train.py: warning: --group-size 1 leaves every group without a baseline: no outcome "
              "advantage, only the dense term trains (pass --group-size 2 or more)", file=sys.stderr)


def validate_scenarios(args):
    """The scenarios file reads, and holds the splits this run plays."""
    try:
        scenarios = arena.load_scenarios(args.scenarios)
    except OSError as e:
        _fail(f"--scenarios {args.scenarios}", f"cannot be read ({e.strerror or e})",
              "pass a readable scenarios.jsonl")
    except (ValueError, TypeError) as e:
        _fail("--scenarios", f"is not a valid scenarios file ({e})", "fix that line")
    for split, needed in (("train", True), ("heldout", args.eval_every > 0)):
        if needed and not any(s["split"] == split for s in scenarios):
            _fail(f"--scenarios {args.scenarios}", f"holds no {split} scenarios",
                  "add some, or pass a file that has them" + (" (or --eval-every 0)"
                                                                  if split == "heldout" else ""))
    return scenarios


def input_problem(args, scenarios):
    """(flag, problem, fix) for a plan size that is no size or a training file that cannot give
    the run its N_TRAIN_INSTANCES distinct instances, else None."""
    if args.plan_gib is not None and not (math.isfinite(args.plan_gib) and args.plan_gib > 0):
        return f"--plan-gib {args.plan_gib}", "must be a finite number of GiB > 0", "pass e.g. --plan-gib 80"
    if args.plan_ranks is not None and args.plan_ranks < 1:
        return f"--plan-ranks {args.plan_ranks}", "must be at least 1", "pass e.g. --plan-ranks 8"
    if problem := arena.variants_problem(scenarios):
        return f"--scenarios {args.scenarios}", problem, "add training scenarios, or vary the personas"
    return None


def record_config(run_dir, args, start):
    """config.json: the settings of a new run and the constants it pins
    (runs.pinned_constants); on a resume the recorded file, with the RESUME_MAY_CHANGE settings
    that changed listed under "resumed" (and said), else untouched."""
    path = run_dir / "config.json"
    if not args.resume:
        config = {k: v for k, v in vars(args).items() if k not in ("resume", "overwrite")}
        return runs.write_atomic(path, json.dumps({**config, "constants": runs.pinned_constants()},
                                                  indent=2), who="train.py",
                                 kept="nothing was trained yet")
    config = json.loads(path.read_text())
    changes = {k: [config.get(k), getattr(args, k)] for k in RESUME_MAY_CHANGE
               if json.dumps(config.get(k)) != json.dumps(getattr(args, k))}
    if changes:
        print(f"train.py: resuming at step {start} with " + ", ".join(
            f"--{k.replace('_', '-')} {new} (was {old})" for k, (old, new) in changes.items()))
        config.update({k: new for k, (_, new) in changes.items()})
        config.setdefault("resumed", []).append(dict(step=start, changed=changes))
        runs.write_atomic(path, json.dumps(config, indent=2), who="train.py", kept=f"{path} is as it was")

# -----------------------------------------------------------------------------
# the actor: sharding, precision, weights


def shard(model, world, compute_dtype=None):
    """FSDP2: each decoder layer, then the root, sharded over the ranks. With a compute_dtype
    (the policy's bf16) the MixedPrecisionPolicy gathers the fp32 master shards cast to it for
    forward and backward and reduce-scatters the gradients in fp32; AdamW then steps fp32 shards
    with fp32 moments. A frozen model (the reference) is sharded as it is, without gradients."""
    if world == 1:
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = (MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
              if compute_dtype not in (None, torch.float32) else MixedPrecisionPolicy())
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    return fully_shard(model, mp_policy=policy)


def compute_context(model, args, world):
    """Where the trainer's forwards (policy and reference) run: off cuDNN's SDPA, as the
    engine's own attention (layers.SDPA_BACKENDS: its per-shape graph builds cost more than
    the attention at shapes that change every micro-batch), and in one process with a half
    --dtype under autocast from the fp32 master weights (under FSDP the MixedPrecisionPolicy
    casts them instead)."""
    from contextlib import ExitStack
    from torch.nn.attention import sdpa_kernel
    stack = ExitStack()
    stack.enter_context(sdpa_kernel(layers.SDPA_BACKENDS))
    device = next(model.parameters()).device
    if world == 1 and args.dtype != "float32":
        stack.enter_context(torch.autocast(device.type, dtype=getattr(torch, args.dtype)))
    return stack


@torch.no_grad()
def copy_weights(policy, rollout_model):
    """Gather the sharded fp32 master weights, one parameter at a time, into the rollout copy
    (cast to its dtype). Its parameters are the actor engine's own fused tensors (layers.fuse),
    so this writes straight into what the engine reads, at the same addresses."""
    target = dict(rollout_model.named_parameters())
    for name, p in policy.named_parameters():
        target[name].copy_(p.full_tensor() if hasattr(p, "full_tensor") else p)

def set_cpu_threads(device):
    """On a CPU with OMP_NUM_THREADS unset, torch's threads: one per core the machine's load leaves
    free (at least one). torch's default takes every core, and on a busy machine its threads then
    wait on each other (a step can take several times as long). OMP_NUM_THREADS, when set, wins."""
    if device.type != "cpu" or os.environ.get("OMP_NUM_THREADS"):
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, min(torch.get_num_threads(), cores - round(os.getloadavg()[0]))))

# -----------------------------------------------------------------------------
# one step


def step_instances(instances, args, step, rank, world):
    """This step's instances (the same on every rank, drawn from the step number) and this
    rank's share of them."""
    chosen = random.Random(args.seed * 100003 + step).sample(instances, args.instances)
    return chosen[rank::world]


def numeric(beliefs):
    """A record's beliefs as rpo.py's arithmetic takes them: NaN where none was read (a served
    persuadee without log-probs), which rpo counts. A record itself holds None (one "no value")."""
    return [math.nan if b is None else b for b in beliefs]


def advantages(records, group_size, args):
    """Rewards and Probe-RPO advantages for this rank's groups; returns per-episode turn
    advantages and the (outcome rewards, process rewards, goals) of each group for diagnostics."""
    groups, per_episode = [], []
    for g in range(0, len(records), group_size):
        group = records[g:g + group_size]
        outcome = [rpo.outcome_reward(r["outcome"], r["judge"]) for r in group]
        process = [rpo.process_rewards(numeric(r["beliefs"]), r["outcome"], args.anchor) for r in group]
        groups.append((outcome, process, [rpo.GOAL[r["outcome"]] for r in group]))
        per_episode += rpo.group_advantages(outcome, process, args.lam)
    return per_episode, groups


def at_reference(optimizer, args, device):
    """True while the policy cannot have left its initial weights (the KL reference): lr 0, or no
    weight decay and every AdamW first moment still exactly 0 (no nonzero gradient ever, this
    run or before its checkpoint)."""
    if args.lr == 0:
        return True
    moments = sum(int(getattr(st["exp_avg"], "_local_tensor", st["exp_avg"]).count_nonzero())
                  for st in optimizer.state.values() if "exp_avg" in st)
    return WEIGHT_DECAY == 0 and runs.all_sum(moments, device) == 0


def zero_advantage_step(policy, optimizer, turn_advantages, args, device):
    """A step whose every advantage is exactly 0 (a lambda = 0 step whose groups are all dead) has
    a zero gradient when its KL term has none (no KL term, or the policy still at the reference):
    its forward and backward passes are skipped, and the optimizer still steps on zero gradients
    (AdamW's moments decay as they would). Returns the update's stats (ratio_mean and clip_frac
    unmeasured: None), or None when some advantage (on any rank) or the KL gradient is not 0."""
    nonzero = runs.all_sum(sum(a != 0 for ep in turn_advantages for a in ep), device)
    if nonzero or (args.kl_beta != 0 and not at_reference(optimizer, args, device)):
        return None
    for p in policy.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return dict(loss=0.0, kl=0.0, clip_frac=None, ratio_mean=None, grad_norm=0.0,
                persuader_tokens=None, step_skipped=0, nonfinite=[], zero_gradient=1)


def kept_logits(model, ids, keep, share_stem):
    """model(ids).logits at the positions keep. With share_stem, the prefix every row shares (a
    group's persuader prompt, up to the first kept position) runs once, and its keys and values,
    autograd graph included, are repeated for the rows, which run only what follows: the same
    logits and gradients for fewer FLOPs (DECISIONS.md: Shared prompt in the update)."""
    share_stem = share_stem and len(ids) > 1 and len(keep) > 0  # (no kept position: no stem)
    stem = min(engine.shared_stem(ids.tolist()), int(keep[0])) if share_stem else 0
    if stem == 0:
        return model(ids, use_cache=False, logits_to_keep=keep).logits
    out = model(ids[:1, :stem], use_cache=True, logits_to_keep=1)
    name = "cache" if "cache" in out else "past_key_values"  # transformers' newer name, its older
    out[name].batch_repeat_interleave(len(ids))
    return model(ids[:, stem:], use_cache=True, logits_to_keep=keep - stem, **{name: out[name]}).logits


def checkpoint_activations(policy):
    """Activation (gradient) checkpointing on, by transformers' newer name where it has one."""
    (getattr(policy, "activation_checkpointing_enable", None) or policy.gradient_checkpointing_enable)()


def shares_prompts(policy, world):
    """Whether kept_logits may run shared prompts once: in one process (not under FSDP) and
    without gradient checkpointing, which drops a training cache."""
    checkpointing = getattr(policy, "is_activation_checkpointing", None)  # transformers' newer name
    if checkpointing is None:
        checkpointing = getattr(policy, "is_gradient_checkpointing", False)
    return world == 1 and not checkpointing


def policy_update(policy, reference, optimizer, records, turn_advantages, args, device, world):
    """One optimizer step on the persuader tokens of this rank's episodes.

    The log-probs (sampled, current, reference), the advantages, the loss and the gradient norm
    are checked first: if any is non-finite on any rank the step is skipped (weights and
    optimizer state untouched) and stats say so (step_skipped, nonfinite)."""
    tokens_here = sum(sum(1 for t in r["turn_ids"][1:] if t) for r in records)
    num_tokens = runs.all_sum(tokens_here, device)
    if (stats := zero_advantage_step(policy, optimizer, turn_advantages, args, device)) is not None:
        return dict(stats, persuader_tokens=num_tokens)
    stats = dict(loss=0.0, kl=0.0, clip_frac=0.0, ratio_mean=0.0)
    bad = dict.fromkeys(NONFINITE_CHECKS, 0)
    policy.train()
    share = shares_prompts(policy, world)
    for i in range(0, len(records), args.micro_batch):
        batch = records[i:i + args.micro_batch]
        width = max(len(r["ids"]) for r in batch)
        pad = lambda key, fill, dtype: torch.tensor(
            [r[key] + [fill] * (width - len(r[key])) for r in batch], dtype=dtype, device=device)
        ids, turn_ids = pad("ids", 0, torch.long), pad("turn_ids", 0, torch.long)
        adv = rpo.batch_token_advantages(turn_ids.cpu(), turn_advantages[i:i + len(batch)])
        # logits only where some row predicts a persuader token: the lm_head and softmax over the
        # vocabulary are skipped for the prompts and the persuadee's text
        keep = (turn_ids[:, 1:] > 0).any(0).nonzero()[:, 0]
        targets, mask = ids[:, keep + 1], turn_ids[:, keep + 1] > 0
        old = pad("logprobs", 0.0, torch.float32)[:, keep + 1]
        adv = adv[:, 1:].to(device)[:, keep]
        temperature = args.persuader_temperature or 1.0  # greedy records log-probs at T = 1
        with compute_context(policy, args, world):
            logits = kept_logits(policy, ids, keep, share)
        logp = rpo.target_logprobs(logits, targets, temperature)
        ref = None
        if args.kl_beta > 0:
            with torch.no_grad(), compute_context(reference, args, world):
                logits = kept_logits(reference, ids, keep, world == 1)
                ref = rpo.target_logprobs(logits, targets, temperature)
        loss, s = rpo.policy_loss(logp, old, ref, adv, mask, num_tokens, args.clip_low,
                                  args.clip_high, args.kl_beta)
        with torch.no_grad():
            logprobs = [x[mask] for x in (logp, old) + ((ref,) if ref is not None else ())]
            bad["logprobs"] += not all(torch.isfinite(x).all() for x in logprobs)
            bad["advantages"] += not torch.isfinite(adv[mask]).all()
            bad["loss"] += not torch.isfinite(loss)
        # FSDP averages gradients over ranks; the loss is already a global mean, so undo it
        (loss * world).backward()
        stats["loss"] += loss.item()
        for k in ("kl", "clip_frac", "ratio_mean"):
            stats[k] += s[k] * s["tokens"] / max(num_tokens, 1)
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), GRAD_CLIP)
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    bad = {k: runs.all_sum(v, device) for k, v in bad.items()}
    bad["grad_norm"] = not math.isfinite(grad_norm)
    nonfinite = [k for k in NONFINITE_CHECKS if bad[k]]
    if not nonfinite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    policy.eval()
    stats = {k: runs.all_sum(v, device) for k, v in stats.items()}
    stats.update(grad_norm=grad_norm, persuader_tokens=num_tokens, step_skipped=int(bool(nonfinite)),
                 nonfinite=nonfinite, zero_gradient=0)
    return stats


def step_metrics(step, records, groups, update, times, args, device):
    """One metrics line: rewards, outcome shares, belief change, rpo diagnostics, timings."""
    episodes = runs.all_sum(len(records), device)
    n = max(episodes, 1)  # every group of a step may have been left out (playable)
    total = lambda values: runs.all_sum(sum(values), device)
    m = dict(step=step, episodes=episodes)
    m["reward_mean"] = total(sum(g[0]) for g in groups) / n
    for o in arena.OUTCOMES:
        m[f"outcome_{o}"] = total(r["outcome"] == o for r in records) / n
    read = [r for r in records if None not in r["beliefs"]]  # rpo counts the rest
    m["belief_change"] = total(r["beliefs"][-1] - r["beliefs"][0] for r in read) / max(
        runs.all_sum(len(read), device), 1)
    m["turns_mean"] = total(r["turns"] for r in records) / n
    m["judge_mean"] = total(r["judge"] for r in records) / n
    # the share of transcripts whose strategy score fell back to s = 0 (DECISIONS.md: Judge retries)
    m["judge_failed_share"] = None if args.judge == "none" else total(
        bool(r.get("judge_failed")) for r in records) / n
    # pooled: every rank's counts and sums are added before the division (rpo.diagnostics)
    sums = rpo.diagnostic_sums(groups, args.lam)
    m.update(rpo.diagnostics({k: runs.all_sum(v, device) for k, v in sums.items()}))
    negative, turns = (runs.all_sum(v, device) for v in rpo.negative_process_counts(numeric(r["beliefs"]) for r in records))
    m["negative_process_share"] = negative / turns if turns else 0.0
    collapsed, counted = (runs.all_sum(v, device) for v in rpo.collapsed_groups(records, args.group_size))
    m["collapsed_group_share"] = collapsed / counted if counted else 0.0  # identical messages
    m.update(update)
    m.update(runs.mean_timings(times, device))  # the same keys, in one order, on every rank
    m["tokens_per_s"] = update["persuader_tokens"] / max(times["rollout_s"], 1e-9)
    if device.type == "cuda":
        m["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
    else:
        import resource
        m["peak_memory_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return m

def step_records(step, records, group_size, args, rank, world):
    """One small record per episode of the step, for analyses of training rollouts with no rerun
    (rollouts.jsonl): instance, group (its index in the step's draw) and member, outcome, goal,
    judge score, b_0, b_T and every belief between (null where unreadable), the lambda-free dense
    return under the run's anchor setting, turns. Every rank's, in draw order, on rank 0; []
    elsewhere."""
    rows = []
    for i, r in enumerate(records):
        local, member = divmod(i, group_size)
        beliefs = r["beliefs"]
        dense = rpo.dense_return(numeric(beliefs), r["outcome"], args.anchor)
        rows.append(dict(step=step, instance=r["id"], group=local * world + rank, member=member,
                         outcome=r["outcome"], goal=rpo.GOAL[r["outcome"]], judge=r["judge"],
                         judge_failed=bool(r.get("judge_failed")), b_0=beliefs[0] if beliefs else None,
                         b_T=beliefs[-1] if beliefs else None, beliefs=beliefs,
                         dense_return=dense if math.isfinite(dense) else None, turns=r["turns"]))
    if world > 1:
        shards = [None] * world
        dist.all_gather_object(shards, rows)
        rows = [row for shard in shards for row in shard]
    return sorted(rows, key=lambda row: (row["group"], row["member"])) if rank == 0 else []

# -----------------------------------------------------------------------------
# TensorBoard and W&B: the scalars of metrics.jsonl, held-out summaries, sample dialogues


def sample_rows(records):
    """[id, outcome, turns, beliefs, transcript] of the first SAMPLE_DIALOGUES episodes."""
    rows = []
    for r in records[:SAMPLE_DIALOGUES]:
        beliefs = " ".join("-" if b is None else f"{b:+.2f}" for b in r["beliefs"])
        transcript = "\n".join(f"{m['role']}: {m['text']}" for m in r["transcript"])
        rows.append([r["id"], r["outcome"], r["turns"], beliefs, transcript])
    return rows


def resume_metrics(path, start):
    """Keep the lines of a run's JSONL record (metrics.jsonl, rollouts.jsonl) of steps <= start
    (later steps are redone), rewritten atomically; a bad last line is dropped with a warning
    (runs.read_jsonl), an earlier one refused."""
    try:
        rows = runs.read_jsonl(path) if path.exists() else []
    except ValueError as e:
        raise SystemExit(f"train.py: {e} (or the file) and rerun with --resume") from None
    runs.write_atomic(path, "".join(runs.json_line(row) for _, row in rows if row["step"] <= start),
                      who="train.py", kept=f"{path} is as it was")


def write_step(run_dir, step, metrics, rows, records, args, log):
    """Rank 0: the step's line of metrics.jsonl and rows of rollouts.jsonl, its samples (every
    --save-every steps and the first), what stdout and the loggers show of it."""
    try:
        runs.append_line(run_dir / "metrics.jsonl", runs.json_line(metrics))
        runs.append_line(run_dir / "rollouts.jsonl", "".join(map(runs.json_line, rows)))
    except OSError as e:
        raise SystemExit(runs.write_failure("train.py", "metrics.jsonl", run_dir, e,
                                            "the last checkpoint is intact",
                                            resumable=(run_dir / "latest").is_file())) from None
    m = metrics
    if m["step_skipped"]:
        log.say(f"step {step}: skipped, non-finite {m['nonfinite']} (weights and optimizer unchanged)")
    log.say(f"step {step}: reward {m['reward_mean']:+.3f}  accept "
            f"{m['outcome_ACCEPT']:.0%}  belief change {m['belief_change']:+.3f}  loss "
            f"{m['loss']:+.4f}  kl {m['kl']:.4f}  dead {m['dead_group_share']:.0%}  "
            f"{m['step_s']:.1f}s (rollout {m['rollout_s']:.1f}, probes {m['probe_s']:.1f}, "
            f"judge {m['judge_s']:.1f}, update {m['update_s']:.1f})")
    log.scalars(step, m, "train/")
    if step % args.save_every == 0 or step == 1:
        runs.write_atomic(run_dir / f"samples-{step}.json", json.dumps(runs.finite(
            [dict(id=r["id"], outcome=r["outcome"], transcript=r["transcript"], beliefs=r["beliefs"])
             for r in records[:SAMPLE_DIALOGUES]]), indent=1, allow_nan=False),
            who="train.py", kept="the last checkpoint is intact")
        log.samples(step, sample_rows(records))


def against_paper(args):
    """What a LoRA run or the one-gpu preset trades against the paper preset, for --plan."""
    if not args.lora and args.preset != "one-gpu":
        return []
    paper, world = PRESETS["paper"], args.plan_ranks or 1
    episodes = args.instances * args.group_size
    full = paper["instances"] * paper["group_size"]
    return [f"against the paper preset (8 GPUs, full fine-tuning): LoRA rank {args.lora} on a "
            f"frozen {args.dtype} base (the reference: adapter off), lr {args.lr:g} (paper "
            f"{paper['lr']:g}); {episodes} episodes a step (paper {full}: "
            f"{episodes / full:.3g}x the batch), {args.steps} steps, {episodes * args.steps:,} "
            f"episodes in all (paper {full * paper['steps']:,}); held-out check on "
            f"{args.eval_limit} scenarios (paper {paper['eval_limit']}); {world} rank(s), "
            "data parallel"]


def load(name, dtype, device):
    model, tokenizer = models.load_model(name, dtype=getattr(torch, dtype), device=device)
    return model.requires_grad_(False), tokenizer


def plan_run(args, world, device, say):
    """The memory plan (printed; what cannot fit is refused before any model loads) and the
    run's banner; returns the engines' pool sizes (a CPU keeps the engine's defaults)."""
    rank_plan = plan.device_plan(args, world, device)
    for line in plan.plan_lines(rank_plan):
        say(line)
    if refusal := plan.plan_refusal(rank_plan):
        sys.exit(refusal)
    if args.preset == "cpu" and not torch.cuda.is_available():
        say(f"no CUDA device: cpu preset ({args.persuader} as persuader and persuadee, judge "
            f"{args.judge or args.persuadee})")
    say(f"run {Path(args.out) / args.name}  preset {args.preset}  ranks {world}  lambda {args.lam}  "
        f"anchor {args.anchor}  G {args.group_size}  instances/step {args.instances}")
    if args.instances % world:
        sys.exit(f"train.py: --instances {args.instances} must be a multiple of the number of "
                 f"ranks ({world}) so that every rank rolls out whole groups")
    return rank_plan["sizes"] if device.type == "cuda" else {}


def served_roles(args):
    """(persuadee, judge) served over the OpenAI API, each checked to answer, else None."""
    persuadee = served.ServedModel(args.persuadee) if served.is_served(args.persuadee) else None
    judge = (served.ServedModel(args.judge) if served.is_served(args.judge) else
             persuadee if args.judge is None else None)  # default: the persuadee
    for model in {id(m): m for m in (persuadee, judge) if m}.values():
        model.check()  # a wrong URL or key is a one-line exit before any model loads
    return persuadee, judge


def build_models(args, world, device, sizes):
    """The actor (fp32 master weights, trained and sharded; its rollout copy in --dtype, the
    actor engine's weights), the frozen reference and persuadee in --dtype, the AdamW."""
    served_persuadee, served_judge = served_roles(args)
    policy, tokenizer = load(args.persuader, args.dtype if args.lora else "float32", device)
    if bad := runs.nonfinite_weight(policy.state_dict()):
        sys.exit(f"train.py: --persuader {args.persuader} holds non-finite weights ({bad}); pass "
                 "a model with finite weights (an earlier checkpoint of the run that wrote it)")
    same = not served_persuadee and args.persuadee == args.persuader
    if served_persuadee:
        persuadee_model = persuadee_tokenizer = None  # the server plays it
    elif same:  # the persuader's frozen initial weights: the persuadee and the reference at once
        persuadee_model, persuadee_tokenizer = load(args.persuader, args.dtype, device)[0], tokenizer
    else:
        persuadee_model, persuadee_tokenizer = load(args.persuadee, args.dtype, device)
    if args.lora:  # fp32 adapters on the frozen base, data parallel; the base is the reference
        policy = lora.average_lora_gradients(lora.attach_lora(policy, args.lora,
                                                                  args.persuader), world)
    reference = None
    if args.kl_beta > 0:
        reference = persuadee_model if same else lora.AdapterOff(policy) if args.lora else \
            shard(load(args.persuader, args.dtype, device)[0], world)
    if not args.lora:
        policy.requires_grad_(True)
    if plan.GRAD_CHECKPOINTING and device.type == "cuda":
        checkpoint_activations(policy)
    separate = world > 1 or args.dtype != "float32" or bool(args.lora)
    rollout_model = load(args.persuader, args.dtype, device)[0] if separate else policy
    policy = policy if args.lora else shard(policy, world, getattr(torch, args.dtype))
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=WEIGHT_DECAY)
    return SimpleNamespace(policy=policy, optimizer=optimizer, reference=reference, lora=args.lora,
                           tokenizer=tokenizer, rollout_model=rollout_model if separate else None,
                           persuadee_model=persuadee_model, persuadee_tokenizer=persuadee_tokenizer,
                           served_persuadee=served_persuadee, served_judge=served_judge)


def build_engines(m, args, device, sizes):
    """The actor engine on the rollout copy (the policy's weights copied in, after a resume),
    the persuadee's engine (or its server) and the judge: the persuadee's when it names the
    same model, a model of its own (which the plan counted), a server, or none."""
    refresh_rollout_copy(m)
    m.actor = engine.Engine(m.rollout_model or m.policy, m.tokenizer, **sizes.get("actor", {}))
    m.persuadee = m.served_persuadee or engine.Engine(m.persuadee_model, m.persuadee_tokenizer,
                                                      **sizes.get("persuadee", {}))
    if m.served_judge or args.judge == "none":
        m.judge = m.served_judge or None
    elif args.judge in (None, args.persuadee):  # the persuadee's model: its engine, shared
        m.judge = m.persuadee
    else:
        m.judge = engine.Engine(*load(args.judge, args.dtype, device), **sizes.get("judge", {}))


def refresh_rollout_copy(m):
    """The policy's weights written into the rollout copy (the actor engine's own tensors): the
    fp32 master weights gathered, or under LoRA the base with its adapters merged."""
    if m.rollout_model is not None:
        (lora.refresh_from_lora if m.lora else copy_weights)(m.policy, m.rollout_model)


def refresh(m):
    """Point the actor engine at the updated weights (written into its own tensors)."""
    refresh_rollout_copy(m)
    m.actor.refresh()


def training_set(args, m, say):
    """The training instances, less those whose prompts fit no context (named once, up front)."""
    instances = arena.training_instances(arena.load_scenarios(args.scenarios, split="train"))
    problems = rollout.prompt_problems(m.actor, m.persuadee, instances, args.max_new_tokens)
    if problems:
        say(f"skipping {len(problems)} training instances that do not fit a context, e.g. "
            f"{next(iter(problems.values()))}")
    args.skipped_instances = len(problems)
    return [inst for inst in instances if inst["id"] not in problems]


def open_run(run_dir, args, start):
    """Rank 0, the models loaded: an --overwrite'n folder emptied, config.json recorded, the
    JSONL records cut back to the checkpoint's step."""
    if args.overwrite:
        runs.clear(run_dir)
    record_config(run_dir, args, start)
    resume_metrics(run_dir / "metrics.jsonl", start)
    resume_metrics(run_dir / "rollouts.jsonl", start)


def play_step(m, instances, args, step, rank, world):
    """This rank's share of the step's groups, played by the current policy; their records
    and the step's timings (seconds, by runs.TIMING_KEYS)."""
    mine = step_instances(instances, args, step, rank, world)
    bar = tqdm(total=len(mine) * args.group_size, desc=f"step {step} rollout",
               disable=rank != 0, leave=False)
    times = dict(judge_s=0.0, probe_s=0.0)
    seed = args.seed * 1000003 + step * 1009  # not the rank: records are rank-free
    persuader_sampling, persuadee_sampling = rollout.role_sampling(args)
    records = rollout.rollout_episodes(
        m.actor, m.persuadee, mine, args.t_max, group_size=args.group_size, seed=seed,
        persuader_sampling=persuader_sampling, persuadee_sampling=persuadee_sampling,
        max_new_tokens=args.max_new_tokens, judge=m.judge, probe_space=args.probe_space,
        probe_signs=args.probe_signs, progress=bar, timings=times)
    bar.close()
    return records, times


def stop_if_diverged(skipped, step, m):
    """Consecutive skipped (non-finite) steps; MAX_SKIPPED_STEPS of them end the run."""
    skipped = skipped + 1 if m["step_skipped"] else 0
    if skipped >= MAX_SKIPPED_STEPS:
        sys.exit(f"train.py: {skipped} steps in a row (steps {step - skipped + 1}-{step}) were "
                 f"skipped as non-finite ({', '.join(m['nonfinite'])}): the run has gone wrong "
                 f"and stops; the weights updated at step {step - skipped} are suspect: resume "
                 f"from a checkpoint saved before it, or start again with a lower --lr")
    return skipped


def main(argv=None):
    args = parse_args(argv)
    if args.plan:
        print("\n".join(against_paper(args)))
        plan.print_plan(args)
        return []
    rank, world, device = runs.setup_distributed()
    rollout.DECISION = args.decision  # the persuadee's decision: its tag, or read as logits
    set_cpu_threads(device)
    torch.manual_seed(args.seed + rank)
    run_dir = Path(args.out) / args.name
    say = print if rank == 0 else (lambda *a, **k: None)
    sizes = plan_run(args, world, device, say)
    if rank == 0:
        runs.lock(run_dir, "train.py")  # held for the run, taken before any model loads
    try:
        return train(args, run_dir, rank, world, device, sizes, say)
    finally:
        runs.unlock(run_dir)


def train(args, run_dir, rank, world, device, sizes, say):
    """build models -> resume -> for each step: rollout -> advantages -> update -> refresh ->
    log -> evaluate -> save. Returns the metrics of every step."""
    m = build_models(args, world, device, sizes)
    start = runs.load_checkpoint(run_dir, m.policy, m.optimizer) if args.resume else 0
    if args.resume:
        say(f"resumed from step {start}")
    build_engines(m, args, device, sizes)
    instances = training_set(args, m, say)
    if rank == 0:
        open_run(run_dir, args, start)
    log, history, skipped = runs.Loggers(args, run_dir, start, rank), [], 0
    for step in range(start + 1, args.steps + 1):
        t0 = time.perf_counter()
        played, times = play_step(m, instances, args, step, rank, world)
        records, left_out = playable(played, args.group_size, say)
        times["rollout_s"] = time.perf_counter() - t0 - times["judge_s"]
        t1 = time.perf_counter()
        turn_adv, groups = advantages(records, args.group_size, args)
        update = policy_update(m.policy, m.reference, m.optimizer,
                               *silenced(played, records, turn_adv), args, device, world)
        refresh(m)
        times["update_s"], times["step_s"] = time.perf_counter() - t1, time.perf_counter() - t0
        metrics = step_metrics(step, records, groups, update, times, args, device)
        metrics.update({k: runs.all_sum(v, device) for k, v in left_out.items()})
        rows = step_records(step, records, args.group_size, args, rank, world)
        history.append(metrics)
        if rank == 0:
            write_step(run_dir, step, metrics, rows, records, args, log)
        skipped = stop_if_diverged(skipped, step, metrics)
        evaluated = bool(args.eval_every) and step % args.eval_every == 0
        if evaluated:
            log.scalars(step, evaluate(m.actor, m.persuadee, m.judge, args, step, rank, run_dir),
                        "heldout/")
        if step % args.save_every == 0 or step == args.steps or evaluated:
            runs.save_checkpoint(run_dir, step, m.policy, m.optimizer, m.tokenizer, rank)
    log.close()
    runs.finish_distributed()
    say(f"done: metrics in {run_dir / 'metrics.jsonl'}, policy in {run_dir / 'checkpoint-*'}")
    return history


def silenced(played, kept, turn_advantages):
    """Every played episode for the update, in its place, those left out (playable) with no
    persuader token and no advantage: each rank then runs the same micro-batches (FSDP's
    collectives), and the left-out ones add nothing to the loss or its token count."""
    kept_ids = {id(r) for r in kept}
    advantage = iter(turn_advantages)
    records, per_episode = [], []
    for r in played:
        if id(r) in kept_ids:
            records.append(r)
            per_episode.append(next(advantage))
        else:
            ids = r["ids"] or [0]  # one inert token for an episode that never started
            records.append(dict(ids=ids, turn_ids=[0] * len(ids), logprobs=[0.0] * len(ids)))
            per_episode.append([])
    return records, per_episode


def playable(records, group_size, say):
    """The groups whose every episode was played, and the counts of those left out: an episode
    that never started (it cannot fit the empty pools: no belief, no token of its own) or whose
    served model failed for good ("api_error") takes its whole group out of the step's metrics
    and loss (a group's baseline needs all of its members)."""
    why = {i: "never started: it does not fit the empty KV pools alone" if not r["beliefs"]
           else "its served model kept failing" for i, r in enumerate(records)
           if not r["beliefs"] or r["end_reason"] == arena.API_ERROR}
    kept = [r for g in range(0, len(records), group_size) for r in records[g:g + group_size]
            if not any(i in why for i in range(g, g + group_size))]
    if why:
        say(f"left out {len(records) - len(kept)} episodes (their groups) of this step: "
            + "; ".join(f"{records[i]['id']} member {i % group_size} {w}"
                        for i, w in why.items()))
    return kept, dict(never_started=sum(not r["beliefs"] for r in records),
                      api_errors=sum(r["end_reason"] == arena.API_ERROR for r in records),
                      left_out=len(records) - len(kept))


def evaluate(actor, persuadee, judge, args, step, rank, run_dir):
    """Held-out evaluation through eval.py, the scenarios sharded over the ranks, with the run's
    own sampling, lambda and anchor; rank 0 writes runs/NAME/eval-STEP and appends its summary to
    runs/NAME/evals.jsonl under its step (what eval.py --runs reads)."""
    import eval
    instances = arena.heldout_instances(arena.load_scenarios(args.scenarios))[:args.eval_limit]
    world = dist.get_world_size() if dist.is_initialized() else 1
    summary = eval.evaluate(actor, persuadee, instances, run_dir / f"eval-{step}",
                            t_max=args.eval_t_max, seed=args.seed,
                            max_new_tokens=args.max_new_tokens, judge=judge, anchor=args.anchor,
                            sampling=rollout.role_sampling(args), probe_space=args.probe_space,
                            probe_signs=args.probe_signs, rank=rank, world=world,
                            shaping_lambda=args.lam,
                            fidelity=(eval.FIDELITY_SAMPLES if args.eval_fidelity is None
                                      else args.eval_fidelity))
    if rank == 0:
        record_evaluation(run_dir / "evals.jsonl", step, summary)
        print(f"eval step {step}: full accept {summary['full_accept']:.1%}  "
              f"full-or-conditional {summary['full_or_conditional']:.1%}")
    return summary


def record_evaluation(path, step, summary):
    """evals.jsonl with the summaries of the steps before this one (a resumed run redoes later
    ones; a line that is no evaluation summary is dropped with a warning) and this step's."""
    kept = []
    for lineno, row in runs.read_jsonl(path, skip_bad=True) if path.exists() else []:
        if not (isinstance(row, dict) and isinstance(row.get("step"), int)):
            print(f"warning: dropping line {lineno} of {path}, not an evaluation summary",
                  file=sys.stderr)
        elif row["step"] < step:
            kept.append(row)
    runs.write_atomic(path, "".join(map(runs.json_line, kept + [{"step": step, **summary}])),
                      who="train.py", kept=f"{path} is as it was")


if __name__ == "__main__":
    main()
