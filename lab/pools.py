"""
Local players and their KV pools, for eval.py: the model a role name stands for (player: a
served model, or an engine.Engine on weights loaded once per name, refused when non-finite), and
the checks made from a model's tokenizer and config alone, before any weight loads, that its
pool can hold one episode (and the default judge's prompt, which shares the persuadee's pool):
a --kv-blocks too small or larger than the machine, a --max-new-tokens too large.

    python -m pytest -q tests/test_eval.py -k "kv_blocks or pool"
"""
import os
import sys

import torch

from persuarena import arena
from persuarena import engine
from persuarena import models
from persuarena import probes
from persuarena import rollout
from lab import checkpoints, served, shapes


def player(name, loaded, dtype, kv_blocks, allow_insecure_key=None):
    """The model a role name stands for: a served.ServedModel (checked to answer) for
    openai:MODEL@URL, else a local engine.Engine on weights loaded once per name."""
    if served.is_served(name):
        if name not in loaded:
            loaded[name] = served.ServedModel(name, allow_insecure_key=allow_insecure_key)
            loaded[name].check()
        return loaded[name]
    if name not in loaded:  # one copy of the weights per name, a fresh Engine per role
        loaded[name] = models.load_model(name, dtype=getattr(torch, dtype))
        refuse_nonfinite(name, loaded[name][0])
    return engine.Engine(*loaded[name], num_blocks=kv_blocks)


def refuse_nonfinite(name, model):
    """Exit in one line when a loaded model holds a NaN or an infinity (as train.py refuses such
    a checkpoint): its every read-out would be None and its text noise."""
    if (bad := checkpoints.nonfinite_weight(model.state_dict())) is not None:
        sys.exit(f"eval.py: {name} holds non-finite weights ({bad}); evaluate a finite checkpoint")


def pool_shape(name, dtype):
    """What capacity checks read of the engine a local model would get (tokenizer, context,
    block size, device), from its tokenizer and config alone: no weight is read."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return engine.PoolShape(
        tokenizer=models.load_tokenizer(name), device=device,
        max_len=shapes.model_config(name).max_position_embeddings,
        block_size=engine.block_size_for(device, getattr(torch, dtype)))


def episode_blocks(eng, instances, t_max, max_new_tokens):
    """KV blocks one episode can take on a local side (an engine, or its pool_shape) at most: its
    longest prompt and t_max turns of two messages (each at most max_new_tokens and its
    framing), capped by the context, plus one message's copy-on-write and the probe forks."""
    longest = max(max(map(len, rollout.prompt_ids(eng.tokenizer, eng.tokenizer, i)))
                  for i in instances)
    tokens = min(eng.max_len, longest + t_max * 2 * (max_new_tokens + rollout.CLOSING_ROOM))
    return (eng.blocks_for(tokens) + rollout.message_blocks(eng, max_new_tokens)
            + probes.read_blocks(eng))


def block_bytes(name, dtype, block_size):
    """Bytes of one KV block of a local model (keys and values of every layer), from its config."""
    c = shapes.model_config(name)
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    return 2 * c.num_hidden_layers * kv_heads * head_dim * block_size * getattr(torch, dtype).itemsize


def machine_bytes(device):
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def judge_blocks(shape, instances, t_max, max_new_tokens):
    """KV blocks the judge's prompt and answer take for the longest episode it may be given (t_max
    turns of two messages, each counted at twice max_new_tokens words for what re-tokenizing
    quoted text adds), capped by the context: what a judge sharing a pool needs of it."""
    filler = " ".join(["so"] * (2 * max_new_tokens))
    transcript = [{"role": r, "text": filler} for _ in range(t_max) for r in ("persuader", "persuadee")]
    longest = max(instances, key=lambda i: len(arena.judge_messages(i, [])[1]["content"]))
    tokens = len(models.chat_ids(shape.tokenizer, arena.judge_messages(longest, transcript), True))
    return (shape.blocks_for(min(tokens, shape.max_len))
            + rollout.message_blocks(shape, rollout.JUDGE_MAX_NEW_TOKENS))


def memory_problem(name, dtype, kv_blocks, shape=None):
    """One line (no prefix) when a --kv-blocks pool of local model `name` is larger than this
    machine's memory, else None (eval.py and the env server refuse it before any weight loads)."""
    shape = shape or pool_shape(name, dtype)
    block, memory = block_bytes(name, dtype, shape.block_size), machine_bytes(shape.device)
    if kv_blocks and kv_blocks * block > memory:
        return (f"--kv-blocks {kv_blocks} needs {kv_blocks * block / 2**30:.1f} GiB for one pool "
                f"of {name}, more than this machine's {memory / 2**30:.1f} GiB; pass --kv-blocks "
                f"{memory // block // 4} or fewer")
    return None


def pool_problem(args, instances):
    """One line refusing, before any weight loads (issue 27): a --kv-blocks pool larger than the
    machine's memory; a --max-new-tokens that lets one episode outgrow the default pool; a pool
    the default judge, which shares the persuadee's, cannot judge one episode in. None when fine."""
    judge = args.judge is None
    for name in dict.fromkeys(args.persuader + args.persuadee):
        if served.is_served(name):
            continue
        shape = pool_shape(name, args.dtype)
        block, memory = block_bytes(name, args.dtype, shape.block_size), machine_bytes(shape.device)
        if too_large := memory_problem(name, args.dtype, args.kv_blocks, shape):
            return f"eval.py: {too_large}"
        budget = (memory * engine.CACHE_FRACTION_GPU if shape.device.type == "cuda"
                  else engine.CACHE_GB_CPU * 2**30)
        pool = args.kv_blocks or min(int(budget // block), engine.MAX_BLOCKS)
        need = episode_blocks(shape, instances, args.t_max, args.max_new_tokens)
        if need > pool:
            return (f"eval.py: --max-new-tokens {args.max_new_tokens} lets one episode of {name} take "
                    f"{need} KV blocks, more than its pool's {pool}; pass a smaller --max-new-tokens")
        if judge and name in args.persuadee and (needed := judge_blocks(
                shape, instances, args.t_max, args.max_new_tokens)) > pool:
            return (f"eval.py: --kv-blocks {pool} cannot hold the judge's prompt for one episode "
                    f"of {name} ({needed} blocks; the default judge shares the persuadee's pool); "
                    f"pass --kv-blocks {max(needed, need)} or more, or --judge MODEL or none")
    return None


def check_kv_blocks(args, instances):
    """--kv-blocks too few for one episode of a local model, refused from its tokenizer and
    config before any weight loads."""
    for name in dict.fromkeys(args.persuader + args.persuadee) if args.kv_blocks else ():
        if not served.is_served(name):
            shape = pool_shape(name, args.dtype)
            need = episode_blocks(shape, instances, args.t_max, args.max_new_tokens)
            if args.kv_blocks < need:
                sys.exit(f"eval.py: --kv-blocks {args.kv_blocks} cannot hold one episode of "
                         f"{name} ({need} blocks of {shape.block_size} tokens at --t-max "
                         f"{args.t_max}, --max-new-tokens {args.max_new_tokens}); pass "
                         f"--kv-blocks {need} or more")
    if problem := pool_problem(args, instances):
        sys.exit(problem)
