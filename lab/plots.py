"""
The paper's figures from episode records and training runs, drawn with matplotlib (PNG files).

  plot_beliefs   mean belief b_t by turn for each outcome, 95% bands (beliefs.png)
  plot_probes    the same per probe of probes.PROBES (probes.png)
  plot_moves     Fig. 5, the share of messages with each move by turn, and the two move rankings
                 of section F (moves.png)
  plot_case      Table 8 as a figure: one episode's probes, b_t and r_t (case-ID.png)
  plot_overlay   Fig. 6: runs overlaid, belief and process reward by turn (overlay.png)
  plot_probe_overlay  Fig. 6 per probe of probes.PROBES, two or more systems (overlay_probes.png)
  plot_runs      checkpoint selection (Table 9) and Fig. 3, best held-out acceptance over lambda
  plot_dynamics  Fig. 7: dead groups, rescued share and the two advantage terms by step
  plot_run       a training run's curves from metrics.jsonl (curves.png)
  plot_training  training episodes against a same-seed frozen control (training.png)
The statistics behind them come from analyses.py; eval.py's command line calls them.
Tests: python -m pytest -q tests/test_plots.py
"""

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from lab import analyses  # noqa: E402
from lab import moves  # noqa: E402
from lab import significance  # noqa: E402
from lab.records import probe_names, probe_title  # noqa: E402
from lab.runs import write_atomic  # noqa: E402
from lab.jsonl import is_number, read_jsonl  # noqa: E402

RUN_DYNAMICS = {"dead_group_share": "share of dead groups (all R equal)",
                "dead_goal_share": "share of dead groups (identical outcomes)",
                "dead_rescued_share": "dead groups rescued by the dense term",
                "outcome_term_abs": "mean |A_out| per turn", "dense_term_abs": "mean |lambda D~| per turn"}
DPI = 100
BELIEF_FIGSIZE = (7.0, 4.5)
PROBE_FIGSIZE = (15.0, 4.5)
MOVES_FIGSIZE = (13.0, 4.5)
CASE_FIGSIZE = (8.0, 6.0)
OVERLAY_FIGSIZE = (12.0, 4.5)
RUNS_FIGSIZE = (12.0, 4.5)
RUN_PANEL_SIZE = (4.5, 3.2)
RUN_COLS = 3
RUN_TITLES = {"reward_mean": "mean outcome reward R", "dead_group_share": "share of dead groups", "dense_share": "dense term's share of sum |A|",
              "kl": "KL to the initial policy (k3)",
              "outcome_term_abs": "outcome term's mean |A_out| a turn", "dense_term_abs": "dense term's mean |λ D| a turn", "clip_frac": "share of clipped tokens",
              "loss": "policy loss"}
OUTCOME_COLORS = {"ACCEPT": "tab:green", "CONDITIONAL_ACCEPT": "tab:olive", "PENDING": "tab:gray",
                  "REJECT": "tab:orange", "WALK_AWAY": "tab:red"}


def _draw_by_outcome(ax, episodes, series, title, ylabel):
    for outcome, (mean, half, count) in analyses.trajectory_stats(episodes, series).items():
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
    try:
        write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=DPI))
    finally:
        plt.close(fig)


def plot_beliefs(episodes, path):
    """Mean persuadee belief b_t by turn for each outcome, with 95% confidence bands."""
    fig, ax = plt.subplots(figsize=BELIEF_FIGSIZE)
    _draw_by_outcome(ax, episodes, lambda ep: ep.beliefs,
                     "Persuadee belief by turn, by outcome (mean, 95% CI)", "belief b_t (mean of 3 probes)")
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    _save_fig(fig, path)


def plot_probes(episodes, path):
    """One panel per probe (probes.PROBES): mean probe value by turn for each outcome, 95% bands."""
    fig, axes = plt.subplots(1, len(probe_names()), figsize=PROBE_FIGSIZE, sharey=True)
    for i, (ax, probe) in enumerate(zip(axes, probe_names())):
        _draw_by_outcome(ax, episodes, lambda ep, i=i: [row[i] for row in ep.probes],
                         f"{probe_title(probe)} by turn", "probe value 2p(yes) - 1")
    axes[0].legend(fontsize=8, loc="lower left")
    fig.suptitle("Per-probe trajectories by outcome (mean, 95% CI)")
    fig.tight_layout()
    _save_fig(fig, path)


def plot_moves(summary, path):
    """Fig. 5 (share of messages with each move by turn) and the two move rankings of section F
    (effect on the turn's r_t and on P(ACCEPT), 95% intervals)."""
    m = summary["moves"]
    fig, axes = plt.subplots(1, 3, figsize=MOVES_FIGSIZE)
    color = {label: f"C{i}" for i, label in enumerate(moves.MOVES)}  # one colour per move in every panel
    for label, shares in m["by_turn"].items():
        axes[0].plot(np.arange(1, len(shares) + 1), shares, marker="o", ms=3, label=label, color=color[label])
    axes[0].set(title="Moves by turn", xlabel="persuader turn", ylabel="share of messages", ylim=(-0.02, 1.02))
    axes[0].legend(fontsize=7)
    for ax, key, title in ((axes[1], "dense", "effect on the turn's r_t"), (axes[2], "accept", "effect on P(ACCEPT)")):
        labels = list(moves.MOVES)
        for y, label in enumerate(labels):
            e = m["effects"][label][key]
            if e is not None:
                ax.errorbar(e["diff"], y, xerr=[[e["diff"] - e["low"]], [e["high"] - e["diff"]]], fmt="o", capsize=3,
                            color=color[label])
        ax.set_yticks(range(len(labels)), labels, fontsize=8)
        ax.axvline(0, color="black", lw=0.5)
        ax.set(title=f"{title}, 95% CI", xlabel="with the move - without it")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    _save_fig(fig, path)


def plot_case(ep, path):
    """Table 8 as a figure: the probes and b_t by turn above; below, r_t with its share of sum |r_t|
    and, in brackets, its signed share of the net sum r_t."""
    rows = analyses.case_rows(ep)
    t = [row["t"] for row in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=CASE_FIGSIZE, sharex=True)
    for k in probe_names():
        top.plot(t, [row[k] for row in rows], marker="o", ms=3, label=k)
    top.plot(t, [row["b"] for row in rows], marker="s", color="black", lw=2, label="b_t")
    top.set(title=f"{ep.scenario_id}: {ep.outcome} after {ep.turns} turns", ylabel="probe value",
            ylim=(-1.05, 1.05))
    top.legend(fontsize=8)
    bars = [(row["t"], row["r"], row["share"], row["signed_share"]) for row in rows if row["r"] is not None]
    if bars:
        xs, rs, shares, signed = zip(*bars)
        bottom.bar(xs, rs, color=["tab:green" if r >= 0 else "tab:red" for r in rs])
        for x, r, share, net in zip(xs, rs, shares, signed):
            bottom.annotate(f"{analyses.pct(share)} ({analyses.pct(net)})", (x, r), ha="center",
                            va="bottom" if r >= 0 else "top", fontsize=8)
    bottom.axhline(0, color="black", lw=0.5)
    bottom.set(xlabel="turn t", ylabel="process reward r_t",
               title="share of sum |r_t| (signed share of the net sum r_t)")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    _save_fig(fig, path)


def system_labels(names):
    """The shortest trailing part of each folder path that tells the systems apart
    ("evals/A" and "evals/B" -> "A", "B"; "runs/x/eval-8" and "runs/y/eval-8" -> "x/eval-8", ...)."""
    parts = [Path(n).parts or (n,) for n in names]
    for k in range(1, max(len(p) for p in parts) + 1):
        labels = ["/".join(p[-k:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return list(names)


def plot_overlay(runs, path):
    """Fig. 6: runs (name -> episodes) overlaid: mean belief b_t by turn, mean r_t by turn."""
    fig, axes = plt.subplots(1, 2, figsize=OVERLAY_FIGSIZE)
    for name, episodes in zip(system_labels(runs), runs.values()):
        for ax, rows, start in ((axes[0], [ep.beliefs for ep in episodes], 0),
                                (axes[1], [analyses.raw_process_rewards(ep) for ep in episodes], 1)):
            mean, half = significance.mean_band(rows)
            x = np.arange(start, start + mean.size)
            ax.plot(x, mean, marker="o", ms=3, label=f"{name} (n={len(episodes)})")
            ax.fill_between(x, mean - half, mean + half, alpha=0.2)
    axes[0].set(title="Belief by turn (mean, 95% CI)", xlabel="turn t", ylabel="b_t", ylim=(-1.05, 1.05))
    axes[1].set(title="Process reward by turn (mean, 95% CI)", xlabel="turn t", ylabel="r_t (measured beliefs)")
    for ax in axes:
        ax.axhline(0, color="black", lw=0.5)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    _save_fig(fig, path)


def plot_probe_overlay(runs, path):
    """Fig. 6: runs (name -> episodes) overlaid per probe, one panel each for CA, PE and AC: the
    mean probe value by turn of every system, 95% bands."""
    fig, axes = plt.subplots(1, len(probe_names()), figsize=PROBE_FIGSIZE, sharey=True)
    for i, (ax, probe) in enumerate(zip(axes, probe_names())):
        for name, episodes in zip(system_labels(runs), runs.values()):
            mean, half = significance.mean_band([[row[i] for row in ep.probes] for ep in episodes])
            x = np.arange(mean.size)
            ax.plot(x, mean, marker="o", ms=3, label=f"{name} (n={len(episodes)})")
            ax.fill_between(x, mean - half, mean + half, alpha=0.2)
        ax.set(title=f"{probe_title(probe)} by turn", xlabel="turn t (0 = before the first message)",
               ylabel="probe value 2p(yes) - 1", ylim=(-1.05, 1.05))
        ax.axhline(0, color="black", lw=0.5)
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].legend(fontsize=8, loc="lower left")
    fig.suptitle("Per-probe trajectories by system (mean, 95% CI)")
    fig.tight_layout()
    _save_fig(fig, path)


def plot_runs(analyses, path):
    """Held-out acceptance by step per run; training against held-out acceptance per checkpoint;
    Fig. 3, the best checkpoint's held-out acceptance over lambda (when the runs differ in it)."""
    fig, axes = plt.subplots(1, 3, figsize=RUNS_FIGSIZE)
    for a in analyses:
        axes[0].plot(a["steps"], a["heldout_accept"], marker="o", ms=4, label=a["name"])
        axes[0].plot(a["best"]["step"], a["best"]["full_accept"], marker="*", ms=12, color="black")
        axes[1].scatter(a["train_accept"], a["heldout_accept"], label=a["name"])
    axes[0].set(title="Held-out acceptance by step (* best)", xlabel="training step", ylabel="full acceptance")
    axes[1].set(title="Checkpoints: training vs held-out", xlabel="training acceptance", ylabel="held-out acceptance")
    lams = sorted({a["lam"] for a in analyses if a["lam"] is not None})
    if len(lams) > 1:
        best = {lam: max(a["best"]["full_accept"] for a in analyses if a["lam"] == lam) for lam in lams}
        axes[2].plot(lams, [best[lam] for lam in lams], marker="o")
        axes[2].set(title="Best checkpoint by lambda (Fig. 3)", xlabel="lambda", ylabel="held-out full acceptance")
    else:
        axes[2].set_visible(False)
    for ax in axes[:2]:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[2].grid(alpha=0.3)
    fig.tight_layout()
    _save_fig(fig, path)


def plot_dynamics(runs, path):
    """Fig. 7: dead-group shares (both definitions), dead groups rescued, and the two advantage
    terms by step per run (a panel says so where no run logged its figure)."""
    fig, axes = plt.subplots(1, len(RUN_DYNAMICS), figsize=(RUN_PANEL_SIZE[0] * len(RUN_DYNAMICS), RUN_PANEL_SIZE[1]))
    for ax, (key, title) in zip(axes, RUN_DYNAMICS.items()):
        for run in runs:
            pts = [(m["step"], m[key]) for m in run["metrics"] if is_number(m.get(key))]
            if pts:
                ax.plot(*zip(*pts), marker="o", ms=3, label=run["name"])
        ax.set(title=title, xlabel="training step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "not logged by these runs", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    _save_fig(fig, path)


def run_panels(keys):
    """plot_run's panels, (title, keys): the outcome shares (outcome_ACCEPT, ..., one per
    arena outcome) together, every other metric alone (outcome_term_abs is an advantage
    magnitude, not a share)."""
    shares = [k for k in keys if k.startswith("outcome_") and k.removeprefix("outcome_") in OUTCOME_COLORS]
    return ([("outcome shares", shares)] if shares else []) + [(k, [k]) for k in keys if k not in shares]


def plot_run(run_dir):
    """Training curves from run_dir/metrics.jsonl into run_dir/curves.png: one panel per numeric
    metric, the outcome_* shares together in one panel. Returns the PNG path."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir} is not a directory; pass a training run such as runs/NAME")
    rows = [row for _, row in read_jsonl(run_dir / "metrics.jsonl",
                                         what="a training run directory written by train.py")]
    if not rows:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} is empty; let train.py log at least one step")
    steps = [row.get("step", i) for i, row in enumerate(rows)]
    keys = list(dict.fromkeys(k for row in rows for k, v in row.items() if k != "step" and is_number(v)))
    panels = run_panels(keys)
    if not panels:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} has no numeric metrics to plot")
    nrows = math.ceil(len(panels) / RUN_COLS)
    fig, axes = plt.subplots(nrows, RUN_COLS, squeeze=False,
                             figsize=(RUN_PANEL_SIZE[0] * RUN_COLS, RUN_PANEL_SIZE[1] * nrows))
    for ax, (title, group) in zip(axes.flat, panels):
        for k in group:
            pts = [(s, row[k]) for s, row in zip(steps, rows) if is_number(row.get(k))]
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


SWEEP_FIGSIZE = (16.0, 4.0)


def plot_sweep(entries, rows, folder):
    """sweep.py's figures: curves.png, held-out b_T - b_0 and full acceptance by checkpoint step,
    one line per lambda (mean over seeds, 95% band over seeds: significance.mean_band), and the
    training steps' dead-group share with the share of them the dense term rescued (Fig. 7,
    means over the steps up to each checkpoint; step 0 has none); effect.png,
    each lambda's last checkpoint minus the initial policy in b_T - b_0, the 95% t interval of
    the episode pairs and, beside it, of the seeds' means (seed level), each labelled."""
    fig, axes = plt.subplots(1, 3, figsize=SWEEP_FIGSIZE)
    for lam in sorted({e["lam"] for e in entries}):
        mine = [e for e in entries if e["lam"] == lam]
        steps = sorted({e["step"] for e in mine})
        for ax, key in zip(axes, ("mean_belief_change", "full_accept", "dead_group_share")):
            series = [[e[key] for e in sorted(mine, key=lambda e: e["step"]) if e["seed"] == s]
                      for s in sorted({e["seed"] for e in mine})]
            series = [[math.nan if v is None else v for v in row] for row in series]
            mean, half = significance.mean_band(series)
            line, = ax.plot(steps[:mean.size], mean, marker="o", ms=3, label=f"lambda {lam:g}")
            ax.fill_between(steps[:mean.size], mean - half, mean + half, alpha=0.2)
        rescued = [[math.nan if e["rescued_share"] is None else e["rescued_share"]
                    for e in sorted(mine, key=lambda e: e["step"]) if e["seed"] == s]
                   for s in sorted({e["seed"] for e in mine}) if "rescued_share" in mine[0]]
        if rescued:  # Fig. 7's rescued share beside the dead groups, dashed, in the arm's colour
            mean, _ = significance.mean_band(rescued)
            axes[2].plot(steps[:mean.size], mean, ls="--", color=line.get_color(),
                         label=f"lambda {lam:g} rescued")
    for ax, title in zip(axes, ("held-out mean b_T - b_0\n(band: 95% over seeds)",
                                "held-out full acceptance\n(band: 95% over seeds)",
                                "training: dead groups (solid),\nthe share of them rescued (dashed)")):
        ax.set(title=title, xlabel="training step (0 = initial policy)")
        ax.grid(alpha=0.3)
        ax.legend()
    _save_fig(fig, Path(folder) / "curves.png")
    last = [r for r in rows if r["which"] == "last"]
    fig, ax = plt.subplots(figsize=BELIEF_FIGSIZE)
    for i, r in enumerate(last):
        vs = r["vs_initial"]
        seed = (vs["seed_level"] or {}).get("belief_change")
        for dx, (diff, low, high), label in (
                (-0.1, (vs["belief_diff"], vs["belief_diff_low"], vs["belief_diff_high"]),
                 "episode level: pairs (seed, scenario), 95% t"),
                (0.1, (seed["diff"], seed["low"], seed["high"]) if seed else (None, None, None),
                 "seed level: seeds' means, 95% t over seeds")):
            if diff is None:
                continue
            err = [[diff - (diff if low is None else low)], [(diff if high is None else high) - diff]]
            ax.errorbar([i + dx], [diff], yerr=err, fmt="o" if dx < 0 else "s", capsize=4,
                        color="C0" if dx < 0 else "C3", label=label if i == 0 else None)
    ax.set_xticks(range(len(last)), [f"lambda {r['lam']:g}\nstep {r['step']}" for r in last])
    ax.axhline(0, color="black", lw=0.5)
    ax.set(title="held-out effect: last checkpoint minus initial policy", ylabel="paired diff of b_T - b_0")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    _save_fig(fig, Path(folder) / "effect.png")


TRAINING_WINDOW = 10  # steps in training.png's running means


def running_mean(values, window=TRAINING_WINDOW):
    """The mean of each value and the window - 1 before it (fewer at the start)."""
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i + 1 - window):i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def plot_training(arms, control, folder, window=TRAINING_WINDOW):
    """training.png: each arm's training episodes against its same-seed frozen control (lr 0:
    the same instances and random streams, only the weights differ). arms: {label: {seed: [mean
    b_T - b_0 of each step's training episodes]}}, control: {seed: [...]}. Left, running means
    over `window` steps of every arm and the control (seeds averaged); right, the difference arm
    minus control, a running mean per seed, its mean over seeds and, from two seeds, a 95% t
    band over seeds (significance.mean_band)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=OVERLAY_FIGSIZE)
    seeds = sorted(control)
    frozen_mean = np.mean([control[s] for s in seeds], axis=0)
    left.plot(range(1, frozen_mean.size + 1), running_mean(list(frozen_mean), window), color="black",
              label="frozen control (lr 0)")
    for label, by_seed in arms.items():
        rows = [by_seed[s][:len(control[s])] for s in seeds if s in by_seed]
        mean = np.mean(rows, axis=0)
        line, = left.plot(range(1, mean.size + 1), running_mean(list(mean), window), label=label)
        diffs = [running_mean([a - b for a, b in zip(by_seed[s], control[s])], window) for s in seeds if s in by_seed]
        middle, half = significance.mean_band(diffs)
        steps = range(1, middle.size + 1)
        for d in diffs:
            right.plot(range(1, len(d) + 1), d, color=line.get_color(), alpha=0.3, lw=0.8)
        right.plot(steps, middle, color=line.get_color(), lw=2, label=f"{label}, mean over {len(diffs)} seeds")
        if len(diffs) > 1:
            right.fill_between(steps, middle - half, middle + half, color=line.get_color(), alpha=0.2)
    left.set(title=f"training episodes' b_T - b_0\n({window}-step running mean, seeds averaged)",
             xlabel="training step", ylabel="mean b_T - b_0")
    right.axhline(0, color="black", lw=0.5)
    right.set(title="trained minus frozen control, running mean\n(thin: each seed; band: 95% t over seeds)",
              xlabel="training step", ylabel="difference in b_T - b_0")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    _save_fig(fig, Path(folder) / "training.png")


FIG7_KEYS = (("dead_group_share", "dead groups (all R equal)"),
             ("rescued_share", "dead groups the dense term rescues"),
             ("dense_share", "dense term's share of |A|"),
             ("grad_clipped_share", "clipped: steps by grad norm (solid),\ntokens by ratio (dashed)"))


def plot_fig7(fig7, folder, paper_dense_share, window=TRAINING_WINDOW):
    """fig7.png: the paper's Fig. 7 quantities by training step (sweep_table.fig7_rows), one line
    per lambda, each a running mean over `window` steps of the seeds' pooled step values; the
    paper's dense share (sweep_table.PAPER_DENSE_SHARE, about 15% at lambda 0.5) dotted."""
    fig, axes = plt.subplots(1, 4, figsize=(SWEEP_FIGSIZE[0] * 4 / 3, SWEEP_FIGSIZE[1]))
    for r in fig7:
        steps = sorted(r["by_step"], key=int)
        for ax, (key, _) in zip(axes, FIG7_KEYS):
            values = [r["by_step"][s][key] for s in steps]
            kept = [(int(s), v) for s, v in zip(steps, values) if v is not None]
            if not kept:
                continue
            line, = ax.plot([s for s, _ in kept], running_mean([v for _, v in kept], window),
                            label=f"lambda {r['lam']:g}")
            if key == "grad_clipped_share":
                clip = [(int(s), r["by_step"][s]["clip_frac"]) for s in steps
                        if r["by_step"][s]["clip_frac"] is not None]
                ax.plot([s for s, _ in clip], running_mean([v for _, v in clip], window), ls="--",
                        color=line.get_color())
    axes[2].axhline(paper_dense_share, color="black", ls=":", lw=1, label="paper, lambda 0.5")
    for ax, (_, title) in zip(axes, FIG7_KEYS):
        ax.set(title=title, xlabel=f"training step ({window}-step running mean)", ylim=(-0.02, 1.02))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    _save_fig(fig, Path(folder) / "fig7.png")


def plot_pooled(by_lam, seed_level, step, path):
    """sweep_table's pooled figure: per lambda, each seed's difference from lambda 0 at one step
    (a dot a seed, left to right in seed order), in b_T - b_0 and in full acceptance points,
    beside the mean and its 95% t interval over the seeds (seed_level's paired t)."""
    fig, axes = plt.subplots(1, 2, figsize=OVERLAY_FIGSIZE)
    lams = sorted(seed_level)
    for ax, (i, key, scale, label) in zip(axes, ((1, "belief_change", 1.0, "b_T - b_0"),
                                                 (0, "full_accept", 100.0, "full acceptance, points"))):
        for x, lam in enumerate(lams):
            seeds = sorted(s for s in by_lam[lam] if s in by_lam[0.0])
            diffs = [scale * (by_lam[lam][s][i] - by_lam[0.0][s][i]) for s in seeds]
            spread = np.linspace(x - 0.35, x - 0.05, len(diffs))
            ax.scatter(spread, diffs, s=14, color="grey", label="a seed (seed order)" if x == 0 else None)
            level = seed_level[lam][key] if seed_level[lam] else None
            if level:
                mean, low, high = (scale * level[k] for k in ("diff", "low", "high"))
                ax.errorbar([x + 0.15], [mean], yerr=[[mean - low], [high - mean]], fmt="s",
                            color="tab:red", capsize=5,
                            label=f"mean, 95% t over {level['n']} seeds" if x == 0 else None)
        ax.axhline(0.0, color="black", lw=0.8)
        ax.set_xticks(range(len(lams)), [f"lambda {lam:g} - 0" for lam in lams])
        ax.set(title=f"held-out {label}, step {step}", xlim=(-0.6, len(lams) - 0.4))
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize="small")
    _save_fig(fig, path)
