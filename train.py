"""
train.py: Probe-RPO, online RL for the persuader against a frozen persuadee.

One step, in the order of the loop at the bottom of this file (rpo.py has the equations):
  1. rollout: draw --instances scenario instances; play --group-size episodes of each with the
     current policy against the frozen persuadee (rollout.py), probes read after every reply
     (probes.py);
  2. rewards: the strategy judge scores each transcript; R = GOAL[outcome] + STRATEGY_WEIGHT * s;
  3. advantages: A_{i,t} = A_out_i + LAMBDA * (D_{i,t} - mean of D_{j,t} over the group's
     episodes that reached turn t), on every token of message t (rpo.DENSE_BASELINE);
  4. loss and update: rpo.micro_batch_loss (clipped surrogate + k3 KL over the persuader's own
     tokens, divided by the global persuader-token count), summed over micro-batches and ranks;
     grad clipping at GRAD_CLIP; AdamW; --updates-per-batch such steps, one a mini-batch;
  5. weight refresh: the rollout engine's weights are written from the updated policy;
  6. log, evaluate (eval.py on held-out scenarios, every --eval-every steps), save.
Groups are sharded across ranks (torchrun). The actor's master weights, gradients and AdamW
moments are fp32, sharded with FSDP2 under a MixedPrecisionPolicy (lab/ranks.shard: bf16
compute, fp32 gradient reduction; in one process autocast, lab/steps.compute_context); its
rollout copy in --dtype is the actor engine's own weights; the frozen reference is sharded
too (or is the persuadee's model when they are the same); persuadee and judge are frozen and
unsharded. --lora trains adapters on a frozen base.
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
import collections
import math
import random
import sys
import time
from pathlib import Path
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tqdm import tqdm

from persuarena import arena
from persuarena import engine
from persuarena import models
from persuarena import rollout
from persuarena import rpo
from lab import checkpoints, cli, loggers, lora, plan, ranks, runs, steps

# the paper's numbers, each its flag's default (a preset sets only what differs: lab/presets.py,
# which the cpu and tiny presets do for all but MICRO_BATCH; the objective's own: rpo.py)
GROUP_SIZE = 8                      # --group-size: episodes of each instance, one GRPO group
INSTANCES = 16                      # --instances: scenario instances a step (x GROUP_SIZE episodes)
LR = 1e-6                           # --lr: AdamW's learning rate
STEPS = 200                         # --steps
MICRO_BATCH = 4                     # --micro-batch: episodes a forward and backward of the update
EVAL_EVERY = 20                     # --eval-every: steps between held-out evaluations (0: none)
EVAL_LIMIT = 120                    # --eval-limit: held-out scenario instances an evaluation plays
SAVE_EVERY = 20                     # --save-every: steps between checkpoints
GRAD_CLIP = 1.0                     # max global grad norm
WEIGHT_DECAY = 0.0                  # AdamW weight decay
SEED = 0                            # --seed
NONFINITE_CHECKS = ("logprobs", "advantages", "loss", "grad_norm")  # a non-finite one skips the
# step; a name taken out is no longer checked (the step then goes ahead), an unknown one is refused
MAX_SKIPPED_STEPS = 3               # consecutive skipped (non-finite) steps that stop the run

# -----------------------------------------------------------------------------
# models and engines: the actor (sharded, trained), its rollout copy, reference, persuadee, judge


def load(name, dtype, device, seed=0):  # seed: a random model's weights (the policy's: --seed)
    model, tokenizer = models.load_model(name, dtype=getattr(torch, dtype), device=device, seed=seed)
    return model.requires_grad_(False), tokenizer


@dataclass
class Models:
    """What build_models loads, as plan.run_models decided (held): the policy (the persuader's
    fp32 master weights, trained) and its AdamW, its rollout copy (None: the engine runs on the
    policy), the frozen reference and persuadee (None where served), the served roles."""
    held: plan.RunModels
    policy: torch.nn.Module
    optimizer: torch.optim.Optimizer
    tokenizer: object
    rollout_copy: torch.nn.Module | None
    reference: torch.nn.Module | None
    persuadee: torch.nn.Module | None
    persuadee_tokenizer: object
    served_persuadee: object
    served_judge: object
    lora: int | None


@dataclass
class Engines:
    """The engines that play a step: the persuader's (on the rollout copy), the persuadee's (or
    its server) and the judge's (the persuadee's, its own, a server, or None)."""
    persuader: engine.Engine
    persuadee: object
    judge: object


def build_models(args, world, device):
    """The models plan.run_models decides (the memory plan counted the same): the policy in
    fp32, sharded, its rollout copy, the frozen reference and persuadee in --dtype, the AdamW."""
    held = plan.run_models(args, world)
    served_persuadee, served_judge = steps.served_roles(args)
    policy, tokenizer = load(args.persuader, args.dtype if args.lora else "float32", device, args.seed)
    if bad := checkpoints.nonfinite_weight(policy.state_dict()):
        sys.exit(f"train.py: --persuader {args.persuader} holds non-finite weights ({bad}); pass "
                 "a model with finite weights (an earlier checkpoint of the run that wrote it)")
    # the persuader is read once: its other roles are copies in --dtype (models.copied)
    copy = lambda: models.copied(policy, getattr(torch, args.dtype))
    persuadee, persuadee_tokenizer = dict(
        served=lambda: (None, None), persuader=lambda: (copy(), tokenizer),  # frozen initial weights
        own=lambda: load(args.persuadee, args.dtype, device))[held.persuadee]()
    rollout_copy = copy() if held.rollout_copy else None  # before adapters or checkpointing
    if args.lora:  # fp32 adapters on the frozen base, data parallel; the base is the reference
        policy = lora.average_lora_gradients(lora.attach_lora(policy, args.lora,
                                                                  args.persuader), world)
    reference = {None: lambda: None, "persuadee": lambda: persuadee,
                 "base": lambda: lora.AdapterOff(policy),
                 "copy": lambda: ranks.shard(copy(), world)}[held.reference]()
    if not args.lora:
        policy.requires_grad_(True)
    if plan.checkpointing(args.activation_checkpointing, device.type):
        steps.checkpoint_activations(policy)
    policy = policy if args.lora else ranks.shard(policy, world, getattr(torch, args.dtype))
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=WEIGHT_DECAY)
    return Models(held, policy, optimizer, tokenizer, rollout_copy, reference, persuadee,
                  persuadee_tokenizer, served_persuadee, served_judge, args.lora)


@torch.no_grad()
def copy_weights(policy, rollout_copy):
    """Gather the sharded fp32 master weights, one parameter at a time, into the rollout copy
    (cast to its dtype). Its parameters are the persuader engine's own fused tensors
    (layers.fuse), so this writes straight into what the engine reads, at the same addresses."""
    target = dict(rollout_copy.named_parameters())
    for name, p in policy.named_parameters():
        target[name].copy_(p.full_tensor() if hasattr(p, "full_tensor") else p)


def refresh_rollout_copy(loaded):
    """The policy's weights written into the rollout copy (the persuader engine's own tensors):
    the fp32 master weights gathered, or under LoRA the base with its adapters merged."""
    if loaded.rollout_copy is not None:
        (lora.refresh_from_lora if loaded.lora else copy_weights)(loaded.policy, loaded.rollout_copy)


def build_engines(loaded, args, device, sizes):
    """The engines of the models loaded.held names: the persuader's on the rollout copy (the
    policy's weights copied in, after a resume), the persuadee's (or its server) and the
    judge's (the persuadee's engine, shared; a model of its own, which the plan counted; a
    server; or none)."""
    refresh_rollout_copy(loaded)
    persuader = engine.Engine(loaded.rollout_copy or loaded.policy, loaded.tokenizer,
                              **sizes.get("persuader", {}))
    persuadee = loaded.served_persuadee or engine.Engine(
        loaded.persuadee, loaded.persuadee_tokenizer, **sizes.get("persuadee", {}))
    judge = dict(none=lambda: None, served=lambda: loaded.served_judge,
                 persuadee=lambda: persuadee, own=lambda: engine.Engine(
                     *load(args.judge, args.dtype, device), **sizes.get("judge", {})))
    return Engines(persuader, persuadee, judge[loaded.held.judge]())


def refresh(loaded, engines):
    """Point the persuader engine at the updated weights (written into its own tensors)."""
    refresh_rollout_copy(loaded)
    engines.persuader.refresh()

# -----------------------------------------------------------------------------
# one step: rollout, the update, the held-out evaluation


def step_instances(instances, args, step, rank, world):
    """This step's instances (the same on every rank, drawn from the step number) and this
    rank's share of them."""
    chosen = random.Random(args.seed * 100003 + step).sample(instances, args.instances)
    return chosen[rank::world]


def rollout_options(args):
    """rollout_episodes' settings of a run, beside its instances, seed and clocks."""
    persuader_sampling, persuadee_sampling = cli.role_sampling(args)
    return dict(group_size=args.group_size, persuader_sampling=persuader_sampling,
                persuadee_sampling=persuadee_sampling, max_new_tokens=args.max_new_tokens,
                probe_space=args.probe_space, probe_signs=args.probe_signs, decision=args.decision)


def policy_update(policy, reference, optimizer, records, turn_advantages, args, device, world):
    """One AdamW step on the persuader tokens of a mini-batch of this rank's episodes: the loss of
    each micro-batch (rpo.micro_batch_loss), its backward, the gradient clipped. A non-finite
    log-prob, advantage, loss or gradient norm on any rank skips the step (weights and optimizer
    state untouched; stats say so: step_skipped, nonfinite)."""
    num_tokens = ranks.all_sum(rpo.persuader_tokens(records), device)
    if (stats := steps.zero_advantage_step(policy, optimizer, turn_advantages, args, device,
                                           WEIGHT_DECAY)) is not None:
        return dict(stats, persuader_tokens=num_tokens)  # a zero gradient: no forward needed
    stats = dict(loss=0.0, kl=0.0, clip_frac=0.0, ratio_mean=0.0)
    bad = collections.Counter()  # non-finite counts by name (cli.NONFINITE_NAMES)
    policy.train()
    for i in range(0, len(records), args.micro_batch):
        loss, s = rpo.micro_batch_loss(
            policy, reference, records[i:i + args.micro_batch],
            turn_advantages[i:i + args.micro_batch], num_tokens,
            temperature=args.persuader_temperature or 1.0,  # greedy records log-probs at T = 1
            clip_low=args.clip_low, clip_high=args.clip_high, beta=args.kl_beta,
            logits=lambda model, *a: steps.kept_logits(  # a shared prompt once where it may
                model, *a, share_stem=steps.shares_prompts(policy, world) if model is policy
                else world == 1),
            context=lambda model: steps.compute_context(model, args, world))
        (loss * world).backward()  # FSDP averages gradients over ranks; the loss is a global mean
        bad.update(s.pop("nonfinite"))
        for k, v in s.items():
            stats[k] += v
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), GRAD_CLIP)
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    bad = {k: ranks.all_sum(bad[k], device) for k in ("logprobs", "advantages", "loss")}
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


def evaluate_heldout(persuader, persuadee, judge, args, step, rank, run_dir):
    """Held-out evaluation through eval.py, the scenarios sharded over the ranks, with the run's
    own sampling, lambda and anchor; rank 0 writes runs/NAME/eval-STEP and appends its summary to
    runs/NAME/evals.jsonl under its step (what eval.py --runs reads)."""
    from persuarena import eval as evaluation  # eval.py (not the builtin)
    heldout = arena.heldout_instances(arena.load_scenarios(args.scenarios))
    instances = arena.stratified(heldout, args.eval_limit)  # every domain x resistance cell as evenly as N allows
    world = dist.get_world_size() if dist.is_initialized() else 1
    summary = evaluation.evaluate(persuader, persuadee, instances, run_dir / f"eval-{step}",
                            t_max=args.eval_t_max, seed=args.seed,
                            max_new_tokens=args.max_new_tokens, judge=judge, anchor=args.anchor,
                            sampling=cli.role_sampling(args), probe_space=args.probe_space,
                            probe_signs=args.probe_signs, rank=rank, world=world,
                            shaping_lambda=args.lam, decision=args.decision,
                            fidelity=(evaluation.FIDELITY_SAMPLES if args.eval_fidelity is None
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
    loaded = build_models(args, world, device)  # the models plan.run_models decided
    start = checkpoints.load_checkpoint(run_dir, loaded.policy, loaded.optimizer) if args.resume else 0
    if args.resume:
        say(f"resumed from step {start}")
    engines = build_engines(loaded, args, device, sizes)
    instances = steps.training_set(args, engines, say)
    if rank == 0:
        steps.open_run(run_dir, args, start, sys.modules[__name__])
    log, history, skipped = loggers.Loggers(args, run_dir, start, rank), [], 0
    for step in range(start + 1, args.steps + 1):
        t0, times = time.perf_counter(), dict(judge_s=0.0, probe_s=0.0)
        mine = step_instances(instances, args, step, rank, world)  # this rank's groups
        seed = args.seed * 1000003 + step * 1009  # not the rank: records are rank-free
        with tqdm(total=len(mine) * args.group_size, desc=f"step {step} rollout",
                  disable=rank != 0, leave=False) as bar:  # 1. rollout, b_0..b_T read by the probes
            played = rollout.rollout_episodes(engines.persuader, engines.persuadee, mine, args.t_max, seed=seed,
                                              progress=bar, timings=times, **rollout_options(args))
        played = rollout.judge_episodes(engines.judge, mine, played, seed, args.group_size, times)  # 2. s
        records, left_out, why = steps.playable(played, args.group_size)  # whole groups only
        if why:
            say(f"left out {left_out['left_out']} episodes (their groups) of this step: {why}")
        times["rollout_s"] = time.perf_counter() - t0 - times["judge_s"]
        t1 = time.perf_counter()
        rewards = rpo.rewards(records, args.group_size, args.anchor)  # 3. R and r_t, per group
        turn_advantages = rpo.advantages(rewards, args.lam)  # 4. A_{i,t}
        batch, batch_advantages = steps.silenced(played, records, turn_advantages)  # every rank alike
        update = steps.mini_batch_updates(batch, batch_advantages, args.updates_per_batch, lambda *mini:  # 5. updates
            policy_update(loaded.policy, loaded.reference, loaded.optimizer, *mini, args, device, world))
        refresh(loaded, engines)  # 6. the rollout copy takes the updated weights
        times["update_s"], times["step_s"] = time.perf_counter() - t1, time.perf_counter() - t0
        metrics = steps.step_metrics(step, records, rewards, update, times, args, device)
        metrics.update({k: ranks.all_sum(v, device) for k, v in left_out.items()})
        rows = steps.step_records(step, records, args.group_size, args, rank, world)
        history.append(metrics)
        if rank == 0:
            steps.write_step(run_dir, step, metrics, rows, records, args, log)
        skipped = steps.stop_if_diverged(skipped, step, metrics, MAX_SKIPPED_STEPS)
        evaluated = bool(args.eval_every) and step % args.eval_every == 0
        if evaluated:
            log.scalars(step, evaluate_heldout(engines.persuader, engines.persuadee,
                                             engines.judge, args, step, rank, run_dir),
                        "heldout/")
        if step % args.save_every == 0 or step == args.steps or evaluated:
            checkpoints.save_checkpoint(run_dir, step, loaded.policy, loaded.optimizer, loaded.tokenizer, rank)
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
