"""verifiers_env.py: verifiers' own rollout (evaluate_sync) against a policy served over the
OpenAI API on loopback (a tiny model behind test_served's Loopback server) plays whole episodes
on a shared hub; each trajectory step carries that turn's r_t, equal to a replay of the same
messages on a plain PersuasionEnv; the reward is G + 0.5 s + LAMBDA * sum r_t; the pool comes
back whole. Skipped where verifiers is not installed (requirements.txt pins it)."""
import pytest

vf = pytest.importorskip("verifiers")

import engine  # noqa: E402
import rpo  # noqa: E402
from conftest import tiny_model  # noqa: E402
from lab import env as persuasion_env  # noqa: E402
from lab import sessions  # noqa: E402
from test_served import Loopback, instances  # noqa: E402

POOL = 2000


def content(message):
    return message["content"] if isinstance(message, dict) else message.content


def test_verifiers_rollouts_carry_the_arenas_per_turn_rewards(tokenizer):
    from openai import AsyncOpenAI

    from lab.verifiers_env import load_environment
    policy = Loopback(tiny_model("llama", seed=1), tokenizer)
    ee = engine.Engine(tiny_model("qwen3", seed=2), tokenizer, 8, POOL)
    hub = sessions.Hub(ee, None, t_max=3, max_new_tokens=6)
    env = load_environment(env=persuasion_env.PersuasionEnv(scenarios=instances(), hub=hub),
                           seed=7)
    assert isinstance(env, vf.MultiTurnEnv)
    client = vf.OpenAIChatCompletionsClient(
        AsyncOpenAI(base_url=policy.spec.split("@", 1)[1], api_key="none"))
    try:
        out = env.evaluate_sync(client=client, model="tiny", num_examples=2,
                                sampling_args={"max_completion_tokens": 8},
                                state_columns=["trajectory", "turn_rewards", "beliefs", "arena"])
    finally:
        policy.close()
    rollouts = out["outputs"]
    assert len(rollouts) == 2 and policy.requests >= 2
    assert ee.free_blocks == POOL and hub.reserved == 0  # every rollout's episode freed
    replay = persuasion_env.PersuasionEnv(scenarios=instances(), hub=hub)
    for i, r in enumerate(rollouts):
        assert r["error"] is None and r["arena"] is not None, r["error"]
        said = [content(m) for m in r["completion"] if m.role == "assistant"]
        heard = [content(m) for m in r["completion"] if m.role == "user"]
        # the same instance, seed and messages on a plain env: the same replies and rewards
        _, info = replay.reset(seed=7 + i, options={"instance": instances()[i]["id"]})
        rewards, replies = [], []
        for text in said:
            reply, reward, terminated, truncated, info = replay.step(text)
            rewards.append(reward)
            replies += [m["content"] for m in reply]
        assert terminated or truncated
        assert replies == heard and len(said) == len(r["trajectory"]) == info["turn"]
        assert r["turn_rewards"] == pytest.approx(rewards, abs=1e-6)
        assert [t["reward"] for t in r["trajectory"]] == r["turn_rewards"]
        b = r["beliefs"]
        assert r["turn_rewards"] == pytest.approx([(b[t] - b[t - 1]) / 2 for t in
                                                   range(1, len(b))], abs=1e-9)
        outcome = rpo.GOAL[r["arena"]["outcome"]] + 0.5 * r["arena"]["strategy"]
        assert r["reward"] == pytest.approx(outcome + rpo.LAMBDA * sum(r["turn_rewards"]))
    replay.close()
    assert ee.free_blocks == POOL
