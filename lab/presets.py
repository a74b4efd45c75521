"""
presets.py: the named settings of a training run (train.py --preset NAME), each a table of only
what differs from the constants that own the values.

Every numeric setting has a constant that owns it and is its flag's default (OWNERS: the paper's
numbers in train.py, e.g. train.GROUP_SIZE 8, train.LR 1e-6; turns and message length in
arena.T_MAX_TRAIN, arena.T_MAX_EVAL, engine.MAX_NEW_TOKENS); a preset holds what it changes and
no constant's own value (tests/test_train.py checks it: repeats). preset_notes names every value
a run takes from its preset over a constant, and train.py prints them before its first step, e.g.

    t_max 2 (cpu preset; arena.T_MAX_TRAIN 6)

eval.py on a CPU takes the cpu preset's message length and judge (laptop_settings), so training
and evaluation on a laptop agree.

The cpu preset's dtype follows the machine (cpu_dtype): bfloat16 where the CPU has bf16 product
units (AVX512_BF16 or AMX on x86, bf16 on Arm, read from /proc/cpuinfo's flags; CPU_BF16, or
else the environment's PERSUARENA_CPU_BF16=0/1, overrides the detection), else float32; train.py and eval.py print which and why, and
`--dtype float32` runs the float32 path (DECISIONS.md: The CPU's dtype).

    python train.py --preset tiny      # tiny random models, seconds a step
"""
import importlib
import os
import sys
from pathlib import Path

CPU_BF16 = None                     # None: detect the CPU's bf16 units; True / False: as if found / not
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # /proc/cpuinfo flags of bf16 product units:
# x86's AVX512_BF16 and AMX, Arm's FEAT_BF16 (its "Features" line); a name is no evidence
CPUINFO_PATH = "/proc/cpuinfo"
CPU_BF16_ENV = "PERSUARENA_CPU_BF16"  # 0 / 1 in the environment: as CPU_BF16 False / True, for a
# run and every process it starts (the test suite sets 0: the float32 path on any machine)
DEFAULT_SAMPLING = "paper"  # the rollout.SAMPLING entry a run samples with unless one is picked
LORA_RANK = 64                      # --preset one-gpu's adapter rank (train.py --lora)
PRESETS = {  # the models, their dtype and sampling, and what differs from the owning constants
    "paper": dict(persuader="Qwen/Qwen3-4B-Instruct-2507", persuadee="Qwen/Qwen3-14B",
                  dtype="bfloat16", sampling="paper"),
    # cpu: SmolLM2-135M as judge wrote a verdict for 1 transcript in 56, a copy of the answer
    # template, at 30% of the step (DECISIONS.md: Small presets' judge): no judge, s = 0
    "cpu": dict(persuader="smollm2", persuadee="smollm2", judge="none", dtype="machine", steps=3,
                instances=2, group_size=4, lr=1e-5, updates_per_batch=2, eval_every=0, eval_limit=4,
                save_every=1, sampling="cpu", t_max=2, eval_t_max=3, max_new_tokens=32),  # ~40 s a step
    # tiny: a random judge never writes a verdict (s falls back to 0 on every transcript, after
    # four attempts): no judge gives the same s = 0 at no cost (DECISIONS.md: Small presets' judge)
    "tiny": dict(persuader="random:tiny-llama", persuadee="random:tiny-qwen3", judge="none",
                 dtype="float32", steps=4, instances=2, group_size=2, lr=1e-3, micro_batch=2,
                 updates_per_batch=2, eval_every=0, eval_limit=2, save_every=2, sampling="paper",
                 t_max=2, eval_t_max=2, max_new_tokens=4),  # tiny random models
}
# one-gpu's evaluation: 16 of the 20 domain x resistance cells (arena.stratified); 20 would
# leave under 15% of an H200 spare (lab/plan.py)
PRESETS["one-gpu"] = dict(  # the paper's models and sampling on one H200, LoRA (README: Train, One GPU)
    PRESETS["paper"], lora=LORA_RANK, lr=1e-5, instances=2, micro_batch=2, eval_limit=16,
    plan_ranks=1)
# the settings a constant owns (its flag's default): setting -> "module.CONSTANT"
OWNERS = {"steps": "train.STEPS", "instances": "train.INSTANCES", "group_size": "train.GROUP_SIZE",
          "lr": "train.LR", "micro_batch": "train.MICRO_BATCH",
          "updates_per_batch": "rpo.UPDATES_PER_BATCH", "eval_every": "train.EVAL_EVERY",
          "eval_limit": "train.EVAL_LIMIT", "save_every": "train.SAVE_EVERY",
          "t_max": "arena.T_MAX_TRAIN", "eval_t_max": "arena.T_MAX_EVAL",
          "max_new_tokens": "engine.MAX_NEW_TOKENS"}


def bf16_units(path=None):
    """The bf16 product flags this CPU lists (BF16_FLAGS found in /proc/cpuinfo's flags or
    Features lines), () where it lists none or the file is missing (not Linux)."""
    try:
        with open(path or CPUINFO_PATH) as f:
            lines = [line for line in f if line.split(":")[0].strip() in ("flags", "Features")]
    except OSError:
        return ()
    found = {flag for line in lines for flag in line.split(":", 1)[-1].split()}
    return tuple(flag for flag in BF16_FLAGS if flag in found)


def cpu_dtype():
    """(dtype, why) a CPU run takes by default: bfloat16 where the CPU has bf16 product units
    (bf16_units, or CPU_BF16 True), else float32."""
    if CPU_BF16 is not None:
        return ("bfloat16" if CPU_BF16 else "float32"), f"lab.presets.CPU_BF16 {CPU_BF16}"
    if (said := os.environ.get(CPU_BF16_ENV)) is not None:
        if said not in ("0", "1"):
            raise SystemExit(f"lab.presets: {CPU_BF16_ENV}={said!r} in the environment; set it "
                             "to 0 (float32) or 1 (bfloat16), or unset it to detect the CPU's units")
        return ("bfloat16" if said == "1" else "float32"), f"{CPU_BF16_ENV}={said}"
    units = bf16_units()
    if units:
        return "bfloat16", f"this CPU has bf16 product units: {', '.join(units)}"
    return "float32", "this CPU lists no bf16 product units (avx512_bf16, amx_bf16, bf16)"


def dtype_note(dtype):
    """The line a CPU run prints when it takes the machine's dtype, e.g. "dtype bfloat16 (this CPU
    has bf16 product units: avx512_bf16; --dtype float32 for the float32 path)"."""
    other = "float32" if dtype == "bfloat16" else "bfloat16"
    return f"dtype {dtype} ({cpu_dtype()[1]}; --dtype {other} for the {other} path)"


def _module(name):
    """A method's module by name (the package persuarena's); train.py run as a script is
    __main__ (not imported twice)."""
    main = sys.modules.get("__main__")
    if main is not None and Path(getattr(main, "__file__", None) or "").stem == name:
        return main
    return importlib.import_module(f"persuarena.{name}")


def owned(setting):
    """The value of the constant that owns a setting, as it is now."""
    module, name = OWNERS[setting].split(".")
    return getattr(_module(module), name)


def preset(name):
    """A preset's table, its dtype "machine" read as this CPU's (cpu_dtype)."""
    table = PRESETS[name]
    return {**table, "dtype": cpu_dtype()[0]} if table.get("dtype") == "machine" else table


def preset_values(name):
    """Every value of a preset: the owned defaults, then the preset's own (its overrides)."""
    return {**{k: owned(k) for k in OWNERS}, **preset(name)}


def repeats():
    """The preset values that repeat their constant's own value ("preset.setting"): a preset
    holds only what differs (an edit of the constant would then not reach that preset)."""
    return [f"{name}.{k} {v!r} (= {OWNERS[k]})" for name, preset in PRESETS.items()
            for k, v in preset.items() if k in OWNERS and v == owned(k)]


def preset_notes(args, explicit=()):
    """One line per value the run takes from its preset where the preset overrides the constant
    that owns it, e.g. "t_max 2 (cpu preset; arena.T_MAX_TRAIN 6)"; values the command line
    names (explicit) are the user's own and not listed."""
    preset = PRESETS[args.preset]
    notes = [f"{k} {preset[k]} ({args.preset} preset; {OWNERS[k]} {owned(k)})"
             for k in OWNERS if k in preset and k not in explicit and preset[k] != owned(k)
             and getattr(args, k, None) == preset[k]]
    picked = preset.get("sampling", DEFAULT_SAMPLING)
    if picked != DEFAULT_SAMPLING and "sampling" not in explicit and args.sampling == picked:
        notes.append(sampling_note(picked, f"{args.preset} preset"))
    return notes


def sampling_note(entry, why):
    """The line that names a rollout.SAMPLING entry a preset or eval.py picks over the default
    one, with the values that differ."""
    table = _module("rollout").SAMPLING
    differ = [f"{role} {field} {mine} ({theirs})" for role, a, b in zip(
        ("persuader", "persuadee"), table[entry], table[DEFAULT_SAMPLING])
        for field, mine, theirs in zip(a._fields, a, b) if mine != theirs]
    return (f"sampling {entry} ({why}; rollout.SAMPLING[{DEFAULT_SAMPLING!r}] by default): "
            + (", ".join(differ) or "the same values"))


def laptop_settings():
    """What eval.py uses on a CPU when its flags leave them out: the cpu preset's message length
    and judge (one source for a laptop's training and evaluation)."""
    cpu = PRESETS["cpu"]
    return dict(max_new_tokens=cpu["max_new_tokens"], judge=cpu["judge"])
