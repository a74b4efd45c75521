"""
cli.py: the command-line mechanism every entry point shares (train.py, eval.py, python -m
lab.sweep, lab.env, lab.bench): flags whose defaults are the constants that own them, one-line
refusals (what, where, how to fix) before any model loads, and resume pinning.

  - train_args(argv, own): train.py's settings: the command line over its preset
    (lab/presets.py) over the owning constants; with --resume the run's config.json, pinned;
  - pinned_constants(own): every JSON-serialisable CAPS constant of the method's modules (and
    of the entry point's own), recorded in config.json / settings.json; --resume refuses a
    run whose constants changed (changed_constants) or a setting changed (pin_settings), with
    no hand-kept list of knobs;
  - the shared flags: the sampling preset and its four overrides (rollout.SAMPLING), --decision
    (default rollout.DECISION), --dtype's choices (DTYPES), and one check of a model argument
    (model_problem) for train.py, eval.py and lab.env; probes.add_flags and
    served.add_key_flag (default served.ALLOW_INSECURE_KEY) beside them. A flag's default is
    the constant that owns it, read when the parser is built, and its value travels down as an
    argument (rollout_episodes(decision=...), ServedModel(allow_insecure_key=...)): no entry
    point assigns another module's constant.

    python train.py --help
"""
import argparse
import importlib
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from persuarena import arena
from persuarena import models
from persuarena import probes
from persuarena import rollout
from persuarena import rpo
from lab import checkpoints, gguf, jsonl, loggers, lora, plan, presets, runs, served, shapes

DTYPES = ("float32", "bfloat16", "float16")  # --dtype choices
MODEL_FIX = "pass a model folder, a hub name, smollm2 or random:NAME"  # after a model_problem
RESUME_MAY_CHANGE = ("steps", "eval_every", "eval_limit", "eval_fidelity", "save_every", "log",
                     "activation_checkpointing")  # recorded in config.json
NOT_SETTINGS = ("name", "out", "resume", "overwrite", "skipped_instances", "resumed", "plan",
                "plan_ranks", "plan_gib", "allow_insecure_key")  # (where the key may go is no setting)
POSITIVE = ("steps", "instances", "group_size", "t_max", "eval_t_max", "max_new_tokens",
            "micro_batch", "eval_limit", "save_every", "updates_per_batch")  # integers >= 1
UPPER = {"group_size": 1024, "micro_batch": 4096}  # at most (a group of 1e9 filled 16 GB of RAM
# on a CPU whose plan said 3 GiB fit; the paper's group is 8)
SEED_MAX = 2**63 - 1  # --seed at most (torch's generators take 64 bits; lab/env.py's SEED_MAX)
TEMPERATURE_RANGE = (1e-2, 1e2)  # a sampling temperature other than 0 (greedy) lies here: below,
# sampling is greedy in all but name; above, it is uniform over the vocabulary
NONFINITE_NAMES = ("logprobs", "advantages", "loss", "grad_norm")  # what a step can find non-finite
# (rpo.micro_batch_loss's three, the gradient norm): train.NONFINITE_CHECKS names some of them
CONFIG_OPTIONAL = ("resumed",)  # config.json keys a run holds only once resumed with a change
LAM_MAX = 100.0  # --lam at most: the dense term's weight; beyond it lambda * sum_t r_t drowns the
# outcome reward a million-fold, and at ~1e308 it overflows to inf (NaN advantages)
PLAN_GIB_MAX = 2.0**20  # --plan-gib at most (a PiB): more is no device, and overflows the byte count
PINNED_MODULES = ("arena", "probes", "rollout", "rpo", "models", "lab.hardening", "lab.lora",
                  "lab.variants")
# the constants that say what is trained and played, pinned on resume with the entry point's own;
# the engine's (engine, layers, lab.fastpath: pool sizes, block size, the fast path) set speed and
# memory, not results, so a resumed run may change them (DECISIONS.md: Resume pins every knob);
# names ending in _PATH or _DIR say where files are on this machine and are not pinned
MOVED_CONSTANTS = {"arena.FIRST_NAMES": "lab.variants.FIRST_NAMES",
                   "arena.SURNAMES": "lab.variants.SURNAMES", "arena.NOT_TEXT": "lab.variants.NOT_TEXT"}
# pinned constants that moved to another module: a run recorded before the move reads its value
# under the new name (same value, same meaning), so it still resumes

# -----------------------------------------------------------------------------
# resume pinning


def _as_json(value):
    """A constant as JSON holds it (sets sorted into lists), or None when JSON cannot hold it."""
    if isinstance(value, (set, frozenset)):
        value = sorted(value, key=repr)
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError):
        return None


def pinned_constants(own=None):
    """{"module.NAME": value} of every CAPS constant of PINNED_MODULES and of the module own
    (the entry point's: train.py, eval.py), as JSON holds it."""
    modules = {name: importlib.import_module(name if name.startswith("lab.") else
                                             f"persuarena.{name}") for name in PINNED_MODULES}
    if own is not None:
        modules[Path(own.__file__).stem] = own
    pinned = {}
    for module_name, module in modules.items():
        for name, value in vars(module).items():
            if name.isupper() and not name.startswith("_") and not name.endswith(("_PATH", "_DIR")) \
                    and (held := _as_json(value)) is not None:
                pinned[f"{module_name}.{name}"] = held
    return pinned


def read_config(run_dir, who):
    """A run's config.json as a dict, or a one-line exit."""
    path = Path(run_dir) / "config.json"
    try:
        recorded = jsonl.loads(path.read_text())
        problem = None if isinstance(recorded, dict) else "not a JSON object"
    except (OSError, ValueError) as e:
        problem = type(e).__name__
    if problem:
        raise runs.say_error(who, f"--resume: {path} cannot be read ({problem}); restore it from a "
                             "copy, or start a new run (another --name)")
    return recorded


def recorded_constants(recorded):
    """A record's pinned constants under today's names (MOVED_CONSTANTS: a constant that moved
    between modules keeps its recorded value); {} when it holds none."""
    then = recorded.get("constants")
    if not isinstance(then, dict):
        return {}
    return {MOVED_CONSTANTS.get(k, k): v for k, v in then.items()}


def changed_constants(recorded, own=None):
    """The pinned constants that differ from those a run recorded (config.json "constants"),
    each as 'module.NAME VALUE here, VALUE in the run'."""
    now = pinned_constants(own)
    then = recorded_constants(recorded)
    return [f"{k} is {json.dumps(now.get(k))} here and {json.dumps(then.get(k))} in the run"
            for k in sorted(set(then) | set(now)) if k in then and then.get(k) != now.get(k)]


def _same_kind(value, like, item=None):
    """Whether a value read back from config.json has the type of the argument it stands for
    (a list: each item that of the argument's items, item, or of the default's own)."""
    if like is None:  # an argument with no default: checked by validation
        return True
    if isinstance(like, list):
        item = item if item is not None else (like[0] if like else None)
        return isinstance(value, list) and all(_same_kind(v, item) for v in value)
    if isinstance(like, bool):
        return isinstance(value, bool)
    if isinstance(like, int):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(like, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, type(like))


def _item_example(parser, key):
    """A value of the type of one item of a list argument (nargs, append), from its parser's
    type: what every item of a recorded list must be. None when the parser does not say."""
    action = next((a for a in getattr(parser, "_actions", ()) if a.dest == key), None)
    kind = getattr(action, "type", None)
    return {int: 0, float: 0.0, str: ""}.get(kind)


def choice_problem(parser, key, value, record):
    """What is wrong with a value read back from a record (config.json, settings.json, sweep.json)
    for the argument key, when the parser gives that argument choices: each value (each element
    of an appended list) must be one of them, as on a command line. None when it is."""
    action = next((a for a in parser._actions if a.dest == key and a.choices is not None), None)
    if action is None:
        return None
    values = value if isinstance(value, list) and isinstance(action.default, list) else [value]
    bad = [v for v in values if not any(v == c and type(v) is type(c) for c in action.choices)]
    if not bad or action.default is None and bad == [None]:
        return None
    flag = action.option_strings[-1] if action.option_strings else key
    return (f"{record} holds {json.dumps(key)}: {json.dumps(bad[0])}, not one of {flag}'s "
            f"choices ({', '.join(map(str, action.choices))})")


def _listed(names, most=6):
    names = sorted(names)
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def record_problem(recorded, keys, optional=(), own=None):
    """What makes a record (config.json, sweep.json) not the whole of what this program writes,
    or None: keys it lacks (a default would silently stand in for them: a run resumed at
    another lambda), keys it holds that this program never writes, and with "constants" among
    the keys, pinned constants missing from it or foreign to this code."""
    missing = set(keys) - recorded.keys()
    extra = recorded.keys() - set(keys) - set(optional)
    if "constants" in keys and isinstance(recorded.get("constants"), dict):
        now, then = pinned_constants(own), recorded_constants(recorded)
        missing |= {f"constants.{k}" for k in now.keys() - then.keys()}
        extra |= {f"constants.{k}" for k in then.keys() - now.keys()}
    elif "constants" in keys and "constants" in recorded:
        extra.add("constants (not an object)")
    parts = ([f"lacks {_listed(missing)}"] if missing else []) + \
        ([f"holds {_listed(extra)}, which it never records"] if extra else [])
    return " and ".join(parts) or None


def pin_settings(args, recorded, explicit, who, may_change=(), not_settings=(), record="config.json",
                 own=None, again="--resume", restart="start a new run (another --name)",
                 parser=None, keys=None, optional=()):
    """--resume: the settings of the run as recorded (config.json or settings.json; sweep.json
    for a sweep run again, `again` naming how in the messages, `restart` how to start over). A
    setting the command line leaves out takes the recorded value (which must have its argument's
    type, and, given the parser, be one of its argument's choices: choice_problem); one it names
    with another value is refused in one line naming each, except may_change; an edited pinned
    constant is refused in one line naming it. The caller then validates args as it does a fresh
    command line, before any model loads. Given keys (what a complete record holds, besides
    optional), a record with a key missing, extra or foreign is refused first (record_problem)."""
    if keys is not None and (problem := record_problem(recorded, keys, optional, own)):
        raise runs.say_error(who, f"{again}: {record} {problem}; it is the run's whole record, "
                             f"read as it is: restore it from a copy, or {restart}")
    if constants := changed_constants(recorded, own):
        raise runs.say_error(who, f"{again}: {'; '.join(constants)}; a resumed run keeps the "
                             f"objective it was trained with: restore the constant, or {restart}")
    changed = []
    for key, value in recorded.items():
        if key in not_settings or key == "constants" or not hasattr(args, key):
            continue
        flag = f"--{key.replace('_', '-')}"
        if key not in explicit:
            item = _item_example(parser, key)
            if not _same_kind(value, getattr(args, key), item):
                kind = type(getattr(args, key)).__name__ + (f" of {type(item).__name__}" if isinstance(
                    getattr(args, key), list) and item is not None else "")
                raise runs.say_error(who, f"{again}: {record} holds {flag} {json.dumps(value)}, "
                                     f"not a {kind}; fix it there, or {restart}")
            if parser is not None and (problem := choice_problem(parser, key, value, record)):
                raise runs.say_error(who, f"{again}: {problem}; fix it there, or {restart}")
            setattr(args, key, value)
        elif json.dumps(getattr(args, key)) != json.dumps(value) and key not in may_change:
            changed.append(f"{flag} {getattr(args, key)} (the run has {value})")
    if changed:
        may = ", ".join(f"--{k.replace('_', '-')}" for k in may_change)
        raise runs.say_error(who, f"{again} keeps the run's settings, and {', '.join(changed)} would "
                             f"change them; drop them{f' (only {may} may change)' if may else ''}, "
                             f"or {restart}")


def explicit_settings(parser, argv, known=False):
    """The settings a command line names (not left to their defaults): a namespace that
    already holds an attribute keeps argparse from writing the default into it. known: the
    arguments the parser does not know are left aside (parse_known_args), as lab.sweep passes
    them on."""
    unset = object()
    parse = (lambda *a, **kw: parser.parse_known_args(*a, **kw)[0]) if known else parser.parse_args
    parsed = parse(argv)
    names = {k for k, v in vars(parsed).items() if not isinstance(v, list)}
    probe = parse(argv, namespace=argparse.Namespace(**dict.fromkeys(names, unset)))
    return {k for k, v in vars(probe).items() if v is not unset and
            (k in names or v != parser.get_default(k))}


# -----------------------------------------------------------------------------
# the flags every entry point shares


def add_sampling_flags(parser):
    """--sampling (a preset of rollout.SAMPLING) and the four flags that override it, recorded in
    every run's config.json or settings.json and summary.json."""
    parser.add_argument("--sampling", choices=tuple(rollout.SAMPLING), default=None,
                        help="rollout.SAMPLING preset of both roles (default: the run's own)")
    parser.add_argument("--persuader-temperature", type=float,
                        help="default: the preset's (no top-k/top-p: exact pi_old)")
    parser.add_argument("--persuadee-temperature", type=float, help="default: the preset's")
    parser.add_argument("--persuadee-top-p", type=float, help="default: the preset's")
    parser.add_argument("--persuadee-top-k", type=int, help="default: the preset's")


def role_sampling(args) -> tuple:
    """(persuader, persuadee) engine.Sampling of a run: its --sampling preset (rollout.SAMPLING),
    each value a flag names (add_sampling_flags) overriding it."""
    persuader, persuadee = rollout.SAMPLING[args.sampling]
    pick = lambda flag, preset: preset if flag is None else flag
    return (persuader._replace(temperature=pick(args.persuader_temperature, persuader.temperature)),
            persuadee._replace(temperature=pick(args.persuadee_temperature, persuadee.temperature),
                               top_p=pick(args.persuadee_top_p, persuadee.top_p),
                               top_k=pick(args.persuadee_top_k, persuadee.top_k)))


def sampling_problem(args):
    """What is wrong with the sampling flags, as (flag, problem, fix), or None. A persuader
    preset that truncates (top_p, top_k) is refused: the loss takes the whole tempered
    distribution's log-probs, so the rollout would be off-policy without a word."""
    persuader = rollout.SAMPLING[args.sampling][0] if args.sampling in rollout.SAMPLING else None
    if persuader is not None and (persuader.top_p not in (None, 1.0) or persuader.top_k):
        return (f"--sampling {args.sampling}", f"gives the persuader top_p {persuader.top_p}, top_k "
                f"{persuader.top_k} (rollout.SAMPLING), which the loss cannot follow (it scores the "
                "whole tempered distribution: off-policy)", "set the persuader's top_p and top_k "
                "there to None; truncate only the persuadee's")
    for flag, value, example in (("--persuader-temperature", args.persuader_temperature, 1.0),
                                 ("--persuadee-temperature", args.persuadee_temperature, 0.7)):
        low, high = TEMPERATURE_RANGE
        if value is not None and value != 0 and not low <= value <= high:
            return (f"{flag} {value}", f"must be 0 (greedy) or lie in [{low:g}, {high:g}] (nearer 0 "
                    "or infinity it samples greedily or uniformly in all but name, and a "
                    "persuader trains nothing: KL 0 every step)", f"pass e.g. {flag} {example}")
    if args.persuadee_top_p is not None and not 0 < args.persuadee_top_p <= 1:
        return (f"--persuadee-top-p {args.persuadee_top_p}", "must lie in (0, 1]",
                "pass e.g. --persuadee-top-p 0.8")
    if args.persuadee_top_k is not None and args.persuadee_top_k < 1:
        return (f"--persuadee-top-k {args.persuadee_top_k}", "must be at least 1",
                "pass e.g. --persuadee-top-k 20")
    return None


def add_decision_flag(parser):
    """--decision (default rollout.DECISION), passed to rollout_episodes as decision=."""
    parser.add_argument("--decision", choices=arena.DECISION_SOURCES, default=rollout.DECISION,
                        help="the persuadee's decision: its reply's tag (the paper's), or read "
                             "from its next-token probabilities in a fork after each reply "
                             "(logit: for persuadees too small to write tags)")


def fill_sampling(args):
    """The four sampling flags a command line leaves out, from its preset (rollout.SAMPLING):
    what config.json records and every rollout of the run, its evaluations included, uses."""
    persuader, persuadee = rollout.SAMPLING[args.sampling]
    defaults = dict(persuader_temperature=persuader.temperature,
                    persuadee_temperature=persuadee.temperature, persuadee_top_p=persuadee.top_p,
                    persuadee_top_k=persuadee.top_k)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def model_problem(name, _seen=()):
    """What is wrong with a model argument, or None (a hub name cannot be checked offline). A
    LoRA adapter folder is checked whole (adapter_chain_problem); _seen: the adapter folders
    whose bases led here."""
    if not isinstance(name, str):
        return "is not a model name"
    if name == "smollm2":
        return None
    if name.startswith("random:"):
        known = models.RANDOM_CONFIGS
        return None if models.random_spec(name) else (f"names no random shape (random:NAME or "
                                                      f"random:NAME@SEED, NAME one of {', '.join(known)})")
    path = Path(name).expanduser()
    if lora.is_adapter(path):
        return adapter_chain_problem(path, _seen)
    if path.exists():
        return None if (path / "config.json").is_file() else \
            "is a path but not a model folder (no config.json)"
    if name.startswith(("/", ".", "~")) or name.count("/") > 1:
        return "is no such folder"
    return None


def local_config(name):
    """A model's config with no weight read and nothing downloaded (lab/shapes.py's, where it
    needs no hub), or None for a hub model not in this machine's cache."""
    from transformers import AutoConfig
    path = Path(name).expanduser()
    if (name.startswith("random:") or name in shapes.KNOWN_SHAPES or lora.is_adapter(path)
            or (path / "config.json").is_file()
            or name == "smollm2" and (gguf.smollm2_folder() / "config.json").is_file()):
        return shapes.model_config(name)
    try:
        return AutoConfig.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError):
        return None


def adapter_chain_problem(folder, seen=()):
    """What is wrong with a LoRA adapter folder, in one line, before any weight loads, or None:
    its adapter_config.json (lora.read_adapter_config), its base (named, not itself nor an
    adapter whose bases lead back to it, and a model model_problem accepts), and its weights
    against the base's config (lora.adapter_problem). An adapter that changes nothing is
    warned about on stderr."""
    record, problem = lora.read_adapter_config(folder)
    if problem:
        return f"is an adapter folder whose {problem}; restore the file from its run"
    base = record.get("base_model_name_or_path")
    if not isinstance(base, str) or not base.strip():
        return (f"is an adapter folder whose {lora.ADAPTER_CONFIG} names no base model "
                f"(base_model_name_or_path {json.dumps(base)}); set it to the model it was trained on")
    chain = (*seen, Path(folder).expanduser().resolve())
    if lora.is_adapter(base) and Path(base).expanduser().resolve() in chain:
        loop = "is itself" if Path(base).expanduser().resolve() == chain[-1] else \
            "leads back to it (a loop of adapters)"
        return (f"is an adapter folder whose base {base} {loop}; set base_model_name_or_path in "
                f"its {lora.ADAPTER_CONFIG} to the model it was trained on")
    if problem := model_problem(base, chain):
        return f"is an adapter folder whose base {base} {problem}"
    try:
        config = local_config(base)
    except (OSError, ValueError) as e:
        return f"is an adapter folder whose base {base} has no readable config ({type(e).__name__})"
    problem, warning = lora.adapter_problem(folder, record, config)
    if warning:
        print(f"warning: the adapter folder {folder}: {warning}", file=sys.stderr)
    return problem and f"is an adapter folder whose {problem}; pass another checkpoint"


# -----------------------------------------------------------------------------
# train.py's command line


def fail(flag, problem, fix):
    raise SystemExit(f"train.py: {flag} {problem}; {fix}")


def new_parser(prog, doc):
    """The parser of an entry point, named as it is run (python -m lab.NAME for the package's),
    described by the first paragraph of its docstring."""
    return argparse.ArgumentParser(prog=prog, description=doc.strip().split("\n\n")[0],
                                   formatter_class=HelpFormatter)


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Every entry point's help: the description as written, each option's default shown
    (where there is one and its help does not already say it)."""

    def _get_help_string(self, action):
        if action.default in (None, False, argparse.SUPPRESS) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def train_parser(own):
    """train.py's flags; own: the train module (its docstring, its SEED)."""
    seed = own.SEED
    p = new_parser("train.py", own.__doc__)
    p.add_argument("--preset", choices=presets.PRESETS, default=None,
                   help="paper on CUDA, cpu otherwise; every value below overrides it")
    for key, what in (("persuader", "the policy trained: random:NAME, smollm2, Qwen/..., a folder"),
                      ("persuadee", "the frozen persuadee: a model name as --persuader, or "
                                    "openai:MODEL@URL"),
                      ("dtype", "the weights' dtype: float32 or bfloat16")):
        p.add_argument(f"--{key}", help=f"{what} (default: the preset's)")
    p.add_argument("--judge", help="judge model (default: the persuadee's); 'none' gives s = 0")
    for key in ("steps", "instances", "group_size", "t_max", "eval_t_max", "max_new_tokens",
                "micro_batch", "eval_every", "eval_limit", "save_every", "lr", "updates_per_batch"):
        # the default: the constant that owns it (presets.OWNERS; train.py's paper numbers, rpo's)
        p.add_argument(f"--{key.replace('_', '-')}", dest=key, default=presets.owned(key),
                       type=float if key == "lr" else int, help=f"default {presets.OWNERS[key]}")
    p.add_argument("--eval-fidelity", type=int, help="read-outs of each held-out evaluation checked "
                   "against transformers' forward (default eval.FIDELITY_SAMPLES; 0 skips the check, "
                   "which changes no result: the persuadee is frozen, one check covers the run)")
    p.add_argument("--activation-checkpointing", choices=("auto", "on", "off"),
                   default=plan.ACTIVATION_CHECKPOINTING, help="recompute the update's "
                   "activations in the backward pass (auto: on for CUDA, off on a CPU)")
    p.add_argument("--lora", type=int, help="train rank-RANK LoRA adapters on a frozen base "
                   "(models.py, LoRA) instead of every weight; 0: full fine-tuning")
    # rpo.py owns these; read at parse time, so an edited constant changes the run
    p.add_argument("--lam", type=float, default=rpo.LAMBDA, help="the dense term's weight "
                   "lambda in A = A_out + lambda (D - mean D) (rpo.LAMBDA); 0: plain GRPO")
    p.add_argument("--anchor", action=argparse.BooleanOptionalAction, default=rpo.ANCHOR,
                   help="the terminal anchor on the dense return (rpo.ANCHOR; DECISIONS.md)")
    probes.add_flags(p)
    p.add_argument("--kl-beta", type=float, default=rpo.KL_BETA,
                   help="the k3 KL penalty's weight (rpo.KL_BETA)")
    p.add_argument("--clip-low", type=float, default=rpo.CLIP_LOW,
                   help="the surrogate's lower clip, 1 - eps_low (rpo.CLIP_LOW)")
    p.add_argument("--clip-high", type=float, default=rpo.CLIP_HIGH,
                   help="the surrogate's upper clip, 1 + eps_high (rpo.CLIP_HIGH)")
    add_sampling_flags(p)
    p.add_argument("--seed", type=int, default=seed, help="the run's seed (train.SEED): weights' "
                   "initial draws, instance order and every sampling stream")
    add_decision_flag(p)
    p.add_argument("--name", default=None, help="run folder runs/NAME (default: preset and time)")
    p.add_argument("--out", default="runs", help="the folder of run folders")
    p.add_argument("--resume", action="store_true", help="continue runs/NAME from its checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace an existing runs/NAME")
    p.add_argument("--scenarios", default=arena.SCENARIOS_PATH, help="the scenarios file "
                   "(its training split is expanded into instances)")
    p.add_argument("--log", action="append", choices=loggers.LOGGERS, default=[],
                   help="also log to TensorBoard (runs/NAME), Weights & Biases or trackio; "
                        "repeatable")
    p.add_argument("--plan", action="store_true", help="print the per-rank memory plan for "
                   "--plan-ranks GPUs of --plan-gib and exit; no model loads")
    p.add_argument("--plan-ranks", type=int, default=None,
                   help=f"default: WORLD_SIZE under torchrun, this node's GPUs, else the preset's "
                   f"(this CPU for cpu and tiny, else {plan.PLAN_NODE[0]}; plan.print_plan)")
    p.add_argument("--plan-gib", type=float, default=None,
                   help=f"default: this GPU's memory, else {plan.PLAN_NODE[1]} (an H200)")
    served.add_key_flag(p)
    return p


def train_args(argv, own):
    """train.py's settings (own: the train module, whose SEED is --seed's default and whose
    constants are pinned with the method's): the command line over its preset (over the owning
    constants); with --resume the run's config.json over the preset, pinned. Every value is
    validated before any model loads, the values read back from config.json as a fresh command
    line's are."""
    p = train_parser(own)
    preset = p.parse_args(argv).preset or ("paper" if torch.cuda.is_available() else "cpu")
    p.set_defaults(**presets.preset(preset), preset=preset)  # the preset's over the constants'
    args = p.parse_args(argv)
    if (presets.PRESETS[preset].get("dtype") == "machine" and "dtype" not in explicit_settings(p, argv)
            and not args.resume and os.environ.get("RANK", "0") == "0"):
        print(presets.dtype_note(args.dtype))  # the machine's dtype, and why
    if unknown := set(own.NONFINITE_CHECKS) - set(NONFINITE_NAMES):
        raise SystemExit(f"train.py: train.NONFINITE_CHECKS names {', '.join(sorted(unknown))}, "
                         f"which no step measures; keep only names of {', '.join(NONFINITE_NAMES)}")
    args.name = args.name or f"{args.preset}-{time.strftime('%Y%m%d-%H%M%S')}"
    fill_sampling(args)
    run_dir = Path(args.out) / args.name
    runs.check_folder(args.out, args.name, "train.py", args.resume, args.overwrite,
                      first=os.environ.get("RANK", "0") == "0")
    if args.resume:
        checkpoints.checkpoint_folder(run_dir)
        pin_settings(args, read_config(run_dir, "train.py"), explicit_settings(p, argv),
                     "train.py", RESUME_MAY_CHANGE, NOT_SETTINGS, record=str(run_dir / "config.json"),
                     own=own, parser=p, keys=config_keys(args), optional=CONFIG_OPTIONAL)
    try:
        validate(args)
    except SystemExit as e:
        raise SystemExit(f"{e.code} (the value read from {run_dir / 'config.json'})"
                         if args.resume else e.code) from None
    for kind in args.log:  # before any model loads: a missing package is a one-line exit
        loggers.require(kind)
    return args


def validate(args):
    """Every argument checked before any model loads; one line naming the flag and the fix."""
    for key in POSITIVE:
        if getattr(args, key) < 1:
            fail(f"--{key.replace('_', '-')} {getattr(args, key)}", "must be at least 1",
                 f"pass a positive number, e.g. --{key.replace('_', '-')} {presets.preset_values('tiny')[key]}")
    for key, most in UPPER.items():
        if getattr(args, key) > most:
            fail(f"--{key.replace('_', '-')} {getattr(args, key)}", f"is above {most} "
                 "(cli.UPPER)", f"pass e.g. --{key.replace('_', '-')} "
                                f"{presets.preset_values('paper')[key]}")
    if not 0 <= args.seed <= SEED_MAX:
        fail(f"--seed {args.seed}", f"must lie in 0..{SEED_MAX}", "pass e.g. --seed 0")
    if args.instances > arena.N_TRAIN_INSTANCES:
        fail(f"--instances {args.instances}", f"exceeds the {arena.N_TRAIN_INSTANCES} training "
             "instances", f"pass at most --instances {arena.N_TRAIN_INSTANCES}")
    if args.eval_every < 0:
        fail(f"--eval-every {args.eval_every}", "is negative", "pass 0 (no evaluation) or a number of steps")
    if args.eval_fidelity is not None and args.eval_fidelity < 0:
        fail(f"--eval-fidelity {args.eval_fidelity}", "is negative", "pass 0 (no check) or a number of read-outs")
    if args.dtype not in DTYPES:
        fail(f"--dtype {args.dtype}", "is not a dtype this loop runs", f"pass one of {', '.join(DTYPES)}")
    for flag, value, example in (("--lr", args.lr, 1e-6), ("--lam", args.lam, rpo.LAMBDA),
                                 ("--kl-beta", args.kl_beta, rpo.KL_BETA),
                                 ("--clip-high", args.clip_high, rpo.CLIP_HIGH)):
        if not math.isfinite(value) or value < 0:
            fail(f"{flag} {value}", "must be a finite number >= 0", f"pass e.g. {flag} {example}")
    if args.lam > LAM_MAX:
        fail(f"--lam {args.lam}", f"is above {LAM_MAX:g} (the dense term would drown the outcome "
             "reward)", f"pass e.g. --lam {rpo.LAMBDA}")
    if not (math.isfinite(args.clip_low) and 0 <= args.clip_low < 1):
        fail(f"--clip-low {args.clip_low}", "must lie in [0, 1) (the ratio is clipped at 1 - clip-low)",
             f"pass e.g. --clip-low {rpo.CLIP_LOW}")
    if problem := sampling_problem(args):
        fail(*problem)
    for role in ("persuader", "persuadee", "judge"):
        name = getattr(args, role)
        if name in (None, "none") and role == "judge" or served.is_served(name) and role != "persuader":
            continue  # a served persuadee or judge is checked at start-up (ServedModel.check)
        if problem := model_problem(name):
            fail(f"--{role} {name}", problem, MODEL_FIX)
    if (args.lora or 0) < 0:
        fail(f"--lora {args.lora}", "must be >= 0", "pass a rank such as --lora 8, or 0 for full fine-tuning")
    if problem := input_problem(args, validate_scenarios(args)):
        fail(*problem)
    if args.group_size == 1:
        print("train.py: warning: --group-size 1 leaves every group without a baseline: no outcome "
              "advantage, only the dense term trains (pass --group-size 2 or more)", file=sys.stderr)


def validate_scenarios(args):
    """The scenarios file reads, and holds the splits this run plays."""
    try:
        scenarios = arena.load_scenarios(args.scenarios)
    except OSError as e:
        fail(f"--scenarios {args.scenarios}", f"cannot be read ({e.strerror or e})",
             "pass a readable scenarios.jsonl")
    except (ValueError, TypeError) as e:
        fail("--scenarios", f"is not a valid scenarios file ({e})", "fix that line")
    for split, needed in (("train", True), ("heldout", args.eval_every > 0)):
        if needed and not any(s["split"] == split for s in scenarios):
            fail(f"--scenarios {args.scenarios}", f"holds no {split} scenarios",
                 "add some, or pass a file that has them" + (" (or --eval-every 0)"
                                                                  if split == "heldout" else ""))
    return scenarios


def input_problem(args, scenarios):
    """(flag, problem, fix) for a plan size that is no size or a training file that cannot give
    the run its N_TRAIN_INSTANCES distinct instances, else None."""
    if args.plan_gib is not None and not (math.isfinite(args.plan_gib) and 0 < args.plan_gib <= PLAN_GIB_MAX):
        return (f"--plan-gib {args.plan_gib}", f"must be a finite number of GiB > 0 and at most "
                f"{PLAN_GIB_MAX:.0f} (a PiB)", "pass e.g. --plan-gib 80")
    if args.plan_ranks is not None and args.plan_ranks < 1:
        return f"--plan-ranks {args.plan_ranks}", "must be at least 1", "pass e.g. --plan-ranks 8"
    if problem := arena.variants_problem(scenarios):
        return f"--scenarios {args.scenarios}", problem, "add training scenarios, or vary the personas"
    return None


def config_keys(args):
    """The keys of a run's config.json (record_config): every setting, the constants it pins,
    and how many training instances it skipped."""
    return (set(vars(args)) - {"resume", "overwrite"}) | {"constants", "skipped_instances"}


def record_config(run_dir, args, start, own=None):
    """config.json: the settings of a new run and the constants it pins
    (pinned_constants); on a resume the recorded file, with the RESUME_MAY_CHANGE settings
    that changed listed under "resumed" (and said), else untouched."""
    path = run_dir / "config.json"
    if not args.resume:
        config = {k: v for k, v in vars(args).items() if k not in ("resume", "overwrite")}
        return runs.write_atomic(path, json.dumps({**config, "constants": pinned_constants(own)},
                                                  indent=2), who="train.py",
                                 kept="nothing was trained yet")
    config = jsonl.loads(path.read_text())
    changes = {k: [config.get(k), getattr(args, k)] for k in RESUME_MAY_CHANGE
               if json.dumps(config.get(k)) != json.dumps(getattr(args, k))}
    if changes:
        print(f"train.py: resuming at step {start} with " + ", ".join(
            f"--{k.replace('_', '-')} {new} (was {old})" for k, (old, new) in changes.items()))
        config.update({k: new for k, (_, new) in changes.items()})
        config.setdefault("resumed", []).append(dict(step=start, changed=changes))
        runs.write_atomic(path, json.dumps(config, indent=2), who="train.py", kept=f"{path} is as it was")


def against_paper(args):
    """What a LoRA run or the one-gpu preset trades against the paper preset, for --plan."""
    if not args.lora and args.preset != "one-gpu":
        return []
    paper, world = presets.preset_values("paper"), args.plan_ranks or 1
    episodes = args.instances * args.group_size
    full = paper["instances"] * paper["group_size"]
    return [f"against the paper preset (8 GPUs, full fine-tuning): LoRA rank {args.lora} on a "
            f"frozen {args.dtype} base (the reference: adapter off), lr {args.lr:g} (paper "
            f"{paper['lr']:g}); {episodes} episodes a step (paper {full}: "
            f"{episodes / full:.3g}x the batch), {args.steps} steps, {episodes * args.steps:,} "
            f"episodes in all (paper {full * paper['steps']:,}); held-out check on "
            f"{args.eval_limit} scenarios (paper {paper['eval_limit']}); {world} rank(s), "
            "data parallel"]
