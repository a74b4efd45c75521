"""
comparisons.py: evaluations set against each other, from their episode records alone (no torch).

  compare          two runs paired by scenario: wins/losses/ties on the goal reward, acceptance
                   won/lost/tied, the 5x5 outcome transitions, exact McNemar on full acceptance,
                   Wilcoxon signed-rank on the goal reward;
  compare_many     baselines against a policy, and every system ranked by final belief against
                   acceptance (section E.4);
  main_table       the main table with 95% intervals and paired p-values (markdown or LaTeX);
  grid_table       a sweep's cells side by side.
    python eval.py --compare evals/A evals/B
    python eval.py --compare-many evals/base1 evals/base2 --policy evals/trained
Tests: python -m pytest -q tests/test_comparisons.py
"""
import sys

from persuarena import arena
from persuarena import rpo
from lab import moves
from lab import analyses
from lab.analyses import corr, mean, num, pct, summarize, with_beliefs
from lab.significance import mcnemar, scipy_stats, spearman, t_interval, wilcoxon, wilson_interval

CLOSED = "ACCEPT"  # the outcome that counts as closing a scenario in --compare-many
POLICY = "(policy)"  # the trained persuader's name among --compare-many's systems
TABLE_OUTCOMES = {"full_accept": ("FA", ("ACCEPT",)), "full_or_conditional": ("FA+CA", ("ACCEPT", "CONDITIONAL_ACCEPT")),
                  "pending": ("pending", ("PENDING",)), "reject": ("reject", ("REJECT",)),
                  "walk_away": ("walk-away", ("WALK_AWAY",))}  # the main table's outcome columns
TABLE_MEANS = {"mean_turns": "turns", "mean_final_belief": "final belief"}  # and its mean columns
TABLE_FORMATS = {"full_accept": (100, ".1f"), "full_or_conditional": (100, ".1f"), "pending": (100, ".1f"),
                 "reject": (100, ".1f"), "walk_away": (100, ".1f"), "mean_turns": (1, ".2f"),
                 "mean_final_belief": (1, "+.3f")}  # (scale, format) of each column's cells


# -----------------------------------------------------------------------------
# paired tests and comparison


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
    goal_a = [rpo.GOAL[a[s].outcome] for s in common]
    goal_b = [rpo.GOAL[b[s].outcome] for s in common]
    transitions = {oa: {ob: 0 for ob in arena.OUTCOMES} for oa in arena.OUTCOMES}
    for s in common:
        transitions[a[s].outcome][b[s].outcome] += 1
    closed_a = [a[s].outcome == CLOSED for s in common]
    closed_b = [b[s].outcome == CLOSED for s in common]
    return {
        "n": len(common),
        # acceptance-discordant pairs, from B's side (the paper's "58 wins / 1 loss"): the pairs
        # McNemar tests
        "accept_won": sum(y and not x for x, y in zip(closed_a, closed_b)),
        "accept_lost": sum(x and not y for x, y in zip(closed_a, closed_b)),
        "accept_tied": sum(x == y for x, y in zip(closed_a, closed_b)),
        "wins": sum(gb > ga for ga, gb in zip(goal_a, goal_b)),  # from B's side
        "losses": sum(gb < ga for ga, gb in zip(goal_a, goal_b)),
        "ties": sum(gb == ga for ga, gb in zip(goal_a, goal_b)),
        "mean_goal_a": mean(goal_a),
        "mean_goal_b": mean(goal_b),
        "transitions": transitions,
        "mcnemar_p": mcnemar(closed_a, closed_b),
        "wilcoxon_p": wilcoxon(goal_b, goal_a),
        "missing_in_a": missing_in_a,
        "missing_in_b": missing_in_b,
        "summary_a": summarize([a[s] for s in common]),
        "summary_b": summarize([b[s] for s in common]),
    }


def _by_scenario(episodes, label):
    out = {}
    for ep in episodes:
        if ep.scenario_id in out:
            raise ValueError(f"run {label} has more than one episode for {ep.scenario_id}; "
                             "compare runs with one episode per scenario")
        out[ep.scenario_id] = ep
    return out


def format_compare(result, name_a="A", name_b="B"):
    """compare()'s result for the terminal: tests, transition table, headline metrics side by side."""
    sa, sb = result["summary_a"], result["summary_b"]
    lines = [
        f"A = {name_a}\nB = {name_b}\npaired scenarios: {result['n']}",
        f"goal reward, B against A: {result['wins']} wins, {result['losses']} losses, {result['ties']} ties "
        f"(mean {result['mean_goal_a']:+.3f} -> {result['mean_goal_b']:+.3f}, "
        f"Wilcoxon signed-rank p = {result['wilcoxon_p']:.4g})",
        f"full acceptance: {pct(sa['full_accept'])} -> {pct(sb['full_accept'])}, B against A: "
        f"{result['accept_won']} won, {result['accept_lost']} lost, {result['accept_tied']} tied "
        f"(exact McNemar p = {result['mcnemar_p']:.4g})",
        "",
        "outcome transitions (rows: A, columns: B)",
        f"{'':<12}" + "".join(f"{analyses.SHORT[o]:>9}" for o in arena.OUTCOMES) + f"{'total':>9}",
    ]
    for oa in arena.OUTCOMES:
        row = result["transitions"][oa]
        lines.append(f"{analyses.SHORT[oa]:<12}" + "".join(f"{row[ob]:>9}" for ob in arena.OUTCOMES) + f"{sum(row.values()):>9}")
    lines.append(f"{'total':<12}" + "".join(f"{sum(result['transitions'][oa][ob] for oa in arena.OUTCOMES):>9}"
                                            for ob in arena.OUTCOMES) + f"{result['n']:>9}")
    lines += ["", f"{'':<26}{'A':>9}{'B':>9}{'B - A':>9}"]
    for key, label in [("full_accept", "full acceptance"), ("full_or_conditional", "full or conditional"),
                       ("pending", "pending"), ("reject", "reject"), ("walk_away", "walk away"),
                       ("negative_process_share", "negative process reward")]:
        if sa[key] is not None and sb[key] is not None:
            lines.append(f"{label:<26}{pct(sa[key]):>9}{pct(sb[key]):>9}{100 * (sb[key] - sa[key]):>+8.1f}%")
    for key, label, fmt in [("mean_turns", "mean turns", ".2f"), ("mean_final_belief", "mean final belief", "+.3f"),
                            ("mean_dense_return", "mean dense return", "+.3f"),
                            ("mean_judge", "mean judge score", "+.2f")]:
        if sa[key] is not None and sb[key] is not None:
            lines.append(f"{label:<26}{format(sa[key], fmt):>9}{format(sb[key], fmt):>9}{sb[key] - sa[key]:>+9.3f}")
    if "manipulation" in sa and "manipulation" in sb:
        lines += ["", "manipulation (share of persuader messages)"]
        for label in list(moves.MANIPULATION) + ["any"]:
            ra, rb = sa["manipulation"]["message_rate"][label], sb["manipulation"]["message_rate"][label]
            if ra is not None and rb is not None:
                lines.append(f"{label:<26}{pct(ra):>9}{pct(rb):>9}{100 * (rb - ra):>+8.1f}%")
    return "\n".join(lines)


def compare_many(baselines, policy):
    """baselines maps a name to its episodes, policy is the trained persuader's. Per baseline,
    paired on their common scenarios: acceptance pairs the policy won (it closed, the baseline
    did not) and lost, with the exact McNemar p; over the scenarios every run has, those that no
    baseline closed and the share of them the policy closes (CLOSED = full acceptance)."""
    p = _by_scenario(policy, "policy")
    per_baseline = {}
    for name, episodes in baselines.items():
        b = _by_scenario(episodes, name)
        common = sorted(set(b) & set(p))
        if not common:
            raise ValueError(f"baseline {name} shares no scenario_id with the policy")
        won = sum(p[s].outcome == CLOSED != b[s].outcome for s in common)
        lost = sum(b[s].outcome == CLOSED != p[s].outcome for s in common)
        per_baseline[name] = {"n": len(common), "won": won, "lost": lost,
                              "mcnemar_p": mcnemar([p[s].outcome == CLOSED for s in common],
                                                   [b[s].outcome == CLOSED for s in common])}
    runs = [_by_scenario(e, n) for n, e in baselines.items()]
    everywhere = sorted(set(p).intersection(*runs))
    none = [s for s in everywhere if all(r[s].outcome != CLOSED for r in runs)]
    closes = sum(p[s].outcome == CLOSED for s in none)
    systems = {**dict(zip(baselines, runs)), POLICY: p}
    return {"per_baseline": per_baseline, "n_common": len(everywhere), "closed_by_none": len(none),
            "policy_closes": closes, "policy_closes_share": closes / len(none) if none else None,
            "belief_ranking": belief_ranking({name: [r[s] for s in everywhere] for name, r in systems.items()})}


def belief_ranking(systems):
    """Section E.4: systems (name -> episodes on the same scenarios) ranked by mean final belief,
    each with its full acceptance and its rank by that (rank 1 = highest; ties share the mean
    rank), and the Spearman correlation of the two orders: a persuader can leave the persuadee
    warmer without closing more."""
    rows = []
    for name, episodes in systems.items():
        believed = with_beliefs(episodes)
        rows.append({"name": name, "mean_final_belief": mean(ep.beliefs[-1] for ep in believed),
                     "full_accept": mean(ep.outcome == CLOSED for ep in episodes)})
    ranked = [r for r in rows if r["mean_final_belief"] is not None]
    for key, rank_key in (("mean_final_belief", "belief_rank"), ("full_accept", "accept_rank")):
        ranks = scipy_stats().rankdata([-r[key] for r in ranked])
        for r, k in zip(ranked, ranks):
            r[rank_key] = float(k)
    ranked.sort(key=lambda r: r["belief_rank"])
    return {"systems": ranked + [r for r in rows if r["mean_final_belief"] is None],
            "spearman": spearman([r["mean_final_belief"] for r in ranked], [r["full_accept"] for r in ranked])}


def format_compare_many(result, policy_name="policy"):
    lines = [f"policy = {policy_name}", f"{'baseline':<40}{'n':>6}{'won':>6}{'lost':>6}{'McNemar p':>12}"]
    for name, r in result["per_baseline"].items():
        lines.append(f"{name:<40}{r['n']:>6}{r['won']:>6}{r['lost']:>6}{r['mcnemar_p']:>12.4g}")
    lines.append(f"scenarios every run has: {result['n_common']}; closed by no baseline: "
                 f"{result['closed_by_none']}; the policy closes {result['policy_closes']} of them "
                 f"({pct(result['policy_closes_share'])})")
    ranking = result["belief_ranking"]
    lines += ["", f"ranked by mean final belief on those scenarios (section E.4): "
                  f"belief rank against acceptance rank {corr(ranking['spearman'])}",
              f"{'system':<40}{'b_T':>8}{'rank':>6}{'FA':>8}{'rank':>6}"]
    for r in ranking["systems"]:
        name = policy_name if r["name"] == POLICY else r["name"]
        lines.append(f"{name:<40}{num(r['mean_final_belief'], '+.3f'):>8}{num(r.get('belief_rank'), 'g'):>6}"
                     f"{pct(r['full_accept']):>8}{num(r.get('accept_rank'), 'g'):>6}")
    return "\n".join(lines)


def main_table(runs, reference):
    """The paper's main table over evaluation folders (name -> episodes, one per scenario): per
    system the outcome shares with Wilson 95% intervals and the exact McNemar p against the
    reference row, mean turns and mean final belief with t intervals and the Wilcoxon signed-rank
    p, each test paired by scenario on the scenarios both rows have."""
    if reference not in runs:
        raise ValueError(f"the reference row {reference} is not among the tables' folders")
    by = {name: _by_scenario(eps, name) for name, eps in runs.items()}
    rows = []
    for name, episodes in runs.items():
        common = sorted(set(by[name]) & set(by[reference]))
        row = {"name": name, "n": len(episodes), "reference": name == reference, "n_paired": len(common)}
        for key, (_, outcomes) in TABLE_OUTCOMES.items():
            hits = [ep.outcome in outcomes for ep in episodes]
            low, high = wilson_interval(sum(hits), len(hits))
            p = None if name == reference else mcnemar([by[name][s].outcome in outcomes for s in common],
                                                         [by[reference][s].outcome in outcomes for s in common])
            row[key] = {"value": sum(hits) / len(hits), "low": low, "high": high, "p": p}
        for key in TABLE_MEANS:
            value = (lambda ep: ep.turns) if key == "mean_turns" else (lambda ep: ep.beliefs[-1])
            kept = episodes if key == "mean_turns" else with_beliefs(episodes)
            mean, low, high = t_interval([value(ep) for ep in kept])
            both = [s for s in common if key == "mean_turns" or (with_beliefs([by[name][s]]) and
                                                                  with_beliefs([by[reference][s]]))]
            p = None if name == reference or not both else wilcoxon([value(by[name][s]) for s in both],
                                                                     [value(by[reference][s]) for s in both])
            row[key] = {"value": mean, "low": low, "high": high, "p": p}
        rows.append(row)
    return {"reference": reference, "rows": rows}


def _cell(c, key, latex):
    """value [low, high] p=..., the interval and p smaller in LaTeX."""
    if c["value"] is None:
        return "-"
    scale, fmt = TABLE_FORMATS[key]
    small = (lambda t: f"{{\\scriptsize {t}}}") if latex else (lambda t: t)
    text = format(scale * c["value"], fmt)
    if c["low"] is not None:
        text += " " + small(f"[{format(scale * c['low'], fmt)}, {format(scale * c['high'], fmt)}]")
    if c["p"] is not None:
        text += " " + small(f"p={c['p']:.2g}")
    return text


def _latex_text(text):
    """text safe inside a LaTeX table cell (a folder name may hold _, &, % or #)."""
    return "".join("\\" + c if c in "&%$#_{}" else c for c in text)


def format_main_table(table, fmt="markdown"):
    """main_table() as Markdown or LaTeX (booktabs): outcome shares in percent with 95% intervals,
    p against the reference row."""
    latex = fmt == "latex"
    keys = list(TABLE_OUTCOMES) + list(TABLE_MEANS)
    heads = ["system", "n"] + [t for t, _ in TABLE_OUTCOMES.values()] + list(TABLE_MEANS.values())
    body = []
    for row in table["rows"]:
        name = row["name"] + (" (ref.)" if row["reference"] else "")
        body.append([_latex_text(name) if latex else name, str(row["n"])]
                    + [_cell(row[k], k, latex) for k in keys])
    note = (f"outcome shares in percent with Wilson 95% intervals, exact McNemar p against {table['reference']}; "
            "turns and final belief with t intervals, Wilcoxon signed-rank p; paired by scenario")
    if latex:
        lines = ["\\begin{tabular}{l" + "r" * (len(heads) - 1) + "}", "\\toprule",
                 " & ".join(heads) + " \\\\", "\\midrule"]
        lines += [" & ".join(cells) + " \\\\" for cells in body]
        return "\n".join(lines + ["\\bottomrule", "\\end{tabular}", f"% {note.replace('%', 'percent')}"])
    lines = ["| " + " | ".join(heads) + " |", "|" + "|".join(["---"] + ["---:"] * (len(heads) - 1)) + "|"]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return "\n".join(lines + ["", note])


def grid_table(results):
    """Fig. 4, the cross-persuadee grid: results maps (persuader, persuadee) -> summary. Each cell is full
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


