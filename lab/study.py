"""
study.py: people as the other side of the arena, in a browser. A small web server (FastAPI and
uvicorn, the OpenEnv server's stack) serves one self-contained page (lab/study_page.html) on
127.0.0.1; its consent and debrief texts are lab/study_texts.md, which a researcher edits.

Two modes, one mechanism: every participant's episode is a session of one sessions.Hub, so the
model's side of many participants runs in the same engine steps, under the arena's state machine
and turn budget (rollout.py's one loop).
  persuadee  (the study) a person plays the scenario's persona against a model persuader. Before
             the first message and after each persuader message, before replying, they answer
             the questions of probes.PROBES (whatever it holds) on SCALE, a yes/no scale whose
             answer a in [-1, 1] is stored as the probe value v = sign * a, where the model's
             read-out v = sign * (2 P(Yes) - 1) goes (probe_mass 1); then a reply and a decision
             (keep talking, or one of the five terminal states) step arena.Dialogue.
  persuader  (the demo) a person persuades a model persuadee and sees after every reply its
             probe values, its belief b_t and r_t = (b_t - b_{t-1}) / 2 (rpo.process_rewards).

Records: each finished episode is added to FOLDER/episodes.jsonl (the whole file rewritten
atomically, runs.write_atomic: a kill leaves the old file or the new one), rollout.record's
fields stamped as an evaluation's, plus participant (a random code, never a name), mode and
self_report (true where the probes are a person's answers). `python eval.py --analyze FOLDER`,
its report.html and `eval.py --compare` read the folder unchanged; lab/study_pair.py sets a model
persuadee beside the people. An episode a participant leaves (closed tab, idle past --idle) is
ended and its slot freed, and nothing of it is kept. A restart on the same folder continues it
(settings.json must match); scenarios go to the participant in rotation, the least played first.

    python -m lab.study --persuader smollm2 --name pilot          # persuadee mode, studies/pilot
    python -m lab.study --mode persuader --persuadee smollm2      # the demo
    python eval.py --analyze studies/pilot
    python -m lab.study_pair studies/pilot --persuadee smollm2   # people beside a model persuadee
    python -m pytest -q tests/test_study.py tests/test_study_browser.py
"""
import asyncio
import json
import queue
import secrets
import string
import sys
import threading
import time
from pathlib import Path

from persuarena import arena
from persuarena import engine
from persuarena import probes
from persuarena import rollout
from persuarena import rpo
from lab import cli, hardening, jsonl, runs, sessions

HOST = "127.0.0.1"  # loopback unless --host says otherwise
PORT = 8700
STUDIES_DIR = "studies"
MODES = ("persuadee", "persuader")
T_MAX = 6  # turns a participant plays (--t-max)
MAX_NEW_TOKENS = 96  # the model's longest message (--max-new-tokens)
SLOTS = 16  # participants in play at once (--slots); more are asked to come back later
IDLE_S = 60.0  # a participant not heard from this long (the page polls every WAIT_S) is ended
WAIT_S = 15.0  # the longest a page's poll for news is held open
MAX_TEXT_CHARS = 2000  # a participant's longest message or reply
MAX_BODY_BYTES = 16_384  # the longest request body taken
KEEP_ENDED_S = 600.0  # an ended participant's page may still read its last news this long
SCALE = ((-1.0, "No"), (-0.5, "Rather no"), (0.0, "Can't say"), (0.5, "Rather yes"), (1.0, "Yes"))
KEEP_TALKING = "KEEP_TALKING"  # the decision control's "no decision yet" (arena: decision None)
DECISIONS = {  # the control's choices, for a person: arena.OUTCOMES and keep talking
    KEEP_TALKING: "Keep talking", "ACCEPT": "Accept the request",
    "CONDITIONAL_ACCEPT": "Accept, on a condition", "PENDING": "Leave it undecided for now",
    "REJECT": "Refuse", "WALK_AWAY": "Walk away from the conversation"}
TEXTS_PATH = Path(__file__).with_name("study_texts.md")
PAGE_PATH = Path(__file__).with_name("study_page.html")
TEXT_SECTIONS = ("title", "consent", "decline", "persuadee-instructions", "persuader-instructions",
                 "debrief-persuadee", "debrief-persuader")
CODE_LETTERS = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"  # participant codes: no 0/O or 1/I

# -----------------------------------------------------------------------------
# what a person reads


def load_texts(path=TEXTS_PATH):
    """The page's texts by section ("## NAME" lines open a section; "#" lines are comments),
    each a list of paragraphs; a missing section is refused in one line."""
    sections, name = {}, None
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            name = line[3:].strip()
            sections[name] = [""]
        elif line.startswith("#") or name is None:
            continue
        elif not line.strip():
            sections[name].append("")
        else:
            sections[name][-1] = (sections[name][-1] + " " + line.strip()).strip()
    texts = {k: [p for p in v if p] for k, v in sections.items()}
    if missing := [s for s in TEXT_SECTIONS if not texts.get(s)]:
        raise SystemExit(f"study.py: {path} lacks the section(s) {', '.join(missing)}; add a "
                         "'## NAME' line and its text for each")
    return texts


def debrief(texts, mode, inst, participant):
    """The debrief's paragraphs with the scenario's persuader role, goal and request and the
    participant's code filled in."""
    fill = dict(role=inst["persuader"]["role"], goal=inst["persuader"]["goal"],
                request=inst["persuader"]["request"], participant=participant)
    return [string.Template(p).safe_substitute(fill) for p in texts[f"debrief-{mode}"]]


REACTIONS = {  # a hidden resistance type, as a person playing it is told
    "entrenched_belief": "You have held your view on this for a long time. Facts that cut "
    "against it seem suspect at first; you move only when the other side takes your reasons "
    "seriously and shows you something you had not weighed.",
    "identity_threat": "Agreeing would feel like giving up part of who you are. Being lectured "
    "or made to look foolish hardens you; being respected for who you are opens you up.",
    "autonomy_resistance": "You dislike being told what to do. Pressure and deadlines make you "
    "dig in; being offered choices and left to decide makes you listen.",
    "ambivalent_avoidance": "Part of you sees the point, and part of you would rather not think "
    "about it at all. You tend to change the subject or put the decision off."}
TRUST = {"low": "You start out wary of them and doubt their motives.",
         "medium": "You neither trust nor distrust them yet.",
         "high": "You start out trusting them, though you can still be let down."}


def _listed(value):
    return "; ".join(value) if isinstance(value, list) else str(value)


def person_brief(inst, mode):
    """What the participant reads before the conversation: (heading, text) pairs. The persona
    and its hidden profile in persuadee mode; the persuader's role and the public persona in
    persuader mode (as the terminal player shows them)."""
    who, they, hidden = inst["persuadee"], inst["persuader"], inst["hidden"]
    person = f"{who['name']} ({who['pronouns']}), {who['age']}, {who['occupation']}."
    if mode == "persuader":
        return [("You are", they["role"]), ("Your goal", they["goal"]),
                ("What you ask of them", they["request"]),
                ("Who they are", f"{person} {who['background']}"),
                ("The situation", inst["context"])]
    brief = [("You play", f"{person} {who['background']}"), ("The situation", inst["context"]),
             ("You are talking with", f"{they['role']}, who will ask you this: {they['request']}"),
             ("What you want", hidden["motivation"]), ("What worries you", _listed(hidden["concerns"])),
             ("What matters to you", _listed(hidden["values"]))]
    if hidden.get("resistance") in REACTIONS:
        brief.append(("How you tend to react", REACTIONS[hidden["resistance"]]))
    brief += [("How you feel about them", f"{TRUST[hidden['trust']]} {hidden['relationship']}"),
              ("What you keep to yourself", f"{hidden['secret']} (share it only once you trust "
                                            "them)"),
              ("What could bring you round", hidden["condition"])]
    return brief


def page_config(study):
    """What the page needs to know: the mode, the probes' questions (probes.PROBES, in order),
    the scale, the decisions, the consent and the bounds."""
    return dict(mode=study.mode, title=study.texts["title"][0], consent=study.texts["consent"],
                decline=study.texts["decline"],
                instructions=study.texts[f"{study.mode}-instructions"],
                probes=[dict(name=n, question=p["question"]) for n, p in probes.PROBES.items()],
                scale=[dict(value=v, label=label) for v, label in SCALE],
                decisions=[dict(value=k, label=v) for k, v in DECISIONS.items()],
                t_max=study.t_max, max_chars=MAX_TEXT_CHARS, wait_s=WAIT_S)

# -----------------------------------------------------------------------------
# what a participant sends, checked


class Refused(Exception):
    """A request the study refuses: its HTTP status and one line saying what to do."""

    def __init__(self, status, text):
        super().__init__(text)
        self.status = status


def text_field(body, key):
    """A participant's text: a string of 1..MAX_TEXT_CHARS visible characters, stripped."""
    value = body.get(key)
    if not isinstance(value, str) or not value.strip():
        raise Refused(422, f"'{key}' must be some text; write a message and send it again")
    if len(value) > MAX_TEXT_CHARS:
        raise Refused(422, f"'{key}' is {len(value)} characters, more than {MAX_TEXT_CHARS}; "
                           "shorten it and send it again")
    if hardening.invalid_text(value) is not None:
        raise Refused(422, f"'{key}' is not valid text; type it again")
    return value.strip()


def probe_answers(body):
    """The self-reported probe values: one answer of SCALE per probe of probes.PROBES (in its
    order), each stored as v = sign * a, the valence a model's read-out has."""
    answers, allowed = body.get("probes"), {v for v, _ in SCALE}
    if (not isinstance(answers, list) or len(answers) != len(probes.PROBES)
            or not all(isinstance(a, (int, float)) and not isinstance(a, bool) and a in allowed
                       for a in answers)):
        raise Refused(422, f"'probes' must hold one answer for each of the {len(probes.PROBES)} "
                           f"questions, each one of {sorted(allowed)}; answer every question")
    return [float(p["sign"] * a) for p, a in zip(probes.PROBES.values(), answers)]


def decision_field(body):
    """The decision control: KEEP_TALKING (None to the arena) or one of arena.OUTCOMES."""
    value = body.get("decision")
    if value not in DECISIONS:
        raise Refused(422, f"'decision' must be one of {', '.join(DECISIONS)}; choose one")
    return None if value == KEEP_TALKING else value


def parse_body(raw):
    """A request body: a JSON object of at most MAX_BODY_BYTES bytes."""
    if len(raw) > MAX_BODY_BYTES:
        raise Refused(413, f"a request of more than {MAX_BODY_BYTES} bytes; send less")
    try:
        body = json.loads(raw.decode("utf-8") or "{}")
    except (ValueError, RecursionError):
        raise Refused(400, "the request is not a JSON object; reload the page") from None
    if not isinstance(body, dict):
        raise Refused(400, "the request is not a JSON object; reload the page")
    return body

# -----------------------------------------------------------------------------
# participants


class Participant:
    """One person's visit: a random code (kept), a secret token (never written), the scenario,
    the hub ticket once the episode opens, what the page has yet to read (news), and the phase:
    brief, waiting (for the model), answer (persuadee: probes, reply, decision), message
    (persuader), ended."""

    def __init__(self, code, token, inst, seed):
        self.code, self.token, self.inst, self.seed = code, token, inst, seed
        self.ticket, self.phase, self.news, self.left = None, "brief", [], False
        self.seen, self.replies, self.changed = time.monotonic(), 0, None
        self.turn = 0

    def post(self, item, phase=None):
        self.news.append(item)
        if phase:
            self.phase = phase
        if self.changed is not None:
            self.changed.set()


class Study:
    """The server's state: the folder and its records, the hub, the participants by token."""

    def __init__(self, folder, mode, model, model_name, instances, *, t_max=T_MAX,
                 max_new_tokens=MAX_NEW_TOKENS, slots=SLOTS, idle_s=IDLE_S, texts=None,
                 sampling=None, seed=0, admit_wait_s=sessions.ADMIT_WAIT_S):
        self.folder, self.mode, self.model_name = Path(folder), mode, model_name
        self.instances, self.t_max, self.slots, self.idle_s = instances, t_max, slots, idle_s
        self.texts, self.seed = texts or load_texts(), seed
        self.hub = sessions.Hub(model, None, t_max=t_max, max_new_tokens=max_new_tokens,
                                sampling=sampling, max_sessions=slots, admit_wait_s=admit_wait_s,
                                outside=mode)
        self.lock = threading.Lock()
        self.participants, self.lines = {}, []
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path = self.folder / "episodes.jsonl"
        self.played = {inst["id"]: 0 for inst in instances}
        for _, rec in jsonl.read_jsonl(self.path, repair=True) if self.path.exists() else ():
            self.lines.append(jsonl.json_line(rec))
            key = str(rec.get("id", "")).rsplit("@", 1)[0] if isinstance(rec, dict) else None
            if key in self.played:  # the instance's id before the participant's code
                self.played[key] += 1

    # the participant's requests ------------------------------------------------

    def start(self):
        """A new participant (after consent): a code, a token, the least played scenario."""
        with self.lock:
            if sum(not p.left and p.phase != "ended" for p in self.participants.values()) >= self.slots:
                raise Refused(503, f"all {self.slots} places are taken right now; please try "
                                   "again in a few minutes")
            inst = min(self.instances, key=lambda i: self.played[i["id"]])
            self.played[inst["id"]] += 1  # in play counts, so that visitors spread out
            code = "P-" + "".join(secrets.choice(CODE_LETTERS) for _ in range(8))
            p = Participant(code, secrets.token_urlsafe(24), inst, secrets.randbelow(2**31))
            self.participants[p.token] = p
        return dict(token=p.token, participant=p.code, title=inst["title"],
                    brief=person_brief(inst, self.mode), t_max=self.t_max)

    def participant(self, body):
        token = body.get("token")
        p = self.participants.get(token) if isinstance(token, str) else None
        if p is None or p.left:
            raise Refused(410, "this conversation is no longer open (it ended, or the page was "
                               "idle too long); reload the page to start again")
        p.seen = time.monotonic()
        return p

    def begin(self, body):
        """The episode opens: in persuadee mode with the person's b_0 answers (blocks while the
        hub has no room, up to its admit_wait_s)."""
        p = self.participant(body)
        if p.phase != "brief":
            raise Refused(409, "this conversation has already begun")
        b0 = probe_answers(body) if self.mode == "persuadee" else None
        p.phase = "waiting"
        try:
            p.ticket = self.hub.open(p.inst, p.seed, b0)
        except RuntimeError as e:
            self.forget(p)
            raise Refused(503, f"the model is busy with other participants ({e}); please try "
                               "again in a few minutes") from None
        if p.left:  # left while waiting for room
            self.hub.say(p.ticket, None)
        return dict(ok=True)

    def turn(self, body):
        """The person's turn: persuadee mode, the probe answers, a reply and a decision;
        persuader mode, a message."""
        p = self.participant(body)
        wanted = "answer" if self.mode == "persuadee" else "message"
        if p.phase != wanted:
            raise Refused(409, "it is not your turn yet; wait for the other side")
        if self.mode == "persuadee":
            answer = dict(probes=probe_answers(body), text=text_field(body, "reply"),
                          decision=decision_field(body))
        else:
            answer = text_field(body, "message")
        p.phase = "waiting"
        self.hub.say(p.ticket, answer)
        return dict(ok=True)

    def leave(self, body):
        """The page is closing: the episode ends and frees its slot; nothing of it is kept."""
        token = body.get("token")
        p = self.participants.get(token) if isinstance(token, str) else None
        if p is not None:
            self.abandon(p)
        return dict(ok=True)

    def news(self, body, after):
        p = self.participant(body)
        if not isinstance(after, int) or isinstance(after, bool) or after < 0:
            raise Refused(422, "'after' must be a whole number >= 0; reload the page")
        return p, dict(news=p.news[after:], phase=p.phase)

    # the hub's side ------------------------------------------------------------

    def abandon(self, p):
        if p.phase != "ended" and not p.left:
            p.left = True
            if p.changed is not None:  # its page's poll, if one is open, ends now
                p.changed.set()
            if p.ticket is not None:
                self.hub.say(p.ticket, None)
            else:
                self.forget(p)

    def forget(self, p):
        with self.lock:
            self.participants.pop(p.token, None)
            if p.phase != "ended" or p.left:
                self.played[p.inst["id"]] -= 1

    def pump(self):
        """The hub's events of every participant turned into news for its page (records
        written as episodes end); participants idle past idle_s abandoned; the ended forgotten
        after KEEP_ENDED_S."""
        now = time.monotonic()
        for p in list(self.participants.values()):
            while p.ticket is not None:
                try:
                    kind, data = p.ticket.events.get_nowait()
                except queue.Empty:
                    break
                try:
                    self.event(p, kind, data)
                except Exception as e:  # one participant's failure never stops the others'
                    why = (str(e).splitlines() or [type(e).__name__])[0][:200]
                    print(f"study.py: participant {p.code}'s episode failed ({why})",
                          file=sys.stderr)
                    p.post(dict(kind="error", text="the study server failed to keep this "
                                "conversation; please tell the researcher"), "ended")
            if p.phase == "ended" and now - p.seen > KEEP_ENDED_S:
                with self.lock:
                    self.participants.pop(p.token, None)
            elif p.left and p.phase == "ended":
                self.forget(p)
            elif now - p.seen > self.idle_s and not p.left:
                print(f"study.py: participant {p.code} idle {self.idle_s:g} s; their episode "
                      "ended, nothing kept", file=sys.stderr)
                self.abandon(p)

    def event(self, p, kind, data):
        """One hub event of p's episode (sessions.Ticket): what the page is told."""
        if kind == "started":
            p.post(dict(kind="start", **self.readout(data["probes"], data["beliefs"])),
                   "message" if self.mode == "persuader" else "waiting")
        elif kind == "hear":  # persuadee mode: the model's message, the person's turn
            p.turn += 1
            p.post(dict(kind="message", text=data["text"], turn=p.turn,
                        final_turn=data["final_turn"]), "answer")
        elif kind == "speak":  # persuader mode: the model's reply and its read-out
            p.replies += 1
            p.post(dict(kind="reply", text=arena.strip_decision_tags(data["text"]),
                        decision=data["decision"], turn=p.replies,
                        **self.readout(data["probes"], data["beliefs"])), "message")
        elif kind == "end":
            self.ended(p, data)
        elif kind == "error":
            p.post(dict(kind="error", text="the study's model failed; the conversation cannot go "
                                           "on, and nothing of it was kept"), "ended")

    @staticmethod
    def readout(values, beliefs):
        """The probe values, b_t and r_t = (b_t - b_{t-1}) / 2 as the page shows them."""
        have = None not in beliefs[-2:] if beliefs else False
        return dict(probes=dict(zip(probes.PROBES, values)) if values else None,
                    belief=beliefs[-1] if beliefs else None, beliefs=beliefs,
                    reward=rpo.process_rewards(beliefs[-2:], None)[0]
                    if have and len(beliefs) > 1 else None)

    def ended(self, p, e):
        """The episode's end (a rollout.Episode): recorded unless the participant left; the
        debrief shown."""
        if e is None or p.left:
            p.phase = "ended"
            return
        if self.mode == "persuader" and len(e.beliefs) - 1 > p.replies:
            last = e.transcript[-1]
            p.post(dict(kind="reply", text=arena.strip_decision_tags(last["text"]),
                        decision=last["decision"], turn=len(e.beliefs) - 1,
                        **self.readout(e.probes[-1], e.beliefs)))
        self.write_record(p, e)
        p.post(dict(kind="end", outcome=e.outcome, end_reason=e.end_reason, turns=e.turns,
                    debrief=debrief(self.texts, self.mode, p.inst, p.code)), "ended")

    def write_record(self, p, e):
        """The episode's record as an evaluation stamps it, with the participant's code, mode and
        whether the probes are self-reports; the whole episodes.jsonl rewritten atomically."""
        rec = e.record(training=False)
        person = self.mode == "persuadee"
        rec.update(id=f"{p.inst['id']}@{p.code}", participant=p.code, mode=self.mode,
                   self_report=person, persuader="person" if not person else self.model_name,
                   persuadee="person" if person else self.model_name, seed=p.seed,
                   anchor=rpo.ANCHOR, probe_space="prob" if person else probes.PROBE_SPACE,
                   probe_signs=probes.probe_signs())
        with self.lock:
            self.lines.append(jsonl.json_line(jsonl.finite(rec)))
            runs.write_atomic(self.path, "".join(self.lines))

# -----------------------------------------------------------------------------
# the web app


SECURITY_HEADERS = {  # the page runs only its own inline code, talks only to this server
    "content-security-policy": "default-src 'none'; script-src 'unsafe-inline'; style-src "
    "'unsafe-inline'; img-src data:; connect-src 'self'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'",
    "x-content-type-options": "nosniff", "referrer-policy": "no-referrer",
    "cache-control": "no-store"}


async def body_of(request):
    """A request's body, read no further than MAX_BODY_BYTES, as parse_body takes it."""
    raw = b""
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY_BYTES:
            break
    return parse_body(raw)


def answered(result, status=200):
    from fastapi.responses import JSONResponse
    return JSONResponse(result, status_code=status, headers=SECURITY_HEADERS)


async def held_news(study, request):
    """The page's news after index `after`, held open until some arrives or WAIT_S passes;
    checked each second that the page is still there (a closed tab's poll ends then)."""
    body = await body_of(request)
    p, result = study.news(body, body.get("after", 0))
    deadline = time.monotonic() + WAIT_S
    while not result["news"] and result["phase"] != "ended" and time.monotonic() < deadline:
        p.changed = asyncio.Event()
        try:
            await asyncio.wait_for(p.changed.wait(), min(1.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                return {"error": "the page is gone"}
        p, result = study.news(body, body.get("after", 0))
    return result


def study_app(study, pump_s=0.05):
    """The FastAPI app: GET / (the page), GET /api/config, and POST /api/start, /api/begin,
    /api/turn, /api/news (held_news), /api/leave, each a JSON object of at most MAX_BODY_BYTES;
    a refusal is {"error": one line} with its status. Study.pump runs every pump_s."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.responses import HTMLResponse
    from starlette.concurrency import run_in_threadpool
    page = PAGE_PATH.read_text(encoding="utf-8")

    async def pump_forever():
        while True:
            study.pump()
            await asyncio.sleep(pump_s)

    @asynccontextmanager
    async def lifespan(app):
        task = asyncio.get_running_loop().create_task(pump_forever())
        yield
        task.cancel()
    app = FastAPI(title="PersuArena study", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)

    def route(path, handler, blocking=False):
        async def endpoint(request: Request):
            try:
                if handler is None:
                    return answered(await held_news(study, request))
                body = await body_of(request)
                result = await run_in_threadpool(handler, body) if blocking else handler(body)
            except Refused as e:
                return answered({"error": str(e)}, e.status)
            return answered(result)
        app.add_api_route(path, endpoint, methods=["POST"])

    route("/api/start", lambda body: study.start())
    route("/api/begin", study.begin, blocking=True)  # may wait for room in the hub
    route("/api/turn", study.turn)
    route("/api/leave", study.leave)
    route("/api/news", None)
    app.add_api_route("/api/config", lambda: answered(page_config(study)), methods=["GET"])
    app.add_api_route("/", lambda: HTMLResponse(page, headers=SECURITY_HEADERS), methods=["GET"])
    return app

# -----------------------------------------------------------------------------
# the command


def parse_args(argv=None):
    ap = cli.new_parser("python -m lab.study", __doc__)
    ap.add_argument("--mode", choices=MODES, default="persuadee", help="persuadee: a person "
                    "plays the persona against --persuader (the study); persuader: a person "
                    "persuades --persuadee (the demo)")
    ap.add_argument("--persuader", default="smollm2", help="persuadee mode's model: a checkpoint "
                    "or model folder, smollm2, random:NAME or openai:MODEL@URL")
    ap.add_argument("--persuadee", default="smollm2", help="persuader mode's model (as --persuader)")
    ap.add_argument("--name", help=f"the study's folder under --out (default: the mode and model)")
    ap.add_argument("--out", default=STUDIES_DIR)
    ap.add_argument("--scenarios", default="heldout", help="heldout, train or a scenarios.jsonl")
    ap.add_argument("--limit", type=int, help="the first N scenarios only (stratified)")
    ap.add_argument("--t-max", type=int, default=T_MAX)
    ap.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    ap.add_argument("--slots", type=int, default=SLOTS, help="participants in play at once")
    ap.add_argument("--idle", type=float, default=IDLE_S, help="seconds after which a silent "
                    "page's episode is ended and its slot freed")
    ap.add_argument("--texts", default=str(TEXTS_PATH), help="the consent and debrief texts")
    ap.add_argument("--host", default=HOST, help="the address to listen on (loopback by "
                    "default; anything else exposes the page to the network)")
    ap.add_argument("--port", type=int, default=PORT)
    ap.add_argument("--dtype", default="float32", choices=cli.DTYPES)
    ap.add_argument("--kv-blocks", type=int, help="the model's KV pool, in blocks")
    ap.add_argument("--allow-insecure-key", action="store_true",
                    help="send an API key over plain http to a non-local server")
    args = ap.parse_args(argv)
    for name in ("t_max", "max_new_tokens", "slots"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not 0 < args.port < 65536:
        ap.error(f"--port must be in 1..65535, got {args.port}")
    if not args.idle > WAIT_S:
        ap.error(f"--idle must be more than the page's poll of {WAIT_S:g} s, got {args.idle}")
    args.model = args.persuader if args.mode == "persuadee" else args.persuadee
    return args


def study_settings(args):
    """What a study folder pins: a restart on it must match."""
    return dict(mode=args.mode, model=args.model, scenarios=args.scenarios, limit=args.limit,
                t_max=args.t_max, max_new_tokens=args.max_new_tokens, dtype=args.dtype,
                probes=list(probes.PROBES), scale=[v for v, _ in SCALE])


def open_folder(args):
    """The study's folder checked, locked and its settings pinned: a new one is made, an
    existing study with the same settings continued, one with others refused in one line."""
    from lab import report
    name = args.name or f"{args.mode}-{report.slug(args.model)}"
    folder = Path(args.out) / name
    settings = study_settings(args)
    before = folder / "settings.json"
    resume = before.is_file()
    runs.check_folder(args.out, name, "study.py", resume, False)
    if resume:
        pinned = json.loads(before.read_text())
        if differ := [f"{k} {pinned.get(k)!r} there, {v!r} now" for k, v in settings.items()
                      if pinned.get(k) != v]:
            raise SystemExit(f"study.py: {folder} is a study run with other settings "
                             f"({'; '.join(differ)}); pass those, or another --name")
    runs.lock(folder, "study.py")
    if not resume:
        runs.write_atomic(before, json.dumps(settings, indent=2) + "\n")
    return folder


def main(argv=None):
    import uvicorn

    from persuarena import models
    from lab import env_server, pools
    from lab.env import load_instances
    args = parse_args(argv)
    texts = load_texts(args.texts)
    try:
        instances = load_instances(args.scenarios)
    except ValueError as e:
        sys.exit(f"study.py: {e}")
    if args.limit:
        instances = arena.stratified(instances, args.limit)
    folder = open_folder(args)
    models.set_cpu_threads()
    model = pools.player(args.model, {}, args.dtype, args.kv_blocks, args.allow_insecure_key)
    if problems := rollout.prompt_problems(model, model, instances, args.max_new_tokens):
        sys.exit("study.py: " + "; ".join(list(problems.values())[:3]) + "; pass --limit or "
                 "other --scenarios")
    study = Study(folder, args.mode, model, args.model, instances, t_max=args.t_max,
                  max_new_tokens=args.max_new_tokens, slots=args.slots, idle_s=args.idle,
                  texts=texts)
    if study.lines:
        print(f"study.py: continuing {folder}: {len(study.lines)} episodes already recorded",
              file=sys.stderr)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"study.py: warning: listening on {args.host}, not loopback: anyone who can reach "
              "this machine can open the page", file=sys.stderr)
    print(f"study.py: {args.mode} mode, {args.model}; open http://{args.host}:{args.port}/ "
          f"(records in {folder}/episodes.jsonl; Ctrl-C stops)", file=sys.stderr)
    uvicorn.run(study_app(study), host=args.host, port=args.port, log_level="warning",
                access_log=False, http=env_server.request_timeout_protocol(),
                limit_concurrency=4 * args.slots + 16, timeout_graceful_shutdown=3)


if __name__ == "__main__":
    main()
