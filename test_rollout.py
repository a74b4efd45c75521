"""Dialogue tests: episodes played on two engines, the persuadee's turn, the judge."""
import torch

import arena
import engine
import models
import probes
import rollout
import rpo
from conftest import tiny_model


def test_dialogue_rollout_returns_blocks_and_consistent_streams(tokenizer):
    """Two tiny models play a short dialogue: all blocks come back, the persuader stream's
    sampled tokens are exactly its messages, and its log-probs match a full forward."""
    scenarios = arena.load_scenarios(split="heldout")[:2]
    er_model, ee_model = tiny_model("llama", seed=1), tiny_model("qwen3", seed=2)
    er = engine.Engine(er_model, tokenizer, block_size=8, num_blocks=2000)
    ee = engine.Engine(ee_model, tokenizer, block_size=8, num_blocks=2000)
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
    original = models.chat_ids
    monkeypatch.setattr(models, "chat_ids", lambda tok, messages, *a, **k: (
        seen.extend(m["content"] for m in messages if m["role"] == "user"),
        original(tok, messages, *a, **k))[1])
    monkeypatch.setattr(engine.Engine, "generate", fake_generate("We agree [ACCEPT] **[Accept]**"))
    scenario = arena.load_scenarios(split="heldout")[0]
    model = tiny_model("llama")
    er, ee = engine.Engine(model, tokenizer, num_blocks=400), engine.Engine(model, tokenizer, num_blocks=400)
    rollout.rollout_episodes(er, ee, [scenario], 1)
    assert seen and all(arena.parse_decision(s) is None for s in seen)


def test_final_turn_instruction_reaches_the_persuadee_on_the_last_turn_only(tokenizer,
                                                                           monkeypatch):
    """With T_max = 3 and no decision, the persuadee's context receives the persuader's three
    messages, and only the third is followed by FINAL_TURN_INSTRUCTION, as a system turn; the
    transcript never holds it."""
    seen = []
    original = models.chat_ids
    monkeypatch.setattr(models, "chat_ids", lambda tok, messages, *a, **k: (
        seen.append(messages), original(tok, messages, *a, **k))[1])
    model = tiny_model("llama")
    er, ee = engine.Engine(model, tokenizer, num_blocks=400), engine.Engine(model, tokenizer, num_blocks=400)
    er.generate = fake_generate("Try it for a week.").__get__(er)
    ee.generate = fake_generate("Let me think.").__get__(ee)
    [record] = rollout.rollout_episodes(er, ee, arena.load_scenarios(split="heldout")[:1], 3)
    to_persuadee = [m for m in seen if m[0]["content"].startswith("Try it")]
    message = {"role": "user", "content": "Try it for a week."}
    assert to_persuadee == [[message]] * 2 + [
        [message, {"role": "system", "content": arena.FINAL_TURN_INSTRUCTION}]]
    assert record["turns"] == 3 and record["outcome"] == "PENDING"
    assert all(arena.FINAL_TURN_INSTRUCTION not in m["text"] for m in record["transcript"])


def fake_generate(text):
    def generate(self, sids, *args, **kwargs):
        ids = models.encode(self.tokenizer, text) + [self.stop_ids[0]]
        for s in sids:
            self.append(s, ids[:-1])
            self.forward([s])
            self.append(s, ids[-1:])
        return [(list(ids), [0.0] * len(ids), "stop") for _ in sids]
    return generate


def test_smollm2_plays_two_dialogues_end_to_end():
    """Integration: the real CPU default model, two short dialogues, probes and all."""
    model, tokenizer = models.load_model("smollm2")
    scenarios = arena.load_scenarios(split="heldout")[:2]
    er, ee = engine.Engine(model, tokenizer), engine.Engine(model, tokenizer)
    records = rollout.rollout_episodes(er, ee, scenarios, 2, max_new_tokens=16, seed=0)
    assert len(records) == 2
    for r in records:
        assert r["transcript"][0]["role"] == "persuader" and r["transcript"][0]["text"]
        assert all(-1 <= b <= 1 for b in r["beliefs"]) and len(r["beliefs"]) == r["turns"] + 1
    assert len(er.cache.free_blocks) == er.cache.num_blocks
    ctx = models.chat_ids(tokenizer, arena.persuadee_messages(scenarios[0]), False)
    torch.testing.assert_close(probes.read_beliefs(model, tokenizer, [ctx]),
                               probes.read_beliefs_reference(model, tokenizer, [ctx]),
                               atol=1e-4, rtol=0)


def test_judge_scores_parse_retry_and_fall_back(tokenizer, monkeypatch):
    """A parseable verdict gives s = mean - 3; an unparseable one is retried JUDGE_RETRIES times
    after its greedy answer, each retry a fork of the once-prefilled prompt, then falls back to 0
    and is counted as failed."""
    answers = {0: "PROBING: 5\nFIT: 4\nADAPTATION: 3", 1: "I cannot say."}
    attempts = []

    def generate(self, sids, *args, **kwargs):
        outs = []
        for s in sids:
            which = 0 if self.length(s) == lengths[0] else 1
            attempts.append(which)
            ids = models.encode(self.tokenizer, answers[which]) + [self.stop_ids[0]]
            outs.append((ids, [0.0] * len(ids), "stop"))
        return outs
    monkeypatch.setattr(engine.Engine, "generate", generate)
    scenarios = arena.load_scenarios(split="heldout")[:2]
    transcripts = [[{"role": "persuader", "text": "Hello."}], [{"role": "persuader", "text": "Hi there, friend."}]]
    judge = engine.Engine(tiny_model("llama"), tokenizer, num_blocks=2000)
    lengths = [len(models.chat_ids(tokenizer, arena.judge_messages(s, t), True))
               for s, t in zip(scenarios, transcripts)]
    assert lengths[0] != lengths[1]
    assert rollout.judge_scores(judge, scenarios, transcripts) == ([1.0, 0.0], [False, True])
    assert sorted(attempts) == [0] + [1] * (1 + arena.JUDGE_RETRIES)  # greedy, then the retries
    assert judge.tokens_prefilled == sum(lengths) - 2  # prompts once; last tokens stay pending
    assert len(judge.cache.free_blocks) == 2000
    # two transcripts of one instance: their shared opening (profile) is prefilled only once
    judge.tokens_prefilled = 0
    attempts.clear()
    assert rollout.judge_scores(judge, [scenarios[0]] * 2, transcripts) == ([1.0, 0.0], [False, True])
    group = [models.chat_ids(tokenizer, arena.judge_messages(scenarios[0], t), True)
             for t in transcripts]
    shared = next(i for i, (a, b) in enumerate(zip(*group)) if a != b)
    assert shared > 100
    assert judge.tokens_prefilled == sum(map(len, group)) - shared - 2
    assert len(judge.cache.free_blocks) == 2000
