"""env.py: PersuasionEnv plays the episodes rollout.py's loop plays (local and served persuadee),
passes gymnasium's checker, and serves them over OpenEnv to openenv-core's own client; the server
survives hostile clients (bad resets mid-episode, lone surrogates, steps after the end, drops,
idle and never-used sessions) with its pool, threads and memory where they started."""
import threading

import pytest

from persuarena import arena
from persuarena import engine
from lab import env as persuasion_env
from persuarena import rollout
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
        (record.transcript, record.outcome, record.end_reason, record.turns)
    assert info["beliefs"] == record.beliefs and got["probes"] == record.probes
    assert (info["strategy"], info["judge_failed"]) == (record.judge, record.judge_failed)
    replies = [m["text"] for m in record.transcript if m["role"] == "persuadee"]
    assert [s[0][0]["content"] for s in steps] == [arena.persuader_sees(t) for t in replies]
    for t, (_, reward, _, _, step_info) in enumerate(steps, 1):
        assert step_info["beliefs"] == record.beliefs[:t + 1]
        assert list(step_info["probes"].values()) == record.probes[t]
        assert list(step_info["probe_mass"].values()) == record.probe_mass[t]
        assert reward == pytest.approx((record.beliefs[t] - record.beliefs[t - 1]) / 2)
    total = sum(s[1] for s in steps)
    assert total == pytest.approx((record.beliefs[-1] - record.beliefs[0]) / 2, abs=1e-12)
    assert info["goal_reward"] == {"ACCEPT": 3.0, "PENDING": 0.0, "REJECT": -1.0}[record.outcome]
    assert steps[-1][2] == (record.end_reason in ("decision", "rejections", "window"))
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
    assert record.end_reason == "budget" and steps[-1][3]
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
        assert None not in record.beliefs
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
    assert record.outcome == outcome and steps[-1][2] and not steps[-1][3]
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
    with pytest.raises(ValueError, match="must be a dict"):
        env.reset(options="heldout-001")
    with pytest.raises(ValueError, match="t_max must be a positive integer"):
        persuasion_env.PersuasionEnv(ee, scenarios=instances(), t_max=0)
    obs, *_ = env.reset(seed=2, options={"instance": instances()[0]["id"]})
    assert env.step("Still here after the bad calls?")[4]["turn"] == 1
    env.close()
    assert len(ee.cache.free_blocks) == 2000


def one_line_error(excinfo):
    """The raised error's message, checked to be one line."""
    text = str(excinfo.value)
    assert "\n" not in text and text.startswith("env.py: "), text
    return text


BAD_INSTANCES = ("nope", ["heldout-001"], {"id": 1}, 7)


def test_a_bad_reset_or_a_lone_surrogate_leaves_the_episode_playing(tokenizer):
    """Mid-episode, a reset with an unknown id, a list, a dict or options that are no dict, and a
    message holding a lone surrogate, are each refused in one line: the episode goes on (the next
    message is its next turn) and the pool's free blocks do not move."""
    ee = engine.Engine(tiny_model("qwen3", seed=2), tokenizer, 8, 2000)
    env = persuasion_env.PersuasionEnv(ee, scenarios=instances(), t_max=4, max_new_tokens=4,
                                       judge=None)
    env.reset(seed=3, options={"instance": instances()[0]["id"]})
    assert env.step("Hello there.")[4]["turn"] == 1
    held = ee.free_blocks
    for options in [{"instance": bad} for bad in BAD_INSTANCES] + ["heldout-001", ["x"]]:
        with pytest.raises(ValueError) as excinfo:
            env.reset(seed=1, options=options)
        assert "episode goes on" in one_line_error(excinfo)
    for text in ("\ud800", "half an emoji \ud83d", "\udfff tail"):
        with pytest.raises(ValueError) as excinfo:
            env.step(text)
        assert "surrogate" in one_line_error(excinfo)
    assert ee.free_blocks == held and env.episode["instance"]["id"] == instances()[0]["id"]
    assert env.step("Still here?")[4]["turn"] == 2
    env.close()
    assert ee.free_blocks == 2000


def test_a_loop_that_fails_frees_its_blocks_and_step_never_waits(tokenizer, monkeypatch):
    """The persuadee's turn raises mid-episode: step answers in one line that the episode ended,
    its KV blocks are all back, and later steps answer at once (no worker to wait on), as does a
    step whose worker died without a word."""
    ee = engine.Engine(tiny_model("qwen3", seed=2), tokenizer, 8, 2000)
    env = persuasion_env.PersuasionEnv(ee, scenarios=instances(), t_max=4, max_new_tokens=4,
                                       judge=None)
    env.reset(seed=3)
    assert ee.free_blocks < 2000

    def broken(*args, **kwargs):
        raise TypeError("TextInputSequence must be str")
    monkeypatch.setattr(rollout.EngineSide, "reply", broken)
    with pytest.raises(RuntimeError) as excinfo:
        env.step("Hello.")
    assert "ended on TypeError: TextInputSequence" in one_line_error(excinfo)
    assert ee.free_blocks == 2000
    with pytest.raises(RuntimeError, match="call reset"):
        env.step("Anyone?")
    monkeypatch.undo()
    env.reset(seed=4)
    assert env.step("Hello?")[4]["turn"] == 1  # the hub's loop runs again
    env.close()
    for _ in range(200):  # the stop is posted; the loop frees the episode's blocks on its own
        if ee.free_blocks == 2000:
            break
        threading.Event().wait(0.05)
    assert ee.free_blocks == 2000


def test_episodes_sharing_an_engine_free_only_their_own_sequences(tokenizer):
    """Two envs over one engine, their calls interleaved (as the server's sessions are when a
    dropped one is closed after the next one started): closing one mid-episode frees its own
    sequences only, and the other plays on to its end; the pool is whole after both."""
    ee = engine.Engine(tiny_model("qwen3", seed=2), tokenizer, 8, 2000)
    first, second = (persuasion_env.PersuasionEnv(ee, scenarios=instances(), t_max=3,
                                                  max_new_tokens=4, judge=None) for _ in range(2))
    first.reset(seed=1)
    first.step("Hello.")
    second.reset(seed=2)
    assert second.step("Hi.")[4]["turn"] == 1
    first.step("Still there?")
    first.close()  # freed while second's sequences, numbered after first's began, are pending
    turn = second.step("Go on.")
    while not (turn[2] or turn[3]):
        turn = second.step("More.")
    assert turn[4]["record"]["turns"] == turn[4]["turn"]
    second.close()
    assert ee.free_blocks == 2000


def test_seeds_are_checked_and_a_second_thread_is_refused(tokenizer):
    """reset refuses a seed that is no integer in 0..SEED_MAX (True, 4,000 digits, -1, 1.5) in one
    line, the episode in play untouched; a step from a second thread while the first's step is in
    flight is refused in one line (the old env raised spurious TypeErrors), and the first's
    step returns its turn."""
    ee = engine.Engine(tiny_model("qwen3", seed=2), tokenizer, 8, 2000)
    env = persuasion_env.PersuasionEnv(ee, scenarios=instances(), t_max=3, max_new_tokens=4,
                                       judge=None)
    env.reset(seed=1)
    for seed in (True, int("9" * 4000), -1, 1.5, persuasion_env.SEED_MAX + 1):
        with pytest.raises(ValueError) as excinfo:
            env.reset(seed=seed)
        assert "a seed is an integer" in one_line_error(excinfo)
    entered, release = threading.Event(), threading.Event()
    generate = ee.generate

    def held(*args, **kwargs):
        entered.set()
        release.wait(60)
        return generate(*args, **kwargs)
    ee.generate = held
    first = []
    worker = threading.Thread(target=lambda: first.append(env.step("Hello.")))
    worker.start()
    assert entered.wait(30)
    for call in (lambda: env.step("Me too."), lambda: env.reset(seed=2)):
        with pytest.raises(RuntimeError) as excinfo:
            call()
        assert "another thread" in one_line_error(excinfo)
    release.set()
    worker.join(60)
    ee.generate = generate
    assert first[0][4]["turn"] == 1
    env.close()
    assert ee.free_blocks == 2000


def test_the_whole_conversation_observation_and_the_judge_by_the_presets_rule(tokenizer):
    ee = engine.Engine(tiny_model("qwen3", seed=2), tokenizer, 8, 2000)
    env = persuasion_env.PersuasionEnv(ee, scenarios=instances(), t_max=2, max_new_tokens=4,
                                       observation="conversation")
    opening, _ = env.reset(seed=0, options={"instance": instances()[0]["id"]})
    seen, *_ = env.step("Hello there.")
    assert seen[:2] == opening and seen[2] == {"role": "assistant", "content": "Hello there."}
    assert len(seen) == 4 and seen[3]["role"] == "user"
    env.close()
    assert env.judge is None  # a local persuadee on a CPU: no judge (the presets' laptop rule)
    assert persuasion_env.preset_judge("openai:m@http://127.0.0.1:1/v1") == "persuadee"
    assert persuasion_env.preset_judge("smollm2", "persuadee") == "persuadee"
    with pytest.raises(ValueError, match="observation 'all'"):
        persuasion_env.PersuasionEnv(ee, scenarios=instances(), observation="all")


def test_gym_make_knows_the_env_and_renders_ansi(tokenizer):
    """gym.make("PersuArena-v0") after importing lab.env, gymnasium's check_env passes; the ansi
    render is the conversation as the persuader saw it."""
    import gymnasium as gym
    from gymnasium.utils.env_checker import check_env
    env = gym.make("PersuArena-v0", persuadee="random:tiny-qwen3", scenarios=instances(),
                   t_max=2, max_new_tokens=4, judge=None, kv_blocks=2000, render_mode="ansi")
    ee = env.unwrapped.persuadee  # gym.make copies its arguments: a model by name
    assert not env.spec.disable_env_checker and env.spec.max_episode_steps == arena.T_MAX_TRAIN
    wrappers, inner = [], env
    while hasattr(inner, "env"):  # gym.make's wrappers, outermost first
        wrappers, inner = wrappers + [type(inner).__name__], inner.env
    assert {"PassiveEnvChecker", "TimeLimit"} <= set(wrappers)
    check_env(env.unwrapped)
    messages, _ = env.reset(seed=3, options={"instance": instances()[0]["id"]})
    reply, *_ = env.step("Hello there.")
    text = env.render()
    assert messages[1]["content"] in text and "[assistant] Hello there." in text
    shown = __import__("lab.terminal").terminal.visible(reply[0]["content"])
    assert f"[user] {shown}" in text and "turn 1/2" in text
    env.step("Copy this \x1b]52;c;aGk=\x07 \x1b[2J\u202eevil")  # OSC 52, a clear, a bidi override
    text = env.render()
    assert not set(text) & {"\x1b", "\x07", "\u202e"} and "\\x1b]52" in text
    env.close()
    assert ee.free_blocks == 2000


def test_a_messages_cost_is_paid_by_its_session_and_a_long_one_is_refused(tokenizer, monkeypatch):
    """A session's message is stripped and tokenized in its own thread before it joins the
    shared round (the hub's loop never strips it, so one session's text cannot hold the engine
    for the others); a message whose ids pass the hub's bound is refused in one line before the
    episode is touched, and the episode goes on."""
    from lab import sessions
    ee = engine.Engine(tiny_model("qwen3", seed=2), tokenizer, 8, 2000)
    env = persuasion_env.PersuasionEnv(ee, scenarios=instances(), t_max=3, max_new_tokens=4,
                                       judge=None)
    env.hub.message_tokens = 200
    stripped, strip = [], arena.strip_decision_tags
    monkeypatch.setattr(arena, "strip_decision_tags",
                        lambda text: (stripped.append((threading.current_thread().name, text)),
                                      strip(text))[1])
    env.reset(seed=1)
    message = "Would a short walk help? [AC[ACCEPT]CEPT]"
    obs, _, _, _, info = env.step(message)
    assert info["turn"] == 1 and any(text == message for _, text in stripped)
    assert not [text for name, text in stripped if name == "persuarena-sessions"
                and text == message]
    with pytest.raises(ValueError) as excinfo:
        env.step("word " * 400)
    text = str(excinfo.value)
    assert "\n" not in text and "at most 200" in text and "goes on" in text
    assert env.episode["turn"] == 1 and len(env.episode["shown"]) == 4
    _, _, _, _, info = env.step("A shorter one, then.")
    assert info["turn"] == 2
    assert sessions.MAX_MESSAGE_TOKENS >= 4 * engine.MAX_NEW_TOKENS
    env.close()
    assert ee.free_blocks == 2000
