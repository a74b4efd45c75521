"""lab/jsonl.py: one JSONL rule for every file (a cut last line dropped with one warning, an
earlier bad line refused naming the file and line)."""
import pytest

from lab import episode_log, steps



def test_the_same_bad_jsonl_line_is_handled_the_same_way_by_train_and_eval(tmp_path, capsys):
    """A bad last line (a write cut by a kill or a full disk) is dropped with the same warning
    in train's metrics.jsonl and eval's episodes.jsonl; a bad earlier line is refused by both,
    naming the file and line."""
    metrics, episodes = tmp_path / "metrics.jsonl", tmp_path / "episodes.jsonl"
    metrics.write_text('{"step": 1}\n{"step": 2, "lo\n')
    episodes.write_text('{"id": "a"}\n{"id": "b", "tr\n')
    steps.resume_metrics(metrics, 5)
    assert list(episode_log.read_played(episodes)) == ["a"]
    warnings = [line.replace(str(tmp_path), "") for line in capsys.readouterr().err.splitlines()]
    assert warnings == ["warning: dropping the partial last line 2 of /metrics.jsonl",
                        "warning: dropping the partial last line 2 of /episodes.jsonl"]
    assert metrics.read_text() == '{"step": 1}\n' and episodes.read_text() == '{"id": "a"}\n'
    metrics.write_text('not json\n{"step": 1}\n')
    episodes.write_text('not json\n{"id": "a"}\n')
    with pytest.raises(SystemExit, match="metrics.jsonl, line 1 is not valid JSON"):
        steps.resume_metrics(metrics, 5)
    with pytest.raises(ValueError, match="episodes.jsonl, line 1 is not valid JSON"):
        episode_log.read_played(episodes)
