"""
The probe fidelity check of an evaluation (DECISIONS.md: Probe fidelity sample): at FIDELITY
read-outs spread over every turn of every episode, the probe values read in a fork of the
persuadee's paged cache (probes.read_beliefs, what rollout records) against a plain full forward
(probes.read_beliefs_reference) on the same ids, with the answer words and with the whole
vocabulary. analyses.summarize_run reports their agreement; fidelity.json keeps them.

    python -m pytest -q tests/test_eval.py -k fidelity
"""
import sys

import arena
import models
import probes
from lab import analyses


def fidelity_reads(persuadee, instances, episodes, n, probe_space=None, probe_signs=None):
    """fidelity.json's reads for n sampled read-outs of a local persuadee (an engine.Engine):
    the sample, the fork's values, the reference's and the whole vocabulary's; None when there
    is nothing to check (n 0, no local persuadee, no episode with a belief)."""
    if not n or getattr(persuadee, "tokenizer", None) is None or no_fidelity(episodes):
        return None
    sample = fidelity_sample(episodes, n)
    contexts = fidelity_contexts(persuadee.tokenizer, instances, episodes, sample)
    model, tok, opts = persuadee.model, persuadee.tokenizer, (probe_space, probe_signs)
    return {"sample": [[episodes[i]["id"], t] for i, t in sample],
            "fork": probes.read_beliefs(persuadee, contexts, False, *opts).tolist(),
            "reference": probes.read_beliefs_reference(model, tok, contexts, False, False,
                                                       *opts).tolist(),
            "vocabulary": probes.read_beliefs_reference(model, tok, contexts, False, True,
                                                        *opts).tolist()}


def fidelity_sample(episodes, n):
    """n read-outs (episode index, t) spread evenly over every read-out t = 0..T of every episode
    with beliefs, so that the check covers every stage of a conversation (DECISIONS.md:
    Probe fidelity sample)."""
    every = [(i, t) for i, ep in enumerate(episodes) if analyses.with_beliefs([ep])
             for t in range(len(ep["probes"]))]
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
        messages = arena.persuadee_messages(by_id[ep["id"]])
        for m in ep["transcript"][:2 * t]:
            role = "user" if m["role"] == "persuader" else "assistant"
            messages.append({"role": role, "content": m["text"]})
        contexts.append(models.chat_ids(tokenizer, messages, False))
    return contexts


def no_fidelity(episodes):
    """True, said in one line, when no episode has a belief to check the probes on (every
    read-out None: a persuadee with non-finite outputs, every episode cut off)."""
    if fidelity_sample(episodes, 1):
        return False
    print("eval.py: probe fidelity skipped: no episode has a belief", file=sys.stderr)
    return True
