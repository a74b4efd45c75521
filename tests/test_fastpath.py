"""The engine's fast path (lab/fastpath.py) on its own terms: its decode memory and decode
batches, CUDA graphs and capacity tiers, the GPU's padded SDPA calls (testable on a CPU by
emptying engine.COMPUTE_BOUND_DEVICES), flash-attn, and the one-query decode attention, each
against an independent reference (Hugging Face generate, SDPA, float32 scores, the eager step).
The equivalence tests that run on both paths are in test_engine.py."""
import pytest
import torch
import torch.nn.functional as F

from persuarena import engine
from persuarena import layers
from persuarena import models
from persuarena import rpo
from conftest import tiny_model, token_logprobs
from lab import fastpath, kernels
from test_engine import ARCHS, PROMPTS, hf_greedy, storages


@pytest.mark.skipif(fastpath.flash_attn_with_kvcache is None or not torch.cuda.is_available(),
                    reason="flash-attn and a GPU are needed for the paged flash kernels")
def test_flash_path_matches_sdpa_path():
    model = tiny_model("qwen3").cuda()
    flash = engine.Engine(model, block_size=256, num_blocks=8)
    sdpa = engine.Engine(model, block_size=256, num_blocks=8)
    sdpa.fast.use_flash = False
    outs = []
    for eng in (flash, sdpa):
        sids = [eng.new(p) for p in PROMPTS]
        outs.append(eng.forward(sids))
        for s in sids:
            eng.append(s, [3])
        outs.append(eng.forward(sids))
    torch.testing.assert_close(outs[0], outs[2], atol=1e-3, rtol=0)
    torch.testing.assert_close(outs[1], outs[3], atol=1e-3, rtol=0)


BF16_NEAR_TIE = 0.125  # logits: a greedy pick whose top two are closer than this may swap under
# bf16's rounding (8 mantissa bits: logits of a few units move by ~2^-6 between two kernels' sums)


def first_split_is_a_near_tie(model, prompt, ours, ref, near_tie=BF16_NEAR_TIE):
    """What bf16 can promise of two implementations' greedy continuations of `prompt`: the same
    tokens up to the first place they differ, and there the reference's top two logits (one
    forward of prompt + ref) within near_tie of each other; (promise kept, where they split)."""
    at = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
    if at is None:
        return len(ours) == len(ref), None
    with torch.no_grad():
        seq = torch.tensor([prompt + ref], device=next(model.parameters()).device)
        top = model(seq).logits[0, len(prompt) - 1 + at].float().topk(2).values
    return (top[0] - top[1]).item() < near_tie, at


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bf16_greedy_agrees_with_hf_up_to_its_first_near_tie(arch):
    """On a CPU in bf16 (the dtype a GPU runs): the engine's greedy tokens equal Hugging Face
    generate's up to where the two first differ, and that place is a near-tie of the reference
    (first_split_is_a_near_tie), the promise bf16 allows; the GPU test below makes the same one."""
    model = tiny_model(arch).to(torch.bfloat16)
    ours = engine.generate(model, PROMPTS, 24)
    for prompt, mine in zip(PROMPTS, ours):
        ref = hf_greedy(model, prompt, 24)
        kept, at = first_split_is_a_near_tie(model, prompt, mine, ref)
        assert kept, (prompt, at)
        with torch.no_grad():  # a split where the reference is decided breaks the promise
            top = model(torch.tensor([prompt + ref])).logits[0, len(prompt) - 1:-1].float().topk(2)
        decided = int((top.values[:, 0] - top.values[:, 1]).argmax())
        wrong = ref[:decided] + [top.indices[decided, 1].item()] + ref[decided + 1:]
        assert first_split_is_a_near_tie(model, prompt, wrong, ref) == (False, decided)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_engine_matches_hf_generate(arch, dtype, monkeypatch):
    """The GPU twin of the CPU equivalence test (PyTorch attention path), in float32 (equal
    tokens) and in bf16 (the graph path's dtype: equal up to the first near-tie, what bf16 can
    promise: its norms and residual adds round unlike Hugging Face's, and cuBLAS picks kernels by
    shape) with SDPA limited to flash and memory-efficient kernels, so that a call only MATH
    would run fails here; bf16 log-probs of a sampled generate stay within 1e-2 (mean) of the
    training forward's."""
    from torch.nn.attention import SDPBackend
    monkeypatch.setattr(layers, "SDPA_BACKENDS", [SDPBackend.FLASH_ATTENTION,
                                                  SDPBackend.EFFICIENT_ATTENTION])
    model = tiny_model(arch).to("cuda", dtype)
    calls = record_sdpa(monkeypatch)
    ours = engine.generate(model, PROMPTS, 24)
    assert not [c for c in calls if math_only(c)]
    monkeypatch.undo()
    ref = [model.generate(torch.tensor([p], device="cuda"), max_new_tokens=24, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    if dtype == torch.float32:
        assert ours == ref
    for prompt, mine, theirs in zip(PROMPTS, ours, ref):
        assert first_split_is_a_near_tie(model, prompt, mine, theirs)[0], prompt
    if dtype == torch.bfloat16:
        eng = engine.Engine(model, block_size=16, num_blocks=64)
        outs = eng.generate([eng.new(p) for p in PROMPTS], 16, engine.Sampling(1.0), [1, 2, 3], [])
        for prompt, (ids, logps, _) in zip(PROMPTS, outs):
            seq = torch.tensor([prompt + ids], device="cuda")
            with torch.no_grad():
                train = token_logprobs(model(seq).logits.float(), seq, 1.0)[0, len(prompt) - 1:]
            assert (torch.tensor(logps, device="cuda") - train).abs().mean() < 1e-2


def test_a_reused_decode_copy_holds_nothing_of_before():
    """DecodeBatch's dense copy on a CPU views memory the engine keeps between calls: stale keys
    and values from earlier, longer sequences must not change a later call's tokens."""
    model = tiny_model("llama")
    eng = engine.Engine(model, block_size=4, num_blocks=256)
    long = [eng.new(p * 4) for p in PROMPTS]
    eng.generate(long, 10)
    eng.fast.decode_memory.normal_(0, 30)  # large, finite: what any keys and values could leave
    prompts = [p[:2 + 2 * i] for i, p in enumerate(PROMPTS)]  # shorter rows see stale columns
    ours = [ids for ids, _, _ in eng.generate([eng.new(p) for p in prompts], 10)]
    assert ours == engine.generate(model, prompts, 10)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_second_turn_copies_only_new_tokens_and_matches_hf(arch):
    """Between generate calls a DecodeBatch row keeps its sequence's keys and values and takes
    only the tokens cached since (DecodeBatch.filled); the second turn must equal HF greedy
    decoding of the whole history, and must really have reused the rows."""
    model = tiny_model(arch)
    eng = engine.Engine(model, block_size=4, num_blocks=256)
    sids = [eng.new(p) for p in PROMPTS]
    first = [ids for ids, _, _ in eng.generate(sids, 6, stop_ids=[])]
    heard = [[7, 8, 9], [11], [12, 13, 14, 15, 16]]
    for sid, ids in zip(sids, heard):
        eng.append(sid, ids)
    shape, rows = eng.fast.copy_rows
    held = [n for _, n in rows[:len(sids)]]
    second = [ids for ids, _, _ in eng.generate(sids, 6, stop_ids=[])]
    assert eng.fast.copy_rows[0] == shape and eng.fast.copy_rows[1] is rows  # the same rows, kept
    assert held == [len(p) + 5 for p in PROMPTS]  # what the first call left in the rows
    for p, a, h, b in zip(PROMPTS, first, heard, second):
        assert b == hf_greedy(model, p + a + h, 6)


def test_six_turns_of_shrinking_batches_hold_one_decode_memory(tokenizer):
    """A 6-turn rollout whose messages stop at different lengths (so batches shrink every turn)
    while the contexts grow: each engine holds one decode memory, allocated once, of the stated
    size; every DecodeBatch views it; the batch cache is keyed by bucket alone, each batch at
    its bucket's fixed capacity; and every episode completes."""
    from persuarena import rollout
    from conftest import short_scenario
    decode_bytes = 3 << 20
    er, ee = (engine.Engine(tiny_model(arch, max_position_embeddings=4096), tokenizer,
                            block_size=8, num_blocks=4000, decode_bytes=decode_bytes)
              for arch in ("llama", "qwen3"))
    for eng in (er, ee):  # a sixth of the vocabulary stops a message: lengths vary
        eng.stop_ids = list(range(3, tokenizer.vocab_size, 6))
    memories = {}

    def count_decode_memories(eng):
        fast = eng.fast
        memory = fast.decode_memory.untyped_storage().data_ptr()
        views = {t.untyped_storage().data_ptr() for b in fast.decode_batches.values()
                 for t in (b.keys_t, b.values)}
        assert views == {memory}
        held = [t for holder in (eng, fast, *fast.decode_batches.values())  # every buffer held
                for t in vars(holder).values() if torch.is_tensor(t)]
        known = storages([eng.cache.k, eng.cache.v,
                          *[t for t in fast.gather_buffers if t is not None]])
        big = {ptr for ptr, n in storages(held).items() if n > 256 << 10 and ptr not in known}
        assert big == {memory}  # nothing else of copy size
        memories.setdefault(id(eng), set()).add((id(fast.decode_memory), fast.decode_memory.data_ptr()))
    generate = engine.Engine.generate

    def counted(self, *a, **k):
        out = generate(self, *a, **k)
        count_decode_memories(self)
        return out
    instances = [short_scenario(i) for i in range(1, 3)]
    engine.Engine.generate = counted
    try:
        records = rollout.rollout_episodes(er, ee, instances, 6, group_size=4, seed=1,
                                           max_new_tokens=12,
                                           persuader_sampling=engine.Sampling(1.0),
                                           persuadee_sampling=engine.Sampling(1.0))
    finally:
        engine.Engine.generate = generate
    assert len(records) == 8 and max(r.turns for r in records) == 6
    for eng in (er, ee):
        assert len(memories[id(eng)]) == 1  # one decode memory, never reallocated
        fast = eng.fast
        assert fast.decode_memory.numel() * fast.decode_memory.element_size() == decode_bytes // 4 * 4
        assert set(fast.decode_batches) <= set(fastpath.BATCH_BUCKETS)  # buckets, no capacity
        assert len(fast.decode_batches) > 1  # the batches did shrink
        for bucket, batch in fast.decode_batches.items():
            assert batch.capacity == fast.decode_capacity_for(bucket) and batch.keys_t.shape[1] == bucket


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphs_are_captured_once_survive_a_refresh_and_equal_eager(monkeypatch, dtype):
    """On CUDA, sampled decoding captures each (bucket, sampling, tier) once; after a refresh the
    same calls replay the same graphs (no capture time added) and give the same tokens and
    log-probs, bit-equal to the eager step's at the same extent (the tier); at the live length
    the log-probs differ by rounding only. In float32 and in bf16 (the graph path's dtype)."""
    model = tiny_model("qwen3").to("cuda", dtype)
    sampling = engine.Sampling(0.7, top_p=0.8, top_k=20)
    eng = engine.Engine(model, block_size=4, num_blocks=400)
    run = lambda: [out[:2] for out in eng.generate([eng.new(p) for p in PROMPTS], 16, sampling,
                                                    [1, 2, 3], [])]
    first = run()
    graphs = {b: dict(batch.graphs) for b, batch in eng.fast.decode_batches.items()}
    captured = eng.fast.graph_capture_s
    eng.refresh()
    assert run() == first and eng.fast.graph_capture_s == captured
    assert {b: dict(batch.graphs) for b, batch in eng.fast.decode_batches.items()} == graphs
    monkeypatch.setattr(fastpath, "CUDA_GRAPHS", False)
    monkeypatch.setattr(fastpath, "DECODE_EXTENT", "tier")
    assert run() == first  # token ids and log-probs, bit for bit
    monkeypatch.setattr(fastpath, "DECODE_EXTENT", "live")
    for (ids, logps), (live_ids, live_logps) in zip(first, run()):
        n = next((i for i, (a, b) in enumerate(zip(ids, live_ids)) if a != b), len(ids))
        torch.testing.assert_close(torch.tensor(logps[:n]), torch.tensor(live_logps[:n]),
                                   atol=1e-2 if dtype == torch.bfloat16 else 1e-5, rtol=0)


def record_sdpa(monkeypatch):
    """Every F.scaled_dot_product_attention call from here on, as (query shape, key shape, mask
    or None, is_causal, enable_gqa): the calls a GPU would make once COMPUTE_BOUND_DEVICES is
    emptied."""
    calls, real = [], F.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False):
        calls.append((tuple(q.shape), tuple(k.shape), attn_mask, is_causal, enable_gqa))
        return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                    scale=scale, enable_gqa=enable_gqa)
    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    return calls


def math_only(call):
    """Whether only PyTorch's MATH kernel runs this SDPA call on CUDA: grouped-query heads with a
    mask (flash takes no mask; memory-efficient needs equal head counts), or a causal flag with
    queries != keys (SDPA's is_causal is top-left aligned: a cached prefix gets the wrong mask
    or MATH)."""
    q, k, mask, causal, _ = call
    return (mask is not None and q[1] != k[1]) or (causal and q[2] != k[2])


@pytest.mark.parametrize("budget_mb", [fastpath.ATTENTION_CALL_MB, 0.05])
def test_gpu_path_attention_has_no_math_only_call_and_matches_hf(monkeypatch, budget_mb):
    """On the GPU's code path (COMPUTE_BOUND_DEVICES emptied), on a grouped-query model: every
    SDPA call of a generate (prefill and eager decode) takes equal head counts or no mask, none
    is MATH-only, each call's mask stays within ATTENTION_CALL_MB (a small budget splits the
    forward into calls of whole sequences and windows of one's queries) and greedy outputs
    equal Hugging Face generate."""
    monkeypatch.setattr(engine, "COMPUTE_BOUND_DEVICES", ())
    monkeypatch.setattr(fastpath, "ATTENTION_CALL_MB", budget_mb)
    monkeypatch.setattr(fastpath, "DECODE_COPY_GB", 0)  # every decode step through the Batch too
    model = tiny_model("qwen3")
    assert model.config.num_attention_heads > model.config.num_key_value_heads
    calls = record_sdpa(monkeypatch)
    ours = engine.generate(model, PROMPTS, 12, block_size=16)
    monkeypatch.undo()
    assert len(calls) > 2 * model.config.num_hidden_layers
    assert not [c for c in calls if math_only(c)]
    if budget_mb < 1:
        assert max(c[2].numel() * c[2].element_size() for c in calls) <= budget_mb * 2**20
        assert len({c[0][0] for c in calls}) > 1  # calls of one and of several sequences
        assert max(c[0][2] for c in calls) < 2 * 60  # the 60-token prefill ran in windows
    assert ours == [hf_greedy(model, p, 12) for p in PROMPTS]


def test_a_window_attends_over_its_capacity_tier_not_the_whole_capacity(monkeypatch):
    """On the GPU's code path with DECODE_EXTENT "tier" (what a CUDA graph replays), every decode
    step attends over the smallest capacity tier its window reaches: short contexts in a
    bucket of large capacity read a quarter of it, not all of it; greedy outputs still equal
    Hugging Face generate and sampled log-probs equal the live-length steps' within 1e-5."""
    monkeypatch.setattr(engine, "COMPUTE_BOUND_DEVICES", ())
    model = tiny_model("qwen3")
    extents, step = [], fastpath.DecodeBatch.step

    def recorded(self, extent, sampling):
        extents.append((extent, self.capacity))
        return step(self, extent, sampling)
    monkeypatch.setattr(fastpath.DecodeBatch, "step", recorded)
    sampling = engine.Sampling(0.7, top_p=0.8, top_k=20)
    outs = {}
    for mode in ("live", "tier"):
        monkeypatch.setattr(fastpath, "DECODE_EXTENT", mode)
        eng = engine.Engine(model, block_size=16, num_blocks=400, decode_capacity=1800)
        extents.clear()
        outs[mode] = eng.generate([eng.new(p) for p in PROMPTS], 16, sampling, [1, 2, 3], [])
    assert {c for _, c in extents} == {2048}
    assert fastpath.capacity_tiers(2048) == [512, 1024, 1536, 2048]
    assert {e for e, _ in extents} == {512}  # every step: a quarter of the capacity
    greedy = engine.generate(model, PROMPTS, 16)
    assert [ids for ids, _, _ in outs["tier"]] == [ids for ids, _, _ in outs["live"]]
    for (_, a, _), (_, b, _) in zip(outs["tier"], outs["live"]):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
    assert greedy == [hf_greedy(model, p, 16) for p in PROMPTS]


def test_a_failed_graph_capture_falls_back_to_eager_in_one_warning_line(monkeypatch, capsys):
    """On the GPU's code path with graphs on (forced here: a CPU has no CUDA graphs) and a capture
    that fails: one warning line, once for the engine, and every step runs eagerly with the same
    tokens and log-probs as an engine that never tried; the next call does not try again."""
    monkeypatch.setattr(engine, "COMPUTE_BOUND_DEVICES", ())
    model = tiny_model("qwen3")
    sampling = engine.Sampling(0.7, top_p=0.8, top_k=20)
    run = lambda eng: [o[:2] for o in eng.generate([eng.new(p) for p in PROMPTS], 16, sampling,
                                                  [1, 2, 3], [])]
    eager = run(engine.Engine(model, block_size=16, num_blocks=400))
    tries = []

    def refused(self, sampling, extent):
        tries.append(extent)
        raise RuntimeError("operation not permitted when stream is capturing\nmore detail")
    monkeypatch.setattr(fastpath.DecodeBatch, "capture", refused)
    monkeypatch.setattr(fastpath.DecodeBatch, "uses_graphs",
                        lambda self: not self.fast.capture_failed)
    eng = engine.Engine(model, block_size=16, num_blocks=400)
    capsys.readouterr()
    assert run(eng) == eager and run(eng) == eager
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["warning: lab.fastpath: a CUDA graph capture failed (RuntimeError: operation "
                   "not permitted when stream is capturing); this engine's decode steps run "
                   "eagerly"]
    assert len(tries) == 1 and eng.fast.capture_failed


def test_decode_memory_key_rows_start_aligned():
    """Every transposed key row of a DecodeBatch starts on a 32-byte boundary (cuBLAS reads
    aligned rows), whatever the bucket."""
    model = tiny_model("llama").to(torch.bfloat16)
    eng = engine.Engine(model, block_size=16, num_blocks=64)
    eng.generate([eng.new(p) for p in PROMPTS], 4)
    for batch in eng.fast.decode_batches.values():
        assert batch.keys_t.stride(-2) * batch.keys_t.element_size() % 32 == 0
        assert batch.keys_t.data_ptr() % 32 == 0


def test_decode_attention_matches_sdpa():
    """The two-product grouped-query decode attention equals SDPA with a boolean key mask."""
    torch.manual_seed(0)
    B, H, Hkv, K, D = 3, 6, 2, 11, 8
    q, keys, values = torch.randn(B, H, D), torch.randn(B, Hkv, K, D), torch.randn(B, Hkv, K, D)
    visible = torch.arange(K) < torch.tensor([11, 4, 1])[:, None, None]  # [B, 1, K]
    bias = torch.zeros(B, 1, K).masked_fill(~visible, float("-inf")).repeat_interleave(Hkv, 0)
    ref = F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=visible[:, None],
                                         enable_gqa=True)[:, :, 0]
    torch.testing.assert_close(kernels.decode_attention(q, keys.transpose(2, 3), values, bias), ref)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_decode_scores_in_bfloat16_are_rounded_at_most_once(device):
    """bf16 queries and keys whose scores differ by less than bf16's spacing at their size. On
    CUDA the scores are float32 (cuBLAS writes them from half inputs): the attention equals the
    reference with float32 scores and softmax (then bf16 probabilities, as flash-attn's), far
    closer than scores rounded to bf16 would give. On a CPU the score product is bf16's (float32
    sums, each score rounded once to bf16, no float32 copy of the keys a layer), the softmax
    float32: it equals that reference (DECISIONS.md: The CPU's dtype)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    torch.manual_seed(0)
    B, H, Hkv, K, D = 2, 4, 2, 64, 16
    q = (torch.randn(B, H, D) * 4).bfloat16()
    keys, values = (torch.randn(B, Hkv, K, D) * 4).bfloat16(), torch.randn(B, Hkv, K, D).bfloat16()
    bias = torch.zeros(B * Hkv, 1, K)
    out = kernels.decode_attention(*(t.to(device) for t in (q, keys.transpose(2, 3), values,
                                                              bias))).float().cpu()
    G = H // Hkv
    kq = keys.float().repeat_interleave(G, 1)
    scores = torch.einsum("bhd,bhkd->bhk", q.float(), kq)
    v = values.float().repeat_interleave(G, 1)
    ref = torch.einsum("bhk,bhkd->bhd", (scores / D ** 0.5).softmax(-1).bfloat16().float(), v)
    rounded = torch.einsum("bhk,bhkd->bhd", (scores.bfloat16().float() / D ** 0.5).softmax(-1)
                           .bfloat16().float(), v)
    rounding = (rounded - ref).abs().max()
    if device == "cuda":
        error = (out - ref).abs().max()
        assert error < 0.02 and error < rounding / 4, (error, rounding)
    else:
        error = (out - rounded).abs().max()
        assert error < 0.01 and error < rounding / 2, (error, rounding)


@pytest.mark.parametrize("shape", ["tiny-qwen3", "tiny-llama"])
def test_a_decode_layer_issues_few_kernels_and_no_residual_add(shape, monkeypatch):
    """bench_gpu.decode_layer_ops over the GPU's code path (bf16): at most 12 kernels a layer, each of
    lab.kernels' custom ops (RoPE with the q/k norms and the store into the dense decode copy,
    the attention, silu * up) counted once, the residual adds in the products (addmm_), the
    attention not one SDPA call (that moved a row's rounding with its batch: DECISIONS.md,
    Decode fusion). With the custom ops off, the composites' 24 (Qwen3) and 21 (Llama)."""
    from lab import bench_gpu
    n, names, _, _ = bench_gpu.decode_layer_ops(shape)
    assert n <= 12, names
    assert names["qk_rope_store"] == names["decode_attention"] == names["silu_mul"] == 1, names
    assert names["addmm_"] == 2 and names["rms_norm"] == 2 and names["mm"] == 2, names
    assert not [name for name in names if "scaled_dot_product" in name], names
    monkeypatch.setattr(fastpath, "FUSED_KERNELS", False)
    n, names, _, _ = bench_gpu.decode_layer_ops(shape)
    assert n == {"tiny-qwen3": 24, "tiny-llama": 21}[shape], names
    assert names["index_put_"] == 2 and names["bmm"] + names.get("baddbmm", 0) == 2, names
    assert "decode_attention" not in names


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_row_decodes_bit_equal_beside_a_much_longer_sequence(arch):
    """A sequence's greedy tokens and log-probs, and its probe-ready prefill logits after them,
    are bit-equal alone and beside a longer sequence, which widens every decode step's key extent
    (one SDPA call a layer broke this). Turns of at least 4 tokens: a CPU product of 1-3 rows
    rounds unlike the same rows inside a larger one (as on the base of this test)."""
    eng = engine.Engine(tiny_model(arch), models.tiny_tokenizer())
    g = torch.Generator().manual_seed(1)
    short, long_, short_turn, long_turn = (torch.randint(3, 200, (n,), generator=g).tolist()
                                           for n in (37, 60, 7, 12))

    def run(prompts, turns):
        parents = [eng.new(p) for p in prompts]
        eng.forward(parents)
        sids = [eng.fork(s, t) for s, t in zip(parents, turns)]
        out = eng.generate(sids, 6, stop_ids=[])[0]
        for s in sids:
            eng.append(s, [7])
        logits = eng.forward(sids)[0]
        for s in sids + parents:
            eng.free(s)
        return out, logits
    (alone, alone_logits), (beside, beside_logits) = run([short], [short_turn]), run([short, long_], [short_turn, long_turn])
    assert alone == beside and torch.equal(alone_logits, beside_logits)


@pytest.mark.parametrize("arch,dtype", [("llama", torch.float32), ("qwen3", torch.float32),
                                        ("qwen3", torch.bfloat16)])
def test_a_row_decodes_bit_equal_in_batches_of_any_size(arch, dtype):
    """A sequence's greedy tokens and log-probs over 12 decode steps are bit-equal alone and
    among 2 to 7 other sequences of other lengths (buckets of 2, 4 and 8, padded rows, other
    extents). Eager extents at any length broke it for 3, 5 and 7 (a CPU score product's last
    columns round unlike the same columns in a wider product): fastpath.EXTENT_MULTIPLE. In
    bf16 too (a CPU's bf16 products, packed weights and score products)."""
    eng = engine.Engine(tiny_model(arch).to(dtype), models.tiny_tokenizer())
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (37, 40, 45, 50, 52, 60, 61, 70)]
    turns = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (7, 8, 9, 10, 11, 12, 13, 14)]

    def first_row(k):
        parents = [eng.new(p) for p in prompts[:k]]
        eng.forward(parents)
        sids = [eng.fork(s, t) for s, t in zip(parents, turns[:k])]
        out = eng.generate(sids, 12, stop_ids=[])[0]
        for s in sids + parents:
            eng.free(s)
        return out
    alone = first_row(1)
    assert [k for k in range(2, 9) if first_row(k) != alone] == []


def test_the_bench_refuses_bad_arguments_in_one_line(capsys):
    """lab.bench's counts (--dialogues, --turns, --max-new-tokens, --load) and --snr's (preset,
    --instances, --messages, --resamples) are refused before any model loads, in one line."""
    import argparse

    from lab import bench, bench_snr
    for argv in (["--dialogues", "0"], ["--turns", "-1"], ["--max-new-tokens", "0"],
                 ["--load", "-2"]):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"lab.bench: {argv[0]} {argv[1]}") and "\n" not in err
    good = dict(snr="tiny", instances=2, messages=2, resamples=2, seed=0)
    bench_snr.snr_problem(argparse.Namespace(**good))
    for change in (dict(snr="nope"), dict(instances=-1), dict(instances=0), dict(messages=1),
                   dict(resamples=1), dict(instances=10**6)):
        with pytest.raises(SystemExit) as e:
            bench_snr.snr_problem(argparse.Namespace(**{**good, **change}))
        assert str(e.value).startswith("lab.bench: --") and "\n" not in str(e.value)

