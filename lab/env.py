"""
env.py: PersuArena as an environment that another trainer drives (Gymnasium, and OpenEnv over HTTP).

The persuader is outside: a policy in TRL, verl, SkyRL or any loop of its own. The arena keeps
everything else: the hidden profile, the persuadee, the decision state machine and the probes. One
episode is one instance played through rollout.py's one loop, with the persuader as a side whose
messages come from step() (TrainerSide, as eval.py --play's PersonSide takes them from a person):

    reset(seed, options={"instance": id}) -> the persuader's opening messages [system, user], info
    step(persuader_text)  -> [the persuadee's reply as the persuader reads it (tags stripped)],
                             r_t = (b_t - b_{t-1}) / 2, terminated, truncated, info

so that sum_t r_t = (b_T - b_0) / 2, the dense term of Probe-RPO (rpo.process_rewards). `terminated`
is a decision (ACCEPT, PENDING, WALK_AWAY, the second REJECT, a closed upgrade window);
`truncated` the turn budget t_max or an end from outside the arena (the persuadee's context or
KV pool, a served persuadee's request that kept failing: DECISIONS.md: Context and cache
ends). info carries the decision, the outcome, the beliefs so far [b_0..b_t], the turn's three
probe values and their Yes+No masses; at the end the goal reward G(outcome), the judge's strategy
score s and the outcome reward G + 0.5 s that a trainer mixes in by its own lambda. The persuadee
is a local model (probes read in forks of its cache) or a served one, openai:MODEL@URL (probes
from its top log-probs).

    env = PersuasionEnv("random:tiny-qwen3", scenarios="heldout", t_max=6)
    messages, info = env.reset(seed=0, options={"instance": "heldout-001"})
    reply, r, terminated, truncated, info = env.step("Hello Rafael, ...")
    python -m lab.env --serve --port 8000 --persuadee smollm2    # OpenEnv server on 127.0.0.1

The loop runs in a worker thread that waits in TrainerSide.speak for each message: step() hands
the message over and waits for the loop to ask for the next one or to end (never for a worker
that is gone); whichever way the loop ends, the sequences it made are freed. A bad reset option
or a message that is not valid text is refused in one line before the running episode is
touched. The server plays one WebSocket session at a time, closes one idle for --session-timeout
(SESSION_IDLE_S), lets a new client take the slot of one never used, serves no stateless HTTP
/reset or /step, and stops on SIGTERM (DECISIONS.md: Server hardening).

    python -m pytest -q tests/test_env.py
"""
import math
import queue
import sys
import threading
import time

import gymnasium as gym
from gymnasium import spaces

import arena
import engine
import probes
import rollout
import rpo
from lab import cli, hardening, served
from lab.play import PersonSide

MAX_MESSAGE_CHARS = 16_000  # longest persuader message taken (a 256-token message is ~1,500)
JUDGE_DEFAULT = "persuadee"  # the paper's frozen judge: the persuadee's model in a fresh context
DECISION_ENDS = ("decision", "rejections", "window")  # end reasons that terminate; others truncate
ROLES = ("system", "user", "assistant")
HOST = "127.0.0.1"  # the OpenEnv server listens on loopback only
SERVER_SESSIONS = 1  # one episode at a time: the persuadee's pool belongs to one session
SESSION_IDLE_S = 60.0  # an OpenEnv session idle this long is closed, its episode abandoned
UNUSED_SESSION_S = 2.0  # a session never reset yields the only slot to a new client after this long
SHUTDOWN_S = 3.0  # on SIGTERM, open connections get this long before the server stops
WAIT_POLL_S = 0.5  # how often a caller waiting on the episode's worker checks that it still lives
SHOWN_CHARS = 60  # the longest repr of a client's bad value an error line quotes


class Utterance(spaces.Text):
    """A message: any characters (a model may write any), at most max_length of them. Samples are
    printable ASCII."""

    def __init__(self, max_length=MAX_MESSAGE_CHARS, min_length=0):
        super().__init__(max_length, min_length=min_length,
                         charset="".join(chr(c) for c in range(32, 127)))

    def contains(self, x):
        return isinstance(x, str) and self.min_length <= len(x) <= self.max_length


def message_space():
    """Observations: a tuple of chat messages, each {"role", "content"}, that the persuader's
    context appends."""
    role = spaces.Text(max(map(len, ROLES)), min_length=min(map(len, ROLES)),
                       charset="".join(sorted(set("".join(ROLES)))))
    return spaces.Sequence(spaces.Dict({"role": role, "content": Utterance(1_000_000)}))


def load_instances(scenarios):
    """Instances from "train" (the training variants), "heldout", a scenarios.jsonl path (each
    scenario as written) or a list of instances."""
    if isinstance(scenarios, list):
        return scenarios
    if scenarios == "train":
        return arena.training_instances()
    if scenarios == "heldout":
        return arena.heldout_instances()
    try:
        return [{**s, "scenario_id": s["id"], "variant": 0}
                for s in arena.load_scenarios(scenarios)]
    except (OSError, ValueError) as e:
        raise ValueError(f"env.py: cannot load scenarios from {scenarios!r} ({e}); pass 'train', "
                         "'heldout', a scenarios.jsonl path or a list of instances") from None


def turn_reward(beliefs):
    """r_t of the last turn, rpo.process_rewards' definition; 0 where a belief is unread (None)."""
    if len(beliefs) < 2 or None in beliefs[-2:]:
        return 0.0
    return rpo.process_rewards(beliefs[-2:], None, anchor=False)[0]


def shown(value):
    """A client's value as an error line quotes it: its repr, cut to SHOWN_CHARS."""
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 3] + "..."


def requested_instance(options, by_id):
    """The instance reset's options ask for (None: one drawn by the seed), checked before the
    running episode is touched: options a dict whose one key is "instance", an id of by_id."""
    if options is None:
        return None
    if not isinstance(options, dict):
        raise ValueError(f"env.py: reset options must be a dict such as {{'instance': "
                         f"'{next(iter(by_id))}'}}, got {shown(options)}; the episode goes on")
    unknown = [key for key in options if key != "instance"]
    if unknown:
        raise ValueError(f"env.py: unknown reset option(s) {shown(unknown)}; the one option is "
                         "'instance' (an instance id); the episode goes on")
    wanted = options.get("instance")
    if wanted is not None and (not isinstance(wanted, str) or wanted not in by_id):
        raise ValueError(f"env.py: no instance {shown(wanted)} here; ids look like "
                         f"{', '.join(list(by_id)[:3])}; the episode goes on")
    return wanted


def named(values):
    """A read-out's three values as {probe name: value} (None when the read-out is absent)."""
    return None if values is None else dict(zip(probes.PROBES, values))


class OwnIds:
    """The sequence ids an episode's loop was handed by a shared engine: the ids numbered while
    its loop ran, span by span. The loop runs only while its caller (reset or step) holds the
    engine; between spans it waits for a message, and another session's episode may number ids
    on the same engine then, which are not this episode's (DECISIONS.md: Server hardening)."""

    def __init__(self, eng):
        self.eng, self.spans = eng, []
        self.resume()

    def now(self):
        return self.eng.cache.next_id if self.eng is not None else 0

    def resume(self):
        self.spans.append([self.now(), None])

    def pause(self):
        self.spans[-1][1] = self.now()

    def release(self):
        """Free this episode's sequences still pending: its KV blocks back in the pool whichever
        way its loop ended. No-op without an engine."""
        if self.spans[-1][1] is None:
            self.pause()
        for sid in [s for s in getattr(self.eng, "pending", ())
                    if any(lo <= s < hi for lo, hi in self.spans)]:
            self.eng.free(sid)


class TrainerSide(PersonSide):
    """The persuader driven from outside (rollout.py's side interface, a person's side whose
    messages come through a queue): speak() announces that the loop waits for a message and
    takes the next one from `actions`; None stops the episode ("stopped"). hear() keeps the reply
    and the beliefs so far for step() to return."""

    def __init__(self, t_max, actions, events, own):
        super().__init__(t_max, read=None, write=None)
        self.actions, self.events, self.own, self.heard = actions, events, own, None

    def prefill(self, instance):
        return None

    def speak(self, sids, keys):
        said = []
        for _ in sids:
            self.own.pause()  # other episodes may use the engine while this one waits
            self.events.put(("speak", None))
            text = self.actions.get()
            self.own.resume()
            said.append(dict(text=text or "", ids=[], logprobs=[],
                             reason=rollout.STOPPED if text is None else "stop"))
        return said

    def hear(self, sid, text, final_turn=False, shown=None):
        self.heard = text, list(shown[1])
        return [], None


class Watched:
    """A persuadee side as rollout.side builds it, keeping what it read: the probe values and
    masses of b_0 (start) and each reply (text, decision, probes, probe_mass)."""

    def __init__(self, inner):
        self.inner, self.starts, self.replies = inner, [], []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def start(self, roots, counts):
        sids, reads = self.inner.start(roots, counts)
        self.starts.extend(reads)
        return sids, reads

    def reply(self, sids, keys, timings=None):
        out = self.inner.reply(sids, keys, timings)
        self.replies.extend(out)
        return out


class PersuasionEnv(gym.Env):
    """PersuArena for a persuader driven from outside (module docstring). `persuadee` and `judge`
    are model names as eval.py takes them (random:NAME, smollm2, a folder, openai:MODEL@URL) or
    an engine.Engine / served.ServedModel already built; judge "persuadee" is the persuadee's
    model, None scores s = 0. A name is loaded once, at construction."""
    metadata = {"render_modes": []}

    def __init__(self, persuadee="smollm2", scenarios="train", t_max=arena.T_MAX_TRAIN, *,
                 judge=JUDGE_DEFAULT, dtype="float32", kv_blocks=None,
                 max_new_tokens=engine.MAX_NEW_TOKENS, sampling=None,
                 probe_space=None, probe_signs=None):
        for name, value in (("t_max", t_max), ("max_new_tokens", max_new_tokens)):
            if type(value) is not int or value < 1:
                raise ValueError(f"env.py: {name} must be a positive integer, got {value!r}")
        self.instances = load_instances(scenarios)
        if not self.instances:
            raise ValueError(f"env.py: no instance in {scenarios!r}")
        self.by_id = {inst["id"]: inst for inst in self.instances}
        self.t_max, self.max_new_tokens = t_max, max_new_tokens
        self.sampling = sampling or rollout.SAMPLING["paper"][1]
        self.probe_space, self.probe_signs = probe_space, probe_signs
        loaded = {}
        self.persuadee = self._player(persuadee, loaded, dtype, kv_blocks)
        self.judge = (self.persuadee if judge == JUDGE_DEFAULT else
                      self._player(judge, loaded, dtype, kv_blocks))
        self.action_space = Utterance()
        self.observation_space = message_space()
        self.worker = None
        self.episode = None  # {instance, seed, turn, done} of the episode in play

    @staticmethod
    def _player(who, loaded, dtype, kv_blocks):
        if who is None or not isinstance(who, str):
            return who
        from lab import pools
        return pools.player(who, loaded, dtype, kv_blocks)

    # -- the worker thread: rollout.py's loop over one episode ------------------------------

    def _start(self, inst, seed):
        self.actions, self.events = queue.Queue(), queue.Queue()
        self.watched = Watched(rollout.side(self.persuadee, "persuadee", self.sampling,
                                            self.max_new_tokens, self.probe_space,
                                            self.probe_signs))
        own = OwnIds(getattr(self.watched.inner, "eng", None))
        self.side = TrainerSide(self.t_max, self.actions, self.events, own)

        def play():
            outcome = ("error", RuntimeError("the loop stopped"))
            try:
                records = rollout.rollout_episodes(
                    self.side, self.watched, [inst], self.t_max, seed=seed,
                    persuadee_sampling=self.sampling, max_new_tokens=self.max_new_tokens,
                    probe_space=self.probe_space, probe_signs=self.probe_signs)
                outcome = ("end", records[0])
            except BaseException as e:  # handed to the caller of reset or step
                outcome = ("error", e)
            finally:  # the episode's blocks go back on any end, then the caller hears of it
                try:
                    own.release()
                finally:
                    self.events.put(outcome)
        self.worker = threading.Thread(target=play, daemon=True, name="persuarena-episode")
        self.worker.start()

    def _wait(self):
        """The worker's next event, or None once the worker is gone and said nothing more: a
        caller never waits on a dead worker."""
        while True:
            try:
                return self.events.get(timeout=WAIT_POLL_S)
            except queue.Empty:
                if not self.worker.is_alive() and self.events.empty():
                    return None

    def _next_event(self):
        event = self._wait()
        if event is None or event[0] in ("end", "error"):
            self.worker.join()
            self.episode["done"] = True
        if event is None:
            raise RuntimeError(f"env.py: the episode of {self.episode['instance']['id']} ended "
                               "(its loop stopped); call reset() for a new one")
        kind, payload = event
        if kind == "error" and isinstance(payload, ValueError):
            raise payload
        if kind == "error":
            first = (str(payload).splitlines() or [""])[0][:200]
            raise RuntimeError(f"env.py: the episode of {self.episode['instance']['id']} ended "
                               f"on {type(payload).__name__}: {first}; call reset() for a new "
                               "one") from payload
        return kind, payload

    def _abandon(self):
        """Stop an episode still in play (its sequences freed by the loop, as a person's stop)."""
        if self.episode is not None:
            self.episode["done"] = True
        if self.worker is not None and self.worker.is_alive():
            self.actions.put(None)
            while (event := self._wait()) is not None and event[0] == "speak":
                self.actions.put(None)
            self.worker.join()
        self.worker = None

    # -- the Gymnasium interface -------------------------------------------------------------

    def reset(self, *, seed=None, options=None):
        """A new episode of options["instance"] (an instance id), else one drawn by the seed.
        The loop's random streams are keyed by `seed` (drawn when None), so the same seed and
        messages give the same episode. Returns (the persuader's opening messages, info with
        instance, seed, turn 0 and b_0's read-out)."""
        wanted = requested_instance(options, self.by_id)  # before the running episode ends
        super().reset(seed=seed)
        self._abandon()
        if wanted is not None:
            inst = self.by_id[wanted]
        else:
            inst = self.instances[int(self.np_random.integers(len(self.instances)))]
        episode_seed = seed if seed is not None else int(self.np_random.integers(2**31))
        self.episode = dict(instance=inst, seed=episode_seed, turn=0, done=False)
        self._start(inst, episode_seed)
        kind, record = self._next_event()
        if kind == "end":  # the loop could not start it: a pool too small for one episode
            self.episode["done"] = True
            raise ValueError(f"env.py: the persuadee cannot hold one episode of {inst['id']} "
                             f"({record['end_reason']}); give it more KV blocks (kv_blocks)")
        values, mass = self.watched.starts[-1] or (None, None)
        belief = None if values is None else probes.belief(values)
        info = dict(instance=inst["id"], seed=episode_seed, turn=0, t_max=self.t_max,
                    beliefs=[belief], probes=named(values), probe_mass=named(mass))
        return tuple(dict(m) for m in arena.persuader_messages(inst)), info

    def step(self, action):
        """One turn: the persuader's message (a str), the persuadee's reply and its read-out."""
        if not isinstance(action, str):
            raise TypeError(f"env.py: step takes the persuader's message as a str, got "
                            f"{type(action).__name__}")
        if len(action) > MAX_MESSAGE_CHARS:
            raise ValueError(f"env.py: a persuader message of {len(action)} characters; at most "
                             f"{MAX_MESSAGE_CHARS} (env.MAX_MESSAGE_CHARS)")
        if bad := hardening.invalid_text(action):
            raise ValueError(f"env.py: the persuader's message holds {bad}, which no tokenizer "
                             "encodes (half an emoji?); send valid text; the episode goes on")
        if self.episode is None or self.episode["done"]:
            raise RuntimeError("env.py: no episode in play; call reset() first")
        if self.worker is None or not self.worker.is_alive():
            self.episode["done"] = True
            raise RuntimeError(f"env.py: the episode of {self.episode['instance']['id']} ended "
                               "(its loop stopped); call reset() for a new one")
        self.episode["turn"] += 1
        self.actions.put(action.strip())
        kind, record = self._next_event()
        inst = self.episode["instance"]
        if kind == "speak":  # the episode goes on: the loop waits for the next message
            text, beliefs = self.side.heard
            reply = self.watched.replies[-1]
            info = dict(instance=inst["id"], turn=self.episode["turn"], decision=reply["decision"],
                        outcome=None, end_reason=None, beliefs=beliefs,
                        probes=named(reply["probes"]), probe_mass=named(reply["probe_mass"]))
            return (({"role": "user", "content": arena.persuader_sees(text)},),
                    turn_reward(beliefs), False, False, info)
        return self._last_step(record)

    def _last_step(self, record):
        """The episode ended in this turn: its record, judged, in the info."""
        self.episode["done"] = True
        read = record["turns"] == self.episode["turn"]  # this turn's reply got a read-out
        last = record["transcript"][-1] if record["transcript"] else None
        replied = last is not None and last["role"] == "persuadee"
        score, failed = rollout.judge_all(self.judge, [self.episode["instance"]],
                                          [record["transcript"]], self.episode["seed"], [0])
        record.update(judge=score[0], judge_failed=failed[0])
        info = dict(instance=record["id"], turn=self.episode["turn"],
                    decision=last["decision"] if replied else None, outcome=record["outcome"],
                    end_reason=record["end_reason"], beliefs=record["beliefs"],
                    probes=named(record["probes"][-1]) if read else None,
                    probe_mass=named(record["probe_mass"][-1]) if read else None,
                    goal_reward=rpo.GOAL[record["outcome"]], strategy=score[0],
                    judge_failed=failed[0],
                    outcome_reward=rpo.outcome_reward(record["outcome"], score[0]),
                    record={k: v for k, v in record.items()
                            if k not in ("ids", "turn_ids", "logprobs")})
        observation = (({"role": "user", "content": arena.persuader_sees(last["text"])},)
                       if replied else ())
        terminated = record["end_reason"] in DECISION_ENDS
        return (observation, turn_reward(record["beliefs"]) if read else 0.0, terminated,
                not terminated, info)

    def close(self):
        self._abandon()

# -----------------------------------------------------------------------------
# OpenEnv: the same episodes over HTTP and WebSocket (openenv-core's server and client contract)


def openenv_models():
    """The action, observation and state of the OpenEnv contract (pydantic models on
    openenv-core's bases): a step is {"message": str}; an observation carries the messages,
    terminated, truncated and info beside openenv's reward and done."""
    from typing import Any, Optional

    from openenv.core.env_server import Action, Observation, State
    from pydantic import ConfigDict, Field

    class PersuaderAction(Action):
        model_config = ConfigDict(extra="allow")  # a wrong field gets env.py's own error (step)
        message: Any = Field(None, description="the persuader's next message, a string")

    class ArenaObservation(Observation):
        messages: list = Field(default_factory=list, description="chat messages to append")
        terminated: bool = False
        truncated: bool = False
        info: dict = Field(default_factory=dict)

    class ArenaState(State):
        instance: Optional[str] = None
        seed: Optional[int] = None
        done: bool = True
    return PersuaderAction, ArenaObservation, ArenaState


def arena_environment(make_env, lock):
    """openenv-core's Environment over make_env()'s PersuasionEnv, one per session: reset takes
    seed and instance, step takes {"message": str}; reset, step and close of every session run
    one at a time (one engine). A session closed by the server (idle) refuses later calls."""
    from openenv.core.env_server import Environment
    PersuaderAction, ArenaObservation, ArenaState = openenv_models()

    class ArenaEnvironment(Environment):
        def __init__(self):
            super().__init__()
            self.env, self.steps, self.episode_id = make_env(), 0, None
            self.used = self.busy = self.closed = False  # read by the server's idle release
            self.last_call = time.time()  # any call, refused ones too (openenv counts answers)

        def _call(self, method, *args, **kwargs):
            if self.closed:
                raise RuntimeError("env.py: this session was closed by the server (idle past "
                                   "its --session-timeout, or never used while another client "
                                   "waited); open a new session")
            self.used = self.busy = True
            try:
                with lock:
                    return method(*args, **kwargs)
            finally:
                self.busy, self.last_call = False, time.time()

        def reset(self, seed=None, episode_id=None, instance=None, **kwargs):
            if kwargs:
                raise ValueError(f"env.py: unknown reset field(s) {shown(sorted(kwargs))}; reset "
                                 "takes seed, episode_id and instance")
            messages, info = self._call(
                self.env.reset, seed=seed,
                options=None if instance is None else {"instance": instance})
            self.steps, self.episode_id = 0, episode_id
            return ArenaObservation(messages=list(messages), info=info)

        def step(self, action, timeout_s=None, **kwargs):
            extra = sorted(action.model_extra or {})
            if extra or not isinstance(action.message, str):
                raise ValueError(f"env.py: a step is {{\"message\": <the persuader's text>}}, got "
                                 f"fields {shown(extra or ['message'])} with message of type "
                                 f"{type(action.message).__name__}; the episode goes on")
            messages, reward, terminated, truncated, info = self._call(self.env.step,
                                                                       action.message)
            self.steps += 1
            return ArenaObservation(messages=list(messages), terminated=terminated,
                                    truncated=truncated, info=info, reward=reward,
                                    done=terminated or truncated)

        @property
        def state(self):
            self.used, self.last_call = True, time.time()  # a client that asks is using it
            episode = self.env.episode or {}
            inst = episode.get("instance")
            return ArenaState(episode_id=self.episode_id, step_count=self.steps,
                              instance=inst and inst["id"], seed=episode.get("seed"),
                              done=episode.get("done", True))

        def close(self):
            self.closed = True
            with lock:
                self.env.close()
    return ArenaEnvironment, PersuaderAction, ArenaObservation


def arena_server_class():
    """openenv-core's HTTPEnvServer whose one slot no idle client keeps: a session idle for
    idle_s is released (its episode abandoned, its blocks freed), checked every idle_s / 4, and
    a session never used (no reset, no state asked) yields the slot to a new client once
    unused_s old. Both hook
    openenv-core 0.3's session table (_sessions, _session_info, _destroy_session)."""
    from openenv.core.env_server.http_server import HTTPEnvServer

    class ArenaServer(HTTPEnvServer):
        def __init__(self, *args, idle_s, unused_s, **kwargs):
            super().__init__(*args, **kwargs)
            self.idle_s, self.unused_s = idle_s, unused_s

        def _stale(self, sid, now, unused_too):
            env, info = self._sessions.get(sid), self._session_info.get(sid)
            if env is None or info is None or env.busy:
                return None
            idle = now - max(info.last_activity_at, env.last_call)
            if idle > self.idle_s:
                return f"idle {idle:.1f} s"
            if unused_too and not env.used and now - info.created_at > self.unused_s:
                return "never used"
            return None

        async def release(self, unused_too):
            now = time.time()
            async with self._session_lock:
                stale = {sid: why for sid in list(self._sessions)
                         if (why := self._stale(sid, now, unused_too))}
            for sid, why in stale.items():
                print(f"env.py: session {sid[:8]} released ({why})", file=sys.stderr)
                await self._destroy_session(sid)

        async def _reap_idle_sessions(self):
            import asyncio
            while True:
                await asyncio.sleep(self.idle_s / 4)
                await self.release(unused_too=False)

        async def _create_session(self):
            if len(self._sessions) >= self._max_concurrent_envs:
                await self.release(unused_too=True)
            return await super()._create_session()
    return ArenaServer


def openenv_app(make_env, session_idle_s=SESSION_IDLE_S, unused_session_s=UNUSED_SESSION_S):
    """A FastAPI app serving make_env()'s episodes by openenv-core's contract over WebSocket
    sessions (/ws, what EnvClient and TRL's and SkyRL's integrations use), one session at a time
    (the persuadee's pool is one), released when idle (arena_server_class). HTTP serves /health,
    /schema, /metadata and /mcp; not the stateless /reset, /step and /state, which would play
    each call on a fresh env (DECISIONS.md: Server hardening). A dropped connection logs one
    line (quiet_drops)."""
    from fastapi import FastAPI
    from openenv.core.env_server.types import ConcurrencyConfig, ServerMode
    ArenaEnvironment, PersuaderAction, ArenaObservation = arena_environment(
        make_env, threading.Lock())
    server = arena_server_class()(
        ArenaEnvironment, PersuaderAction, ArenaObservation, idle_s=session_idle_s,
        unused_s=unused_session_s,
        concurrency_config=ConcurrencyConfig(max_concurrent_envs=SERVER_SESSIONS,
                                             session_timeout=session_idle_s))
    app = FastAPI(title="PersuArena (OpenEnv)", description=__doc__.strip().split("\n\n")[0])
    server.register_routes(app, mode=ServerMode.PRODUCTION)
    return quiet_drops(app)


def quiet_drops(app):
    """The ASGI app, save that on a WebSocket whose client went away, closing it again is a
    no-op and a handler that fails because its answer could not be sent logs one line instead
    of uvicorn's traceback (openenv-core's handler has released the session by then). HTTP
    passes through unchanged. `.app` is app."""
    async def asgi(scope, receive, send):
        if scope["type"] != "websocket":
            return await app(scope, receive, send)

        async def sent(message):
            try:
                await send(message)
            except Exception:
                if message["type"] != "websocket.close":  # a close to a gone client: done
                    raise
        try:
            await app(scope, receive, sent)
        except Exception as e:
            print(f"env.py: a client dropped its connection ({type(e).__name__}); its session "
                  "is closed", file=sys.stderr)
    asgi.app = app
    return asgi


def parse_args(argv=None):
    ap = cli.new_parser("python -m lab.env", __doc__)
    ap.add_argument("--serve", action="store_true", help="run the OpenEnv server on 127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--persuadee", default="smollm2", help="random:NAME, smollm2, a model "
                    "folder or openai:MODEL@URL")
    ap.add_argument("--judge", default=JUDGE_DEFAULT, help="'persuadee' (its model), 'none' "
                    "(s = 0) or a model name")
    ap.add_argument("--scenarios", default="train", help="train, heldout or a scenarios.jsonl")
    ap.add_argument("--t-max", type=int, default=arena.T_MAX_TRAIN)
    ap.add_argument("--max-new-tokens", type=int, default=engine.MAX_NEW_TOKENS)
    ap.add_argument("--dtype", default="float32", choices=cli.DTYPES)
    ap.add_argument("--kv-blocks", type=int, help="the persuadee's KV pool, in blocks")
    ap.add_argument("--session-timeout", type=float, default=SESSION_IDLE_S, help="seconds "
                    "after which an idle session is closed and its slot freed")
    args = ap.parse_args(argv)
    if problem := flag_problem(args):
        ap.error(problem)
    return args


def flag_problem(args):
    """What is wrong with the server's flags, in one line, or None: checked before any model
    loads (a model's files, its pool and a served model's answer are checked in checked_models)."""
    if not args.serve:
        return "nothing to do: pass --serve (the Python API is env.PersuasionEnv)"
    if not 0 < args.port < 65536:
        return f"--port must be in 1..65535, got {args.port}"
    for name, value in (("t_max", args.t_max), ("max_new_tokens", args.max_new_tokens),
                        ("kv_blocks", 1 if args.kv_blocks is None else args.kv_blocks)):
        if value < 1:
            return f"--{name.replace('_', '-')} must be at least 1, got {value}"
    if not (math.isfinite(args.session_timeout) and args.session_timeout > 0):
        return f"--session-timeout must be a number of seconds > 0, got {args.session_timeout}"
    for flag, name in (("--persuadee", args.persuadee), ("--judge", args.judge)):
        if name in ("persuadee", "none") and flag == "--judge":
            continue
        if served.is_served(name):
            try:
                served.parse_spec(name)
            except SystemExit as e:
                return f"{flag}: {e}"
        elif found := cli.model_problem(name):  # as train.py checks it
            return f"{flag} {name} {found}; {cli.MODEL_FIX}"
    return None


def pool_problem(flag, name, args, instances, judging):
    """One line when local model `name` cannot be read or its --kv-blocks pool cannot hold one
    episode (nor, when it judges too, one judging), from its tokenizer and config alone."""
    from lab import pools
    try:
        shape = pools.pool_shape(name, args.dtype)
    except (OSError, ValueError) as e:
        return f"env.py: {flag} {name} cannot be read ({str(e).splitlines()[0]}); {cli.MODEL_FIX}"
    if args.kv_blocks is None:
        return None
    need = pools.episode_blocks(shape, instances, args.t_max, args.max_new_tokens)
    if judging:
        need = max(need, pools.judge_blocks(shape, instances, args.t_max, args.max_new_tokens))
    if args.kv_blocks >= need:
        return None
    return (f"env.py: --kv-blocks {args.kv_blocks} cannot hold one episode of {name} ({need} "
            f"blocks of {shape.block_size} tokens at --t-max {args.t_max}, --max-new-tokens "
            f"{args.max_new_tokens}{' and its judging' if judging else ''}); pass --kv-blocks "
            f"{need} or more")


def checked_models(args, instances):
    """(persuadee, judge), every model checked before any weight loads: a served one answers
    (ServedModel.check), a local one's files read and its pool sized; then the local ones load."""
    from lab import pools
    roles = {"--persuadee": args.persuadee}
    if args.judge not in ("persuadee", "none"):
        roles["--judge"] = args.judge
    loaded = {}
    for flag, name in roles.items():
        if served.is_served(name):
            pools.player(name, loaded, args.dtype, None)
    for flag, name in roles.items():
        if not served.is_served(name) and (problem := pool_problem(
                flag, name, args, instances, flag == "--persuadee" and args.judge == "persuadee")):
            sys.exit(problem)
    persuadee = PersuasionEnv._player(args.persuadee, loaded, args.dtype, args.kv_blocks)
    if args.judge in ("persuadee", "none"):
        return persuadee, {"persuadee": persuadee, "none": None}[args.judge]
    return persuadee, PersuasionEnv._player(args.judge, loaded, args.dtype, args.kv_blocks)


def main(argv=None):
    import uvicorn
    args = parse_args(argv)
    instances = load_instances(args.scenarios)  # a bad path is named before any model loads
    import models
    models.set_cpu_threads()  # one thread per core the machine's load leaves free
    persuadee, judge = checked_models(args, instances)

    def make_env():
        return PersuasionEnv(persuadee, scenarios=instances, t_max=args.t_max, judge=judge,
                             max_new_tokens=args.max_new_tokens)
    print(f"env.py: serving {args.persuadee} on ws://{HOST}:{args.port}/ws (OpenEnv; sessions "
          f"idle {args.session_timeout:g} s are closed)", file=sys.stderr)
    uvicorn.run(openenv_app(make_env, args.session_timeout), host=HOST, port=args.port,
                log_level="warning", timeout_graceful_shutdown=SHUTDOWN_S)


if __name__ == "__main__":
    main()
