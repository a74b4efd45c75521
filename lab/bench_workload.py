"""
lab/bench_workload.py: the rollout workload of lab.bench and the engine's run of it.

Workload (defaults): DIALOGUES dialogues with different personas, the first held-out scenarios of
arena.load_scenarios(split="heldout") taken one per (domain, resistance) cell (then in file order);
TURNS turns, MAX_NEW_TOKENS new tokens a message, greedy, float32 (bfloat16 on a GPU); the three
probes after each persuadee reply plus b_0 before the first message; SmolLM2-135M-Instruct on a CPU.
Every implementation plays the same dialogue logic: arena.Dialogue (a dialogue ends early on a
decision tag, at the same place in all of them), tags stripped by persuadee_sees/persuader_sees,
FINAL_TURN_INSTRUCTION as a system turn after the persuader's message on the final turn.

The engine's run: rollout.rollout_episodes on two engine.Engine (paged KV cache, every token
prefilled once, probes read in forks of the cached context), on the path engine.FAST_PATH selects
(lab/fastpath.py by default; False: the reference), with timers patched around its generate,
forward, free, decode windows and probe reads (run_engine); the machine's floors (machine: a sum
over BANDWIDTH_MB for the memory bandwidth, a [MATMUL_ROWS, hidden] x [hidden, 2 * intermediate]
product for the matmul rate); Table 4's probe read against a judge call (probe_vs_judge).

    PYTHONPATH=. python -m lab.bench --dialogues 2 --turns 1 --max-new-tokens 8   # this workload, short
"""
import time
from contextlib import contextmanager

import torch

from persuarena import arena
from persuarena import engine
from persuarena import models
from persuarena import probes
from persuarena import rollout
from lab import fastpath, gguf

MODEL = "smollm2"
DIALOGUES = 8
TURNS = 3
MAX_NEW_TOKENS = 48
BANDWIDTH_MB = 512  # tensor summed for the memory bandwidth (beyond any cache)
MATMUL_ROWS = 512   # tokens in the prefill matmul probe


def load(args, dtype):
    if not args.random_init:
        return models.load_model(args.model, dtype, args.device)
    from transformers import AutoTokenizer  # a random model of a paper size, SmolLM2's tokenizer
    tok = AutoTokenizer.from_pretrained(gguf.smollm2_path())
    return models.random_model(args.random_init, dtype, args.device, tokenizer=tok)


def pick_instances(n):
    """The first held-out scenarios, one per (domain, resistance) cell, then the rest in order."""
    seen, first, rest = set(), [], []
    for s in arena.load_scenarios(split="heldout"):
        cell = (s["domain"], s["hidden"]["resistance"])
        (rest if cell in seen else first).append(s)
        seen.add(cell)
    return (first + rest)[:n]


def best_time(fn, sync, reps=5):
    times = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return min(times)


def alternated(items, rounds):
    """The items, `rounds` passes over them, in order then reversed, alternately: a machine whose
    speed drifts over the passes weighs on every item alike."""
    for r in range(rounds):
        yield from items if r % 2 == 0 else items[::-1]


def machine(model, device, dtype, sync):
    """Memory bandwidth (bytes/s) and matmul rate (FLOP/s) of this device, in the model's dtype."""
    x = torch.ones(BANDWIDTH_MB * 2**20 // 4, device=device)
    bandwidth = x.numel() * 4 / best_time(x.sum, sync)
    cfg = model.config
    a = torch.randn(MATMUL_ROWS, cfg.hidden_size, device=device, dtype=dtype)
    b = torch.randn(cfg.hidden_size, 2 * cfg.intermediate_size, device=device, dtype=dtype)
    return bandwidth, 2 * a.shape[0] * a.shape[1] * b.shape[1] / best_time(lambda: a @ b, sync)


def add(st, **kw):
    for k, v in kw.items():
        st[k] += v


def touch_memory(eng):
    """The engine's KV pool and decode memory written once (zeros) before it is timed: fresh pages
    cost their first touch (the pool comes from calloc'd memory, the decode memory is made on
    first use), a cost an engine kept across steps pays once, as vLLM's start-up pays its own
    KV cache's."""
    eng.cache.kv.zero_()
    if eng.fast is not None:
        eng.fast.decode_memory_views(1)
        eng.fast.decode_memory.zero_()


def time_engine(eng, st, is_persuadee, sync):
    """Patch timers and counters into `st` around one engine's generate, forward, free and threads
    (instance attributes: deleting them restores the class methods)."""
    generate, forward, free = eng.generate, eng.forward, eng.free

    def timed_generate(sids, *a, **k):
        st["started"], t = True, time.perf_counter()
        label = "persuadee reply" if is_persuadee else "persuader message"
        with torch.profiler.record_function(label):
            outs = generate(sids, *a, **k)
        add(st, reply=(time.perf_counter() - t) * is_persuadee, gen=sum(len(o[0]) for o in outs))
        return outs

    def timed_forward(sids, *args):
        n, kv = [len(eng.pending[s]) for s in sids], sum(eng.length(s) for s in sids)
        t = time.perf_counter()
        out = forward(sids, *args)
        sync()
        if max(n) == 1:  # a decode step
            add(st, dec_t=time.perf_counter() - t, dec_n=1, dec_b=len(sids), dec_kv=kv)
        else:
            add(st, pre_t=time.perf_counter() - t, pre_tok=sum(n))
        return out

    def counted_free(sid):
        if st["started"] and not st["in_probe"]:  # a conversation, not a root or a probe fork
            st["unique"] += eng.cache.lengths[sid]
        free(sid)

    @contextmanager
    def counted_threads():  # the torch threads each forward and decode window ran on
        with threads():
            st["threads"].append(torch.get_num_threads())
            yield
    threads = eng.threads
    eng.generate, eng.forward, eng.free, eng.threads = (timed_generate, timed_forward, counted_free,
                                                        counted_threads)


def run_engine(model, tok, instances, turns, max_new, sync, sdpa_backends=None):
    """rollout.rollout_episodes with timers around the persuadee's generate, every forward and
    probes.read_engine (patched on the engine instances and the module, restored afterwards);
    the engines' attention on sdpa_backends (default layers.SDPA_BACKENDS)."""
    persuader, persuadee = (engine.Engine(model, tok, sdpa_backends=sdpa_backends),
                            engine.Engine(model, tok, sdpa_backends=sdpa_backends))
    for eng in (persuader, persuadee):
        touch_memory(eng)
    st = dict(reply=0.0, probe=0.0, probe_tokens=0, gen=0, unique=0, dec_t=0.0, dec_n=0, dec_b=0,
              dec_kv=0, pre_t=0.0, pre_tok=0, in_probe=False, started=False, threads=[])
    read = probes.read_engine

    def timed_read(eng, sids, **kw):
        st["in_probe"], n0, t = True, eng.tokens_prefilled, time.perf_counter()
        try:
            with torch.profiler.record_function("probe read"):
                return read(eng, sids, **kw)
        finally:
            add(st, probe=time.perf_counter() - t, probe_tokens=eng.tokens_prefilled - n0)
            st["in_probe"] = False
    run_steps = fastpath.DecodeBatch.run

    def timed_run(batch, running, keys, steps, sampling):
        t = time.perf_counter()
        out = run_steps(batch, running, keys, steps, sampling)  # ends in one read-back: synced
        add(st, dec_t=time.perf_counter() - t, dec_n=steps, dec_b=steps * len(running),
            dec_kv=steps * sum(batch.engine.cached(s) for s in running))
        return out
    time_engine(persuader, st, False, sync)
    time_engine(persuadee, st, True, sync)
    probes.read_engine = timed_read
    fastpath.DecodeBatch.run = timed_run
    try:
        t0 = time.perf_counter()
        with timed_decode_parts(st, (persuader, persuadee), sync):
            eps = rollout.rollout_episodes(persuader, persuadee, instances, t_max=turns,
                                           persuader_sampling=engine.GREEDY,
                                           persuadee_sampling=engine.GREEDY, max_new_tokens=max_new)
        st["wall"] = time.perf_counter() - t0
    finally:
        probes.read_engine = read
        fastpath.DecodeBatch.run = run_steps
        for eng in (persuader, persuadee):  # back to the class methods (breaks the closure cycles)
            del eng.generate, eng.forward, eng.free, eng.threads
    st["graph_capture_s"] = sum(e.fast.graph_capture_s for e in (persuader, persuadee) if e.fast)
    st["conv"] = persuader.tokens_prefilled + persuadee.tokens_prefilled - st["probe_tokens"]
    st["twice"] = st["conv"] - st["unique"]
    st["dialogues"] = [[m["text"] for m in e.transcript] for e in eps]
    st["probes"] = [e.probes for e in eps]
    return st



@contextmanager
def timed_decode_parts(st, engines, sync):
    """Timers on DecodeBatch.begin (bringing a batch's dense copy up to date) and on the engines'
    fast-path sampler, each call synced: st's begin_s, begin_n, sample_s, sample_n. A sampler
    inside a CUDA graph runs in its replay, unseen: on a GPU these are the eager steps' and
    captures' calls only."""
    begin = fastpath.DecodeBatch.begin
    st.update(begin_s=0.0, begin_n=0, sample_s=0.0, sample_n=0)

    def timed(fn, key):
        def call(*args, **kwargs):
            sync()
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            sync()
            add(st, **{f"{key}_s": time.perf_counter() - t, f"{key}_n": 1})
            return out
        return call
    fastpath.DecodeBatch.begin = timed(begin, "begin")
    fasts = [e.fast for e in engines if e.fast is not None]
    samplers = [f.sample for f in fasts]
    for f in fasts:
        f.sample = timed(f.sample, "sample")
    try:
        yield
    finally:
        fastpath.DecodeBatch.begin = begin
        for f, sample in zip(fasts, samplers):
            f.sample = sample


def first_mismatch(tok, a, b):
    """(dialogue, message, token index) of the first difference between two sets of dialogues."""
    for i, (da, db) in enumerate(zip(a, b)):
        for m in range(max(len(da), len(db))):
            if m >= len(da) or m >= len(db):
                return i, m, 0
            ta, tb = models.encode(tok, da[m]), models.encode(tok, db[m])
            if ta != tb:
                return i, m, next((k for k, (x, y) in enumerate(zip(ta, tb)) if x != y),
                                  min(len(ta), len(tb)))
    return None


@contextmanager
def profiled(trace, gpu):
    """Under --profile: torch.profiler around the engine's run; prints the three labelled ranges
    (persuader message, persuadee reply, probe read) and the operations that cost most."""
    if not trace:
        yield
        return
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if gpu else [])
    with torch.profiler.profile(activities=activities) as prof:
        yield
    rows = prof.key_averages()
    key = "device_time_total" if gpu else "cpu_time_total"
    for r in rows:
        if r.key in ("persuader message", "persuadee reply", "probe read"):
            print(f"{r.key:18s} x{r.count:3d}  cpu {r.cpu_time_total / 1e6:8.2f} s"
                  + (f"  device {r.device_time_total / 1e6:8.2f} s" if gpu else ""))
    print(rows.table(sort_by=f"self_{key}", row_limit=20))
    prof.export_chrome_trace(trace)


def probe_vs_judge(model, tok, instances, turns, max_new, sync):
    """Table 4's comparison: reading the three probes in forks of the persuadee's cached context
    against an equal-sized judge call on the same persuadee model, after the same dialogues. The
    judge call reads the transcript in a fresh context (the strategy judge's prompt,
    arena.judge_messages: nothing cached) and answers with as many greedy tokens as there are
    probes, one per question; both are batched over the dialogues. Best of 3 each."""
    persuader, persuadee = engine.Engine(model, tok), engine.Engine(model, tok)
    eps = rollout.rollout_episodes(persuader, persuadee, instances, t_max=turns,
                                   persuader_sampling=engine.GREEDY,
                                   persuadee_sampling=engine.GREEDY, max_new_tokens=max_new)
    contexts, prompts = [], []
    for inst, ep in zip(instances, eps):
        messages = arena.persuadee_messages(inst) + [
            {"role": "user" if m["role"] == "persuader" else "assistant", "content": m["text"]}
            for m in ep.transcript]
        contexts.append(models.chat_ids(tok, messages, False))
        prompts.append(models.chat_ids(tok, arena.judge_messages(inst, ep.transcript), True))
    sids = [persuadee.new(ids) for ids in contexts]
    persuadee.forward(sids)  # the persuadee's contexts, cached as in a rollout

    def judge_call():
        js = [persuadee.new(ids) for ids in prompts]
        persuadee.generate(js, max_new_tokens=len(probes.PROBES), sampling=engine.GREEDY, stop_ids=())
        for j in js:
            persuadee.free(j)
    probe_s = best_time(lambda: probes.read_engine(persuadee, sids), sync, reps=3)
    judge_s = best_time(judge_call, sync, reps=3)
    for sid in sids:
        persuadee.free(sid)
    return dict(probe_read_s=probe_s, judge_call_s=judge_s, probe_over_judge=probe_s / judge_s,
                dialogues=len(instances), context_tokens=sum(map(len, contexts)) / len(contexts),
                judge_prompt_tokens=sum(map(len, prompts)) / len(prompts))
