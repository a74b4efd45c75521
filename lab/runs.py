"""
runs.py: a run folder on disk, shared by train.py (runs/NAME) and eval.py (evals/NAME), and the
one writer of every file a run, a sweep or an evaluation writes.
(What config.json pins on --resume, and how, is lab/cli.py's; JSONL and non-finite numbers are
lab/jsonl.py's, checkpoints lab/checkpoints.py's, ranks lab/ranks.py's, loggers
lab/loggers.py's.)

A run folder is written only by the process that holds its lock, only by this module's writers,
and never through a link:
  - one name rule (name_problem): one folder name of visible characters (no path separators,
    no control, zero-width, bidi or line-separator character), at most NAME_MAX bytes;
  - prepare(): before any model loads, the folder is checked (not a link, no link among its own
    files, an existing run refused without --resume or --overwrite, --overwrite only of a folder
    that holds a run this project wrote), its parent checked writable, and an exclusive lock
    (fcntl.flock on NAME/.lock) taken and held for the whole run: a second process under the
    same name is refused in one line;
  - write_atomic(): a temporary file created exclusively (O_CREAT | O_EXCL | O_NOFOLLOW, a
    random name) in the same folder, then renamed over the target: a kill or a full disk leaves
    the old file or the new one, and a link planted in a copied folder is replaced, never
    written through; append_line() opens with O_NOFOLLOW; write_in() refuses a linked folder
    (the writer for every file a sweep or a bench writes).
The standard library (and lab.hardening, which is) only.
Tests: python -m pytest -q tests/test_runs.py
"""
import errno
import fcntl
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path

from lab import hardening

MARKER = ".persuarena-run"  # written into every run folder this project makes: --overwrite may delete it
LOCK = ".lock"  # flock'ed by the process that writes the folder, for as long as it runs
NAME_MAX = 200  # UTF-8 bytes of a run name (a file system allows 255; temporary names add a suffix)
# files a run writes (train.py's and eval.py's); a folder holding only these and no marker is a
# run of an earlier version of the project, which --overwrite may replace as well
RUN_FILES = re.compile(r"(config\.json|metrics\.jsonl|rollouts\.jsonl|evals\.jsonl|latest|"
                       r"checkpoint-\d+|eval-\d+|samples-\d+\.json|events\.out\.tfevents\..*|wandb|"
                       r"episodes(\.rank\d+)?\.jsonl|summary\.json|settings\.json|fidelity\.json|"
                       r"compare\.json|runs\.json|[\w.-]+\.png|\..*\.tmp|\.lock|\.persuarena-run)")


def say_error(who, text):
    """The one line a refusal ends a program with."""
    return SystemExit(f"{who}: {text}")

# -----------------------------------------------------------------------------
# writing: never through a link


def _exclusive_temp(path, directory=False):
    """A new temporary file (or folder) beside path, with a random name, created exclusively
    (O_CREAT | O_EXCL | O_NOFOLLOW: tempfile's flags), so no planted link is followed."""
    prefix = f".{path.name[:NAME_MAX]}."
    umask = os.umask(0o022)
    os.umask(umask)
    if directory:  # mkdtemp and mkstemp create 0700 and 0600: a run is shared as any file is
        folder = Path(tempfile.mkdtemp(prefix=prefix, suffix=".tmp", dir=path.parent))
        folder.chmod(0o777 & ~umask)
        return folder
    fd, name = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=path.parent)
    os.fchmod(fd, 0o666 & ~umask)
    return fd, Path(name)


def write_atomic(path, data, *, who=None, kept="the previous file is intact"):
    """path's new content (str, bytes, or a function given the open binary file) through an
    exclusive temporary file and a rename: a kill or a full disk leaves the old file or the
    new one, and a link at path is replaced, not written through. A failed write removes the
    temporary file and raises OSError, or with who exits in one line (write_failure)."""
    path = Path(path)
    fd, tmp = _exclusive_temp(path)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if who is None or not isinstance(e, OSError):
            raise
        raise SystemExit(write_failure(who, path.name, path.parent, e, kept)) from None


def write_in(folder, name, data, who):
    """A file of a folder this program owns (a run, a sweep, a bench's output): refused in one
    line when the folder is a link (its files would land wherever it points) or name is not one
    file name; else write_atomic (a link at the file is replaced, never followed). Returns the
    path written."""
    folder = Path(folder)
    if name_problem(name):
        raise say_error(who, f"{name!r} is not one file name; nothing was written into {folder}")
    if folder.is_symlink():
        raise say_error(who, f"{folder} is a link ({folder} -> {os.readlink(folder)}), which this "
                             f"program never writes through; nothing was written: pass another folder")
    write_atomic(folder / name, data, who=who)
    return folder / name


def write_folder_atomic(path, fill):
    """A folder's new content: fill(temporary folder) in an exclusive temporary folder beside
    path, then a rename over path (a kill leaves the old folder or the new one; a link at path
    is removed, never followed). A failure removes the temporary folder and is raised."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _exclusive_temp(path, directory=True)
    try:
        fill(tmp)
        if path.is_symlink() or path.is_file():
            path.unlink()
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def append_line(path, text, sync=False):
    """Append text to path, opened with O_NOFOLLOW (a link there is refused, not followed)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "a") as f:
        f.write(text)
        if sync:
            f.flush()
            os.fsync(f.fileno())


def write_failure(who, what, run_dir, error, kept, needed=0, resumable=True):
    """The one line a failed write ends a run with (a full disk, most often: torch and
    safetensors report it in words of their own, so the free space is named beside them), with
    advice that leads somewhere: --resume where a checkpoint exists, --overwrite where none does."""
    try:
        free = shutil.disk_usage(run_dir).free
    except OSError:
        free = 0
    cause = error.strerror if isinstance(error, OSError) and error.strerror else \
        (str(error).strip().splitlines() or [type(error).__name__])[-1]
    code = getattr(error, "errno", None)
    full = "the disk is full: " if free < needed or code in (errno.ENOSPC, errno.EDQUOT) else ""
    again = ("rerun with --resume" if resumable else
             "rerun with --overwrite (no checkpoint was saved to resume from)")
    # an OSError that names another cause (a permission, a read-only disk) is not the disk's room
    fix = "fix that" if isinstance(error, OSError) and code is not None and not full else \
        "free space there"
    return (f"{who}: could not write {what} into {run_dir} ({full}{free / 2**20:.1f} MiB free, "
            f"{needed / 2**20:.1f} MiB needed; {cause}); {kept}: {fix} and {again}")

# -----------------------------------------------------------------------------
# the folder: one name rule, links refused, one lock, --overwrite of a run only


def name_problem(name):
    """What makes name no single folder name a person can read, or None: checked as characters
    (hardening.hidden_character: no control, zero-width, bidi or line-separator character, no
    lone surrogate, which is how a byte that is not UTF-8 arrives) and as the bytes the file
    system stores (at most NAME_MAX in UTF-8)."""
    if name in ("", ".", "..") or any(c in name for c in "/\\\0" + os.sep):
        return "must be one folder name (no '.', '..' or path separators)"
    if hidden := hardening.hidden_character(name):
        return f"holds {hidden}; use visible characters"
    if name.isspace():
        return "is blank"
    if len(name.encode()) > NAME_MAX:
        return f"is {len(name.encode())} bytes long in UTF-8, more than {NAME_MAX}"
    return None


def links_in(run_dir):
    """The links among a run folder's own entries (and those of its checkpoint and eval
    folders), which no writer of this module follows and no run should hold."""
    found = []
    for entry in sorted(run_dir.iterdir()) if run_dir.is_dir() else ():
        if entry.is_symlink():
            found.append(entry.name)
        elif entry.is_dir() and (entry.name.startswith(("checkpoint-", "eval-")) or
                                 (entry / MARKER).exists()):
            found += [f"{entry.name}/{e.name}" for e in sorted(entry.iterdir()) if e.is_symlink()]
    return found


def writer(run_dir):
    """The program whose marker run_dir holds (lock: "written by WHO"), or None (no marker, or
    one of an earlier version that named none)."""
    try:
        text = (Path(run_dir) / MARKER).read_text(errors="replace")
    except OSError:
        return None
    return text.rpartition("written by ")[2].strip() or None


def is_project_run(run_dir):
    """A folder holding the project's marker, or only files a run writes (an older run)."""
    return (run_dir / MARKER).is_file() or all(RUN_FILES.fullmatch(e.name) for e in run_dir.iterdir())


def _own_files(run_dir):
    return [e for e in run_dir.iterdir() if e.name not in (LOCK, MARKER)] if run_dir.is_dir() else []


def _writable_parent(path):
    """The nearest existing folder at or above path, and whether this process may write there."""
    path = Path(os.path.abspath(path))
    while not path.exists():
        path = path.parent
    return path, path.is_dir() and os.access(path, os.W_OK | os.X_OK)


def check_folder(out, name, who, resume, overwrite, flag="--name", first=True):
    """Everything about run_dir that can refuse a run, before any model loads: the name, a link,
    links inside, a file where a folder belongs, a folder that cannot be written, an existing
    run without --resume or --overwrite, --overwrite of a folder no run of this project wrote
    (those two by the first process only: under torchrun rank 0, which may have begun the run),
    --resume or --overwrite of another program's folder (its marker: writer). A folder another
    process runs in is refused by lock(), which every program takes before it deletes anything.
    The run folder is out/name."""
    if problem := name_problem(name):
        raise say_error(who, f"{flag} {name!r} {problem}; pass e.g. {flag} my-run "
                             "(--out says where runs go)")
    run_dir = Path(out) / name
    if run_dir.is_symlink():
        raise say_error(who, f"{flag} {run_dir.name} is a link ({run_dir} -> "
                             f"{os.readlink(run_dir)}), not a run folder; pass another {flag}")
    if run_dir.exists() and not run_dir.is_dir():
        raise say_error(who, f"{run_dir} is a file, not a run folder; pass another {flag} or --out")
    if links := links_in(run_dir):
        raise say_error(who, f"{run_dir} holds links ({', '.join(links[:4])}), which a run never "
                             "writes through; remove them (copy the run with cp -L), or pass "
                             f"another {flag}")
    where, ok = _writable_parent(run_dir)
    if not ok:
        raise say_error(who, f"{where} cannot be written (not a writable folder), so {run_dir} "
                             "cannot hold a run; pass an --out you may write to")
    if resume and overwrite:
        raise say_error(who, "--resume with --overwrite contradict each other; pass one of them")
    own = _own_files(run_dir) if first else []
    if (resume or overwrite) and (other := writer(run_dir)) not in (None, who):
        raise say_error(who, f"{'--resume' if resume else '--overwrite'}: {run_dir} is a run of "
                             f"another program ({other}), not of {who}; nothing was touched: pass "
                             f"another {flag} or --out")
    if own and overwrite and not is_project_run(run_dir):
        foreign = [e.name for e in own if not RUN_FILES.fullmatch(e.name)]
        raise say_error(who, f"--overwrite would delete {run_dir}, which is not a run this "
                             f"project wrote (it holds {', '.join(sorted(foreign)[:4])}); nothing "
                             f"was deleted: pass another {flag} or --out")
    if own and not resume and not overwrite:
        held = ", ".join(sorted(e.name for e in own)[:4])
        raise say_error(who, f"{flag} {run_dir.name} is an existing run ({run_dir} holds {held}); "
                             f"pass --resume to continue it, --overwrite to replace it, or "
                             f"another {flag}")


_HELD = {}  # run folder -> the open lock file, kept for the life of the process


def lock(run_dir, who, flag="--name"):
    """Create run_dir (with its marker) and take its lock, held until this process ends or
    unlock(run_dir): a second process under the same name is refused in one line."""
    run_dir = Path(run_dir)
    key = os.path.abspath(run_dir)
    if key in _HELD:
        return
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        raise say_error(who, f"cannot create {run_dir / LOCK} ({e.strerror or e}); pass an --out "
                             "you may write to") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise say_error(who, f"{run_dir} is in use by process {holder}, which holds its lock; "
                             f"wait for it to end, or pass another {flag}") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    _HELD[key] = fd
    if not (run_dir / MARKER).is_file():
        write_atomic(run_dir / MARKER, f"a PersuArena run folder, written by {who}\n")


def unlock(run_dir):
    """Release run_dir's lock (the end of a run; a test that runs several in one process)."""
    fd = _HELD.pop(os.path.abspath(run_dir), None)
    if fd is not None:
        os.close(fd)


def clear(run_dir):
    """Empty a folder --overwrite replaces (check_folder has checked it is a run), keeping its
    lock and marker."""
    for entry in _own_files(Path(run_dir)):
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def exit_on_interrupt(who, run_dir):
    """Ctrl-C ends a run as SIGTERM does: at once, whatever is in flight (a step, a save), in
    one line, with exit status 130. Every file of the run is written whole or not at all (the
    writers above; checkpoints are renamed into place), so nothing a step half-did is kept and
    --resume continues from the last checkpoint. (A KeyboardInterrupt would instead unwind
    through the step's threads and cleanups: late, in several tracebacks.) Returns what puts the
    previous handler back (a run called from another program, a test)."""
    line = (f"{who}: interrupted (Ctrl-C); {run_dir} keeps its last checkpoint: continue with "
            "--resume\n").encode()

    def stop(signum, frame):
        os.write(sys.stderr.fileno(), line)
        os._exit(128 + signum)
    if threading.current_thread() is not threading.main_thread():
        return lambda: None  # a run called from a thread: Python lets only the main one handle it
    previous = signal.signal(signal.SIGINT, stop)
    return lambda: signal.signal(signal.SIGINT, previous)

