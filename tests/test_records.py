"""Tests of records.py: the one episode schema and what reading a record back refuses."""
import json
from dataclasses import replace
import subprocess
import sys

import pytest

from persuarena import probes
from lab import records
from test_analyses import SIX

ROWS = [ep.record() for ep in SIX]  # as episodes.jsonl holds them


def test_importing_records_loads_no_torch():
    code = "from lab import records; import sys; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_probe_names_are_the_probes_own(monkeypatch):
    """The record's columns are read from probes.PROBES when asked: a probe added there is a
    column here, with no second edit."""
    assert records.probe_names() == tuple(probes.PROBES)
    monkeypatch.setitem(probes.PROBES, "XT", dict(question="Q?", sign=1, title="extra (XT)"))
    assert records.probe_names() == ("CA", "PE", "AC", "XT")
    assert records.probe_title("XT") == "extra (XT)"


@pytest.mark.parametrize("field, value", [
    ("probe_mass", "x"), ("probe_mass", [["x", 1, 1]]),
    ("moves", "x"), ("manipulation", 3), ("judge_failed", "yes")])
def test_analyze_refuses_a_malformed_optional_field_in_one_line(tmp_path, field, value):
    path = tmp_path / "episodes.jsonl"
    path.write_text(json.dumps({**ROWS[0], field: value}) + "\n")
    with pytest.raises(ValueError, match=f"line 1: field '{field}' must be"):
        records.load_episodes(path)
    path.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps([ROWS[1]]) + "\n")
    with pytest.raises(ValueError, match="line 2: field '\\(whole line\\)' must be a JSON object"):
        records.load_episodes(path)


def test_a_non_finite_or_out_of_range_number_makes_a_record_unsound():
    """Read as a number, it is set aside by the analyses (analyses.set_aside), not summarised."""
    assert records.unsound(SIX[0]) == []
    bad = replace(SIX[0], probe_mass=[[0.5, 2.0, 0.1]], judge=float("nan"),
                  beliefs=[0.0, 1e308], probes=[[float("-inf"), 0, 0]])
    assert records.unsound(bad) == ["beliefs", "probes", "probe_mass", "judge"]


@pytest.mark.parametrize("field, value, must", [
    ("outcome", "MAYBE", "must be one of ACCEPT"), ("turns", -1, "whole number"),
    ("beliefs", [0.1, "x"], "list of numbers"), ("probes", [[0.1, 0.2]], "one value per probe"),
    ("transcript", [{"role": "judge", "text": "hi"}], "{role, text}"), ("scenario_id", None, "a string"),
])
def test_a_malformed_record_names_file_line_and_field(tmp_path, field, value, must):
    path = tmp_path / "episodes.jsonl"
    bad = dict(ROWS[1], **{field: value})
    path.write_text("".join(json.dumps(ep) + "\n" for ep in [ROWS[0], bad]))
    with pytest.raises(ValueError) as e:
        records.load_episodes(tmp_path)
    message = str(e.value)
    assert message.startswith(f"{path}, line 2: field '{field}' ") and must in message and "\n" not in message
    del bad[field]
    path.write_text(json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match=f"line 1: field '{field}' .* got missing"):
        records.load_episodes(path)


def test_an_episode_is_its_record_and_an_older_file_still_loads(tmp_path):
    """rollout.Episode.record() is what load_episodes reads back, field for field; a record of
    an older version (no judge_failed, a field this one does not name) loads, and writes back
    what it held."""
    from persuarena import rollout
    path = tmp_path / "episodes.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    assert [ep.record() for ep in records.load_episodes(path)] == ROWS
    old = {k: v for k, v in ROWS[0].items() if k != "judge_failed"} | {"fidelity": 0.5}
    path.write_text(json.dumps(old) + "\n")
    [ep] = records.load_episodes(path)
    assert ep.judge_failed is None and ep.extra == {"fidelity": 0.5} and ep.record() == {
        **old, "judge_failed": None}
    assert set(rollout.RECORD_FIELDS) >= set(records.EPISODE_FIELDS)  # every checked field named
