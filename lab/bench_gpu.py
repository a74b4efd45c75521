"""
lab/bench_gpu.py: the GPU check (python -m lab.bench --gpu-check), one command for a lent GPU.

One rank of the paper preset on one GPU (BENCHMARKS.md, "The GPU check", says how to carry the
tokenizer to a machine without network), random weights of the paper's shapes in bf16: a
Qwen3-4B-shaped persuader and a Qwen3-14B-shaped persuadee (also the judge; CHECK_MODELS),
engines sized by plan.py's memory plan for 8 ranks (16 episodes a rank), and
  warm-up     every batch bucket of each engine under each sampling it uses, so that every CUDA
              graph is captured before timing (capture seconds reported apart)
  rollout     2 instances x G 8, T_max 6, 256 new tokens, the paper's sampling (persuader T 1;
              persuadee T 0.7, top-p 0.8, top-k 20; judge greedy); a stop set of 1/STOP_SHARE of
              the vocabulary ends messages at varied lengths, so batches shrink as in a real
              run: tokens/s, each engine's decode step against its weight + KV floor, the probe
              share of the persuadee's reply time, capture seconds inside the timed run (0)
  graphs      the same sampled generate with CUDA graphs and eagerly at the same extent (the
              window's capacity tier): token ids and log-probs bit-equal; and eagerly at the live
              length (attending over fewer columns: rounding, not a bug): max |delta log-prob|
  memory      torch.cuda.max_memory_allocated against the plan's figures for what this process
              holds (rollout copy, persuadee, both KV pools and decode memories)
  kernels     aten ops a decode layer issues on the GPU's code path (decode_layer_ops); the
              persuadee's decode step with lab.kernels' fused kernels and with the composites
              (ms a step, max |delta log-prob|), each kernel's max difference from its composite
Targets: decode step <= 1.5x the weight + live-KV floor, probe share <= 5%, peak within 10% of the
plan, graphs bit-equal to eager at the same extent, <= 12 kernels a decode layer.

    PYTHONPATH=. python -m lab.bench --gpu-check --json                      # on the GPU (minutes)
    PYTHONPATH=. python -m lab.bench --gpu-check --device cpu --check-models tiny-llama,tiny-qwen3 \
        --check-turns 2 --check-new-tokens 16                           # the script's logic, here
"""
import time

import torch

from persuarena import engine
from persuarena import layers
from persuarena import models
from persuarena import probes
from persuarena import rollout
from lab import bench_workload as workload, cli, fastpath, gguf, kernels

H200 = dict(bandwidth=4.8e12, sms=132, registers=65536, chunk_s=0.7e-6, kernel_gap_s=1e-6)
# --decode-model's machine: HBM bytes/s, SMs, registers an SM, seconds one chunk's dependent loads
# and sums take in one program (about a DRAM latency), seconds between two kernels in a graph
ATTENTION_REGISTERS = {False: 159, True: 206}  # a thread of the Triton attention at 32-key
# chunks, unsplit and split (ptxas -v, sm_90, bf16, Qwen3-14B's heads; tests/test_kernels.py)
DECODE_MODEL_SHAPES = ("qwen3-4b", "qwen3-14b")
DECODE_MODEL_BATCHES = (1, 4, 16)
DECODE_MODEL_CONTEXTS = (512, 1024, 2048, 4096)
STOP_SHARE = 128    # --gpu-check: one token id in this many ends a message (mean length ~128)
CHECK_MODELS = "qwen3-4b,qwen3-14b"  # --gpu-check: persuader and persuadee shapes


VIEW_OPS = ("view", "_unsafe_view", "slice", "select", "t", "transpose", "permute", "expand",
            "unsqueeze", "squeeze", "split", "as_strided", "alias", "detach", "reshape")


def decode_layer_ops(shape="tiny-qwen3", sampling=rollout.FROZEN_SAMPLING):
    """Aten operations one decode layer issues on the GPU's code path (the fast path's
    DecodeBatch step, which engine.COMPUTE_BOUND_DEVICES does not touch; bf16, which no CPU
    weight packing takes), counted on this machine with a TorchDispatchMode over one step of
    models of `shape` with 2 and 3 layers: (ops that run a kernel, of which the names, all ops
    with views, the step's ops outside the layers). F.rms_norm counts as one (CUDA's fused
    kernel; a CPU runs its ~8-op decomposition), and so does each of lab.kernels' operators
    (one Triton kernel each on CUDA; the dispatch mode sees the operator, not the composite a
    CPU runs inside it): RoPE with the q/k norms and the store into the decode copy, the
    attention, silu * up. With lab.fastpath.FUSED_KERNELS off, the composites' ops are counted
    (the attention's six: on a CPU in bf16 bmm, a cast to float32, add, softmax, a cast, bmm)."""
    import collections

    from torch.utils._python_dispatch import TorchDispatchMode

    from torch.overrides import TorchFunctionMode

    class Count(TorchDispatchMode):  # a custom op counts as one: what runs inside it is unseen
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if self.inside:
                return func(*args, **(kwargs or {}))
            self.ops[func.overloadpacket.__name__] += 1
            self.inside = func.namespace == "persuarena"  # its F.rms_norm calls too (FusedNorm)
            try:
                return func(*args, **(kwargs or {}))
            finally:
                self.inside = False

    class FusedNorm(TorchFunctionMode):  # F.rms_norm: one op, as CUDA's fused kernel runs it
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func not in (torch.nn.functional.rms_norm, torch.rms_norm) or counter.inside:
                return func(*args, **(kwargs or {}))
            counter.ops["rms_norm"] += 1
            counter.inside = True
            try:
                return func(*args, **(kwargs or {}))
            finally:
                counter.inside = False
    step = fastpath.DecodeBatch.step
    counts, counter = {}, None

    def counted(self, extent, sampling):
        nonlocal counter
        counter = Count()
        counter.ops, counter.inside = collections.Counter(), False
        with FusedNorm(), counter:
            out = step(self, extent, sampling)
        counts.setdefault(len(self.engine.w["layers"]), counter.ops)
        return out
    fastpath.DecodeBatch.step = counted
    try:
        for n_layers in (2, 3):
            model, tok = models.random_model(shape, torch.bfloat16, num_hidden_layers=n_layers)
            eng = engine.Engine(model, tok, block_size=16, num_blocks=64, fast_path=True)
            eng.w = layers.fused_weights(model)  # the GPU's products: unpacked (mm, addmm_)
            eng.generate([eng.new(list(range(10, 40))) for _ in range(4)], 2, sampling,
                         [1, 2, 3, 4], [])
    finally:
        fastpath.DecodeBatch.step = step
    layer = counts[3] - counts[2]
    issued = {k: n for k, n in layer.items() if k not in VIEW_OPS}
    outside = sum(counts[2].values()) - 2 * sum(layer.values())
    return sum(issued.values()), issued, sum(layer.values()), outside


def max_logp_difference(a, b):
    """Max |log-prob difference| of two generate outputs over each sequence's tokens up to where
    their ids first differ (after that they sample different things)."""
    delta = 0.0
    for (ids_a, lps_a, _), (ids_b, lps_b, _) in zip(a, b):
        for x, y, lx, ly in zip(ids_a, ids_b, lps_a, lps_b):
            delta = max(delta, abs(lx - ly))
            if x != y:
                break
    return delta


def smollm2_tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(gguf.smollm2_path())


def warm_up(engine_samplings, rows, gpu):
    """Every decode bucket up to `rows` rows under every sampling each engine will use, its CUDA
    graphs captured here rather than in the timed run."""
    for eng, samplings in engine_samplings:
        for bucket in sorted({fastpath.batch_bucket(n) for n in range(1, rows + 1)}):
            for sampling in samplings:
                sids = [eng.new(list(range(10, 40))) for _ in range(bucket)]
                eng.generate(sids, fastpath.SYNC_EVERY + 1, sampling, list(range(bucket)), [])
                for sid in sids:
                    eng.free(sid)
                batch = eng.fast.decode_batches.get(bucket)
                for tier in batch.tiers if batch is not None and gpu else ():
                    batch.live.zero_()  # every row inert: a replay writes scratch only
                    batch.replay(sampling, tier)  # captured here, not in the timed run


def timed_check_rollout(persuader, persuadee, targs, samplings, sync, gpu):
    """The paper preset's rollout of one rank, timed: (records, wall seconds, per model id
    [decode seconds, steps, KV tokens], persuadee reply and probe seconds, peak bytes)."""
    persuader_sampling, persuadee_sampling = samplings
    steps = {id(persuader.model): {}, id(persuadee.model): {}}  # model -> bucket -> [s, n, kv]
    run_steps, read = fastpath.DecodeBatch.run, probes.read_engine
    st = dict(reply=0.0, probe=0.0)

    def timed_run(batch, running, keys, n, sampling):
        t = time.perf_counter()
        out = run_steps(batch, running, keys, n, sampling)  # ends in one read-back: synced
        s = steps[id(batch.engine.model)].setdefault(len(batch.tokens), [0.0, 0, 0])
        s[0] += time.perf_counter() - t
        s[1] += n
        s[2] += n * sum(batch.engine.cached(x) for x in running)
        return out

    def timed_read(eng, sids, **kw):
        t = time.perf_counter()
        try:
            return read(eng, sids, **kw)
        finally:
            st["probe"] += time.perf_counter() - t
    persuadee_generate = persuadee.generate

    def timed_generate(*a, **k):
        t = time.perf_counter()
        out = persuadee_generate(*a, **k)
        sync()
        st["reply"] += time.perf_counter() - t
        return out
    fastpath.DecodeBatch.run, probes.read_engine, persuadee.generate = timed_run, timed_read, timed_generate
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    try:
        t = time.perf_counter()
        with workload.timed_decode_parts(st, (persuader, persuadee), sync):
            records = rollout.rollout_episodes(
                persuader, persuadee, workload.pick_instances(targs.instances // 8), targs.t_max,
                group_size=targs.group_size, seed=1, persuader_sampling=persuader_sampling,
                persuadee_sampling=persuadee_sampling, max_new_tokens=targs.max_new_tokens,
                judge=persuadee)
        sync()
        wall = time.perf_counter() - t
    finally:
        fastpath.DecodeBatch.run, probes.read_engine = run_steps, read
        del persuadee.generate
    peak = torch.cuda.max_memory_allocated() if gpu else 0
    return records, wall, steps, st, peak


def graphs_against_eager(persuadee, sampling, rows):
    """The same sampled calls on fresh sequences, the same keys, with CUDA graphs, eager at the
    graph's extent (the capacity tier) and eager at the live length: (graph tokens, tokens that
    differ from eager tier, whether its log-probs match too, max |delta log-prob| against live)."""
    prompts = [[(97 * i + 13 * j) % 40000 + 10 for j in range(1500 + 37 * i)] for i in range(rows)]
    runs = {}
    for name, graphs, extent in (("graph", True, "live"), ("eager tier", False, "tier"),
                                 ("eager live", False, "live")):
        persuadee.fast.cuda_graphs, persuadee.fast.decode_extent = graphs, extent
        sids = [persuadee.new(p) for p in prompts]
        runs[name] = persuadee.generate(sids, 64, sampling, list(range(rows)), [])
        for sid in sids:
            persuadee.free(sid)
    persuadee.fast.cuda_graphs = persuadee.fast.decode_extent = None  # the constants again
    tokens = {name: [ids for ids, _, _ in out] for name, out in runs.items()}
    differ = sum(a != b for x, y in zip(tokens["graph"], tokens["eager tier"])
                 for a, b in zip(x, y))
    same_logps = all(a[:2] == b[:2] for a, b in zip(runs["graph"], runs["eager tier"]))
    return tokens["graph"], differ, same_logps, max_logp_difference(runs["graph"], runs["eager live"])


def fused_against_composite(eng, sampling, rows, sync):
    """One engine's decode with lab.kernels' custom ops (Triton on CUDA) and with the composites:
    ms a step each (64 steps of `rows` rows after prompts of ~1000 tokens, the second of two runs
    timed), max |delta log-prob| over the tokens both sampled alike, and each Triton kernel's
    largest difference from its composite (kernels.max_differences; None without Triton)."""
    prompts = [[(89 * i + 7 * j) % 40000 + 10 for j in range(1000 + 29 * i)] for i in range(rows)]
    out, runs = {}, {}
    for fused in (True, False):
        eng.fast.fused_kernels = fused
        for _ in range(2):  # the first captures the graphs (and compiles the kernels)
            parents = [eng.new(p) for p in prompts]
            eng.forward(parents)
            sids = [eng.fork(s, [7, 8]) for s in parents]
            sync()
            start = time.perf_counter()
            runs[fused] = eng.generate(sids, 64, sampling, list(range(rows)), [])
            sync()
            seconds = time.perf_counter() - start
            for sid in sids + parents:
                eng.free(sid)
        out[f"decode_step_ms_fused_{'on' if fused else 'off'}"] = 1e3 * seconds / 64
    eng.fast.fused_kernels = None  # the constant again
    out["fused_max_abs_dlogp"] = max_logp_difference(runs[True], runs[False])
    out["fused_kernel_max_diff"] = kernels.max_differences(eng.device)
    return out


def print_gpu_check(out, shapes, device, records, generated, bandwidth):
    """The GPU check's figures (gpu_check's dict), as lines."""
    print(f"gpu check: {shapes[0]} persuader, {shapes[1]} persuadee (judge), bf16 on {device}")
    print(f"warm-up {out['warmup_s']:.1f} s, of which CUDA-graph capture {out['capture_s']:.1f} s; "
          f"capture in the timed run {out['capture_in_timed_run_s']:.2f} s")
    print(f"rollout: {len(records)} episodes x {out['turns']} turns, {generated} persuader tokens, "
          f"{out['wall_s']:.1f} s ({out['tok_s']:.1f} persuader tok/s), probe share "
          f"{out['probe_share']:.3f}")
    for name in ("persuader", "persuadee"):
        print(f"{name} decode step {out[f'{name}_decode_step_ms']:.2f} ms against a floor of "
              f"{out[f'{name}_floor_ms']:.2f} ms (weights + KV at {bandwidth / 1e9:.0f} GB/s); "
              f"buckets {out[f'{name}_decode_buckets']}")
        for bucket, b in out.get(f"{name}_buckets", {}).items():
            print(f"  bucket {bucket:>3}: {b['step_ms']:.2f} ms a step, floor {b['floor_ms']:.2f} "
                  f"ms ({b['over_floor']:.2f}x; target <= 1.5x), {b['steps']} steps")
    print(f"DecodeBatch.begin {out['begin_ms']:.2f} ms a call ({out['begin_calls']} calls); "
          f"sampler {out['sample_ms']:.2f} ms a call outside graphs ({out['sample_calls']} calls)")
    print(f"graphs vs eager at the same extent (the capacity tier): {out['graph_tokens_differ']} of "
          f"{out['graph_tokens']} sampled tokens differ, bit-equal tokens and log-probs: "
          f"{out['graph_bit_equal']}; against eager at the live length: max |delta log-prob| "
          f"{out['live_max_abs_dlogp']:.2e} over the tokens both sampled alike")
    print(f"decode layer: {out['decode_layer_kernels']} kernels (aten ops of tiny-qwen3 on the GPU "
          "path, counted on the CPU; target <= 12)")
    print(f"persuadee decode step with the fused kernels {out['decode_step_ms_fused_on']:.2f} ms, "
          f"with the composites {out['decode_step_ms_fused_off']:.2f} ms; max |delta log-prob| "
          f"{out['fused_max_abs_dlogp']:.2e}; each kernel's max |difference| from its composite: "
          f"{out['fused_kernel_max_diff']}")
    print(f"peak memory {out['peak_gib']:.2f} GiB against the plan's {out['planned_gib']:.2f} GiB")


def planned_rollout_bytes(rank_plan):
    """What a rank's memory plan says the rollout holds: the rollout copy, the persuadee and each
    engine's KV pool, decode memory and attention transient (what gpu_check's peak measures)."""
    held = ("rollout copy", "actor KV pool", "actor decode memory", "actor attention transient",
            "persuadee bfloat16", "persuadee KV pool", "persuadee decode memory",
            "persuadee attention transient")
    return sum(n for name, n in rank_plan["items"] if name.startswith(held))


def step_figures(name, eng, per_bucket, bandwidth):
    """One engine's decode step against its weight + KV floor, over all its steps and for each
    batch bucket (per_bucket: bucket -> [seconds, steps, KV tokens read]), as flat figures."""
    weights = sum(p.numel() for p in eng.model.parameters()) * 2  # bf16
    floor = lambda n, kv: weights / bandwidth + kv / max(n, 1) * eng.token_bytes / bandwidth
    out = {f"{name}_buckets": {bucket: dict(step_ms=1e3 * s / max(n, 1), floor_ms=1e3 * floor(n, kv),
                                            steps=n, over_floor=s / max(n, 1) / floor(n, kv))
                               for bucket, (s, n, kv) in sorted(per_bucket.items())}}
    seconds, n, kv = (sum(v[i] for v in per_bucket.values()) for i in range(3))
    out.update({f"{name}_decode_step_ms": 1e3 * seconds / max(n, 1),
                f"{name}_floor_ms": 1e3 * floor(n, kv),
                f"{name}_decode_buckets": sorted(eng.fast.decode_batches)})
    return out


def gpu_check(args):
    """One rank of the paper preset at the paper's shapes, measured as the module docstring says.
    Returns the figures as a dict."""
    import tempfile
    from lab import plan
    from persuarena import train
    gpu = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    shapes = args.check_models.split(",")
    targs = cli.train_args(["--preset", "paper", "--persuader", f"random:{shapes[0]}",
                             "--persuadee", f"random:{shapes[1]}", "--dtype", "bfloat16",
                             "--out", tempfile.mkdtemp(), "--plan"], train)
    targs.t_max = args.check_turns or targs.t_max
    targs.max_new_tokens = args.check_new_tokens or targs.max_new_tokens
    rank_plan = plan.memory_plan(targs, 8, plan.PLAN_NODE[1], True)
    tok = smollm2_tokenizer()
    persuader_model, persuadee_model = (
        models.random_model(shape, torch.bfloat16, args.device, seed=seed, tokenizer=tok)[0]
        for shape, seed in zip(shapes, (1, 2)))
    persuader = engine.Engine(persuader_model, tok, **rank_plan["sizes"]["persuader"])
    persuadee = engine.Engine(persuadee_model, tok, **rank_plan["sizes"]["persuadee"])
    persuader_sampling, persuadee_sampling = rollout.SAMPLING["paper"]
    for eng in (persuader, persuadee):
        eng.stop_ids = list(range(7, eng.model.config.vocab_size, STOP_SHARE))
    rows = targs.instances // 8 * targs.group_size

    t = time.perf_counter()
    warm_up([(persuader, [persuader_sampling]),
             (persuadee, [persuadee_sampling, engine.GREEDY, rollout.JUDGE_RETRY_SAMPLING])], rows, gpu)
    sync()
    warm_s = time.perf_counter() - t
    capture_s = persuader.fast.graph_capture_s + persuadee.fast.graph_capture_s
    print(f"warm-up done in {warm_s:.1f} s", flush=True)
    records, wall, steps, st, peak = timed_check_rollout(
        persuader, persuadee, targs, (persuader_sampling, persuadee_sampling), sync, gpu)
    print(f"rollout done in {wall:.1f} s", flush=True)
    generated = sum(sum(1 for t in r.turn_ids if t) for r in records)
    graph_tokens, differ, same_logps, live_delta = graphs_against_eager(persuadee, persuadee_sampling,
                                                                        rows)

    fused = fused_against_composite(persuadee, persuadee_sampling, rows, sync)
    bandwidth, _ = workload.machine(persuadee_model, args.device, torch.bfloat16, sync)
    out = dict(tok_s=generated / wall, wall_s=wall, warmup_s=warm_s, capture_s=capture_s,
               capture_in_timed_run_s=(persuader.fast.graph_capture_s + persuadee.fast.graph_capture_s
                                       - capture_s),
               probe_share=st["probe"] / max(st["reply"], 1e-9), turns=max(r.turns for r in records),
               graph_tokens_differ=differ, graph_tokens=sum(map(len, graph_tokens)),
               graph_bit_equal=differ == 0 and same_logps, live_max_abs_dlogp=live_delta,
               decode_layer_kernels=decode_layer_ops()[0],
               bandwidth_gb_s=bandwidth / 1e9, **fused)
    for name, eng in (("persuader", persuader), ("persuadee", persuadee)):
        out.update(step_figures(name, eng, steps[id(eng.model)], bandwidth))
    out.update(begin_ms=1e3 * st["begin_s"] / max(st["begin_n"], 1), begin_calls=st["begin_n"],
               sample_ms=1e3 * st["sample_s"] / max(st["sample_n"], 1), sample_calls=st["sample_n"])
    planned = planned_rollout_bytes(rank_plan)
    out.update(peak_gib=peak / 2**30, planned_gib=planned / 2**30,
               peak_over_plan=peak / planned if gpu else None)
    print_gpu_check(out, shapes, args.device, records, generated, bandwidth)
    return out



# -----------------------------------------------------------------------------
# the modelled decode on an H200 (python -m lab.bench --decode-model): no GPU needed


def attention_seconds(rows, heads, kv_heads, head_dim, context, span, machine=None, itemsize=2):
    """Modelled seconds of one layer's Triton decode attention (lab.kernels) on `machine` (H200):
    programs = rows x heads x spans (span None: one span a row, the unsplit kernel); as many run
    at once as the registers allow (ATTENTION_REGISTERS a thread, 4 warps a program), in waves.
    A program walks its span's chunks of kernels.ATTENTION_BLOCK one after another, chunk_s each
    (its loads wait on memory), so a wave lasts max(chunks x chunk_s, the wave's bytes /
    bandwidth); the bytes are each row's keys and values once (a kv head's query heads run side
    by side and share them through L2) plus the partials; the combine kernel (split only) walks
    the spans the same way. Plus kernel_gap_s a kernel."""
    from lab import kernels
    m = machine or H200
    spans = 1 if span is None else -(-context // span)
    per_span = min(context, span or context)
    resident = m["sms"] * (m["registers"] // (ATTENTION_REGISTERS[spans > 1] * 128))
    programs = rows * heads * spans
    waves = -(-programs // resident)
    kv_bytes = rows * context * 2 * kv_heads * head_dim * itemsize
    part_bytes = programs * (head_dim + 2) * 4 if spans > 1 else 0
    chunks = -(-per_span // kernels.ATTENTION_BLOCK)
    seconds = max(waves * chunks * m["chunk_s"], (kv_bytes + part_bytes) / m["bandwidth"])
    if spans > 1:  # the combine: one program a (row, head), its spans in turn
        seconds += max(spans * m["chunk_s"] / 4, 2 * part_bytes / m["bandwidth"]) + m["kernel_gap_s"]
    return seconds + m["kernel_gap_s"], kv_bytes / m["bandwidth"]


def decode_model(span=None, machine=None):
    """The modelled decode table: for each of DECODE_MODEL_SHAPES (models.random_config, the
    planner's shapes), batch and context, the attention of one layer against its KV floor,
    unsplit and split at `span` keys (default kernels.ATTENTION_SPAN), and the whole step against
    its weight + KV floor with the products at their floor (bf16). Rows of dicts."""
    from lab import kernels, plan
    m, span = machine or H200, span or kernels.ATTENTION_SPAN
    rows = []
    for shape in DECODE_MODEL_SHAPES:
        cfg = models.random_config(shape)
        heads, kv_heads, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        weights_s = plan.parameter_count(cfg) * 2 / m["bandwidth"]
        for batch in DECODE_MODEL_BATCHES:
            for context in DECODE_MODEL_CONTEXTS:
                whole, floor = attention_seconds(batch, heads, kv_heads, D, context, None, m)
                split, _ = attention_seconds(batch, heads, kv_heads, D, context, span, m)
                layers_n = cfg.num_hidden_layers
                step_floor = weights_s + layers_n * floor
                rows.append(dict(
                    shape=shape, batch=batch, context=context, kv_floor_us=1e6 * floor,
                    unsplit_us=1e6 * whole, split_us=1e6 * split, unsplit_over_floor=whole / floor,
                    split_over_floor=split / floor, step_floor_ms=1e3 * step_floor,
                    step_over_floor=(weights_s + layers_n * split) / step_floor))
    return rows


def print_decode_model(rows):
    """decode_model's rows as the Markdown table BENCHMARKS.md carries."""
    from lab import kernels
    print(f"| shape | batch | context | KV floor us | unsplit us (x floor) | split at "
          f"{kernels.ATTENTION_SPAN} us (x floor) | step floor ms | step x floor |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['shape']} | {r['batch']} | {r['context']} | {r['kv_floor_us']:.1f} | "
              f"{r['unsplit_us']:.1f} ({r['unsplit_over_floor']:.1f}x) | {r['split_us']:.1f} "
              f"({r['split_over_floor']:.1f}x) | {r['step_floor_ms']:.2f} | "
              f"{r['step_over_floor']:.2f}x |")
