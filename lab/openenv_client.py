"""
openenv_client.py: the typed side of PersuArena's OpenEnv contract, as OpenEnv's environment
packages ship it: the action, observation and state models (pydantic, on openenv's bases) that
lab/env_server.py serves, and a typed EnvClient over its WebSocket at /ws.

    action       {"message": str}                     the persuader's next message
    observation  {"messages": [{"role", "content"}], "terminated", "truncated", "info",
                  "reward": r_t, "done"}               what the persuader's context appends

    from lab.openenv_client import PersuArenaClient, PersuaderAction
    with PersuArenaClient(base_url="http://127.0.0.1:8000").sync() as client:
        result = client.reset(seed=0, instance="train-0001/v0")
        result = client.step(PersuaderAction(message="Hello, ..."))
        result.observation.messages, result.reward, result.done

The server: `python -m lab.env_server --serve --port 8000` (or server/app.py, the package's
entry point; openenv.yaml at the repository root names it).

    python -m pytest -q tests/test_env_server.py -k client
"""
from typing import Any, Dict, Optional

from openenv.core import EnvClient
from openenv.core.client_types import StepResult
from openenv.core.env_server import Action, Observation, State
from pydantic import ConfigDict, Field


class PersuaderAction(Action):
    """A step: the persuader's next message."""
    model_config = ConfigDict(extra="allow")  # a wrong field gets env.py's own error (step)
    message: Any = Field(None, description="the persuader's next message, a string")


class ArenaObservation(Observation):
    """What a reset or step returns: the chat messages the persuader's context appends (reset:
    its opening system and user messages), terminated (a decision), truncated (the turn budget
    or an end from outside the arena) and the env's info (beliefs, probes, outcome...)."""
    messages: list = Field(default_factory=list, description="chat messages to append")
    terminated: bool = False
    truncated: bool = False
    info: dict = Field(default_factory=dict)


class ArenaState(State):
    """A session's episode: its instance id and seed, and whether it has ended."""
    instance: Optional[str] = None
    seed: Optional[int] = None
    done: bool = True


class PersuArenaClient(EnvClient[PersuaderAction, ArenaObservation, ArenaState]):
    """OpenEnv's EnvClient for PersuArena: one WebSocket session, one episode at a time.
    reset(seed=, instance=) opens an episode; step(PersuaderAction(message=...)) plays a turn."""

    def _step_payload(self, action: PersuaderAction) -> Dict:
        return {"message": action.message}

    def _parse_result(self, payload: Dict) -> StepResult[ArenaObservation]:
        seen = payload.get("observation", {})
        observation = ArenaObservation(
            messages=seen.get("messages", []), terminated=seen.get("terminated", False),
            truncated=seen.get("truncated", False), info=seen.get("info", {}),
            done=payload.get("done", False), reward=payload.get("reward"))
        return StepResult(observation=observation, reward=payload.get("reward"),
                          done=payload.get("done", False))

    def _parse_state(self, payload: Dict) -> ArenaState:
        return ArenaState(**{k: payload.get(k) for k in ("episode_id", "instance", "seed")},
                          step_count=payload.get("step_count", 0),
                          done=payload.get("done", True))
