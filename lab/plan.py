"""
plan.py: the memory plan. What one rank of a training run holds, from the models' configs alone
(no weight is read), so that a run that cannot fit is refused before anything loads.

Per rank, for a policy of P parameters (fp32 master weights, gradients and AdamW's two moments,
sharded over the ranks by FSDP2), a frozen reference, a persuadee and a judge (in --dtype), each
engine's KV pool and decode memory, and one micro-batch of activations:

    total = 16 P / world + (dtype copies of the weights) + sum_engines (KV pool + decode memory)
            + activations + PLAN_RESERVED_GIB,      headroom = capacity - total

KV per token = 2 (keys, values) x layers x kv_heads x head_dim x itemsize; a pool holds the
contexts in play (prompt + T_max turns of two messages) with PLAN_POOL_MARGIN to spare.

    python train.py --plan                                   # this machine, or 8 x H200 off-GPU
    python train.py --preset paper --plan --plan-gib 40      # refused, with the numbers

The disk a run folder takes at its fullest (disk_plan): the fp32 weights of every evaluated step
and of the latest two checkpoints, and AdamW's state of only those two (checkpoints.save_checkpoint keeps
no other); a run whose disk cannot hold it is refused before any model loads (disk_refusal).
    python -m pytest -q test_plan.py
"""
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from persuarena import engine
from lab import checkpoints, fastpath, lora, served, shapes

ACTIVATION_CHECKPOINTING = "auto"  # --activation-checkpointing: auto (on for CUDA), on, off
PLAN_NODE = (8, 139.0)     # --plan's default target: ranks, GiB a GPU (an H200 as torch counts it)
LAPTOP_PRESETS = ("cpu", "tiny")  # planned for this machine's CPU when it has no GPU
PLAN_RESERVED_GIB = 3.0    # a GPU's share outside tensors: CUDA context, NCCL, cuBLAS, allocator slack
PLAN_PROMPT_TOKENS = 1024  # a context's opening (the longest persuadee prompt: 3,426 characters)
PLAN_TURN_TOKENS = 32      # what a turn adds beside its two messages: framing, the final-turn instruction
PLAN_POOL_MARGIN = 1.25    # KV pool over the contexts in play: probe forks, judge, block rounding
PLAN_DISK_SLACK_GIB = 0.5  # a run folder beside its checkpoints: tokenizers, logs, evaluations' records



@dataclass(frozen=True)
class RunModels:
    """Which models a training run holds: the one decision train.py loads (build_models,
    build_engines) and memory_plan counts, so the plan cannot disagree with what loads."""
    persuadee: str          # "served"; "persuader": the persuader's frozen initial weights (a copy
    #                         in --dtype, read once); "own": a model of its own
    judge: str              # "none" (s = 0); "served"; "persuadee": its engine, shared; "own"
    reference: str | None   # None (no KL term); "persuadee": the same weights; "base": LoRA's
    #                         frozen base, adapters off; "copy": the persuader's, sharded
    rollout_copy: bool      # the persuader engine runs on a copy of the policy in --dtype
    #                         (several ranks, a half dtype, or LoRA's merged weights), else on it


def run_models(args, world):
    """The RunModels of a run's settings on world ranks."""
    served_persuadee = served.is_served(args.persuadee)
    persuadee = ("served" if served_persuadee else
                 "persuader" if args.persuadee == args.persuader else "own")
    judge = ("served" if served.is_served(args.judge) or args.judge is None and served_persuadee
             else "none" if args.judge == "none"
             else "persuadee" if args.judge in (None, args.persuadee) else "own")
    reference = (None if args.kl_beta <= 0 else "persuadee" if persuadee == "persuader"
                 else "base" if getattr(args, "lora", None) else "copy")
    rollout_copy = world > 1 or args.dtype != "float32" or bool(getattr(args, "lora", None))
    return RunModels(persuadee, judge, reference, rollout_copy)


def checkpointing(mode, device_type):
    """Whether the update recomputes activations in the backward pass (--activation-checkpointing
    MODE): on, off, or auto (on for CUDA, where memory binds; off on a CPU, where time does)."""
    return mode == "on" or (mode == "auto" and device_type == "cuda")


def parameter_count(cfg):
    """Parameters of a Llama / Qwen2 / Qwen3 decoder from its config: embeddings (and an untied
    lm_head), per layer q/k/v/o, gate/up/down, two norms (Qwen2's q/k/v biases, Qwen3's q/k
    norms), the final norm."""
    h, H, Hkv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or h // H
    layer = h * (H + 2 * Hkv) * D + H * D * h + 3 * h * cfg.intermediate_size + 2 * h
    layer += (H + 2 * Hkv) * D if cfg.model_type == "qwen2" else 0
    layer += 2 * D if cfg.model_type == "qwen3" else 0
    embeddings = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    return embeddings + cfg.num_hidden_layers * layer + h


def layer_count(cfg):
    """Parameters of one decoder layer (what FSDP gathers at a time)."""
    return (parameter_count(cfg) - cfg.vocab_size * cfg.hidden_size
            * (1 if cfg.tie_word_embeddings else 2) - cfg.hidden_size) // cfg.num_hidden_layers


def kv_token_bytes(cfg, itemsize):
    """Keys and values of one token over every layer."""
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * D * itemsize


def context_tokens(t_max, max_new_tokens):
    """The longest context an episode builds on either side in t_max turns."""
    return PLAN_PROMPT_TOKENS + t_max * (2 * max_new_tokens + PLAN_TURN_TOKENS)


def engine_sizes(cfg, itemsize, rows, contexts, gpu):
    """(KV pool bytes, decode memory bytes, decode capacity) of one engine. On a GPU from the
    workload: a pool for the contexts in play (rows, tokens each, of training and of the
    held-out evaluation) and a decode memory of the largest batch bucket at the training context (a
    smaller bucket gets more tokens a row, up to the longest context); on a CPU the engine's
    defaults (engine.CACHE_GB_CPU, fastpath.DECODE_COPY_GB)."""
    token = kv_token_bytes(cfg, itemsize)
    limit = engine.pool_limit_bytes(token)
    if not gpu:
        return min(engine.CACHE_GB_CPU * 2**30, limit), fastpath.DECODE_COPY_GB * 2**30, None
    pool = min(PLAN_POOL_MARGIN * max(n * t for n, t in contexts) * token, limit)
    longest = min(max(t for _, t in contexts), cfg.max_position_embeddings) + fastpath.SYNC_EVERY
    train = fastpath.round_up(contexts[0][1] + fastpath.SYNC_EVERY, fastpath.CAPACITY_BUCKET)
    decode_memory = fastpath.decode_memory_bytes(fastpath.batch_bucket(rows), train, token)
    return pool, decode_memory, fastpath.round_up(longest, fastpath.CAPACITY_BUCKET)


def heldout_decode_note(cfg, itemsize, contexts, decode_memory, gpu):
    """What the decode memory gives up, said on its line: it is sized for the training batch at
    the training context (engine_sizes), and the held-out evaluation's later turns, past that
    context at the evaluation's batch, decode in smaller batches (more steps, the same tokens);
    covering them would take the bytes named."""
    if not gpu or len(contexts) < 2:
        return ""
    rows, tokens = contexts[1]
    token = kv_token_bytes(cfg, itemsize)
    extent = fastpath.round_up(min(tokens, cfg.max_position_embeddings) + fastpath.SYNC_EVERY,
                               fastpath.CAPACITY_BUCKET)
    cover = fastpath.decode_memory_bytes(fastpath.batch_bucket(rows), extent, token)
    if cover <= decode_memory:
        return ""
    return (f" (training context; held-out turns past it decode in smaller batches; "
            f"{fastpath.batch_bucket(rows)} rows at {extent} tokens: +{(cover - decode_memory) / 2**30:.1f} GiB)")


def engine_contexts(args, world, rows):
    """(rows, context tokens) of each batch a rank's engines hold: the training rollout's, and
    with --eval-every the held-out evaluation's."""
    contexts = [(rows, context_tokens(args.t_max, args.max_new_tokens))]
    if args.eval_every:
        contexts.append((-(-args.eval_limit // world), context_tokens(args.eval_t_max,
                                                                      args.max_new_tokens)))
    return contexts


def policy_items(policy_cfg, args, world, itemsize, shard, rollout_copy):
    """The policy's lines of a rank's memory plan (full fine-tuning): fp32 master shard,
    gradients and AdamW moments; FSDP's gathered layers or autocast's weight copies; the rollout
    copy when the persuader engine cannot share the master weights."""
    P = parameter_count(policy_cfg)
    items = [(f"policy master weights fp32{shard}", int(4 * P / world)),
             (f"policy gradients fp32{shard}", int(4 * P / world)),
             (f"AdamW moments fp32{shard}", int(8 * P / world))]
    if world > 1:  # the roots (embeddings, lm_head) of policy and reference, two layers in flight
        roots = policy_cfg.vocab_size * policy_cfg.hidden_size * (
            1 if policy_cfg.tie_word_embeddings else 2)
        items.append(("FSDP gathered weights and fp32 reduce buffers",
                      int(itemsize * (2 * roots + 2 * layer_count(policy_cfg))
                          + 4 * layer_count(policy_cfg))))
    elif args.dtype != "float32":
        items.append((f"autocast {args.dtype} weight copies", int(itemsize * P)))
    if rollout_copy:  # RunModels.rollout_copy
        items.append((f"rollout copy {args.dtype} (persuader engine's weights)", int(itemsize * P)))
    return items


def memory_plan(args, world, gib, gpu):
    """Every tensor a rank holds, in bytes, from the configs alone: the policy's fp32 master
    shard, gradients and AdamW moments; FSDP's gathered layers (or autocast's bf16 weights in
    one process); the rollout copy, reference, persuadee and judge; each engine's KV pool and
    decode memory; one micro-batch's activations; what CUDA keeps outside tensors. Returns the
    items, the total, the device's bytes and each engine's sizes (Engine keyword arguments)."""
    GiB, itemsize = 2**30, getattr(torch, args.dtype).itemsize
    policy_cfg = shapes.model_config(args.persuader)
    P = parameter_count(policy_cfg)
    held = run_models(args, world)  # what train.py loads
    rows = max(args.instances // world, 1) * args.group_size
    contexts = engine_contexts(args, world, rows)
    shard = f" (1/{world} shard)" if world > 1 else ""
    if getattr(args, "lora", None):  # train.py --lora: LoRA's policy lines instead
        items, sizes = lora_items(policy_cfg, args, itemsize), {}
    else:
        items, sizes = policy_items(policy_cfg, args, world, itemsize, shard, held.rollout_copy), {}

    def add(name, n):
        items.append((name, int(n)))

    def engine_items(role, cfg):
        pool, decode_memory, capacity = engine_sizes(cfg, itemsize, rows, contexts, gpu)
        add(f"{role} KV pool", pool)
        add(f"{role} decode memory" + heldout_decode_note(cfg, itemsize, contexts, decode_memory, gpu),
            decode_memory)
        if gpu:  # the padded path's largest SDPA call (its gathered keys stay: fastpath.Batch.gather)
            add(f"{role} attention transient",
                fastpath.attention_transient_bytes(
                    cfg.num_attention_heads, decode_memory // kv_token_bytes(cfg, itemsize), itemsize))
            add(f"{role} forward transient ({engine.FORWARD_TOKENS} tokens at most)",
                forward_transient_bytes(cfg, itemsize, engine.FORWARD_TOKENS))
        sizes[role] = dict(cache_bytes=pool, decode_bytes=decode_memory, decode_capacity=capacity)

    engine_items("persuader", policy_cfg)
    if held.persuadee != "served":
        same = held.persuadee == "persuader"
        persuadee_cfg = policy_cfg if same else shapes.model_config(args.persuadee)
        add(f"persuadee {args.dtype}" + (" (also the reference)" if held.reference == "persuadee"
                                         else ""), itemsize * parameter_count(persuadee_cfg))
        engine_items("persuadee", persuadee_cfg)
    if held.reference == "copy":  # "base": LoRA's, counted in lora_items
        add(f"reference {args.dtype}{shard}", itemsize * P / world)
    if held.judge == "own":
        judge_cfg = shapes.model_config(args.judge)
        add(f"judge {args.dtype} (its own model)", itemsize * parameter_count(judge_cfg))
        engine_items("judge", judge_cfg)
    add("activations, one micro-batch (estimate)", activation_bytes(policy_cfg, args, itemsize, gpu))
    add("update logits, each row's kept positions", kept_logit_bytes(policy_cfg, args, itemsize))
    if gpu:
        add("CUDA context, NCCL, allocator slack", PLAN_RESERVED_GIB * GiB)
    total = sum(n for _, n in items)
    return dict(items=items, total=total, capacity=int(gib * GiB), world=world, gpu=gpu,
                sizes=sizes)


def lora_parameter_count(cfg, rank):
    """Adapter parameters: r (fan-in + fan-out) for each lora.LORA_TARGETS projection of
    every layer."""
    h, H, Hkv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    D, inner = getattr(cfg, "head_dim", None) or h // H, cfg.intermediate_size
    fans = dict(q_proj=(h, H * D), k_proj=(h, Hkv * D), v_proj=(h, Hkv * D), o_proj=(H * D, h),
                gate_proj=(h, inner), up_proj=(h, inner), down_proj=(inner, h))
    return cfg.num_hidden_layers * rank * sum(sum(fans[t]) for t in lora.LORA_TARGETS)


def lora_items(cfg, args, itemsize):
    """The policy's lines under --lora (data parallel: nothing is sharded): fp32 adapters, their
    gradients and AdamW moments (16 bytes an adapter parameter), the frozen base in --dtype that
    is also the KL reference (adapter off: no reference copy), and the rollout copy that takes
    the merged weights."""
    n = lora_parameter_count(cfg, args.lora)
    P = parameter_count(cfg)
    return [(f"LoRA adapters r={args.lora} fp32 ({n / 1e6:.0f}M, replicated)", 4 * n),
            ("adapter gradients fp32", 4 * n), ("AdamW moments fp32 (adapters)", 8 * n),
            (f"frozen base {args.dtype} (the reference, adapter off)", itemsize * P),
            (f"rollout copy {args.dtype} (merged, persuader engine's)", itemsize * P),
            ("LoRA merge, one module at a time", lora_merge_bytes(cfg, itemsize))]


def forward_transient_bytes(cfg, itemsize, tokens):
    """What one engine forward of `tokens` new tokens (the judge's prompts, the fidelity check's
    forks: engine.FORWARD_TOKENS at most a forward) holds beside the weights and the pool, its
    tensors of one layer counted as alive together: the residual and its norm, q, k, v and the
    attention's output, the MLP's gate, up and their product."""
    h, H, Hkv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or h // H
    return tokens * (2 * h + (2 * H + 2 * Hkv) * D + 3 * cfg.intermediate_size) * itemsize


def lora_merge_bytes(cfg, itemsize):
    """The LoRA merge into the rollout copy, one module at a time (lora.merged_lora_weights): the
    largest projection's fp32 weight, delta B A and sum, and the sum cast to the rollout dtype."""
    h, H, Hkv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or h // H
    largest = max(h * H * D, h * cfg.intermediate_size)
    return largest * (12 + itemsize)


def activation_bytes(cfg, args, itemsize, gpu):
    """One micro-batch of the update's layers at the training context: their saved tensors (with
    activation checkpointing, each layer's input plus one layer recomputed)."""
    mb, T = args.micro_batch, context_tokens(args.t_max, args.max_new_tokens)
    h, H, Hkv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or h // H
    compute = itemsize if args.dtype != "float32" else 4
    layer = mb * T * (6 * h + 2 * (H + 2 * Hkv) * D + 4 * cfg.intermediate_size) * compute
    mode = getattr(args, "activation_checkpointing", ACTIVATION_CHECKPOINTING)
    if checkpointing(mode, "cuda" if gpu else "cpu"):
        return cfg.num_hidden_layers * mb * T * h * compute + 2 * layer
    return cfg.num_hidden_layers * layer


def kept_logit_bytes(cfg, args, itemsize):
    """One micro-batch's logits in the update: each row's own kept positions (steps.row_logits:
    the rows' union never reaches the output layer), at most t_max x max_new_tokens a row; the
    compute-dtype logits, the float32 rows autograd keeps, their gradient, the reference's."""
    kept = min(context_tokens(args.t_max, args.max_new_tokens), args.t_max * args.max_new_tokens)
    compute = itemsize if args.dtype != "float32" else 4
    return args.micro_batch * kept * cfg.vocab_size * (2 * compute + 8)


def saved_steps(args):
    """(the steps a run saves, in order; the steps it evaluates), as train.py's loop does: every
    --save-every steps, the last step and every evaluated one."""
    steps = range(1, args.steps + 1)
    evaluated = {s for s in steps if args.eval_every and s % args.eval_every == 0}
    saved = sorted({s for s in steps if s % args.save_every == 0 or s == args.steps} | evaluated)
    return saved, evaluated


def disk_plan(args):
    """The disk a run folder takes at its fullest, from the policy's config (checkpoints.save_checkpoint's
    rule): the fp32 weights of every evaluated step and of the latest two checkpoints, AdamW's
    state of the latest checkpoint and of the one before it while the newest is written (full
    fine-tuning: the whole policy, 4 P and 8 P bytes; LoRA: the adapters), and the rest."""
    cfg = shapes.model_config(args.persuader)
    adapters = getattr(args, "lora", None)
    n = lora_parameter_count(cfg, adapters) if adapters else parameter_count(cfg)
    saved, evaluated = saved_steps(args)
    latest = set(saved[-2:])
    what = "adapters" if adapters else "policy"
    copies = len(evaluated | latest)
    items = [(f"{what} weights fp32 x{copies} (evaluated, latest two)", 4 * n * copies),
             (f"{what} AdamW state fp32 x{len(latest)} (latest, one before)", 8 * n * len(latest)),
             ("tokenizers, logs, evaluations' records", int(PLAN_DISK_SLACK_GIB * 2**30))]
    return dict(items=items, total=sum(b for _, b in items))


def disk_lines(disk, run_dir):
    GiB = 2**30
    lines = [f"disk plan for {run_dir} at its fullest:"]
    lines += [f"  {name:<52}{n / GiB:>8.2f} GiB" for name, n in disk["items"]]
    lines.append(f"  {'total':<52}{disk['total'] / GiB:>8.2f} GiB")
    found, size = checkpoints.leftovers(run_dir)
    if found:
        lines.append(f"  {f'+ {len(found)} left by an interrupted save (removed on resume)':<52}"
                     f"{size / GiB:>8.2f} GiB")
    return lines


def disk_refusal(disk, run_dir):
    """The one line that refuses a run whose disk cannot hold what disk_plan says it keeps (less
    what its folder already holds, on a resume), or None."""
    run_dir = Path(run_dir).absolute()
    held = sum(f.stat().st_size for f in run_dir.rglob("*") if f.is_file() and not f.is_symlink()) \
        if run_dir.is_dir() else 0
    left = checkpoints.leftovers(run_dir)[1]  # not the run's: removed on resume, which frees them
    free = shutil.disk_usage(next(p for p in (run_dir, *run_dir.parents) if p.exists())).free + left
    needed = disk["total"] - (held - left)
    if needed <= free:
        return None
    GiB = 2**30
    return (f"train.py: the disk does not hold this run: {needed / GiB:.1f} GiB more needed in "
            f"{run_dir}, {free / GiB:.1f} GiB free there ({disk['items'][0][0]}); free some space, "
            "pass --out on a larger disk, or a larger --eval-every or fewer --steps (python "
            "train.py --plan shows every figure)")


def plan_lines(plan):
    GiB = 2**30
    where = (f"{plan['world']} GPU(s) of {plan['capacity'] / GiB:.1f} GiB" if plan["gpu"] else
             f"{plan['world']} CPU rank(s), {plan['capacity'] / GiB:.1f} GiB of RAM each")
    lines = [f"memory plan, per rank, for {where} (arithmetic from the configs, no weight read):"]
    lines += [f"  {name:<52}{n / GiB:>8.2f} GiB" for name, n in plan["items"]]
    lines.append(f"  {'total':<52}{plan['total'] / GiB:>8.2f} GiB, headroom "
                 f"{(plan['capacity'] - plan['total']) / GiB:.2f} GiB")
    return lines


def plan_refusal(plan):
    """The one line that refuses a plan that does not fit, or None."""
    if plan["total"] <= plan["capacity"]:
        return None
    GiB = 2**30
    biggest = ", ".join(f"{name} {n / GiB:.1f}" for name, n in
                        sorted(plan["items"], key=lambda item: -item[1])[:3])
    return (f"train.py: this run does not fit: {plan['total'] / GiB:.1f} GiB a rank needed, "
            f"{plan['capacity'] / GiB:.1f} GiB available (largest: {biggest} GiB); use more "
            "ranks, fewer --instances or --group-size, a shorter --max-new-tokens or a smaller "
            "--micro-batch (python train.py --plan shows every figure)")


def ranks_refusal(args, world):
    """The one line that refuses --instances the ranks cannot share out in whole groups, or more
    --updates-per-batch than each rank has episodes to split into mini-batches, or None:
    the run's check (steps.plan_run), which --plan makes for its --plan-ranks too."""
    if args.instances % world:
        return (f"train.py: --instances {args.instances} must be a multiple of the number of ranks "
                f"({world}) so that every rank rolls out whole groups; pass e.g. --instances "
                f"{world * max(args.instances // world, 1)}")
    episodes = args.instances // world * args.group_size  # each rank's, split into mini-batches
    if args.updates_per_batch > episodes:
        return (f"train.py: --updates-per-batch {args.updates_per_batch} exceeds the {episodes} "
                f"episodes each of {world} rank(s) updates on (one at least a mini-batch); pass "
                f"e.g. --updates-per-batch {episodes}")
    return None


def device_plan(args, world, device):
    """The plan for this run's own devices (a GPU's memory; a CPU rank's share of the RAM)."""
    if device.type == "cuda":
        gib = torch.cuda.get_device_properties(device).total_memory / 2**30
    else:
        gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 / world
    return memory_plan(args, world, gib, device.type == "cuda")


def print_plan(args):
    """--plan: the plan for --plan-ranks GPUs of --plan-gib (by default this node's GPUs; on a
    machine with none, the node the preset is for: this CPU for LAPTOP_PRESETS, the run
    `python train.py` would start, PLAN_NODE for the others, said), printed; a plan the run would refuse (it does not fit, or its --instances do not
    share out over the ranks) exits with the run's one line. The arguments were validated as the
    run's are (cli.train_args); a disk here that cannot hold the run is a warning (the plan may
    be for another machine)."""
    cuda = torch.cuda.is_available()
    here = not (cuda or args.plan_ranks or args.plan_gib or os.environ.get("WORLD_SIZE"))
    if here and args.preset in LAPTOP_PRESETS:  # the run `python train.py` would start here
        print(f"planning the {args.preset} preset on this machine (its CPU, one process); "
              "--plan-ranks and --plan-gib plan a GPU node")
        plan = device_plan(args, 1, torch.device("cpu"))
        world = 1
    else:
        world = args.plan_ranks or int(os.environ.get("WORLD_SIZE", 0)) or (
            torch.cuda.device_count() if cuda else PLAN_NODE[0])
        gib = args.plan_gib or (torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda
                                else PLAN_NODE[1])
        if here:
            print(f"no GPU here: planning the {args.preset} preset on {world} GPU(s) of {gib:g} GiB, "
                  "the node it is for (--plan-ranks, --plan-gib to plan another)")
        plan = memory_plan(args, world, gib, True)
    disk, run_dir = disk_plan(args), Path(args.out) / args.name
    print("\n".join(plan_lines(plan) + disk_lines(disk, run_dir)))
    if refusal := plan_refusal(plan) or ranks_refusal(args, world):
        sys.exit(refusal)
    if refusal := disk_refusal(disk, run_dir):
        print(f"warning: on this machine, {refusal}", file=sys.stderr)
    return plan
