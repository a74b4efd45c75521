"""
rollout.py: the dialogues. Episodes of a persuader and a persuadee, scheduled onto two engines.

A persuasion dialogue is two growing contexts, the persuader's and the persuadee's. Each turn only
appends: the persuader's new message goes into the persuadee's context, the reply into the
persuader's, so every token of a conversation is prefilled exactly once (engine.py). After each
reply the persuadee's beliefs are read in forks of its context (probes.py); at the end a frozen
judge scores each transcript.

Scheduling, so that any number of episodes completes on any pool that holds one of them:
    admit    groups in order, while both pools keep room for the group's prompts plus one
             message per episode; each instance's prompts are prefilled once and forked G times
    round    the episodes whose next message fits the pool (its worst case: MAX_NEW_TOKENS, the
             probe forks) run it; the others wait untouched; finished episodes free their blocks
             and the queue refills (continuous admission)
    stall    when no episode can move, the youngest is freed and put back in the queue: its
             random streams are keyed by (seed, instance, group index, side), so its replay is
             the same episode. An episode ends "cache" only when it cannot fit a pool alone.
A persuader message whose reply never came (the episode ended "cache" or "context" in between)
is kept in the transcript but masked out of the loss: its tokens get turn id 0, since no
belief change and no decision answers it.

    python -m pytest -q test_rollout.py
"""
import time
from collections import deque
from contextlib import contextmanager

import arena
import engine
import models
import probes

JUDGE_MAX_NEW_TOKENS = 32  # the judge answers three short lines (~15 tokens)
SAMPLING = {  # per preset: (persuader, persuadee). The persuader samples its whole tempered
    # distribution (pi_old exact); the frozen persuadee may truncate. paper: Qwen3 non-thinking
    # as its makers advise; cpu: SmolLM2-135M, chosen by reading its samples (README)
    "paper": (engine.Sampling(1.0), engine.Sampling(0.7, top_p=0.8, top_k=20)),
    "cpu": (engine.Sampling(0.7), engine.Sampling(0.7, top_p=0.8, top_k=20)),
}
PERSUADER_SAMPLING, PERSUADEE_SAMPLING = SAMPLING["paper"]
JUDGE_RETRY_SAMPLING = engine.Sampling(0.7, top_p=0.8, top_k=20)  # the judge's sampled retries
CUT_OFF = ("context", "cache")  # end reasons of a message that could not be completed
CLOSING_ROOM = 8  # tokens kept for the template's tail that closes a reply
PROMPT_ROOM = engine.MAX_NEW_TOKENS // 4  # context a prompt must leave free: a short exchange
ADMISSION = "continuous"  # or "waves": admit only into empty pools (README compares the two)


@contextmanager
def clock(timings, key):
    """Add the block's wall time to timings[key] (when timings is a dict)."""
    start = time.perf_counter()
    yield
    if timings is not None:
        timings[key] = timings.get(key, 0.0) + time.perf_counter() - start


def prompt_ids(persuader_tok, persuadee_tok, instance):
    """The persuader's prompt (ending in its generation prompt) and the persuadee's system turn."""
    return (models.chat_ids(persuader_tok, arena.persuader_messages(instance), True),
            models.chat_ids(persuadee_tok, arena.persuadee_messages(instance), False))


def prompt_problems(persuader, persuadee, instances, prompts=None):
    """{instance id: why it cannot be played}, for prompts (prompt_ids of each instance, built
    here unless given) that leave less than PROMPT_ROOM tokens of a model's context."""
    problems = {}
    prompts = prompts or [prompt_ids(persuader.tokenizer, persuadee.tokenizer, inst)
                          for inst in instances]
    for inst, pair in zip(instances, prompts):
        for side, eng, ids in zip(("persuader", "persuadee"), (persuader, persuadee), pair):
            if len(ids) + PROMPT_ROOM > eng.max_len:
                problems[inst["id"]] = (f"the {side} prompt of {inst['id']} is {len(ids)} tokens, "
                                        f"the model's context {eng.max_len}")
    return problems


def persuadee_heard(tokenizer, text, final_turn):
    """Ids of the persuader's message as the persuadee receives it: inert text, tags stripped;
    on the last turn the final-turn instruction follows as a system turn (never part of any
    transcript, and not something the persuader can write)."""
    return models.chat_ids(tokenizer, arena.persuadee_sees(text, final_turn), True,
                           continued=True)


def persuadee_turn(persuadee, sids, heard, *, sampling, max_new_tokens, keys=None,
                   timings=None):
    """The persuadee's half of a turn, for each sequence: the message it heard (persuadee_heard)
    enters its context, it replies, its reply is closed and its beliefs are read in forks.

    Returns per sequence {text, decision, reason, probes, probe_mass (the Yes+No mass of each
    read-out)}; a reply cut off by the cache or the context ("context", "cache") has no probes,
    and its sequence is left as it is."""
    tok = persuadee.tokenizer
    for sid, ids in zip(sids, heard):
        persuadee.append(sid, ids)
    with clock(timings, "persuadee_s"):
        outs = persuadee.generate(sids, max_new_tokens, sampling, keys)
    replies, closed = [], []
    for sid, (ids, _, reason) in zip(sids, outs):
        text = tok.decode(ids, skip_special_tokens=True).strip()
        closing = models.closing_ids(tok, ids)
        if (reason not in CUT_OFF and persuadee.length(sid) + len(closing)
                + probes.longest_question(tok) > persuadee.max_len):
            reason = "context"  # no room left to close the reply and ask the probes
        replies.append(dict(text=text, decision=arena.parse_decision(text), reason=reason,
                            probes=None, probe_mass=None))
        if reason not in CUT_OFF:
            persuadee.append(sid, closing)
            closed.append((sid, replies[-1]))
    if closed:
        with clock(timings, "persuadee_s"):
            persuadee.forward([sid for sid, _ in closed])
        with clock(timings, "probe_s"):
            values, mass = probes.read_engine(persuadee, [sid for sid, _ in closed], with_mass=True)
        for (_, reply), v, m in zip(closed, values.tolist(), mass.tolist()):
            reply["probes"], reply["probe_mass"] = v, m
    return replies


def message_blocks(eng, max_new_tokens):
    """Blocks one more message of a sequence can take at most (one more for copy-on-write)."""
    return -(-max_new_tokens // eng.block_size) + 1


def rollout_episodes(persuader, persuadee, instances, t_max, *, group_size=1, seed=0,
                     persuader_sampling=PERSUADER_SAMPLING, persuadee_sampling=PERSUADEE_SAMPLING,
                     max_new_tokens=engine.MAX_NEW_TOKENS, judge=None, max_active=None,
                     progress=None, timings=None):
    """Play G = group_size episodes of every instance to the end, scheduled onto the pools.

    `max_active` caps the episodes in play at once (default: as many as the pools take).
    `timings`, when given a dict, accumulates seconds under persuader_s, persuadee_s, probe_s
    and judge_s. Returns one record per episode (instance-major): outcome, transcript, beliefs
    b_0..b_T and probe values, judge score, and the persuader-side token stream for training:
    `ids`, `turn_ids` (t for the tokens the policy sampled in message t, else 0) and
    `logprobs`."""
    er_tok, ee_tok = persuader.tokenizer, persuadee.tokenizer
    prompts = [prompt_ids(er_tok, ee_tok, inst) for inst in instances]  # built once
    problems = prompt_problems(persuader, persuadee, instances, prompts)
    if problems:
        raise ValueError("rollout.py: " + "; ".join(problems.values()) + ". Leave these instances "
                         "out (rollout.prompt_problems finds them) or use a longer-context model.")
    queue = deque((i, list(range(group_size))) for i in range(len(instances)))
    active, done = [], {}
    er_step = message_blocks(persuader, max_new_tokens)
    ee_step = message_blocks(persuadee, max_new_tokens) + probes.read_blocks(persuadee)

    def prefill(index):
        """An instance's prompts, prefilled once on each side (its episodes fork them)."""
        er_ids, ee_ids = prompts[index]
        er_root, ee_root = persuader.new(er_ids[:-1]), persuadee.new(ee_ids)
        with clock(timings, "persuader_s"):
            persuader.forward([er_root])
        with clock(timings, "persuadee_s"):
            persuadee.forward([ee_root])
        return er_root, ee_root

    def start(groups):
        """Read b_0 of every prefilled instance in one probe read, fork one episode per member."""
        with clock(timings, "probe_s"):
            b0s, m0s = (x.tolist() for x in probes.read_engine(
                persuadee, [ee_root for _, _, _, ee_root in groups], with_mass=True))
        for (index, members, er_root, ee_root), b0, m0 in zip(groups, b0s, m0s):
            inst, er_ids = instances[index], prompts[index][0]
            for g in members:
                key = (seed, inst["id"], g)
                active.append(dict(
                    index=index, g=g, inst=inst, state=arena.Episode(t_max), phase="speak",
                    er=persuader.fork(er_root, er_ids[-1:]), ee=persuadee.fork(ee_root),
                    er_key=engine.stream_key(*key, "persuader"),
                    ee_key=engine.stream_key(*key, "persuadee"),
                    ids=list(er_ids), turn_ids=[0] * len(er_ids), logprobs=[0.0] * len(er_ids),
                    transcript=[], probes=[b0], probe_mass=[m0], beliefs=[sum(b0) / 3]))
            persuader.free(er_root)
            persuadee.free(ee_root)

    def fits_group(index, members):
        """Room on both pools for the prompts, b_0's forks and one message per member."""
        er_ids, ee_ids = prompts[index]
        blocks = lambda eng, n: -(-n // eng.block_size)
        er_need = blocks(persuader, len(er_ids)) + len(members) * er_step
        ee_need = blocks(persuadee, len(ee_ids)) + len(members) * ee_step
        return er_need <= persuader.free_blocks and ee_need <= persuadee.free_blocks

    def finish(e, reason=None):
        if reason:
            e["state"].end(reason)
        persuader.free(e["er"])
        persuadee.free(e["ee"])
        done[e["index"], e["g"]] = e
        active.remove(e)

    def split_head(n):  # the queue's first group, as its first n members and the rest
        index, members = queue.popleft()
        queue.extendleft([(index, members[n:]), (index, members[:n])])

    def refill():
        """Admit groups from the queue while the pools take them: prompts prefilled one group at
        a time (each fits_group sees the blocks the last one took), b_0 read for all at once."""
        started = []  # (index, members, persuader root, persuadee root)
        admit(started)
        if started:
            start(started)

    def admit(started):
        if ADMISSION == "waves" and active:
            return
        while queue:
            admitted = len(active) + sum(len(members) for _, members, _, _ in started)
            allowed = len(queue[0][1]) if max_active is None else max_active - admitted
            if allowed <= 0:
                return
            if allowed < len(queue[0][1]):
                split_head(allowed)
            index, members = queue[0]
            if not fits_group(index, members):
                if active or started:
                    return
                if len(members) > 1:  # alone in the pools and still too big: one at a time
                    split_head(1)
                    continue
                queue.popleft()  # one episode does not fit empty pools: it can never start
                done[index, members[0]] = dict(index=index, g=members[0], inst=instances[index],
                                               state=arena.Episode(t_max), transcript=[],
                                               probes=[], probe_mass=[], beliefs=[], ids=[],
                                               turn_ids=[], logprobs=[])
                done[index, members[0]]["state"].end("cache")
                continue
            queue.popleft()
            started.append((index, members, *prefill(index)))

    def preempt():
        """Free the youngest episode and queue it to be replayed from the start, once another
        episode has finished (else it would be admitted straight back into the same stall)."""
        e = active.pop()
        persuader.free(e["er"])
        persuadee.free(e["ee"])
        queue.appendleft((e["index"], [e["g"]]))
        return len(done)

    def append(e, ids, turn=0, logprobs=None):  # the persuader-side token stream for training
        e["ids"] += ids
        e["turn_ids"] += [turn] * len(ids)
        e["logprobs"] += logprobs or [0.0] * len(ids)

    def mask_last_message(e):
        """The last persuader message got no reply: no loss on its tokens (module docstring)."""
        turn = e["state"].turn + 1
        e["turn_ids"] = [0 if t == turn else t for t in e["turn_ids"]]

    held = -1  # len(done) at the last preemption: no admission until an episode finishes
    refill()
    while active or queue:
        moved = False
        ready = [e for e in active if e["phase"] == "speak"]  # worst case: a whole message
        fits = set(persuader.admit([e["er"] for e in ready],
                                   [persuader.length(e["er"]) - persuader.cached(e["er"])
                                    + max_new_tokens for e in ready]))
        speakers = [e for e in ready if e["er"] in fits]
        if speakers:
            moved = True
            with clock(timings, "persuader_s"):
                outs = persuader.generate([e["er"] for e in speakers], max_new_tokens,
                                          persuader_sampling, [e["er_key"] for e in speakers])
            for e, (ids, logprobs, reason) in zip(speakers, outs):
                text = er_tok.decode(ids, skip_special_tokens=True).strip()
                append(e, ids, e["state"].turn + 1, logprobs)
                e["er_ids"] = ids
                e["transcript"].append({"role": "persuader", "text": text, "decision": None})
                if reason in CUT_OFF:
                    mask_last_message(e)
                    finish(e, reason)
                    continue
                e["heard"] = persuadee_heard(ee_tok, text, e["state"].final_turn)
                e["phase"] = "reply"
        ready = [e for e in active if e["phase"] == "reply"]  # a whole reply, then its probes
        fits = set(persuadee.admit([e["ee"] for e in ready],
                                   [len(e["heard"]) + max_new_tokens + CLOSING_ROOM for e in ready],
                                   reserve=probes.read_blocks(persuadee)))
        chosen = [e for e in ready if e["ee"] in fits]
        if chosen:
            moved = True
            replies = persuadee_turn(persuadee, [e["ee"] for e in chosen],
                                     [e.pop("heard") for e in chosen], sampling=persuadee_sampling,
                                     max_new_tokens=max_new_tokens,
                                     keys=[e["ee_key"] for e in chosen], timings=timings)
            for e, reply in zip(chosen, replies):
                e["transcript"].append({"role": "persuadee", "text": reply["text"],
                                        "decision": reply["decision"]})
                if reply["reason"] in CUT_OFF:
                    mask_last_message(e)
                    finish(e, reply["reason"])
                    continue
                e["state"].step(reply["decision"])
                e["probes"].append(reply["probes"])
                e["probe_mass"].append(reply["probe_mass"])
                e["beliefs"].append(sum(reply["probes"]) / 3)
                if e["state"].done:
                    finish(e)
                    continue
                # the persuader reads the reply, tags stripped
                seen = arena.persuader_sees(reply["text"])
                ids = models.closing_ids(er_tok, e["er_ids"]) + models.turn_ids(er_tok, seen)
                persuader.append(e["er"], ids)
                append(e, ids)
                e["phase"] = "speak"
                if persuader.overflow(e["er"]) == "context":
                    finish(e, "context")
        if not moved and active:
            if len(active) == 1:  # alone in the pools and still stuck: it cannot fit
                finish(active[0], "cache")
            else:
                held = preempt()
        if len(done) > held or not active:
            refill()
        if progress is not None:
            progress.update(len(done) - progress.n)
    episodes = [done[i, g] for i in range(len(instances)) for g in range(group_size)]
    scores, failed = [0.0] * len(episodes), [False] * len(episodes)
    if judge is not None:
        with clock(timings, "judge_s"):
            scores, failed = judge_scores(judge, [e["inst"] for e in episodes],
                                  [e["transcript"] for e in episodes], seed,
                                  [e["g"] for e in episodes])
    return [dict(
        id=e["inst"]["id"], scenario_id=e["inst"].get("scenario_id", e["inst"]["id"]),
        domain=e["inst"]["domain"], resistance=e["inst"]["hidden"].get("resistance"),
        outcome=e["state"].outcome, turns=max(len(e["beliefs"]) - 1, 0),
        end_reason=e["state"].end_reason, transcript=e["transcript"], beliefs=e["beliefs"],
        probes=e["probes"], probe_mass=e["probe_mass"], judge=score, judge_failed=fail,
        ids=e["ids"], turn_ids=e["turn_ids"], logprobs=e["logprobs"])
        for e, score, fail in zip(episodes, scores, failed)]


def judge_scores(judge, instances, transcripts, seed=0, group_indices=None):
    """(strategy score s, fell back) per transcript: one greedy answer, then up to
    arena.JUDGE_RETRIES sampled retries, then s = 0 with fell back True (also for a prompt too
    long to judge, or one that the judge's free pool cannot take even alone). Run in chunks of
    transcripts that the pool takes at once (their prompts plus their answers), in order, a group
    split across chunks where it does not fit whole; attempt k of transcript i samples from the
    stream keyed by (seed, instance, group index, "judge", k), whatever its chunk."""
    group_indices = group_indices or list(range(len(instances)))
    tok = judge.tokenizer
    prompts = [models.chat_ids(tok, arena.judge_messages(inst, transcript), True)
               for inst, transcript in zip(instances, transcripts)]
    answer = message_blocks(judge, JUDGE_MAX_NEW_TOKENS)
    need = [-(-len(p) // judge.block_size) + answer for p in prompts]
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
                                   [instances[j]["id"] for j in chunk], keys)
            for j, s in zip(chunk, verdicts):
                scores[j] = s
            chunk, room = [], judge.free_blocks
        if i is not None:
            chunk.append(i)
            room -= need[i]
    return [0.0 if s is None else s for s in scores], [s is None for s in scores]


def judge_chunk(judge, prompts, group_ids, keys):
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
    scores = [None] * len(prompts)
    waiting = [bases[i] for i in judged if judge.length(bases[i]) > judge.cached(bases[i])]
    if waiting:
        judge.forward(waiting)  # the chunk was sized to fit (judge_scores)
    for attempt in range(1 + arena.JUDGE_RETRIES):
        todo = [i for i in judged if scores[i] is None]
        if not todo:
            break
        sids = [judge.fork(bases[i], prompts[i][-1:]) for i in todo]
        sampling = engine.GREEDY if attempt == 0 else JUDGE_RETRY_SAMPLING
        outs = judge.generate(sids, JUDGE_MAX_NEW_TOKENS, sampling,
                              [engine.stream_key(keys[i], attempt) for i in todo])
        for i, sid, (ids, _, _) in zip(todo, sids, outs):
            scores[i] = arena.parse_judge(tok.decode(ids, skip_special_tokens=True))
            judge.free(sid)
    for sid in roots + [b for b in bases if b is not None]:
        judge.free(sid)
    return scores
