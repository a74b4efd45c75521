"""trl_grpo.py: TRL's GRPOTrainer trains a tiny persuader against PersuasionEnv on a CPU; the
rewards it logs are the arena's, its completions are the episodes the env played."""
import json
import threading

import pytest
import torch

from persuarena import engine
from persuarena import models
from persuarena import rpo
from conftest import tiny_model
from lab import env as persuasion_env
from lab import trl_grpo
from test_env_server import openenv_server  # noqa: F401
from test_served import instances

# on the worker that runs test_env_server's tests: importing trl (~1.5 CPU-s) and the OpenEnv
# server (openenv and gradio, ~5) is then paid once
pytestmark = pytest.mark.xdist_group("openenv")

TURN_TOKENS = 6
GROUP = 2  # episodes per instance (GRPO's group)


def recording(env):
    """env with each step()'s (reward, terminated, truncated, info) kept, per episode."""
    played, real_reset, real_step = [], env.reset, env.step

    def reset(**kw):
        played.append(dict(instance=kw["options"]["instance"], steps=[]))
        return real_reset(**kw)

    def step(text):
        out = real_step(text)
        played[-1]["steps"].append(dict(text=text, reply=out[0], reward=out[1], info=out[4]))
        return out
    env.reset, env.step = reset, step
    return played


def test_grpo_trainer_trains_on_the_arenas_rewards(tmp_path):
    """Two GRPO steps of a tiny random persuader against a tiny persuadee, judge off: each step's
    logged rewards are the means over its episodes of what the env reported, checked against
    the beliefs in the env's last info ((b_T - b_0) / 2) and the outcome (G(outcome) + 0.5 * 0);
    the mixed reward is outcome + LAMBDA * dense; a step's group is one instance; the policy's
    weights move; the completion the trainer saw is the persuader's messages as the env took
    them, with the replies between them masked out."""
    tokenizer = models.tiny_tokenizer()
    persuadee = engine.Engine(tiny_model("qwen3", seed=2), tokenizer, 8, 2000)
    env = persuasion_env.PersuasionEnv(persuadee, scenarios=instances(), t_max=2,
                                       max_new_tokens=4, judge=None)
    played = recording(env)
    episodes = []
    policy, policy_tokenizer = models.random_model("tiny-qwen3", seed=1)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    config = trl_grpo.grpo_config(str(tmp_path), 2, num_generations=GROUP, learning_rate=1e-2)
    trainer = trl_grpo.trainer_for(env, policy, policy_tokenizer, config, turn_tokens=TURN_TOKENS,
                                   on_episode=lambda i, e: episodes.append(e))
    trainer.train()

    logged = [row for row in trainer.state.log_history if "reward" in row]
    assert [row["step"] for row in logged] == [1, 2] and len(played) == 2 * GROUP
    for row, start in zip(logged, range(0, len(played), GROUP)):
        group = played[start:start + GROUP]
        assert len({e["instance"] for e in group}) == 1
        last = [e["steps"][-1]["info"] for e in group]
        dense = [(info["beliefs"][-1] - info["beliefs"][0]) / 2 for info in last]
        outcome = [{"ACCEPT": 3.0, "CONDITIONAL_ACCEPT": 1.0, "PENDING": 0.0, "REJECT": -1.0,
                    "WALK_AWAY": -2.0}[info["outcome"]] for info in last]
        for e, d in zip(group, dense):
            assert sum(s["reward"] for s in e["steps"]) == pytest.approx(d, abs=1e-9)
        assert row["rewards/arena_dense/mean"] == pytest.approx(sum(dense) / GROUP, abs=1e-6)
        assert row["rewards/arena_outcome/mean"] == pytest.approx(sum(outcome) / GROUP, abs=1e-6)
        assert row["reward"] == pytest.approx(
            (sum(outcome) + rpo.LAMBDA * sum(dense)) / GROUP, abs=1e-6)
    assert any(not torch.equal(before[k], v) for k, v in policy.state_dict().items())

    for e, got in zip(played, episodes):  # the trainer's completion: messages sent, replies heard
        segments, ids, mask = [], got["completion_ids"], got["env_mask"]
        for i, m in enumerate(mask):
            if i == 0 or m != mask[i - 1]:
                segments.append((m, []))
            segments[-1][1].append(ids[i])
        said = [policy_tokenizer.decode(s, skip_special_tokens=True) for m, s in segments if m]
        heard = [policy_tokenizer.decode(s) for m, s in segments if not m]
        assert said == [s["text"] for s in e["steps"]] and len(got["logprobs"]) == len(ids)
        assert len(heard) == len(e["steps"]) - 1
        for h, s in zip(heard, e["steps"]):
            assert s["reply"][0]["content"] in h
        assert all(lp == 0.0 for lp, m in zip(got["logprobs"], mask) if not m)
        assert all(lp <= 0.0 for lp in got["logprobs"])


SERVER_GROUP = 4  # generations a step plays at once against the server


def test_grpo_trainer_drives_the_openenv_server_concurrently(openenv_server, tmp_path):  # noqa: F811
    """One GRPO step of 4 generations over openenv's client against the OpenEnv server: the
    4 episodes play as 4 sessions at once (the persuadee replied to several in one engine step),
    the logged rewards are the means of what the server reported per step (the episodes' own
    sums), and the server's pool is whole after."""
    url, _, persuadee = openenv_server
    batches, generate = [], persuadee.generate

    def counted(sids, *args, **kwargs):
        batches.append(len(sids))
        return generate(sids, *args, **kwargs)
    persuadee.generate = counted
    env = trl_grpo.ServerEnv(url, instances())
    episodes = []
    policy, policy_tokenizer = models.random_model("tiny-qwen3", seed=3)
    config = trl_grpo.grpo_config(str(tmp_path), 1, num_generations=SERVER_GROUP)
    trainer = trl_grpo.trainer_for(env, policy, policy_tokenizer, config, turn_tokens=TURN_TOKENS,
                                   on_episode=lambda i, e: episodes.append((i, e)))
    trainer.train()
    assert len(env.pool) == SERVER_GROUP - 1  # the env's own session is one of the group's
    env.close()
    persuadee.generate = generate
    (row,) = [row for row in trainer.state.log_history if "reward" in row]
    assert len(episodes) == SERVER_GROUP and len({i for i, _ in episodes}) == 1
    assert max(batches) > 1  # sessions' replies shared engine steps
    assert all(1 <= e["turns"] <= 3 for _, e in episodes)
    dense = sum(sum(e["step_rewards"]) for _, e in episodes) / SERVER_GROUP
    outcome = sum(e["arena_outcome"] for _, e in episodes) / SERVER_GROUP
    assert row["rewards/arena_dense/mean"] == pytest.approx(dense, abs=1e-6)
    assert row["rewards/arena_outcome/mean"] == pytest.approx(outcome, abs=1e-6)
    for _ in range(200):
        if len(persuadee.cache.free_blocks) == 2000:
            break
        threading.Event().wait(0.05)
    assert len(persuadee.cache.free_blocks) == 2000


def test_a_message_after_a_cached_context_equals_one_after_the_whole_context():
    """persuader_message with the episode's cache carried from turn to turn gives, greedy, the
    ids of a plain generate over the whole context, and log-probs equal to rounding."""
    policy, tokenizer = models.random_model("tiny-qwen3", seed=1)
    policy.eval()
    gen = dict(do_sample=False, max_new_tokens=6, eos_token_id=[-1], pad_token_id=0,
               return_dict_in_generate=True, output_scores=True)
    context, cache = list(range(20, 60)), trl_grpo.DynamicCache()
    for turn in range(3):
        cached = trl_grpo.persuader_message(policy, context, gen, cache)
        plain = trl_grpo.persuader_message(policy, context, gen)
        assert cached[0] == plain[0]
        assert torch.allclose(torch.tensor(cached[1]), torch.tensor(plain[1]), atol=1e-4)
        assert cache.get_seq_length() == len(context) + len(cached[0]) - 1
        context = context + cached[0] + list(range(70 + turn, 80 + turn))  # the reply's ids


def test_a_prompt_that_is_no_instance_is_refused_in_one_line(tokenizer):
    env = persuasion_env.PersuasionEnv(engine.Engine(tiny_model("qwen3"), tokenizer, 8, 2000),
                                       scenarios=instances(), t_max=1, judge=None)
    with pytest.raises(ValueError, match="no instance .*train-9999.* ids look like"):
        trl_grpo.prompt_dataset(env, ["train-9999"])
    dataset, by_prompt = trl_grpo.prompt_dataset(env)
    assert dataset["instance"] == ["train-0001", "train-0002", "train-0003"]
    rollout = trl_grpo.make_rollout(env, by_prompt)
    with pytest.raises(ValueError, match="no instance's opening"):
        rollout([[{"role": "user", "content": "hi"}]], trainer=None)


def test_bad_flags_are_one_line_errors(capsys):
    for flags, says in ((["--num-generations", "1"], "GRPO requires at least 2 generations"),
                        (["--num_generations", "66", "--per_device_train_batch_size", "66"],
                         "--num_generations must be in 2..64"),
                        (["--max_steps", "0"], "--max_steps must be at least 1"),
                        (["--lam", "nan"], "--lam must be >= 0"),
                        (["--lam", "inf"], "--lam must be >= 0 and finite"),
                        (["--learning-rate", "inf"], "--learning_rate must be in (0, 1]"),
                        (["--seed", "-1"], "--seed must be in 0.."),
                        (["--policy", "random:nope"], "--policy random:nope"),
                        (["--server", "127.0.0.1:8000"], "--server takes a URL")):
        with pytest.raises(SystemExit):
            trl_grpo.parse_args(flags)
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert says in err, err


TINY = ["--policy", "random:tiny-qwen3", "--persuadee", "random:tiny-qwen3", "--judge", "none",
        "--t-max", "1", "--turn-tokens", "4", "--max-new-tokens", "4", "--num-generations", "2",
        "--instances", "1"]


def test_trls_own_parser_reads_a_recipe_and_the_flags_over_it(tmp_path, monkeypatch):
    """TrlParser over GRPOConfig: --config recipe.yaml sets GRPOConfig's and the arena's fields,
    a flag overrides the file, TRL's loggers are the user's (--report_to), its progress bar on;
    --help names every flag with its default."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("max_steps: 7\nlearning_rate: 3.0e-6\nscenarios: heldout\n"
                      "report_to: tensorboard\noutput_dir: runs/from-recipe\n")
    args = trl_grpo.parse_args(TINY + ["--config", str(recipe), "--max_steps", "5"])
    assert (args.steps, args.learning_rate, args.scenarios) == (5, 3e-6, "heldout")
    assert args.grpo.report_to == ["tensorboard"] and not args.grpo.disable_tqdm
    assert args.grpo.reward_weights == [1.0, rpo.LAMBDA] and args.out == "runs/from-recipe"
    assert args.judge == "none"
    import contextlib
    import io
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown), pytest.raises(SystemExit):
        trl_grpo.parse_args(["--help"])
    text = " ".join(shown.getvalue().split())
    for flag in ("--output_dir", "--max_steps", "--report_to", "--config", "--persuadee",
                 "--t_max", "--lam"):
        assert flag in text
    assert "(default: smollm2)" in text and "(default: runs/trl-grpo)" in text


def test_out_is_a_protected_run_folder(tmp_path, monkeypatch, short_scenarios):
    """--out refuses, in one line and before any model loads: a train.py run (plain, with
    --overwrite, with --resume), a folder inside a run, a missing scenarios file, a server that
    is down; the train.py run's config.json is untouched (the old --out replaced it)."""
    from lab import runs

    def no_weights(*args, **kwargs):
        raise AssertionError("a model loaded before the run folder was checked")
    monkeypatch.setattr(models, "load_model", no_weights)
    train_run = tmp_path / "train-run"
    train_run.mkdir()
    (train_run / runs.MARKER).write_text("a PersuArena run folder, written by train.py\n")
    (train_run / "config.json").write_text(json.dumps({"name": "train-run", "lr": 1e-5}))
    base = TINY + ["--scenarios", short_scenarios, "--max_steps", "1"]
    for extra, says in (([], "is an existing run"), (["--overwrite"], "another program"),
                        (["--resume"], "another program (train.py)")):
        with pytest.raises(SystemExit) as excinfo:
            trl_grpo.main(base + ["--output_dir", str(train_run)] + extra)
        assert says in str(excinfo.value) and "\n" not in str(excinfo.value)
    assert json.loads((train_run / "config.json").read_text()) == {"name": "train-run",
                                                                  "lr": 1e-5}
    for argv, says in ((base + ["--output_dir", str(train_run / "inner")], "is inside the run"),
                       (TINY + ["--scenarios", str(tmp_path / "no.jsonl"), "--output_dir",
                                str(tmp_path / "b")], "cannot load scenarios"),
                       (base + ["--server", "http://127.0.0.1:9", "--output_dir",
                                str(tmp_path / "c")],
                        "cannot reach the arena server")):
        with pytest.raises(SystemExit) as excinfo:
            trl_grpo.main(argv)
        assert says in str(excinfo.value) and "\n" not in str(excinfo.value)


def test_training_is_saved_as_it_goes_and_resumes(tmp_path, short_scenarios):
    """Each step leaves a whole checkpoint named by `latest` (written atomically); --resume
    continues from it to the new --steps; the persuader folder is written at the end."""
    out = tmp_path / "run"
    argv = TINY + ["--scenarios", short_scenarios, "--output_dir", str(out)]
    trl_grpo.main(argv + ["--max_steps", "1"])
    assert (out / "latest").read_text() == "checkpoint-1" and (out / "persuader").is_dir()
    config = (out / "config.json").read_text()
    for changed in (["--lam", "2"], ["--persuadee", "random:tiny-llama"], ["--t-max", "2"]):
        with pytest.raises(SystemExit) as excinfo:
            trl_grpo.main(argv + ["--max_steps", "2", "--resume"] + changed)
        assert "--resume keeps the run's settings" in str(excinfo.value) and changed[0] in \
            str(excinfo.value) and "\n" not in str(excinfo.value)
    assert (out / "config.json").read_text() == config and (out / "latest").read_text() == \
        "checkpoint-1"
    trl_grpo.main(["--output_dir", str(out), "--max_steps", "2", "--resume"])  # every other setting pinned
    assert (out / "latest").read_text() == "checkpoint-2"
    assert json.loads((out / "config.json").read_text()) == json.loads(config)
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["global_step"] == 2
    assert [row["step"] for row in state["log_history"] if "reward" in row] == [1, 2]


def test_a_resumed_rollout_plays_the_seeds_of_an_uninterrupted_one(monkeypatch, tmp_path):
    """The episode seeds follow the trainer's step (restored on --resume), not a count that
    restarts with the process; `latest` never names a checkpoint whose weights are not finite
    (the run stops in one line, latest left on the last finite one)."""
    from types import SimpleNamespace
    played = []
    monkeypatch.setattr(trl_grpo, "play_episode", lambda env, m, t, i, seed, g: played.append(seed)
                        or dict(prompt_ids=[], completion_ids=[], logprobs=[], env_mask=[],
                                arena_outcome=0.0, arena_dense=0.0))
    prompt = [{"role": "user", "content": "hi"}]
    rollout = trl_grpo.make_rollout(object(), {trl_grpo.prompt_key(prompt): "a"}, seed=5)
    model = torch.nn.Linear(1, 1)
    for step in (0, 3):  # a fresh process resumed at step 3 plays step 3's seeds
        trainer = SimpleNamespace(accelerator=SimpleNamespace(unwrap_model=lambda m: m),
                                  model=model, generation_kwargs={"eos_token_id": 0},
                                  processing_class=None, state=SimpleNamespace(global_step=step))
        rollout([prompt] * 2, trainer)
    assert played == [5, 6, 11, 12]
    (tmp_path / "checkpoint-1").mkdir()
    (tmp_path / "checkpoint-2").mkdir()
    latest = trl_grpo.latest_callback(tmp_path)
    latest.on_save(None, SimpleNamespace(global_step=1), None, model=model)
    with torch.no_grad():
        model.weight.fill_(float("nan"))
    with pytest.raises(SystemExit) as excinfo:
        latest.on_save(None, SimpleNamespace(global_step=2), None, model=model)
    assert "not finite at step 2" in str(excinfo.value) and "\n" not in str(excinfo.value)
    assert (tmp_path / "latest").read_text() == "checkpoint-1"
