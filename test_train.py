"""The training loop (train.py) on tiny random models: learning, ranks, kill and resume."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import rpo
import train


TINY = ["--preset", "tiny", "--judge", "none", "--save-every", "1000"]
COMPARED = ("loss", "grad_norm", "reward_mean", "belief_change", "kl", "persuader_tokens")


def tiny_run(tmp_path, scenarios, name, *extra):
    return train.main(TINY + ["--scenarios", scenarios, "--out", str(tmp_path), "--name", name,
                              *map(str, extra)])


def test_learning_raises_the_persuadees_belief(tmp_path, short_scenarios, monkeypatch):
    """Dense reward only (lambda 1, no anchor, no KL), deterministic persuadee: the trained
    policy moves the persuadee's belief up against a frozen copy on the same seeds, and the same
    loop with the advantage's sign flipped moves it down."""
    args = ("--steps", 30, "--lam", 1, "--no-anchor", "--kl-beta", 0, "--group-size", 4,
            "--instances", 2, "--t-max", 1, "--max-new-tokens", 8, "--persuadee-temperature", 0)
    change = lambda history: [m["belief_change"] for m in history[-10:]]
    frozen = change(tiny_run(tmp_path, short_scenarios, "frozen", *args, "--lr", 0))
    trained = change(tiny_run(tmp_path, short_scenarios, "trained", *args, "--lr", 3e-2))
    gain = sum(t - f for t, f in zip(trained, frozen)) / len(frozen)
    original = rpo.group_advantages
    monkeypatch.setattr(rpo, "group_advantages",
                        lambda *a, **k: [[-x for x in ep] for ep in original(*a, **k)])
    flipped = change(tiny_run(tmp_path, short_scenarios, "flipped", *args, "--lr", 3e-2))
    loss = sum(t - f for t, f in zip(flipped, frozen)) / len(frozen)
    assert gain > 0.005, (trained, frozen)
    assert loss < -0.005, (flipped, frozen)


def run_script(argv, env_extra=None, **kw):
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
    return subprocess.Popen([sys.executable, *argv], cwd=Path(__file__).parent, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_ranks_match_one_process(tmp_path, short_scenarios):
    """torchrun with 2 CPU ranks (gloo, FSDP) and one process, same global batch: the same loss,
    gradient norm, KL and rewards at step 1 and, after one sharded AdamW step, at step 2, with
    both sides sampling: each episode's random streams are keyed by (seed, instance, group
    index, side), never by the rank or the batch it shares."""
    common = TINY + ["--scenarios", short_scenarios, "--out", str(tmp_path), "--steps", "2",
                     "--instances", "2", "--group-size", "2", "--persuader-temperature", "1",
                     "--persuadee-temperature", "0.7", "--max-new-tokens", "6"]
    one = run_script(["train.py", *common, "--name", "one"])
    two = run_script(["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                      "29517", "train.py", *common, "--name", "two"])
    for p in (one, two):
        out = p.communicate(timeout=300)[0]
        assert p.returncode == 0, out[-3000:]
    for a, b in zip(metrics(tmp_path / "one"), metrics(tmp_path / "two"), strict=True):
        for key in COMPARED:
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(a[key])), (key, a[key], b[key])
        assert a["grad_norm"] > 0
    assert b["kl"] > 0  # step 2 runs on the updated, sharded weights


def test_kill_and_resume_reaches_the_same_metrics(tmp_path, short_scenarios):
    """kill -9 after the step-2 checkpoint, --resume: step 4 equals an uninterrupted run's."""
    common = TINY + ["--scenarios", short_scenarios, "--out", str(tmp_path), "--steps", "4",
                     "--save-every", "2", "--instances", "2", "--group-size", "2",
                     "--max-new-tokens", "6"]
    whole = run_script(["train.py", *common, "--name", "whole"])
    assert whole.wait(timeout=300) == 0
    killed = run_script(["train.py", *common, "--name", "killed"])
    latest = tmp_path / "killed" / "latest"
    deadline = time.time() + 300
    while not (latest.exists() and latest.read_text() == "checkpoint-2") and time.time() < deadline:
        assert killed.poll() is None, "the run ended before it could be killed"
        time.sleep(0.02)
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait()
    resumed = run_script(["train.py", *common, "--name", "killed", "--resume"])
    out = resumed.communicate(timeout=300)[0]
    assert resumed.returncode == 0 and "resumed from step 2" in out, out[-3000:]
    a, b = metrics(tmp_path / "whole"), metrics(tmp_path / "killed")
    assert [m["step"] for m in b] == [1, 2, 3, 4]
    for key in COMPARED:
        assert abs(a[3][key] - b[3][key]) <= 1e-6 * max(1.0, abs(a[3][key])), key
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(tmp_path / "killed" / "checkpoint-4")


def test_update_gradient_ignores_everything_but_the_persuaders_tokens(tmp_path):
    """train.policy_update on a tiny model: garbage sampling log-probs outside the persuader's
    messages change no gradient; a persuader token's log-prob does."""
    import copy
    import argparse as ap

    import torch

    import models
    model = models.random_model("tiny-llama")[0]
    args = ap.Namespace(micro_batch=2, persuader_temperature=1.0, kl_beta=0.01, clip_low=0.2,
                        clip_high=0.28)
    torch.manual_seed(0)
    ids = torch.randint(3, 600, (2, 12)).tolist()
    turn_ids = [[0, 0, 0, 1, 1, 0, 0, 2, 2, 0, 0, 0], [0, 0, 1, 1, 1, 0, 2, 0, 0, 0, 0, 0]]
    def records(logprob):
        return [dict(ids=i, turn_ids=t, logprobs=[logprob(k, tt) for k, tt in enumerate(t)])
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
    expected = {(f"train/{k}", m["step"]): v for m in metrics(run) for k, v in train.scalars(m).items()
                if k != "step"}
    heldout = json.loads((run / "eval-2" / "summary.json").read_text())
    expected.update({(f"heldout/{k}", 2): v for k, v in train.scalars(heldout).items()})
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


def test_a_missing_logger_package_is_a_one_line_exit(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now raises ImportError
    with pytest.raises(SystemExit) as e:
        train.parse_args(["--log", "wandb"])
    assert str(e.value) == "train.py: --log wandb needs the wandb package: pip install wandb"
