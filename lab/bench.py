"""
bench.py: the persuasion rollout workload on the paged engine against the inference engines a
researcher would otherwise use: Hugging Face generate and generate_batch.

The modules of the bench, each its own concept:
  lab/bench_workload.py   the workload (dialogues, turns, tokens, probes) and the engine's timed run
  lab/bench_baselines.py  Hugging Face generate and generate_batch on the same contexts' ids
  lab/bench_gpu.py        the GPU check (--gpu-check) and the modelled decode on an H200
  lab/bench_load.py       the comparison again beside busy processes (--load N)
  lab/bench_snr.py        the signal to noise of the dense reward (--snr PRESET)
Each implementation runs in this process on one model object, warmed up on a tiny run first
(the engine's KV pool and decode memory written once before it is timed, as vLLM's start-up
writes its KV cache: bench_workload.touch_memory); this file compares them (comparison_figures,
print_comparison).

Metrics:
  tok/s            sampled message tokens of both sides (a stop token counted once) / wall time of
                   the whole dialogue loop (prefill, decode and probes)
  probe_share      time in probe reads / time generating persuadee replies
  prefilled_twice  tokens run through the model - probe question tokens - unique conversation
                   tokens, where a conversation's unique tokens are the longest prefix of it that
                   any forward held (engine: cache.lengths of each conversation sequence when it is
                   freed; probe tokens: Engine.tokens_prefilled counted inside probes.read_engine).
                   Padding is not counted. For the engine it is 0 when nothing is prefilled twice.
  greedy_match     every message of the engine's dialogues equals hf generate's; with identical
                   contexts the probe values agree too, and their largest difference is printed.
                   (Re-templating the message texts instead, as a first version of this baseline
                   did, changes the contexts wherever a sampled message is not its text's own
                   encoding, and the dialogues then drift apart on near-ties.)
  floors           decode step >= bytes of the layers and lm_head / memory bandwidth (a sum over a
                   big tensor; the KV reads of the step are added in a second figure), and
                   >= 2 * (params + lm_head) * rows / matmul rate (a CPU's products at batch 8
                   and more are bound by their flops, not their bytes): its roofline is the larger;
                   prefill >= 2 * params * tokens / matmul rate ([512, hidden] x [hidden,
                   2 * intermediate], i.e. [512, 576] x [576, 3072] for SmolLM2); params = the
                   decoder layers' weights (the lm_head only runs on last tokens). The engine's
                   decode step and prefill rate are its forward calls (sampling excluded).

    PYTHONPATH=. python -m lab.bench                                           # full workload (minutes)
    PYTHONPATH=. python -m lab.bench --dialogues 2 --turns 1 --max-new-tokens 8  # quick check
    PYTHONPATH=. python -m lab.bench --load 2       # again beside 2 busy processes (one a core)
    PYTHONPATH=. python -m lab.bench --device cuda --random-init qwen3-4b --json  # GPU, 4B random model
    PYTHONPATH=. python -m lab.bench --skip-baselines --profile trace.json   # where the engine's time goes
    PYTHONPATH=. python -m lab.bench --probe-vs-judge --dialogues 4 --turns 2   # Table 4: probe vs judge call
    PYTHONPATH=. python -m lab.bench --device cuda --random-init qwen3-4b --skip-baselines --cudnn-attention
    PYTHONPATH=. python -m lab.bench --gpu-check --json                      # on a GPU (lab/bench_gpu.py)
    PYTHONPATH=. python -m lab.bench --decode-model                          # the modelled H200 decode
    PYTHONPATH=. python -m lab.bench --snr tiny                              # lab/bench_snr.py
"""
import json
import os
import sys

import torch

from persuarena import engine
from persuarena import layers
from persuarena import models
from persuarena import rollout
from lab import (bench_baselines as baselines, bench_gpu as gpu_bench, bench_load as load_runs,
                 bench_snr as snr, bench_vllm as vllm, bench_workload as workload, cli,
                 cpu_products, presets)

def parse_args(argv=None):
    p = cli.new_parser("python -m lab.bench", __doc__)
    p.add_argument("--model", default=workload.MODEL, help="the model of both sides of the workload")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the engine and the baselines run")
    p.add_argument("--dtype", default=None, help="float32 (default on cpu) or bfloat16 (on gpu)")
    p.add_argument("--dialogues", type=int, default=workload.DIALOGUES,
                   help="dialogues played at once")
    p.add_argument("--turns", type=int, default=workload.TURNS, help="turns of each dialogue")
    p.add_argument("--max-new-tokens", type=int, default=workload.MAX_NEW_TOKENS,
                   help="tokens of each message")
    p.add_argument("--load", type=int, default=0, metavar="N", help="time the comparison again "
                   "with N busy-loop processes running beside it (one a core: a loaded machine; at most "
                   "the machine's cores)")
    p.add_argument("--skip-baselines", action="store_true",
                   help="time the engine only (no Hugging Face generate / generate_batch)")
    p.add_argument("--random-init", choices=sorted(models.RANDOM_CONFIGS), default=None,
                   help="random weights of this shape instead of --model's (no download)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--probe-vs-judge", action="store_true", help="only time a probe read against an "
                   "equal-sized judge call on the same persuadee after the dialogues (Table 4)")
    p.add_argument("--profile", metavar="TRACE", help="profile the engine's run: print the operations "
                   "inside probe reads and persuadee replies, write a chrome trace to TRACE; "
                   "with --vllm-python, vLLM's worker under cProfile too (TRACE.vllm.pstats)")
    p.add_argument("--cudnn-attention", action="store_true", help="let the engine's SDPA calls use "
                   "cuDNN too (layers.SDPA_BACKENDS leaves it out), to measure what that costs")
    p.add_argument("--vllm-python", default=vllm.VLLM_PYTHON, metavar="PATH", help="the Python of "
                   "vLLM's own environment: runs the workload through vLLM too (lab/bench_vllm.py)")
    p.add_argument("--vllm-pairs", type=int, default=vllm.PAIRS, metavar="N", help="with "
                   "--vllm-python: N timed runs of each side on one vLLM worker, alternated "
                   "engine-first and vLLM-first; speedup_vs_vllm is the median of the pairs' ratios")
    p.add_argument("--gpu-check", action="store_true", help="the GPU check (lab/bench_gpu.py)")
    p.add_argument("--decode-model", action="store_true", help="print the modelled decode attention "
                   "on an H200 against its KV floor (bench_gpu.decode_model; no GPU needed)")
    p.add_argument("--check-models", default=gpu_bench.CHECK_MODELS,
                   help="--gpu-check's persuader and persuadee RANDOM_CONFIGS shapes")
    p.add_argument("--check-turns", type=int, default=None,
                   help="--gpu-check's turns (default: the paper preset's T_max)")
    p.add_argument("--check-new-tokens", type=int, default=None,
                   help="--gpu-check's new tokens a message (default: the paper preset's)")
    args = p.parse_args(argv)
    for flag in ("dialogues", "turns", "max_new_tokens"):
        if getattr(args, flag) < 1:
            p.exit(2, f"lab.bench: --{flag.replace('_', '-')} {getattr(args, flag)} must be at "
                      f"least 1; pass a positive number, e.g. --{flag.replace('_', '-')} 2\n")
    if args.load < 0:
        p.exit(2, f"lab.bench: --load {args.load} is negative; pass 0 (a quiet run only) or the "
                  "busy processes to run beside it, e.g. --load 2\n")
    cores = os.cpu_count() or 1
    if args.load > cores:  # one busy process a core: more only starts processes to no purpose
        p.exit(2, f"lab.bench: --load {args.load} is more than this machine's {cores} cores; pass "
                  f"at most one busy process a core, e.g. --load {cores}\n")
    if args.vllm_pairs < 1 or (args.vllm_pairs > 1 and not args.vllm_python):
        p.exit(2, f"lab.bench: --vllm-pairs {args.vllm_pairs} needs a count of at least 1 and, "
                  "above 1, --vllm-python; pass e.g. --vllm-python PATH --vllm-pairs 3\n")
    vllm.vllm_problem(args)
    return args



def run_implementations(args, model, tok, instances, sync, gpu, with_vllm=True):
    """(unless --skip-baselines) transformers' generate and generate_batch on the dialogues, then
    the engine's, alone or, with --vllm-python (unless with_vllm is False), in --vllm-pairs pairs
    with vLLM's on one worker (bench_vllm.paired_runs); each after a one-turn warm-up, a baseline
    on the cores free at its start (engine.cpu_threads: not the process's threads, set at the
    bench's start, when a process that was ending may have held a core). Returns
    their dicts by name (a later pair's as "engine (pair 2)", ...), with tok_s, the probe share
    and the machine's one-minute load average before and after added, and the pairs [(engine,
    vLLM)] (none without vLLM). A failing baseline is reported and left out."""
    backends = ([torch.nn.attention.SDPBackend.CUDNN_ATTENTION, *layers.SDPA_BACKENDS]
                if args.cudnn_attention else None)
    engine_run = lambda *a: workload.run_engine(*a, sdpa_backends=backends)
    impls = {} if args.skip_baselines else {
        "hf generate": baselines.run_hf,
        "hf generate_batch": lambda *a: baselines.run_hf(*a, batch_api=True)}
    res, pairs = {}, []
    for name, fn in impls.items():
        try:  # on the cores free at its start, as vLLM's worker and each engine window
            with engine.cpu_threads(args.device):
                res[name] = warmed_run(args, model, tok, instances, sync, fn)
        except Exception as e:  # a failing baseline is reported, not given a number
            print(f"{name} failed: {type(e).__name__}: {e}")
    if with_vllm and args.vllm_python:
        pairs = paired_runs(args, model, tok, instances, sync, engine_run, gpu)
        for i, (ours, theirs) in enumerate(pairs):  # the first pair is the comparison's own
            suffix = "" if i == 0 else f" (pair {i + 1})"
            res.update({"engine" + suffix: ours, "vllm" + suffix: theirs})
    else:
        res["engine"] = warmed_run(args, model, tok, instances, sync, engine_run,
                                   profile=args.profile, gpu=gpu)
    for r in res.values():
        r["tok_s"], r["share"] = r["gen"] / r["wall"], r["probe"] / max(r["reply"], 1e-9)
    return res, pairs


def warmed_run(args, model, tok, instances, sync, run, profile=None, gpu=False):
    """run(model, tok, instances, turns, max_new, sync) after a one-turn warm-up, profiled under
    `profile` (workload.profiled), with the one-minute load average before and after added."""
    run(model, tok, instances[:1], 1, 2, sync)
    load = os.getloadavg()[0]
    with workload.profiled(profile, gpu):
        out = run(model, tok, instances, args.turns, args.max_new_tokens, sync)
    return out | dict(load_before=load, load_after=os.getloadavg()[0])


def paired_runs(args, model, tok, instances, sync, engine_run, gpu):
    """The engine and vLLM alternated on one worker (bench_vllm.paired_runs), each engine run
    warmed up (warmed_run); under --profile the first one profiled."""
    runs = []

    def engine_side():
        runs.append(warmed_run(args, model, tok, instances, sync, engine_run,
                               profile=None if runs else args.profile, gpu=gpu))
        return runs[-1]
    return vllm.paired_runs(args, model, tok, instances, sync, engine_side)


def decode_floors(params, itemsize, kv_bytes, rows, bandwidth, flops):
    """A decode step's floors in seconds: (its weights read once, its weights and the rows' keys and
    values read once, its products' flops: 2 * params a row) at `bandwidth` bytes/s and `flops`
    FLOP/s. The step's roofline is the larger of the last two."""
    weights = params * itemsize / bandwidth
    return weights, weights + kv_bytes / bandwidth, 2 * params * rows / flops


def comparison_figures(args, model, tok, dtype, res, bandwidth, flops, instances, pairs=()):
    """The engine's run against the baselines' (res: run_engine's and run_hf's dicts by name),
    vLLM's (pairs: run_implementations') and the machine's floors (bandwidth bytes/s, flops
    FLOP/s), as one flat dict."""
    e, hf, cb = res["engine"], res.get("hf generate"), res.get("hf generate_batch")
    cfg, n_dec = model.config, max(e["dec_n"], 1)
    layer_params = sum(q.numel() for q in model.model.layers.parameters())
    kv_bytes = (e["dec_kv"] / n_dec * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads
                * (getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
                * dtype.itemsize)
    decode_floor, decode_floor_kv, decode_floor_flops = decode_floors(
        layer_params + model.lm_head.weight.numel(), dtype.itemsize, kv_bytes,
        e["dec_b"] / n_dec, bandwidth, flops)
    mismatch = workload.first_mismatch(tok, e["dialogues"], hf["dialogues"]) if hf else None
    out = dict(
        engine_tok_s=e["tok_s"], hf_generate_tok_s=hf and hf["tok_s"],
        hf_generate_batch_tok_s=cb and cb["tok_s"],
        speedup_vs_generate=hf and e["tok_s"] / hf["tok_s"],
        speedup_vs_generate_batch=cb and e["tok_s"] / cb["tok_s"],
        probe_share=e["share"], probe_share_generate=hf and hf["share"],
        probe_share_generate_batch=cb and cb["share"], prefilled_twice=e["twice"],
        prefilled_twice_generate=hf and hf["twice"],
        greedy_match=hf and mismatch is None, first_mismatch=mismatch,
        probe_max_diff_generate=hf and max(abs(x - y) for a, b in zip(e["probes"], hf["probes"])
                                           for pa, pb in zip(a, b) for x, y in zip(pa, pb)),
        decode_step_ms=1e3 * e["dec_t"] / n_dec, decode_floor_ms=1e3 * decode_floor,
        decode_floor_kv_ms=1e3 * decode_floor_kv, decode_floor_flops_ms=1e3 * decode_floor_flops,
        decode_roofline_ms=1e3 * max(decode_floor_kv, decode_floor_flops),
        decode_batch=e["dec_b"] / n_dec, prefill_tok_s=e["pre_tok"] / e["pre_t"],
        prefill_floor_tok_s=flops / (2 * layer_params), bandwidth_gb_s=bandwidth / 1e9,
        matmul_gflop_s=flops / 1e9, device=args.device, dtype=str(dtype).split(".")[-1],
        model=args.random_init or args.model, dialogues=len(instances), turns=args.turns,
        max_new_tokens=args.max_new_tokens, graph_capture_s=e["graph_capture_s"],
        engine_threads=[min(e["threads"], default=0), max(e["threads"], default=0)],
        engine_threads_mean=sum(e["threads"]) / max(len(e["threads"]), 1),
        load_before=e["load_before"], load_after=e["load_after"],
        begin_ms=1e3 * e["begin_s"] / max(e["begin_n"], 1), begin_calls=e["begin_n"],
        sample_ms=1e3 * e["sample_s"] / max(e["sample_n"], 1), sample_calls=e["sample_n"],
        cpu_bf16_units=presets.bf16_units(), onednn_bf16=cpu_products.onednn_bf16())
    return out | vllm.figures(tok, e, res.get("vllm"), pairs)


def print_comparison(args, out, res, names, prompt_lengths, cfg, gpu):
    """The comparison's figures (comparison_figures' dict, res by implementation), as lines."""
    persuader_len, persuadee_len = prompt_lengths
    mismatch, hf, cb = out["first_mismatch"], res.get("hf generate"), res.get("hf generate_batch")
    print(f"workload: {out['dialogues']} dialogues x {args.turns} turns, {args.max_new_tokens} new "
          f"tokens, greedy, {out['dtype']} on {args.device}, {out['model']}; mean prompt tokens: "
          f"persuader system+opening {sum(persuader_len) / len(persuader_len):.0f}, persuadee system "
          f"{sum(persuadee_len) / len(persuadee_len):.0f}; {torch.get_num_threads()} torch threads")
    print(f"machine: memory {out['bandwidth_gb_s']:.1f} GB/s, matmul {out['matmul_gflop_s']:.0f} "
          f"GFLOP/s [{workload.MATMUL_ROWS}, {cfg.hidden_size}] x [{cfg.hidden_size}, "
          f"{2 * cfg.intermediate_size}]")
    print(f"{'implementation':<18}{'wall s':>8}{'msg tok':>9}{'tok/s':>8}{'reply s':>9}"
          f"{'probe s':>9}{'probe/reply':>12}{'conv prefill':>14}{'prefilled twice':>17}"
          f"{'threads':>9}{'load (1 min)':>14}")
    for k, r in res.items():
        threads = f"{min(r['threads'], default=0)}-{max(r['threads'], default=0)}"
        print(f"{k:<18}{r['wall']:>8.1f}{r['gen']:>9}{r['tok_s']:>8.1f}{r['reply']:>9.1f}"
              f"{r['probe']:>9.1f}{r['share']:>12.2f}{r['conv']:>14}{r['twice']:>17}"
              f"{threads:>9}{r['load_before']:>8.1f} -> {r['load_after']:.1f}")
    if hf:
        print(f"speedup: {out['speedup_vs_generate']:.2f}x vs hf generate" + (
            f", {out['speedup_vs_generate_batch']:.2f}x vs hf generate_batch" if cb else ""))
        where = "dialogue {}, message {}, token {}".format(*mismatch) if mismatch else "none"
        print(f"greedy_match: {out['greedy_match']} (first mismatch: {where}); probe values "
              f"max |engine - hf generate| = {out['probe_max_diff_generate']:.2e}")
    print(f"engine decode step {out['decode_step_ms']:.1f} ms at batch {out['decode_batch']:.1f} "
          f"(floor {out['decode_roofline_ms']:.1f} ms: the weights {out['decode_floor_ms']:.1f}, "
          f"with the KV reads {out['decode_floor_kv_ms']:.1f}, the products' flops "
          f"{out['decode_floor_flops_ms']:.1f}); prefill {out['prefill_tok_s']:.0f} tok/s (floor "
          f"{out['prefill_floor_tok_s']:.0f} tok/s)" + (
              f"; CUDA graph capture {out['graph_capture_s']:.2f} s" if gpu else ""))
    print(f"engine DecodeBatch.begin {out['begin_ms']:.2f} ms a call ({out['begin_calls']} calls); "
          f"sampler {out['sample_ms']:.2f} ms a step ({out['sample_calls']} eager steps)")
    vllm.print_figures(out)
    print(f"decode layer (tiny-qwen3 on the GPU's code path, aten ops that run a kernel): "
          f"{out['decode_layer_kernels']} (target <= 12): "
          + ", ".join(f"{k} {n}" for k, n in sorted(names.items(), key=lambda kv: -kv[1])))


def main():
    args = parse_args()
    if args.decode_model:
        rows = gpu_bench.decode_model()
        print(json.dumps(rows)) if args.json else gpu_bench.print_decode_model(rows)
        return
    models.set_cpu_threads(args.device)  # one thread per core free now
    if args.gpu_check:
        out = gpu_bench.gpu_check(args)
        if args.json:
            print(json.dumps(out))
        return
    gpu = args.device.startswith("cuda")
    dtype = getattr(torch, args.dtype or ("bfloat16" if gpu else "float32"))
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    if not gpu and dtype == torch.bfloat16 and not presets.bf16_units():
        print("lab.bench: this CPU lists no bf16 product units (lab.presets.bf16_units): its bf16 "
              "products run several times slower than float32 (BENCHMARKS.md: The CPU in bf16)")
    model, tok = workload.load(args, dtype)
    instances = workload.pick_instances(args.dialogues)
    if args.probe_vs_judge:
        r = workload.probe_vs_judge(model, tok, instances, args.turns, args.max_new_tokens, sync)
        print(f"probe read {1e3 * r['probe_read_s']:.1f} ms, judge call {1e3 * r['judge_call_s']:.1f} ms "
              f"({r['probe_over_judge']:.1%}) for {r['dialogues']} dialogues (persuadee context "
              f"{r['context_tokens']:.0f} tokens, judge prompt {r['judge_prompt_tokens']:.0f} tokens)")
        if args.json:
            print(json.dumps(r))
        return
    persuader_len, persuadee_len = zip(*[map(len, rollout.prompt_ids(tok, tok, i)) for i in instances])
    bandwidth, flops = workload.machine(model, args.device, dtype, sync)
    res, pairs = run_implementations(args, model, tok, instances, sync, gpu)
    out = comparison_figures(args, model, tok, dtype, res, bandwidth, flops, instances, pairs)
    out["decode_layer_kernels"], names, _, _ = gpu_bench.decode_layer_ops()
    print_comparison(args, out, res, names, (persuader_len, persuadee_len), model.config, gpu)
    if args.load:  # the same comparison beside --load busy processes
        with load_runs.busy_load(args.load):
            loaded, _ = run_implementations(args, model, tok, instances, sync, gpu,
                                            with_vllm=False)
        figures = comparison_figures(args, model, tok, dtype, loaded, bandwidth, flops, instances)
        out["loaded"] = dict(busy_processes=args.load,
                             **{k: figures[k] for k in load_runs.LOADED_FIGURES})
        load_runs.print_loaded(args, out["loaded"], loaded)
    if args.json:
        print(json.dumps(out))



if __name__ == "__main__":
    snr.snr_main(sys.argv[1:]) if "--snr" in sys.argv else main()
