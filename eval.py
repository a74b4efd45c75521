"""
Evaluate persuaders on PersuArena and analyse the results (SPEC section 10).

An evaluation run plays one seeded episode per held-out scenario (T_max 10) and writes
evals/<name>/episodes.jsonl, summary.json, beliefs.png and probes.png. Reported metrics:
full acceptance, full-or-conditional, pending, reject and walk-away (percent of episodes), mean
turns, mean final belief (the measured b_T), mean dense return (sum of the anchored process rewards,
as training sees them), the share of turns with a negative process reward (raw, un-anchored beliefs:
how often a turn lowers the persuadee's belief), mean strategy-judge score; the same per resistance
type and per domain. Two runs are compared paired by scenario: wins/losses/ties on the goal reward,
the 5x5 outcome transition table, an exact McNemar test on full acceptance and a Wilcoxon
signed-rank test on the goal reward.

    python eval.py --limit 4                                    # quick run, SmolLM2 on both sides
    python eval.py --persuader PATH --name NAME                 # a trained policy or any HF chat model
    python eval.py --scenarios train --limit 20                 # training scenarios as written
    python eval.py --persuader A --persuader B --persuadee C --persuadee D   # cross-persuadee grid
    python eval.py --compare evals/A evals/B                    # paired comparison, B against A
    python eval.py --plot-run runs/NAME                         # training curves -> curves.png
    python eval.py --play heldout-017                           # you are the persuader, in the terminal
"""

import argparse
import json
import math
import os
import re
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from scipy import stats  # noqa: E402

OUTCOMES = ("ACCEPT", "CONDITIONAL_ACCEPT", "PENDING", "REJECT", "WALK_AWAY")
SHORT = {"ACCEPT": "ACCEPT", "CONDITIONAL_ACCEPT": "COND", "PENDING": "PENDING", "REJECT": "REJECT",
         "WALK_AWAY": "WALK"}
PROBES = ("CA", "PE", "AC")  # column order of each row of an episode's "probes"
PROBE_TITLES = {"CA": "concern addressed (CA)", "PE": "persuasion effective (PE)",
                "AC": "acceptance shift (AC)"}
T_MAX = 10
TRAINING_KEYS = ("ids", "turn_ids", "logprobs")  # rollout's token stream, of no use once scored
EVALS_DIR = "evals"
DEFAULT_MODEL = "smollm2"
FIDELITY_SAMPLES = 4  # contexts whose fork read-out is checked against a full forward
GPU_MAX_NEW_TOKENS = 256  # per message, as in training (SPEC 9)
CPU_MAX_NEW_TOKENS = 64  # per message on a CPU, so that --limit 4 takes minutes
Z95 = 1.959964  # two-sided 95% normal quantile for the confidence bands
EXACT_WILCOXON_MAX_N = 50  # exact signed-rank null up to this many nonzero differences (as scipy)
SATURATION = 0.95  # a probe value beyond this carries almost no gradient of belief
DPI = 100
BELIEF_FIGSIZE = (7.0, 4.5)
PROBE_FIGSIZE = (15.0, 4.5)
RUN_PANEL_SIZE = (4.5, 3.2)
RUN_COLS = 3
RUN_TITLES = {"reward_mean": "mean outcome reward R", "dead_group_share": "share of dead groups", "dense_share": "dense term's share of sum |A|",
              "kl": "KL to the initial policy (k3)", "clip_frac": "share of clipped tokens",
              "loss": "policy loss"}
OUTCOME_COLORS = {"ACCEPT": "tab:green", "CONDITIONAL_ACCEPT": "tab:olive", "PENDING": "tab:gray",
                  "REJECT": "tab:orange", "WALK_AWAY": "tab:red"}

# -----------------------------------------------------------------------------
# metrics


def _mean(values):
    values = list(values)
    return sum(values) / len(values) if values else None


def _summary(episodes):
    import rpo  # here, not at the top: rpo imports torch, which --plot-run and bad-argument exits never need
    n = len(episodes)
    count = {o: sum(ep["outcome"] == o for ep in episodes) for o in OUTCOMES}
    # the paper's "turn lowers belief" statistic: raw b_t, never the outcome anchor
    raw = [r for ep in episodes for r in rpo.process_rewards(ep["beliefs"], ep["outcome"], anchor=False)]
    judged = [ep["judge"] for ep in episodes if ep.get("judge") is not None]
    return {
        "n": n,
        "full_accept": count["ACCEPT"] / n,
        "full_or_conditional": (count["ACCEPT"] + count["CONDITIONAL_ACCEPT"]) / n,
        "pending": count["PENDING"] / n,
        "reject": count["REJECT"] / n,
        "walk_away": count["WALK_AWAY"] / n,
        "mean_turns": _mean(ep["turns"] for ep in episodes),
        "mean_final_belief": _mean(ep["beliefs"][-1] for ep in episodes),
        "mean_dense_return": _mean(sum(rpo.process_rewards(ep["beliefs"], ep["outcome"])) for ep in episodes),
        "negative_process_share": sum(r < 0 for r in raw) / len(raw) if raw else None,
        "mean_judge": _mean(judged),
        # the share of judged transcripts whose score fell back to s = 0 (SPEC 6)
        "judge_failed_share": _mean(bool(ep.get("judge_failed")) for ep in episodes if ep.get("judge") is not None),
    }


def _groups(episodes, key):
    groups = defaultdict(list)
    for ep in episodes:
        groups[ep[key]].append(ep)
    return {k: _summary(v) for k, v in sorted(groups.items())}


def summarize(episodes):
    """Headline metrics of a run (fractions, not percent), plus the same per resistance and domain."""
    if not episodes:
        raise ValueError("no episodes to summarize")
    summary = _summary(episodes)
    summary["by_resistance"] = _groups(episodes, "resistance")
    summary["by_domain"] = _groups(episodes, "domain")
    return summary


def _pct(x):
    return "-" if x is None else f"{100 * x:.1f}%"


def _num(x, fmt):
    return "-" if x is None else format(x, fmt)


def _breakdown(title, groups):
    head = (f"{title:<22}{'n':>5}{'accept':>9}{'acc+cond':>10}{'pending':>9}{'reject':>8}{'walk':>7}"
            f"{'turns':>7}{'belief':>8}{'dense':>8}{'neg r':>8}")
    rows = [head]
    for name, s in groups.items():
        rows.append(f"{name:<22}{s['n']:>5}{_pct(s['full_accept']):>9}{_pct(s['full_or_conditional']):>10}"
                    f"{_pct(s['pending']):>9}{_pct(s['reject']):>8}{_pct(s['walk_away']):>7}"
                    f"{_num(s['mean_turns'], '.2f'):>7}{_num(s['mean_final_belief'], '+.3f'):>8}"
                    f"{_num(s['mean_dense_return'], '+.3f'):>8}{_pct(s['negative_process_share']):>8}")
    return "\n".join(rows)


def format_table(summary):
    """The SPEC 10 report: headline metrics, then the breakdowns by resistance and by domain."""
    lines = [
        f"{'episodes':<26}{summary['n']:>8}",
        f"{'full acceptance':<26}{_pct(summary['full_accept']):>8}",
        f"{'full or conditional':<26}{_pct(summary['full_or_conditional']):>8}",
        f"{'pending':<26}{_pct(summary['pending']):>8}",
        f"{'reject':<26}{_pct(summary['reject']):>8}",
        f"{'walk away':<26}{_pct(summary['walk_away']):>8}",
        f"{'mean turns':<26}{_num(summary['mean_turns'], '.2f'):>8}",
        f"{'mean final belief':<26}{_num(summary['mean_final_belief'], '+.3f'):>8}",
        f"{'mean dense return':<26}{_num(summary['mean_dense_return'], '+.3f'):>8}",
        f"{'negative process reward':<26}{_pct(summary['negative_process_share']):>8}  of turns (raw beliefs)",
        f"{'mean judge score':<26}{_num(summary['mean_judge'], '+.2f'):>8}",
        f"{'judge fell back to 0':<26}{_pct(summary.get('judge_failed_share')):>8}  of judged transcripts",
    ]
    return "\n".join(lines + ["", _breakdown("by resistance", summary["by_resistance"]),
                              "", _breakdown("by domain", summary["by_domain"])])


# -----------------------------------------------------------------------------
# paired tests and comparison


def mcnemar(a, b):
    """Two-sided exact McNemar p-value for paired booleans: a binomial test on the discordant pairs."""
    if len(a) != len(b):
        raise ValueError(f"mcnemar needs paired samples, got {len(a)} and {len(b)}")
    only_a = sum(bool(x) and not bool(y) for x, y in zip(a, b))
    only_b = sum(bool(y) and not bool(x) for x, y in zip(a, b))
    if only_a + only_b == 0:
        return 1.0
    return float(stats.binomtest(only_a, only_a + only_b, 0.5).pvalue)


def wilcoxon(x, y):
    """Two-sided Wilcoxon signed-rank p-value of x - y, zero differences dropped.
    Exact null distribution for up to EXACT_WILCOXON_MAX_N differences without ties in |d|; otherwise
    the normal approximation with scipy's tie-corrected variance and no continuity correction."""
    d = np.asarray(x, dtype=float) - np.asarray(y, dtype=float)
    d = d[d != 0]
    if d.size == 0:
        return 1.0
    ties = np.unique(np.abs(d)).size < d.size
    method = "exact" if d.size <= EXACT_WILCOXON_MAX_N and not ties else "asymptotic"
    return float(stats.wilcoxon(d, zero_method="wilcox", correction=False, alternative="two-sided",
                                method=method).pvalue)


def compare(episodes_a, episodes_b):
    """Pair two runs by scenario_id and test B against A. Runs covering different scenarios are
    compared on the common ones, with a warning naming what is missing."""
    a, b = _by_scenario(episodes_a, "A"), _by_scenario(episodes_b, "B")
    missing_in_b, missing_in_a = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    common = sorted(set(a) & set(b))
    if not common:
        raise ValueError("the two runs share no scenario_id")
    if missing_in_a or missing_in_b:
        print(f"eval.py: warning: comparing the {len(common)} common scenarios; missing in A: "
              f"{', '.join(missing_in_a) or 'none'}; missing in B: {', '.join(missing_in_b) or 'none'}",
              file=sys.stderr)
    import rpo
    goal_a = [rpo.GOAL[a[s]["outcome"]] for s in common]
    goal_b = [rpo.GOAL[b[s]["outcome"]] for s in common]
    transitions = {oa: {ob: 0 for ob in OUTCOMES} for oa in OUTCOMES}
    for s in common:
        transitions[a[s]["outcome"]][b[s]["outcome"]] += 1
    return {
        "n": len(common),
        "wins": sum(gb > ga for ga, gb in zip(goal_a, goal_b)),  # from B's side
        "losses": sum(gb < ga for ga, gb in zip(goal_a, goal_b)),
        "ties": sum(gb == ga for ga, gb in zip(goal_a, goal_b)),
        "mean_goal_a": _mean(goal_a),
        "mean_goal_b": _mean(goal_b),
        "transitions": transitions,
        "mcnemar_p": mcnemar([a[s]["outcome"] == "ACCEPT" for s in common],
                             [b[s]["outcome"] == "ACCEPT" for s in common]),
        "wilcoxon_p": wilcoxon(goal_b, goal_a),
        "missing_in_a": missing_in_a,
        "missing_in_b": missing_in_b,
        "summary_a": summarize([a[s] for s in common]),
        "summary_b": summarize([b[s] for s in common]),
    }


def _by_scenario(episodes, label):
    out = {}
    for ep in episodes:
        if ep["scenario_id"] in out:
            raise ValueError(f"run {label} has more than one episode for {ep['scenario_id']}; "
                             "compare runs with one episode per scenario")
        out[ep["scenario_id"]] = ep
    return out


def format_compare(result, name_a="A", name_b="B"):
    """compare()'s result for the terminal: tests, transition table, headline metrics side by side."""
    sa, sb = result["summary_a"], result["summary_b"]
    lines = [
        f"A = {name_a}\nB = {name_b}\npaired scenarios: {result['n']}",
        f"goal reward, B against A: {result['wins']} wins, {result['losses']} losses, {result['ties']} ties "
        f"(mean {result['mean_goal_a']:+.3f} -> {result['mean_goal_b']:+.3f}, "
        f"Wilcoxon signed-rank p = {result['wilcoxon_p']:.4g})",
        f"full acceptance: {_pct(sa['full_accept'])} -> {_pct(sb['full_accept'])} "
        f"(exact McNemar p = {result['mcnemar_p']:.4g})",
        "",
        "outcome transitions (rows: A, columns: B)",
        f"{'':<12}" + "".join(f"{SHORT[o]:>9}" for o in OUTCOMES) + f"{'total':>9}",
    ]
    for oa in OUTCOMES:
        row = result["transitions"][oa]
        lines.append(f"{SHORT[oa]:<12}" + "".join(f"{row[ob]:>9}" for ob in OUTCOMES) + f"{sum(row.values()):>9}")
    lines.append(f"{'total':<12}" + "".join(f"{sum(result['transitions'][oa][ob] for oa in OUTCOMES):>9}"
                                            for ob in OUTCOMES) + f"{result['n']:>9}")
    lines += ["", f"{'':<26}{'A':>9}{'B':>9}{'B - A':>9}"]
    for key, label in [("full_accept", "full acceptance"), ("full_or_conditional", "full or conditional"),
                       ("pending", "pending"), ("reject", "reject"), ("walk_away", "walk away"),
                       ("negative_process_share", "negative process reward")]:
        if sa[key] is not None and sb[key] is not None:
            lines.append(f"{label:<26}{_pct(sa[key]):>9}{_pct(sb[key]):>9}{100 * (sb[key] - sa[key]):>+8.1f}%")
    for key, label, fmt in [("mean_turns", "mean turns", ".2f"), ("mean_final_belief", "mean final belief", "+.3f"),
                            ("mean_dense_return", "mean dense return", "+.3f"),
                            ("mean_judge", "mean judge score", "+.2f")]:
        if sa[key] is not None and sb[key] is not None:
            lines.append(f"{label:<26}{format(sa[key], fmt):>9}{format(sb[key], fmt):>9}{sb[key] - sa[key]:>+9.3f}")
    return "\n".join(lines)


def grid_table(results):
    """Cross-persuadee grid: results maps (persuader, persuadee) -> summary. Each cell is full
    acceptance % with full-or-conditional % in parentheses."""
    rows = list(dict.fromkeys(p for p, _ in results))
    cols = list(dict.fromkeys(q for _, q in results))
    width = max([len(c) for c in cols] + [13]) + 2
    corner = "persuader \\ persuadee"
    first = max([len(r) for r in rows] + [len(corner)]) + 2
    lines = [f"{corner:<{first}}" + "".join(f"{c:>{width}}" for c in cols)]
    for r in rows:
        cells = []
        for c in cols:
            s = results.get((r, c))
            cells.append("-" if s is None else
                         f"{100 * s['full_accept']:.1f} ({100 * s['full_or_conditional']:.1f})")
        lines.append(f"{r:<{first}}" + "".join(f"{cell:>{width}}" for cell in cells))
    lines.append("cells: full acceptance % (full or conditional %)")
    return "\n".join(lines)


def probe_fidelity(fork_values, reference_values):
    """How far forked probe read-outs are from reference ones (e.g. a full re-forward), and the
    share of forked read-outs saturated beyond SATURATION."""
    f = np.asarray(fork_values, dtype=float).ravel()
    r = np.asarray(reference_values, dtype=float).ravel()
    if f.shape != r.shape or f.size == 0:
        raise ValueError(f"probe_fidelity needs two equal, non-empty sets of values, got {f.size} and {r.size}")
    diff = np.abs(f - r)
    return {"max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean()),
            "saturated_share": float(np.mean(np.abs(f) > SATURATION))}


# -----------------------------------------------------------------------------
# plots


def trajectory_stats(episodes, series):
    """Per outcome, the mean of a per-turn series by turn, the 95% half-width of that mean (normal
    approximation, 0 where a turn has one episode) and the episode count. series(ep) -> values
    b_0..b_T; turn t averages the episodes that reached it."""
    out = {}
    for outcome in OUTCOMES:
        rows = [series(ep) for ep in episodes if ep["outcome"] == outcome]
        if not rows:
            continue
        length = max(len(row) for row in rows)
        mean, half, count = np.zeros(length), np.zeros(length), np.zeros(length, dtype=int)
        for t in range(length):
            v = np.array([row[t] for row in rows if len(row) > t], dtype=float)
            mean[t], count[t] = v.mean(), v.size
            half[t] = Z95 * v.std(ddof=1) / math.sqrt(v.size) if v.size > 1 else 0.0
        out[outcome] = (mean, half, count)
    return out


def _draw_by_outcome(ax, episodes, series, title, ylabel):
    for outcome, (mean, half, count) in trajectory_stats(episodes, series).items():
        t = np.arange(mean.size)
        ax.plot(t, mean, marker="o", ms=3, color=OUTCOME_COLORS[outcome],
                label=f"{outcome} (n={count[0]})")
        ax.fill_between(t, mean - half, mean + half, color=OUTCOME_COLORS[outcome], alpha=0.2)
    ax.set(title=title, xlabel="turn t (0 = before the first message)", ylabel=ylabel, ylim=(-1.05, 1.05))
    ax.axhline(0, color="black", lw=0.5)
    ax.grid(alpha=0.3)


def _save_fig(fig, path):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fig.savefig(tmp, format="png", dpi=DPI)
    plt.close(fig)
    os.replace(tmp, path)


def plot_beliefs(episodes, path):
    """Mean persuadee belief b_t by turn for each outcome, with 95% confidence bands."""
    fig, ax = plt.subplots(figsize=BELIEF_FIGSIZE)
    _draw_by_outcome(ax, episodes, lambda ep: ep["beliefs"],
                     "Persuadee belief by turn, by outcome (mean, 95% CI)", "belief b_t (mean of 3 probes)")
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    _save_fig(fig, path)


def plot_probes(episodes, path):
    """One panel per probe (CA, PE, AC): mean probe value by turn for each outcome, 95% bands."""
    fig, axes = plt.subplots(1, len(PROBES), figsize=PROBE_FIGSIZE, sharey=True)
    for i, (ax, probe) in enumerate(zip(axes, PROBES)):
        _draw_by_outcome(ax, episodes, lambda ep, i=i: [row[i] for row in ep["probes"]],
                         f"{PROBE_TITLES[probe]} by turn", "probe value 2p(yes) - 1")
    axes[0].legend(fontsize=8, loc="lower left")
    fig.suptitle("Per-probe trajectories by outcome (mean, 95% CI)")
    fig.tight_layout()
    _save_fig(fig, path)


def _is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def plot_run(run_dir):
    """Training curves from run_dir/metrics.jsonl into run_dir/curves.png: one panel per numeric
    metric, the outcome_* shares together in one panel. Returns the PNG path."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir} is not a directory; pass a training run such as runs/NAME")
    rows = _read_jsonl(run_dir / "metrics.jsonl", "a training run directory written by train.py")
    if not rows:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} is empty; let train.py log at least one step")
    steps = [row.get("step", i) for i, row in enumerate(rows)]
    keys = list(dict.fromkeys(k for row in rows for k, v in row.items() if k != "step" and _is_number(v)))
    outcome_keys = [k for k in keys if k.startswith("outcome_")]
    panels = ([("outcome shares", outcome_keys)] if outcome_keys else []) + \
        [(k, [k]) for k in keys if k not in outcome_keys]
    if not panels:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} has no numeric metrics to plot")
    nrows = math.ceil(len(panels) / RUN_COLS)
    fig, axes = plt.subplots(nrows, RUN_COLS, squeeze=False,
                             figsize=(RUN_PANEL_SIZE[0] * RUN_COLS, RUN_PANEL_SIZE[1] * nrows))
    for ax, (title, group) in zip(axes.flat, panels):
        for k in group:
            pts = [(s, row[k]) for s, row in zip(steps, rows) if _is_number(row.get(k))]
            # metrics logged only some steps (e.g. held-out eval) get markers so lone points show
            ax.plot(*zip(*pts), marker="o" if len(pts) < len(rows) or len(pts) < 20 else None, ms=3,
                    label=k.removeprefix("outcome_") if len(group) > 1 else None)
        ax.set(title=RUN_TITLES.get(title, title), xlabel="training step",
               ylabel="share of episodes" if len(group) > 1 else k)
        ax.grid(alpha=0.3)
        if len(group) > 1:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(f"Training curves: {run_dir.name}")
    fig.tight_layout()
    path = run_dir / "curves.png"
    _save_fig(fig, path)
    return path


# -----------------------------------------------------------------------------
# IO


def _read_jsonl(path, what):
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; pass {what}")
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno} is not valid JSON ({e.msg})") from None
    return rows


def load_episodes(dir_or_file):
    """Episodes of a run directory (its episodes.jsonl) or of a .jsonl file."""
    path = Path(dir_or_file)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist; pass an eval directory such as evals/NAME")
    if path.is_dir():
        path = path / "episodes.jsonl"
    episodes = _read_jsonl(path, "an eval directory written by `python eval.py --name NAME`")
    if not episodes:
        raise ValueError(f"{path} holds no episodes; rerun the evaluation that wrote it")
    return episodes


def _write_text(path, text):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_run(out_dir, episodes, summary):
    """Write episodes.jsonl, summary.json, beliefs.png and probes.png, each atomically."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_text(out_dir / "episodes.jsonl", "".join(json.dumps(ep) + "\n" for ep in episodes))
    _write_text(out_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    plot_beliefs(episodes, out_dir / "beliefs.png")
    plot_probes(episodes, out_dir / "probes.png")


# -----------------------------------------------------------------------------
# model-driven modes (rollout/arena import torch, so they load only here)


def _slug(name):
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name.strip("/"))  # whole path: checkpoints share leaf names


def _load(name, loaded):
    import models
    if name not in loaded:  # one copy of the weights per name, a fresh Engine per role
        loaded[name] = models.load_model(name)
    return loaded[name]


def _instances(split):
    """Held-out or training scenarios as written, one instance each (variant 0)."""
    import arena
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
    import arena
    import models
    contexts = []
    for inst, ep in list(zip(instances, episodes))[:n]:
        messages = arena.persuadee_messages(inst)
        for m in ep["transcript"][:2]:
            role = "user" if m["role"] == "persuader" else "assistant"
            messages.append({"role": role, "content": m["text"]})
        contexts.append(models.chat_ids(tokenizer, messages, False))
    return contexts


def evaluate(persuader, persuadee, instances, out_dir, *, t_max=T_MAX, seed=0, names=("", ""),
             fidelity=FIDELITY_SAMPLES, max_new_tokens=GPU_MAX_NEW_TOKENS):
    """One seeded episode per instance with rollout Engines; saves the run, returns its summary.

    The strategy judge is the persuadee's model in a fresh context (SPEC 6)."""
    import probes
    import rollout
    episodes = rollout.rollout_episodes(persuader, persuadee, instances, t_max, seed=seed,
                                        judge=persuadee, max_new_tokens=max_new_tokens)
    for ep in episodes:
        for key in TRAINING_KEYS:
            ep.pop(key, None)
        ep.update(persuader=names[0], persuadee=names[1], seed=seed)
    summary = summarize(episodes)
    if fidelity:
        contexts = fidelity_contexts(persuadee.tokenizer, instances, episodes, fidelity)
        summary["probe_fidelity"] = probe_fidelity(
            probes.read_beliefs(persuadee.model, persuadee.tokenizer, contexts).tolist(),
            probes.read_beliefs_reference(persuadee.model, persuadee.tokenizer, contexts).tolist())
    save_run(out_dir, episodes, summary)
    return summary


def run_eval(persuader, persuadee, instances, out_dir, *, seed, t_max, loaded,
             max_new_tokens=GPU_MAX_NEW_TOKENS):
    """Load the two models by name (once each) and evaluate."""
    import engine
    engines = [engine.Engine(*_load(name, loaded)) for name in (persuader, persuadee)]
    return evaluate(*engines, instances, out_dir, t_max=t_max, seed=seed,
                    names=(persuader, persuadee), max_new_tokens=max_new_tokens)


def play(scenario_id, persuadee, *, seed, t_max, read=input, write=print,
         max_new_tokens=GPU_MAX_NEW_TOKENS):
    """You are the persuader: type each message; the model persuadee answers and you see its
    three probe values and the belief change of the turn. The transcript is saved under
    evals/play-SCENARIO_ID-TIME like any episode."""
    import time

    import torch

    import arena
    import engine
    import models
    import probes
    import rollout
    found = [inst for split in ("heldout", "train") for inst in _instances(split) if inst["id"] == scenario_id]
    if not found:
        sys.exit(f"eval.py: unknown scenario id {scenario_id!r}; use an id from scenarios.jsonl, e.g. heldout-017")
    inst = found[0]
    persuadee_engine = engine.Engine(*_load(persuadee, {}))
    tok = persuadee_engine.tokenizer
    gen = torch.Generator(persuadee_engine.device).manual_seed(seed)
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
        [reply] = rollout.persuadee_turn(persuadee_engine, [sid], [text], [episode.final_turn],
                                         temperature=0.7, top_p=None,
                                         max_new_tokens=max_new_tokens, generator=gen)
        transcript.append({"role": "persuadee", "text": reply["text"], "decision": reply["decision"]})
        if reply["reason"] in ("context", "cache"):
            episode.end(reply["reason"])
            break
        episode.step(reply["decision"])
        before = sum(values) / 3
        values = reply["probes"]
        probe_rows.append(values)
        write(f"{inst['persuadee']['name']}: {reply['text']}")
        write("   " + "  ".join(f"{k} {v:+.2f}" for k, v in zip(PROBES, values)) +
              f"   belief {sum(values) / 3:+.2f} ({sum(values) / 3 - before:+.2f})")
    beliefs = [sum(v) / 3 for v in probe_rows]
    ep = dict(id=inst["id"], scenario_id=inst["id"], domain=inst["domain"],
              resistance=inst["hidden"]["resistance"], outcome=episode.outcome,
              turns=len(beliefs) - 1, end_reason=episode.end_reason, transcript=transcript,
              beliefs=beliefs, probes=probe_rows, judge=None, persuader="human",
              persuadee=persuadee, seed=seed)
    out_dir = Path(EVALS_DIR) / f"play-{inst['id']}-{time.strftime('%Y%m%d-%H%M%S')}"
    save_run(out_dir, [ep], summarize([ep]))
    write(f"outcome {episode.outcome} after {episode.turn} turns; saved to {out_dir}")
    return ep


# -----------------------------------------------------------------------------
# CLI


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--persuader", action="append", help="model name or path; repeat for a grid (default smollm2)")
    ap.add_argument("--persuadee", action="append", help="model name or path; repeat for a grid (default smollm2)")
    ap.add_argument("--scenarios", choices=("heldout", "train"), default="heldout")
    ap.add_argument("--limit", type=int, help="evaluate only the first N scenarios")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", help=f"run name; output goes to {EVALS_DIR}/NAME")
    ap.add_argument("--t-max", type=int, default=T_MAX, help="turn budget per episode")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help=f"per message (default {GPU_MAX_NEW_TOKENS} with CUDA, {CPU_MAX_NEW_TOKENS} on a CPU)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two eval directories, B against A")
    mode.add_argument("--plot-run", metavar="DIR", help="plot DIR/metrics.jsonl into DIR/curves.png")
    mode.add_argument("--play", metavar="SCENARIO_ID", help="you persuade the model persuadee, in the terminal")
    args = ap.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        ap.exit(2, f"eval.py: --limit must be at least 1, got {args.limit}\n")
    if args.t_max < 1:
        ap.exit(2, f"eval.py: --t-max must be at least 1, got {args.t_max}\n")
    args.persuader = args.persuader or [DEFAULT_MODEL]
    args.persuadee = args.persuadee or [DEFAULT_MODEL]
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.compare or args.plot_run:
        try:
            if args.compare:
                a, b = args.compare
                print(format_compare(compare(load_episodes(a), load_episodes(b)), a, b))
            else:
                print(f"wrote {plot_run(args.plot_run)}")
        except (OSError, ValueError) as e:
            sys.exit(f"eval.py: {e}")
        return
    if args.max_new_tokens is None:  # the model-driven modes only: torch loads here
        import torch
        args.max_new_tokens = GPU_MAX_NEW_TOKENS if torch.cuda.is_available() else CPU_MAX_NEW_TOKENS
    if args.play:
        if len(args.persuadee) > 1:
            sys.exit("eval.py: --play takes one --persuadee (you are the persuader)")
        play(args.play, args.persuadee[0], seed=args.seed, t_max=args.t_max,
             max_new_tokens=args.max_new_tokens)
        return
    instances = _instances(args.scenarios)[:args.limit]
    pairs = [(p, q) for p in args.persuader for q in args.persuadee]
    base = args.name or (f"{_slug(pairs[0][0])}_vs_{_slug(pairs[0][1])}_{args.scenarios}_s{args.seed}"
                         if len(pairs) == 1 else f"grid_{args.scenarios}_s{args.seed}")
    loaded, results = {}, {}
    for p, q in pairs:
        out_dir = Path(EVALS_DIR) / base if len(pairs) == 1 else Path(EVALS_DIR) / base / f"{_slug(p)}_vs_{_slug(q)}"
        results[(p, q)] = run_eval(p, q, instances, out_dir, seed=args.seed, t_max=args.t_max, loaded=loaded,
                                   max_new_tokens=args.max_new_tokens)
        print(f"\n== persuader {p}, persuadee {q} -> {out_dir}\n{format_table(results[(p, q)])}")
    if len(pairs) > 1:
        print("\n" + grid_table(results))


if __name__ == "__main__":
    main()
