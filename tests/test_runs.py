"""The run folder (runs.py) as train.py and eval.py use it: links never written through, a lock,
--overwrite of a run only, resume pinning and validation, one JSONL rule, the run's own sampling
and lambda in its evaluations. One tiny trained run (conftest.trained_run) serves
the tests that read a run; each copies it."""
import dataclasses
import errno
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from persuarena import eval as evaluation
from persuarena import models
from persuarena import probes
from lab import records
from persuarena import rollout
from persuarena import rpo
from lab import cli, presets, runs
from persuarena import train
import warm


def parse_train(argv):
    return cli.train_args(argv, train)

# one worker builds conftest.trained_run and runs every test here that copies it
pytestmark = pytest.mark.xdist_group("trained-run")

HERE = Path(__file__).resolve().parent.parent  # the repository root


@pytest.fixture
def no_model_loads(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the run folder was checked")
    monkeypatch.setattr(models, "load_model", refuse)


@pytest.fixture
def run_copy(trained_run, tmp_path):
    """A copy of the shared tiny run (lambda 0, its own sampling flags, one evaluation)."""
    folder, argv = trained_run
    shutil.copytree(folder, tmp_path / "run", symlinks=True)
    return tmp_path / "run", argv


def resume(run, *extra):
    return train.main(["--out", str(run.parent), "--name", run.name, "--resume", *map(str, extra)])

# -----------------------------------------------------------------------------
# links, --overwrite, the lock


def test_the_writers_never_follow_a_link(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    link = tmp_path / "config.json"
    link.symlink_to(outside)
    runs.write_atomic(link, "new")
    assert outside.read_text() == "keep" and not link.is_symlink() and link.read_text() == "new"
    metrics = tmp_path / "metrics.jsonl"
    metrics.symlink_to(outside)
    with pytest.raises(OSError) as e:
        runs.append_line(metrics, "{}\n")
    assert e.value.errno == errno.ELOOP and outside.read_text() == "keep"
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


@pytest.mark.parametrize("planted", ["metrics.jsonl", "config.json", "latest", ".latest.tmp",
                                     ".config.json.tmp", "metrics.jsonl.tmp", ".checkpoint-2.tmp"])
def test_train_resume_refuses_a_run_with_planted_links(run_copy, tmp_path, planted, no_model_loads):
    """A copied run folder whose files (or the temporary names earlier versions wrote through)
    are links: --resume is refused in one line before any model loads, and nothing outside the
    folder is written."""
    run, _ = run_copy
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "file").write_text("keep")
    target = victim if planted.startswith(".checkpoint") else victim / "file"
    if (run / planted).exists():
        (run / planted).unlink()
    (run / planted).symlink_to(target)
    with pytest.raises(SystemExit) as e:
        resume(run, "--steps", 2)
    assert "holds links" in str(e.value.code) and planted in str(e.value.code)
    assert "\n" not in str(e.value.code)
    assert [p.name for p in victim.iterdir()] == ["file"] and (victim / "file").read_text() == "keep"


def test_eval_resume_refuses_a_folder_with_planted_links(tmp_path, monkeypatch, no_model_loads):
    monkeypatch.setattr(evaluation, "EVALS_DIR", str(tmp_path / "evals"))
    folder = tmp_path / "evals" / "e"
    folder.mkdir(parents=True)
    (tmp_path / "elsewhere").write_text("keep")
    (folder / "settings.json").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(SystemExit, match="holds links"):
        evaluation.main(["--persuader", "random:tiny-llama", "--persuadee", "random:tiny-qwen3",
                   "--limit", "1", "--name", "e", "--resume"])
    assert (tmp_path / "elsewhere").read_text() == "keep"


def test_a_folder_that_holds_no_run_survives_overwrite(tmp_path, short_scenarios, monkeypatch,
                                                       no_model_loads):
    """--out notrun --name src --overwrite: src holds a file no run writes, so nothing is
    deleted, in train.py and in eval.py alike."""
    source = tmp_path / "notrun" / "src"
    source.mkdir(parents=True)
    (source / "important.py").write_text("x = 1\n")
    with pytest.raises(SystemExit) as e:
        train.main(["--preset", "tiny", "--scenarios", short_scenarios, "--out", str(source.parent),
                    "--name", "src", "--overwrite"])
    assert "not a run this project wrote" in str(e.value.code) and "important.py" in str(e.value.code)
    monkeypatch.setattr(evaluation, "EVALS_DIR", str(source.parent))
    with pytest.raises(SystemExit, match="not a run this project wrote"):
        evaluation.main(["--persuader", "random:tiny-llama", "--persuadee", "random:tiny-qwen3",
                   "--limit", "1", "--name", "src", "--overwrite"])
    assert (source / "important.py").read_text() == "x = 1\n"


def hold_lock(folder):
    """Another process that takes folder's lock and keeps it until killed."""
    code = (f"from lab import runs; import sys, time; runs.lock({str(folder)!r}, 'other'); print('locked', "
            "flush=True); time.sleep(600)")
    p = subprocess.Popen([sys.executable, "-c", code], cwd=HERE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "locked"
    return p


def test_a_second_process_under_one_name_is_refused(tmp_path, short_scenarios, monkeypatch,
                                                    no_model_loads):
    other = hold_lock(tmp_path / "runs" / "busy")
    try:
        with pytest.raises(SystemExit) as e:
            train.main(["--preset", "tiny", "--scenarios", short_scenarios, "--out",
                        str(tmp_path / "runs"), "--name", "busy"])
        message = str(e.value.code)
        assert "is in use by process" in message and str(other.pid) in message and "\n" not in message
        monkeypatch.setattr(evaluation, "EVALS_DIR", str(tmp_path / "runs"))
        with pytest.raises(SystemExit, match="is in use by process"):
            evaluation.main(["--persuader", "random:tiny-llama", "--persuadee", "random:tiny-qwen3",
                       "--limit", "1", "--name", "busy"])
    finally:
        other.kill()
        other.wait()
    assert not (tmp_path / "runs" / "busy" / "config.json").exists()


@pytest.mark.parametrize("out", ["file", "readonly"])
def test_an_out_that_cannot_hold_a_run_is_refused_before_loading(tmp_path, short_scenarios, out,
                                                                 no_model_loads):
    where = tmp_path / out
    if out == "file":
        where.write_text("x")
    else:
        where.mkdir()
        where.chmod(0o500)
    if os.access(where, os.W_OK) and out == "readonly":
        pytest.skip("running as a user who may write anywhere")
    with pytest.raises(SystemExit, match="cannot be written|is a file"):
        train.main(["--preset", "tiny", "--scenarios", short_scenarios, "--out", str(where),
                    "--name", "r"])


def test_a_long_name_is_refused_in_one_line(tmp_path, no_model_loads):
    with pytest.raises(SystemExit, match=f"more than {runs.NAME_MAX}"):
        parse_train(["--preset", "tiny", "--out", str(tmp_path), "--name", "x" * 300])
    with pytest.raises(SystemExit):
        evaluation.main(["--limit", "1", "--name", "bad\x07name"])


def test_a_failed_first_checkpoint_advises_overwrite_which_then_runs(tmp_path, short_scenarios,
                                                                     monkeypatch):
    real = os.replace
    def full(source, target, *a, **k):
        if Path(target).name.startswith("checkpoint-"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(source, target, *a, **k)
    argv = ["--preset", "tiny", "--judge", "none", "--scenarios", short_scenarios, "--out",
            str(tmp_path), "--name", "r", "--steps", "1", "--save-every", "1"]
    with monkeypatch.context() as m:
        m.setattr(os, "replace", full)
        with pytest.raises(SystemExit) as e:
            train.main(argv)
    assert "rerun with --overwrite" in str(e.value.code) and "--resume" not in str(e.value.code)
    train.main(argv + ["--overwrite"])
    assert (tmp_path / "r" / "latest").read_text() == "checkpoint-1"

# -----------------------------------------------------------------------------
# --resume: settings and constants pinned, every value validated before loading


@pytest.mark.parametrize("key, value, says", [
    ("group_size", 0, "--group-size 0 must be at least 1"),
    ("group_size", 10**9, "--group-size 1000000000 is above"),
    ("seed", 10**23, "--seed 100000000000000000000000 must lie in"),
    ("lam", math.nan, "--lam nan"),
    ("lr", -1, "--lr -1"),
    ("scenarios", "/moved/scenarios.jsonl", "--scenarios /moved/scenarios.jsonl"),
    ("group_size", "two", "--group-size \"two\", not a int"),
    ("persuadee_top_p", 2.0, "--persuadee-top-p 2.0"),
])
def test_a_resumed_config_with_an_invalid_value_is_refused_before_loading(run_copy, key, value, says,
                                                                          no_model_loads):
    run, _ = run_copy
    config = json.loads((run / "config.json").read_text())
    config[key] = value
    (run / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit) as e:
        resume(run, "--steps", 2)
    message = str(e.value.code)
    assert message.startswith("train.py: ") and says in message and "\n" not in message
    assert "config.json" in message


@pytest.mark.parametrize("edit, says", [
    (lambda c: c.pop("lam"), "lacks lam"),
    (lambda c: c.clear(), "lacks "),
    (lambda c: c.update(foo=1, persuader_top_p=0.5), "holds foo, persuader_top_p, which it never records"),
    (lambda c: c["constants"].pop("rpo.LAMBDA"), "lacks constants.rpo.LAMBDA"),
    (lambda c: c["constants"].update({"other.CONSTANT": 1}), "holds constants.other.CONSTANT, which"),
])
def test_resume_refuses_a_config_with_missing_or_foreign_keys_in_one_line(run_copy, edit, says,
                                                                           no_model_loads):
    """A key deleted from config.json is not filled with today's default (a lambda-0 run resumed
    at rpo.LAMBDA); a key this program never writes is no setting of this run."""
    run, _ = run_copy
    config = json.loads((run / "config.json").read_text())
    edit(config)
    (run / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit) as e:
        resume(run, "--steps", 2)
    message = str(e.value.code)
    assert message.startswith(f"train.py: --resume: {run / 'config.json'} {says}") and "\n" not in message
    assert message.endswith("it is the run's whole record, read as it is: restore it from a copy, "
                            "or start a new run (another --name)")
    if not config:  # the exact line, as a user sees it
        assert message == (f"train.py: --resume: {run / 'config.json'} lacks activation_checkpointing, "
                           "allow_insecure_key, anchor, clip_high, clip_low, constants and 38 more; it is "
                           "the run's whole record, read as it is: restore it from a copy, or start a "
                           "new run (another --name)")


def test_a_run_recorded_before_a_constant_moved_passes_the_pin_check(run_copy, no_model_loads):
    """cli.MOVED_CONSTANTS: a config.json holding a moved constant under its old name (the training
    variants' names were arena's) is read under the new one, so the resume gets past every check
    to the model load (no_model_loads); the same old name with another value is refused naming it."""
    run, _ = run_copy
    config = json.loads((run / "config.json").read_text())
    for old, new in cli.MOVED_CONSTANTS.items():
        config["constants"][old] = config["constants"].pop(new)
    (run / "config.json").write_text(json.dumps(config))
    with pytest.raises(AssertionError, match="a model was loaded"):
        resume(run, "--steps", 2)
    config["constants"]["arena.SURNAMES"] = ["Other"]
    (run / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit) as e:
        resume(run, "--steps", 2)
    assert "lab.variants.SURNAMES" in str(e.value.code) and "\n" not in str(e.value.code)


@pytest.mark.parametrize("module, name, value", [
    (rpo, "STRATEGY_WEIGHT", 0.25),
    (rpo, "GOAL", {**rpo.GOAL, "ACCEPT": 5.0}),
    (probes, "PROBES", {**probes.PROBES, "CA": {**probes.PROBES["CA"], "question": "Do you feel heard?"}}),
    # no hand-kept list: every CAPS constant of the method's modules and of train.py is pinned
    (rollout, "CLOSING_ROOM", 9),
    (rpo, "CLIP_HIGH", 0.3),
    (train, "GRAD_CLIP", 0.5),
])
def test_resume_after_editing_an_ablation_constant_is_refused_naming_it(run_copy, monkeypatch, module,
                                                                       name, value, no_model_loads):
    run, _ = run_copy
    monkeypatch.setattr(module, name, value)
    with pytest.raises(SystemExit) as e:
        resume(run, "--steps", 2)
    message = str(e.value.code)
    assert f"{module.__name__.rpartition('.')[2]}.{name}" in message and "\n" not in message
    assert message.startswith("train.py: --resume: ")


def test_editing_a_constant_reaches_a_preset_that_does_not_override_it(monkeypatch, tmp_path):
    from persuarena import arena
    from persuarena import engine
    monkeypatch.setattr(arena, "T_MAX_TRAIN", 3)
    monkeypatch.setattr(engine, "MAX_NEW_TOKENS", 77)
    args = parse_train(["--preset", "paper", "--plan", "--out", str(tmp_path)])
    assert (args.t_max, args.max_new_tokens) == (3, 77)


def test_a_preset_names_every_value_it_sets_over_the_owning_constant(monkeypatch, tmp_path):
    """The tiny preset pins turns and tokens: the run says so, naming the constant and its value
    (an edit of arena.T_MAX_TRAIN then shows why it changed nothing); a value the command line
    gives, or one the preset leaves to its constant, is not listed."""
    from persuarena import arena
    monkeypatch.setattr(arena, "T_MAX_TRAIN", 5)
    tiny = presets.PRESETS["tiny"]
    notes = presets.preset_notes(parse_train(["--preset", "tiny", "--out", str(tmp_path)]))
    assert notes[-3:] == [f"t_max {tiny['t_max']} (tiny preset; arena.T_MAX_TRAIN 5)",
                          f"eval_t_max {tiny['eval_t_max']} (tiny preset; arena.T_MAX_EVAL {arena.T_MAX_EVAL})",
                          f"max_new_tokens {tiny['max_new_tokens']} (tiny preset; engine.MAX_NEW_TOKENS "
                          f"{__import__('persuarena.engine', fromlist=['engine']).MAX_NEW_TOKENS})"]
    assert notes[0] == f"steps {tiny['steps']} (tiny preset; train.STEPS 200)"
    owned = [k for k in presets.OWNERS if k in tiny]  # the paper's numbers too (train.py's)
    assert [n.split()[0] for n in notes] == owned
    given = parse_train(["--preset", "tiny", "--t-max", "3", "--out", str(tmp_path)])
    assert [n.split()[0] for n in presets.preset_notes(given)] == [k for k in owned if k != "t_max"]
    assert presets.preset_notes(parse_train(["--preset", "paper", "--plan", "--out", str(tmp_path)])) == []



def test_the_sampling_entry_a_preset_or_eval_picks_is_said(tmp_path):
    """The cpu preset's rollout.SAMPLING["cpu"], and eval.py's pick of it for SmolLM2, are named
    like every other override, with the values that differ from the default entry."""
    import argparse
    from persuarena import rollout
    cpu, paper = rollout.SAMPLING["cpu"][0], rollout.SAMPLING["paper"][0]
    line = (f"sampling cpu (cpu preset; rollout.SAMPLING['paper'] by default): persuader "
            f"temperature {cpu.temperature} ({paper.temperature})")
    assert presets.preset_notes(parse_train(["--preset", "cpu", "--out", str(tmp_path)]))[-1] == line
    assert not any(n.startswith("sampling") for n in presets.preset_notes(
        parse_train(["--preset", "cpu", "--sampling", "cpu", "--out", str(tmp_path)]), ["sampling"]))
    args = argparse.Namespace(sampling=None)
    assert evaluation.sampling_line(args, evaluation.DEFAULT_MODEL).startswith(
        f"sampling cpu (eval.CPU_SAMPLING_MODELS: {evaluation.DEFAULT_MODEL};")
    assert evaluation.sampling_line(args, "random:tiny-qwen3") is None
    assert evaluation.sampling_line(argparse.Namespace(sampling="cpu"), evaluation.DEFAULT_MODEL) is None

# -----------------------------------------------------------------------------
# a run's evaluations: its own sampling, lambda and anchor


def test_a_runs_periodic_evaluation_samples_with_its_own_flags(trained_run):
    """The shared run was trained with its own four sampling flags: its evaluation at step 1
    played with them (what rollout received) and recorded them."""
    folder, argv = trained_run
    flags = dict(zip(argv[::2], argv[1::2]))
    persuader = [float(flags["--persuader-temperature"]), None, None]
    persuadee = [float(flags["--persuadee-temperature"]), float(flags["--persuadee-top-p"]),
                 int(flags["--persuadee-top-k"])]
    roles = json.loads((folder / "eval-1" / "summary.json").read_text())["roles"]
    assert roles["persuader"]["sampling"] == persuader and roles["persuadee"]["sampling"] == persuadee
    played = json.loads((folder / "played-sampling.json").read_text())
    assert played["training"] == played["evaluation"] == [persuader, persuadee]


def test_a_standalone_summary_of_a_lambda_0_run_reports_shaping_at_lambda_0(run_copy, tmp_path,
                                                                            monkeypatch):
    run, argv = run_copy
    assert json.loads((run / "config.json").read_text())["lam"] == 0 != rpo.LAMBDA
    monkeypatch.setattr(evaluation, "EVALS_DIR", str(tmp_path / "evals"))
    evaluation.main(["--persuader", str(run / "checkpoint-1"), "--persuadee", "random:tiny-qwen3",
               "--judge", "none", "--limit", "1", "--t-max", "1", "--max-new-tokens", "2",
               "--kv-blocks", "600", "--name", "standalone"])
    folder = tmp_path / "evals" / "standalone"
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["shaping_lambda"] == 0
    flags = dict(zip(argv[::2], argv[1::2]))  # the run's own sampling, read from config.json
    assert summary["roles"]["persuader"]["sampling"][0] == float(flags["--persuader-temperature"])
    for analyzed in (folder, run / "eval-1"):
        (analyzed / "summary.json").unlink()
        evaluation.main(["--analyze", str(analyzed)])
        assert json.loads((analyzed / "summary.json").read_text())["shaping_lambda"] == 0

def test_the_sampling_flags_name_rollouts_presets():
    """--sampling offers the presets rollout.SAMPLING holds (read there, never copied), and the
    flags resolve as the presets overridden flag by flag."""
    import argparse
    parser = argparse.ArgumentParser()
    cli.add_sampling_flags(parser)
    assert next(a for a in parser._actions if a.dest == "sampling").choices == tuple(rollout.SAMPLING)
    args = parser.parse_args(["--sampling", "cpu", "--persuadee-top-k", "5"])
    persuader, persuadee = cli.role_sampling(args)
    assert persuader == rollout.SAMPLING["cpu"][0]
    assert persuadee == rollout.SAMPLING["cpu"][1]._replace(top_k=5)


def test_the_episode_record_has_one_schema(tmp_path):
    """rollout.Episode.record() writes exactly rollout.RECORD_FIELDS less the stamps and labels;
    an evaluation's saved episode holds exactly the record's fields less the training stream;
    what the analyses check is part of the record."""
    from persuarena import arena
    from persuarena import engine
    from conftest import tiny_model
    tokenizer = models.tiny_tokenizer()
    engines = [engine.Engine(tiny_model(a), tokenizer, num_blocks=400) for a in ("llama", "qwen3")]
    [episode] = rollout.rollout_episodes(*engines, arena.heldout_instances()[:1], 1, max_new_tokens=2)
    kind = {f.name: f.metadata.get("kind") for f in dataclasses.fields(rollout.Episode)}
    schema = set(rollout.RECORD_FIELDS)
    assert set(episode.record()) == {k for k in schema if kind[k] in ("play", "training")}
    assert set(records.EPISODE_FIELDS) <= schema
    evaluation.evaluate(*engines, arena.heldout_instances()[:1], tmp_path / "e", t_max=1, fidelity=0,
                  max_new_tokens=2)
    [saved] = [json.loads(line) for line in (tmp_path / "e" / "episodes.jsonl").read_text().splitlines()]
    assert set(saved) == schema - set(rollout.TRAINING_FIELDS)


def test_eval_resume_keeps_the_evaluations_own_settings(tmp_path, monkeypatch, capsys):
    """eval.py --resume means what train.py --resume means: a setting the command line leaves
    out is the evaluation's own (here --seed 1 and --t-max 1), one it changes is refused."""
    monkeypatch.setattr(evaluation, "EVALS_DIR", str(tmp_path))
    argv = ["--persuader", "random:tiny-llama", "--persuadee", "random:tiny-qwen3", "--limit", "1",
            "--max-new-tokens", "2", "--kv-blocks", "600", "--name", "r"]
    evaluation.main(argv + ["--seed", "1", "--t-max", "1"])
    lines = (tmp_path / "r" / "episodes.jsonl").read_text()
    evaluation.main(["--name", "r", "--resume"])
    assert "1 of 1 episodes already played" in capsys.readouterr().err
    assert (tmp_path / "r" / "episodes.jsonl").read_text() == lines
    with pytest.raises(SystemExit, match="seed 1 there, 2 now"):
        evaluation.main(["--name", "r", "--resume", "--seed", "2"])


def test_pinned_constants_hold_every_caps_constant_json_can():
    """cli.pinned_constants: the CAPS constants of the method's modules and the entry point's
    own, as JSON holds them; where files are (_PATH, _DIR) and what JSON cannot hold are not."""
    from persuarena import arena
    pinned = cli.pinned_constants(train)
    assert pinned["train.MAX_SKIPPED_STEPS"] == train.MAX_SKIPPED_STEPS
    assert pinned["arena.T_MAX_TRAIN"] == arena.T_MAX_TRAIN
    assert pinned["rollout.DECISION"] == rollout.DECISION
    from lab import gguf, hardening
    assert pinned["arena.NEGATIONS"] == sorted(arena.NEGATIONS, key=repr)
    assert "arena.SCENARIOS_PATH" not in pinned and not any(k.startswith("lab.gguf") for k in pinned)
    assert gguf.CACHE_DIR and not any(k.startswith(("engine.", "layers.")) for k in pinned)
    assert "arena.TAG_RE" not in pinned
    assert json.loads(json.dumps(pinned)) == pinned


# -----------------------------------------------------------------------------
# Ctrl-C: as SIGTERM, at once, in one line


STALLED_STEP = """
import sys, time
from persuarena import train
def stalled(*a, **k):  # the update of step 2 never ends on its own: only an interrupt ends the run
    print("in flight", flush=True)
    time.sleep(600)
train.policy_update = stalled
train.main(sys.argv[1:])
"""


def test_ctrl_c_with_a_step_in_flight_ends_the_run_at_once_in_one_line(tmp_path, short_scenarios):
    import signal
    proc = warm.popen(  # started warm: tests/warm.py
        ["-c", STALLED_STEP, "--preset", "tiny", "--judge", "none", "--scenarios",
         short_scenarios, "--out", str(tmp_path), "--name", "r", "--steps", "3", "--max-new-tokens", "3"],
        {**os.environ, "PYTHONPATH": str(HERE)}, HERE)
    for line in proc.stdout:  # the step is in its update
        if line.startswith("in flight"):
            break
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)  # the stalled update would hold the run for 600 s
    assert proc.returncode == 130 and "Traceback" not in err  # (the progress bars are stderr's too)
    assert err.endswith(f"\ntrain.py: interrupted (Ctrl-C); {tmp_path / 'r'} keeps its last checkpoint: "
                        "continue with --resume\n")


def test_overwrite_and_resume_refuse_another_programs_folder(tmp_path, short_scenarios, monkeypatch,
                                                            no_model_loads):
    """--overwrite (or --resume) of a folder another program of the project wrote (its marker
    names it) is refused in one line, nothing deleted, both ways: train.py on an evaluation's
    folder, eval.py on a training run's (each once deleted the other's)."""
    from lab import runs
    evals, trained = tmp_path / "f" / "an-eval", tmp_path / "f" / "a-run"
    for folder, who, kept in ((evals, "eval.py", "summary.json"), (trained, "train.py", "metrics.jsonl")):
        folder.mkdir(parents=True)
        (folder / runs.MARKER).write_text(f"a PersuArena run folder, written by {who}\n")
        (folder / kept).write_text("{}\n")
    for flag in ("--overwrite", "--resume"):
        with pytest.raises(SystemExit) as e:
            train.main(["--preset", "tiny", "--scenarios", short_scenarios, "--out",
                        str(tmp_path / "f"), "--name", "an-eval", flag])
        assert "another program (eval.py), not of train.py" in str(e.value.code)
    monkeypatch.setattr(evaluation, "EVALS_DIR", str(tmp_path / "f"))
    with pytest.raises(SystemExit, match=r"another program \(train.py\), not of eval.py"):
        evaluation.main(["--persuader", "random:tiny-llama", "--persuadee", "random:tiny-qwen3",
                         "--limit", "1", "--name", "a-run", "--overwrite"])
    assert (evals / "summary.json").is_file() and (trained / "metrics.jsonl").is_file()


def test_a_failed_write_blames_the_disk_only_when_it_is_full(tmp_path):
    """runs.write_failure advises freeing space for a full disk (ENOSPC, or less free than
    needed) and for a library's own words, but names the cause of any other OSError instead."""
    import errno
    from lab import runs
    full = runs.write_failure("x", "a file", tmp_path, OSError(errno.ENOSPC, "No space left"), "kept")
    denied = runs.write_failure("x", "a file", tmp_path, OSError(errno.EACCES, "Permission denied"),
                                "kept")
    assert "the disk is full" in full and "free space there" in full
    assert "Permission denied" in denied and "fix that" in denied and "free space" not in denied


def test_deeply_nested_json_in_a_run_file_is_one_line(tmp_path, capsys):
    """A line or a config nested too deep for Python's parser (a RecursionError, past every
    except ValueError) is refused in one line: an evaluation's episodes.jsonl under --analyze,
    a sweep's sweep.json, a LoRA adapter's config."""
    from lab import jsonl, lora
    deep = "[" * 100_000 + "]" * 100_000
    folder = tmp_path / "ev"
    folder.mkdir()
    (folder / "episodes.jsonl").write_text(deep + "\n{}\n")
    with pytest.raises(SystemExit) as e:
        evaluation.main(["--analyze", str(folder)])
    assert "nested too deep" in str(e.value.code) and "\n" not in str(e.value.code)
    with pytest.raises(ValueError, match="nested too deep"):
        jsonl.loads(deep)
    (tmp_path / lora.ADAPTER_CONFIG).write_text(deep)
    assert "nested too deep" in lora.read_adapter_config(tmp_path)[1]
