"""
The probe fidelity check of an evaluation (DECISIONS.md: Probe fidelity sample): at FIDELITY
read-outs spread over every turn of every episode, the probe values read in a fork of the
persuadee's paged cache (probes.read_beliefs, what rollout records) against transformers' own
forward of the same ids (probes.read_beliefs_references: each context once through its KV cache,
each probe question on a copy), with the answer words and with the whole vocabulary, both from
the same forwards. Under torchrun the ranks share the sample. analyses.summarize_run reports
their agreement; fidelity.json keeps them.

    python -m pytest -q tests/test_eval.py -k fidelity
"""
import sys

from tqdm import tqdm

from persuarena import arena
from persuarena import models
from persuarena import probes
from lab import analyses

CHUNK = 4  # read-outs checked at a time (the progress bar's step)


def fidelity_reads(persuadee, instances, episodes, n, probe_space=None, probe_signs=None,
                   rank=0, world=1):
    """fidelity.json's reads for n sampled read-outs of a local persuadee (an engine.Engine):
    the sample, the fork's values, the reference's and the whole vocabulary's (both from the same
    forwards); None when there is nothing to check (n 0, no local persuadee, no episode with a
    belief). Under torchrun every rank calls it: each reads sample[rank::world] on its own
    persuadee, and every rank gets all the reads back, in the sample's order."""
    if not n or persuadee is None or no_fidelity(episodes, rank):
        return None
    sample = fidelity_sample(episodes, n)
    contexts = fidelity_contexts(persuadee.tokenizer, instances, episodes, sample[rank::world])
    fits = [fits_read(persuadee, c) for c in contexts]
    contexts = [c for c, ok in zip(contexts, fits) if ok]
    opts = (probe_space, probe_signs)
    mine = []
    if contexts and rank == 0:
        print(f"eval.py: probe fidelity check: {len(sample)} read-outs, each probe read in a fork "
              "of the persuadee's cache (what the episodes recorded) against transformers' own "
              f"forward of the same ids ({len(sample)} contexts, "
              f"{len(sample) * len(probes.PROBES)} questions on copies of their cache)", file=sys.stderr)
    for start in tqdm(range(0, len(contexts), CHUNK), desc="probe fidelity", unit="chunk",
                      disable=rank != 0 or not contexts, file=sys.stderr):
        chunk = contexts[start:start + CHUNK]
        fork = probes.read_beliefs(persuadee, chunk, False, *opts).tolist()
        reference, vocabulary = probes.read_beliefs_references(persuadee.model,
                                                               persuadee.tokenizer, chunk, *opts)
        mine += list(zip(fork, reference.tolist(), vocabulary.tolist()))
    mine = iter(mine)
    mine = [next(mine) if ok else None for ok in fits]  # None: a read-out that does not fit
    shards = [mine]
    if world > 1:
        import torch.distributed as dist
        shards = [None] * world
        dist.all_gather_object(shards, mine)
    reads = [shards[j % world][j // world] for j in range(len(sample))]  # back in sample order
    kept = [j for j, r in enumerate(reads) if r is not None]
    if len(kept) < len(sample) and rank == 0:
        print(f"eval.py: probe fidelity: {len(sample) - len(kept)} of {len(sample)} sampled "
              f"read-outs skipped: their context with a probe question passes the persuadee's "
              f"context of {persuadee.max_len} tokens or its KV pool (an episode that ended "
              "\"context\")", file=sys.stderr)
    if not kept:
        return None
    return {"sample": [[episodes[sample[j][0]].id, sample[j][1]] for j in kept],
            "skipped": len(sample) - len(kept),
            **{key: [reads[j][k] for j in kept] for k, key in enumerate(("fork", "reference",
                                                                        "vocabulary"))}}


def fits_read(persuadee, context):
    """Whether a context and its probe turns fit the persuadee's context and its pool (the
    reference forward takes the same length); one rebuilt from an episode that ended "context"
    may not."""
    turns, _ = probes.probe_ids(persuadee.tokenizer)
    longest = max(map(len, turns))
    return (len(context) + longest <= persuadee.max_len and
            persuadee.blocks_for(len(context)) + probes.read_blocks(persuadee)
            <= persuadee.free_blocks)


def fidelity_sample(episodes, n):
    """n read-outs (episode index, t) spread evenly over every read-out t = 0..T of every episode
    with beliefs, so that the check covers every stage of a conversation (DECISIONS.md:
    Probe fidelity sample)."""
    every = [(i, t) for i, ep in enumerate(episodes) if analyses.with_beliefs([ep])
             for t in range(len(ep.probes))]
    if len(every) <= n:
        return every
    return [every[round(k * (len(every) - 1) / (n - 1))] for k in range(n)] if n > 1 else every[:1]


def fidelity_contexts(tokenizer, instances, episodes, sample):
    """The persuadee's context at each sampled read-out (after t replies), for the probe fidelity
    check. Built from the transcript text: a measurement of fork against reference on identical
    ids, not a conversation that continues."""
    by_id = {inst["id"]: inst for inst in instances}
    contexts = []
    for i, t in sample:
        ep = episodes[i]
        messages = arena.persuadee_messages(by_id[ep.id])
        for m in ep.transcript[:2 * t]:
            role = "user" if m["role"] == "persuader" else "assistant"
            messages.append({"role": role, "content": m["text"]})
        contexts.append(models.chat_ids(tokenizer, messages, False))
    return contexts


def no_fidelity(episodes, rank=0):
    """True, said in one line (by rank 0), when no episode has a belief to check the probes on
    (every read-out None: a persuadee with non-finite outputs, every episode cut off)."""
    if fidelity_sample(episodes, 1):
        return False
    if rank == 0:
        print("eval.py: probe fidelity skipped: no episode has a belief", file=sys.stderr)
    return True
