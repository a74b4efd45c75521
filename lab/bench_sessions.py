"""
bench_sessions.py: episodes per second against the number of sessions playing at once on one
persuadee (lab/sessions.py), in-process and over the OpenEnv server on loopback.

For each count N, N clients each play REPEATS whole episodes of scripted persuader messages at
once, client c the instance c mod --instances (1: every client the same one, as the G sessions
of a trainer's group; then the persuadee prefills its prompt once for those admitted together,
sessions.SharedPrompts), and

    episodes/s = N * REPEATS / wall,   speed-up(N) = episodes/s(N) / episodes/s(1).

In-process, each client is a PersuasionEnv over one shared sessions.Hub in its own thread; the
engine's decode calls are counted, so the table also gives the mean number of sequences each
decode step carried (replies of several sessions in one step lift it above 1). Over loopback
the server is `python -m lab.env_server --serve` in its own process and each client one
WebSocket session through the server's own client (env_server.ServerSession, openenv's). One
warm-up episode precedes the counts; in-process, the persuadee's KV pool and decode memory are
written once before it (bench_workload.touch_memory: a fresh page's first touch would otherwise
fall on whichever count first reaches it). The judge is off (s = 0): the table times the
persuadee's replies, probe reads and decisions.

    python -m lab.bench_sessions --persuadee random:tiny-qwen3 --over inprocess
    python -m lab.bench_sessions --persuadee smollm2 --over loopback --sessions 1,16 --repeats 1
    python -m lab.bench_sessions --persuadee smollm2 --sessions 1,4,16 --rounds 3   # medians

--attacker S: HONEST clients step for S seconds, then again beside one client that sends
ATTACK (tags nested 1,998 deep, 15,992 characters) as each of its messages, then beside a fifth
honest client instead (the control); the honest steps' median and count each time, in-process (a session's text must not cost the others
their turn: lab/sessions.py). Nothing is asserted about time; the table reports it.
"""
import argparse
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

SESSIONS = (1, 4, 16, 64)  # the counts
REPEATS = 2  # episodes each client plays back to back at a count
ROUNDS = 1  # times the counts are played, in order then reversed, alternately (--rounds)
INSTANCES = 1  # distinct instances the clients play (1: all one, as a trainer's group of G)
T_MAX = 3  # turns an episode may last
MAX_NEW_TOKENS = 8  # tokens of a persuadee reply
SCRIPT = ("Hello, may I ask about your week?", "Would a leaflet help?", "We could go together.",
          "What would make it easier?")
SESSIONS_MAX = 1024  # --sessions at most (sessions.MAX_SESSIONS is the server's default)
HONEST = 4  # honest clients of the --attacker table
ATTACK = "[ACC" * 1998 + "[ACCEPT]" + "EPT]" * 1998  # the attacker's message (under 16,000 chars)
SERVER_START_S = 600  # a SmolLM2 server on a busy 2-core machine takes a while to load


def client_messages(i):
    """Client i's messages (a different tail each, so no two contexts are the same)."""
    return [f"{text} ({i})" for text in SCRIPT * 2]


def play(env, i, instance, turns):
    """One episode of client i's messages on env: a PersuasionEnv in-process, or
    env_server.ServerSession, the server's own client over loopback (the same calls)."""
    env.reset(seed=i, options={"instance": instance})
    for n, text in enumerate(client_messages(i), 1):
        _, _, terminated, truncated, _ = env.step(text)
        if terminated or truncated:
            break
    turns.append(n)


def timed(target, count, repeats, instances):
    """Wall seconds for `count` clients, each on its env target(c), playing `repeats` episodes
    each at once, and the turns the episodes lasted."""
    turns, errors = [], []

    def client(c):
        try:
            env = target(c)
            try:
                for r in range(repeats):
                    play(env, c * repeats + r, instances[c % len(instances)], turns)
            finally:
                env.close()  # its session (and the server's slot) freed for the next count
        except (Exception, SystemExit) as e:  # no table over a failed client
            errors.append(e)
    threads = [threading.Thread(target=client, args=(c,)) for c in range(count)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        sys.exit(f"bench_sessions.py: {len(errors)} client(s) failed, the first: {errors[0]!r}")
    return time.perf_counter() - start, turns


def inprocess_hub(args, instances):
    """A hub over the persuadee, its engine's decode calls counted: (hub, steps list)."""
    from persuarena import models
    from lab import env as persuasion_env, pools, sessions
    from lab.bench_workload import touch_memory
    models.set_cpu_threads()
    eng = pools.player(args.persuadee, {}, "float32", args.kv_blocks)
    touch_memory(eng)  # its pages' first touch not counted against the larger counts
    steps, generate = [], eng.generate

    def counted(sids, *a, **kw):
        steps.append(len(sids))
        return generate(sids, *a, **kw)
    eng.generate = counted
    hub = sessions.Hub(eng, None, t_max=args.t_max, max_new_tokens=args.max_new_tokens,
                       max_sessions=max(args.sessions))
    return (lambda c: persuasion_env.PersuasionEnv(scenarios=instances, hub=hub)), steps


def start_server(args, port):
    """`python -m lab.env_server --serve` on loopback in its own process, once it answers."""
    cmd = [sys.executable, "-m", "lab.env_server", "--serve", "--port", str(port),
           "--persuadee", args.persuadee, "--judge", "none", "--scenarios", args.scenarios,
           "--t-max", str(args.t_max), "--max-new-tokens", str(args.max_new_tokens),
           "--sessions", str(max(args.sessions)), "--session-timeout", "600"]
    if args.kv_blocks:
        cmd += ["--kv-blocks", str(args.kv_blocks)]
    proc = subprocess.Popen(cmd)
    deadline = time.time() + SERVER_START_S
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                sys.exit("bench_sessions.py: the server did not start")
            time.sleep(1)


def play_counts(args, target, steps, instances):
    """Each count's episodes/s, --rounds times (bench_workload.alternated), a table row
    a play: {count: [rate a round]}."""
    from lab.bench_workload import alternated
    print("| sessions | episodes | turns/episode | wall (s) | episodes/s | vs first | "
          "sequences/decode step | load |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    rates = {count: [] for count in args.sessions}
    for count in alternated(args.sessions, args.rounds):
        steps.clear()
        wall, turns = timed(target, count, args.repeats, instances)
        rates[count].append(len(turns) / wall)
        base = rates[args.sessions[0]][0]  # the first count's first rate: the first row's
        batch = f"{sum(steps) / len(steps):.1f}" if steps else "-"
        print(f"| {count} | {len(turns)} | {sum(turns) / len(turns):.1f} | {wall:.2f} | "
              f"{rates[count][-1]:.2f} | {rates[count][-1] / base:.1f}x | {batch} | "
              f"{os.getloadavg()[0]:.1f} |", flush=True)
    return rates


def stepping(env, c, instances, stop, times, refused, text=None):
    """Client c's episodes on env until stop is set: each step's seconds in times (text: the
    same message every step, its one-line refusals counted in refused)."""
    while not stop.is_set():
        env.reset(seed=c, options={"instance": instances[c % len(instances)]})
        for message in client_messages(c) if text is None else [text] * 64:
            start = time.perf_counter()
            try:
                *_, terminated, truncated, _ = env.step(message)
            except ValueError:
                refused.append(1)
                continue
            times.append(time.perf_counter() - start)
            if terminated or truncated or stop.is_set():
                break


def attacked(target, instances, seconds):
    """The honest clients' step times for `seconds`, without the attacker, with it, and with a
    fifth honest client in its place (the control: what any fifth client costs them): {label:
    (median step s, steps)}, and the attacker's refused messages."""
    table, refused = {}, []
    for label in ("without", "with", "with a fifth honest client instead of"):
        stop, times, spent = threading.Event(), [], []  # spent: the fifth client's own steps
        envs = [target(c) for c in range(HONEST + (label != "without"))]
        threads = [threading.Thread(target=stepping, args=(
            env, c, instances, stop, spent if c == HONEST else times, refused,
            ATTACK if c == HONEST and label == "with" else None)) for c, env in enumerate(envs)]
        for t in threads:
            t.start()
        time.sleep(seconds)
        stop.set()
        for t in threads:
            t.join()
        for env in envs:
            env.close()
        table[label] = (statistics.median(times) if times else float("nan"), len(times))
    return table, len(refused)


def print_medians(counts, rates):
    """Each count's median episodes/s over the rounds, and its ratio to the first count's."""
    medians = {count: statistics.median(rates[count]) for count in counts}
    print(f"\nMedians over {len(rates[counts[0]])} rounds:\n")
    print("| sessions | median episodes/s | vs first | rounds' episodes/s |")
    print("|---:|---:|---:|---|")
    for count in counts:
        print(f"| {count} | {medians[count]:.2f} | {medians[count] / medians[counts[0]]:.1f}x | "
              + ", ".join(f"{r:.2f}" for r in rates[count]) + " |")


def main(argv=None):
    from lab import cli
    ap = argparse.ArgumentParser(prog="python -m lab.bench_sessions", description=__doc__,
                                 formatter_class=cli.HelpFormatter)
    ap.add_argument("--persuadee", default="random:tiny-qwen3", help="the one persuadee every "
                    "session shares: random:NAME, smollm2 or a model folder")
    ap.add_argument("--over", choices=("inprocess", "loopback"), default="inprocess",
                    help="the sessions as PersuasionEnvs in this process, or as OpenEnv clients "
                         "of the server on loopback")
    ap.add_argument("--sessions", default=",".join(map(str, SESSIONS)),
                    help="the counts of concurrent sessions timed, comma-separated")
    ap.add_argument("--repeats", type=int, default=REPEATS,
                    help="episodes each session plays a count")
    ap.add_argument("--rounds", type=int, default=ROUNDS, help="play the counts this many times, "
                    "in order then reversed, alternately (a machine whose speed drifts then weighs "
                    "on every count alike); a second table gives each count's median")
    ap.add_argument("--t-max", type=int, default=T_MAX, help="the turn budget of an episode")
    ap.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS,
                    help="the persuadee's reply and the scripted persuader's message, in tokens")
    ap.add_argument("--kv-blocks", type=int, help="the persuadee's KV pool in blocks (default: "
                    "the engine's)")
    ap.add_argument("--scenarios", default="heldout", help="train, heldout or a scenarios.jsonl")
    ap.add_argument("--instances", type=int, default=INSTANCES, help="distinct instances played")
    ap.add_argument("--attacker", type=float, metavar="S", help="the attacker table: S seconds "
                    "of honest steps without, then with, one client sending ATTACK")
    args = ap.parse_args(argv)
    args.sessions = [int(n) for n in args.sessions.split(",")]
    if min(args.sessions) < 1 or min(args.repeats, args.instances, args.rounds) < 1:
        ap.error("--sessions are positive counts, --repeats, --instances and --rounds at least 1")
    if max(args.sessions) > SESSIONS_MAX:  # a thread, an env and a session each
        ap.error(f"--sessions at most {SESSIONS_MAX} each, got {max(args.sessions)}")
    if args.attacker is not None and not 0 < args.attacker <= 3600:
        ap.error(f"--attacker takes seconds in (0, 3600], got {args.attacker}")
    from lab.env import load_instances
    loaded = load_instances(args.scenarios)
    instances = [i["id"] for i in loaded][:args.instances]
    steps, proc = [], None
    if args.over == "inprocess":
        target, steps = inprocess_hub(args, loaded)
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = start_server(args, port)
        from lab.env_server import ServerSession
        target = lambda c: ServerSession(f"http://127.0.0.1:{port}", who="bench_sessions.py")
    try:
        timed(target, 1, 1, instances)  # warm-up
        if args.attacker:
            table, refused = attacked(target, instances, args.attacker)
            print(f"| {HONEST} honest sessions | median step (s) | steps in {args.attacker:g} s |")
            print("|---|---:|---:|")
            for label, (median, n) in table.items():
                print(f"| {label} the attacker | {median:.3f} | {n} |")
            print(f"\nthe attacker's messages refused: {refused}")
            return table
        rates = play_counts(args, target, steps, instances)
        if args.rounds > 1:
            print_medians(args.sessions, rates)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
