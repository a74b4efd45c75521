"""
jsonl.py: records on disk as JSONL, and the one non-finite-to-null rule.

  - finite(): every non-finite float, at any depth, written as None (JSON has no NaN; a record's
    "no value" is None, NaN lives only inside tensors); is_number(): a finite int or float;
  - json_line(): one record as one line (allow_nan=False: a NaN cannot slip through);
  - read_jsonl(): the one tolerant JSONL reader: a bad last line (a write cut by a kill or a
    full disk) is dropped with a warning, the same in every file; an earlier bad line is an
    error naming the file and line (or, for a file that is only a cache, dropped with a warning).
Rewrites go through runs.write_atomic. The standard library only.
Tests: python -m pytest -q tests/test_jsonl.py
"""
import json
import math
import sys
from pathlib import Path

from lab.runs import write_atomic


def is_number(value):
    """A finite int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def finite(value):
    """value with every non-finite float, at any depth, written as None (JSON has no NaN; a
    record's "no value" is None, NaN lives only inside tensors)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def loads(text):
    """json.loads for a run's files, where a nesting too deep for Python's parser (a
    RecursionError, not a ValueError: a traceback past every caller's except) is a ValueError."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deep to read (a RecursionError)") from None


def json_line(row):
    """One JSONL line of a record (non-finite numbers as null)."""
    return json.dumps(finite(row), allow_nan=False) + "\n"


def read_jsonl(path, skip_bad=False, repair=False, what=None):
    """[(line number, object)] of a JSONL file's non-empty lines. A last line that is not valid
    JSON (a write cut by a kill or a full disk) is dropped with a warning, in every file alike;
    with repair the file is rewritten without it (so that appends start on a fresh line). An
    earlier bad line is a ValueError naming the file and line, or with skip_bad (a file that is
    a cache of what can be redone) dropped with a warning. A missing file is a
    FileNotFoundError saying to pass `what` (what the caller needed) when given."""
    path = Path(path)
    if what is not None and not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; pass {what}")
    text = path.read_text(errors="replace")
    lines = text.split("\n")
    while lines and not lines[-1].strip():
        lines.pop()
    rows = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append((lineno, loads(line)))
        except ValueError as e:  # json.JSONDecodeError, or nested too deep
            e.msg = getattr(e, "msg", str(e))
            if lineno == len(lines):
                print(f"warning: dropping the partial last line {lineno} of {path}", file=sys.stderr)
                if repair:
                    write_atomic(path, "".join(line + "\n" for line in lines[:-1]))
            elif skip_bad:
                print(f"warning: dropping line {lineno} of {path}, not valid JSON", file=sys.stderr)
            else:
                raise ValueError(f"{path}, line {lineno} is not valid JSON ({e.msg}); delete "
                                 "that line") from None
    return rows
