"""
probes.py: the persuadee's implicit beliefs, read from its own next-token logits.

After each persuadee reply, the yes/no questions of PROBES are put to the persuadee in a fork of
its context that is thrown away afterwards: the question as a user turn, the assistant generation
prompt, one forward step. Nothing of it enters a transcript. For each probe

    p = sum P(yes ids) / (sum P(yes ids) + sum P(no ids)),   v = 2p - 1 in [-1, 1],

with the ids the first tokens of "Yes", " Yes", "yes", " yes" (and likewise "No"); the belief is
b = mean(v_CA, v_PE, v_AC), the mean over PROBES. In logit space p = sigmoid(d), d = lse(yes) -
lse(no), so v = tanh(d / 2). Validity options: PROBE_SPACE "logodds" reads v = clip(d,
+-LOGODDS_CLIP) / LOGODDS_CLIP instead, so that a saturated p still moves; a probe's sign flips a
negatively valenced question; a read-out can return its Yes+No mass m = sum P(yes ids) +
sum P(no ids), how much of the model's first-token distribution the two answers hold.

The fork shares the conversation's KV blocks (engine.PagedCache), so a read costs the probe's own
tokens only. On a CPU the questions' shared opening is prefilled once and forked per question; on
a GPU each question's fork takes all of its tokens, one forward. `read_beliefs_reference` computes
the same values by a plain full forward of each context plus question (cache=True: the context
once through transformers' own KV cache, each question on a copy; read_beliefs_references, the
evaluation's fidelity check: the answer words' and the whole vocabulary's from the same cached
forwards); the tests hold fork and
reference within 1e-4 on every path. The logit decision (rollout.DECISION "logit") reuses the fork:
read_decisions returns the probabilities of arena.DECISION_WORDS after arena.DECISION_QUESTION,
sample_decisions draws one with the episode's keyed stream.
The belief decision (rollout.DECISION "belief") reads nothing more: after turn t the persuadee
accepts with p_t = sigmoid((b_t - BELIEF_THRESHOLD) / BELIEF_TEMPERATURE), drawn with u < p_t
from the episode's keyed stream (belief_decisions), so its outcome follows its own belief.

    python -m pytest -q tests/test_probes.py
"""
import argparse
import functools
import math

import torch

from persuarena import engine
from persuarena import models

INSTRUCTION = "Answer only Yes or No."  # goes first so the questions share a longer prefix
PROBES = {  # name: the question, its valence sign (+1 where Yes favours the persuader, -1 flips
    # v) and its figure title. Adding or removing a probe is this one edit: the read-outs, the
    # records' columns, the figures and the analyses all follow from this dict.
    "CA": dict(question="Has the other person addressed your main concern?",  # cognitive
               sign=1, title="concern addressed (CA)"),
    "PE": dict(question="Is the other person's approach working on you?",  # strategic
               sign=1, title="persuasion effective (PE)"),
    "AC": dict(question="Are you more willing to agree to the request than before their last message?",
               sign=1, title="acceptance shift (AC)"),  # conative
}
PROBE_SPACE = "prob"  # "prob": v = 2p - 1; "logodds": v = clip(log-odds, +-LOGODDS_CLIP) / LOGODDS_CLIP
LOGODDS_CLIP = 4.0  # log-odds read as saturated (v = +-1) beyond this, i.e. p beyond 0.982
PROBE_SPACES = ("prob", "logodds")
YES_WORDS = ("Yes", " Yes", "yes", " yes")
NO_WORDS = ("No", " No", "no", " no")
# the belief decision (DECISIONS.md: Belief decision): acceptance rare where the initial tiny
# policy leaves the belief (BENCHMARKS.md: Belief-decided persuadee, the pilot that set them)
BELIEF_THRESHOLD = 0.10  # b_t at which the persuadee accepts half the time
BELIEF_TEMPERATURE = 0.02  # how sharply p_t rises with b_t around the threshold


@functools.cache  # encoded once per tokenizer, not on every read
def answer_ids(tokenizer, words) -> list[int]:
    return sorted({models.encode(tokenizer, w)[0] for w in words})


def probe_ids(tokenizer) -> tuple:
    """The probe turns (one per PROBES question) as ids appended to a closed context, and their
    shared prefix length."""
    return _probe_turns(tokenizer, INSTRUCTION, tuple(questions()))


@functools.cache  # rendered once per tokenizer and question set, not once per read
def _probe_turns(tokenizer, instruction, asked):
    turns = [models.turn_ids(tokenizer, f"{instruction} {q}") for q in asked]
    return turns, engine.shared_stem(turns)


@functools.cache  # the whole vocabulary decoded once per tokenizer
def vocabulary_answer_ids(tokenizer) -> tuple:
    """Every token id whose text, stripped and lower-cased, is "yes" or "no" ("YES", " No",
    "no", ...): the answers over the full vocabulary, not only the four spellings' first tokens."""
    words = [w.strip().lower() for w in tokenizer.batch_decode([[i] for i in range(len(tokenizer))])]
    return (tuple(i for i, w in enumerate(words) if w == "yes"),
            tuple(i for i, w in enumerate(words) if w == "no"))


def _answer_logprobs(logits, tokenizer, answers=None):
    """log sum P(yes ids), log sum P(no ids); answers (yes ids, no ids) defaults to the first
    tokens of YES_WORDS and NO_WORDS."""
    yes_ids, no_ids = answers or (answer_ids(tokenizer, YES_WORDS), answer_ids(tokenizer, NO_WORDS))
    logp = torch.log_softmax(logits.float(), -1)
    return logp[..., list(yes_ids)].logsumexp(-1), logp[..., list(no_ids)].logsumexp(-1)


def questions() -> list[str]:
    """The probes' questions, in PROBES order."""
    return [probe["question"] for probe in PROBES.values()]


def probe_signs() -> dict[str, int]:
    """{name: valence sign} of every probe, from PROBES."""
    return {name: probe["sign"] for name, probe in PROBES.items()}


def parse_signs(text: str) -> dict[str, int]:
    """Probe signs from "CA=1,PE=-1,AC=1", each probe not named keeping its PROBES sign (the
    --probe-signs flag's type: its error is the line argparse prints)."""
    signs = probe_signs()
    for part in filter(None, text.split(",")):
        name, _, sign = part.partition("=")
        if name.strip() not in PROBES or sign.strip() not in ("1", "+1", "-1"):
            raise argparse.ArgumentTypeError(f"probe sign {part!r} is not NAME=1 or NAME=-1, "
                                             f"NAME one of {', '.join(PROBES)}")
        signs[name.strip()] = int(sign)
    return signs


def add_flags(parser):
    """--probe-signs and --probe-space, the probe options train.py and eval.py share."""
    parser.add_argument("--probe-signs", type=parse_signs, default=probe_signs(),
                        help='per-probe valence, e.g. "PE=-1" flips PE (default: the signs in PROBES)')
    parser.add_argument("--probe-space", choices=PROBE_SPACES, default=PROBE_SPACE,
                        help="probe values as 2p - 1 (prob) or clipped, rescaled log-odds "
                             "(logodds)")


def values_from_logits(logits: "torch.Tensor", tokenizer, space: str | None = None,
                       answers=None) -> "torch.Tensor":
    """Probe values from next-token logits [..., V]: 2p - 1 ("prob") or the clipped, rescaled
    log-odds ("logodds"); space defaults to PROBE_SPACE. No valence sign applied. A read from
    logits that overflowed (a non-finite one) or collapsed (all equal, which would read as
    exactly 0) is NaN, for rpo.py to count and exclude, never a silent value."""
    space = space or PROBE_SPACE
    if space not in PROBE_SPACES:
        raise ValueError(f"probes: PROBE_SPACE must be one of {PROBE_SPACES}, got {space!r}")
    logits = logits.float()
    yes, no = _answer_logprobs(logits, tokenizer, answers)
    readable = torch.isfinite(logits).all(-1) & (logits.amax(-1) > logits.amin(-1))
    if space == "logodds":
        value = (yes - no).clamp(-LOGODDS_CLIP, LOGODDS_CLIP) / LOGODDS_CLIP
    else:
        value = torch.tanh((yes - no) / 2)
    return torch.where(readable, value, float("nan"))


def yes_no_mass(logits: "torch.Tensor", tokenizer) -> "torch.Tensor":
    """sum P(yes ids) + sum P(no ids) under the full next-token distribution of logits [..., V]."""
    yes, no = _answer_logprobs(logits, tokenizer)
    return yes.exp() + no.exp()


def belief(values: list[float] | None) -> float | None:
    """b = mean of the probe values of one read-out; None when any is absent (a served persuadee
    that gives no log-probs) or not finite."""
    if values is None or not all(v is not None and math.isfinite(v) for v in values):
        return None
    return sum(values) / len(values)


def from_prob_value(v: float | None, space: str | None = None, sign: int = 1) -> float | None:
    """A probe value read as 2p - 1 (what a served persuadee's top log-probs give), in `space`
    with the valence `sign`, as values_from_logits and _readout would give it; None stays None."""
    if v is None:
        return None
    if (space or PROBE_SPACE) == "logodds":
        p = min(max((v + 1) / 2, 0.0), 1.0)
        d = math.inf if p == 1 else -math.inf if p == 0 else math.log(p / (1 - p))
        v = max(-LOGODDS_CLIP, min(LOGODDS_CLIP, d)) / LOGODDS_CLIP
    return sign * v


def _readout(logits, tokenizer, n, answers=None, space=None, signs=None):
    """[n * k, V] question logits -> signed probe values [n, k] and Yes+No mass [n, k] (k probes); space and
    signs default to PROBE_SPACE and the signs in PROBES."""
    signs = signs or probe_signs()
    signs = torch.tensor([float(signs[k]) for k in PROBES], device=logits.device)
    values = values_from_logits(logits, tokenizer, space, answers).view(n, len(PROBES)) * signs
    return values, yes_no_mass(logits, tokenizer).view(n, len(PROBES))


def read_engine(eng, sids: list[int], with_mass: bool = False, space: str | None = None,
                signs: dict[str, int] | None = None):
    """Probe values [n, k] (k = len(PROBES)) for sequences whose context is closed and fully
    cached; with_mass: (values, Yes+No mass), both [n, k].

    Per sequence, one fork per question, all in one forward; on engine.COMPUTE_BOUND_DEVICES
    the questions' common opening is first prefilled once, in a fork of its own that the question
    forks then fork again. Every fork is freed at the end, leaving the parents untouched."""
    turns, shared = probe_ids(eng.tokenizer)
    if eng.device.type not in engine.COMPUTE_BOUND_DEVICES:
        shared = 0
    out, mass, need = [], [], read_blocks(eng)
    if need > eng.free_blocks:
        raise RuntimeError(f"probes.py: a probe read takes up to {need} KV blocks, the pool has "
                           f"{eng.free_blocks} free; leave room for it (rollout reserves it)")
    step = eng.free_blocks // need  # sequences whose forks the pool takes at once
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
        values, m = _readout(logits, eng.tokenizer, len(chunk), space=space, signs=signs)
        out.append(values)
        mass.append(m)
    values = torch.cat(out).cpu()
    return (values, torch.cat(mass).cpu()) if with_mass else values


def read_blocks(eng) -> int:
    """KV blocks one sequence's probe read can take at most: a fork writing n tokens may copy the
    block it starts in and takes ceil(n / block_size) more."""
    turns, shared = probe_ids(eng.tokenizer)
    if eng.device.type not in engine.COMPUTE_BOUND_DEVICES:
        shared = 0
    fork = lambda n: eng.blocks_for(n, copy_on_write=True)
    return (fork(shared) if shared else 0) + sum(fork(len(t) - shared) for t in turns)


def read_beliefs(eng, contexts, with_mass=False, space=None, signs=None):
    """Probe values [n, k] (in PROBES order) for closed contexts given as token ids, read via
    forks on `eng` (the persuadee's own engine; no pool is built here): the contexts are
    prefilled in chunks that the engine's free pool takes together with their probe forks
    (Engine.admit), read, and freed, so any number of contexts reads on any pool that holds
    one context and its forks; one that holds less raises with the numbers."""
    need, out = read_blocks(eng), []
    for i, c in enumerate(contexts):
        if eng.blocks_for(len(c)) + need > eng.free_blocks:
            raise RuntimeError(f"probes.py: context {i} ({len(c)} tokens) and its probe forks take "
                               f"{eng.blocks_for(len(c)) + need} KV blocks, the pool has "
                               f"{eng.free_blocks} free; read on an engine with a larger pool")
    start = 0
    while start < len(contexts):
        sids = [eng.new(c) for c in contexts[start:]]
        chunk = eng.admit(sids, [len(c) for c in contexts[start:]], reserve=need)
        chunk = sids[:max(1, next((k for k, s in enumerate(sids) if s not in chunk), len(sids)))]
        for s in sids[len(chunk):]:
            eng.free(s)
        eng.forward(chunk)
        out.append(read_engine(eng, chunk, with_mass, space, signs))
        for s in chunk:
            eng.free(s)
        start += len(chunk)
    if with_mass:
        return torch.cat([v for v, _ in out]), torch.cat([m for _, m in out])
    return torch.cat(out)


@torch.no_grad()
def read_beliefs_reference(model, tokenizer, contexts, with_mass=False, vocabulary=False,
                           space=None, signs=None, cache=False):
    """The same read-out by one plain full forward of each context plus question, no cache;
    with vocabulary=True over every answer token of the vocabulary (vocabulary_answer_ids), the
    reference for where the four spellings depart from the model's own first-token answer.
    cache=True: each context's forward once, through transformers' own KV cache, and each
    question on a copy of it (still not the engine's pool; a third of the cost at k = 3)."""
    answers = vocabulary_answer_ids(tokenizer) if vocabulary else None
    logits = _reference_logits(model, tokenizer, contexts, cache)
    values, mass = _readout(logits, tokenizer, len(contexts), answers, space, signs)
    return (values.cpu(), mass.cpu()) if with_mass else values.cpu()


@torch.no_grad()
def read_beliefs_references(model, tokenizer, contexts, space=None, signs=None):
    """(the answer words' values, the whole vocabulary's) [n, k] each, as read_beliefs_reference
    with cache=True and vocabulary False and True, from the same forwards (the evaluation's
    fidelity check: each context once through transformers' own cache, not k times)."""
    logits, n = _reference_logits(model, tokenizer, contexts, cache=True), len(contexts)
    return tuple(_readout(logits, tokenizer, n, answers, space, signs)[0].cpu()
                 for answers in (None, vocabulary_answer_ids(tokenizer)))


def _reference_logits(model, tokenizer, contexts, cache=False):
    """[n * k, V] next-token logits of each context plus each question: plain forwards, or
    (cache) the context once into transformers' KV cache and each question on a copy of it."""
    import copy
    turns, _ = probe_ids(tokenizer)
    device = next(model.parameters()).device
    ids = lambda tokens: torch.tensor([tokens], device=device)  # noqa: E731
    if not cache:
        return torch.stack([model(ids(context + t), logits_to_keep=1).logits[0, -1]
                            for context in contexts for t in turns])
    name = models.cache_argument(model)
    logits = []
    for context in contexts:
        kv = model(ids(context), use_cache=True, logits_to_keep=1).past_key_values
        logits += [model(ids(t), logits_to_keep=1, **{name: copy.deepcopy(kv)}).logits[0, -1]
                   for t in turns]
    return torch.stack(logits)


# -----------------------------------------------------------------------------
# the logit decision (arena.DECISION_QUESTION; rollout.DECISION "logit"): the same fork machinery,
# one question, and the probabilities of arena.DECISION_WORDS' first tokens instead of Yes/No


@functools.cache  # built once per tokenizer
def decision_ids(tokenizer):
    """The decision question's turn ids, and per choice (arena.DECISION_WORDS order) the first
    tokens of its word's spellings ("Accept", " Accept", "accept", " accept") that no other
    choice shares. A tokenizer that leaves a choice no token of its own is refused in one line."""
    from persuarena import arena
    firsts = [set(answer_ids(tokenizer, (w, " " + w, w.lower(), " " + w.lower())))
              for w in arena.DECISION_WORDS.values()]
    own = [tuple(sorted(f - set().union(*(g for g in firsts if g is not f)))) for f in firsts]
    if not all(own):
        lost = [w for w, ids in zip(arena.DECISION_WORDS.values(), own) if not ids]
        raise ValueError(f"probes.py: the tokenizer gives the decision words {lost} no first token "
                         "of their own; change arena.DECISION_WORDS")
    return models.turn_ids(tokenizer, arena.DECISION_QUESTION), tuple(own)


def decision_probs(logits, tokenizer):
    """[n, V] next-token logits after the decision question -> [n, choices] probabilities of each
    choice, renormalised over the choices' tokens (sum P(its ids) / sum over all choices)."""
    logp = torch.log_softmax(logits.float(), -1)
    per_choice = torch.stack([logp[:, list(ids)].logsumexp(-1)
                              for ids in decision_ids(tokenizer)[1]], -1)
    return per_choice.softmax(-1)


def decision_blocks(eng) -> int:
    """KV blocks one sequence's decision read can take at most (read_blocks' rule)."""
    return eng.blocks_for(len(decision_ids(eng.tokenizer)[0]), copy_on_write=True)


def read_decisions(eng, sids: list[int]) -> "torch.Tensor":
    """Decision probabilities [n, choices] for sequences whose context is closed and fully cached:
    one fork per sequence with the question, one forward, every fork freed."""
    turn, need = decision_ids(eng.tokenizer)[0], decision_blocks(eng)
    if need > eng.free_blocks:
        raise RuntimeError(f"probes.py: a decision read takes up to {need} KV blocks, the pool "
                           f"has {eng.free_blocks} free; leave room for it (rollout reserves it)")
    out, step = [], eng.free_blocks // need
    for i in range(0, len(sids), step):
        forks = [eng.fork(s, turn) for s in sids[i:i + step]]
        out.append(decision_probs(eng.forward(forks), eng.tokenizer))
        for s in forks:
            eng.free(s)
    return torch.cat(out).cpu()


def sample_decisions(probs: torch.Tensor, keys: list[int],
                     positions: list[int]) -> list[str | None]:
    """One choice of arena.DECISION_WORDS per row of probs [n, choices] (read_decisions),
    Gumbel-max with the noise of engine.sample: a pure function of the row's stream key and its
    position, so a replayed episode decides the same."""
    from persuarena import arena
    keys = torch.tensor([engine.stream_key(k, "decision") for k in keys], dtype=torch.long)
    noise = engine.uniform_noise(keys, torch.tensor(positions, dtype=torch.long), probs.shape[-1])
    picks = (probs.clamp_min(1e-30).log() - torch.log(-torch.log(noise))).argmax(-1)
    choices = list(arena.DECISION_WORDS)
    return [choices[i] for i in picks.tolist()]


@torch.no_grad()
def read_decisions_reference(model, tokenizer, contexts):
    """The same probabilities by one plain full forward of each context plus question, no cache."""
    turn, device = decision_ids(tokenizer)[0], next(model.parameters()).device
    logits = [model(torch.tensor([c + turn], device=device), logits_to_keep=1).logits[0, -1]
              for c in contexts]
    return decision_probs(torch.stack(logits), tokenizer).cpu()


# -----------------------------------------------------------------------------
# the belief decision (rollout.DECISION "belief"): the persuadee accepts as its own belief says


def belief_accept_prob(b, threshold=None, temperature=None):
    """p = sigmoid((b - BELIEF_THRESHOLD) / BELIEF_TEMPERATURE); 0 for an absent belief (None)."""
    if b is None:
        return 0.0
    threshold = BELIEF_THRESHOLD if threshold is None else threshold
    temperature = BELIEF_TEMPERATURE if temperature is None else temperature
    z = (b - threshold) / temperature
    return 1 / (1 + math.exp(-z)) if z >= 0 else math.exp(z) / (1 + math.exp(z))


def belief_decisions(beliefs, keys, positions):
    """(decisions, probabilities): per reply "ACCEPT" where u < belief_accept_prob(b), else None
    (no decision: the talk goes on), u the uniform noise of the episode's stream key at the
    context's position (engine.uniform_noise), so a replayed episode decides the same whatever
    rows run beside it."""
    if not beliefs:
        return [], []
    streams = torch.tensor([engine.stream_key(k, "belief") for k in keys], dtype=torch.long)
    u = engine.uniform_noise(streams, torch.tensor(positions, dtype=torch.long), 1)[:, 0].tolist()
    p = [belief_accept_prob(b) for b in beliefs]
    return ["ACCEPT" if ui < pi else None for ui, pi in zip(u, p)], p
