"""
probes.py: the persuadee's implicit beliefs, read from its own next-token logits.

After each persuadee reply, three yes/no questions are put to the persuadee in a fork of its
context that is thrown away afterwards: the question as a user turn, the assistant generation
prompt, one forward step. Nothing of it enters a transcript. For each probe

    p = sum P(yes ids) / (sum P(yes ids) + sum P(no ids)),   v = 2p - 1 in [-1, 1],

with the ids the first tokens of "Yes", " Yes", "yes", " yes" (and likewise "No"); the belief is
b = mean(v_CA, v_PE, v_AC). In logit space p = sigmoid(lse(yes) - lse(no)), so v = tanh(d / 2).

The fork shares the conversation's KV blocks (engine.PagedCache), so a read costs the probe's own
tokens only. The three questions share their opening (the turn header and the instruction): on a
CPU, where the cost is compute, it is prefilled once in one fork and forked again per question;
on a GPU, where a forward costs its kernel launches, each question's fork takes all of its
tokens, and a read is a single forward. `read_beliefs_reference` computes the same values by one
plain full forward of each context plus question, with no cache; the tests hold the two within
1e-4 on every path.

    python -m pytest -q test_probes.py
"""
import functools

import torch

import engine
import models

INSTRUCTION = "Answer only Yes or No."  # goes first so the three questions share a longer prefix
PROBES = {  # all positively valenced: Yes favours the persuader
    "CA": "Has the other person addressed your main concern?",        # cognitive
    "PE": "Is the other person's approach working on you?",           # strategic
    "AC": "Are you more willing to agree to the request than before their last message?",  # conative
}
YES_WORDS = ("Yes", " Yes", "yes", " yes")
NO_WORDS = ("No", " No", "no", " no")


@functools.cache  # encoded once per tokenizer, not on every read
def answer_ids(tokenizer, words):
    return sorted({models.encode(tokenizer, w)[0] for w in words})


@functools.cache  # rendered once per tokenizer, not once per read
def probe_ids(tokenizer):
    """The three probe turns as ids appended to a closed context, and their shared prefix length."""
    turns = [models.turn_ids(tokenizer, f"{INSTRUCTION} {q}") for q in PROBES.values()]
    return turns, engine.shared_stem(turns)


def values_from_logits(logits, tokenizer):
    """Probe values v = 2p - 1 from next-token logits [..., V]. A read from logits that overflowed
    (a non-finite one) or collapsed (all equal, which would read as exactly 0) is NaN, for
    rpo.py to count and exclude, never a silent value."""
    logits = logits.float()
    logp = torch.log_softmax(logits, -1)
    yes = logp[..., answer_ids(tokenizer, YES_WORDS)].logsumexp(-1)
    no = logp[..., answer_ids(tokenizer, NO_WORDS)].logsumexp(-1)
    readable = torch.isfinite(logits).all(-1) & (logits.amax(-1) > logits.amin(-1))
    return torch.where(readable, torch.tanh((yes - no) / 2), float("nan"))


def read_engine(eng, sids):
    """Probe values [n, 3] for sequences whose context is closed and fully cached.

    Per sequence, one fork per question, all in one forward; on engine.COMPUTE_BOUND_DEVICES
    the questions' common opening is first prefilled once, in a fork of its own that the question
    forks then fork again. Every fork is freed at the end, leaving the parents untouched."""
    turns, shared = probe_ids(eng.tokenizer)
    if eng.device.type not in engine.COMPUTE_BOUND_DEVICES:
        shared = 0
    out = []
    step = max(1, len(eng.cache.free_blocks) // (2 * len(turns) + 2))  # forks that fit the pool
    for i in range(0, len(sids), step):
        chunk = parents = sids[i:i + step]
        if shared:
            parents = [eng.fork(s, turns[0][:shared]) for s in chunk]
            eng.forward(parents)
        leaves = []
        for parent in parents:
            for t in turns:
                leaves.append(eng.fork(parent, t[shared:]))
        logits = eng.forward(leaves)
        for s in leaves + (parents if shared else []):
            eng.free(s)
        out.append(values_from_logits(logits, eng.tokenizer).view(len(chunk), len(turns)))
    return torch.cat(out).cpu()


def read_beliefs(model, tokenizer, contexts):
    """Probe values [n, 3] (order CA, PE, AC) for closed contexts given as token ids, via forks."""
    eng = engine.Engine(model, tokenizer)
    sids = [eng.new(c) for c in contexts]
    eng.forward(sids)
    values = read_engine(eng, sids)
    for s in sids:
        eng.free(s)
    return values


@torch.no_grad()
def read_beliefs_reference(model, tokenizer, contexts):
    """The same read-out by one plain full forward of each context plus question, no cache."""
    turns, _ = probe_ids(tokenizer)
    device = next(model.parameters()).device
    rows = []
    for context in contexts:
        logits = [model(torch.tensor([context + t], device=device)).logits[0, -1] for t in turns]
        rows.append(values_from_logits(torch.stack(logits), tokenizer))
    return torch.stack(rows).cpu()
