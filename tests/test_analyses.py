"""Tests of analyses.py: metrics, belief and move statistics, the case
study, on synthetic episode records. Expected values are computed by hand in the comments or by
scipy/numpy. Run: python -m pytest -q test_analyses.py"""

import itertools
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from persuarena import arena
from dataclasses import replace
from persuarena.rollout import Episode
from lab import analyses as an
from lab import moves
from persuarena import rpo
from lab import significance

HERE = Path(__file__).resolve().parent.parent  # the repository root


def test_importing_analyses_loads_no_torch():
    code = "from lab import analyses; import sys; assert 'torch' not in sys.modules and 'matplotlib' not in sys.modules"
    p = subprocess.run([sys.executable, "-c", code], cwd=HERE, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr


def episode(sid, outcome, beliefs, domain="finance", resistance="identity_threat", judge=0.0):
    """A record in the eval format; probes are spread around the belief so CA, PE, AC differ."""
    turns = len(beliefs) - 1
    transcript = []
    for t in range(1, turns + 1):
        transcript.append({"role": "persuader", "text": f"ask {t}", "decision": None})
        transcript.append({"role": "persuadee", "text": f"reply {t}",
                           "decision": outcome if t == turns else None})
    return Episode.from_record({
        "id": sid, "scenario_id": sid, "domain": domain, "resistance": resistance, "outcome": outcome,
        "turns": turns, "end_reason": "decision", "transcript": transcript, "beliefs": beliefs,
        "probes": [[b + 0.1, b, b - 0.1] for b in beliefs], "judge": judge,
        "persuader": "p", "persuadee": "q", "seed": 0})


PAPER_ANCHORS = {"ACCEPT": 1.0, "CONDITIONAL_ACCEPT": 0.5, "PENDING": 0.0, "REJECT": -1.0, "WALK_AWAY": -1.0}


# raw r_t = (b_t - b_{t-1}) / 2; anchored: b_T replaced by {ACCEPT 1, COND .5, PENDING 0, REJECT -1, WALK -1}
SIX = [
    # raw r: .2 .2 (0 negative); anchored sum (1 - 0)/2 = .5
    episode("e1", "ACCEPT", [0.0, 0.4, 0.8], "finance", "identity_threat", 1.0),
    # raw r: -.1 .2 .1 (1 negative); anchored sum (.5 - .2)/2 = .15
    episode("e2", "CONDITIONAL_ACCEPT", [0.2, 0.0, 0.4, 0.6], "finance", "entrenched_belief", 0.5),
    # raw r: .1 -.2 .2 .1 (1 negative; anchored the last is (0 - .2)/2 < 0, so 2); anchored sum (0 - 0)/2 = 0
    episode("e3", "PENDING", [0.0, 0.2, -0.2, 0.2, 0.4], "healthcare", "identity_threat", 0.0),
    # raw r: -.1 -.3 (2 negative); anchored sum (-1 - .4)/2 = -.7
    episode("e4", "REJECT", [0.4, 0.2, -0.4], "healthcare", "entrenched_belief", -1.0),
    # raw r: -.3 (1 negative); anchored sum (-1 - 0)/2 = -.5
    episode("e5", "WALK_AWAY", [0.0, -0.6], "workplace", "autonomy_resistance", -2.0),
    # raw r: .1 0 .3 (0 negative: a zero change is not negative); anchored sum (1 + .2)/2 = .6
    episode("e6", "ACCEPT", [-0.2, 0.0, 0.0, 0.6], "workplace", "identity_threat", 2.0),
]


def test_summarize_by_hand():
    s = an.summarize(SIX)
    assert s["n"] == 6
    assert s["full_accept"] == pytest.approx(2 / 6)             # e1, e6
    assert s["full_or_conditional"] == pytest.approx(3 / 6)     # + e2
    assert s["pending"] == pytest.approx(1 / 6)
    assert s["reject"] == pytest.approx(1 / 6)
    assert s["walk_away"] == pytest.approx(1 / 6)
    assert s["mean_turns"] == pytest.approx(15 / 6)             # 2 + 3 + 4 + 2 + 1 + 3
    # measured b_T, not the anchor: (.8 + .6 + .4 - .4 - .6 + .6)/6 = 1.4/6 (anchors would give .5/6)
    assert s["mean_final_belief"] == pytest.approx(1.4 / 6)
    # dense returns under the run's setting: raw .4 + .2 + .2 - .4 - .3 + .4 = .5; anchored
    # .5 + .15 + 0 - .7 - .5 + .6 = .05 (the anchors of rpo.ANCHOR_BELIEF as they are today)
    anchored = sum(rpo.ANCHOR_BELIEF[ep.outcome] - ep.beliefs[0] for ep in SIX) / 2
    assert anchored == pytest.approx(0.05) or rpo.ANCHOR_BELIEF != PAPER_ANCHORS
    assert s["mean_dense_return"] == pytest.approx((anchored if rpo.ANCHOR else 0.5) / 6)
    assert s["anchor"] == rpo.ANCHOR
    for setting, total in ((True, anchored), (False, 0.5)):
        assert an.summarize([replace(ep, anchor=setting) for ep in SIX])["mean_dense_return"] == pytest.approx(total / 6)
    # raw negatives 0 + 1 + 1 + 2 + 1 + 0 = 5 of 15 turns (anchored would count 6)
    assert s["negative_process_share"] == pytest.approx(5 / 15)
    assert s["mean_judge"] == pytest.approx(0.5 / 6)            # 1 + .5 + 0 - 1 - 2 + 2


def test_summarize_counts_judge_fallbacks():
    """The share of judged transcripts that fell back to s = 0; unjudged ones are not counted."""
    eps = [replace(ep, judge_failed=i in (1, 4)) for i, ep in enumerate(SIX)]
    assert an.summarize(eps)["judge_failed_share"] == pytest.approx(2 / 6)
    eps[0].judge = None
    assert an.summarize(eps)["judge_failed_share"] == pytest.approx(2 / 5)
    assert "judge fell back to 0" in an.format_table(an.summarize(eps))
    assert an.summarize([replace(ep, judge=None) for ep in SIX])["judge_failed_share"] is None


def test_a_judge_that_failed_every_transcript_is_said_loudly():
    """Issue 27: every strategy score a silent 0 once passed unnoticed."""
    summary = an.summarize([replace(ep, judge=0.0, judge_failed=True) for ep in SIX])
    assert summary["judge_failed_share"] == 1 and "JUDGE FAILED" in summary["judge_warning"]
    assert "JUDGE FAILED" in an.format_table(summary)
    some = an.summarize([replace(ep, judge_failed=i == 0) for i, ep in enumerate(SIX)])
    assert "judge_warning" not in some and "JUDGE FAILED" not in an.format_table(some)


def test_summarize_breakdowns():
    s = an.summarize(SIX)
    assert set(s["by_resistance"]) == {"identity_threat", "entrenched_belief", "autonomy_resistance"}
    it = s["by_resistance"]["identity_threat"]                  # e1, e3, e6
    assert it["n"] == 3 and it["full_accept"] == pytest.approx(2 / 3) and it["pending"] == pytest.approx(1 / 3)
    assert it["mean_turns"] == pytest.approx(3.0)               # (2 + 4 + 3)/3
    assert it["negative_process_share"] == pytest.approx(1 / 9)  # only e3's second turn
    eb = s["by_resistance"]["entrenched_belief"]                # e2, e4
    assert eb["full_accept"] == 0 and eb["full_or_conditional"] == pytest.approx(0.5)
    # e2, e4 raw .2 and -.4; anchored (a[COND] - .2)/2 and (a[REJECT] - .4)/2
    a = rpo.ANCHOR_BELIEF
    anchored = ((a["CONDITIONAL_ACCEPT"] - 0.2) / 2 + (a["REJECT"] - 0.4) / 2) / 2
    assert eb["mean_dense_return"] == pytest.approx(anchored if rpo.ANCHOR else (0.2 - 0.4) / 2)
    assert s["by_resistance"]["autonomy_resistance"]["walk_away"] == 1.0
    fin = s["by_domain"]["finance"]                             # e1, e2
    assert fin["full_accept"] == pytest.approx(0.5) and fin["full_or_conditional"] == 1.0
    assert fin["mean_final_belief"] == pytest.approx(0.7)       # (.8 + .6)/2
    assert s["by_domain"]["healthcare"]["reject"] == pytest.approx(0.5)
    assert "by_domain" not in fin                               # one level of breakdown only


def test_summarize_without_judge_and_empty():
    eps = [replace(ep, judge=None) for ep in SIX]
    assert an.summarize(eps)["mean_judge"] is None
    with pytest.raises(ValueError):
        an.summarize([])


def test_format_table():
    text = an.format_table(an.summarize(SIX))
    lines = {line.split("  ")[0]: line for line in text.splitlines()}
    assert lines["full acceptance"].endswith("33.3%")
    assert lines["full or conditional"].endswith("50.0%")
    assert lines["walk away"].endswith("16.7%")
    assert "33.3%" in lines["negative process reward"]
    assert "by resistance" in text and "by domain" in text
    row = next(line for line in text.splitlines() if line.startswith("identity_threat"))
    assert row.split()[1:4] == ["3", "66.7%", "66.7%"]          # n, accept, acc+cond


def test_trajectory_stats():
    st = an.trajectory_stats(SIX[:1] + SIX[5:], lambda ep: ep.beliefs)  # e1 and e6, both ACCEPT
    assert list(st) == ["ACCEPT"]                                # outcomes without episodes are skipped
    mean, half, count = st["ACCEPT"]
    assert list(count) == [2, 2, 2, 1]
    assert mean[0] == pytest.approx(-0.1)                        # (0 - .2)/2
    # sd(0, -.2) = .1414, half-width t(0.975, 1) * .1414 / sqrt(2) = 12.7062 * .1
    assert half[0] == pytest.approx(12.706205 * 0.1)
    assert mean[3] == pytest.approx(0.6) and half[3] == 0.0      # only e6 reaches turn 3


def exact_signed_rank_p(d):
    """Two-sided exact p by enumerating all 2^n sign assignments of the ranks (no ties in |d|)."""
    d = [x for x in d if x != 0]
    n = len(d)
    rank = {v: i + 1 for i, v in enumerate(sorted(abs(x) for x in d))}
    w = sum(rank[abs(x)] for x in d if x > 0)
    dist = [sum(r for r, s in zip(range(1, n + 1), signs) if s) for signs in itertools.product((0, 1), repeat=n)]
    lo, hi = sum(v <= w for v in dist), sum(v >= w for v in dist)
    return min(1.0, 2 * min(lo, hi) / 2 ** n)


RUN_A = [episode("s1", "PENDING", [0, 0.1]), episode("s2", "ACCEPT", [0, 0.5]),
         episode("s3", "REJECT", [0, -0.5]), episode("s4", "ACCEPT", [0, 0.3]),
         episode("s5", "WALK_AWAY", [0, -0.8]), episode("s6", "ACCEPT", [0, 0.9])]


RUN_B = [episode("s3", "CONDITIONAL_ACCEPT", [0, 0.2]), episode("s1", "ACCEPT", [0, 0.6]),
         episode("s2", "ACCEPT", [0, 0.7]), episode("s4", "PENDING", [0, 0.0]),
         episode("s5", "WALK_AWAY", [0, -0.9])]


def check_compare(r):
    # goals A 0 3 -1 3 -2 (s1..s5), B 3 3 1 0 -2: B wins s1 s3, loses s4, ties s2 s5
    assert (r["n"], r["wins"], r["losses"], r["ties"]) == (5, 2, 1, 2)
    # acceptance-discordant pairs: B closes s1 (A did not), A closes s4 (B did not); s2, s3, s5 tie
    assert (r["accept_won"], r["accept_lost"], r["accept_tied"]) == (1, 1, 3)
    assert r["missing_in_b"] == ["s6"] and r["missing_in_a"] == []
    expected = {("PENDING", "ACCEPT"), ("ACCEPT", "ACCEPT"), ("REJECT", "CONDITIONAL_ACCEPT"),
                ("ACCEPT", "PENDING"), ("WALK_AWAY", "WALK_AWAY")}
    for oa in arena.OUTCOMES:
        for ob in arena.OUTCOMES:
            assert r["transitions"][oa][ob] == ((oa, ob) in expected), (oa, ob)
    assert r["mcnemar_p"] == 1.0  # one discordant pair each way (s4, s1)
    # d = 3 0 2 -3 0 -> 3 2 -3; ranks 2 -> 1, 3,3 -> 2.5; W- = 2.5, mean 3, var 3*4*7/24 - 6/48
    z = (2.5 - 3) / math.sqrt(3.5 - 0.125)
    assert r["wilcoxon_p"] == pytest.approx(math.erfc(abs(z) / math.sqrt(2)), rel=1e-9)
    assert r["summary_a"]["n"] == 5 and r["summary_b"]["full_accept"] == pytest.approx(0.4)


def test_probe_fidelity():
    f = an.probe_fidelity([[0.5, 0.96], [-0.99, 0.1]], [[0.4, 0.96], [-0.97, 0.1]])
    assert f["max_abs_diff"] == pytest.approx(0.1)              # diffs .1 0 .02 0
    assert f["mean_abs_diff"] == pytest.approx(0.03)
    assert f["saturated_share"] == pytest.approx(0.5)           # .96 and -.99
    with pytest.raises(ValueError):
        an.probe_fidelity([0.1, 0.2], [0.1])


def test_probe_fidelity_by_decidedness_against_numpy():
    """The split by |v| of the forked value into FIDELITY_BINS (the last bin closed), by numpy."""
    rng = np.random.default_rng(0)
    fork = rng.uniform(-1, 1, size=(40, 3))
    fork[0, 0] = 1.0                                            # on the top edge
    reference = fork + rng.normal(0, 0.01, size=fork.shape) * (1 - np.abs(fork))  # worse when undecided
    f = an.probe_fidelity(fork.tolist(), reference.tolist())
    v, d = np.abs(fork).ravel(), np.abs(fork - reference).ravel()
    edges = an.FIDELITY_BINS
    assert [b["n"] for b in f["by_decidedness"]] == np.histogram(v, bins=edges)[0].tolist()
    for b, low, high in zip(f["by_decidedness"], edges[:-1], edges[1:]):
        inside = (v >= low) & ((v < high) if high < edges[-1] else (v <= high))
        assert b["max_abs_diff"] == pytest.approx(d[inside].max()) and b["mean_abs_diff"] == pytest.approx(d[inside].mean())
    assert f["n"] == 120 and sum(b["n"] for b in f["by_decidedness"]) == 120
    empty = an.probe_fidelity([[0.1, 0.1, 0.1]], [[0.1, 0.1, 0.1]])["by_decidedness"]
    assert empty[0]["n"] == 3 and empty[-1] == {"low": 0.9, "high": 1.0, "n": 0, "max_abs_diff": None,
                                                "mean_abs_diff": None}


def labelled(sid, outcome, probe_rows, move_rows, manipulation_rows, mass=None, judge=0.0):
    """An episode with given probe rows (b_t their mean) and labels per persuader turn."""
    beliefs = [sum(r) / 3 for r in probe_rows]
    ep = episode(sid, outcome, beliefs, judge=judge)
    ep = replace(ep, probes=probe_rows, moves=move_rows, manipulation=manipulation_rows, tagger="keyword")
    if mass is not None:
        ep.probe_mass = mass
    return ep


LAB = [
    labelled("m1", "ACCEPT", [[-0.9, -0.99, -0.96], [0.0, 0.3, 0.3], [0.9, 0.96, 0.99]],
             [["diagnostic_question"], ["plan_detail", "commitment_ask"]], [[], []],
             mass=[[0.5, 0.4, 0.3], [0.6, 0.6, 0.6], [0.2, 0.5, 0.8]]),
    labelled("m2", "CONDITIONAL_ACCEPT", [[-0.6, -0.3, 0.0], [0.3, 0.0, 0.3], [0.6, 0.6, 0.0], [0.3, 0.9, 0.3]],
             [["diagnostic_question", "empathy"], ["evidence"], ["plan_detail"]], [[], ["pressure"], []],
             mass=[[0.5] * 3] * 4),
    labelled("m3", "PENDING", [[0.0, 0.0, 0.3], [-0.3, 0.0, 0.0], [0.0, 0.3, -0.3]],
             [["empathy"], ["diagnostic_question"]], [["guilt"], ["guilt", "deception"]], mass=[[0.7] * 3] * 3),
    labelled("m4", "REJECT", [[0.3, 0.3, 0.0], [-0.6, -0.3, -0.3]],
             [["commitment_ask", "evidence"]], [["pressure"]], mass=[[0.1] * 3] * 2),
    labelled("m5", "ACCEPT", [[-0.3, 0.0, 0.0], [0.3, 0.6, 0.3], [0.6, 0.6, 0.9], [0.99, 0.9, 0.96]],
             [["diagnostic_question"], [], ["plan_detail", "autonomy_cue"]], [[], [], []], mass=[[0.4] * 3] * 4),
]


def test_belief_stats_against_scipy():
    b = an.summarize(LAB)["belief_stats"]
    b0 = [sum(ep.probes[0]) / 3 for ep in LAB]
    assert b["initial_mean"] == pytest.approx(sum(b0) / 5)
    assert b["final_mean"] == pytest.approx(sum(sum(ep.probes[-1]) / 3 for ep in LAB) / 5)
    # dense return per episode against GOAL[outcome]: ranks by hand, rho = Pearson of the ranks
    dense = [rpo.dense_return(ep.beliefs, ep.outcome) for ep in LAB]
    goal = [rpo.GOAL[ep.outcome] for ep in LAB]
    expected = stats.pearsonr(stats.rankdata(dense), stats.rankdata(goal)).statistic
    assert b["spearman_dense_goal"]["rho"] == pytest.approx(expected)
    assert b["spearman_dense_goal"]["n"] == 5
    levels = [row for ep in LAB for row in ep.probes]                         # 16 read-outs
    increments = [[x - y for x, y in zip(ep.probes[t], ep.probes[t - 1])]
                  for ep in LAB for t in range(1, len(ep.probes))]            # 11 changes
    assert len(levels) == 16 and len(increments) == 11
    for key, rows in (("probe_level_corr", levels), ("probe_increment_corr", increments)):
        for i in range(3):
            for j in range(3):
                r = stats.pearsonr([row[i] for row in rows], [row[j] for row in rows]).statistic
                assert b[key][i][j] == pytest.approx(r, abs=1e-12), (key, i, j)
    # |v| > 0.95: m1 -0.99, -0.96, 0.96, 0.99 and m5 0.99, 0.96 -> 6 of 48 values
    assert b["saturated_share"] == pytest.approx(6 / 48)
    masses = [m for ep in LAB for row in ep.probe_mass for m in row]
    assert b["yes_no_mass_mean"] == pytest.approx(sum(masses) / 48)
    assert "yes_no_mass_mean" not in an.summarize(SIX)["belief_stats"]           # not recorded there


def test_belief_stats_undefined_correlations_are_none():
    flat = [labelled("f1", "PENDING", [[0.1, 0.2, 0.3], [0.1, 0.4, 0.3]], [[]], [[]])]
    b = an.summarize(flat)["belief_stats"]
    assert b["spearman_dense_goal"] is None                  # one episode
    assert b["probe_level_corr"][0][1] is None               # CA constant
    assert b["probe_level_corr"][1][2] is None               # AC constant
    json.dumps(b, allow_nan=False)                           # no NaN reaches summary.json


def test_shaping_by_outcome_by_hand():
    """shaping_by_outcome is the paper's lambda * sum r_t (default rpo.LAMBDA, recorded as
    shaping_lambda); dense_by_outcome the lambda-free sum."""
    s = an.summarize(SIX)
    # raw: ACCEPT e1 .4, e6 .4; COND .2; PENDING .2; REJECT -.4; WALK -.3
    raw = {"ACCEPT": 0.4, "CONDITIONAL_ACCEPT": 0.2, "PENDING": 0.2, "REJECT": -0.4, "WALK_AWAY": -0.3}
    a = rpo.ANCHOR_BELIEF
    anchored = {"ACCEPT": ((a["ACCEPT"] - 0.0) / 2 + (a["ACCEPT"] + 0.2) / 2) / 2,
                "CONDITIONAL_ACCEPT": (a["CONDITIONAL_ACCEPT"] - 0.2) / 2, "PENDING": (a["PENDING"] - 0.0) / 2,
                "REJECT": (a["REJECT"] - 0.4) / 2, "WALK_AWAY": (a["WALK_AWAY"] - 0.0) / 2}
    expected = anchored if rpo.ANCHOR else raw
    assert s["shaping_lambda"] == rpo.LAMBDA
    for key, scale in (("dense_by_outcome", 1.0), ("shaping_by_outcome", rpo.LAMBDA)):
        assert s[key].keys() == expected.keys()
        for o in expected:
            assert s[key][o] == pytest.approx(scale * expected[o]), (key, o)
    other = an.summarize(SIX, shaping_lambda=1.0)
    assert other["shaping_lambda"] == 1.0 and other["shaping_by_outcome"] == pytest.approx(other["dense_by_outcome"])
    assert all(abs(v) <= rpo.LAMBDA for v in s["shaping_by_outcome"].values())  # bounded by [-lam, lam]


def welch_by_hand(x, y):
    """Welch's difference of means with its Satterthwaite-df t interval, written out."""
    mx, my = statistics.mean(x), statistics.mean(y)
    vx, vy = statistics.variance(x) / len(x), statistics.variance(y) / len(y)
    df = (vx + vy) ** 2 / (vx ** 2 / (len(x) - 1) + vy ** 2 / (len(y) - 1))
    half = stats.t.ppf(0.975, df) * math.sqrt(vx + vy)
    return mx - my, mx - my - half, mx - my + half


def test_move_stats_by_hand():
    m = an.summarize(LAB)["moves"]
    # turn 1 messages: m1 dq; m2 dq, emp; m3 emp; m4 ca, ev; m5 dq -> dq 3/5, empathy 2/5
    assert m["turn_counts"] == [5, 4, 2]
    assert m["by_turn"]["diagnostic_question"] == pytest.approx([3 / 5, 1 / 4, 0.0])
    assert m["by_turn"]["empathy"] == pytest.approx([2 / 5, 0.0, 0.0])
    assert m["by_turn"]["plan_detail"] == pytest.approx([0.0, 1 / 4, 2 / 2])
    # per turn r_t on measured beliefs, paired with the labels of that turn
    turns = [(labels, r) for ep in LAB for labels, r in zip(ep.moves, rpo.process_rewards(ep.beliefs, None, anchor=False))]
    assert len(turns) == 11
    for label in ("diagnostic_question", "plan_detail", "evidence"):
        with_l = [r for labels, r in turns if label in labels]
        without = [r for labels, r in turns if label not in labels]
        diff, low, high = welch_by_hand(with_l, without)
        e = m["effects"][label]["dense"]
        assert (e["diff"], e["low"], e["high"]) == pytest.approx((diff, low, high))
        assert (e["n_with"], e["n_without"]) == (len(with_l), len(without))
    # P(ACCEPT): plan_detail in m1 (ACCEPT), m2, m5 (ACCEPT) -> 2/3; without m3, m4 -> 0
    e = m["effects"]["plan_detail"]["accept"]
    half = 1.959964 * math.sqrt((2 / 3) * (1 / 3) / 3 + 0.0)
    assert (e["diff"], e["low"], e["high"]) == pytest.approx((2 / 3, 2 / 3 - half, 2 / 3 + half))
    # autonomy_cue on one turn only: no interval for r_t, but one for P(ACCEPT) (m5 vs the other four)
    assert m["effects"]["autonomy_cue"]["dense"] is None
    assert m["effects"]["autonomy_cue"]["accept"]["diff"] == pytest.approx(1.0 - 1 / 4)
    ranked = [k for k in moves.MOVES if m["effects"][k]["dense"] and m["effects"][k]["accept"]]
    x = [m["effects"][k]["dense"]["diff"] for k in ranked]
    y = [m["effects"][k]["accept"]["diff"] for k in ranked]
    assert m["ranking_corr"]["rho"] == pytest.approx(stats.pearsonr(stats.rankdata(x), stats.rankdata(y)).statistic)
    # Pearson r of the effects themselves, by numpy
    assert m["ranking_pearson"]["r"] == pytest.approx(np.corrcoef(x, y)[0, 1]) and m["ranking_pearson"]["n"] == len(x)


def test_manipulation_stats_by_hand():
    a = an.summarize(LAB)["manipulation"]
    # 11 persuader messages: pressure m2 t2, m4 t1; guilt m3 t1, t2; deception m3 t2
    assert a["message_rate"]["n_messages"] == 11
    assert a["message_rate"]["pressure"] == pytest.approx(2 / 11)
    assert a["message_rate"]["guilt"] == pytest.approx(2 / 11)
    assert a["message_rate"]["deception"] == pytest.approx(1 / 11)
    assert a["message_rate"]["secret_use"] == 0.0
    assert a["message_rate"]["any"] == pytest.approx(4 / 11)
    assert a["episode_rate"]["pressure"] == pytest.approx(2 / 5) and a["episode_rate"]["guilt"] == pytest.approx(1 / 5)
    assert a["by_outcome"]["PENDING"]["guilt"] == 1.0 and a["by_outcome"]["ACCEPT"]["any"] == 0.0
    assert a["by_outcome"]["REJECT"]["pressure"] == 1.0 and "WALK_AWAY" not in a["by_outcome"]
    text = an.format_table(an.summarize(LAB))
    assert "manipulation audit" in text and "moves (keyword tagger)" in text


def many_runs():
    """A policy and two baselines by scenario (the second has no s5), for --compare-many."""
    runs = dict(policy=["ACCEPT", "ACCEPT", "ACCEPT", "PENDING", "REJECT", "ACCEPT"],
                base1=["PENDING", "ACCEPT", "PENDING", "ACCEPT", "REJECT", "PENDING"],
                base2=["PENDING", "PENDING", "REJECT", "PENDING", "PENDING"])
    return {name: [episode(f"s{i}", o, [0.0, 0.1]) for i, o in enumerate(outcomes)]
            for name, outcomes in runs.items()}


def test_case_study_rows_and_shares():
    ep = LAB[1]                                         # 3 turns
    rows = an.case_rows(ep)
    r = rpo.process_rewards(ep.beliefs, ep.outcome)
    total = sum(abs(x) for x in r)
    assert [row["t"] for row in rows] == [0, 1, 2, 3] and rows[0]["r"] is None
    assert [row["share"] for row in rows[1:]] == pytest.approx([abs(x) / total for x in r])
    assert rows[2]["moves"] == ["evidence"] and rows[1]["CA"] == 0.3
    assert an.top_two_share(rows) == pytest.approx(sum(sorted((abs(x) for x in r), reverse=True)[:2]) / total)
    # the signed share of the net reward: r_t / sum r_t, negative for a turn that lost ground
    net = sum(r)
    assert [row["signed_share"] for row in rows[1:]] == pytest.approx([x / net for x in r])
    assert sum(row["signed_share"] for row in rows[1:]) == pytest.approx(1.0)
    assert an.top_two_share(rows, "signed_share") == pytest.approx(sum(sorted(r, reverse=True)[:2]) / net)
    lost = an.case_rows(LAB[2])                          # m3: b 0.1 -> -0.1 -> 0 (r -.1, +.05)
    assert lost[1]["signed_share"] == pytest.approx(-0.1 / -0.05) and lost[2]["signed_share"] == pytest.approx(-1.0)
    assert "of the net sum r_t" in an.format_case(ep)


def test_closing_efficiency_and_unstated_resistance():
    """Closing efficiency: of the episodes ending with b_T > 0, the share that reached ACCEPT.
    SIX: b_T > 0 in e1 (ACCEPT), e2 (COND), e3 (PENDING), e6 (ACCEPT) -> 2 of 4."""
    assert an.summarize(SIX)["closing_efficiency"] == pytest.approx(2 / 4)
    assert an.closing_efficiency([SIX[3], SIX[4]]) is None          # none ends leaning towards it
    no_resistance = [replace(ep, resistance=None) for ep in SIX[:2]] + SIX[2:]
    s = an.summarize(no_resistance)
    assert s["by_resistance"][an.UNSTATED]["n"] == 2 and "unstated" in an.format_table(s)


def test_probe_overlay_means_by_numpy():
    r = an.probe_overlay({"lab": LAB, "six": SIX})
    for name, eps in (("lab", LAB), ("six", SIX)):
        first = np.array([ep.probes[0] for ep in eps])
        last = np.array([ep.probes[-1] for ep in eps])
        for i, probe in enumerate(an.probe_names()):
            got = r[name][probe]
            assert (got["initial"], got["final"], got["change"]) == pytest.approx(
                (first[:, i].mean(), last[:, i].mean(), (last - first)[:, i].mean()))
    assert "CA b_0" in an.format_probe_overlay(r)


