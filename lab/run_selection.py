"""
run_selection.py: checkpoint selection over training runs (Table 9, Figs 3 and 7), from a run
folder's records alone (config.json, metrics.jsonl, evals.jsonl, eval-STEP/episodes.jsonl,
rollouts.jsonl; no torch): per evaluated checkpoint the held-out figures beside the training
acceptance, the best checkpoint, the train/held-out Spearman correlation, and the run-level
Fig. 7 diagnostics pooled from rollouts.jsonl.
    python eval.py --runs runs/A runs/B
Tests: python -m pytest -q tests/test_run_selection.py
"""
import json
import math
from collections import defaultdict
from pathlib import Path

from persuarena import rpo
from lab import jsonl, records
from lab import analyses
from lab.analyses import closing_efficiency, corr, mean, num, pct, pearson_text
from lab.jsonl import is_number
from lab.records import load_episodes, read_records
from lab.significance import pearson, spearman

DIAGNOSTICS = ("dead_group_share", "dead_goal_share", "dead_rescued_share", "dense_share", "outcome_term_abs",
               "dense_term_abs")  # the Fig. 7 step diagnostics of metrics.jsonl (rpo.diagnostics)


def migrate_summary(summary, lam=None):
    """A summary.json (or evals.jsonl row) in today's keys. Before shaping_lambda was recorded,
    shaping_by_outcome held the lambda-free sum: it becomes dense_by_outcome, and the shaping
    return is recomputed at lam (the run's, else rpo.LAMBDA)."""
    if "shaping_lambda" in summary or "shaping_by_outcome" not in summary:
        return summary
    lam = rpo.LAMBDA if lam is None else lam
    dense = summary["shaping_by_outcome"] or {}
    return {**summary, "shaping_lambda": lam, "dense_by_outcome": dense,
            "shaping_by_outcome": {o: lam * v for o, v in dense.items()}}


def read_run(run_dir):
    """A training run's config, metrics.jsonl, evals.jsonl (migrated to today's keys), held-out
    episodes (eval-STEP) and training rollouts (rollouts.jsonl, when train.py wrote one)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir} is not a directory; pass a training run such as runs/NAME")
    config = jsonl.loads((run_dir / "config.json").read_text()) if (run_dir / "config.json").is_file() else {}
    evals = read_records(run_dir / "evals.jsonl", "a run trained with --eval-every N (train.py writes evals.jsonl)",
                         records.RUN_FIELDS["evals.jsonl"])
    if not evals:
        raise ValueError(f"{run_dir / 'evals.jsonl'} is empty; train with --eval-every N")
    metrics = read_records(run_dir / "metrics.jsonl", "a training run directory written by train.py",
                           records.RUN_FIELDS["metrics.jsonl"])
    episodes = {}
    for row in evals:
        path = run_dir / f"eval-{row['step']}" / "episodes.jsonl"
        episodes[row["step"]] = load_episodes(path) if path.is_file() else []
    path = run_dir / "rollouts.jsonl"
    rollouts = read_records(path, "", records.RUN_FIELDS["rollouts.jsonl"]) if path.is_file() else []
    return {"dir": run_dir, "name": run_dir.name, "lam": config.get("lam"), "anchor": config.get("anchor"),
            "metrics": metrics, "rollouts": rollouts, "episodes": episodes,
            "evals": sorted((migrate_summary(r, config.get("lam")) for r in evals), key=lambda r: r["step"])}


def rollout_groups(rows, anchor=None):
    """rollouts.jsonl rows -> the (outcome rewards, process rewards, goals) of every group of every
    step, as train.py formed them (an unreadable belief is NaN again); anchor default rpo.ANCHOR."""
    anchor = rpo.ANCHOR if anchor is None else anchor
    groups = defaultdict(list)
    for row in rows:
        groups[row["step"], row["group"]].append(row)
    out = []
    for _, members in sorted(groups.items()):
        members.sort(key=lambda r: r["member"])
        beliefs = [[math.nan if b is None else b for b in r["beliefs"]] for r in members]
        out.append(([rpo.outcome_reward(r["outcome"], r["judge"]) for r in members],
                    [rpo.process_rewards(b, r["outcome"], anchor) for b, r in zip(beliefs, members)],
                    [r["goal"] for r in members]))
    return out


def run_diagnostics(run):
    """The Fig. 7 diagnostics over a whole run: the mean over steps of each logged figure
    (metrics.jsonl), and where rollouts.jsonl exists, the run pooled (every group of every step,
    sums before the division: the paper's 10.3% dead, 83% rescued, ~15% dense share)."""
    means = {k: mean(m[k] for m in run["metrics"] if is_number(m.get(k))) for k in DIAGNOSTICS}
    pooled = None
    if run["rollouts"]:
        anchor = rpo.ANCHOR if run["anchor"] is None else run["anchor"]
        lam = rpo.LAMBDA if run["lam"] is None else run["lam"]
        pooled = rpo.diagnostics(rpo.diagnostic_sums(rollout_groups(run["rollouts"], anchor), lam))
    return {"step_mean": means, "pooled": pooled}


def run_analysis(run):
    """Checkpoint selection for one run (Table 9, section F): per evaluated checkpoint its held-out
    full acceptance, full-or-conditional, mean final belief, closing efficiency and the training
    acceptance (the mean of outcome_ACCEPT over the steps since the previous evaluation); the best
    checkpoint; the Spearman correlation of training against held-out acceptance across this run's
    checkpoints; the Pearson correlation of goal and strategy rewards over its held-out episodes
    (and over its training rollouts, when recorded); the run-level Fig. 7 diagnostics."""
    steps = [row["step"] for row in run["evals"]]
    heldout = [row["full_accept"] for row in run["evals"]]
    train = []
    for prev, step in zip([0] + steps[:-1], steps):
        window = [m["outcome_ACCEPT"] for m in run["metrics"] if prev < m["step"] <= step and "outcome_ACCEPT" in m]
        train.append(mean(window))
    checkpoints = []
    for row, train_accept in zip(run["evals"], train):
        eps = run["episodes"].get(row["step"])
        checkpoints.append({"step": row["step"], "full_accept": row["full_accept"],
                            "full_or_conditional": row.get("full_or_conditional"),
                            "mean_final_belief": row.get("mean_final_belief"),
                            "closing_efficiency": closing_efficiency(eps) if eps else row.get("closing_efficiency"),
                            "train_accept": train_accept})
    best = max(range(len(steps)), key=lambda i: (heldout[i], -steps[i]))  # ties: the earliest
    checkpoint = run["dir"] / f"checkpoint-{steps[best]}"
    paired = [(a, b) for a, b in zip(train, heldout) if a is not None]
    judged = [(rpo.GOAL[ep.outcome], ep.judge) for eps in run["episodes"].values() for ep in eps
              if ep.judge is not None]
    trained = [(r["goal"], r["judge"]) for r in run["rollouts"] if r.get("judge") is not None]
    return {"name": run["name"], "lam": run["lam"], "anchor": run["anchor"], "steps": steps,
            "heldout_accept": heldout, "train_accept": train, "checkpoints": checkpoints,
            "best": {"step": steps[best], "full_accept": heldout[best],
                     "checkpoint": str(checkpoint) if checkpoint.is_dir() else None},
            "train_heldout_spearman": spearman([a for a, _ in paired], [b for _, b in paired]),
            "goal_strategy_corr": pearson([g for g, _ in judged], [j for _, j in judged]),
            "goal_strategy_corr_train": pearson([g for g, _ in trained], [j for _, j in trained]),
            "shaping_lambda": run["evals"][best].get("shaping_lambda"),
            "shaping_by_outcome": run["evals"][best].get("shaping_by_outcome"),
            "dense_by_outcome": run["evals"][best].get("dense_by_outcome"),
            "diagnostics": run_diagnostics(run)}


def runs_selection(runs):
    """run_analysis of every run, and the Spearman correlation of training against held-out
    acceptance pooled over every run's checkpoints (the paper's rho = 0.57 over seven
    checkpoints across the lambda runs)."""
    selected = [run_analysis(r) for r in runs]
    paired = [(c["train_accept"], c["full_accept"]) for a in selected for c in a["checkpoints"]
              if c["train_accept"] is not None]
    return {"runs": selected,
            "pooled_train_heldout_spearman": spearman([a for a, _ in paired], [b for _, b in paired])}


def format_runs(selection):
    """Table 9: per run and checkpoint the held-out figures and training acceptance; each run's
    selection and run-level diagnostics; the pooled train/held-out correlation."""
    analysed = selection["runs"]
    steps = sorted({s for a in analysed for s in a["steps"]})
    width = max([len(a["name"]) for a in analysed] + [10]) + 2
    lines = ["held-out full acceptance by step", f"{'step':>6}" + "".join(f"{a['name']:>{width}}" for a in analysed)]
    for step in steps:
        cells = [pct(a["heldout_accept"][a["steps"].index(step)]) if step in a["steps"] else "-" for a in analysed]
        lines.append(f"{step:>6}" + "".join(f"{c:>{width}}" for c in cells))
    lines += ["", f"{'run':<{width}}{'step':>6}{'FA':>8}{'FA+CA':>8}{'b_T':>8}{'closing':>9}{'train FA':>10}"]
    for a in analysed:
        for c in a["checkpoints"]:
            lines.append(f"{a['name']:<{width}}{c['step']:>6}{pct(c['full_accept']):>8}"
                         f"{pct(c['full_or_conditional']):>8}{num(c['mean_final_belief'], '+.3f'):>8}"
                         f"{pct(c['closing_efficiency']):>9}{pct(c['train_accept']):>10}")
    lines.append("closing: of the episodes ending with b_T > 0, the share that reached ACCEPT")
    for a in analysed:
        b = a["best"]
        shaping = "  ".join(f"{analyses.SHORT[o]} {v:+.3f}" for o, v in (a["shaping_by_outcome"] or {}).items())
        gs, gt = a["goal_strategy_corr"], a["goal_strategy_corr_train"]
        d = a["diagnostics"]
        lines += ["", f"{a['name']} (lambda {a['lam']}, anchor {a['anchor']}): best step {b['step']} at "
                      f"{pct(b['full_accept'])}, checkpoint {b['checkpoint'] or 'not kept'}",
                  f"  train vs held-out acceptance across checkpoints: {corr(a['train_heldout_spearman'])}",
                  f"  goal vs strategy reward: held-out {pearson_text(gs)}; training rollouts {pearson_text(gt)}",
                  f"  shaping return (lambda {a['shaping_lambda']}) by outcome at the best step: {shaping or '-'}"]
        for title, figures in (("mean over steps", d["step_mean"]), ("pooled over the run", d["pooled"])):
            lines.append(f"  diagnostics, {title}: " + ("- (no rollouts.jsonl)" if figures is None else "  ".join(
                f"{k} {num(figures.get(k), '.3f')}" for k in DIAGNOSTICS)))
    lines += ["", "train vs held-out acceptance over every run's checkpoints: "
                  f"{corr(selection['pooled_train_heldout_spearman'])}"]
    return "\n".join(lines)
