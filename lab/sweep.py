"""
sweep.py: the paper's lambda experiment (Table 2, Fig. 7) in one command, at any preset.

Every (lambda, seed) arm is a training run (train.py, called through its main) that evaluates its
policy on the same held-out episodes every --eval-every steps (train.evaluate_heldout: one episode per
scenario, the persuadee's random streams keyed by (seed, instance, side), so two arms of one
seed, and the initial policy, meet the same persuadee draws: only the weights differ). The
initial policy of each seed is evaluated the same way (step 0). Then, from the runs' records:

    summary.json   arms: one entry per (lambda, seed, checkpoint step, step 0 included) with
                   held-out full_accept, full_or_conditional, mean_belief_change (mean b_T - b_0),
                   mean dense return, and the training steps' dead-group, rescued (dead groups
                   the dense term gives an advantage) and collapsed-group shares;
                   clipped_steps: per arm, the steps whose gradient norm exceeded train.GRAD_CLIP
    table.md       (lab/sweep_table.py) per lambda its last checkpoint (the primary row) and its best (selected on
                   the same held-out episodes, labelled so), seeds pooled: Wilson intervals of
                   the acceptance shares, a t interval of b_T - b_0, and paired tests (pairs:
                   same seed, same scenario) against lambda = 0 at the same step (where the sweep has that
                   arm: a sweep may leave it out, e.g. when lambda 0 cannot learn) and against the
                   initial policy: exact McNemar on full acceptance, Wilcoxon on b_T - b_0;
                   with sweep_table.SEED_LEVEL_MIN seeds or more each comparison also carries seed_level, a
                   paired t test over the seeds' means (the seed is the unit of replication of
                   a training effect), and each row between_seed_sd; the differences the
                   episode pairs and, from sweep_table.SEED_LEVEL_MIN seeds, the seeds detect at 80% power
                   (t; summary.json "power", "power.seed_level"); with --frozen-control, each
                   arm against a same-seed run at lr 0 on the training episodes themselves
                   (paired by step, group and member): a t test over the seeds' mean
                   differences (seed_level), and beside it a group as one cluster; and how
                   many tests the table holds, none corrected
                   fig7: per lambda the paper's Fig. 7 from the training steps (by step and
                   over the run): dead-group share, the share of dead groups the dense term
                   rescues, the dense term's share of |A|, the clipped steps and tokens
    curves.png     held-out b_T - b_0 and full acceptance by step, per lambda, seed bands
    fig7.png       the Fig. 7 quantities by training step, per lambda (running means)
    effect.png     each lambda's last checkpoint minus the initial policy, 95% intervals
    training.png   with --frozen-control, every arm's training episodes against its control

Seed by seed (a sitting cut short leaves whole pairs): its initial evaluation, then its arms.
Arms already trained are reused; a killed arm resumes from its checkpoint (train.py --resume).
The arms' run folders are run outputs, ignored by git; the sweep's summary, table and figures
are what is committed.
A re-run keeps the settings sweep.json recorded (cli.pin_settings, as train.py --resume keeps
config.json): a changed one is refused in one line, --overwrite starts the sweep again. Arguments
sweep.py does not know go to every arm's train.py (e.g. --judge none --group-size 4), except the
flags the sweep sets itself (SWEEP_SETS), which are refused; "{seed}" in one of them becomes the
arm's seed (--persuader random:tiny-llama@{seed}: distinct initial weights a seed); every arm's
values are checked as train.py checks them before the first arm trains.

    python -m lab.sweep --preset tiny --lams 0 1 --seeds 0 --steps 4 --eval-every 2 --eval-limit 2 --name smoke
    python -m lab.sweep --preset cpu --lams 0 0.5 1 --seeds 0 1 --steps 60 --eval-every 20 \\
        --eval-limit 16 --decision logit --frozen-control --name cpu-logit -- --judge none
"""
import json
import math
import os
import re
import shutil
import sys
from pathlib import Path

from tqdm import tqdm

from lab import analyses, audit, run_selection
from lab import cli
from lab import jsonl
from lab import records
from lab import runs
from lab import sweep_table
from lab.sweep_table import (belief_changes, count_tests, fig7_rows, format_table, frozen_rows,
                              sweep_power, table_rows)
from lab.jsonl import read_jsonl

LAMS = (0.0, 0.5, 1.0)  # the paper's three arms
SEEDS = (0, 1)
SWEEPS_DIR = "sweeps"
FROZEN = "frozen"  # the control arm's label: the same seed trained at lr 0
SEED_FIELD = "{seed}"  # in an argument after --, the arm's seed (random:tiny-llama@{seed}: each
# seed's own initial weights, the frozen control's the same as its arm's)
SWEEP_ARMS_MAX = 64  # lambdas x seeds at most: each arm is a training run with its own folder
SWEEP_FILES = re.compile(r"sweep\.json|summary\.json|table\.md|\w+\.png|runs|initial_s-?\d+"
                         r"|\.lock|\.persuarena-run|\..*\.tmp")  # what a sweep writes
SWEEP_SETS = ("preset", "lam", "seed", "steps", "eval_every", "eval_limit", "decision", "save_every",
              "out", "name", "eval_fidelity", "resume", "overwrite")  # train.py flags the sweep sets per arm


def parse_args(argv=None):
    """(args, train.py's extra arguments), every value checked, and on a re-run (sweep.json
    there, no --overwrite) the sweep's recorded settings pinned as train.py --resume pins
    config.json (cli.pin_settings): what the command line leaves out is the sweep's own, what it
    names with another value is refused in one line."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = cli.new_parser("python -m lab.sweep", __doc__)
    p.add_argument("--preset", default="tiny", help="train.py preset of every arm")
    p.add_argument("--lams", type=float, nargs="+", default=list(LAMS),
                   help="the lambda of each arm (sweep.LAMS)")
    p.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS),
                   help="the seeds of each lambda (sweep.SEEDS)")
    p.add_argument("--steps", type=int, required=True, help="training steps of every arm")
    p.add_argument("--eval-every", type=int, required=True, help="held-out evaluation (and a "
                   "kept checkpoint) every K steps; --steps must be a multiple of it")
    p.add_argument("--eval-limit", type=int, required=True, help="held-out scenarios per "
                   "evaluation, stratified over domain x resistance (arena.stratified)")
    p.add_argument("--save-every", type=int, help="a resumable checkpoint every K steps (default "
                   "--eval-every): a killed arm resumes from its last one, losing less")
    p.add_argument("--name", required=True, help=f"the sweep's folder, {SWEEPS_DIR}/NAME")
    p.add_argument("--out", default=SWEEPS_DIR, help="the folder of sweep folders")
    p.add_argument("--overwrite", action="store_true", help="delete the sweep's folder and start "
                   "again (a re-run otherwise keeps its recorded settings and trained arms)")
    p.add_argument("--frozen-control", action="store_true",
                   help="also train each seed at lr 0: the same instances and random streams, "
                        "only the weights differ")
    cli.add_decision_flag(p)
    args, extra = p.parse_known_args(argv)
    args.train_args = [a for a in extra if a != "--"]
    problems = argument_problems(args)
    if not problems and not args.overwrite:
        pin_recorded(args, p, argv)
        problems = argument_problems(args)
    if problems:
        p.exit(2, f"lab.sweep: {'; '.join(problems)}\n")  # one line, as eval.py's refusals
    return args, args.train_args


def argument_problems(args):
    """What is wrong with the sweep's own values and with the flags it passes on (train.py's
    own checks of every arm come later, in check_arms, still before any arm trains)."""
    problems = [f"--{k.replace('_', '-')} {getattr(args, k)} must be at least 1"
                for k in ("steps", "eval_every", "eval_limit", "save_every")
                if getattr(args, k) is not None and getattr(args, k) < 1]
    if not problems and args.steps % args.eval_every:
        problems.append(f"--steps {args.steps} is not a multiple of --eval-every {args.eval_every}")
    if problem := runs.name_problem(args.name):  # the one name rule (lab/runs.py)
        problems.append(f"--name {args.name!r} {problem}")
    for flag, values in (("--lams", args.lams), ("--seeds", args.seeds)):
        if dupes := sorted({v for v in values if values.count(v) > 1}):
            problems.append(f"{flag} names {', '.join(f'{v:g}' for v in dupes)} more than once")
    if bad := [lam for lam in args.lams if not math.isfinite(lam) or not 0 <= lam <= cli.LAM_MAX]:
        problems.append(f"--lams {', '.join(map(str, bad))}: each must be a number in [0, {cli.LAM_MAX:g}]")
    if len(args.lams) * len(args.seeds) > SWEEP_ARMS_MAX:
        problems.append(f"--lams x --seeds make {len(args.lams) * len(args.seeds)} arms, more than "
                        f"{SWEEP_ARMS_MAX} (each a training run and its folder); pass fewer")
    if taken := sweep_owned(args):
        problems.append(f"{', '.join(taken)} after -- would override what the sweep sets for every "
                        "arm (and label); pass them as the sweep's own flags or drop them")
    return problems


def sweep_owned(args):
    """The flags among train.py's extra arguments that the sweep sets itself (read as train.py's
    parser reads them: abbreviations and --flag=value count)."""
    from persuarena import train
    owned = set(SWEEP_SETS)
    try:
        named = cli.explicit_settings(cli.train_parser(train), args.train_args, known=True)
    except SystemExit:
        return []  # a malformed value: train.py's parser names it in check_arms
    return [f"--{k.replace('_', '-')}" for k in sorted(named & owned)]


def pin_recorded(args, parser, argv):
    """A re-run of a sweep: its sweep.json's settings over what the command line leaves out,
    a changed one refused in one line (cli.pin_settings)."""
    path = Path(args.out) / args.name / "sweep.json"
    if not path.is_file():
        return
    try:
        recorded = jsonl.loads(path.read_text())
        assert isinstance(recorded, dict)
    except (OSError, ValueError, AssertionError):
        raise runs.say_error("lab.sweep", f"{path} cannot be read; restore it, or pass --overwrite "
                             "to start the sweep again")
    explicit = cli.explicit_settings(parser, argv, known=True) | ({"train_args"} if args.train_args else set())
    cli.pin_settings(args, recorded, explicit, "lab.sweep", not_settings=("name", "out", "overwrite"),
                     record=str(path), again="a re-run of a sweep", parser=parser,
                     keys=set(vars(args)) - {"overwrite", "save_every"}, optional=("save_every",),
                     restart="pass --overwrite to start the sweep again (or another --name)")


def arm_name(lam, seed):
    return f"{FROZEN}_s{seed}" if lam == FROZEN else f"lam{lam:g}_s{seed}"


def arm_argv(args, extra, lam, seed, runs_dir, check_fidelity=False):
    """train.py's arguments for one arm (the frozen control: lr 0, after the extra arguments so that
    it wins over an --lr given there for the learning arms; no held-out evaluation, which would
    repeat the initial policy's). The probes' fork-against-full-forward check runs in the
    initial policy's evaluation only (check_fidelity): the persuadee is frozen, so the arms'
    evaluations would repeat it, and on a CPU it is most of an evaluation's time."""
    frozen = lam == FROZEN
    return ["--preset", args.preset, "--lam", str(0.0 if frozen else lam), "--seed", str(seed),
            "--steps", str(args.steps), "--eval-every", "0" if frozen else str(args.eval_every),
            "--eval-limit", str(args.eval_limit), "--decision", args.decision,
            "--save-every", str(args.steps if frozen else getattr(args, "save_every", None) or args.eval_every),
            "--out", str(runs_dir), "--name", arm_name(lam, seed),
            *([] if check_fidelity else ["--eval-fidelity", "0"]),
            *(a.replace(SEED_FIELD, str(seed)) for a in extra), *(["--lr", "0"] if frozen else [])]


def _steps_in(path, key="step"):
    if not path.is_file():
        return set()
    return {row[key] for _, row in read_jsonl(path, what=str(path))}


def arm_finished(run_dir, args, frozen=False):
    """Every step trained and every held-out evaluation written."""
    wanted = set() if frozen else set(range(args.eval_every, args.steps + 1, args.eval_every))
    return (args.steps in _steps_in(run_dir / "metrics.jsonl")
            and wanted <= _steps_in(run_dir / "evals.jsonl"))


def arm_command(argv, run_dir):
    """train.py's arguments for an arm as it will run: fresh, or resumed from its last checkpoint."""
    if (run_dir / "latest").is_file():
        return argv + ["--resume"]
    return argv + ["--overwrite"] if run_dir.exists() else argv  # started, killed before a checkpoint


def train_arm(argv, run_dir):
    """train.py on one arm: fresh, or resumed from its last checkpoint."""
    from persuarena import train
    train.main(arm_command(argv, run_dir))


def check_arms(args, extra, arms, runs_dir):
    """Every arm's train.py arguments checked as train.py checks them (cli.train_args: values,
    models' names, scenarios, a resumed arm's config.json), before the first arm trains; the
    first problem is one line naming the arm."""
    from persuarena import train
    for lam, seed in arms:
        run_dir = runs_dir / arm_name(lam, seed)
        if run_dir.exists() and arm_finished(run_dir, args, lam == FROZEN):
            continue
        try:
            cli.train_args(arm_command(arm_argv(args, extra, lam, seed, runs_dir), run_dir), train)
        except SystemExit as e:  # argparse has printed its own line when the code is a number
            why = e.code if isinstance(e.code, str) else "train.py refused the arguments after -- (above)"
            raise runs.say_error("lab.sweep", f"arm {arm_name(lam, seed)}: {why}") from None


def evaluate_initial(argv, folder):
    """The initial policy on the arms' held-out episodes (train.evaluate_heldout at step 0, the arm's
    own settings), into folder/eval-0 and folder/evals.jsonl."""
    import torch

    from persuarena import engine
    from lab import plan
    from persuarena import train
    args = cli.train_args(argv, train)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sizes = plan.device_plan(args, 1, device)["sizes"] if device.type == "cuda" else {}
    from persuarena import models
    persuader_model, tokenizer = train.load(args.persuader, args.dtype, device, args.seed)  # as train.py
    persuadee_loaded = ((models.copied(persuader_model, getattr(torch, args.dtype)), tokenizer)
                        if args.persuadee == args.persuader else  # read once, as train.py does
                        train.load(args.persuadee, args.dtype, device))
    actor = engine.Engine(persuader_model, tokenizer, **sizes.get("persuader", {}))
    persuadee = engine.Engine(*persuadee_loaded, **sizes.get("persuadee", {}))
    judge = (None if args.judge == "none" else persuadee if args.judge in (None, args.persuadee)
             else engine.Engine(*train.load(args.judge, args.dtype, device), **sizes.get("judge", {})))
    folder.mkdir(parents=True, exist_ok=True)
    train.evaluate_heldout(actor, persuadee, judge, args, 0, 0, folder)


def step_window(metrics, step, every, key):
    """The mean of a training metric over the steps that led to a checkpoint, (step - every, step]."""
    values = [m[key] for m in metrics if step - every < m["step"] <= step and m.get(key) is not None]
    return sum(values) / len(values) if values else None


def rescued_window(metrics, step, every):
    """The share of the dead groups of (step - every, step] that the dense term rescued, pooled
    over those steps (a step's dead_rescued_share weighted by its dead groups; a step has the same
    number of groups throughout a run), None when no group was dead: a mean of per-step shares
    would count every step without a dead group as 0."""
    window = [m for m in metrics if step - every < m["step"] <= step
              and m.get("dead_group_share") is not None and m.get("dead_rescued_share") is not None]
    dead = sum(m["dead_group_share"] for m in window)
    return sum(m["dead_group_share"] * m["dead_rescued_share"] for m in window) / dead if dead else None


def arm_entries(lam, seed, run, initial, every):
    """summary.json's entries of one arm: the initial policy (step 0) and each checkpoint, with
    the shares of its held-out persuader messages that are degenerate, warm only or ask
    (lab/audit.py's message scores)."""
    entries = []
    for step, episodes in [(0, initial)] + sorted(run["episodes"].items()):
        summary = analyses.summarize(episodes, lam)
        changes = list(belief_changes(episodes).values())
        entries.append(dict(
            lam=lam, seed=seed, step=step, n=len(episodes), full_accept=summary["full_accept"],
            full_or_conditional=summary["full_or_conditional"],
            mean_belief_change=sum(changes) / len(changes) if changes else None,
            mean_dense_return=summary["mean_dense_return"],
            dead_group_share=step_window(run["metrics"], step, every, "dead_group_share"),
            rescued_share=rescued_window(run["metrics"], step, every),
            collapsed_group_share=step_window(run["metrics"], step, every,
                                              "collapsed_group_share"),
            messages=audit.score_texts([t["text"] for e in episodes for t in e.transcript
                                        if t["role"] == "persuader"])))  # what the policy says
    return entries


def clipped_steps(runs, clip):
    """{arm: steps whose gradient norm (before clipping, as train.py logs it) exceeded clip}.
    Where every group is dead for the outcome term, lambda only scales the whole advantage, which
    AdamW's update does not see up to its eps: two such arms train the same weights only if no
    step of either was clipped (BENCHMARKS.md's tag sweep)."""
    return {arm_name(lam, s): sum(m.get("grad_norm") is not None and m["grad_norm"] > clip
                                  for m in run["metrics"])
            for lam, by_seed in runs.items() for s, run in by_seed.items()}


def start_folder(root, args):
    """The sweep's folder: emptied by --overwrite (only a folder a sweep wrote), and its settings
    recorded in sweep.json (what a re-run pins)."""
    if args.overwrite and root.is_dir():
        foreign = [e.name for e in root.iterdir() if not SWEEP_FILES.fullmatch(e.name)]
        if foreign:
            raise runs.say_error("lab.sweep", f"--overwrite would delete {root}, which holds "
                                 f"{', '.join(sorted(foreign)[:4])}, not a sweep's files; nothing "
                                 "was deleted: pass another --name or --out")
        runs.clear(root)  # its lock and marker kept: the lock is held on that file
    root.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("overwrite",)}
    runs.write_in(root, "sweep.json", json.dumps(settings, indent=2) + "\n", who="lab.sweep")


def main(argv=None):
    args, extra = parse_args(argv)
    root = Path(args.out) / args.name
    runs_dir = root / "runs"
    arms = [(lam, seed) for seed in args.seeds for lam in args.lams]
    arms += [(FROZEN, seed) for seed in args.seeds] if args.frozen_control else []
    check_sweep_folder(root)
    runs.lock(root, "lab.sweep")  # before anything is deleted: a running sweep is refused
    if args.overwrite and root.is_dir():
        start_folder(root, args)  # emptied before the arms are checked: none of them resumes
    try:
        check_arms(args, extra, arms, runs_dir)  # every arm's values, before the first trains
    except ValueError as e:  # an arm's metrics or evals file unreadable
        raise runs.say_error("lab.sweep", f"{e}; delete that arm's folder (it trains again) or "
                             "pass --overwrite") from None
    start_folder(root, args)
    bar = tqdm(total=len(arms) + len(args.seeds), desc="sweep arms")
    for seed in args.seeds:  # seed by seed, so that a sitting cut short leaves whole pairs
        folder = root / f"initial_s{seed}"  # the initial policy first: every arm is tested against it
        if 0 not in _steps_in(folder / "evals.jsonl"):
            evaluate_initial(arm_argv(args, extra, args.lams[0], seed, runs_dir, True), folder)
        bar.update()
        for lam in [lam for lam, s in arms if s == seed]:
            run_dir = runs_dir / arm_name(lam, seed)
            bar.set_postfix_str(arm_name(lam, seed))
            if not arm_finished(run_dir, args, lam == FROZEN):
                train_arm(arm_argv(args, extra, lam, seed, runs_dir), run_dir)
            bar.update()
    bar.close()
    return summarize_sweep(root, args)


def plot_training(root, runs, args):
    """training.png: every arm's training episodes against its same-seed frozen control, step by
    step (the mean b_T - b_0 of each step's episodes, metrics.jsonl's belief_change)."""
    from lab import plots
    changes = lambda rows: [m["belief_change"] for m in rows]
    control = {s: changes(row for _, row in read_arm(
                   read_jsonl, root / "runs" / arm_name(FROZEN, s) / "metrics.jsonl")) for s in args.seeds}
    arms = {f"lambda {lam:g}": {s: changes(runs[lam][s]["metrics"]) for s in args.seeds} for lam in args.lams}
    plots.plot_training(arms, control, root)


def write_summary(root, summary):
    """summary.json through the sweep folder's one writer (runs.write_in: atomic, never through a
    link), every non-finite number written as null (jsonl.finite: an arm's record holding NaN
    or an infinity never reaches the summary or the table). Returns the summary as written."""
    summary = jsonl.finite(summary)
    runs.write_in(root, "summary.json", json.dumps(summary, indent=1, default=str, allow_nan=False),
                  who="lab.sweep")
    return summary


def write_table(root, table):
    """table.md through the sweep folder's one writer (runs.write_in)."""
    runs.write_in(root, "table.md", table, who="lab.sweep")


def check_sweep_folder(root):
    """A sweep folder is written only where it is: refused in one line when it, or an entry in
    it, is a link (its arms, summary and table would land where the link points)."""
    if root.is_symlink():
        raise runs.say_error("lab.sweep", f"{root} is a link (-> {os.readlink(root)}), not a sweep "
                             "folder; pass another --name or --out")
    if root.exists() and not root.is_dir():
        raise runs.say_error("lab.sweep", f"{root} is a file, not a sweep folder; pass another --name")
    if root.is_dir() and (links := [e.name for e in sorted(root.iterdir()) if e.is_symlink()]
                          or [f"runs/{n}" for n in runs.links_in(root / "runs")]):  # not read
        # through a link: runs/ is looked into only once it is no link itself
        raise runs.say_error("lab.sweep", f"{root} holds links ({', '.join(links[:4])}), which a "
                             "sweep never writes through; remove them, or pass another --name")


def read_arm(reader, path):
    """reader(path), or a one-line refusal naming the arm's file or folder that cannot be read."""
    try:
        return reader(path)
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise runs.say_error("lab.sweep", f"{path} cannot be read ({type(e).__name__}: {e}); "
                             "delete that arm's folder (it trains again) or pass --overwrite") from None


QUOTED = 3  # held-out messages quoted an arm and checkpoint in messages.json


def heldout_episodes(root, lam, seed, step):
    """The episodes.jsonl of an arm's held-out evaluation at a step (0: the seed's initial policy)."""
    if step == 0:
        return Path(root) / f"initial_s{seed}" / "eval-0" / "episodes.jsonl"
    return Path(root) / "runs" / arm_name(lam, seed) / f"eval-{step}" / "episodes.jsonl"


def message_report(root, lams, seeds, steps):
    """messages.json: per arm, the held-out persuader messages' scores (audit.score_texts: the
    degenerate, warm-only and asking shares) at step 0 and at the last checkpoint, and the first
    QUOTED messages of each, as written; per lambda every seed's together. What a policy learned,
    read beside the number it raised. Returns it, and the lines appended to table.md."""
    report, share = {"arms": {}, "all": {}}, (lambda x: "–" if x is None else f"{x:.0%}")
    lines = ["", "Held-out persuader messages (lab.audit's scores), initial policy -> last checkpoint "
             "(messages.json quotes them):", "",
             "| lambda | seed | messages | degenerate | warm only | ask |", "| --- | --- | --- | --- | --- | --- |"]
    for lam in lams:
        every = {0: [], steps: []}
        for seed in seeds:
            arm = report["arms"][arm_name(lam, seed)] = {}
            for step in (0, steps):
                path = heldout_episodes(root, lam, seed, step)
                texts = audit.persuader_texts(path) if path.is_file() else []
                every[step] += texts
                arm[str(step)] = dict(audit.score_texts(texts), quoted=texts[:QUOTED])
        report["all"][f"lam{lam:g}"] = {str(step): audit.score_texts(t) for step, t in every.items()}
        for seed, by_step in [*((s, report["arms"][arm_name(lam, s)]) for s in seeds),
                              ("all", report["all"][f"lam{lam:g}"])]:
            a, b = by_step["0"], by_step[str(steps)]
            lines.append(f"| {lam:g} | {seed} | {a['messages']} -> {b['messages']} | "
                         f"{share(a['degenerate'])} -> {share(b['degenerate'])} | {share(a['warm_only'])}"
                         f" -> {share(b['warm_only'])} | {share(a['ask'])} -> {share(b['ask'])} |")
    return report, lines


def write_message_report(root, lams, seeds, steps):
    """messages.json and table.md's section (message_report), a second report replacing the first."""
    root = Path(root)
    report, lines = message_report(root, lams, seeds, steps)
    runs.write_in(root, "messages.json", json.dumps(report, indent=1, ensure_ascii=False) + "\n",
                  who="lab.sweep")
    table = (root / "table.md").read_text() if (root / "table.md").is_file() else ""
    table = table.split("\n" + lines[1])[0].rstrip("\n") + "\n" + "\n".join(lines) + "\n"
    runs.write_in(root, "table.md", table, who="lab.sweep")
    print("\n".join(lines[1:]))
    return report


def summarize_sweep(root, args):
    """summary.json, table.md and the figures from the sweep folder's runs."""
    from lab import plots
    initial = {s: read_arm(records.load_episodes, root / f"initial_s{s}" / "eval-0" / "episodes.jsonl")
               for s in args.seeds}
    runs = {lam: {s: read_arm(run_selection.read_run, root / "runs" / arm_name(lam, s)) for s in args.seeds}
            for lam in args.lams}
    held_out = {lam: {s: {0: initial[s], **runs[lam][s]["episodes"]} for s in args.seeds}
                for lam in args.lams}
    entries = [e for lam in args.lams for s in args.seeds
               for e in arm_entries(lam, s, runs[lam][s], initial[s], args.eval_every)]
    steps = [0] + list(range(args.eval_every, args.steps + 1, args.eval_every))
    rows = table_rows(held_out, args.lams, args.seeds, steps[1:])
    frozen = None
    if args.frozen_control:
        control = {s: {"rollouts": [row for _, row in read_arm(
                    read_jsonl, root / "runs" / arm_name(FROZEN, s) / "rollouts.jsonl")]}
                   for s in args.seeds}
        frozen = frozen_rows(runs, control, args.lams, args.seeds, args.steps)
        plot_training(root, runs, args)
    power = sweep_power(rows, [ep for s in args.seeds for ep in initial[s]])
    first = root / f"initial_s{args.seeds[0]}" / "eval-0" / "summary.json"
    subset = read_arm(lambda p: jsonl.loads(p.read_text()).get("subset"), first) if first.is_file() else None
    from persuarena import train
    fig7 = fig7_rows({lam: {s: runs[lam][s]["metrics"] for s in args.seeds} for lam in args.lams},
                     args.lams, args.seeds, train.GRAD_CLIP)
    summary = dict(settings=jsonl.loads((root / "sweep.json").read_text()),
                   clipped_steps=clipped_steps(runs, train.GRAD_CLIP), fig7=fig7,
                   subset=(subset or f"{args.eval_limit} scenarios").removeprefix("heldout "), arms=entries,
                   table=rows, frozen_control=frozen, power=power, tests=count_tests(rows, frozen))
    summary = write_summary(root, summary)
    header = (f"# sweep {args.name}: preset {args.preset}, lambdas {args.lams}, seeds {args.seeds}, "
              f"{args.steps} steps, held-out {summary['subset']} (arena.stratified), decision {args.decision}")
    table = format_table(summary["table"], summary["frozen_control"], header, summary["power"],
                         summary["fig7"])
    write_table(root, table)
    plots.plot_sweep(entries, summary["table"], root)
    plots.plot_fig7(summary["fig7"], root, sweep_table.PAPER_DENSE_SHARE)
    print(table)
    summary["messages"] = write_message_report(root, args.lams, args.seeds, args.steps)
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
