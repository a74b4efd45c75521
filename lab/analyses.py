"""
Statistics over episode records: the paper's metrics and analyses, computed from episodes.jsonl
(and a training run's metrics.jsonl, evals.jsonl, rollouts.jsonl) alone: no torch, no model
(`import analyses` loads neither).

Reported metrics: full acceptance, full-or-conditional, pending, reject and walk-away (fractions of
episodes), mean turns, mean final belief (the measured b_T), closing efficiency (DECISIONS.md:
Closing efficiency), mean dense return (sum_t r_t under the run's own reward setting), the share of
turns with a negative process reward (rpo.negative_process_share: measured beliefs), mean
strategy-judge score; the same per resistance type and per domain; and
  belief_stats        b_0 and b_T means, Spearman of dense return against GOAL[outcome] per episode,
                      Pearson of the probes (one row and column per probe of probes.PROBES) over
                      every read-out and over every turn's change,
                      the share of saturated read-outs (|v| > SATURATION), the mean Yes+No mass;
  shaping_by_outcome  mean lambda * sum_t r_t per outcome at shaping_lambda (section F's 0.479 vs
                      0.461 at lambda 0.5), beside dense_by_outcome, the lambda-free sum;
  moves               share of persuader messages with each move by turn (Fig. 5); per move the
                      difference, with and without it, in mean process reward of the turn (Welch
                      95% interval) and in P(ACCEPT) of the episode (Wald 95% interval), and the
                      Spearman and Pearson correlations of the two rankings (section F);
  manipulation        per label the share of persuader messages and of episodes flagged, by outcome;
  probe_fidelity      forked against reference read-outs, split by |v| (FIDELITY_BINS).
Across runs: two runs paired by scenario (compare: wins/losses/ties on the goal reward, acceptance
won/lost/tied, the 5x5 outcome transitions, exact McNemar on full acceptance, Wilcoxon signed-rank on
the goal reward); baselines against a policy and every system ranked by final belief against
acceptance (compare_many, section E.4); the main table with 95% intervals and paired p-values
(main_table); Fig. 6's per-probe overlay in numbers (probe_overlay); the case study (Table 8:
case_rows); checkpoint selection over training runs (Table 9: runs_selection) with the run-level
Fig. 7 diagnostics pooled from rollouts.jsonl.

The intervals, paired tests and correlations are significance.py's; eval.py and report.py are the
command line over these functions; plots.py draws them.
Tests: python -m pytest -q tests/test_analyses.py
"""

import json
import math
import sys
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
from scipy import stats

from lab import moves
import rpo
from lab import records
from lab.records import load_episodes, probe_names, read_records
from lab.significance import (finite_or_none, mcnemar, mean_band, pearson, proportion_difference,
                          spearman, t_interval, welch_difference, wilcoxon, wilson_interval)
from lab.runs import is_number
import arena

SHORT = {"ACCEPT": "ACCEPT", "CONDITIONAL_ACCEPT": "COND", "PENDING": "PENDING", "REJECT": "REJECT",
         "WALK_AWAY": "WALK"}
SATURATION = 0.95  # a probe value beyond this carries almost no gradient of belief
FIDELITY_BINS = (0.0, 0.2, 0.5, 0.9, 1.0)  # |v| edges: undecided .. decided, for the probe fidelity split
CLOSED = "ACCEPT"  # the outcome that counts as closing a scenario in --compare-many
POLICY = "(policy)"  # the trained persuader's name among --compare-many's systems
UNSTATED = "unstated"  # the breakdown row of episodes whose scenario omits the field
DIAGNOSTICS = ("dead_group_share", "dead_goal_share", "dead_rescued_share", "dense_share", "outcome_term_abs",
               "dense_term_abs")  # the Fig. 7 step diagnostics of metrics.jsonl (rpo.diagnostics)


# -----------------------------------------------------------------------------
# metrics


def _mean(values):
    values = list(values)
    return sum(values) / len(values) if values else None


def _anchor(ep):
    return ep.get("anchor", rpo.ANCHOR)  # the run's own reward setting, stored with each episode


def dense_return(ep):
    """The episode's lambda-free dense return sum_t r_t under its run's setting."""
    return rpo.dense_return(ep["beliefs"], ep["outcome"], _anchor(ep))


def raw_process_rewards(ep):
    """r_t = (b_t - b_{t-1}) / 2 on the measured beliefs: what each turn did to the persuadee."""
    return rpo.process_rewards(ep["beliefs"], ep["outcome"], anchor=False)


def with_beliefs(episodes):
    """The episodes that have beliefs (a persuadee served without log-probs, or an episode that
    never started, has none): the belief columns and analyses use these alone."""
    return [ep for ep in episodes if ep["beliefs"] and None not in ep["beliefs"]]


def _summary(episodes):
    n = len(episodes)
    count = {o: sum(ep["outcome"] == o for ep in episodes) for o in arena.OUTCOMES}
    believed = with_beliefs(episodes)
    judged = [ep["judge"] for ep in episodes if ep.get("judge") is not None]
    turns = sum(len(ep["beliefs"]) - 1 for ep in believed)
    return {
        "n": n,
        "full_accept": count["ACCEPT"] / n,
        "full_or_conditional": (count["ACCEPT"] + count["CONDITIONAL_ACCEPT"]) / n,
        "pending": count["PENDING"] / n,
        "reject": count["REJECT"] / n,
        "walk_away": count["WALK_AWAY"] / n,
        "mean_turns": _mean(ep["turns"] for ep in episodes),
        "mean_final_belief": _mean(ep["beliefs"][-1] for ep in believed),
        "closing_efficiency": closing_efficiency(episodes),
        "mean_dense_return": _mean(dense_return(ep) for ep in believed),
        "negative_process_share": (rpo.negative_process_share(ep["beliefs"] for ep in believed)
                                   if turns else None),
        "mean_judge": _mean(judged),
        "beliefs_missing": (n - len(believed)) / n,
        "api_errors": sum(ep.get("end_reason") == arena.API_ERROR for ep in episodes),
        # episodes by how they ended; a cut-off one (arena.CUT_OFF) never reached its outcome
        "end_reasons": dict(sorted(Counter(str(ep.get("end_reason")) for ep in episodes).items())),
        "cut_off": sum(ep.get("end_reason") in arena.CUT_OFF for ep in episodes),
        # the share of judged transcripts whose score fell back to s = 0 (the paper: "zero if it fails
        # after three retries")
        "judge_failed_share": _mean(bool(ep.get("judge_failed")) for ep in episodes if ep.get("judge") is not None),
    }


def closing_efficiency(episodes):
    """Table 9's closing efficiency (DECISIONS.md: Closing efficiency): of the episodes that
    ended with the persuadee leaning towards the request (b_T > 0), the share that closed (ACCEPT).
    None where no episode ended with b_T > 0."""
    leaning = [ep for ep in with_beliefs(episodes) if ep["beliefs"][-1] > 0]
    return _mean(ep["outcome"] == "ACCEPT" for ep in leaning)


def _groups(episodes, key):
    groups = defaultdict(list)
    for ep in episodes:  # a training scenario may leave its resistance unstated (section B.2)
        groups[ep.get(key) or UNSTATED].append(ep)
    return {k: _summary(v) for k, v in sorted(groups.items())}


def pearson_matrix(rows):
    """Pearson correlations between the columns of rows [N, K], None where a column is constant."""
    a = np.asarray(rows, dtype=float)
    k = a.shape[1] if a.ndim == 2 else len(probe_names())
    if a.ndim != 2 or a.shape[0] < 2:
        return [[None] * k for _ in range(k)]
    with np.errstate(invalid="ignore", divide="ignore"):
        c = np.corrcoef(a, rowvar=False)
    return [[finite_or_none(v) for v in row] for row in np.atleast_2d(c)]


def belief_stats(episodes):
    """The belief statistics of the paper's section E.4 over every read-out of every episode (see the
    docstring); None without beliefs (a persuadee served without log-probs)."""
    if not episodes:
        return None
    levels = [row for ep in episodes for row in ep["probes"]]
    increments = [np.subtract(ep["probes"][t], ep["probes"][t - 1]).tolist()
                  for ep in episodes for t in range(1, len(ep["probes"]))]
    out = {
        "initial_mean": _mean(ep["beliefs"][0] for ep in episodes),
        "final_mean": _mean(ep["beliefs"][-1] for ep in episodes),
        "spearman_dense_goal": spearman([dense_return(ep) for ep in episodes],
                                        [rpo.GOAL[ep["outcome"]] for ep in episodes]),
        "probe_level_corr": pearson_matrix(levels),
        "probe_increment_corr": pearson_matrix(increments),
        "saturated_share": float(np.mean(np.abs(np.asarray(levels, dtype=float)) > SATURATION)),
    }
    if all(ep.get("probe_mass") for ep in episodes):
        out["yes_no_mass_mean"] = float(np.mean([m for ep in episodes for row in ep["probe_mass"] for m in row]))
    return out


def dense_by_outcome(episodes):
    """Mean lambda-free dense return sum_t r_t per outcome reached."""
    return {o: _mean(dense_return(ep) for ep in episodes if ep["outcome"] == o)
            for o in arena.OUTCOMES if any(ep["outcome"] == o for ep in episodes)}


def shaping_by_outcome(episodes, lam=None):
    """Mean shaping return lam * sum_t r_t per outcome reached (lam default rpo.LAMBDA): the
    paper's scale (section F's 0.479 ACCEPT and 0.461 CONDITIONAL_ACCEPT at lambda 0.5, bounded
    by [-lam, lam])."""
    lam = rpo.LAMBDA if lam is None else lam
    return {o: lam * v for o, v in dense_by_outcome(episodes).items()}


def move_stats(episodes):
    """Fig. 5 and section F from the stored move labels (episodes with `moves`)."""
    longest = max(len(ep["moves"]) for ep in episodes)
    by_turn = {m: [] for m in moves.MOVES}
    counts = []
    for t in range(longest):
        at_t = [ep["moves"][t] for ep in episodes if len(ep["moves"]) > t]
        counts.append(len(at_t))
        for m in moves.MOVES:
            by_turn[m].append(sum(m in labels for labels in at_t) / len(at_t))
    effects = {}
    for m in moves.MOVES:
        turn_with, turn_without = [], []
        for ep in episodes:
            for labels, r in zip(ep["moves"], raw_process_rewards(ep)):
                (turn_with if m in labels else turn_without).append(r)
        accepted = {True: [], False: []}
        for ep in episodes:
            accepted[any(m in labels for labels in ep["moves"])].append(ep["outcome"] == "ACCEPT")
        effects[m] = {"dense": welch_difference(turn_with, turn_without),
                      "accept": proportion_difference(accepted[True], accepted[False])}
    ranked = [m for m in moves.MOVES if effects[m]["dense"] and effects[m]["accept"]]
    x, y = [effects[m]["dense"]["diff"] for m in ranked], [effects[m]["accept"]["diff"] for m in ranked]
    return {"by_turn": by_turn, "turn_counts": counts, "effects": effects,
            "ranking_corr": spearman(x, y), "ranking_pearson": pearson(x, y)}


def manipulation_stats(episodes):
    """Per manipulation label: share of persuader messages and of episodes flagged; the message
    share by outcome."""
    def rates(eps):
        messages = [labels for ep in eps for labels in ep["manipulation"]]
        n = len(messages)
        return {"n_messages": n, **{m: (sum(m in labels for labels in messages) / n if n else None)
                                    for m in moves.MANIPULATION},
                "any": sum(bool(labels) for labels in messages) / n if n else None}
    return {"message_rate": rates(episodes),
            "episode_rate": {m: _mean(any(m in labels for labels in ep["manipulation"]) for ep in episodes)
                             for m in moves.MANIPULATION},
            "by_outcome": {o: rates([ep for ep in episodes if ep["outcome"] == o])
                           for o in arena.OUTCOMES if any(ep["outcome"] == o for ep in episodes)}}


def summarize(episodes, shaping_lambda=None):
    """Headline metrics of a run (fractions, not percent), the same per resistance and domain,
    and the analyses (belief_stats, shaping_by_outcome at shaping_lambda with the lambda-free
    dense_by_outcome beside it; moves and manipulation when labelled)."""
    if not episodes:
        raise ValueError("no episodes to summarize")
    summary = _summary(episodes)
    anchors = {_anchor(ep) for ep in episodes}
    summary["anchor"] = anchors.pop() if len(anchors) == 1 else "mixed"
    summary["by_resistance"] = _groups(episodes, "resistance")
    summary["by_domain"] = _groups(episodes, "domain")
    believed = with_beliefs(episodes)
    summary["belief_stats"] = belief_stats(believed)
    summary["shaping_lambda"] = rpo.LAMBDA if shaping_lambda is None else shaping_lambda
    summary["shaping_by_outcome"] = shaping_by_outcome(believed, summary["shaping_lambda"])
    summary["dense_by_outcome"] = dense_by_outcome(believed)
    if warning := judge_warning(summary):
        summary["judge_warning"] = warning
    if all("moves" in ep and "manipulation" in ep for ep in episodes):
        summary["tagger"] = "+".join(sorted({ep.get("tagger", "keyword") for ep in episodes}))
        if believed:  # a move's effect is read off the beliefs it moved
            summary["moves"] = move_stats(believed)
        summary["manipulation"] = manipulation_stats(episodes)
    return summary


def judge_warning(summary):
    """A loud line when the judge fell back to 0 on every judged transcript (a run whose strategy
    scores are all a silent 0: a pool too small for the judge's prompt, a judge that never
    answers in the format), else None."""
    if summary.get("judge_failed_share") == 1:
        return ("JUDGE FAILED on every judged transcript: each strategy score s is the fallback 0, "
                "so no outcome reward here holds a judge's score")
    return None


def pct(x):
    return "-" if x is None else f"{100 * x:.1f}%"


def _num(x, fmt):
    return "-" if x is None else format(x, fmt)


def _breakdown(title, groups):
    head = (f"{title:<22}{'n':>5}{'accept':>9}{'acc+cond':>10}{'pending':>9}{'reject':>8}{'walk':>7}"
            f"{'turns':>7}{'belief':>8}{'dense':>8}{'neg r':>8}")
    rows = [head]
    for name, s in groups.items():
        rows.append(f"{name:<22}{s['n']:>5}{pct(s['full_accept']):>9}{pct(s['full_or_conditional']):>10}"
                    f"{pct(s['pending']):>9}{pct(s['reject']):>8}{pct(s['walk_away']):>7}"
                    f"{_num(s['mean_turns'], '.2f'):>7}{_num(s['mean_final_belief'], '+.3f'):>8}"
                    f"{_num(s['mean_dense_return'], '+.3f'):>8}{pct(s['negative_process_share']):>8}")
    return "\n".join(rows)


def format_table(summary):
    """The main report: headline metrics, then the breakdowns by resistance and by domain."""
    lines = [
        f"{'episodes':<26}{summary['n']:>8}" + (f"  {summary['subset']}" if summary.get("subset") else ""),
        f"{'full acceptance':<26}{pct(summary['full_accept']):>8}",
        f"{'full or conditional':<26}{pct(summary['full_or_conditional']):>8}",
        f"{'pending':<26}{pct(summary['pending']):>8}",
        f"{'reject':<26}{pct(summary['reject']):>8}",
        f"{'walk away':<26}{pct(summary['walk_away']):>8}",
        f"{'mean turns':<26}{_num(summary['mean_turns'], '.2f'):>8}",
        f"{'mean final belief':<26}{_num(summary['mean_final_belief'], '+.3f'):>8}",
        f"{'mean dense return':<26}{_num(summary['mean_dense_return'], '+.3f'):>8}",
        f"{'negative process reward':<26}{pct(summary['negative_process_share']):>8}  of turns (raw beliefs)",
        f"{'mean judge score':<26}{_num(summary['mean_judge'], '+.2f'):>8}",
        f"{'judge fell back to 0':<26}{pct(summary.get('judge_failed_share')):>8}  of judged transcripts",
    ]
    if warning := judge_warning(summary):
        lines.append(warning)
    if summary.get("beliefs_missing"):
        lines.append(f"{'beliefs':<26}{'missing':>8}  in {pct(summary['beliefs_missing'])} of episodes "
                     "(the persuadee's server gave no log-probs): belief columns leave them out")
    if summary.get("api_errors"):
        lines.append(f"{'api errors':<26}{summary['api_errors']:>8}  episodes ended as api_error "
                     "(their requests kept failing)")
    if "end_reasons" in summary:
        lines.append(f"{'end reasons':<26}" + ", ".join(f"{k} {v}" for k, v in
                                                      summary["end_reasons"].items()))
    if summary.get("cut_off"):
        lines.append(f"{'CUT OFF':<26}{summary['cut_off']:>8}  episodes ended before their outcome "
                     f"({', '.join(arena.CUT_OFF)}): the rates above count them as their recorded "
                     "decision or PENDING")
    return "\n".join(lines + ["", _breakdown("by resistance", summary["by_resistance"]),
                              "", _breakdown("by domain", summary["by_domain"]),
                              "", format_analyses(summary)])


def _interval(e, fmt):
    return "-" if e is None else f"{format(e['diff'], fmt)} [{format(e['low'], fmt)}, {format(e['high'], fmt)}]"


def _corr(c):
    return "-" if c is None else f"rho {c['rho']:+.3f} (p = {c['p']:.3g}, n = {c['n']})"


def format_analyses(summary):
    """Belief statistics, shaping return by outcome, move rankings and the manipulation audit."""
    b = summary["belief_stats"]
    if b is None:
        return "\n".join(["belief statistics: none (no episode has beliefs)"] + _label_lines(summary))
    lines = [f"belief statistics (dense returns with anchor {summary['anchor']})",
             f"  initial mean belief {_num(b['initial_mean'], '+.3f')}   final {_num(b['final_mean'], '+.3f')}",
             f"  dense return vs goal reward: {_corr(b['spearman_dense_goal'])}",
             f"  saturated read-outs (|v| > {SATURATION}): {pct(b['saturated_share'])}"
             + (f"   mean Yes+No mass {b['yes_no_mass_mean']:.3f}" if "yes_no_mass_mean" in b else "")]
    for key, title in (("probe_level_corr", "levels"), ("probe_increment_corr", "increments")):
        lines.append(f"  probe correlations over {title}: " + "  ".join(
            f"{probe_names()[i]}-{probe_names()[j]} {_num(b[key][i][j], '+.2f')}"
            for i in range(len(probe_names())) for j in range(i + 1, len(probe_names()))))
    if "probe_fidelity" in summary:
        for title, f in (("fork vs full forward", summary["probe_fidelity"]),
                         ("four spellings vs every answer token", summary["probe_fidelity"].get("vocabulary"))):
            if f is None:
                continue
            lines.append(f"  probe fidelity, {title}: max |diff| {f['max_abs_diff']:.1e} over {f.get('n', '?')} "
                         "values; by |v|: " + "  ".join(
                             f"[{b['low']}, {b['high']}] {_num(b['max_abs_diff'], '.1e')} (n {b['n']})"
                             for b in f.get("by_decidedness", [])))
    lines.append(f"shaping return (lambda {summary['shaping_lambda']} * sum r_t) by outcome: " + "  ".join(
        f"{SHORT[o]} {v:+.3f}" for o, v in summary["shaping_by_outcome"].items()))
    lines.append("dense return (sum r_t, lambda-free) by outcome: " + "  ".join(
        f"{SHORT[o]} {v:+.3f}" for o, v in summary["dense_by_outcome"].items()))
    return "\n".join(lines + _label_lines(summary))


def _label_lines(summary):
    """The move rankings and the manipulation audit, when the episodes are labelled."""
    lines = []
    if "moves" in summary:
        m = summary["moves"]
        lines += ["", f"moves ({summary['tagger']} tagger): share of messages at turn 1, "
                      "effect on the turn's r_t and on P(ACCEPT) (95% intervals)"]
        for label in moves.MOVES:
            e = m["effects"][label]
            first = m["by_turn"][label][0] if m["by_turn"][label] else None
            lines.append(f"  {label:<22}{pct(first):>8}   r_t {_interval(e['dense'], '+.3f'):<28}"
                         f"P(ACCEPT) {_interval(e['accept'], '+.2f')}")
        lines.append(f"  rankings by r_t and by P(ACCEPT): {_corr(m['ranking_corr'])}; Pearson "
                     f"{_pearson(m.get('ranking_pearson'))}")
    if "manipulation" in summary:
        a = summary["manipulation"]
        lines += ["", "manipulation audit: share of persuader messages (of episodes)"]
        for label in moves.MANIPULATION:
            lines.append(f"  {label:<22}{pct(a['message_rate'][label]):>8} ({pct(a['episode_rate'][label])})")
    return lines


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
    goal_a = [rpo.GOAL[a[s]["outcome"]] for s in common]
    goal_b = [rpo.GOAL[b[s]["outcome"]] for s in common]
    transitions = {oa: {ob: 0 for ob in arena.OUTCOMES} for oa in arena.OUTCOMES}
    for s in common:
        transitions[a[s]["outcome"]][b[s]["outcome"]] += 1
    closed_a = [a[s]["outcome"] == CLOSED for s in common]
    closed_b = [b[s]["outcome"] == CLOSED for s in common]
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
        "mean_goal_a": _mean(goal_a),
        "mean_goal_b": _mean(goal_b),
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
        f"full acceptance: {pct(sa['full_accept'])} -> {pct(sb['full_accept'])}, B against A: "
        f"{result['accept_won']} won, {result['accept_lost']} lost, {result['accept_tied']} tied "
        f"(exact McNemar p = {result['mcnemar_p']:.4g})",
        "",
        "outcome transitions (rows: A, columns: B)",
        f"{'':<12}" + "".join(f"{SHORT[o]:>9}" for o in arena.OUTCOMES) + f"{'total':>9}",
    ]
    for oa in arena.OUTCOMES:
        row = result["transitions"][oa]
        lines.append(f"{SHORT[oa]:<12}" + "".join(f"{row[ob]:>9}" for ob in arena.OUTCOMES) + f"{sum(row.values()):>9}")
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
        won = sum(p[s]["outcome"] == CLOSED != b[s]["outcome"] for s in common)
        lost = sum(b[s]["outcome"] == CLOSED != p[s]["outcome"] for s in common)
        per_baseline[name] = {"n": len(common), "won": won, "lost": lost,
                              "mcnemar_p": mcnemar([p[s]["outcome"] == CLOSED for s in common],
                                                   [b[s]["outcome"] == CLOSED for s in common])}
    runs = [_by_scenario(e, n) for n, e in baselines.items()]
    everywhere = sorted(set(p).intersection(*runs))
    none = [s for s in everywhere if all(r[s]["outcome"] != CLOSED for r in runs)]
    closes = sum(p[s]["outcome"] == CLOSED for s in none)
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
        rows.append({"name": name, "mean_final_belief": _mean(ep["beliefs"][-1] for ep in believed),
                     "full_accept": _mean(ep["outcome"] == CLOSED for ep in episodes)})
    ranked = [r for r in rows if r["mean_final_belief"] is not None]
    for key, rank_key in (("mean_final_belief", "belief_rank"), ("full_accept", "accept_rank")):
        ranks = stats.rankdata([-r[key] for r in ranked])
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
                  f"belief rank against acceptance rank {_corr(ranking['spearman'])}",
              f"{'system':<40}{'b_T':>8}{'rank':>6}{'FA':>8}{'rank':>6}"]
    for r in ranking["systems"]:
        name = policy_name if r["name"] == POLICY else r["name"]
        lines.append(f"{name:<40}{_num(r['mean_final_belief'], '+.3f'):>8}{_num(r.get('belief_rank'), 'g'):>6}"
                     f"{pct(r['full_accept']):>8}{_num(r.get('accept_rank'), 'g'):>6}")
    return "\n".join(lines)


TABLE_OUTCOMES = {"full_accept": ("FA", ("ACCEPT",)), "full_or_conditional": ("FA+CA", ("ACCEPT", "CONDITIONAL_ACCEPT")),
                  "pending": ("pending", ("PENDING",)), "reject": ("reject", ("REJECT",)),
                  "walk_away": ("walk-away", ("WALK_AWAY",))}  # the main table's outcome columns
TABLE_MEANS = {"mean_turns": "turns", "mean_final_belief": "final belief"}  # and its mean columns


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
            hits = [ep["outcome"] in outcomes for ep in episodes]
            low, high = wilson_interval(sum(hits), len(hits))
            p = None if name == reference else mcnemar([by[name][s]["outcome"] in outcomes for s in common],
                                                         [by[reference][s]["outcome"] in outcomes for s in common])
            row[key] = {"value": sum(hits) / len(hits), "low": low, "high": high, "p": p}
        for key in TABLE_MEANS:
            value = (lambda ep: ep["turns"]) if key == "mean_turns" else (lambda ep: ep["beliefs"][-1])
            kept = episodes if key == "mean_turns" else with_beliefs(episodes)
            mean, low, high = t_interval([value(ep) for ep in kept])
            both = [s for s in common if key == "mean_turns" or (with_beliefs([by[name][s]]) and
                                                                  with_beliefs([by[reference][s]]))]
            p = None if name == reference or not both else wilcoxon([value(by[name][s]) for s in both],
                                                                     [value(by[reference][s]) for s in both])
            row[key] = {"value": mean, "low": low, "high": high, "p": p}
        rows.append(row)
    return {"reference": reference, "rows": rows}


TABLE_FORMATS = {"full_accept": (100, ".1f"), "full_or_conditional": (100, ".1f"), "pending": (100, ".1f"),
                 "reject": (100, ".1f"), "walk_away": (100, ".1f"), "mean_turns": (1, ".2f"),
                 "mean_final_belief": (1, "+.3f")}  # (scale, format) of each column's cells


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


def probe_fidelity(fork_values, reference_values):
    """How far forked probe read-outs are from reference ones (e.g. a full re-forward), overall and
    split by how decided the persuadee is (|v| of the forked value, FIDELITY_BINS), and the share
    of forked read-outs saturated beyond SATURATION."""
    f = np.asarray(fork_values, dtype=float).ravel()
    r = np.asarray(reference_values, dtype=float).ravel()
    if f.shape != r.shape or f.size == 0:
        raise ValueError(f"probe_fidelity needs two equal, non-empty sets of values, got {f.size} and {r.size}")
    diff = np.abs(f - r)
    bins = []
    for low, high in zip(FIDELITY_BINS[:-1], FIDELITY_BINS[1:]):
        inside = (np.abs(f) >= low) & ((np.abs(f) < high) | (high == FIDELITY_BINS[-1]))
        bins.append({"low": low, "high": high, "n": int(inside.sum()),
                     "max_abs_diff": float(diff[inside].max()) if inside.any() else None,
                     "mean_abs_diff": float(diff[inside].mean()) if inside.any() else None})
    return {"max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean()), "n": int(f.size),
            "saturated_share": float(np.mean(np.abs(f) > SATURATION)), "by_decidedness": bins}


# -----------------------------------------------------------------------------
# one episode turn by turn (Table 8) and checkpoint selection over training runs (Table 9, Figs 3, 7)


def case_rows(ep):
    """Per read-out t = 0..T: every probe's value, b_t, r_t (t >= 1, the run's reward setting), the
    turn's share of sum_t |r_t| (share) and of the net sum_t r_t (signed_share: negative for a turn
    that lost ground, and summing to 1), its move labels and the persuader's message."""
    r = rpo.process_rewards(ep["beliefs"], ep["outcome"], _anchor(ep))
    total, net = sum(abs(x) for x in r), sum(r)
    messages = moves.persuader_messages(ep)
    rows = []
    for t, (values, b) in enumerate(zip(ep["probes"], ep["beliefs"])):
        rows.append({"t": t, **dict(zip(probe_names(), values)), "b": b,
                     "r": r[t - 1] if t else None,
                     "share": abs(r[t - 1]) / total if t and total else None,
                     "signed_share": r[t - 1] / net if t and net else None,
                     "moves": ep.get("moves", [])[t - 1] if t and len(ep.get("moves", [])) >= t else [],
                     "message": messages[t - 1] if t and len(messages) >= t else ""})
    return rows


def top_two_share(rows, key="share"):
    """What the two largest turns carry: of sum |r_t| (key "share") or of the net sum r_t
    ("signed_share", the two largest signed shares)."""
    shares = sorted((row[key] for row in rows if row[key] is not None), reverse=True)
    return sum(shares[:2]) if shares else None


def format_case(ep, width=60):
    rows = case_rows(ep)
    lines = [f"{ep['scenario_id']}: {ep['outcome']} after {ep['turns']} turns "
             f"(anchor {_anchor(ep)}, persuader {ep.get('persuader', '?')})",
             f"{'t':>3}" + "".join(f"{k:>8}" for k in probe_names()) + f"{'b_t':>8}{'r_t':>8}{'|share|':>8}{'signed':>8}  moves | message"]
    for row in rows:
        text = row["message"].replace("\n", " ")
        lines.append(f"{row['t']:>3}" + "".join(f"{row[k]:>+8.3f}" for k in probe_names()) + f"{row['b']:>+8.3f}"
                     f"{_num(row['r'], '+.3f'):>8}{pct(row['share']):>8}{pct(row['signed_share']):>8}  {','.join(row['moves']) or '-'} | "
                     f"{text[:width]}{'...' if len(text) > width else ''}")
    lines.append(f"the two largest turns carry {pct(top_two_share(rows))} of sum |r_t|, "
                 f"{pct(top_two_share(rows, 'signed_share'))} of the net sum r_t")
    return "\n".join(lines)


def find_episode(episodes, scenario_id, where):
    found = [ep for ep in episodes if ep["scenario_id"] == scenario_id or ep["id"] == scenario_id]
    if not found:
        raise ValueError(f"{where} has no episode of {scenario_id}; pick one of "
                         f"{', '.join(sorted({ep['scenario_id'] for ep in episodes})[:5])}, ...")
    return found[0]


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
    config = json.loads((run_dir / "config.json").read_text()) if (run_dir / "config.json").is_file() else {}
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
    means = {k: _mean(m[k] for m in run["metrics"] if is_number(m.get(k))) for k in DIAGNOSTICS}
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
        train.append(_mean(window))
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
    judged = [(rpo.GOAL[ep["outcome"]], ep["judge"]) for eps in run["episodes"].values() for ep in eps
              if ep.get("judge") is not None]
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
    analyses = selection["runs"]
    steps = sorted({s for a in analyses for s in a["steps"]})
    width = max([len(a["name"]) for a in analyses] + [10]) + 2
    lines = ["held-out full acceptance by step", f"{'step':>6}" + "".join(f"{a['name']:>{width}}" for a in analyses)]
    for step in steps:
        cells = [pct(a["heldout_accept"][a["steps"].index(step)]) if step in a["steps"] else "-" for a in analyses]
        lines.append(f"{step:>6}" + "".join(f"{c:>{width}}" for c in cells))
    lines += ["", f"{'run':<{width}}{'step':>6}{'FA':>8}{'FA+CA':>8}{'b_T':>8}{'closing':>9}{'train FA':>10}"]
    for a in analyses:
        for c in a["checkpoints"]:
            lines.append(f"{a['name']:<{width}}{c['step']:>6}{pct(c['full_accept']):>8}"
                         f"{pct(c['full_or_conditional']):>8}{_num(c['mean_final_belief'], '+.3f'):>8}"
                         f"{pct(c['closing_efficiency']):>9}{pct(c['train_accept']):>10}")
    lines.append("closing: of the episodes ending with b_T > 0, the share that reached ACCEPT")
    for a in analyses:
        b = a["best"]
        shaping = "  ".join(f"{SHORT[o]} {v:+.3f}" for o, v in (a["shaping_by_outcome"] or {}).items())
        gs, gt = a["goal_strategy_corr"], a["goal_strategy_corr_train"]
        d = a["diagnostics"]
        lines += ["", f"{a['name']} (lambda {a['lam']}, anchor {a['anchor']}): best step {b['step']} at "
                      f"{pct(b['full_accept'])}, checkpoint {b['checkpoint'] or 'not kept'}",
                  f"  train vs held-out acceptance across checkpoints: {_corr(a['train_heldout_spearman'])}",
                  f"  goal vs strategy reward: held-out {_pearson(gs)}; training rollouts {_pearson(gt)}",
                  f"  shaping return (lambda {a['shaping_lambda']}) by outcome at the best step: {shaping or '-'}"]
        for title, figures in (("mean over steps", d["step_mean"]), ("pooled over the run", d["pooled"])):
            lines.append(f"  diagnostics, {title}: " + ("- (no rollouts.jsonl)" if figures is None else "  ".join(
                f"{k} {_num(figures.get(k), '.3f')}" for k in DIAGNOSTICS)))
    lines += ["", "train vs held-out acceptance over every run's checkpoints: "
                  f"{_corr(selection['pooled_train_heldout_spearman'])}"]
    return "\n".join(lines)


def _pearson(c):
    return "-" if c is None else f"r {c['r']:+.3f} (p = {c['p']:.3g}, n = {c['n']})"


# -----------------------------------------------------------------------------
# trajectories by turn (the bands of the plots)


def probe_overlay(runs):
    """Fig. 6 in numbers: per system (name -> episodes with beliefs) and probe, the mean read-out
    before the first message, at the end of the episode, and the mean change between them."""
    out = {}
    for name, episodes in runs.items():
        out[name] = {}
        for i, probe in enumerate(probe_names()):
            first = [ep["probes"][0][i] for ep in episodes]
            last = [ep["probes"][-1][i] for ep in episodes]
            out[name][probe] = {"initial": _mean(first), "final": _mean(last),
                                "change": _mean(b - a for a, b in zip(first, last)), "n": len(episodes)}
    return out


def format_probe_overlay(result):
    lines = [f"{'system':<40}" + "".join(f"{p + ' ' + k:>12}" for p in probe_names() for k in ("b_0", "b_T"))]
    for name, probes in result.items():
        lines.append(f"{name:<40}" + "".join(f"{_num(probes[p][k], '+.3f'):>12}"
                                              for p in probe_names() for k in ("initial", "final")))
    return "\n".join(lines)


def trajectory_stats(episodes, series):
    """Per outcome, the mean of a per-turn series by turn, the 95% half-width of that mean
    (significance.mean_band) and the episode count. series(ep) -> values b_0..b_T; turn t
    averages the episodes that reached it."""
    out = {}
    for outcome in arena.OUTCOMES:
        rows = [series(ep) for ep in episodes if ep["outcome"] == outcome]
        if rows:
            length = max(len(row) for row in rows)
            count = np.array([sum(len(row) > t for row in rows) for t in range(length)])
            out[outcome] = (*mean_band(rows), count)
    return out

def summarize_run(episodes, fidelity=None, shaping_lambda=None):
    """summarize() plus probe_fidelity from the stored fork and reference read-outs."""
    summary = summarize(episodes, shaping_lambda)
    if fidelity is not None:
        summary["probe_fidelity"] = probe_fidelity(fidelity["fork"], fidelity["reference"])
        if "vocabulary" in fidelity:  # the four spellings against every answer token
            summary["probe_fidelity"]["vocabulary"] = probe_fidelity(fidelity["reference"],
                                                                     fidelity["vocabulary"])
    return summary
