"""
Scheduling rollout's episodes onto the sides' capacity: which episodes wait and which run, so
that any number of episodes completes on any pools that hold one of them:
    admit    groups in order, while every side has room for the group's prompts plus one
             message per episode; each instance's prompts are prefilled once and forked G times
    round    the episodes whose next message fits (its worst case: max_new_tokens, the probe
             forks) run it; the others wait untouched; finished episodes free their blocks and
             the queue refills (continuous admission)
    stall    when no episode can move, the youngest is freed and put back in the queue: its
             random streams are keyed by (seed, instance, group index, side), so its replay is
             the same episode. An episode ends "cache" only when it cannot fit a pool alone.
The scheduler asks the sides (rollout.Side: room, prefill, free) and returns what to start;
the episode loop (rollout.rollout_episodes) starts it. A side with no pool of its own (a person,
the sessions, a script) names the episodes it starts with numbered.

ADMISSION "continuous" refills the pools as episodes end; "waves" admits only into empty pools
(BENCHMARKS.md compares the two).

Tests: python -m pytest -q tests/test_rollout.py
"""
import time
from collections import deque
from contextlib import contextmanager

ADMISSION = "continuous"  # or "waves": admit only into empty pools (BENCHMARKS.md: Admission)
ROLES = ("persuader", "persuadee")  # the sides' order; a side's prefill is timed as ROLE_s


@contextmanager
def clock(timings, key):
    """Add the block's wall time to timings[key] (when timings is a dict)."""
    start = time.perf_counter()
    yield
    if timings is not None:
        timings[key] = timings.get(key, 0.0) + time.perf_counter() - start


def numbered(first: int, counts: list[int]) -> tuple[list[list[int]], int]:
    """Consecutive sequence ids from `first`, one list a count, and the next free id."""
    sids = []
    for n in counts:
        sids.append(list(range(first, first + n)))
        first += n
    return sids, first


class NoModelSide:
    """What every side without a model of its own shares (rollout.Side: the sessions' outside
    players, the audit's scripted persuader): no prompt, no KV pool, nothing to prefill, its
    episodes numbered as they start. FIRST: what start gives each root (a persuadee's b_0 and
    probes where it has them; None here, set elsewhere)."""
    tokenizer = max_len = eng = None
    FIRST = None
    next_sid = 0

    def prompt(self, instance) -> list[int]:
        return []

    def room(self, instance, n: int) -> bool:
        return True

    def prefill(self, instance) -> None:
        return None

    def start(self, roots, counts: list[int]) -> tuple[list[list[int]], list]:
        sids, self.next_sid = numbered(self.next_sid, counts)
        return sids, [self.FIRST] * len(roots)


class Scheduler:
    """Which episodes wait and which run, over the sides' capacity (module docstring): waiting
    holds (instance index, group members) in order, running the episodes in play, done the
    finished ones by (index, member)."""

    def __init__(self, sides, instances, group_size, max_active=None, timings=None):
        self.sides, self.instances, self.max_active = sides, instances, max_active
        self.timings = timings  # each side's prefill is timed under ROLES[i] + "_s"
        self.waiting = deque((i, list(range(group_size))) for i in range(len(instances)))
        self.running, self.done = [], {}
        self.held = -1  # len(done) at the last preemption: no admission until an episode ends

    def fits(self, index, n):
        return all(side.room(self.instances[index], n) for side in self.sides)

    def prefill(self, index):
        """The instance's prompt prefilled once on every side: its roots, one a side."""
        roots = []
        for role, side in zip(ROLES, self.sides):
            with clock(self.timings, f"{role}_s"):
                roots.append(side.prefill(self.instances[index]))
        return tuple(roots)

    def admit(self):
        """What to start now: ([(index, members, roots)], [(index, member)]). Groups are admitted
        from the head of the queue while every side has room for them, each prefilled as it is
        admitted (so the next check sees the room it took); a group too big for empty pools goes
        one episode at a time; an episode that cannot fit them alone is returned second, never
        to start."""
        started, never = [], []  # (index, members, roots); (index, member)
        if len(self.done) <= self.held and self.running or ADMISSION == "waves" and self.running:
            return started, never
        while self.waiting:
            admitted = len(self.running) + sum(len(members) for _, members, _ in started)
            allowed = (len(self.waiting[0][1]) if self.max_active is None
                       else self.max_active - admitted)
            if allowed <= 0:
                break
            if allowed < len(self.waiting[0][1]):
                self.split_head(allowed)
            index, members = self.waiting[0]
            if not self.fits(index, len(members)):
                if self.running or started:
                    break
                if len(members) > 1:
                    self.split_head(1)
                    continue
                self.waiting.popleft()
                never.append((index, members[0]))
                continue
            self.waiting.popleft()
            started.append((index, members, self.prefill(index)))
        return started, never

    def split_head(self, n):
        """The queue's first group, as its first n members and the rest."""
        index, members = self.waiting.popleft()
        self.waiting.extendleft([(index, members[n:]), (index, members[:n])])

    def release(self, e):
        for s, sid in zip(self.sides, (e.persuader_sid, e.persuadee_sid)):
            s.free(sid)

    def finish(self, e, reason=None):
        """e (a rollout.Episode) ends: its dialogue ended with reason, or done already."""
        e.end(reason or None)
        self.release(e)
        self.done[e.index, e.g] = e
        self.running.remove(e)

    def stall(self):
        """No episode could move: one alone cannot fit and ends "cache"; else the youngest is
        freed and queued to be replayed from the start, once another episode has ended (else it
        would be admitted straight back into the same stall)."""
        if len(self.running) == 1:
            return self.finish(self.running[0], "cache")
        e = self.running.pop()
        self.release(e)
        self.waiting.appendleft((e.index, [e.g]))
        self.held = len(self.done)
