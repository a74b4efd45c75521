"""
served.py: a model served over the OpenAI-compatible chat API as persuader, persuadee or judge.

A spec `openai:MODEL@URL` names the model and the server, e.g.
openai:gpt-4o-mini@https://api.openai.com/v1, or openai:/path/to/folder@http://127.0.0.1:8000/v1
for `transformers serve` (vLLM, SGLang and hosted APIs speak the same API). The key comes from
OPENAI_API_KEY (a loopback server needs none); requests go through the official `openai` client.

The episode is the local one (rollout.py): arena's prompts as chat messages, the same parser,
state machine and tag stripping, records with rollout's keys in the same episodes.jsonl. Text is
what crosses an API, so a served side keeps its context as a message list; a local side
(engine.Engine) keeps its ids, and a local persuadee plays through rollout.persuadee_turn.

Probes of a served persuadee: each question is put after the reply, answered in one greedy token
with the server's top log-probs, and over the Yes and No tokens among them

    p = sum P(yes found) / (sum P(yes found) + sum P(no found)),   v = 2p - 1,

with the found mass P(yes found) + P(no found) recorded beside it. A server that returns no
log-probs (transformers serve ignores them) gets probes and beliefs recorded as None: absent,
never 0; after its first such answer it is not asked again.

Requests: at most MAX_IN_FLIGHT at once per served model, TIMEOUT_S each, up to RETRIES retries
with exponential backoff (or the server's Retry-After) on rate limits, server errors, timeouts
and dropped connections. An episode whose request still fails ends with end_reason "api_error"
and the rest go on. play_episodes appends every finished episode to its episodes.jsonl at once,
so a rerun plays only the episodes missing there.

    python eval.py --persuader openai:gpt-4o-mini@https://api.openai.com/v1 --name gpt-4o-mini
    python -m pytest -q test_served.py
"""
import hashlib
import ipaddress
import json
import math
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

from tqdm import tqdm

import arena
import engine
import models
import probes
import rollout

SPEC_PREFIX = "openai:"       # a model spec with this prefix is served: openai:MODEL@URL
API_KEY_ENV = "OPENAI_API_KEY"
LOOPBACK_KEY = "unused"       # the client needs some key; a server on this machine checks none
MAX_IN_FLIGHT = 8             # concurrent requests per served model
TIMEOUT_S = 120.0             # per request
RETRIES = 4                   # retries of a failed request before its episode ends in API_ERROR
BACKOFF_S = 1.0               # wait before the first retry; doubled for each further one
BACKOFF_MAX_S = 60.0          # longest wait, the server's Retry-After included
TOP_LOGPROBS = 20             # log-probs asked for a probe's one-token answer (OpenAI's maximum)
API_ERROR = "api_error"       # end_reason of an episode whose request kept failing
ENDING_REASONS = ("context", "cache", API_ERROR)  # a half-turn that ends its episode
JUDGE_RETRY_TEMPERATURE = 0.7  # the judge's retries after an unparseable greedy answer (as rollout's)
RETRY_STATUS = (408, 409, 429)  # client-side statuses worth retrying, besides every 5xx

# -----------------------------------------------------------------------------
# specs, errors, probe arithmetic


def is_served(spec):
    return isinstance(spec, str) and spec.startswith(SPEC_PREFIX)


def parse_spec(spec):
    """(model, base URL) of `openai:MODEL@URL`; the URL is what follows the last '@'."""
    model, _, url = spec[len(SPEC_PREFIX):].rpartition("@")
    if not model or not urlparse(url).scheme.startswith("http") or not urlparse(url).netloc:
        raise SystemExit(f"served.py: model spec {spec!r} is not openai:MODEL@URL; write e.g. "
                         "openai:gpt-4o-mini@https://api.openai.com/v1 or "
                         "openai:MODEL@http://127.0.0.1:8000/v1")
    return model, url.rstrip("/")


def api_key(url):
    """OPENAI_API_KEY, or a placeholder for a server on this machine."""
    key = os.environ.get(API_KEY_ENV)
    if key:
        return key
    host = urlparse(url).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise SystemExit(f"served.py: {url} needs a key: set {API_KEY_ENV} (any value for a "
                         "server that checks none)")
    return LOOPBACK_KEY


def retryable(error):
    """Rate limits, server errors, timeouts and dropped connections are worth another try."""
    import openai
    if isinstance(error, openai.APIConnectionError):  # timeouts included
        return True
    status = getattr(error, "status_code", None)
    return status is not None and (status in RETRY_STATUS or status >= 500)


def context_exceeded(error):
    """A request the server refused because the conversation outgrew the model's context."""
    text = f"{getattr(error, 'code', '')} {error}".lower()
    return getattr(error, "status_code", None) == 400 and (
        "context_length" in text or "context length" in text or "maximum context" in text)


def fixed_temperature(error):
    """A request refused because the model takes no temperature but its default (some reasoning
    models)."""
    return getattr(error, "status_code", None) == 400 and "temperature" in str(error).lower()


def backoff_s(attempt, error, rng=random):
    """BACKOFF_S * 2^attempt with up to 25% jitter, or the server's Retry-After; capped."""
    response = getattr(error, "response", None)
    try:
        wait = float(response.headers.get("retry-after"))
    except (AttributeError, TypeError, ValueError):
        wait = BACKOFF_S * 2 ** attempt * (1 + 0.25 * rng.random())
    return min(wait, BACKOFF_MAX_S)


def probe_value(top_logprobs):
    """(v, found mass) from a one-token answer's top log-probs [(token, logprob)]: p is
    renormalised over the Yes and No tokens found (probes.YES_WORDS, NO_WORDS); (None, 0.0) when
    neither appears."""
    yes = sum(math.exp(lp) for tok, lp in top_logprobs if tok in probes.YES_WORDS)
    no = sum(math.exp(lp) for tok, lp in top_logprobs if tok in probes.NO_WORDS)
    if yes + no == 0:
        return None, 0.0
    return 2 * yes / (yes + no) - 1, yes + no


def belief(values):
    """b = mean of the three probe values; None when any is absent."""
    return None if values is None or None in values else sum(values) / len(values)


def seed_of(*parts):
    """A request seed from the run seed and the request's place in it (stable across reruns)."""
    return int(hashlib.sha256(repr(parts).encode()).hexdigest()[:8], 16) % 2**31


# -----------------------------------------------------------------------------
# resumable episodes.jsonl


def read_played(path):
    """Records already in episodes.jsonl, by id. A last line cut off by a kill is dropped from
    the file; an id written twice is an error."""
    path = Path(path)
    if not path.exists():
        return {}
    text = path.read_text()
    lines = text.split("\n")
    if lines[-1]:  # no newline after the last record: it was being written when the run died
        path.write_text("\n".join(lines[:-1]) + ("\n" if len(lines) > 1 else ""))
    played = {}
    for lineno, line in enumerate(lines[:-1], 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno} is not valid JSON ({e.msg}); delete that line to "
                             "play its episode again") from None
        if record["id"] in played:
            raise ValueError(f"{path}:{lineno} repeats episode {record['id']}; delete one of them")
        played[record["id"]] = record
    return played


def append_record(path, record):
    """One finished episode, flushed to disk before the next is played."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


# -----------------------------------------------------------------------------
# the judge, served or local


def judge_scores(judge, instances, transcripts, seed=0):
    """(strategy score s, fell back) per transcript, as rollout.judge_scores returns them: greedy
    first, then sampled retries, then 0. A local judge (engine.Engine) runs rollout.judge_scores."""
    if not isinstance(judge, ServedModel):
        return rollout.judge_scores(judge, instances, transcripts, seed)
    scores = [None] * len(instances)
    for attempt in range(1 + arena.JUDGE_RETRIES):
        todo = [i for i, s in enumerate(scores) if s is None]
        if not todo:
            break
        replies = judge.map([dict(
            messages=arena.judge_messages(instances[i], transcripts[i]),
            max_tokens=rollout.JUDGE_MAX_NEW_TOKENS,
            temperature=0.0 if attempt == 0 else JUDGE_RETRY_TEMPERATURE,
            seed=seed_of(seed, "judge", instances[i]["id"], attempt)) for i in todo])
        for i, reply in zip(todo, replies):
            if not isinstance(reply, ServedError):
                scores[i] = arena.parse_judge(reply["text"])
    judge.count("judge_fallbacks", sum(s is None for s in scores))
    return [0.0 if s is None else s for s in scores], [s is None for s in scores]


# -----------------------------------------------------------------------------
# episodes with served and local sides


def side(model, role):
    """The persuader or persuadee adapter for a served model or a local engine.Engine."""
    if role == "persuader":
        return ServedPersuader(model) if isinstance(model, ServedModel) else LocalPersuader(model)
    return ServedPersuadee(model) if isinstance(model, ServedModel) else LocalPersuadee(model)


def record(inst, state, transcript, probe_rows, masses, judge, judge_failed=None):
    """A record with rollout.rollout_episodes' keys (less the training token stream); probe_mass
    is the Yes + No probability mass each probe found."""
    out = dict(id=inst["id"], scenario_id=inst.get("scenario_id", inst["id"]),
               domain=inst["domain"], resistance=inst["hidden"].get("resistance"),
               outcome=state.outcome, turns=len(probe_rows) - 1, end_reason=state.end_reason,
               transcript=transcript, beliefs=[belief(v) for v in probe_rows], probes=probe_rows,
               judge=judge, judge_failed=judge_failed)
    out["probe_mass"] = masses
    return out


def play_episodes(persuader, persuadee, instances, t_max, *, judge=None, seed=0,
                  persuader_temperature=1.0, persuadee_temperature=0.7, top_p=None,
                  max_new_tokens=engine.MAX_NEW_TOKENS, out_path=None, progress=True,
                  with_stream=False):
    """One episode per instance, every side a ServedModel or a local engine.Engine, all
    episodes advanced a turn at a time (a side's requests of a turn run concurrently).

    With `out_path` (an episodes.jsonl), instances whose id is already there are not played
    again, and each episode is appended as soon as it ends (judged first). Returns the records
    of all instances, in their order. with_stream (a local persuader, for training) adds its
    token stream to each record: ids, turn_ids, logprobs, as rollout.rollout_episodes has them."""
    played = read_played(out_path) if out_path else {}
    todo = [inst for inst in instances if inst["id"] not in played]
    er, ee = side(persuader, "persuader"), side(persuadee, "persuadee")
    bar = tqdm(total=len(instances), initial=len(instances) - len(todo), desc="episodes",
               disable=not progress)
    episodes = []
    if todo:
        er_sids = er.open(todo)
        ee_sids, b0 = ee.open(todo)
        for inst, s_er, s_ee, (values, mass) in zip(todo, er_sids, ee_sids, b0):
            episodes.append(dict(inst=inst, er=s_er, ee=s_ee, state=arena.Episode(t_max),
                                 transcript=[], probes=[values],
                                 masses=[mass]))
    active = list(episodes)
    while active:
        turn = [(e["inst"]["id"], e["state"].turn + 1) for e in active]
        said = er.speak([e["er"] for e in active], max_new_tokens, persuader_temperature, top_p,
                        [seed_of(seed, "persuader", *t) for t in turn])
        speaking = []
        for e, (text, reason) in zip(active, said):
            if reason != API_ERROR:
                e["transcript"].append({"role": "persuader", "text": text, "decision": None})
            if reason in ENDING_REASONS:
                er.unanswered(e["er"])
                e["state"].end(reason)
            else:
                speaking.append(e)
        replies = ee.turn([e["ee"] for e in speaking], [e["transcript"][-1]["text"] for e in speaking],
                          [e["state"].final_turn for e in speaking],
                          temperature=persuadee_temperature, top_p=top_p,
                          max_new_tokens=max_new_tokens,
                          seeds=[seed_of(seed, "persuadee", e["inst"]["id"], e["state"].turn + 1)
                                 for e in speaking])
        for e, reply in zip(speaking, replies):
            if reply["reason"] != API_ERROR:
                e["transcript"].append({"role": "persuadee", "text": reply["text"],
                                        "decision": reply["decision"]})
            if reply["reason"] in ENDING_REASONS:
                er.unanswered(e["er"])
                e["state"].end(reply["reason"])
                continue
            e["state"].step(reply["decision"])
            e["probes"].append(reply["probes"])
            e["masses"].append(reply["probe_mass"])
        for e in active:
            if not e["state"].done and (reason := er.hear(e["er"], e["transcript"][-1]["text"])):
                e["state"].end(reason)
        ended = [e for e in active if e["state"].done]
        if ended:
            scores, failed = (([None] * len(ended), [None] * len(ended)) if judge is None else
                              judge_scores(judge, [e["inst"] for e in ended],
                                           [e["transcript"] for e in ended], seed))
            for e, score, fail in zip(ended, scores, failed):
                ee.free(e["ee"])
                e["record"] = record(e["inst"], e["state"], e["transcript"], e["probes"],
                                     e["masses"], score, fail)
                if with_stream:
                    e["record"].update(er.stream(e["er"]))
                er.free(e["er"])
                played[e["inst"]["id"]] = e["record"]
                if out_path:
                    append_record(out_path, e["record"])
            bar.update(len(ended))
        active = [e for e in active if not e["state"].done]
    bar.close()
    return [played[inst["id"]] for inst in instances]


# -----------------------------------------------------------------------------
# the served model and the four sides


class ServedError(Exception):
    """A request that failed for good (not retryable, or out of retries)."""


class ServedModel:
    """One model behind an OpenAI-compatible server: chat requests with bounded concurrency,
    timeouts and retries. `stats` counts requests, failed attempts, requests that failed for
    good and the judge's fallbacks."""

    def __init__(self, spec, *, max_in_flight=MAX_IN_FLIGHT, timeout=TIMEOUT_S, retries=RETRIES,
                 backoff=True, http_client=None):
        import openai
        self.spec = spec
        self.model, self.url = parse_spec(spec)
        self.client = openai.OpenAI(base_url=self.url, api_key=api_key(self.url), timeout=timeout,
                                    max_retries=0, http_client=http_client)
        self.retries, self.backoff = retries, backoff
        self.pool = ThreadPoolExecutor(max_in_flight, thread_name_prefix="served")
        self.lock = threading.Lock()
        self.stats = dict(requests=0, failed_attempts=0, failed_requests=0, judge_fallbacks=0)
        self.logprobs = True  # until the server answers a probe without them
        self.temperature = True  # until the model refuses a temperature

    def count(self, key, n=1):
        with self.lock:
            self.stats[key] += n

    def chat(self, messages, max_tokens, temperature=0.0, top_p=None, seed=None,
             top_logprobs=None):
        """{text, reason, top}: the reply, "stop" | "length" | "context", and the first token's
        top log-probs [(token, logprob)] (None when not asked for or not given). Raises
        ServedError once the request has failed for good."""
        import openai
        request = dict(model=self.model, messages=messages, max_completion_tokens=max_tokens)
        if self.temperature:
            request["temperature"] = temperature
        if top_p is not None:
            request["top_p"] = top_p
        if seed is not None:
            request["seed"] = seed
        if top_logprobs:
            request.update(logprobs=True, top_logprobs=top_logprobs)
        for attempt in range(self.retries + 1):
            self.count("requests")
            try:
                choice = self.client.chat.completions.create(**request).choices[0]
                break
            except (openai.APIError, IndexError) as e:
                self.count("failed_attempts")
                if context_exceeded(e):
                    return dict(text="", reason="context", top=None)
                if "temperature" in request and fixed_temperature(e):
                    self.temperature = False  # this model samples only at its own temperature
                    del request["temperature"]
                    continue
                if attempt == self.retries or not (isinstance(e, IndexError) or retryable(e)):
                    self.count("failed_requests")
                    raise ServedError(f"{self.spec}: {type(e).__name__}: {e}") from e
                if self.backoff:
                    time.sleep(backoff_s(attempt, e))
        top = None
        content = getattr(choice.logprobs, "content", None)
        if content:
            top = [(t.token, t.logprob) for t in content[0].top_logprobs or []]
        reason = "length" if choice.finish_reason == "length" else "stop"
        return dict(text=(choice.message.content or "").strip(), reason=reason, top=top)

    def map(self, requests):
        """chat(**r) for every request, at most max_in_flight at once; a ServedError in the place
        of each request that failed for good."""
        def call(r):
            try:
                return self.chat(**r)
            except ServedError as e:
                return e
        return list(self.pool.map(call, requests))

    def check(self):
        """Exit in one line when the server does not answer a one-token request."""
        try:
            self.chat([{"role": "user", "content": "Say OK."}], 1)
        except ServedError as e:
            raise SystemExit(f"served.py: {self.spec} does not answer ({str(e).splitlines()[0]}); "
                             f"check the URL (it usually ends in /v1), the model name ({self.url}"
                             f"/models lists them) and {API_KEY_ENV}") from None


class ServedPersuader:
    """The persuader's side over the API: one message list per episode (no token stream: a
    served persuader is evaluated, never trained)."""
    served = True

    def unanswered(self, sid):
        pass

    def __init__(self, model):
        self.model, self.chats = model, {}


    def open(self, instances):
        sids = []
        for inst in instances:
            sids.append(len(self.chats))
            self.chats[sids[-1]] = arena.persuader_messages(inst)
        return sids

    def speak(self, sids, max_new_tokens, temperature, top_p, seeds):
        """[(text, reason)]: each episode's next message."""
        replies = self.model.map([dict(messages=self.chats[s], max_tokens=max_new_tokens,
                                       temperature=temperature, top_p=top_p, seed=seed)
                                  for s, seed in zip(sids, seeds)])
        out = []
        for s, r in zip(sids, replies):
            if isinstance(r, ServedError):
                out.append(("", API_ERROR))
                continue
            self.chats[s].append({"role": "assistant", "content": r["text"]})
            out.append((r["text"], r["reason"]))
        return out

    def hear(self, sid, reply):
        """The persuadee's reply, tags stripped, as the next user turn; None (it always fits)."""
        self.chats[sid].append({"role": "user", "content": arena.persuader_sees(reply)})

    def free(self, sid):
        del self.chats[sid]


class LocalPersuader:
    """The persuader's side on a local engine.Engine, ids in and ids out (as rollout.py), with the
    training stream rollout records: ids, turn_ids (t on the tokens of message t, 0 elsewhere and
    on a message that got no reply) and logprobs."""
    served = False

    def __init__(self, eng):
        self.eng, self.last, self.streams = eng, {}, {}


    def open(self, instances):
        tok, sids = self.eng.tokenizer, []
        for inst in instances:
            ids = models.chat_ids(tok, arena.persuader_messages(inst), True)
            sids.append(self.eng.new(ids))
            self.streams[sids[-1]] = dict(ids=list(ids), turn_ids=[0] * len(ids),
                                          logprobs=[0.0] * len(ids), turn=0)
        return sids

    def speak(self, sids, max_new_tokens, temperature, top_p, seeds):
        outs = self.eng.generate(sids, max_new_tokens, engine.Sampling(temperature, top_p),
                                 [s & engine.MASK32 for s in seeds])
        out = []
        for s, (ids, logprobs, reason) in zip(sids, outs):
            self.last[s] = ids
            stream = self.streams[s]
            stream["turn"] += 1
            self._extend(s, ids, stream["turn"], logprobs)
            out.append((self.eng.tokenizer.decode(ids, skip_special_tokens=True).strip(), reason))
        return out

    def _extend(self, sid, ids, turn=0, logprobs=None):
        stream = self.streams[sid]
        stream["ids"] += ids
        stream["turn_ids"] += [turn] * len(ids)
        stream["logprobs"] += logprobs or [0.0] * len(ids)

    def hear(self, sid, reply):
        """Append the reply's ids; why the sequence cannot take them ("context", "cache"), or None."""
        tok = self.eng.tokenizer
        ids = models.closing_ids(tok, self.last[sid]) + models.turn_ids(tok, arena.persuader_sees(reply))
        self.eng.append(sid, ids)
        self._extend(sid, ids)
        return self.eng.overflow(sid)

    def unanswered(self, sid):
        """The last message got no reply: masked out of the loss, as rollout.py does."""
        stream = self.streams[sid]
        stream["turn_ids"] = [0 if t == stream["turn"] else t for t in stream["turn_ids"]]

    def stream(self, sid):
        return {k: v for k, v in self.streams[sid].items() if k != "turn"}

    def free(self, sid):
        self.eng.free(sid)
        self.last.pop(sid, None)
        self.streams.pop(sid, None)


class ServedPersuadee:
    """The persuadee's side over the API, for eval.py and train.py's scheduler.

    new(instance) -> sid opens an episode's context (the persuadee's system prompt);
    read(sids) -> [(values, masses)] reads the probes of closed contexts (b_0);
    turn(sids, messages, final_turns, *, temperature, top_p, max_new_tokens, timings=None,
    seeds=None) returns what rollout.persuadee_turn returns, a dict per sequence
    {text, decision, reason, probes}, plus probe_mass; reason "api_error" (no probes) when the
    reply failed for good; free(sid) closes it."""
    served = True

    def __init__(self, model):
        self.model, self.chats = model, {}


    def new(self, instance):
        sid = max(self.chats, default=-1) + 1
        self.chats[sid] = arena.persuadee_messages(instance)
        return sid

    def open(self, instances):
        sids = [self.new(inst) for inst in instances]
        return sids, self.read(sids)

    def read(self, sids):
        """Per sequence (values [CA, PE, AC], found masses); Nones where the server gives no
        log-probs."""
        absent = [None] * len(probes.PROBES)
        if not self.model.logprobs:
            return [(absent, absent) for _ in sids]
        asks = [dict(messages=self.chats[s] + [{"role": "user",
                                                 "content": f"{probes.INSTRUCTION} {q}"}],
                     max_tokens=1, temperature=0.0, top_logprobs=TOP_LOGPROBS)
                for s in sids for q in probes.PROBES.values()]
        answers = self.model.map(asks)
        if any(not isinstance(a, ServedError) and a["top"] is None for a in answers):
            self.model.logprobs = False
            return [(absent, absent) for _ in sids]
        out = []
        for i in range(0, len(answers), len(probes.PROBES)):
            pairs = [(None, None) if isinstance(a, ServedError) else probe_value(a["top"])
                     for a in answers[i:i + len(probes.PROBES)]]
            out.append(([v for v, _ in pairs], [m for _, m in pairs]))
        return out

    def turn(self, sids, messages, final_turns, *, temperature, top_p, max_new_tokens,
             timings=None, seeds=None):
        for s, text, final in zip(sids, messages, final_turns):
            self.chats[s].extend(arena.persuadee_sees(text, final))
        with rollout.clock(timings, "persuadee_s"):
            answers = self.model.map([dict(messages=self.chats[s], max_tokens=max_new_tokens,
                                           temperature=temperature, top_p=top_p, seed=seed)
                                      for s, seed in zip(sids, seeds or [None] * len(sids))])
        replies, closed = [], []
        for s, a in zip(sids, answers):
            if isinstance(a, ServedError):
                replies.append(dict(text="", decision=None, reason=API_ERROR, probes=None,
                                    probe_mass=None))
                continue
            replies.append(dict(text=a["text"], decision=arena.parse_decision(a["text"]),
                                reason=a["reason"], probes=None, probe_mass=None))
            if a["reason"] not in ENDING_REASONS:
                self.chats[s].append({"role": "assistant", "content": a["text"]})
                closed.append((s, replies[-1]))
        with rollout.clock(timings, "probe_s"):
            read = self.read([s for s, _ in closed])
        for (_, reply), (values, masses) in zip(closed, read):
            reply["probes"], reply["probe_mass"] = values, masses
        return replies

    def free(self, sid):
        del self.chats[sid]


class LocalPersuadee:
    """The persuadee's side on a local engine.Engine: rollout.persuadee_turn plays each turn."""
    served = False

    def __init__(self, eng):
        self.eng = eng


    def open(self, instances):
        tok = self.eng.tokenizer
        sids = [self.eng.new(models.chat_ids(tok, arena.persuadee_messages(i), False))
                for i in instances]
        self.eng.forward(sids)
        values, mass = probes.read_engine(self.eng, sids, with_mass=True)
        return sids, list(zip(values.tolist(), mass.tolist()))

    def turn(self, sids, messages, final_turns, *, temperature, top_p, max_new_tokens,
             timings=None, seeds=None):
        tok = self.eng.tokenizer
        heard = [rollout.persuadee_heard(tok, m, f) for m, f in zip(messages, final_turns)]
        return rollout.persuadee_turn(self.eng, sids, heard,
                                      sampling=engine.Sampling(temperature, top_p),
                                      max_new_tokens=max_new_tokens,
                                      keys=[s & engine.MASK32 for s in seeds], timings=timings)

    def free(self, sid):
        self.eng.free(sid)
