"""env_server.py: PersuasionEnv's episodes over OpenEnv to openenv-core's own client; many
sessions at once on one persuadee; the server survives hostile clients (bad resets mid-episode,
lone surrogates, malformed frames, half-sent requests, steps after the end, drops, idle and
never-used sessions) with its pool, threads and memory where they started."""
import contextlib
import json
import os
import socket
import threading
import time

import pytest

from persuarena import arena
from persuarena import engine
from lab import env as persuasion_env
from lab import env_server, sessions
from conftest import served_app, tiny_model
from test_env import BAD_INSTANCES, MESSAGES, play_env
from test_served import instances  # noqa: F401
import warm

# every test here on one worker (and those elsewhere that start an OpenEnv server): importing
# openenv (and gradio, which it imports) costs a process ~5 CPU-s, which the other worker then
# never pays
pytestmark = pytest.mark.xdist_group("openenv")


@contextlib.contextmanager
def serving(make_env, **app_kw):
    """env.py's OpenEnv app on 127.0.0.1 (a free port) in a thread: yields its http URL."""
    http = app_kw.pop("http", "auto")
    with served_app(env_server.openenv_app(make_env, **app_kw), http=http) as url:
        yield url


@pytest.fixture
def openenv_server(tokenizer):
    """The server over a tiny local persuadee: (URL, make_env, engine)."""
    ee = engine.Engine(tiny_model("qwen3", seed=2), tokenizer, 8, 2000)
    hub = sessions.Hub(ee, None, t_max=3, max_new_tokens=6)

    def make_env():
        return persuasion_env.PersuasionEnv(scenarios=instances(), hub=hub)
    with serving(make_env) as url:
        yield url, make_env, ee


def test_openenvs_own_client_plays_a_whole_episode(openenv_server):
    """openenv-core's GenericEnvClient over the WebSocket session: the episode the env plays
    in-process for the same seed; a malformed action gets env.py's error and the episode goes on."""
    from openenv.core import GenericEnvClient
    url, make_env, ee = openenv_server
    inst = instances()[0]
    local = play_env(make_env(), inst, 4)
    with GenericEnvClient(base_url=url).sync() as client:
        first = client.reset(seed=4, instance=inst["id"])
        assert first.observation["messages"] == arena.persuader_messages(inst)
        assert first.observation["info"]["beliefs"] == local[0][4]["beliefs"][:1]
        results = []
        for k, text in enumerate(MESSAGES):
            if k == 1:
                for bad in ({"text": text}, {"message": 3}):
                    with pytest.raises(RuntimeError, match='a step is {"message"'):
                        client.step(bad)
            results.append(client.step({"message": text}))
            if results[-1].done:
                break
        state = client.state()
    assert len(results) == len(local) and state["instance"] == inst["id"] and state["done"]
    for got, (obs, reward, terminated, truncated, info) in zip(results, local):
        assert got.observation["messages"] == list(obs) and got.reward == reward
        assert (got.observation["terminated"], got.observation["truncated"]) == \
            (terminated, truncated)
        assert got.observation["info"]["beliefs"] == info["beliefs"]
    assert results[-1].observation["info"]["record"]["transcript"] == \
        local[-1][4]["record"]["transcript"]
    assert len(ee.cache.free_blocks) == 2000


def test_the_server_cli_refuses_bad_flags_before_loading(capsys, monkeypatch, short_scenarios):
    """Each bad flag is one line before any weight loads: a served judge's malformed spec, a
    random shape that does not exist, a --session-timeout that is not a positive number, and a
    --kv-blocks pool that cannot hold one episode (sized from the tokenizer and config)."""
    from persuarena import models
    for argv, words in ((["--port", "1"], "pass --serve"), (["--serve", "--port", "0"], "--port"),
                        (["--serve", "--t-max", "0"], "--t-max must be at least 1"),
                        (["--serve", "--sessions", str(10**9)], "--sessions must be at most"),
                        (["--serve", "--judge", "openai:nope"], "--judge: served.py: model spec"),
                        (["--serve", "--judge", "random:nope"], "--judge random:nope names no"),
                        (["--serve", "--session-timeout", "nan"], "--session-timeout must be"),
                        (["--serve", "--session-timeout", "0"], "--session-timeout must be")):
        with pytest.raises(SystemExit):
            env_server.parse_args(argv)
        err = capsys.readouterr().err
        assert words in err and err.strip().splitlines()[-1].count("error:") == 1, err

    def no_weights(*args, **kwargs):
        raise AssertionError("a model loaded before the flags were checked")
    monkeypatch.setattr(models, "load_model", no_weights)
    with pytest.raises(SystemExit) as excinfo:
        env_server.main(["--serve", "--persuadee", "random:tiny-qwen3", "--kv-blocks", "1",
                         "--scenarios", short_scenarios, "--judge", "persuadee"])
    message = str(excinfo.value)
    assert "\n" not in message and "--kv-blocks 1 cannot hold one episode" in message, message
    assert "and its judging" in message  # a judge of the persuadee's model shares its pool
    for extra, words in ((["--kv-blocks", str(10**9), "--scenarios", short_scenarios],
                          "more than this machine's"),  # a 7 TiB pool, as eval.py refuses it
                         (["--scenarios", "/etc/passwd"], "invalid JSON"),
                         (["--scenarios", "/dev/zero"], "not a regular file")):
        with pytest.raises(SystemExit) as excinfo:
            env_server.main(["--serve", "--persuadee", "random:tiny-qwen3", *extra])
        message = str(excinfo.value)
        assert "\n" not in message and words in message, message


def test_sigterm_stops_the_server_with_a_client_mid_episode(short_scenarios):
    """python -m lab.env_server --serve with a client mid-episode (and one more connecting):
    SIGTERM ends the process, with no traceback."""
    import signal
    import subprocess

    port = warm.free_port()
    url = f"http://127.0.0.1:{port}"
    server = warm.popen(  # started warm: tests/warm.py
        ["-m", "lab.env_server", "--serve", "--port", str(port), "--persuadee",
         "random:tiny-qwen3", "--judge", "none", "--scenarios", short_scenarios, "--t-max", "3",
         "--max-new-tokens", "4"], {**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL)
    try:
        for _ in range(1200):  # start-up: imports and a random model
            with contextlib.suppress(OSError):
                post(url + "/mcp", {"jsonrpc": "2.0", "id": 1, "method": "tools/list",
                                    "params": {}})
                break
            assert server.poll() is None, server.stderr.read()
            time.sleep(0.1)
        raw = session(url)
        observed(raw.ask("reset", {"seed": 1}))
        observed(raw.ask("step", {"message": "Hello."}))
        waiting = Raw(url)
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) is not None
        err = server.stderr.read()
        assert "Traceback" not in err, err
    finally:
        server.kill()
        server.wait()


def test_the_server_cli_serves_on_loopback_only(monkeypatch, short_scenarios):
    """The server binds to loopback and serves with the smallest --kv-blocks it does not
    refuse, its SIGTERM grace and its session timeout as given."""
    import uvicorn
    served_at = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: served_at.update(app=app, **kw))
    argv = ["--serve", "--port", "8123", "--persuadee", "random:tiny-qwen3", "--scenarios",
            short_scenarios, "--judge", "none", "--t-max", "2", "--max-new-tokens", "4"]
    with pytest.raises(SystemExit) as excinfo:
        env_server.main(argv + ["--kv-blocks", "2"])
    need = str(excinfo.value).split("pass --kv-blocks ")[1].split()[0]
    assert "and its judging" not in str(excinfo.value)  # --judge none: no judging in the pool
    env_server.main(argv + ["--kv-blocks", need, "--session-timeout", "5"])
    assert (served_at["host"], served_at["port"]) == ("127.0.0.1", 8123)
    assert served_at["timeout_graceful_shutdown"] == env_server.SHUTDOWN_S
    routes = {r.path for r in served_at["app"].app.routes}
    assert "/ws" in routes and not {"/reset", "/step", "/state"} & routes  # no stateless HTTP


class Raw:
    """A raw client of openenv-core's WebSocket protocol (websockets' own client): what a hostile
    client may send, and drop."""

    def __init__(self, url):
        from websockets.sync.client import connect
        self.ws = connect(url.replace("http://", "ws://") + "/ws", open_timeout=10,
                          close_timeout=1, ping_interval=None).__enter__()

    def send(self, kind, data=None, raw=None):
        message = {"type": kind} if data is None else {"type": kind, "data": data}
        self.ws.send(raw if raw is not None else json.dumps(message))

    def ask(self, kind, data=None, raw=None):
        """(the answer's type, its data), within 10 s."""
        self.send(kind, data, raw)
        answer = json.loads(self.ws.recv(timeout=10))
        return answer["type"], answer["data"]

    def error(self, kind, data=None, raw=None):
        """The one-line error message an ask answers."""
        kind, data = self.ask(kind, data, raw)
        assert kind == "error" and "\n" not in data["message"], data
        return data["message"]

    def drop(self):
        """Gone without a close frame, as a killed client."""
        self.ws.socket.shutdown(socket.SHUT_RDWR)
        self.ws.recv_events_thread.join(10)  # the client's own thread, ended

    def close(self):
        with contextlib.suppress(Exception):
            self.ws.send(json.dumps({"type": "close"}))
        self.ws.close()


def play_through(raw, seed, instance=None):
    """A polite whole episode over a raw session: the last observation's data."""
    kind, data = raw.ask("reset", {"seed": seed, "instance": instance})
    assert kind == "observation", data
    for text in MESSAGES * 2:
        kind, data = raw.ask("step", {"message": text})
        assert kind == "observation", data
        if data["done"]:
            return data
    raise AssertionError("the episode never ended")


def test_over_openenv_a_bad_reset_or_a_surrogate_mid_episode_is_one_line(openenv_server):
    """Over the server: a reset with an unknown (or list, dict, number) instance during an
    episode, then a step: each answers at once, the error in one line and the step as the
    episode's next turn; a lone surrogate sent as JSON is refused in one line with the pool's
    free blocks unchanged; the next client plays a full episode; HTTP /step is not served."""
    import httpx
    url, make_env, ee = openenv_server
    raw = Raw(url)
    observed(raw.ask("reset", {"seed": 1, "instance": instances()[0]["id"]}))
    assert raw.ask("step", {"message": "Hello."})[1]["observation"]["info"]["turn"] == 1
    held = ee.free_blocks
    for bad in BAD_INSTANCES:
        assert "no instance" in raw.error("reset", {"seed": 2, "instance": bad})
    assert "unknown reset field" in raw.error("reset", {"seed": 2, "scenario": "x"})
    surrogate = '{"type": "step", "data": {"message": "half an emoji \\ud83d"}}'
    assert "surrogate U+D83D" in raw.error("step", raw=surrogate)
    assert ee.free_blocks == held
    assert raw.ask("step", {"message": "Go on."})[1]["observation"]["info"]["turn"] == 2
    raw.close()
    other = Raw(url)
    assert play_through(other, 5)["observation"]["info"]["record"]["turns"] >= 1
    assert "no episode in play" in other.error("step", {"message": "After the end."})
    other.close()
    assert ee.free_blocks == 2000
    for answer in (httpx.post(url + "/step", json={"action": {"message": "hi"}}),
                   httpx.post(url + "/reset", json={}), httpx.get(url + "/state")):
        assert answer.status_code == 404 and "WebSocket at /ws" in answer.json()["detail"]
    assert httpx.get(url + "/health").json()["status"] == "healthy"
    meta = httpx.get(url + "/metadata").json()
    assert meta["name"] == "PersuArena" and '{"message": str}' in meta["description"]


def test_the_typed_client_plays_an_episode(openenv_server):
    from lab.openenv_client import ArenaObservation, PersuaderAction, PersuArenaClient
    url, make_env, ee = openenv_server
    with PersuArenaClient(base_url=url).sync() as client:
        result = client.reset(seed=1, instance=instances()[0]["id"])
        assert isinstance(result.observation, ArenaObservation)
        assert [m["role"] for m in result.observation.messages] == ["system", "user"]
        while not result.done:
            result = client.step(PersuaderAction(message="Hello."))
        assert result.observation.info["record"]["turns"] >= 1
        assert client.state().instance == instances()[0]["id"]


def test_the_repository_is_an_openenv_package_that_validates():
    """`openenv validate .` at the repository root (openenv's command-line app, run in this
    process, whose imports the server's tests have paid): openenv.yaml naming server/app.py, whose
    app builds lab/env_server.py's on its first event (importing it loads no model)."""
    import pathlib

    from openenv.cli.__main__ import app
    from typer.testing import CliRunner
    root = pathlib.Path(__file__).resolve().parent.parent
    done = CliRunner().invoke(app, ["validate", str(root), "--level", "static"])
    assert done.exit_code == 0 and "PASS  static.manifest" in done.output, done.output
    for name in ("Dockerfile", "server/__init__.py", "server/app.py"):
        assert (root / name).is_file()
    from server import app as package_app
    assert package_app.app.app is None and callable(package_app.main)


def session(url, tries=400):
    """A raw session that holds the server's one slot: connect again while the server answers
    that it is at capacity (a slot not yet released)."""

    from websockets.exceptions import ConnectionClosed
    for _ in range(tries):
        raw = Raw(url)
        try:  # at capacity the server answers so at once and closes, maybe before the ask
            kind, data = raw.ask("state")
        except ConnectionClosed:
            kind, data = "error", {"code": "CAPACITY_REACHED"}
        if kind == "state":
            return raw
        assert data["code"] == "CAPACITY_REACHED", data
        raw.ws.close()
        time.sleep(0.05)
    raise AssertionError("the slot was never released")


def post(url, body):
    """POST JSON, the answer's JSON (urllib: no client pool or TLS context per call)."""
    from urllib.request import Request, urlopen
    request = Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urlopen(request, timeout=10) as answer:
        return json.load(answer)


def mcp_session_refused(url):
    """The one-line refusal of an MCP session over HTTP (POST /mcp openenv/session/create)."""
    answer = post(url + "/mcp", {"jsonrpc": "2.0", "id": 1, "params": {},
                                 "method": "openenv/session/create"})
    assert "\n" not in answer["error"]["message"], answer
    return answer["error"]["message"]


def rss_bytes():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def settled_threads(target, tries=200):
    """The thread count once it is back to target (finished threads need a moment to exit)."""
    for _ in range(tries):
        if threading.active_count() <= target:
            break
        time.sleep(0.05)
    return threading.active_count()



def observed(answer):
    """An ask's answer that must be an observation; the error it got instead, said if not."""
    kind, data = answer
    assert kind == "observation", data
    return data


def misbehave(url, i):
    """Episode i of the soak: a client that misbehaves in one of the ways the server must survive.
    Returns a client left holding its session (idle) or None."""
    raw = session(url)
    kind = i % 6
    if kind == 4:  # the reset in flight when the client goes
        raw.send("reset", {"seed": i})
        raw.drop()
        return None
    observed(raw.ask("reset", {"seed": i}))
    if kind == 0:  # a bad instance mid-episode, then the episode goes on
        assert "no instance" in raw.error("reset", {"instance": BAD_INSTANCES[i // 6 % 4]})
        observed(raw.ask("step", {"message": "Next."}))
        raw.close()
    elif kind == 1:  # a lone surrogate, then gone without a close frame
        assert "surrogate" in raw.error("step", raw='{"type": "step", "data": '
                                                   '{"message": "\\ud800"}}')
        raw.drop()
    elif kind == 2:  # to the end, then a step after it
        kind_, data = raw.ask("step", {"message": "Hi."})
        while kind_ == "observation" and not data["done"]:
            kind_, data = raw.ask("step", {"message": "More."})
        assert kind_ == "observation", data
        assert "call reset" in raw.error("step", {"message": "After the end."})
        raw.close()
    elif kind == 3:  # gone while its step is played (the answer cannot be sent)
        raw.send("step", {"message": "Hello?"})
        raw.drop()
    else:  # a step, then idle: the next client waits for its release
        observed(raw.ask("step", {"message": "Hi."}))
        return raw
    return None


def one_malloc_arena():
    """Cap glibc's malloc at 2 arenas (mallopt M_ARENA_MAX) where it is glibc: otherwise each
    new thread may take an arena of its own and the resident memory grows with the threads that
    ever allocated (tens of MiB over a soak; flat with the cap), which is no leak."""
    import ctypes
    import ctypes.util
    with contextlib.suppress(OSError, AttributeError, TypeError):
        ctypes.CDLL(ctypes.util.find_library("c")).mallopt(-8, 2)  # M_ARENA_MAX


def soak(url, ee, episodes, idle_every, unused_every, capfd):
    """episodes misbehaving clients (misbehave), sessions opened and never used, refused MCP
    sessions and idle ones among them; then a polite client plays a whole episode, and the
    pool's free blocks, the thread count and the memory are where they started."""
    one_malloc_arena()
    play_through(polite := session(url), 0)  # warm: lazy threads and caches exist from here
    polite.close()
    threads, rss = settled_threads(0, tries=1), rss_bytes()
    held = []
    for i in range(episodes):
        kind = "idle" if i % idle_every == idle_every - 1 else None
        left = misbehave(url, 5 if kind else i if i % 6 != 5 else i + 1)
        held += [left] if left else []
        if i % unused_every == 0:  # a session opened and never used
            held.append(Raw(url))
        elif i % unused_every == 1:  # an MCP session over HTTP: refused in one line
            assert "not served" in mcp_session_refused(url)
    polite = session(url)
    final = play_through(polite, 99, instances()[2]["id"])
    polite.close()
    assert final["observation"]["info"]["record"]["id"] == instances()[2]["id"]
    # the idle clients, still connected, are released by their idle timeout, however fast the
    # soak was: waited for, before the held clients close
    deadline = time.time() + 10
    while ee.free_blocks != 2000 and time.time() < deadline:
        time.sleep(0.05)
    assert ee.free_blocks == 2000
    for raw in held:
        with contextlib.suppress(Exception):
            raw.ws.close()
    # none left behind (the count taken after the warm-up may still hold a closing client's own
    # thread, so the end may hold fewer: the 500-episode soak once ended at 3 against 4)
    assert settled_threads(threads) <= threads, [t.name for t in threading.enumerate()]
    assert rss_bytes() - rss < 64 * 2**20
    err = capfd.readouterr().err
    assert "Traceback" not in err and "dropped its connection" in err
    assert "released (idle" in err


def test_an_idle_session_is_closed_and_says_so(tokenizer, capfd):
    """A session whose calls are refused (a bad reset) or only ask its state, for twice the
    timeout, is not idle; once silent past the timeout it is told so in one line and closed
    mid-episode (its blocks freed, one line logged); a new client plays; an MCP session over
    HTTP is refused in one line. No openenv internals are reached into (ASGI level)."""
    ee = engine.Engine(tiny_model("qwen3", seed=2), tokenizer, 8, 2000)
    hub = sessions.Hub(ee, None, t_max=2, max_new_tokens=4)

    def make_env():
        return persuasion_env.PersuasionEnv(scenarios=instances(), hub=hub)
    with serving(make_env, session_idle_s=1.0) as url:
        idle = session(url)
        assert idle.ask("reset", {"seed": 1})[0] == "observation"
        assert ee.free_blocks < 2000
        busy_until = time.time() + 2.0
        while time.time() < busy_until:
            assert "no instance" in idle.error("reset", {"instance": "nowhere"})
            assert idle.ask("state")[0] == "state"
            time.sleep(0.1)
        assert ee.free_blocks < 2000  # still in play
        notice = json.loads(idle.ws.recv(timeout=10))
        assert notice["type"] == "error" and "closed by the server (idle" in \
            notice["data"]["message"] and "\n" not in notice["data"]["message"]
        for _ in range(200):
            if ee.free_blocks == 2000:
                break
            time.sleep(0.05)
        assert ee.free_blocks == 2000
        play_through(polite := session(url), 2)
        polite.close()
        idle.close()
        assert "not served" in mcp_session_refused(url)
    assert "released (idle " in capfd.readouterr().err


SOAK_ALL = "PERSUARENA_SOAK"  # set to run the 500-episode soak too


@pytest.mark.slow
@pytest.mark.parametrize("episodes", [24, pytest.param(500, marks=pytest.mark.skipif(
    not os.environ.get(SOAK_ALL), reason=f"the 500-episode soak runs with {SOAK_ALL}=1"))])
def test_the_server_survives_a_soak_of_misbehaving_clients(tokenizer, capfd, episodes):
    """A bounded soak over loopback (soak) with a short idle timeout. 24 episodes hold each of
    misbehave's 6 kinds at least twice (two of them the idle clients), its 4 bad instances,
    three sessions never used and three refused MCP sessions; the 500-episode one is opt-in."""
    ee = engine.Engine(tiny_model("qwen3", seed=2), tokenizer, 8, 2000)

    hub = sessions.Hub(ee, None, t_max=2, max_new_tokens=4)

    def make_env():
        return persuasion_env.PersuasionEnv(scenarios=instances(), hub=hub)
    with serving(make_env, session_idle_s=2.0) as url:
        soak(url, ee, episodes, idle_every=min(75, episodes // 2), unused_every=10, capfd=capfd)


@contextlib.contextmanager
def held_replies(ee):
    """The persuadee's generate blocks until released: (entered, release) events; a step is
    then in flight for as long as the test wants."""
    entered, release = threading.Event(), threading.Event()
    generate = ee.generate

    def held(*args, **kwargs):
        entered.set()
        assert release.wait(60)
        return generate(*args, **kwargs)
    ee.generate = held
    try:
        yield entered, release
    finally:
        release.set()
        ee.generate = generate


def test_info_routes_answer_while_a_step_is_in_flight(openenv_server):
    """A POST /mcp and GET /health during a step answer while the step is still in flight (the
    engine held): neither waits on the engine (on the old server, /mcp's env close waited on the
    engine lock on the event loop and froze every route)."""
    import httpx
    url, make_env, ee = openenv_server
    raw = Raw(url)
    observed(raw.ask("reset", {"seed": 1, "instance": instances()[0]["id"]}))
    with held_replies(ee) as (entered, release):
        raw.send("step", {"message": "Hello."})
        assert entered.wait(30)
        answer = post(url + "/mcp", {"jsonrpc": "2.0", "id": 1, "method": "tools/list",
                                     "params": {}})
        assert "jsonrpc" in answer
        assert httpx.get(url + "/health", timeout=10).json()["status"] == "healthy"
        assert not release.is_set()  # answered while the step was still held
    kind, data = json.loads(raw.ws.recv(timeout=30))["type"], None
    assert kind == "observation"
    raw.close()


MALFORMED = [("binary", b"\x00\x01"), ("list", "[1, 2]"), ("string", '"step"'),
             ("deep", "[" * 5000 + "]" * 5000), ("number", '{"type": "reset", "data": {"seed": '
                                                          + "9" * 4300 + "}}"),
             ("nan", '{"type": "step", "data": {"message": NaN}}'), ("not JSON", "{oops")]


def test_malformed_frames_are_one_line_and_the_episode_goes_on(openenv_server):
    """A binary frame, JSON that is no object, deep nesting, a 4,300-digit number, NaN and a
    frame that is not JSON: each answered with a one-line error, and the next step is the
    episode's next turn (the old handler ended the session on all but the last); seeds that are
    no integer in range (true, 4,000 digits, -1, 1.5) are refused in one line too."""
    url, make_env, ee = openenv_server
    raw = Raw(url)
    observed(raw.ask("reset", {"seed": 1, "instance": instances()[0]["id"]}))
    assert observed(raw.ask("step", {"message": "Hello."}))["observation"]["info"]["turn"] == 1
    for name, frame in MALFORMED:
        raw.ws.send(frame)
        answer = json.loads(raw.ws.recv(timeout=10))
        assert answer["type"] == "error" and "\n" not in answer["data"]["message"], (name, answer)
        assert "the episode goes on" in answer["data"]["message"], name
    for seed in (True, int("9" * 30), -1, 1.5):
        assert "a seed is an integer" in raw.error("reset", {"seed": seed}), seed
    assert observed(raw.ask("step", {"message": "Go on."}))["observation"]["info"]["turn"] == 2
    raw.close()


def test_the_request_timeout_reads_uvicorns_internals_as_pinned():
    """request_timeout_protocol subclasses uvicorn's H11Protocol (uvicorn has no public
    whole-request deadline): uvicorn is pinned in requirements.txt, the installed one is that
    version, and the internals the subclass reads are still there."""
    import inspect
    import pathlib
    from importlib import metadata

    from uvicorn.protocols.http import h11_impl
    pins = [line.split("#")[0].strip() for line in
            (pathlib.Path(__file__).resolve().parent.parent / "requirements.txt").read_text().splitlines()
            if line.startswith("uvicorn==")]
    assert pins == [f"uvicorn=={metadata.version('uvicorn')}"]
    for hook in ("connection_made", "on_response_complete", "handle_websocket_upgrade",
                 "connection_lost"):
        assert callable(getattr(h11_impl.H11Protocol, hook))
    source = inspect.getsource(h11_impl.H11Protocol)
    assert "self.cycle" in source and "self.loop" in source and "self.transport" in source
    assert "more_body" in inspect.getsource(h11_impl.RequestResponseCycle)


def test_a_half_sent_request_is_dropped(tokenizer):
    """An HTTP request whose headers never end (or whose body never comes) is dropped after the
    request timeout: the connection is closed by the server (the old server held it forever);
    a whole request on the same server is answered."""
    ee = engine.Engine(tiny_model("qwen3", seed=2), tokenizer, 8, 200)
    hub = sessions.Hub(ee, None, t_max=2, max_new_tokens=4)
    make_env = lambda: persuasion_env.PersuasionEnv(scenarios=instances(), hub=hub)  # noqa: E731
    with serving(make_env, http=env_server.request_timeout_protocol(0.5)) as url:
        port = int(url.rsplit(":", 1)[1])
        for partial in (b"GET /health HTTP/1.1\r\nHost: x\r\n",
                        b"POST /mcp HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"):
            with socket.create_connection(("127.0.0.1", port)) as conn:
                conn.sendall(partial)
                conn.settimeout(20)
                assert conn.recv(1024) == b""  # closed, not answered
        assert post(url + "/mcp", {"jsonrpc": "2.0", "id": 1, "method": "tools/list",
                                   "params": {}})["jsonrpc"] == "2.0"


def test_a_frame_that_is_not_utf8_is_one_line(openenv_server):
    """A text frame that is not UTF-8 fails its connection (1007, as RFC 6455 requires); its
    episode's blocks are freed and the next client plays; uvicorn's log of it (a traceback on
    the old server, one per frame) is one line without the traceback."""
    import logging
    import sys

    from websockets.exceptions import ConnectionClosedError
    url, make_env, ee = openenv_server
    raw = Raw(url)
    observed(raw.ask("reset", {"seed": 1}))
    with raw.ws.send_context():
        raw.ws.protocol.send_text(b'{"type": "step", "data": {"message": "\xff\xfe"}}')
    with pytest.raises(ConnectionClosedError, match="1007"):
        raw.ws.recv(timeout=30)
    for _ in range(400):
        if ee.free_blocks == 2000:
            break
        time.sleep(0.05)
    assert ee.free_blocks == 2000
    play_through(Raw(url), 2)
    try:
        b"\xff".decode()
    except UnicodeDecodeError:
        record = logging.LogRecord("uvicorn.error", logging.ERROR, __file__, 1,
                                   "Invalid UTF-8 sequence received from client.", (),
                                   sys.exc_info())
    assert any(isinstance(f, env_server.OneLineUTF8)
               for f in logging.getLogger("uvicorn.error").filters)
    env_server.OneLineUTF8().filter(record)
    line = logging.Formatter().format(record)
    assert "a text frame that is not UTF-8" in line and "\n" not in line, line


def test_a_huge_http_body_is_refused_unread_and_not_echoed(openenv_server):
    """A request body past MAX_BODY_BYTES (sent whole or in chunks) is answered 413 in one line,
    never echoed (a 422 once sent a 400 MB body back), and the server answers on; a small body
    still reaches its route."""
    import httpx
    url, _, _ = openenv_server
    huge = b'{"jsonrpc": "2.0", "id": 1, "method": "' + b"x" * (4 * env_server.MAX_BODY_BYTES) + b'"}'
    for route in ("/mcp", "/schema", "/reset"):
        for body in (huge, iter([huge[:1000], huge[1000:]])):  # with a length, then chunked
            answer = httpx.post(url + route, content=body, timeout=30)
            assert answer.status_code == 413 and len(answer.content) < 500, route
            assert "\n" not in answer.json()["detail"]
    assert "jsonrpc" in post(url + "/mcp", {"jsonrpc": "2.0", "id": 1, "method": "tools/list",
                                             "params": {}})
    assert httpx.get(url + "/health", timeout=10).json()["status"] == "healthy"


def test_ctrl_c_ends_the_server_as_sigterm_does(monkeypatch, capfd):
    """SIGINT's handler while serving (uvicorn calls it again after its graceful shutdown) ends
    the process at once in one line with status 130, without waiting for a step's thread or
    raising KeyboardInterrupt's tracebacks."""
    import os
    import signal
    previous = signal.getsignal(signal.SIGINT)
    exits = []
    monkeypatch.setattr(os, "_exit", exits.append)
    try:
        handler = env_server.stop_like_sigterm()
        assert signal.getsignal(signal.SIGINT) is handler
        handler(signal.SIGINT, None)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert exits == [130]
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "stopped (Ctrl-C)" in err and "Traceback" not in err


def test_a_websocket_other_than_ws_is_refused(openenv_server):
    """MCP over the WebSocket /mcp attached an env per connection outside --sessions: every
    WebSocket path but /ws is refused before it is accepted; /ws still plays."""
    from websockets.sync.client import connect
    url, _, _ = openenv_server
    for path in ("/mcp", "/other"):
        with pytest.raises(Exception) as excinfo:
            connect(url.replace("http://", "ws://") + path, open_timeout=10).__enter__()
        assert "403" in str(excinfo.value), excinfo.value
    raw = Raw(url)
    observed(raw.ask("reset", {"seed": 1}))
    raw.close()
