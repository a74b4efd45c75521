"""sessions.py: many sessions' episodes on one persuadee, batched by rollout.py's loop: 16 clients
on loopback play whole episodes at once against one server, all finish with the pool whole, their
replies share engine steps, and a bad client among them leaves the others' episodes unchanged."""
import json
import threading

import pytest

from persuarena import engine
from conftest import tiny_model
from lab import env as persuasion_env
from lab import sessions
from test_env_server import Raw, serving
from test_served import instances

CLIENTS = 16
SCRIPT = ["Hello, may I ask about your week?", "Would a leaflet help?", "We could go together.",
          "What would make it easier?"]


def play(url, i, records):
    """Client i plays a whole episode of instance i % 2 with seed i; its record kept."""
    raw = Raw(url)
    kind, data = raw.ask("reset", {"seed": i, "instance": instances()[i % 2]["id"]})
    assert kind == "observation", data
    for text in SCRIPT * 2:
        kind, data = raw.ask("step", {"message": f"{text} ({i})"})
        assert kind == "observation", data
        if data["done"]:
            records[i] = data["observation"]["info"]["record"]
            break
    raw.close()


def bad_client(url):
    """Sends every kind of malformed frame, a bad seed, a few steps, then drops mid-episode."""
    raw = Raw(url)
    raw.ws.send(b"\x00binary")
    raw.ws.recv(timeout=30)
    raw.ws.send("[" * 3000 + "]" * 3000)
    raw.ws.recv(timeout=30)
    raw.ask("reset", {"seed": True})
    raw.ask("reset", {"seed": 99, "instance": instances()[0]["id"]})
    raw.ask("step", {"message": "I am the bad one."})
    raw.ws.send(json.dumps({"type": "step", "data": {"message": "gone"}}))
    raw.drop()


def run(tokenizer, with_bad):
    """The 16 clients' records, the largest batch the persuadee replied to, the pool afterwards."""
    ee = engine.Engine(tiny_model("qwen3", seed=2), tokenizer, 8, 6000)
    hub = sessions.Hub(ee, None, t_max=3, max_new_tokens=6)
    batches, generate = [], ee.generate

    def counted(sids, *args, **kwargs):
        batches.append(len(sids))
        return generate(sids, *args, **kwargs)
    ee.generate = counted
    make_env = lambda: persuasion_env.PersuasionEnv(scenarios=instances(), hub=hub)  # noqa: E731
    records = {}
    with serving(make_env, max_sessions=CLIENTS + 1) as url:
        threads = [threading.Thread(target=play, args=(url, i, records)) for i in range(CLIENTS)]
        if with_bad:
            threads.insert(CLIENTS // 2, threading.Thread(target=bad_client, args=(url,)))
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    for _ in range(200):  # the dropped client's episode is stopped by its session's close
        if ee.free_blocks == 6000:
            break
        threading.Event().wait(0.05)
    return records, max(batches), ee.free_blocks, hub.reserved


@pytest.mark.xdist_group("openenv")  # with test_env_server's: one worker imports openenv
def test_sixteen_clients_play_at_once_and_a_bad_one_changes_nothing(tokenizer):
    """16 clients at once: all finish, the pool and the hub's reservations come back whole, the
    persuadee replied to several episodes in one engine step; with a bad client among them
    (malformed frames, a bad seed, a drop mid-episode) every other record is the same."""
    clean, largest, free, reserved = run(tokenizer, with_bad=False)
    assert sorted(clean) == list(range(CLIENTS)) and free == 6000 and reserved == 0
    assert largest > 1  # replies of different sessions shared engine steps
    noisy, _, free, reserved = run(tokenizer, with_bad=True)
    assert free == 6000 and reserved == 0
    assert noisy == clean


def test_a_session_that_does_not_fit_waits_then_is_refused_in_one_line(tokenizer):
    """With one episode's room taken, a second reset waits admit_wait_s and is refused in one
    line, the first episode untouched; once the first ends, the second is admitted."""
    ee = engine.Engine(tiny_model("qwen3", seed=2), tokenizer, 8, 2000)
    hub = sessions.Hub(ee, None, t_max=2, max_new_tokens=4, max_sessions=1, admit_wait_s=0.3)
    first, second = (persuasion_env.PersuasionEnv(scenarios=instances(), hub=hub)
                     for _ in range(2))
    first.reset(seed=1)
    try:
        second.reset(seed=2)
        raise AssertionError("a second episode was admitted past max_sessions")
    except RuntimeError as e:
        assert "the persuadee is full (1 episodes in play" in str(e) and "\n" not in str(e)
    assert first.step("Hello.")[4]["turn"] == 1
    first.close()
    assert second.reset(seed=2)[1]["turn"] == 0
    second.close()
    assert ee.free_blocks == 2000 and hub.reserved == 0


def test_episodes_of_one_instance_admitted_together_share_one_prefill(tokenizer):
    """The hub's persuadee side prefills an instance's prompt once for every episode of it
    admitted in one round, reads b_0 once, and forks each its own sequence: the same b_0 as a
    plain side's own prefill, the prompt's tokens run once, the pool whole once all are freed."""
    from persuarena import rollout
    ee = engine.Engine(tiny_model("qwen3", seed=2), tokenizer, 8, 2000)
    hub = sessions.Hub(ee, None, t_max=2, max_new_tokens=4)
    side, inst = hub.persuadee_side, instances()[0]
    before = ee.tokens_prefilled
    roots = [side.prefill(inst), side.prefill(inst), side.prefill(instances()[1])]
    assert roots[0] == roots[1] != roots[2]
    assert ee.tokens_prefilled - before == len(side.prompt(inst)) + len(side.prompt(instances()[1]))
    sids, reads = side.start(roots, [1, 2, 1])
    assert [len(s) for s in sids] == [1, 2, 1] and len({s for g in sids for s in g}) == 4
    plain = rollout.side(ee, "persuadee", rollout.SAMPLING["paper"][1], 4, None, None)
    alone_sids, alone = plain.start([plain.prefill(inst)], [1])
    assert reads[0] == reads[1] and reads[0][0] == pytest.approx(alone[0][0], abs=1e-6)
    for s in [s for g in sids + alone_sids for s in g]:
        ee.free(s)
    assert ee.free_blocks == 2000
