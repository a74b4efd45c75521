"""
The frozen strategy judge run on a local engine: each transcript scored by arena.judge_messages
and arena.parse_judge, s = mean of three 1-5 scores - 3 (lab/served.py has the same for a judge
behind an API). rollout.judge_all calls judge_scores once every episode has ended, with the
judge's answer length (rollout.JUDGE_MAX_NEW_TOKENS) and its one retry policy
(rollout.judge_attempts), which asks this engine for each attempt's answers.
Transcripts are judged in chunks that fit the judge's pool, the part a group of transcripts
shares prefilled once.

Tests: python -m pytest -q tests/test_rollout.py -k judge
"""
from persuarena import arena
from persuarena import engine
from persuarena import models


def judge_scores(judge, instances, transcripts, seed=0, group_indices=None, *, max_tokens,
                 attempts):
    """(strategy score s, fell back) per transcript: the attempts of the retry policy
    (rollout.judge_attempts), then s = 0 with fell back True (also for a prompt too
    long to judge, or one that the judge's free pool cannot take even alone). Run in chunks of
    transcripts that the pool takes at once (their prompts plus their answers), in order, a group
    split across chunks where it does not fit whole; attempt k of transcript i samples from the
    stream keyed by (seed, instance, group index, "judge", k), whatever its chunk."""
    group_indices = group_indices or list(range(len(instances)))
    tok = judge.tokenizer
    prompts = [models.chat_ids(tok, arena.judge_messages(inst, transcript), True)
               for inst, transcript in zip(instances, transcripts)]
    answer = judge.blocks_for(max_tokens, copy_on_write=True)  # as rollout.message_blocks
    need = [judge.blocks_for(len(p)) + answer for p in prompts]
    groups = {}
    for i, inst in enumerate(instances):
        groups.setdefault(inst["id"], []).append(i)
    fits = [i for members in groups.values() for i in members if need[i] <= judge.free_blocks]
    scores, chunk, room = [None] * len(prompts), [], judge.free_blocks
    for i in fits + [None]:
        if chunk and (i is None or need[i] > room):
            keys = [engine.stream_key(seed, instances[j]["id"], group_indices[j], "judge")
                    for j in chunk]
            verdicts = judge_chunk(judge, [prompts[j] for j in chunk],
                                   [instances[j]["id"] for j in chunk], keys, max_tokens,
                                   attempts)
            for j, s in zip(chunk, verdicts):
                scores[j] = s
            chunk, room = [], judge.free_blocks
        if i is not None:
            chunk.append(i)
            room -= need[i]
    return [0.0 if s is None else s for s in scores], [s is None for s in scores]


def judge_chunk(judge, prompts, group_ids, keys, max_tokens, attempts):
    """Verdicts (None where no answer parsed) of prompts that fit the judge's pool together.

    Prompts are prefilled once: the part a group shares (the instruction and the hidden profile
    of its instance) in one root, each transcript in a fork of it, each attempt in a fork of that."""
    tok = judge.tokenizer
    groups = {}
    for i, gid in enumerate(group_ids):
        groups.setdefault(gid, []).append(i)
    roots, bases = [], [None] * len(prompts)
    for members in groups.values():
        ours = [prompts[i] for i in members]
        shared = engine.shared_stem(ours)
        roots.append(judge.new(prompts[members[0]][:shared]))
        if judge.overflow(roots[-1]):
            continue  # too long to judge: those transcripts fall back to 0
        judge.forward(roots[-1:])
        for i in members:
            bases[i] = judge.fork(roots[-1], prompts[i][shared:-1])  # the last token starts each attempt
    judged = [i for i, b in enumerate(bases) if b is not None and not judge.overflow(b)]
    waiting = [bases[i] for i in judged if judge.length(bases[i]) > judge.cached(bases[i])]
    if waiting:
        judge.forward(waiting)  # the chunk was sized to fit (judge_scores)

    def answer(todo, sampling, attempt):  # each attempt in a fork of its transcript's base
        sids = [judge.fork(bases[judged[i]], prompts[judged[i]][-1:]) for i in todo]
        outs = judge.generate(sids, max_tokens, sampling,
                              [engine.stream_key(keys[judged[i]], attempt) for i in todo])
        for sid in sids:
            judge.free(sid)
        return [tok.decode(ids, skip_special_tokens=True) for ids, _, _ in outs]
    scores = [None] * len(prompts)
    for i, s in zip(judged, attempts(answer, len(judged))):
        scores[i] = s
    for sid in roots + [b for b in bases if b is not None]:
        judge.free(sid)
    return scores
