"""Engine tests: the paged cache, its forward and keyed sampling against plain Hugging Face
computations, on the reference path and on each attention path of the fast path (the `paths`
fixture), and the two paths against each other. The fast path's own machinery: test_fastpath.py."""
import functools
import os

import pytest
import torch

from persuarena import engine
from persuarena import rpo
from conftest import tiny_model, token_logprobs
from lab import cpu_products, fastpath

ARCHS = ["llama", "qwen3", "qwen2"]
PROMPTS = [[5, 9, 14, 3, 77, 120, 8, 41, 19, 66, 7, 301, 45, 12, 99, 4, 18, 250, 33, 61, 5, 88],
           [17, 4, 230],
           list(range(40, 100))]


def hf_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@functools.cache
def hf_reference(arch, n):
    """Hugging Face generate's greedy n tokens after each of PROMPTS on a fresh tiny_model(arch)
    (seeded: the same weights every call), computed once per worker for every block size and
    attention path that is compared with it."""
    model = tiny_model(arch)
    return [hf_greedy(model, p, n) for p in PROMPTS]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("block_size", [4, 16])
def test_greedy_matches_hf_generate(arch, block_size, paths):
    model = tiny_model(arch)
    ours = engine.generate(model, PROMPTS, 24, block_size=block_size)
    assert ours == hf_reference(arch, 24)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_reference_and_the_fast_path_agree(arch):
    """The same calls on the reference engine (FAST_PATH off: paged attention through the block
    tables, one forward a token) and on the fast path: prefill logits within float32 rounding
    (a fork's too, reading shared blocks), greedy and sampled tokens identical, their log-probs
    within 1e-5 (top-k sampling: a top-p cut can move by a rounding, and with it every kept
    log-prob's normalisation). Each path against Hugging Face: the tests that take `paths`."""
    model = tiny_model(arch)
    runs = {}
    for fast in (False, True):
        eng = engine.Engine(model, block_size=4, num_blocks=300, fast_path=fast)
        assert (eng.fast is None) != fast
        roots = [eng.new(p) for p in PROMPTS]
        logits = eng.forward(roots)
        forks = eng.forward([eng.fork(s, [3, 5, 8]) for s in roots])
        greedy = eng.generate([eng.new(p) for p in PROMPTS], 16, stop_ids=[])
        sampled = eng.generate([eng.new(p) for p in PROMPTS], 16, engine.Sampling(0.8, top_k=20),
                               [4, 5, 6], [])
        runs[fast] = torch.cat([logits, forks]), greedy, sampled
    (ref_logits, *ref_outs), (logits, *outs) = runs[False], runs[True]
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=0)
    for ours, ref in zip(outs, ref_outs):
        assert [ids for ids, _, _ in ours] == [ids for ids, _, _ in ref]
        for (_, a, _), (_, b, _) in zip(ours, ref):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)


def test_the_switch_is_read_when_an_engine_is_made(monkeypatch):
    """engine.FAST_PATH is the default of Engine(fast_path=...), read at each construction."""
    model = tiny_model("llama")
    monkeypatch.setattr(engine, "FAST_PATH", False)
    assert engine.Engine(model, num_blocks=8).fast is None
    assert engine.Engine(model, num_blocks=8, fast_path=True).fast is not None
    monkeypatch.setattr(engine, "FAST_PATH", True)
    assert engine.Engine(model, num_blocks=8).fast is not None


def test_stop_tokens_and_max_new_tokens(paths):
    model = tiny_model("llama")
    free = hf_greedy(model, PROMPTS[0], 12)
    stop = free[5]
    out = engine.generate(model, [PROMPTS[0], PROMPTS[1]], 12, stop_ids=[stop])
    assert out[0] == free[:free.index(stop) + 1]  # ends at the stop token, which is kept
    assert len(out[1]) <= 12


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_in_pieces_matches_full_forward(arch, paths):
    """Ragged batch, each sequence prefilled in two chunks (the second reading the first from
    the cache): last-token logits equal a plain full forward."""
    model = tiny_model(arch)
    eng = engine.Engine(model, block_size=4, num_blocks=64)
    sids = [eng.new(p[:len(p) // 2]) for p in PROMPTS]
    eng.forward(sids)
    for sid, p in zip(sids, PROMPTS):
        eng.append(sid, p[len(p) // 2:])
    logits = eng.forward(sids)
    for row, p in zip(logits, PROMPTS):
        ref = model(torch.tensor([p])).logits[0, -1]
        torch.testing.assert_close(row, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("top_p", [None, 0.9])
def test_sampling_logprobs_equal_training_forward(top_p, paths):
    """The recorded log-prob of each sampled token equals log_softmax(logits / T) of a plain
    full forward over prompt + sample (the training-side computation); top-p renormalises."""
    model, temperature = tiny_model("qwen3"), 0.7
    eng = engine.Engine(model, block_size=4, num_blocks=64)
    sids = [eng.new(p) for p in PROMPTS]
    outs = eng.generate(sids, 10, engine.Sampling(temperature, top_p), [1, 2, 3], stop_ids=[])
    for prompt, (ids, logps, _) in zip(PROMPTS, outs):
        seq = torch.tensor([prompt + ids])
        ref = token_logprobs(model(seq).logits, seq, temperature)[0, len(prompt) - 1:]
        if top_p is None:
            torch.testing.assert_close(torch.tensor(logps), ref, atol=1e-4, rtol=0)
        else:  # truncation only raises a kept token's probability
            assert (torch.tensor(logps) >= ref - 1e-5).all()


def test_decode_steps_leave_the_pool_complete(paths):
    """Decode over a DecodeCopy must still write every token into the pool: after a generate in
    which sequences stop at different steps (the copy is rebuilt as the batch shrinks), a prefill
    that reads the pool gives the logits of a plain full forward."""
    model = tiny_model("qwen3")
    free = engine.generate(model, PROMPTS, 12)
    stop = free[0][3]  # the first prompt stops after 4 tokens, the others later or never
    eng = engine.Engine(model, block_size=4, num_blocks=128)
    sids = [eng.new(p) for p in PROMPTS]
    outs = eng.generate(sids, 12, stop_ids=[stop])
    assert outs[0][0] == free[0][:4] and len({len(ids) for ids, _, _ in outs}) > 1
    for sid in sids:
        eng.append(sid, [3, 5, 8])
    logits = eng.forward(sids)
    for row, prompt, (ids, _, _) in zip(logits, PROMPTS, outs):
        ref = model(torch.tensor([prompt + ids + [3, 5, 8]])).logits[0, -1]
        torch.testing.assert_close(row, ref, atol=1e-4, rtol=0)


def test_fork_shares_blocks_and_never_changes_parent(paths):
    model = tiny_model("llama")
    eng = engine.Engine(model, block_size=4, num_blocks=32)
    parent = eng.new(PROMPTS[0][:10])  # 2 full blocks + a partial one
    eng.forward([parent])
    table, k_before = list(eng.cache.tables[parent]), eng.cache.k.clone()
    child = eng.fork(parent)
    assert eng.cache.tables[child] == table and eng.cache.refs[table[0]] == 2
    eng.append(child, [7, 8, 9])
    eng.forward([child])
    assert eng.cache.tables[parent] == table and eng.cache.lengths[parent] == 10
    assert eng.cache.tables[child][:2] == table[:2]  # full blocks still shared
    assert eng.cache.tables[child][2] != table[2]  # the partial one was copied on write
    for b in table:
        sl = slice(b * 4, b * 4 + 4)
        assert torch.equal(eng.cache.k[:, sl], k_before[:, sl])
    eng.append(parent, [7, 8, 9])
    torch.testing.assert_close(eng.forward([parent]),
                               model(torch.tensor([PROMPTS[0][:10] + [7, 8, 9]])).logits[:, -1],
                               atol=1e-4, rtol=0)


def test_thousands_of_forks_and_frees_leak_nothing():
    eng = engine.Engine(tiny_model("llama"), block_size=4, num_blocks=40)
    root = eng.new(PROMPTS[2][:14])
    eng.forward([root])
    for i in range(2000):
        child = eng.fork(root)
        eng.cache.reserve([child], [1 + i % 9])  # copy-on-write plus fresh blocks
        eng.cache.lengths[child] += 1 + i % 9
        grandchild = eng.fork(child)
        eng.free(child)
        eng.free(grandchild)
    eng.free(root)
    assert len(eng.cache.free_blocks) == 40 and not any(eng.cache.refs)


def test_pool_and_context_overflow_end_cleanly(paths):
    model = tiny_model("llama", max_position_embeddings=30)
    eng = engine.Engine(model, block_size=4, num_blocks=10)
    long_a, long_b = eng.new(PROMPTS[2][:20]), eng.new(PROMPTS[0][:20])
    outs = eng.generate([long_a, long_b], 50, stop_ids=[])
    reasons = {r for _, _, r in outs}
    assert reasons <= {"cache", "context"} and "cache" in reasons  # 10 blocks = 40 tokens
    total = sum(eng.length(s) for s in (long_a, long_b))
    assert total <= 40 + 2  # each keeps at most its last sampled token pending
    eng.free(long_a)
    outs = eng.generate([long_b], 50, stop_ids=[])
    assert outs[0][2] == "context" and eng.length(long_b) <= 31


def test_unwritten_pool_memory_never_reaches_the_logits(paths):
    """Attention copies whole blocks; whatever sits in their unwritten tail must stay masked
    out, even non-finite garbage in memory the pool reuses."""
    eng = engine.Engine(tiny_model("llama"), block_size=8, num_blocks=8)
    eng.cache.k.fill_(float("nan"))
    eng.cache.v.fill_(float("-inf"))
    logits = eng.forward([eng.new(PROMPTS[1]), eng.new(PROMPTS[0][:5])])
    assert logits.isfinite().all()


# -----------------------------------------------------------------------------
# capacity: a batch is reserved whole, nothing is written when it does not fit


def test_generate_on_a_pool_too_small_for_the_batch_never_raises(paths):
    """Two 4-token sequences with one pending token each on a 3-block pool of 4-token blocks:
    only one of them can take a block. It generates as it would alone; the other ends "cache"
    untouched (no IndexError)."""
    model = tiny_model("llama")
    eng = engine.Engine(model, block_size=4, num_blocks=3)
    a, b = eng.new(PROMPTS[0][:4]), eng.new(PROMPTS[1] + [6])
    eng.forward([a, b])
    eng.append(a, PROMPTS[0][4:5])
    eng.append(b, [11])
    assert eng.overflow(a) is None and eng.overflow(b) is None  # each would fit alone
    (ids_a, _, reason_a), (ids_b, _, reason_b) = eng.generate([a, b], 3, stop_ids=[])
    assert ids_a == hf_greedy(model, PROMPTS[0][:5], 3) and reason_a == "length"
    assert ids_b == [] and reason_b == "cache" and eng.cached(b) == 4 and eng.pending[b] == [11]


def test_forward_that_does_not_fit_raises_and_changes_nothing():
    model = tiny_model("llama")
    eng = engine.Engine(model, block_size=4, num_blocks=4)
    a = eng.new(PROMPTS[0][:8])
    eng.forward([a])
    b, c = eng.fork(a, [1, 2, 3, 4, 5]), eng.fork(a, [6])  # b needs 2 blocks, c 1: 3 > 2 free
    tables = {s: list(eng.cache.tables[s]) for s in (a, b, c)}
    with pytest.raises(RuntimeError, match="needs 3 KV blocks, the pool has 2 free"):
        eng.forward([b, c])
    assert eng.free_blocks == 2 and {s: eng.cache.tables[s] for s in (a, b, c)} == tables
    assert eng.admit([b, c], [5, 1]) == [b]  # what the caller may run instead
    assert eng.cached(b) == 8 and eng.pending[b] == [1, 2, 3, 4, 5]


# -----------------------------------------------------------------------------
# the fixed-shape decode step and batch-invariant sampling


@pytest.mark.parametrize("arch", ARCHS)
def test_padded_rows_change_no_other_row(arch, paths):
    """Three sequences decode in a bucket of four rows (one padded), and one stops early and
    turns inert: each row's tokens and log-probs equal the same sequence decoded alone (a bucket
    of one), under greedy and under sampling."""
    model = tiny_model(arch)
    stop = engine.generate(model, [PROMPTS[1]], 5)[0][2]  # PROMPTS[1] stops after 3 tokens
    for sampling in (engine.GREEDY, engine.Sampling(1.0, top_p=0.95)):
        eng = engine.Engine(model, block_size=4, num_blocks=200)
        together = eng.generate([eng.new(p) for p in PROMPTS], 20, sampling, [7, 8, 9], [stop])
        assert fastpath.batch_bucket(3) == 4 and (sampling.temperature or together[1][2] == "stop")
        for prompt, key, (ids, logps, reason) in zip(PROMPTS, [7, 8, 9], together):
            [(alone, alone_logps, alone_reason)] = eng.generate([eng.new(prompt)], 20, sampling,
                                                                [key], [stop])
            assert ids == alone and reason == alone_reason
            torch.testing.assert_close(torch.tensor(logps), torch.tensor(alone_logps),
                                       atol=1e-5, rtol=0)


def test_a_sequences_samples_follow_its_key_not_its_batch():
    """Sampled at T = 1: the same key gives the same tokens whether a sequence runs alone, with
    others, or after a pool refill; another key gives other tokens."""
    model = tiny_model("qwen2")
    sampling = engine.Sampling(1.0)
    eng = engine.Engine(model, block_size=4, num_blocks=300)
    alone = eng.generate([eng.new(PROMPTS[2])], 16, sampling, [42], [])[0][0]
    mixed = eng.generate([eng.new(p) for p in (PROMPTS[0], PROMPTS[2], PROMPTS[1])], 16,
                         sampling, [1, 42, 3], [])[1][0]
    other = eng.generate([eng.new(PROMPTS[2])], 16, sampling, [43], [])[0][0]
    assert alone == mixed and alone != other


def test_gumbel_sampling_draws_the_tempered_truncated_distribution():
    """20,000 draws from one row of logits (keys fixed, positions counting): frequencies match
    softmax(logits / T) within 4 standard errors; top_k and top_p leave out exactly the tail."""
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, -3.0])
    n = 20000
    rows, keys, positions = logits.expand(n, -1), torch.full((n,), 5), torch.arange(n)
    for sampling, kept in ((engine.Sampling(0.8), 5), (engine.Sampling(1.0, top_k=3), 3),
                           (engine.Sampling(1.0, top_p=0.75), 2)):
        p = torch.softmax(logits / sampling.temperature, -1)
        p = torch.where(torch.arange(5) < kept, p, 0.0)
        p = p / p.sum()
        tokens, logps = engine.sample(rows, sampling, keys, positions)
        freq = torch.bincount(tokens, minlength=5).float() / n
        assert (freq[kept:] == 0).all()
        assert ((freq - p).abs() <= 4 * (p * (1 - p) / n).sqrt() + 1e-9).all(), (sampling, freq, p)
        torch.testing.assert_close(logps, p.log()[tokens])


def test_uniform_noise_is_a_pure_function_of_key_position_and_id():
    keys, positions = torch.tensor([3, 3, 4]), torch.tensor([10, 11, 10])
    u = engine.uniform_noise(keys, positions, 1000)
    assert ((u > 0) & (u < 1)).all() and not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    torch.testing.assert_close(engine.uniform_noise(keys[:1], positions[:1], 1000), u[:1])
    assert abs(u.mean().item() - 0.5) < 0.02


# -----------------------------------------------------------------------------
# the weights held once, read again in place by a refresh


def storages(tensors):
    """{storage address: bytes} of the distinct storages behind these tensors."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def weight_tensors(w):
    return [v for lw in w["layers"] for v in lw.values()] + [w["embed"], w["norm"], w["lm_head"]]


@pytest.mark.parametrize("arch", ARCHS)
def test_a_fused_model_holds_no_parameter_bytes_twice(arch, monkeypatch):
    """After an engine fuses q/k/v and gate/up, the model's parameters and the engine's weights
    together take exactly the parameters' own bytes (the fused tensors are the parameters'
    storage), a second engine on the same model adds nothing, and the Hugging Face forward
    still gives the logits it gave before. (A CPU's oneDNN-packed layout, PACK_CPU_WEIGHTS, is
    a copy of its own: off here, as on a GPU.)"""
    monkeypatch.setattr(cpu_products, "PACK_CPU_WEIGHTS", False)
    model = tiny_model(arch)
    ids = torch.tensor([PROMPTS[0]])
    before = model(ids).logits
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    eng, again = engine.Engine(model), engine.Engine(model)
    held = storages(list(model.parameters()) + weight_tensors(eng.w) + weight_tensors(again.w))
    assert sum(held.values()) == param_bytes
    a = model.model.layers[0].self_attn
    assert a.q_proj.weight.data_ptr() == eng.w["layers"][0]["qkv"].data_ptr() == \
        again.w["layers"][0]["qkv"].data_ptr()
    torch.testing.assert_close(model(ids).logits, before, atol=0, rtol=0)


def test_a_refresh_keeps_the_fused_storage_and_reads_the_new_weights(monkeypatch):
    """Weights written into the engine's model in place (train.copy_weights) or copied from
    another model (refresh(other)) are read at the same addresses: every fused tensor keeps its
    data_ptr, the decode batches (and on CUDA their graphs) are kept, and greedy decoding
    follows the new weights token for token."""
    monkeypatch.setattr(cpu_products, "PACK_CPU_WEIGHTS", False)
    model, other = tiny_model("qwen3"), tiny_model("qwen3", seed=5)
    eng = engine.Engine(model, block_size=4, num_blocks=200)
    eng.generate([eng.new(p) for p in PROMPTS], 12)
    addresses = [t.data_ptr() for t in weight_tensors(eng.w)]
    batches = dict(eng.fast.decode_batches)
    eng.refresh(other)
    assert [t.data_ptr() for t in weight_tensors(eng.w)] == addresses
    assert eng.fast.decode_batches == batches and batches
    ours = [ids for ids, _, _ in eng.generate([eng.new(p) for p in PROMPTS], 12)]
    assert ours == [hf_greedy(other, p, 12) for p in PROMPTS]
    with torch.no_grad():  # an in-place write, as train.copy_weights does
        for p, q in zip(model.parameters(), tiny_model("qwen3", seed=6).parameters()):
            p.copy_(q)
    eng.refresh()
    assert [t.data_ptr() for t in weight_tensors(eng.w)] == addresses
    ours = [ids for ids, _, _ in eng.generate([eng.new(p) for p in PROMPTS], 12)]
    assert ours == [hf_greedy(model, p, 12) for p in PROMPTS]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_cpu_pool_is_zero_writable_and_independent(dtype):
    """engine.zero_pool on a CPU (calloc'd memory): the shape and dtype asked for, every element
    0, writes land where they are written, and two pools share nothing."""
    a, b = (engine.zero_pool((2, 8, 3, 4), dtype, "cpu") for _ in range(2))
    assert a.shape == (2, 8, 3, 4) and a.dtype == dtype and a.is_contiguous()
    assert torch.equal(a, torch.zeros_like(a))
    a[1, 5, 2, 3] = 1.5
    assert a.float().sum() == 1.5 and a[1, 5, 2, 3] == 1.5 and b.abs().sum() == 0


def test_token_chunks_bound_each_forward():
    assert engine.token_chunks([3, 4, 5, 20, 1], 8) == [(0, 2), (2, 3), (3, 4), (4, 5)]
    assert engine.token_chunks([2, 2, 2], 100) == [(0, 3)] and engine.token_chunks([], 8) == []


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_batch_past_forward_tokens_runs_in_chunks_with_the_same_logits(arch, paths, monkeypatch):
    """A ragged batch (forks of a shared opening included) larger than forward_tokens runs in
    forwards of at most that many new tokens (one longer sequence alone), each sequence's
    last-token logits those of a plain full forward, and so are the next forward's (which reads
    the keys and values the chunks wrote)."""
    model = tiny_model(arch)
    sizes = []
    original = engine.Engine._forward_chunk

    def counted(self, sids, news, starts):
        sizes.append(sum(map(len, news)))
        return original(self, sids, news, starts)
    monkeypatch.setattr(engine.Engine, "_forward_chunk", counted)
    out = {}
    for limit in (10_000, 24):
        eng = engine.Engine(model, block_size=4, num_blocks=256, forward_tokens=limit)
        root = eng.new(PROMPTS[0][:8])
        eng.forward([root])
        forks = [eng.fork(root) for _ in range(2)]
        for sid, extra in zip(forks, (PROMPTS[0][8:], [7, 8, 9])):
            eng.append(sid, extra)
        sids = forks + [eng.new(p) for p in PROMPTS[1:]]
        sizes.clear()
        logits = eng.forward(sids)
        chunks = list(sizes)
        for sid in sids:
            eng.append(sid, [11])
        out[limit] = logits, chunks, eng.forward(sids)  # the next forward reads the chunks' cache
    assert out[10_000][1] == [14 + 3 + 3 + 60] and len(out[24][1]) > 1
    assert all(n <= 24 or n == 60 for n in out[24][1])
    torch.testing.assert_close(out[24][0], out[10_000][0], atol=1e-5, rtol=0)
    contexts = [PROMPTS[0], PROMPTS[0][:8] + [7, 8, 9], *PROMPTS[1:]]
    for row, ids in zip(out[24][0], contexts):
        torch.testing.assert_close(row, model(torch.tensor([ids])).logits[0, -1], atol=1e-4, rtol=0)
    for row, ids in zip(out[24][2], contexts):
        torch.testing.assert_close(row, model(torch.tensor([ids + [11]])).logits[0, -1], atol=1e-4,
                                   rtol=0)


def test_a_cpu_forward_takes_the_cores_other_processes_leave(monkeypatch):
    """cpu_threads (an engine's forwards and decode windows): beside as many running tasks as
    cores, one thread; on an idle machine every core of the process, more than the one thread a
    busy start left it (the threads follow the machine up as well as down), at most
    OMP_NUM_THREADS when set; restored afterwards; "all" and a GPU leave the threads alone. A
    forward runs inside it."""
    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        torch.set_num_threads(1)  # what a start beside busy processes chose
        seen = {}
        for name, elsewhere, policy, device in (("busy", 4, "free", "cpu"),
                                                ("idle", 0, "free", "cpu"),
                                                ("half", 2, "free", "cpu"),
                                                ("all", 4, "all", "cpu"),
                                                ("gpu", 4, "free", "cuda")):
            monkeypatch.setattr(engine, "running_elsewhere", lambda: elsewhere)
            with engine.cpu_threads(device, policy):
                seen[name] = torch.get_num_threads()
            assert torch.get_num_threads() == 1
        assert seen == dict(busy=1, idle=4, half=2, all=1, gpu=1)
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        monkeypatch.setattr(engine, "running_elsewhere", lambda: 0)
        with engine.cpu_threads("cpu", "free"):
            assert torch.get_num_threads() == 3
        monkeypatch.setenv("OMP_NUM_THREADS", "1")  # held to one thread: no /proc read at all
        monkeypatch.setattr(engine, "running_elsewhere", lambda: pytest.fail("read /proc"))
        with engine.cpu_threads("cpu", "free"):
            assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    monkeypatch.undo()
    inside = []
    monkeypatch.setattr(engine, "running_elsewhere", lambda: cores)
    eng = engine.Engine(tiny_model("llama"), block_size=16, num_blocks=64)
    monkeypatch.setattr(eng, "_forward_chunk", lambda *a: inside.append(torch.get_num_threads())
                        or torch.zeros(len(a[0]), 4))
    torch.set_num_threads(2)
    try:
        eng.forward([eng.new([1, 2, 3])])
    finally:
        torch.set_num_threads(before)
    assert inside == [1]
