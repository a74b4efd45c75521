"""
verifiers_env.py: PersuArena as a verifiers environment on its current API (verifiers.v1), the
environment id `persuarena`: a Taskset of arena instances and an Env whose run() steps the arena
host-side, as verifiers' TextArena environment steps its game. The persuader is the policy under
training or evaluation (the `persuader` agent, any model verifiers' client reaches); the arena
keeps the persuadee, the hidden profile, the decision state machine and the probes.

One task is one instance and a seed (the persuadee's random streams). Its prompt is the
persuader's opening messages; the persuader speaks first, each reply is the persuadee's (tags
stripped), and each turn's

    r_t = (b_t - b_{t-1}) / 2                        (env.turn_reward; sum_t r_t = (b_T - b_0) / 2)

is kept on the trace (trace.info["turn_rewards"], with the beliefs and the episode's end in
trace.info["arena"]). The trace is scored as TRL's run does (lab/trl_grpo.py): arena_outcome,
G(outcome) + 0.5 s, weight 1, plus arena_dense, the sum of the r_t, weight lam (rpo.LAMBDA).
Rollouts in flight at once share one sessions.Hub (lab/env.py, lab/sessions.py): the persuadee's
replies, probe reads and decisions of every episode run in the same engine steps. The policy's
text reaches the persuadee only through PersuasionEnv.step, so it stays as inert as there.

verifiers resolves the id `persuarena` to the installed package of that name, which exports
these classes (pyproject.toml; DECISIONS.md: verifiers), so its own command line runs it:

    eval persuarena --env.taskset.persuadee smollm2 --env.taskset.scenarios heldout \\
        --env.persuader.model MODEL --env.persuader.client.base-url URL -n 4
    from lab.verifiers_env import load_environment          # in Python: a verifiers.v1 Env
    env = load_environment(persuadee="smollm2", scenarios="heldout", t_max=6)
    python -m pytest -q tests/test_verifiers_env.py

Nothing here imports verifiers.legacy (the deprecated v0 stack).
"""
import asyncio
from collections.abc import Iterator

import verifiers.v1 as vf

from persuarena import arena
from persuarena import engine
from persuarena import rpo
from lab import env as persuasion_env

ENV_ID = "persuarena"  # verifiers' id: the installed package that exports these classes
SEED = 0  # task i's episode is keyed by seed SEED + i
HUBS = {}  # the shared persuadee of each (persuadee, scenarios, t_max, judge, tokens) setting


class PersuArenaConfig(vf.TasksetConfig):
    """The arena's settings, under `--env.taskset.*`."""
    id: str = ENV_ID
    persuadee: str = "smollm2"
    """random:NAME, smollm2, a model folder or openai:MODEL@URL."""
    scenarios: str = "heldout"
    """train, heldout or a scenarios.jsonl path."""
    t_max: int = arena.T_MAX_TRAIN
    """The turn budget of an episode."""
    judge: str = persuasion_env.JUDGE_DEFAULT
    """auto (the presets' rule), persuadee, none or a model name."""
    max_new_tokens: int = engine.MAX_NEW_TOKENS
    """The persuadee's reply, in tokens."""
    seed: int = SEED
    """Task i's episode is keyed by seed + i."""
    lam: float = rpo.LAMBDA
    """arena_dense's weight: the reward is G + 0.5 s + lam * sum_t r_t."""


class PersuArenaData(vf.TaskData):
    info: dict
    """The instance id and the seed the arena reproduces the episode from."""


class PersuArenaTask(vf.Task[PersuArenaData, vf.State, vf.TaskConfig]):
    pass


class PersuArenaTaskset(vf.Taskset[PersuArenaTask, PersuArenaConfig]):
    """One task an instance of --env.taskset.scenarios, in file order."""

    def load(self) -> Iterator[PersuArenaTask]:
        yield from arena_tasks(persuasion_env.load_instances(self.config.scenarios),
                               self.config.seed, self.config.task)


def arena_tasks(instances, seed=SEED, config=None):
    """One task an instance: the persuader's opening (system prompt and first user message),
    the instance id and seed + i."""
    for i, inst in enumerate(instances):
        system, user = arena.persuader_messages(inst)
        yield PersuArenaTask(PersuArenaData(
            idx=i, name=inst["id"], description=inst.get("title"), prompt=user["content"],
            system_prompt=system["content"], info=dict(instance=inst["id"], seed=seed + i)),
            config)


class PersuArenaEnvConfig(vf.EnvConfig):
    persuader: vf.AgentConfig = vf.AgentConfig(harness={"id": "null"},
                                               runtime=vf.SubprocessConfig())
    """The policy: a chat model, no tools (verifiers' null harness), run on this machine."""


def shared_env(settings):
    """A PersuasionEnv over the hub of these settings (a PersuArenaConfig), loaded once."""
    key = (settings.persuadee, settings.scenarios, settings.t_max, settings.judge,
           settings.max_new_tokens)
    if key not in HUBS:
        HUBS[key] = persuasion_env.PersuasionEnv(
            settings.persuadee, settings.scenarios, settings.t_max, judge=settings.judge,
            max_new_tokens=settings.max_new_tokens)
    base = HUBS[key]
    return persuasion_env.PersuasionEnv(scenarios=base.instances, hub=base.hub)


class PersuArenaEnv(vf.Env[PersuArenaEnvConfig]):
    """The arena stepped host-side: each persuader reply is a PersuasionEnv.step, the
    persuadee's answer the next user turn, until a decision or the turn budget."""
    make_env = None  # a callable returning a PersuasionEnv (load_environment(env=...)); else shared_env

    async def run(self, task, agents):
        settings = self.config.taskset
        env = self.make_env() if self.make_env is not None else shared_env(settings)
        info = task.data.info
        try:
            _, seen = await asyncio.to_thread(env.reset, seed=int(info["seed"]),
                                              options={"instance": info["instance"]})
            beliefs, turn_rewards, end = seen["beliefs"], [], None
            async with agents.persuader.interaction(task) as interaction:
                segment = await interaction.turn()  # the task's prompt opens: the first message
                while not segment.terminated:
                    reply, reward, terminated, truncated, step = await asyncio.to_thread(
                        env.step, segment.last_reply)
                    turn_rewards.append(reward)
                    beliefs = step["beliefs"]
                    if terminated or truncated:
                        end = {k: v for k, v in step.items() if k != "record"}
                        break
                    segment = await interaction.turn(reply[0]["content"])
            score(interaction.trace, turn_rewards, beliefs, end,
                  getattr(settings, "lam", rpo.LAMBDA))
        finally:
            await asyncio.to_thread(env.close)


def score(trace, turn_rewards, beliefs, end, lam):
    """The trace's rewards (arena_outcome weight 1, arena_dense weight lam) and the arena's
    record: the per-turn rewards, the beliefs, the episode's end (None: cut off before one)."""
    trace.info.update(turn_rewards=turn_rewards, beliefs=beliefs, arena=end)
    trace.record_reward("arena_outcome", float((end or {}).get("outcome_reward") or 0.0), 1.0)
    trace.record_reward("arena_dense", float(sum(turn_rewards)), lam)


def load_environment(persuadee="smollm2", scenarios="heldout", t_max=arena.T_MAX_TRAIN, *,
                     judge=persuasion_env.JUDGE_DEFAULT, max_new_tokens=engine.MAX_NEW_TOKENS,
                     seed=SEED, lam=rpo.LAMBDA, env=None, persuader=None):
    """A PersuArenaEnv (verifiers.v1) over these settings, as `eval persuarena --env.taskset.*`
    builds it; `env`: a PersuasionEnv whose hub (persuadee, judge, t_max) the episodes share
    and whose instances are the tasks; `persuader`: the policy's vf.AgentConfig."""
    settings = PersuArenaConfig(persuadee=persuadee if isinstance(persuadee, str) else "",
                                scenarios=scenarios if isinstance(scenarios, str) else "",
                                t_max=env.t_max if env is not None else t_max, judge=judge,
                                max_new_tokens=max_new_tokens, seed=seed, lam=lam)
    config = PersuArenaEnvConfig(taskset=settings, **({} if persuader is None
                                                      else {"persuader": persuader}))
    built = PersuArenaEnv(config)
    if env is not None:
        built.make_env = lambda: persuasion_env.PersuasionEnv(scenarios=env.instances, hub=env.hub)
    return built


__all__ = ["PersuArenaTaskset", "PersuArenaEnv"]
