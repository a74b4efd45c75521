"""
train.py: Probe-RPO, online RL for the persuader against a frozen persuadee.

One step, in the order of the loop at the bottom of this file (rpo.py has the equations):
  1. rollout: draw --instances scenario instances; play --group-size episodes of each with the
     current policy against the frozen persuadee (rollout.py), probes read after every reply
     (probes.py);
  2. rewards: the strategy judge scores each transcript; R = GOAL[outcome] + STRATEGY_WEIGHT * s;
  3. advantages: A_{i,t} = A_out_i + LAMBDA * (D_{i,t} - mean D), on every token of message t;
  4. loss and update: rpo.micro_batch_loss (clipped surrogate + k3 KL over the persuader's own
     tokens, divided by the global persuader-token count), summed over micro-batches and ranks;
     grad clipping at GRAD_CLIP; AdamW;
  5. weight refresh: the rollout engine's weights are written from the updated policy;
  6. log, evaluate (eval.py on held-out scenarios, every --eval-every steps), save.
Groups are sharded across ranks (torchrun). The actor's master weights, gradients and AdamW
moments are fp32, sharded with FSDP2 under a MixedPrecisionPolicy (bf16 compute, fp32 gradient
reduction; autocast in one process); its rollout copy in --dtype is the actor engine's own
weights; the frozen reference is sharded too (or is the persuadee's model when they are the
same); persuadee and judge are frozen and unsharded. --lora trains adapters on a frozen base.
Checkpoints (runs/NAME/checkpoint-STEP) are Hugging Face folders of the fp32 master weights plus
the optimizer, written to a temporary folder and renamed: a killed run resumes from the last one
(--resume, its settings and constants pinned). metrics.jsonl is the record of truth, one line a
step; rollouts.jsonl one small record per training episode. A non-finite log-prob, advantage,
loss or gradient norm skips its step; MAX_SKIPPED_STEPS in a row stop the run.
Flags, validation and resume pinning are lab/cli.py's; presets lab/presets.py's (a run prints
every value its preset sets over the constant that owns it); the run folder, checkpoints and
loggers lab/runs.py's; start-up, the step's records and metrics lab/steps.py's; the memory plan
lab/plan.py's.

    python train.py                                # cpu preset (the default without CUDA)
    python train.py --preset tiny                  # tiny random models, seconds a step
    python train.py --steps 50 --lam 0 --name grpo # an ablation: outcome-only GRPO
    python train.py --name NAME --resume           # continue a killed run
    python train.py --log tensorboard              # also TensorBoard events in runs/NAME
    python train.py --judge openai:MODEL@URL       # a judge served over the OpenAI API
    python train.py --persuadee openai:MODEL@URL   # a persuadee (and judge) served over the API
    torchrun --nproc_per_node 8 train.py           # paper preset on a GPU node
    python train.py --preset paper --plan          # its memory per rank on 8 x H200, on any machine
"""
import math
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
import rollout
import rpo
from lab import checkpoints, cli, loggers, lora, plan, ranks, runs, steps

# the knobs train.py owns (presets: lab/presets.py; the objective's: rpo.py)
GRAD_CLIP = 1.0                     # max global grad norm
WEIGHT_DECAY = 0.0                  # AdamW weight decay
SEED = 0                            # --seed
NONFINITE_CHECKS = ("logprobs", "advantages", "loss", "grad_norm")  # a non-finite one skips the step
MAX_SKIPPED_STEPS = 3               # consecutive skipped (non-finite) steps that stop the run

# -----------------------------------------------------------------------------
# models and engines: the actor (sharded, trained), its rollout copy, reference, persuadee, judge


def load(name, dtype, device):
    model, tokenizer = models.load_model(name, dtype=getattr(torch, dtype), device=device)
    return model.requires_grad_(False), tokenizer


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


def checkpoint_activations(policy):
    """Activation (gradient) checkpointing on, by transformers' newer name where it has one."""
    (getattr(policy, "activation_checkpointing_enable", None) or policy.gradient_checkpointing_enable)()


def build_models(args, world, device, sizes):
    """The actor (fp32 master weights, trained and sharded; its rollout copy in --dtype, the
    actor engine's weights), the frozen reference and persuadee in --dtype, the AdamW."""
    served_persuadee, served_judge = steps.served_roles(args)
    policy, tokenizer = load(args.persuader, args.dtype if args.lora else "float32", device)
    if bad := checkpoints.nonfinite_weight(policy.state_dict()):
        sys.exit(f"train.py: --persuader {args.persuader} holds non-finite weights ({bad}); pass "
                 "a model with finite weights (an earlier checkpoint of the run that wrote it)")
    same = not served_persuadee and args.persuadee == args.persuader
    # the persuader is read once: its other roles are copies in --dtype (models.copied)
    copy = lambda: models.copied(policy, getattr(torch, args.dtype))
    if served_persuadee:
        persuadee_model = persuadee_tokenizer = None  # the server plays it
    elif same:  # the persuader's frozen initial weights: the persuadee and the reference at once
        persuadee_model, persuadee_tokenizer = copy(), tokenizer
    else:
        persuadee_model, persuadee_tokenizer = load(args.persuadee, args.dtype, device)
    separate = world > 1 or args.dtype != "float32" or bool(args.lora)
    rollout_model = copy() if separate else policy  # copied before adapters or checkpointing
    if args.lora:  # fp32 adapters on the frozen base, data parallel; the base is the reference
        policy = lora.average_lora_gradients(lora.attach_lora(policy, args.lora,
                                                                  args.persuader), world)
    reference = None
    if args.kl_beta > 0:
        reference = persuadee_model if same else lora.AdapterOff(policy) if args.lora else \
            shard(copy(), world)
    if not args.lora:
        policy.requires_grad_(True)
    if plan.checkpointing(args.activation_checkpointing, device.type):
        checkpoint_activations(policy)
    policy = policy if args.lora else shard(policy, world, getattr(torch, args.dtype))
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=WEIGHT_DECAY)
    return SimpleNamespace(policy=policy, optimizer=optimizer, reference=reference, lora=args.lora,
                           tokenizer=tokenizer, rollout_model=rollout_model if separate else None,
                           persuadee_model=persuadee_model, persuadee_tokenizer=persuadee_tokenizer,
                           served_persuadee=served_persuadee, served_judge=served_judge)


@torch.no_grad()
def copy_weights(policy, rollout_model):
    """Gather the sharded fp32 master weights, one parameter at a time, into the rollout copy
    (cast to its dtype). Its parameters are the actor engine's own fused tensors (layers.fuse),
    so this writes straight into what the engine reads, at the same addresses."""
    target = dict(rollout_model.named_parameters())
    for name, p in policy.named_parameters():
        target[name].copy_(p.full_tensor() if hasattr(p, "full_tensor") else p)


def refresh_rollout_copy(m):
    """The policy's weights written into the rollout copy (the actor engine's own tensors): the
    fp32 master weights gathered, or under LoRA the base with its adapters merged."""
    if m.rollout_model is not None:
        (lora.refresh_from_lora if m.lora else copy_weights)(m.policy, m.rollout_model)


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


def refresh(m):
    """Point the actor engine at the updated weights (written into its own tensors)."""
    refresh_rollout_copy(m)
    m.actor.refresh()

# -----------------------------------------------------------------------------
# one step: rollout, the update, the held-out evaluation


def step_instances(instances, args, step, rank, world):
    """This step's instances (the same on every rank, drawn from the step number) and this
    rank's share of them."""
    chosen = random.Random(args.seed * 100003 + step).sample(instances, args.instances)
    return chosen[rank::world]


def play_step(m, instances, args, step, rank, world):
    """This rank's share of the step's groups, played by the current policy; their records
    and the step's timings (seconds, by ranks.TIMING_KEYS)."""
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
        probe_signs=args.probe_signs, decision=args.decision, progress=bar, timings=times)
    bar.close()
    return records, times


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


def shares_prompts(policy, world):
    """Whether kept_logits may run shared prompts once: in one process (not under FSDP) and
    without gradient checkpointing, which drops a training cache."""
    checkpointing = getattr(policy, "is_activation_checkpointing", None)  # transformers' newer name
    if checkpointing is None:
        checkpointing = getattr(policy, "is_gradient_checkpointing", False)
    return world == 1 and not checkpointing


def policy_update(policy, reference, optimizer, records, turn_advantages, args, device, world):
    """One AdamW step on the persuader tokens of this rank's episodes: the loss of each
    micro-batch (rpo.micro_batch_loss), its backward, the gradient clipped. A non-finite
    log-prob, advantage, loss or gradient norm on any rank skips the step (weights and optimizer
    state untouched; stats say so: step_skipped, nonfinite)."""
    num_tokens = ranks.all_sum(rpo.persuader_tokens(records), device)
    if (stats := steps.zero_advantage_step(policy, optimizer, turn_advantages, args, device,
                                           WEIGHT_DECAY)) is not None:
        return dict(stats, persuader_tokens=num_tokens)  # a zero gradient: no forward needed
    stats = dict(loss=0.0, kl=0.0, clip_frac=0.0, ratio_mean=0.0)
    bad = dict.fromkeys(NONFINITE_CHECKS, 0)
    policy.train()
    for i in range(0, len(records), args.micro_batch):
        loss, s = rpo.micro_batch_loss(
            policy, reference, records[i:i + args.micro_batch],
            turn_advantages[i:i + args.micro_batch], num_tokens,
            temperature=args.persuader_temperature or 1.0,  # greedy records log-probs at T = 1
            clip_low=args.clip_low, clip_high=args.clip_high, beta=args.kl_beta,
            share_stem=shares_prompts(policy, world), share_reference_stem=world == 1,
            context=lambda model: compute_context(model, args, world))
        (loss * world).backward()  # FSDP averages gradients over ranks; the loss is a global mean
        for k, v in s.pop("nonfinite").items():
            bad[k] += v
        for k, v in s.items():
            stats[k] += v
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), GRAD_CLIP)
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    bad = {k: ranks.all_sum(v, device) for k, v in bad.items()}
    bad["grad_norm"] = not math.isfinite(grad_norm)
    nonfinite = [k for k in NONFINITE_CHECKS if bad[k]]
    if not nonfinite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    policy.eval()
    stats = {k: ranks.all_sum(v, device) for k, v in stats.items()}
    stats.update(grad_norm=grad_norm, persuader_tokens=num_tokens, step_skipped=int(bool(nonfinite)),
                 nonfinite=nonfinite, zero_gradient=0)
    return stats


def evaluate(actor, persuadee, judge, args, step, rank, run_dir):
    """Held-out evaluation through eval.py, the scenarios sharded over the ranks, with the run's
    own sampling, lambda and anchor; rank 0 writes runs/NAME/eval-STEP and appends its summary to
    runs/NAME/evals.jsonl under its step (what eval.py --runs reads)."""
    import eval
    heldout = arena.heldout_instances(arena.load_scenarios(args.scenarios))
    instances = arena.stratified(heldout, args.eval_limit)  # every domain x resistance cell as evenly as N allows
    world = dist.get_world_size() if dist.is_initialized() else 1
    summary = eval.evaluate(actor, persuadee, instances, run_dir / f"eval-{step}",
                            t_max=args.eval_t_max, seed=args.seed,
                            max_new_tokens=args.max_new_tokens, judge=judge, anchor=args.anchor,
                            sampling=rollout.role_sampling(args), probe_space=args.probe_space,
                            probe_signs=args.probe_signs, rank=rank, world=world,
                            shaping_lambda=args.lam, decision=args.decision,
                            fidelity=(eval.FIDELITY_SAMPLES if args.eval_fidelity is None
                                      else args.eval_fidelity),
                            subset="heldout " + arena.subset_name(args.eval_limit, len(heldout)))
    if rank == 0:
        steps.record_evaluation(run_dir / "evals.jsonl", step, summary)
        print(f"eval step {step}: full accept {summary['full_accept']:.1%}  "
              f"full-or-conditional {summary['full_or_conditional']:.1%}")
    return summary

# -----------------------------------------------------------------------------
# the loop


def train(args, run_dir, rank, world, device, sizes, say):
    """Build the models and engines, resume, then for each step: rollout -> rewards ->
    advantages -> loss and update -> weight refresh -> log -> evaluate -> save. Returns the
    metrics of every step."""
    m = build_models(args, world, device, sizes)
    start = checkpoints.load_checkpoint(run_dir, m.policy, m.optimizer) if args.resume else 0
    if args.resume:
        say(f"resumed from step {start}")
    build_engines(m, args, device, sizes)
    instances = steps.training_set(args, m, say)
    if rank == 0:
        steps.open_run(run_dir, args, start, sys.modules[__name__])
    log, history, skipped = loggers.Loggers(args, run_dir, start, rank), [], 0
    for step in range(start + 1, args.steps + 1):
        t0 = time.perf_counter()
        played, times = play_step(m, instances, args, step, rank, world)  # rollout and rewards
        records, left_out, why = rpo.playable(played, args.group_size)
        if why:
            say(f"left out {left_out['left_out']} episodes (their groups) of this step: {why}")
        times["rollout_s"] = time.perf_counter() - t0 - times["judge_s"]
        t1 = time.perf_counter()
        turn_adv, groups = rpo.advantages(records, args.group_size, args.lam, args.anchor)
        update = policy_update(m.policy, m.reference, m.optimizer,
                               *rpo.silenced(played, records, turn_adv), args, device, world)
        refresh(m)
        times["update_s"], times["step_s"] = time.perf_counter() - t1, time.perf_counter() - t0
        metrics = steps.step_metrics(step, records, groups, update, times, args, device)
        metrics.update({k: ranks.all_sum(v, device) for k, v in left_out.items()})
        rows = steps.step_records(step, records, args.group_size, args, rank, world)
        history.append(metrics)
        if rank == 0:
            steps.write_step(run_dir, step, metrics, rows, records, args, log)
        skipped = steps.stop_if_diverged(skipped, step, metrics, MAX_SKIPPED_STEPS)
        evaluated = bool(args.eval_every) and step % args.eval_every == 0
        if evaluated:
            log.scalars(step, evaluate(m.actor, m.persuadee, m.judge, args, step, rank, run_dir),
                        "heldout/")
        if step % args.save_every == 0 or step == args.steps or evaluated:
            checkpoints.save_checkpoint(run_dir, step, m.policy, m.optimizer, m.tokenizer, rank)
    log.close()
    ranks.finish_distributed()
    say(f"done: metrics in {run_dir / 'metrics.jsonl'}, policy in {run_dir / 'checkpoint-*'}")
    return history


def main(argv=None):
    args = cli.train_args(argv, sys.modules[__name__])
    if args.plan:
        for line in cli.against_paper(args):
            print(line)
        plan.print_plan(args)
        return []
    rank, world, device = ranks.setup_distributed()
    models.set_cpu_threads(device)
    torch.manual_seed(args.seed + rank)
    run_dir = Path(args.out) / args.name
    say = print if rank == 0 else (lambda *a, **k: None)
    sizes = steps.plan_run(args, world, device, say)
    if rank == 0:
        runs.lock(run_dir, "train.py")  # held for the run, taken before any model loads
    restore = runs.exit_on_interrupt("train.py", run_dir)  # Ctrl-C as SIGTERM: at once, one line
    try:
        return train(args, run_dir, rank, world, device, sizes, say)
    finally:
        runs.unlock(run_dir)
        restore()


if __name__ == "__main__":
    main()
