"""
sessions.py: many sessions' episodes on one persuadee, played by rollout.py's one loop.

A session (a PersuasionEnv, one OpenEnv WebSocket client) opens an episode and feeds it the
persuader's messages from outside. Every session of a Hub shares one persuadee (and judge): the
hub plays rollout.rollout_episodes on an EpisodeLoop of its own in one thread (SessionLoop),
whose persuader side is the sessions themselves (OutsideSide: an episode is ready to speak
once its session's message has arrived).
So what the sessions ask of the persuadee at the same moment, replies with their probe reads and
decisions, runs in the same engine steps (a round waits a little, SessionLoop.gather, for the
messages of the sessions answered together in the last round, so that they stay together; an idle
hub's first episodes wait for others opening at the same moment, and episodes of one instance
admitted together share their prompt's prefill, SharedPrompts), and the judge scores the
episodes that ended in the same round together (those of one seed in one call: its retries are
keyed by the seed). A session's message never waits for another session's episode to end.

A message's own cost is paid in its session's thread, before it joins the shared round
(Hub.prepare): its tags stripped and its ids built there, and a message whose ids exceed
MAX_MESSAGE_TOKENS (a few of a trainer's messages' length) is refused in one line, after
REFUSED_WAIT_S on the sender's clock. So one
session's text (tags nested deep, a 9,000-token message the judge then reads) cannot hold the
engine for the others.

The outside may play either role (Hub's outside): the persuader (the default, OutsideSide: the
model persuadee answers) or the persuadee (OutsidePersuadee: a person of lab/study.py, who
answers the model persuader's messages with a reply, a decision and the probes' self-reported
values, the first of them, b_0, given when the episode opens).

Admission: an episode of a local persuadee is admitted only while its worst case fits the pool
beside the worst cases of those in play (pools.episode_blocks, and pools.judge_blocks when the
persuadee judges), so no episode in play ever has to be preempted; a session that does not fit
waits up to ADMIT_WAIT_S and is then refused in one line. At most max_sessions episodes play at
once. A session's stop (reset, close, a dropped client) ends its own episode ("stopped") and
frees exactly its blocks; nothing a session sends reaches another's episode. An episode's random
streams are keyed by its own seed, so it plays the same whoever else is in play.

    hub = Hub(engine, judge=None, t_max=3, max_new_tokens=8)
    ticket = hub.open(instance, seed=0)   # then hub.say(ticket, text), ticket.events.get()

    python -m pytest -q tests/test_sessions.py
"""
import contextlib
import queue
import threading
import time
import weakref
from collections import deque

from persuarena import arena
from persuarena import probes
from persuarena import rollout
from lab import pools, scheduling

HUB_IDLE_S = 5.0  # the loop's thread ends after this long without an episode (started again)
ADMIT_WAIT_S = 30.0  # a session whose episode does not fit the pool waits this long, then is refused
POLL_S = 0.5  # how often a waiting loop or session checks that the other side still lives
MAX_MESSAGE_TOKENS = 1024  # ids a local persuadee hears of one message at most (4x a trainer's 256)
REFUSED_WAIT_S = 0.25  # a refused message's session waits this long for its refusal: one
# session sending refused text in a loop cannot take the CPU the others' rounds need
MAX_SESSIONS = 64  # episodes in play at once on one hub (the server's --sessions)
GATHER_S = 0.02  # a round waits this long for the messages of sessions answered in the last one,
GATHER_FRACTION = 0.1  # or this fraction of the last round's time when longer,
GATHER_MAX_S = 1.0  # but never longer than this
GATHER_OPEN_S = 0.25  # an idle hub's first episodes wait at most this long for others opening,
GATHER_OPEN_GAP_S = 0.05  # until this long passes with none

_ENGINE_LOCKS = weakref.WeakKeyDictionary()  # persuadee -> the lock a round holds (one hub)


def engine_lock(player):
    """The one lock of a persuadee (an engine or a served model): two hubs on one engine (envs
    built with different settings) never step it at once."""
    try:
        return _ENGINE_LOCKS.setdefault(player, threading.RLock())
    except TypeError:  # not weak-referenceable: a lock of its own
        return threading.RLock()


class Ticket:
    """One session's episode in a hub: its instance and seed, the messages it was sent (None:
    stop) and the events the loop posts to it: ("started", snapshot), ("speak", snapshot) when the
    episode waits for the next message, ("end", the judged rollout.Episode), ("error", exception)."""

    def __init__(self, inst, seed, need, b0=None):
        self.inst, self.seed, self.need, self.b0 = inst, seed, need, b0
        self.mailbox, self.events = deque(), queue.Queue()
        self.episode, self.index, self.ended = None, None, False


def snapshot(e):
    """What a session reads of its episode after b_0 or a reply: turn, decision, beliefs, the
    last read-out's probe values and masses, the reply's text."""
    last = e.transcript[-1] if e.transcript else None
    replied = last is not None and last["role"] == "persuadee"
    return dict(text=last["text"] if replied else None,
                decision=last["decision"] if replied else None, beliefs=list(e.beliefs),
                probes=e.probes[-1], probe_mass=e.probe_mass[-1])


class OutsideSide(scheduling.NoModelSide):
    """The persuader of every session (rollout.py's side interface): no prompt, no pool; an
    episode is ready once its session's message is in the mailbox; hearing a reply tells the
    session that the episode waits for the next message."""

    def __init__(self, loop):
        self.loop, self.tickets = loop, {}

    def ready(self, sids):
        return [s for s in sids if s in self.tickets and self.tickets[s].mailbox]

    def speak(self, sids, keys):
        said = []
        for s in sids:
            text, prepared = self.tickets[s].mailbox.popleft()
            if prepared is not None:  # built in the session's thread (Hub.prepare): heard as is
                sid = self.tickets[s].episode.persuadee_sid
                self.loop.hub.persuadee_side.prepared[sid] = prepared
            said.append(arena.Message(text or "", rollout.STOPPED if text is None else "stop"))
        return said

    def reply(self, sids, keys, timings=None):
        raise TypeError("sessions.py: the sessions play the persuader; a persuadee replies")

    def hear(self, sid, text, final_turn=False, shown=None):
        ticket = self.tickets[sid]
        ticket.events.put(("speak", snapshot(ticket.episode)))
        return [], None

    def free(self, sid):
        self.tickets.pop(sid, None)


class OutsidePersuadee(scheduling.NoModelSide):
    """The persuadee of every session when the sessions play that role (Hub(outside="persuadee")):
    no prompt, no pool; an episode is ready once its session's answer is in the mailbox, a dict
    (text, decision: one of arena.OUTCOMES or None, probes: one value per probe), whose values
    stand where a model's read-out would (probe_mass 1: the whole answer is on the yes/no
    scale); hearing the persuader's message tells the session that the episode waits for it."""
    FIRST = (None, None)  # b_0 is the ticket's, set by SessionLoop.started

    def __init__(self, loop):
        self.loop, self.tickets = loop, {}

    def ready(self, sids):
        return [s for s in sids if s in self.tickets and self.tickets[s].mailbox
                and self.tickets[s].mailbox[0][0] is not None]  # (answer, None) items

    def speak(self, sids, keys):
        raise TypeError("sessions.py: the sessions play the persuadee; a persuader speaks")

    def reply(self, sids, keys, timings=None):
        replies = []
        for s in sids:
            answer, _ = self.tickets[s].mailbox.popleft()
            replies.append(arena.Reply(answer["text"], answer["decision"], "stop",
                                       list(answer["probes"]), [1.0] * len(answer["probes"])))
        return replies

    def hear(self, sid, text, final_turn=False, shown=None):
        self.tickets[sid].events.put(("hear", dict(text=text, final_turn=final_turn)))
        return [], None

    def free(self, sid):
        self.tickets.pop(sid, None)


class SharedPrompts:
    """A local persuadee's side (rollout.EngineSide) whose episodes of one instance admitted
    in the same round share one prefill and one b_0 read, as a rollout group's members do: the
    second one's prefill is the first one's root, and start forks every member from it. A
    session is a group of one, so without this each of a trainer's G sessions of an instance
    prefilled the whole prompt, most of an episode's compute on a CPU. Nothing outlives the
    round: the root is freed once its members are forked."""

    def __init__(self, side):
        self.side, self.roots = side, {}
        self.prepared = {}  # persuadee sid -> (final_turn, ids) of the message it hears next

    def hear(self, sid, text, final_turn=False, shown=None):
        """The message's ids as its session built them (Hub.prepare), else built here."""
        done, ids = self.prepared.pop(sid, (None, None))
        if ids is None or done != final_turn:
            return self.side.hear(sid, text, final_turn, shown)
        self.eng.append(sid, ids)
        return [], None

    def __getattr__(self, name):
        return getattr(self.side, name)

    def prefill(self, instance):
        if instance["id"] not in self.roots:
            self.roots[instance["id"]] = self.side.prefill(instance)
        return self.roots[instance["id"]]

    def start(self, roots, counts):
        self.roots.clear()
        unique = list(dict.fromkeys(roots))
        totals = [sum(n for r, n in zip(roots, counts) if r == u) for u in unique]
        forked, reads = self.side.start(unique, totals)
        members = {u: iter(sids) for u, sids in zip(unique, forked)}
        read = dict(zip(unique, reads))
        return [[next(members[r]) for _ in range(n)] for r, n in zip(roots, counts)], \
            [read[r] for r in roots]


class SessionLoop(rollout.EpisodeLoop):
    """rollout.EpisodeLoop over the sessions of a hub, played by rollout.rollout_episodes: episodes
    join as sessions open them (one "instance" entry each, group size 1, its own seed), the loop
    waits for messages instead of stalling when every episode waits on its session, ended
    episodes are judged a round at a time and handed back, and every round holds the
    persuadee's engine lock."""

    def __init__(self, hub):
        self.hub = hub
        if hub.outside == "persuader":
            self.outside, self.sid_key = OutsideSide(self), "persuader_sid"
            self.phase = rollout.Status.SPEAK  # what an episode waiting on its session is in
            self.persuader, self.persuadee = self.outside, hub.persuadee_side
        else:  # the model persuades (hub.persuader_side); the sessions answer
            self.outside, self.sid_key = OutsidePersuadee(self), "persuadee_sid"
            self.phase = rollout.Status.REPLY
            self.persuader, self.persuadee = hub.persuader_side, self.outside
        super().__init__(self.persuader, self.persuadee, {}, hub.t_max, None, 1, None, None, None)
        self.judged = []  # (ticket, record) ended this round, judged at the next hand_back
        self.round_s = 0.0  # how long the last round took (gather's wait scales with it)

    def run(self):
        """Rounds while the hub has work (more), played by the one episode loop on this one:
        before each, new episodes join (round); each holds the engine lock; after each, the
        ended ones are judged and handed back (after_round)."""
        rollout.rollout_episodes(self.persuader, self.persuadee, [], self.hub.t_max, loop=self)

    @contextlib.contextmanager
    def round(self):
        """New episodes joined and the messages gathered, then the round under the engine lock,
        the sessions that left stopped first."""
        idle = not self.scheduler.running
        if self.take_inbox() and idle:
            self.gather_openings()
        self.gather()
        start = time.monotonic()
        with self.hub.lock:
            self.stop_left()
            yield
        self.round_s = time.monotonic() - start

    def after_round(self, moved):
        """No episode moved: wait for the sessions (stuck); then hand back what ended."""
        if not moved and self.scheduler.running:
            self.stuck()
        self.hand_back()

    def episodes(self):
        return []  # each went back to its session as it ended (hand_back)

    def gather(self):
        """Before a round, wait while some episodes' messages have arrived and others' have not
        (GATHER_S, or GATHER_FRACTION of the last round's time, at most GATHER_MAX_S): sessions
        answered in one round then speak in the next together. Without it the first message back
        starts a round alone and the sessions split into cohorts that alternate, each a fraction
        of the batch. No wait when none has arrived (stuck waits) or all have."""
        wait = min(GATHER_MAX_S, max(GATHER_S, GATHER_FRACTION * self.round_s))
        deadline = time.monotonic() + wait
        with self.hub.wake:
            while (left := deadline - time.monotonic()) > 0:
                waiting = [getattr(e, self.sid_key) for e in self.scheduler.running
                           if e.status is self.phase]
                arrived = len(self.outside.ready(waiting))
                if arrived in (0, len(waiting)):
                    return
                self.hub.wake.wait(left)

    def gather_openings(self):
        """On an idle hub (a trainer's step starting), the first episodes wait for those opened
        at the same moment, until GATHER_OPEN_GAP_S passes with none new (at most GATHER_OPEN_S),
        so that a group's sessions are admitted in one round and share their prompt's prefill."""
        deadline = time.monotonic() + GATHER_OPEN_S
        with self.hub.wake:
            while (left := min(GATHER_OPEN_GAP_S, deadline - time.monotonic())) > 0:
                if not self.hub.wake.wait_for(lambda: self.hub.inbox, left):
                    break
                self.take_inbox(locked=True)

    def seed_of(self, index):
        return self.hub.tickets[index].seed

    def more(self):
        """Whether the loop goes on: work in play, or a new episode within HUB_IDLE_S."""
        with self.hub.wake:
            if not (self.scheduler.running or self.scheduler.waiting or self.hub.inbox):
                self.hub.wake.wait(HUB_IDLE_S)
            if not (self.scheduler.running or self.scheduler.waiting or self.hub.inbox):
                self.hub.thread = None  # the next open starts a new one
                return False
        return True

    def stuck(self):
        """No episode moved: wait for a session's message when any episode waits on one; else
        (the pool cannot take a reply, which admission prevents) the youngest ends "cache"."""
        if any(e.status is self.phase for e in self.scheduler.running):
            with self.hub.wake:
                if not self.hub.inbox and not self.outside.ready(
                        [getattr(e, self.sid_key) for e in self.scheduler.running]):
                    self.hub.wake.wait(POLL_S)
            return
        self.finish(self.scheduler.running[-1], "cache")

    def take_inbox(self, locked=False):
        """New episodes join the queue; a stopped one waiting to start is dropped. Whether any
        joined. locked: the caller holds hub.wake."""
        if not locked:
            with self.hub.wake:
                return self.take_inbox(locked=True)
        arrived, self.hub.inbox = self.hub.inbox, []
        joined = False
        for ticket in arrived:
            if ticket.mailbox and ticket.mailbox[-1][0] is None and ticket.episode is None:
                self.scheduler.waiting = deque(w for w in self.scheduler.waiting
                                               if w[0] != ticket.index)
                self.hub.tickets.pop(ticket.index, None)
                self.hub.release(ticket)
                ticket.events.put(("end", None))
                continue
            if ticket.index is None:
                ticket.index = self.hub.next_index
                self.hub.next_index += 1
                self.hub.tickets[ticket.index] = ticket
                self.instances[ticket.index] = ticket.inst
                self.scheduler.waiting.append((ticket.index, [0]))
                joined = True
        return joined

    def started(self, groups, persuader_sids, persuadee_sids, reads):
        super().started(groups, persuader_sids, persuadee_sids, reads)
        started = {index for index, _, _ in groups}
        for e in self.scheduler.running:
            if e.index in started and self.hub.tickets[e.index].episode is None:
                ticket = self.hub.tickets[e.index]
                ticket.episode = e
                self.outside.tickets[getattr(e, self.sid_key)] = ticket
                if ticket.b0 is not None:  # a person's own b_0 (OutsidePersuadee)
                    e.probes[0], e.probe_mass[0] = list(ticket.b0), [1.0] * len(ticket.b0)
                    e.beliefs[0] = probes.belief(ticket.b0)
                ticket.events.put(("started", snapshot(e)))

    def stop_left(self):
        """Sessions playing the persuadee that left (a None in the mailbox: reset, close, a
        dropped client) end their episodes "stopped" at once, their blocks freed; the last
        persuader message, which no reply answers, stays out of the loss (cut_off)."""
        if self.phase is not rollout.Status.REPLY:
            return  # a persuader's stop is its own message (OutsideSide.speak)
        for e in list(self.scheduler.running):
            ticket = self.outside.tickets.get(getattr(e, self.sid_key))
            if ticket is not None and ticket.mailbox and ticket.mailbox[0][0] is None:
                ticket.mailbox.popleft()
                if e.status is rollout.Status.REPLY:
                    self.cut_off(e, rollout.STOPPED)
                else:
                    self.finish(e, rollout.STOPPED)

    def ended(self, e):
        ticket = self.hub.tickets[e.index]
        ticket.ended = True
        self.scheduler.done.pop((e.index, e.g), None)
        self.instances.pop(e.index, None)
        self.judged.append((ticket, e))

    def hand_back(self):
        """Judge the episodes that ended (one judge call per seed), then hand each its record."""
        done, self.judged = self.judged, []
        by_seed = {}
        for ticket, rec in done:
            by_seed.setdefault(ticket.seed, []).append((ticket, rec))
        for seed, items in by_seed.items():
            spoken = [(t, e) for t, e in items if e.transcript]
            with self.hub.lock:
                scores, failed = rollout.judge_all(self.hub.judge, [t.inst for t, _ in spoken],
                                                   [e.transcript for _, e in spoken], seed,
                                                   [0] * len(spoken))
            for (_, e), s, f in zip(spoken, scores, failed):
                e.judge, e.judge_failed = s, f
            for ticket, e in items:
                if e.judge is None:
                    e.judge, e.judge_failed = 0.0, False
                self.hub.tickets.pop(ticket.index, None)
                self.hub.release(ticket)
                ticket.events.put(("end", e))

    def fail(self, error):
        """The loop raised: every episode in play frees its sequences and hears of the error."""
        for e in list(self.scheduler.running):
            try:
                self.scheduler.release(e)
            except Exception:
                pass
        for ticket in list(self.hub.tickets.values()) + self.hub.inbox:
            self.hub.release(ticket)
            ticket.events.put(("error", error))
        self.hub.tickets.clear()
        self.hub.inbox.clear()


class Hub:
    """Episodes of many sessions on one persuadee (module docstring). persuadee and judge as
    PersuasionEnv takes them once built (an engine.Engine, a served.ServedModel, a side);
    max_sessions caps the episodes in play; admit_wait_s bounds a session's wait for room.
    outside: the role the sessions play, "persuader" (the default) or "persuadee", where the
    model `persuadee` plays the persuader instead (persuader_side), sampled with `sampling`."""

    def __init__(self, persuadee, judge=None, *, t_max, max_new_tokens, sampling=None,
                 probe_space=None, probe_signs=None, max_sessions=MAX_SESSIONS,
                 admit_wait_s=ADMIT_WAIT_S, message_tokens=MAX_MESSAGE_TOKENS,
                 outside="persuader"):
        if outside not in ("persuader", "persuadee"):
            raise ValueError(f"sessions.py: outside is 'persuader' or 'persuadee', got {outside!r}")
        self.persuadee, self.judge, self.t_max, self.outside = persuadee, judge, t_max, outside
        self.max_new_tokens, self.max_sessions, self.admit_wait_s = (max_new_tokens, max_sessions,
                                                                    admit_wait_s)
        self.message_tokens = message_tokens
        role = "persuadee" if outside == "persuader" else "persuader"
        model_side = rollout.side(persuadee, role, sampling or
                                  rollout.SAMPLING["paper"][role == "persuadee"],
                                  max_new_tokens, probe_space, probe_signs)
        if model_side.eng is not None:  # a local engine: episodes admitted together share a prefill
            model_side = SharedPrompts(model_side)
        self.persuadee_side = model_side if role == "persuadee" else None
        self.persuader_side = model_side if role == "persuader" else None
        self.lock = engine_lock(persuadee)
        self.eng = model_side.eng
        self.wake = threading.Condition()
        self.inbox, self.tickets, self.next_index = [], {}, 0
        self.reserved, self.open_count, self.thread, self.loop = 0, 0, None, None
        self.needs = {}  # instance id -> need()

    def need(self, inst):
        """The KV blocks one episode of inst (and its judging, when the persuadee judges) can
        take at most; 0 for a served persuadee."""
        if self.eng is None:
            return 0
        if inst["id"] not in self.needs:  # once an instance: its prompts are tokenized for it
            need = pools.episode_blocks(self.eng, [inst], self.t_max, self.max_new_tokens)
            if self.judge is self.persuadee:
                need = max(need, pools.judge_blocks(self.eng, [inst], self.t_max,
                                                    self.max_new_tokens))
            self.needs[inst["id"]] = need
        return self.needs[inst["id"]]

    def capacity(self):
        return self.eng.cache.num_blocks if self.eng is not None else 0

    def open(self, inst, seed, b0=None):
        """A new episode of inst keyed by seed, once admitted (module docstring): its Ticket.
        Refused in one line when it can never fit, or does not within admit_wait_s. b0: the
        probe values of a person playing the persuadee, before the first message."""
        need = self.need(inst)
        if need > self.capacity() and self.eng is not None:
            return self._never_fits(inst, seed, need, b0)
        with self.wake:
            fits = lambda: (self.open_count < self.max_sessions
                            and self.reserved + need <= max(self.capacity(), need))
            if not self.wake.wait_for(fits, self.admit_wait_s):
                raise RuntimeError(
                    f"sessions.py: the persuadee is full ({self.open_count} episodes in play, "
                    f"{self.reserved} of {self.capacity()} KV blocks reserved; one of "
                    f"{inst['id']} needs {need}) and none ended within {self.admit_wait_s:g} s; "
                    "try again later, or serve with more --kv-blocks")
            ticket = Ticket(inst, seed, need, b0)
            self.reserved += need
            self.open_count += 1
            self.inbox.append(ticket)
            self._ensure_thread()
            self.wake.notify_all()
        return ticket

    def _never_fits(self, inst, seed, need, b0=None):
        """An episode whose worst case exceeds the whole pool is still played (the loop ends it
        "cache" if it must, as rollout.py would): admitted alone."""
        with self.wake:
            if not self.wake.wait_for(lambda: self.open_count == 0, self.admit_wait_s):
                raise RuntimeError(f"sessions.py: an episode of {inst['id']} needs the whole "
                                   f"pool ({need} KV blocks of {self.capacity()}) and other "
                                   "episodes kept it; try again later")
            ticket = Ticket(inst, seed, self.capacity(), b0)
            self.reserved += ticket.need
            self.open_count += 1
            self.inbox.append(ticket)
            self._ensure_thread()
            self.wake.notify_all()
        return ticket

    def _ensure_thread(self):
        if self.thread is None or not self.thread.is_alive():
            self.loop = SessionLoop(self)
            self.thread = threading.Thread(target=self._run, args=(self.loop,), daemon=True,
                                           name="persuarena-sessions")
            self.thread.start()

    def _run(self, loop):
        try:
            loop.run()
        except BaseException as e:  # every waiting session hears of it
            with self.wake:
                loop.fail(e)
                self.thread = None
                self.wake.notify_all()

    def release(self, ticket):
        """A ticket's reservation back (once)."""
        with self.wake:
            if ticket.need is not None:
                self.reserved -= ticket.need
                self.open_count -= 1
                ticket.need = None
                self.wake.notify_all()

    def prepare(self, ticket, text):
        """What the loop needs of a session's message, built in the session's own thread: for a
        local persuadee the ids it hears (rollout.persuadee_heard: tags stripped, its turn's
        markers, the final-turn instruction), refused in one line past message_tokens; None for
        a served one (its server tokenizes)."""
        if self.eng is None or ticket.episode is None:
            return None
        final_turn = ticket.episode.dialogue.final_turn
        # counted first, so a message refused anyway costs no text work; as a batch of one,
        # which the fast tokenizer encodes without holding the GIL the loop's thread needs
        raw = self.eng.tokenizer([text], add_special_tokens=False)["input_ids"][0]
        for n in (len(raw), None):
            if n is None:
                n = len(ids := rollout.persuadee_heard(self.eng.tokenizer, text, final_turn))
            if n > self.message_tokens:
                time.sleep(REFUSED_WAIT_S)  # on the sender's clock, not the others' CPU
                raise ValueError(f"sessions.py: a persuader message of {n} tokens as the "
                                 f"persuadee hears it; at most {self.message_tokens} "
                                 "(sessions.MAX_MESSAGE_TOKENS): send a shorter message; the "
                                 "episode goes on")
        return final_turn, ids

    def say(self, ticket, text, prepared=None):
        """The session's next message (None: stop the episode), with what prepare built of it."""
        with self.wake:
            ticket.mailbox.append((text, prepared))
            if ticket.episode is None and text is None:
                self.inbox.append(ticket)
            self.wake.notify_all()

    def alive(self):
        return self.thread is not None and self.thread.is_alive()
