"""
runs.py: a run folder on disk, shared by train.py (runs/NAME) and eval.py (evals/NAME).
(What config.json pins on --resume, and how, is lab/cli.py's.)

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
    written through; append_line() opens with O_NOFOLLOW;
  - read_jsonl(): the one tolerant JSONL reader: a bad last line (a write cut by a kill or a
    full disk) is dropped with a warning, the same in every file; an earlier bad line is an
    error naming the file and line (or, for a file that is only a cache, dropped with a warning);
  - finite(): the one non-finite-to-null rule (None in records and files, NaN only in tensors);
  - nonfinite_weight(): the one check for a NaN or an infinity in a model's weights (a
    checkpoint saved or resumed, a --persuader loaded by train.py or eval.py);
  - checkpoints (save_checkpoint / load_checkpoint), the loggers (stdout, TensorBoard and W&B as
    one Loggers object) and rank setup (setup_distributed, all_sum).
The standard library (and lab.hardening, which is) only at import: torch is imported inside the checkpoint and rank functions.
"""
import errno
import fcntl
import importlib
import json
import math
import os
import re
import shutil
import sys
import tempfile
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
DIST_TIMEOUT_S = 3600  # collectives wait this long: above the slowest rank-0-only step (a paper
# preset's held-out summary and the checkpoint gather and save of a 4B policy)
TIMING_KEYS = ("judge_s", "probe_s", "persuader_s", "persuadee_s", "rollout_s", "update_s",
               "step_s")  # all-reduced in this order on every rank, whatever a rank measured
CHECKPOINT_RE = re.compile(r"checkpoint-(\d+)")  # the only names `latest` may hold
WANDB_PROJECT = "persuarena"  # W&B project of every run
LOGGERS = ("tensorboard", "wandb")  # --log choices, each an optional package


def say_error(who, text):
    """The one line a refusal ends a program with."""
    return SystemExit(f"{who}: {text}")

# -----------------------------------------------------------------------------
# non-finite numbers and JSONL


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
            rows.append((lineno, json.loads(line)))
        except json.JSONDecodeError as e:
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
    full = "the disk is full: " if free < needed or getattr(error, "errno", None) == errno.ENOSPC else ""
    again = ("rerun with --resume" if resumable else
             "rerun with --overwrite (no checkpoint was saved to resume from)")
    return (f"{who}: could not write {what} into {run_dir} ({full}{free / 2**20:.1f} MiB free, "
            f"{needed / 2**20:.1f} MiB needed; {cause}); {kept}: free space there and {again}")

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
    (those two by the first process only: under torchrun rank 0, which may have begun the run).
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

# -----------------------------------------------------------------------------
# resume: the settings and the module constants a run was made with













# -----------------------------------------------------------------------------
# ranks


def setup_distributed():
    """(rank, world, device): one process per GPU under torchrun (the device set before the
    process group starts, with NCCL bound to it), gloo on CPU; collectives time out after
    DIST_TIMEOUT_S. Without torchrun: (0, 1, cuda or cpu)."""
    import datetime

    import torch
    import torch.distributed as dist
    cuda = torch.cuda.is_available()
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if cuda else "cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=DIST_TIMEOUT_S)
        if cuda:
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", device_id=device, timeout=timeout)
        else:
            dist.init_process_group("gloo", timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), device


def all_sum(value, device):
    """Sum a number over ranks (a no-op in one process)."""
    import torch
    import torch.distributed as dist
    if not dist.is_initialized():
        return value
    t = torch.tensor(float(value), device=device, dtype=torch.float64)
    dist.all_reduce(t)
    return t.item()


def mean_timings(times, device):
    """The TIMING_KEYS of times (0 where a rank measured none), each averaged over ranks, in the
    same order on every rank (a rank that admitted no group has no persuader_s of its own)."""
    world = all_sum(1, device)
    return {k: all_sum(times.get(k, 0.0), device) / world for k in TIMING_KEYS}


def finish_distributed():
    """End the process group, if one was started (a rank exiting with it alive can abort gloo)."""
    if "RANK" in os.environ and "torch.distributed" in sys.modules:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()


def agree(message):
    """Rank 0's verdict (a refusal's line, or None) on every rank: a check made on rank 0 alone
    ends every rank, not only the one that made it."""
    import torch.distributed as dist
    if not dist.is_initialized():
        return message
    box = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]

# -----------------------------------------------------------------------------
# checkpoints


def nonfinite_weight(state_dict):
    """The name of the first floating-point tensor holding a NaN or an infinity, or None."""
    import torch
    return next((k for k, v in state_dict.items()
                 if v.is_floating_point() and not torch.isfinite(v).all()), None)


def checkpoint_folder(run_dir, who="train.py"):
    """The folder runs/NAME/latest names, checked: a checkpoint-STEP folder of this run, holding
    trainer.pt and the weights (a model's, or a LoRA run's adapter). A bad pointer is one line naming it and the fix."""
    latest = run_dir / "latest"
    fix = f"restore {run_dir} from a copy, or start a new run (another --name, or --overwrite)"
    if not latest.is_file():
        raise say_error(who, f"--resume: no checkpoint in {run_dir} (no 'latest' file); drop "
                             "--resume and pass --overwrite to start the run again")
    name = latest.read_text(errors="replace").strip()
    folder = run_dir / name
    if not CHECKPOINT_RE.fullmatch(name) or folder.is_symlink() or not folder.is_dir():
        raise say_error(who, f"{latest} names {name[:80]!r}, not a checkpoint-STEP folder inside "
                             f"the run; {fix}")
    from lab import lora
    for needed in ("trainer.pt", lora.ADAPTER_CONFIG if lora.is_adapter(folder) else "config.json"):
        if not (folder / needed).is_file():
            raise say_error(who, f"{folder / needed} is missing; {fix}")
    if not any(folder.glob("*.safetensors")):
        raise say_error(who, f"{folder} holds no *.safetensors weights (model.safetensors missing "
                             f"or renamed); {fix}")
    return folder


def _write_checkpoint(run_dir, step, model_sd, optim_sd, policy, tokenizer, previous, who):
    """Rank 0: checkpoint-STEP (write_folder_atomic), then `latest` (write_atomic); a failure
    removes the temporary folder and leaves `latest`."""
    import torch
    final = run_dir / f"checkpoint-{step}"

    def fill(folder):
        model = getattr(policy, "module", policy)
        # a peft adapter folder: embeddings are never adapted here, and asking peft to check
        # ("auto") looks the base model up on a hub, which a run never does
        extra = dict(save_embedding_layers=False) if hasattr(model, "peft_config") else {}
        model.save_pretrained(folder, state_dict=model_sd, **extra)
        tokenizer.save_pretrained(folder)
        torch.save(dict(step=step, optimizer=optim_sd, torch_rng=torch.get_rng_state()),
                   folder / "trainer.pt")
    try:
        write_folder_atomic(final, fill)
        write_atomic(run_dir / "latest", final.name)
    except Exception as e:  # safetensors, torch and the file system each raise their own kind
        kept = f"{previous} is intact" if previous else "no earlier checkpoint exists"
        needed = sum(f.stat().st_size for f in (run_dir / previous).iterdir()) if previous else 0
        raise SystemExit(write_failure(who, f"checkpoint-{step}", run_dir, e, kept, needed,
                                       resumable=bool(previous))) from None
    return final


def prune_checkpoints(run_dir, final):
    """Once `latest` names checkpoint `final`: an older checkpoint of a held-out evaluation (an
    eval-STEP folder: checkpoint selection, eval.py --runs, needs its weights) keeps its weights
    and loses trainer.pt, its optimizer state; any other is deleted. A run so holds the optimizer
    state of its latest checkpoint only, and of the one before while the newest is written."""
    for old in run_dir.glob("checkpoint-*"):
        if old == final or not CHECKPOINT_RE.fullmatch(old.name) or old.is_symlink():
            continue
        if (run_dir / f"eval-{old.name.removeprefix('checkpoint-')}").is_dir():
            (old / "trainer.pt").unlink(missing_ok=True)
        else:
            shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(run_dir, step, policy, optimizer, tokenizer, rank, who="train.py"):
    """Write checkpoint-STEP atomically, point `latest` at it and prune the older ones
    (prune_checkpoints: an evaluated step's weights stay, its optimizer state goes). The weights and optimizer are gathered to rank 0 (a full state
    dict, on the CPU), which alone writes. Non-finite weights are never written; a failed write
    removes its temporary files and leaves the previous checkpoint."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(policy, optimizer, options=options)
    if rank == 0:
        latest = run_dir / "latest"
        previous = latest.read_text().strip() if latest.is_file() else None
        bad = next((k for k, v in model_sd.items() if not torch.isfinite(v).all()), None)
        if bad is not None:
            raise say_error(who, f"the policy's {bad} is not finite at step {step}; not saving it "
                                 f"over {previous or 'nothing'} in {run_dir}: lower --lr and --resume")
        final = _write_checkpoint(run_dir, step, model_sd, optim_sd, policy, tokenizer, previous, who)
        prune_checkpoints(run_dir, final)
    if dist.is_initialized():
        dist.barrier()


def _read_checkpoint(run_dir, policy, who):
    """Rank 0: (step, model state dict, optimizer state dict, rng state) of runs/NAME/latest,
    every check made; raises SystemExit with one line on a bad checkpoint."""
    import torch
    from safetensors.torch import load_file
    folder = checkpoint_folder(run_dir, who)
    trainer = folder / "trainer.pt"
    try:
        state = torch.load(trainer, map_location="cpu", weights_only=True)
    except Exception as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:120]
        raise say_error(who, f"{trainer} is not a checkpoint train.py wrote ({reason}); it was "
                             "not run; restore the run from a copy or start a new one") from None
    if not (isinstance(state, dict) and {"step", "optimizer", "torch_rng"} <= state.keys()
            and state["step"] == int(CHECKPOINT_RE.fullmatch(folder.name)[1])):
        raise say_error(who, f"{trainer} does not hold the step, optimizer and random state of "
                             f"{folder.name}; restore the run from a copy or start a new one")
    model_sd = {}
    for f in sorted(folder.glob("*.safetensors")):
        try:
            model_sd.update(load_file(f))
        except Exception as e:
            raise say_error(who, f"{f} cannot be read ({type(e).__name__}: {str(e)[:80]}); restore "
                                 "it from a copy or start a new run") from None
    if bad := nonfinite_weight(model_sd):
        others = sorted((p.name for p in run_dir.glob("checkpoint-*")
                         if p != folder and (p / "trainer.pt").is_file()),
                        key=lambda n: int(n.split("-")[1]) if n.split("-")[1].isdigit() else -1)
        earlier = (f"resume from an earlier checkpoint (write e.g. {others[-1]} into "
                   f"{run_dir / 'latest'}), or " if others else
                   "no earlier checkpoint keeps its optimizer state: ")
        raise say_error(who, f"{folder} holds non-finite weights ({bad}); {earlier}start a new run "
                             "with a lower --lr (another --name, or --overwrite)")
    tied = getattr(policy.config, "tie_word_embeddings", False)
    if tied and "lm_head.weight" not in model_sd and "model.embed_tokens.weight" in model_sd:
        model_sd["lm_head.weight"] = model_sd["model.embed_tokens.weight"]
    if hasattr(policy, "peft_config"):  # peft's adapter file: the adapters alone, under its names
        from lab import lora
        names = lora.saved_names(policy)
        model_sd = {names.get(k, k): v for k, v in model_sd.items()}
        want = {k: tuple(p.shape) for k, p in policy.named_parameters() if p.requires_grad}
    else:
        want = {k: tuple(v.shape) for k, v in policy.state_dict().items()}
    have = {k: tuple(v.shape) for k, v in model_sd.items()}
    problems = [f"{len(m)} {what}, e.g. {m[0]}" for what, m in (
        ("missing", sorted(want.keys() - have.keys())), ("unexpected", sorted(have.keys() - want.keys())),
        ("of another shape", [f"{k} {have[k]} vs {want[k]}" for k in sorted(want.keys() & have.keys())
                              if have[k] != want[k]])) if m]
    if problems:
        raise say_error(who, f"the weights in {folder} do not match the policy ({'; '.join(problems)}); "
                             "resume with the --persuader the run started with, or start a new run "
                             "(another --name)")
    return state["step"], model_sd, state["optimizer"], state["torch_rng"]


def load_checkpoint(run_dir, policy, optimizer, device=None, who="train.py"):
    """Restore the policy (under --lora its adapters) and optimizer from runs/NAME/latest;
    returns the step it was saved at.

    Rank 0 alone reads the checkpoint (trainer.pt with weights_only=True: no pickled code runs)
    and checks it (exactly the policy's names and shapes, finite weights: a foreign, renamed or
    corrupted checkpoint is one line naming the file and the fix, on every rank); the weights
    and the optimizer state are then broadcast from rank 0 and each rank keeps its own shard,
    so no other rank reads the whole trainer state."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)
    ranks = dist.is_initialized() and dist.get_world_size() > 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    found, refusal = None, None
    if rank == 0:
        try:
            found = _read_checkpoint(run_dir, policy, who)
        except SystemExit as e:
            refusal = str(e.code)
    if refusal := agree(refusal):
        raise SystemExit(refusal)
    step, model_sd, optim_sd, rng = found or (None, {}, {}, None)
    if ranks:
        step, rng = agree((step, rng))
    # the model and the optimizer each by itself: set_state_dict skips the model on a rank
    # whose model state dict is empty, which broadcast_from_rank0 gives every rank but 0
    options = StateDictOptions(full_state_dict=True, strict=False, broadcast_from_rank0=ranks)
    set_optimizer_state_dict(policy, optimizer, optim_sd, options=options)
    set_model_state_dict(policy, model_sd, options=options)
    torch.set_rng_state(rng)
    return step

# -----------------------------------------------------------------------------
# loggers: stdout, TensorBoard and W&B as one object


def require(kind, who="train.py"):
    """The optional package behind a --log choice, or a one-line exit saying how to get it."""
    try:
        return importlib.import_module(kind)
    except ImportError:
        raise say_error(who, f"--log {kind} needs the {kind} package: pip install {kind}") from None


def scalars(values, prefix=""):
    """The finite numbers of a (nested) metrics dict as {prefix/key/...: value}."""
    out = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out.update(scalars(value, f"{prefix}{key}/"))
        elif is_number(value):
            out[f"{prefix}{key}"] = value
    return out


class TensorBoardLog:
    """Events in runs/NAME (`tensorboard --logdir runs`); a resumed run drops what came after
    its checkpoint, as metrics.jsonl does."""

    def __init__(self, run_dir, start):
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(str(run_dir), purge_step=start + 1 if start else None)

    def scalars(self, step, values):
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def samples(self, step, rows):
        head = "| id | outcome | turns | beliefs | transcript |\n| --- | --- | --- | --- | --- |\n"
        cell = lambda v: str(v).replace("|", "\\|").replace("\n", "<br>")
        self.writer.add_text("samples", head + "".join(
            "| " + " | ".join(cell(v) for v in row) + " |\n" for row in rows), step)

    def close(self):
        self.writer.close()


class WandbLog:
    """A W&B run in runs/NAME/wandb, offline unless WANDB_MODE is set (`wandb sync` uploads it)."""

    def __init__(self, run_dir, args):
        self.wandb = require("wandb")
        mode = None if os.environ.get("WANDB_MODE") else "offline"
        run_id = "".join(c if c.isalnum() or c in "-_" else "-" for c in args.name)  # W&B's id alphabet
        self.run = self.wandb.init(project=WANDB_PROJECT, name=args.name, id=run_id,
                                   resume="allow", dir=str(run_dir), mode=mode,
                                   config={k: v for k, v in vars(args).items() if k != "log"})

    def scalars(self, step, values):
        self.run.log(values, step=step)

    def samples(self, step, rows):
        table = self.wandb.Table(columns=["id", "outcome", "turns", "beliefs", "transcript"],
                                 data=rows)
        self.run.log({"samples": table}, step=step)

    def close(self):
        self.run.finish()


class Loggers:
    """Every output of a run's scalars: stdout (rank 0) and one logger per --log choice (rank 0
    only), written through one object."""

    def __init__(self, args, run_dir, start, rank):
        self.rank = rank
        self.sinks = [TensorBoardLog(run_dir, start) if kind == "tensorboard" else WandbLog(run_dir, args)
                      for kind in args.log] if rank == 0 else []

    def say(self, *text, **kw):
        if self.rank == 0:
            print(*text, **kw)

    def scalars(self, step, values, prefix):
        for sink in self.sinks:
            sink.scalars(step, scalars({k: v for k, v in values.items() if k != "step"}, prefix))

    def samples(self, step, rows):
        for sink in self.sinks:
            sink.samples(step, rows)

    def close(self):
        for sink in self.sinks:
            sink.close()
