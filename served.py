"""
served.py: a model served over the OpenAI-compatible chat API as persuader, persuadee or judge.

A spec `openai:MODEL@URL` names the model and the server, e.g.
openai:gpt-4o-mini@https://api.openai.com/v1, or openai:/path/to/folder@http://127.0.0.1:8000/v1
for `transformers serve` (vLLM, SGLang and hosted APIs speak the same API). The key comes from
OPENAI_API_KEY (a loopback server needs none); requests go through the official `openai` client.

A served model is a side of rollout.py's one episode loop (ServedSide), beside a local
engine.Engine (rollout.EngineSide): arena's prompts as chat messages, the same scheduler, parser,
state machine, tag stripping and records. Text is what crosses an API, so a served side keeps
its context as a message list. Each role's engine.Sampling maps onto the request: temperature,
top_p, and top_k through the server's extra parameters (vLLM and SGLang accept it).

Probes of a served persuadee: each question is put after the reply, answered in one greedy token
with the server's top log-probs, and over the Yes and No tokens among them

    p = sum P(yes found) / (sum P(yes found) + sum P(no found)),   v = 2p - 1,

with the found mass P(yes found) + P(no found) recorded beside it. A server that returns no
log-probs (transformers serve ignores them) gets probes and beliefs recorded as None: absent,
never 0; after its first such answer it is not asked again. The run's --probe-space and
--probe-signs apply to these values as to a local read (probes.from_prob_value).

Requests: at most MAX_IN_FLIGHT at once per served model, TIMEOUT_S each, up to RETRIES retries
with exponential backoff (or the server's Retry-After) on rate limits, server errors, timeouts
and dropped connections. An episode whose request still fails ends with end_reason "api_error"
and the rest go on.

    python eval.py --persuader openai:gpt-4o-mini@https://api.openai.com/v1 --name gpt-4o-mini
    python -m pytest -q test_served.py
"""
import hashlib
import ipaddress
import math
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import arena
import engine
import probes

SPEC_PREFIX = "openai:"       # a model spec with this prefix is served: openai:MODEL@URL
API_KEY_ENV = "OPENAI_API_KEY"
LOOPBACK_KEY = "unused"       # the client needs some key; a server on this machine checks none
MAX_IN_FLIGHT = 8             # concurrent requests per served model
TIMEOUT_S = 120.0             # per request
RETRIES = 4                   # retries of a failed request before its episode ends in API_ERROR
BACKOFF_S = 1.0               # wait before the first retry; doubled for each further one
BACKOFF_MAX_S = 60.0          # longest wait, the server's Retry-After included
TOP_LOGPROBS = 20             # log-probs asked for a probe's one-token answer (OpenAI's maximum)
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


def seed_of(*parts):
    """A request seed from the run seed and the request's place in it (stable across reruns)."""
    return int(hashlib.sha256(repr(parts).encode()).hexdigest()[:8], 16) % 2**31


def judge_scores(judge, instances, transcripts, seed, group_indices, *, max_tokens,
                 retry_sampling):
    """(strategy score s, fell back) per transcript, as rollout.judge_scores returns them: greedy
    first, then arena.JUDGE_RETRIES retries sampled with retry_sampling, then 0."""
    scores = [None] * len(instances)
    for attempt in range(1 + arena.JUDGE_RETRIES):
        todo = [i for i, s in enumerate(scores) if s is None]
        if not todo:
            break
        replies = judge.map([dict(
            messages=arena.judge_messages(instances[i], transcripts[i]), max_tokens=max_tokens,
            sampling=engine.GREEDY if attempt == 0 else retry_sampling,
            seed=seed_of(seed, "judge", instances[i]["id"], group_indices[i], attempt))
            for i in todo])
        for i, reply in zip(todo, replies):
            if not isinstance(reply, ServedError):
                scores[i] = arena.parse_judge(reply["text"])
    judge.count("judge_fallbacks", sum(s is None for s in scores))
    return [0.0 if s is None else s for s in scores], [s is None for s in scores]


# -----------------------------------------------------------------------------
# the served model and its side


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
        self.top_k = True  # until the server refuses a top_k

    def count(self, key, n=1):
        with self.lock:
            self.stats[key] += n

    def chat(self, messages, max_tokens, sampling=engine.GREEDY, seed=None, top_logprobs=None):
        """{text, reason, top}: the reply, "stop" | "length" | "context", and the first token's
        top log-probs [(token, logprob)] (None when not asked for or not given). `sampling` (an
        engine.Sampling) maps onto temperature and top_p, its top_k onto the server's extra
        parameters (vLLM and SGLang take it). Raises ServedError once the request has failed for
        good."""
        import openai
        request = dict(model=self.model, messages=messages, max_completion_tokens=max_tokens)
        if self.temperature:
            request["temperature"] = sampling.temperature
        if sampling.top_p is not None:
            request["top_p"] = sampling.top_p
        if sampling.top_k and self.top_k:
            request["extra_body"] = {"top_k": sampling.top_k}
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
                if "extra_body" in request and getattr(e, "status_code", None) in (400, 422):
                    self.top_k = False  # a server that takes no top_k: recorded, not applied
                    del request["extra_body"]
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




class ServedSide:
    """A role played over the API, the side interface rollout.py schedules (rollout.EngineSide has
    the same methods): text crosses the API, so each episode's context is a message list. Its
    capacity is the server's: every ready episode goes, the client keeps max_in_flight requests
    in flight and queues the rest. A served persuader has no token stream (it is evaluated,
    never trained). Probes of a served persuadee need the server's top log-probs (module
    docstring); without them they are None, as are the beliefs."""
    tokenizer = max_len = None  # the server checks its own context

    def __init__(self, model, role, sampling, max_new_tokens, probe_space=None, probe_signs=None):
        self.model, self.role, self.sampling = model, role, sampling
        self.max_new_tokens, self.space = max_new_tokens, probe_space
        self.signs = probe_signs or probes.PROBE_SIGNS
        self.chats, self.next_sid = {}, 0

    def _new(self, messages):
        self.next_sid += 1
        self.chats[self.next_sid] = messages
        return self.next_sid

    def prompt(self, instance):
        return []  # no ids: text crosses the API

    def room(self, instance, n):
        return True

    def prefill(self, instance):
        return self._new(arena.persuader_messages(instance) if self.role == "persuader" else
                         arena.persuadee_messages(instance))

    def start(self, roots, counts):
        """n episodes forked from each root; a persuadee's roots read b_0 first."""
        reads = self.read(roots) if self.role == "persuadee" else [None] * len(roots)
        sids = [[self._new(list(self.chats[r])) for _ in range(n)] for r, n in zip(roots, counts)]
        for r in roots:
            self.free(r)
        return sids, reads

    def ready(self, sids):
        return list(sids)

    def free(self, sid):
        del self.chats[sid]

    def _ask(self, sids, keys):
        return self.model.map([dict(messages=self.chats[s], max_tokens=self.max_new_tokens,
                                    sampling=self.sampling,
                                    seed=engine.stream_key(k, len(self.chats[s])) % 2**31)
                               for s, k in zip(sids, keys)])

    def speak(self, sids, keys):
        """The persuader's next messages: dict(text, ids, logprobs, reason) each."""
        out = []
        for s, r in zip(sids, self._ask(sids, keys)):
            if isinstance(r, ServedError):
                out.append(dict(text="", ids=[], logprobs=[], reason=arena.API_ERROR))
                continue
            self.chats[s].append({"role": "assistant", "content": r["text"]})
            out.append(dict(text=r["text"], ids=[], logprobs=[], reason=r["reason"]))
        return out

    def hear(self, sid, text, final_turn=False, shown=None):
        """The other side's text as this side's next turn (tags stripped: arena's views); returns
        (ids added to the persuader's stream: none, why it cannot go on: None)."""
        if self.role == "persuader":
            self.chats[sid].append({"role": "user", "content": arena.persuader_sees(text)})
        else:
            self.chats[sid].extend(arena.persuadee_sees(text, final_turn))
        return [], None

    def reply(self, sids, keys, timings=None):
        """The persuadee's replies, as rollout.persuadee_turn returns them: dict(text, decision,
        reason, probes, probe_mass); reason "api_error" (no probes) when the reply failed for
        good. `timings` (a dict) accumulates persuadee_s and probe_s."""
        start = time.perf_counter()
        answers = self._ask(sids, keys)
        replies, closed = [], []
        for s, a in zip(sids, answers):
            failed = isinstance(a, ServedError)
            text = "" if failed else a["text"]
            reason = arena.API_ERROR if failed else a["reason"]
            replies.append(dict(text=text, decision=arena.parse_decision(text), reason=reason,
                                probes=None, probe_mass=None))
            if reason not in arena.CUT_OFF:
                self.chats[s].append({"role": "assistant", "content": text})
                closed.append((s, replies[-1]))
        read_start = time.perf_counter()
        for (_, reply), (values, masses) in zip(closed, self.read([s for s, _ in closed])):
            reply["probes"], reply["probe_mass"] = values, masses
        if timings is not None:
            timings["persuadee_s"] = timings.get("persuadee_s", 0.0) + read_start - start
            timings["probe_s"] = timings.get("probe_s", 0.0) + time.perf_counter() - read_start
        return replies

    def read(self, sids):
        """Per sequence (values [CA, PE, AC] in the run's probe space and signs, found masses);
        Nones where the server gives no log-probs (after its first such answer it is not asked
        again)."""
        absent = [None] * len(probes.PROBES)
        if not self.model.logprobs:
            return [(absent, absent) for _ in sids]
        asks = [dict(messages=self.chats[s] + [{"role": "user",
                                                 "content": f"{probes.INSTRUCTION} {q}"}],
                     max_tokens=1, top_logprobs=TOP_LOGPROBS)
                for s in sids for q in probes.PROBES.values()]
        answers = self.model.map(asks)
        if any(not isinstance(a, ServedError) and a["top"] is None for a in answers):
            self.model.logprobs = False
            return [(absent, absent) for _ in sids]
        out, k = [], len(probes.PROBES)
        for i in range(0, len(answers), k):
            pairs = [(None, None) if isinstance(a, ServedError) else probe_value(a["top"])
                     for a in answers[i:i + k]]
            out.append(([probes.from_prob_value(v, self.space, self.signs[name])
                         for (v, _), name in zip(pairs, probes.PROBES)], [m for _, m in pairs]))
        return out

