"""
Evaluate persuaders on PersuArena: play the held-out scenarios, save the episodes, and the command
line over the analyses (analyses.py) and figures (plots.py).

An evaluation run plays one seeded episode per held-out scenario (T_max 10) and writes
evals/<name>/episodes.jsonl, summary.json, fidelity.json, beliefs.png, probes.png and moves.png.
What summary.json holds is described in analyses.py. Moves and manipulation labels come from
moves.py (keyword tagger by default, --tagger logit reads the judge model).

    python eval.py --limit 4                                    # quick run, SmolLM2 on both sides
    python eval.py --persuader PATH --name NAME                 # a trained policy or any HF chat model
    python eval.py --subset balanced60                          # 3 scenarios per domain x resistance cell
    python eval.py --scenarios train --limit 20                 # training scenarios as written
    python eval.py --persuader A --persuader B --persuadee C --persuadee D --judge J   # grid, one judge
    python eval.py --analyze evals/NAME                         # summary.json and plots from episodes.jsonl
    python eval.py --case evals/NAME heldout-017                # Table 8: one episode turn by turn
    python eval.py --persuader openai:MODEL@URL --name NAME     # a model served over the OpenAI API
    python eval.py --compare evals/A evals/B                    # paired comparison, B against A
    python eval.py --compare-many evals/B1 evals/B2 --policy evals/P   # discordant pairs, closed by none
    python eval.py --overlay evals/A evals/B                    # Fig. 6: belief trajectories overlaid
    python eval.py --runs runs/A runs/B                         # Table 9, Fig. 3, Fig. 7: checkpoint selection
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

import analyses
import arena
import moves
import plots
import probes
import rpo
import served
from analyses import PROBE_NAMES

TRAINING_KEYS = ("ids", "turn_ids", "logprobs")  # rollout's token stream, of no use once scored
EVALS_DIR = "evals"
DEFAULT_MODEL = "smollm2"
SAME_AS_PERSUADEE = "persuadee"  # the judge by default (SPEC 6): the persuadee's model, fresh context
FIDELITY_SAMPLES = 4  # contexts whose fork read-out is checked against a full forward
GPU_MAX_NEW_TOKENS = 256  # per message, as in training (SPEC 9)
CPU_MAX_NEW_TOKENS = 64  # per message on a CPU, so that --limit 4 takes minutes
SUBSETS = {"balanced60": 3}  # named subsets: scenarios kept per domain x resistance cell, file order

# -----------------------------------------------------------------------------
# IO


def _write_text(path, text):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_run(out_dir, episodes, summary, fidelity=None):
    """Write episodes.jsonl, summary.json, fidelity.json (the fork and reference read-outs, when
    given), beliefs.png, probes.png and moves.png (when labelled), each atomically."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_text(out_dir / "episodes.jsonl", "".join(json.dumps(ep) + "\n" for ep in episodes))
    if fidelity is not None:
        _write_text(out_dir / "fidelity.json", json.dumps(fidelity) + "\n")
    _write_text(out_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    believed = analyses.with_beliefs(episodes)
    if believed:  # a persuadee served without log-probs has no belief to plot
        plots.plot_beliefs(believed, out_dir / "beliefs.png")
        plots.plot_probes(believed, out_dir / "probes.png")
    if "moves" in summary:
        plots.plot_moves(summary, out_dir / "moves.png")


def scenarios_by_id():
    """Every scenario of scenarios.jsonl by id (the hidden profiles the keyword tagger audits)."""
    return {s["id"]: s for s in arena.load_scenarios()}


def analyze(run_dir):
    """Recompute summary.json and the plots of an eval folder from its episodes.jsonl (and
    fidelity.json) alone, with no model: episodes stored without labels are tagged in memory by
    the keyword tagger. Returns the summary."""
    run_dir = Path(run_dir)
    episodes = analyses.load_episodes(run_dir)
    if not all("moves" in ep for ep in episodes):
        moves.tag_episodes([ep for ep in episodes if "moves" not in ep], scenarios_by_id())
    path = run_dir / "fidelity.json"
    fidelity = json.loads(path.read_text()) if path.is_file() else None
    summary = analyses.summarize_run(episodes, fidelity)
    _write_text(run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    plots.plot_beliefs(episodes, run_dir / "beliefs.png")
    plots.plot_probes(episodes, run_dir / "probes.png")
    plots.plot_moves(summary, run_dir / "moves.png")
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


def _load(name, loaded):
    import models
    if name not in loaded:  # one copy of the weights per name, a fresh Engine per role
        loaded[name] = models.load_model(name)
    return loaded[name]


def _instances(split):
    """Held-out or training scenarios as written, one instance each (variant 0)."""
    try:
        if split == "heldout":
            return arena.heldout_instances()
        return [{**s, "scenario_id": s["id"], "variant": 0} for s in arena.load_scenarios(split="train")]
    except (OSError, ValueError) as e:
        sys.exit(f"eval.py: cannot load the {split} scenarios: {e}")


def fidelity_contexts(tokenizer, instances, episodes, n):
    """Persuadee contexts after the first reply of n episodes, for the probe fidelity check.

    Built from the transcript text: a measurement of fork against reference on identical ids,
    not a conversation that continues."""
    import models
    contexts = []
    for inst, ep in list(zip(instances, episodes))[:n]:
        messages = arena.persuadee_messages(inst)
        for m in ep["transcript"][:2]:
            role = "user" if m["role"] == "persuader" else "assistant"
            messages.append({"role": role, "content": m["text"]})
        contexts.append(models.chat_ids(tokenizer, messages, False))
    return contexts


def sampling_preset():
    """The rollout.SAMPLING preset for this machine: "paper" with CUDA, "cpu" without."""
    import torch
    return "paper" if torch.cuda.is_available() else "cpu"


def distributed():
    """(rank, world): under torchrun the held-out scenarios are sharded over the ranks (the
    process group is started here when the caller has not); else (0, 1)."""
    import torch
    import torch.distributed as dist
    if "RANK" not in os.environ:
        return 0, 1
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), dist.get_world_size()


def evaluate(persuader, persuadee, instances, out_dir, *, t_max=arena.T_MAX_EVAL, seed=0,
             names=("", ""), fidelity=FIDELITY_SAMPLES, max_new_tokens=GPU_MAX_NEW_TOKENS,
             judge=SAME_AS_PERSUADEE, anchor=rpo.ANCHOR, tagger="keyword", preset=None, rank=0,
             world=1):
    """One seeded episode per instance with rollout Engines; saves the run, returns its summary.

    The strategy judge is an Engine, by default the persuadee's (SPEC 6), or None (s = 0); the
    logit tagger reads it too. `anchor` is the reward setting the dense returns are computed under.
    Under torchrun (world > 1) each rank plays instances[rank::world] and rank 0 gathers, tags,
    summarises and saves (other ranks return None); an episode's record does not depend on its
    rank (rollout's keyed random streams), so the summary equals one process's."""
    import rollout
    judge = persuadee if judge == SAME_AS_PERSUADEE else judge
    er_sampling, ee_sampling = rollout.SAMPLING[preset or sampling_preset()]
    episodes = rollout.rollout_episodes(persuader, persuadee, instances[rank::world], t_max,
                                        seed=seed, judge=judge, max_new_tokens=max_new_tokens,
                                        persuader_sampling=er_sampling,
                                        persuadee_sampling=ee_sampling)
    if world > 1:
        import torch.distributed as dist
        shards = [None] * world
        dist.all_gather_object(shards, episodes)
        order = {inst["id"]: i for i, inst in enumerate(instances)}
        episodes = sorted((ep for shard in shards for ep in shard), key=lambda ep: order[ep["id"]])
    if rank:
        return None
    for ep in episodes:
        for key in TRAINING_KEYS:
            ep.pop(key, None)
        ep.update(persuader=names[0], persuadee=names[1], seed=seed, anchor=anchor,
                  probe_space=probes.PROBE_SPACE)
    moves.tag_episodes(episodes, {inst.get("scenario_id", inst["id"]): inst for inst in instances},
                       tagger, judge if judge is not None else persuadee)
    return _finish(episodes, persuadee, instances, out_dir, fidelity)


def _finish(episodes, persuadee, instances, out_dir, fidelity, extra=None):
    """Summary (with the probe fidelity check of a local persuadee), saved with the episodes;
    episodes without move labels (a served run) are labelled by the keyword tagger."""
    untagged = [ep for ep in episodes if "moves" not in ep]
    if untagged:
        moves.tag_episodes(untagged, {i.get("scenario_id", i["id"]): i for i in instances})
    reads = None
    if fidelity and getattr(persuadee, "tokenizer", None) is not None:  # local: an Engine
        contexts = fidelity_contexts(persuadee.tokenizer, instances, episodes, fidelity)
        model, tok = persuadee.model, persuadee.tokenizer
        reads = {"fork": probes.read_beliefs(model, tok, contexts).tolist(),
                 "reference": probes.read_beliefs_reference(model, tok, contexts).tolist(),
                 "vocabulary": probes.read_beliefs_reference(model, tok, contexts,
                                                             vocabulary=True).tolist()}
    summary = analyses.summarize_run(episodes, reads)
    summary.update(extra or {})
    save_run(out_dir, episodes, summary, reads)
    return summary


def run_eval(persuader, persuadee, instances, out_dir, *, seed, t_max, loaded,
             max_new_tokens=GPU_MAX_NEW_TOKENS, judge=None, anchor=rpo.ANCHOR, tagger="keyword",
             kv_blocks=None):
    """Load the models by name (once each) and evaluate (sharded under torchrun). judge None:
    the persuadee's model; "none": no judge (s = 0); else a model name or path, the same across
    a grid. A role named openai:MODEL@URL is served (served.py), and then the evaluation resumes
    from out_dir/episodes.jsonl."""
    import engine
    names = (persuader, persuadee, judge or persuadee)
    if any(served.is_served(n) for n in names):
        return run_served(*names, instances, out_dir, seed=seed, t_max=t_max, loaded=loaded,
                          max_new_tokens=max_new_tokens)
    rank, world = distributed()
    engines = [engine.Engine(*_load(name, loaded), num_blocks=kv_blocks)
               for name in (persuader, persuadee)]
    judge_engine = (SAME_AS_PERSUADEE if judge is None else None if judge == "none"
                    else engine.Engine(*_load(judge, loaded), num_blocks=kv_blocks))
    return evaluate(*engines, instances, out_dir, t_max=t_max, seed=seed,
                    names=(persuader, persuadee), max_new_tokens=max_new_tokens, judge=judge_engine,
                    anchor=anchor, tagger=tagger, rank=rank, world=world)


def run_served(persuader, persuadee, judge, instances, out_dir, *, seed, t_max, loaded,
               max_new_tokens, fidelity=FIDELITY_SAMPLES):
    """An evaluation in which some role is served: episodes played by served.play_episodes,
    appended to out_dir/episodes.jsonl as they end, so a rerun plays only the missing ones."""
    import engine
    out_dir = Path(out_dir)
    settings = dict(persuader=persuader, persuadee=persuadee, judge=judge, seed=seed, t_max=t_max,
                    max_new_tokens=max_new_tokens)
    settings_path = out_dir / "settings.json"
    if settings_path.exists() and json.loads(settings_path.read_text()) != settings:
        sys.exit(f"eval.py: {out_dir} holds an evaluation with other settings ({settings_path}); "
                 "pass another --name, or delete the folder to start again")
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_text(settings_path, json.dumps(settings, indent=2) + "\n")
    sides = {}
    for name in dict.fromkeys((persuader, persuadee, judge)):
        if served.is_served(name):
            sides[name] = served.ServedModel(name)
            sides[name].check()
        else:
            sides[name] = engine.Engine(*_load(name, loaded))
    path = out_dir / "episodes.jsonl"
    try:
        if played := len(served.read_played(path)):
            print(f"resuming {out_dir}: {played} of {len(instances)} episodes already played",
                  file=sys.stderr)
        episodes = served.play_episodes(sides[persuader], sides[persuadee], instances, t_max,
                                        judge=sides[judge], seed=seed, max_new_tokens=max_new_tokens,
                                        out_path=path)
    except ValueError as e:
        sys.exit(f"eval.py: {e}")
    for ep in episodes:
        ep.update(persuader=persuader, persuadee=persuadee, seed=seed)
    requests = {name: m.stats for name, m in sides.items() if isinstance(m, served.ServedModel)}
    return _finish(episodes, sides[persuadee], instances, out_dir, fidelity, {"requests": requests})


def play(scenario_id, persuadee, *, seed, t_max, read=input, write=print,
         max_new_tokens=GPU_MAX_NEW_TOKENS):
    """You are the persuader: type each message; the model persuadee answers and you see its
    three probe values and the belief change of the turn. The transcript is saved under
    evals/play-SCENARIO_ID-TIME like any episode."""
    import time

    import arena
    import engine
    import models
    import rollout
    preset = sampling_preset()
    found = [inst for split in ("heldout", "train") for inst in _instances(split) if inst["id"] == scenario_id]
    if not found:
        sys.exit(f"eval.py: unknown scenario id {scenario_id!r}; use an id from scenarios.jsonl, e.g. heldout-017")
    inst = found[0]
    persuadee_engine = engine.Engine(*_load(persuadee, {}))
    tok = persuadee_engine.tokenizer
    write(f"== {inst['title']} ({inst['id']})\nYou are {inst['persuader']['role']}. "
          f"Goal: {inst['persuader']['goal']}\nRequest: {inst['persuader']['request']}\n"
          f"They: {inst['persuadee']['name']}, {inst['persuadee']['age']}, "
          f"{inst['persuadee']['occupation']}. {inst['context']}\n(empty line or Ctrl-D: stop)")
    sid = persuadee_engine.new(models.chat_ids(tok, arena.persuadee_messages(inst), False))
    persuadee_engine.forward([sid])
    values = probes.read_engine(persuadee_engine, [sid])[0].tolist()
    episode, transcript, probe_rows = arena.Episode(t_max), [], [values]
    while not episode.done:
        try:
            text = read(f"turn {episode.turn + 1}/{t_max} you> ").strip()
        except EOFError:
            text = ""
        if not text:
            episode.end("stopped")
            break
        transcript.append({"role": "persuader", "text": text, "decision": None})
        heard = rollout.persuadee_heard(tok, text, episode.final_turn)
        [reply] = rollout.persuadee_turn(
            persuadee_engine, [sid], [heard], sampling=rollout.SAMPLING[preset][1],
            max_new_tokens=max_new_tokens,
            keys=[engine.stream_key(seed, inst["id"], episode.turn, "persuadee")])
        transcript.append({"role": "persuadee", "text": reply["text"], "decision": reply["decision"]})
        if reply["reason"] in ("context", "cache"):
            episode.end(reply["reason"])
            break
        episode.step(reply["decision"])
        before = sum(values) / 3
        values = reply["probes"]
        probe_rows.append(values)
        write(f"{inst['persuadee']['name']}: {reply['text']}")
        write("   " + "  ".join(f"{k} {v:+.2f}" for k, v in zip(PROBE_NAMES, values)) +
              f"   belief {sum(values) / 3:+.2f} ({sum(values) / 3 - before:+.2f})")
    beliefs = [sum(v) / 3 for v in probe_rows]
    ep = dict(id=inst["id"], scenario_id=inst["id"], domain=inst["domain"],
              resistance=inst["hidden"]["resistance"], outcome=episode.outcome,
              turns=len(beliefs) - 1, end_reason=episode.end_reason, transcript=transcript,
              beliefs=beliefs, probes=probe_rows, judge=None, persuader="human",
              persuadee=persuadee, seed=seed)
    out_dir = Path(EVALS_DIR) / f"play-{inst['id']}-{time.strftime('%Y%m%d-%H%M%S')}"
    save_run(out_dir, [ep], analyses.summarize([ep]))
    write(f"outcome {episode.outcome} after {episode.turn} turns; saved to {out_dir}")
    return ep

# -----------------------------------------------------------------------------
# CLI


def parse_args(argv=None):
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
    ap.add_argument("--probe-signs", type=probes.parse_signs, default=probes.PROBE_SIGNS,
                    help='per-probe valence, e.g. "PE=-1" flips PE (default: probes.PROBE_SIGNS)')
    ap.add_argument("--probe-space", choices=probes.PROBE_SPACES, default=probes.PROBE_SPACE,
                    help="probe values as 2p - 1 (prob) or clipped, rescaled log-odds (logodds)")
    ap.add_argument("--scenarios", choices=("heldout", "train"), default="heldout")
    ap.add_argument("--subset", choices=SUBSETS, help="balanced60: 3 scenarios per domain x resistance cell")
    ap.add_argument("--limit", type=int, help="evaluate only the first N scenarios")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", help=f"run name; output goes to {EVALS_DIR}/NAME")
    ap.add_argument("--t-max", type=int, default=arena.T_MAX_EVAL, help="turn budget per episode")
    ap.add_argument("--kv-blocks", type=int, help="KV pool size of each engine, in blocks "
                    "(default: engine.CACHE_GB_CPU or CACHE_FRACTION_GPU of free memory)")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help=f"per message (default {GPU_MAX_NEW_TOKENS} with CUDA, {CPU_MAX_NEW_TOKENS} on a CPU)")
    ap.add_argument("--policy", metavar="DIR", help="with --compare-many: the trained policy's eval directory")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two eval directories, B against A")
    mode.add_argument("--compare-many", nargs="+", metavar="BASE", help="baseline eval directories against --policy")
    mode.add_argument("--analyze", metavar="DIR", help="recompute DIR/summary.json and plots from DIR/episodes.jsonl")
    mode.add_argument("--case", nargs=2, metavar=("DIR", "SCENARIO_ID"), help="one episode turn by turn (Table 8)")
    mode.add_argument("--overlay", nargs="+", metavar="DIR", help="belief trajectories of runs overlaid (Fig. 6)")
    mode.add_argument("--runs", nargs="+", metavar="RUN", help="checkpoint selection over training runs (Table 9)")
    mode.add_argument("--plot-run", metavar="DIR", help="plot DIR/metrics.jsonl into DIR/curves.png")
    mode.add_argument("--play", metavar="SCENARIO_ID", help="you persuade the model persuadee, in the terminal")
    args = ap.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        ap.exit(2, f"eval.py: --limit must be at least 1, got {args.limit}\n")
    if args.t_max < 1:
        ap.exit(2, f"eval.py: --t-max must be at least 1, got {args.t_max}\n")
    if bool(args.compare_many) != bool(args.policy):
        ap.exit(2, "eval.py: --compare-many and --policy go together: --compare-many BASE ... --policy DIR\n")
    if args.overlay is not None and len(args.overlay) < 2:
        ap.exit(2, "eval.py: --overlay needs at least two eval directories\n")
    if args.tagger == "logit" and args.judge == "none":
        ap.exit(2, "eval.py: --tagger logit reads the judge model; give --judge MODEL or use --tagger keyword\n")
    args.persuader = args.persuader or [DEFAULT_MODEL]
    args.persuadee = args.persuadee or [DEFAULT_MODEL]
    return args


def run_anchor(persuader):
    """The anchor setting of the training run a checkpoint belongs to (its folder's config.json),
    else rpo.ANCHOR."""
    config = Path(persuader).parent / "config.json"
    if Path(persuader).is_dir() and config.is_file():
        return bool(json.loads(config.read_text()).get("anchor", rpo.ANCHOR))
    return rpo.ANCHOR


def _output_dir(args, default):
    return Path(EVALS_DIR) / (args.name or default)


def analysis_mode(args):
    """The model-free modes; returns what they print."""
    if args.compare:
        a, b = args.compare
        return analyses.format_compare(analyses.compare(analyses.load_episodes(a), analyses.load_episodes(b)),
                                       a, b)
    if args.compare_many:
        result = analyses.compare_many({d: analyses.load_episodes(d) for d in args.compare_many},
                                       analyses.load_episodes(args.policy))
        return analyses.format_compare_many(result, args.policy)
    if args.analyze:
        summary = analyze(args.analyze)
        return f"{analyses.format_table(summary)}\nwrote {Path(args.analyze) / 'summary.json'} and the plots"
    if args.case:
        folder, sid = args.case
        ep = analyses.find_episode(analyses.load_episodes(folder), sid, folder)
        path = Path(folder) / f"case-{_slug(sid)}.png"
        plots.plot_case(ep, path)
        return f"{analyses.format_case(ep)}\nwrote {path}"
    if args.overlay:
        path = _output_dir(args, "overlay_" + "_vs_".join(_slug(Path(d).name) for d in args.overlay)) / "overlay.png"
        plots.plot_overlay({d: analyses.load_episodes(d) for d in args.overlay}, path)
        return f"wrote {path}"
    if args.runs:
        runs = [analyses.read_run(d) for d in args.runs]
        selection = [analyses.run_analysis(r) for r in runs]
        out = _output_dir(args, "runs_" + "_".join(_slug(r["name"]) for r in runs))
        plots.plot_runs(selection, out / "runs.png")
        plots.plot_dynamics(runs, out / "dynamics.png")
        out.mkdir(parents=True, exist_ok=True)
        _write_text(out / "runs.json", json.dumps(selection, indent=2) + "\n")
        return f"{analyses.format_runs(selection)}\nwrote {out / 'runs.png'}, {out / 'dynamics.png'} and {out / 'runs.json'}"
    return f"wrote {plots.plot_run(args.plot_run)}"


def main(argv=None):
    args = parse_args(argv)
    if args.compare or args.compare_many or args.analyze or args.case or args.overlay or args.runs or args.plot_run:
        try:
            print(analysis_mode(args))
        except (OSError, ValueError) as e:
            sys.exit(f"eval.py: {e}")
        return
    probes.PROBE_SPACE = args.probe_space  # every read-out of this process, fidelity check included
    probes.PROBE_SIGNS = args.probe_signs
    if args.max_new_tokens is None:  # the model-driven modes only
        import torch
        remote = all(served.is_served(n) for n in args.persuader + args.persuadee)
        args.max_new_tokens = (GPU_MAX_NEW_TOKENS if torch.cuda.is_available() or remote
                               else CPU_MAX_NEW_TOKENS)
    if args.play:
        if len(args.persuadee) > 1:
            sys.exit("eval.py: --play takes one --persuadee (you are the persuader)")
        play(args.play, args.persuadee[0], seed=args.seed, t_max=args.t_max,
             max_new_tokens=args.max_new_tokens)
        return
    instances = _instances(args.scenarios)
    if args.subset:
        try:
            instances = balanced_subset(instances, SUBSETS[args.subset])
        except ValueError as e:
            sys.exit(f"eval.py: --subset {args.subset}: {e}")
    instances = instances[:args.limit]
    pairs = [(p, q) for p in args.persuader for q in args.persuadee]
    split = args.scenarios + (f"_{args.subset}" if args.subset else "")
    base = args.name or (f"{_slug(pairs[0][0])}_vs_{_slug(pairs[0][1])}_{split}_s{args.seed}"
                         if len(pairs) == 1 else f"grid_{split}_s{args.seed}")
    loaded, results, rank = {}, {}, distributed()[0]  # under torchrun rank 0 prints
    for p, q in pairs:
        out_dir = Path(EVALS_DIR) / base if len(pairs) == 1 else Path(EVALS_DIR) / base / f"{_slug(p)}_vs_{_slug(q)}"
        results[(p, q)] = run_eval(p, q, instances, out_dir, seed=args.seed, t_max=args.t_max, loaded=loaded,
                                   max_new_tokens=args.max_new_tokens, judge=args.judge,
                                   anchor=run_anchor(p) if args.anchor is None else args.anchor,
                                   tagger=args.tagger, kv_blocks=args.kv_blocks)
        if rank == 0:
            print(f"\n== persuader {p}, persuadee {q}, judge {args.judge or q} -> {out_dir}\n"
                  f"{analyses.format_table(results[(p, q)])}")
    if len(pairs) > 1 and rank == 0:
        print("\n" + analyses.grid_table(results))
    if "RANK" in os.environ:  # a rank that exits with its process group alive can abort in gloo
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
