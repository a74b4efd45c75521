"""tests/warm.py: a warm process is what `python ...` would be (argv, environment, folder, import
path, stdout and stderr apart, exit codes, atexit), and warm ranks end together when one fails."""
import subprocess
import time

import warm

SHOW = """
import atexit, os, sys
atexit.register(lambda: print("atexit ran", flush=True))
print(sys.argv, os.environ.get("WARM_SET"), os.environ.get("WARM_UNSET"), os.getcwd())
print("tests on path", any(p.rstrip("/").endswith("tests") for p in sys.path))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


def test_a_warm_process_gets_a_fresh_ones_argv_environment_folder_path_and_exit(tmp_path, monkeypatch):
    monkeypatch.setenv("WARM_UNSET", "the worker's")  # not in the env passed: not seen
    env = {"WARM_SET": "given", "PATH": "/usr/bin"}
    p = warm.popen(["-c", SHOW, "3", "x"], env, cwd=tmp_path)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 3 and err == "to stderr\n"
    assert out.splitlines() == [f"['-c', '3', 'x'] given None {tmp_path}", "tests on path False",
                                "atexit ran"]
    (tmp_path / "script.py").write_text(SHOW)
    p = warm.popen(["script.py", "0"], dict(env, PYTHONPATH=str(warm.ROOT / "tests")), cwd=tmp_path,
                   stderr=subprocess.STDOUT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0 and err is None and "to stderr" in out
    assert out.splitlines()[:2] == [f"['script.py', '0'] given None {tmp_path}", "tests on path True"]


def test_an_exit_message_or_an_exception_exits_1_with_it_on_stderr(tmp_path):
    p = warm.popen(["-c", "raise SystemExit('eval.py: no such run')"], {}, cwd=tmp_path)
    assert p.communicate(timeout=60) == ("", "eval.py: no such run\n") and p.returncode == 1
    p = warm.popen(["-m", "json.tool", "missing.json"], {}, cwd=tmp_path)  # a module's own error
    out, err = p.communicate(timeout=60)
    assert p.returncode != 0 and "missing.json" in err
    p = warm.popen(["-c", "1 / 0"], {}, cwd=tmp_path)
    assert "ZeroDivisionError" in p.communicate(timeout=60)[1] and p.returncode == 1


def test_ranks_get_torchruns_environment_and_one_failing_ends_both(tmp_path):
    code = ("import os; print(os.environ['RANK'], os.environ['LOCAL_RANK'], os.environ['WORLD_SIZE'],"
            " os.environ['MASTER_ADDR'], flush=True)")
    out = warm.ranks(["-c", code], {}, cwd=tmp_path).communicate(timeout=60)[0]
    assert sorted(out.splitlines()) == ["0 0 2 127.0.0.1", "1 1 2 127.0.0.1"]
    stuck = "import os, sys, time; time.sleep(600) if os.environ['RANK'] == '0' else sys.exit(5)"
    start, ranks = time.monotonic(), warm.ranks(["-c", stuck], {}, cwd=tmp_path)
    ranks.communicate(timeout=120)
    assert ranks.returncode == 5 and time.monotonic() - start < 60  # rank 0 killed, not waited for
    assert all(p.poll() is not None for p in ranks.procs)
