"""
Evaluate persuaders on PersuArena: play the held-out scenarios, save the episodes and the summary,
and the main table. The model-free modes over saved folders (--analyze, --compare, --case, ...)
are lab/report.py's; the analyses lab/analyses.py's, the figures lab/plots.py's.

An evaluation run plays one seeded episode per held-out scenario (T_max 10) through rollout.py's
one loop, whatever plays each role (a local model, openai:MODEL@URL, or you with --play), and
writes evals/<name>/episodes.jsonl (appended as each episode ends: --resume plays only the
missing ones, with every setting pinned in settings.json), summary.json (with each role's model,
dtype and sampling), fidelity.json, beliefs.png, probes.png and moves.png.
What summary.json holds is described in lab/analyses.py. Moves and manipulation labels come from
lab/moves.py (keyword tagger by default, --tagger logit reads the judge model).

    python eval.py --limit 4                                    # quick run, SmolLM2 on both sides
    python eval.py --persuader PATH --name NAME                 # a trained policy or any HF chat model
    python eval.py --subset balanced60                          # 3 scenarios per domain x resistance cell
    python eval.py --scenarios train --limit 20                 # training scenarios as written
    python eval.py --persuader A --persuader B --persuadee C --persuadee D --judge J   # Fig. 4 grid, one judge
    python eval.py --persuader openai:MODEL@URL --name NAME     # a model served over the OpenAI API
    python eval.py --name NAME --resume                         # finish an interrupted evaluation
    python eval.py --table evals/A evals/B --reference evals/A --format latex   # the main table
    python eval.py --play heldout-017                           # you are the persuader, in the terminal
"""

import argparse
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

from persuarena import arena
from persuarena import probes
from persuarena import rpo
from lab import analyses, cli, comparisons, episode_log, jsonl, moves, pools, presets, ranks, report, runs, served, terminal

EVALS_DIR = "evals"
DEFAULT_MODEL = "smollm2"
SAME_AS_PERSUADEE = "persuadee"  # the judge by default (the paper's frozen judge): the persuadee's model, fresh context
FIDELITY_SAMPLES = 24  # read-outs, spread over every turn, whose fork is checked against transformers' forward
CPU_SAMPLING_MODELS = (DEFAULT_MODEL,)  # persuaders whose default --sampling is "cpu" (DECISIONS.md: CPU sampling preset)
SAMPLING_FLAGS = ("sampling", "persuader_temperature", "persuadee_temperature", "persuadee_top_p",
                  "persuadee_top_k")  # cli.add_sampling_flags: a training run's, by default
SUBSETS = {"balanced60": 60}  # named subsets: their size, stratified (60: three a domain x resistance cell)

# -----------------------------------------------------------------------------
# the scenarios an evaluation plays


def _instances(split):
    """Held-out or training scenarios as written, one instance each (variant 0)."""
    try:
        return arena.written_instances(split)
    except (OSError, ValueError) as e:
        sys.exit(f"eval.py: cannot load the {split} scenarios: {e}")


def chosen_instances(args):
    """The scenarios an evaluation plays: --scenarios, then the stratified subset of --subset's
    or --limit's size, whichever is smaller (arena.stratified: every domain x resistance cell as
    evenly as the size allows); args.subset_name names it for the summary."""
    instances = _instances(args.scenarios)
    sizes = [n for n in (SUBSETS.get(args.subset), args.limit) if n is not None]
    n = min(sizes) if sizes else None
    args.subset_name = f"{args.scenarios} {arena.subset_name(n, len(instances))}"
    return arena.stratified(instances, n)

# -----------------------------------------------------------------------------
# one evaluation: one persuader against one persuadee (rollout imports the model side, so the
# model-driven functions import it when called)


def default_dtype():
    """As train.py's presets: bfloat16 with CUDA; on a CPU the machine's (lab.presets.cpu_dtype:
    bfloat16 where it has bf16 units, else float32), printed with why (DECISIONS.md: Precision)."""
    import torch
    if torch.cuda.is_available():
        return "bfloat16"
    dtype = presets.cpu_dtype()[0]
    print(presets.dtype_note(dtype))
    return dtype


def distributed():
    """(rank, world): under torchrun the held-out scenarios are sharded over the ranks (the
    process group started by ranks.setup_distributed when the caller has not); else (0, 1)."""
    return ranks.setup_distributed()[:2]


def evaluate(persuader, persuadee, instances, out_dir, *, t_max=None, seed=0, names=("", ""),
             fidelity=None, max_new_tokens=None, judge=SAME_AS_PERSUADEE, anchor=None,
             tagger="keyword", sampling=None, probe_space=None, probe_signs=None, settings=None,
             resume=False, rank=0, world=1, shaping_lambda=None, decision=None, subset=None):
    """One seeded episode per instance through rollout.py's loop (each role an engine.Engine, a
    served.ServedModel or a side); saves the run, returns its summary.

    The judge is an Engine or ServedModel, by default the persuadee's (the paper's frozen judge),
    or None (s = 0); the logit tagger reads it. None means the constant: t_max arena.T_MAX_EVAL,
    fidelity FIDELITY_SAMPLES, sampling rollout.SAMPLING["paper"], anchor rpo.ANCHOR (the dense
    returns'), shaping_lambda rpo.LAMBDA (the summary's shaping returns'), decision
    rollout.DECISION. Each episode is appended to out_dir/episodes.jsonl as it ends; with
    `resume` those already there are not played again. `settings` go to settings.json and the
    summary. Under torchrun each rank plays instances[rank::world] and rank 0 gathers, tags,
    summarises and saves (others return None), the probe fidelity check shared by the ranks;
    records do not depend on the rank (rollout's keyed random streams), so the summary equals
    one process's. `subset` names the scenarios played in the summary (arena.subset_name), by
    default their count."""
    from persuarena import engine
    from persuarena import rollout
    from lab import fidelity as probe_fidelity
    out_dir, anchor = Path(out_dir), rpo.ANCHOR if anchor is None else anchor
    judge = persuadee if judge == SAME_AS_PERSUADEE else judge
    persuader_sampling, persuadee_sampling = sampling or rollout.SAMPLING["paper"]
    played = episode_log.played_so_far(out_dir, resume, rank, world)
    if rank == 0 and settings is not None:
        runs.write_atomic(out_dir / "settings.json", json.dumps(settings, indent=2) + "\n")
    mine = instances[rank::world]
    if done := sum(inst["id"] in played for inst in mine):
        print(f"resuming {out_dir}: {done} of {len(mine)} episodes already played",
              file=sys.stderr)
    stamp = dict(persuader=names[0], persuadee=names[1], seed=seed, anchor=anchor,
                 probe_space=probe_space or probes.PROBE_SPACE,
                 probe_signs=probe_signs or probes.probe_signs())
    path = out_dir / ("episodes.jsonl" if world == 1 else f"episodes.rank{rank}.jsonl")
    episodes = episode_log.play_resumable(
        persuader, persuadee, mine, path, t_max=arena.T_MAX_EVAL if t_max is None else t_max,
        judge=judge, seed=seed, stamp=stamp, played=played, max_new_tokens=max_new_tokens,
        persuader_sampling=persuader_sampling, persuadee_sampling=persuadee_sampling,
        probe_space=probe_space, probe_signs=probe_signs, decision=decision,
        say=None if rank == 0 else (lambda line: None))
    episodes = episode_log.gathered(episodes, instances, world)
    local_persuadee = persuadee if isinstance(persuadee, engine.Engine) else None
    reads = probe_fidelity.fidelity_reads(  # every rank reads its share of the sample
        local_persuadee, instances, episodes, FIDELITY_SAMPLES if fidelity is None else fidelity,
        probe_space, probe_signs, rank, world)
    if rank:
        return None
    local_judge = judge if isinstance(judge, engine.Engine) else None
    moves.tag_episodes(episodes, {inst.get("scenario_id", inst["id"]): inst for inst in instances},
                       tagger, local_judge or local_persuadee)
    summary = analyses.summarize_run(episodes, reads,
                                     rpo.LAMBDA if shaping_lambda is None else shaping_lambda)
    roles = report.roles_record(names, (persuader, persuadee, judge),
                                (persuader_sampling, persuadee_sampling))
    summary.update(roles=roles, settings=settings or {}, subset=subset or f"{len(instances)} given")
    report.save_run(out_dir, episodes, summary, reads)
    for path in episode_log.part_paths(out_dir)[1:]:
        path.unlink()  # merged into episodes.jsonl by save_run
    return summary


def run_eval(persuader, persuadee, instances, out_dir, *, loaded, judge=None, kv_blocks=None,
             dtype="float32", allow_insecure_key=None, **evaluate_kw):
    """Make each role's player by name (weights loaded once each) and evaluate (sharded under
    torchrun; evaluate_kw as evaluate's). judge None: the persuadee's model (its own engine and
    pool); "none": no judge (s = 0); else a model name or path, the same across a grid. Any role
    may be openai:MODEL@URL (lab/served.py)."""
    rank, world = distributed()
    judge_name = judge or persuadee
    players = [pools.player(n, loaded, dtype, kv_blocks, allow_insecure_key) for n in (persuader, persuadee)]
    judge_player = (None if judge == "none" else players[1] if judge is None  # its pool too
                    else pools.player(judge_name, loaded, dtype, kv_blocks, allow_insecure_key))
    summary = evaluate(*players, instances, out_dir, judge=judge_player, rank=rank, world=world,
                       names=(persuader, persuadee, None if judge == "none" else judge_name),
                       **evaluate_kw)
    if summary is not None:
        summary["requests"] = {n: m.stats for n, m in loaded.items()
                               if isinstance(m, served.ServedModel)}
        runs.write_atomic(Path(out_dir) / "summary.json",
                          json.dumps(jsonl.finite(summary), indent=2, allow_nan=False) + "\n")
    return summary


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
    ap = cli.new_parser("eval.py", __doc__)
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
    cli.add_sampling_flags(ap)
    ap.add_argument("--scenarios", choices=("heldout", "train"), default="heldout",
                    help="the split played (train: the training scenarios as written)")
    ap.add_argument("--subset", choices=SUBSETS, help="balanced60: 3 scenarios per domain x resistance cell (arena.stratified)")
    ap.add_argument("--limit", type=int, help="evaluate N scenarios, stratified over domain x resistance "
                    "(arena.stratified: 5 = one a domain, 8 = every domain and type, 20 = one a cell)")
    ap.add_argument("--seed", type=int, default=0, help="the episodes' random streams")
    cli.add_decision_flag(ap)
    ap.add_argument("--name", help=f"run name, one folder name; output goes to {EVALS_DIR}/NAME")
    ap.add_argument("--resume", action="store_true",
                    help="continue the evaluation of that name: play only its missing episodes")
    ap.add_argument("--overwrite", action="store_true",
                    help="delete that evaluation's folder and start again")
    ap.add_argument("--dtype", choices=cli.DTYPES,
                    help="of every local model (default bfloat16 with CUDA; on a CPU bfloat16 where it "
                    "has bf16 units, else float32: lab.presets.cpu_dtype)")
    ap.add_argument("--t-max", type=int, default=arena.T_MAX_EVAL, help="turn budget per episode")
    served.add_key_flag(ap)
    ap.add_argument("--kv-blocks", type=int, help="KV pool size of each engine, in blocks "
                    "(default: engine.CACHE_GB_CPU or CACHE_FRACTION_GPU of free memory)")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="per message (default engine.MAX_NEW_TOKENS with CUDA or every role "
                         "served, the cpu training preset's on a CPU: lab/presets.py)")
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
    leaves out is the evaluation's own, as with train.py --resume (cli.pin_settings); what it
    names with another value is refused later (settings_mismatch), and every value is checked
    as a fresh argument is (argument_problem), all before any model loads."""
    path = Path(EVALS_DIR) / (args.name or "") / "settings.json"
    if (not args.name or runs.name_problem(args.name) or path.is_symlink()
            or runs.links_in(path.parent) or not path.is_file()):
        return  # open_folder refuses what is wrong with the folder, in one line
    try:
        recorded = jsonl.loads(path.read_text())
    except (OSError, ValueError):
        return  # settings_mismatch names the unreadable record
    if not isinstance(recorded, dict):
        return
    explicit = cli.explicit_settings(parser, argv)
    pinned = {k: recorded[k] for k in PINNED if k in recorded}
    for role in ("persuader", "persuadee"):
        if role not in explicit and isinstance(recorded.get(role), str):
            pinned[role] = [recorded[role]]
    sampling = recorded.get("sampling")
    if not explicit & set(SAMPLING_FLAGS) and isinstance(sampling, list) and len(sampling) == 2:
        pinned.update(sampling="paper", persuader_temperature=sampling[0][0],
                      persuadee_temperature=sampling[1][0], persuadee_top_p=sampling[1][1],
                      persuadee_top_k=sampling[1][2])
    cli.pin_settings(args, pinned, explicit, "eval.py", may_change=tuple(pinned),
                     record=str(path), own=sys.modules[__name__], parser=parser)


def argument_problem(args):
    """What is wrong with the arguments of a model-driven mode, in one line, or None: found
    before any model loads."""
    judge = args.judge or args.persuadee[0]
    if args.tagger == "logit" and (args.judge == "none" or served.is_served(judge)):
        return ("--tagger logit reads the judge's own logits, so it needs a local judge: give "
                "--judge MODEL or use --tagger keyword")
    if args.name is not None and (problem := runs.name_problem(args.name)):
        return f"--name {args.name!r} {problem} under {EVALS_DIR}/"
    if problem := cli.sampling_problem(args):
        flag, what, fix = problem
        return f"{flag} {what}; {fix}"
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
        if name and name != "none" and not served.is_served(name) and (
                problem := cli.model_problem(name)):
            return f"{flag} {name} {problem}; {cli.MODEL_FIX}"
    return None


def cell_sampling(args, persuader):
    """(persuader, persuadee) engine.Sampling of one evaluation: the sampling flags the command
    line names over, when it names no --sampling, the training run's own (its config.json); the
    preset by default "cpu" for CPU_SAMPLING_MODELS (SmolLM2), else "paper"."""
    import types

    config = report.run_config(persuader) if args.sampling is None else {}
    values = {k: getattr(args, k) if getattr(args, k) is not None else config.get(k)
              for k in SAMPLING_FLAGS}
    values["sampling"] = values["sampling"] or picked_sampling(persuader)
    return cli.role_sampling(types.SimpleNamespace(**values))


def picked_sampling(persuader):
    """The rollout.SAMPLING entry eval.py picks when neither the command line nor the
    persuader's training run names one: "cpu" for CPU_SAMPLING_MODELS, else the default."""
    return "cpu" if persuader in CPU_SAMPLING_MODELS else presets.DEFAULT_SAMPLING


def sampling_line(args, persuader):
    """The line that says which sampling entry eval.py picked over the default, or None (printed
    like a preset's overrides)."""
    if args.sampling is not None or report.run_config(persuader).get("sampling"):
        return None
    entry = picked_sampling(persuader)
    return None if entry == presets.DEFAULT_SAMPLING else presets.sampling_note(
        entry, f"eval.CPU_SAMPLING_MODELS: {persuader}")


def run_settings(args, persuader, persuadee):
    """Every setting that changes one evaluation's results (pinned by --resume)."""
    return dict(scenarios=args.scenarios, subset=args.subset, limit=args.limit, seed=args.seed,
                persuader=persuader, persuadee=persuadee, judge=args.judge or persuadee,
                sampling=[list(s) for s in cell_sampling(args, persuader)],
                shaping_lambda=report.run_lambda(persuader), constants=cli.pinned_constants(sys.modules[__name__]),
                dtype=args.dtype, probe_space=args.probe_space, probe_signs=args.probe_signs,
                anchor=report.run_anchor(persuader) if args.anchor is None else args.anchor,
                t_max=args.t_max, max_new_tokens=args.max_new_tokens, tagger=args.tagger,
                **({"decision": args.decision} if args.decision != "tag" else {}))


def cpu_defaults(args):
    """--max-new-tokens and --judge a command line leaves out: on a machine without CUDA, the cpu
    training preset's (lab/presets.py), so a laptop trains and evaluates alike: its message
    length when some role is local, its judge (none) when every persuadee is local (a served
    one still judges); else engine.MAX_NEW_TOKENS and the persuadee's own model."""
    import torch

    from persuarena import engine
    cpu = {} if torch.cuda.is_available() else presets.laptop_settings()
    if args.max_new_tokens is None:
        remote = all(served.is_served(n) for n in args.persuader + args.persuadee)
        args.max_new_tokens = engine.MAX_NEW_TOKENS if remote else cpu.get(
            "max_new_tokens", engine.MAX_NEW_TOKENS)
    if (args.judge is None and args.tagger != "logit"  # the logit tagger reads a local judge
            and not any(served.is_served(n) for n in args.persuadee)):
        args.judge = cpu.get("judge")


def main(argv=None):
    args = parse_args(argv)
    if (args.compare or args.compare_many or args.analyze or args.case or args.overlay or args.runs
            or args.plot_run or args.table):
        try:
            print(terminal.visible(report.analysis_mode(args, EVALS_DIR)))  # --case shows model text
        except (OSError, ValueError) as e:
            sys.exit(f"eval.py: {e}")
        return
    cpu_defaults(args)  # the model-driven modes only
    args.dtype = args.dtype or default_dtype()
    from persuarena import models
    models.set_cpu_threads()  # one thread per core the machine's load leaves free
    if args.play:
        if len(args.persuadee) > 1:
            sys.exit("eval.py: --play takes one --persuadee (you are the persuader)")
        from lab import play
        play.play(args.play, args.persuadee[0], seed=args.seed, t_max=args.t_max,
                  out_root=EVALS_DIR, max_new_tokens=args.max_new_tokens, dtype=args.dtype,
                  probe_space=args.probe_space, probe_signs=args.probe_signs,
                  sampling=cell_sampling(args, "human"), decision=args.decision,
                  allow_insecure_key=args.allow_insecure_key, name=args.name,
                  overwrite=args.overwrite)
        return
    instances = chosen_instances(args)
    root, cells = evaluation_cells(args, instances)
    open_folder(args, root, cells, instances)  # checked and locked before any weight loads
    try:
        run_cells(args, instances, cells)
    finally:
        runs.unlock(root)
    ranks.finish_distributed()


def evaluation_cells(args, instances):
    """The evaluation's folder (evals/NAME) and its cells: (persuader, persuadee, folder,
    settings) for every pair of a grid, the folder itself for one pair."""
    pairs = [(p, q) for p in args.persuader for q in args.persuadee]
    split = args.scenarios + (f"_{args.subset}" if args.subset else "")
    base = args.name or (f"{report.slug(pairs[0][0])}_vs_{report.slug(pairs[0][1])}_{split}_s{args.seed}"
                         if len(pairs) == 1 else f"grid_{split}_s{args.seed}")
    root = Path(EVALS_DIR) / base
    return root, [(p, q, root if len(pairs) == 1 else root / f"{report.slug(p)}_vs_{report.slug(q)}",
                   run_settings(args, p, q)) for p, q in pairs]


def open_folder(args, root, cells, instances):
    """Before any weight loads: the folder checked (runs.check_folder), locked by rank 0,
    emptied by --overwrite, its settings pinned by --resume, --kv-blocks checked."""
    first = int(os.environ.get("RANK", 0)) == 0
    runs.check_folder(root.parent, root.name, "eval.py", args.resume, args.overwrite, first=first)
    for _, _, out_dir, settings in cells if args.resume else ():
        if differ := episode_log.settings_mismatch(out_dir, settings, sys.modules[__name__]):
            sys.exit(f"eval.py: {out_dir} was run with other settings ({'; '.join(differ)}): "
                     "a resumed evaluation keeps every setting; pass another --name or "
                     "--overwrite")
    pools.check_kv_blocks(args, instances)
    if first:
        runs.lock(root, "eval.py")
        if args.overwrite:
            runs.clear(root)  # this evaluation's folder only


def run_cells(args, instances, cells):
    """Every cell evaluated (weights loaded once per name), each summary printed by rank 0, and
    a grid's table."""
    loaded, results, rank = {}, {}, distributed()[0]  # under torchrun rank 0 prints
    for p, q, out_dir, settings in cells:
        if rank == 0:
            print(f"eval.py: {len(instances)} {args.scenarios} scenario(s), persuader {p}, "
                  f"persuadee {q} -> {out_dir} (loading the models)", file=sys.stderr, flush=True)
        if rank == 0 and (line := sampling_line(args, p)):
            print(line)
        try:
            results[(p, q)] = run_eval(
                p, q, instances, out_dir, seed=args.seed, t_max=args.t_max, loaded=loaded,
                max_new_tokens=args.max_new_tokens, judge=args.judge, anchor=settings["anchor"],
                tagger=args.tagger, kv_blocks=args.kv_blocks, dtype=args.dtype,
                probe_space=args.probe_space, probe_signs=args.probe_signs, settings=settings,
                resume=args.resume, sampling=cell_sampling(args, p),
                shaping_lambda=settings["shaping_lambda"], decision=args.decision,
                allow_insecure_key=args.allow_insecure_key, subset=args.subset_name)
        except ValueError as e:  # a malformed episodes.jsonl, a prompt too long for a model
            sys.exit(f"eval.py: {e}")
        if rank == 0:
            print(f"\n== persuader {p}, persuadee {q}, judge {args.judge or q} -> {out_dir}\n"
                  f"{analyses.format_table(results[(p, q)])}")
    if len(cells) > 1 and rank == 0:
        print("\n" + comparisons.grid_table(results))
    if rank == 0:
        print("\n" + "\n".join(f"report: {out_dir / 'report.html'}" for *_, out_dir, _ in cells))


if __name__ == "__main__":
    main()
