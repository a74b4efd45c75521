"""
presets.py: the named settings of a training run (train.py --preset NAME), each a table of
overrides of the constants that own the values.

A preset's value for turns and tokens a message comes from the constant that owns it
(OWNERS: arena.T_MAX_TRAIN, arena.T_MAX_EVAL, engine.MAX_NEW_TOKENS), read when the arguments
are parsed, unless the preset overrides it; preset_notes names every override that differs from
its constant, and train.py prints them before its first step, e.g.

    t_max 2 (cpu preset; arena.T_MAX_TRAIN 6)

eval.py on a CPU takes the cpu preset's message length and judge (cpu_defaults), so training
and evaluation on a laptop agree.

    python train.py --preset tiny      # tiny random models, seconds a step
"""
import importlib

LORA_RANK = 64                      # --preset one-gpu's adapter rank (train.py --lora)
PRESETS = {
    "paper": dict(persuader="Qwen/Qwen3-4B-Instruct-2507", persuadee="Qwen/Qwen3-14B",
                  judge=None, dtype="bfloat16", steps=200, instances=16, group_size=8, lr=1e-6,
                  micro_batch=4, eval_every=20, eval_limit=120, save_every=20, sampling="paper"),
    # cpu: SmolLM2-135M as judge wrote a verdict for 1 transcript in 56, a copy of the answer
    # template, at 30% of the step (DECISIONS.md: Small presets' judge): no judge, s = 0
    "cpu": dict(persuader="smollm2", persuadee="smollm2", judge="none", dtype="float32", steps=3,
                instances=2, group_size=4, lr=1e-5, micro_batch=4, eval_every=0, eval_limit=4,
                save_every=1, sampling="cpu",
                t_max=2, eval_t_max=3, max_new_tokens=32),  # overrides: a CPU step in about 40 s
    # tiny: a random judge never writes a verdict (s falls back to 0 on every transcript, after
    # four attempts): no judge gives the same s = 0 at no cost (DECISIONS.md: Small presets' judge)
    "tiny": dict(persuader="random:tiny-llama", persuadee="random:tiny-qwen3", judge="none",
                 dtype="float32", steps=4, instances=2, group_size=2, lr=1e-3, micro_batch=2,
                 eval_every=0, eval_limit=2, save_every=2, sampling="paper",
                 t_max=2, eval_t_max=2, max_new_tokens=4),  # overrides: tiny random models
}
# one-gpu's evaluation: 16 of the 20 domain x resistance cells (arena.stratified); 20 would
# leave under 15% of an H200 spare (lab/plan.py)
PRESETS["one-gpu"] = dict(  # the paper's models and sampling on one H200, LoRA (README: Train with LoRA on one GPU)
    PRESETS["paper"], lora=LORA_RANK, lr=1e-5, instances=2, micro_batch=2, eval_limit=16,
    plan_ranks=1)
# the preset values another module's constant owns: setting -> "module.CONSTANT"
OWNERS = {"t_max": "arena.T_MAX_TRAIN", "eval_t_max": "arena.T_MAX_EVAL",
          "max_new_tokens": "engine.MAX_NEW_TOKENS"}


def owned(setting):
    """The value of the constant that owns a setting, as it is now."""
    module, name = OWNERS[setting].split(".")
    return getattr(importlib.import_module(module), name)


def preset_values(name):
    """Every value of a preset: the owned defaults, then the preset's own (its overrides)."""
    return {**{k: owned(k) for k in OWNERS}, **PRESETS[name]}


def preset_notes(args, explicit=()):
    """One line per value the run takes from its preset where the preset overrides the constant
    that owns it, e.g. "t_max 2 (cpu preset; arena.T_MAX_TRAIN 6)"; values the command line
    names (explicit) are the user's own and not listed."""
    preset = PRESETS[args.preset]
    return [f"{k} {preset[k]} ({args.preset} preset; {OWNERS[k]} {owned(k)})"
            for k in OWNERS if k in preset and k not in explicit and preset[k] != owned(k)
            and getattr(args, k, None) == preset[k]]


def cpu_defaults():
    """What eval.py uses on a CPU when its flags leave them out: the cpu preset's message length
    and judge (one source for a laptop's training and evaluation)."""
    cpu = PRESETS["cpu"]
    return dict(max_new_tokens=cpu["max_new_tokens"], judge=cpu["judge"])
