"""
rollout.py: the dialogues. Episodes of a persuader and a persuadee, played on two engine.

A persuasion dialogue is two growing contexts, the persuader's and the persuadee's. Each turn only
appends: the persuader's new message goes into the persuadee's context, the reply into the
persuader's, so every token of a conversation is prefilled exactly once (engine.py). After each
reply the persuadee's beliefs are read in forks of its context (probes.py); at the end a frozen
judge scores each transcript.

    python -m pytest -q test_rollout.py
"""
import time
from contextlib import contextmanager

import torch

import arena
import engine
import models
import probes

JUDGE_MAX_NEW_TOKENS = 32  # the judge answers three short lines (~15 tokens)


@contextmanager
def clock(timings, key):
    """Add the block's wall time to timings[key] (when timings is a dict)."""
    start = time.perf_counter()
    yield
    if timings is not None:
        timings[key] = timings.get(key, 0.0) + time.perf_counter() - start


def rollout_episodes(persuader, persuadee, instances, t_max, *, group_size=1, seed=0,
                     persuader_temperature=1.0, persuadee_temperature=0.7, top_p=None,
                     max_new_tokens=engine.MAX_NEW_TOKENS, judge=None, progress=None, timings=None):
    """Play G = group_size episodes of every instance to the end, all in one batch.

    `timings`, when given a dict, accumulates seconds under persuader_s, persuadee_s, probe_s
    and judge_s.
    Returns one record per episode (instance-major): outcome, transcript, beliefs b_0..b_T and
    probe values, judge score, and the persuader-side token stream for training: `ids`,
    `turn_ids` (t for the tokens the policy sampled in message t, else 0) and `logprobs`."""
    er_tok, ee_tok = persuader.tokenizer, persuadee.tokenizer
    gen_er = torch.Generator(persuader.device).manual_seed(seed)
    gen_ee = torch.Generator(persuadee.device).manual_seed(seed + 1)
    # each system prompt is prefilled once per instance and shared by its group through forks;
    # the persuader's last prompt token stays pending so that every fork samples its own message
    roots = []
    for inst in instances:
        er_ids = models.chat_ids(er_tok, arena.persuader_messages(inst), True)
        er_root = persuader.new(er_ids[:-1])
        ee_ids = models.chat_ids(ee_tok, arena.persuadee_messages(inst), False)
        ee_root = persuadee.new(ee_ids)
        for eng, root in ((persuader, er_root), (persuadee, ee_root)):
            if eng.overflow(root):
                raise RuntimeError(
                    f"rollout.py: the system prompt of {inst['id']} ({eng.length(root)} tokens) "
                    f"does not fit the {eng.overflow(root)}; give the Engine more blocks "
                    "(CACHE_GB_CPU, CACHE_FRACTION_GPU) or roll out fewer episodes at once.")
        roots.append((inst, er_ids, er_root, ee_root))
    er_roots, ee_roots = [r[2] for r in roots], [r[3] for r in roots]
    persuader.forward(er_roots)
    persuadee.forward(ee_roots)
    with clock(timings, "probe_s"):
        b0s = probes.read_engine(persuadee, ee_roots).tolist()
    episodes = []
    for (inst, er_ids, er_root, ee_root), b0 in zip(roots, b0s):
        for _ in range(group_size):
            er, ee = persuader.fork(er_root, er_ids[-1:]), persuadee.fork(ee_root)
            episodes.append(dict(inst=inst, er=er, ee=ee, state=arena.Episode(t_max),
                                 ids=list(er_ids), turn_ids=[0] * len(er_ids),
                                 logprobs=[0.0] * len(er_ids), transcript=[], probes=[b0],
                                 beliefs=[sum(b0) / 3]))
        persuader.free(er_root)
        persuadee.free(ee_root)

    def append(e, ids, turn=0, logprobs=None):  # the persuader-side token stream for training
        e["ids"] += ids
        e["turn_ids"] += [turn] * len(ids)
        e["logprobs"] += logprobs or [0.0] * len(ids)

    active = list(episodes)
    while active:
        # the persuader speaks; its tags are stripped before the persuadee reads the message
        with clock(timings, "persuader_s"):
            outs = persuader.generate([e["er"] for e in active], max_new_tokens,
                                      persuader_temperature, top_p, gen_er)
        speaking = []
        for e, (ids, logprobs, reason) in zip(active, outs):
            text = er_tok.decode(ids, skip_special_tokens=True).strip()
            append(e, ids, e["state"].turn + 1, logprobs)
            e["er_ids"] = ids
            e["transcript"].append({"role": "persuader", "text": text, "decision": None})
            if reason in ("context", "cache"):
                e["state"].end(reason)
                continue
            speaking.append(e)
        # the persuadee replies; its message is closed and its beliefs read in forks
        replies = persuadee_turn(persuadee, [e["ee"] for e in speaking],
                                 [e["transcript"][-1]["text"] for e in speaking],
                                 [e["state"].final_turn for e in speaking],
                                 temperature=persuadee_temperature, top_p=top_p,
                                 max_new_tokens=max_new_tokens, generator=gen_ee, timings=timings)
        for e, reply in zip(speaking, replies):
            e["transcript"].append({"role": "persuadee", "text": reply["text"],
                                    "decision": reply["decision"]})
            if reply["reason"] in ("context", "cache"):
                e["state"].end(reply["reason"])
                continue
            e["state"].step(reply["decision"])
            e["probes"].append(reply["probes"])
            e["beliefs"].append(sum(reply["probes"]) / 3)
        # the persuader reads the reply, tags stripped
        for e in active:
            if e["state"].done:
                continue
            reply = arena.persuader_sees(e["transcript"][-1]["text"])
            ids = models.closing_ids(er_tok, e["er_ids"]) + models.turn_ids(er_tok, reply)
            persuader.append(e["er"], ids)
            append(e, ids)
            if reason := persuader.overflow(e["er"]):
                e["state"].end(reason)
        for e in active:
            if e["state"].done:
                persuader.free(e["er"])
                persuadee.free(e["ee"])
        active = [e for e in active if not e["state"].done]
        if progress is not None:
            progress.update(len(episodes) - len(active) - progress.n)
    scores, failed = [0.0] * len(episodes), [False] * len(episodes)
    if judge is not None:
        with clock(timings, "judge_s"):
            scores, failed = judge_scores(judge, [e["inst"] for e in episodes],
                                          [e["transcript"] for e in episodes], seed)
    return [dict(
        id=e["inst"]["id"], scenario_id=e["inst"].get("scenario_id", e["inst"]["id"]),
        domain=e["inst"]["domain"], resistance=e["inst"]["hidden"]["resistance"],
        outcome=e["state"].outcome, turns=len(e["beliefs"]) - 1,
        end_reason=e["state"].end_reason, transcript=e["transcript"], beliefs=e["beliefs"],
        probes=e["probes"], judge=score, judge_failed=fail, ids=e["ids"], turn_ids=e["turn_ids"],
        logprobs=e["logprobs"]) for e, score, fail in zip(episodes, scores, failed)]



def persuadee_turn(persuadee, sids, messages, final_turns, *, temperature, top_p, max_new_tokens,
                   generator=None, timings=None):
    """The persuadee's half of a turn, for each sequence: the persuader's message enters its
    context as inert text (tags stripped; where due, the final-turn instruction follows as a
    system turn, never in a transcript),
    it replies, its reply is closed and its beliefs are read in forks.

    Returns per sequence {text, decision, reason, probes}; a reply cut off by the cache or the
    context ("context", "cache") has no probes, and its sequence is left as it is."""
    tok = persuadee.tokenizer
    for sid, text, final in zip(sids, messages, final_turns):
        persuadee.append(sid, models.chat_ids(tok, arena.persuadee_sees(text, final), True,
                                              continued=True))
    with clock(timings, "persuadee_s"):
        outs = persuadee.generate(sids, max_new_tokens, temperature, top_p, generator)
    replies, closed = [], []
    for sid, (ids, _, reason) in zip(sids, outs):
        text = tok.decode(ids, skip_special_tokens=True).strip()
        replies.append(dict(text=text, decision=arena.parse_decision(text), reason=reason,
                            probes=None))
        if reason not in ("context", "cache"):
            persuadee.append(sid, models.closing_ids(tok, ids))
            closed.append((sid, replies[-1]))
    if closed:
        with clock(timings, "persuadee_s"):
            persuadee.forward([sid for sid, _ in closed])
        with clock(timings, "probe_s"):
            values = probes.read_engine(persuadee, [sid for sid, _ in closed]).tolist()
        for (_, reply), v in zip(closed, values):
            reply["probes"] = v
    return replies


def judge_scores(judge, instances, transcripts, seed=0):
    """(strategy score s, fell back) per transcript: one greedy answer, then up to
    arena.JUDGE_RETRIES sampled retries, then s = 0 with fell back True (also for a prompt too
    long to judge).

    Prompts are prefilled once: the part a group shares (the instruction and the hidden profile
    of its instance) in one root, each transcript in a fork of it, each attempt in a fork of that."""
    gen = torch.Generator(judge.device).manual_seed(seed + 2)
    tok = judge.tokenizer
    prompts = [models.chat_ids(tok, arena.judge_messages(inst, transcript), True)
               for inst, transcript in zip(instances, transcripts)]
    groups = {}
    for i, inst in enumerate(instances):
        groups.setdefault(inst["id"], []).append(i)
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
    scores = [None] * len(prompts)  # None until a verdict parses; the rest fall back to 0
    waiting = [bases[i] for i in judged if judge.length(bases[i]) > judge.cached(bases[i])]
    if waiting:
        judge.forward(waiting)
    for attempt in range(1 + arena.JUDGE_RETRIES):
        todo = [i for i in judged if scores[i] is None]
        if not todo:
            break
        sids = []
        for i in todo:
            sids.append(judge.fork(bases[i], prompts[i][-1:]))
        outs = judge.generate(sids, JUDGE_MAX_NEW_TOKENS, 0.0 if attempt == 0 else 0.7, None, gen)
        for i, sid, (ids, _, _) in zip(todo, sids, outs):
            scores[i] = arena.parse_judge(tok.decode(ids, skip_special_tokens=True))
            judge.free(sid)
    for sid in roots + [b for b in bases if b is not None]:
        judge.free(sid)
    return [0.0 if s is None else s for s in scores], [s is None for s in scores]
