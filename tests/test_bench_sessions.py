"""bench_sessions.py: the table runs in-process on a tiny random persuadee (rows for each count,
every episode played whole) and refuses bad counts in one line; no speed is asserted."""
import pytest

from lab import bench_sessions


def test_the_table_has_a_row_per_count_with_every_episode(capsys):
    bench_sessions.main(["--persuadee", "random:tiny-qwen3", "--sessions", "1,3", "--repeats",
                         "1", "--t-max", "1", "--max-new-tokens", "2", "--kv-blocks", "256"])
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and line[2].isdigit()]
    assert [(int(r[0]), int(r[1]), float(r[2])) for r in rows] == [(1, 1, 1.0), (3, 3, 1.0)]
    assert float(rows[0][5].strip().rstrip("x")) == 1.0


def test_bad_counts_are_refused(capsys):
    with pytest.raises(SystemExit):
        bench_sessions.main(["--sessions", "0"])
    assert "--sessions are positive counts" in capsys.readouterr().err
