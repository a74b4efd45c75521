"""Tests of eval.py's model-free half: metrics, paired tests, comparison, plots, IO and CLI errors.
Expected values are computed by hand in the comments. Run: python -m pytest -q test_eval.py"""

import itertools
import statistics
import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

import eval as ev
import rpo

HERE = Path(__file__).resolve().parent


def episode(sid, outcome, beliefs, domain="finance", resistance="identity_threat", judge=0.0):
    """A record in the eval format; probes are spread around the belief so CA, PE, AC differ."""
    turns = len(beliefs) - 1
    transcript = []
    for t in range(1, turns + 1):
        transcript.append({"role": "persuader", "text": f"ask {t}", "decision": None})
        transcript.append({"role": "persuadee", "text": f"reply {t}",
                           "decision": outcome if t == turns else None})
    return {"id": sid, "scenario_id": sid, "domain": domain, "resistance": resistance, "outcome": outcome,
            "turns": turns, "end_reason": "decision", "transcript": transcript, "beliefs": beliefs,
            "probes": [[b + 0.1, b, b - 0.1] for b in beliefs], "judge": judge,
            "persuader": "p", "persuadee": "q", "seed": 0}


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


def png_size(path):
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


# -----------------------------------------------------------------------------
# metrics


def test_summarize_by_hand():
    s = ev.summarize(SIX)
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
    anchored = sum(rpo.ANCHOR_BELIEF[ep["outcome"]] - ep["beliefs"][0] for ep in SIX) / 2
    assert anchored == pytest.approx(0.05) or rpo.ANCHOR_BELIEF != PAPER_ANCHORS
    assert s["mean_dense_return"] == pytest.approx((anchored if rpo.ANCHOR else 0.5) / 6)
    assert s["anchor"] == rpo.ANCHOR
    for setting, total in ((True, anchored), (False, 0.5)):
        assert ev.summarize([{**ep, "anchor": setting} for ep in SIX])["mean_dense_return"] == pytest.approx(total / 6)
    # raw negatives 0 + 1 + 1 + 2 + 1 + 0 = 5 of 15 turns (anchored would count 6)
    assert s["negative_process_share"] == pytest.approx(5 / 15)
    assert s["mean_judge"] == pytest.approx(0.5 / 6)            # 1 + .5 + 0 - 1 - 2 + 2


def test_summarize_counts_judge_fallbacks():
    """The share of judged transcripts that fell back to s = 0; unjudged ones are not counted."""
    eps = [dict(ep, judge_failed=i in (1, 4)) for i, ep in enumerate(SIX)]
    assert ev.summarize(eps)["judge_failed_share"] == pytest.approx(2 / 6)
    eps[0]["judge"] = None
    assert ev.summarize(eps)["judge_failed_share"] == pytest.approx(2 / 5)
    assert "judge fell back to 0" in ev.format_table(ev.summarize(eps))
    assert ev.summarize([dict(ep, judge=None) for ep in SIX])["judge_failed_share"] is None


def test_summarize_breakdowns():
    s = ev.summarize(SIX)
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
    eps = [dict(ep, judge=None) for ep in SIX]
    assert ev.summarize(eps)["mean_judge"] is None
    with pytest.raises(ValueError):
        ev.summarize([])


def test_format_table():
    text = ev.format_table(ev.summarize(SIX))
    lines = {line.split("  ")[0]: line for line in text.splitlines()}
    assert lines["full acceptance"].endswith("33.3%")
    assert lines["full or conditional"].endswith("50.0%")
    assert lines["walk away"].endswith("16.7%")
    assert "33.3%" in lines["negative process reward"]
    assert "by resistance" in text and "by domain" in text
    row = next(line for line in text.splitlines() if line.startswith("identity_threat"))
    assert row.split()[1:4] == ["3", "66.7%", "66.7%"]          # n, accept, acc+cond


def test_trajectory_stats():
    st = ev.trajectory_stats(SIX[:1] + SIX[5:], lambda ep: ep["beliefs"])  # e1 and e6, both ACCEPT
    assert list(st) == ["ACCEPT"]                                # outcomes without episodes are skipped
    mean, half, count = st["ACCEPT"]
    assert list(count) == [2, 2, 2, 1]
    assert mean[0] == pytest.approx(-0.1)                        # (0 - .2)/2
    # sd(0, -.2) = .1414, half-width 1.96 * .1414 / sqrt(2) = 1.96 * .1
    assert half[0] == pytest.approx(ev.Z95 * 0.1)
    assert mean[3] == pytest.approx(0.6) and half[3] == 0.0      # only e6 reaches turn 3


# -----------------------------------------------------------------------------
# paired tests


def test_mcnemar_small_exact():
    # 1 pair only A succeeds, 7 only B, 5 both, 3 neither: p = 2 * (C(8,0) + C(8,1)) / 2^8 = 18/256
    a = [True] * 1 + [False] * 7 + [True] * 5 + [False] * 3
    b = [False] * 1 + [True] * 7 + [True] * 5 + [False] * 3
    assert ev.mcnemar(a, b) == pytest.approx(18 / 256)
    assert ev.mcnemar(b, a) == pytest.approx(18 / 256)


def test_mcnemar_textbook():
    # the classic table a=101, b=121, c=59, d=33 (chi2 = 21.35); exact p = 2 P(X <= 59), X ~ Bin(180, .5)
    a = [True] * 101 + [True] * 121 + [False] * 59 + [False] * 33
    b = [True] * 101 + [False] * 121 + [True] * 59 + [False] * 33
    p = 2 * sum(math.comb(180, k) for k in range(60)) / 2 ** 180
    assert ev.mcnemar(a, b) == pytest.approx(p, rel=1e-9)
    assert 1e-6 < p < 1e-4


def test_mcnemar_no_discordant():
    assert ev.mcnemar([True, False, True], [True, False, True]) == 1.0


def exact_signed_rank_p(d):
    """Two-sided exact p by enumerating all 2^n sign assignments of the ranks (no ties in |d|)."""
    d = [x for x in d if x != 0]
    n = len(d)
    rank = {v: i + 1 for i, v in enumerate(sorted(abs(x) for x in d))}
    w = sum(rank[abs(x)] for x in d if x > 0)
    dist = [sum(r for r, s in zip(range(1, n + 1), signs) if s) for signs in itertools.product((0, 1), repeat=n)]
    lo, hi = sum(v <= w for v in dist), sum(v >= w for v in dist)
    return min(1.0, 2 * min(lo, hi) / 2 ** n)


def test_wilcoxon_exact_small():
    # differences 1.5 -.5 2.5 3.5 4.5 -5.5 6.5 7.5 and a zero (dropped): n = 8, W- = 1 + 6 = 7;
    # subsets of {1..8} with sum <= 7: 1+1+1+2+2+3+4+5 = 19, so p = 2 * 19/256
    x = [11.5, 9.5, 12.5, 13.5, 14.5, 4.5, 16.5, 17.5, 10.0]
    y = [10.0] * 9
    assert ev.wilcoxon(x, y) == pytest.approx(38 / 256)
    assert ev.wilcoxon(x, y) == pytest.approx(exact_signed_rank_p([a - b for a, b in zip(x, y)]))


def test_wilcoxon_ties_normal_approx():
    # d = 1 1 2 -2 3 3 3 4 -1 5 (+ a zero, dropped): n = 10; |d| ranks 1,1,1 -> 2; 2,2 -> 4.5; 3,3,3 -> 7
    # W- = 4.5 + 2 = 6.5; mean 10*11/4 = 27.5; var 10*11*21/24 - (24 + 6 + 24)/48 = 96.25 - 1.125
    d = [1, 1, 2, -2, 3, 3, 3, 4, -1, 5, 0]
    z = (6.5 - 27.5) / math.sqrt(96.25 - 1.125)
    assert ev.wilcoxon(d, [0] * len(d)) == pytest.approx(math.erfc(abs(z) / math.sqrt(2)), rel=1e-9)


def test_wilcoxon_large_sample_normal_approx():
    # n = 60 > EXACT_WILCOXON_MAX_N, no ties: every third difference negative, ranks 1, 4, ..., 58
    d = [-(i + 1) if i % 3 == 0 else i + 1 for i in range(60)]
    w_minus = sum(range(1, 61, 3))
    z = (w_minus - 60 * 61 / 4) / math.sqrt(60 * 61 * 121 / 24)
    assert ev.wilcoxon(d, [0] * 60) == pytest.approx(math.erfc(abs(z) / math.sqrt(2)), rel=1e-9)


def test_wilcoxon_all_zero():
    assert ev.wilcoxon([1, 2, 3], [1, 2, 3]) == 1.0


# -----------------------------------------------------------------------------
# comparison, IO and CLI

RUN_A = [episode("s1", "PENDING", [0, 0.1]), episode("s2", "ACCEPT", [0, 0.5]),
         episode("s3", "REJECT", [0, -0.5]), episode("s4", "ACCEPT", [0, 0.3]),
         episode("s5", "WALK_AWAY", [0, -0.8]), episode("s6", "ACCEPT", [0, 0.9])]
RUN_B = [episode("s3", "CONDITIONAL_ACCEPT", [0, 0.2]), episode("s1", "ACCEPT", [0, 0.6]),
         episode("s2", "ACCEPT", [0, 0.7]), episode("s4", "PENDING", [0, 0.0]),
         episode("s5", "WALK_AWAY", [0, -0.9])]


def check_compare(r):
    # goals A 0 3 -1 3 -2 (s1..s5), B 3 3 1 0 -2: B wins s1 s3, loses s4, ties s2 s5
    assert (r["n"], r["wins"], r["losses"], r["ties"]) == (5, 2, 1, 2)
    assert r["missing_in_b"] == ["s6"] and r["missing_in_a"] == []
    expected = {("PENDING", "ACCEPT"), ("ACCEPT", "ACCEPT"), ("REJECT", "CONDITIONAL_ACCEPT"),
                ("ACCEPT", "PENDING"), ("WALK_AWAY", "WALK_AWAY")}
    for oa in ev.OUTCOMES:
        for ob in ev.OUTCOMES:
            assert r["transitions"][oa][ob] == ((oa, ob) in expected), (oa, ob)
    assert r["mcnemar_p"] == 1.0  # one discordant pair each way (s4, s1)
    # d = 3 0 2 -3 0 -> 3 2 -3; ranks 2 -> 1, 3,3 -> 2.5; W- = 2.5, mean 3, var 3*4*7/24 - 6/48
    z = (2.5 - 3) / math.sqrt(3.5 - 0.125)
    assert r["wilcoxon_p"] == pytest.approx(math.erfc(abs(z) / math.sqrt(2)), rel=1e-9)
    assert r["summary_a"]["n"] == 5 and r["summary_b"]["full_accept"] == pytest.approx(0.4)


def test_compare(capsys):
    r = ev.compare(RUN_A, RUN_B)
    check_compare(r)
    assert "missing in B: s6" in capsys.readouterr().err
    text = ev.format_compare(r)
    assert "2 wins, 1 losses, 2 ties" in text
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines()
            if line.split() and line.split()[0] in ev.SHORT.values()}
    assert rows["PENDING"] == ["1", "0", "0", "0", "0", "1"]   # PENDING -> ACCEPT
    assert rows["ACCEPT"] == ["1", "0", "1", "0", "0", "2"]
    assert rows["REJECT"] == ["0", "1", "0", "0", "0", "1"]


def test_compare_rejects_disjoint_and_duplicates():
    with pytest.raises(ValueError, match="share no scenario_id"):
        ev.compare(RUN_A[:1], RUN_B[:1])
    with pytest.raises(ValueError, match="more than one episode for s1"):
        ev.compare(RUN_A + RUN_A[:1], RUN_B)


def test_save_load_and_compare_cli(tmp_path, capsys):
    ev.save_run(tmp_path / "A", RUN_A, ev.summarize(RUN_A))
    ev.save_run(tmp_path / "B", RUN_B, ev.summarize(RUN_B))
    assert sorted(p.name for p in (tmp_path / "A").iterdir()) == \
        ["beliefs.png", "episodes.jsonl", "probes.png", "summary.json"]   # no temp files left behind
    assert ev.load_episodes(tmp_path / "A") == RUN_A
    assert ev.load_episodes(tmp_path / "B" / "episodes.jsonl") == RUN_B
    assert json.loads((tmp_path / "A" / "summary.json").read_text())["full_accept"] == pytest.approx(0.5)
    check_compare(ev.compare(ev.load_episodes(tmp_path / "A"), ev.load_episodes(tmp_path / "B")))
    ev.main(["--compare", str(tmp_path / "A"), str(tmp_path / "B")])
    out = capsys.readouterr().out
    assert "2 wins, 1 losses, 2 ties" in out and "outcome transitions" in out


def test_plots_png_size(tmp_path):
    ev.plot_beliefs(SIX, tmp_path / "b.png")
    ev.plot_probes(SIX, tmp_path / "p.png")
    assert png_size(tmp_path / "b.png") == tuple(round(v * ev.DPI) for v in ev.BELIEF_FIGSIZE)
    assert png_size(tmp_path / "p.png") == tuple(round(v * ev.DPI) for v in ev.PROBE_FIGSIZE)
    assert (tmp_path / "b.png").stat().st_size > 10_000


def test_plot_run(tmp_path):
    rows = [{"step": s, "reward_mean": 0.1 * s, "outcome_ACCEPT": 0.2, "outcome_PENDING": 0.5,
             "kl": 0.01 * s, "note": "text", "flag": True} for s in range(5)]
    rows[4]["heldout_full_accept"] = 0.3  # logged only at eval steps
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = ev.plot_run(tmp_path)
    # panels: outcome shares, reward_mean, kl, heldout_full_accept -> 2 rows of RUN_COLS
    w, h = ev.RUN_PANEL_SIZE
    assert path == tmp_path / "curves.png"
    assert png_size(path) == (round(w * ev.RUN_COLS * ev.DPI), round(h * 2 * ev.DPI))


def test_grid_table():
    s = ev.summarize(SIX)
    t = ev.summarize(SIX[:2])                                   # 50% accept, 100% acc+cond
    text = ev.grid_table({("p1", "q1"): s, ("p1", "q2"): t, ("p2", "q1"): t})
    lines = text.splitlines()
    assert lines[0].split()[-2:] == ["q1", "q2"]
    assert lines[1].split() == ["p1", "33.3", "(50.0)", "50.0", "(100.0)"]
    assert lines[2].split() == ["p2", "50.0", "(100.0)", "-"]


def test_probe_fidelity():
    f = ev.probe_fidelity([[0.5, 0.96], [-0.99, 0.1]], [[0.4, 0.96], [-0.97, 0.1]])
    assert f["max_abs_diff"] == pytest.approx(0.1)              # diffs .1 0 .02 0
    assert f["mean_abs_diff"] == pytest.approx(0.03)
    assert f["saturated_share"] == pytest.approx(0.5)           # .96 and -.99
    with pytest.raises(ValueError):
        ev.probe_fidelity([0.1, 0.2], [0.1])


@pytest.mark.parametrize("argv, needle", [
    (["--compare", "{tmp}/nope", "{tmp}/B"], "nope does not exist"),
    (["--compare", "{tmp}/empty", "{tmp}/B"], "episodes.jsonl does not exist"),
    (["--plot-run", "{tmp}/nope"], "is not a directory"),
    (["--plot-run", "{tmp}/empty"], "metrics.jsonl does not exist"),
    (["--limit", "0"], "--limit must be at least 1"),
    (["--play", "heldout-999"], "unknown scenario id"),
    (["--compare-many", "{tmp}/B"], "--compare-many and --policy go together"),
    (["--overlay", "{tmp}/B"], "--overlay needs at least two"),
    (["--case", "{tmp}/B", "nope"], "has no episode of nope"),
    (["--runs", "{tmp}/nope"], "is not a directory"),
    (["--analyze", "{tmp}/empty"], "episodes.jsonl does not exist"),
    (["--tagger", "logit", "--judge", "none"], "--tagger logit reads the judge model"),
])
def test_bad_arguments_exit_with_one_line(tmp_path, argv, needle, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "B").mkdir()
    (tmp_path / "B" / "episodes.jsonl").write_text("".join(json.dumps(ep) + "\n" for ep in RUN_B))
    with pytest.raises(SystemExit) as e:
        ev.main([a.format(tmp=tmp_path) for a in argv])
    message = e.value.code if isinstance(e.value.code, str) else capsys.readouterr().err
    assert e.value.code != 0
    assert message.strip().startswith("eval.py: ") and needle in message and "\n" not in message.strip()


def test_cli_subprocess_no_traceback():
    p = subprocess.run([sys.executable, str(HERE / "eval.py"), "--compare", "/nonexistent", "x"],
                       capture_output=True, text=True, cwd=HERE, timeout=60)
    assert p.returncode != 0
    assert p.stderr.strip().splitlines() == [
        "eval.py: /nonexistent does not exist; pass an eval directory such as evals/NAME"]


# -----------------------------------------------------------------------------
# model-driven modes on tiny random models


def test_evaluate_writes_a_run_and_analyze_reproduces_it(tmp_path, capsys):
    """A tiny-model run stores labels per persuader turn and the probe mass; --analyze recomputes
    its summary.json exactly from episodes.jsonl and fidelity.json, with no model."""
    import arena
    import engine
    import models
    model, tok = models.load_model("random:tiny-qwen3")
    instances = arena.heldout_instances()[:2]
    engines = [engine.Engine(model, tok, num_blocks=3000) for _ in range(2)]
    summary = ev.evaluate(*engines, instances, tmp_path / "run", t_max=2, fidelity=2, max_new_tokens=8)
    assert summary["n"] == 2 and summary["probe_fidelity"]["max_abs_diff"] < 1e-4
    saved = ev.load_episodes(tmp_path / "run")
    assert [e["id"] for e in saved] == [i["id"] for i in instances]
    assert not any(k in saved[0] for k in ev.TRAINING_KEYS)
    for ep in saved:
        n_messages = sum(m["role"] == "persuader" for m in ep["transcript"])
        assert len(ep["moves"]) == len(ep["manipulation"]) == n_messages and ep["tagger"] == "keyword"
        assert len(ep["probe_mass"]) == len(ep["probes"]) and ep["anchor"] == rpo.ANCHOR
    for name in ("summary.json", "fidelity.json", "beliefs.png", "probes.png", "moves.png"):
        assert (tmp_path / "run" / name).stat().st_size > 0
    written = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert written["belief_stats"]["yes_no_mass_mean"] > 0 and "manipulation" in written
    (tmp_path / "run" / "summary.json").unlink()
    ev.main(["--analyze", str(tmp_path / "run")])
    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == written
    assert "belief statistics" in capsys.readouterr().out
    # episodes stored without labels (an older run) are tagged by keyword in memory, not on disk
    bare = [{k: v for k, v in ep.items() if k not in ("moves", "manipulation", "tagger")} for ep in saved]
    (tmp_path / "run" / "episodes.jsonl").write_text("".join(json.dumps(ep) + "\n" for ep in bare))
    assert ev.analyze(tmp_path / "run") == written
    assert "moves" not in ev.load_episodes(tmp_path / "run")[0]


def test_grid_holds_the_judge_fixed_and_subset_cli(tmp_path, monkeypatch):
    """--judge: one judge model for every persuadee of a grid; --subset balanced60 then --limit;
    --probe-space reaches the read-outs and is recorded."""
    import probes
    import rollout
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(probes, "PROBE_SPACE", probes.PROBE_SPACE)  # restored after the test
    judged_by = []
    monkeypatch.setattr(rollout, "judge_scores",
                        lambda judge, instances, transcripts, seed=0, groups=None: judged_by.append(judge.model)
                        or ([0.0] * len(instances), [False] * len(instances)))
    ev.main(["--persuader", "random:tiny-qwen3", "--persuadee", "random:tiny-qwen3", "--persuadee", "random:tiny-llama",
             "--judge", "random:tiny-llama", "--subset", "balanced60", "--limit", "1", "--t-max", "1",
             "--max-new-tokens", "3", "--name", "g", "--probe-space", "logodds"])
    assert probes.PROBE_SPACE == "logodds"
    assert len(judged_by) == 2 and judged_by[0] is judged_by[1]
    assert judged_by[0].config.model_type == "llama"
    runs = sorted((tmp_path / "evals" / "g").iterdir())
    assert len(runs) == 2 and all((r / "summary.json").exists() for r in runs)
    [ep] = ev.load_episodes(runs[0])
    assert ep["scenario_id"] == ev.balanced_subset(__import__("arena").heldout_instances(), 3)[0]["id"]
    assert ep["probe_space"] == "logodds"


def test_play_drives_the_persuadee_and_saves_the_transcript(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    typed = iter(["Hello, could we talk about the appointment?", "Could we book it for Tuesday?", ""])
    shown = []
    ep = ev.play("heldout-001", "random:tiny-qwen3", seed=0, t_max=3, read=lambda _: next(typed),
                 write=shown.append)
    assert [m["role"] for m in ep["transcript"]] == ["persuader", "persuadee"] * 2
    assert ep["transcript"][0]["text"] == "Hello, could we talk about the appointment?"
    assert ep["end_reason"] == "stopped" and len(ep["probes"]) == 3 == len(ep["beliefs"])
    assert sum("belief" in line for line in shown) == 2
    [saved] = ev.load_episodes(next((tmp_path / "evals").iterdir()))
    assert saved["transcript"] == ep["transcript"]


def test_all_120_heldout_scenarios_complete_on_a_pool_that_holds_a_few(tmp_path):
    """The main table's scale in miniature: every held-out scenario, one episode each, on pools
    of 400 blocks of 16 tokens (a few episodes at a time): no episode ends "cache"."""
    import arena
    import engine
    import models
    model, tok = models.load_model("random:tiny-qwen3")
    instances = arena.heldout_instances()
    assert len(instances) == 120
    engines = [engine.Engine(model, tok, num_blocks=400) for _ in range(2)]
    summary = ev.evaluate(*engines, instances, tmp_path / "run", t_max=2, fidelity=0,
                          max_new_tokens=4)
    episodes = ev.load_episodes(tmp_path / "run")
    assert summary["n"] == 120 and [e["id"] for e in episodes] == [i["id"] for i in instances]
    assert not any(e["end_reason"] in ("cache", "context") for e in episodes)
    assert all(eng.free_blocks == 400 for eng in engines)


def test_two_ranks_write_the_summary_of_one_process(tmp_path):
    """torchrun --nproc_per_node 2 eval.py shards the scenarios over the ranks; rank 0 gathers
    them: episodes.jsonl and summary.json equal one process's."""
    common = ["--persuader", "random:tiny-llama", "--persuadee", "random:tiny-qwen3",
              "--limit", "6", "--t-max", "2", "--max-new-tokens", "4", "--kv-blocks", "600"]
    runs = {}
    for name, launcher in (("one", []), ("two", ["-m", "torch.distributed.run",
                                                 "--nproc_per_node", "2", "--master_port", "29533"])):
        cmd = [sys.executable, *launcher, str(Path(ev.__file__)), *common, "--name", name]
        p = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
        runs[name] = tmp_path / ev.EVALS_DIR / name
    one, two = (ev.load_episodes(runs[k]) for k in ("one", "two"))
    assert len(one) == 6 == len(two)
    for a, b in zip(one, two):  # texts exactly; beliefs to float noise (other batch neighbours)
        floats = ("beliefs", "probes", "probe_mass")
        assert {k: v for k, v in a.items() if k not in floats} == \
               {k: v for k, v in b.items() if k not in floats}
        for key in ("probes", "probe_mass"):
            assert sum(a[key], []) == pytest.approx(sum(b[key], []), abs=1e-5)
    summary = lambda k: json.loads((runs[k] / "summary.json").read_text())
    def flat(value, path=""):  # {path: number or text} of nested dicts and lists
        if isinstance(value, (dict, list)):
            items = value.items() if isinstance(value, dict) else enumerate(value)
            return {p: v for k, val in items if k != "probe_fidelity"
                    for p, v in flat(val, f"{path}/{k}").items()}
        return {path: value}
    one, two = flat(summary("one")), flat(summary("two"))
    assert one.keys() == two.keys()
    for key in one:
        assert one[key] == (pytest.approx(two[key], abs=1e-5)
                            if isinstance(two[key], float) else two[key]), key


# -----------------------------------------------------------------------------
# analyses on synthetic episodes with hand-made values (scipy or a hand formula as the reference)


def labelled(sid, outcome, probe_rows, move_rows, manipulation_rows, mass=None, judge=0.0):
    """An episode with given probe rows (b_t their mean) and labels per persuader turn."""
    beliefs = [sum(r) / 3 for r in probe_rows]
    ep = episode(sid, outcome, beliefs, judge=judge)
    ep.update(probes=probe_rows, moves=move_rows, manipulation=manipulation_rows, tagger="keyword")
    if mass is not None:
        ep["probe_mass"] = mass
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
    b = ev.summarize(LAB)["belief_stats"]
    b0 = [sum(ep["probes"][0]) / 3 for ep in LAB]
    assert b["initial_mean"] == pytest.approx(sum(b0) / 5)
    assert b["final_mean"] == pytest.approx(sum(sum(ep["probes"][-1]) / 3 for ep in LAB) / 5)
    # dense return per episode against GOAL[outcome]: ranks by hand, rho = Pearson of the ranks
    dense = [rpo.dense_return(ep["beliefs"], ep["outcome"]) for ep in LAB]
    goal = [rpo.GOAL[ep["outcome"]] for ep in LAB]
    expected = stats.pearsonr(stats.rankdata(dense), stats.rankdata(goal)).statistic
    assert b["spearman_dense_goal"]["rho"] == pytest.approx(expected)
    assert b["spearman_dense_goal"]["n"] == 5
    levels = [row for ep in LAB for row in ep["probes"]]                         # 16 read-outs
    increments = [[x - y for x, y in zip(ep["probes"][t], ep["probes"][t - 1])]
                  for ep in LAB for t in range(1, len(ep["probes"]))]            # 11 changes
    assert len(levels) == 16 and len(increments) == 11
    for key, rows in (("probe_level_corr", levels), ("probe_increment_corr", increments)):
        for i in range(3):
            for j in range(3):
                r = stats.pearsonr([row[i] for row in rows], [row[j] for row in rows]).statistic
                assert b[key][i][j] == pytest.approx(r, abs=1e-12), (key, i, j)
    # |v| > 0.95: m1 -0.99, -0.96, 0.96, 0.99 and m5 0.99, 0.96 -> 6 of 48 values
    assert b["saturated_share"] == pytest.approx(6 / 48)
    masses = [m for ep in LAB for row in ep["probe_mass"] for m in row]
    assert b["yes_no_mass_mean"] == pytest.approx(sum(masses) / 48)
    assert "yes_no_mass_mean" not in ev.summarize(SIX)["belief_stats"]           # not recorded there


def test_belief_stats_undefined_correlations_are_none():
    flat = [labelled("f1", "PENDING", [[0.1, 0.2, 0.3], [0.1, 0.4, 0.3]], [[]], [[]])]
    b = ev.summarize(flat)["belief_stats"]
    assert b["spearman_dense_goal"] is None                  # one episode
    assert b["probe_level_corr"][0][1] is None               # CA constant
    assert b["probe_level_corr"][1][2] is None               # AC constant
    json.dumps(b, allow_nan=False)                           # no NaN reaches summary.json


def test_shaping_by_outcome_by_hand():
    s = ev.summarize(SIX)["shaping_by_outcome"]
    # raw: ACCEPT e1 .4, e6 .4; COND .2; PENDING .2; REJECT -.4; WALK -.3
    raw = {"ACCEPT": 0.4, "CONDITIONAL_ACCEPT": 0.2, "PENDING": 0.2, "REJECT": -0.4, "WALK_AWAY": -0.3}
    a = rpo.ANCHOR_BELIEF
    anchored = {"ACCEPT": ((a["ACCEPT"] - 0.0) / 2 + (a["ACCEPT"] + 0.2) / 2) / 2,
                "CONDITIONAL_ACCEPT": (a["CONDITIONAL_ACCEPT"] - 0.2) / 2, "PENDING": (a["PENDING"] - 0.0) / 2,
                "REJECT": (a["REJECT"] - 0.4) / 2, "WALK_AWAY": (a["WALK_AWAY"] - 0.0) / 2}
    expected = anchored if rpo.ANCHOR else raw
    assert s.keys() == expected.keys()
    for o in expected:
        assert s[o] == pytest.approx(expected[o])


def welch_by_hand(x, y):
    """Welch's difference of means with its Satterthwaite-df t interval, written out."""
    mx, my = statistics.mean(x), statistics.mean(y)
    vx, vy = statistics.variance(x) / len(x), statistics.variance(y) / len(y)
    df = (vx + vy) ** 2 / (vx ** 2 / (len(x) - 1) + vy ** 2 / (len(y) - 1))
    half = stats.t.ppf(0.975, df) * math.sqrt(vx + vy)
    return mx - my, mx - my - half, mx - my + half


def test_move_stats_by_hand():
    m = ev.summarize(LAB)["moves"]
    # turn 1 messages: m1 dq; m2 dq, emp; m3 emp; m4 ca, ev; m5 dq -> dq 3/5, empathy 2/5
    assert m["turn_counts"] == [5, 4, 2]
    assert m["by_turn"]["diagnostic_question"] == pytest.approx([3 / 5, 1 / 4, 0.0])
    assert m["by_turn"]["empathy"] == pytest.approx([2 / 5, 0.0, 0.0])
    assert m["by_turn"]["plan_detail"] == pytest.approx([0.0, 1 / 4, 2 / 2])
    # per turn r_t on measured beliefs, paired with the labels of that turn
    turns = [(labels, r) for ep in LAB for labels, r in zip(ep["moves"], rpo.process_rewards(ep["beliefs"], None, anchor=False))]
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
    ranked = [k for k in ev.moves.MOVES if m["effects"][k]["dense"] and m["effects"][k]["accept"]]
    x = [m["effects"][k]["dense"]["diff"] for k in ranked]
    y = [m["effects"][k]["accept"]["diff"] for k in ranked]
    assert m["ranking_corr"]["rho"] == pytest.approx(stats.pearsonr(stats.rankdata(x), stats.rankdata(y)).statistic)


def test_manipulation_stats_by_hand():
    a = ev.summarize(LAB)["manipulation"]
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
    text = ev.format_table(ev.summarize(LAB))
    assert "manipulation audit" in text and "moves (keyword tagger)" in text


def test_compare_many_by_hand(tmp_path, capsys):
    policy = [episode(f"s{i}", o, [0.0, 0.1]) for i, o in enumerate(
        ["ACCEPT", "ACCEPT", "ACCEPT", "PENDING", "REJECT", "ACCEPT"])]
    base1 = [episode(f"s{i}", o, [0.0, 0.1]) for i, o in enumerate(
        ["PENDING", "ACCEPT", "PENDING", "ACCEPT", "REJECT", "PENDING"])]
    base2 = [episode(f"s{i}", o, [0.0, 0.1]) for i, o in enumerate(
        ["PENDING", "PENDING", "REJECT", "PENDING", "PENDING"])]              # no s5
    r = ev.compare_many({"b1": base1, "b2": base2}, policy)
    # b1: won s0 s2 s5, lost s3; b2 (s0-s4): won s0 s1 s2, lost none
    assert r["per_baseline"]["b1"] == {"n": 6, "won": 3, "lost": 1,
                                       "mcnemar_p": pytest.approx(stats.binomtest(3, 4).pvalue)}
    assert (r["per_baseline"]["b2"]["won"], r["per_baseline"]["b2"]["lost"]) == (3, 0)
    # common s0-s4; closed by neither: s0 s2 s4 -> the policy closes s0, s2
    assert (r["n_common"], r["closed_by_none"], r["policy_closes"]) == (5, 3, 2)
    assert r["policy_closes_share"] == pytest.approx(2 / 3)
    for name, eps in (("b1", base1), ("b2", base2), ("p", policy)):
        ev.save_run(tmp_path / name, eps, ev.summarize(eps))
    ev.main(["--compare-many", str(tmp_path / "b1"), str(tmp_path / "b2"), "--policy", str(tmp_path / "p")])
    out = capsys.readouterr().out
    assert "closed by no baseline: 3; the policy closes 2 of them (66.7%)" in out
    assert [line.split()[1:4] for line in out.splitlines() if line.startswith(str(tmp_path))] == \
        [["6", "3", "1"], ["5", "3", "0"]]


def test_balanced_subset_keeps_three_per_cell():
    import arena
    per_cell = ev.SUBSETS["balanced60"]
    kept = ev.balanced_subset(arena.heldout_instances(), per_cell)
    cells = {(d, r): 0 for d in arena.DOMAINS for r in arena.RESISTANCE_TYPES}
    for inst in kept:
        cells[(inst["domain"], inst["hidden"]["resistance"])] += 1
    assert set(cells.values()) == {per_cell} and len(kept) == per_cell * len(cells) == 60
    with pytest.raises(ValueError, match="too few in"):
        ev.balanced_subset(arena.heldout_instances()[:30], per_cell)


def test_case_study_rows_shares_and_plot(tmp_path, capsys):
    ep = LAB[1]                                         # 3 turns
    rows = ev.case_rows(ep)
    r = rpo.process_rewards(ep["beliefs"], ep["outcome"])
    total = sum(abs(x) for x in r)
    assert [row["t"] for row in rows] == [0, 1, 2, 3] and rows[0]["r"] is None
    assert [row["share"] for row in rows[1:]] == pytest.approx([abs(x) / total for x in r])
    assert rows[2]["moves"] == ["evidence"] and rows[1]["CA"] == 0.3
    assert ev.top_two_share(rows) == pytest.approx(sum(sorted((abs(x) for x in r), reverse=True)[:2]) / total)
    ev.save_run(tmp_path / "run", LAB, ev.summarize(LAB))
    ev.main(["--case", str(tmp_path / "run"), "m2"])
    out = capsys.readouterr().out
    assert "m2: CONDITIONAL_ACCEPT after 3 turns" in out and "the two largest turns carry" in out
    assert png_size(tmp_path / "run" / "case-m2.png") == tuple(round(v * ev.DPI) for v in ev.CASE_FIGSIZE)
    with pytest.raises(SystemExit, match="has no episode of nope"):
        ev.main(["--case", str(tmp_path / "run"), "nope"])


def test_overlay_and_moves_plots(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ev.save_run(tmp_path / "A", LAB, ev.summarize(LAB))
    ev.save_run(tmp_path / "B", SIX, ev.summarize(SIX))
    assert png_size(tmp_path / "A" / "moves.png") == tuple(round(v * ev.DPI) for v in ev.MOVES_FIGSIZE)
    assert not (tmp_path / "B" / "moves.png").exists()   # no labels stored
    ev.main(["--overlay", str(tmp_path / "A"), str(tmp_path / "B"), "--name", "ov"])
    assert png_size(tmp_path / "evals" / "ov" / "overlay.png") == tuple(round(v * ev.DPI) for v in ev.OVERLAY_FIGSIZE)


def write_run(root, name, lam, heldout, train_accept, judged):
    """A training run folder by hand: config, metrics of 8 steps, evaluations at steps 2, 4, 6, 8
    with held-out acceptance `heldout`, per-step training acceptance `train_accept`, and held-out
    episodes (outcome, judge) at step 8."""
    run = root / name
    (run / "eval-8").mkdir(parents=True)
    (run / "checkpoint-4").mkdir()
    (run / "config.json").write_text(json.dumps({"lam": lam, "anchor": False}))
    rows = [{"step": s, "outcome_ACCEPT": a, "dead_group_share": 0.1 * s, "dead_rescued_share": 0.5,
             "outcome_term_abs": 1.0, "dense_term_abs": 0.02 * s} for s, a in enumerate(train_accept, 1)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    evals = [{"step": s, "full_accept": h, "shaping_by_outcome": {"ACCEPT": 0.4 + s / 100}}
             for s, h in zip((2, 4, 6, 8), heldout)]
    (run / "evals.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
    eps = [episode(f"h{i}", o, [0.0, 0.1], judge=j) for i, (o, j) in enumerate(judged)]
    (run / "eval-8" / "episodes.jsonl").write_text("".join(json.dumps(e) + "\n" for e in eps))
    return run


def test_runs_checkpoint_selection_by_hand(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    judged = [("ACCEPT", 1.0), ("PENDING", 0.5), ("REJECT", -1.0), ("ACCEPT", 0.0)]
    a = write_run(tmp_path, "lam0.5", 0.5, [0.2, 0.5, 0.4, 0.5], [0.0, 0.2, 0.1, 0.3, 0.3, 0.5, 0.6, 0.6], judged)
    b = write_run(tmp_path, "lam1", 1.0, [0.1, 0.3, 0.2, 0.2], [0.1] * 8, judged)
    ev.main(["--runs", str(a), str(b), "--name", "sel"])
    out = capsys.readouterr().out
    table = {line.split()[0]: line.split()[1:] for line in out.splitlines()[:6] if line.split()[0].isdigit()}
    assert table == {"2": ["20.0%", "10.0%"], "4": ["50.0%", "30.0%"], "6": ["40.0%", "20.0%"], "8": ["50.0%", "20.0%"]}
    # best: 50% first reached at step 4 (ties go to the earliest); its checkpoint was kept
    assert f"best step 4 at 50.0%, checkpoint {a / 'checkpoint-4'}" in out
    result = json.loads((tmp_path / "evals" / "sel" / "runs.json").read_text())
    ra, rb = result
    # training acceptance per evaluation window: (0 + .2)/2, (.1 + .3)/2, (.3 + .5)/2, (.6 + .6)/2
    assert ra["train_accept"] == pytest.approx([0.1, 0.2, 0.4, 0.6])
    # Spearman of [.1 .2 .4 .6] vs [.2 .5 .4 .5]: ranks 1 2 3 4 vs 1 3.5 2 3.5 (ties: mid-ranks)
    x, y = np.array([1, 2, 3, 4.0]), np.array([1, 3.5, 2, 3.5])
    rho = float(np.corrcoef(x, y)[0, 1])
    t = rho * math.sqrt(2 / (1 - rho ** 2))
    assert ra["train_heldout_spearman"]["rho"] == pytest.approx(rho)
    assert ra["train_heldout_spearman"]["p"] == pytest.approx(2 * stats.t.sf(abs(t), 2))
    assert rb["train_heldout_spearman"] is None             # constant training acceptance
    # goal vs strategy: goals 3 0 -1 3 against 1 .5 -1 0, Pearson by hand
    g, j = np.array([3, 0, -1, 3.0]), np.array([1, 0.5, -1, 0])
    r = ((g - g.mean()) @ (j - j.mean())) / math.sqrt(((g - g.mean()) ** 2).sum() * ((j - j.mean()) ** 2).sum())
    assert ra["goal_strategy_corr"]["r"] == pytest.approx(r) and ra["goal_strategy_corr"]["n"] == 4
    assert ra["shaping_by_outcome"] == {"ACCEPT": pytest.approx(0.44)} and rb["best"]["checkpoint"] is not None
    assert png_size(tmp_path / "evals" / "sel" / "runs.png") == tuple(round(v * ev.DPI) for v in ev.RUNS_FIGSIZE)
    w, h = ev.RUN_PANEL_SIZE
    assert png_size(tmp_path / "evals" / "sel" / "dynamics.png") == (round(w * len(ev.RUN_DYNAMICS) * ev.DPI), round(h * ev.DPI))
    with pytest.raises(SystemExit, match="evals.jsonl does not exist"):
        ev.main(["--runs", str(tmp_path / "evals")])


def test_training_keeps_evaluated_checkpoints_and_joins_summaries(tmp_path, short_scenarios, capsys, monkeypatch):
    """train.py: every periodic evaluation keeps its checkpoint and appends its summary to
    evals.jsonl under its step; eval.py --runs reads the run."""
    import train
    monkeypatch.chdir(tmp_path)
    train.main(["--preset", "tiny", "--judge", "none", "--scenarios", short_scenarios, "--out", str(tmp_path),
                "--name", "r", "--steps", "4", "--eval-every", "2", "--save-every", "1", "--eval-limit", "1",
                "--eval-t-max", "1", "--max-new-tokens", "3", "--group-size", "2", "--instances", "2"])
    run = tmp_path / "r"
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    rows = [json.loads(line) for line in (run / "evals.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4] and all("belief_stats" in r and r["anchor"] is rpo.ANCHOR for r in rows)
    assert rows[0] == json.loads((run / "eval-2" / "summary.json").read_text()) | {"step": 2}
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(k in metrics[0] for k in ev.RUN_DYNAMICS) and "negative_process_share" in metrics[0]
    capsys.readouterr()
    ev.main(["--runs", str(run)])
    assert "held-out full acceptance by step" in capsys.readouterr().out


def test_run_anchor_follows_the_training_run(tmp_path):
    checkpoint = tmp_path / "run" / "checkpoint-20"
    checkpoint.mkdir(parents=True)
    assert ev.run_anchor(str(checkpoint)) == rpo.ANCHOR                  # no config: the default
    (tmp_path / "run" / "config.json").write_text(json.dumps({"anchor": not rpo.ANCHOR}))
    assert ev.run_anchor(str(checkpoint)) == (not rpo.ANCHOR)
    assert ev.run_anchor("smollm2") == rpo.ANCHOR
