"""lab.bench's modules on a CPU, without vLLM: the vLLM side's client against a stand-in worker
that answers its JSON protocol with the same model (the dialogues and probe values then equal the
Hugging Face baseline's), the --vllm-python check, the worker's stop cut and cache size, and the
modelled decode's floors.

    python -m pytest -q tests/test_bench.py
"""
import argparse
import contextlib
import math

import pytest
import torch

from persuarena import engine
from persuarena import models
from persuarena import probes
from conftest import tiny_model
from lab import bench, bench_baselines, bench_gpu, bench_vllm, bench_workload, kernels, vllm_worker


class ModelWorker:
    """lab/vllm_worker.py's protocol answered by a Hugging Face model in this process: greedy
    generate (cut after the first stop id) and next-token log-probabilities of given ids."""

    def __init__(self, model):
        self.model, self.ready, self.asked = model, dict(threads=1, startup_s=0.0, vllm="none"), []

    @torch.no_grad()
    def ask(self, **request):
        self.asked.append(request)
        if "reset" in request:
            return dict(reset=True, seconds=0.0)
        if "generate" in request:
            outs = [self.model.generate(torch.tensor([p]), max_new_tokens=request["max_new_tokens"],
                                        do_sample=False, pad_token_id=0, eos_token_id=None)
                    [0, len(p):].tolist() for p in request["generate"]]
            return dict(outputs=[vllm_worker.cut(o, set(request["stop"])) for o in outs],
                        cached=[0] * len(outs), seconds=0.25)
        logps = [torch.log_softmax(self.model(torch.tensor([p])).logits[0, -1].float(), -1)
                 [request["token_ids"]].tolist() for p in request["probe"]]
        return dict(logprobs=logps, cached=[0] * len(logps), seconds=0.25)

    def close(self):
        self.closed = True


def test_the_hf_baseline_plays_the_engines_dialogues_through_the_one_loop(tokenizer, monkeypatch,
                                                                         small_engine_memory):
    """run_hf's HistorySides, played by rollout.rollout_episodes as the engine is, give the
    engine's dialogues: the same greedy messages, probe values within 1e-4 (a full forward of
    history + question against a fork of the cached context), an episode ended by a decision
    ended at the same turn; the baseline feeds each history again every turn (twice > 0), the
    engine prefills every conversation token once (twice 0)."""
    from persuarena import arena, rollout
    played = []
    original = rollout.rollout_episodes
    monkeypatch.setattr(rollout, "rollout_episodes", lambda *a, **k: played.append(
        type(a[0]).__name__) or original(*a, **k))
    monkeypatch.setattr(arena, "parse_decision", lambda text: "ACCEPT" if len(text) % 3 == 0
                        else None)  # some dialogues end early, as the decision says
    model = tiny_model("llama", max_position_embeddings=8192)
    instances = bench_workload.pick_instances(3)
    ours = bench_workload.run_engine(model, tokenizer, instances, 2, 6, lambda: None)
    hf = bench_baselines.run_hf(model, tokenizer, instances, 2, 6, lambda: None)
    assert played == ["Engine", "HistorySide"]
    assert hf["dialogues"] == ours["dialogues"] and hf["gen"] == ours["gen"]
    assert sorted({len(d) for d in hf["dialogues"]}) != [4]  # not every dialogue ran to its end
    for a, b in zip(hf["probes"], ours["probes"], strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)
    assert hf["twice"] > 0 and ours["twice"] == 0


def test_vllms_client_plays_the_same_dialogues_as_the_hf_baseline(tokenizer):
    """run_vllm over a stand-in worker backed by the same model: token ids only cross (every
    prompt is one of the dialogue's histories, never text tokenized again), the messages equal
    hf generate's and the probe values agree within bench_vllm.PROBE_TOLERANCE (read from the yes
    and no ids' log-probabilities alone, as vLLM's logprob_token_ids gives them); agreement()
    says so, and a changed message is found. The worker's seconds in vLLM are summed (`inside`)
    and a warm-up's requests say so."""
    model = tiny_model("llama")
    instances = bench_workload.pick_instances(2)
    hf = bench_baselines.run_hf(model, tokenizer, instances, 2, 6, lambda: None)
    worker = ModelWorker(model)
    stop = engine.stop_ids(model, tokenizer)
    ours = bench_vllm.run_vllm(worker, tokenizer, stop, instances, 2, 6)
    assert ours["dialogues"] == hf["dialogues"] and ours["gen"] == hf["gen"]
    assert ours["inside"] == 0.25 * len(worker.asked)  # the worker's seconds in vLLM, summed
    assert not any("warmup" in r for r in worker.asked)
    asked = len(worker.asked)
    bench_vllm.run_vllm(worker, tokenizer, stop, instances[:1], 1, 2, warmup=True)
    assert all(r["warmup"] for r in worker.asked[asked:])  # left out of the worker's --profile
    assert all(isinstance(t, int) for r in worker.asked for p in r.get("generate", r.get("probe"))
               for t in p)
    yes = probes.answer_ids(tokenizer, probes.YES_WORDS)
    assert worker.asked[0]["token_ids"][:len(yes)] == list(yes)
    match, mismatch, diff, within = bench_vllm.agreement(tokenizer, hf, ours)
    assert match and mismatch is None and within and diff <= bench_vllm.PROBE_TOLERANCE
    changed = dict(ours, dialogues=[d[:] for d in ours["dialogues"]])
    changed["dialogues"][1][0] = changed["dialogues"][1][0] + " more"
    assert bench_vllm.agreement(tokenizer, hf, changed)[:2] == (False, (1, 0, len(
        models.encode(tokenizer, hf["dialogues"][1][0]))))


def test_paired_runs_alternate_the_sides_on_one_worker(tokenizer, monkeypatch):
    """--vllm-pairs: one worker started and warmed up once for all pairs, the sides alternated
    engine-first then vLLM-first, the same dialogues every run, and speedup_vs_vllm the median of
    the pairs' ratios (checked against ratios computed here), listed in speedup_vs_vllm_pairs."""
    model = tiny_model("llama")
    instances = bench_workload.pick_instances(1)
    started, order = [], []
    monkeypatch.setattr(bench_vllm, "Worker", lambda *a: started.append(ModelWorker(model))
                        or started[-1])
    monkeypatch.setattr(bench_vllm, "release_memory", lambda: None)
    walls = iter([4.0, 2.0, 3.0, 1.0, 1.0, 5.0])  # in the order run

    def engine_run():
        order.append("engine")
        return dict(bench_baselines.run_hf(model, tokenizer, instances, 1, 4, lambda: None),
                    wall=next(walls))
    run = bench_vllm.vllm_run

    def timed_vllm(*a):
        order.append("vllm")
        return dict(run(*a), wall=next(walls))
    monkeypatch.setattr(bench_vllm, "vllm_run", timed_vllm)
    args = argparse.Namespace(model="none", vllm_python="python", profile=None, vllm_pairs=3,
                              turns=1, max_new_tokens=4)
    pairs = bench_vllm.paired_runs(args, model, tokenizer, instances, lambda: None, engine_run)
    assert len(started) == 1 and order == ["engine", "vllm", "vllm", "engine", "engine", "vllm"]
    asked = started[0].asked
    assert started[0].closed and sum("warmup" in r for r in asked) > 0
    resets = [i for i, r in enumerate(asked) if "reset" in r]  # the cache emptied before each
    assert len(resets) == 3 and all("warmup" in r for r in asked[:resets[0]])  # timed run
    for e, v in pairs:
        e["tok_s"], v["tok_s"] = e["gen"] / e["wall"], v["gen"] / v["wall"]
        e["share"] = v["share"] = 0.0
        assert e["dialogues"] == v["dialogues"] == pairs[0][0]["dialogues"]
    out = bench_vllm.figures(tokenizer, *pairs[0], pairs)
    assert out["speedup_vs_vllm_pairs"] == pytest.approx([2 / 4, 3 / 1, 5 / 1])  # vLLM's wall
    assert out["speedup_vs_vllm"] == pytest.approx(3.0)  # over the engine's: the median, not the mean


def test_vllms_worker_takes_the_cores_free_at_its_start(tokenizer, monkeypatch):
    """The worker's threads are the cores free when it starts, not the process's torch threads
    (set at the bench's start, perhaps beside a process that was ending)."""
    model, started = tiny_model("llama"), []
    monkeypatch.setattr(bench_vllm, "Worker", lambda *a: started.append(a) or ModelWorker(model))
    monkeypatch.setattr(bench_vllm, "release_memory", lambda: None)
    monkeypatch.setattr(bench_vllm, "run_vllm", lambda *a, **k: None)  # no warm-up dialogue
    monkeypatch.setattr(engine, "free_cores", lambda samples=3: 2)
    args = argparse.Namespace(model="none", vllm_python="python", profile=None)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with bench_vllm.started_worker(args, model, tokenizer, []):
            pass
    finally:
        torch.set_num_threads(threads)
    assert [a[2] for a in started] == [2]


def test_with_vllm_the_engine_runs_only_in_the_pairs(monkeypatch):
    """run_implementations with --vllm-python: the engine's runs are the pairs' (a warm-up and a
    timed run each, the first profiled under --profile), none besides; without vLLM one warm-up
    and one timed run; the pairs come back with the rows named for them."""
    calls, profiled = [], []
    monkeypatch.setattr(bench_workload, "run_engine", lambda *a, **k: calls.append(a[3]) or dict(
        gen=4, wall=1.0, probe=0.0, reply=1.0, turns=a[3]))
    monkeypatch.setattr(bench_workload, "profiled", lambda trace, gpu: profiled.append(trace)
                        or contextlib.nullcontext())

    def pairs(args, model, tok, instances, sync, engine_run):
        return [(engine_run(), dict(gen=4, wall=2.0, probe=0.0, reply=1.0))
                for _ in range(args.vllm_pairs)]
    monkeypatch.setattr(bench_vllm, "paired_runs", pairs)
    args = argparse.Namespace(cudnn_attention=False, skip_baselines=True, vllm_python="python",
                              vllm_pairs=2, turns=3, max_new_tokens=4, profile="trace.json")
    res, got = bench.run_implementations(args, None, None, ["i0", "i1"], lambda: None, False)
    assert calls == [1, 3, 1, 3] and profiled == ["trace.json", None]
    assert sorted(res) == ["engine", "engine (pair 2)", "vllm", "vllm (pair 2)"]
    assert [(e["tok_s"], v["tok_s"]) for e, v in got] == [(4.0, 2.0), (4.0, 2.0)]
    calls.clear()
    res, got = bench.run_implementations(args, None, None, ["i0"], lambda: None, False,
                                         with_vllm=False)
    assert calls == [1, 3] and list(res) == ["engine"] and got == []


def test_each_baseline_runs_on_the_cores_free_at_its_start(monkeypatch):
    """A baseline's threads are the cores free when it starts, not the process's threads (set
    at the bench's start, perhaps beside a process that was ending): one core busy at the start
    and none later gives the baselines both cores; the process's threads come back after."""
    seen = []

    def baseline(*a, batch_api=False):
        seen.append(torch.get_num_threads())
        return dict(gen=4, wall=1.0, probe=0.0, reply=1.0, threads=[torch.get_num_threads()])
    monkeypatch.setattr(bench_baselines, "run_hf", baseline)
    monkeypatch.setattr(bench_workload, "run_engine", lambda *a, **k: dict(
        gen=4, wall=1.0, probe=0.0, reply=1.0))
    monkeypatch.setattr(engine, "free_cores", lambda samples=3: 2)
    args = argparse.Namespace(cudnn_attention=False, skip_baselines=False, vllm_python=None,
                              vllm_pairs=1, turns=3, max_new_tokens=4, profile=None, device="cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # what set_cpu_threads chose beside the ending process
    try:
        res, _ = bench.run_implementations(args, None, None, ["i0"], lambda: None, False)
        assert seen == [2, 2, 2, 2] and torch.get_num_threads() == 1
        assert res["hf generate"]["threads"] == res["hf generate_batch"]["threads"] == [2]
    finally:
        torch.set_num_threads(threads)


def test_touching_the_memory_leaves_the_engine_s_tokens_alone():
    """bench_workload.touch_memory writes the pool and the decode memory once (zeros, all of it:
    every page touched) and the engine then samples what a fresh engine does, log-probs included."""
    model = tiny_model("llama")
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]

    def run(touch):
        eng = engine.Engine(model, num_blocks=32, decode_bytes=2**20)
        if touch:  # garbage in both, which the touch must clear
            eng.cache.kv.fill_(float("nan"))
            eng.fast.decode_memory_views(1)
            eng.fast.decode_memory.fill_(float("nan"))
            bench_workload.touch_memory(eng)
            assert not eng.fast.decode_memory.any() and not eng.cache.kv.any()
        sids = [eng.new(p) for p in prompts]
        return eng.generate(sids, 6, engine.GREEDY, [1, 2], stop_ids=[])
    assert run(True) == run(False)


def test_the_bench_refuses_a_bad_vllm_python_in_one_line(tmp_path):
    """--vllm-python must be an executable file, and vLLM needs a model folder (no --random-init):
    one line each, before any model loads."""
    good = argparse.Namespace(vllm_python=None, random_init=None)
    bench_vllm.vllm_problem(good)
    script = tmp_path / "python"
    script.write_text("#!/bin/sh\n")
    for args in (argparse.Namespace(vllm_python=str(tmp_path / "none"), random_init=None),
                 argparse.Namespace(vllm_python=str(tmp_path), random_init=None),
                 argparse.Namespace(vllm_python=str(script), random_init=None)):
        with pytest.raises(SystemExit) as e:
            bench_vllm.vllm_problem(args)
        assert str(e.value).startswith("lab.bench: --vllm-python") and "\n" not in str(e.value)
    script.chmod(0o755)
    bench_vllm.vllm_problem(argparse.Namespace(vllm_python=str(script), random_init=None))
    with pytest.raises(SystemExit, match="random-init"):
        bench_vllm.vllm_problem(argparse.Namespace(vllm_python=str(script), random_init="tiny-llama"))


def test_the_worker_cuts_after_the_first_stop_id():
    assert vllm_worker.cut([5, 6, 2, 7, 2], {2}) == [5, 6, 2]
    assert vllm_worker.cut([5, 6], {2}) == [5, 6]


def test_vllms_kv_cache_holds_what_the_engines_two_pools_hold(monkeypatch):
    """vLLM's cache is its persuader's and persuadee's conversations together: smaller than the
    engine's two pools, it evicts what the engine keeps and prefills it again (its side slower for
    the cache's size, not its engine). vLLM reads the size as a whole number of GiB; the pools'
    size is read when the worker starts (an edited engine.CACHE_GB_CPU follows)."""
    gib = bench_vllm.worker_env(2)["VLLM_CPU_KVCACHE_SPACE"]
    assert gib.isdigit() and int(gib) >= 2 * engine.CACHE_GB_CPU
    monkeypatch.setattr(engine, "CACHE_GB_CPU", 2.5)
    assert bench_vllm.worker_env(2)["VLLM_CPU_KVCACHE_SPACE"] == "5"
    monkeypatch.setattr(bench_vllm, "VLLM_KV_GIB", 1)
    assert bench_vllm.worker_env(2)["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_a_decode_steps_floors_are_its_bytes_and_its_flops():
    """Hand-computed: 1,000 float32 weights and 2,000 bytes of keys and values at 1 MB/s; 8 rows
    of 2 * 1,000 flops at 1 MFLOP/s. The flops floor grows with the rows, the bytes' do not."""
    weights, with_kv, products = bench.decode_floors(1000, 4, 2000, 8, 1e6, 1e6)
    assert (weights, with_kv, products) == pytest.approx((4e-3, 6e-3, 16e-3))
    assert bench.decode_floors(1000, 4, 2000, 1, 1e6, 1e6)[2] == pytest.approx(2e-3)


def test_the_modelled_decode_counts_the_kv_floor_and_the_spans():
    """bench_gpu.attention_seconds: the KV floor is every row's keys and values once over the
    bandwidth (exact); one span unsplit, more past the span; splitting a long context at batch 1
    beats walking it in one program a head; a longer context never models faster."""
    m = bench_gpu.H200
    whole, floor = bench_gpu.attention_seconds(1, 32, 8, 128, 4096, None)
    assert floor == 4096 * 2 * 8 * 128 * 2 / m["bandwidth"]
    chunks = 4096 // kernels.ATTENTION_BLOCK
    assert whole == pytest.approx(chunks * m["chunk_s"] + m["kernel_gap_s"])
    split, _ = bench_gpu.attention_seconds(1, 32, 8, 128, 4096, 256)
    assert split < whole / 4
    times = [bench_gpu.attention_seconds(4, 40, 8, 128, n, 256)[0] for n in (512, 1024, 2048, 4096)]
    assert times == sorted(times)
    rows = bench_gpu.decode_model()
    assert len(rows) == (len(bench_gpu.DECODE_MODEL_SHAPES) * len(bench_gpu.DECODE_MODEL_BATCHES)
                         * len(bench_gpu.DECODE_MODEL_CONTEXTS))
    assert all(math.isfinite(r["step_over_floor"]) and r["step_over_floor"] >= 1 for r in rows)


def test_the_bench_refuses_more_busy_processes_than_cores_before_anything_starts(monkeypatch, capsys):
    """--load N above os.cpu_count() is refused in one line before a model loads or a process
    starts (--load 100000 once took a 2-core machine to a load of 159); N up to the cores passes."""
    import subprocess
    import sys

    from lab import bench

    def started(*a, **k):
        raise AssertionError("something started before --load was checked")
    monkeypatch.setattr(bench.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(subprocess, "Popen", started)
    monkeypatch.setattr(bench_workload, "load", started)
    for n in ("3", "100000"):
        monkeypatch.setattr(sys, "argv", ["lab.bench", "--load", n])
        with pytest.raises(SystemExit) as e:
            bench.main()
        assert e.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err == (f"lab.bench: --load {n} is more than this machine's 2 cores; pass at most "
                       "one busy process a core, e.g. --load 2")
    assert bench.parse_args(["--load", "2"]).load == 2
