"""sweep.py end to end on tiny models: every arm trained and evaluated, summary and table
written, a second invocation reuses the finished arms."""
import json
import math

import pytest
import torch

from lab import audit, cli, records, significance, sweep
from persuarena import train


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
        texts = [t["text"] for ep in records.load_episodes(
            root / ("initial_s0/eval-0" if e["step"] == 0 else f"runs/lam{e['lam']:g}_s0/eval-{e['step']}")
            / "episodes.jsonl") for t in ep.transcript if t["role"] == "persuader"]
        assert e["messages"] == audit.score_texts(texts) and e["messages"]["messages"] >= 2
    # step 0 is the same initial evaluation for both lambdas: the paired baseline
    initial = [e for e in summary["arms"] if e["step"] == 0]
    assert initial[0]["mean_belief_change"] == initial[1]["mean_belief_change"]
    table = (root / "table.md").read_text()
    assert "| 1 | last (step 2) | 2 |" in table and "frozen control" in table
    power = summary["power"]
    assert power["pairs"] == 2 and "Power (80%" in table
    if power["belief_diff_sd"]:  # two pairs: what they detect is the inverse of what they need
        assert significance.episodes_for_mean(
            power["belief_diff_sd"], power["detectable_belief_diff"] * 1.001, paired=True) <= 2
    assert all((root / name).stat().st_size for name in ("curves.png", "effect.png", "training.png",
                                                          "fig7.png"))
    assert [r["lam"] for r in summary["fig7"]] == [0.0, 1.0] and "Fig. 7 (training steps" in table
    assert set(summary["fig7"][1]["by_step"]) == {"1", "2"}
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
    (["--lams", "0.5", "-1"], "each must be a number in [0, 100]"),
    (["--name", "a/b"], "one folder name")])
def test_bad_sweep_arguments_are_one_line(extra, says, capsys):
    base = ["--steps", "2", "--eval-every", "1", "--eval-limit", "1", "--name", "x"]
    with pytest.raises(SystemExit):
        sweep.parse_args(base + extra)
    assert says in capsys.readouterr().err


BASE = ["--steps", "2", "--eval-every", "1", "--eval-limit", "1", "--name", "x"]


@pytest.mark.parametrize("after, names", [
    (["--lam", "1"], "--lam"), (["--lam=1"], "--lam"), (["--seed", "3", "--steps", "9"], "--seed, --steps"),
    (["--out", "elsewhere"], "--out"), (["--eval-lim", "5"], "--eval-limit"), (["--preset", "cpu"], "--preset"),
    (["--decision", "tag"], "--decision")])
def test_flags_the_sweep_sets_are_refused_after_the_separator(after, names, capsys, tmp_path):
    """issue 35: `-- --lam 1` trained every arm at lambda 1 under labels 0 and 1; now one line."""
    with pytest.raises(SystemExit):
        sweep.parse_args(BASE + ["--out", str(tmp_path), "--", "--judge", "none", *after])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{names} after -- would override" in err[0]


def test_lr_after_the_separator_trains_the_learning_arms_and_the_control_stays_at_lr_0(tmp_path):
    """--lr after -- sets the learning arms' rate; the frozen control's lr 0 comes after it, so
    the control stays frozen (argparse: the last value wins)."""
    from persuarena import train
    args, extra = sweep.parse_args(BASE + ["--out", str(tmp_path), "--frozen-control", "--",
                                           "--lr", "1e-4"])
    assert extra == ["--lr", "1e-4"]
    rates = {lam: cli.train_args(sweep.arm_argv(args, extra, lam, 0, tmp_path), train).lr
             for lam in (0.5, sweep.FROZEN)}
    assert rates == {0.5: 1e-4, sweep.FROZEN: 0.0}
    saves = lambda a: cli.train_args(sweep.arm_argv(a, extra, 0.5, 0, tmp_path), train).save_every
    assert saves(args) == args.eval_every  # --save-every's default
    args.save_every = 1
    assert saves(args) == 1


def test_each_seed_draws_its_own_random_initial_weights(tmp_path, monkeypatch):
    """A random policy's weights are drawn with --seed (train.build_models and the sweep's
    initial evaluation load it so): two seeds differ, one seed repeats; the persuadee keeps 0."""
    from persuarena import models
    from persuarena import train
    weights = lambda seed: models.load_model("random:tiny-llama", seed=seed)[0].model.embed_tokens.weight
    assert torch.equal(weights(3), weights(3)) and not torch.equal(weights(3), weights(4))
    loads = []
    def fake_load(name, dtype, device, seed=0):
        loads.append((name, seed))
        raise KeyboardInterrupt
    monkeypatch.setattr(train, "load", fake_load)
    args, extra = sweep.parse_args(BASE + ["--out", str(tmp_path), "--", "--judge", "none"])
    with pytest.raises(KeyboardInterrupt):
        sweep.evaluate_initial(sweep.arm_argv(args, extra, 0.0, 7, tmp_path), tmp_path / "i")
    argv = sweep.arm_argv(args, extra, 0.0, 7, tmp_path)
    with pytest.raises(KeyboardInterrupt):
        train.build_models(cli.train_args(argv, train), 1, torch.device("cpu"))
    assert loads == [("random:tiny-llama", 7)] * 2


@pytest.mark.parametrize("extra, says", [
    (["--lams", "0", "1", "1"], "--lams names 1 more than once"),
    (["--seeds", "0", "2", "0"], "--seeds names 0 more than once"),
    (["--lams", "0", "-1"], "each must be a number in [0, 100]"),
    (["--lams", "0", "nan"], "each must be a number in [0, 100]"),
    (["--lams", "0", "1e308"], "lab.sweep: --lams 1e+308: each must be a number in [0, 100]\n"),
    (["--seeds", *map(str, range(33))], "lab.sweep: --lams x --seeds make 99 arms, more than 64 "
                                        "(each a training run and its folder); pass fewer\n")])
def test_bad_values_are_refused_before_anything(extra, says, capsys, tmp_path):
    with pytest.raises(SystemExit):
        sweep.parse_args(BASE + ["--out", str(tmp_path)] + extra)
    assert says in capsys.readouterr().err


def test_a_rerun_keeps_the_recorded_settings(tmp_path):
    """sweep.json pinned as train.py pins config.json: left-out values are the sweep's own, a
    changed one is refused in one line naming it; --overwrite starts again."""
    args, _ = sweep.parse_args(BASE + ["--out", str(tmp_path), "--lams", "0", "1", "--seeds", "4",
                                       "--", "--judge", "none"])
    sweep.start_folder(tmp_path / "x", args)
    again, extra = sweep.parse_args(BASE + ["--out", str(tmp_path)])
    assert again.lams == [0.0, 1.0] and again.seeds == [4] and extra == ["--judge", "none"]
    with pytest.raises(SystemExit) as e:
        sweep.parse_args(["--steps", "2", "--eval-every", "1", "--eval-limit", "3", "--name", "x",
                          "--out", str(tmp_path)])
    assert "--eval-limit 3 (the run has 1)" in str(e.value) and "\n" not in str(e.value)
    assert "--overwrite" in str(e.value)
    with pytest.raises(SystemExit) as e:
        sweep.parse_args(BASE + ["--out", str(tmp_path), "--", "--judge", "random:tiny-llama"])
    assert "--train-args" in str(e.value)
    fresh, _ = sweep.parse_args(["--steps", "2", "--eval-every", "1", "--eval-limit", "3", "--name", "x",
                                 "--out", str(tmp_path), "--overwrite"])
    (tmp_path / "x" / "runs").mkdir()
    sweep.start_folder(tmp_path / "x", fresh)
    assert not (tmp_path / "x" / "runs").exists()
    assert json.loads((tmp_path / "x" / "sweep.json").read_text())["eval_limit"] == 3
    (tmp_path / "x" / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match="nothing was deleted"):
        sweep.start_folder(tmp_path / "x", fresh)


def test_every_arm_is_checked_before_the_first_trains(tmp_path, monkeypatch):
    """A value train.py refuses is named with its arm before any model loads or arm trains."""
    calls = []
    monkeypatch.setattr(train, "main", lambda a: calls.append(a))
    monkeypatch.setattr(sweep, "evaluate_initial", lambda *a: calls.append(a))
    with pytest.raises(SystemExit) as e:
        sweep.main(BASE + ["--out", str(tmp_path), "--", "--judge", "none", "--group-size", "0"])
    assert calls == [] and str(e.value).startswith("lab.sweep: arm lam0_s0: train.py: --group-size 0")


def test_a_bad_arm_file_is_named_in_one_line(tmp_path):
    bad = tmp_path / "episodes.jsonl"
    bad.write_text('{"a": 1}\nnot json\n{"b": 2}\n')
    with pytest.raises(SystemExit) as e:
        sweep.read_arm(sweep.records.load_episodes, bad)
    assert str(bad) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
def test_three_seeds_write_seed_level_into_the_summary(tmp_path, short_scenarios):
    """issue 35 acceptance: a tiny sweep with --seeds 0 1 2 writes seed_level and between_seed_sd."""
    summary = sweep.main(["--preset", "tiny", "--lams", "0", "1", "--seeds", "0", "1", "2", "--steps", "1",
                          "--eval-every", "1", "--eval-limit", "1", "--name", "three", "--out", str(tmp_path),
                          "--", "--judge", "none", "--scenarios", short_scenarios, "--group-size", "2"])
    on_disk = json.loads((tmp_path / "three" / "summary.json").read_text())
    for row in on_disk["table"]:
        assert row["vs_initial"]["seed_level"]["seeds"] == 3 and "between_seed_sd" in row
        if row["lam"] == 1.0:
            assert row["vs_lambda0"]["seed_level"]["belief_change"]["n"] == 3
    assert on_disk["tests"] == summary["tests"] > 0
    assert "stratified-1 of" in (tmp_path / "three" / "table.md").read_text()


def test_the_rescued_share_pools_the_dead_groups_of_its_window():
    """(0.5 * 1 + 0.25 * 0) / (0 + 0.5 + 0.25) = 2/3 of the window's dead groups rescued; a mean of
    the per-step shares would say 1/3, counting the step without a dead group as 0."""
    metrics = [dict(step=1, dead_group_share=0.0, dead_rescued_share=0.0),
               dict(step=2, dead_group_share=0.5, dead_rescued_share=1.0),
               dict(step=3, dead_group_share=0.25, dead_rescued_share=0.0),
               dict(step=4, dead_group_share=1.0, dead_rescued_share=1.0)]  # outside the window
    assert sweep.rescued_window(metrics, 3, 3) == pytest.approx(2 / 3)
    assert sweep.rescued_window(metrics[:1], 1, 1) is None


@pytest.mark.parametrize("edit, says", [
    (dict(lams=[0, "1"]), 'lab.sweep: a re-run of a sweep: {path} holds --lams [0, "1"], not a list of '
                          "float; fix it there, or pass --overwrite to start the sweep again (or "
                          "another --name)"),
    (dict(seeds=[0, 1.5]), "holds --seeds [0, 1.5], not a list of int"),
    (dict(lams=[0, 1e308]), "--lams 1e+308: each must be a number in [0, 100]"),
    (dict(extra_setting=1), "holds extra_setting, which it never records"),
])
def test_a_finished_sweeps_tampered_settings_are_refused_as_an_unfinished_ones(tmp_path, monkeypatch,
                                                                             edit, says, capsys):
    """A re-run checks sweep.json's values (list items typed, lambda bounded, no key it never
    writes) before it looks at which arms are done: a finished sweep trains nothing, so its
    arms' own checks (train.py's) never run."""
    args, _ = sweep.parse_args(BASE + ["--out", str(tmp_path), "--lams", "0", "1", "--", "--judge", "none"])
    sweep.start_folder(tmp_path / "x", args)
    recorded = json.loads((tmp_path / "x" / "sweep.json").read_text())
    (tmp_path / "x" / "sweep.json").write_text(json.dumps({**recorded, **edit}))
    monkeypatch.setattr(sweep, "check_arms", lambda *a: pytest.fail("reached the arms"))
    with pytest.raises(SystemExit) as e:
        sweep.main(BASE + ["--out", str(tmp_path)])
    message = e.value.code if isinstance(e.value.code, str) else capsys.readouterr().err  # argparse's exit
    assert message.startswith("lab.sweep: ") and "\n" not in message.strip()
    assert says.format(path=tmp_path / "x" / "sweep.json") in message


def fake_arms(monkeypatch):
    """summarize_sweep's readers answered from memory: one seed, lambdas 0 and 1, one
    evaluation at step 1, and a training step whose dead-group share is NaN (a tampered or
    broken metrics.jsonl: json reads NaN and Infinity)."""
    from test_analyses import episode
    eps = [episode(f"s{i}", "ACCEPT" if i % 2 else "REJECT", [0.0, 0.1 * i]) for i in range(4)]
    run = dict(episodes={1: eps}, rollouts=[], lam=0.0, anchor=None,
               metrics=[dict(step=1, dead_group_share=math.nan, dead_rescued_share=math.inf,
                             collapsed_group_share=math.nan, grad_norm=math.nan)])
    monkeypatch.setattr(sweep, "read_arm", lambda reader, path: eps if path.name == "episodes.jsonl" else run)


def test_the_summary_and_table_hold_no_nan_and_never_go_through_a_link(tmp_path, monkeypatch):
    fake_arms(monkeypatch)
    args, _ = sweep.parse_args(["--steps", "1", "--eval-every", "1", "--eval-limit", "4", "--name",
                                "x", "--out", str(tmp_path), "--lams", "0", "1", "--seeds", "0"])
    root = tmp_path / "x"
    sweep.start_folder(root, args)
    outside = tmp_path / "outside.txt"
    outside.write_text("not the sweep's")
    for name in ("summary.json", "table.md"):
        (root / name).symlink_to(outside)
    sweep.summarize_sweep(root, args)
    assert outside.read_text() == "not the sweep's"
    text = (root / "summary.json").read_text()
    assert not (root / "summary.json").is_symlink() and "NaN" not in text and "Infinity" not in text
    arm = json.loads(text)["arms"][1]
    assert arm["step"] == 1 and arm["dead_group_share"] is None and arm["rescued_share"] is None
    assert not (root / "table.md").is_symlink() and "nan" not in (root / "table.md").read_text()


def test_a_linked_sweep_folder_is_refused_in_one_line(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "x").symlink_to(elsewhere)
    with pytest.raises(SystemExit) as e:
        sweep.main(BASE + ["--out", str(tmp_path)])
    assert str(e.value.code) == (f"lab.sweep: {tmp_path / 'x'} is a link (-> {elsewhere}), not a sweep "
                                 "folder; pass another --name or --out")
    assert not list(elsewhere.iterdir())
    (tmp_path / "x").unlink()  # runs/ a link: refused without reading through it
    (tmp_path / "x" / "runs").parent.mkdir()
    (elsewhere / "planted").symlink_to(tmp_path)
    (tmp_path / "x" / "runs").symlink_to(elsewhere)
    with pytest.raises(SystemExit) as e:
        sweep.main(BASE + ["--out", str(tmp_path)])
    assert "holds links (runs)," in str(e.value.code)


def test_a_running_sweep_is_never_deleted_and_names_follow_the_one_rule(tmp_path, capsys):
    """lab.sweep takes its folder's lock before it deletes anything: --overwrite of a sweep
    another process runs is refused in one line, every file kept (it once deleted the folder
    under the running arm, which then blamed the disk); a name holding ESC is refused, and
    lab.watch --name '' is refused rather than run (and overwrite) the committed watch."""
    from test_runs import hold_lock
    from lab import watch
    root = tmp_path / "x"
    (root / "runs" / "lam0_s0").mkdir(parents=True)
    (root / "sweep.json").write_text("{}\n")
    other = hold_lock(root)
    try:
        with pytest.raises(SystemExit) as e:
            sweep.main(BASE + ["--out", str(tmp_path), "--overwrite"])
        assert "is in use by process" in str(e.value.code) and "\n" not in str(e.value.code)
    finally:
        other.kill()
        other.wait()
    assert (root / "sweep.json").is_file() and (root / "runs" / "lam0_s0").is_dir()
    with pytest.raises(SystemExit):
        sweep.parse_args(BASE[:-1] + ["x\x1b[2J"])
    assert "control character" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        watch.main(["--name", ""])
    assert "--name ''" in capsys.readouterr().err


def test_message_report_scores_each_arms_heldout_messages(tmp_path):
    """messages.json and table.md's section from the evaluations' episodes.jsonl (step 0 and the
    last), the degenerate share counted as lab.audit scores it; a second report replaces the first."""
    root = tmp_path / "w"
    texts = {0: ["Would you come on Thursday?", "Hello there."], 60: ["\ufffd" * 8, "ex ex ex ex"]}
    for seed in (0, 1):
        for step, said in texts.items():
            path = sweep.heldout_episodes(root, 0.5, seed, step)
            path.parent.mkdir(parents=True)
            path.write_text("".join(json.dumps(dict(transcript=[dict(role="persuader", text=t)])) + "\n"
                                    for t in said))
    (root / "table.md").write_text("the sweep's table\n")
    for _ in range(2):
        report = sweep.write_message_report(root, [0.5], (0, 1), 60)
    pooled, arm = report["all"]["lam0.5"], report["arms"]
    assert pooled["0"]["degenerate"] == 0 and pooled["60"]["degenerate"] == 1
    assert arm["lam0.5_s1"]["0"]["ask"] == 0.5 and arm["lam0.5_s0"]["60"]["quoted"][1] == "ex ex ex ex"
    table = (root / "table.md").read_text()
    assert table.startswith("the sweep's table\n") and table.count("Held-out persuader") == 1
    assert "| 0.5 | all | 4 -> 4 | 0% -> 100% |" in table


def test_the_sweep_runs_seed_by_seed(tmp_path, monkeypatch):
    """Each seed's initial evaluation, then that seed's arms, then the next seed: a sitting cut
    short leaves whole pairs (the initial policy and every lambda of a seed), not initial
    evaluations alone."""
    order = []
    monkeypatch.setattr(sweep, "evaluate_initial", lambda argv, folder: order.append(folder.name))
    monkeypatch.setattr(sweep, "train_arm", lambda argv, run_dir: order.append(run_dir.name))
    monkeypatch.setattr(sweep, "summarize_sweep", lambda root, args: None)
    sweep.main(BASE + ["--lams", "0", "0.5", "--seeds", "3", "4", "--out", str(tmp_path),
                       "--", "--judge", "none"])
    assert order == ["initial_s3", "lam0_s3", "lam0.5_s3", "initial_s4", "lam0_s4", "lam0.5_s4"]
