"""Warm processes for tests: `python SCRIPT ARGS`, `python -m MODULE ARGS`, `python -c CODE ARGS`
and torchrun-style ranks, started by a multiprocessing forkserver that has imported torch,
transformers' tiny model classes and the method already (one forkserver per pytest worker, started
on first use). A process then starts in ~0.3 CPU-s instead of the ~8 a fresh interpreter pays for
those imports, which was the largest share of the suite's time. Each process gets the argv,
environment, folder and import path a fresh one would (not the pytest worker's), its own stdout
and stderr, runs its atexit handlers and exits with the code a fresh one would. Not for tests of
what a fresh interpreter imports; ranks get torchrun's environment, not torchrun itself
(DECISIONS.md: Test workers). Tests: tests/test_warm.py.

    proc = warm.popen(["train.py", "--preset", "tiny"], env)   # a subprocess.Popen's interface
    out = warm.ranks(["train.py", ...], env).communicate(timeout=600)[0]
"""
import atexit
import multiprocessing
import os
import runpy
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTEST_PATHS = {str(ROOT), str(ROOT / "tests")}  # on the worker's import path (pytest.ini's
# pythonpath, the rootdir conftest), not on a fresh interpreter's: the package is installed
PRELOAD = ["torch", "torch.distributed", "transformers.models.llama.modeling_llama",
           "transformers.models.qwen3.modeling_qwen3", "persuarena.train", "persuarena.eval"]
_context = None


def context():
    """This worker's forkserver context, its preload set before the server starts."""
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _run(argv, env, cwd, out, err):
    """In the forked child: what `python *argv` would do, in env and cwd, printing to out and err
    (out a pipe's end, a file's path or None for /dev/null; err None: to out)."""
    out_fd = (out.fileno() if hasattr(out, "fileno") else
              os.open(out or os.devnull, os.O_WRONLY | os.O_CREAT | os.O_APPEND))
    os.dup2(out_fd, 1)
    os.dup2(err.fileno() if err is not None else out_fd, 2)
    for pipe in (out, err):
        if hasattr(pipe, "close"):
            pipe.close()
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[:] = ([p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p] +
                   [p for p in sys.path if p not in PYTEST_PATHS])
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path.insert(0, str(cwd))
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        elif argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path.insert(0, str(cwd))
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path.insert(0, str(Path(cwd, argv[0]).resolve().parent))
            runpy.run_path(argv[0], run_name="__main__")
    finally:
        atexit._run_exitfuncs()  # a fresh interpreter's exit runs them; multiprocessing's does not


class WarmProcess:
    """One warm process with the part of subprocess.Popen's interface the tests use: stdout a pipe,
    subprocess.DEVNULL or a file's path (appended to), stderr its own pipe or stdout's
    (subprocess.STDOUT)."""

    def __init__(self, argv, env=None, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE):
        ctx = context()
        out = ctx.Pipe(duplex=False) if stdout == subprocess.PIPE else None
        err = None if stderr == subprocess.STDOUT else ctx.Pipe(duplex=False)
        env = dict(os.environ if env is None else env)
        path = str(stdout) if isinstance(stdout, (str, Path)) else None
        self.process = ctx.Process(target=_run, args=([str(a) for a in argv], env, str(cwd),
                                                      out[1] if out else path, err and err[1]))
        self.process.start()
        self.stdout, self.stderr = (self._reader(p) for p in (out, err))
        self.pid = self.process.pid

    @staticmethod
    def _reader(pipe):
        """Our end of a pipe as a text file (None for none), the child's end closed here."""
        if pipe is None:
            return None
        read, write = pipe
        write.close()
        stream = os.fdopen(os.dup(read.fileno()), "r", errors="replace")
        read.close()
        return stream

    @property
    def returncode(self):
        return self.process.exitcode

    def poll(self):
        return self.process.exitcode

    def wait(self, timeout=None):
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired("warm process", timeout)
        return self.process.exitcode

    def send_signal(self, sig):
        if self.process.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self):
        self.process.kill()

    def terminate(self):
        self.process.terminate()

    def communicate(self, timeout=None):
        """(stdout, stderr) it printed, once it has exited (TimeoutExpired after timeout s)."""
        streams = {name: getattr(self, name) for name in ("stdout", "stderr") if getattr(self, name)}
        texts = {}
        readers = [threading.Thread(target=lambda n=n, f=f: texts.update({n: f.read()}), daemon=True)
                   for n, f in streams.items()]
        deadline = None if timeout is None else time.time() + timeout
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.time()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired("warm process", timeout)
        self.wait(None if deadline is None else max(1.0, deadline - time.time()))
        for stream in streams.values():
            stream.close()
        return texts.get("stdout"), texts.get("stderr")


def popen(argv, env=None, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE):
    """`python *argv` (a script, -m MODULE or -c CODE) in env (os.environ by default) and cwd,
    started warm."""
    return WarmProcess(argv, env, cwd, stdout, stderr)


def free_port():
    """A port free on 127.0.0.1 now (the OS's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ranks:
    """`torchrun --nproc_per_node N --standalone *argv`, warm: the ranks get torchrun's
    environment (RANK, LOCAL_RANK, WORLD_SIZE, the rendezvous on a free port, one thread each); when
    one fails the others are killed, as torchrun does. communicate() gives their output joined."""

    def __init__(self, argv, env=None, n=2, cwd=ROOT):
        base = dict(os.environ if env is None else env, MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(free_port()), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n),
                    OMP_NUM_THREADS="1")
        self.procs = [WarmProcess(argv, dict(base, RANK=str(r), LOCAL_RANK=str(r)), cwd,
                                  stderr=subprocess.STDOUT) for r in range(n)]
        self.failed = None  # the first failing rank's exit code, once one has failed
        self.outputs = [[] for _ in self.procs]
        self.readers = [threading.Thread(target=lambda p=p, o=o: o.append(p.stdout.read()),
                                         daemon=True) for p, o in zip(self.procs, self.outputs)]
        for reader in self.readers:
            reader.start()

    @property
    def returncode(self):
        """The first failing rank's code (as torchrun reports it; fixed once seen, so the
        others' kill does not replace it), 0 when all exited 0, None while any runs."""
        if self.failed is None:
            codes = [p.poll() for p in self.procs]
            self.failed = next((c for c in codes if c not in (None, 0)), None)
            if self.failed is None:
                return None if None in codes else 0
        return self.failed

    def communicate(self, timeout=None):
        deadline = None if timeout is None else time.time() + timeout
        while self.returncode is None:
            if deadline is not None and time.time() > deadline:
                self.kill()
                raise subprocess.TimeoutExpired("warm ranks", timeout)
            time.sleep(0.05)
        if self.returncode != 0:
            self.kill()
        for p, reader in zip(self.procs, self.readers):
            p.wait(30)
            reader.join(30)
        return "".join(o[0] if o else "" for o in self.outputs), None

    def kill(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()


def ranks(argv, env=None, n=2, cwd=ROOT):
    """torchrun --nproc_per_node n --standalone *argv, started warm (see Ranks)."""
    return Ranks(argv, env, n, cwd)
