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
never 0; each such answer is counted (missing_logprobs) and the first said in the log, and
the probes stay on (one glitch does not make a run outcome-only). The run's --probe-space and
--probe-signs apply to these values as to a local read (probes.from_prob_value).

Requests: at most MAX_IN_FLIGHT at once per served model, each whole call (every attempt and
wait) within DEADLINE_S however slowly the server sends, up to RETRIES retries with exponential
backoff (or a sane Retry-After) on rate limits, server errors, timeouts, dropped connections and
answers that are not a well-formed completion (parse_answer: bad JSON, another content type, no
choices, null content, non-finite or positive log-probs, more than the tokens asked for). Only
an answer naming a parameter unsupported drops that one parameter (ServedModel.dropped: not
applied from then on). An episode whose request still fails ends with end_reason "api_error"
and the rest go on. Message content sent is inert: chat-template control strings in it are
broken by a space (inert), so a server that templates and tokenizes reads them as text.

    python eval.py --persuader openai:gpt-4o-mini@https://api.openai.com/v1 --name gpt-4o-mini
    python -m pytest -q test_served.py
"""
import functools
import hashlib
import ipaddress
import json
import math
import os
import random
import re
import sys
import threading
import time
import unicodedata
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

from persuarena import arena
from persuarena import engine
from persuarena import probes
from lab import hardening
from lab.jsonl import is_number as finite_number

SERVED_PREFIX = "openai:"     # a model spec with this prefix is served: openai:MODEL@URL
API_KEY_ENV = "OPENAI_API_KEY"
LOOPBACK_KEY = "unused"       # the client needs some key; a server on this machine checks none
MAX_IN_FLIGHT = 8             # concurrent requests per served model
TIMEOUT_S = 120.0             # per read of an answer (the client's own timeout)
DEADLINE_S = 300.0            # a whole chat call: every attempt, read and wait, dripped bytes included
RETRIES = 4                   # retries of a failed request before its episode ends in API_ERROR
BACKOFF_S = 1.0               # wait before the first retry; doubled for each further one
BACKOFF_MAX_S = 60.0          # longest wait, the server's Retry-After included
TOP_LOGPROBS = 20             # log-probs asked for a probe's one-token answer (OpenAI's maximum)
RETRY_STATUS = (408, 409, 429)  # client-side statuses worth retrying, besides every 5xx
MAX_CHARS_PER_TOKEN = 32      # an answer longer than this per token asked for is not a completion
BODY_BYTES_PER_TOKEN = 4096   # an answer's body is cut off past this per token asked for (+ 64 KB)
LOGPROB_SLACK = 1e-6          # a log-prob above 0 by no more than this is rounding (clamped to 0)
MASS_SLACK = 1e-3             # top log-probs whose probabilities sum past 1 + this are no distribution
MODEL_SUFFIXES = "-@:"        # an answer may name the model asked for plus a snapshot ("-2024-07-18"),
                              # a revision ("@main", transformers serve) or a file (":x.gguf")
DROPPABLE = ("temperature", "top_p", "top_k", "seed", "logprobs", "top_logprobs")  # may go unapplied
# The control strings of the chat template families the project knows, broken in any content sent
# over the API: <|...|> (ChatML, Qwen, Llama 3, Phi), Qwen3's think and tool tags, Mistral's
# [INST] family, Llama 2's <<SYS>>, Gemma 3's turn, image, mask and unused tokens, and BOS/EOS
# spellings.
CONTROL = re.compile(
    r"<\|[^|<>\s]{1,64}\|>"
    r"|</?(?:s|unk|pad|bos|eos|mask|think|tool_call|tool_response|start_of_turn|end_of_turn"
    r"|start_of_image|end_of_image|image_soft_token|unused\d{1,3})>"
    r"|\[/?(?:INST|SYSTEM_PROMPT|AVAILABLE_TOOLS|TOOL_CALLS|TOOL_RESULTS|TOOL_CONTENT|IMG|THINK)\]"
    r"|<</?SYS>>")
UNSUPPORTED_WORDS = re.compile(  # OpenAI's, vLLM's and transformers serve's (422) wording
    r"unsupported (?:parameter|value)s?\W+(\w+)|unrecognized request arguments? supplied\W+(\w+)"
    r"|unexpected fields in the request\W+(\w+)", re.IGNORECASE)
ALLOW_INSECURE_KEY = False    # --allow-insecure-key: OPENAI_API_KEY goes to plain http URLs too
UNSUPPORTED_STATUS = (400, 422)  # statuses of an answer that may name an unsupported parameter

# -----------------------------------------------------------------------------
# specs, errors, probe arithmetic


def is_served(spec):
    return isinstance(spec, str) and spec.startswith(SERVED_PREFIX)


def parse_spec(spec):
    """(model, base URL) of `openai:MODEL@URL`; the URL is what follows the last '@'."""
    model, _, url = spec[len(SERVED_PREFIX):].rpartition("@")
    if not model or not urlparse(url).scheme.startswith("http") or not urlparse(url).netloc:
        raise SystemExit(f"served.py: model spec {spec!r} is not openai:MODEL@URL; write e.g. "
                         "openai:gpt-4o-mini@https://api.openai.com/v1 or "
                         "openai:MODEL@http://127.0.0.1:8000/v1")
    return model, url.rstrip("/")


def is_loopback(url):
    host = urlparse(url).hostname or ""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def api_key(url, key=None, allow_insecure_key=False, warn=None):
    """The key sent to url: a key given for this URL (key) as is; else OPENAI_API_KEY, but only
    over https (or with allow_insecure_key: --allow-insecure-key), since plain http shows it to
    every hop; else a placeholder for a server on this machine. A key from the environment held
    back from an http URL is said in one line (warn, by default to stderr)."""
    if key:
        return key
    env = os.environ.get(API_KEY_ENV)
    secure = urlparse(url).scheme == "https"
    if env and (secure or allow_insecure_key):
        return env
    if env:
        (warn or say)(f"served.py: {API_KEY_ENV} is not sent to {url} (not https); pass "
                      "--allow-insecure-key to send it anyway")
    if not is_loopback(url) and not env:
        raise SystemExit(f"served.py: {url} needs a key: set {API_KEY_ENV} (any value for a "
                         "server that checks none)")
    return LOOPBACK_KEY


def say(line):
    print(line, file=sys.stderr, flush=True)


def add_key_flag(parser):
    """--allow-insecure-key (default ALLOW_INSECURE_KEY), for eval.py and train.py, passed to
    ServedModel as allow_insecure_key."""
    parser.add_argument("--allow-insecure-key", action="store_true", default=ALLOW_INSECURE_KEY,
                        help=f"send {API_KEY_ENV} to a served model's URL over plain http too "
                             "(by default it goes to https URLs only)")


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
    """The request parameter a 400 (or transformers serve's 422) answer names as unsupported by
    this model (OpenAI's codes unsupported_parameter / unsupported_value, or such words in the
    message), or None. Any other 400, an out-of-range temperature included, names none."""
    if getattr(error, "status_code", None) not in UNSUPPORTED_STATUS:
        return None
    code, param = getattr(error, "code", None), getattr(error, "param", None)
    if code in ("unsupported_parameter", "unsupported_value") and isinstance(param, str):
        return param.split(".")[0]
    body = getattr(error, "body", None)  # a streamed answer's words are here, not in str(error)
    found = UNSUPPORTED_WORDS.search(f"{error} {json.dumps(body) if body is not None else ''}")
    return found and next(g for g in found.groups() if g)


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
    what a normalising tokenizer would see; only a string so broken is written in its NFKC form,
    the rest of the text stays as it was."""
    folded, origin = [], []
    for i, c in enumerate(text):
        for n in unicodedata.normalize("NFKC", c):
            folded.append(n)
            origin.append(i)
    folded = "".join(folded)
    out, last, n = [], 0, 0
    for m in CONTROL.finditer(folded):
        start, end = origin[m.start()], origin[m.end() - 1] + 1
        if start < last:
            continue
        out += [text[last:start], m.group(0)[0] + " " + m.group(0)[1:]]
        last, n = end, n + 1
    return "".join(out) + text[last:], n


def inert_messages(messages):
    """(messages with inert content, number of control strings neutralised)."""
    out, total = [], 0
    for m in messages:
        content, n = inert(m["content"])
        out.append({**m, "content": content})
        total += n
    return out, total


def logprob_of(entry, where):
    """(token, logprob) of a log-prob entry, or InvalidAnswer: a string token and a finite
    log-prob <= 0 (up to LOGPROB_SLACK of rounding, clamped to 0)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("token"), str):
        raise InvalidAnswer(f"{where} has no token")
    if bad := hardening.invalid_text(entry["token"]):
        raise InvalidAnswer(f"{where}'s token holds {bad}")
    lp = entry.get("logprob")
    if not finite_number(lp) or lp > LOGPROB_SLACK:
        raise InvalidAnswer(f"{where} has log-prob {lp!r}, not a finite number <= 0")
    return entry["token"], min(float(lp), 0.0)


def refuse_constant(name):
    raise ValueError(f"{name} is not a JSON number")


def same_model(asked, named):
    """Whether an answer naming `named` comes from the model asked for: no name, the same name, or
    it plus a snapshot, revision or file suffix (MODEL_SUFFIXES), or the same last path part."""
    if named is None:
        return True
    if not isinstance(named, str):
        return False
    if named == asked or any(named.startswith(asked + c) for c in MODEL_SUFFIXES):
        return True
    return named.rstrip("/").rsplit("/", 1)[-1] == asked.rstrip("/").rsplit("/", 1)[-1] != ""


def parse_answer(body, max_tokens, top_logprobs=None, model=None):
    """{text, reason, top} from a chat completion's body (bytes), or InvalidAnswer for anything
    but a well-formed one. Whatever goes wrong while reading it (RecursionError from deeply nested
    JSON included) is an InvalidAnswer: a failed attempt."""
    try:
        return read_answer(body, max_tokens, top_logprobs, model)
    except InvalidAnswer:
        raise
    except Exception as e:  # RecursionError, MemoryError's kin are Exceptions too
        raise InvalidAnswer(f"the answer cannot be read ({type(e).__name__})") from None


def read_answer(body, max_tokens, top_logprobs=None, model=None):
    """parse_answer's checks: JSON (NaN and Infinity refused), another model's name (same_model),
    no choices, a message whose content is not valid text (a lone surrogate included), non-finite
    or positive log-probs, top log-probs with a Yes or No token twice or a mass over 1, more than
    max_tokens tokens (the usage count, or MAX_CHARS_PER_TOKEN characters a token)."""
    try:
        data = json.loads(body, parse_constant=refuse_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidAnswer(f"the answer is not JSON ({e})") from None
    if model is not None and isinstance(data, dict) and not same_model(model, data.get("model")):
        raise InvalidAnswer(f"the answer names the model {data.get('model')!r}, not {model!r}")
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise InvalidAnswer("the answer has no choices")
    choice = choices[0]
    message = choice.get("message")
    text = message.get("content") if isinstance(message, dict) else None
    if not isinstance(text, str):
        raise InvalidAnswer(f"the answer's message content is {text!r}, not text")
    if bad := hardening.invalid_text(text):
        raise InvalidAnswer(f"the answer's text holds {bad}")
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
            read = [tok for tok, _ in top if tok in probes.YES_WORDS or tok in probes.NO_WORDS]
            if len(set(read)) < len(read):  # byte pieces may decode alike; a Yes or No may not
                raise InvalidAnswer("the first token's top log-probs name a Yes or No token twice")
            if math.fsum(math.exp(lp) for _, lp in top) > 1 + MASS_SLACK:
                raise InvalidAnswer("the first token's top log-probs hold more than all the mass")
    return dict(text=text.strip(), reason="length" if finish == "length" else "stop", top=top)


def probe_value(top_logprobs):
    """(v, found mass) from a one-token answer's top log-probs [(token, logprob)]: p is
    renormalised over the Yes and No tokens found (probes.YES_WORDS, NO_WORDS); (None, 0.0) when
    neither appears, a log-prob is not a finite number <= 0, a Yes or No token comes twice or
    the mass is over 1: v is finite in [-1, 1] and the mass in [0, 1], never a NaN."""
    if any(not finite_number(lp) or lp > LOGPROB_SLACK for _, lp in top_logprobs):
        return None, 0.0
    read = [tok for tok, _ in top_logprobs if tok in probes.YES_WORDS or tok in probes.NO_WORDS]
    if len(set(read)) < len(read):
        return None, 0.0  # a Yes or No token twice: no distribution
    yes = sum(math.exp(min(lp, 0.0)) for tok, lp in top_logprobs if tok in probes.YES_WORDS)
    no = sum(math.exp(min(lp, 0.0)) for tok, lp in top_logprobs if tok in probes.NO_WORDS)
    if yes + no == 0 or not math.isfinite(yes + no) or yes + no > 1 + MASS_SLACK:
        return None, 0.0
    return max(-1.0, min(1.0, 2 * yes / (yes + no) - 1)), min(1.0, yes + no)


def seed_of(*parts):
    """A request seed from the run seed and the request's place in it (stable across reruns)."""
    return int(hashlib.sha256(repr(parts).encode()).hexdigest()[:8], 16) % 2**31


def judge_scores(judge, instances, transcripts, seed, group_indices, *, max_tokens, attempts):
    """(strategy score s, fell back) per transcript, as lab/judge.judge_scores returns them:
    attempts (rollout.judge_attempts, the one retry policy) asks this server for each answer,
    a request that failed for good giving none; then 0 where none parsed."""
    def answer(todo, sampling, attempt):
        replies = judge.map([dict(
            messages=arena.judge_messages(instances[i], transcripts[i]), max_tokens=max_tokens,
            sampling=sampling, seed=seed_of(seed, "judge", instances[i]["id"], group_indices[i],
                                            attempt)) for i in todo])
        return [None if isinstance(reply, ServedError) else reply["text"] for reply in replies]
    scores = attempts(answer, len(instances))
    judge.count("judge_fallbacks", sum(s is None for s in scores))
    return [0.0 if s is None else s for s in scores], [s is None for s in scores]


# -----------------------------------------------------------------------------
# the served model and its side


class ServedError(Exception):
    """A request that failed for good (not retryable, out of retries or out of time)."""


class InvalidAnswer(Exception):
    """An answer that is not a well-formed chat completion: a failed attempt."""


class DeadlineExceeded(Exception):
    """A chat call that ran past its whole-request deadline."""


@functools.cache
def tls_context():
    """The process's one TLS context, the default of the HTTP library the openai client is built
    on (certifi's roots, or SSL_CERT_FILE or SSL_CERT_DIR), made at first use: each client would
    otherwise load the roots again (~25 ms a client)."""
    return http_library().create_ssl_context()


def http_library():
    """The module the openai client's HTTP client comes from: httpx, or httpx2 under openai 3."""
    import openai
    return sys.modules[openai.DefaultHttpxClient.__mro__[1].__module__.partition(".")[0]]


class ServedModel:
    """One model behind an OpenAI-compatible server: chat requests with bounded concurrency, a
    deadline on each whole call, validated answers and retries. `stats` counts requests, failed
    attempts, requests that failed for good, control strings neutralised, the judge's fallbacks
    and probe answers that came without log-probs; `dropped` names the request parameters this model refused as unsupported (sent
    no more: not applied)."""
    max_len = None  # the server checks its own context (rollout.prompt_problems leaves it)

    def __init__(self, spec, *, max_in_flight=MAX_IN_FLIGHT, timeout=TIMEOUT_S,
                 deadline=DEADLINE_S, retries=RETRIES, backoff=True, http_client=None, key=None,
                 allow_insecure_key=None):
        import openai
        self.spec = spec
        self.model, self.url = parse_spec(spec)
        insecure = ALLOW_INSECURE_KEY if allow_insecure_key is None else allow_insecure_key
        # requests stay where they were sent: a redirect (3xx) is a failed request, never followed
        # with the system prompt (the hidden profile) and the key to wherever it points
        http_client = http_client or openai.DefaultHttpxClient(follow_redirects=False,
                                                               verify=tls_context())
        self.client = openai.OpenAI(base_url=self.url, api_key=api_key(self.url, key, insecure),
                                    timeout=timeout, max_retries=0, http_client=http_client)
        self.timeout, self.deadline = timeout, deadline
        self.retries, self.backoff = retries, backoff
        self.pool = ThreadPoolExecutor(max_in_flight, thread_name_prefix="served")
        self.lock = threading.Lock()
        self.stats = dict(requests=0, failed_attempts=0, failed_requests=0, neutralised=0,
                          judge_fallbacks=0, missing_logprobs=0)
        self.dropped = set()  # parameters the model refused as unsupported

    def count(self, key, n=1):
        with self.lock:
            self.stats[key] += n

    def note_missing(self, n):
        """Count n probe answers without log-probs; the first is said in one line."""
        if n and not self.stats["missing_logprobs"]:
            say(f"served.py: {self.spec} answered a probe without log-probs: that read-out is "
                "None (counted in the run's requests as missing_logprobs)")
        self.count("missing_logprobs", n)

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
                return {**parse_answer(body, max_tokens, top_logprobs, self.model),
                        "neutralised": neutralised}
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




class ServedSide:
    """A role played over the API, the side interface rollout.py schedules (rollout.EngineSide has
    the same methods): text crosses the API, so each episode's context is a message list. Its
    capacity is the server's: every ready episode goes, the client keeps max_in_flight requests
    in flight and queues the rest. A served persuader has no token stream (it is evaluated,
    never trained). Probes of a served persuadee need the server's top log-probs (module
    docstring); without them they are None, as are the beliefs. A served persuadee decides by
    its tag alone (decision None or "tag"): the others read its logits in a fork of its cache."""
    tokenizer = max_len = eng = None  # the server checks its own context

    def __init__(self, model, role, sampling, max_new_tokens, probe_space=None, probe_signs=None,
                 decision=None):
        if decision not in (None, "tag"):
            raise ValueError(f"served.py: --decision {decision} reads the persuadee's logits in "
                             "a fork of its cache, which only a local persuadee has; use "
                             "--decision tag")
        self.model, self.role, self.sampling = model, role, sampling
        self.max_new_tokens, self.space = max_new_tokens, probe_space
        self.signs = probe_signs or probes.probe_signs()
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
        """The persuader's next messages, an arena.Message each (no ids: text crosses)."""
        out = []
        for s, r in zip(sids, self._ask(sids, keys)):
            if isinstance(r, ServedError):
                out.append(arena.Message("", arena.API_ERROR))
                continue
            self.chats[s].append({"role": "assistant", "content": r["text"]})
            out.append(arena.Message(r["text"], r["reason"]))
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
        """The persuadee's replies, an arena.Reply each with its probes read after it; reason
        "api_error" (no probes) when the reply failed for good. `timings` (a dict) accumulates
        persuadee_s and probe_s."""
        start = time.perf_counter()
        answers = self._ask(sids, keys)
        replies, closed = [], []
        for s, a in zip(sids, answers):
            failed = isinstance(a, ServedError)
            text = "" if failed else a["text"]
            reason = arena.API_ERROR if failed else a["reason"]
            replies.append(arena.Reply(text, arena.parse_decision(text), reason))
            if reason not in arena.CUT_OFF:
                self.chats[s].append({"role": "assistant", "content": text})
                closed.append((s, replies[-1]))
        read_start = time.perf_counter()
        for (_, reply), (values, masses) in zip(closed, self.read([s for s, _ in closed])):
            reply.probes, reply.probe_mass = values, masses
        if timings is not None:
            timings["persuadee_s"] = timings.get("persuadee_s", 0.0) + read_start - start
            timings["probe_s"] = timings.get("probe_s", 0.0) + time.perf_counter() - read_start
        return replies

    def read(self, sids):
        """Per sequence (values [CA, PE, AC] in the run's probe space and signs, found masses); a
        None for each probe whose answer failed or came without log-probs (counted in
        stats["missing_logprobs"], said once), all None once the server refused log-probs as an
        unsupported parameter. One answer without them turns no probe off."""
        absent = [None] * len(probes.PROBES)
        if "logprobs" in self.model.dropped:
            return [(absent, absent) for _ in sids]
        asks = [dict(messages=self.chats[s] + [{"role": "user",
                                                 "content": f"{probes.INSTRUCTION} {q}"}],
                     max_tokens=1, top_logprobs=TOP_LOGPROBS)
                for s in sids for q in probes.questions()]
        answers = self.model.map(asks)
        self.model.note_missing(sum(not isinstance(a, ServedError) and a["top"] is None
                                    for a in answers))
        out, k = [], len(probes.PROBES)
        for i in range(0, len(answers), k):
            pairs = [(None, None) if isinstance(a, ServedError) or a["top"] is None
                     else probe_value(a["top"]) for a in answers[i:i + k]]
            out.append(([probes.from_prob_value(v, self.space, self.signs[name])
                         for (v, _), name in zip(pairs, probes.PROBES)], [m for _, m in pairs]))
        return out
