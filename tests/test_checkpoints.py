"""lab/checkpoints.py: a kill at any moment of a save leaves `latest` naming a whole checkpoint (the
old or the new); what an interrupted save leaves is removed on resume, in one line, and counted
by the disk plan. The kill is real: a forked child saving checkpoint-2 over checkpoint-1 ends
with os._exit before or after each file-system call a save makes."""
import os
import re
import shutil
import tempfile

import pytest
import torch

from lab import checkpoints, plan
from test_train import saved_run, trained_policy  # noqa: F401 (saved_run: a fixture)

# the calls a save is made of, each a moment a kill can land before or after
KILL_AT = (("os", "replace"), ("shutil", "rmtree"), ("torch", "save"), ("tempfile", "mkdtemp"),
           ("tempfile", "mkstemp"), ("os", "unlink"), ("os", "fsync"))


def save_in_child(run, tokenizer, kill_at):
    """Fork; the child saves checkpoint-2 and dies (os._exit) at moment kill_at (2k: before the
    k-th hooked call, 2k+1: after it), or finishes. Returns how many moments the save had."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no cleanup of any kind runs on os._exit, as under SIGKILL
        os.close(read)
        moments = [0]

        def hooked(real):
            def call(*a, **k):
                if moments[0] == kill_at:
                    os._exit(9)
                moments[0] += 1
                out = real(*a, **k)
                if moments[0] == kill_at:
                    os._exit(9)
                moments[0] += 1
                return out
            return call
        modules = dict(os=os, shutil=shutil, torch=torch, tempfile=tempfile)
        for module, name in KILL_AT:
            setattr(modules[module], name, hooked(getattr(modules[module], name)))
        try:
            policy, optimizer = trained_policy(seed=2)
            checkpoints.save_checkpoint(run, 2, policy, optimizer, tokenizer, 0)
            os.write(write, str(moments[0]).encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read) as f:
        told = f.read()
    return int(told) if told else None


@pytest.fixture
def run_with_one_checkpoint(saved_run):
    return saved_run[0]


def test_a_kill_at_any_moment_of_a_save_leaves_the_old_or_the_new_checkpoint(
        run_with_one_checkpoint, tmp_path, tokenizer, capsys):
    pristine = tmp_path / "pristine"
    shutil.copytree(run_with_one_checkpoint, pristine)
    total = save_in_child(tmp_path / "pristine", tokenizer, kill_at=-1)
    assert total and total > 6 and (pristine / "latest").read_text() == "checkpoint-2"
    seen = set()
    for moment in range(total):
        run = tmp_path / f"killed-{moment}"
        shutil.copytree(run_with_one_checkpoint, run)
        assert save_in_child(run, tokenizer, kill_at=moment) is None  # killed
        capsys.readouterr()
        fresh, optimizer = trained_policy(seed=3)
        step = checkpoints.load_checkpoint(run, fresh, optimizer, torch.device("cpu"))
        seen.add(step)
        assert step in (1, 2), moment
        said = capsys.readouterr().out
        assert not checkpoints.leftovers(run)[0] and not [p for p in run.iterdir() if p.name.endswith(".tmp")]
        if said:  # the one line a resume says about what it removed
            assert re.fullmatch(r"train\.py: removed \.(checkpoint-2|latest)\.\w+\.tmp \(\d+\.\d MiB\) "
                                rf"from {re.escape(str(run))}, left by an interrupted checkpoint save\n", said)
    assert seen == {1, 2}


def test_an_interrupted_saves_leftover_is_counted_by_the_disk_plan_and_removed_on_resume(
        run_with_one_checkpoint, tokenizer, capsys):
    run = run_with_one_checkpoint
    leftover = run / ".checkpoint-2.k1ll3d.tmp"
    shutil.copytree(run / "checkpoint-1", leftover)  # a kill before the rename: a whole checkpoint
    size = sum(f.stat().st_size for f in leftover.rglob("*") if f.is_file())
    assert checkpoints.leftovers(run) == ([leftover], size)
    lines = plan.disk_lines(dict(items=[("weights", 1)], total=1), run)
    assert lines[-1] == (f"  {'+ 1 left by an interrupted save (removed on resume)':<52}"
                         f"{size / 2**30:>8.2f} GiB")
    fresh, optimizer = trained_policy(seed=3)
    assert checkpoints.load_checkpoint(run, fresh, optimizer, torch.device("cpu")) == 1
    assert capsys.readouterr().out == (f"train.py: removed .checkpoint-2.k1ll3d.tmp ({size / 2**20:.1f} "
                                       f"MiB) from {run}, left by an interrupted checkpoint save\n")
    assert not leftover.exists() and sorted(p.name for p in run.iterdir()) == ["checkpoint-1", "latest"]
