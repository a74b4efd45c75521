"""
steps.py: what train.py does around the method's step, kept out of the reader's way: start-up
(the memory and disk plans and banner, served roles, the playable training set), the run
folder's records (config.json, metrics.jsonl, rollouts.jsonl, samples-STEP.json, evals.jsonl),
the step's metrics and diagnostics (pooled over ranks: counts and sums are all-reduced before
each division), the zero-advantage skip and the stop after MAX_SKIPPED_STEPS non-finite steps,
and where the update's forwards run (compute_context, shares_prompts, checkpoint_activations).

    python train.py --preset tiny      # every line it prints but the loop's comes from here
"""
import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from persuarena import arena
from persuarena import engine
from persuarena import layers
from persuarena import rollout
from persuarena import rpo
from lab import cli, jsonl, plan, presets, ranks, runs, served

SAMPLE_DIALOGUES = 2                # episodes a step kept in samples-STEP.json and the loggers' table

# -----------------------------------------------------------------------------
# start-up


def served_roles(args):
    """(persuadee, judge) served over the OpenAI API, each checked to answer, else None."""
    key = dict(allow_insecure_key=args.allow_insecure_key)  # --allow-insecure-key
    persuadee = served.ServedModel(args.persuadee, **key) if served.is_served(args.persuadee) else None
    judge = (served.ServedModel(args.judge, **key) if served.is_served(args.judge) else
             persuadee if args.judge is None else None)  # default: the persuadee
    for model in {id(s): s for s in (persuadee, judge) if s}.values():
        model.check()  # a wrong URL or key is a one-line exit before any model loads
    return persuadee, judge


def plan_run(args, world, device, say):
    """The memory and disk plans (printed; what cannot fit is refused before any model loads)
    and the run's banner; returns the engines' pool sizes (a CPU keeps the engine's defaults)."""
    rank_plan = plan.device_plan(args, world, device)
    for line in plan.plan_lines(rank_plan):
        say(line)
    if refusal := plan.plan_refusal(rank_plan):
        sys.exit(refusal)
    disk, run_dir = plan.disk_plan(args), Path(args.out) / args.name
    for line in plan.disk_lines(disk, run_dir):
        say(line)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if refusal := ranks.agree(plan.disk_refusal(disk, run_dir) if rank == 0 else None):
        sys.exit(refusal)  # only rank 0 writes checkpoints
    for line in presets.preset_notes(args):  # what the preset sets over the owning constants
        say(line)
    if args.preset == "cpu" and not torch.cuda.is_available():
        say(f"no CUDA device: cpu preset ({args.persuader} as persuader and persuadee, judge "
            f"{args.judge or args.persuadee})")
    for line in small_persuadee_note(args):
        say(line)
    say(f"run {Path(args.out) / args.name}  preset {args.preset}  ranks {world}  lambda {args.lam}  "
        f"anchor {args.anchor}  G {args.group_size}  instances/step {args.instances}  "
        f"updates/step {args.updates_per_batch}  kl-beta {args.kl_beta}")
    if refusal := plan.ranks_refusal(args, world):
        sys.exit(refusal)
    return rank_plan["sizes"] if device.type == "cuda" else {}


def small_persuadee_note(args):
    """Said once at the start of a run whose persuadee writes no decision tag (SmolLM2-135M):
    why the outcome columns stay still and what to run next."""
    if args.decision != "tag" or "smollm2" not in str(args.persuadee).lower():
        return []
    run = Path(args.out) / args.name
    return [f"note: {args.persuadee} writes no decision tag, so every episode ends undecided: "
            "expect 'reward +0.000 accept 0% dead 100%' on every step. Only the dense belief term "
            f"(lambda {args.lam} x sum r_t) moves the persuader: watch belief_change. Next: "
            f"`python eval.py --plot-run {run}` (the curves), `python eval.py --persuader "
            f"{run}/checkpoint-{args.steps} --limit 4` (held-out), or --decision logit "
            "(the decision read from the persuadee's logits; DECISIONS.md: Logit decision)"]


def training_set(args, engines, say):
    """The training instances, less those whose prompts fit no context (named once, up front)."""
    instances = arena.training_instances(arena.load_scenarios(args.scenarios, split="train"))
    problems = rollout.prompt_problems(engines.persuader, engines.persuadee, instances,
                                       args.max_new_tokens)
    if problems:
        say(f"skipping {len(problems)} training instances that do not fit a context, e.g. "
            f"{next(iter(problems.values()))}")
    args.skipped_instances = len(problems)
    return [inst for inst in instances if inst["id"] not in problems]


def open_run(run_dir, args, start, own=None):
    """Rank 0, the models loaded: an --overwrite'n folder emptied, config.json recorded, the
    JSONL records cut back to the checkpoint's step."""
    if args.overwrite:
        runs.clear(run_dir)
    cli.record_config(run_dir, args, start, own)
    resume_metrics(run_dir / "metrics.jsonl", start)
    resume_metrics(run_dir / "rollouts.jsonl", start)

# -----------------------------------------------------------------------------
# the step's batch: whole groups only, every rank the same micro-batches


def playable(episodes, group_size):
    """(the groups whose every episode was played, counts of those left out, why each was): an
    episode that never started (it cannot fit the empty pools: no belief, no token of its own)
    or whose served model failed for good ("api_error") takes its whole group out of the step's
    metrics and loss (a group's baseline needs all of its members)."""
    why = {i: "never started: it does not fit the empty KV pools alone" if not e.beliefs
           else "its served model kept failing" for i, e in enumerate(episodes)
           if not e.beliefs or e.end_reason == arena.API_ERROR}
    kept = [e for g in range(0, len(episodes), group_size) for e in episodes[g:g + group_size]
            if not any(i in why for i in range(g, g + group_size))]
    said = "; ".join(f"{episodes[i].id} member {i % group_size} {w}" for i, w in why.items())
    return kept, dict(never_started=sum(not e.beliefs for e in episodes),
                      api_errors=sum(e.end_reason == arena.API_ERROR for e in episodes),
                      left_out=len(episodes) - len(kept)), said


def silenced(played, kept, turn_advantages):
    """Every played episode for the update, in its place, those left out (playable) with no
    persuader token and no advantage: each rank then runs the same micro-batches (FSDP's
    collectives), and the left-out ones add nothing to the loss or its token count."""
    kept_ids = {id(e) for e in kept}
    advantage = iter(turn_advantages)
    episodes, per_episode = [], []
    for e in played:
        if id(e) in kept_ids:
            episodes.append(e)
            per_episode.append(next(advantage))
        else:
            ids = e.ids or [0]  # one inert token for an episode that never started
            episodes.append(rollout.Episode(id=e.id, ids=ids, turn_ids=[0] * len(ids),
                                            logprobs=[0.0] * len(ids)))
            per_episode.append([])
    return episodes, per_episode



def mini_batch_updates(records, turn_advantages, updates, update):
    """The step's `updates` optimizer steps: update(records, turn_advantages) (train.policy_update)
    on each mini-batch of this rank's episodes in turn (rpo.mini_batches, the same split on every
    rank), each against the rollout's log-probs; a step that finds a non-finite value ends the
    batch's updates (those before it stand). Returns their stats merged (merged_updates)."""
    done = []
    for part in rpo.mini_batches(len(records), updates):
        done.append(update(records[part], turn_advantages[part]))
        if done[-1]["step_skipped"]:
            break
    return merged_updates(done)


def merged_updates(done):
    """One step's stats from its updates' (each already pooled over ranks): loss, kl, clip_frac
    and ratio_mean as means over every update's tokens (None where no update measured them: a
    zero-advantage update), grad_norm the largest (a step counts as clipped if any update was),
    persuader_tokens the batch's, zero_gradient the updates that skipped their passes, updates
    the AdamW steps taken (a non-finite one and those after it not), step_skipped and nonfinite
    as the last update left them."""
    tokens = [u["persuader_tokens"] for u in done]
    merged = dict(persuader_tokens=sum(tokens), grad_norm=max(u["grad_norm"] for u in done),
                  zero_gradient=sum(u["zero_gradient"] for u in done),
                  step_skipped=done[-1]["step_skipped"], nonfinite=done[-1]["nonfinite"],
                  updates=len(done) - done[-1]["step_skipped"])
    for key in ("loss", "kl", "clip_frac", "ratio_mean"):
        measured = [(u[key], n) for u, n in zip(done, tokens) if u[key] is not None]
        weight = sum(n for _, n in measured)
        merged[key] = (sum(v * n for v, n in measured) / weight if weight else
                       measured[0][0] if measured else None)
    return merged


def checkpoint_activations(policy):
    """Activation (gradient) checkpointing on, by transformers' newer name where it has one."""
    (getattr(policy, "activation_checkpointing_enable", None) or policy.gradient_checkpointing_enable)()


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


def kept_logits(model, ids, keep, rows=None, share_stem=False):
    """model(ids).logits at the positions keep; with rows ([B, K] indices into keep), each row's
    own K of them (row_logits): [B, K, V]. With share_stem, the prefix every row shares (a
    group's persuader prompt, up to the first kept position) runs once, and its keys and values,
    autograd graph included, are repeated for the rows, which run only what follows: the same
    logits and gradients for fewer FLOPs (DECISIONS.md: Shared prompt in the update). A model
    that returns no cache for the stem gets the plain forward instead."""
    share_stem = share_stem and len(ids) > 1 and len(keep) > 0  # (no kept position: no stem)
    stem = min(engine.shared_stem(ids.tolist()), int(keep[0])) if share_stem else 0
    out = model(ids[:1, :stem], use_cache=True, logits_to_keep=1) if stem else {}
    name = "cache" if "cache" in out else "past_key_values"  # transformers' newer name, its older
    with row_logits(model, rows):
        if out.get(name) is None:  # no stem, or no cache back (transformers 5.17: train mode
            return model(ids, use_cache=False, logits_to_keep=keep).logits  # with checkpointing)
        out[name].batch_repeat_interleave(len(ids))
        return model(ids[:, stem:], use_cache=True, logits_to_keep=keep - stem,
                     **{name: out[name]}).logits


def row_logits(model, rows):
    """Within it, the model's output layer takes of the hidden states at the kept positions
    [B, U, h] only each row's own, rows [B, K] (indices into U): the logits are [B, K, V], not
    the union's [B, U, V] (rows of different reply lengths keep different positions; lab/plan.py
    counts K). rows None: the union as it is."""
    import contextlib
    if rows is None:
        return contextlib.nullcontext()
    take = lambda module, args: (args[0].gather(1, rows[..., None].expand(-1, -1, args[0].shape[-1])),
                                 *args[1:])
    return model.get_output_embeddings().register_forward_pre_hook(take)  # removed on exit

# -----------------------------------------------------------------------------
# the zero-advantage skip and the divergence stop


def at_reference(optimizer, args, device, weight_decay):
    """True while the policy cannot have left its initial weights (the KL reference): lr 0, or no
    weight decay and every AdamW first moment still exactly 0 (no nonzero gradient ever, this
    run or before its checkpoint)."""
    if args.lr == 0:
        return True
    moments = sum(int(getattr(st["exp_avg"], "_local_tensor", st["exp_avg"]).count_nonzero())
                  for st in optimizer.state.values() if "exp_avg" in st)
    return weight_decay == 0 and ranks.all_sum(moments, device) == 0


def zero_advantage_step(policy, optimizer, turn_advantages, args, device, weight_decay):
    """A step whose every advantage is exactly 0 (a lambda = 0 step whose groups are all dead) has
    a zero gradient when its KL term has none (no KL term, or the policy still at the reference):
    its forward and backward passes are skipped, and the optimizer still steps on zero gradients
    (AdamW's moments decay as they would). Returns the update's stats (ratio_mean and clip_frac
    unmeasured: None), or None when some advantage (on any rank) or the KL gradient is not 0."""
    nonzero = ranks.all_sum(sum(a != 0 for ep in turn_advantages for a in ep), device)
    if nonzero or (args.kl_beta != 0 and not at_reference(optimizer, args, device, weight_decay)):
        return None
    for p in policy.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return dict(loss=0.0, kl=0.0, clip_frac=None, ratio_mean=None, grad_norm=0.0,
                persuader_tokens=None, step_skipped=0, nonfinite=[], zero_gradient=1)


def stop_if_diverged(skipped, step, m, limit):
    """Consecutive skipped (non-finite) steps; limit of them (train.MAX_SKIPPED_STEPS) end the run."""
    skipped = skipped + 1 if m["step_skipped"] else 0
    if skipped >= limit:
        sys.exit(f"train.py: {skipped} steps in a row (steps {step - skipped + 1}-{step}) were "
                 f"skipped as non-finite ({', '.join(m['nonfinite'])}): the run has gone wrong "
                 f"and stops; the weights updated at step {step - skipped} are suspect: resume "
                 f"from a checkpoint saved before it, or start again with a lower --lr")
    return skipped

# -----------------------------------------------------------------------------
# the step's records: metrics.jsonl, rollouts.jsonl, samples, evals.jsonl


def step_metrics(step, records, groups, update, times, args, device):
    """One metrics line: rewards, outcome shares, belief change, rpo diagnostics, timings."""
    episodes = ranks.all_sum(len(records), device)
    n = max(episodes, 1)  # every group of a step may have been left out (playable)
    total = lambda values: ranks.all_sum(sum(values), device)
    m = dict(step=step, episodes=episodes)
    m["reward_mean"] = total(sum(g[0]) for g in groups) / n
    for o in arena.OUTCOMES:
        m[f"outcome_{o}"] = total(r.outcome == o for r in records) / n
    read = [r for r in records if None not in r.beliefs]  # rpo counts the rest
    m["belief_change"] = total(r.beliefs[-1] - r.beliefs[0] for r in read) / max(
        ranks.all_sum(len(read), device), 1)
    m["turns_mean"] = total(r.turns for r in records) / n
    m["judge_mean"] = total(r.judge for r in records) / n
    # the share of transcripts whose strategy score fell back to s = 0 (DECISIONS.md: Judge retries)
    m["judge_failed_share"] = None if args.judge == "none" else total(
        bool(r.judge_failed) for r in records) / n
    # pooled: every rank's counts and sums are added before the division (rpo.diagnostics)
    sums = rpo.diagnostic_sums(groups, args.lam)
    m.update(rpo.diagnostics({k: ranks.all_sum(v, device) for k, v in sums.items()}))
    negative, turns = (ranks.all_sum(v, device) for v in rpo.negative_process_counts(rpo.numeric(r.beliefs) for r in records))
    m["negative_process_share"] = negative / turns if turns else 0.0
    collapsed, counted = (ranks.all_sum(v, device) for v in rpo.collapsed_groups(records, args.group_size))
    m["collapsed_group_share"] = collapsed / counted if counted else 0.0  # identical messages
    m.update(update)
    m.update(ranks.mean_timings(times, device))  # the same keys, in one order, on every rank
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
        beliefs = r.beliefs
        dense = rpo.dense_return(rpo.numeric(beliefs), r.outcome, args.anchor)
        rows.append(dict(step=step, instance=r.id, group=local * world + rank, member=member,
                         outcome=r.outcome, goal=rpo.GOAL[r.outcome], judge=r.judge,
                         judge_failed=bool(r.judge_failed), b_0=beliefs[0] if beliefs else None,
                         b_T=beliefs[-1] if beliefs else None, beliefs=beliefs,
                         dense_return=dense if math.isfinite(dense) else None, turns=r.turns))
    if world > 1:
        shards = [None] * world
        dist.all_gather_object(shards, rows)
        rows = [row for shard in shards for row in shard]
    return sorted(rows, key=lambda row: (row["group"], row["member"])) if rank == 0 else []


def sample_rows(records):
    """[id, outcome, turns, beliefs, transcript] of the first SAMPLE_DIALOGUES episodes."""
    rows = []
    for r in records[:SAMPLE_DIALOGUES]:
        beliefs = " ".join("-" if b is None else f"{b:+.2f}" for b in r.beliefs)
        transcript = "\n".join(f"{turn['role']}: {turn['text']}" for turn in r.transcript)
        rows.append([r.id, r.outcome, r.turns, beliefs, transcript])
    return rows


def resume_metrics(path, start):
    """Keep the lines of a run's JSONL record (metrics.jsonl, rollouts.jsonl) of steps <= start
    (later steps are redone), rewritten atomically; a bad last line is dropped with a warning
    (jsonl.read_jsonl), an earlier one refused."""
    try:
        rows = jsonl.read_jsonl(path) if path.exists() else []
    except ValueError as e:
        raise SystemExit(f"train.py: {e} (or the file) and rerun with --resume") from None
    runs.write_atomic(path, "".join(jsonl.json_line(row) for _, row in rows if row["step"] <= start),
                      who="train.py", kept=f"{path} is as it was")


def write_step(run_dir, step, metrics, rows, records, args, log):
    """Rank 0: the step's line of metrics.jsonl and rows of rollouts.jsonl, its samples (every
    --save-every steps and the first), what stdout and the loggers show of it."""
    try:
        runs.append_line(run_dir / "metrics.jsonl", jsonl.json_line(metrics))
        runs.append_line(run_dir / "rollouts.jsonl", "".join(map(jsonl.json_line, rows)))
    except OSError as e:
        raise SystemExit(runs.write_failure("train.py", "metrics.jsonl", run_dir, e,
                                            "the last checkpoint is intact",
                                            resumable=(run_dir / "latest").is_file())) from None
    m = metrics
    if m["step_skipped"]:  # the updates before the non-finite one stand
        kept = (f"its {m['updates']} update(s) before it stand" if m["updates"]
                else "weights and optimizer unchanged")
        log.say(f"step {step}: skipped, non-finite {m['nonfinite']} ({kept})")
    clip = "-" if m["clip_frac"] is None else f"{m['clip_frac']:.1%}"  # None: no update measured it
    kl = f"{m['kl']:.4f}" if args.kl_beta else "off"  # beta 0: no reference forward, unmeasured
    log.say(f"step {step}: reward {m['reward_mean']:+.3f}  accept "
            f"{m['outcome_ACCEPT']:.0%}  belief change {m['belief_change']:+.3f}  loss "
            f"{m['loss']:+.4f}  kl {kl}  clip {clip}  dead {m['dead_group_share']:.0%}  "
            f"{m['step_s']:.1f}s (rollout {m['rollout_s']:.1f}, probes {m['probe_s']:.1f}, "
            f"judge {m['judge_s']:.1f}, update {m['update_s']:.1f})")
    log.scalars(step, m, "train/")
    if step % args.save_every == 0 or step == 1:
        runs.write_atomic(run_dir / f"samples-{step}.json", json.dumps(jsonl.finite(
            [dict(id=r.id, outcome=r.outcome, transcript=r.transcript, beliefs=r.beliefs)
             for r in records[:SAMPLE_DIALOGUES]]), indent=1, allow_nan=False),
            who="train.py", kept="the last checkpoint is intact")
        log.samples(step, sample_rows(records))


def record_evaluation(path, step, summary):
    """evals.jsonl with the summaries of the steps before this one (a resumed run redoes later
    ones; a line that is no evaluation summary is dropped with a warning) and this step's."""
    kept = []
    for lineno, row in jsonl.read_jsonl(path, skip_bad=True) if path.exists() else []:
        if not (isinstance(row, dict) and isinstance(row.get("step"), int)):
            print(f"warning: dropping line {lineno} of {path}, not an evaluation summary",
                  file=sys.stderr)
        elif row["step"] < step:
            kept.append(row)
    runs.write_atomic(path, "".join(map(jsonl.json_line, kept + [{"step": step, **summary}])),
                      who="train.py", kept=f"{path} is as it was")
