"""bench_sessions.py: the table runs in-process on a tiny random persuadee (rows for each count,
every episode played whole) and refuses bad counts in one line; no speed is asserted."""
import pytest

from lab import bench_sessions


def test_the_table_has_a_row_per_count_with_every_episode(capsys, small_engine_memory):
    bench_sessions.main(["--persuadee", "random:tiny-qwen3", "--sessions", "1,3", "--repeats",
                         "1", "--t-max", "1", "--max-new-tokens", "2", "--kv-blocks", "256"])
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and line[2].isdigit()]
    assert [(int(r[0]), int(r[1]), float(r[2])) for r in rows] == [(1, 1, 1.0), (3, 3, 1.0)]
    assert float(rows[0][5].strip().rstrip("x")) == 1.0


def test_rounds_alternate_the_counts_order_and_report_medians(capsys, monkeypatch):
    """--rounds 3: the counts played 1, 3 then 3, 1 then 1, 3, and the medians table gives each
    count's median rate and its ratio to the first count's (checked against rates computed here
    from the walls a stand-in timer returns)."""
    walls = iter([2.0, 1.0, 1.5, 4.0, 1.0, 6.0])  # (count, rate): (1, .5) (3, 3) (3, 2) (1, .25) (1, 1) (3, .5)
    played = []

    def timed(target, count, repeats, instances):
        if not played:  # the warm-up
            played.append("warm-up")
            return 1.0, [1]
        played.append(count)
        return next(walls), [1] * count
    monkeypatch.setattr(bench_sessions, "timed", timed)
    monkeypatch.setattr(bench_sessions, "inprocess_hub", lambda args, loaded: (None, []))
    bench_sessions.main(["--sessions", "1,3", "--repeats", "1", "--rounds", "3"])
    assert played == ["warm-up", 1, 3, 3, 1, 1, 3]
    out = capsys.readouterr().out
    medians = out[out.index("Medians over 3 rounds"):]
    rows = [line.split("|")[1:-1] for line in medians.splitlines() if line.startswith("| ")
            and line[2].isdigit()]
    assert [(int(r[0]), float(r[1]), r[2].strip()) for r in rows] == [(1, 0.5, "1.0x"),
                                                                     (3, 2.0, "4.0x")]


def test_bad_counts_are_refused(capsys):
    with pytest.raises(SystemExit):
        bench_sessions.main(["--sessions", "0"])
    assert "--sessions are positive counts" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_sessions.main(["--rounds", "0"])
    assert "--rounds at least 1" in capsys.readouterr().err
    for argv, says in ((["--sessions", "4,1000000"], "--sessions at most"),
                       (["--attacker", "-1"], "--attacker takes seconds")):
        with pytest.raises(SystemExit):
            bench_sessions.main(argv)
        assert says in capsys.readouterr().err
