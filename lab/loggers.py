"""
loggers.py: a run's scalars and samples to stdout (rank 0), TensorBoard, W&B and trackio, as one
Loggers object (--log tensorboard wandb trackio; each an optional package, asked for in one line
when missing).
    python train.py --name my-run --log tensorboard && tensorboard --logdir runs
    python train.py --name my-run --log trackio && trackio show --project persuarena
Tests: python -m pytest -q tests/test_loggers.py
"""
import importlib
import os

from lab.jsonl import is_number
from lab.runs import say_error

WANDB_PROJECT = "persuarena"  # the W&B and trackio project of every run
LOGGERS = ("tensorboard", "wandb", "trackio")  # --log choices, each an optional package


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


class TrackioLog:
    """A trackio run, named as the run folder, in trackio's local store (TRACKIO_DIR, by default
    ~/.cache/huggingface/trackio; `trackio show --project persuarena` opens its dashboard)."""

    def __init__(self, run_dir, args):
        self.trackio = require("trackio")
        self.run = self.trackio.init(project=WANDB_PROJECT, name=args.name, resume="allow",
                                     config={k: v for k, v in vars(args).items() if k != "log"},
                                     auto_log_cpu=False, auto_log_gpu=False)

    def scalars(self, step, values):
        self.trackio.log(values, step=step)

    def samples(self, step, rows):
        table = self.trackio.Table(columns=["id", "outcome", "turns", "beliefs", "transcript"],
                                   data=[[str(v) for v in row] for row in rows])
        self.trackio.log({"samples": table}, step=step)

    def close(self):
        self.trackio.finish()


SINKS = {"tensorboard": lambda run_dir, args, start: TensorBoardLog(run_dir, start),
         "wandb": lambda run_dir, args, start: WandbLog(run_dir, args),
         "trackio": lambda run_dir, args, start: TrackioLog(run_dir, args)}


class Loggers:
    """Every output of a run's scalars: stdout (rank 0) and one logger per --log choice (rank 0
    only), written through one object."""

    def __init__(self, args, run_dir, start, rank):
        self.rank = rank
        self.sinks = [SINKS[kind](run_dir, args, start) for kind in args.log] if rank == 0 else []

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
