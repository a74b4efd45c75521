"""
records.py: reading episode records back from disk, checked (no torch at import; the probe names
are read from probes.PROBES when asked, and rollout.Episode, the record itself, when loading).

What a record holds, and what each field means, is rollout.Episode's (its described fields;
rollout.RECORD_FIELDS). EPISODE_FIELDS is what the analyses read of a record and what
each must be; load_episodes refuses a record that breaks it, naming the file, line and field;
RUN_FIELDS is the same for a training run's metrics.jsonl, evals.jsonl and rollouts.jsonl. A
JSONL file is read by jsonl.read_jsonl: a bad last line (a killed writer) is dropped with a
warning, an earlier one refused.

Tests: python -m pytest -q tests/test_records.py
"""
import json
import math
from pathlib import Path

from persuarena import arena
from lab.jsonl import read_jsonl


def probe_names():
    """The column order of an episode's "probes" rows: the names in probes.PROBES, read when
    called (probes, and torch with it, loads then, not when this module is imported)."""
    from persuarena import probes
    return tuple(probes.PROBES)


def probe_title(name):
    """A probe's figure title (probes.PROBES)."""
    from persuarena import probes
    return probes.PROBES[name]["title"]


def _number_or_none(v):
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))


def _label_rows(v):
    return isinstance(v, list) and all(isinstance(r, list) and all(isinstance(x, str) for x in r) for r in v)


MAX_TURNS = 1000  # an episode's turns at most (a run's --t-max is a handful; 10**18 is no episode)
EPISODE_FIELDS = {  # what the analyses read of an episode record, and what it must be
    "id": ("a string", lambda v: isinstance(v, str)),
    "scenario_id": ("a string", lambda v: isinstance(v, str)),
    "outcome": (lambda: "one of " + ", ".join(arena.OUTCOMES), lambda v: v in arena.OUTCOMES),
    "turns": (f"a whole number in 0..{MAX_TURNS}",
              lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_TURNS),
    "beliefs": ("a list of numbers (null where unread)", lambda v: isinstance(v, list) and all(map(_number_or_none, v))),
    "probes": ("a list of rows, one value per probe of probes.PROBES (null where unread)",
               lambda v: isinstance(v, list) and all(r is None or (isinstance(r, list) and len(r) == len(probe_names())
                                                                    and all(map(_number_or_none, r))) for r in v)),
    "transcript": ("a list of {role, text} messages",
                   lambda v: isinstance(v, list) and all(isinstance(m, dict) and isinstance(m.get("text"), str)
                                                         and m.get("role") in ("persuader", "persuadee") for m in v)),
    "judge": ("a number or null", _number_or_none),
    "judge_failed": ("true, false or null (not judged)", lambda v: v is None or isinstance(v, bool)),
    "probe_mass": ("a list of rows, one number per probe (null where unread)",
                   lambda v: isinstance(v, list) and all(r is None or (isinstance(r, list) and len(r) == len(probe_names())
                                                                        and all(map(_number_or_none, r))) for r in v)),
    "moves": ("a list of label lists, one per persuader turn", lambda v: _label_rows(v)),
    "manipulation": ("a list of label lists, one per persuader turn", lambda v: _label_rows(v)),
}
VALUE_RANGES = {  # where a record's numbers lie; a record with one outside (or NaN, an infinity)
    "beliefs": (-1.0, 1.0), "probes": (-1.0, 1.0),  # is set aside by the analyses (unsound)
    "probe_mass": (0.0, 1.0), "judge": (-2.0, 2.0)}  # s = a mean of 1-5 scores - 3 (lab/judge.py)
OPTIONAL_EPISODE_FIELDS = ("judge", "judge_failed", "probe_mass", "moves", "manipulation")  # checked where present


_STEP = ("a whole number", lambda v: isinstance(v, int) and not isinstance(v, bool))
_NUMBER = ("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool))
RUN_FIELDS = {  # what --runs reads of a training run's files
    "evals.jsonl": {"step": _STEP, "full_accept": _NUMBER},
    "metrics.jsonl": {"step": _STEP},
    "rollouts.jsonl": {"step": _STEP, "group": _STEP, "member": _STEP, "outcome": EPISODE_FIELDS["outcome"],
                       "goal": _NUMBER, "judge": EPISODE_FIELDS["judge"], "beliefs": EPISODE_FIELDS["beliefs"]},
}


def _numbers(value):
    if isinstance(value, list):
        for v in value:
            yield from _numbers(v)
    elif value is not None:
        yield value


def unsound(ep):
    """The fields of an episode (rollout.Episode, checked by EPISODE_FIELDS) holding a NaN, an infinity or
    a number outside its VALUE_RANGES: read as they are, one such value turns a whole run's
    means and correlations into null. A read-out whose belief is None was never read (a
    persuadee that returned no finite log-probs: counted as beliefs_missing), so its probe
    values and mass are not looked at."""
    read = [b is not None for b in ep.beliefs or []]
    def values(field):
        value = getattr(ep, field)
        if field in ("probes", "probe_mass") and isinstance(value, list) and len(value) == len(read):
            value = [v for v, ok in zip(value, read) if ok]
        return _numbers(value)
    return [field for field, (low, high) in VALUE_RANGES.items()
            if any(not (math.isfinite(v) and low <= v <= high) for v in values(field))]


def check_record(row, fields, optional=()):
    """None for a record that has every field of `fields` as it must be (those named in optional
    may be absent), else (field, what it must be, what it is). A description may be a function,
    read when a record breaks it (the outcomes as arena holds them then)."""
    if not isinstance(row, dict):
        return "(whole line)", "a JSON object", type(row).__name__
    for field, (must, ok) in fields.items():
        if field not in row:
            if field in optional:
                continue
            return field, must() if callable(must) else must, "missing"
        if not ok(row[field]):
            return field, must() if callable(must) else must, json.dumps(row[field])[:60]
    return None


def read_records(path, what, fields, optional=()):
    """The rows of a JSONL file, each checked against fields: a bad one is one error naming the
    file, the line and the field."""
    rows = read_jsonl(path, what=what)
    for lineno, row in rows:
        if problem := check_record(row, fields, optional):
            field, must, got = problem
            raise ValueError(f"{path}, line {lineno}: field '{field}' must be {must}, got {got}")
    return [row for _, row in rows]


def load_episodes(dir_or_file):
    """Episodes (rollout.Episode) of a run directory (its episodes.jsonl) or of a .jsonl file; a
    record the analyses cannot read is refused with its file, line and field."""
    from persuarena import rollout
    path = Path(dir_or_file)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist; pass an eval directory such as evals/NAME")
    if path.is_dir():
        path = path / "episodes.jsonl"
    episodes = read_records(path, "an eval directory written by `python eval.py --name NAME`",
                            EPISODE_FIELDS, OPTIONAL_EPISODE_FIELDS)
    if not episodes:
        raise ValueError(f"{path} holds no episodes; rerun the evaluation that wrote it")
    seen = {}
    for number, ep in enumerate(episodes, 1):
        if (first := seen.setdefault(ep["id"], number)) != number:
            raise ValueError(f"{path}: episode {ep['id']!r} is recorded twice (records {first} and "
                             f"{number}); delete one of them (each counts once)")
    return [rollout.Episode.from_record(row) for row in episodes]
