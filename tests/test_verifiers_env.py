"""verifiers_env.py on verifiers' current API (verifiers.v1): the id `persuarena` resolves to this
package's Taskset and Env (what `eval persuarena` loads); two episodes run at once through
PersuArenaEnv.run on a shared hub, the persuader a stand-in for verifiers' agent interaction
(its harness needs uv and a network to start), each trace scored outcome + LAMBDA * sum r_t with
the per-turn rewards equal to a replay of the same messages on a plain PersuasionEnv; the pool
comes back whole; nothing imports verifiers.legacy. Skipped where verifiers is not installed."""
import asyncio
from pathlib import Path

import pytest

from persuarena import engine
from persuarena import rpo
from conftest import tiny_model
from lab import env as persuasion_env
from lab import sessions
from test_served import instances
import warm

pytestmark = pytest.mark.xdist_group("verifiers")  # one worker imports verifiers (~6 CPU-s)
vf = None  # verifiers.v1, imported when the first test here runs, not at collection


@pytest.fixture(autouse=True)
def verifiers_v1():
    global vf
    vf = pytest.importorskip("verifiers.v1")

POOL = 2000
ROOT = Path(__file__).resolve().parent.parent


class Trace:
    """The part of a verifiers Trace the env writes: info and rewards."""

    def __init__(self):
        self.info, self.rewards = {}, {}

    def record_reward(self, name, value, weight=1.0):
        self.rewards[name] = (value, weight)


class Interaction:
    """A stand-in for verifiers' Interaction: the persuader's scripted messages, one a turn."""

    def __init__(self, said):
        self.said, self.heard, self.trace = list(said), [], Trace()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return None

    async def turn(self, message=None):
        self.heard.append(message)
        if not self.said:
            return vf.Segment(messages=[], terminated=True)
        return vf.Segment(messages=[vf.AssistantMessage(content=self.said.pop(0))])


class Persuader:
    def __init__(self, said):
        self.said, self.opened = said, []

    def interaction(self, task):
        self.opened.append(Interaction(self.said))
        return self.opened[-1]


def test_the_id_persuarena_resolves_to_this_packages_taskset_and_env():
    from verifiers.v1.utils import loaders

    from lab import verifiers_env
    assert loaders.taskset_class("persuarena") is verifiers_env.PersuArenaTaskset
    assert loaders.environment_class("persuarena") is verifiers_env.PersuArenaEnv
    config = vf.resolve_env_config({"taskset": {"id": "persuarena", "scenarios": "heldout",
                                                "persuadee": "random:tiny-qwen3", "t_max": 2}})
    assert isinstance(config, verifiers_env.PersuArenaEnvConfig) and config.taskset.t_max == 2
    tasks = list(loaders.load_taskset(config.taskset).head(2))
    assert [t.data.name for t in tasks] == ["heldout-001", "heldout-002"]
    assert tasks[1].data.info == {"instance": "heldout-002", "seed": 1}
    assert "heldout-001" not in tasks[0].data.prompt_text  # the persuader's opening, no id
    code = ("import sys, lab.verifiers_env; "
            "sys.exit(any(m.startswith('verifiers.legacy') for m in sys.modules))")
    fresh = warm.popen(["-c", code], cwd=ROOT)  # a fresh interpreter's imports (tests/warm.py:
    err = fresh.communicate(timeout=120)[1]  # its preload holds no verifiers)
    assert fresh.returncode == 0, err[-2000:]


def test_episodes_carry_the_arenas_per_turn_rewards(tokenizer):
    from lab.verifiers_env import arena_tasks, load_environment
    ee = engine.Engine(tiny_model("qwen3", seed=2), tokenizer, 8, POOL)
    hub = sessions.Hub(ee, None, t_max=3, max_new_tokens=6)
    env = load_environment(env=persuasion_env.PersuasionEnv(scenarios=instances(), hub=hub))
    tasks = list(arena_tasks(instances()[:2], seed=7))
    said = [[f"Hello {k}.", "Think about it.", "One more thing."] for k in range(2)]
    persuaders = [Persuader(list(s)) for s in said]

    async def both():
        await asyncio.gather(*(env.run(task, type("Agents", (), {"persuader": p}))
                               for task, p in zip(tasks, persuaders)))
    asyncio.run(both())
    assert ee.free_blocks == POOL and hub.reserved == 0  # every episode's blocks freed
    replay = persuasion_env.PersuasionEnv(scenarios=instances(), hub=hub)
    for i, persuader in enumerate(persuaders):
        talk, = persuader.opened
        trace = talk.trace
        _, info = replay.reset(seed=7 + i, options={"instance": instances()[i]["id"]})
        rewards, replies = [], []
        for text in said[i][:len(trace.info["turn_rewards"])]:
            reply, reward, terminated, truncated, info = replay.step(text)
            rewards.append(reward)
            replies += [m["content"] for m in reply]
        assert terminated or truncated
        assert talk.heard[0] is None and talk.heard[1:] == replies[:len(talk.heard) - 1]
        assert trace.info["turn_rewards"] == pytest.approx(rewards, abs=1e-6)
        b = trace.info["beliefs"]
        assert trace.info["turn_rewards"] == pytest.approx(
            [(b[t] - b[t - 1]) / 2 for t in range(1, len(b))], abs=1e-9)
        end = trace.info["arena"]
        outcome = rpo.GOAL[end["outcome"]] + 0.5 * end["strategy"]
        assert trace.rewards["arena_outcome"] == (pytest.approx(outcome), 1.0)
        assert trace.rewards["arena_dense"] == (pytest.approx(sum(rewards)), rpo.LAMBDA)
    replay.close()
    assert ee.free_blocks == POOL
