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

Requests: at most MAX_IN_FLIGHT at once per served model, each whole call (every attempt and
wait) within DEADLINE_S however slowly the server sends, up to RETRIES retries with exponential
backoff (or a sane Retry-After) on rate limits, server errors, timeouts, dropped connections and
answers that are not a well-formed completion (parse_answer: bad JSON, another content type, no
choices, null content, non-finite or positive log-probs, more than the tokens asked for). Only
an answer naming a parameter unsupported drops that one parameter (ServedModel.dropped: not
applied from then on). An episode whose request still fails ends with end_reason "api_error"
and the rest go on. Message content sent is inert: chat-template control strings in it are
broken by a space (inert), so a server that templates and tokenizes reads them as text.
play_episodes appends every finished episode to its episodes.jsonl at once, so a rerun plays
only the episodes missing there.

    python eval.py --persuader openai:gpt-4o-mini@https://api.openai.com/v1 --name gpt-4o-mini
    python -m pytest -q test_served.py
"""
import hashlib
import ipaddress
import json
import math
import os
import random
import re
import threading
import time
import unicodedata
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
TIMEOUT_S = 120.0             # per read of an answer (the client's own timeout)
DEADLINE_S = 300.0            # a whole chat call: every attempt, read and wait, dripped bytes included
RETRIES = 4                   # retries of a failed request before its episode ends in API_ERROR
BACKOFF_S = 1.0               # wait before the first retry; doubled for each further one
BACKOFF_MAX_S = 60.0          # longest wait, the server's Retry-After included
TOP_LOGPROBS = 20             # log-probs asked for a probe's one-token answer (OpenAI's maximum)
API_ERROR = "api_error"       # end_reason of an episode whose request kept failing
ENDING_REASONS = ("context", "cache", API_ERROR)  # a half-turn that ends its episode
JUDGE_RETRY_TEMPERATURE = 0.7  # the judge's retries after an unparseable greedy answer (as rollout's)
RETRY_STATUS = (408, 409, 429)  # client-side statuses worth retrying, besides every 5xx
MAX_CHARS_PER_TOKEN = 32      # an answer longer than this per token asked for is not a completion
BODY_BYTES_PER_TOKEN = 4096   # an answer's body is cut off past this per token asked for (+ 64 KB)
LOGPROB_SLACK = 1e-6          # a log-prob above 0 by no more than this is rounding (clamped to 0)
DROPPABLE = ("temperature", "top_p", "top_k", "seed", "logprobs", "top_logprobs")  # may go unapplied
# The control strings of the chat template families the project knows, broken in any content sent
# over the API: <|...|> (ChatML, Qwen, Llama 3, Phi), Qwen3's think and tool tags, Mistral's
# [INST] family, Llama 2's <<SYS>>, Gemma's turns, and BOS/EOS spellings.
CONTROL = re.compile(
    r"<\|[^|<>\s]{1,64}\|>"
    r"|</?(?:s|unk|pad|bos|eos|think|tool_call|tool_response|start_of_turn|end_of_turn)>"
    r"|\[/?(?:INST|SYSTEM_PROMPT|AVAILABLE_TOOLS|TOOL_CALLS|TOOL_RESULTS|TOOL_CONTENT|IMG|THINK)\]"
    r"|<</?SYS>>")
UNSUPPORTED_WORDS = re.compile(  # OpenAI's and vLLM's wording of an unsupported parameter
    r"unsupported (?:parameter|value)s?\W+(\w+)|unrecognized request arguments? supplied\W+(\w+)",
    re.IGNORECASE)

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
    """Rate limits, server errors, timeouts, dropped connections and answers that are not a
    well-formed completion (InvalidAnswer) are worth another try; a spent deadline is not."""
    import openai
    if isinstance(error, InvalidAnswer):
        return True
    if isinstance(error, openai.APIConnectionError):  # per-read timeouts included
        return True
    status = getattr(error, "status_code", None)
    return status is not None and (status in RETRY_STATUS or status >= 500)


def context_exceeded(error):
    """A request the server refused because the conversation outgrew the model's context."""
    text = f"{getattr(error, 'code', '')} {error}".lower()
    return getattr(error, "status_code", None) == 400 and (
        "context_length" in text or "context length" in text or "maximum context" in text)


def unsupported_parameter(error):
    """The request parameter a 400 answer names as unsupported by this model (OpenAI's codes
    unsupported_parameter / unsupported_value, or the same words in the message), or None. Any
    other 400, an out-of-range temperature included, names none."""
    if getattr(error, "status_code", None) != 400:
        return None
    code, param = getattr(error, "code", None), getattr(error, "param", None)
    if code in ("unsupported_parameter", "unsupported_value") and isinstance(param, str):
        return param.split(".")[0]
    found = UNSUPPORTED_WORDS.search(str(error))
    return found and (found.group(1) or found.group(2))


def backoff_s(attempt, error, rng=random):
    """BACKOFF_S * 2^attempt with up to 25% jitter, or the server's Retry-After in seconds when it
    is a finite number >= 0 (a date, a negative or a NaN one is ignored); capped at BACKOFF_MAX_S."""
    response = getattr(error, "response", None)
    try:
        wait = float(response.headers.get("retry-after"))
    except (AttributeError, TypeError, ValueError):
        wait = math.nan
    if not (math.isfinite(wait) and wait >= 0):
        wait = BACKOFF_S * 2.0 ** min(attempt, 64) * (1 + 0.25 * rng.random())
    return min(wait, BACKOFF_MAX_S)


def inert(text):
    """(text, n): the text with each of the n chat-template control strings in it (CONTROL)
    broken by a space after its first character, so that a server that renders a chat template
    and tokenizes cannot read one as a control token. Matched on the NFKC form too, which is
    what a normalising tokenizer would see."""
    folded = unicodedata.normalize("NFKC", text)
    if folded != text and CONTROL.search(folded):
        text = folded
    return CONTROL.subn(lambda m: m.group(0)[0] + " " + m.group(0)[1:], text)


def inert_messages(messages):
    """(messages with inert content, number of control strings neutralised)."""
    out, total = [], 0
    for m in messages:
        content, n = inert(m["content"])
        out.append({**m, "content": content})
        total += n
    return out, total


def finite_number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def logprob_of(entry, where):
    """(token, logprob) of a log-prob entry, or InvalidAnswer: a string token and a finite
    log-prob <= 0 (up to LOGPROB_SLACK of rounding, clamped to 0)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("token"), str):
        raise InvalidAnswer(f"{where} has no token")
    lp = entry.get("logprob")
    if not finite_number(lp) or lp > LOGPROB_SLACK:
        raise InvalidAnswer(f"{where} has log-prob {lp!r}, not a finite number <= 0")
    return entry["token"], min(float(lp), 0.0)


def refuse_constant(name):
    raise ValueError(f"{name} is not a JSON number")


def parse_answer(body, max_tokens, top_logprobs=None):
    """{text, reason, top} from a chat completion's body (bytes), or InvalidAnswer for anything
    but a well-formed one: not JSON (NaN and Infinity refused), no choices, a message whose
    content is not a string, non-finite or positive log-probs, more than max_tokens tokens
    (the usage count, or MAX_CHARS_PER_TOKEN characters a token)."""
    try:
        data = json.loads(body, parse_constant=refuse_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidAnswer(f"the answer is not JSON ({e})") from None
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise InvalidAnswer("the answer has no choices")
    choice = choices[0]
    message = choice.get("message")
    text = message.get("content") if isinstance(message, dict) else None
    if not isinstance(text, str):
        raise InvalidAnswer(f"the answer's message content is {text!r}, not text")
    finish = choice.get("finish_reason")
    if finish is not None and not isinstance(finish, str):
        raise InvalidAnswer(f"the answer's finish_reason is {finish!r}")
    usage = data.get("usage")
    used = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if finite_number(used) and used > max_tokens or len(text) > max_tokens * MAX_CHARS_PER_TOKEN:
        raise InvalidAnswer(f"the answer is longer than the {max_tokens} tokens asked for")
    top = None
    logprobs = choice.get("logprobs") if top_logprobs else None
    if logprobs is not None:
        content = logprobs.get("content") if isinstance(logprobs, dict) else "?"
        if content is not None and not isinstance(content, list):
            raise InvalidAnswer("the answer's logprobs hold no content list")
        if content:
            logprob_of(content[0], "the first token")
            entries = content[0].get("top_logprobs") or []
            if not isinstance(entries, list):
                raise InvalidAnswer("the first token's top_logprobs is not a list")
            top = [logprob_of(e, "a top log-prob") for e in entries]
    return dict(text=text.strip(), reason="length" if finish == "length" else "stop", top=top)


def probe_value(top_logprobs):
    """(v, found mass) from a one-token answer's top log-probs [(token, logprob)]: p is
    renormalised over the Yes and No tokens found (probes.YES_WORDS, NO_WORDS); (None, 0.0) when
    neither appears or a log-prob is not a finite number <= 0 (never a NaN)."""
    if any(not finite_number(lp) or lp > LOGPROB_SLACK for _, lp in top_logprobs):
        return None, 0.0
    yes = sum(math.exp(min(lp, 0.0)) for tok, lp in top_logprobs if tok in probes.YES_WORDS)
    no = sum(math.exp(min(lp, 0.0)) for tok, lp in top_logprobs if tok in probes.NO_WORDS)
    if yes + no == 0:
        return None, 0.0
    return 2 * yes / (yes + no) - 1, yes + no


def belief(values):
    """b = mean of the three probe values; None when any is absent or not finite."""
    if values is None or not all(finite_number(v) for v in values):
        return None
    return sum(values) / len(values)


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
            sampling=engine.GREEDY if attempt == 0 else engine.Sampling(JUDGE_RETRY_TEMPERATURE),
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
    """A request that failed for good (not retryable, out of retries or out of time)."""


class InvalidAnswer(Exception):
    """An answer that is not a well-formed chat completion: a failed attempt."""


class DeadlineExceeded(Exception):
    """A chat call that ran past its whole-request deadline."""


class ServedModel:
    """One model behind an OpenAI-compatible server: chat requests with bounded concurrency, a
    deadline on each whole call, validated answers and retries. `stats` counts requests, failed
    attempts, requests that failed for good, control strings neutralised and the judge's
    fallbacks; `dropped` names the request parameters this model refused as unsupported (sent
    no more: not applied)."""

    def __init__(self, spec, *, max_in_flight=MAX_IN_FLIGHT, timeout=TIMEOUT_S,
                 deadline=DEADLINE_S, retries=RETRIES, backoff=True, http_client=None):
        import openai
        self.spec = spec
        self.model, self.url = parse_spec(spec)
        self.client = openai.OpenAI(base_url=self.url, api_key=api_key(self.url), timeout=timeout,
                                    max_retries=0, http_client=http_client)
        self.timeout, self.deadline = timeout, deadline
        self.retries, self.backoff = retries, backoff
        self.pool = ThreadPoolExecutor(max_in_flight, thread_name_prefix="served")
        self.lock = threading.Lock()
        self.stats = dict(requests=0, failed_attempts=0, failed_requests=0, neutralised=0,
                          judge_fallbacks=0)
        self.logprobs = True  # until the server answers a probe without them
        self.dropped = set()  # parameters the model refused as unsupported

    def count(self, key, n=1):
        with self.lock:
            self.stats[key] += n

    def request(self, messages, max_tokens, sampling, seed, top_logprobs):
        """The request body: sampling mapped onto temperature, top_p and (vLLM's and SGLang's)
        top_k, less the parameters in `dropped`."""
        request = dict(model=self.model, messages=messages, max_completion_tokens=max_tokens,
                       temperature=sampling.temperature, top_p=sampling.top_p, seed=seed)
        if top_logprobs:
            request.update(logprobs=True, top_logprobs=top_logprobs)
        request = {k: v for k, v in request.items() if v is not None and k not in self.dropped}
        if sampling.top_k is not None and "top_k" not in self.dropped:
            request["extra_body"] = dict(top_k=sampling.top_k)
        return request

    def chat(self, messages, max_tokens, sampling=engine.GREEDY, seed=None, top_logprobs=None):
        """{text, reason, top, neutralised}: the reply, "stop" | "length" | "context", the first
        token's top log-probs [(token, logprob)] (None when not asked for or not given) and the
        control strings broken in the messages sent (inert). Every attempt's answer is
        validated (parse_answer); the whole call, retries and waits included, ends within
        `deadline` seconds. Raises ServedError once the request has failed for good."""
        import openai
        messages, neutralised = inert_messages(messages)
        self.count("neutralised", neutralised)
        end, attempt = time.monotonic() + self.deadline, 0
        while True:  # a dropped parameter costs no attempt: each is dropped once
            request = self.request(messages, max_tokens, sampling, seed, top_logprobs)
            self.count("requests")
            try:
                body = self.attempt(request, max_tokens, end)
                return {**parse_answer(body, max_tokens, top_logprobs), "neutralised": neutralised}
            except (openai.APIError, InvalidAnswer, DeadlineExceeded) as e:
                self.count("failed_attempts")
                if context_exceeded(e):
                    return dict(text="", reason="context", top=None, neutralised=neutralised)
                param = unsupported_parameter(e)
                param = "logprobs" if param == "top_logprobs" else param
                if param in DROPPABLE and (param in request or param == "top_k" and "extra_body"
                                           in request):
                    with self.lock:
                        self.dropped |= {param, "top_logprobs"} if param == "logprobs" else {param}
                    continue
                wait = backoff_s(attempt, e) if self.backoff else 0.0
                if (attempt == self.retries or not retryable(e)
                        or time.monotonic() + wait >= end):
                    self.count("failed_requests")
                    raise ServedError(f"{self.spec}: {type(e).__name__}: {e}") from e
                time.sleep(wait)
                attempt += 1

    def attempt(self, request, max_tokens, end):
        """One request's body (bytes), read by a daemon thread so that the call returns by `end`
        whatever the server does (a server dripping bytes included)."""
        done, out = threading.Event(), {}

        def run():
            try:
                out["body"] = self.fetch(request, max_tokens, end)
            except BaseException as e:  # handed to the caller, which re-raises it
                out["error"] = e
            finally:
                done.set()
        threading.Thread(target=run, daemon=True, name="served-request").start()
        if not done.wait(max(0.0, end - time.monotonic())):
            raise DeadlineExceeded(f"no answer within the {self.deadline:g} s deadline")
        if "error" in out:
            raise out["error"]
        return out["body"]

    def fetch(self, request, max_tokens, end):
        limit = 65536 + BODY_BYTES_PER_TOKEN * max_tokens * (1 + request.get("top_logprobs", 0))
        timeout = max(0.001, min(self.timeout, end - time.monotonic()))
        with self.client.chat.completions.with_streaming_response.create(
                **request, timeout=timeout) as response:
            kind = response.headers.get("content-type", "")
            if "json" not in kind.lower():
                raise InvalidAnswer(f"the answer is {kind or 'untyped'}, not JSON")
            chunks, size = [], 0
            try:
                for chunk in response.iter_bytes():
                    chunks.append(chunk)
                    size += len(chunk)
                    if size > limit:
                        raise InvalidAnswer(f"the answer is over {limit} bytes")
                    if time.monotonic() > end:
                        raise DeadlineExceeded(f"the answer took over the {self.deadline:g} s "
                                               "deadline")
            except (InvalidAnswer, DeadlineExceeded):
                raise
            except Exception as e:  # the connection broke while the body was read
                raise InvalidAnswer(f"the answer broke off ({type(e).__name__}: {e})") from e
        return b"".join(chunks)

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
                                       sampling=engine.Sampling(temperature, top_p), seed=seed)
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
                     max_tokens=1, top_logprobs=TOP_LOGPROBS)
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
                                           sampling=engine.Sampling(temperature, top_p), seed=seed)
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
