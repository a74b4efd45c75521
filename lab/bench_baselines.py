"""
lab/bench_baselines.py: the Hugging Face baselines of lab.bench, on the same dialogues as the engine.

  hf generate        model.generate on left-padded batches of each side's whole history, run again
                     every turn: the same ids as the engine's contexts (the sampled ids, closed and
                     framed by the same chat edge, rollout.prompt_ids / persuadee_heard and
                     models.closing_ids / turn_ids), so only the caching differs; probes as full
                     forwards of history + question, batched over dialogues (last-position logits)
  hf generate_batch  model.generate_batch (continuous batching) on the same histories, probes as
                     above. Knobs: warmup=False (its warm-up captures CUDA graphs only) and
                     ContinuousBatchingConfig(num_blocks=) sized to the call's prompts + new tokens
                     (PAGE_SIZE tokens a block): by default it sizes its KV cache to ~90% of free
                     memory (of all RAM on a CPU) and allocates it on every call, which is the
                     ~12 s a call on a CPU. Its other per-call set-up and tear-down (threads, gc)
                     is timed.

A conversation's tokens fed through the model are counted (fed) so that lab.bench can report
what was prefilled twice: every turn, each side's whole history again.

    PYTHONPATH=. python -m lab.bench --dialogues 2 --turns 1 --max-new-tokens 8   # engine and baselines
"""
import time

import torch

from persuarena import arena
from persuarena import engine
from persuarena import models
from persuarena import probes
from persuarena import rollout
from lab import bench_workload as workload

PAGE_SIZE = 256     # tokens a continuous-batching block holds (ContinuousBatchingConfig default)


def left_padded(prompts, pad, device):
    """Token-id prompts of unequal length as one left-padded batch: (ids, attention mask)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask


def hf_generate(model, prompts, cfg, stop, pad, batch_api=False):
    """Transformers' own generation on token-id prompts, each output cut after its first stop id:
    model.generate on a left-padded batch, or generate_batch (continuous batching, its KV pages
    sized to the prompts plus cfg.max_new_tokens each)."""
    if batch_api:
        from transformers import ContinuousBatchingConfig
        tokens = sum(len(q) + cfg.max_new_tokens for q in prompts)
        pages = engine.blocks_for(tokens, PAGE_SIZE) + len(prompts)
        res = list(model.generate_batch(
            inputs=prompts, generation_config=cfg, warmup=False,
            continuous_batching_config=ContinuousBatchingConfig(num_blocks=pages)).values())
        if len(res) != len(prompts) or any(r.error for r in res):
            raise RuntimeError(f"generate_batch failed: {[r.error for r in res]}")
        return [list(r.generated_tokens) for r in res]
    ids, mask = left_padded(prompts, pad, next(model.parameters()).device)
    new = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)[:, ids.shape[1]:]
    return [next((ids[:i + 1] for i, t in enumerate(ids) if t in stop), ids) for ids in new.tolist()]


def fed(st, d, key, n):
    """n conversation tokens of dialogue d's `key` side went through the model (run_hf)."""
    workload.add(st, conv=n)
    d["fed"][key] = max(d["fed"][key], n)


def hf_read_probes(model, tok, batch, questions, pad, st):
    """The probes of each dialogue's persuadee history, read by the plain model (one left-padded
    forward a question, no cache), appended to d["probes"]."""
    t, values = time.perf_counter(), []
    for q in questions:
        histories = [d["persuadee"] + q for d in batch]
        ids, mask = left_padded(histories, pad, next(model.parameters()).device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding shifts positions
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos,
                       logits_to_keep=1).logits[:, -1]
        values.append(probes.values_from_logits(logits, tok).cpu())
        for d in batch:
            fed(st, d, "persuadee", len(d["persuadee"]))
            workload.add(st, probe_tokens=len(q))
    for d, v in zip(batch, torch.stack(values, 1).tolist()):
        d["probes"].append(v)
    workload.add(st, probe=time.perf_counter() - t)


@torch.no_grad()
def run_hf(model, tok, instances, turns, max_new, sync, batch_api=False):
    """The same dialogues with no cache kept between calls: every turn, each side's whole history
    runs through the model again (play_dialogues), by model.generate or generate_batch."""
    from transformers import GenerationConfig
    stop = engine.stop_ids(model, tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    cfg = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=stop,
                           pad_token_id=pad)
    questions, _ = probes.probe_ids(tok)
    st = new_stats()

    def generate(batch, key):
        prompts = [d[key] for d in batch]
        outs = hf_generate(model, prompts, cfg, stop, pad, batch_api)
        for d, p, ids in zip(batch, prompts, outs):
            fed(st, d, key, len(p) + len(ids) - 1)  # the last sampled token is never fed
            workload.add(st, gen=len(ids))
        return outs

    def read_probes(batch):
        hf_read_probes(model, tok, batch, questions, pad, st)
    return play_dialogues(tok, instances, turns, st, generate, read_probes, sync)


def new_stats():
    """A baseline's counters: seconds in persuadee replies and probe reads, message tokens,
    conversation and probe-question tokens through the model, the torch threads it runs on (the
    cores free at its start: lab.bench runs it under engine.cpu_threads)."""
    return dict(reply=0.0, probe=0.0, gen=0, conv=0, probe_tokens=0, threads=[torch.get_num_threads()])


def play_dialogues(tok, instances, turns, st, generate, read_probes, sync):
    """The dialogues of a baseline that keeps no cache of its own between calls, on the engine's
    own ids: each side's history built by the same chat edge (rollout.prompt_ids, persuadee_heard,
    models.closing_ids and turn_ids) around the ids each side generated, so that every
    implementation sees identical contexts and greedy decoding must give identical messages.
    generate(dialogues, side) -> the new ids of each; read_probes(dialogues) appends each one's
    probe values to d["probes"]; both add to st (new_stats), which is returned with the wall time,
    the tokens prefilled twice, the message texts and the probe values."""
    ds = [dict(zip(("persuader", "persuadee"), rollout.prompt_ids(tok, tok, i)),
               state=arena.Dialogue(turns), texts=[], probes=[], fed={"persuader": 0, "persuadee": 0})
          for i in instances]

    def text(ids):
        return tok.decode(ids, skip_special_tokens=True).strip()

    t0 = time.perf_counter()
    read_probes(ds)  # b_0
    active = ds
    while active:
        for d, ids in zip(active, generate(active, "persuader")):
            d["persuader_ids"] = ids
            d["texts"].append(text(ids))
            d["persuadee"] = d["persuadee"] + rollout.persuadee_heard(tok, d["texts"][-1],
                                                                     d["state"].final_turn)
        t = time.perf_counter()
        replies = generate(active, "persuadee")
        sync()
        workload.add(st, reply=time.perf_counter() - t)
        for d, ids in zip(active, replies):
            d["persuadee"] = d["persuadee"] + ids + models.closing_ids(tok, ids)
            d["texts"].append(text(ids))
            d["state"].step(arena.parse_decision(d["texts"][-1]))
        read_probes(active)
        for d in active:
            if not d["state"].done:  # the persuader reads the reply, tags stripped
                said = d["persuader_ids"]
                d["persuader"] = (d["persuader"] + said + models.closing_ids(tok, said)
                                  + models.turn_ids(tok, arena.persuader_sees(d["texts"][-1])))
        active = [d for d in active if not d["state"].done]
    st["wall"] = time.perf_counter() - t0
    st["twice"] = st["conv"] - sum(sum(d["fed"].values()) for d in ds)
    st["dialogues"], st["probes"] = [d["texts"] for d in ds], [d["probes"] for d in ds]
    return st

