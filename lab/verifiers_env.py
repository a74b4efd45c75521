"""
verifiers_env.py: PersuArena as a verifiers multi-turn environment (`load_environment`, the
convention prime-rl and the environment hubs load), its rollouts carrying the per-turn rewards.

verifiers' own rollout loop drives the policy (any model behind the OpenAI API): each rollout
opens a PersuasionEnv over one shared sessions.Hub (lab/env.py, lab/sessions.py), so the
persuadee's replies, probe reads and decisions of rollouts in flight at once run in the same
engine steps; the policy's message is the env's step, the persuadee's reply (tags stripped) the
environment's response. Each turn's

    r_t = (b_t - b_{t-1}) / 2                        (env.turn_reward; sum_t r_t = (b_T - b_0) / 2)

is written on that turn's trajectory step (`state["trajectory"][t-1]["reward"]`, which verifiers
keeps as set), with the beliefs in state["beliefs"] and the episode's end in state["arena"]. The
rubric scores a rollout as TRL's run does (lab/trl_grpo.py): arena_outcome, G(outcome) + 0.5 s,
plus lam (rpo.LAMBDA) times arena_dense, the sum of the r_t. A dataset row is an instance and a
seed (the persuadee's random streams); its prompt is the persuader's opening messages. The
policy's text reaches the persuadee only through PersuasionEnv.step, so it stays as inert as
there.

Needs verifiers 0.3.1 (requirements.txt; DECISIONS.md: verifiers):

    from lab.verifiers_env import load_environment
    env = load_environment(persuadee="smollm2", scenarios="heldout", t_max=6)
    out = env.evaluate_sync(client=vf.OpenAIChatCompletionsClient(AsyncOpenAI(base_url=URL,
                            api_key="none")), model="policy", num_examples=4)
    python -m pytest -q tests/test_verifiers_env.py
"""
import asyncio

import verifiers as vf
from datasets import Dataset

import arena
import rpo
from lab import env as persuasion_env

SEED = 0  # row i's episode is keyed by seed SEED + i


def arena_rows(instances, seed):
    """One dataset row an instance: the persuader's opening messages, the instance and seed."""
    return [dict(prompt=[dict(m) for m in arena.persuader_messages(inst)],
                 info=dict(instance=inst["id"], seed=seed + i),
                 example_id=i) for i, inst in enumerate(instances)]


async def arena_outcome(state) -> float:
    """G(outcome) + 0.5 s of the episode (its last info), 0 when it never ended."""
    return float((state.get("arena") or {}).get("outcome_reward") or 0.0)


async def arena_dense(state) -> float:
    """The episode's sum of r_t, (b_T - b_0) / 2."""
    return float(sum(state.get("turn_rewards") or []))


class PersuArenaEnv(vf.MultiTurnEnv):
    """A verifiers MultiTurnEnv whose environment response is PersuasionEnv.step (module
    docstring). make_env() builds one PersuasionEnv per rollout over a shared hub."""

    def __init__(self, make_env, instances, seed=SEED, lam=rpo.LAMBDA, **kwargs):
        rows = arena_rows(instances, seed)
        rubric = vf.Rubric(funcs=[arena_outcome, arena_dense], weights=[1.0, lam])
        rows = Dataset.from_list(rows)
        super().__init__(dataset=rows, eval_dataset=rows, rubric=rubric, **kwargs)
        self.make_env, self.envs = make_env, {}

    async def setup_state(self, state):
        """A PersuasionEnv for this rollout, reset to its row's instance and seed."""
        env = self.make_env()
        self.envs[state["trajectory_id"]] = env
        info = state["info"]
        _, seen = await asyncio.to_thread(env.reset, seed=int(info["seed"]),
                                          options={"instance": info["instance"]})
        state.update(beliefs=seen["beliefs"], turn_rewards=[], arena=None)
        return state

    async def env_response(self, messages, state, **kwargs):
        """The policy's last message stepped into the arena; the reply back, r_t on its step."""
        env = self.envs[state["trajectory_id"]]
        text = messages[-1]["content"] if messages else ""
        try:
            reply, reward, terminated, truncated, info = await asyncio.to_thread(
                env.step, text if isinstance(text, str) else "")
        except (ValueError, RuntimeError, TypeError) as e:  # env.py's one-line refusals
            raise vf.Error(str(e)) from None
        state["trajectory"][-1]["reward"] = reward
        state["turn_rewards"].append(reward)
        state["beliefs"] = info["beliefs"]
        response = [vf.UserMessage(content=m["content"]) for m in reply]
        if terminated or truncated:
            state["arena"] = {k: v for k, v in info.items() if k != "record"}
            state["final_env_response"] = response
        return response

    @vf.cleanup
    async def close_arena(self, state):
        """The rollout's episode stopped (its blocks freed) however the rollout ended."""
        env = self.envs.pop(state["trajectory_id"], None)
        if env is not None:
            await asyncio.to_thread(env.close)


def load_environment(persuadee="smollm2", scenarios="heldout", t_max=arena.T_MAX_TRAIN, *,
                     judge=persuasion_env.JUDGE_DEFAULT, max_new_tokens=None, num_examples=-1,
                     seed=SEED, lam=rpo.LAMBDA, env=None, **kwargs):
    """A PersuArenaEnv over `scenarios` (the first num_examples instances, all when -1), the
    persuadee and judge loaded once (PersuasionEnv's names) or taken from `env`, a PersuasionEnv
    whose hub the rollouts share. kwargs go to verifiers' MultiTurnEnv."""
    if env is None:
        options = {} if max_new_tokens is None else dict(max_new_tokens=max_new_tokens)
        env = persuasion_env.PersuasionEnv(persuadee, scenarios, t_max, judge=judge, **options)
    instances = env.instances if num_examples < 0 else env.instances[:num_examples]
    hub = env.hub

    def make_env():
        return persuasion_env.PersuasionEnv(scenarios=env.instances, hub=hub)
    return PersuArenaEnv(make_env, instances, seed=seed, lam=lam, max_turns=hub.t_max + 1,
                         **kwargs)
