"""
env.py: PersuArena as a Gymnasium environment that another trainer drives ("PersuArena-v0").

The persuader is outside: a policy in TRL, verl, SkyRL, verifiers or any loop of its own. The
arena keeps everything else: the hidden profile, the persuadee, the decision state machine and the
probes. One episode is one instance played through rollout.py's one loop, with the persuader's
messages coming from step():

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

    import lab.env, gymnasium as gym       # importing the module registers "PersuArena-v0"
    env = gym.make("PersuArena-v0", persuadee="random:tiny-qwen3", scenarios="heldout", t_max=6)
    # gym.make's TimeLimit: max_episode_steps arena.T_MAX_TRAIN (6); a longer t_max passes its own
    # max_episode_steps. observation="conversation": step returns every message so far
    messages, info = env.reset(seed=0, options={"instance": "heldout-001"})
    reply, r, terminated, truncated, info = env.step("Hello Rafael, ...")
    print(env.render())                    # render_mode="ansi": the conversation so far
    python -m lab.env_server --serve --port 8000 --persuadee smollm2   # OpenEnv, many sessions

Episodes are played by a sessions.Hub: envs built over one hub (the server's sessions) share its
persuadee and their replies run in the same engine steps (lab/sessions.py). A bad reset option, a
bad seed or a message that is not valid text is refused in one line before the running episode
is touched; one env takes one call at a time (a second thread's call is refused in one line);
close() never waits on the engine.

    python -m pytest -q tests/test_env.py
"""
import queue
import threading

import gymnasium as gym
from gymnasium import spaces

from persuarena import arena
from persuarena import engine
from persuarena import probes
from persuarena import rollout
from persuarena import rpo
from lab import hardening, sessions, terminal

MAX_MESSAGE_CHARS = 16_000  # longest persuader message taken (a 256-token message is ~1,500)
JUDGE_DEFAULT = "auto"  # the presets' rule (preset_judge): the persuadee's model, none on a laptop
OBSERVATIONS = ("new", "conversation")  # what step returns: the new messages, or all of them
DECISION_ENDS = ("decision", "rejections", "window")  # end reasons that terminate; others truncate
ROLES = ("system", "user", "assistant")
SEED_MAX = 2**63 - 1  # the largest seed reset takes (numpy takes any size: bounded here)
SAMPLE_CHARS = 256  # longest message the action space samples (ASCII: at most a token a character)
SHOWN_CHARS = 60  # the longest repr of a client's bad value an error line quotes
ENV_ID = "PersuArena-v0"  # gym.make's name, registered when this module is imported


class Utterance(spaces.Text):
    """A message: any characters (a model may write any), at most max_length of them. Samples are
    printable ASCII."""

    def __init__(self, max_length=MAX_MESSAGE_CHARS, min_length=0):
        super().__init__(max_length, min_length=min_length,
                         charset="".join(chr(c) for c in range(32, 127)))

    def contains(self, x):
        return isinstance(x, str) and self.min_length <= len(x) <= self.max_length

    def sample(self, mask=None, probability=None):
        """Printable ASCII of at most SAMPLE_CHARS characters unless mask sets a length: a
        message the hub takes (its ids are bounded too, sessions.MAX_MESSAGE_TOKENS)."""
        if mask is None and probability is None:
            top = min(self.max_length, SAMPLE_CHARS)
            mask = (int(self.np_random.integers(self.min_length, top + 1)), None)
        return super().sample(mask, probability)


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




def preset_judge(persuadee, judge=JUDGE_DEFAULT):
    """The judge a name resolves to: "auto" follows the presets' rule (lab/presets.py
    laptop_settings): on a machine without CUDA a local persuadee (SmolLM2 writes no verdict)
    gets no judge (s = 0, "none"); otherwise the paper's frozen judge, the persuadee's model in
    a fresh context ("persuadee"). Any other name is kept."""
    if judge != "auto":
        return judge
    import torch
    from lab import presets, served
    local = not (isinstance(persuadee, served.ServedModel)
                 or isinstance(persuadee, str) and served.is_served(persuadee))
    if local and not torch.cuda.is_available():
        return presets.laptop_settings()["judge"] or "none"
    return "persuadee"


def checked_seed(seed):
    """reset's seed: None or an int in 0..SEED_MAX (not a bool, not a float), else one line."""
    if seed is None or (type(seed) is int and 0 <= seed <= SEED_MAX):
        return seed
    raise ValueError(f"env.py: a seed is an integer in 0..{SEED_MAX} (or none), got {shown(seed)}; "
                     "the episode goes on")


class PersuasionEnv(gym.Env):
    """PersuArena for a persuader driven from outside (module docstring). `persuadee` and `judge`
    are model names as eval.py takes them (random:NAME, smollm2, a folder, openai:MODEL@URL) or
    an engine.Engine / served.ServedModel already built; judge "persuadee" is the persuadee's
    model, None (or "none") scores s = 0, "auto" (the default) follows the presets' rule
    (preset_judge). A name is loaded once, at construction. `observation`: "new" (step returns
    the messages the persuader's context appends) or "conversation" (every message so far, the
    opening ones included, for a policy that keeps no history). `hub`: a sessions.Hub
    shared with other envs (the server's sessions), whose persuadee, judge, t_max and sampling
    are then this env's."""
    metadata = {"render_modes": ["ansi"], "render_fps": 1}  # fps: a turn a frame

    def __init__(self, persuadee="smollm2", scenarios="train", t_max=arena.T_MAX_TRAIN, *,
                 judge=JUDGE_DEFAULT, dtype="float32", kv_blocks=None,
                 max_new_tokens=engine.MAX_NEW_TOKENS, sampling=None,
                 probe_space=None, probe_signs=None, hub=None, render_mode=None,
                 observation="new"):
        for name, value in (("t_max", t_max), ("max_new_tokens", max_new_tokens)):
            if type(value) is not int or value < 1:
                raise ValueError(f"env.py: {name} must be a positive integer, got {value!r}")
        if render_mode not in (None, "ansi"):
            raise ValueError(f"env.py: render_mode {shown(render_mode)}; the one mode is 'ansi'")
        if observation not in OBSERVATIONS:
            raise ValueError(f"env.py: observation {shown(observation)}; one of {OBSERVATIONS}")
        self.render_mode, self.observation = render_mode, observation
        self.instances = load_instances(scenarios)
        if not self.instances:
            raise ValueError(f"env.py: no instance in {scenarios!r}")
        self.by_id = {inst["id"]: inst for inst in self.instances}
        judge = preset_judge(persuadee, judge)
        judge = None if judge == "none" else judge
        if hub is None:
            loaded = {}
            player = self._player(persuadee, loaded, dtype, kv_blocks)
            hub = sessions.Hub(player, player if judge == "persuadee" else
                               self._player(judge, loaded, dtype, kv_blocks), t_max=t_max,
                               max_new_tokens=max_new_tokens,
                               sampling=sampling or rollout.SAMPLING["paper"][1],
                               probe_space=probe_space, probe_signs=probe_signs)
        self.hub, self.persuadee, self.judge = hub, hub.persuadee, hub.judge
        self.t_max, self.max_new_tokens = hub.t_max, hub.max_new_tokens
        self.action_space = Utterance()
        self.observation_space = message_space()
        self.ticket = None
        self.episode = None  # {instance, seed, turn, done, shown: the conversation} in play
        self.calling = threading.Lock()  # one call at a time: a second thread's is refused

    @staticmethod
    def _player(who, loaded, dtype, kv_blocks):
        if who is None or not isinstance(who, str):
            return who
        from lab import pools
        return pools.player(who, loaded, dtype, kv_blocks)

    def _one_at_a_time(self, name):
        if not self.calling.acquire(blocking=False):
            raise RuntimeError(f"env.py: {name}() called while another thread's reset or step "
                               "runs on this PersuasionEnv; one call at a time (one env per "
                               "thread: envs built with hub= share one persuadee)")

    def _next_event(self):
        """The hub's next event for this episode; an error (or a loop gone silent) ends it in
        one line."""
        event = None
        while event is None:
            try:
                event = self.ticket.events.get(timeout=sessions.POLL_S)
            except queue.Empty:
                if not self.hub.alive() and self.ticket.events.empty():
                    event = ("error", RuntimeError("the loop stopped"))
        kind, payload = event
        if kind in ("end", "error"):
            self.episode["done"] = True
        if kind == "error":
            first = (str(payload).splitlines() or [""])[0][:200]
            raise RuntimeError(f"env.py: the episode of {self.episode['instance']['id']} ended "
                               f"on {type(payload).__name__}: {first}; call reset() for a new "
                               "one") from payload
        return kind, payload

    def _abandon(self):
        """Stop the episode in play (its sequences freed by the loop, as a person's stop) and
        wait for the loop to have freed them (while the loop lives)."""
        if self.ticket is not None and not self.episode["done"]:
            self.episode["done"] = True
            self.hub.say(self.ticket, None)
            while True:
                try:
                    if self.ticket.events.get(timeout=sessions.POLL_S)[0] in ("end", "error"):
                        break
                except queue.Empty:
                    if not self.hub.alive():
                        break

    # -- the Gymnasium interface -------------------------------------------------------------

    def reset(self, *, seed=None, options=None):
        """A new episode of options["instance"] (an instance id), else one drawn by the seed.
        The loop's random streams are keyed by `seed` (drawn when None), so the same seed and
        messages give the same episode. Returns (the persuader's opening messages, info with
        instance, seed, turn 0 and b_0's read-out)."""
        wanted = requested_instance(options, self.by_id)  # before the running episode ends
        checked_seed(seed)
        limit = getattr(self.spec, "max_episode_steps", None)  # gym.make's TimeLimit
        if limit is not None and limit < self.t_max:
            raise ValueError(f"env.py: gym.make's max_episode_steps {limit} would cut episodes "
                             f"of t_max {self.t_max}; pass max_episode_steps={self.t_max} too")
        self._one_at_a_time("reset")
        try:
            return self._reset(seed, wanted)
        finally:
            self.calling.release()

    def _reset(self, seed, wanted):
        super().reset(seed=seed)
        self._abandon()
        if wanted is not None:
            inst = self.by_id[wanted]
        else:
            inst = self.instances[int(self.np_random.integers(len(self.instances)))]
        episode_seed = seed if seed is not None else int(self.np_random.integers(2**31))
        messages = tuple(dict(m) for m in arena.persuader_messages(inst))
        self.episode = dict(instance=inst, seed=episode_seed, turn=0, done=False,
                            shown=list(messages))
        self.ticket = self.hub.open(inst, episode_seed)
        kind, seen = self._next_event()
        if kind == "end":  # the loop could not start it: a pool too small for one episode
            raise ValueError(f"env.py: the persuadee cannot hold one episode of {inst['id']} "
                             f"({seen.end_reason}); give it more KV blocks (kv_blocks)")
        values, mass = seen["probes"], seen["probe_mass"]
        info = dict(instance=inst["id"], seed=episode_seed, turn=0, t_max=self.t_max,
                    beliefs=seen["beliefs"], probes=named(values), probe_mass=named(mass))
        return messages, info

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
        self._one_at_a_time("step")
        try:
            return self._step(action)
        finally:
            self.calling.release()

    def _step(self, action):
        if self.episode is None or self.episode["done"]:
            raise RuntimeError("env.py: no episode in play; call reset() first")
        prepared = self.hub.prepare(self.ticket, action.strip())  # its cost on this thread
        self.episode["turn"] += 1
        self.episode["shown"].append({"role": "assistant", "content": action.strip()})
        self.hub.say(self.ticket, action.strip(), prepared)
        kind, seen = self._next_event()
        inst = self.episode["instance"]
        if kind == "speak":  # the episode goes on: the loop waits for the next message
            observation = ({"role": "user", "content": arena.persuader_sees(seen["text"])},)
            self.episode["shown"].append(observation[0])
            observation = self._observed(observation)
            info = dict(instance=inst["id"], turn=self.episode["turn"], decision=seen["decision"],
                        outcome=None, end_reason=None, beliefs=seen["beliefs"],
                        probes=named(seen["probes"]), probe_mass=named(seen["probe_mass"]))
            return observation, turn_reward(seen["beliefs"]), False, False, info
        return self._last_step(seen)

    def _last_step(self, ended):
        """The episode ended in this turn (ended, the judged rollout.Episode): its record in the
        info."""
        self.episode["done"] = True
        read = ended.turns == self.episode["turn"]  # this turn's reply got a read-out
        last = ended.transcript[-1] if ended.transcript else None
        replied = last is not None and last["role"] == "persuadee"
        info = dict(instance=ended.id, turn=self.episode["turn"],
                    decision=last["decision"] if replied else None, outcome=ended.outcome,
                    end_reason=ended.end_reason, beliefs=ended.beliefs,
                    probes=named(ended.probes[-1]) if read else None,
                    probe_mass=named(ended.probe_mass[-1]) if read else None,
                    goal_reward=rpo.GOAL[ended.outcome], strategy=ended.judge,
                    judge_failed=ended.judge_failed,
                    outcome_reward=rpo.outcome_reward(ended.outcome, ended.judge),
                    record=ended.record(training=False))
        observation = (({"role": "user", "content": arena.persuader_sees(last["text"])},)
                       if replied else ())
        self.episode["shown"].extend(observation)
        observation = self._observed(observation)
        terminated = ended.end_reason in DECISION_ENDS
        return (observation, turn_reward(ended.beliefs) if read else 0.0, terminated,
                not terminated, info)

    def _observed(self, new):
        """step's observation: the new messages, or the whole conversation so far."""
        if self.observation == "new":
            return new
        return tuple(dict(m) for m in self.episode["shown"])

    def render(self):
        """render_mode "ansi": the conversation so far as the persuader saw it, one message a
        paragraph, with the turn and beliefs; None without a render mode. Model text goes
        through lab/terminal.visible (escapes and bidi controls shown, never obeyed), so the
        text is safe to print."""
        if self.render_mode != "ansi":
            return None
        if self.episode is None:
            return "(no episode: call reset())\n"
        ep = self.episode
        lines = [f"== {ep['instance']['id']} (seed {ep['seed']}), turn {ep['turn']}/{self.t_max}"
                 f"{', ended' if ep['done'] else ''}"]
        lines += [f"[{m['role']}] {m['content']}" for m in ep["shown"]]
        return terminal.visible("\n\n".join(lines) + "\n")

    def close(self):
        """Stop the episode in play; its blocks are free on return. Never waits on the engine
        without an episode (an info route's env), nor behind another thread's call on this env
        (the stop is posted and the loop frees the blocks on its own)."""
        if self.ticket is None or self.episode["done"]:
            return
        if not self.calling.acquire(blocking=False):
            self.hub.say(self.ticket, None)
            return
        try:
            self._abandon()
        finally:
            self.calling.release()


if ENV_ID not in gym.registry:  # Gymnasium's checker on; TimeLimit at the default turn budget
    gym.register(ENV_ID, entry_point="lab.env:PersuasionEnv", max_episode_steps=arena.T_MAX_TRAIN)
