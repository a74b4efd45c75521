"""Tests of comparisons.py: two evaluations paired by scenario, baselines against a policy, the
belief ranking, the main table and a sweep's grid, on the synthetic records of test_analyses.py.
Expected values by hand or by scipy. Run: python -m pytest -q tests/test_comparisons.py"""
import numpy as np
import pytest
from scipy import stats

from lab import analyses as an, comparisons
from test_analyses import RUN_A, RUN_B, SIX, check_compare, episode, exact_signed_rank_p, many_runs


def test_compare(capsys):
    r = comparisons.compare(RUN_A, RUN_B)
    check_compare(r)
    assert "missing in B: s6" in capsys.readouterr().err
    text = comparisons.format_compare(r)
    assert "2 wins, 1 losses, 2 ties" in text
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines()
            if line.split() and line.split()[0] in an.SHORT.values()}
    assert rows["PENDING"] == ["1", "0", "0", "0", "0", "1"]   # PENDING -> ACCEPT
    assert rows["ACCEPT"] == ["1", "0", "1", "0", "0", "2"]
    assert rows["REJECT"] == ["0", "1", "0", "0", "0", "1"]


def test_compare_rejects_disjoint_and_duplicates():
    with pytest.raises(ValueError, match="share no scenario_id"):
        comparisons.compare(RUN_A[:1], RUN_B[:1])
    with pytest.raises(ValueError, match="more than one episode for s1"):
        comparisons.compare(RUN_A + RUN_A[:1], RUN_B)


def test_grid_table():
    s = an.summarize(SIX)
    t = an.summarize(SIX[:2])                                   # 50% accept, 100% acc+cond
    text = comparisons.grid_table({("p1", "q1"): s, ("p1", "q2"): t, ("p2", "q1"): t})
    lines = text.splitlines()
    assert lines[0].split()[-2:] == ["q1", "q2"]
    assert lines[1].split() == ["p1", "33.3", "(50.0)", "50.0", "(100.0)"]
    assert lines[2].split() == ["p2", "50.0", "(100.0)", "-"]


def test_compare_many_by_hand():
    policy, base1, base2 = many_runs().values()
    r = comparisons.compare_many({"b1": base1, "b2": base2}, policy)
    # b1: won s0 s2 s5, lost s3; b2 (s0-s4): won s0 s1 s2, lost none
    assert r["per_baseline"]["b1"] == {"n": 6, "won": 3, "lost": 1,
                                       "mcnemar_p": pytest.approx(stats.binomtest(3, 4).pvalue)}
    assert (r["per_baseline"]["b2"]["won"], r["per_baseline"]["b2"]["lost"]) == (3, 0)
    # common s0-s4; closed by neither: s0 s2 s4 -> the policy closes s0, s2
    assert (r["n_common"], r["closed_by_none"], r["policy_closes"]) == (5, 3, 2)
    assert r["policy_closes_share"] == pytest.approx(2 / 3)


def test_belief_ranking_against_acceptance():
    """Systems ranked by mean final belief (section E.4) with their acceptance ranks; Spearman of
    the two orders by numpy on the ranks. Four systems on the same two scenarios."""
    def system(outcomes, finals):
        return [episode(f"s{i}", o, [0.0, b]) for i, (o, b) in enumerate(zip(outcomes, finals))]
    systems = {"warm": system(["PENDING", "ACCEPT"], [0.9, 0.7]),          # b_T .8, FA .5
               "closer": system(["ACCEPT", "ACCEPT"], [0.2, 0.4]),         # b_T .3, FA 1
               "cold": system(["REJECT", "PENDING"], [-0.5, -0.3]),        # b_T -.4, FA 0
               "middle": system(["ACCEPT", "REJECT"], [0.5, 0.3])}         # b_T .4, FA .5
    r = comparisons.belief_ranking(systems)
    assert [s["name"] for s in r["systems"]] == ["warm", "middle", "closer", "cold"]
    got = {s["name"]: (s["belief_rank"], s["accept_rank"]) for s in r["systems"]}
    assert got == {"warm": (1, 2.5), "middle": (2, 2.5), "closer": (3, 1), "cold": (4, 4)}
    b = np.array([1, 2, 3, 4.0])
    a = np.array([2.5, 2.5, 1, 4.0])
    assert r["spearman"]["rho"] == pytest.approx(np.corrcoef(b, a)[0, 1]) and r["spearman"]["n"] == 4


def test_compare_many_ranks_the_policy_among_the_baselines():
    policy = [episode("s0", "ACCEPT", [0.0, 0.2]), episode("s1", "ACCEPT", [0.0, 0.4])]
    base = [episode("s0", "PENDING", [0.0, 0.9]), episode("s1", "REJECT", [0.0, 0.7]),
            episode("s2", "ACCEPT", [0.0, 1.0])]                       # s2 is not common
    r = comparisons.compare_many({"b": base}, policy)["belief_ranking"]
    assert [(s["name"], s["mean_final_belief"]) for s in r["systems"]] == [("b", pytest.approx(0.8)),
                                                                            (comparisons.POLICY, pytest.approx(0.3))]
    assert r["spearman"] is None                                        # two systems


def test_main_table_against_scipy():
    """Wilson intervals (scipy's binomtest), t intervals (scipy's ttest_1samp), McNemar and
    Wilcoxon p paired by scenario on the common ones (RUN_A has s6, RUN_B does not)."""
    t = comparisons.main_table({"A": RUN_A, "B": RUN_B}, "A")
    ref, b = t["rows"]
    assert ref["reference"] and ref["full_accept"]["p"] is None and b["n_paired"] == 5
    for row, eps in ((ref, RUN_A), (b, RUN_B)):
        for key, outcomes in (("full_accept", ("ACCEPT",)), ("full_or_conditional", ("ACCEPT", "CONDITIONAL_ACCEPT")),
                              ("pending", ("PENDING",)), ("reject", ("REJECT",)), ("walk_away", ("WALK_AWAY",))):
            k = sum(ep.outcome in outcomes for ep in eps)
            ci = stats.binomtest(k, len(eps)).proportion_ci(0.95, method="wilson")
            c = row[key]
            assert (c["value"], c["low"], c["high"]) == pytest.approx((k / len(eps), ci.low, ci.high), abs=1e-6), key
        finals = [ep.beliefs[-1] for ep in eps]
        ci = stats.ttest_1samp(finals, 0).confidence_interval(0.95)
        c = row["mean_final_belief"]
        assert (c["value"], c["low"], c["high"]) == pytest.approx((np.mean(finals), ci.low, ci.high))
    # FA+CA paired on s1..s5: A 0 1 0 1 0, B 1 1 1 0 0 -> discordant 2 (B) vs 1 (A): binomial p
    assert b["full_or_conditional"]["p"] == pytest.approx(stats.binomtest(1, 3).pvalue)
    # final belief paired: B - A = .5 .2 .7 -.3 -.1 (no ties): exact signed-rank p
    a_final = {ep.scenario_id: ep.beliefs[-1] for ep in RUN_A}
    d = [ep.beliefs[-1] - a_final[ep.scenario_id] for ep in RUN_B]
    assert b["mean_final_belief"]["p"] == pytest.approx(exact_signed_rank_p(d))
    assert b["mean_turns"]["p"] == 1.0                              # every episode took one turn
    md = comparisons.format_main_table(t).splitlines()
    assert md[0].startswith("| system | n | FA |") and md[2].startswith("| A (ref.) | 6 | 50.0 [18.8, 81.2] |")
    latex = comparisons.format_main_table(comparisons.main_table({"run_a": RUN_A, "B": RUN_B}, "run_a"), "latex")
    assert "\\toprule" in latex and "run\\_a (ref.) & 6 & 50.0 {\\scriptsize [18.8, 81.2]}" in latex
    with pytest.raises(ValueError, match="reference row"):
        comparisons.main_table({"A": RUN_A}, "B")
