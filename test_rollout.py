"""Engine tests: the paged cache and its forward against plain Hugging Face computations."""
import pytest
import torch
import torch.nn.functional as F

import arena
import probes
import rollout
import rpo
from conftest import tiny_model

ARCHS = ["llama", "qwen3", "qwen2"]
PROMPTS = [[5, 9, 14, 3, 77, 120, 8, 41, 19, 66, 7, 301, 45, 12, 99, 4, 18, 250, 33, 61, 5, 88],
           [17, 4, 230],
           list(range(40, 100))]


PATHS = {"split+copy": {},  # a CPU's: prefill a sequence at a time, decode over a dense copy
         "split+gather": {"DECODE_COPY_GB": 0},  # the copy would not fit: gather every step
         "padded": {"COMPUTE_BOUND_DEVICES": ()}}  # a GPU's without flash-attn


@pytest.fixture(params=list(PATHS))
def paths(request, monkeypatch):
    """Runs a test once per PyTorch attention path pair (rollout.Batch)."""
    for name, value in PATHS[request.param].items():
        monkeypatch.setattr(rollout, name, value)
    return request.param


def hf_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("block_size", [4, 16])
def test_greedy_matches_hf_generate(arch, block_size, paths):
    model = tiny_model(arch)
    ours = rollout.generate(model, PROMPTS, 24, block_size=block_size)
    assert ours == [hf_greedy(model, p, 24) for p in PROMPTS]


def test_stop_tokens_and_max_new_tokens():
    model = tiny_model("llama")
    free = hf_greedy(model, PROMPTS[0], 12)
    stop = free[5]
    out = rollout.generate(model, [PROMPTS[0], PROMPTS[1]], 12, stop_ids=[stop])
    assert out[0] == free[:free.index(stop) + 1]  # ends at the stop token, which is kept
    assert len(out[1]) <= 12


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_in_pieces_matches_full_forward(arch, paths):
    """Ragged batch, each sequence prefilled in two chunks (the second reading the first from
    the cache): last-token logits equal a plain full forward."""
    model = tiny_model(arch)
    engine = rollout.Engine(model, block_size=4, num_blocks=64)
    sids = [engine.new(p[:len(p) // 2]) for p in PROMPTS]
    engine.forward(sids)
    for sid, p in zip(sids, PROMPTS):
        engine.pending[sid] = p[len(p) // 2:]
    logits = engine.forward(sids)
    for row, p in zip(logits, PROMPTS):
        ref = model(torch.tensor([p])).logits[0, -1]
        torch.testing.assert_close(row, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_probe_fork_read_matches_reference(arch, tokenizer, paths):
    """Both read-outs (the opening prefilled once and forked per question, a CPU's; each question
    whole in one forward, the padded path's) equal plain full forwards of context + question."""
    model = tiny_model(arch)
    contexts = [rollout.encode(tokenizer, rollout.render(tokenizer, msgs, False)) for msgs in [
        [{"role": "system", "content": "You are Ana, a nurse."}],
        [{"role": "system", "content": "You are Bo."}, {"role": "user", "content": "Could we book it?"},
         {"role": "assistant", "content": "I need to see the numbers first."}]]]
    fork = probes.read_beliefs(model, tokenizer, contexts)
    ref = probes.read_beliefs_reference(model, tokenizer, contexts)
    assert fork.shape == (2, 3) and (fork.abs() <= 1).all()
    torch.testing.assert_close(fork, ref, atol=1e-4, rtol=0)


def test_probe_value_is_yes_vs_no_probability(tokenizer):
    """v = 2p - 1 with p = P(yes ids) / (P(yes ids) + P(no ids)), computed directly."""
    logits = torch.randn(2, len(tokenizer))
    probs = logits.softmax(-1)
    yes = probs[:, probes.answer_ids(tokenizer, probes.YES_WORDS)].sum(-1)
    no = probs[:, probes.answer_ids(tokenizer, probes.NO_WORDS)].sum(-1)
    torch.testing.assert_close(probes.values_from_logits(logits, tokenizer), 2 * yes / (yes + no) - 1)


@pytest.mark.parametrize("top_p", [None, 0.9])
def test_sampling_logprobs_equal_training_forward(top_p, paths):
    """The recorded log-prob of each sampled token equals log_softmax(logits / T) of a plain
    full forward over prompt + sample (the training-side computation); top-p renormalises."""
    model, temperature = tiny_model("qwen3"), 0.7
    engine = rollout.Engine(model, block_size=4, num_blocks=64)
    gen = torch.Generator().manual_seed(0)
    sids = [engine.new(p) for p in PROMPTS]
    outs = engine.generate(sids, 10, temperature, top_p, gen, stop_ids=[])
    for prompt, (ids, logps, _) in zip(PROMPTS, outs):
        seq = torch.tensor([prompt + ids])
        ref = rpo.token_logprobs(model(seq).logits, seq, temperature)[0, len(prompt) - 1:]
        if top_p is None:
            torch.testing.assert_close(torch.tensor(logps), ref, atol=1e-4, rtol=0)
        else:  # truncation only raises a kept token's probability
            assert (torch.tensor(logps) >= ref - 1e-5).all()


def test_decode_attention_matches_sdpa():
    """The two-product grouped-query decode attention equals SDPA with a boolean key mask."""
    torch.manual_seed(0)
    B, H, Hkv, K, D = 3, 6, 2, 11, 8
    q, keys, values = torch.randn(B, H, D), torch.randn(B, Hkv, K, D), torch.randn(B, Hkv, K, D)
    visible = torch.arange(K) < torch.tensor([11, 4, 1])[:, None, None]  # [B, 1, K]
    bias = torch.zeros(B, 1, K).masked_fill(~visible, float("-inf")).repeat_interleave(Hkv, 0)
    ref = F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=visible[:, None],
                                         enable_gqa=True)[:, :, 0]
    torch.testing.assert_close(rollout.decode_attention(q, keys, values, bias), ref)


def test_decode_steps_leave_the_pool_complete(paths):
    """Decode over a DecodeCopy must still write every token into the pool: after a generate in
    which sequences stop at different steps (the copy is rebuilt as the batch shrinks), a prefill
    that reads the pool gives the logits of a plain full forward."""
    model = tiny_model("qwen3")
    free = rollout.generate(model, PROMPTS, 12)
    stop = free[0][3]  # the first prompt stops after 4 tokens, the others later or never
    engine = rollout.Engine(model, block_size=4, num_blocks=128)
    sids = [engine.new(p) for p in PROMPTS]
    outs = engine.generate(sids, 12, stop_ids=[stop])
    assert outs[0][0] == free[0][:4] and len({len(ids) for ids, _, _ in outs}) > 1
    for sid in sids:
        engine.pending[sid] += [3, 5, 8]
    logits = engine.forward(sids)
    for row, prompt, (ids, _, _) in zip(logits, PROMPTS, outs):
        ref = model(torch.tensor([prompt + ids + [3, 5, 8]])).logits[0, -1]
        torch.testing.assert_close(row, ref, atol=1e-4, rtol=0)


def test_fork_shares_blocks_and_never_changes_parent():
    model = tiny_model("llama")
    engine = rollout.Engine(model, block_size=4, num_blocks=32)
    parent = engine.new(PROMPTS[0][:10])  # 2 full blocks + a partial one
    engine.forward([parent])
    table, k_before = list(engine.cache.tables[parent]), engine.cache.k.clone()
    child = engine.fork(parent)
    assert engine.cache.tables[child] == table and engine.cache.refs[table[0]] == 2
    engine.pending[child] = [7, 8, 9]
    engine.forward([child])
    assert engine.cache.tables[parent] == table and engine.cache.lengths[parent] == 10
    assert engine.cache.tables[child][:2] == table[:2]  # full blocks still shared
    assert engine.cache.tables[child][2] != table[2]  # the partial one was copied on write
    for b in table:
        sl = slice(b * 4, b * 4 + 4)
        assert torch.equal(engine.cache.k[:, sl], k_before[:, sl])
    engine.pending[parent] = [7, 8, 9]
    torch.testing.assert_close(engine.forward([parent]),
                               model(torch.tensor([PROMPTS[0][:10] + [7, 8, 9]])).logits[:, -1],
                               atol=1e-4, rtol=0)


def test_thousands_of_forks_and_frees_leak_nothing():
    engine = rollout.Engine(tiny_model("llama"), block_size=4, num_blocks=40)
    root = engine.new(PROMPTS[2][:14])
    engine.forward([root])
    for i in range(2000):
        child = engine.fork(root)
        engine.cache.reserve([child], [1 + i % 9])  # copy-on-write plus fresh blocks
        engine.cache.lengths[child] += 1 + i % 9
        grandchild = engine.fork(child)
        engine.free(child)
        engine.free(grandchild)
    engine.free(root)
    assert len(engine.cache.free_blocks) == 40 and not any(engine.cache.refs)


def test_pool_and_context_overflow_end_cleanly():
    model = tiny_model("llama", max_position_embeddings=30)
    engine = rollout.Engine(model, block_size=4, num_blocks=10)
    long_a, long_b = engine.new(PROMPTS[2][:20]), engine.new(PROMPTS[0][:20])
    outs = engine.generate([long_a, long_b], 50, stop_ids=[])
    reasons = {r for _, _, r in outs}
    assert reasons <= {"cache", "context"} and "cache" in reasons  # 10 blocks = 40 tokens
    total = sum(engine.length(s) for s in (long_a, long_b))
    assert total <= 40 + 2  # each keeps at most its last sampled token pending
    engine.free(long_a)
    outs = engine.generate([long_b], 50, stop_ids=[])
    assert outs[0][2] == "context" and engine.length(long_b) <= 31


def test_dialogue_rollout_returns_blocks_and_consistent_streams(tokenizer):
    """Two tiny models play a short dialogue: all blocks come back, the persuader stream's
    sampled tokens are exactly its messages, and its log-probs match a full forward."""
    scenarios = arena.load_scenarios(split="heldout")[:2]
    er_model, ee_model = tiny_model("llama", seed=1), tiny_model("qwen3", seed=2)
    er = rollout.Engine(er_model, tokenizer, block_size=8, num_blocks=2000)
    ee = rollout.Engine(ee_model, tokenizer, block_size=8, num_blocks=2000)
    records = rollout.rollout_episodes(er, ee, scenarios, 2, group_size=2, seed=3,
                                       max_new_tokens=6, persuader_temperature=1.0)
    assert len(records) == 4 and [r["id"] for r in records][::2] == [s["id"] for s in scenarios]
    assert len(er.cache.free_blocks) == 2000 and len(ee.cache.free_blocks) == 2000
    for r in records:
        assert len(r["beliefs"]) == r["turns"] + 1 == len(r["probes"])
        assert r["outcome"] in arena.OUTCOMES
        ids, turns = torch.tensor([r["ids"]]), torch.tensor(r["turn_ids"])
        assert len(r["ids"]) == len(r["turn_ids"]) == len(r["logprobs"])
        for t in range(1, r["turns"] + 1):
            sampled = ids[0, turns == t].tolist()
            assert 1 <= len(sampled) <= 6
            assert tokenizer.decode(sampled, skip_special_tokens=True).strip() == \
                r["transcript"][2 * (t - 1)]["text"]
        ref = rpo.token_logprobs(er_model(ids).logits, ids, 1.0)[0]
        mask = turns[1:] > 0
        torch.testing.assert_close(torch.tensor(r["logprobs"][1:])[mask], ref[mask],
                                   atol=1e-4, rtol=0)
    # b_0 is read once per instance, before any message, and shared by the group
    assert records[0]["probes"][0] == records[1]["probes"][0]


def test_persuader_tags_never_reach_the_persuadee(tokenizer, monkeypatch):
    """Whatever the persuader writes, the persuadee's context holds it with its tags stripped."""
    seen = []
    original = rollout.turn_ids
    monkeypatch.setattr(rollout, "turn_ids", lambda tok, content, *a, **k: (
        seen.append(content), original(tok, content, *a, **k))[1])
    monkeypatch.setattr(rollout.Engine, "generate", fake_generate("We agree [ACCEPT] **[Accept]**"))
    scenario = arena.load_scenarios(split="heldout")[0]
    model = tiny_model("llama")
    er, ee = rollout.Engine(model, tokenizer, num_blocks=400), rollout.Engine(model, tokenizer, num_blocks=400)
    rollout.rollout_episodes(er, ee, [scenario], 1)
    assert seen and all(arena.parse_decision(s) is None for s in seen)


def test_final_turn_instruction_reaches_the_persuadee_on_the_last_turn_only(tokenizer,
                                                                           monkeypatch):
    """With T_max = 3 and no decision, the persuadee's context receives the persuader's three
    messages, and only the third carries FINAL_TURN_INSTRUCTION; the transcript never does."""
    seen = []
    original = rollout.turn_ids
    monkeypatch.setattr(rollout, "turn_ids", lambda tok, content, *a, **k: (
        seen.append(content), original(tok, content, *a, **k))[1])
    model = tiny_model("llama")
    er, ee = rollout.Engine(model, tokenizer, num_blocks=400), rollout.Engine(model, tokenizer, num_blocks=400)
    er.generate = fake_generate("Try it for a week.").__get__(er)
    ee.generate = fake_generate("Let me think.").__get__(ee)
    [record] = rollout.rollout_episodes(er, ee, arena.load_scenarios(split="heldout")[:1], 3)
    to_persuadee = [s for s in seen if s.startswith("Try it")]
    assert to_persuadee == ["Try it for a week."] * 2 + [
        "Try it for a week.\n\n" + arena.FINAL_TURN_INSTRUCTION]
    assert record["turns"] == 3 and record["outcome"] == "PENDING"
    assert all(arena.FINAL_TURN_INSTRUCTION not in m["text"] for m in record["transcript"])


def fake_generate(text):
    def generate(self, sids, *args, **kwargs):
        ids = rollout.encode(self.tokenizer, text) + [self.stop_ids[0]]
        for s in sids:
            self.pending[s] += ids[:-1]
            self.forward([s])
            self.pending[s] = ids[-1:]
        return [(list(ids), [0.0] * len(ids), "stop") for _ in sids]
    return generate


def test_turn_and_closing_ids_follow_the_template(tokenizer):
    """Appending ids message by message reproduces the template's rendering of the whole chat."""
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Yes?"}]
    ids = rollout.encode(tokenizer, rollout.render(tokenizer, msgs[:1], False))
    ids += rollout.turn_ids(tokenizer, "Hi there")
    reply = rollout.encode(tokenizer, "Hello") + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    ids += reply + rollout.closing_ids(tokenizer, reply) + rollout.turn_ids(tokenizer, "Yes?")
    assert tokenizer.decode(ids) == rollout.render(tokenizer, msgs, True)
    cut = rollout.encode(tokenizer, "Hel")  # a message cut at the token limit gets the end token
    assert tokenizer.decode(cut + rollout.closing_ids(tokenizer, cut)) == "Hel<|im_end|>\n"


@pytest.mark.skipif(rollout.flash_attn_with_kvcache is None or not torch.cuda.is_available(),
                    reason="flash-attn and a GPU are needed for the paged flash kernels")
def test_flash_path_matches_sdpa_path():
    model = tiny_model("qwen3").cuda()
    flash = rollout.Engine(model, block_size=256, num_blocks=8)
    sdpa = rollout.Engine(model, block_size=256, num_blocks=8)
    sdpa.use_flash = False
    outs = []
    for engine in (flash, sdpa):
        sids = [engine.new(p) for p in PROMPTS]
        outs.append(engine.forward(sids))
        for s in sids:
            engine.pending[s] = [3]
        outs.append(engine.forward(sids))
    torch.testing.assert_close(outs[0], outs[2], atol=1e-3, rtol=0)
    torch.testing.assert_close(outs[1], outs[3], atol=1e-3, rtol=0)


def test_smollm2_plays_two_dialogues_end_to_end():
    """Integration: the real CPU default model, two short dialogues, probes and all."""
    model, tokenizer = rollout.load_model("smollm2")
    scenarios = arena.load_scenarios(split="heldout")[:2]
    er, ee = rollout.Engine(model, tokenizer), rollout.Engine(model, tokenizer)
    records = rollout.rollout_episodes(er, ee, scenarios, 2, max_new_tokens=16, seed=0)
    assert len(records) == 2
    for r in records:
        assert r["transcript"][0]["role"] == "persuader" and r["transcript"][0]["text"]
        assert all(-1 <= b <= 1 for b in r["beliefs"]) and len(r["beliefs"]) == r["turns"] + 1
    assert len(er.cache.free_blocks) == er.cache.num_blocks
    ctx = rollout.encode(tokenizer, rollout.render(tokenizer, arena.persuadee_messages(scenarios[0]),
                                                   False))
    torch.testing.assert_close(probes.read_beliefs(model, tokenizer, [ctx]),
                               probes.read_beliefs_reference(model, tokenizer, [ctx]),
                               atol=1e-4, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cuda_engine_matches_hf_generate(arch):
    """The GPU twin of the CPU equivalence test (float32, PyTorch attention path)."""
    model = tiny_model(arch).cuda()
    ours = rollout.generate(model, PROMPTS, 24)
    ref = [model.generate(torch.tensor([p], device="cuda"), max_new_tokens=24, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    assert ours == ref


def test_unwritten_pool_memory_never_reaches_the_logits(paths):
    """Attention copies whole blocks; whatever sits in their unwritten tail must stay masked
    out, even non-finite garbage in memory the pool reuses."""
    engine = rollout.Engine(tiny_model("llama"), block_size=8, num_blocks=8)
    engine.cache.k.fill_(float("nan"))
    engine.cache.v.fill_(float("-inf"))
    logits = engine.forward([engine.new(PROMPTS[1]), engine.new(PROMPTS[0][:5])])
    assert logits.isfinite().all()


def test_judge_scores_parse_retry_and_fall_back(tokenizer, monkeypatch):
    """A parseable verdict gives s = mean - 3; an unparseable one is retried JUDGE_RETRIES times,
    each retry a fork of the once-prefilled prompt, then scores 0."""
    answers = {0: "PROBING: 5\nFIT: 4\nADAPTATION: 3", 1: "I cannot say."}
    attempts = []

    def generate(self, sids, *args, **kwargs):
        outs = []
        for s in sids:
            which = 0 if self.length(s) == lengths[0] else 1
            attempts.append(which)
            ids = rollout.encode(self.tokenizer, answers[which]) + [self.stop_ids[0]]
            outs.append((ids, [0.0] * len(ids), "stop"))
        return outs
    monkeypatch.setattr(rollout.Engine, "generate", generate)
    scenarios = arena.load_scenarios(split="heldout")[:2]
    transcripts = [[{"role": "persuader", "text": "Hello."}], [{"role": "persuader", "text": "Hi there, friend."}]]
    judge = rollout.Engine(tiny_model("llama"), tokenizer, num_blocks=2000)
    lengths = [len(rollout.encode(tokenizer, rollout.render(tokenizer, arena.judge_messages(s, t), True)))
               for s, t in zip(scenarios, transcripts)]
    assert lengths[0] != lengths[1]
    assert rollout.judge_scores(judge, scenarios, transcripts) == [1.0, 0.0]
    assert sorted(attempts) == [0] + [1] * arena.JUDGE_RETRIES
    assert judge.tokens_prefilled == sum(lengths) - 2  # prompts once; last tokens stay pending
    assert len(judge.cache.free_blocks) == 2000
    # two transcripts of one instance: their shared opening (profile) is prefilled only once
    judge.tokens_prefilled = 0
    attempts.clear()
    assert rollout.judge_scores(judge, [scenarios[0]] * 2, transcripts) == [1.0, 0.0]
    group = [rollout.encode(tokenizer, rollout.render(tokenizer, arena.judge_messages(scenarios[0], t), True))
             for t in transcripts]
    shared = next(i for i, (a, b) in enumerate(zip(*group)) if a != b)
    assert shared > 100
    assert judge.tokens_prefilled == sum(map(len, group)) - shared - 2
    assert len(judge.cache.free_blocks) == 2000
