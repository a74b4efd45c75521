"""lab/sweep_table.py: the sweep's statistics by hand (frozen controls, power, seed level)."""
import json
import math
import statistics

import pytest

from lab import significance, sweep_table
from persuarena.rollout import Episode


def test_frozen_rows_pair_training_episodes_of_the_second_half():
    """Each arm's episode against the control's of the same seed, step, group and member, over
    steps after the first half only (steps 1-2 of 4 differ by 10 and must not count)."""
    def rollouts(shift):
        return [dict(step=step, group=g, member=m, b_0=0.0,
                     b_T=0.1 * m + g + shift(step, g, m)) for step in (1, 2, 3, 4)
                for g in (0, 1) for m in (0, 1)]
    gains = {(3, 0, 0): 0.01, (3, 0, 1): 0.03, (3, 1, 0): -0.02, (3, 1, 1): 0.05,
             (4, 0, 0): 0.00, (4, 0, 1): 0.04, (4, 1, 0): 0.02, (4, 1, 1): 0.01}
    arm = rollouts(lambda step, g, m: 10.0 if step <= 2 else gains[step, g, m])
    control = rollouts(lambda *_: 0.0)
    [row] = sweep_table.frozen_rows({0.0: {0: {"rollouts": arm}}}, {0: {"rollouts": control}}, [0.0], [0], 4)
    # a group is one cluster (issue 35): (step, group) 3/0 0.02, 3/1 0.015, 4/0 0.02, 4/1 0.015
    clusters = [0.02, 0.015, 0.02, 0.015]
    assert row["n"] == 4 and row["pairs"] == 8 and row["belief_diff"] == pytest.approx(0.0175)
    assert row["low"] < row["belief_diff"] < row["high"]
    # paired t power over 4 clusters: sqrt(1 / 4) (t_.975,3 3.182446 + t_.8,3 0.978472) sd
    exact4 = significance.detectable_mean(1.0, 4, paired=True)  # 4 pairs, exact (test_significance)
    assert row["detectable"] == pytest.approx(exact4 * statistics.stdev(clusters), rel=1e-4)


def test_sweep_power_by_hand():
    """The paired sd pooled as a root mean square over every comparison that has one; the
    acceptance baseline is the initial policy's share."""
    rows = [dict(vs_initial=dict(n=4, belief_diff_sd=0.3), vs_lambda0=None),
            dict(vs_initial=dict(n=4, belief_diff_sd=0.4), vs_lambda0=dict(n=4, belief_diff_sd=None))]
    initial = [Episode(outcome=o) for o in ("ACCEPT", "REJECT", "PENDING", "CONDITIONAL_ACCEPT")]
    power = sweep_table.sweep_power(rows, initial)
    sd = math.sqrt((0.09 + 0.16) / 2)
    assert power["pairs"] == 4 and power["belief_diff_sd"] == pytest.approx(sd)
    assert power["initial_full_accept"] == 0.25
    assert power["detectable_belief_diff"] == pytest.approx(  # 4 pairs, exact noncentral t
        significance.detectable_mean(1.0, 4, paired=True) * sd, rel=1e-5)
    assert power["detectable_full_accept"] is None  # 4 pairs cannot detect even 25% -> 100%


def test_seed_level_comparisons_by_hand():
    """Three seeds, two scenarios each: the seed-level test is a paired t over the seeds' means
    (not over the six episodes), between_seed_sd the sd of those means; below three seeds none."""
    def eps(accepts, changes):
        return [Episode(scenario_id=f"h{i}", outcome="ACCEPT" if a else "REJECT", beliefs=[0.0, c])
                for i, (a, c) in enumerate(zip(accepts, changes))]
    initial = {s: eps([0, 0], [0.0, 0.0]) for s in (0, 1, 2)}
    trained = {0: eps([1, 0], [0.1, 0.3]), 1: eps([1, 1], [0.2, 0.2]), 2: eps([0, 0], [0.4, 0.2])}
    held_out = {0.0: {s: {0: initial[s], 1: trained[s]} for s in (0, 1, 2)}}
    [last, best] = sweep_table.table_rows(held_out, [0.0], [0, 1, 2], [1])
    assert last["which"] == "last" and best["selected_on"] == "test episodes" and last["selected_on"] is None
    level = last["vs_initial"]["seed_level"]
    # per-seed mean changes 0.2, 0.2, 0.3: diff 0.23333, sd 0.057735, t 7.0 on 2 df, p 0.019804
    assert level["seeds"] == 3 and level["belief_change"]["diff"] == pytest.approx(0.7 / 3)
    assert level["belief_change"]["p"] == pytest.approx(0.019804, abs=1e-5)
    # per-seed acceptance 0.5, 1, 0: mean 0.5, sd 0.5
    assert level["full_accept"]["diff"] == pytest.approx(0.5) and level["full_accept"]["sd"] == pytest.approx(0.5)
    assert last["between_seed_sd"]["full_accept"] == pytest.approx(0.5)
    assert last["between_seed_sd"]["belief_change"] == pytest.approx(statistics.stdev([0.2, 0.2, 0.3]))
    assert last["vs_initial"]["n"] == 6  # the episode-level test beside it
    table = sweep_table.format_table([last, best])
    assert "Seed level (3 seeds" in table and "best* (step 1)" in table
    assert f"This table holds {sweep_table.count_tests([last, best])} tests" in table
    assert sweep_table.count_tests([last, best]) == 8
    [two] = sweep_table.table_rows({0.0: {s: held_out[0.0][s] for s in (0, 1)}}, [0.0], [0, 1], [1])[:1]
    assert two["vs_initial"]["seed_level"] is None and "Seed level" not in sweep_table.format_table([two])


def test_frozen_control_at_the_seed_level_by_hand():
    """Each seed's mean of its groups' mean differences, then a t test over the seeds: a seed
    with more groups weighs no more than another, and a flipped sign flips the difference."""
    from scipy import stats
    clusters = {(0, 1, 0): [0.1, 0.3], (0, 2, 0): [0.0], (1, 1, 0): [0.2], (2, 1, 0): [-0.1, 0.1],
                (2, 2, 0): [0.4], (2, 3, 0): [0.1]}
    means = [(0.2 + 0.0) / 2, 0.2, (0.0 + 0.4 + 0.1) / 3]
    level = sweep_table.frozen_seed_level(clusters, [0, 1, 2])
    assert level["n"] == 3 and level["diff"] == pytest.approx(statistics.mean(means))
    assert level["p"] == pytest.approx(stats.ttest_1samp(means, 0.0).pvalue)
    assert level["detectable"] > 0
    flipped = sweep_table.frozen_seed_level({k: [-x for x in v] for k, v in clusters.items()}, [0, 1, 2])
    assert flipped["diff"] == pytest.approx(-level["diff"])
    assert sweep_table.frozen_seed_level(clusters, [0, 1]) is None  # below SEED_LEVEL_MIN


def test_fig7_rows_by_hand(tmp_path):
    """Fig. 7 from training metrics: dead share the mean of the steps', the rescued share pooled
    by dead groups (0.5 * 1 + 1.0 * 0.5) / 1.5, the dense share the steps' mean, a step clipped
    when its gradient norm exceeded the clip; by step, the seeds pooled; the table's line and
    the figure follow."""
    step = lambda n, dead, rescued, dense, norm, clip: dict(
        step=n, dead_group_share=dead, dead_rescued_share=rescued, dense_share=dense,
        grad_norm=norm, clip_frac=clip)
    metrics = {0.5: {0: [step(1, 0.5, 1.0, 0.2, 2.0, 0.1), step(2, 1.0, 0.5, 0.6, 0.5, 0.0)],
                     1: [step(1, 0.0, 0.0, 0.1, 0.9, 0.3)]}}
    [row] = sweep_table.fig7_rows(metrics, [0.5], [0, 1], grad_clip=1.0)
    run = row["run"]
    assert run["dead_group_share"] == pytest.approx(0.5) and run["rescued_share"] == pytest.approx(1 / 1.5)
    assert run["dense_share"] == pytest.approx(0.3) and run["grad_clipped_share"] == pytest.approx(1 / 3)
    assert run["clip_frac"] == pytest.approx(0.4 / 3) and row["seeds"] == 2
    assert row["by_step"]["1"]["dead_group_share"] == pytest.approx(0.25)
    assert row["by_step"]["1"]["rescued_share"] == pytest.approx(1.0)
    assert row["by_step"]["2"]["grad_clipped_share"] == 0.0
    assert "| 0.5 | 2 | 50.0 | 66.7 | 30.0 | 33.3 | 13.3 |" in sweep_table.fig7_lines([row])
    from lab import plots
    plots.plot_fig7([row], tmp_path, sweep_table.PAPER_DENSE_SHARE)
    assert (tmp_path / "fig7.png").stat().st_size > 0


def pool_summary(seeds, settings_extra=None, shift=0.0):
    """A summary.json as lab.sweep writes it, reduced to what pooling reads: per (lambda, seed) at
    steps 0 and 25, full acceptance and mean b_T - b_0."""
    settings = dict(preset="cpu", lams=[0.0, 0.5], seeds=seeds, steps=25, decision="logit",
                    train_args=["--lr", "3e-5"]) | (settings_extra or {})
    arms = [dict(lam=lam, seed=s, step=step, full_accept=0.1 * s + lam * (s % 3) / 10,
                 mean_belief_change=0.2 + 0.01 * s + lam * (0.03 * (s % 4) + shift))
            for lam in (0.0, 0.5) for s in seeds for step in (0, 25)]
    return dict(settings=settings, arms=arms)


def test_pooled_sweeps_give_the_seed_level_test_of_all_their_seeds(tmp_path, capsys):
    """Two sweeps of the same settings on seeds 0-2 and 3-6 pool to a paired t test over 7 seeds,
    equal to scipy's on the differences written out here; the CLI prints it, --json holds it and
    --out writes each seed's arms, the result and the figure."""
    from scipy import stats
    a, b = pool_summary([0, 1, 2]), pool_summary([3, 4, 5, 6], dict(steps=50, name="longer"))
    pooled = sweep_table.pooled_seed_level([("a", a), ("b", b)], 25)
    diffs = [0.5 * (0.03 * (s % 4)) for s in range(7)]
    level = pooled[0.5]["belief_change"]
    assert pooled[0.5]["seeds"] == 7 and level["n"] == 7
    assert level["diff"] == pytest.approx(statistics.mean(diffs))
    assert level["p"] == pytest.approx(stats.ttest_1samp(diffs, 0.0).pvalue)
    accept = pooled[0.5]["full_accept"]
    assert accept["diff"] == pytest.approx(statistics.mean(0.5 * (s % 3) / 10 for s in range(7)))
    for name, summary in (("a", a), ("b", b)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(summary))
    sweep_table.main([str(tmp_path / "a"), str(tmp_path / "b"), "--step", "25"])
    assert "lambda 0.5 - 0 at step 25, 7 seeds" in capsys.readouterr().out
    sweep_table.main([str(tmp_path / "a"), str(tmp_path / "b"), "--step", "25", "--json"])
    assert json.loads(capsys.readouterr().out)["0.5"]["belief_change"]["n"] == 7
    out = tmp_path / "new" / "folder"  # made where missing
    sweep_table.main([str(tmp_path / "a"), str(tmp_path / "b"), "--step", "25", "--out", str(out)])
    record = json.loads((out / "pooled-step25.json").read_text())
    assert record["command"].endswith(f"--step 25 --out {out}") and record["step"] == 25
    assert sorted(record["seeds"]["0.5"], key=int) == [str(s) for s in range(7)]
    assert [record["seeds"]["0.5"][str(s)]["belief_change"] - record["seeds"]["0"][str(s)]["belief_change"]
            for s in range(7)] == pytest.approx(diffs)
    assert record["seed_level"]["0.5"] == json.loads(json.dumps(pooled[0.5]))
    assert (out / "pooled-step25.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("second, says", [
    (dict(seeds=[2, 3, 4]), "seed 2 is in two of the pooled sweeps"),
    (dict(seeds=[3, 4], settings_extra=dict(decision="tag")), "differ from a's in ['decision']"),
    (dict(seeds=[3, 4], step=10), "no lambda 0 arm at step 10")])
def test_pooling_refuses_shared_seeds_other_settings_and_a_missing_step_in_one_line(second, says):
    step = second.pop("step", 25)
    b = pool_summary(**second)
    with pytest.raises(ValueError) as e:
        sweep_table.pooled_seed_level([("a", pool_summary([0, 1, 2])), ("b", b)], step)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_the_cli_names_an_unreadable_sweep_in_one_line(tmp_path):
    with pytest.raises(SystemExit) as e:
        sweep_table.main([str(tmp_path / "missing"), "--step", "25"])
    assert "missing/summary.json" in str(e.value) and "\n" not in str(e.value)
