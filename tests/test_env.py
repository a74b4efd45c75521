"""env.py: PersuasionEnv plays the episodes rollout.py's loop plays (local and served persuadee),
passes gymnasium's checker, and serves them over OpenEnv to openenv-core's own client."""
import pytest

import arena
import engine
from lab import env as persuasion_env
import rollout
from lab import served
from lab.play import PersonSide
from conftest import tiny_model
from test_served import Loopback, ScriptedServer, answer_tokenizer, instances  # noqa: F401

MESSAGES = ["Hello Ana, I hear the shifts are early. [ACCEPT]", "Would the leaflet on side effects "
            "help?", "We could book the quietest slot.", "One more thought.", "Last one."]


def scripted(messages):
    """A person's side reading the scripted messages: the project's loop with those messages."""
    lines = iter(messages)

    def read(prompt):
        return next(lines)
    return PersonSide(len(messages), read=read, write=lambda *a: None)


def play_loop(persuadee, inst, t_max, seed, judge=None, **kw):
    return rollout.rollout_episodes(scripted(MESSAGES), persuadee, [inst], t_max, seed=seed,
                                    judge=judge, **kw)[0]


def play_env(env, inst, seed):
    """The scripted messages through the env: (the per-step results, the last info)."""
    messages, info = env.reset(seed=seed, options={"instance": inst["id"]})
    assert list(messages) == arena.persuader_messages(inst) and info["turn"] == 0
    beliefs0, steps = info["beliefs"], []
    for text in MESSAGES:
        obs, reward, terminated, truncated, info = env.step(text)
        steps.append((obs, reward, terminated, truncated, info))
        if terminated or truncated:
            break
    assert steps[0][4]["beliefs"][0] == beliefs0[0]
    return steps


def assert_same(record, steps):
    info = steps[-1][4]
    got = info["record"]
    assert (got["transcript"], got["outcome"], got["end_reason"], got["turns"]) == \
        (record["transcript"], record["outcome"], record["end_reason"], record["turns"])
    assert info["beliefs"] == record["beliefs"] and got["probes"] == record["probes"]
    assert (info["strategy"], info["judge_failed"]) == (record["judge"], record["judge_failed"])
    replies = [m["text"] for m in record["transcript"] if m["role"] == "persuadee"]
    assert [s[0][0]["content"] for s in steps] == [arena.persuader_sees(t) for t in replies]
    for t, (_, reward, _, _, step_info) in enumerate(steps, 1):
        assert step_info["beliefs"] == record["beliefs"][:t + 1]
        assert list(step_info["probes"].values()) == record["probes"][t]
        assert list(step_info["probe_mass"].values()) == record["probe_mass"][t]
        assert reward == pytest.approx((record["beliefs"][t] - record["beliefs"][t - 1]) / 2)
    total = sum(s[1] for s in steps)
    assert total == pytest.approx((record["beliefs"][-1] - record["beliefs"][0]) / 2, abs=1e-12)
    assert info["goal_reward"] == {"ACCEPT": 3.0, "PENDING": 0.0, "REJECT": -1.0}[record["outcome"]]
    assert steps[-1][2] == (record["end_reason"] in ("decision", "rejections", "window"))
    assert steps[-1][3] == (not steps[-1][2])


def test_a_local_persuadee_plays_the_loops_episode(tokenizer):
    """Scripted messages through PersuasionEnv and through rollout.py's loop (a person's side),
    sampled persuadee, same seed: the same transcript, beliefs, probes and outcome."""
    inst = instances()[0]
    ee = engine.Engine(tiny_model("qwen3", seed=2), tokenizer, 8, 2000)
    kw = dict(max_new_tokens=6, persuadee_sampling=rollout.FROZEN_SAMPLING)
    record = play_loop(ee, inst, 3, seed=11, **kw)
    env = persuasion_env.PersuasionEnv(ee, scenarios=instances(), t_max=3, max_new_tokens=6,
                                       judge=None)  # the judge's equality: the scripted test
    steps = play_env(env, inst, 11)
    assert_same(record, steps)
    assert record["end_reason"] == "budget" and steps[-1][3]
    again = play_env(env, inst, 11)  # a second episode on the same env, same seed: the same
    assert [s[1] for s in again] == [s[1] for s in steps]
    env.close()
    assert len(ee.cache.free_blocks) == 2000  # every block came back


def test_a_served_persuadee_plays_the_loops_episode(answer_tokenizer):  # noqa: F811
    """The same through a loopback OpenAI-compatible server wrapping a tiny model (probes from
    its top log-probs), greedy."""
    inst = instances()[1]
    server = Loopback(tiny_model("qwen3", seed=2), answer_tokenizer)
    try:
        model = served.ServedModel(server.spec, backoff=False)
        kw = dict(max_new_tokens=6, persuadee_sampling=engine.GREEDY)
        record = play_loop(model, inst, 3, seed=5, **kw)
        env = persuasion_env.PersuasionEnv(model, scenarios=instances(), t_max=3,
                                           max_new_tokens=6, sampling=engine.GREEDY, judge=None)
        assert_same(record, play_env(env, inst, 5))
        assert None not in record["beliefs"]
    finally:
        server.close()


@pytest.mark.parametrize("day, outcome", [(1, "ACCEPT"), (3, "REJECT")])
def test_a_decision_terminates_with_the_goal_reward(day, outcome):
    """A scripted served persuadee that decides: the episode terminates on its decision, with
    the goal reward, the judge's score and the outcome reward in the last info."""
    inst = instances((day,))[0]
    model = ScriptedServer().model()
    record = play_loop(model, inst, 4, seed=0, judge=model, max_new_tokens=8)
    env = persuasion_env.PersuasionEnv(model, scenarios=[inst], t_max=4, max_new_tokens=8)
    steps = play_env(env, inst, 0)
    assert_same(record, steps)
    info = steps[-1][4]
    assert record["outcome"] == outcome and steps[-1][2] and not steps[-1][3]
    assert info["strategy"] == 1.0 and info["outcome_reward"] == info["goal_reward"] + 0.5
    assert "[ACCEPT]" not in steps[-1][0][0]["content"]  # the reply reaches the trainer stripped
    with pytest.raises(RuntimeError, match="call reset"):
        env.step("After the end.")


def test_gymnasiums_checker_passes_and_bad_input_is_named(tokenizer):
    from gymnasium.utils.env_checker import check_env
    ee = engine.Engine(tiny_model("qwen3", seed=2), tokenizer, 8, 2000)
    env = persuasion_env.PersuasionEnv(ee, scenarios=instances(), t_max=2, max_new_tokens=4,
                                       judge=None)
    check_env(env, skip_render_check=True)
    obs, info = env.reset(seed=1)
    assert env.observation_space.contains(obs) and info["instance"] in env.by_id
    with pytest.raises(TypeError, match="as a str"):
        env.step(["not", "text"])
    with pytest.raises(ValueError, match="no instance"):
        env.reset(options={"instance": "nope"})
    with pytest.raises(ValueError, match="unknown reset option"):
        env.reset(options={"scenario": 1})
    with pytest.raises(ValueError, match="t_max must be a positive integer"):
        persuasion_env.PersuasionEnv(ee, scenarios=instances(), t_max=0)
    obs, *_ = env.reset(seed=2, options={"instance": instances()[0]["id"]})
    assert env.step("Still here after the bad calls?")[4]["turn"] == 1
    env.close()
    assert len(ee.cache.free_blocks) == 2000


@pytest.fixture
def openenv_server(tokenizer):
    """env.py's OpenEnv app on 127.0.0.1 (a free port) over a tiny local persuadee, in a thread."""
    import socket
    import threading

    import uvicorn
    ee = engine.Engine(tiny_model("qwen3", seed=2), tokenizer, 8, 2000)

    def make_env():
        return persuasion_env.PersuasionEnv(ee, scenarios=instances(), t_max=3, max_new_tokens=6,
                                            judge=None)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(persuasion_env.openenv_app(make_env), host="127.0.0.1",
                                           port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started and thread.is_alive():
        thread.join(0.05)
    yield f"http://127.0.0.1:{port}", make_env, ee
    server.should_exit = True
    thread.join(30)


def test_openenvs_own_client_plays_a_whole_episode(openenv_server):
    """openenv-core's GenericEnvClient over the WebSocket session: the episode the env plays
    in-process for the same seed; a malformed action gets env.py's error and the episode goes on."""
    from openenv.core import GenericEnvClient
    url, make_env, ee = openenv_server
    inst = instances()[0]
    local = play_env(make_env(), inst, 4)
    with GenericEnvClient(base_url=url).sync() as client:
        first = client.reset(seed=4, instance=inst["id"])
        assert first.observation["messages"] == arena.persuader_messages(inst)
        assert first.observation["info"]["beliefs"] == local[0][4]["beliefs"][:1]
        results = []
        for k, text in enumerate(MESSAGES):
            if k == 1:
                for bad in ({"text": text}, {"message": 3}):
                    with pytest.raises(RuntimeError, match='a step is {"message"'):
                        client.step(bad)
            results.append(client.step({"message": text}))
            if results[-1].done:
                break
        state = client.state()
    assert len(results) == len(local) and state["instance"] == inst["id"] and state["done"]
    for got, (obs, reward, terminated, truncated, info) in zip(results, local):
        assert got.observation["messages"] == list(obs) and got.reward == reward
        assert (got.observation["terminated"], got.observation["truncated"]) == \
            (terminated, truncated)
        assert got.observation["info"]["beliefs"] == info["beliefs"]
    assert results[-1].observation["info"]["record"]["transcript"] == \
        local[-1][4]["record"]["transcript"]
    assert len(ee.cache.free_blocks) == 2000


def test_the_server_cli_refuses_bad_flags_before_loading(capsys):
    for argv, words in ((["--port", "1"], "pass --serve"), (["--serve", "--port", "0"], "--port"),
                        (["--serve", "--t-max", "0"], "--t-max must be at least 1")):
        with pytest.raises(SystemExit):
            persuasion_env.parse_args(argv)
        assert words in capsys.readouterr().err


def test_the_server_cli_serves_on_loopback_only(monkeypatch, short_scenarios):
    import uvicorn
    served_at = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: served_at.update(app=app, **kw))
    persuasion_env.main(["--serve", "--port", "8123", "--persuadee", "random:tiny-qwen3",
                         "--scenarios", short_scenarios, "--judge", "none"])
    assert (served_at["host"], served_at["port"]) == ("127.0.0.1", 8123)
    assert {"/ws", "/reset", "/step", "/state"} <= {r.path for r in served_at["app"].routes}
