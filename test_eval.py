"""Tests of eval.py's model-free half: metrics, paired tests, comparison, plots, IO and CLI errors.
Expected values are computed by hand in the comments. Run: python -m pytest -q test_eval.py"""

import itertools
import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import pytest

import eval as ev

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
    # anchored dense returns .5 + .15 + 0 - .7 - .5 + .6 = .05 (raw would give .5)
    assert s["mean_dense_return"] == pytest.approx(0.05 / 6)
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
    assert eb["mean_dense_return"] == pytest.approx((0.15 - 0.7) / 2)
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


def test_evaluate_writes_a_run_and_probe_fidelity(tmp_path):
    import arena
    import engine
    import models
    model, tok = models.load_model("random:tiny-qwen3")
    instances = arena.heldout_instances()[:2]
    engines = [engine.Engine(model, tok, num_blocks=3000) for _ in range(2)]
    summary = ev.evaluate(*engines, instances, tmp_path / "run", t_max=2, fidelity=2)
    assert summary["n"] == 2 and summary["probe_fidelity"]["max_abs_diff"] < 1e-4
    saved = ev.load_episodes(tmp_path / "run")
    assert [e["id"] for e in saved] == [i["id"] for i in instances]
    assert not any(k in saved[0] for k in ev.TRAINING_KEYS)
    for name in ("summary.json", "beliefs.png", "probes.png"):
        assert (tmp_path / "run" / name).stat().st_size > 0


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
