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
import errno
import importlib
import json
import math
import os
import random
import re
import shutil
import sys
import time
import unicodedata
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

import analyses
import arena
import engine
import models
import plan
import probes
import rollout
import rpo
import served

PRESETS = {
    "paper": dict(persuader="Qwen/Qwen3-4B-Instruct-2507", persuadee="Qwen/Qwen3-14B",
                  judge=None, dtype="bfloat16", steps=200, instances=16, group_size=8,
                  t_max=arena.T_MAX_TRAIN, eval_t_max=arena.T_MAX_EVAL, lr=1e-6,
                  max_new_tokens=engine.MAX_NEW_TOKENS, micro_batch=4, eval_every=20, eval_limit=120,
                  save_every=20, sampling="paper"),
    "cpu": dict(persuader="smollm2", persuadee="smollm2", judge=None, dtype="float32", steps=3,
                instances=2, group_size=4, t_max=2, eval_t_max=3, lr=1e-5, max_new_tokens=32,
                micro_batch=2, eval_every=0, eval_limit=4, save_every=1, sampling="cpu"),
    # tiny: a random judge never writes a verdict (s falls back to 0 on every transcript, after
    # four attempts): no judge gives the same s = 0 at no cost
    "tiny": dict(persuader="random:tiny-llama", persuadee="random:tiny-qwen3", judge="none",
                 dtype="float32", steps=4, instances=2, group_size=2, t_max=2, eval_t_max=2,
                 lr=1e-3, max_new_tokens=4, micro_batch=2, eval_every=0, eval_limit=2,
                 save_every=2, sampling="paper"),
}
LORA_RANK = 64                      # --preset one-gpu's adapter rank (train.py --lora)
PRESETS["one-gpu"] = dict(  # the paper's models and sampling on one H200, LoRA (README: one GPU)
    PRESETS["paper"], lora=LORA_RANK, lr=1e-5, instances=2, micro_batch=2, eval_limit=16,
    plan_ranks=1)
GRAD_CLIP = 1.0                     # max global grad norm
WEIGHT_DECAY = 0.0                  # AdamW weight decay
SEED = 0
LOGGERS = ("tensorboard", "wandb")  # --log choices, each an optional package
WANDB_PROJECT = "persuarena"        # W&B project of every run
SAMPLE_DIALOGUES = 2                # episodes a step kept in samples-STEP.json and the loggers' table
DTYPES = ("float32", "bfloat16", "float16")  # --dtype choices
NONFINITE_CHECKS = ("logprobs", "advantages", "loss", "grad_norm")  # a non-finite one skips the step
MAX_SKIPPED_STEPS = 3               # consecutive skipped (non-finite) steps that stop the run
RESUME_MAY_CHANGE = ("steps", "eval_every", "eval_limit", "save_every", "log")  # recorded in config.json
NOT_SETTINGS = ("name", "out", "resume", "overwrite", "skipped_instances", "resumed",
                "allow_insecure_key")  # (where the key may go is no setting of the run)
POSITIVE = ("steps", "instances", "group_size", "t_max", "eval_t_max", "max_new_tokens",
            "micro_batch", "eval_limit", "save_every")  # integer arguments that must be >= 1


def parse_args(argv=None):
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
    p.add_argument("--lora", type=int, help="train rank-RANK LoRA adapters on a frozen base "
                   "(models.py, LoRA) instead of every weight; 0: full fine-tuning")
    # rpo.py owns these; read at parse time, so an edited constant changes the run
    p.add_argument("--lam", type=float, default=rpo.LAMBDA)
    p.add_argument("--anchor", action=argparse.BooleanOptionalAction, default=rpo.ANCHOR)
    probes.add_flags(p)
    p.add_argument("--kl-beta", type=float, default=rpo.KL_BETA)
    p.add_argument("--clip-low", type=float, default=rpo.CLIP_LOW)
    p.add_argument("--clip-high", type=float, default=rpo.CLIP_HIGH)
    p.add_argument("--persuader-temperature", type=float,
                   help="default: the preset's rollout.SAMPLING (no top-k/top-p: exact pi_old)")
    p.add_argument("--persuadee-temperature", type=float, help="default: the preset's")
    p.add_argument("--persuadee-top-p", type=float, help="default: the preset's")
    p.add_argument("--persuadee-top-k", type=int, help="default: the preset's")
    p.add_argument("--seed", type=int, default=SEED)
    arena.add_decision_flag(p)
    p.add_argument("--name", default=None, help="run folder runs/NAME (default: preset and time)")
    p.add_argument("--out", default="runs")
    p.add_argument("--resume", action="store_true", help="continue runs/NAME from its checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace an existing runs/NAME")
    p.add_argument("--scenarios", default=arena.SCENARIOS_PATH)
    p.add_argument("--log", action="append", choices=LOGGERS, default=[],
                   help="also log to TensorBoard (runs/NAME) or Weights & Biases; repeatable")
    p.add_argument("--plan", action="store_true", help="print the per-rank memory plan for "
                   "--plan-ranks GPUs of --plan-gib and exit; no model loads")
    p.add_argument("--plan-ranks", type=int, default=None,
                   help=f"default: WORLD_SIZE under torchrun, else {plan.PLAN_NODE[0]}")
    p.add_argument("--plan-gib", type=float, default=None,
                   help=f"default: this GPU's memory, else {plan.PLAN_NODE[1]} (an H200)")
    served.add_key_flag(p)
    args = p.parse_args(argv)
    served.ALLOW_INSECURE_KEY = args.allow_insecure_key
    cuda = torch.cuda.is_available()
    args.preset = args.preset or ("paper" if cuda else "cpu")
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    er, ee = rollout.SAMPLING[args.sampling]  # the roles' sampling (rollout.SAMPLING)
    defaults = dict(persuader_temperature=er.temperature, persuadee_temperature=ee.temperature,
                    persuadee_top_p=ee.top_p, persuadee_top_k=ee.top_k)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.name = args.name or f"{args.preset}-{time.strftime('%Y%m%d-%H%M%S')}"
    validate(args)
    if args.resume:
        resume_settings(args, explicit_settings(p, argv))
    for kind in args.log:  # before any model loads: a missing package is a one-line exit
        require(kind)
    return args


def _model_problem(name):
    """What is wrong with a model argument, or None (a hub name cannot be checked offline)."""
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


def input_problem(args, scenarios):
    """(flag, problem, fix) for a plan size that is no size or a training file that cannot give
    the run its N_TRAIN_INSTANCES distinct instances (issue 27), else None."""
    if args.plan_gib is not None and not (math.isfinite(args.plan_gib) and args.plan_gib > 0):
        return f"--plan-gib {args.plan_gib}", "must be a finite number of GiB > 0", "pass e.g. --plan-gib 80"
    if args.plan_ranks is not None and args.plan_ranks < 1:
        return f"--plan-ranks {args.plan_ranks}", "must be at least 1", "pass e.g. --plan-ranks 8"
    if problem := arena.variants_problem(scenarios):
        return f"--scenarios {args.scenarios}", problem, "add training scenarios, or vary the personas"
    return None


def validate(args):
    """Every argument checked before any model loads; one line naming the flag and the fix."""
    def fail(flag, problem, fix):
        raise SystemExit(f"train.py: {flag} {problem}; {fix}")
    for key in POSITIVE:
        if getattr(args, key) < 1:
            fail(f"--{key.replace('_', '-')} {getattr(args, key)}", "must be at least 1",
                 f"pass a positive number, e.g. --{key.replace('_', '-')} {PRESETS['tiny'][key]}")
    if args.instances > arena.N_TRAIN_INSTANCES:
        fail(f"--instances {args.instances}", f"exceeds the {arena.N_TRAIN_INSTANCES} training "
             "instances", f"pass at most --instances {arena.N_TRAIN_INSTANCES}")
    if args.eval_every < 0:
        fail(f"--eval-every {args.eval_every}", "is negative", "pass 0 (no evaluation) or a number of steps")
    if args.dtype not in DTYPES:
        fail(f"--dtype {args.dtype}", "is not a dtype this loop runs",
             f"pass one of {', '.join(DTYPES)}")
    for flag, value, example in (("--lr", args.lr, 1e-6), ("--lam", args.lam, rpo.LAMBDA),
                                 ("--kl-beta", args.kl_beta, rpo.KL_BETA),
                                 ("--clip-high", args.clip_high, rpo.CLIP_HIGH),
                                 ("--persuader-temperature", args.persuader_temperature, 1.0),
                                 ("--persuadee-temperature", args.persuadee_temperature, 0.7)):
        if not math.isfinite(value) or value < 0:
            fail(f"{flag} {value}", "must be a finite number >= 0", f"pass e.g. {flag} {example}")
    if not (math.isfinite(args.clip_low) and 0 <= args.clip_low < 1):
        fail(f"--clip-low {args.clip_low}", "must lie in [0, 1) (the ratio is clipped at 1 - clip-low)",
             f"pass e.g. --clip-low {rpo.CLIP_LOW}")
    if args.persuadee_top_p is not None and not 0 < args.persuadee_top_p <= 1:
        fail(f"--persuadee-top-p {args.persuadee_top_p}", "must lie in (0, 1]",
             "pass e.g. --persuadee-top-p 0.8")
    if args.persuadee_top_k is not None and args.persuadee_top_k < 1:
        fail(f"--persuadee-top-k {args.persuadee_top_k}", "must be at least 1",
             "pass e.g. --persuadee-top-k 20")
    for role in ("persuader", "persuadee", "judge"):
        name = getattr(args, role)
        if name in (None, "none") and role == "judge" or served.is_served(name) and role != "persuader":
            continue  # a served persuadee or judge is checked at start-up (ServedModel.check)
        if problem := _model_problem(name):
            fail(f"--{role} {name}", problem, "pass a Hugging Face model folder, a hub name, "
                 "'smollm2' or random:NAME")
    if args.name in ("", ".", "..") or any(c in args.name for c in "/\\\0") or \
            any(unicodedata.category(c) == "Cc" for c in args.name):
        fail(f"--name {args.name!r}", "is not one folder name (no '.', '..', path separators or "
             "control characters)", "pass e.g. --name my-run; --out says where runs go")
    run_dir = Path(args.out) / args.name
    if run_dir.is_symlink():
        fail(f"--name {args.name}", f"is a link ({run_dir} -> {os.readlink(run_dir)}), not a run "
             "folder", "pass another --name")
    try:
        scenarios = arena.load_scenarios(args.scenarios)
    except OSError as e:
        fail(f"--scenarios {args.scenarios}", f"cannot be read ({e.strerror or e})",
             "pass a readable scenarios.jsonl")
    except ValueError as e:
        fail("--scenarios", f"is not a valid scenarios file ({e})", "fix that line")
    for split, needed in (("train", True), ("heldout", args.eval_every > 0)):
        if needed and not any(s["split"] == split for s in scenarios):
            fail(f"--scenarios {args.scenarios}", f"holds no {split} scenarios",
                 "add some, or pass a file that has them" + (" (or --eval-every 0)"
                                                                 if split == "heldout" else ""))
    if problem := input_problem(args, scenarios):
        fail(*problem)
    if args.resume and args.overwrite:
        fail("--resume with --overwrite", "contradict each other", "pass one of them")
    if (args.lora or 0) < 0 or args.lora and args.resume:
        fail(f"--lora {args.lora}", "must be >= 0 and cannot resume yet", "start a new run")
    if args.resume:
        checkpoint_folder(run_dir)
    elif os.environ.get("RANK", "0") == "0" and run_dir.is_dir() and any(run_dir.iterdir()) \
            and not args.overwrite:
        held = ", ".join(sorted(p.name for p in run_dir.iterdir())[:4])
        fail(f"--name {args.name}", f"is an existing run ({run_dir} holds {held})",
             "pass --resume to continue it, --overwrite to replace it, or another --name")
    if args.group_size == 1:
        print("train.py: warning: --group-size 1 leaves every group without a baseline: no outcome "
              "advantage, only the dense term trains (pass --group-size 2 or more)", file=sys.stderr)


def explicit_settings(parser, argv):
    """The settings the command line names (not left to their defaults)."""
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


def resume_settings(args, explicit):
    """--resume continues the run as recorded in runs/NAME/config.json: a setting the command
    line leaves out takes the recorded value; one it names with another value is refused, in one
    line naming each, except RESUME_MAY_CHANGE (applied, and recorded by record_config)."""
    path = Path(args.out) / args.name / "config.json"
    try:
        recorded = json.loads(path.read_text())
        problem = None if isinstance(recorded, dict) else "not a JSON object"
    except (OSError, ValueError) as e:
        problem = type(e).__name__
    if problem:
        raise SystemExit(f"train.py: --resume: {path} cannot be read ({problem}); restore it from "
                         "a copy, or start a new run (another --name)")
    changed = []
    for key, value in recorded.items():
        if key in NOT_SETTINGS or not hasattr(args, key):
            continue
        if key not in explicit:
            setattr(args, key, value)
        elif json.dumps(getattr(args, key)) != json.dumps(value) and key not in RESUME_MAY_CHANGE:
            changed.append(f"--{key.replace('_', '-')} {getattr(args, key)} (the run has {value})")
    if changed:
        may = ", ".join(f"--{k.replace('_', '-')}" for k in RESUME_MAY_CHANGE)
        raise SystemExit(f"train.py: --resume keeps the run's settings, and {', '.join(changed)} "
                         f"would change them; drop them (only {may} may change), or start a new "
                         "run (another --name)")


def write_atomic(path, text, kept):
    """path's new text through a temporary file and a rename: a kill or a full disk leaves the
    old file or the new one; a failed write is one line (_write_failure)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise SystemExit(_write_failure(path.name, path.parent, e, kept)) from None


def record_config(run_dir, args, start):
    """config.json: the settings of a new run; on a resume the recorded file, with the
    RESUME_MAY_CHANGE settings that changed listed under "resumed" (and said), else untouched."""
    path = run_dir / "config.json"
    if not args.resume:
        return write_atomic(path, json.dumps(vars(args), indent=2), "nothing was trained yet")
    config = json.loads(path.read_text())
    changes = {k: [config.get(k), getattr(args, k)] for k in RESUME_MAY_CHANGE
               if json.dumps(config.get(k)) != json.dumps(getattr(args, k))}
    if changes:
        print(f"train.py: resuming at step {start} with " + ", ".join(
            f"--{k.replace('_', '-')} {new} (was {old})" for k, (old, new) in changes.items()))
        config.update({k: new for k, (_, new) in changes.items()})
        config.setdefault("resumed", []).append(dict(step=start, changed=changes))
        write_atomic(path, json.dumps(config, indent=2), f"{path} is as it was")


def nonfinite_weight(state_dict):
    """The name of the first floating-point tensor holding a NaN or an infinity, or None."""
    return next((k for k, v in state_dict.items()
                 if v.is_floating_point() and not torch.isfinite(v).all()), None)

# -----------------------------------------------------------------------------
# distributed set-up and the actor


def setup_distributed():
    """(rank, world, device); one process per GPU under torchrun, gloo on CPU."""
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return rank, world, torch.device("cuda", local)
    return rank, world, torch.device("cpu")


def set_cpu_threads(device):
    """On a CPU with OMP_NUM_THREADS unset, torch's threads: one per core the machine's load leaves
    free (at least one). torch's default takes every core, and on a busy machine its threads then
    wait on each other (a step can take several times as long). OMP_NUM_THREADS, when set, wins."""
    if device.type != "cpu" or os.environ.get("OMP_NUM_THREADS"):
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, min(torch.get_num_threads(), cores - round(os.getloadavg()[0]))))


def at_reference(optimizer, args, device):
    """True while the policy cannot have left its initial weights (the KL reference): lr 0, or no
    weight decay and every AdamW first moment still exactly 0 (no nonzero gradient ever, this
    run or before its checkpoint)."""
    if args.lr == 0:
        return True
    moments = sum(int(getattr(st["exp_avg"], "_local_tensor", st["exp_avg"]).count_nonzero())
                  for st in optimizer.state.values() if "exp_avg" in st)
    return WEIGHT_DECAY == 0 and all_sum(moments, device) == 0


def zero_advantage_step(policy, optimizer, turn_advantages, args, device):
    """A step whose every advantage is exactly 0 (a lambda = 0 step whose groups are all dead) has
    a zero gradient when its KL term has none (no KL term, or the policy still at the reference):
    its forward and backward passes are skipped, and the optimizer still steps on zero gradients
    (AdamW's moments decay as they would). Returns the update's stats (ratio_mean and clip_frac
    unmeasured: None), or None when some advantage (on any rank) or the KL gradient is not 0."""
    nonzero = all_sum(sum(a != 0 for ep in turn_advantages for a in ep), device)
    if nonzero or (args.kl_beta != 0 and not at_reference(optimizer, args, device)):
        return None
    for p in policy.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return dict(loss=0.0, kl=0.0, clip_frac=None, ratio_mean=None, grad_norm=0.0,
                persuader_tokens=None, step_skipped=0, nonfinite=[], zero_gradient=1)


def all_sum(value, device):
    """Sum a number over ranks (a no-op in one process)."""
    if not dist.is_initialized():
        return value
    t = torch.tensor(float(value), device=device, dtype=torch.float64)
    dist.all_reduce(t)
    return t.item()


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
    engine's own attention (engine.SDPA_BACKENDS: its per-shape graph builds cost more than
    the attention at shapes that change every micro-batch), and in one process with a half
    --dtype under autocast from the fp32 master weights (under FSDP the MixedPrecisionPolicy
    casts them instead)."""
    from contextlib import ExitStack
    from torch.nn.attention import sdpa_kernel
    stack = ExitStack()
    stack.enter_context(sdpa_kernel(engine.SDPA_BACKENDS))
    device = next(model.parameters()).device
    if world == 1 and args.dtype != "float32":
        stack.enter_context(torch.autocast(device.type, dtype=getattr(torch, args.dtype)))
    return stack


@torch.no_grad()
def copy_weights(policy, rollout_model):
    """Gather the sharded fp32 master weights, one parameter at a time, into the rollout copy
    (cast to its dtype). Its parameters are the actor engine's own fused tensors (engine.fuse),
    so this writes straight into what the engine reads, at the same addresses."""
    target = dict(rollout_model.named_parameters())
    for name, p in policy.named_parameters():
        target[name].copy_(p.full_tensor() if hasattr(p, "full_tensor") else p)

# -----------------------------------------------------------------------------
# one step


def step_instances(instances, args, step, rank, world):
    """This step's instances (the same on every rank, drawn from the step number) and this
    rank's share of them."""
    chosen = random.Random(args.seed * 100003 + step).sample(instances, args.instances)
    return chosen[rank::world]


def advantages(records, group_size, args):
    """Rewards and Probe-RPO advantages for this rank's groups; returns per-episode turn
    advantages and the (outcome rewards, process rewards, goals) of each group for diagnostics."""
    groups, per_episode = [], []
    for g in range(0, len(records), group_size):
        group = records[g:g + group_size]
        outcome = [rpo.outcome_reward(r["outcome"], r["judge"]) for r in group]
        process = [rpo.process_rewards(r["beliefs"], r["outcome"], args.anchor) for r in group]
        groups.append((outcome, process, [rpo.GOAL[r["outcome"]] for r in group]))
        per_episode += rpo.group_advantages(outcome, process, args.lam)
    return per_episode, groups


def policy_update(policy, reference, optimizer, records, turn_advantages, args, device, world):
    """One optimizer step on the persuader tokens of this rank's episodes.

    The log-probs (sampled, current, reference), the advantages, the loss and the gradient norm
    are checked first: if any is non-finite on any rank the step is skipped (weights and
    optimizer state untouched) and stats say so (step_skipped, nonfinite)."""
    tokens_here = sum(sum(1 for t in r["turn_ids"][1:] if t) for r in records)
    num_tokens = all_sum(tokens_here, device)
    if (stats := zero_advantage_step(policy, optimizer, turn_advantages, args, device)) is not None:
        return dict(stats, persuader_tokens=num_tokens)
    stats = dict(loss=0.0, kl=0.0, clip_frac=0.0, ratio_mean=0.0)
    bad = dict.fromkeys(NONFINITE_CHECKS, 0)
    policy.train()
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
            logits = policy(ids, use_cache=False, logits_to_keep=keep).logits
        logp = rpo.target_logprobs(logits, targets, temperature)
        ref = None
        if args.kl_beta > 0:
            with torch.no_grad(), compute_context(reference, args, world):
                logits = reference(ids, use_cache=False, logits_to_keep=keep).logits
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
    bad = {k: all_sum(v, device) for k, v in bad.items()}
    bad["grad_norm"] = not math.isfinite(grad_norm)
    nonfinite = [k for k in NONFINITE_CHECKS if bad[k]]
    if not nonfinite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    policy.eval()
    stats = {k: all_sum(v, device) for k, v in stats.items()}
    stats.update(grad_norm=grad_norm, persuader_tokens=num_tokens, step_skipped=int(bool(nonfinite)),
                 nonfinite=nonfinite, zero_gradient=0)
    return stats


def step_metrics(step, records, groups, update, times, args, device):
    """One metrics line: rewards, outcome shares, belief change, rpo diagnostics, timings."""
    episodes = all_sum(len(records), device)
    n = max(episodes, 1)  # every group of a step may have been left out (playable)
    total = lambda values: all_sum(sum(values), device)
    m = dict(step=step, episodes=episodes)
    m["reward_mean"] = total(sum(g[0]) for g in groups) / n
    for o in arena.OUTCOMES:
        m[f"outcome_{o}"] = total(r["outcome"] == o for r in records) / n
    read = [r for r in records if all(map(math.isfinite, r["beliefs"]))]  # rpo counts the rest
    m["belief_change"] = total(r["beliefs"][-1] - r["beliefs"][0] for r in read) / max(
        all_sum(len(read), device), 1)
    m["turns_mean"] = total(r["turns"] for r in records) / n
    m["judge_mean"] = total(r["judge"] for r in records) / n
    # the share of transcripts whose strategy score fell back to s = 0 (README, Decisions: Judge retries)
    m["judge_failed_share"] = None if args.judge == "none" else total(
        bool(r.get("judge_failed")) for r in records) / n
    # pooled: every rank's counts and sums are added before the division (rpo.diagnostics)
    sums = rpo.diagnostic_sums(groups, args.lam)
    m.update(rpo.diagnostics({k: all_sum(v, device) for k, v in sums.items()}))
    negative, turns = (all_sum(v, device) for v in rpo.negative_process_counts(r["beliefs"] for r in records))
    m["negative_process_share"] = negative / turns if turns else 0.0
    collapsed, counted = (all_sum(v, device) for v in rpo.collapsed_groups(records, args.group_size))
    m["collapsed_group_share"] = collapsed / counted if counted else 0.0  # identical messages
    m.update(update)
    m.update({k: all_sum(v, device) / all_sum(1, device) for k, v in times.items()})
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
        beliefs = [b if math.isfinite(b) else None for b in r["beliefs"]]
        dense = rpo.dense_return(r["beliefs"], r["outcome"], args.anchor)
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


def require(kind):
    """The optional package behind a --log choice, or a one-line exit saying how to get it."""
    try:
        return importlib.import_module(kind)
    except ImportError:
        sys.exit(f"train.py: --log {kind} needs the {kind} package: pip install {kind}")


def scalars(values, prefix=""):
    """The finite numbers of a (nested) metrics dict as {prefix/key/...: value}."""
    out = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out.update(scalars(value, f"{prefix}{key}/"))
        elif (isinstance(value, (int, float)) and not isinstance(value, bool)
              and math.isfinite(value)):
            out[f"{prefix}{key}"] = value
    return out


def sample_rows(records):
    """[id, outcome, turns, beliefs, transcript] of the first SAMPLE_DIALOGUES episodes."""
    rows = []
    for r in records[:SAMPLE_DIALOGUES]:
        beliefs = " ".join("-" if b is None else f"{b:+.2f}" for b in r["beliefs"])
        transcript = "\n".join(f"{m['role']}: {m['text']}" for m in r["transcript"])
        rows.append([r["id"], r["outcome"], r["turns"], beliefs, transcript])
    return rows


def open_loggers(args, run_dir, start):
    """A logger per --log choice (rank 0 only)."""
    return [TensorBoardLog(run_dir, start) if kind == "tensorboard" else WandbLog(run_dir, args)
            for kind in args.log]

# -----------------------------------------------------------------------------
# checkpoints


CHECKPOINT_RE = re.compile(r"checkpoint-(\d+)")  # the only names `latest` may hold


def checkpoint_folder(run_dir):
    """The folder runs/NAME/latest names, checked: a checkpoint-STEP folder of this run, holding
    trainer.pt and the weights. A bad pointer is one line naming it and the fix."""
    latest = run_dir / "latest"
    fix = f"restore {run_dir} from a copy, or start a new run (another --name, or --overwrite)"
    if not latest.is_file():
        raise SystemExit(f"train.py: --resume: no checkpoint in {run_dir} (no 'latest' file); "
                         "drop --resume to start a new run")
    name = latest.read_text(errors="replace").strip()
    folder = run_dir / name
    if not CHECKPOINT_RE.fullmatch(name) or folder.is_symlink() or not folder.is_dir():
        raise SystemExit(f"train.py: {latest} names {name[:80]!r}, not a checkpoint-STEP folder "
                         f"inside the run; {fix}")
    for needed in ("trainer.pt", "config.json"):
        if not (folder / needed).is_file():
            raise SystemExit(f"train.py: {folder / needed} is missing; {fix}")
    if not any(folder.glob("*.safetensors")):
        raise SystemExit(f"train.py: {folder} holds no *.safetensors weights (model.safetensors "
                         f"missing or renamed); {fix}")
    return folder


def _write_failure(what, run_dir, error, kept, needed=0):
    """The one line a failed write ends the run with (a full disk, most often: torch and
    safetensors report it in words of their own, so the free space is named beside them)."""
    free = shutil.disk_usage(run_dir).free
    cause = error.strerror if isinstance(error, OSError) and error.strerror else \
        (str(error).strip().splitlines() or [type(error).__name__])[-1]
    full = "the disk is full: " if free < needed or getattr(error, "errno", None) == errno.ENOSPC else ""
    return (f"train.py: could not write {what} into {run_dir} ({full}{free / 2**20:.1f} MiB free, "
            f"{needed / 2**20:.1f} MiB needed; {cause}); {kept}: free space there and rerun with --resume")


def save_checkpoint(run_dir, step, policy, optimizer, tokenizer, rank):
    """Write checkpoint-STEP atomically (temporary folder, then rename), then point `latest` at
    it (temporary file, then rename) and drop older checkpoints, except those of a held-out
    evaluation (an eval-STEP folder), which checkpoint selection (eval.py --runs) needs.
    Non-finite weights are never written; a failed write removes its temporary files and leaves
    the previous checkpoint."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(policy, optimizer, options=options)
    if rank == 0:
        latest = run_dir / "latest"
        previous = latest.read_text().strip() if latest.is_file() else None
        bad = next((k for k, v in model_sd.items() if not torch.isfinite(v).all()), None)
        if bad is not None:
            raise SystemExit(f"train.py: the policy's {bad} is not finite at step {step}; not saving "
                             f"it over {previous or 'nothing'} in {run_dir}: lower --lr and --resume")
        final = run_dir / f"checkpoint-{step}"
        tmp = run_dir / f".checkpoint-{step}.tmp"
        pointer = run_dir / ".latest.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            unwrapped = getattr(policy, "module", policy)
            unwrapped.save_pretrained(tmp, state_dict=model_sd)
            tokenizer.save_pretrained(tmp)
            torch.save(dict(step=step, optimizer=optim_sd, torch_rng=torch.get_rng_state()),
                       tmp / "trainer.pt")
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            pointer.write_text(final.name)
            os.replace(pointer, latest)
        except Exception as e:  # safetensors, torch and the file system each raise their own kind
            shutil.rmtree(tmp, ignore_errors=True)
            pointer.unlink(missing_ok=True)
            kept = f"{previous} is intact" if previous else "no earlier checkpoint exists"
            needed = sum(f.stat().st_size for f in (run_dir / previous).iterdir()) if previous else 0
            raise SystemExit(_write_failure(f"checkpoint-{step}", run_dir, e, kept, needed)) from None
        for old in run_dir.glob("checkpoint-*"):
            if old != final and not (run_dir / f"eval-{old.name.removeprefix('checkpoint-')}").is_dir():
                shutil.rmtree(old, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()


def load_checkpoint(run_dir, policy, optimizer, device):
    """Restore the policy and optimizer from runs/NAME/latest; returns the step it was saved at.

    trainer.pt is read with weights_only=True (no pickled code runs), and the saved weights must
    carry exactly the policy's names and shapes: a foreign, renamed or corrupted checkpoint is
    one line naming the file and the fix, never a run that trains other weights."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
    folder = checkpoint_folder(run_dir)
    fix = "resume with the --persuader the run started with, or start a new run (another --name)"
    trainer = folder / "trainer.pt"
    try:
        state = torch.load(trainer, map_location="cpu", weights_only=True)
    except Exception as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:120]
        raise SystemExit(f"train.py: {trainer} is not a checkpoint train.py wrote ({reason}); "
                         "it was not run; restore the run from a copy or start a new one") from None
    if not (isinstance(state, dict) and {"step", "optimizer", "torch_rng"} <= state.keys()
            and state["step"] == int(CHECKPOINT_RE.fullmatch(folder.name)[1])):
        raise SystemExit(f"train.py: {trainer} does not hold the step, optimizer and random state "
                         f"of {folder.name}; restore the run from a copy or start a new one")
    model_sd = {}
    for f in sorted(folder.glob("*.safetensors")):
        try:
            model_sd.update(load_file(f))
        except Exception as e:
            raise SystemExit(f"train.py: {f} cannot be read ({type(e).__name__}: "
                             f"{str(e)[:80]}); restore it from a copy or start a new run") from None
    if bad := nonfinite_weight(model_sd):
        others = sorted((p.name for p in run_dir.glob("checkpoint-*") if p != folder),
                        key=lambda n: int(n.split("-")[1]) if n.split("-")[1].isdigit() else -1)
        earlier = (f"resume from an earlier checkpoint (write e.g. {others[-1]} into "
                   f"{run_dir / 'latest'}), or " if others else "no earlier checkpoint is kept: ")
        raise SystemExit(f"train.py: {folder} holds non-finite weights ({bad}); {earlier}start a "
                         "new run with a lower --lr (another --name, or --overwrite)")
    tied = getattr(policy.config, "tie_word_embeddings", False)
    if tied and "lm_head.weight" not in model_sd and "model.embed_tokens.weight" in model_sd:
        model_sd["lm_head.weight"] = model_sd["model.embed_tokens.weight"]
    want = {k: tuple(v.shape) for k, v in policy.state_dict().items()}
    have = {k: tuple(v.shape) for k, v in model_sd.items()}
    problems = [f"{len(m)} {what}, e.g. {m[0]}" for what, m in (
        ("missing", sorted(want.keys() - have.keys())), ("unexpected", sorted(have.keys() - want.keys())),
        ("of another shape", [f"{k} {have[k]} vs {want[k]}" for k in sorted(want.keys() & have.keys())
                              if have[k] != want[k]])) if m]
    if problems:
        raise SystemExit(f"train.py: the weights in {folder} do not match the policy "
                         f"({'; '.join(problems)}); {fix}")
    set_state_dict(policy, optimizer, model_state_dict=model_sd,
                   optim_state_dict=state["optimizer"],
                   options=StateDictOptions(full_state_dict=True, strict=False))
    torch.set_rng_state(state["torch_rng"])
    return state["step"]

# -----------------------------------------------------------------------------
# metrics.jsonl: one JSON object a line, always valid JSON


def finite(m):
    """The metrics with every non-finite number written as null (JSON has no NaN)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in m.items()}


def resume_metrics(path, start):
    """Keep the metrics lines of steps <= start (later steps are redone), rewritten atomically
    (temporary file, then rename): a kill at any moment leaves the old or the new file. A partial
    last line (a write cut by a full disk) is dropped with a warning."""
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    kept = []
    for lineno, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if lineno == len(lines):
                print(f"train.py: warning: dropping the partial last line {lineno} of {path}",
                      file=sys.stderr)
                break
            raise SystemExit(f"train.py: {path}, line {lineno} is not valid JSON; delete that line "
                             "(or the file) and rerun with --resume") from None
        if row["step"] <= start:
            kept.append(line)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text("".join(l + "\n" for l in kept))
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise SystemExit(_write_failure(path.name, path.parent, e, f"{path} is as it was")) from None

# -----------------------------------------------------------------------------
# the loop


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


def main(argv=None):
    args = parse_args(argv)
    if args.plan:
        print("\n".join(against_paper(args)))
        plan.print_plan(args)
        return []
    rank, world, device = setup_distributed()
    rollout.DECISION = args.decision  # the persuadee's decision: its tag, or read as logits
    set_cpu_threads(device)
    torch.manual_seed(args.seed + rank)
    run_dir = Path(args.out) / args.name
    say = print if rank == 0 else (lambda *a, **k: None)
    rank_plan = plan.device_plan(args, world, device)  # before any model loads
    for line in plan.plan_lines(rank_plan):
        say(line)
    if refusal := plan.plan_refusal(rank_plan):
        sys.exit(refusal)
    sizes = rank_plan["sizes"] if device.type == "cuda" else {}  # a CPU keeps the engine's defaults
    if args.preset == "cpu" and not torch.cuda.is_available():
        say(f"no CUDA device: cpu preset ({args.persuader} as persuader, persuadee and judge)")
    say(f"run {run_dir}  preset {args.preset}  ranks {world}  lambda {args.lam}  "
        f"anchor {args.anchor}  G {args.group_size}  instances/step {args.instances}")
    if args.instances % world:
        sys.exit(f"train.py: --instances {args.instances} must be a multiple of the number of "
                 f"ranks ({world}) so that every rank rolls out whole groups")

    served_persuadee = (served.ServedModel(args.persuadee) if served.is_served(args.persuadee)
                        else None)
    served_judge = (served.ServedModel(args.judge) if served.is_served(args.judge) else
                    served_persuadee if args.judge is None else None)  # default: the persuadee
    for model in {id(m): m for m in (served_persuadee, served_judge) if m}.values():
        model.check()  # a wrong URL or key is a one-line exit before any model loads

    # the actor: fp32 master weights (trained, sharded), its rollout copy in --dtype (the actor
    # engine's weights); the frozen reference, persuadee and judge in --dtype
    policy, tokenizer = load(args.persuader, args.dtype if args.lora else "float32", device)
    if bad := nonfinite_weight(policy.state_dict()):
        sys.exit(f"train.py: --persuader {args.persuader} holds non-finite weights ({bad}); pass "
                 "a model with finite weights (an earlier checkpoint of the run that wrote it)")
    same = not served_persuadee and args.persuadee == args.persuader
    if served_persuadee:
        persuadee_model = persuadee_tok = None  # the server plays it
    elif same:  # the persuader's frozen initial weights: the persuadee and the reference at once
        persuadee_model, persuadee_tok = load(args.persuader, args.dtype, device)[0], tokenizer
    else:
        persuadee_model, persuadee_tok = load(args.persuadee, args.dtype, device)
    if args.lora:  # fp32 adapters on the frozen base, data parallel; the base is the reference
        policy = models.average_lora_gradients(models.attach_lora(policy, args.lora,
                                                                  args.persuader), world)
    reference = None
    if args.kl_beta > 0:
        reference = persuadee_model if same else models.AdapterOff(policy) if args.lora else \
            shard(load(args.persuader, args.dtype, device)[0], world)
    if not args.lora:
        policy.requires_grad_(True)
    if plan.GRAD_CHECKPOINTING and device.type == "cuda":
        policy.gradient_checkpointing_enable()
    separate = world > 1 or args.dtype != "float32" or bool(args.lora)
    rollout_model = load(args.persuader, args.dtype, device)[0] if separate else policy
    policy = policy if args.lora else shard(policy, world, getattr(torch, args.dtype))
    update_rollout = models.refresh_from_lora if args.lora else copy_weights
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=WEIGHT_DECAY)
    start = 0
    if args.resume:
        start = load_checkpoint(run_dir, policy, optimizer, device)
        say(f"resumed from step {start}")
    if separate:
        update_rollout(policy, rollout_model)
    actor = engine.Engine(rollout_model, tokenizer, **sizes.get("actor", {}))
    persuadee = served_persuadee or engine.Engine(persuadee_model, persuadee_tok,
                                                  **sizes.get("persuadee", {}))
    if served_judge or args.judge == "none":
        judge = served_judge or None
    elif args.judge in (None, args.persuadee):  # the persuadee's model: its engine, shared
        judge = persuadee
    else:  # a model of its own, which the plan counted
        judge = engine.Engine(*load(args.judge, args.dtype, device), **sizes.get("judge", {}))

    instances = arena.training_instances(arena.load_scenarios(args.scenarios, split="train"))
    problems = rollout.prompt_problems(actor, persuadee, instances)  # found once, up front
    if problems:
        say(f"skipping {len(problems)} training instances that do not fit a context, e.g. "
            f"{next(iter(problems.values()))}")
        instances = [inst for inst in instances if inst["id"] not in problems]
    args.skipped_instances = len(problems)
    if rank == 0:
        if args.overwrite:
            shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True, exist_ok=True)
        record_config(run_dir, args, start)
        resume_metrics(run_dir / "metrics.jsonl", start)
        resume_metrics(run_dir / "rollouts.jsonl", start)
    loggers = open_loggers(args, run_dir, start) if rank == 0 else []
    history, skipped = [], 0
    for step in range(start + 1, args.steps + 1):
        t0 = time.perf_counter()
        mine = step_instances(instances, args, step, rank, world)
        bar = tqdm(total=len(mine) * args.group_size, desc=f"step {step} rollout",
                   disable=rank != 0, leave=False)
        times = dict(judge_s=0.0, probe_s=0.0)
        seed = args.seed * 1000003 + step * 1009  # not the rank: records are rank-free
        records = rollout.rollout_episodes(
            actor, persuadee, mine, args.t_max, group_size=args.group_size, seed=seed,
            persuader_sampling=engine.Sampling(args.persuader_temperature),
            persuadee_sampling=engine.Sampling(args.persuadee_temperature,
                                               args.persuadee_top_p, args.persuadee_top_k),
            max_new_tokens=args.max_new_tokens, judge=judge, probe_space=args.probe_space,
            probe_signs=args.probe_signs, progress=bar, timings=times)
        bar.close()
        for r in records:  # beliefs a served persuadee cannot give: NaN, which rpo.py counts
            r["beliefs"] = [math.nan if b is None else b for b in r["beliefs"]]
        played, (records, left_out) = records, playable(records, args.group_size, say)
        times["rollout_s"] = time.perf_counter() - t0 - times["judge_s"]
        t2 = time.perf_counter()
        turn_adv, groups = advantages(records, args.group_size, args)
        update = policy_update(policy, reference, optimizer, *silenced(played, records, turn_adv),
                               args, device, world)
        if separate:
            update_rollout(policy, rollout_model)  # into the actor engine's own tensors
        actor.refresh()
        times["update_s"] = time.perf_counter() - t2
        times["step_s"] = time.perf_counter() - t0
        m = step_metrics(step, records, groups, update, times, args, device)
        m.update({k: all_sum(v, device) for k, v in left_out.items()})
        rows = step_records(step, records, args.group_size, args, rank, world)
        history.append(m)
        if rank == 0:
            try:
                with open(run_dir / "metrics.jsonl", "a") as f:
                    f.write(json.dumps(finite(m), allow_nan=False) + "\n")
                with open(run_dir / "rollouts.jsonl", "a") as f:
                    f.write("".join(json.dumps(row, allow_nan=False) + "\n" for row in rows))
            except OSError as e:
                raise SystemExit(_write_failure("metrics.jsonl", run_dir, e, "the last checkpoint "
                                                "is intact")) from None
            if m["step_skipped"]:
                say(f"step {step}: skipped, non-finite {m['nonfinite']} (weights and optimizer unchanged)")
            say(f"step {step}: reward {m['reward_mean']:+.3f}  accept "
                f"{m['outcome_ACCEPT']:.0%}  belief change {m['belief_change']:+.3f}  loss "
                f"{m['loss']:+.4f}  kl {m['kl']:.4f}  dead {m['dead_group_share']:.0%}  "
                f"{m['step_s']:.1f}s (rollout {m['rollout_s']:.1f}, probes {m['probe_s']:.1f}, "
                f"judge {m['judge_s']:.1f}, update {m['update_s']:.1f})")
            for log in loggers:
                log.scalars(step, scalars({k: v for k, v in m.items() if k != "step"}, "train/"))
            if step % max(args.save_every, 1) == 0 or step == 1:
                write_atomic(run_dir / f"samples-{step}.json", json.dumps(
                    [dict(id=r["id"], outcome=r["outcome"], transcript=r["transcript"],
                          beliefs=[b if math.isfinite(b) else None for b in r["beliefs"]])
                     for r in records[:SAMPLE_DIALOGUES]], indent=1, allow_nan=False),
                    "the last checkpoint is intact")
                for log in loggers:
                    log.samples(step, sample_rows(records))
        skipped = skipped + 1 if m["step_skipped"] else 0
        if skipped >= MAX_SKIPPED_STEPS:
            sys.exit(f"train.py: {skipped} steps in a row (steps {step - skipped + 1}-{step}) were "
                     f"skipped as non-finite ({', '.join(m['nonfinite'])}): the run has gone wrong "
                     f"and stops; the weights updated at step {step - skipped} are suspect: resume "
                     f"from a checkpoint saved before it, or start again with a lower --lr")
        evaluated = bool(args.eval_every) and step % args.eval_every == 0
        if evaluated:
            summary = evaluate(actor, persuadee, judge, args, step, rank, run_dir)
            for log in loggers:
                log.scalars(step, scalars(summary, "heldout/"))
        if step % max(args.save_every, 1) == 0 or step == args.steps or evaluated:
            save_checkpoint(run_dir, step, policy, optimizer, tokenizer, rank)
    for log in loggers:
        log.close()
    if dist.is_initialized():
        dist.destroy_process_group()
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
    """Held-out evaluation through eval.py, the scenarios sharded over the ranks; rank 0 writes
    runs/NAME/eval-STEP and appends its summary to runs/NAME/evals.jsonl under its step (what
    eval.py --runs reads)."""
    import eval as evaluation
    instances = arena.heldout_instances(arena.load_scenarios(args.scenarios))[:args.eval_limit]
    world = dist.get_world_size() if dist.is_initialized() else 1
    summary = evaluation.evaluate(actor, persuadee, instances, run_dir / f"eval-{step}",
                                  t_max=args.eval_t_max, seed=args.seed,
                                  max_new_tokens=args.max_new_tokens, judge=judge,
                                  anchor=args.anchor, preset=args.sampling,
                                  probe_space=args.probe_space, probe_signs=args.probe_signs,
                                  rank=rank, world=world, shaping_lambda=args.lam)
    if rank == 0:
        path, kept = run_dir / "evals.jsonl", []
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines()
                                      if path.exists() else [], 1):
            try:
                earlier = json.loads(line)["step"] < step  # a resumed run redoes later ones
            except (ValueError, KeyError, TypeError):
                print(f"train.py: warning: dropping line {lineno} of {path}, not an evaluation "
                      "summary", file=sys.stderr)
                continue
            if earlier:
                kept.append(line)
        write_atomic(path, "".join(l + "\n" for l in kept + [json.dumps(
            analyses.standard({"step": step, **summary}), allow_nan=False)]), f"{path} is as it was")
        print(f"eval step {step}: full accept {summary['full_accept']:.1%}  "
              f"full-or-conditional {summary['full_or_conditional']:.1%}")
    return summary


class TensorBoardLog:
    """Events in runs/NAME (`tensorboard --logdir runs`); a resumed run drops what came after
    its checkpoint, as metrics.jsonl does."""

    def __init__(self, run_dir, start):
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(str(run_dir), purge_step=start + 1 if start else None)

    def scalars(self, step, values):
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def samples(self, step, rows):
        head = "| id | outcome | turns | beliefs | transcript |\n| --- | --- | --- | --- | --- |\n"
        cell = lambda v: str(v).replace("|", "\\|").replace("\n", "<br>")
        self.writer.add_text("samples", head + "".join(
            "| " + " | ".join(cell(v) for v in row) + " |\n" for row in rows), step)

    def close(self):
        self.writer.close()


class WandbLog:
    """A W&B run in runs/NAME/wandb, offline unless WANDB_MODE is set (`wandb sync` uploads it)."""

    def __init__(self, run_dir, args):
        self.wandb = require("wandb")
        mode = None if os.environ.get("WANDB_MODE") else "offline"
        run_id = "".join(c if c.isalnum() or c in "-_" else "-" for c in args.name)  # W&B's id alphabet
        self.run = self.wandb.init(project=WANDB_PROJECT, name=args.name, id=run_id,
                                   resume="allow", dir=str(run_dir), mode=mode,
                                   config={k: v for k, v in vars(args).items() if k != "log"})

    def scalars(self, step, values):
        self.run.log(values, step=step)

    def samples(self, step, rows):
        table = self.wandb.Table(columns=["id", "outcome", "turns", "beliefs", "transcript"],
                                 data=rows)
        self.run.log({"samples": table}, step=step)

    def close(self):
        self.run.finish()


if __name__ == "__main__":
    main()
