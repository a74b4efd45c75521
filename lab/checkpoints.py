"""
checkpoints.py: a training run's checkpoint-STEP folders and the `latest` pointer.

save_checkpoint gathers the full weights and optimizer state to rank 0, which writes
checkpoint-STEP as one atomic folder (runs.write_folder_atomic), then `latest` (runs.write_atomic),
then prunes older checkpoints (an evaluated step keeps its weights, loses its optimizer state).
A kill at any moment of a save leaves `latest` naming the old checkpoint or the new one, both
whole (the folder is renamed into place before `latest` moves, older ones pruned after); what
an interrupted save leaves (LEFTOVER_RE) is removed on resume and counted by lab/plan.py.
load_checkpoint has rank 0 read and check `latest` (names and shapes of the policy, finite
weights, trainer.pt with weights_only=True) and broadcasts it; every rank keeps its shard.
torch is imported inside each function.
    python train.py --name my-run --resume
Tests: python -m pytest -q tests/test_checkpoints.py
"""
import re
import shutil
from pathlib import Path

from lab.ranks import agree
from lab.runs import say_error, write_atomic, write_failure, write_folder_atomic

CHECKPOINT_RE = re.compile(r"checkpoint-(\d+)")  # the only names `latest` may hold
LEFTOVER_RE = re.compile(r"\.(checkpoint-\d+|latest)\..+\.tmp")  # an interrupted save's temporary
# folder or `latest` (runs.write_folder_atomic, runs.write_atomic): never read, removed on resume


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


def leftovers(run_dir):
    """The temporary folders and files an interrupted save left in run_dir (a kill between
    their creation and their rename: one may hold a whole checkpoint) and their bytes."""
    found = [e for e in sorted(Path(run_dir).iterdir()) if LEFTOVER_RE.fullmatch(e.name)] \
        if Path(run_dir).is_dir() else []
    size = sum(f.stat().st_size for e in found for f in ([e] if e.is_file() else e.rglob("*"))
               if f.is_file() and not f.is_symlink())
    return found, size


def remove_leftovers(run_dir, who="train.py"):
    """Remove what an interrupted save left (leftovers), saying so in one line."""
    found, size = leftovers(run_dir)
    for entry in found:
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    if found:
        print(f"{who}: removed {', '.join(e.name for e in found[:3])}{' ...' if len(found) > 3 else ''} "
              f"({size / 2**20:.1f} MiB) from {run_dir}, left by an interrupted checkpoint save")


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
    if getattr(policy.config, "tie_word_embeddings", False) and "model.embed_tokens.weight" in model_sd:
        model_sd.pop("lm_head.weight", None)  # gathered as a copy of its own under FSDP: one
        # matrix written once, as one process writes it and plan.py counts it (load re-ties it)
    if rank == 0:
        latest = run_dir / "latest"
        previous = latest.read_text().strip() if latest.is_file() else None
        bad = next((k for k, v in model_sd.items() if not torch.isfinite(v).all()), None)
        if bad is not None:
            raise say_error(who, f"the policy's {bad} is not finite at step {step}; not saving it "
                                 f"over {previous or 'nothing'} in {run_dir}: lower --lr and --resume")
        final = _write_checkpoint(run_dir, step, model_sd, optim_sd, policy, tokenizer, previous, who)
        prune_checkpoints(run_dir, final)
        remove_leftovers(run_dir, who)
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
        remove_leftovers(run_dir, who)
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
