"""
rollout.py: the one episode loop. Episodes of a persuader and a persuadee, whatever plays each role.

A role is a *side* (the Protocol Side, below): a local engine.Engine (EngineSide), a model behind
an OpenAI-compatible API (served.ServedSide) or, as persuader, the person at the terminal
(lab/play.py). Every side has the same small interface (prompt, room, prefill, start: forks with
b_0 read, ready, speak: an arena.Message each, reply: an arena.Reply each, the probes read after
it, hear, free), so one loop drives every mix of them, and a player becomes a side one way
(side: by its type). Each episode is one Episode (a dataclass, below): what the loop builds and
plays (its Status says whose message is due), what rpo.py's rewards and loss read and what
episodes.jsonl holds (Episode.record; Episode.from_record reads one back).

On a local side a dialogue is a growing context that only appends: the persuader's new message
goes into the persuadee's context, the reply into the persuader's, so every token of a
conversation is prefilled exactly once (engine.py). After each reply the persuadee's beliefs are
read in forks of its context (probes.py); once all have ended a frozen judge scores each
transcript (judge_episodes, under the one retry policy judge_attempts; lab/judge.py and
lab/served.py answer each attempt). With decision "logit" (--decision logit) the
persuadee's decision is read in such a fork too (probes.read_decisions) and sampled with its
episode's keyed stream, instead of parsed from its tag; with decision "belief" it accepts with a
probability its probe belief sets (probes.belief_decisions), drawn with the same keyed stream.

Scheduling (lab/scheduling.py: admit, round, stall) completes any number of episodes on any
pools that hold one of them; a stalled episode is replayed the same, its streams keyed.
A persuader message whose reply never came (the episode ended "cache", "context" or "api_error"
in between) is kept in the transcript but masked out of the loss: its tokens get turn id 0,
since no belief change and no decision answers it.

    python -m pytest -q tests/test_rollout.py
"""
import contextlib
import dataclasses
import enum
import functools
from typing import Protocol, runtime_checkable

from persuarena import arena
from persuarena import engine
from persuarena import models
from persuarena import probes
from lab import judge as local_judge, scheduling, served

JUDGE_MAX_NEW_TOKENS = 32  # the judge answers three short lines (~15 tokens)
FROZEN_SAMPLING = engine.Sampling(0.7, top_p=0.8, top_k=20)  # the persuadee's replies in every
# preset (Qwen3 non-thinking, as its makers advise)
SAMPLING = {  # per preset: (persuader, persuadee). The persuader samples its whole tempered
    # distribution (pi_old exact); cpu: SmolLM2-135M at T 0.7, chosen by reading its samples (DECISIONS.md: CPU sampling preset)
    "paper": (engine.Sampling(1.0), FROZEN_SAMPLING),
    "cpu": (engine.Sampling(0.7), FROZEN_SAMPLING),
}
JUDGE_RETRY_SAMPLING = engine.Sampling(0.7, top_p=0.8, top_k=20)  # the judge's sampled retries
SPOKEN = ("stop", "length")  # how a message that keeps its episode going ends
STOPPED = "stopped"  # end reason: the person at the terminal (lab/play.py) ended the conversation
CLOSING_ROOM = 8  # tokens kept for the template's tail that closes a reply
PROMPT_ROOM_SHARE = 4  # a prompt must leave max_new_tokens // PROMPT_ROOM_SHARE of the context
# free: room for a short exchange
DECISION = "tag"  # "logit": the persuadee's decision read in a fork after each reply (DECISIONS.md:
# Logit decision), for persuadees too small to write tags; "belief": accepted as its probe belief
# says (DECISIONS.md: Belief decision); --decision's default


@runtime_checkable
class Side(Protocol):
    """What plays a role, whatever it is (module docstring); side() makes one of a player. The
    sides that exist: EngineSide (a local engine.Engine, either role), served.ServedSide (a model
    behind an OpenAI-compatible API, either role), play.PersonSide (the person at the terminal,
    persuader), sessions.OutsideSide and sessions.OutsidePersuadee (the sessions of a hub, as
    persuader or persuadee; sessions.SharedPrompts wraps a hub's EngineSide), audit.ScriptedSide
    (the audit's scripted persuader) and bench_baselines.HistorySide (lab.bench's baselines,
    which run each side's whole history again every turn)."""
    tokenizer: object  # None where text crosses (served or typed)
    max_len: int | None  # the context, None where a server checks its own
    eng: engine.Engine | None  # the local engine it plays on (None: a server, a person, sessions)

    def prompt(self, instance: dict) -> list[int]: ...  # the prompt's ids ([] where text crosses)
    def room(self, instance: dict, n: int) -> bool: ...  # can n episodes of instance open now?
    def prefill(self, instance: dict) -> int | None: ...  # the prompt once; its root
    def start(self, roots: list[int | None],
              counts: list[int]) -> tuple[list[list[int]], list[tuple | None]]: ...
    # (sids per root, (b_0 probe values, masses) per root or None); the roots are freed
    def ready(self, sids: list[int]) -> list[int]: ...  # those whose next message fits now
    def speak(self, sids: list[int], keys: list[int]) -> list[arena.Message]: ...
    def reply(self, sids: list[int], keys: list[int],
              timings: dict | None = None) -> list[arena.Reply]: ...  # probes read after each
    def hear(self, sid: int, text: str, final_turn: bool = False,
             shown: tuple | None = None) -> tuple[list[int], str | None]: ...
    # (the ids it added to a persuader's stream, "context" when they did not fit, else None)
    def free(self, sid: int) -> None: ...




def prompt_ids(persuader_tok, persuadee_tok, instance):
    """The persuader's prompt (ending in its generation prompt) and the persuadee's system turn."""
    return (models.chat_ids(persuader_tok, arena.persuader_messages(instance), True),
            models.chat_ids(persuadee_tok, arena.persuadee_messages(instance), False))


def prompt_problems(persuader, persuadee, instances: list[dict],
                    max_new_tokens: int | None = None) -> dict[str, str]:
    """{instance id: why it cannot be played}, for prompts that leave less than max_new_tokens
    (default engine.MAX_NEW_TOKENS) // PROMPT_ROOM_SHARE tokens of a local model's context (a
    server checks its own). Each role is what has a tokenizer and a max_len (None: unchecked): a
    side, an engine.Engine, a served.ServedModel. A prompt is encoded (as prompt_ids encodes it)
    only when models.chat_length_bound does not already show that it fits."""
    room = (engine.MAX_NEW_TOKENS if max_new_tokens is None else max_new_tokens) // PROMPT_ROOM_SHARE
    problems = {}
    for inst in instances:
        for role, eng in (("persuader", persuader), ("persuadee", persuadee)):
            if eng.max_len is None:
                continue
            messages = (arena.persuadee_messages(inst) if role == "persuadee" else
                        arena.persuader_messages(inst))
            generation = role == "persuader"  # as prompt_ids encodes each side
            if models.chat_length_bound(eng.tokenizer, messages, generation) + room <= eng.max_len:
                continue
            ids = models.chat_ids(eng.tokenizer, messages, generation)
            if len(ids) + room > eng.max_len:
                problems[inst["id"]] = (f"the {role} prompt of {inst['id']} is {len(ids)} tokens, "
                                        f"the model's context {eng.max_len}")
    return problems


def persuadee_heard(tokenizer, text, final_turn):
    """Ids of the persuader's message as the persuadee receives it: inert text, tags stripped;
    on the last turn the final-turn instruction follows as a system turn (never part of any
    transcript, and not something the persuader can write)."""
    return models.chat_ids(tokenizer, arena.persuadee_sees(text, final_turn), True,
                           continued=True)


def persuader_heard(tokenizer, message_ids, text):
    """Ids of the persuadee's reply as the persuader receives it after its own message
    (message_ids, as sampled): that message's closing, then the reply as a user turn, tags
    stripped, and the generation prompt of the next message."""
    return (models.closing_ids(tokenizer, message_ids)
            + models.turn_ids(tokenizer, arena.persuader_sees(text)))


def close_replies(persuadee: engine.Engine, sids: list[int],
                  outs: list[tuple]) -> tuple[list[arena.Reply], list[tuple[int, arena.Reply]]]:
    """The persuadee's replies as generated (outs), each closed in its context where it fits:
    (an arena.Reply per sequence, no probes read yet; the closed ones as (sid, reply)). A reply
    with no room left to close and ask the probes ends "context"."""
    tok = persuadee.tokenizer
    replies, closed = [], []
    for sid, (ids, _, reason) in zip(sids, outs):
        text = tok.decode(ids, skip_special_tokens=True).strip()
        closing = models.closing_ids(tok, ids)
        if (reason not in arena.CUT_OFF and persuadee.length(sid) + len(closing)
                + max(map(len, probes.probe_ids(tok)[0])) > persuadee.max_len):
            reason = "context"  # no room left to close the reply and ask the probes
        replies.append(arena.Reply(text, arena.parse_decision(text), reason))
        if reason not in arena.CUT_OFF:
            persuadee.append(sid, closing)
            closed.append((sid, replies[-1]))
    return replies, closed


def message_blocks(eng: engine.Engine, max_new_tokens: int) -> int:
    """Blocks one more message of a sequence can take at most (one more for copy-on-write)."""
    return eng.blocks_for(max_new_tokens, copy_on_write=True)


@functools.singledispatch
def judge_scores(model: object, *args, **kwargs):
    """The judge's scores, chosen as side() chooses a side: by the model's type (each kind's
    scorer looked up when called)."""
    raise TypeError(f"rollout.py: a judge is an engine.Engine or a served.ServedModel, not a "
                    f"{type(model).__name__}; pass one of those, or None for no judge")


judge_scores.register(engine.Engine, lambda *a, **k: local_judge.judge_scores(*a, **k))
judge_scores.register(served.ServedModel, lambda *a, **k: served.judge_scores(*a, **k))


def judge_all(model, instances: list[dict], transcripts: list[list[dict]], seed: int,
              group_indices: list[int]) -> tuple[list[float], list[bool]]:
    """(strategy score s, fell back) per transcript, by a local or a served judge (judge_scores)
    under the one retry policy (judge_attempts); s = 0 (not fallen back) for every transcript
    when there is no judge (model None)."""
    if model is None:
        return [0.0] * len(instances), [False] * len(instances)
    return judge_scores(model, instances, transcripts, seed, group_indices,
                        max_tokens=JUDGE_MAX_NEW_TOKENS, attempts=judge_attempts)


def judge_attempts(answer, n):
    """The judge's retry policy, which sets s (DECISIONS.md: Judge retries), for every judge
    (local: lab/judge.py; served: lab/served.py): each of n transcripts' greedy answer, then up
    to arena.JUDGE_RETRIES answers sampled with JUDGE_RETRY_SAMPLING while none parses
    (arena.parse_judge). answer(todo, sampling, attempt) returns the answer texts (None: no
    answer) of the transcripts todo (indices). Returns s per transcript, None where none parsed
    (the caller falls back to s = 0)."""
    scores = [None] * n
    for attempt in range(1 + arena.JUDGE_RETRIES):
        todo = [i for i, s in enumerate(scores) if s is None]
        if not todo:
            break
        sampling = engine.GREEDY if attempt == 0 else JUDGE_RETRY_SAMPLING
        for i, text in zip(todo, answer(todo, sampling, attempt)):
            scores[i] = None if text is None else arena.parse_judge(text)
    return scores


class Status(enum.Enum):
    """Where an episode stands in the loop."""
    SPEAK = "speak"  # the persuader's next message is due
    REPLY = "reply"  # the persuadee's reply to the message it heard is due
    ENDED = "ended"  # its dialogue is done: outcome, turns and end reason are set


def described(doc, kind="play", default=None, factory=None):
    """A field of Episode written to its record (kind: "play", always; "training", left out of an
    evaluation's records; "stamp" and "label", written where set), with its description."""
    meta = dict(doc=doc, kind=kind)
    return (dataclasses.field(default_factory=factory, metadata=meta) if factory else
            dataclasses.field(default=default, metadata=meta))


def loop_only(default):
    """A field of Episode that only the loop reads: neither recorded nor compared."""
    return dataclasses.field(default=default, compare=False)


@dataclasses.dataclass
class Episode:
    """One episode, from the loop to the loss and the disk: rollout_episodes builds and plays it,
    rpo.rewards and rpo.micro_batch_loss read it, record() is what episodes.jsonl holds (the
    described fields, below) and from_record reads one back (older files too). "No value" is
    None in every field (a belief a served persuadee could not read, a judge that gave no score);
    NaN lives only inside rpo.py's arithmetic. The fields with no description are the loop's."""
    id: str = described("the instance's id (scenario and variant)", default="")
    scenario_id: str = described("the scenario's id", default="")
    domain: str = described("the scenario's domain", default="")
    resistance: str | None = described("the hidden resistance type")
    outcome: str | None = described("one of arena.OUTCOMES (None while the episode plays)")
    turns: int = described("persuader messages answered", default=0)
    end_reason: str | None = described("why the episode ended (arena.Dialogue)")
    transcript: list[dict] = described("[{role, text, decision}] in order", factory=list)
    beliefs: list[float | None] = described("b_0..b_T, the mean of the probe values (None: "
                                            "unread)", factory=list)
    probes: list[list[float] | None] = described("one value per probe of probes.PROBES after each "
                                                 "reply (None: unread)", factory=list)
    probe_mass: list[list[float] | None] = described("P(Yes) + P(No) of each read-out",
                                                     factory=list)
    judge: float | None = described("strategy score s (None: not judged)")
    judge_failed: bool | None = described("the judge's answer could not be parsed: s fell back to 0")
    ids: list[int] = described("persuader-side token stream", "training", factory=list)
    turn_ids: list[int] = described("message index t of each token the policy sampled in message "
                                    "t, 0 for the others", "training", factory=list)
    logprobs: list[float] = described("sampling log-probs (empty for a persuader whose tokens "
                                      "never came here: served or typed)", "training", factory=list)
    persuader: str | None = described("the persuader's model (evaluation)", "stamp")
    persuadee: str | None = described("the persuadee's model (evaluation)", "stamp")
    seed: int | None = described("the evaluation's seed", "stamp")
    anchor: bool | None = described("the reward setting (evaluation)", "stamp")
    probe_space: str | None = described("probe value space (evaluation)", "stamp")
    probe_signs: dict | None = described("probe valences (evaluation)", "stamp")
    moves: list[list[str]] | None = described("move labels per persuader message (moves.py)",
                                              "label")
    manipulation: list[list[str]] | None = described("manipulation labels per persuader message "
                                                     "(moves.py)", "label")
    tagger: str | None = described("which tagger labelled them", "label")
    extra: dict = described("fields of a record that this one does not name, kept as read",
                            "extra", factory=dict)
    # the loop's, not recorded (nor compared: two episodes are equal when their records are)
    instance: dict | None = loop_only(None)  # the scenario instance played
    index: int = loop_only(0)  # the instance's place in the loop's instances
    g: int = loop_only(0)  # its place in its group
    persuader_key: int = loop_only(0)  # the random streams it samples with (engine.stream_key)
    persuadee_key: int = loop_only(0)
    persuader_sid: int | None = loop_only(None)  # its sequence on each side
    persuadee_sid: int | None = loop_only(None)
    dialogue: arena.Dialogue | None = loop_only(None)  # the decision state machine
    status: Status = loop_only(Status.SPEAK)

    @classmethod
    def new(cls, inst: dict, index: int, g: int, t_max: int, seed: int) -> "Episode":
        """An episode before it starts: no context, no message, no belief."""
        key = (seed, inst["id"], g)
        return cls(id=inst["id"], scenario_id=inst.get("scenario_id", inst["id"]),
                   domain=inst["domain"], resistance=inst["hidden"].get("resistance"),
                   instance=inst, index=index, g=g, dialogue=arena.Dialogue(t_max),
                   persuader_key=engine.stream_key(*key, "persuader"),
                   persuadee_key=engine.stream_key(*key, "persuadee"))

    def end(self, reason: str | None = None) -> None:
        """The episode ends (its dialogue ended from outside with reason, unless already done):
        outcome, turns and end reason are set from its dialogue and beliefs."""
        if reason is not None:
            self.dialogue.end(reason)
        self.outcome, self.end_reason = self.dialogue.outcome, self.dialogue.end_reason
        self.turns, self.status = max(len(self.beliefs) - 1, 0), Status.ENDED

    def record(self, training: bool = True) -> dict:
        """The record on disk: every described field ("training" ones when training; "stamp" and
        "label" ones where set), then the extra fields as read."""
        out = {}
        for f in dataclasses.fields(self):
            kind, value = f.metadata.get("kind"), getattr(self, f.name)
            if kind == "play" or kind == "training" and training or (
                    kind in ("stamp", "label") and value is not None):
                out[f.name] = value
        return {**out, **self.extra}

    @classmethod
    def from_record(cls, row: dict) -> "Episode":
        """An episode read back from its record (episodes.jsonl, any version): the fields it
        names, the others in extra."""
        named = {f.name for f in dataclasses.fields(cls) if f.metadata.get("kind") not in
                 (None, "extra")}
        return cls(**{k: v for k, v in row.items() if k in named},
                   extra={k: v for k, v in row.items() if k not in named},
                   status=Status.ENDED)


RECORD_FIELDS = {f.name: f.metadata["doc"] for f in dataclasses.fields(Episode)
                 if f.metadata.get("kind") not in (None, "extra")}  # what a record may hold
TRAINING_FIELDS = tuple(f.name for f in dataclasses.fields(Episode)
                        if f.metadata.get("kind") == "training")  # of no use once scored


def rollout_episodes(persuader, persuadee, instances: list[dict], t_max: int, *,
                     group_size: int = 1, seed: int = 0, persuader_sampling=None,
                     persuadee_sampling=None, max_new_tokens: int | None = None, judge=None,
                     max_active: int | None = None, probe_space: str | None = None,
                     probe_signs: dict | None = None, decision: str | None = None,
                     on_record=None, progress=None, timings: dict | None = None,
                     loop: "EpisodeLoop | None" = None) -> list[Episode]:
    """Play G = group_size episodes of every instance to the end, scheduled onto the sides, in
    rounds: admit what fits, then every persuader with room speaks and every persuadee with room
    replies, its probes read after each reply (Side.reply).

    persuader and persuadee are each an engine.Engine, a served.ServedModel or a Side (side),
    sampled with their role's engine.Sampling (default SAMPLING["paper"]), each message at most
    max_new_tokens (default engine.MAX_NEW_TOKENS). probe_space and probe_signs are the probe
    options (probes.py's defaults); decision is how the persuadee decides, "tag", "logit" or
    "belief" (default DECISION). `max_active` caps the episodes in play at once (default: as
    many as the sides take). `on_record`, when given, receives each episode as soon as it ends,
    its judge still None. judge: an Engine or a ServedModel scores every transcript once all
    have ended (judge_episodes; train.py calls it itself); None leaves s = 0. `timings`, when
    given a dict, accumulates seconds under persuader_s, persuadee_s, probe_s and judge_s.
    `loop`: an EpisodeLoop to play instead of one made here (lab/sessions.py's, whose episodes
    join as sessions open them), its sides persuader and persuadee as given. Returns one
    Episode per episode (instance-major)."""
    if loop is None:
        persuader, persuadee = sides(persuader, persuadee, instances, persuader_sampling,
                                     persuadee_sampling, max_new_tokens, probe_space, probe_signs,
                                     decision)
        loop = EpisodeLoop(persuader, persuadee, instances, t_max, seed, group_size, max_active,
                           on_record, timings, progress)
    while loop.more():
        with loop.round():
            if groups := loop.admit():  # prompts prefilled where every side has room
                counts = [len(members) for _, members, _ in groups]
                persuader_sids, _ = persuader.start([roots[0] for *_, roots in groups], counts)
                with scheduling.clock(timings, "probe_s"):  # b_0, before the first message
                    persuadee_sids, b0 = persuadee.start([roots[1] for *_, roots in groups], counts)
                loop.started(groups, persuader_sids, persuadee_sids, b0)
            if speakers := loop.ready(persuader, Status.SPEAK):
                with scheduling.clock(timings, "persuader_s"):
                    said = persuader.speak([e.persuader_sid for e in speakers],
                                           [e.persuader_key for e in speakers])
                loop.said(speakers, said)
            if repliers := loop.ready(persuadee, Status.REPLY):  # the probes read after each
                replies = persuadee.reply([e.persuadee_sid for e in repliers],
                                          [e.persuadee_key for e in repliers], timings)
                loop.replied(repliers, replies)
        loop.after_round(bool(speakers or repliers))
    return judge_episodes(judge, instances, loop.episodes(), seed, group_size, timings)


def sides(persuader, persuadee, instances: list[dict], persuader_sampling, persuadee_sampling,
          max_new_tokens: int | None, probe_space: str | None, probe_signs: dict | None,
          decision: str | None) -> tuple[Side, Side]:
    """The two sides of rollout_episodes (side), their prompts checked against the instances."""
    paper = SAMPLING["paper"]
    max_new_tokens = engine.MAX_NEW_TOKENS if max_new_tokens is None else max_new_tokens
    decision = DECISION if decision is None else decision
    persuader_side = side(persuader, "persuader", persuader_sampling or paper[0], max_new_tokens)
    persuadee_side = side(persuadee, "persuadee", persuadee_sampling or paper[1], max_new_tokens,
                          probe_space, probe_signs, decision)
    problems = prompt_problems(persuader_side, persuadee_side, instances, max_new_tokens)
    if problems:
        raise ValueError("rollout.py: " + "; ".join(problems.values()) + ". Leave these instances "
                         "out (rollout.prompt_problems finds them) or use a longer-context model.")
    return persuader_side, persuadee_side


def judge_episodes(judge, instances: list[dict], episodes: list[Episode], seed: int,
                   group_size: int, timings: dict | None = None) -> list[Episode]:
    """The strategy judge's score s of each Episode (instance-major, group_size a instance),
    set as its judge and judge_failed (judge_all); an episode with nothing said keeps s = 0, and
    so does every one when judge is None. Returns the episodes."""
    spoken = [i for i, e in enumerate(episodes) if e.transcript] if judge is not None else []
    with scheduling.clock(timings, "judge_s"):
        scores, failed = judge_all(judge, [instances[i // group_size] for i in spoken],
                                   [episodes[i].transcript for i in spoken], seed,
                                   [i % group_size for i in spoken]) if spoken else ([], [])
    for i, score, fell_back in zip(spoken, scores, failed):
        episodes[i].judge, episodes[i].judge_failed = score, fell_back
    return episodes


class EpisodeLoop:
    """The episodes' state between the sides' calls in rollout_episodes: which episodes wait
    and run (Scheduler), and what each message and reply does to its episode (its arena state
    machine, its token stream, transcript and beliefs). more, round and after_round pace the
    rounds (lab/sessions.py's SessionLoop paces a hub's its own way)."""

    def __init__(self, persuader: Side, persuadee: Side, instances, t_max: int, seed: int | None,
                 group_size: int, max_active: int | None, on_record, timings: dict | None,
                 progress=None):
        self.instances, self.t_max, self.seed = instances, t_max, seed
        self.group_size, self.on_record, self.progress = group_size, on_record, progress
        self.scheduler = scheduling.Scheduler((persuader, persuadee), instances, group_size,
                                              max_active, timings)

    def more(self) -> bool:
        """Whether another round is due: episodes in play or waiting."""
        return bool(self.scheduler.running or self.scheduler.waiting)

    def round(self) -> contextlib.AbstractContextManager:
        """What holds around one round's calls to the sides (nothing here)."""
        return contextlib.nullcontext()

    def after_round(self, moved: bool) -> None:
        """When no episode could move, the youngest is freed and queued again (Scheduler.stall);
        the progress bar follows the episodes ended."""
        if not moved and self.scheduler.running:
            self.scheduler.stall()
        if self.progress is not None:
            self.progress.update(len(self.scheduler.done) - self.progress.n)

    def episodes(self) -> list[Episode]:
        """Every episode played, instance-major, judged s = 0 until judge_episodes."""
        episodes = [self.scheduler.done[i, g] for i in range(len(self.instances))
                    for g in range(self.group_size)]
        for e in episodes:
            e.judge, e.judge_failed = 0.0, False
        return episodes

    def admit(self):
        """The groups the scheduler admits now (index, members, roots); those that never start
        (no room in empty pools) are recorded as ended "cache"."""
        groups, never = self.scheduler.admit()
        for index, g in never:
            e = Episode.new(self.instances[index], index, g, self.t_max, self.seed_of(index))
            e.end("cache")
            self.scheduler.done[index, g] = e
            self.ended(e)
        return groups

    def started(self, groups, persuader_sids, persuadee_sids, reads):
        """The groups' episodes, forked from their prompts, running with b_0 read."""
        for (index, members, _), persuader_group, persuadee_group, (b0, m0) in zip(
                groups, persuader_sids, persuadee_sids, reads):
            inst = self.instances[index]
            prompt = self.scheduler.sides[0].prompt(inst)
            for g, persuader_sid, persuadee_sid in zip(members, persuader_group, persuadee_group):
                e = Episode.new(inst, index, g, self.t_max, self.seed_of(index))
                e.persuader_sid, e.persuadee_sid = persuader_sid, persuadee_sid
                e.ids, e.turn_ids, e.logprobs = list(prompt), [0] * len(prompt), [0.0] * len(prompt)
                e.probes, e.probe_mass, e.beliefs = [b0], [m0], [probes.belief(b0)]
                self.scheduler.running.append(e)

    def seed_of(self, index):  # the seed its streams are keyed by (lab/sessions.py: its own)
        return self.seed

    @staticmethod
    def extend(e, ids, turn=0, logprobs=None):  # the persuader-side token stream for training
        e.ids += ids
        e.turn_ids += [turn] * len(ids)
        e.logprobs += logprobs or [0.0] * len(ids)

    def cut_off(self, e, reason):
        """The last persuader message got no reply: no loss on its tokens (module docstring)."""
        turn = e.dialogue.turn + 1
        e.turn_ids = [0 if t == turn else t for t in e.turn_ids]
        self.finish(e, reason)

    def finish(self, e, reason=None):
        self.scheduler.finish(e, reason)
        self.ended(e)

    def ended(self, e):
        if self.on_record is not None:
            self.on_record(e)

    def ready(self, side_, status):
        """The running episodes in status (SPEAK, REPLY) whose side has room for their next
        message now."""
        sid = (lambda e: e.persuader_sid) if status is Status.SPEAK else (lambda e: e.persuadee_sid)
        episodes = [e for e in self.scheduler.running if e.status is status]
        fit = set(side_.ready([sid(e) for e in episodes]))
        return [e for e in episodes if sid(e) in fit]

    def said(self, speakers: list[Episode], said: list[arena.Message]) -> None:
        """Each persuader's message enters its token stream and transcript; the persuadee hears it."""
        for e, out in zip(speakers, said):
            self.extend(e, out.ids, e.dialogue.turn + 1, out.logprobs)
            if out.reason not in (arena.API_ERROR, STOPPED):  # those said nothing
                e.transcript.append({"role": "persuader", "text": out.text, "decision": None})
            if out.reason not in SPOKEN:
                self.cut_off(e, out.reason)
                continue
            self.scheduler.sides[1].hear(e.persuadee_sid, out.text, e.dialogue.final_turn)
            e.status = Status.REPLY

    def replied(self, repliers: list[Episode], replies: list[arena.Reply]) -> None:
        """Each reply steps its episode's state machine, adds its belief, and the persuader
        hears it."""
        for e, reply in zip(repliers, replies):
            if reply.reason != arena.API_ERROR:
                e.transcript.append({"role": "persuadee", "text": reply.text,
                                     "decision": reply.decision})
            if reply.reason in arena.CUT_OFF:
                self.cut_off(e, reply.reason)
                continue
            e.dialogue.step(reply.decision)
            e.probes.append(reply.probes)
            e.probe_mass.append(reply.probe_mass)
            e.beliefs.append(probes.belief(reply.probes))
            if e.dialogue.done:
                self.finish(e)
                continue
            ids, reason = self.scheduler.sides[0].hear(e.persuader_sid, reply.text,
                                                       shown=(reply.probes, e.beliefs))
            self.extend(e, ids)
            e.status = Status.SPEAK
            if reason:
                self.finish(e, reason)


class EngineSide:
    """A role played by a local engine.Engine: ids in, ids out. Its capacity is its pool: a
    message is admitted with room for its worst case (max_new_tokens; for the persuadee the
    reply's closing and the probe forks too)."""

    def __init__(self, eng, role, sampling, max_new_tokens, probe_space=None, probe_signs=None,
                 decision=None):
        self.eng, self.role, self.sampling = eng, role, sampling
        self.max_new_tokens, self.space, self.signs = max_new_tokens, probe_space, probe_signs
        self.tokenizer, self.max_len = eng.tokenizer, eng.max_len
        self.persuadee = role == "persuadee"
        self.decision = (DECISION if decision is None else decision) if self.persuadee else "tag"
        self.reserve = (max(probes.read_blocks(eng), probes.decision_blocks(eng) if
                            self.decision == "logit" else 0) if self.persuadee else 0)
        self.step = message_blocks(eng, max_new_tokens) + self.reserve
        self.prompts, self.tails, self.last = {}, {}, {}

    def prompt(self, instance: dict) -> list[int]:
        if instance["id"] not in self.prompts:  # built once per instance
            self.prompts[instance["id"]] = prompt_ids(self.tokenizer, self.tokenizer,
                                                      instance)[self.persuadee]
        return self.prompts[instance["id"]]

    def room(self, instance: dict, n: int) -> bool:
        return self.eng.can_fit(len(self.prompt(instance)), n * self.step)

    def prefill(self, instance: dict) -> int:
        """The prompt once; a persuader's last prompt token starts each episode's first message."""
        ids = self.prompt(instance)
        root = self.eng.new(ids if self.persuadee else ids[:-1])
        self.tails[root] = [] if self.persuadee else ids[-1:]
        self.eng.forward([root])
        return root

    def start(self, roots: list[int], counts: list[int]) -> tuple[list[list[int]], list]:
        reads = [None] * len(roots)
        if self.persuadee:
            values, mass = probes.read_engine(self.eng, roots, with_mass=True, space=self.space,
                                              signs=self.signs)
            reads = list(zip(values.tolist(), mass.tolist()))
        sids = [[self.eng.fork(r, self.tails[r]) for _ in range(n)] for r, n in zip(roots, counts)]
        for r in roots:
            self.eng.free(r)
            del self.tails[r]
        return sids, reads

    def ready(self, sids: list[int]) -> list[int]:
        extra = self.max_new_tokens + (CLOSING_ROOM if self.persuadee else 0)
        counts = [self.eng.length(s) - self.eng.cached(s) + extra for s in sids]
        return self.eng.admit(sids, counts, reserve=self.reserve)

    def speak(self, sids: list[int], keys: list[int]) -> list[arena.Message]:
        outs = self.eng.generate(sids, self.max_new_tokens, self.sampling, keys)
        said = []
        for s, (ids, logprobs, reason) in zip(sids, outs):
            self.last[s] = ids
            said.append(arena.Message(self.tokenizer.decode(ids, skip_special_tokens=True).strip(),
                                      reason, ids, logprobs))
        return said

    def hear(self, sid: int, text: str, final_turn: bool = False,
             shown: tuple | None = None) -> tuple[list[int], str | None]:
        """The other side's text enters the context (a persuader is shown the reply's probe
        values and the beliefs so far, which only a person reads); returns (the ids it added to
        a persuader's stream, "context" when the context cannot take them, else None)."""
        if self.persuadee:
            self.eng.append(sid, persuadee_heard(self.tokenizer, text, final_turn))
            return [], None
        ids = persuader_heard(self.tokenizer, self.last.pop(sid), text)
        self.eng.append(sid, ids)
        return ids, "context" if self.eng.overflow(sid) == "context" else None

    def reply(self, sids: list[int], keys: list[int] | None,
              timings: dict | None = None) -> list[arena.Reply]:
        """The persuadee's replies (the message it heard pending: persuadee_heard), each closed and
        its beliefs read in forks (probes.read_engine: values and the Yes+No mass of each
        read-out); a reply cut off ("context", "cache") has no probes. decision "logit": the
        decision read in a fork too (probes.read_decisions) and sampled (probes.sample_decisions);
        "belief": drawn from the belief just read (probes.belief_decisions)."""
        with scheduling.clock(timings, "persuadee_s"):
            outs = self.eng.generate(sids, self.max_new_tokens, self.sampling, keys)
            replies, closed = close_replies(self.eng, sids, outs)
            if closed:
                self.eng.forward([sid for sid, _ in closed])
        if not closed:
            return replies
        done = [sid for sid, _ in closed]
        with scheduling.clock(timings, "probe_s"):
            values, mass = probes.read_engine(self.eng, done, with_mass=True, space=self.space,
                                              signs=self.signs)
            probs = probes.read_decisions(self.eng, done) if self.decision == "logit" else None
        for (_, reply), v, m in zip(closed, values.tolist(), mass.tolist()):
            reply.probes, reply.probe_mass = v, m
        by_sid = dict(zip(sids, keys or [0] * len(sids)))
        keyed, positions = [by_sid[sid] for sid in done], [self.eng.length(sid) for sid in done]
        if self.decision == "logit":
            drawn = probes.sample_decisions(probs, keyed, positions)
            for (_, reply), decision, p in zip(closed, drawn, probs.tolist()):
                reply.decision, reply.decision_probs = decision, p
        if self.decision == "belief":
            drawn = probes.belief_decisions([probes.belief(r.probes) for _, r in closed], keyed,
                                            positions)
            for (_, reply), decision, p in zip(closed, *drawn):
                reply.decision, reply.accept_prob = decision, p
        return replies

    def free(self, sid: int) -> None:
        self.eng.free(sid)
        self.last.pop(sid, None)


@functools.singledispatch
def side(player: object, role: str, sampling: engine.Sampling, max_new_tokens: int,
         probe_space: str | None = None, probe_signs: dict | None = None,
         decision: str | None = None) -> Side:
    """The side that plays `role`, chosen one way: by the player's type, as registered below (an
    engine.Engine plays as EngineSide, a served.ServedModel as served.ServedSide, each built
    with these arguments); any other player is a side already (Side), returned as it is.
    decision: how the persuadee decides (default DECISION; a served one reads only its tag)."""
    return player


side.register(engine.Engine, lambda *a, **k: EngineSide(*a, **k))
side.register(served.ServedModel, lambda *a, **k: served.ServedSide(*a, **k))
