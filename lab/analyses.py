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
Also: Fig. 6's per-probe overlay in numbers (probe_overlay), the case study (Table 8: case_rows)
and the per-turn bands of the plots (trajectory_stats). Across runs: lab/comparisons.py (paired
tests, baselines, the main table); over training runs: lab/run_selection.py (Table 9).

The intervals, paired tests and correlations are significance.py's; eval.py and report.py are the
command line over these functions; plots.py draws them.
Tests: python -m pytest -q tests/test_analyses.py
"""

from collections import Counter, defaultdict

import numpy as np

from persuarena import arena
from persuarena import rpo
from lab import moves, records
from lab.records import probe_names
from lab.significance import (finite_or_none, mean_band, pearson, proportion_difference, spearman,
                              welch_difference)

SHORT = {"ACCEPT": "ACCEPT", "CONDITIONAL_ACCEPT": "COND", "PENDING": "PENDING", "REJECT": "REJECT",
         "WALK_AWAY": "WALK"}
SATURATION = 0.95  # a probe value beyond this carries almost no gradient of belief
FIDELITY_BINS = (0.0, 0.2, 0.5, 0.9, 1.0)  # |v| edges: undecided .. decided, for the probe fidelity split
UNSTATED = "unstated"  # the breakdown row of episodes whose scenario omits the field


# -----------------------------------------------------------------------------
# metrics


def mean(values):
    """The mean of values, None where there are none."""
    values = list(values)
    return sum(values) / len(values) if values else None


def _anchor(ep):
    return rpo.ANCHOR if ep.anchor is None else ep.anchor  # the run's own reward setting, stored with each episode


def dense_return(ep):
    """The episode's lambda-free dense return sum_t r_t under its run's setting."""
    return rpo.dense_return(ep.beliefs, ep.outcome, _anchor(ep))


def raw_process_rewards(ep):
    """r_t = (b_t - b_{t-1}) / 2 on the measured beliefs: what each turn did to the persuadee."""
    return rpo.process_rewards(ep.beliefs, ep.outcome, anchor=False)


def with_beliefs(episodes):
    """The episodes that have beliefs (a persuadee served without log-probs, or an episode that
    never started, has none) and no unsound value (records.unsound): the belief columns and
    analyses use these alone."""
    return [ep for ep in episodes if ep.beliefs and None not in ep.beliefs and not records.unsound(ep)]


def set_aside(episodes):
    """(the sound episodes, [{id, fields}] of those with a NaN, an infinity or an absurd value,
    records.unsound): the summary is of the first, and lists and counts the second."""
    sound, aside = [], []
    for ep in episodes:
        fields = records.unsound(ep)
        (aside.append(dict(id=ep.id, fields=fields)) if fields else sound.append(ep))
    return sound, aside


def _summary(episodes):
    n = len(episodes)
    count = {o: sum(ep.outcome == o for ep in episodes) for o in arena.OUTCOMES}
    believed = with_beliefs(episodes)
    judged = [ep.judge for ep in episodes if ep.judge is not None]
    turns = sum(len(ep.beliefs) - 1 for ep in believed)
    return {
        "n": n,
        "full_accept": count["ACCEPT"] / n,
        "full_or_conditional": (count["ACCEPT"] + count["CONDITIONAL_ACCEPT"]) / n,
        "pending": count["PENDING"] / n,
        "reject": count["REJECT"] / n,
        "walk_away": count["WALK_AWAY"] / n,
        "mean_turns": mean(ep.turns for ep in episodes),
        "mean_final_belief": mean(ep.beliefs[-1] for ep in believed),
        "closing_efficiency": closing_efficiency(episodes),
        "mean_dense_return": mean(dense_return(ep) for ep in believed),
        "negative_process_share": (rpo.negative_process_share(ep.beliefs for ep in believed)
                                   if turns else None),
        "mean_judge": mean(judged),
        "beliefs_missing": (n - len(believed)) / n,
        "api_errors": sum(ep.end_reason == arena.API_ERROR for ep in episodes),
        # episodes by how they ended; a cut-off one (arena.CUT_OFF) never reached its outcome
        "end_reasons": dict(sorted(Counter(str(ep.end_reason) for ep in episodes).items())),
        "cut_off": sum(ep.end_reason in arena.CUT_OFF for ep in episodes),
        # the share of judged transcripts whose score fell back to s = 0 (the paper: "zero if it fails
        # after three retries")
        "judge_failed_share": mean(bool(ep.judge_failed) for ep in episodes if ep.judge is not None),
    }


def closing_efficiency(episodes):
    """Table 9's closing efficiency (DECISIONS.md: Closing efficiency): of the episodes that
    ended with the persuadee leaning towards the request (b_T > 0), the share that closed (ACCEPT).
    None where no episode ended with b_T > 0."""
    leaning = [ep for ep in with_beliefs(episodes) if ep.beliefs[-1] > 0]
    return mean(ep.outcome == "ACCEPT" for ep in leaning)


def _groups(episodes, key):
    groups = defaultdict(list)
    for ep in episodes:  # a training scenario may leave its resistance unstated (section B.2)
        groups[getattr(ep, key) or UNSTATED].append(ep)
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
    levels = [row for ep in episodes for row in ep.probes]
    increments = [np.subtract(ep.probes[t], ep.probes[t - 1]).tolist()
                  for ep in episodes for t in range(1, len(ep.probes))]
    out = {
        "initial_mean": mean(ep.beliefs[0] for ep in episodes),
        "final_mean": mean(ep.beliefs[-1] for ep in episodes),
        "spearman_dense_goal": spearman([dense_return(ep) for ep in episodes],
                                        [rpo.GOAL[ep.outcome] for ep in episodes]),
        "probe_level_corr": pearson_matrix(levels),
        "probe_increment_corr": pearson_matrix(increments),
        "saturated_share": float(np.mean(np.abs(np.asarray(levels, dtype=float)) > SATURATION)),
    }
    if all(ep.probe_mass for ep in episodes):
        out["yes_no_mass_mean"] = float(np.mean([m for ep in episodes for row in ep.probe_mass for m in row]))
    return out


def dense_by_outcome(episodes):
    """Mean lambda-free dense return sum_t r_t per outcome reached."""
    return {o: mean(dense_return(ep) for ep in episodes if ep.outcome == o)
            for o in arena.OUTCOMES if any(ep.outcome == o for ep in episodes)}


def shaping_by_outcome(episodes, lam=None):
    """Mean shaping return lam * sum_t r_t per outcome reached (lam default rpo.LAMBDA): the
    paper's scale (section F's 0.479 ACCEPT and 0.461 CONDITIONAL_ACCEPT at lambda 0.5, bounded
    by [-lam, lam])."""
    lam = rpo.LAMBDA if lam is None else lam
    return {o: lam * v for o, v in dense_by_outcome(episodes).items()}


def move_stats(episodes):
    """Fig. 5 and section F from the stored move labels (episodes with `moves`)."""
    longest = max(len(ep.moves) for ep in episodes)
    by_turn = {m: [] for m in moves.MOVES}
    counts = []
    for t in range(longest):
        at_t = [ep.moves[t] for ep in episodes if len(ep.moves) > t]
        counts.append(len(at_t))
        for m in moves.MOVES:
            by_turn[m].append(sum(m in labels for labels in at_t) / len(at_t))
    effects = {}
    for m in moves.MOVES:
        turn_with, turn_without = [], []
        for ep in episodes:
            for labels, r in zip(ep.moves, raw_process_rewards(ep)):
                (turn_with if m in labels else turn_without).append(r)
        accepted = {True: [], False: []}
        for ep in episodes:
            accepted[any(m in labels for labels in ep.moves)].append(ep.outcome == "ACCEPT")
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
        messages = [labels for ep in eps for labels in ep.manipulation]
        n = len(messages)
        return {"n_messages": n, **{m: (sum(m in labels for labels in messages) / n if n else None)
                                    for m in moves.MANIPULATION},
                "any": sum(bool(labels) for labels in messages) / n if n else None}
    return {"message_rate": rates(episodes),
            "episode_rate": {m: mean(any(m in labels for labels in ep.manipulation) for ep in episodes)
                             for m in moves.MANIPULATION},
            "by_outcome": {o: rates([ep for ep in episodes if ep.outcome == o])
                           for o in arena.OUTCOMES if any(ep.outcome == o for ep in episodes)}}


def summarize(episodes, shaping_lambda=None):
    """Headline metrics of a run (fractions, not percent), the same per resistance and domain,
    and the analyses (belief_stats, shaping_by_outcome at shaping_lambda with the lambda-free
    dense_by_outcome beside it; moves and manipulation when labelled)."""
    if not episodes:
        raise ValueError("no episodes to summarize")
    episodes, aside = set_aside(episodes)
    if not episodes:
        raise ValueError(f"every record holds a NaN, an infinity or an out-of-range value (e.g. "
                         f"{aside[0]['id']}: {', '.join(aside[0]['fields'])}); nothing to summarize")
    summary = _summary(episodes)
    summary["set_aside"] = aside
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
    if all(ep.moves is not None and ep.manipulation is not None for ep in episodes):
        summary["tagger"] = "+".join(sorted({ep.tagger or "keyword" for ep in episodes}))
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


def num(x, fmt):
    return "-" if x is None else format(x, fmt)


def _breakdown(title, groups):
    head = (f"{title:<22}{'n':>5}{'accept':>9}{'acc+cond':>10}{'pending':>9}{'reject':>8}{'walk':>7}"
            f"{'turns':>7}{'belief':>8}{'dense':>8}{'neg r':>8}")
    rows = [head]
    for name, s in groups.items():
        rows.append(f"{name:<22}{s['n']:>5}{pct(s['full_accept']):>9}{pct(s['full_or_conditional']):>10}"
                    f"{pct(s['pending']):>9}{pct(s['reject']):>8}{pct(s['walk_away']):>7}"
                    f"{num(s['mean_turns'], '.2f'):>7}{num(s['mean_final_belief'], '+.3f'):>8}"
                    f"{num(s['mean_dense_return'], '+.3f'):>8}{pct(s['negative_process_share']):>8}")
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
        f"{'mean turns':<26}{num(summary['mean_turns'], '.2f'):>8}",
        f"{'mean final belief':<26}{num(summary['mean_final_belief'], '+.3f'):>8}",
        f"{'mean dense return':<26}{num(summary['mean_dense_return'], '+.3f'):>8}",
        f"{'negative process reward':<26}{pct(summary['negative_process_share']):>8}  of turns (raw beliefs)",
        f"{'mean judge score':<26}{num(summary['mean_judge'], '+.2f'):>8}",
        f"{'judge fell back to 0':<26}{pct(summary.get('judge_failed_share')):>8}  of judged transcripts",
    ]
    if warning := judge_warning(summary):
        lines.append(warning)
    if summary.get("beliefs_missing"):
        lines.append(f"{'beliefs':<26}{'missing':>8}  in {pct(summary['beliefs_missing'])} of episodes "
                     "(the persuadee's server gave no log-probs): belief columns leave them out")
    if aside := summary.get("set_aside"):
        lines.append(f"{'SET ASIDE':<26}{len(aside):>8}  records with a NaN, an infinity or an "
                     "out-of-range value, left out of every figure: " + ", ".join(
                         f"{a['id']} ({', '.join(a['fields'])})" for a in aside[:3]) +
                     (f" and {len(aside) - 3} more" if len(aside) > 3 else ""))
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


def corr(c):
    return "-" if c is None else f"rho {c['rho']:+.3f} (p = {c['p']:.3g}, n = {c['n']})"


def format_analyses(summary):
    """Belief statistics, shaping return by outcome, move rankings and the manipulation audit."""
    b = summary["belief_stats"]
    if b is None:
        return "\n".join(["belief statistics: none (no episode has beliefs)"] + _label_lines(summary))
    lines = [f"belief statistics (dense returns with anchor {summary['anchor']})",
             f"  initial mean belief {num(b['initial_mean'], '+.3f')}   final {num(b['final_mean'], '+.3f')}",
             f"  dense return vs goal reward: {corr(b['spearman_dense_goal'])}",
             f"  saturated read-outs (|v| > {SATURATION}): {pct(b['saturated_share'])}"
             + (f"   mean Yes+No mass {b['yes_no_mass_mean']:.3f}" if "yes_no_mass_mean" in b else "")]
    for key, title in (("probe_level_corr", "levels"), ("probe_increment_corr", "increments")):
        lines.append(f"  probe correlations over {title}: " + "  ".join(
            f"{probe_names()[i]}-{probe_names()[j]} {num(b[key][i][j], '+.2f')}"
            for i in range(len(probe_names())) for j in range(i + 1, len(probe_names()))))
    if "probe_fidelity" in summary:
        for title, f in (("fork vs transformers' forward", summary["probe_fidelity"]),
                         ("four spellings vs every answer token", summary["probe_fidelity"].get("vocabulary"))):
            if f is None:
                continue
            lines.append(f"  probe fidelity, {title}: max |diff| {f['max_abs_diff']:.1e} over {f.get('n', '?')} "
                         "values; by |v|: " + "  ".join(
                             f"[{b['low']}, {b['high']}] {num(b['max_abs_diff'], '.1e')} (n {b['n']})"
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
        lines.append(f"  rankings by r_t and by P(ACCEPT): {corr(m['ranking_corr'])}; Pearson "
                     f"{pearson_text(m.get('ranking_pearson'))}")
    if "manipulation" in summary:
        a = summary["manipulation"]
        lines += ["", "manipulation audit: share of persuader messages (of episodes)"]
        for label in moves.MANIPULATION:
            lines.append(f"  {label:<22}{pct(a['message_rate'][label]):>8} ({pct(a['episode_rate'][label])})")
    return lines


def pearson_text(c):
    return "-" if c is None else f"r {c['r']:+.3f} (p = {c['p']:.3g}, n = {c['n']})"


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
# one episode turn by turn (Table 8)


def case_rows(ep):
    """Per read-out t = 0..T: every probe's value, b_t, r_t (t >= 1, the run's reward setting), the
    turn's share of sum_t |r_t| (share) and of the net sum_t r_t (signed_share: negative for a turn
    that lost ground, and summing to 1), its move labels and the persuader's message."""
    r = rpo.process_rewards(ep.beliefs, ep.outcome, _anchor(ep))
    total, net = sum(abs(x) for x in r), sum(r)
    messages = moves.persuader_messages(ep)
    rows = []
    for t, (values, b) in enumerate(zip(ep.probes, ep.beliefs)):
        rows.append({"t": t, **dict(zip(probe_names(), values)), "b": b,
                     "r": r[t - 1] if t else None,
                     "share": abs(r[t - 1]) / total if t and total else None,
                     "signed_share": r[t - 1] / net if t and net else None,
                     "moves": ep.moves[t - 1] if t and len(ep.moves or []) >= t else [],
                     "message": messages[t - 1] if t and len(messages) >= t else ""})
    return rows


def top_two_share(rows, key="share"):
    """What the two largest turns carry: of sum |r_t| (key "share") or of the net sum r_t
    ("signed_share", the two largest signed shares)."""
    shares = sorted((row[key] for row in rows if row[key] is not None), reverse=True)
    return sum(shares[:2]) if shares else None


def format_case(ep, width=60):
    rows = case_rows(ep)
    lines = [f"{ep.scenario_id}: {ep.outcome} after {ep.turns} turns "
             f"(anchor {_anchor(ep)}, persuader {ep.persuader or '?'})",
             f"{'t':>3}" + "".join(f"{k:>8}" for k in probe_names()) + f"{'b_t':>8}{'r_t':>8}{'|share|':>8}{'signed':>8}  moves | message"]
    for row in rows:
        text = row["message"].replace("\n", " ")
        lines.append(f"{row['t']:>3}" + "".join(f"{row[k]:>+8.3f}" for k in probe_names()) + f"{row['b']:>+8.3f}"
                     f"{num(row['r'], '+.3f'):>8}{pct(row['share']):>8}{pct(row['signed_share']):>8}  {','.join(row['moves']) or '-'} | "
                     f"{text[:width]}{'...' if len(text) > width else ''}")
    lines.append(f"the two largest turns carry {pct(top_two_share(rows))} of sum |r_t|, "
                 f"{pct(top_two_share(rows, 'signed_share'))} of the net sum r_t")
    return "\n".join(lines)


def find_episode(episodes, scenario_id, where):
    found = [ep for ep in episodes if ep.scenario_id == scenario_id or ep.id == scenario_id]
    if not found:
        raise ValueError(f"{where} has no episode of {scenario_id}; pick one of "
                         f"{', '.join(sorted({ep.scenario_id for ep in episodes})[:5])}, ...")
    return found[0]


# -----------------------------------------------------------------------------
# trajectories by turn (the bands of the plots)


def probe_overlay(runs):
    """Fig. 6 in numbers: per system (name -> episodes with beliefs) and probe, the mean read-out
    before the first message, at the end of the episode, and the mean change between them."""
    out = {}
    for name, episodes in runs.items():
        out[name] = {}
        for i, probe in enumerate(probe_names()):
            first = [ep.probes[0][i] for ep in episodes]
            last = [ep.probes[-1][i] for ep in episodes]
            out[name][probe] = {"initial": mean(first), "final": mean(last),
                                "change": mean(b - a for a, b in zip(first, last)), "n": len(episodes)}
    return out


def format_probe_overlay(result):
    lines = [f"{'system':<40}" + "".join(f"{p + ' ' + k:>12}" for p in probe_names() for k in ("b_0", "b_T"))]
    for name, probes in result.items():
        lines.append(f"{name:<40}" + "".join(f"{num(probes[p][k], '+.3f'):>12}"
                                              for p in probe_names() for k in ("initial", "final")))
    return "\n".join(lines)


def trajectory_stats(episodes, series):
    """Per outcome, the mean of a per-turn series by turn, the 95% half-width of that mean
    (significance.mean_band) and the episode count. series(ep) -> values b_0..b_T; turn t
    averages the episodes that reached it."""
    out = {}
    for outcome in arena.OUTCOMES:
        rows = [series(ep) for ep in episodes if ep.outcome == outcome]
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
