"""
Scheduling rollout's episodes onto the sides' capacity (rollout.py's docstring, Scheduling):
which episodes wait and which run. Groups are admitted in order while every side has room for
their prompts plus one message each; when no episode can move, the youngest is freed and queued
to be replayed from the start (its random streams are keyed, so the replay is the same episode).

ADMISSION "continuous" refills the pools as episodes end; "waves" admits only into empty pools
(BENCHMARKS.md compares the two).

Tests: python -m pytest -q tests/test_rollout.py
"""
from collections import deque

ADMISSION = "continuous"  # or "waves": admit only into empty pools (BENCHMARKS.md compares the two)


class Scheduler:
    """Which episodes wait and which run, over the sides' capacity (module docstring): waiting
    holds (instance index, group members) in order, running the episodes in play, done the
    finished ones by (index, member)."""

    def __init__(self, sides, n_instances, group_size, max_active=None):
        self.sides, self.max_active = sides, max_active
        self.waiting = deque((i, list(range(group_size))) for i in range(n_instances))
        self.running, self.done = [], {}
        self.held = -1  # len(done) at the last preemption: no admission until an episode ends

    def refill(self, fits, open_group, never_started, start):
        """Admit groups from the head of the queue while fits(index, n) holds, each prefilled by
        open_group as it is admitted (so the next check sees the room it took), then start them
        all at once. A group too big for empty pools goes one episode at a time; an episode
        that cannot fit them alone goes to never_started."""
        if len(self.done) <= self.held and self.running:
            return
        if ADMISSION == "waves" and self.running:
            return
        started = []  # (index, members, roots)
        while self.waiting:
            admitted = len(self.running) + sum(len(members) for _, members, _ in started)
            allowed = (len(self.waiting[0][1]) if self.max_active is None
                       else self.max_active - admitted)
            if allowed <= 0:
                break
            if allowed < len(self.waiting[0][1]):
                self.split_head(allowed)
            index, members = self.waiting[0]
            if not fits(index, len(members)):
                if self.running or started:
                    break
                if len(members) > 1:
                    self.split_head(1)
                    continue
                self.waiting.popleft()
                never_started(index, members[0])
                continue
            self.waiting.popleft()
            started.append((index, members, open_group(index)))
        if started:
            start(started)

    def split_head(self, n):
        """The queue's first group, as its first n members and the rest."""
        index, members = self.waiting.popleft()
        self.waiting.extendleft([(index, members[n:]), (index, members[:n])])

    def release(self, e):
        for s, key in zip(self.sides, ("persuader_sid", "persuadee_sid")):
            s.free(e[key])

    def finish(self, e, reason=None):
        if reason:
            e["state"].end(reason)
        self.release(e)
        self.done[e["index"], e["g"]] = e
        self.running.remove(e)

    def stall(self):
        """No episode could move: one alone cannot fit and ends "cache"; else the youngest is
        freed and queued to be replayed from the start, once another episode has ended (else it
        would be admitted straight back into the same stall)."""
        if len(self.running) == 1:
            return self.finish(self.running[0], "cache")
        e = self.running.pop()
        self.release(e)
        self.waiting.appendleft((e["index"], [e["g"]]))
        self.held = len(self.done)
