"""
An evaluation's episodes.jsonl, resumable: each episode appended (and flushed) as it ends, read
back by --resume so that only the missing ones are played, the settings an evaluation ran with
compared with the resumed one's, and under torchrun each rank's part (episodes.rankR.jsonl)
gathered by rank 0.

    python -m pytest -q tests/test_eval.py -k resume
"""
import json
import sys
import time
from pathlib import Path

from persuarena import rollout
from lab import cli, jsonl, runs


def read_played(path):
    """Episodes already in an episodes.jsonl (rollout.Episode.from_record), by id. A bad last
    line (cut off by a kill) is dropped with a warning and from the file (jsonl.read_jsonl); an id
    written twice is an error."""
    path = Path(path)
    if not path.exists():
        return {}
    played = {}
    for lineno, record in jsonl.read_jsonl(path, repair=True):
        if not isinstance(record, dict) or "id" not in record:
            raise ValueError(f"{path}, line {lineno} is no episode record; delete that line to "
                             "play its episode again")
        if record["id"] in played:
            raise ValueError(f"{path}, line {lineno} repeats episode {record['id']}; delete one of them")
        played[record["id"]] = rollout.Episode.from_record(record)
    return played


def append_record(path, record):
    """One finished episode, flushed to disk before the next ends."""
    runs.append_line(path, jsonl.json_line(record), sync=True)


def part_paths(out_dir):
    """episodes.jsonl, and under torchrun each rank's part of it (merged by rank 0 at the end)."""
    out_dir = Path(out_dir)
    return [out_dir / "episodes.jsonl"] + sorted(out_dir.glob("episodes.rank*.jsonl"))


def progress_line(done, total, record, elapsed_s):
    """One episode's line of an evaluation's progress: its count, id, outcome and turns."""
    return (f"eval.py: episode {done}/{total} {record.id}: {record.outcome} after "
            f"{record.turns} turn(s) ({elapsed_s:.0f} s)")


class RoundProgress:
    """rollout_episodes' progress (updated once a round of turns): a line every EVERY_S seconds
    while no episode ends, so a long evaluation is never silent."""
    EVERY_S = 20.0

    def __init__(self, say, total, start):
        self.say, self.total, self.start, self.n, self.rounds = say, total, start, 0, 0
        self.last = start

    def update(self, ended):
        self.n += ended
        self.rounds += 1
        now = time.perf_counter()
        if now - self.last >= self.EVERY_S:
            self.last = now
            self.say(f"eval.py: turn {self.rounds} played, {self.n}/{self.total} episode(s) "
                     f"ended ({now - self.start:.0f} s)")


def play_resumable(persuader, persuadee, instances, path, *, t_max, judge=None, seed=0,
                   stamp=None, played=None, say=None, **rollout_kw):
    """rollout.rollout_episodes over the instances not yet in `played` (read from path unless
    given), each record appended to path (an episodes.jsonl) as its episode ends, without the
    training stream and with `stamp` (the run's settings) added, and a progress line said
    (`say`, default stderr; rank 0's evaluation); the judge scores them at the end with those
    resumed unscored (judge None). Returns the Episodes of all instances, in order."""
    played = read_played(path) if played is None else played
    stamp = stamp or {}
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))

    def clean(e):  # the record without its training stream, stamped
        return {**e.record(training=False), **stamp}
    todo = [inst for inst in instances if inst["id"] not in played]
    start, done = time.perf_counter(), [len(instances) - len(todo)]

    def on_record(e):
        append_record(path, clean(e))
        done[0] += 1
        say(progress_line(done[0], len(instances), e, time.perf_counter() - start))
    if todo:
        say(f"eval.py: playing {len(todo)} episode(s) at once, up to {t_max} turns each; a line "
            "as each ends")
    rollout_kw.setdefault("progress", RoundProgress(say, len(todo), start))
    for e in rollout.rollout_episodes(persuader, persuadee, todo, t_max, judge=judge, seed=seed,
                                      on_record=on_record, **rollout_kw):
        played[e.id] = rollout.Episode.from_record(clean(e))
    pending = [inst for inst in instances if played[inst["id"]].judge is None]
    if pending and judge is not None:
        say(f"eval.py: the judge scores {len(pending)} transcript(s)")
    if pending:  # killed before the judge scored them
        scores, failed = rollout.judge_all(judge, pending,
                                           [played[i["id"]].transcript for i in pending],
                                           seed, [0] * len(pending))
        for inst, score, fail in zip(pending, scores, failed):
            played[inst["id"]].judge, played[inst["id"]].judge_failed = score, fail
    return [played[inst["id"]] for inst in instances]


def settings_mismatch(out_dir, settings, own=None):
    """The settings (and pinned constants, cli.changed_constants, with the entry point's own
    module `own`) that differ from those out_dir's evaluation was run with, named."""
    path = Path(out_dir) / "settings.json"
    if not path.exists():
        return []
    before = jsonl.loads(path.read_text())
    return cli.changed_constants(before, own) + [
        f"{k} {before.get(k)!r} there, {settings.get(k)!r} now"
        for k in sorted(set(before) | set(settings)) if k != "constants" and before.get(k) != settings.get(k)]


def played_so_far(out_dir, resume, rank, world):
    """The episodes out_dir already holds (every rank's part) when resuming; else none, the
    folder's parts removed by rank 0 before any rank reads them."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if not resume and rank == 0:
        for path in part_paths(out_dir):
            path.unlink(missing_ok=True)
    if world > 1:
        import torch.distributed as dist
        dist.barrier()  # rank 0 has cleared the folder before any rank reads it
    return {} if not resume else {k: v for path in part_paths(out_dir)
                                  for k, v in read_played(path).items()}


def gathered(episodes, instances, world):
    """Every rank's episodes, in the instances' order (under torchrun), else these."""
    if world == 1:
        return episodes
    import torch.distributed as dist
    shards = [None] * world
    dist.all_gather_object(shards, episodes)
    order = {inst["id"]: i for i, inst in enumerate(instances)}
    return sorted((ep for shard in shards for ep in shard), key=lambda ep: order[ep.id])
