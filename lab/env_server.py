"""
env_server.py: PersuArena over OpenEnv (WebSocket sessions), many at once on one persuadee.

Each WebSocket session (/ws, what openenv's EnvClient and TRL's and SkyRL's integrations use) is a
PersuasionEnv over one shared sessions.Hub: up to --sessions (sessions.MAX_SESSIONS) episodes
play at once and whatever they ask of the persuadee in the same moment runs in the same engine
steps (lab/sessions.py). A session that sends nothing for --session-timeout while no answer is
owed is told so in one line and closed, its episode ended and its blocks freed. HTTP serves the
info routes /health, /schema, /metadata and /mcp, which never wait on the engine (MCP sessions
over HTTP are refused: a session is a WebSocket); not the stateless /reset, /step and /state,
which would play each call on a fresh env (DECISIONS.md: Server hardening). Nothing of openenv's
internals is reached into: the server is openenv's, wrapped at the ASGI level.

A frame that is not a JSON object (binary, not JSON, nested deeper than MAX_DEPTH, a number of
more than MAX_DIGITS digits, longer than MAX_FRAME_CHARS) is answered with one error message and
the session's episode goes on; an HTTP request not received whole within REQUEST_TIMEOUT_S is
dropped; a text frame that is not UTF-8 ends its connection (1007, as RFC 6455 requires: the
protocol layer fails it before any handler sees it) and its episode, logged in one line.

    python -m lab.env_server --serve --port 8000 --persuadee smollm2 --sessions 64
    (--sessions defaults to sessions.MAX_SESSIONS)
    python -m pytest -q tests/test_env_server.py
"""
import asyncio
import json
import logging
import math
import sys

from persuarena import arena
from persuarena import engine
from lab import cli, served, sessions
from lab import env as persuasion_env
from lab.env import PersuasionEnv, load_instances, shown

HOST = "127.0.0.1"  # the OpenEnv server listens on loopback only
SESSION_IDLE_S = 60.0  # an OpenEnv session idle this long is closed, its episode abandoned
SHUTDOWN_S = 3.0  # on SIGTERM, open connections get this long before the server stops
MESSAGE_TIMEOUT_S = 360.0  # a client waits this long for an answer: past the server's own
# deadlines (sessions.ADMIT_WAIT_S for room, served.DEADLINE_S for a served persuadee's call)
REQUEST_TIMEOUT_S = 10.0  # an HTTP request not received whole by then is dropped
MAX_FRAME_CHARS = 64_000  # the longest text frame taken (a step's message is at most 16,000)
MAX_BODY_BYTES = 4 * MAX_FRAME_CHARS  # the largest HTTP request body read (413 past it)
MAX_DEPTH = 8  # the deepest nesting of a frame's JSON (a step is 3 deep)
MAX_DIGITS = 40  # the most digits of a number in a frame (a seed is at most 19)


def openenv_models():
    """The action, observation and state of the OpenEnv contract (lab/openenv_client.py's
    pydantic models on openenv's bases): a step is {"message": str}; an observation carries the
    messages, terminated, truncated and info beside openenv's reward and done."""
    from lab.openenv_client import ArenaObservation, ArenaState, PersuaderAction
    return PersuaderAction, ArenaObservation, ArenaState


def arena_metadata():
    """/metadata: the arena's name, what it is and its version, the README's opening."""
    from importlib import metadata
    from pathlib import Path

    from openenv.core.env_server.types import EnvironmentMetadata
    try:
        version = metadata.version("persuarena")
    except metadata.PackageNotFoundError:
        version = None
    readme = Path(__file__).resolve().parent.parent / "README.md"
    return EnvironmentMetadata(
        name="PersuArena", version=version, author="the PersuArena authors",
        description="A persuasion arena: the persuader (your policy) sends {\"message\": str} "
                    "each turn to a persuadee playing a hidden psychological profile under a "
                    "deterministic decision state machine; each step returns the reply, r_t = "
                    "(b_t - b_{t-1}) / 2 read from three yes/no probes of the persuadee's "
                    "logits, and at the end the outcome (ACCEPT, CONDITIONAL_ACCEPT, PENDING, "
                    "REJECT, WALK_AWAY) and its reward. Sessions at /ws.",
        readme_content=readme.read_text(encoding="utf-8") if readme.is_file() else None)


def arena_environment(make_env):
    """openenv's Environment over make_env()'s PersuasionEnv, one per session: reset takes seed
    and instance, step takes {"message": str}; sessions run at once (their envs share one hub,
    which batches them); close never waits on the engine."""
    from openenv.core.env_server import Environment
    PersuaderAction, ArenaObservation, ArenaState = openenv_models()

    class ArenaEnvironment(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True  # each session its own episode on the shared hub

        def __init__(self):
            super().__init__()
            self.env, self.steps, self.episode_id = make_env(), 0, None

        def reset(self, seed=None, episode_id=None, instance=None, **kwargs):
            if kwargs:
                raise ValueError(f"env.py: unknown reset field(s) {shown(sorted(kwargs))}; reset "
                                 "takes seed, episode_id and instance")
            messages, info = self.env.reset(
                seed=seed, options=None if instance is None else {"instance": instance})
            self.steps, self.episode_id = 0, episode_id
            return ArenaObservation(messages=list(messages), info=info)

        def step(self, action, timeout_s=None, **kwargs):
            extra = sorted(action.model_extra or {})
            if extra or not isinstance(action.message, str):
                raise ValueError(f"env.py: a step is {{\"message\": <the persuader's text>}}, got "
                                 f"fields {shown(extra or ['message'])} with message of type "
                                 f"{type(action.message).__name__}; the episode goes on")
            messages, reward, terminated, truncated, info = self.env.step(action.message)
            self.steps += 1
            return ArenaObservation(messages=list(messages), terminated=terminated,
                                    truncated=truncated, info=info, reward=reward,
                                    done=terminated or truncated)

        @property
        def state(self):
            episode = self.env.episode or {}
            inst = episode.get("instance")
            return ArenaState(episode_id=self.episode_id, step_count=self.steps,
                              instance=inst and inst["id"], seed=episode.get("seed"),
                              done=episode.get("done", True))

        def get_metadata(self):
            return arena_metadata()

        def close(self):
            self.env.close()  # stops the episode; never waits on the engine without one
    return ArenaEnvironment, PersuaderAction, ArenaObservation


def openenv_app(make_env, session_idle_s=SESSION_IDLE_S, max_sessions=sessions.MAX_SESSIONS):
    """A FastAPI app serving make_env()'s episodes by openenv's contract over WebSocket
    sessions (/ws, what EnvClient and TRL's and SkyRL's integrations use), up to max_sessions
    at once (make_env's envs share one hub), each closed once idle for session_idle_s. HTTP
    serves /health, /schema, /metadata and /mcp (no MCP sessions: a session is a WebSocket);
    not the stateless /reset, /step and /state, which would play each call on a fresh env
    (DECISIONS.md: Server hardening). openenv's public server, wrapped at the ASGI level
    (guarded): nothing of its internals is reached into."""
    from fastapi import FastAPI
    from openenv.core.env_server.http_server import HTTPEnvServer
    from openenv.core.env_server.types import ConcurrencyConfig, ServerMode
    ArenaEnvironment, PersuaderAction, ArenaObservation = arena_environment(make_env)
    server = HTTPEnvServer(ArenaEnvironment, PersuaderAction, ArenaObservation,
                           concurrency_config=ConcurrencyConfig(max_concurrent_envs=max_sessions))
    app = FastAPI(title="PersuArena (OpenEnv)", description=__doc__.strip().split("\n\n")[0])
    server.register_routes(app, mode=ServerMode.PRODUCTION)
    quiet_utf8_log()
    return guarded(app, session_idle_s)


def frame_problem(message):
    """Why a received WebSocket frame is no message of the protocol (one line), or None: a
    binary frame, a text longer than MAX_FRAME_CHARS, not JSON, not an object, nested deeper
    than MAX_DEPTH or holding a number of more than MAX_DIGITS digits."""
    fix = 'send one JSON object per text frame, e.g. {"type": "step", "data": {"message": "..."}}'
    text = message.get("text")
    if text is None:
        return f"env_server.py: a binary frame; {fix}; the episode goes on"
    if len(text) > MAX_FRAME_CHARS:
        return (f"env_server.py: a frame of {len(text)} characters, more than {MAX_FRAME_CHARS}; "
                f"{fix}; the episode goes on")

    def number(token):
        if len(token) > MAX_DIGITS:
            raise ValueError(f"a number of more than {MAX_DIGITS} characters")
        return float(token) if any(c in token for c in ".eE") else int(token)

    def constant(name):
        raise ValueError(f"{name} is not a number JSON has")
    try:
        if depth(text) > MAX_DEPTH:
            raise ValueError(f"nested deeper than {MAX_DEPTH}")
        value = json.loads(text, parse_int=number, parse_float=number,
                           parse_constant=constant)
    except (ValueError, RecursionError) as e:
        why = (str(e).splitlines() or [type(e).__name__])[0][:120]
        return f"env_server.py: a frame that is not valid JSON ({why}); {fix}; the episode goes on"
    if not isinstance(value, dict):
        return (f"env_server.py: a frame holding a JSON {type(value).__name__}, not an object; "
                f"{fix}; the episode goes on")
    return None


def depth(text):
    """The deepest bracket nesting of a JSON text (brackets inside strings not counted)."""
    deepest = level = 0
    in_string = escaped = False
    for c in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (c == "\\", c != '"')
        elif c == '"':
            in_string = True
        elif c in "[{":
            level += 1
            deepest = max(deepest, level)
        elif c in "]}":
            level -= 1
    return deepest


def idle_notice(idle_s):
    return json.dumps({"type": "error", "data": {"code": "SESSION_ERROR", "message": (
        f"env_server.py: this session was closed by the server (idle past its --session-timeout "
        f"of {idle_s:g} s; its episode ended, its blocks freed); open a new session")}})


MCP_SESSIONS = ("openenv/session/create", "openenv/session/close")


async def mcp_session_refusal(receive):
    """(a JSON-RPC answer refusing an MCP session over HTTP, or None; the body's messages to
    replay): the body is read up to MAX_FRAME_CHARS."""
    messages, body = [], b""
    while True:
        message = await receive()
        messages.append(message)
        body += message.get("body", b"")
        if not message.get("more_body") or len(body) > MAX_FRAME_CHARS:
            break
    try:
        request = json.loads(body)
        method = request.get("method") if isinstance(request, dict) else None
    except (ValueError, RecursionError):
        method = None
    if method not in MCP_SESSIONS:
        return None, messages
    return {"jsonrpc": "2.0", "id": request.get("id"), "error": {"code": -32601, "message": (
        "env_server.py: MCP sessions over HTTP are not served: a session is a WebSocket (/ws), "
        "closed when its client goes or idles")}}, messages


async def bounded_body(receive):
    """An HTTP request's body messages, read whole up to MAX_BODY_BYTES (a 200 MB POST once
    raised the server's memory by 1.2 GB, and a 422 echoed it back); None past it."""
    messages, size = [], 0
    while True:
        message = await receive()
        messages.append(message)
        size += len(message.get("body", b""))
        if size > MAX_BODY_BYTES:
            return None
        if message["type"] != "http.request" or not message.get("more_body"):
            return messages


def replay(messages, receive):
    async def replayed():
        return messages.pop(0) if messages else await receive()
    return replayed


async def too_large(send):
    """413 in one line, the body neither kept nor echoed."""
    body = json.dumps({"detail": f"env_server.py: a request body of more than {MAX_BODY_BYTES} "
                       "bytes; the routes take small JSON bodies (a session's steps go over "
                       "the WebSocket /ws)"}).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


async def screened(scope, receive, send):
    """(handled, the receive to pass on): an HTTP body past MAX_BODY_BYTES answered 413, and a
    WebSocket on any path but /ws refused (403) before it is accepted (an MCP session over /mcp
    would hold an env outside --sessions), both handled; else an HTTP body is replayed."""
    if scope["type"] == "http":
        messages = await bounded_body(receive)
        if messages is None:
            await too_large(send)
            return True, receive
        return False, replay(messages, receive)
    if scope["type"] == "websocket" and scope["path"] != "/ws":
        await receive()
        await send({"type": "websocket.close", "code": 1008})
        return True, receive
    return False, receive


def guarded(app, idle_s=SESSION_IDLE_S):
    """The ASGI app, save that: on a WebSocket a malformed frame (frame_problem) is answered with
    an error message of the protocol and never reaches openenv's handler (which ends the session
    on it); a session that sends nothing for idle_s while no answer is owed (no step in flight)
    is told so in one line and closed (openenv's handler then closes its env: the episode ends
    and frees its blocks); closing a gone client again is a no-op and a handler that fails
    because its answer could not be sent logs one line; POST /mcp refuses MCP sessions, and a
    WebSocket anywhere but /ws is refused (MCP's /mcp would attach envs outside --sessions); an HTTP
    body past MAX_BODY_BYTES is refused (413) unread and unechoed. `.app`
    is app."""
    async def asgi(scope, receive, send):
        handled, receive = await screened(scope, receive, send)
        if handled:
            return
        if scope["type"] == "http" and scope["path"] == "/mcp" and scope["method"] == "POST":
            return await mcp(scope, receive, send)
        if scope["type"] == "http" and scope["path"] in STATELESS:
            return await not_here(send)
        if scope["type"] != "websocket":
            return await app(scope, receive, send)

        async def sent(message):
            try:
                await send(message)
            except Exception:
                if message["type"] != "websocket.close":  # a close to a gone client: done
                    raise
        waiting = []  # the receive in progress, kept across idle checks

        async def received():
            while True:
                if not waiting:
                    waiting.append(asyncio.ensure_future(receive()))
                done, _ = await asyncio.wait(waiting, timeout=idle_s)
                if not done:
                    print(f"env_server.py: a session released (idle {idle_s:g} s)",
                          file=sys.stderr)
                    await sent({"type": "websocket.send", "text": idle_notice(idle_s)})
                    await sent({"type": "websocket.close", "code": 1000})
                    return {"type": "websocket.disconnect", "code": 1000}
                message = waiting.pop().result()
                if message["type"] != "websocket.receive" or not (
                        problem := frame_problem(message)):
                    return message
                await sent({"type": "websocket.send", "text": json.dumps(
                    {"type": "error", "data": {"message": problem, "code": "INVALID_JSON"}})})
        try:
            await app(scope, received, sent)
        except Exception as e:
            print(f"env_server.py: a client dropped its connection ({type(e).__name__}); its "
                  "session is closed", file=sys.stderr)
        finally:
            for task in waiting:
                task.cancel()

    async def mcp(scope, receive, send):
        refusal, messages = await mcp_session_refusal(receive)
        if refusal is not None:
            body = json.dumps(refusal).encode()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            return await send({"type": "http.response.body", "body": body})

        return await app(scope, replay(messages, receive), send)
    asgi.app = app
    return asgi


STATELESS = ("/reset", "/step", "/state")  # openenv's stateless routes, not served here
NOT_HERE = ("PersuArena plays episodes over the WebSocket at /ws (one session, one episode: "
            "openenv's EnvClient, lab.openenv_client.PersuArenaClient); the stateless /reset, "
            "/step and /state would play each call on a fresh env and are not served")


async def not_here(send):
    """The stateless routes' 404, saying where to go instead."""
    body = json.dumps({"detail": NOT_HERE}).encode()
    await send({"type": "http.response.start", "status": 404,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class OneLineUTF8(logging.Filter):
    """uvicorn's log of a text frame that is not UTF-8 (the protocol fails the connection with
    1007, as RFC 6455 requires) in one line of env_server.py's, without the traceback."""

    def filter(self, record):
        if "Invalid UTF-8" in str(record.msg):
            record.msg, record.args, record.exc_info, record.exc_text = (
                "env_server.py: a text frame that is not UTF-8; its connection is closed (1007) "
                "and its episode ended", (), None, None)
        return True


def quiet_utf8_log():
    """Install OneLineUTF8 on uvicorn's error log (once)."""
    log = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, OneLineUTF8) for f in log.filters):
        log.addFilter(OneLineUTF8())


def request_timeout_protocol(timeout_s=REQUEST_TIMEOUT_S):
    """uvicorn's h11 protocol, save that a request not received whole (headers and body) within
    timeout_s of the connection or of the last response is dropped: a half-sent request never
    holds a descriptor. A WebSocket upgrade disarms it (the session has its own idle timeout)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class TimedH11Protocol(H11Protocol):
        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def _arm(self):
            self._awaited = self.cycle  # the cycle before the awaited request's
            self._timer = self.loop.call_later(timeout_s, self._expire)

        def _disarm(self):
            if getattr(self, "_timer", None) is not None:
                self._timer.cancel()
                self._timer = None

        def _expire(self):
            self._timer = None
            if self.cycle is self._awaited or self.cycle is None or self.cycle.more_body:
                if not self.transport.is_closing():
                    self.transport.close()

        def on_response_complete(self):
            super().on_response_complete()
            self._disarm()
            if not self.transport.is_closing():
                self._arm()

        def handle_websocket_upgrade(self, event):
            self._disarm()
            return super().handle_websocket_upgrade(event)

        def connection_lost(self, exc):
            self._disarm()
            super().connection_lost(exc)
    return TimedH11Protocol


def parse_args(argv=None):
    ap = cli.new_parser("python -m lab.env_server", __doc__)
    ap.add_argument("--serve", action="store_true", help="run the OpenEnv server on 127.0.0.1")
    ap.add_argument("--port", type=int, default=8000, help="the port to listen on")
    ap.add_argument("--host", default=HOST, help="the address to listen on (a container's "
                    "server/app.py passes 0.0.0.0; outside one, keep loopback)")
    ap.add_argument("--persuadee", default="smollm2", help="random:NAME, smollm2, a model "
                    "folder or openai:MODEL@URL")
    ap.add_argument("--judge", default=persuasion_env.JUDGE_DEFAULT, help="'auto' (the presets' "
                    "rule: none for a local persuadee on a CPU, else the persuadee's model), "
                    "'persuadee' (its model), 'none' (s = 0) or a model name")
    ap.add_argument("--scenarios", default="train", help="train, heldout or a scenarios.jsonl")
    ap.add_argument("--t-max", type=int, default=arena.T_MAX_TRAIN,
                    help="the turn budget of an episode (arena.T_MAX_TRAIN)")
    ap.add_argument("--max-new-tokens", type=int, default=engine.MAX_NEW_TOKENS,
                    help="the persuadee's reply, in tokens (engine.MAX_NEW_TOKENS)")
    ap.add_argument("--dtype", default="float32", choices=cli.DTYPES,
                    help="the persuadee's weights")
    ap.add_argument("--kv-blocks", type=int, help="the persuadee's KV pool, in blocks")
    ap.add_argument("--session-timeout", type=float, default=SESSION_IDLE_S, help="seconds "
                    "after which an idle session is closed and its slot freed")
    ap.add_argument("--sessions", type=int, default=sessions.MAX_SESSIONS, help="episodes in "
                    "play at once on the one persuadee (more wait for room, then are refused)")
    args = ap.parse_args(argv)
    if problem := flag_problem(args):
        ap.error(problem)
    args.judge = persuasion_env.preset_judge(args.persuadee, args.judge)
    return args


class ServerSession:
    """This server's client: one WebSocket session of `python -m lab.env_server --serve` over
    openenv's own client, with PersuasionEnv's reset, step and close (what trl_grpo's episodes
    and bench_sessions' clients call). who: the command named in its one-line error."""

    def __init__(self, url, who="env_server.py"):
        from openenv.core import GenericEnvClient
        try:
            self.client = GenericEnvClient(base_url=url, message_timeout_s=MESSAGE_TIMEOUT_S
                                           ).sync().connect()
        except Exception as e:
            why = (str(e).splitlines() or [type(e).__name__])[0][:120]
            raise SystemExit(f"{who}: cannot reach the arena server at {url} ({why}); "
                             "start it with python -m lab.env_server --serve, or check its address"
                             ) from None

    def reset(self, *, seed=None, options=None):
        result = self.client.reset(seed=seed, instance=(options or {}).get("instance"))
        return tuple(result.observation["messages"]), result.observation["info"]

    def step(self, text):
        result = self.client.step({"message": text})
        seen = result.observation
        return (tuple(seen["messages"]), result.reward, seen["terminated"], seen["truncated"],
                seen["info"])

    def close(self):
        self.client.close()


def open_file_limit():
    """This process's soft limit on open files (sockets included); unlimited reads as Linux's
    default ceiling on any process's open files (fs.nr_open, 2**20)."""
    import resource
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 2**20 if soft == resource.RLIM_INFINITY else soft


def flag_problem(args):
    """What is wrong with the server's flags, in one line, or None: checked before any model
    loads (a model's files, its pool and a served model's answer are checked in checked_models)."""
    if not args.serve:
        return "nothing to do: pass --serve (the Python API is env.PersuasionEnv)"
    if not 0 < args.port < 65536:
        return f"--port must be in 1..65535, got {args.port}"
    for name, value in (("t_max", args.t_max), ("max_new_tokens", args.max_new_tokens),
                        ("kv_blocks", 1 if args.kv_blocks is None else args.kv_blocks),
                        ("sessions", args.sessions)):
        if value < 1:
            return f"--{name.replace('_', '-')} must be at least 1, got {value}"
    if args.sessions > (most := open_file_limit() // 2):  # a session holds a socket, and more
        return (f"--sessions must be at most {most} (half this process's open-file limit, "
                f"ulimit -n), got {args.sessions}; pass fewer, or raise the limit")
    if not (math.isfinite(args.session_timeout) and args.session_timeout > 0):
        return f"--session-timeout must be a number of seconds > 0, got {args.session_timeout}"
    for flag, name in (("--persuadee", args.persuadee), ("--judge", args.judge)):
        if name in ("persuadee", "none") and flag == "--judge":
            continue
        if served.is_served(name):
            try:
                served.parse_spec(name)
            except SystemExit as e:
                return f"{flag}: {e}"
        elif found := cli.model_problem(name):  # as train.py checks it
            return f"{flag} {name} {found}; {cli.MODEL_FIX}"
    return None


def pool_problem(flag, name, args, instances, judging):
    """One line when local model `name` cannot be read or its --kv-blocks pool cannot hold one
    episode (nor, when it judges too, one judging), from its tokenizer and config alone."""
    from lab import pools
    try:
        shape = pools.pool_shape(name, args.dtype)
    except (OSError, ValueError) as e:
        return f"env.py: {flag} {name} cannot be read ({str(e).splitlines()[0]}); {cli.MODEL_FIX}"
    if args.kv_blocks is None:
        return None
    if too_large := pools.memory_problem(name, args.dtype, args.kv_blocks, shape):
        return f"env.py: {too_large}"
    need = pools.episode_blocks(shape, instances, args.t_max, args.max_new_tokens)
    if judging:
        need = max(need, pools.judge_blocks(shape, instances, args.t_max, args.max_new_tokens))
    if args.kv_blocks >= need:
        return None
    return (f"env.py: --kv-blocks {args.kv_blocks} cannot hold one episode of {name} ({need} "
            f"blocks of {shape.block_size} tokens at --t-max {args.t_max}, --max-new-tokens "
            f"{args.max_new_tokens}{' and its judging' if judging else ''}); pass --kv-blocks "
            f"{need} or more")


def checked_models(args, instances):
    """(persuadee, judge), every model checked before any weight loads: a served one answers
    (ServedModel.check), a local one's files read and its pool sized; then the local ones load."""
    from lab import pools
    roles = {"--persuadee": args.persuadee}
    if args.judge not in ("persuadee", "none"):
        roles["--judge"] = args.judge
    loaded = {}
    for flag, name in roles.items():
        if served.is_served(name):
            pools.player(name, loaded, args.dtype, None)
    for flag, name in roles.items():
        if not served.is_served(name) and (problem := pool_problem(
                flag, name, args, instances, flag == "--persuadee" and args.judge == "persuadee")):
            sys.exit(problem)
    persuadee = PersuasionEnv._player(args.persuadee, loaded, args.dtype, args.kv_blocks)
    if args.judge in ("persuadee", "none"):
        return persuadee, {"persuadee": persuadee, "none": None}[args.judge]
    return persuadee, PersuasionEnv._player(args.judge, loaded, args.dtype, args.kv_blocks)


def stop_like_sigterm():
    """Ctrl-C ends the server as SIGTERM does: uvicorn's graceful shutdown (SHUTDOWN_S), then
    at once, in one line (uvicorn raises the signal again once it has shut down, and this is
    then SIGINT's handler), not after a step in flight (its thread is not waited for) with two
    tracebacks and exit status 0."""
    import os
    import signal

    def stopped(signum, frame):
        os.write(sys.stderr.fileno(), b"env_server.py: stopped (Ctrl-C); every session's "
                                      b"episode ended\n")
        os._exit(128 + signum)
    signal.signal(signal.SIGINT, stopped)
    return stopped


def serving_app(args):
    """The app `--serve` runs (args: parse_args'), every model checked and loaded first."""
    try:  # a bad path is named before any model loads
        instances = load_instances(args.scenarios)
    except ValueError as e:
        sys.exit(str(e))
    from persuarena import models
    models.set_cpu_threads()  # one thread per core the machine's load leaves free
    persuadee, judge = checked_models(args, instances)

    hub = sessions.Hub(persuadee, judge, t_max=args.t_max, max_new_tokens=args.max_new_tokens,
                       max_sessions=args.sessions)

    def make_env():
        return PersuasionEnv(scenarios=instances, hub=hub)
    return openenv_app(make_env, args.session_timeout, args.sessions)


def main(argv=None):
    import uvicorn
    args = parse_args(argv)
    app = serving_app(args)
    stop_like_sigterm()
    print(f"env.py: serving {args.persuadee} on ws://{args.host}:{args.port}/ws (OpenEnv; up to "
          f"{args.sessions} sessions; idle {args.session_timeout:g} s are closed)", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning",
                http=request_timeout_protocol(), timeout_graceful_shutdown=SHUTDOWN_S)


if __name__ == "__main__":
    main()
