"""
sweep_table.py: the statistics of a lambda sweep (lab/sweep.py), from its arms' held-out episodes
and training rollouts to summary.json's table and table.md.

Per lambda, its last checkpoint (the primary row) and its best (selected on the same held-out
episodes, labelled so), seeds pooled: Wilson intervals of the acceptance shares, a t interval of
b_T - b_0, paired tests (pairs: same seed, same scenario) against lambda = 0 and against the
initial policy (exact McNemar on full acceptance, Wilcoxon on b_T - b_0) and, from
SEED_LEVEL_MIN seeds, the same comparisons with the seed as the unit (a paired t test over the
seeds' means: the seed is what replicates a training effect). Power at both levels. Against a
same-seed frozen control (lr 0) on the training episodes: a t test over the seeds' mean
differences, and a group as one cluster beside it.

Sweeps of the same settings on different seeds pool at the seed level (a sweep longer than a
sitting, or more seeds added later): each lambda against lambda 0 at one step, over the union of
their seeds, from their summary.json's per-arm entries alone (pooled_seed_level).

    python -m lab.sweep_table --step 25 sweeps/smollm2-logit-50 sweeps/smollm2-logit-25 \
        --out sweeps/smollm2-logit-25       # also pooled-step25.json and pooled-step25.png
    python -m pytest -q tests/test_sweep_table.py
"""
import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from lab import analyses
from lab import runs
from lab import significance

SEED_LEVEL_MIN = 3  # seeds from which the comparisons carry a paired t test over seeds (seed_level)
PAPER_DENSE_SHARE = 0.15  # the paper's dense share of |A| at lambda 0.5 (its Fig. 7), beside ours
POOL_FREE = ("seeds", "steps", "name", "out", "save_every")  # sweep.json keys pooled sweeps may differ in


def belief_changes(episodes):
    """{scenario_id: b_T - b_0} of the episodes whose beliefs were read."""
    return {ep.scenario_id: ep.beliefs[-1] - ep.beliefs[0]
            for ep in analyses.with_beliefs(episodes)}


def paired(a, b):
    """Paired tests of episode sets a against b, keyed by (seed, scenario): exact McNemar on full
    acceptance, Wilcoxon on b_T - b_0, and the mean of the paired b_T - b_0 differences."""
    common = sorted(set(a) & set(b))
    accept = [a[k].outcome == "ACCEPT" for k in common], [b[k].outcome == "ACCEPT" for k in common]
    both = [k for k in common if analyses.with_beliefs([a[k]]) and analyses.with_beliefs([b[k]])]
    change = lambda ep: ep.beliefs[-1] - ep.beliefs[0]
    diffs = [change(a[k]) - change(b[k]) for k in both]
    mean, low, high = significance.t_interval(diffs)
    sd = statistics.stdev(diffs) if len(diffs) > 1 else None
    return dict(n=len(common), mcnemar_p=significance.mcnemar(*accept), belief_diff_sd=sd,
                wilcoxon_p=significance.wilcoxon([change(a[k]) for k in both],
                                             [change(b[k]) for k in both]) if both else None,
                belief_diff=mean, belief_diff_low=low, belief_diff_high=high)


def pooled(runs, seeds, step):
    """{(seed, scenario): episode} at one step over seeds (runs: seed -> {step: episodes})."""
    return {(s, ep.scenario_id): ep for s in seeds for ep in runs[s].get(step, [])}


def per_seed(runs, seeds, step):
    """{seed: (full acceptance share, mean b_T - b_0)} of one lambda's held-out episodes at a
    step (runs: seed -> {step: episodes}); None where a seed has no episodes or no beliefs."""
    out = {}
    for s in seeds:
        episodes = runs[s].get(step, [])
        changes = list(belief_changes(episodes).values())
        out[s] = (sum(ep.outcome == "ACCEPT" for ep in episodes) / len(episodes) if episodes else None,
                  sum(changes) / len(changes) if changes else None)
    return out


def seed_level(a, b):
    """The comparison whose unit is the seed (the unit of replication of a training effect): a
    paired t test over the seeds' means, a minus b (per_seed's), on full acceptance and on
    b_T - b_0; None below SEED_LEVEL_MIN seeds."""
    seeds = [s for s in a if s in b]
    if len(seeds) < SEED_LEVEL_MIN:
        return None
    out = dict(seeds=len(seeds))
    for i, key in enumerate(("full_accept", "belief_change")):
        both = [s for s in seeds if a[s][i] is not None and b[s][i] is not None]
        out[key] = significance.paired_t([a[s][i] for s in both], [b[s][i] for s in both])
    return out


def between_seed_sd(means):
    """The sd over seeds of their means (per_seed's), per measure; None below two seeds."""
    out = {}
    for i, key in enumerate(("full_accept", "belief_change")):
        values = [m[i] for m in means.values() if m[i] is not None]
        out[key] = statistics.stdev(values) if len(values) > 1 else None
    return out


def table_rows(held_out, lams, seeds, steps):
    """Per lambda its last checkpoint (the primary row) and its best (highest mean full
    acceptance over seeds, then b_T - b_0, chosen on these same held-out episodes, so labelled
    selected_on "test episodes": optimistic), seeds pooled, against lambda = 0 (same step) and
    the initial policy: episode-level tests, and with SEED_LEVEL_MIN seeds or more seed_level;
    between_seed_sd beside them."""
    rows = []
    for lam in lams:
        def score(step):
            eps = list(pooled(held_out[lam], seeds, step).values())
            changes = [c for s in seeds for c in belief_changes(held_out[lam][s].get(step, [])).values()]
            return (sum(ep.outcome == "ACCEPT" for ep in eps) / max(len(eps), 1),
                    sum(changes) / len(changes) if changes else -math.inf)
        best = max(steps, key=score)
        for which, step in (("last", steps[-1]), ("best", best)):
            rows.append(table_row(held_out, lam, seeds, step, which))
    return rows


def table_row(held_out, lam, seeds, step, which):
    """One row of table_rows."""
    eps = pooled(held_out[lam], seeds, step)
    episodes = list(eps.values())
    accept = sum(ep.outcome == "ACCEPT" for ep in episodes)
    either = sum(ep.outcome in ("ACCEPT", "CONDITIONAL_ACCEPT") for ep in episodes)
    changes = [ep.beliefs[-1] - ep.beliefs[0] for ep in analyses.with_beliefs(episodes)]
    mine = per_seed(held_out[lam], seeds, step)
    vs_initial = dict(paired(eps, pooled(held_out[lam], seeds, 0)),
                      seed_level=seed_level(mine, per_seed(held_out[lam], seeds, 0)))
    vs_lambda0 = None if lam == 0.0 or 0.0 not in held_out else dict(
        paired(eps, pooled(held_out[0.0], seeds, step)),
        seed_level=seed_level(mine, per_seed(held_out[0.0], seeds, step)))
    return dict(lam=lam, which=which, step=step, n=len(episodes), seeds=len(seeds),
                selected_on="test episodes" if which == "best" else None,
                full_accept=accept / max(len(episodes), 1),
                full_accept_interval=significance.wilson_interval(accept, len(episodes)),
                full_or_conditional=either / max(len(episodes), 1),
                full_or_conditional_interval=significance.wilson_interval(either, len(episodes)),
                belief_change=significance.t_interval(changes), between_seed_sd=between_seed_sd(mine),
                vs_initial=vs_initial, vs_lambda0=vs_lambda0)


def frozen_rows(runs, frozen, lams, seeds, steps):
    """Each arm against its seed's lr-0 control on the training episodes of the second half of
    training, paired by step, group and member; a group (one instance, one policy: its members
    are not independent) is one cluster: the mean of its paired differences. Over the clusters:
    mean (b_T - b_0) difference, t interval, Wilcoxon, the difference detectable at 80% power."""
    rows = []
    for lam in lams:
        a, b = {}, {}
        for s in seeds:
            for side, source in ((a, runs[lam][s]), (b, frozen[s])):
                for r in source["rollouts"]:
                    if r["step"] > steps // 2 and r["b_0"] is not None and r["b_T"] is not None:
                        side[s, r["step"], r["group"], r["member"]] = r["b_T"] - r["b_0"]
        keys = sorted(set(a) & set(b))
        clusters = {}
        for k in keys:
            clusters.setdefault(k[:3], []).append(a[k] - b[k])
        diffs = [sum(d) / len(d) for d in clusters.values()]
        mean, low, high = significance.t_interval(diffs)
        detectable = (significance.detectable_mean(statistics.stdev(diffs), len(diffs), paired=True)
                      if len(diffs) > 1 else None)  # at 80% power, alpha 0.05
        rows.append(dict(lam=lam, n=len(diffs), pairs=len(keys), belief_diff=mean, low=low, high=high,
                         detectable=detectable,
                         wilcoxon_p=significance.wilcoxon(diffs, [0.0] * len(diffs)) if diffs else None,
                         seed_level=frozen_seed_level(clusters, seeds)))
    return rows


def frozen_seed_level(clusters, seeds):
    """The frozen-control comparison with the seed as the unit: each seed's mean of its groups'
    paired differences, then a t test over the seeds against 0 (paired_t), and the difference
    that many seeds detect at 80% power; None below SEED_LEVEL_MIN seeds."""
    by_seed = {}
    for (seed, *_), d in clusters.items():
        by_seed.setdefault(seed, []).append(sum(d) / len(d))
    means = [sum(v) / len(v) for s, v in sorted(by_seed.items()) if s in seeds]
    if len(means) < SEED_LEVEL_MIN:
        return None
    t = significance.paired_t(means, [0.0] * len(means))
    return dict(t, detectable=significance.detectable_mean(t["sd"], len(means), paired=True) if t["sd"] else None)


def sweep_power(rows, initial):
    """What the held-out comparisons could detect at 80% power, two-sided alpha 0.05: a paired
    b_T - b_0 difference (the sd of the paired differences pooled over every comparison of the
    table, as a root mean square) and a rise in full acceptance from the initial policy's share
    (independent proportions: McNemar's own power depends on the discordant pairs)."""
    sds = [vs["belief_diff_sd"] for r in rows for vs in (r["vs_initial"], r["vs_lambda0"])
           if vs is not None and vs["belief_diff_sd"] is not None]
    n = min(r["vs_initial"]["n"] for r in rows)
    sd = math.sqrt(sum(x * x for x in sds) / len(sds)) if sds else None
    p0 = sum(ep.outcome == "ACCEPT" for ep in initial) / max(len(initial), 1)
    return dict(pairs=n, belief_diff_sd=sd, initial_full_accept=p0,
                detectable_belief_diff=sd and n and significance.detectable_mean(sd, n, paired=True),
                detectable_full_accept=n and significance.detectable_proportion(p0, n),
                seed_level=seed_power(rows))


def seed_power(rows):
    """What the seed-level comparisons could detect at 80% power, two-sided alpha 0.05 (paired t
    over the seeds' means, t quantiles at seeds - 1 degrees of freedom): per measure the sd of the
    seeds' paired differences pooled over every seed-level comparison of the table (root mean
    square) and the difference that many seeds detect; None below SEED_LEVEL_MIN seeds. With
    few seeds this is far larger than the episode-level figure: the seed is what replicates."""
    levels = [vs.get("seed_level") for r in rows for vs in (r["vs_initial"], r["vs_lambda0"])
              if vs is not None and vs.get("seed_level")]
    if not levels:
        return None
    out = dict(seeds=min(level["seeds"] for level in levels))
    for key in ("full_accept", "belief_change"):
        sds = [level[key]["sd"] for level in levels if level[key]["sd"] is not None]
        sd = math.sqrt(sum(x * x for x in sds) / len(sds)) if sds else None
        out[key] = dict(sd=sd, detectable=significance.detectable_mean(sd, out["seeds"], paired=True)
                        if sd else None)  # no spread: nothing to scale a detectable difference by
    return out


def fig7_rows(metrics, lams, seeds, grad_clip):
    """The paper's Fig. 7 per lambda, from its arms' training metrics ({lam: {seed: [metrics.jsonl
    rows]}}): by step (seeds averaged) and over the whole run (every step of every seed), the
    dead-group share (all R equal), the share of dead groups the dense term gives a nonzero
    advantage (pooled: a step's share weighted by its dead groups), the dense term's share of
    sum |A| (the mean of the steps' shares), and the clipping: the share of steps whose gradient
    norm exceeded grad_clip (the update rescaled: train.GRAD_CLIP) and the mean share of tokens
    whose ratio the PPO clip held (clip_frac)."""
    def pooled_stats(rows):
        rows = [m for m in rows if m.get("dead_group_share") is not None]
        dead = sum(m["dead_group_share"] for m in rows)
        mean = lambda key: (sum(m[key] for m in rows if m.get(key) is not None)
                            / max(sum(m.get(key) is not None for m in rows), 1)) if rows else None
        return dict(dead_group_share=mean("dead_group_share"),
                    rescued_share=(sum(m["dead_group_share"] * (m.get("dead_rescued_share") or 0.0)
                                       for m in rows) / dead) if dead else None,
                    dense_share=mean("dense_share"), clip_frac=mean("clip_frac"),
                    grad_clipped_share=(sum(m.get("grad_norm") is not None and m["grad_norm"] > grad_clip
                                            for m in rows) / len(rows)) if rows else None)
    out = []
    for lam in lams:
        by_seed = [metrics[lam][s] for s in seeds if s in metrics.get(lam, {})]
        steps = sorted({m["step"] for rows in by_seed for m in rows})
        at = {step: [m for rows in by_seed for m in rows if m["step"] == step] for step in steps}
        out.append(dict(lam=lam, seeds=len(by_seed), run=pooled_stats([m for rows in by_seed for m in rows]),
                        by_step={str(step): pooled_stats(at[step]) for step in steps}))
    return out


def fig7_lines(fig7):
    """table.md's Fig. 7 section: each lambda's run-level shares (fig7_rows)."""
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}"
    lines = ["", f"Fig. 7 (training steps, every step of every seed; the paper's dense share of |A| at "
             f"lambda 0.5 is about {100 * PAPER_DENSE_SHARE:.0f}%; fig7.png by step):", "",
             "| lambda | seeds | dead groups % | dead groups the dense term rescues % | dense share of "
             "\\|A\\| % | steps grad-norm clipped % | tokens ratio-clipped % |", "|" + "---|" * 7]
    for r in fig7:
        run = r["run"]
        lines.append(f"| {r['lam']:g} | {r['seeds']} | {pct(run['dead_group_share'])} | "
                     f"{pct(run['rescued_share'])} | {pct(run['dense_share'])} | "
                     f"{pct(run['grad_clipped_share'])} | {pct(run['clip_frac'])} |")
    return lines


def _f(x, fmt="+.4f"):
    return "-" if x is None else format(x, fmt)


def _p(x):
    return "-" if x is None else f"{x:.3g}"


def count_tests(rows, frozen=None):
    """The p-values table.md holds (none corrected for multiplicity)."""
    ps = [vs[k] for r in rows for vs in (r["vs_initial"], r["vs_lambda0"]) if vs
          for k in ("mcnemar_p", "wilcoxon_p")]
    ps += [vs["seed_level"][k]["p"] for r in rows for vs in (r["vs_initial"], r["vs_lambda0"])
           if vs and vs["seed_level"] for k in ("full_accept", "belief_change")]
    ps += [r["wilcoxon_p"] for r in frozen or ()]
    ps += [r["seed_level"]["p"] for r in frozen or () if r.get("seed_level")]
    return sum(p is not None for p in ps)


def _diff(t, scale=1.0, fmt="+.4f"):
    """A paired_t result as 'diff [low, high] p'."""
    if t is None or t["diff"] is None:
        return "-"
    at = lambda x: None if x is None else scale * x
    return f"{_f(at(t['diff']), fmt)} [{_f(at(t['low']), fmt)}, {_f(at(t['high']), fmt)}] p {_p(t['p'])}"


def seed_table(rows):
    """table.md's seed-level section: per row the paired t tests over seeds and the sd between seeds."""
    lines = ["", f"Seed level ({rows[0]['seeds']} seeds; paired t over the seeds' means, 95% "
             "intervals; the unit of replication of a training effect is the seed):", "",
             "| lambda | checkpoint | vs initial: full accept pts | b_T - b_0 | vs lambda 0: full "
             "accept pts | b_T - b_0 | between-seed sd: full accept pts | b_T - b_0 |", "|" + "---|" * 8]
    for r in rows:
        cells = [f"{r['lam']:g}", f"{r['which']}{'*' if r['selected_on'] else ''} (step {r['step']})"]
        for vs in (r["vs_initial"], r["vs_lambda0"]):
            level = vs and vs["seed_level"]
            cells += ([_diff(level["full_accept"], 100, "+.1f"), _diff(level["belief_change"])]
                      if level else ["-", "-"])
        sd = r["between_seed_sd"]
        cells += [_f(sd["full_accept"] and 100 * sd["full_accept"], ".1f"), _f(sd["belief_change"], ".4f")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def format_table(rows, frozen=None, header="", power=None, fig7=None):
    """table.md: the rows of table_rows (and frozen_rows, sweep_power and fig7_rows) as markdown."""
    pct = lambda v, iv: f"{100 * v:.1f} [{_f(iv[0] and 100 * iv[0], '.1f')}, {_f(iv[1] and 100 * iv[1], '.1f')}]"
    lines = [header, "", "| lambda | checkpoint | n | full accept % [95%] | FA+CA % [95%] | "
             "b_T - b_0 [95%] | vs initial: McNemar p | Wilcoxon p | paired diff | "
             "vs lambda 0: McNemar p | Wilcoxon p | paired diff |", "|" + "---|" * 12]
    for r in rows:
        mean, low, high = r["belief_change"]
        cells = [f"{r['lam']:g}", f"{r['which']}{'*' if r['selected_on'] else ''} (step {r['step']})",
                 str(r["n"]), pct(r["full_accept"], r["full_accept_interval"]),
                 pct(r["full_or_conditional"], r["full_or_conditional_interval"]),
                 f"{_f(mean)} [{_f(low)}, {_f(high)}]"]
        for vs in (r["vs_initial"], r["vs_lambda0"]):
            cells += (["-"] * 3 if vs is None else
                      [_p(vs["mcnemar_p"]), _p(vs["wilcoxon_p"]),
                       f"{_f(vs['belief_diff'])} [{_f(vs['belief_diff_low'])}, {_f(vs['belief_diff_high'])}]"])
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Episode level: the pairs are (seed, scenario), seeds pooled; they describe the "
              "trained policies, not lambda. last: the primary row. best*: the checkpoint with the "
              "highest full acceptance on these same held-out episodes, selected on the test "
              "episodes, so optimistic."]
    if any(vs and vs["seed_level"] for r in rows for vs in (r["vs_initial"], r["vs_lambda0"])):
        lines += seed_table(rows)
    if power:
        rise = power["detectable_full_accept"]
        lines += ["", f"Power (80%, two-sided alpha 0.05, t for means, {power['pairs']} held-out pairs a "
                  f"comparison): a paired b_T - b_0 difference of {_f(power['detectable_belief_diff'], '.4f')} "
                  f"(sd of the paired differences {_f(power['belief_diff_sd'], '.4f')}); a rise in full "
                  f"acceptance from the initial {100 * power['initial_full_accept']:.1f}% of "
                  + ("more than the sample allows" if rise is None else f"{100 * rise:.1f} points")
                  + " (independent proportions): episode level, which overstates what replicates."]
        lines += seed_power_lines(power.get("seed_level"))
    if frozen:
        lines += frozen_lines(frozen)
    if fig7:
        lines += fig7_lines(fig7)
    lines += ["", f"This table holds {count_tests(rows, frozen)} tests (p-values), none corrected "
              "for multiplicity: at alpha 0.05, one in twenty falls below it by chance when nothing differs."]
    return "\n".join(lines) + "\n"


def seed_power_lines(level):
    """table.md's seed-level power sentence (sweep_power's seed_level), none below SEED_LEVEL_MIN."""
    if not level:
        return []
    fa, bc = level["full_accept"], level["belief_change"]
    return [f"Power at the seed level ({level['seeds']} seeds, paired t over the seeds' means, 80%, "
            f"alpha 0.05): a b_T - b_0 difference of {_f(bc['detectable'], '.4f')} (sd of the seeds' "
            f"paired differences {_f(bc['sd'], '.4f')}); a full-acceptance difference of "
            f"{_f(fa['detectable'] and 100 * fa['detectable'], '.1f')} points (sd "
            f"{_f(fa['sd'] and 100 * fa['sd'], '.1f')} points)."]


def frozen_lines(frozen):
    """table.md's frozen-control section: the seed level first (the unit that replicates), then
    the groups as clusters, which describe these seeds' trained policies only."""
    lines = ["", "Against the same-seed frozen control (lr 0), training episodes of the second half, "
             "paired by step, group and member. Seed level: each seed's mean paired difference, a "
             "t test over the seeds (95% interval). Group level: a group one cluster (the mean of "
             "its members' differences), pooled over seeds, describing these seeds' policies:", "",
             "| lambda | seed level: diff of b_T - b_0 [95%] p | detectable (80%) | groups (pairs) | "
             "group level: mean diff [95%] | Wilcoxon p | detectable (80%) |", "|---|---|---|---|---|---|---|"]
    for r in frozen:
        level = r.get("seed_level")
        lines.append(f"| {r['lam']:g} | {_diff(level)} | {_f(level and level['detectable'], '.4f')} | "
                     f"{r['n']} ({r['pairs']}) | {_f(r['belief_diff'])} [{_f(r['low'])}, {_f(r['high'])}] | "
                     f"{_p(r['wilcoxon_p'])} | {_f(r['detectable'], '.4f')} |")
    return lines


def pooled_arms(summaries, step):
    """{lambda: {seed: (full acceptance share, mean b_T - b_0)}} at one step over the seeds of
    several sweeps, from each summary.json's per-arm entries (as per_seed gives them); the sweeps
    must share every setting but POOL_FREE's and no seed. A problem is a ValueError in one line,
    naming the sweep."""
    first, by_lam = summaries[0][1]["settings"], {}
    same = lambda settings: {k: v for k, v in settings.items() if k not in POOL_FREE}
    for name, summary in summaries:
        if same(summary["settings"]) != same(first):
            differ = sorted(k for k in set(same(first)) | set(same(summary["settings"]))
                            if first.get(k) != summary["settings"].get(k))
            raise ValueError(f"{name}: its settings differ from {summaries[0][0]}'s in {differ}; "
                             "pool only sweeps of the same settings")
        for e in summary["arms"]:
            if e["step"] == step:
                seeds = by_lam.setdefault(e["lam"], {})
                if e["seed"] in seeds:
                    raise ValueError(f"{name}: seed {e['seed']} is in two of the pooled sweeps; "
                                     "pool sweeps of different seeds")
                seeds[e["seed"]] = (e["full_accept"], e["mean_belief_change"])
    if 0.0 not in by_lam:
        raise ValueError(f"no lambda 0 arm at step {step} in the pooled sweeps; pass a step they "
                         "evaluated (--step)")
    return by_lam


def seed_levels(by_lam):
    """{lambda: seed_level(lambda, lambda 0)} over pooled_arms' seeds."""
    return {lam: seed_level(by_lam[lam], by_lam[0.0]) for lam in sorted(by_lam) if lam != 0.0}


def pooled_seed_level(summaries, step):
    """seed_levels at one step over the pooled sweeps' seeds (pooled_arms)."""
    return seed_levels(pooled_arms(summaries, step))


def write_pooled(folder, sweeps, by_lam, result, step, argv):
    """pooled-stepN.json (the command, each seed's arms, result: the seed-level comparison) and
    pooled-stepN.png (each seed's lambda - 0 difference with the t interval over seeds) in folder."""
    from lab import plots  # matplotlib loads where the figure is drawn
    record = dict(command="python -m lab.sweep_table " + " ".join(argv), step=step, sweeps=sweeps,
                  seeds={f"{lam:g}": {str(s): dict(full_accept=fa, belief_change=b)
                                      for s, (fa, b) in sorted(arms.items())}
                         for lam, arms in sorted(by_lam.items())},
                  seed_level={f"{lam:g}": level for lam, level in result.items()})
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    runs.write_atomic(folder / f"pooled-step{step}.json", json.dumps(record, indent=1) + "\n")
    plots.plot_pooled(by_lam, result, step, folder / f"pooled-step{step}.png")
    return folder / f"pooled-step{step}.json"


def main(argv=None):
    parser = argparse.ArgumentParser(description="Pool sweeps of the same settings at the seed "
                                     "level: each lambda against lambda 0 at one step.")
    parser.add_argument("sweeps", nargs="+", type=Path, help="sweep folders (their summary.json)")
    parser.add_argument("--step", type=int, required=True, help="the checkpoint to compare")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line")
    parser.add_argument("--out", type=Path, help="write pooled-stepN.json and pooled-stepN.png here")
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    args = parser.parse_args(argv)
    summaries = []
    for folder in args.sweeps:
        path = folder / "summary.json"
        try:
            summaries.append((str(folder), json.loads(path.read_text())))
        except (OSError, ValueError) as e:
            raise SystemExit(f"lab.sweep_table: cannot read {path} ({e}); pass sweep folders "
                             "that lab.sweep has summarised") from None
    try:
        by_lam = pooled_arms(summaries, args.step)
    except ValueError as e:
        raise SystemExit(f"lab.sweep_table: {e}") from None
    pooled = seed_levels(by_lam)
    if args.out:
        written = write_pooled(args.out, [name for name, _ in summaries], by_lam, pooled, args.step, argv)
        print(f"wrote {written} and its figure")
    if args.json:
        print(json.dumps({f"{lam:g}": level for lam, level in pooled.items()}))
        return pooled
    for lam, level in pooled.items():
        if level is None:
            print(f"lambda {lam:g} - 0 at step {args.step}: fewer than {SEED_LEVEL_MIN} seeds")
            continue
        print(f"lambda {lam:g} - 0 at step {args.step}, {level['seeds']} seeds (paired t over the "
              f"seeds' means): b_T - b_0 {_diff(level['belief_change'])}; full accept pts "
              f"{_diff(level['full_accept'], 100, '+.1f')}")
    return pooled


if __name__ == "__main__":
    main(sys.argv[1:])
