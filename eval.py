"""
Evaluate persuaders on PersuArena and analyse the results (SPEC section 10, the paper's analyses).

An evaluation run plays one seeded episode per held-out scenario (T_max 10) and writes
evals/<name>/episodes.jsonl, summary.json, fidelity.json, beliefs.png, probes.png and moves.png.
Reported metrics: full acceptance, full-or-conditional, pending, reject and walk-away (percent of
episodes), mean turns, mean final belief (the measured b_T), mean dense return (sum_t r_t under
the run's own reward setting, rpo.ANCHOR unless --anchor), the share of turns with a negative
process reward (rpo.negative_process_share: measured beliefs), mean strategy-judge score; the same
per resistance type and per domain; and
  belief_stats        b_0 and b_T means, Spearman of dense return against GOAL[outcome] per episode,
                      3x3 Pearson of the probes over every read-out and over every turn's change,
                      the share of saturated read-outs (|v| > SATURATION), the mean Yes+No mass;
  shaping_by_outcome  mean lambda-free dense return per outcome (the paper's 0.479 vs 0.461);
  moves               share of persuader messages with each move by turn (Fig. 5); per move the
                      difference, with and without it, in mean process reward of the turn (Welch
                      95% interval) and in P(ACCEPT) of the episode (Wald 95% interval), and the
                      Spearman correlation of the two rankings (section F);
  manipulation        per label the share of persuader messages and of episodes flagged, by outcome.
Moves and manipulation labels come from moves.py (keyword tagger by default, --tagger logit reads
the judge model). Two runs are compared paired by scenario: wins/losses/ties on the goal reward,
the 5x5 outcome transition table, an exact McNemar test on full acceptance and a Wilcoxon
signed-rank test on the goal reward.

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

import arena  # noqa: E402
import moves  # noqa: E402
import probes  # noqa: E402
import rpo  # noqa: E402
import served  # noqa: E402
from arena import OUTCOMES  # noqa: E402

SHORT = {"ACCEPT": "ACCEPT", "CONDITIONAL_ACCEPT": "COND", "PENDING": "PENDING", "REJECT": "REJECT",
         "WALK_AWAY": "WALK"}
PROBE_NAMES = tuple(probes.PROBES)  # column order of each row of an episode's "probes"
PROBE_TITLES = {"CA": "concern addressed (CA)", "PE": "persuasion effective (PE)",
                "AC": "acceptance shift (AC)"}
TRAINING_KEYS = ("ids", "turn_ids", "logprobs")  # rollout's token stream, of no use once scored
EVALS_DIR = "evals"
DEFAULT_MODEL = "smollm2"
SAME_AS_PERSUADEE = "persuadee"  # the judge by default (SPEC 6): the persuadee's model, fresh context
FIDELITY_SAMPLES = 4  # contexts whose fork read-out is checked against a full forward
GPU_MAX_NEW_TOKENS = 256  # per message, as in training (SPEC 9)
CPU_MAX_NEW_TOKENS = 64  # per message on a CPU, so that --limit 4 takes minutes
Z95 = 1.959964  # two-sided 95% normal quantile for the confidence bands and Wald intervals
CONFIDENCE = 0.95  # level of the Welch intervals of the move effects
EXACT_WILCOXON_MAX_N = 50  # exact signed-rank null up to this many nonzero differences (as scipy)
SATURATION = 0.95  # a probe value beyond this carries almost no gradient of belief
SUBSETS = {"balanced60": 3}  # named subsets: scenarios kept per domain x resistance cell, file order
CLOSED = "ACCEPT"  # the outcome that counts as closing a scenario in --compare-many
RUN_DYNAMICS = {"dead_group_share": "share of dead groups", "dead_rescued_share": "dead groups rescued by the dense term",
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
              "kl": "KL to the initial policy (k3)", "clip_frac": "share of clipped tokens",
              "loss": "policy loss"}
OUTCOME_COLORS = {"ACCEPT": "tab:green", "CONDITIONAL_ACCEPT": "tab:olive", "PENDING": "tab:gray",
                  "REJECT": "tab:orange", "WALK_AWAY": "tab:red"}

# -----------------------------------------------------------------------------
# metrics


def _mean(values):
    values = list(values)
    return sum(values) / len(values) if values else None


def _finite(x):
    """A float for JSON, None where a statistic is undefined (nan: too few or constant values)."""
    return None if x is None or not math.isfinite(float(x)) else float(x)


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
    count = {o: sum(ep["outcome"] == o for ep in episodes) for o in OUTCOMES}
    believed = with_beliefs(episodes)
    judged = [ep["judge"] for ep in episodes if ep.get("judge") is not None]
    turns = sum(len(ep["beliefs"]) - 1 for ep in episodes)
    return {
        "n": n,
        "full_accept": count["ACCEPT"] / n,
        "full_or_conditional": (count["ACCEPT"] + count["CONDITIONAL_ACCEPT"]) / n,
        "pending": count["PENDING"] / n,
        "reject": count["REJECT"] / n,
        "walk_away": count["WALK_AWAY"] / n,
        "mean_turns": _mean(ep["turns"] for ep in episodes),
        "mean_final_belief": _mean(ep["beliefs"][-1] for ep in believed),
        "mean_dense_return": _mean(dense_return(ep) for ep in believed),
        "negative_process_share": (rpo.negative_process_share(ep["beliefs"] for ep in believed)
                                   if turns else None),
        "mean_judge": _mean(judged),
        "beliefs_missing": (n - len(believed)) / n,
        "api_errors": sum(ep.get("end_reason") == served.API_ERROR for ep in episodes),
        # the share of judged transcripts whose score fell back to s = 0 (SPEC 6)
        "judge_failed_share": _mean(bool(ep.get("judge_failed")) for ep in episodes if ep.get("judge") is not None),
    }


def _groups(episodes, key):
    groups = defaultdict(list)
    for ep in episodes:
        groups[ep[key]].append(ep)
    return {k: _summary(v) for k, v in sorted(groups.items())}


def spearman(x, y):
    """{rho, p} of scipy's Spearman rank correlation; None where undefined (n < 3 or a constant)."""
    if len(x) < 3 or len(set(x)) < 2 or len(set(y)) < 2:
        return None
    r = stats.spearmanr(x, y)
    return {"rho": _finite(r.statistic), "p": _finite(r.pvalue), "n": len(x)}


def pearson_matrix(rows):
    """Pearson correlations between the columns of rows [N, K], None where a column is constant."""
    a = np.asarray(rows, dtype=float)
    k = a.shape[1] if a.ndim == 2 else len(PROBE_NAMES)
    if a.ndim != 2 or a.shape[0] < 2:
        return [[None] * k for _ in range(k)]
    with np.errstate(invalid="ignore", divide="ignore"):
        c = np.corrcoef(a, rowvar=False)
    return [[_finite(v) for v in row] for row in np.atleast_2d(c)]


def belief_stats(episodes):
    """SPEC E.4's belief statistics over every read-out of every episode (see the docstring)."""
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


def shaping_by_outcome(episodes):
    """Mean lambda-free dense return per outcome reached."""
    return {o: _mean(dense_return(ep) for ep in episodes if ep["outcome"] == o)
            for o in OUTCOMES if any(ep["outcome"] == o for ep in episodes)}


def welch_difference(with_label, without_label):
    """Difference of means (with - without) and its Welch 95% interval; None below two of each."""
    if len(with_label) < 2 or len(without_label) < 2:
        return None
    diff = float(np.mean(with_label) - np.mean(without_label))
    test = stats.ttest_ind(with_label, without_label, equal_var=False)
    low, high = test.confidence_interval(CONFIDENCE)
    return {"diff": diff, "low": _finite(low), "high": _finite(high), "n_with": len(with_label),
            "n_without": len(without_label)}


def proportion_difference(with_label, without_label):
    """Difference of two proportions (booleans) with its Wald 95% interval; None if a side is empty."""
    if not with_label or not without_label:
        return None
    p1, p2 = float(np.mean(with_label)), float(np.mean(without_label))
    half = Z95 * math.sqrt(p1 * (1 - p1) / len(with_label) + p2 * (1 - p2) / len(without_label))
    return {"diff": p1 - p2, "low": p1 - p2 - half, "high": p1 - p2 + half, "n_with": len(with_label),
            "n_without": len(without_label)}


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
    return {"by_turn": by_turn, "turn_counts": counts, "effects": effects,
            "ranking_corr": spearman([effects[m]["dense"]["diff"] for m in ranked],
                                     [effects[m]["accept"]["diff"] for m in ranked])}


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
                           for o in OUTCOMES if any(ep["outcome"] == o for ep in episodes)}}


def summarize(episodes):
    """Headline metrics of a run (fractions, not percent), the same per resistance and domain,
    and the analyses (belief_stats, shaping_by_outcome; moves and manipulation when labelled)."""
    if not episodes:
        raise ValueError("no episodes to summarize")
    summary = _summary(episodes)
    anchors = {_anchor(ep) for ep in episodes}
    summary["anchor"] = anchors.pop() if len(anchors) == 1 else "mixed"
    summary["by_resistance"] = _groups(episodes, "resistance")
    summary["by_domain"] = _groups(episodes, "domain")
    believed = with_beliefs(episodes)
    summary["belief_stats"] = belief_stats(believed)
    summary["shaping_by_outcome"] = shaping_by_outcome(believed)
    if all("moves" in ep and "manipulation" in ep for ep in episodes):
        summary["tagger"] = "+".join(sorted({ep.get("tagger", "keyword") for ep in episodes}))
        if believed:  # a move's effect is read off the beliefs it moved
            summary["moves"] = move_stats(believed)
        summary["manipulation"] = manipulation_stats(episodes)
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
    if summary.get("beliefs_missing"):
        lines.append(f"{'beliefs':<26}{'missing':>8}  in {_pct(summary['beliefs_missing'])} of episodes "
                     "(the persuadee's server gave no log-probs): belief columns leave them out")
    if summary.get("api_errors"):
        lines.append(f"{'api errors':<26}{summary['api_errors']:>8}  episodes ended as api_error "
                     "(their requests kept failing)")
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
    lines = [f"belief statistics (dense returns with anchor {summary['anchor']})",
             f"  initial mean belief {_num(b['initial_mean'], '+.3f')}   final {_num(b['final_mean'], '+.3f')}",
             f"  dense return vs goal reward: {_corr(b['spearman_dense_goal'])}",
             f"  saturated read-outs (|v| > {SATURATION}): {_pct(b['saturated_share'])}"
             + (f"   mean Yes+No mass {b['yes_no_mass_mean']:.3f}" if "yes_no_mass_mean" in b else "")]
    for key, title in (("probe_level_corr", "levels"), ("probe_increment_corr", "increments")):
        lines.append(f"  probe correlations over {title}: " + "  ".join(
            f"{PROBE_NAMES[i]}-{PROBE_NAMES[j]} {_num(b[key][i][j], '+.2f')}"
            for i in range(len(PROBE_NAMES)) for j in range(i + 1, len(PROBE_NAMES))))
    if "probe_fidelity" in summary:
        f = summary["probe_fidelity"]
        lines.append(f"  probe fidelity (fork vs full forward): max |diff| {f['max_abs_diff']:.1e}")
    lines.append("shaping return (sum r_t) by outcome: " + "  ".join(
        f"{SHORT[o]} {v:+.3f}" for o, v in summary["shaping_by_outcome"].items()))
    if "moves" in summary:
        m = summary["moves"]
        lines += ["", f"moves ({summary['tagger']} tagger): share of messages at turn 1, "
                      "effect on the turn's r_t and on P(ACCEPT) (95% intervals)"]
        for label in moves.MOVES:
            e = m["effects"][label]
            first = m["by_turn"][label][0] if m["by_turn"][label] else None
            lines.append(f"  {label:<22}{_pct(first):>8}   r_t {_interval(e['dense'], '+.3f'):<28}"
                         f"P(ACCEPT) {_interval(e['accept'], '+.2f')}")
        lines.append(f"  rankings by r_t and by P(ACCEPT): {_corr(m['ranking_corr'])}")
        a = summary["manipulation"]
        lines += ["", "manipulation audit: share of persuader messages (of episodes)"]
        for label in moves.MANIPULATION:
            lines.append(f"  {label:<22}{_pct(a['message_rate'][label]):>8} ({_pct(a['episode_rate'][label])})")
    return "\n".join(lines)


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
    if "manipulation" in sa and "manipulation" in sb:
        lines += ["", "manipulation (share of persuader messages)"]
        for label in list(moves.MANIPULATION) + ["any"]:
            ra, rb = sa["manipulation"]["message_rate"][label], sb["manipulation"]["message_rate"][label]
            if ra is not None and rb is not None:
                lines.append(f"{label:<26}{_pct(ra):>9}{_pct(rb):>9}{100 * (rb - ra):>+8.1f}%")
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
    return {"per_baseline": per_baseline, "n_common": len(everywhere), "closed_by_none": len(none),
            "policy_closes": closes, "policy_closes_share": closes / len(none) if none else None}


def format_compare_many(result, policy_name="policy"):
    lines = [f"policy = {policy_name}", f"{'baseline':<40}{'n':>6}{'won':>6}{'lost':>6}{'McNemar p':>12}"]
    for name, r in result["per_baseline"].items():
        lines.append(f"{name:<40}{r['n']:>6}{r['won']:>6}{r['lost']:>6}{r['mcnemar_p']:>12.4g}")
    lines.append(f"scenarios every run has: {result['n_common']}; closed by no baseline: "
                 f"{result['closed_by_none']}; the policy closes {result['policy_closes']} of them "
                 f"({_pct(result['policy_closes_share'])})")
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
# one episode turn by turn (Table 8) and checkpoint selection over training runs (Table 9, Figs 3, 7)


def case_rows(ep):
    """Per read-out t = 0..T: the three probes, b_t, r_t (t >= 1, the run's reward setting), the
    turn's share of sum_t |r_t|, its move labels and the persuader's message."""
    r = rpo.process_rewards(ep["beliefs"], ep["outcome"], _anchor(ep))
    total = sum(abs(x) for x in r)
    messages = moves.persuader_messages(ep)
    rows = []
    for t, (values, b) in enumerate(zip(ep["probes"], ep["beliefs"])):
        rows.append({"t": t, **dict(zip(PROBE_NAMES, values)), "b": b,
                     "r": r[t - 1] if t else None,
                     "share": abs(r[t - 1]) / total if t and total else None,
                     "moves": ep.get("moves", [])[t - 1] if t and len(ep.get("moves", [])) >= t else [],
                     "message": messages[t - 1] if t and len(messages) >= t else ""})
    return rows


def top_two_share(rows):
    shares = sorted((row["share"] for row in rows if row["share"] is not None), reverse=True)
    return sum(shares[:2]) if shares else None


def format_case(ep, width=60):
    rows = case_rows(ep)
    lines = [f"{ep['scenario_id']}: {ep['outcome']} after {ep['turns']} turns "
             f"(anchor {_anchor(ep)}, persuader {ep.get('persuader', '?')})",
             f"{'t':>3}" + "".join(f"{k:>8}" for k in PROBE_NAMES) + f"{'b_t':>8}{'r_t':>8}{'share':>8}  moves | message"]
    for row in rows:
        text = row["message"].replace("\n", " ")
        lines.append(f"{row['t']:>3}" + "".join(f"{row[k]:>+8.3f}" for k in PROBE_NAMES) + f"{row['b']:>+8.3f}"
                     f"{_num(row['r'], '+.3f'):>8}{_pct(row['share']):>8}  {','.join(row['moves']) or '-'} | "
                     f"{text[:width]}{'...' if len(text) > width else ''}")
    lines.append(f"the two largest turns carry {_pct(top_two_share(rows))} of sum |r_t|")
    return "\n".join(lines)


def find_episode(episodes, scenario_id, where):
    found = [ep for ep in episodes if ep["scenario_id"] == scenario_id or ep["id"] == scenario_id]
    if not found:
        raise ValueError(f"{where} has no episode of {scenario_id}; pick one of "
                         f"{', '.join(sorted({ep['scenario_id'] for ep in episodes})[:5])}, ...")
    return found[0]


def read_run(run_dir):
    """A training run's config, metrics.jsonl, evals.jsonl and held-out episodes (eval-STEP)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir} is not a directory; pass a training run such as runs/NAME")
    config = json.loads((run_dir / "config.json").read_text()) if (run_dir / "config.json").is_file() else {}
    evals = _read_jsonl(run_dir / "evals.jsonl", "a run trained with --eval-every N (train.py writes evals.jsonl)")
    if not evals:
        raise ValueError(f"{run_dir / 'evals.jsonl'} is empty; train with --eval-every N")
    metrics = _read_jsonl(run_dir / "metrics.jsonl", "a training run directory written by train.py")
    episodes = {}
    for row in evals:
        path = run_dir / f"eval-{row['step']}" / "episodes.jsonl"
        episodes[row["step"]] = load_episodes(path) if path.is_file() else []
    return {"dir": run_dir, "name": run_dir.name, "lam": config.get("lam"), "anchor": config.get("anchor"),
            "metrics": metrics, "evals": sorted(evals, key=lambda r: r["step"]), "episodes": episodes}


def run_analysis(run):
    """Checkpoint selection for one run: held-out acceptance by step, the best checkpoint, the
    Spearman correlation of training acceptance (the mean of outcome_ACCEPT over the steps since the
    previous evaluation) against held-out acceptance across evaluations, and the Pearson
    correlation of goal and strategy rewards over its held-out episodes."""
    steps = [row["step"] for row in run["evals"]]
    heldout = [row["full_accept"] for row in run["evals"]]
    train = []
    for prev, step in zip([0] + steps[:-1], steps):
        window = [m["outcome_ACCEPT"] for m in run["metrics"] if prev < m["step"] <= step and "outcome_ACCEPT" in m]
        train.append(_mean(window))
    best = max(range(len(steps)), key=lambda i: (heldout[i], -steps[i]))  # ties: the earliest
    checkpoint = run["dir"] / f"checkpoint-{steps[best]}"
    paired = [(a, b) for a, b in zip(train, heldout) if a is not None]
    judged = [(rpo.GOAL[ep["outcome"]], ep["judge"]) for eps in run["episodes"].values() for ep in eps
              if ep.get("judge") is not None]
    goal_strategy = None
    if len(judged) >= 3 and len({g for g, _ in judged}) > 1 and len({j for _, j in judged}) > 1:
        r = stats.pearsonr([g for g, _ in judged], [j for _, j in judged])
        goal_strategy = {"r": _finite(r.statistic), "p": _finite(r.pvalue), "n": len(judged)}
    return {"name": run["name"], "lam": run["lam"], "anchor": run["anchor"], "steps": steps,
            "heldout_accept": heldout, "train_accept": train,
            "best": {"step": steps[best], "full_accept": heldout[best],
                     "checkpoint": str(checkpoint) if checkpoint.is_dir() else None},
            "train_heldout_spearman": spearman([a for a, _ in paired], [b for _, b in paired]),
            "goal_strategy_corr": goal_strategy,
            "shaping_by_outcome": run["evals"][best].get("shaping_by_outcome")}


def format_runs(analyses):
    """Table 9 (held-out acceptance by step, one column per run) and each run's selection."""
    steps = sorted({s for a in analyses for s in a["steps"]})
    width = max([len(a["name"]) for a in analyses] + [10]) + 2
    lines = ["held-out full acceptance by step", f"{'step':>6}" + "".join(f"{a['name']:>{width}}" for a in analyses)]
    for step in steps:
        cells = [_pct(a["heldout_accept"][a["steps"].index(step)]) if step in a["steps"] else "-" for a in analyses]
        lines.append(f"{step:>6}" + "".join(f"{c:>{width}}" for c in cells))
    for a in analyses:
        b = a["best"]
        shaping = "  ".join(f"{SHORT[o]} {v:+.3f}" for o, v in (a["shaping_by_outcome"] or {}).items())
        gs = a["goal_strategy_corr"]
        lines += ["", f"{a['name']} (lambda {a['lam']}, anchor {a['anchor']}): best step {b['step']} at "
                      f"{_pct(b['full_accept'])}, checkpoint {b['checkpoint'] or 'not kept'}",
                  f"  train vs held-out acceptance across checkpoints: {_corr(a['train_heldout_spearman'])}",
                  "  goal vs strategy reward (held-out episodes): "
                  + ("-" if gs is None else f"r {gs['r']:+.3f} (p = {gs['p']:.3g}, n = {gs['n']})"),
                  f"  shaping return by outcome at the best step: {shaping or '-'}"]
    return "\n".join(lines)


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
    fig, axes = plt.subplots(1, len(PROBE_NAMES), figsize=PROBE_FIGSIZE, sharey=True)
    for i, (ax, probe) in enumerate(zip(axes, PROBE_NAMES)):
        _draw_by_outcome(ax, episodes, lambda ep, i=i: [row[i] for row in ep["probes"]],
                         f"{PROBE_TITLES[probe]} by turn", "probe value 2p(yes) - 1")
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
    """Table 8 as a figure: the probes and b_t by turn above, r_t and its share of sum |r_t| below."""
    rows = case_rows(ep)
    t = [row["t"] for row in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=CASE_FIGSIZE, sharex=True)
    for k in PROBE_NAMES:
        top.plot(t, [row[k] for row in rows], marker="o", ms=3, label=k)
    top.plot(t, [row["b"] for row in rows], marker="s", color="black", lw=2, label="b_t")
    top.set(title=f"{ep['scenario_id']}: {ep['outcome']} after {ep['turns']} turns", ylabel="probe value",
            ylim=(-1.05, 1.05))
    top.legend(fontsize=8)
    bars = [(row["t"], row["r"], row["share"]) for row in rows if row["r"] is not None]
    if bars:
        xs, rs, shares = zip(*bars)
        bottom.bar(xs, rs, color=["tab:green" if r >= 0 else "tab:red" for r in rs])
        for x, r, share in zip(xs, rs, shares):
            bottom.annotate(_pct(share), (x, r), ha="center", va="bottom" if r >= 0 else "top", fontsize=8)
    bottom.axhline(0, color="black", lw=0.5)
    bottom.set(xlabel="turn t", ylabel="process reward r_t")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    _save_fig(fig, path)


def _mean_band(rows):
    """Mean by index over ragged rows and its 95% normal half-width (0 where one row)."""
    length = max((len(r) for r in rows), default=0)
    mean, half = np.zeros(length), np.zeros(length)
    for t in range(length):
        v = np.array([r[t] for r in rows if len(r) > t], dtype=float)
        mean[t] = v.mean()
        half[t] = Z95 * v.std(ddof=1) / math.sqrt(v.size) if v.size > 1 else 0.0
    return mean, half


def plot_overlay(runs, path):
    """Fig. 6: runs (name -> episodes) overlaid: mean belief b_t by turn, mean r_t by turn."""
    fig, axes = plt.subplots(1, 2, figsize=OVERLAY_FIGSIZE)
    for name, episodes in runs.items():
        for ax, rows, start in ((axes[0], [ep["beliefs"] for ep in episodes], 0),
                                (axes[1], [raw_process_rewards(ep) for ep in episodes], 1)):
            mean, half = _mean_band(rows)
            x = np.arange(start, start + mean.size)
            ax.plot(x, mean, marker="o", ms=3, label=f"{name} (n={len(episodes)})")
            ax.fill_between(x, mean - half, mean + half, alpha=0.2)
    axes[0].set(title="Belief by turn (mean, 95% CI)", xlabel="turn t", ylabel="b_t", ylim=(-1.05, 1.05))
    axes[1].set(title="Process reward by turn (mean, 95% CI)", xlabel="turn t", ylabel="r_t (measured beliefs)")
    for ax in axes:
        ax.axhline(0, color="black", lw=0.5)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
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
    """Fig. 7: dead-group share, dead groups rescued, and the two advantage terms by step per run."""
    fig, axes = plt.subplots(1, len(RUN_DYNAMICS), figsize=(RUN_PANEL_SIZE[0] * len(RUN_DYNAMICS), RUN_PANEL_SIZE[1]))
    for ax, (key, title) in zip(axes, RUN_DYNAMICS.items()):
        for run in runs:
            pts = [(m["step"], m[key]) for m in run["metrics"] if _is_number(m.get(key))]
            if pts:
                ax.plot(*zip(*pts), marker="o", ms=3, label=run["name"])
        ax.set(title=title, xlabel="training step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
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


def standard(value):
    """value with every non-finite float, at any depth, written as null (standard JSON: a mean
    over no episode with beliefs is no NaN in a file)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: standard(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [standard(v) for v in value]
    return value


def _write_text(path, text):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_run(out_dir, episodes, summary, fidelity=None):
    """Write episodes.jsonl, summary.json, fidelity.json (the fork and reference read-outs, when
    given), beliefs.png, probes.png and moves.png (when labelled), each atomically."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_text(out_dir / "episodes.jsonl", "".join(json.dumps(standard(ep), allow_nan=False) + "\n"
                                                    for ep in episodes))
    if fidelity is not None:
        _write_text(out_dir / "fidelity.json", json.dumps(fidelity) + "\n")
    _write_text(out_dir / "summary.json", json.dumps(standard(summary), indent=2, allow_nan=False) + "\n")
    believed = with_beliefs(episodes)
    if believed:  # a persuadee served without log-probs has no belief to plot
        plot_beliefs(believed, out_dir / "beliefs.png")
        plot_probes(believed, out_dir / "probes.png")
    if "moves" in summary:
        plot_moves(summary, out_dir / "moves.png")


def summarize_run(episodes, fidelity=None):
    """summarize() plus probe_fidelity from the stored fork and reference read-outs."""
    summary = summarize(episodes)
    if fidelity is not None:
        summary["probe_fidelity"] = probe_fidelity(fidelity["fork"], fidelity["reference"])
        if "vocabulary" in fidelity:  # the four spellings against every answer token
            summary["probe_fidelity"]["vocabulary"] = probe_fidelity(fidelity["reference"],
                                                                     fidelity["vocabulary"])
    return summary


def scenarios_by_id():
    """Every scenario of scenarios.jsonl by id (the hidden profiles the keyword tagger audits)."""
    return {s["id"]: s for s in arena.load_scenarios()}


def analyze(run_dir):
    """Recompute summary.json and the plots of an eval folder from its episodes.jsonl (and
    fidelity.json) alone, with no model: episodes stored without labels are tagged in memory by
    the keyword tagger. Returns the summary."""
    run_dir = Path(run_dir)
    episodes = load_episodes(run_dir)
    if not all("moves" in ep for ep in episodes):
        moves.tag_episodes([ep for ep in episodes if "moves" not in ep], scenarios_by_id())
    path = run_dir / "fidelity.json"
    fidelity = json.loads(path.read_text()) if path.is_file() else None
    summary = summarize_run(episodes, fidelity)
    _write_text(run_dir / "summary.json", json.dumps(standard(summary), indent=2, allow_nan=False) + "\n")
    plot_beliefs(episodes, run_dir / "beliefs.png")
    plot_probes(episodes, run_dir / "probes.png")
    plot_moves(summary, run_dir / "moves.png")
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
    summary = summarize_run(episodes, reads)
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
    save_run(out_dir, [ep], summarize([ep]))
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
        return format_compare(compare(load_episodes(a), load_episodes(b)), a, b)
    if args.compare_many:
        result = compare_many({d: load_episodes(d) for d in args.compare_many}, load_episodes(args.policy))
        return format_compare_many(result, args.policy)
    if args.analyze:
        summary = analyze(args.analyze)
        return f"{format_table(summary)}\nwrote {Path(args.analyze) / 'summary.json'} and the plots"
    if args.case:
        folder, sid = args.case
        ep = find_episode(load_episodes(folder), sid, folder)
        path = Path(folder) / f"case-{_slug(sid)}.png"
        plot_case(ep, path)
        return f"{format_case(ep)}\nwrote {path}"
    if args.overlay:
        path = _output_dir(args, "overlay_" + "_vs_".join(_slug(Path(d).name) for d in args.overlay)) / "overlay.png"
        plot_overlay({d: load_episodes(d) for d in args.overlay}, path)
        return f"wrote {path}"
    if args.runs:
        runs = [read_run(d) for d in args.runs]
        analyses = [run_analysis(r) for r in runs]
        out = _output_dir(args, "runs_" + "_".join(_slug(r["name"]) for r in runs))
        plot_runs(analyses, out / "runs.png")
        plot_dynamics(runs, out / "dynamics.png")
        out.mkdir(parents=True, exist_ok=True)
        _write_text(out / "runs.json", json.dumps(analyses, indent=2) + "\n")
        return f"{format_runs(analyses)}\nwrote {out / 'runs.png'}, {out / 'dynamics.png'} and {out / 'runs.json'}"
    return f"wrote {plot_run(args.plot_run)}"


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
                  f"{format_table(results[(p, q)])}")
    if len(pairs) > 1 and rank == 0:
        print("\n" + grid_table(results))
    if "RANK" in os.environ:  # a rank that exits with its process group alive can abort in gloo
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
