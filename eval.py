"""
Evaluate persuaders on PersuArena: play the held-out scenarios, save the episodes, and the command
line over the analyses (analyses.py) and figures (plots.py).

An evaluation run plays one seeded episode per held-out scenario (T_max 10) through rollout.py's
one loop, whatever plays each role (a local model, openai:MODEL@URL, or you with --play), and
writes evals/<name>/episodes.jsonl (appended as each episode ends: --resume plays only the
missing ones, with every setting pinned in settings.json), summary.json (with each role's model,
dtype and sampling), fidelity.json, beliefs.png, probes.png and moves.png.
What summary.json holds is described in analyses.py. Moves and manipulation labels come from
moves.py (keyword tagger by default, --tagger logit reads the judge model).

    python eval.py --limit 4                                    # quick run, SmolLM2 on both sides
    python eval.py --persuader PATH --name NAME                 # a trained policy or any HF chat model
    python eval.py --subset balanced60                          # 3 scenarios per domain x resistance cell
    python eval.py --scenarios train --limit 20                 # training scenarios as written
    python eval.py --persuader A --persuader B --persuadee C --persuadee D --judge J   # Fig. 4 grid, one judge
    python eval.py --analyze evals/NAME                         # summary.json and plots from episodes.jsonl
    python eval.py --case evals/NAME heldout-017                # Table 8: one episode turn by turn
    python eval.py --persuader openai:MODEL@URL --name NAME     # a model served over the OpenAI API
    python eval.py --name NAME --resume                         # finish an interrupted evaluation
    python eval.py --compare evals/A evals/B                    # paired comparison, B against A
    python eval.py --compare-many evals/B1 evals/B2 --policy evals/P   # discordant pairs, closed by none
    python eval.py --overlay evals/A evals/B                    # Fig. 6: belief and per-probe trajectories
    python eval.py --runs runs/A runs/B                         # Table 9, Fig. 3, Fig. 7: checkpoint selection
    python eval.py --table evals/A evals/B --reference evals/A --format latex   # the main table
    python eval.py --plot-run runs/NAME                         # training curves -> curves.png
    python eval.py --play heldout-017                           # you are the persuader, in the terminal
"""

import argparse
import json
import os
import re
import sys
from collections import defaultdict
from pathlib import Path

from lab import analyses
import arena
from lab import moves
from lab import plots
import probes
from lab import records
import rpo
from lab import runs
from lab import served

TRAINING_KEYS = records.TRAINING_FIELDS  # rollout's token stream, of no use once scored
RUN_KEYS = ("roles", "settings", "requests")  # summary.json's record of how the run was played
EVALS_DIR = "evals"
DEFAULT_MODEL = "smollm2"
SAME_AS_PERSUADEE = "persuadee"  # the judge by default (the paper's frozen judge): the persuadee's model, fresh context
FIDELITY_SAMPLES = 24  # read-outs, spread over every turn, whose fork is checked against a full forward
CPU_MAX_NEW_TOKENS = 64  # per message on a CPU, so that --limit 4 takes minutes
CPU_SAMPLING_MODELS = (DEFAULT_MODEL,)  # persuaders whose default --sampling is "cpu" (DECISIONS.md: CPU sampling preset)
SAMPLING_FLAGS = ("sampling", "persuader_temperature", "persuadee_temperature", "persuadee_top_p",
                  "persuadee_top_k")  # runs.add_sampling_flags: a training run's, by default
SUBSETS = {"balanced60": 3}  # named subsets: scenarios kept per domain x resistance cell, file order

# -----------------------------------------------------------------------------
# IO


def save_run(out_dir, episodes, summary, fidelity=None):
    """Write episodes.jsonl, summary.json, fidelity.json (the fork and reference read-outs, when
    given), beliefs.png, probes.png and moves.png (when labelled), each atomically."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs.write_atomic(out_dir / "episodes.jsonl", "".join(map(runs.json_line, episodes)))
    if fidelity is not None:
        runs.write_atomic(out_dir / "fidelity.json", json.dumps(fidelity) + "\n")
    runs.write_atomic(out_dir / "summary.json", json.dumps(runs.finite(summary), indent=2, allow_nan=False) + "\n")
    save_plots(out_dir, episodes, summary)


def save_plots(out_dir, episodes, summary):
    """beliefs.png and probes.png (when some episode has beliefs), moves.png (when labelled)."""
    believed = analyses.with_beliefs(episodes)
    if believed:  # a persuadee served without log-probs has no belief to plot
        plots.plot_beliefs(believed, out_dir / "beliefs.png")
        plots.plot_probes(believed, out_dir / "probes.png")
    if "moves" in summary:
        plots.plot_moves(summary, out_dir / "moves.png")


def scenarios_by_id(path=arena.SCENARIOS_PATH):
    """Every scenario of a scenarios file by id (the hidden profiles the keyword tagger audits)."""
    return {s["id"]: s for s in arena.load_scenarios(path)}


def analyze(run_dir, shaping_lambda=None):
    """Recompute summary.json and the plots of any eval folder the project wrote (an evaluation,
    a training run's eval-STEP, a --play session, a served run) from its episodes.jsonl (and
    fidelity.json) alone, with no model. Episodes stored without labels are tagged in memory by
    the keyword tagger, against the scenarios of their training run when the folder is an
    eval-STEP of one; episodes without beliefs or of unknown scenarios lose only those columns.
    The shaping returns are at shaping_lambda, by default the folder's own (folder_lambda).
    Returns the summary."""
    run_dir = Path(run_dir)
    if not (run_dir / "episodes.jsonl").is_file() and (run_dir / "metrics.jsonl").is_file():
        raise ValueError(f"{run_dir} is a training run (metrics.jsonl, no episodes.jsonl); pass one of its "
                         "eval-STEP folders, or read it with --runs or --plot-run")
    episodes = records.load_episodes(run_dir)
    untagged = [ep for ep in episodes if "moves" not in ep]
    if untagged:
        config = run_dir.parent / "config.json"
        path = (json.loads(config.read_text()).get("scenarios") if config.is_file() else None) or arena.SCENARIOS_PATH
        scenarios = scenarios_by_id(path)
        unknown = sorted({ep["scenario_id"] for ep in untagged} - set(scenarios))
        if unknown:
            print(f"eval.py: warning: {run_dir}: scenarios {', '.join(unknown[:3])}"
                  f"{', ...' if len(unknown) > 3 else ''} are not in {path}; no move labels", file=sys.stderr)
        else:
            moves.tag_episodes(untagged, scenarios)
    path = run_dir / "fidelity.json"
    fidelity = json.loads(path.read_text()) if path.is_file() else None
    lam = folder_lambda(run_dir) if shaping_lambda is None else shaping_lambda
    summary = analyses.summarize_run(episodes, fidelity, lam)
    path = run_dir / "summary.json"
    if path.is_file():  # what the run recorded of itself, which its episodes do not hold
        before = json.loads(path.read_text())
        summary.update({k: before[k] for k in RUN_KEYS if k in before})
    runs.write_atomic(path, json.dumps(runs.finite(summary), indent=2, allow_nan=False) + "\n")
    save_plots(run_dir, episodes, summary)
    return summary


def balanced_subset(instances, per_cell):
    """The first per_cell instances of every domain x resistance cell, in file order."""
    kept, seen = [], defaultdict(int)
    for inst in instances:
        cell = (inst["domain"], inst["hidden"]["resistance"])
        if seen[cell] < per_cell:
            seen[cell] += 1
            kept.append(inst)
    short = [f"{d}/{r}" for d in arena.DOMAINS for r in arena.RESISTANCE_TYPES if seen[(d, r)] < per_cell]
    if short:
        raise ValueError(f"the subset needs {per_cell} scenarios in every domain x resistance cell; "
                         f"too few in {', '.join(short)}")
    return kept

# -----------------------------------------------------------------------------
# model-driven modes (rollout imports the model side, so it loads only here)


def _slug(name):
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name.strip("/"))  # whole path: checkpoints share leaf names


def _instances(split):
    """Held-out or training scenarios as written, one instance each (variant 0)."""
    try:
        if split == "heldout":
            return arena.heldout_instances()
        return [{**s, "scenario_id": s["id"], "variant": 0} for s in arena.load_scenarios(split="train")]
    except (OSError, ValueError) as e:
        sys.exit(f"eval.py: cannot load the {split} scenarios: {e}")


def fidelity_sample(episodes, n):
    """n read-outs (episode index, t) spread evenly over every read-out t = 0..T of every episode
    with beliefs, so that the check covers every stage of a conversation (DECISIONS.md:
    Probe fidelity sample)."""
    every = [(i, t) for i, ep in enumerate(episodes) if analyses.with_beliefs([ep])
             for t in range(len(ep["probes"]))]
    if len(every) <= n:
        return every
    return [every[round(k * (len(every) - 1) / (n - 1))] for k in range(n)] if n > 1 else every[:1]


def fidelity_contexts(tokenizer, instances, episodes, sample):
    """The persuadee's context at each sampled read-out (after t replies), for the probe fidelity
    check. Built from the transcript text: a measurement of fork against reference on identical
    ids, not a conversation that continues."""
    import models
    by_id = {inst["id"]: inst for inst in instances}
    contexts = []
    for i, t in sample:
        ep = episodes[i]
        messages = arena.persuadee_messages(by_id[ep["id"]])
        for m in ep["transcript"][:2 * t]:
            role = "user" if m["role"] == "persuader" else "assistant"
            messages.append({"role": role, "content": m["text"]})
        contexts.append(models.chat_ids(tokenizer, messages, False))
    return contexts


def default_dtype():
    """As train.py's presets: bfloat16 with CUDA, float32 on a CPU (DECISIONS.md: Precision)."""
    import torch
    return "bfloat16" if torch.cuda.is_available() else "float32"


def distributed():
    """(rank, world): under torchrun the held-out scenarios are sharded over the ranks (the
    process group started by runs.setup_distributed when the caller has not); else (0, 1)."""
    return runs.setup_distributed()[:2]

# -----------------------------------------------------------------------------
# resumable episodes.jsonl: every evaluation appends each episode as it ends


def read_played(path):
    """Records already in an episodes.jsonl, by id. A bad last line (cut off by a kill) is
    dropped with a warning and from the file (runs.read_jsonl); an id written twice is an error."""
    path = Path(path)
    if not path.exists():
        return {}
    played = {}
    for lineno, record in runs.read_jsonl(path, repair=True):
        if not isinstance(record, dict) or "id" not in record:
            raise ValueError(f"{path}, line {lineno} is no episode record; delete that line to "
                             "play its episode again")
        if record["id"] in played:
            raise ValueError(f"{path}, line {lineno} repeats episode {record['id']}; delete one of them")
        played[record["id"]] = record
    return played


def append_record(path, record):
    """One finished episode, flushed to disk before the next ends."""
    runs.append_line(path, runs.json_line(record), sync=True)


def part_paths(out_dir):
    """episodes.jsonl, and under torchrun each rank's part of it (merged by rank 0 at the end)."""
    out_dir = Path(out_dir)
    return [out_dir / "episodes.jsonl"] + sorted(out_dir.glob("episodes.rank*.jsonl"))


def play_resumable(persuader, persuadee, instances, path, *, t_max, judge=None, seed=0,
                   stamp=None, played=None, **rollout_kw):
    """rollout.rollout_episodes over the instances not yet in `played` (read from path unless
    given), each record appended to path (an episodes.jsonl) as its episode ends, without the
    training stream and with `stamp` (the run's settings) added; the judge scores them at the end
    with those resumed unscored (judge None). Returns the records of all instances, in order."""
    import rollout
    played = read_played(path) if played is None else played
    stamp = stamp or {}

    def clean(r):
        return {**{k: v for k, v in r.items() if k not in TRAINING_KEYS}, **stamp}
    todo = [inst for inst in instances if inst["id"] not in played]
    for r in rollout.rollout_episodes(persuader, persuadee, todo, t_max, judge=judge, seed=seed,
                                      on_record=lambda r: append_record(path, clean(r)),
                                      **rollout_kw):
        played[r["id"]] = clean(r)
    pending = [inst for inst in instances if played[inst["id"]]["judge"] is None]
    if pending:  # killed before the judge scored them
        scores, failed = rollout.judge_all(judge, pending,
                                           [played[i["id"]]["transcript"] for i in pending],
                                           seed, [0] * len(pending))
        for inst, score, fail in zip(pending, scores, failed):
            played[inst["id"]].update(judge=score, judge_failed=fail)
    return [played[inst["id"]] for inst in instances]


def settings_mismatch(out_dir, settings):
    """The settings (and pinned constants, runs.changed_constants) that differ from those
    out_dir's evaluation was run with, named."""
    path = Path(out_dir) / "settings.json"
    if not path.exists():
        return []
    before = json.loads(path.read_text())
    return runs.changed_constants(before) + [
        f"{k} {before.get(k)!r} there, {settings.get(k)!r} now"
        for k in sorted(set(before) | set(settings)) if k != "constants" and before.get(k) != settings.get(k)]


def evaluate(persuader, persuadee, instances, out_dir, *, t_max=arena.T_MAX_EVAL, seed=0,
             names=("", ""), fidelity=FIDELITY_SAMPLES, max_new_tokens=None,
             judge=SAME_AS_PERSUADEE, anchor=rpo.ANCHOR, tagger="keyword", sampling=None,
             probe_space=None, probe_signs=None, settings=None, resume=False, rank=0, world=1,
             shaping_lambda=rpo.LAMBDA):
    """One seeded episode per instance through rollout.py's loop (each role an engine.Engine, a
    served.ServedModel or a side); saves the run, returns its summary.

    The strategy judge is an Engine or ServedModel, by default the persuadee's (the paper's
    frozen judge), or None (s = 0); the logit tagger reads it (a local one). `sampling` is the
    (persuader, persuadee) engine.Sampling (default rollout.SAMPLING["paper"]; a training run
    passes its own flags', rollout.role_sampling). `anchor` is the reward setting the dense
    returns are computed under, `shaping_lambda` the lambda of the summary's shaping returns (a
    training run's own). Every episode is appended to out_dir/episodes.jsonl as it ends (under
    torchrun to this rank's part); with `resume`, those already there are not played again, else
    the folder's episodes are discarded first. `settings` (what changes the results) go to
    settings.json and into the summary. Under torchrun (world > 1) each rank plays
    instances[rank::world] and rank 0 gathers, tags, summarises and saves (other ranks return
    None); an episode's record does not depend on its rank (rollout's keyed random streams), so
    the summary equals one process's."""
    import engine
    import rollout
    out_dir = Path(out_dir)
    judge = persuadee if judge == SAME_AS_PERSUADEE else judge
    persuader_sampling, persuadee_sampling = sampling or rollout.SAMPLING["paper"]
    played = _played_so_far(out_dir, resume, rank, world)
    if rank == 0 and settings is not None:
        runs.write_atomic(out_dir / "settings.json", json.dumps(settings, indent=2) + "\n")
    mine = instances[rank::world]
    if done := sum(inst["id"] in played for inst in mine):
        print(f"resuming {out_dir}: {done} of {len(mine)} episodes already played",
              file=sys.stderr)
    stamp = dict(persuader=names[0], persuadee=names[1], seed=seed, anchor=anchor,
                 probe_space=probe_space or probes.PROBE_SPACE,
                 probe_signs=probe_signs or probes.PROBE_SIGNS)
    path = out_dir / ("episodes.jsonl" if world == 1 else f"episodes.rank{rank}.jsonl")
    episodes = play_resumable(persuader, persuadee, mine, path, t_max=t_max, judge=judge,
                              seed=seed, stamp=stamp, played=played,
                              max_new_tokens=max_new_tokens or engine.MAX_NEW_TOKENS,
                              persuader_sampling=persuader_sampling,
                              persuadee_sampling=persuadee_sampling,
                              probe_space=probe_space, probe_signs=probe_signs)
    episodes = _gathered(episodes, instances, world)
    if rank:
        return None
    local_judge = judge if isinstance(judge, engine.Engine) else None
    local_persuadee = persuadee if isinstance(persuadee, engine.Engine) else None
    moves.tag_episodes(episodes, {inst.get("scenario_id", inst["id"]): inst for inst in instances},
                       tagger, local_judge or local_persuadee)
    roles = _roles(names, (persuader, persuadee, judge), (persuader_sampling, persuadee_sampling))
    summary = _finish(episodes, local_persuadee, instances, out_dir, fidelity,
                      dict(roles=roles, settings=settings or {}), probe_space, probe_signs,
                      shaping_lambda)
    for path in part_paths(out_dir)[1:]:
        path.unlink()  # merged into episodes.jsonl by save_run
    return summary


def _played_so_far(out_dir, resume, rank, world):
    """The episodes out_dir already holds (every rank's part) when resuming; else none, the
    folder's parts removed by rank 0 before any rank reads them."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if not resume and rank == 0:
        for path in part_paths(out_dir):
            path.unlink(missing_ok=True)
    if world > 1:
        import torch.distributed as dist
        dist.barrier()  # rank 0 has cleared the folder before any rank reads it
    return {} if not resume else {k: v for path in part_paths(out_dir)
                                  for k, v in read_played(path).items()}


def _gathered(episodes, instances, world):
    """Every rank's episodes, in the instances' order (under torchrun), else these."""
    if world == 1:
        return episodes
    import torch.distributed as dist
    shards = [None] * world
    dist.all_gather_object(shards, episodes)
    order = {inst["id"]: i for i, inst in enumerate(instances)}
    return sorted((ep for shard in shards for ep in shard), key=lambda ep: order[ep["id"]])


def _roles(names, players, sampling):
    """summary.json's record of each role: its model, sampling, dtype (a local one) and what a
    server would not take."""
    import engine
    import rollout
    roles = dict(persuader=dict(model=names[0], sampling=list(sampling[0])),
                 persuadee=dict(model=names[1], sampling=list(sampling[1])),
                 judge=dict(model=names[2] if len(names) > 2 else None,
                            sampling=[list(engine.GREEDY), list(rollout.JUDGE_RETRY_SAMPLING)]))
    for role, who in zip(("persuader", "persuadee", "judge"), players):
        roles[role]["dtype"] = (str(who.dtype).removeprefix("torch.")
                                if isinstance(who, engine.Engine) else None)
        if isinstance(who, served.ServedModel):  # what the server would not take
            roles[role]["not_applied"] = sorted(who.dropped)
    return roles


def _finish(episodes, persuadee, instances, out_dir, fidelity, extra=None, probe_space=None,
            probe_signs=None, shaping_lambda=rpo.LAMBDA):
    """Summary (with the probe fidelity check of a local persuadee, an engine.Engine), saved with
    the episodes; episodes without move labels are labelled by the keyword tagger."""
    untagged = [ep for ep in episodes if "moves" not in ep]
    if untagged:
        moves.tag_episodes(untagged, {i.get("scenario_id", i["id"]): i for i in instances})
    reads = None
    if fidelity and getattr(persuadee, "tokenizer", None) is not None and no_fidelity(episodes):
        fidelity = 0  # no belief to check: the summary is still written
    if fidelity and getattr(persuadee, "tokenizer", None) is not None:  # local: an Engine
        sample = fidelity_sample(episodes, fidelity)
        contexts = fidelity_contexts(persuadee.tokenizer, instances, episodes, sample)
        model, tok, opts = persuadee.model, persuadee.tokenizer, (probe_space, probe_signs)
        reads = {"sample": [[episodes[i]["id"], t] for i, t in sample],
                 "fork": probes.read_beliefs(persuadee, contexts, False, *opts).tolist(),
                 "reference": probes.read_beliefs_reference(model, tok, contexts, False, False,
                                                            *opts).tolist(),
                 "vocabulary": probes.read_beliefs_reference(model, tok, contexts, False, True,
                                                             *opts).tolist()}
    summary = analyses.summarize_run(episodes, reads, shaping_lambda)
    summary.update(extra or {})
    save_run(out_dir, episodes, summary, reads)
    return summary


def no_fidelity(episodes):
    """True, said in one line, when no episode has a belief to check the probes on (every
    read-out None: a persuadee with non-finite outputs, every episode cut off)."""
    if fidelity_sample(episodes, 1):
        return False
    print("eval.py: probe fidelity skipped: no episode has a belief", file=sys.stderr)
    return True


def refuse_nonfinite(name, model):
    """Exit in one line when a loaded model holds a NaN or an infinity (as train.py refuses such
    a checkpoint): its every read-out would be None and its text noise."""
    bad = next((k for k, v in model.state_dict().items()
                if v.is_floating_point() and not v.isfinite().all()), None)
    if bad is not None:
        sys.exit(f"eval.py: {name} holds non-finite weights ({bad}); evaluate a finite checkpoint")


def player(name, loaded, dtype, kv_blocks):
    """The model a role name stands for: a served.ServedModel (checked to answer) for
    openai:MODEL@URL, else a local engine.Engine on weights loaded once per name."""
    import engine
    if served.is_served(name):
        if name not in loaded:
            loaded[name] = served.ServedModel(name)
            loaded[name].check()
        return loaded[name]
    import torch
    if name not in loaded:  # one copy of the weights per name, a fresh Engine per role
        import models
        loaded[name] = models.load_model(name, dtype=getattr(torch, dtype))
        refuse_nonfinite(name, loaded[name][0])
    return engine.Engine(*loaded[name], num_blocks=kv_blocks)


def pool_shape(name, dtype):
    """What capacity checks read of the engine a local model would get (tokenizer, context,
    block size, device), from its tokenizer and config alone: no weight is read."""
    import torch

    import engine
    import models
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return engine.PoolShape(
        tokenizer=models.load_tokenizer(name), device=device,
        max_len=shapes.model_config(name).max_position_embeddings,
        block_size=engine.block_size_for(device, getattr(torch, dtype)))


def episode_blocks(eng, instances, t_max, max_new_tokens):
    """KV blocks one episode can take on a local side (an engine, or its pool_shape) at most: its
    longest prompt and t_max turns of two messages (each at most max_new_tokens and its
    framing), capped by the context, plus one message's copy-on-write and the probe forks."""
    import rollout
    longest = max(max(map(len, rollout.prompt_ids(eng.tokenizer, eng.tokenizer, i)))
                  for i in instances)
    tokens = min(eng.max_len, longest + t_max * 2 * (max_new_tokens + rollout.CLOSING_ROOM))
    return (eng.blocks_for(tokens) + rollout.message_blocks(eng, max_new_tokens)
            + probes.read_blocks(eng))


def block_bytes(name, dtype, block_size):
    """Bytes of one KV block of a local model (keys and values of every layer), from its config."""
    import torch

    import models
    c = shapes.model_config(name)
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    return 2 * c.num_hidden_layers * kv_heads * head_dim * block_size * getattr(torch, dtype).itemsize


def machine_bytes(device):
    import torch
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def judge_blocks(shape, instances, t_max, max_new_tokens):
    """KV blocks the judge's prompt and answer take for the longest episode it may be given (t_max
    turns of two messages, each counted at twice max_new_tokens words for what re-tokenizing
    quoted text adds), capped by the context: what a judge sharing a pool needs of it."""
    import models
    import rollout
    filler = " ".join(["so"] * (2 * max_new_tokens))
    transcript = [{"role": r, "text": filler} for _ in range(t_max) for r in ("persuader", "persuadee")]
    longest = max(instances, key=lambda i: len(arena.judge_messages(i, [])[1]["content"]))
    tokens = len(models.chat_ids(shape.tokenizer, arena.judge_messages(longest, transcript), True))
    return (shape.blocks_for(min(tokens, shape.max_len))
            + rollout.message_blocks(shape, rollout.JUDGE_MAX_NEW_TOKENS))


def pool_problem(args, instances):
    """One line refusing, before any weight loads (issue 27): a --kv-blocks pool larger than the
    machine's memory; a --max-new-tokens that lets one episode outgrow the default pool; a pool
    the default judge, which shares the persuadee's, cannot judge one episode in. None when fine."""
    import engine
    judge = args.judge is None
    for name in dict.fromkeys(args.persuader + args.persuadee):
        if served.is_served(name):
            continue
        shape = pool_shape(name, args.dtype)
        block, memory = block_bytes(name, args.dtype, shape.block_size), machine_bytes(shape.device)
        if args.kv_blocks and args.kv_blocks * block > memory:
            return (f"eval.py: --kv-blocks {args.kv_blocks} needs {args.kv_blocks * block / 2**30:.1f} "
                    f"GiB for one pool of {name}, more than this machine's {memory / 2**30:.1f} GiB; "
                    f"pass --kv-blocks {memory // block // 4} or fewer")
        budget = (memory * engine.CACHE_FRACTION_GPU if shape.device.type == "cuda"
                  else engine.CACHE_GB_CPU * 2**30)
        pool = args.kv_blocks or min(int(budget // block), engine.MAX_BLOCKS)
        need = episode_blocks(shape, instances, args.t_max, args.max_new_tokens)
        if need > pool:
            return (f"eval.py: --max-new-tokens {args.max_new_tokens} lets one episode of {name} take "
                    f"{need} KV blocks, more than its pool's {pool}; pass a smaller --max-new-tokens")
        if judge and name in args.persuadee and (needed := judge_blocks(
                shape, instances, args.t_max, args.max_new_tokens)) > pool:
            return (f"eval.py: --kv-blocks {pool} cannot hold the judge's prompt for one episode "
                    f"of {name} ({needed} blocks; the default judge shares the persuadee's pool); "
                    f"pass --kv-blocks {max(needed, need)} or more, or --judge MODEL or none")
    return None


def run_eval(persuader, persuadee, instances, out_dir, *, seed, t_max, loaded,
             max_new_tokens=None, judge=None, anchor=rpo.ANCHOR, tagger="keyword",
             kv_blocks=None, dtype="float32", probe_space=None, probe_signs=None, settings=None,
             resume=False, sampling=None, shaping_lambda=rpo.LAMBDA):
    """Make each role's player by name (weights loaded once each) and evaluate (sharded under
    torchrun) with `sampling` and the summary's shaping at `shaping_lambda`. judge None: the persuadee's model (its own engine and pool); "none": no judge
    (s = 0); else a model name or path, the same across a grid. Any role may be openai:MODEL@URL
    (served.py)."""
    rank, world = distributed()
    judge_name = judge or persuadee
    players = [player(n, loaded, dtype, kv_blocks) for n in (persuader, persuadee)]
    judge_player = (None if judge == "none" else players[1] if judge is None  # its pool too
                    else player(judge_name, loaded, dtype, kv_blocks))
    summary = evaluate(*players, instances, out_dir, t_max=t_max, seed=seed,
                       names=(persuader, persuadee, None if judge == "none" else judge_name),
                       max_new_tokens=max_new_tokens, judge=judge_player, anchor=anchor,
                       tagger=tagger, probe_space=probe_space, probe_signs=probe_signs,
                       settings=settings, resume=resume, rank=rank, world=world,
                       sampling=sampling, shaping_lambda=shaping_lambda)
    if summary is not None:
        summary["requests"] = {n: m.stats for n, m in loaded.items()
                               if isinstance(m, served.ServedModel)}
        runs.write_atomic(Path(out_dir) / "summary.json",
                          json.dumps(runs.finite(summary), indent=2, allow_nan=False) + "\n")
    return summary


def play(scenario_id, persuadee, *, seed, t_max, read=input, write=print, max_new_tokens=None,
         dtype="float32", probe_space=None, probe_signs=None, sampling=None):
    """You are the persuader (rollout.PersonSide): type each message; the persuadee (a local
    model or openai:MODEL@URL) answers and you see its three probe values and the belief change
    of the turn. The episode is saved under evals/play-SCENARIO_ID-TIME like any other."""
    import time

    import engine
    import rollout
    found = [inst for split in ("heldout", "train") for inst in _instances(split)
             if inst["id"] == scenario_id]
    if not found:
        sys.exit(f"eval.py: unknown scenario id {scenario_id!r}; use an id from scenarios.jsonl, e.g. heldout-017")
    you = rollout.PersonSide(t_max, read, write)
    [ep] = rollout.rollout_episodes(
        you, player(persuadee, {}, dtype, None), found[:1], t_max, seed=seed,
        persuadee_sampling=(sampling or rollout.SAMPLING["paper"])[1],
        max_new_tokens=max_new_tokens or engine.MAX_NEW_TOKENS, probe_space=probe_space,
        probe_signs=probe_signs)
    for key in TRAINING_KEYS:
        ep.pop(key)
    ep.update(judge=None, persuader="human", persuadee=persuadee, seed=seed)
    out_dir = Path(EVALS_DIR) / f"play-{scenario_id}-{time.strftime('%Y%m%d-%H%M%S')}"
    save_run(out_dir, [ep], analyses.summarize([ep]))
    write(f"outcome {ep['outcome']} after {ep['turns']} turns; saved to {out_dir}")
    return ep

# -----------------------------------------------------------------------------
# CLI


def add_mode_flags(ap):
    """The model-free modes, one at a time."""
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two eval directories, B against A")
    mode.add_argument("--compare-many", nargs="+", metavar="BASE", help="baseline eval directories against --policy")
    mode.add_argument("--analyze", metavar="DIR", help="recompute DIR/summary.json and plots from DIR/episodes.jsonl")
    mode.add_argument("--case", nargs=2, metavar=("DIR", "SCENARIO_ID"), help="one episode turn by turn (Table 8)")
    mode.add_argument("--overlay", nargs="+", metavar="DIR", help="belief and per-probe trajectories of runs overlaid (Fig. 6)")
    mode.add_argument("--runs", nargs="+", metavar="RUN", help="checkpoint selection over training runs (Table 9)")
    mode.add_argument("--table", nargs="+", metavar="DIR", help="the main table of eval directories, 95%% "
                      "intervals and paired p-values against --reference (Markdown, or --format latex)")
    mode.add_argument("--plot-run", metavar="DIR", help="plot DIR/metrics.jsonl into DIR/curves.png")
    mode.add_argument("--play", metavar="SCENARIO_ID", help="you persuade the model persuadee, in the terminal")


def build_parser():
    """eval.py's flags (parse_args checks the combinations once parsed)."""
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--persuader", action="append", help="model name or path; repeat for a grid (default smollm2)")
    ap.add_argument("--persuadee", action="append", help="model name or path; repeat for a grid (default smollm2)")
    ap.add_argument("--judge", help="strategy judge and logit tagger model, fixed across a grid "
                                    "(default: each persuadee's own model); 'none' gives s = 0; "
                                    "any role may be openai:MODEL@URL, a model served over the "
                                    "OpenAI API (key from OPENAI_API_KEY)")
    ap.add_argument("--tagger", choices=("keyword", "logit"), default="keyword",
                    help="move and manipulation labels: keyword rules, or yes/no logits of the judge")
    ap.add_argument("--anchor", action=argparse.BooleanOptionalAction, default=None,
                    help="the reward setting dense returns are computed under (default: the training "
                         "run's, read from the checkpoint's run folder, else rpo.ANCHOR)")
    probes.add_flags(ap)
    runs.add_sampling_flags(ap)
    ap.add_argument("--scenarios", choices=("heldout", "train"), default="heldout")
    ap.add_argument("--subset", choices=SUBSETS, help="balanced60: 3 scenarios per domain x resistance cell")
    ap.add_argument("--limit", type=int, help="evaluate only the first N scenarios")
    ap.add_argument("--seed", type=int, default=0)
    arena.add_decision_flag(ap)
    ap.add_argument("--name", help=f"run name, one folder name; output goes to {EVALS_DIR}/NAME")
    ap.add_argument("--resume", action="store_true",
                    help="continue the evaluation of that name: play only its missing episodes")
    ap.add_argument("--overwrite", action="store_true",
                    help="delete that evaluation's folder and start again")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                    help="of every local model (default bfloat16 with CUDA, float32 on a CPU)")
    ap.add_argument("--t-max", type=int, default=arena.T_MAX_EVAL, help="turn budget per episode")
    served.add_key_flag(ap)
    ap.add_argument("--kv-blocks", type=int, help="KV pool size of each engine, in blocks "
                    "(default: engine.CACHE_GB_CPU or CACHE_FRACTION_GPU of free memory)")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help=f"per message (default engine.MAX_NEW_TOKENS with CUDA or every role "
                         f"served, {CPU_MAX_NEW_TOKENS} on a CPU)")
    ap.add_argument("--reference", metavar="DIR", help="with --table: the row the others are tested "
                    "against (default: the first directory)")
    ap.add_argument("--format", choices=("markdown", "latex"), default="markdown", help="with --table")
    ap.add_argument("--shaping-lambda", type=float, default=None,
                    help="with --analyze: the lambda of shaping_by_outcome (default: the run's "
                         "own, else rpo.LAMBDA)")
    ap.add_argument("--policy", metavar="DIR", help="with --compare-many: the trained policy's eval directory")
    add_mode_flags(ap)
    return ap


def parse_args(argv=None):
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.resume:
        pin_settings(args, ap, argv)
    if args.limit is not None and args.limit < 1:
        ap.exit(2, f"eval.py: --limit must be at least 1, got {args.limit}\n")
    if args.t_max < 1:
        ap.exit(2, f"eval.py: --t-max must be at least 1, got {args.t_max}\n")
    if bool(args.compare_many) != bool(args.policy):
        ap.exit(2, "eval.py: --compare-many and --policy go together: --compare-many BASE ... --policy DIR\n")
    if args.reference is not None and args.reference not in (args.table or []):
        ap.exit(2, "eval.py: --reference names one of the --table directories\n")
    if args.overlay is not None and len(args.overlay) < 2:
        ap.exit(2, "eval.py: --overlay needs at least two eval directories\n")
    args.persuader = args.persuader or [DEFAULT_MODEL]
    args.persuadee = args.persuadee or [DEFAULT_MODEL]
    problem = argument_problem(args)
    if problem:
        ap.exit(2, f"eval.py: {problem}\n")
    return args


PINNED = ("scenarios", "subset", "limit", "seed", "dtype", "probe_space", "probe_signs", "t_max",
          "max_new_tokens", "tagger", "anchor")  # settings.json keys that are eval.py flags


def pin_settings(args, parser, argv):
    """--resume of one evaluation (evals/NAME/settings.json, not a grid): what the command line
    leaves out is the evaluation's own, as with train.py --resume (runs.pin_settings); what it
    names with another value is refused later (settings_mismatch), and every value is checked
    as a fresh argument is (argument_problem), all before any model loads."""
    path = Path(EVALS_DIR) / (args.name or "") / "settings.json"
    if (not args.name or runs.name_problem(args.name) or path.is_symlink()
            or runs.links_in(path.parent) or not path.is_file()):
        return  # open_folder refuses what is wrong with the folder, in one line
    try:
        recorded = json.loads(path.read_text())
    except (OSError, ValueError):
        return  # settings_mismatch names the unreadable record
    if not isinstance(recorded, dict):
        return
    explicit = runs.explicit_settings(parser, argv)
    pinned = {k: recorded[k] for k in PINNED if k in recorded}
    for role in ("persuader", "persuadee"):
        if role not in explicit and isinstance(recorded.get(role), str):
            pinned[role] = [recorded[role]]
    sampling = recorded.get("sampling")
    if not explicit & set(SAMPLING_FLAGS) and isinstance(sampling, list) and len(sampling) == 2:
        pinned.update(sampling="paper", persuader_temperature=sampling[0][0],
                      persuadee_temperature=sampling[1][0], persuadee_top_p=sampling[1][1],
                      persuadee_top_k=sampling[1][2])
    runs.pin_settings(args, pinned, explicit, "eval.py", may_change=tuple(pinned),
                      record=str(path))


def argument_problem(args):
    """What is wrong with the arguments of a model-driven mode, in one line, or None: found
    before any model loads."""
    judge = args.judge or args.persuadee[0]
    if args.tagger == "logit" and (args.judge == "none" or served.is_served(judge)):
        return ("--tagger logit reads the judge's own logits, so it needs a local judge: give "
                "--judge MODEL or use --tagger keyword")
    if args.name is not None and (problem := runs.name_problem(args.name)):
        return f"--name {args.name!r} {problem} under {EVALS_DIR}/"
    if problem := runs.sampling_problem(args):
        return " ".join(problem)
    if args.resume and args.overwrite:
        return "--resume continues an evaluation and --overwrite deletes it: pass one of them"
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        return f"--max-new-tokens must be at least 1, got {args.max_new_tokens}"
    if args.kv_blocks is not None and args.kv_blocks < 1:
        return f"--kv-blocks must be at least 1, got {args.kv_blocks}"
    if len(set(args.persuadee)) > 1 and args.judge is None:
        return ("a grid of several persuadees needs one fixed judge: pass --judge MODEL (or "
                "--judge none); each persuadee judging its own episodes would make the cells "
                "incomparable")
    for flag, name in [("--judge", args.judge)] + [("--persuader", n) for n in args.persuader] + \
            [("--persuadee", n) for n in args.persuadee]:
        if (name and name != "none" and not served.is_served(name)
                and name.startswith(("/", ".", "~")) and not Path(name).expanduser().exists()):
            return f"{flag} {name} is no such folder; pass a model folder, a hub name or smollm2"
    return None


def run_config(persuader):
    """The config.json of the training run a checkpoint folder belongs to, else {}."""
    config = Path(persuader).parent / "config.json"
    if Path(persuader).is_dir() and config.is_file():
        recorded = json.loads(config.read_text())
        return recorded if isinstance(recorded, dict) else {}
    return {}


def run_anchor(persuader):
    """The anchor setting of the training run a checkpoint belongs to, else rpo.ANCHOR."""
    return bool(run_config(persuader).get("anchor", rpo.ANCHOR))


def run_lambda(persuader):
    """The lambda of the training run a checkpoint belongs to (its shaping returns are reported
    at it), else rpo.LAMBDA."""
    return float(run_config(persuader).get("lam", rpo.LAMBDA))


def folder_lambda(run_dir):
    """The lambda an eval folder's shaping returns are reported at: its settings.json's, a
    training run's (an eval-STEP folder's config.json), else rpo.LAMBDA."""
    run_dir = Path(run_dir)
    for path, key in ((run_dir / "settings.json", "shaping_lambda"),
                      (run_dir.parent / "config.json", "lam")):
        if path.is_file():
            recorded = json.loads(path.read_text())
            if isinstance(recorded, dict) and runs.is_number(recorded.get(key)):
                return float(recorded[key])
    return rpo.LAMBDA


def cell_sampling(args, persuader):
    """(persuader, persuadee) engine.Sampling of one evaluation: the sampling flags the command
    line names over, when it names no --sampling, the training run's own (its config.json); the
    preset by default "cpu" for CPU_SAMPLING_MODELS (SmolLM2), else "paper"."""
    import types

    import rollout
    config = run_config(persuader) if args.sampling is None else {}
    values = {k: getattr(args, k) if getattr(args, k) is not None else config.get(k)
              for k in SAMPLING_FLAGS}
    values["sampling"] = values["sampling"] or ("cpu" if persuader in CPU_SAMPLING_MODELS else "paper")
    return rollout.role_sampling(types.SimpleNamespace(**values))


def role_differences(a, b):
    """Warnings for two eval folders whose persuadee, judge or sampling differ (their
    summary.json "roles"): their rates then measure more than the persuader."""
    def roles(folder):
        path = Path(folder) / "summary.json"
        return json.loads(path.read_text()).get("roles", {}) if path.is_file() else {}
    ra, rb = roles(a), roles(b)
    out = []
    for role in ("persuader", "persuadee", "judge"):
        for key in ("model", "sampling", "dtype") if role != "persuader" else ("sampling",):
            x, y = ra.get(role, {}).get(key), rb.get(role, {}).get(key)
            if ra and rb and x != y:
                out.append(f"warning: A and B differ in the {role}'s {key}: {x} against {y}")
    return out


def run_settings(args, persuader, persuadee):
    """Every setting that changes one evaluation's results (pinned by --resume)."""
    return dict(scenarios=args.scenarios, subset=args.subset, limit=args.limit, seed=args.seed,
                persuader=persuader, persuadee=persuadee, judge=args.judge or persuadee,
                sampling=[list(s) for s in cell_sampling(args, persuader)],
                shaping_lambda=run_lambda(persuader), constants=runs.pinned_constants(),
                dtype=args.dtype, probe_space=args.probe_space, probe_signs=args.probe_signs,
                anchor=run_anchor(persuader) if args.anchor is None else args.anchor,
                t_max=args.t_max, max_new_tokens=args.max_new_tokens, tagger=args.tagger,
                **({"decision": args.decision} if args.decision != "tag" else {}))


def _output_dir(args, default):
    return Path(EVALS_DIR) / (args.name or default)


def analysis_mode(args):
    """The model-free modes; returns what they print."""
    if args.compare:
        a, b = args.compare
        result = analyses.compare(records.load_episodes(a), records.load_episodes(b))
        path = (Path(b) if Path(b).is_dir() else Path(b).parent) / "compare.json"
        runs.write_atomic(path, json.dumps({"a": a, "b": b, **result}, indent=2) + "\n")
        return "\n".join(role_differences(a, b) + [analyses.format_compare(result, a, b), f"wrote {path}"])
    if args.compare_many:
        result = analyses.compare_many({d: records.load_episodes(d) for d in args.compare_many},
                                       records.load_episodes(args.policy))
        return analyses.format_compare_many(result, args.policy)
    if args.table:
        table = analyses.main_table({d: records.load_episodes(d) for d in args.table},
                                    args.reference or args.table[0])
        return analyses.format_main_table(table, args.format)
    if args.analyze:
        summary = analyze(args.analyze, args.shaping_lambda)
        return f"{analyses.format_table(summary)}\nwrote {Path(args.analyze) / 'summary.json'} and the plots"
    if args.case:
        folder, sid = args.case
        ep = analyses.find_episode(records.load_episodes(folder), sid, folder)
        path = Path(folder) / f"case-{_slug(sid)}.png"
        plots.plot_case(ep, path)
        return f"{analyses.format_case(ep)}\nwrote {path}"
    if args.overlay:
        out = _output_dir(args, "overlay_" + "_vs_".join(_slug(Path(d).name) for d in args.overlay))
        believed = {d: analyses.with_beliefs(records.load_episodes(d)) for d in args.overlay}
        if not all(believed.values()):
            raise ValueError(f"{', '.join(d for d, eps in believed.items() if not eps)}: no episode has beliefs "
                             "to overlay (a persuadee served without log-probs)")
        plots.plot_overlay(believed, out / "overlay.png")
        plots.plot_probe_overlay(believed, out / "overlay_probes.png")
        return (f"{analyses.format_probe_overlay(analyses.probe_overlay(believed))}\n"
                f"wrote {out / 'overlay.png'} and {out / 'overlay_probes.png'}")
    if args.runs:
        trained = [analyses.read_run(d) for d in args.runs]
        selection = analyses.runs_selection(trained)
        out = _output_dir(args, "runs_" + "_".join(_slug(r["name"]) for r in trained))
        plots.plot_runs(selection["runs"], out / "runs.png")
        plots.plot_dynamics(trained, out / "dynamics.png")
        out.mkdir(parents=True, exist_ok=True)
        runs.write_atomic(out / "runs.json", json.dumps(selection, indent=2) + "\n")
        return f"{analyses.format_runs(selection)}\nwrote {out / 'runs.png'}, {out / 'dynamics.png'} and {out / 'runs.json'}"
    return f"wrote {plots.plot_run(args.plot_run)}"


def main(argv=None):
    args = parse_args(argv)
    served.ALLOW_INSECURE_KEY = args.allow_insecure_key
    if (args.compare or args.compare_many or args.analyze or args.case or args.overlay or args.runs
            or args.plot_run or args.table):
        try:
            print(analysis_mode(args))
        except (OSError, ValueError) as e:
            sys.exit(f"eval.py: {e}")
        return
    if args.max_new_tokens is None:  # the model-driven modes only
        import torch

        import engine
        remote = all(served.is_served(n) for n in args.persuader + args.persuadee)
        args.max_new_tokens = (engine.MAX_NEW_TOKENS if torch.cuda.is_available() or remote
                               else CPU_MAX_NEW_TOKENS)
    args.dtype = args.dtype or default_dtype()
    import rollout
    rollout.DECISION = args.decision  # the persuadee's decision: its tag, or read as logits
    if args.play:
        if len(args.persuadee) > 1:
            sys.exit("eval.py: --play takes one --persuadee (you are the persuader)")
        play(args.play, args.persuadee[0], seed=args.seed, t_max=args.t_max,
             max_new_tokens=args.max_new_tokens, dtype=args.dtype, probe_space=args.probe_space,
             probe_signs=args.probe_signs, sampling=cell_sampling(args, "human"))
        return
    instances = chosen_instances(args)
    root, cells = evaluation_cells(args, instances)
    open_folder(args, root, cells, instances)  # checked and locked before any weight loads
    try:
        run_cells(args, instances, cells)
    finally:
        runs.unlock(root)
    runs.finish_distributed()


def chosen_instances(args):
    """The scenarios an evaluation plays: --scenarios, then --subset, then --limit."""
    instances = _instances(args.scenarios)
    if args.subset:
        try:
            instances = balanced_subset(instances, SUBSETS[args.subset])
        except ValueError as e:
            sys.exit(f"eval.py: --subset {args.subset}: {e}")
    return instances[:args.limit]


def evaluation_cells(args, instances):
    """The evaluation's folder (evals/NAME) and its cells: (persuader, persuadee, folder,
    settings) for every pair of a grid, the folder itself for one pair."""
    pairs = [(p, q) for p in args.persuader for q in args.persuadee]
    split = args.scenarios + (f"_{args.subset}" if args.subset else "")
    base = args.name or (f"{_slug(pairs[0][0])}_vs_{_slug(pairs[0][1])}_{split}_s{args.seed}"
                         if len(pairs) == 1 else f"grid_{split}_s{args.seed}")
    root = Path(EVALS_DIR) / base
    return root, [(p, q, root if len(pairs) == 1 else root / f"{_slug(p)}_vs_{_slug(q)}",
                   run_settings(args, p, q)) for p, q in pairs]


def open_folder(args, root, cells, instances):
    """Before any weight loads: the folder checked (runs.check_folder), locked by rank 0,
    emptied by --overwrite, its settings pinned by --resume, --kv-blocks checked."""
    first = int(os.environ.get("RANK", 0)) == 0
    runs.check_folder(root.parent, root.name, "eval.py", args.resume, args.overwrite, first=first)
    for _, _, out_dir, settings in cells if args.resume else ():
        if differ := settings_mismatch(out_dir, settings):
            sys.exit(f"eval.py: {out_dir} was run with other settings ({'; '.join(differ)}): "
                     "a resumed evaluation keeps every setting; pass another --name or "
                     "--overwrite")
    check_kv_blocks(args, instances)
    if first:
        runs.lock(root, "eval.py")
        if args.overwrite:
            runs.clear(root)  # this evaluation's folder only


def check_kv_blocks(args, instances):
    """--kv-blocks too few for one episode of a local model, refused from its tokenizer and
    config before any weight loads."""
    for name in dict.fromkeys(args.persuader + args.persuadee) if args.kv_blocks else ():
        if not served.is_served(name):
            shape = pool_shape(name, args.dtype)
            need = episode_blocks(shape, instances, args.t_max, args.max_new_tokens)
            if args.kv_blocks < need:
                sys.exit(f"eval.py: --kv-blocks {args.kv_blocks} cannot hold one episode of "
                         f"{name} ({need} blocks of {shape.block_size} tokens at --t-max "
                         f"{args.t_max}, --max-new-tokens {args.max_new_tokens}); pass "
                         f"--kv-blocks {need} or more")
    if problem := pool_problem(args, instances):
        sys.exit(problem)


def run_cells(args, instances, cells):
    """Every cell evaluated (weights loaded once per name), each summary printed by rank 0, and
    a grid's table."""
    loaded, results, rank = {}, {}, distributed()[0]  # under torchrun rank 0 prints
    for p, q, out_dir, settings in cells:
        try:
            results[(p, q)] = run_eval(
                p, q, instances, out_dir, seed=args.seed, t_max=args.t_max, loaded=loaded,
                max_new_tokens=args.max_new_tokens, judge=args.judge, anchor=settings["anchor"],
                tagger=args.tagger, kv_blocks=args.kv_blocks, dtype=args.dtype,
                probe_space=args.probe_space, probe_signs=args.probe_signs, settings=settings,
                resume=args.resume, sampling=cell_sampling(args, p),
                shaping_lambda=settings["shaping_lambda"])
        except ValueError as e:  # a malformed episodes.jsonl, a prompt too long for a model
            sys.exit(f"eval.py: {e}")
        if rank == 0:
            print(f"\n== persuader {p}, persuadee {q}, judge {args.judge or q} -> {out_dir}\n"
                  f"{analyses.format_table(results[(p, q)])}")
    if len(cells) > 1 and rank == 0:
        print("\n" + analyses.grid_table(results))


if __name__ == "__main__":
    main()
