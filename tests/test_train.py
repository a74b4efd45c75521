"""The training loop (train.py) on tiny random models: learning, ranks, kill and resume."""
import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers.modeling_layers import GradientCheckpointingLayer

from persuarena import arena
from persuarena import models
from persuarena import rpo
from persuarena.rollout import Episode
from lab import checkpoints, cli, jsonl, loggers, presets, runs, steps
from persuarena import train
from rank_helpers import hashed_decision
import warm


TINY = ["--preset", "tiny", "--judge", "none", "--save-every", "1000"]
COMPARED = ("loss", "grad_norm", "reward_mean", "belief_change", "kl", "persuader_tokens")


def parse_train(argv):
    return cli.train_args(argv, train)


def tiny_run(tmp_path, scenarios, name, *extra):
    return train.main(TINY + ["--scenarios", scenarios, "--out", str(tmp_path), "--name", name,
                              *map(str, extra)])


@pytest.mark.slow
def test_learning_raises_the_persuadees_belief(tmp_path, short_scenarios, monkeypatch):
    """Dense reward only (lambda 1, no anchor, no KL), deterministic persuadee, three-turn
    episodes: the trained policy moves the persuadee's belief up against a frozen copy on the
    same seeds (the same instances and random streams), while its groups still differ (a
    collapsed group's gradient is 0: at T_max 3 and this lr groups begin to collapse to one
    message from step ~17, 70% of them by step 30, so the run stops at 12 and compares its last
    6 steps: gain +0.036, flipped -0.009 here); the same loop with the advantage's sign flipped
    moves it down. Multi-turn credit rests on the
    dense term's per-turn baseline (rpo.DENSE_BASELINE; DECISIONS.md: Dense baseline)."""
    args = ("--steps", 12, "--lam", 1, "--no-anchor", "--kl-beta", 0, "--group-size", 4,
            "--instances", 2, "--t-max", 3, "--max-new-tokens", 8, "--persuadee-temperature", 0,
            "--save-every", 12)
    last = lambda history, key="belief_change": [m[key] for m in history[-6:]]
    frozen = last(tiny_run(tmp_path, short_scenarios, "frozen", *args, "--lr", 0,
                           "--updates-per-batch", 1))  # its weights never move: one pass will do
    history = tiny_run(tmp_path, short_scenarios, "trained", *args, "--lr", 1.5e-2)
    trained, collapsed = last(history), last(history, "collapsed_group_share")
    gain = sum(t - f for t, f in zip(trained, frozen)) / len(frozen)
    original = rpo.group_advantages
    monkeypatch.setattr(rpo, "group_advantages",
                        lambda *a, **k: [[-x for x in ep] for ep in original(*a, **k)])
    flipped = last(tiny_run(tmp_path, short_scenarios, "flipped", *args, "--lr", 1.5e-2))
    loss = sum(t - f for t, f in zip(flipped, frozen)) / len(frozen)
    assert sum(collapsed) / len(collapsed) < 0.5, collapsed
    assert gain > 0.005, (trained, frozen)
    assert loss < -0.005, (flipped, frozen)


def run_script(argv, env_extra=None):
    """`python *argv` from the repository root, one thread, stderr into stdout: started warm
    (tests/warm.py: the imports paid once per worker)."""
    return warm.popen(argv, dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {})),
                      stderr=subprocess.STDOUT)


def run_ranks(argv, env_extra=None):
    """torchrun --nproc_per_node 2 --standalone *argv, its ranks started warm (tests/warm.py)."""
    return warm.ranks(argv, dict(os.environ, **(env_extra or {})))


def one_and_two_ranks(script, args, env=None, timeout=300, one=None):
    """Run `script args` as torchrun's 2 gloo ranks (--name two, on a free port; warm.ranks)
    and as one process (--name one), both to a zero exit. The one process is this
    one (its imports are paid already), running one(argv), train.main by default, while the
    ranks start; `script` must then do what one does. Returns what the ranks printed."""
    two = run_ranks([script, *args, "--name", "two"], env)
    (one or train.main)([str(a) for a in args] + ["--name", "one"])
    out = two.communicate(timeout=timeout)[0]
    assert two.returncode == 0, out[-3000:]
    return out


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_kill_and_resume_reaches_the_same_metrics(tmp_path, short_scenarios, capsys):
    """kill -9 after the step-2 checkpoint, --resume (here, from the run's files alone): step 3
    equals an uninterrupted run's."""
    common = TINY + ["--scenarios", short_scenarios, "--out", str(tmp_path), "--steps", "3",
                     "--save-every", "2", "--instances", "2", "--group-size", "2",
                     "--max-new-tokens", "6"]
    killed = run_script(["train.py", *common, "--name", "killed"])
    latest = tmp_path / "killed" / "latest"
    deadline = time.time() + 300
    while not (latest.exists() and latest.read_text() == "checkpoint-2") and time.time() < deadline:
        assert killed.poll() is None, "the run ended before it could be killed"
        time.sleep(0.02)
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait()
    train.main([str(a) for a in common] + ["--name", "killed", "--resume"])
    out = capsys.readouterr().out
    assert "resumed from step 2" in out, out[-3000:]
    train.main([str(a) for a in common] + ["--name", "whole"])  # the uninterrupted run
    a, b = metrics(tmp_path / "whole"), metrics(tmp_path / "killed")
    assert [m["step"] for m in b] == [1, 2, 3]
    for key in COMPARED:
        assert abs(a[2][key] - b[2][key]) <= 1e-6 * max(1.0, abs(a[2][key])), key
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(tmp_path / "killed" / "checkpoint-3")


def test_update_gradient_ignores_everything_but_the_persuaders_tokens(tmp_path):
    """train.policy_update on a tiny model: garbage sampling log-probs outside the persuader's
    messages change no gradient; a persuader token's log-prob does."""
    import copy
    import argparse as ap

    import torch

    from persuarena import models
    model = models.random_model("tiny-llama")[0]
    args = ap.Namespace(micro_batch=2, persuader_temperature=1.0, kl_beta=0.01, clip_low=0.2,
                        clip_high=0.28, dtype="float32")
    torch.manual_seed(0)
    ids = torch.randint(3, 600, (2, 12)).tolist()
    turn_ids = [[0, 0, 0, 1, 1, 0, 0, 2, 2, 0, 0, 0], [0, 0, 1, 1, 1, 0, 2, 0, 0, 0, 0, 0]]
    def records(logprob):
        return [Episode(ids=i, turn_ids=t, logprobs=[logprob(k, tt) for k, tt in enumerate(t)])
                for i, t in zip(ids, turn_ids)]
    def grads(recs, adv):
        policy = copy.deepcopy(model).requires_grad_(True)
        opt = torch.optim.SGD(policy.parameters(), lr=0.0)
        policy.zero_grad()
        stats = train.policy_update(policy, model, opt, recs, adv, args, torch.device("cpu"), 1)
        return stats["grad_norm"], policy
    clean = records(lambda k, t: -2.0 if t else 0.0)
    garbage = records(lambda k, t: -2.0 if t else -1e4 + k)
    adv = [[0.5, -1.0], [1.5, 0.25]]
    base, _ = grads(clean, adv)
    assert base > 0
    assert grads(garbage, adv)[0] == pytest.approx(base, rel=1e-6)
    moved = records(lambda k, t: -2.5 if t == 2 else (-2.0 if t else 0.0))
    assert grads(moved, adv)[0] != pytest.approx(base, rel=1e-3)


def test_tensorboard_events_hold_the_metrics_the_heldout_summary_and_samples(tmp_path, short_scenarios):
    """--log tensorboard: tensorboard's own event reader finds every number of metrics.jsonl
    under train/ at its step, the held-out summary under heldout/, and the sample table."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tiny_run(tmp_path, short_scenarios, "tb", "--steps", 2, "--eval-every", 2, "--eval-limit", 1,
             "--log", "tensorboard")
    run = tmp_path / "tb"
    events = EventAccumulator(str(run), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    expected = {(f"train/{k}", m["step"]): v for m in metrics(run) for k, v in loggers.scalars(m).items()
                if k != "step"}
    heldout = json.loads((run / "eval-2" / "summary.json").read_text())
    expected.update({(f"heldout/{k}", 2): v for k, v in loggers.scalars(heldout).items()})
    assert {tag for tag, _ in expected} == tags and ("heldout/by_domain/healthcare/n", 2) in expected
    for (tag, step), value in expected.items():
        [event] = [e for e in events.Scalars(tag) if e.step == step]
        assert event.value == pytest.approx(value, rel=1e-6, abs=1e-6), tag
    assert "samples/text_summary" in events.Tags()["tensors"]
    [table] = [e for e in events.Tensors("samples/text_summary") if e.step == 1]
    first = json.loads((run / "samples-1.json").read_text())[0]
    assert first["id"] in table.tensor_proto.string_val[0].decode()


def test_wandb_runs_offline(tmp_path, short_scenarios, monkeypatch):
    """--log wandb with no W&B settings: an offline run in runs/NAME/wandb, nothing sent."""
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    tiny_run(tmp_path, short_scenarios, "wb", "--steps", 1, "--log", "wandb")
    [offline] = (tmp_path / "wb" / "wandb").glob("offline-run-*")
    assert list(offline.glob("*.wandb"))


def test_trackio_logs_each_steps_metrics(tmp_path, short_scenarios):
    """--log trackio: a trackio run named as the run (in the session's TRACKIO_DIR, conftest.py),
    holding each step's metrics as metrics.jsonl has them."""
    sqlite = pytest.importorskip("trackio.sqlite_storage")
    name = f"tk-{tmp_path.name}"
    tiny_run(tmp_path, short_scenarios, name, "--steps", 1, "--log", "trackio")
    logs = sqlite.SQLiteStorage.get_logs("persuarena", name)
    logged = {k: v for row in logs for k, v in row.items()}  # the rows of step 1
    [step] = metrics(tmp_path / name)
    assert logged["train/reward_mean"] == pytest.approx(step["reward_mean"])
    assert logged["train/belief_change"] == pytest.approx(step["belief_change"])


def test_a_missing_logger_package_is_a_one_line_exit(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now raises ImportError
    with pytest.raises(SystemExit) as e:
        parse_train(["--log", "wandb"])
    assert str(e.value) == "train.py: --log wandb needs the wandb package: pip install wandb"


# -----------------------------------------------------------------------------
# arguments, run folders, checkpoints, non-finite values


def test_a_smollm2_run_says_once_why_outcomes_stay_still_and_what_next():
    from lab import steps
    args = parse_train(["--preset", "cpu", "--out", "/nonexistent-runs", "--name", "r"])
    note, = steps.small_persuadee_note(args)
    assert "writes no decision tag" in note and "--plot-run /nonexistent-runs/r" in note
    assert "--persuader /nonexistent-runs/r/checkpoint-3" in note
    assert steps.small_persuadee_note(parse_train(["--preset", "tiny", "--out", "/x"])) == []
    args = parse_train(["--preset", "cpu", "--out", "/x", "--decision", "logit"])
    assert steps.small_persuadee_note(args) == []


def test_rpo_owns_the_defaults(monkeypatch):
    """train.py re-exports none of rpo's constants; its defaults read them when parsing."""
    for name in ("LAMBDA", "ANCHOR", "KL_BETA", "CLIP_LOW", "CLIP_HIGH", "UPDATES_PER_BATCH"):
        assert not hasattr(train, name)
    edited = dict(LAMBDA=0.25, ANCHOR=not rpo.ANCHOR, KL_BETA=0.5, CLIP_LOW=0.1, CLIP_HIGH=0.4,
                  UPDATES_PER_BATCH=3)
    for name, value in edited.items():
        monkeypatch.setattr(rpo, name, value)
    args = parse_train(["--preset", "paper", "--plan", "--out", "/nonexistent-runs"])
    assert (args.lam, args.anchor, args.kl_beta, args.clip_low, args.clip_high,
            args.updates_per_batch) == tuple(edited.values())


SHIPPED = dict(steps=200, instances=16, group_size=8, lr=1e-6, micro_batch=4, eval_every=20,
               eval_limit=120, save_every=20, t_max=6, eval_t_max=10, max_new_tokens=256,
               updates_per_batch=4)  # as shipped


def test_defaults():
    """The paper's values and this project's defaults (DECISIONS.md), gathered here: the one
    test an edited default breaks; every other test derives from the constants."""
    assert (rpo.LAMBDA, rpo.KL_BETA, rpo.CLIP_LOW, rpo.CLIP_HIGH) == (0.5, 0.01, 0.2, 0.28)
    assert rpo.UPDATES_PER_BATCH == 4  # verl's default: 1024 prompts a batch, 256 a mini-batch
    assert rpo.ANCHOR is False and (rpo.STD_EPS, rpo.STRATEGY_WEIGHT) == (1e-6, 0.5)
    assert rpo.GOAL == {"ACCEPT": 3.0, "CONDITIONAL_ACCEPT": 1.0, "PENDING": 0.0, "REJECT": -1.0,
                        "WALK_AWAY": -2.0}  # the paper's accept - conditional gap: 2.0
    assert rpo.ANCHOR_BELIEF == {"ACCEPT": 1.0, "CONDITIONAL_ACCEPT": 0.5, "PENDING": 0.0,
                                 "REJECT": -1.0, "WALK_AWAY": -1.0}
    assert (arena.T_MAX_TRAIN, arena.T_MAX_EVAL, arena.JUDGE_RETRIES) == (6, 10, 3)
    assert (arena.UPGRADE_WINDOW, arena.MAX_REJECTIONS, arena.NEGATION_WINDOW) == (2, 2, 3)
    paper = presets.preset_values("paper")
    assert (paper["group_size"], paper["instances"], paper["lr"], paper["max_new_tokens"]) == (8, 16, 1e-6, 256)
    assert {k: presets.owned(k) for k in presets.OWNERS} == SHIPPED


def test_the_paper_numbers_are_train_constants_and_their_flags_defaults(monkeypatch, tmp_path):
    """An edit of train.GROUP_SIZE or train.LR reaches a paper run (no preset holds them), and
    the cpu preset's own group size still wins over it."""
    monkeypatch.setattr(train, "GROUP_SIZE", 6)
    monkeypatch.setattr(train, "LR", 3e-6)
    args = parse_train(["--preset", "paper", "--plan", "--out", str(tmp_path)])
    assert (args.group_size, args.lr, args.instances) == (6, 3e-6, train.INSTANCES)
    cpu = parse_train(["--preset", "cpu", "--out", str(tmp_path)])
    assert cpu.group_size == presets.PRESETS["cpu"]["group_size"] != 6
    assert parse_train(["--preset", "cpu", "--group-size", "5", "--out", str(tmp_path)]).group_size == 5


def test_the_cpu_preset_takes_bf16_where_the_cpu_has_its_units(tmp_path, monkeypatch, capsys):
    """The cpu preset's dtype follows the CPU's flags (/proc/cpuinfo): bfloat16 with x86's
    avx512_bf16 or amx_bf16 or Arm's bf16, float32 without (a name is no evidence), printed with
    why; --dtype float32 is the user's and prints nothing; CPU_BF16, or else PERSUARENA_CPU_BF16,
    overrides the detection (a bad value refused in one line)."""
    monkeypatch.setattr(presets, "CPU_BF16", None)
    monkeypatch.delenv(presets.CPU_BF16_ENV, raising=False)
    info = tmp_path / "cpuinfo"
    monkeypatch.setattr(presets, "CPUINFO_PATH", str(info))
    for text, dtype in (("flags\t: fpu avx512f avx512_bf16 avx512_vnni\n", "bfloat16"),
                        ("flags\t: fpu amx_tile amx_bf16\n", "bfloat16"),
                        ("Features\t: fp asimd bf16 i8mm\n", "bfloat16"),
                        ("model name\t: bf16 Lake\nflags\t: fpu avx512f avx2\n", "float32"),
                        ("Features\t: fp asimd sve\n", "float32")):
        info.write_text(text)
        capsys.readouterr()
        assert parse_train(["--preset", "cpu", "--out", str(tmp_path)]).dtype == dtype, text
        out = capsys.readouterr().out
        assert f"dtype {dtype} (this CPU" in out and "--dtype" in out, out
    assert parse_train(["--preset", "cpu", "--dtype", "float32", "--out",
                        str(tmp_path)]).dtype == "float32"
    assert "dtype" not in capsys.readouterr().out
    monkeypatch.setattr(presets, "CPUINFO_PATH", str(tmp_path / "missing"))
    assert presets.cpu_dtype()[0] == "float32" and presets.bf16_units() == ()
    monkeypatch.setenv(presets.CPU_BF16_ENV, "1")
    assert presets.cpu_dtype() == ("bfloat16", "PERSUARENA_CPU_BF16=1")
    monkeypatch.setenv(presets.CPU_BF16_ENV, "yes")
    with pytest.raises(SystemExit, match="PERSUARENA_CPU_BF16='yes'"):
        presets.cpu_dtype()
    monkeypatch.setattr(presets, "CPU_BF16", False)  # the constant over the environment
    assert presets.cpu_dtype()[0] == "float32"
    monkeypatch.setattr(presets, "CPU_BF16", True)
    assert presets.cpu_dtype()[0] == "bfloat16"
    assert parse_train(["--preset", "tiny", "--out", str(tmp_path)]).dtype == "float32"


def test_no_preset_repeats_a_constants_own_value(monkeypatch):
    """A preset holds only what differs from the owning constants as shipped (a fork's edit of
    a constant, say train.LR to one-gpu's 1e-5, is its own and breaks only test_defaults); a
    repeated value (here the tiny preset given train.py's own MICRO_BATCH) is caught."""
    monkeypatch.setattr(presets, "owned", SHIPPED.get)
    assert presets.repeats() == []
    monkeypatch.setitem(presets.PRESETS, "tiny", dict(presets.PRESETS["tiny"],
                                                       micro_batch=SHIPPED["micro_batch"]))
    assert presets.repeats() == [f"tiny.micro_batch {SHIPPED['micro_batch']} (= train.MICRO_BATCH)"]
    monkeypatch.undo()
    monkeypatch.setattr(train, "LR", presets.PRESETS["one-gpu"]["lr"])  # a fork's edit
    monkeypatch.setattr(presets, "owned", SHIPPED.get)
    assert presets.repeats() == []


def test_a_truncating_persuader_sampling_is_refused_in_one_line(monkeypatch, tmp_path):
    """top_p or top_k on the persuader's rollout.SAMPLING would change the rollout but not the
    loss (off-policy): refused before any model loads, naming it."""
    from persuarena import engine
    from persuarena import rollout
    paper = rollout.SAMPLING["paper"]
    monkeypatch.setitem(rollout.SAMPLING, "paper", (paper[0]._replace(top_p=0.9), paper[1]))
    with pytest.raises(SystemExit) as e:
        parse_train(["--preset", "tiny", "--out", str(tmp_path)])
    assert str(e.value).startswith("train.py: --sampling paper gives the persuader top_p 0.9")
    assert "\n" not in str(e.value)
    monkeypatch.setitem(rollout.SAMPLING, "paper", (engine.Sampling(1.0, top_k=50), paper[1]))
    with pytest.raises(SystemExit, match="top_k 50"):
        parse_train(["--preset", "tiny", "--out", str(tmp_path)])


def test_a_nonfinite_check_taken_out_is_not_a_crash_and_an_unknown_one_refused(monkeypatch, tmp_path):
    """train.NONFINITE_CHECKS edited: a name taken out stops that check (the step goes ahead),
    a name no step measures is refused in one line."""
    monkeypatch.setattr(train, "NONFINITE_CHECKS", ("logprobs", "grad_norm"))
    monkeypatch.setattr(rpo, "policy_loss", lambda *a, **k: (a[0].sum() * float("nan"),
                                                             dict(kl=0.0, clip_frac=0.0, ratio_mean=1.0, tokens=1)))
    args = parse_train(["--preset", "tiny", "--out", str(tmp_path), "--kl-beta", "0"])
    policy = models.load_model("random:tiny-llama", dtype=torch.float32)[0]
    record = Episode(ids=[1, 2, 3, 4], turn_ids=[0, 0, 1, 1], logprobs=[0.0, 0.0, -1.0, -1.0])
    stats = train.policy_update(policy, None, torch.optim.AdamW(policy.parameters()), [record],
                                [[1.0]], args, torch.device("cpu"), 1)
    assert stats["step_skipped"] == 1 and stats["nonfinite"] == ["grad_norm"]  # loss unchecked
    monkeypatch.setattr(train, "NONFINITE_CHECKS", ("loss", "reward"))
    with pytest.raises(SystemExit, match=r"^train.py: train.NONFINITE_CHECKS names reward, which"):
        parse_train(["--preset", "tiny", "--out", str(tmp_path)])


@pytest.fixture
def no_model_loads(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the arguments were checked")
    monkeypatch.setattr(models, "load_model", refuse)


@pytest.mark.parametrize("extra, says", [
    (["--t-max", "0"], "--t-max 0"), (["--group-size", "0"], "--group-size 0"),
    (["--instances", "0"], "--instances 0"), (["--micro-batch", "0"], "--micro-batch 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens 0"), (["--dtype", "foo"], "--dtype foo"),
    (["--persuader-temperature", "-1"], "--persuader-temperature -1"),
    (["--persuadee-temperature", "nan"], "--persuadee-temperature nan"),
    (["--kl-beta", "-0.1"], "--kl-beta -0.1"), (["--clip-low", "2"], "--clip-low 2"),
    (["--lr", "inf"], "--lr inf"), (["--persuader", "/no/such/model"], "--persuader /no/such/model"),
    (["--persuadee", "random:nope"], "--persuadee random:nope"),
    (["--instances", str(arena.N_TRAIN_INSTANCES + 1)], "exceeds"),
    (["--resume"], "no checkpoint"), (["--resume", "--overwrite"], "contradict"),
    (["--scenarios", "/nonexistent"], "--scenarios /nonexistent"),
    (["--judge", "/no/such/judge"], "--judge /no/such/judge"),
    (["--max-new-tokens", "-3"], "--max-new-tokens -3"), (["--eval-fidelity", "-1"], "--eval-fidelity -1"),
    (["--group-size", "1000000000"], "--group-size 1000000000 is above"),
    (["--seed", "99999999999999999999999"], "--seed 99999999999999999999999"),
    (["--seed", "-1"], "--seed -1"), (["--scenarios", "/dev/zero"], "not a regular file"),
])
def test_bad_arguments_fail_before_any_model_loads(tmp_path, short_scenarios, no_model_loads, extra, says):
    with pytest.raises(SystemExit) as e:
        train.main(TINY + ["--scenarios", short_scenarios, "--out", str(tmp_path), "--name", "x", *extra])
    message = str(e.value.code)
    assert message.startswith("train.py: ") and says in message and "\n" not in message
    assert not (tmp_path / "x").exists()


def test_a_folder_that_is_no_model_is_refused(tmp_path, no_model_loads):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="not a model folder"):
        parse_train(["--preset", "tiny", "--persuadee", str(tmp_path / "empty"), "--out", str(tmp_path)])


def test_group_size_one_warns(tmp_path, capsys):
    parse_train(["--preset", "tiny", "--group-size", "1", "--out", str(tmp_path)])
    assert "--group-size 1" in capsys.readouterr().err


def test_an_existing_run_is_refused_unless_overwrite(tmp_path, short_scenarios, monkeypatch):
    """Reusing --name without --resume touches nothing; --overwrite replaces the old run."""
    run = tmp_path / "old"
    (run / "checkpoint-2").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    with monkeypatch.context() as m:
        m.setattr(models, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
        with pytest.raises(SystemExit, match="--overwrite"):
            tiny_run(tmp_path, short_scenarios, "old", "--steps", 1)
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    assert (run / "checkpoint-2").is_dir()
    tiny_run(tmp_path, short_scenarios, "old", "--steps", 1, "--overwrite", "--judge", "random:tiny-qwen3")
    assert [m["step"] for m in metrics(run)] == [1]
    assert metrics(run)[0]["judge_failed_share"] == 1.0  # a random judge never writes a verdict
    assert not (run / "checkpoint-2").exists() and (run / "latest").read_text() == "checkpoint-1"


def test_metrics_rewrite_is_atomic_and_drops_a_partial_last_line(tmp_path, monkeypatch, capsys):
    path = tmp_path / "metrics.jsonl"
    full = "".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3))
    path.write_text(full + '{"step": 4, "lo')
    def killed(*a):
        raise OSError(errno.ENOSPC, "No space left on device")
    with monkeypatch.context() as m:  # a write that dies before the rename leaves the old file
        m.setattr(os, "replace", killed)
        with pytest.raises(SystemExit, match="metrics.jsonl.*No space left"):
            steps.resume_metrics(path, 2)
    assert path.read_text() == full + '{"step": 4, "lo' and not (tmp_path / "metrics.jsonl.tmp").exists()
    steps.resume_metrics(path, 2)
    assert path.read_text() == full[:full.index('{"step": 3')]
    assert "partial last line 4" in capsys.readouterr().err
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(SystemExit, match="line 2 is not valid JSON"):
        steps.resume_metrics(path, 2)


def test_metrics_lines_are_valid_json_with_non_finite_values():
    line = json.dumps(jsonl.finite({"step": 1, "loss": float("nan"), "kl": float("inf"), "x": 2.0}),
                      allow_nan=False)
    assert json.loads(line) == {"step": 1, "loss": None, "kl": None, "x": 2.0}


def trained_policy(arch="llama", seed=0):
    """A tiny policy and an AdamW that has taken one step (so the optimizer has state)."""
    from conftest import tiny_model
    policy = tiny_model(arch, seed=seed).requires_grad_(True)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    policy(torch.tensor([[5, 6, 7]])).logits.sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return policy, optimizer


@pytest.fixture
def saved_run(tmp_path, tokenizer):
    policy, optimizer = trained_policy()
    run = tmp_path / "run"
    run.mkdir()
    checkpoints.save_checkpoint(run, 1, policy, optimizer, tokenizer, 0)
    return run, policy


class Payload:
    """Pickled into a forged trainer.pt: loading it with weights_only=False would create `path`."""
    path = None

    def __reduce__(self):
        return open, (str(self.path), "w")


def _rename_a_key(folder):
    from safetensors.torch import load_file, save_file
    sd = load_file(folder / "model.safetensors")
    sd["model.layers.0.mlp.renamed.weight"] = sd.pop("model.layers.0.mlp.up_proj.weight")
    save_file(sd, folder / "model.safetensors")


CORRUPTIONS = {
    "weights missing": (lambda f: (f / "model.safetensors").unlink(), "no *.safetensors"),
    "weights renamed": (lambda f: (f / "model.safetensors").rename(f / "weights.bin"), "no *.safetensors"),
    "weights truncated": (lambda f: (f / "model.safetensors").write_bytes(b"\x08\x00\x00"), "cannot be read"),
    "a key renamed": (_rename_a_key, "do not match the policy (1 missing"),
    "trainer.pt missing": (lambda f: (f / "trainer.pt").unlink(), "trainer.pt is missing"),
    "latest outside the run": (lambda f: (f.parent / "latest").write_text("../elsewhere/checkpoint-1"),
                               "not a checkpoint-STEP folder"),
    "latest to a missing step": (lambda f: (f.parent / "latest").write_text("checkpoint-7"),
                                 "not a checkpoint-STEP folder"),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_a_bad_checkpoint_is_one_clear_line(saved_run, kind):
    run, _ = saved_run
    corrupt, says = CORRUPTIONS[kind]
    corrupt(run / "checkpoint-1")
    fresh, optimizer = trained_policy(seed=1)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(SystemExit) as e:
        checkpoints.load_checkpoint(run, fresh, optimizer, torch.device("cpu"))
    assert says in str(e.value.code) and "\n" not in str(e.value.code)
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())


def test_a_pickled_payload_is_refused_and_never_runs(saved_run, tmp_path):
    run, _ = saved_run
    Payload.path = tmp_path / "payload-ran"
    torch.save({"step": 1, "optimizer": Payload(), "torch_rng": torch.get_rng_state()},
               run / "checkpoint-1" / "trainer.pt")
    fresh, optimizer = trained_policy(seed=1)
    with pytest.raises(SystemExit, match="trainer.pt is not a checkpoint train.py wrote"):
        checkpoints.load_checkpoint(run, fresh, optimizer, torch.device("cpu"))
    assert not Payload.path.exists()


def test_a_foreign_architecture_is_refused(tmp_path, tokenizer):
    policy, optimizer = trained_policy("qwen3")
    checkpoints.save_checkpoint(tmp_path, 3, policy, optimizer, tokenizer, 0)
    fresh, optimizer = trained_policy("llama")
    with pytest.raises(SystemExit, match="do not match the policy.*unexpected"):
        checkpoints.load_checkpoint(tmp_path, fresh, optimizer, torch.device("cpu"))


def test_the_genuine_checkpoint_loads_with_weights_only(saved_run, monkeypatch):
    run, policy = saved_run
    loads = []
    original = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: (loads.append(k.get("weights_only")), original(*a, **k))[1])
    fresh, optimizer = trained_policy(seed=1)
    assert checkpoints.load_checkpoint(run, fresh, optimizer, torch.device("cpu")) == 1
    assert loads == [True]
    assert all(torch.equal(policy.state_dict()[k], v) for k, v in fresh.state_dict().items())
    assert optimizer.state_dict()["state"]


@pytest.mark.parametrize("failing", ["torch.save", "save_pretrained"])
def test_a_full_disk_keeps_the_previous_checkpoint(saved_run, tokenizer, monkeypatch, failing):
    """A write cut by a full disk: one line naming the folder, the cause and the free space; the
    temporary folder is gone and `latest` still points at the intact previous checkpoint."""
    run, policy = saved_run
    def torch_save(obj, path, *a, **k):
        Path(path).write_bytes(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed "
                           "writing file data/0: file write failed")
    def save_pretrained(self, folder, *a, **k):
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "model.safetensors").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")
    optimizer = torch.optim.AdamW(policy.parameters())
    if failing == "torch.save":
        monkeypatch.setattr(torch, "save", torch_save)
    else:
        monkeypatch.setattr(type(policy), "save_pretrained", save_pretrained)
    with pytest.raises(SystemExit) as e:
        checkpoints.save_checkpoint(run, 2, policy, optimizer, tokenizer, 0)
    message = str(e.value.code)
    assert "checkpoint-2" in message and str(run) in message and "MiB free" in message
    assert "checkpoint-1 is intact" in message and "\n" not in message
    if failing == "save_pretrained":  # ENOSPC says so; torch's own words are named beside the free space
        assert "the disk is full" in message
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint-1", "latest"]
    assert (run / "latest").read_text() == "checkpoint-1"
    monkeypatch.undo()
    fresh, optimizer = trained_policy(seed=1)
    assert checkpoints.load_checkpoint(run, fresh, optimizer, torch.device("cpu")) == 1


def test_non_finite_weights_are_never_saved(saved_run, tokenizer):
    run, policy = saved_run
    with torch.no_grad():
        policy.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    with pytest.raises(SystemExit, match="up_proj.weight is not finite.*checkpoint-1"):
        checkpoints.save_checkpoint(run, 2, policy, torch.optim.AdamW(policy.parameters()), tokenizer, 0)
    assert (run / "latest").read_text() == "checkpoint-1" and not (run / "checkpoint-2").exists()


def test_a_non_finite_log_prob_skips_the_step(tmp_path, short_scenarios, monkeypatch):
    """One NaN sampling log-prob on a persuader token: the step is skipped and counted, the
    weights stay finite and are saved, and every metrics line is valid JSON."""
    original = train.rollout.rollout_episodes
    def poisoned(*a, **k):
        records = original(*a, **k)
        r = records[0]
        r.logprobs[r.turn_ids.index(1)] = float("nan")
        return records
    monkeypatch.setattr(train.rollout, "rollout_episodes", poisoned)
    history = tiny_run(tmp_path, short_scenarios, "nan", "--steps", 1)
    assert [m["step_skipped"] for m in history] == [1]
    assert history[0]["nonfinite"] == ["logprobs", "loss", "grad_norm"]
    lines = (tmp_path / "nan" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(l)["step_skipped"] for l in lines] == [1]
    assert "NaN" not in "".join(lines)
    from safetensors.torch import load_file
    saved = load_file(tmp_path / "nan" / "checkpoint-1" / "model.safetensors")
    assert all(torch.isfinite(v).all() for v in saved.values())
    initial = models.random_model("tiny-llama")[0].state_dict()
    assert all(torch.equal(initial[k], v) for k, v in saved.items())  # no step was taken


HASHED_PERSUADEE = '''
import sys
from persuarena import arena, train
from rank_helpers import hashed_decision
arena.parse_decision = hashed_decision
train.main(sys.argv[1:])
'''
RESUME_ON_TWO_RANKS = '''
import os, sys, torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from persuarena import arena, train
from lab import checkpoints
from rank_helpers import hashed_decision
arena.parse_decision = hashed_decision  # as the ranks' first two steps and the unbroken run
real = torch.load
def load(path, *a, **k):
    print(f"rank {os.environ['RANK']} read {os.path.basename(str(path))}", flush=True)
    return real(path, *a, **k)
torch.load = load
real_checkpoint = checkpoints.load_checkpoint
def load_checkpoint(run_dir, policy, optimizer, *a, **k):  # then the state gathered, to compare
    step = real_checkpoint(run_dir, policy, optimizer, *a, **k)
    model, optim = get_state_dict(policy, optimizer,
                                  options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if os.environ["RANK"] == "0":
        folder = run_dir / f"checkpoint-{step}"
        saved, trainer = load_file(folder / "model.safetensors"), real(folder / "trainer.pt")
        same = lambda a, b: (torch.equal(a, b) if isinstance(a, torch.Tensor) else
                             a.keys() == b.keys() and all(same(a[n], b[n]) for n in a)
                             if isinstance(a, dict) else  # betas come back a list
                             len(a) == len(b) and all(map(same, a, b))
                             if isinstance(a, (list, tuple)) else a == b)
        tied = policy.lm_head.weight is policy.model.embed_tokens.weight
        print(f"resumed state bit-equal: weights {all(same(v, model[n]) for n, v in saved.items())} "
              f"optimizer {same(trainer['optimizer'], optim)} tied {tied}", flush=True)
    return step
checkpoints.load_checkpoint = load_checkpoint
train.main(sys.argv[1:])
'''
DIAGNOSTICS = ("dead_group_share", "dead_goal_share", "dead_rescued_share", "dense_share", "outcome_term_abs",
               "dense_term_abs", "negative_process_share")


def pooled_by_hand(rows, lam):
    """The step diagnostics of rollouts.jsonl rows written out with numpy: A_out from the group's
    R (no judge: R = GOAL), D~ the return-to-go centred on the mean of its turn index over the
    members that reached it (rpo.DENSE_BASELINE "turn")."""
    groups = {}
    for row in rows:
        groups.setdefault(row["group"], []).append(row)
    dead = rescued = 0
    abs_dense = abs_total = 0.0
    for members in groups.values():
        R = np.array([m["goal"] for m in members], dtype=float)
        a_out = (R - R.mean()) / (R.std(ddof=1) + 1e-6) if np.ptp(R) > 0 else np.zeros_like(R)
        togo = [np.cumsum(np.diff(m["beliefs"])[::-1] / 2)[::-1] for m in members]
        turn_mean = [np.mean([d[t] for d in togo if len(d) > t]) for t in range(max(map(len, togo)))]
        centred = [d - np.array(turn_mean[:len(d)]) for d in togo]
        A = [a + lam * c for a, c in zip(a_out, centred)]
        if np.ptp(R) == 0:
            dead += 1
            rescued += any(np.abs(x).max() > 1e-9 for x in A)
        abs_dense += sum(np.abs(lam * c).sum() for c in centred)
        abs_total += sum(np.abs(x).sum() for x in A)
    return {"dead_group_share": dead / len(groups), "dead_rescued_share": rescued / dead if dead else 0.0,
            "dense_share": abs_dense / abs_total}


@pytest.mark.xdist_group("ranks")  # one 2-rank run at a time: three processes each
@pytest.mark.slow
def test_two_ranks_match_one_process_and_pool_its_diagnostics(tmp_path, short_scenarios):
    """torchrun with 2 CPU ranks (gloo, FSDP) and one process, same global batch, both sides
    sampling (the tiny preset's persuader at T 1, persuadee at T 0.7): the same rollouts, and the
    same loss, gradient norm, KL and rewards at step 1 and, after sharded AdamW steps, at step 2: each episode's random streams are keyed by (seed, instance, group index, side), never
    by the rank or the batch it shares. Dead groups, rescued share, dense share (and the rest) are
    pooled over ranks, numerators and denominators summed before the division: the ranks log one
    process's figures, which equal a numpy computation from rollouts.jsonl, and differ from the
    mean of the two ranks' own ratios in some step (so a rank-averaged figure would fail this).
    The persuader ties its input and output embeddings (one matrix, as Qwen3-4B's). The ranks'
    step-2 checkpoint then resumes on two fresh ranks, only rank 0 reading trainer.pt: the
    resumed weights and AdamW state, gathered, equal the saved ones bit for bit, the embeddings
    still tied, and step 3 and its checkpoint equal the unbroken run's (the one process, to step
    3). (Resuming in the same ranks, their process group started again, hung once in CI.)"""
    script = tmp_path / "hashed_persuadee.py"
    script.write_text(HASHED_PERSUADEE)
    env = {"PYTHONPATH": os.pathsep.join((str(Path(__file__).parent.parent), str(Path(__file__).parent)))}
    common = TINY + ["--scenarios", short_scenarios, "--out", str(tmp_path), "--steps", "2", "--instances", "4",
                     "--group-size", "2", "--lam", "0.5", "--max-new-tokens", "3",
                     "--persuader", "random:tiny-qwen3-tied", "--updates-per-batch", "2"]
    def hashed(argv):  # what the script does, in this process, on to step 3 (the unbroken run)
        with pytest.MonkeyPatch.context() as m:
            m.setattr(arena, "parse_decision", hashed_decision)
            train.main(argv + ["--steps", "3"])
    one_and_two_ranks(str(script), common, env, timeout=600, one=hashed)
    rollouts = {k: [r for line in (tmp_path / k / "rollouts.jsonl").read_text().splitlines()
                    if (r := json.loads(line))["step"] <= 2]  # the ranks' two steps, then resumed
                for k in ("one", "two")}
    assert rollouts["one"] == rollouts["two"] and len(rollouts["one"]) == 2 * 4 * 2
    assert all(r["b_0"] == r["beliefs"][0] and r["b_T"] == r["beliefs"][-1] for r in rollouts["one"])
    discriminating = False
    for a, b in zip(metrics(tmp_path / "one")[:2], metrics(tmp_path / "two")[:2], strict=True):
        for key in COMPARED:
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(a[key])), (key, a[key], b[key])
        assert a["grad_norm"] > 0
        for key in DIAGNOSTICS:
            assert a[key] == pytest.approx(b[key], abs=1e-12), (a["step"], key)
        rows = [r for r in rollouts["one"] if r["step"] == a["step"]]
        for key, value in pooled_by_hand(rows, 0.5).items():
            assert a[key] == pytest.approx(value, abs=1e-9), (a["step"], key)
        goals = {}
        for r in rows:
            goals.setdefault(r["group"], set()).add(r["goal"])
        assert a["dead_goal_share"] == pytest.approx(sum(len(g) == 1 for g in goals.values()) / len(goals))
        by_rank = [pooled_by_hand([r for r in rows if r["group"] % 2 == k], 0.5) for k in (0, 1)]
        discriminating |= any(abs((x[key] + y[key]) / 2 - a[key]) > 1e-6
                              for x, y in [by_rank] for key in x)
    assert discriminating, "every step had the same ratios on both ranks: change the hash"
    assert b["kl"] > 0  # the last step runs on the updated, sharded weights
    # the two ranks' last checkpoint resumes on two ranks, rank 0 alone reading the trainer state
    # (the weights and optimizer state are broadcast from it)
    (tmp_path / "resume_two.py").write_text(RESUME_ON_TWO_RANKS)
    resumed = run_ranks([str(tmp_path / "resume_two.py"), *common, "--steps", "3", "--name", "two",
                         "--resume"], env)
    out = resumed.communicate(timeout=600)[0]
    assert resumed.returncode == 0, out[-3000:]
    reads = sorted(line for line in out.splitlines() if line.endswith("trainer.pt"))
    assert reads == ["rank 0 read trainer.pt"] and "resumed from step 2" in out
    assert "resumed state bit-equal: weights True optimizer True tied True" in out, out[-3000:]
    rows, whole = metrics(tmp_path / "two"), metrics(tmp_path / "one")
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[2]["grad_norm"] > 0
    for key in COMPARED:
        assert abs(whole[2][key] - rows[2][key]) <= 1e-5 * max(1.0, abs(whole[2][key])), key
    wa, wb = checkpoint_weights(tmp_path / "one"), checkpoint_weights(tmp_path / "two")
    assert wa.keys() == wb.keys() and "lm_head.weight" not in wb  # one matrix, saved once
    diff = torch.cat([(wa[k] - wb[k]).flatten() for k in wa]).abs()  # lost AdamW moments: ~lr
    assert diff.max() <= 1e-4 and (diff > 1e-6).float().mean() < 1e-3  # (a near-0 gradient's sign)

# -----------------------------------------------------------------------------
# precision and memory at the paper's scale, in miniature


def checkpoint_weights(run_dir):
    from safetensors.torch import load_file
    return load_file(run_dir / (run_dir / "latest").read_text() / "model.safetensors")


def projections(state):
    return {k: v for k, v in state.items() if "layers." in k and k.endswith("proj.weight")}


def test_a_bf16_step_at_lr_1e6_moves_the_weights_as_fp32_adamw_does(tmp_path, short_scenarios):
    """The tiny preset in bfloat16 at lr 1e-6, one step: the checkpoint holds float32 master
    weights, and (AdamW's first step being ~lr times the gradient's sign) nearly every
    projection weight moved by about lr, as in the same run in float32 (bf16 weights would
    round such a step away: its spacing at |w| ~ 0.1 is ~5e-4)."""
    from persuarena import models
    initial = projections(models.random_model("tiny-llama")[0].state_dict())
    moved = {}
    for dtype in ("bfloat16", "float32"):
        tiny_run(tmp_path, short_scenarios, dtype, "--dtype", dtype, "--lr", 1e-6, "--steps", 1,
                 "--save-every", 1, "--updates-per-batch", 1)  # one AdamW step
        saved = projections(checkpoint_weights(tmp_path / dtype))
        assert all(v.dtype == torch.float32 for v in saved.values())
        delta = torch.cat([(saved[k] - initial[k]).flatten() for k in initial]).abs()
        moved[dtype] = delta
        assert (delta > 0.5e-6).float().mean() > 0.9, dtype
        assert 0.7e-6 < delta.median() < 1.3e-6 and delta.max() < 1.5e-6, dtype
    agree = ((moved["bfloat16"] > 0.5e-6) == (moved["float32"] > 0.5e-6)).float().mean()
    assert agree > 0.9


TORCH_2_11_RECOMPUTE = '''
import sys
from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState, TrainingState
from persuarena import train
from lab import checkpoints
checkpoints.prune_checkpoints = lambda *a: None  # checkpoint-1 kept, to compare
cast_in, cast_out = FSDPState._cast_forward_inputs, FSDPState._cast_output_dtype
def cast_inputs(self, args, kwargs):  # torch 2.11 skips it while recomputing (pytorch#159359)
    return ((args, kwargs) if self._training_state == TrainingState.PRE_BACKWARD
            else cast_in(self, args, kwargs))
FSDPState._cast_forward_inputs = cast_inputs
FSDPState._cast_output_dtype = lambda self, output: (
    output if self._training_state == TrainingState.PRE_BACKWARD else cast_out(self, output))
train.main(sys.argv[1:])
'''


BF16_RANKS_ALL = "PERSUARENA_BF16_RANKS"  # set to run the bf16 checkpointing ranks anywhere
# whether transformers checkpoints a layer's __call__, FSDP's hooks inside the recompute (5.17, a
# lent H200's), the path torch 2.11's recompute bug takes; newer ones checkpoint forward
CHECKPOINTS_CALL = "__call__" in vars(GradientCheckpointingLayer)


@pytest.mark.xdist_group("ranks")  # one 2-rank run at a time: three processes each
@pytest.mark.slow
@pytest.mark.skipif(not (CHECKPOINTS_CALL or os.environ.get(BF16_RANKS_ALL)),
                    reason="this transformers checkpoints forward, not the path torch 2.11's "
                           "recompute bug takes: runs in .ci/run's transformers 5.17 stage; "
                           f"{BF16_RANKS_ALL}=1 runs it here")
def test_two_bf16_ranks_with_activation_checkpointing_match_one_process(tmp_path, short_scenarios,
                                                                         monkeypatch):
    """bfloat16, lr 1e-6, --activation-checkpointing on, 2 steps: torchrun with 2 gloo ranks
    (FSDP2, MixedPrecisionPolicy bf16 params, fp32 gradient reduction, fp32 AdamW shards, each
    decoder layer recomputed in the backward) against one process (autocast from fp32 master
    weights, the same recomputation): the same step-1 gradient norm within 2%, the same loss
    (~1e-6 here, every group being dead) within 2e-6, and the same fp32 master weights after the
    step but for a few elements whose tiny gradient changed sign (2 lr apart); step 2 trains on
    both. The KL agrees to 1e-4: FSDP computes with the bf16 copy of every weight, which is the
    reference's, so its step-1 KL is 0; autocast keeps embeddings and norms in fp32, a
    difference of ~4e-5 here. The ranks run with torch 2.11's recomputation put back (FSDP's
    input and output casts skipped while a checkpointed layer is recomputed, pytorch#159359,
    fixed in 2.13; reached where transformers checkpoints a layer's __call__, as 5.17 does, which
    .ci/run tests): every floating input of a decoder layer is bf16 already (DECISIONS.md)."""
    common = TINY + ["--scenarios", short_scenarios, "--out", str(tmp_path), "--steps", "2",
                     "--instances", "2", "--group-size", "2", "--dtype", "bfloat16", "--lr",
                     "1e-6", "--save-every", "1", "--max-new-tokens", "6",
                     "--activation-checkpointing", "on", "--updates-per-batch", "1"]
    script = tmp_path / "torch_2_11_recompute.py"
    script.write_text(TORCH_2_11_RECOMPUTE)
    root = str(Path(__file__).parent.parent)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
    monkeypatch.setattr(checkpoints, "prune_checkpoints", lambda *a: None)
    one_and_two_ranks(str(script), common, env)
    (a, a2), (b, b2) = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert a["persuader_tokens"] == b["persuader_tokens"] and a["grad_norm"] > 0
    assert abs(a["grad_norm"] - b["grad_norm"]) <= 2e-2 * a["grad_norm"]
    assert abs(a["loss"] - b["loss"]) <= 2e-6 and abs(a["kl"] - b["kl"]) <= 1e-4  # both ~1e-6
    assert a2["step"] == b2["step"] == 2 and b2["grad_norm"] > 0 and not b2.get("step_skipped")
    assert abs(a2["grad_norm"] - b2["grad_norm"]) <= 2e-2 * a2["grad_norm"]
    from safetensors.torch import load_file
    wa, wb = (load_file(tmp_path / k / "checkpoint-1" / "model.safetensors") for k in ("one", "two"))
    assert wa.keys() == wb.keys() and all(v.dtype == torch.float32 for v in wb.values())
    diff = torch.cat([(wa[k] - wb[k]).flatten() for k in wa]).abs()
    assert diff.max() <= 2.1e-6 and (diff > 0.5e-6).float().mean() < 0.05


# -----------------------------------------------------------------------------
# run folders: one name, never another folder; resume keeps the run's settings


@pytest.mark.parametrize("name", [".", "..", "../victim", "a/b", "a\\b", "/tmp", "run\x00"])
def test_name_is_one_folder_name_and_overwrite_deletes_nothing_else(tmp_path, short_scenarios, name,
                                                                     no_model_loads):
    runs, victim = tmp_path / "runs", tmp_path / "victim"
    (runs / "other").mkdir(parents=True)
    victim.mkdir()
    (runs / "other" / "metrics.jsonl").write_text("{}\n")
    (victim / "keep").write_text("x")
    with pytest.raises(SystemExit) as e:
        train.main(TINY + ["--scenarios", short_scenarios, "--out", str(runs), "--name", name,
                           "--overwrite"])
    assert "--name" in str(e.value.code) and "one folder name" in str(e.value.code)
    assert (runs / "other" / "metrics.jsonl").is_file() and (victim / "keep").is_file()


def test_a_scenarios_file_with_a_bad_line_is_refused_before_any_model_loads(tmp_path, short_scenarios,
                                                                            no_model_loads):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(Path(short_scenarios).read_text() + '{"id": "x"\n')
    with pytest.raises(SystemExit, match=r"^train.py: --scenarios is not a valid scenarios file .*line 7"):
        train.main(TINY + ["--scenarios", str(bad), "--out", str(tmp_path), "--name", "x"])


def test_resume_refuses_changed_settings_and_records_the_allowed_ones(tmp_path, short_scenarios, capsys):
    """--resume --lr 0.5 names the change in one line and touches nothing; a resume that names
    only the run continues with its recorded settings; a longer --steps is applied and recorded."""
    tiny_run(tmp_path, short_scenarios, "r", "--steps", 1)
    config = tmp_path / "r" / "config.json"
    before = config.read_text()
    with pytest.raises(SystemExit) as e:
        tiny_run(tmp_path, short_scenarios, "r", "--steps", 2, "--resume", "--lr", 0.5, "--t-max", 3)
    message = str(e.value.code)
    assert "--lr 0.5 (the run has 0.001)" in message and "--t-max 3 (the run has 2)" in message
    assert "\n" not in message and config.read_text() == before
    history = train.main(["--out", str(tmp_path), "--name", "r", "--resume", "--steps", "2"])
    assert [m["step"] for m in history] == [2]
    recorded = json.loads(config.read_text())
    assert recorded["steps"] == 2 and recorded["preset"] == "tiny" and recorded["lr"] == 1e-3
    assert recorded["resumed"] == [{"step": 1, "changed": {"steps": [1, 2]}}]
    assert "--steps 2 (was 1)" in capsys.readouterr().out


def test_a_bad_evals_line_does_not_crash_a_resumed_run(tmp_path, short_scenarios, capsys):
    tiny_run(tmp_path, short_scenarios, "e", "--steps", 1, "--eval-every", 1)
    evals = tmp_path / "e" / "evals.jsonl"
    evals.write_text(evals.read_text() + 'garbage\n{"no step": 1}\n[3]\n')
    tiny_run(tmp_path, short_scenarios, "e", "--steps", 2, "--eval-every", 1, "--resume")
    def refuse(name):
        raise ValueError(name)
    rows = [json.loads(l, parse_constant=refuse) for l in evals.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert "dropping line 2" in capsys.readouterr().err
    assert (tmp_path / "e" / "latest").read_text() == "checkpoint-2"


def test_a_full_disk_while_writing_samples_is_one_line(tmp_path, short_scenarios, monkeypatch):
    real = os.replace
    def full(source, target, *a, **k):  # the atomic write of samples-1.json fails
        if "samples" in Path(target).name:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(source, target, *a, **k)
    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(SystemExit) as e:
        tiny_run(tmp_path, short_scenarios, "full", "--steps", 1)
    message = str(e.value.code)
    assert message.startswith("train.py: could not write samples-1.json") and "disk is full" in message
    assert not [p for p in (tmp_path / "full").iterdir() if "samples" in p.name]


def test_rewritten_files_go_through_a_rename(tmp_path, short_scenarios, monkeypatch):
    """config.json, samples and evals.jsonl are each written to a temporary file and renamed;
    the evaluation's shaping return is at the run's own lambda, not the default."""
    replaced, real = [], os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (replaced.append(Path(b).name), real(a, b)))
    lam = rpo.LAMBDA / 2
    tiny_run(tmp_path, short_scenarios, "atomic", "--steps", 1, "--eval-every", 1, "--lam", lam)
    assert {"config.json", "samples-1.json", "evals.jsonl"} <= set(replaced)
    [row] = [json.loads(line) for line in (tmp_path / "atomic" / "evals.jsonl").read_text().splitlines()]
    assert row["shaping_lambda"] == lam


def test_a_diverged_run_stops_after_max_skipped_steps(tmp_path, short_scenarios):
    """--lr 1e30: one finite step blows the weights up, every later one is skipped as non-finite;
    after MAX_SKIPPED_STEPS in a row the run exits non-zero, saying why."""
    steps = train.MAX_SKIPPED_STEPS + 3
    with pytest.raises(SystemExit) as e:
        tiny_run(tmp_path, short_scenarios, "lr", "--steps", steps, "--lr", 1e30)
    message = str(e.value.code)
    assert f"{train.MAX_SKIPPED_STEPS} steps in a row" in message and "--lr" in message
    skipped = [m["step_skipped"] for m in metrics(tmp_path / "lr")]
    assert skipped[-train.MAX_SKIPPED_STEPS:] == [1] * train.MAX_SKIPPED_STEPS and len(skipped) < steps


def test_non_finite_weights_are_refused_at_resume(saved_run, tmp_path):
    from safetensors.torch import load_file, save_file
    run, policy = saved_run
    weights = run / "checkpoint-1" / "model.safetensors"
    sd = load_file(weights)
    key = next(k for k in sd if "up_proj" in k)
    sd[key][0, 0] = float("inf")
    save_file(sd, weights, metadata={"format": "pt"})
    with pytest.raises(SystemExit, match=r"non-finite weights \(.*up_proj.*lower --lr"):
        checkpoints.load_checkpoint(run, policy, torch.optim.AdamW(policy.parameters()), "cpu")



def test_an_episode_that_never_started_is_named_and_left_out_of_the_step(capsys):
    """An instance whose episode cannot fit the empty pools even alone: its episodes are
    recorded as never started (no belief, end reason "cache"), named, counted, and leave the
    step's metrics and loss with their group; the groups that played are scored as usual (the
    metrics raised IndexError on beliefs [] and a micro-batch of such episodes failed)."""
    import argparse as ap

    from persuarena import engine
    from persuarena import rollout
    from conftest import short_scenario, tiny_model
    tok = models.tiny_tokenizer()
    short = short_scenario(1)
    long = {**short_scenario(2), "context": "At the clinic desk, a long queue. " * 150}
    lengths = [max(map(len, rollout.prompt_ids(tok, tok, i))) for i in (short, long)]
    blocks = lengths[0] // 16 + 40  # the short one's episode, never the long one's prompt
    assert lengths[1] // 16 > blocks
    er, ee = (engine.Engine(tiny_model(a, max_position_embeddings=8192), tok, block_size=16,
                            num_blocks=blocks) for a in ("llama", "qwen3"))
    records = rollout.rollout_episodes(er, ee, [short, long], 2, group_size=2, max_new_tokens=4,
                                       persuader_sampling=engine.Sampling(1.0))
    assert [(r.end_reason == "cache", r.beliefs == []) for r in records] == \
        [(False, False)] * 2 + [(True, True)] * 2
    kept, left_out, why = steps.playable(records, 2)
    assert kept == records[:2]
    assert left_out == dict(never_started=2, api_errors=0, left_out=2)
    assert f"{long['id']} member 1 never started" in why
    args = ap.Namespace(lam=rpo.LAMBDA, anchor=rpo.ANCHOR, judge="none", group_size=2)
    groups = rpo.rewards(kept, 2, args.anchor)
    turn_adv = rpo.advantages(groups, args.lam)
    m = steps.step_metrics(1, kept, groups, dict(persuader_tokens=1), dict(rollout_s=1.0), args,
                           torch.device("cpu"))
    assert m["episodes"] == 2
    empty = steps.step_metrics(1, [], [], dict(persuader_tokens=0), dict(rollout_s=1.0), args,
                               torch.device("cpu"))
    assert empty["episodes"] == 0 and empty["reward_mean"] == 0.0
    # the update still sees four episodes in their places (every rank the same micro-batches),
    # the left-out ones without a persuader token: a micro-batch of only those adds nothing
    update_records, update_adv = steps.silenced(records, kept, turn_adv)
    assert update_records[:2] == kept and update_adv[2:] == [[], []]
    assert all(not any(r.turn_ids) and r.ids for r in update_records[2:])
    model = er.model
    opt_args = ap.Namespace(micro_batch=2, persuader_temperature=1.0, kl_beta=0.0, clip_low=0.2,
                            clip_high=0.28, dtype="float32")
    policy = model.requires_grad_(True)
    stats = train.policy_update(policy, None, torch.optim.SGD(policy.parameters(), lr=0.0),
                                update_records, update_adv, opt_args, torch.device("cpu"), 1)
    assert stats["persuader_tokens"] == sum(t > 0 for r in kept for t in r.turn_ids[1:])
    assert stats["ratio_mean"] == pytest.approx(1.0, abs=1e-3)


def test_a_judge_naming_the_persuadees_model_shares_its_engine(tmp_path, short_scenarios,
                                                               monkeypatch):
    """--judge with the persuadee's own model loads no second model: two engines (actor and
    persuadee), as with the default judge; a judge of another model gets its own."""
    from persuarena import engine
    built = []
    original = engine.Engine.__init__

    def counted(self, model, *a, **k):
        built.append(model.config.model_type)
        original(self, model, *a, **k)
    monkeypatch.setattr(engine.Engine, "__init__", counted)
    base = ["--preset", "tiny", "--save-every", "1000", "--steps", "1", "--scenarios",
            short_scenarios, "--out", str(tmp_path), "--max-new-tokens", "2"]
    train.main(base + ["--name", "shared", "--judge", "random:tiny-qwen3"])
    assert built == ["llama", "qwen3"]
    built.clear()
    train.main(base + ["--name", "own", "--judge", "random:tiny-qwen2"])
    assert built == ["llama", "qwen3", "qwen2"]


def test_a_lora_run_plays_its_adapter_saves_it_and_eval_runs_the_checkpoint(tmp_path, short_scenarios,
                                                                           monkeypatch):
    """--lora on the tiny preset: the adapter moves (KL to the base > 0) while the rollout engine
    plays the merged weights (the sampled log-probs are the policy's: ratio 1 at step 2); the
    checkpoint is peft's adapter folder (PeftModel.from_pretrained, merge_and_unload) and
    eval.py --persuader runs/NAME/checkpoint-K evaluates it."""
    from persuarena import eval as evaluation
    from peft import PeftModel
    history = tiny_run(tmp_path, short_scenarios, "lora", "--lora", 4, "--steps", 2, "--lr", 3e-2,
                       "--save-every", 1, "--kl-beta", 0.01, "--updates-per-batch", 1)
    assert history[1]["kl"] > 1e-4 and abs(history[1]["ratio_mean"] - 1) < 1e-4
    folder = tmp_path / "lora" / "checkpoint-2"
    assert (folder / "adapter_config.json").is_file() and not (folder / "model.safetensors").exists()
    config = json.loads((tmp_path / "lora" / "config.json").read_text())
    assert config["lora"] == 4
    base = models.random_model("tiny-llama")[0]
    merged = PeftModel.from_pretrained(base, folder).merge_and_unload()
    assert not torch.equal(merged.model.layers[0].self_attn.q_proj.weight,
                           models.random_model("tiny-llama")[0].model.layers[0].self_attn.q_proj.weight)
    monkeypatch.chdir(tmp_path)
    evaluation.main(["--persuader", str(folder), "--persuadee", "random:tiny-qwen3", "--judge", "none",
             "--limit", "1", "--t-max", "1", "--max-new-tokens", "3", "--name", "lora-eval"])
    assert (tmp_path / "evals" / "lora-eval" / "summary.json").is_file()


@pytest.mark.parametrize("lora_rank", [4, 0])
def test_activation_checkpointing_on_a_cpu_trains_as_without_it(tmp_path, short_scenarios,
                                                                 monkeypatch, lora_rank):
    """--activation-checkpointing on runs the GPU's update path on a CPU (the LoRA reference
    through the shared prompt, the policy's recomputed layers): checkpointing is turned on, and
    loss, gradient norm and KL equal a run without it (recomputation changes no number)."""
    calls = []
    original = steps.checkpoint_activations
    monkeypatch.setattr(steps, "checkpoint_activations",
                        lambda policy: calls.append(original(policy)))
    runs_ = {}
    for mode in ("on", "off"):
        runs_[mode] = tiny_run(tmp_path, short_scenarios, f"ckpt-{mode}", "--lora", lora_rank,
                               "--steps", 2, "--lr", 3e-2, "--kl-beta", 0.01,
                               "--activation-checkpointing", mode)
    assert len(calls) == 1
    assert runs_["on"][1]["kl"] > 0 and runs_["on"][0]["grad_norm"] > 0
    for a, b in zip(runs_["on"], runs_["off"], strict=True):
        for key in COMPARED:
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(a[key])), (key, a[key], b[key])


def test_a_run_keeps_two_optimizer_states_at_most_and_resumes_from_its_last(tmp_path,
                                                                             short_scenarios,
                                                                             monkeypatch):
    """6 steps, a checkpoint every step, an evaluation every 2: while a checkpoint is written at
    most one other holds an optimizer state (trainer.pt); after the run the evaluated steps keep
    their weights without it, the others are gone, and --resume continues from the last one."""
    run = tmp_path / "disk"
    states, original = [], torch.save

    def counting_save(obj, path, *a, **k):
        states.append(len(list(run.glob("checkpoint-*/trainer.pt"))) + 1)
        return original(obj, path, *a, **k)
    monkeypatch.setattr(torch, "save", counting_save)
    common = ["--save-every", 1, "--eval-every", 2, "--eval-limit", 1, "--eval-fidelity", 0]
    tiny_run(tmp_path, short_scenarios, "disk", "--steps", 6, *common)
    assert len(states) == 6 and max(states) <= 2
    assert sorted(p.parent.name for p in run.glob("checkpoint-*/trainer.pt")) == ["checkpoint-6"]
    assert sorted(p.name for p in run.glob("checkpoint-*")) == [f"checkpoint-{s}" for s in (2, 4, 6)]
    assert all(any((run / f"checkpoint-{s}").glob("*.safetensors")) for s in (2, 4))
    train.main(TINY + ["--scenarios", short_scenarios, "--out", str(tmp_path), "--name", "disk",
                       "--resume", "--steps", "7"])
    assert [m["step"] for m in metrics(run)] == list(range(1, 8))
    assert sorted(p.parent.name for p in run.glob("checkpoint-*/trainer.pt")) == ["checkpoint-7"]


def test_lora_refuses_a_negative_rank(tmp_path, short_scenarios, no_model_loads):
    with pytest.raises(SystemExit, match="--lora -1"):
        parse_train(TINY + ["--scenarios", short_scenarios, "--out", str(tmp_path),
                            "--name", "x", "--lora", "-1"])


def test_a_stopped_lora_run_resumes_as_an_unbroken_one(tmp_path, short_scenarios):
    """--lora with --resume: a run stopped after its step-2 checkpoint and resumed to step 4
    (adapters, AdamW moments, step and random streams restored) gives the unbroken run's
    metrics at steps 3 and 4 and its final adapters; the refusal of a foreign checkpoint
    still holds (another rank's adapters do not load)."""
    from safetensors.torch import load_file
    common = ["--lora", 4, "--lr", 3e-2, "--kl-beta", 0.01, "--persuader-temperature", 1,
              "--instances", 2, "--group-size", 2, "--max-new-tokens", 6]
    tiny_run(tmp_path, short_scenarios, "broken", "--steps", 2, *common)
    resumed = train.main(TINY + ["--scenarios", short_scenarios, "--out", str(tmp_path),
                                 "--name", "broken", "--resume", "--steps", "4"])
    whole = tiny_run(tmp_path, short_scenarios, "whole", "--steps", 4, *common)
    assert [m["step"] for m in resumed] == [3, 4] and whole[2]["grad_norm"] > 0
    for a, b in zip(whole[2:], resumed, strict=True):
        for key in COMPARED:
            assert abs(a[key] - b[key]) <= 1e-6 * max(1.0, abs(a[key])), (key, a[key], b[key])
    adapters = [load_file(tmp_path / name / "checkpoint-4" / "adapter_model.safetensors")
                for name in ("whole", "broken")]
    assert adapters[0].keys() == adapters[1].keys()
    for k, v in adapters[0].items():
        torch.testing.assert_close(adapters[1][k], v, atol=1e-6, rtol=0)
    import shutil
    (tmp_path / "broken" / "latest").write_text("checkpoint-4")
    config = tmp_path / "broken" / "config.json"
    config.write_text(config.read_text().replace('"lora": 4', '"lora": 8'))
    with pytest.raises(SystemExit, match="do not match the policy"):
        train.main(TINY + ["--scenarios", short_scenarios, "--out", str(tmp_path),
                           "--name", "broken", "--resume", "--steps", "5"])
    shutil.rmtree(tmp_path / "whole")


@pytest.mark.xdist_group("ranks")  # one 2-rank run at a time: three processes each
@pytest.mark.slow
def test_two_lora_ranks_match_one_process(tmp_path, short_scenarios):
    """--lora under torchrun is data parallel: 2 CPU ranks (replicated adapters, gradients
    averaged during backward) give one process's loss, gradient norm, KL and rewards at step 1
    and, after the AdamW step, at step 2."""
    common = TINY + ["--scenarios", short_scenarios, "--out", str(tmp_path), "--steps", "2",
                     "--instances", "2", "--group-size", "2", "--persuader-temperature", "1",
                     "--max-new-tokens", "6", "--lora", "4", "--lr", "3e-2", "--updates-per-batch", "1"]
    one_and_two_ranks("train.py", common)
    for a, b in zip(metrics(tmp_path / "one"), metrics(tmp_path / "two"), strict=True):
        for key in COMPARED:
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(a[key])), (key, a[key], b[key])
        assert a["grad_norm"] > 0
    assert b["kl"] > 0
    assert (tmp_path / "two" / "checkpoint-2" / "adapter_config.json").is_file()


@pytest.mark.parametrize("kl_beta", [0.0, 0.01])
def test_a_zero_advantage_step_skips_its_passes_and_matches_the_full_update(kl_beta, monkeypatch):
    """All advantages 0 (a lambda = 0 step of dead groups) after a real step: with no KL term the
    skipped step leaves the same weights and AdamW state as the full forward and backward; with a
    KL term the policy has left the reference, so the full update runs."""
    import argparse as ap
    import copy

    import torch

    from persuarena import models
    model = models.random_model("tiny-llama")[0]
    args = ap.Namespace(micro_batch=2, persuader_temperature=1.0, kl_beta=kl_beta, clip_low=0.2,
                        clip_high=0.28, dtype="float32", lr=1e-2)
    torch.manual_seed(0)
    recs = [Episode(ids=torch.randint(3, 600, (10,)).tolist(), turn_ids=[0, 0, 1, 1, 1, 0, 2, 2, 0, 0],
                 logprobs=[-2.0] * 10) for _ in range(2)]
    def run(skip):
        if not skip:
            monkeypatch.setattr(steps, "zero_advantage_step", lambda *a: None)
        policy = copy.deepcopy(model).requires_grad_(True)
        opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
        device = torch.device("cpu")
        train.policy_update(policy, model, opt, recs, [[0.5, -1.0], [-0.5, 1.0]], args, device, 1)
        stats = train.policy_update(policy, model, opt, recs, [[0.0, 0.0], [0.0, 0.0]], args, device, 1)
        monkeypatch.undo()
        return stats, policy.state_dict()
    fast, fast_weights = run(skip=True)
    full, full_weights = run(skip=False)
    assert fast["zero_gradient"] == (kl_beta == 0) and full["zero_gradient"] == 0
    for k in full_weights:
        torch.testing.assert_close(fast_weights[k], full_weights[k], atol=1e-7, rtol=0)
    assert fast["persuader_tokens"] == full["persuader_tokens"] == 10


def test_a_zero_advantage_step_at_the_reference_skips_even_with_a_kl_term():
    """Before any nonzero gradient the policy is its KL reference, whose KL gradient is 0: a
    zero-advantage step with kl_beta 0.01 skips its passes and leaves the weights as they were."""
    import argparse as ap
    import copy

    import torch

    from persuarena import models
    model = models.random_model("tiny-llama")[0]
    args = ap.Namespace(micro_batch=2, persuader_temperature=1.0, kl_beta=0.01, clip_low=0.2,
                        clip_high=0.28, dtype="float32", lr=1e-2)
    policy = copy.deepcopy(model).requires_grad_(True)
    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    recs = [Episode(ids=list(range(3, 13)), turn_ids=[0, 0, 1, 1, 1, 0, 2, 2, 0, 0], logprobs=[-2.0] * 10)]
    stats = train.policy_update(policy, model, opt, recs, [[0.0, 0.0]], args, torch.device("cpu"), 1)
    assert stats["zero_gradient"] == 1 and stats["kl"] == 0.0
    for k, v in model.state_dict().items():
        assert torch.equal(policy.state_dict()[k], v)


def test_prompts_are_shared_in_one_process_without_checkpointing():
    from persuarena import models
    model = models.random_model("tiny-llama")[0]
    assert steps.shares_prompts(model, 1) and not steps.shares_prompts(model, 2)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no deprecated name
        steps.checkpoint_activations(model)
    assert not steps.shares_prompts(model, 1)


def test_flags_are_passed_down_and_the_preset_is_named_before_step_one(tmp_path, short_scenarios,
                                                                       monkeypatch, capsys):
    """--decision reaches every rollout as an argument (rollout.DECISION, its default, is never
    assigned), and the tiny preset names the values it sets over their constants (turns,
    tokens) before step 1."""
    from persuarena import rollout
    seen, original = [], rollout.rollout_episodes

    def spy(*a, **k):
        seen.append(k.get("decision"))
        return original(*a, **k)
    monkeypatch.setattr(rollout, "rollout_episodes", spy)
    before = rollout.DECISION
    tiny_run(tmp_path, short_scenarios, "flags", "--steps", 1, "--max-new-tokens", 3,
             "--decision", "logit")
    assert seen == ["logit"] and rollout.DECISION == before
    out = capsys.readouterr().out
    t_max = presets.PRESETS["tiny"]["t_max"]
    note = f"t_max {t_max} (tiny preset; arena.T_MAX_TRAIN {arena.T_MAX_TRAIN})"
    assert note in out and out.index(note) < out.index("step 1:")
    assert not any(line.startswith("max_new_tokens ") for line in out.splitlines())  # given: 3


def test_periodic_evaluation_plays_a_stratified_subset(monkeypatch, tmp_path):
    """issue 35: --eval-limit 5 evaluates one scenario of each domain, and the summary names it."""
    from persuarena import arena
    from persuarena import eval as evaluation
    from lab import cli
    played = {}
    monkeypatch.setattr(evaluation, "evaluate", lambda a, p, instances, out, **kw: played.update(
        instances=instances, subset=kw["subset"]) or {"full_accept": 0.0, "full_or_conditional": 0.0})
    monkeypatch.setattr(train.steps, "record_evaluation", lambda *a: None)
    args = cli.train_args(["--preset", "tiny", "--eval-limit", "5"], train)
    train.evaluate_heldout(None, None, None, args, 1, 0, tmp_path)
    assert sorted(i["domain"] for i in played["instances"]) == sorted(arena.DOMAINS)
    assert played["subset"] == "heldout stratified-5 of 120"


@pytest.mark.parametrize("persuadee, extra", [("random:tiny-qwen3", []), ("random:tiny-llama", []),
                                              ("random:tiny-qwen3", ["--lora", "4"])])
def test_the_persuader_is_read_once_and_copied_for_its_other_roles(persuadee, extra, monkeypatch,
                                                                   short_scenarios):
    """build_models loads the persuader once (loads counted): its rollout copy, its KL reference
    and, when it is also the persuadee, the persuadee are copies cast to --dtype, weight for
    weight equal to the policy's initial weights so cast, each in storage of its own (under
    --lora the rollout copy is the base, the reference the base with the adapter off)."""
    loads, original = [], models.load_model
    monkeypatch.setattr(models, "load_model",
                        lambda name, *a, **k: loads.append(name) or original(name, *a, **k))
    args = parse_train(TINY + ["--scenarios", short_scenarios, "--dtype", "bfloat16", "--persuadee",
                               persuadee, "--kl-beta", "0.05", *extra])
    m = train.build_models(args, 1, torch.device("cpu"))
    same = persuadee == args.persuader
    assert loads == [args.persuader] + ([] if same else [persuadee])
    initial = {k.replace("base_model.model.", "").replace(".base_layer", ""): p.detach()
               for k, p in m.policy.named_parameters() if "lora_" not in k}
    copies = [m.rollout_copy] + ([m.persuadee] if same else [])
    if not extra:
        copies.append(m.reference)
        assert (m.reference is m.persuadee) == same
    else:
        assert isinstance(m.reference, train.lora.AdapterOff)
    pointers = {p.data_ptr() for p in initial.values()}
    for copy in copies:
        params = dict(copy.named_parameters())
        assert params.keys() == initial.keys()
        for name, p in params.items():
            assert p.dtype == torch.bfloat16 and not p.requires_grad and p.data_ptr() not in pointers
            assert torch.equal(p, initial[name].to(torch.bfloat16)), name
    assert m.rollout_copy is not m.persuadee
    assert m.held == train.plan.run_models(args, 1)  # what the memory plan counts


def test_train_loads_what_the_plan_decides(monkeypatch, short_scenarios):
    """plan.run_models is the one decision: edited to give the reference a copy of its own
    (instead of the persuadee's weights), build_models loads one and the memory plan counts it."""
    import dataclasses
    args = parse_train(TINY + ["--scenarios", short_scenarios, "--persuadee", "random:tiny-llama",
                               "--kl-beta", "0.05"])
    decided = train.plan.run_models(args, 1)
    assert decided == train.plan.RunModels("persuader", "none", "persuadee", False)
    original = train.plan.run_models
    monkeypatch.setattr(train.plan, "run_models",
                        lambda *a: dataclasses.replace(original(*a), reference="copy"))
    m = train.build_models(args, 1, torch.device("cpu"))
    assert m.reference is not m.persuadee and m.reference is not None
    items = dict(train.plan.memory_plan(args, 1, 139, False)["items"])
    assert any(k.startswith("reference ") for k in items)
    assert not any("also the reference" in k for k in items)


def rpo_record(outcome, judge, beliefs, end_reason="accept"):
    return Episode(outcome=outcome, judge=judge, beliefs=beliefs, end_reason=end_reason, id="x")


def test_playable_leaves_out_whole_groups_and_silenced_keeps_their_places():
    recs = [rpo_record("ACCEPT", 0.0, [0.0, 0.1]), rpo_record("REJECT", 0.0, [0.0, 0.1]),
            rpo_record("PENDING", 0.0, []), rpo_record("PENDING", 0.0, [0.0, 0.1], end_reason="api_error")]
    for r in recs:
        r.ids, r.turn_ids, r.logprobs = [5, 6, 7], [0, 1, 1], [0.0, -1.0, -1.0]
    kept, counts, why = steps.playable(recs, 2)
    assert kept == recs[:2] and counts == dict(never_started=1, api_errors=1, left_out=2)
    assert "member 0 never started" in why and "member 1 its served model kept failing" in why
    records, adv = steps.silenced(recs, kept, [[1.0], [-1.0]])
    assert records[:2] == kept and adv == [[1.0], [-1.0], [], []]
    assert all(r.turn_ids == [0, 0, 0] for r in records[2:])
    assert rpo.persuader_tokens(records) == 4


def on_policy_records(policy, count=4, length=12):
    """`count` episodes of `length` random tokens whose persuader tokens (two messages) carry the
    policy's own log-probs at T 1, as the rollout records them: the first update's ratio is 1."""
    torch.manual_seed(1)
    ids = torch.randint(3, 600, (count, length))
    turn_ids = [0, 0, 1, 1, 1, 0, 0, 2, 2, 2, 0, 0][:length]
    from conftest import token_logprobs
    with torch.no_grad():
        logprobs = token_logprobs(policy(ids).logits, ids)
    return [Episode(ids=row.tolist(), turn_ids=turn_ids, logprobs=[0.0] + lp.tolist())
            for row, lp in zip(ids, logprobs)]


@pytest.mark.parametrize("updates", [1, 4])
def test_updates_after_the_first_see_a_ratio_off_one_and_the_clip_acts(updates):
    """--updates-per-batch U: U AdamW steps, one a mini-batch of the episodes, each against the
    rollout's log-probs. With one, the policy that sampled is the one updated: the ratio is 1,
    nothing is clipped and the KL to the reference (the initial weights) is 0. With four, the
    mini-batches after the first meet a moved policy: the ratio leaves 1, the clip fraction is
    nonzero and so is the KL, as a policy that took the old log-probs from itself would not."""
    import argparse as ap
    import copy
    model = models.random_model("tiny-llama")[0]
    records = on_policy_records(model)
    policy = copy.deepcopy(model).requires_grad_(True)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=2e-2, weight_decay=0.0)
    args = ap.Namespace(micro_batch=2, persuader_temperature=1.0, kl_beta=0.01, clip_low=0.2,
                        clip_high=0.28, dtype="float32", lr=2e-2, updates_per_batch=updates)
    seen = []
    def update(*mini):
        seen.append(len(mini[0]))
        return train.policy_update(policy, model, optimizer, *mini, args, torch.device("cpu"), 1)
    stats = steps.mini_batch_updates(records, [[1.0, -0.5], [-1.0, 0.5], [0.5, 1.0], [-0.5, -1.0]],
                                     updates, update)
    assert seen == [4 // updates] * updates and stats["updates"] == updates
    assert next(iter(optimizer.state.values()))["step"] == updates
    assert stats["persuader_tokens"] == 4 * 6 and stats["grad_norm"] > 0
    if updates == 1:
        assert stats["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
        assert stats["clip_frac"] == 0.0 and stats["kl"] < 1e-9
    else:
        assert abs(stats["ratio_mean"] - 1) > 1e-2 and stats["clip_frac"] > 0.05 and stats["kl"] > 1e-3


def test_merged_updates_weigh_by_tokens_and_a_non_finite_update_ends_the_batch():
    """The step's stats: token-weighted means (an update that measured nothing left out), the
    largest gradient norm; an update that finds a non-finite value is the batch's last."""
    def update_stats(tokens, clip, skipped=0, grad_norm=1.0):
        return dict(loss=clip, kl=clip, clip_frac=clip, ratio_mean=clip, grad_norm=grad_norm,
                    persuader_tokens=tokens, step_skipped=skipped, nonfinite=["loss"] if skipped else [],
                    zero_gradient=int(clip is None))
    merged = steps.merged_updates([update_stats(10, 0.0), update_stats(30, 0.4, grad_norm=2.0),
                                   update_stats(5, None)])
    assert merged["clip_frac"] == pytest.approx(0.3) and merged["grad_norm"] == 2.0
    assert (merged["persuader_tokens"], merged["zero_gradient"], merged["updates"]) == (45, 1, 3)
    planned = iter([update_stats(10, 0.1), update_stats(10, 0.1, skipped=1), update_stats(10, 0.1)])
    calls = []
    stats = steps.mini_batch_updates(list(range(6)), [[]] * 6, 3,
                                     lambda r, a: calls.append(r) or next(planned))
    assert calls == [[0, 1], [2, 3]] and stats["step_skipped"] == 1 and stats["updates"] == 1
    assert stats["nonfinite"] == ["loss"]
