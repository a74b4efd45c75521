"""
Scenario validation: every line of a scenario file checked against arena's schema before anything
uses it, so that a typo in a hand-written scenario is a one-line error naming the file, line and
field, with the fix (DECISIONS.md, The scenario set). arena.load_scenarios calls read_scenarios with its
vocabulary (splits, domains, pronouns, resistance types, trust levels, the age range).

Training scenarios may omit TRAIN_OPTIONAL fields (the paper's B.2); held-out ones keep every field.
Standard library only, besides lab/hardening.py's text check.

Tests: python -m pytest -q tests/test_scenarios.py tests/test_arena.py
"""

import difflib
import json
import os
import stat
import unicodedata

from lab import hardening

def _kind(value):
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)

def _short(value):
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."

# A rule returns None, or (what is wrong, how to fix it).
def _text(value):
    if not isinstance(value, str):
        return f"is {_kind(value)}, not a string", "write it as a JSON string"
    if bad := hardening.invalid_text(value):
        return f"holds {bad}", "write it as valid Unicode text"
    if not value.strip():
        return "is an empty string", "write the text, or remove the field where it is optional"

def _one_of(choices):
    def rule(value):
        if not isinstance(value, str) or value not in choices:
            return f"is {_short(value)}, not one of {', '.join(choices)}", "use one of those exact strings"
    return rule

def _age(low, high):
    def rule(value):
        if type(value) is not int:
            return f"is {_kind(value)} {_short(value)}, not an integer", "write the age as a whole number, e.g. 42"
        if not low <= value <= high:
            return f"is {value}, outside {low}-{high}", "personas are adults: use an age in that range"
    return rule

def _concerns(value):
    if not isinstance(value, list) or not 1 <= len(value) <= 3 or any(_text(c) for c in value):
        return (f"must be a list of 1-3 non-empty strings, got {_short(value)}",
                'write e.g. ["the cost", "the side effects"], most important first')

def _values(value):
    if isinstance(value, list) and value and not any(_text(v) for v in value):
        return None
    if _text(value):
        return (f"must be a non-empty string or a list of non-empty strings, got {_short(value)}",
                'write e.g. "honesty; independence" or ["honesty", "independence"]')

def schema(vocabulary):
    """The rule of every field; vocabulary (arena's) names the choices of each enumerated field
    and the age range."""
    v = vocabulary
    return {
        "id": _text, "split": _one_of(v["split"]), "domain": _one_of(v["domain"]), "title": _text,
        "persuader": {"role": _text, "goal": _text, "request": _text},
        "persuadee": {"name": _text, "age": _age(*v["age"]), "occupation": _text, "background": _text,
                      "pronouns": _one_of(v["pronouns"])},
        "context": _text,
        "hidden": {"resistance": _one_of(v["resistance"]), "motivation": _text, "concerns": _concerns,
                   "values": _values, "trust": _one_of(v["trust"]), "relationship": _text,
                   "secret": _text, "condition": _text},
    }
MAX_FILE_BYTES = 64 * 2**20  # the largest scenario file read (the project's 200 scenarios: ~0.5 MB)
OPTIONAL = {"persuadee.pronouns"}                                       # in every split
TRAIN_OPTIONAL = {"hidden.resistance", "hidden.motivation", "hidden.relationship",
                  "hidden.secret"}  # training may omit these (the paper's B.2); held-out keeps every field

def _validate(obj, schema, prefix, optional, where):
    if not isinstance(obj, dict):
        field = prefix.rstrip(".") or "(whole line)"
        raise ValueError(f"{where}: field '{field}' is {_kind(obj)}, not an object; write it as a JSON object {{...}}")
    for key in obj:
        if key not in schema:
            near = difflib.get_close_matches(key, schema, n=1)
            fix = f"did you mean '{near[0]}'?" if near else f"the known fields here are {', '.join(schema)}"
            raise ValueError(f"{where}: field '{prefix}{key}' is not part of the schema; remove it ({fix})")
    for key, rule in schema.items():
        field = prefix + key
        if key not in obj:
            if field in optional:
                continue
            raise ValueError(f"{where}: field '{field}' is missing; add it (DECISIONS.md, The scenario set, says what it holds)")
        if isinstance(rule, dict):
            _validate(obj[key], rule, field + ".", optional, where)
        elif problem := rule(obj[key]):
            raise ValueError(f"{where}: field '{field}' {problem[0]}; {problem[1]}")

def _read_json(line):
    """The parsed line and the first key written twice in one of its objects (json keeps the last
    one silently, which would hide a typo)."""
    repeated = []
    def pairs_to_dict(pairs):
        keys = [k for k, _ in pairs]
        repeated.extend(k for i, k in enumerate(keys) if k in keys[:i])
        return dict(pairs)
    return json.loads(line, object_pairs_hook=pairs_to_dict), repeated[0] if repeated else None

def _scenario_id(value, where):
    """The id NFC-normalised and stripped, so that ids differing only there are one id; an id
    holding a control, format or line-separator character is refused."""
    value = unicodedata.normalize("NFC", value).strip()
    bad = next((c for c in value if unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp")), None)
    if bad is not None:
        raise ValueError(f"{where}: field 'id' holds the control character U+{ord(bad):04X}; "
                         "write ids in letters, digits and punctuation")
    return value

def read_bounded(path, most=MAX_FILE_BYTES):
    """A file's bytes, refused in one line (ValueError) when it is no regular file (a FIFO would
    hang the read, /dev/zero fill memory) or holds more than `most` bytes."""
    with open(path, "rb", opener=lambda p, flags: os.open(p, flags | os.O_NONBLOCK)) as f:
        kind = os.fstat(f.fileno()).st_mode
        if not stat.S_ISREG(kind):
            raise ValueError(f"{path} is not a regular file (a directory, FIFO or device); pass a "
                             "scenarios.jsonl file")
        data = f.read(most + 1)
    if len(data) > most:
        raise ValueError(f"{path} holds more than {most // 2**20} MiB "
                         "(scenario_check.MAX_FILE_BYTES); pass a scenarios.jsonl file")
    return data


def read_scenarios(path, vocabulary):
    """Every scenario of a JSONL file, each line checked against schema(vocabulary): the first
    problem raises a one-line ValueError naming the file, line and field, and the fix."""
    rules = schema(vocabulary)
    lines = read_bounded(path).split(b"\n")
    scenarios, first_line = [], {}
    for lineno, raw in enumerate(lines, 1):
        where = f"{path}, line {lineno}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{where}: field '(whole line)' is not valid UTF-8 (byte {e.start + 1}); "
                             "save the file as UTF-8") from None
        if not line.strip():
            continue  # blank lines separate groups of scenarios
        try:
            obj, repeated = _read_json(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: field '(whole line)' is invalid JSON ({e.msg}, column {e.colno}); "
                             "write each scenario as one complete JSON object on one line") from None
        except (ValueError, RecursionError) as e:  # a number too long to convert, nesting too deep
            raise ValueError(f"{where}: field '(whole line)' cannot be read ({type(e).__name__}); "
                             "write each scenario as one plain JSON object on one line") from None
        if repeated is not None:
            raise ValueError(f"{where}: field '{repeated}' is written twice in one object; keep one of them")
        optional = OPTIONAL | (TRAIN_OPTIONAL if isinstance(obj, dict) and obj.get("split") == "train" else set())
        _validate(obj, rules, "", optional, where)
        obj["id"] = _scenario_id(obj["id"], where)
        if obj["id"] in first_line:
            raise ValueError(f"{where}: field 'id' repeats {obj['id']!r} from line {first_line[obj['id']]}; "
                             "give every scenario its own id")
        first_line[obj["id"]] = lineno
        scenarios.append(obj)
    return scenarios
