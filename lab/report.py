"""
Eval folders (evals/NAME): writing one (save_run: episodes.jsonl, summary.json, fidelity.json,
the figures and report.html, lab/html_report.py's page of every episode), recomputing its summary,
figures and page from its episodes alone (analyze), reading what a folder or its training run
recorded (the lambda, the anchor, the roles), and eval.py's model-free modes over folders:
--compare (compare.json and report-compare.html), --compare-many, --table, --analyze, --case,
--overlay, --runs and --plot-run (analysis_mode). The analyses themselves are lab/analyses.py's,
the figures lab/plots.py's.

    python eval.py --analyze evals/NAME                         # summary.json and plots from episodes.jsonl
    python eval.py --case evals/NAME heldout-017                # Table 8: one episode turn by turn
    python eval.py --compare evals/A evals/B                    # paired comparison, B against A
    python eval.py --compare-many evals/B1 evals/B2 --policy evals/P   # discordant pairs, closed by none
    python eval.py --overlay evals/A evals/B                    # Fig. 6: belief and per-probe trajectories
    python eval.py --runs runs/A runs/B                         # Table 9, Fig. 3, Fig. 7: checkpoint selection
    python eval.py --plot-run runs/NAME                         # training curves -> curves.png
    python -m pytest -q tests/test_eval.py

An evaluation draws its PNGs each time it is written; PERSUARENA_FIGURES=0 in the environment
leaves them out (summary.json, report.html and the episodes are written all the same), for the
many small evaluations of a sweep or a test suite: eval.py --analyze FOLDER draws them later.
"""
import json
import math
import os
import re
import sys
from pathlib import Path

from persuarena import arena
from persuarena import rpo
from lab import analyses, comparisons, html_report, jsonl, moves, records, run_selection, runs, served

FIGURES_ENV = "PERSUARENA_FIGURES"  # 0 in the environment: no PNGs when a folder is written
RUN_KEYS = ("roles", "settings", "requests", "subset")  # summary.json's record of how the run was played


def save_run(out_dir, episodes, summary, fidelity=None):
    """Write episodes.jsonl, summary.json, fidelity.json (the fork and reference read-outs, when
    given), beliefs.png, probes.png and moves.png (when labelled), each atomically."""
    out_dir = Path(out_dir)
    try:  # a full disk (or any failed write) is one line; what was written whole stays
        out_dir.mkdir(parents=True, exist_ok=True)
        runs.write_atomic(out_dir / "episodes.jsonl", "".join(jsonl.json_line(ep.record(training=False)) for ep in episodes))
        if fidelity is not None:
            runs.write_atomic(out_dir / "fidelity.json", json.dumps(fidelity) + "\n")
        runs.write_atomic(out_dir / "summary.json", json.dumps(jsonl.finite(summary), indent=2, allow_nan=False) + "\n")
        save_plots(out_dir, episodes, summary)
    except OSError as e:
        raise SystemExit(runs.write_failure(
            "eval.py", "the summary, figures and report", out_dir, e, "every episode played is "
            "in episodes.jsonl (eval.py --analyze FOLDER writes the rest)")) from None


def save_plots(out_dir, episodes, summary):
    """beliefs.png and probes.png (when some episode has beliefs), moves.png (when labelled), and
    report.html (lab/html_report.py: every episode and its transcript, readable in a browser).
    With PERSUARENA_FIGURES=0 in the environment, report.html alone."""
    if (said := os.environ.get(FIGURES_ENV, "1")) not in ("0", "1"):
        raise SystemExit(f"lab.report: {FIGURES_ENV}={said!r} in the environment; set it to 0 (no "
                         "PNGs) or 1 (the default), or unset it")
    if said == "1":
        from lab import plots  # matplotlib loads where a figure is drawn, not with every evaluation
        believed = analyses.with_beliefs(episodes)
        if believed:  # a persuadee served without log-probs has no belief to plot
            plots.plot_beliefs(believed, out_dir / "beliefs.png")
            plots.plot_probes(believed, out_dir / "probes.png")
        if "moves" in summary:
            plots.plot_moves(summary, out_dir / "moves.png")
    html_report.write_report(out_dir, episodes, summary)


def scenarios_by_id(path=None):
    """Every scenario of a scenarios file (default arena.SCENARIOS_PATH) by id (the hidden
    profiles the keyword tagger audits)."""
    return {s["id"]: s for s in arena.load_scenarios(path or arena.SCENARIOS_PATH)}


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
    if links := runs.links_in(run_dir):
        raise ValueError(f"{run_dir} holds links ({', '.join(links[:4])}), which eval.py never "
                         "reads or writes through; remove them (copy the folder with cp -L)")
    episodes = records.load_episodes(run_dir)
    untagged = [ep for ep in episodes if ep.moves is None]
    if untagged:
        config = run_dir.parent / "config.json"
        path = (jsonl.loads(config.read_text()).get("scenarios") if config.is_file() else None) or arena.SCENARIOS_PATH
        scenarios = scenarios_by_id(path)
        unknown = sorted({ep.scenario_id for ep in untagged} - set(scenarios))
        if unknown:
            print(f"eval.py: warning: {run_dir}: scenarios {', '.join(unknown[:3])}"
                  f"{', ...' if len(unknown) > 3 else ''} are not in {path}; no move labels", file=sys.stderr)
        else:
            moves.tag_episodes(untagged, scenarios)
    fidelity = read_fidelity(run_dir / "fidelity.json")
    lam = folder_lambda(run_dir) if shaping_lambda is None else shaping_lambda
    summary = analyses.summarize_run(episodes, fidelity, lam)
    path = run_dir / "summary.json"
    if path.is_file():  # what the run recorded of itself, which its episodes do not hold
        before = read_json(path, "delete it (its episodes give the rest)")
        summary.update({k: before[k] for k in RUN_KEYS if k in before} if isinstance(before, dict) else {})
    runs.write_atomic(path, json.dumps(jsonl.finite(summary), indent=2, allow_nan=False) + "\n")
    save_plots(run_dir, episodes, summary)
    return summary


def read_json(path, fix):
    """A JSON file an evaluation wrote, or a ValueError naming it and fix (one line)."""
    try:
        return jsonl.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        why = e.msg if isinstance(e, json.JSONDecodeError) else (getattr(e, "strerror", None) or type(e).__name__)
        raise ValueError(f"{path} cannot be read ({why}); {fix}") from None


def read_fidelity(path):
    """fidelity.json (the probes' fork and reference read-outs, eval.py --eval-fidelity), or None
    when absent; one that is not what eval.py writes is a ValueError naming it."""
    if not path.is_file():
        return None
    fix = "delete it (the summary then leaves the probe fidelity out) or restore it"
    fidelity = read_json(path, fix)
    keys = ("fork", "reference", "vocabulary")
    shapes = {k: _shape(fidelity[k]) for k in keys if isinstance(fidelity, dict) and k in fidelity}
    if not (shapes.get("fork") and shapes.get("reference") and len(set(shapes.values())) == 1):
        raise ValueError(f"{path} does not hold fork and reference read-outs (lists of finite "
                         f"numbers of one shape, as eval.py writes them); {fix}")
    return fidelity if shapes["fork"] != (0,) else None


def _shape(value):
    """The shape of a nested list of finite numbers (rows of one length), else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return () if math.isfinite(value) else None
    if not isinstance(value, list):
        return None
    inner = {_shape(v) for v in value}
    return (len(value), *inner.pop()) if len(inner) == 1 and None not in inner else \
        ((0,) if not value else None)


def run_config(persuader):
    """The config.json of the training run a checkpoint folder belongs to, else {}."""
    config = Path(persuader).parent / "config.json"
    if Path(persuader).is_dir() and config.is_file():
        recorded = jsonl.loads(config.read_text())
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
            recorded = jsonl.loads(path.read_text())
            if isinstance(recorded, dict) and jsonl.is_number(recorded.get(key)):
                return float(recorded[key])
    return rpo.LAMBDA


def roles_record(names, players, sampling):
    """summary.json's record of each role: its model, sampling, dtype (a local one) and what a
    server would not take."""
    from persuarena import engine
    from persuarena import rollout
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


def role_differences(a, b):
    """Warnings for two eval folders whose persuadee, judge or sampling differ (their
    summary.json "roles"): their rates then measure more than the persuader."""
    def roles(folder):
        path = Path(folder) / "summary.json"
        return jsonl.loads(path.read_text()).get("roles", {}) if path.is_file() else {}
    ra, rb = roles(a), roles(b)
    out = []
    for role in ("persuader", "persuadee", "judge"):
        for key in ("model", "sampling", "dtype") if role != "persuader" else ("sampling",):
            x, y = ra.get(role, {}).get(key), rb.get(role, {}).get(key)
            if ra and rb and x != y:
                out.append(f"warning: A and B differ in the {role}'s {key}: {x} against {y}")
    return out


def slug(name):
    """name as a folder name: the whole path (checkpoints share leaf names), odd characters as _."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name.strip("/"))


def output_dir(args, evals_dir, default):
    return Path(evals_dir) / (args.name or default)


def analysis_mode(args, evals_dir):
    """The model-free modes; returns what they print. New folders go under evals_dir (eval.EVALS_DIR)."""
    from lab import plots  # matplotlib loads for the modes that draw, not with every evaluation
    if args.compare:
        a, b = args.compare
        episodes_a, episodes_b = records.load_episodes(a), records.load_episodes(b)
        result = comparisons.compare(episodes_a, episodes_b)
        path = (Path(b) if Path(b).is_dir() else Path(b).parent) / "compare.json"
        runs.write_atomic(path, json.dumps({"a": a, "b": b, **result}, indent=2) + "\n")
        page = html_report.write_compare(path.parent / html_report.COMPARE_NAME, a, b, result, episodes_a, episodes_b)
        return "\n".join(role_differences(a, b) + [comparisons.format_compare(result, a, b), f"wrote {path} and {page}"])
    if args.compare_many:
        result = comparisons.compare_many({d: records.load_episodes(d) for d in args.compare_many},
                                       records.load_episodes(args.policy))
        return comparisons.format_compare_many(result, args.policy)
    if args.table:
        table = comparisons.main_table({d: records.load_episodes(d) for d in args.table},
                                    args.reference or args.table[0])
        return comparisons.format_main_table(table, args.format)
    if args.analyze:
        summary = analyze(args.analyze, args.shaping_lambda)
        return f"{analyses.format_table(summary)}\nwrote {Path(args.analyze) / 'summary.json'} and the plots"
    if args.case:
        folder, sid = args.case
        ep = analyses.find_episode(records.load_episodes(folder), sid, folder)
        path = Path(folder) / f"case-{slug(sid)}.png"
        plots.plot_case(ep, path)
        return f"{analyses.format_case(ep)}\nwrote {path}"
    if args.overlay:
        out = output_dir(args, evals_dir, "overlay_" + "_vs_".join(slug(Path(d).name) for d in args.overlay))
        believed = {d: analyses.with_beliefs(records.load_episodes(d)) for d in args.overlay}
        if not all(believed.values()):
            raise ValueError(f"{', '.join(d for d, eps in believed.items() if not eps)}: no episode has beliefs "
                             "to overlay (a persuadee served without log-probs)")
        plots.plot_overlay(believed, out / "overlay.png")
        plots.plot_probe_overlay(believed, out / "overlay_probes.png")
        return (f"{analyses.format_probe_overlay(analyses.probe_overlay(believed))}\n"
                f"wrote {out / 'overlay.png'} and {out / 'overlay_probes.png'}")
    if args.runs:
        trained = [run_selection.read_run(d) for d in args.runs]
        selection = run_selection.runs_selection(trained)
        out = output_dir(args, evals_dir, "runs_" + "_".join(slug(r["name"]) for r in trained))
        plots.plot_runs(selection["runs"], out / "runs.png")
        plots.plot_dynamics(trained, out / "dynamics.png")
        out.mkdir(parents=True, exist_ok=True)
        runs.write_atomic(out / "runs.json", json.dumps(selection, indent=2) + "\n")
        return f"{run_selection.format_runs(selection)}\nwrote {out / 'runs.png'}, {out / 'dynamics.png'} and {out / 'runs.json'}"
    return f"wrote {plots.plot_run(args.plot_run)}"
