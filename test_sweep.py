"""sweep.py end to end on tiny models: every arm trained and evaluated, summary and table
written, a second invocation reuses the finished arms."""
import json

import pytest

import sweep
import train


@pytest.mark.slow
def test_sweep_end_to_end_and_reused(tmp_path, short_scenarios, monkeypatch):
    """2 lambdas x 1 seed x 2 steps, --eval-limit 2, logit decisions and a frozen control:
    summary.json has one entry per arm and checkpoint (step 0 = the initial policy, paired on the
    same held-out episodes), table.md and the figures exist; run again, no arm trains again."""
    argv = ["--preset", "tiny", "--lams", "0", "1", "--seeds", "0", "--steps", "2",
            "--eval-every", "1", "--eval-limit", "2", "--name", "smoke", "--out", str(tmp_path),
            "--decision", "logit", "--frozen-control", "--",
            "--judge", "none", "--scenarios", short_scenarios, "--group-size", "2"]
    summary = sweep.main(argv)
    root = tmp_path / "smoke"
    keys = sorted((e["lam"], e["seed"], e["step"]) for e in summary["arms"])
    assert keys == [(lam, 0, step) for lam in (0.0, 1.0) for step in (0, 1, 2)]
    assert json.loads((root / "summary.json").read_text())["arms"] == json.loads(
        json.dumps(summary["arms"]))
    for e in summary["arms"]:
        assert e["n"] == 2 and 0 <= e["full_accept"] <= e["full_or_conditional"] <= 1
        assert e["mean_belief_change"] is not None
    # step 0 is the same initial evaluation for both lambdas: the paired baseline
    initial = [e for e in summary["arms"] if e["step"] == 0]
    assert initial[0]["mean_belief_change"] == initial[1]["mean_belief_change"]
    table = (root / "table.md").read_text()
    assert "| 1 | last (step 2) | 2 |" in table and "frozen control" in table
    power = summary["power"]
    assert power["pairs"] == 2 and "Power (80%" in table
    if power["belief_diff_sd"]:  # two pairs: what they detect is the inverse of what they need
        assert sweep.significance.episodes_for_mean(
            power["belief_diff_sd"], power["detectable_belief_diff"] * 1.001, paired=True) <= 2
    assert (root / "curves.png").stat().st_size and (root / "effect.png").stat().st_size
    # the frozen persuadee's probe fidelity is checked once, in the initial evaluation
    assert json.loads((root / "initial_s0" / "eval-0" / "fidelity.json").read_text())["sample"]
    assert not list((root / "runs").glob("*/eval-*/fidelity.json"))
    assert all("probe_fidelity" not in json.loads(p.read_text())
               for p in (root / "runs").glob("*/eval-*/summary.json"))
    calls = []
    monkeypatch.setattr(train, "main", lambda a: calls.append(a))
    monkeypatch.setattr(sweep, "evaluate_initial", lambda *a: calls.append(a))
    again = sweep.main(argv)
    assert calls == [] and again["arms"] == summary["arms"]


@pytest.mark.parametrize("extra, says", [
    (["--steps", "3", "--eval-every", "2"], "not a multiple"),
    (["--lams", "0.5", "1"], "must include 0"),
    (["--name", "a/b"], "one folder name")])
def test_bad_sweep_arguments_are_one_line(extra, says, capsys):
    base = ["--steps", "2", "--eval-every", "1", "--eval-limit", "1", "--name", "x"]
    with pytest.raises(SystemExit):
        sweep.parse_args(base + extra)
    assert says in capsys.readouterr().err
