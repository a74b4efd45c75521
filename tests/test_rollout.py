"""Dialogue tests: episodes played on two engines, the persuadee's turn, the judge."""
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from persuarena import arena
from persuarena import engine
from persuarena import models
from persuarena import probes
from persuarena import rollout
from persuarena import rpo
from lab import judge as local_judge
from conftest import tiny_model, token_logprobs


def test_dialogue_rollout_returns_blocks_and_consistent_streams(tokenizer):
    """Two tiny models play a short dialogue: all blocks come back, the persuader stream's
    sampled tokens are exactly its messages, and its log-probs match a full forward."""
    scenarios = arena.load_scenarios(split="heldout")[:2]
    er_model, ee_model = tiny_model("llama", seed=1), tiny_model("qwen3", seed=2)
    er = engine.Engine(er_model, tokenizer, block_size=8, num_blocks=2000)
    ee = engine.Engine(ee_model, tokenizer, block_size=8, num_blocks=2000)
    records = rollout.rollout_episodes(er, ee, scenarios, 2, group_size=2, seed=3,
                                       max_new_tokens=6, persuader_sampling=engine.Sampling(1.0))
    assert len(records) == 4 and [r.id for r in records][::2] == [s["id"] for s in scenarios]
    assert len(er.cache.free_blocks) == 2000 and len(ee.cache.free_blocks) == 2000
    for r in records:
        assert len(r.beliefs) == r.turns + 1 == len(r.probes) == len(r.probe_mass)
        assert all(0 < m <= 1 for row in r.probe_mass for m in row)
        assert r.outcome in arena.OUTCOMES
        ids, turns = torch.tensor([r.ids]), torch.tensor(r.turn_ids)
        assert len(r.ids) == len(r.turn_ids) == len(r.logprobs)
        for t in range(1, r.turns + 1):
            sampled = ids[0, turns == t].tolist()
            assert 1 <= len(sampled) <= 6
            assert tokenizer.decode(sampled, skip_special_tokens=True).strip() == \
                r.transcript[2 * (t - 1)]["text"]
        ref = token_logprobs(er_model(ids).logits, ids, 1.0)[0]
        mask = turns[1:] > 0
        torch.testing.assert_close(torch.tensor(r.logprobs[1:])[mask], ref[mask],
                                   atol=1e-4, rtol=0)
    # b_0 is read once per instance, before any message, and shared by the group
    assert records[0].probes[0] == records[1].probes[0]


def test_persuader_tags_never_reach_the_persuadee(tokenizer, monkeypatch):
    """Whatever the persuader writes, the persuadee's context holds it with its tags stripped."""
    seen = []
    original = models.chat_ids
    monkeypatch.setattr(models, "chat_ids", lambda tok, messages, *a, **k: (
        seen.extend(m["content"] for m in messages if m["role"] == "user"),
        original(tok, messages, *a, **k))[1])
    monkeypatch.setattr(engine.Engine, "generate", fake_generate("We agree [ACCEPT] **[Accept]**"))
    scenario = arena.load_scenarios(split="heldout")[0]
    model = tiny_model("llama", max_position_embeddings=8192)  # real prompts, tiny tokenizer
    er, ee = engine.Engine(model, tokenizer, num_blocks=1000), engine.Engine(model, tokenizer, num_blocks=1000)
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
    model = tiny_model("llama", max_position_embeddings=8192)  # real prompts, tiny tokenizer
    er, ee = engine.Engine(model, tokenizer, num_blocks=1000), engine.Engine(model, tokenizer, num_blocks=1000)
    er.generate = fake_generate("Try it for a week.").__get__(er)
    ee.generate = fake_generate("Let me think.").__get__(ee)
    [record] = rollout.rollout_episodes(er, ee, arena.load_scenarios(split="heldout")[:1], 3)
    to_persuadee = [m for m in seen if m[0]["content"].startswith("Try it")]
    message = {"role": "user", "content": "Try it for a week."}
    assert to_persuadee == [[message]] * 2 + [
        [message, {"role": "system", "content": arena.FINAL_TURN_INSTRUCTION}]]
    assert record.turns == 3 and record.outcome == "PENDING"
    assert all(arena.FINAL_TURN_INSTRUCTION not in m["text"] for m in record.transcript)


def fake_generate(text):
    def generate(self, sids, *args, **kwargs):
        ids = models.encode(self.tokenizer, text) + [self.stop_ids[0]]
        for s in sids:
            self.append(s, ids[:-1])
            self.forward([s])
            self.append(s, ids[-1:])
        return [(list(ids), [0.0] * len(ids), "stop") for _ in sids]
    return generate


@pytest.mark.slow
def test_smollm2_plays_two_dialogues_end_to_end():
    """Integration: the real CPU default model, two one-turn dialogues of one scenario (a group:
    its prompts prefilled once), probes and all; the probe values the rollout read at b_0 equal
    forwards of the persuadee's prompt by transformers' own cache."""
    model, tokenizer = models.load_model("smollm2")
    scenarios = arena.load_scenarios(split="heldout")[:1]
    er, ee = (engine.Engine(model, tokenizer, num_blocks=256) for _ in range(2))  # ~2,000 tokens
    records = rollout.rollout_episodes(er, ee, scenarios, 1, group_size=2, max_new_tokens=8,
                                       seed=0)
    assert len(records) == 2 and records[0].transcript != records[1].transcript
    for r in records:
        assert r.transcript[0]["role"] == "persuader" and r.transcript[0]["text"]
        assert all(-1 <= b <= 1 for b in r.beliefs) and len(r.beliefs) == r.turns + 1
    assert len(er.cache.free_blocks) == er.cache.num_blocks
    ctx = models.chat_ids(tokenizer, arena.persuadee_messages(scenarios[0]), False)
    # (cache=True: the reference at a third of the plain forwards' cost on SmolLM2)
    torch.testing.assert_close(torch.tensor([records[0].probes[0]]),
                               probes.read_beliefs_reference(model, tokenizer, [ctx], cache=True),
                               atol=1e-4, rtol=0)


def judge_scores(judge, instances, transcripts, seed=0):
    """The local judge as rollout.judge_all calls it (its answer length read now)."""
    return local_judge.judge_scores(judge, instances, transcripts, seed,
                                    max_tokens=rollout.JUDGE_MAX_NEW_TOKENS,
                                    attempts=rollout.judge_attempts)


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
    assert judge_scores(judge, scenarios, transcripts) == ([1.0, 0.0], [False, True])
    assert sorted(attempts) == [0] + [1] * (1 + arena.JUDGE_RETRIES)  # greedy, then the retries
    assert judge.tokens_prefilled == sum(lengths) - 2  # prompts once; last tokens stay pending
    assert len(judge.cache.free_blocks) == 2000
    # two transcripts of one instance: their shared opening (profile) is prefilled only once
    judge.tokens_prefilled = 0
    attempts.clear()
    assert judge_scores(judge, [scenarios[0]] * 2, transcripts) == ([1.0, 0.0], [False, True])
    group = [models.chat_ids(tokenizer, arena.judge_messages(scenarios[0], t), True)
             for t in transcripts]
    shared = next(i for i, (a, b) in enumerate(zip(*group)) if a != b)
    assert shared > 100
    assert judge.tokens_prefilled == sum(map(len, group)) - shared - 2
    assert len(judge.cache.free_blocks) == 2000


# -----------------------------------------------------------------------------
# the scheduler: any pool that holds one episode, the same records


def play_on(pool, instances, tokenizer, max_active=None, **kw):
    """Six sampled episodes of three instances on pools of `pool` blocks of 16 tokens."""
    er = engine.Engine(tiny_model("llama"), tokenizer, block_size=16, num_blocks=pool)
    ee = engine.Engine(tiny_model("qwen3", seed=1), tokenizer, block_size=16, num_blocks=pool)
    generate, batches = er.generate, []
    er.generate = lambda sids, *a, **k: batches.append(len(sids)) or generate(sids, *a, **k)
    records = rollout.rollout_episodes(
        er, ee, instances, 3, group_size=2, seed=5, persuader_sampling=engine.Sampling(1.0),
        persuadee_sampling=engine.Sampling(0.9, top_p=0.95), max_new_tokens=6, judge=ee,
        max_active=max_active, **kw)
    assert er.free_blocks == pool and ee.free_blocks == pool  # every block came back
    assert max(batches, default=0) <= (max_active or len(instances) * 2)  # never more in play
    return records


def test_records_do_not_depend_on_the_pool_or_the_admission_size(tokenizer):
    """A pool that holds all six episodes, one that holds about one at a time (episodes wait and
    are preempted and replayed), and one episode at a time: token ids and transcripts equal,
    beliefs within 1e-5. A pool too small for one episode alone ends each one "cache"."""
    from conftest import short_scenario
    instances = [short_scenario(i) for i in range(1, 4)]
    big = play_on(4000, instances, tokenizer)
    assert {r.end_reason for r in big} == {"budget"}
    for records in (play_on(100, instances, tokenizer), play_on(4000, instances, tokenizer, 1)):
        for a, b in zip(big, records, strict=True):
            assert (a.ids, a.turn_ids, a.transcript) == (b.ids, b.turn_ids,
                                                                  b.transcript)
            torch.testing.assert_close(torch.tensor(a.beliefs), torch.tensor(b.beliefs),
                                       atol=1e-5, rtol=0)
            assert a.judge == b.judge
    assert {r.end_reason for r in play_on(40, instances, tokenizer)} == {"cache"}


def test_a_message_without_a_reply_is_masked_out_of_the_loss(tokenizer):
    """The persuadee's context fills during turn 2: the episode ends "context" with one turn
    scored; message 2 stays in the transcript, its sampled tokens carry turn id 0, and the
    advantages of one turn map onto the stream (an unmasked stream is refused, never a 0)."""
    from conftest import short_scenario
    inst = short_scenario(1)
    _, ee_prompt = rollout.prompt_ids(tokenizer, tokenizer, inst)
    er = engine.Engine(tiny_model("llama"), tokenizer, num_blocks=400)
    ee_model = tiny_model("qwen3", seed=1, max_position_embeddings=len(ee_prompt) + 70)
    ee = engine.Engine(ee_model, tokenizer, num_blocks=400)
    [r] = rollout.rollout_episodes(er, ee, [inst], 4, max_new_tokens=6,
                                   persuader_sampling=engine.GREEDY,
                                   persuadee_sampling=engine.GREEDY)
    assert r.end_reason == "context" and r.turns == 1 and len(r.beliefs) == 2
    assert [m["role"] for m in r.transcript][:3] == ["persuader", "persuadee", "persuader"]
    sampled = [t for t, lp in zip(r.turn_ids, r.logprobs) if lp != 0.0]
    first = sampled.index(0)  # message 1's tokens are tagged 1, message 2's are not
    assert set(sampled[:first]) == {1} and set(sampled[first:]) == {0} and len(sampled) > first
    ids = torch.tensor([r.turn_ids])
    assert rpo.batch_token_advantages(ids, [[0.5]]).sum() == 0.5 * sampled.count(1)
    unmasked = torch.tensor([[2 if lp != 0.0 and t == 0 else t
                              for t, lp in zip(r.turn_ids, r.logprobs)]])
    with pytest.raises(ValueError, match="turn id 0"):
        rpo.batch_token_advantages(unmasked, [[0.5]])


def test_a_prompt_longer_than_the_context_is_named_before_anything_runs(tokenizer):
    from conftest import short_scenario
    inst = short_scenario(2)
    short = tiny_model("llama", max_position_embeddings=256)
    er, ee = engine.Engine(short, tokenizer), engine.Engine(short, tokenizer)
    assert set(rollout.prompt_problems(er, ee, [inst])) == {inst["id"]}
    # the bound skips encoding only prompts that fit: at every context length around the
    # prompts' own, the problems equal those of the exact lengths
    lengths = [len(ids) for ids in rollout.prompt_ids(tokenizer, tokenizer, inst)]
    room = engine.MAX_NEW_TOKENS // rollout.PROMPT_ROOM_SHARE
    for max_len in range(min(lengths) + room - 2, max(lengths) + room + 3):
        side = SimpleNamespace(tokenizer=tokenizer, max_len=max_len)  # what prompt_problems reads
        exact = {inst["id"]} if max(lengths) + room > max_len else set()
        assert set(rollout.prompt_problems(side, side, [inst])) == exact, max_len
    # the room follows the max_new_tokens in use (--max-new-tokens), not the engine's default
    side = SimpleNamespace(tokenizer=tokenizer, max_len=max(lengths) + 10)
    assert set(rollout.prompt_problems(side, side, [inst], max_new_tokens=40 * rollout.PROMPT_ROOM_SHARE))
    assert not rollout.prompt_problems(side, side, [inst], max_new_tokens=10 * rollout.PROMPT_ROOM_SHARE)
    with pytest.raises(ValueError, match=f"prompt of {inst['id']} is \\d+ tokens"):
        rollout.rollout_episodes(er, ee, [inst], 2)
    assert er.free_blocks == er.cache.num_blocks


def test_one_judge_retry_policy_for_the_local_and_the_served_judge():
    """rollout.judge_attempts is the only retry loop: greedy, then arena.JUDGE_RETRIES sampled
    retries while nothing parses, then None (s falls back to 0); lab/judge.py and lab/served.py
    hold none of their own."""
    from pathlib import Path
    asked = []

    def answer(todo, sampling, attempt):
        asked.append((list(todo), sampling, attempt))
        return ["PROBING: 5\nFIT: 5\nADAPTATION: 5" if i == 0 and attempt == 1 else
                None if i == 1 else "no verdict" for i in todo]
    assert rollout.judge_attempts(answer, 3) == [2.0, None, None]
    assert [a[2] for a in asked] == list(range(1 + arena.JUDGE_RETRIES))
    assert asked[0][:2] == ([0, 1, 2], engine.GREEDY)
    assert asked[1][:2] == ([0, 1, 2], rollout.JUDGE_RETRY_SAMPLING) and asked[2][0] == [1, 2]
    here = Path(__file__).resolve().parent.parent
    for name in ("lab/judge.py", "lab/served.py"):
        assert "JUDGE_RETRIES" not in (here / name).read_text(), name


def test_the_judge_fits_any_pool_that_holds_one_transcript(tokenizer, monkeypatch):
    """On the smallest pool that judges the longest transcript alone (found by trying), a group
    of four and another instance are all judged, a group split across chunks, each as it is
    alone; on a pool one block smaller the longest falls back to 0 (counted) and the rest are
    judged. The answers are the engine's own generated tokens, replaced by a verdict afterwards."""
    real = engine.Engine.generate

    def generate(self, sids, *args, **kwargs):
        outs = real(self, sids, *args, **kwargs)  # the blocks are taken as in a real answer
        ids = models.encode(self.tokenizer, "PROBING: 5\nFIT: 4\nADAPTATION: 3") + [self.stop_ids[0]]
        return [(ids, [0.0] * len(ids), "stop") for _ in outs]
    monkeypatch.setattr(engine.Engine, "generate", generate)
    monkeypatch.setattr(rollout, "JUDGE_MAX_NEW_TOKENS", 8)
    model = tiny_model("llama")
    a, b = arena.load_scenarios(split="heldout")[:2]
    transcripts = [[{"role": "persuader", "text": "Hello. " * k}] for k in (1, 30, 60, 90)]
    longest = ([a], transcripts[-1:])

    def judged(num_blocks, instances, chats):
        judge = engine.Engine(model, tokenizer, block_size=16, num_blocks=num_blocks)
        scores, failed = judge_scores(judge, instances, chats, seed=3)
        assert len(judge.cache.free_blocks) == num_blocks
        return scores, failed
    low, high = 1, 400  # judged(high) holds, judged(low) does not
    assert judged(high, *longest) == ([1.0], [False]) and judged(low, *longest) == ([0.0], [True])
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if judged(mid, *longest)[1] == [False] else (mid, high)
    group = [a] * 4 + [b]
    chats = transcripts + [transcripts[0]]
    assert judged(high, group, chats) == ([1.0] * 5, [False] * 5)
    assert judged(high - 1, group, chats) == ([1.0] * 3 + [0.0, 1.0], [False] * 3 + [True, False])


def test_one_loop_drives_every_episode():
    """arena.Dialogue is constructed in rollout.py alone (lab.study_pair aside, which replays a
    person's recorded decisions to rebuild the contexts a model would have read, playing
    nothing): served, local, typed and the bench's Hugging Face baselines' episodes all go
    through rollout_episodes, and so do a hub's sessions (its SessionLoop, no rounds of its own)."""
    from pathlib import Path

    from lab import bench_baselines, sessions
    here = Path(__file__).resolve().parent.parent
    drivers = {str(p.relative_to(here)) for p in [*here.glob("*.py"), *here.glob("lab/*.py")]
               if "arena.Dialogue(" in p.read_text()}
    assert drivers == {"rollout.py", "lab/study_pair.py"}
    assert "def play_episodes" not in (here / "lab" / "served.py").read_text()
    assert "rollout.rollout_episodes" in calls_in(bench_baselines.play_dialogues)
    assert "rollout.rollout_episodes" in calls_in(sessions.SessionLoop.run)
    assert not hasattr(rollout, "play_round")


SIDES = ("rollout.EngineSide", "served.ServedSide", "play.PersonSide", "sessions.OutsideSide",
         "sessions.OutsidePersuadee", "sessions.SharedPrompts", "audit.ScriptedSide",
         "bench_baselines.HistorySide")  # every side there is, as Side's docstring names them


def test_every_side_conforms_to_the_one_side_protocol():
    """rollout.Side is declared once, each method annotated, and its docstring names every side
    there is; each of those has all of its methods and attributes (one dropped fails here)."""
    import importlib
    import inspect
    import typing

    methods = [name for name, v in vars(rollout.Side).items() if inspect.isfunction(v) and name[0] != "_"]
    assert methods == ["prompt", "room", "prefill", "start", "ready", "speak", "reply", "hear", "free"]
    for name in methods:
        hints = typing.get_type_hints(getattr(rollout.Side, name))
        params = set(inspect.signature(getattr(rollout.Side, name)).parameters) - {"self"}
        assert set(hints) == params | {"return"}, name
    assert typing.get_type_hints(rollout.Side.speak)["return"] == list[arena.Message]
    assert typing.get_type_hints(rollout.Side.reply)["return"] == list[arena.Reply]
    attributes = set(rollout.Side.__annotations__)
    assert attributes == {"tokenizer", "max_len", "eng"}
    from lab import play, sessions
    person = play.PersonSide(2, read=lambda prompt: "", write=lambda *a: None)
    doc = " ".join(rollout.Side.__doc__.split())
    for dotted in SIDES:
        module, name = dotted.split(".")
        assert (name if module == "rollout" else dotted) in doc, dotted
        owner = rollout if module == "rollout" else importlib.import_module(f"lab.{module}")
        cls = getattr(owner, name)
        side = sessions.SharedPrompts(person) if cls is sessions.SharedPrompts else cls  # wraps one
        assert [m for m in methods if not callable(getattr(side, m, None))] == [], name
        if "self.tokenizer" not in inspect.getsource(cls):  # else set per instance, from a model
            assert [a for a in attributes if not hasattr(side, a)] == [], name
    assert isinstance(person, rollout.Side) and isinstance(sessions.OutsideSide(None), rollout.Side)
    assert not isinstance(object(), rollout.Side)


def test_a_player_becomes_a_side_one_way_by_its_type(tokenizer, monkeypatch):
    """rollout.side: an engine (or a subclass of engine.Engine) plays as EngineSide, a
    served.ServedModel as ServedSide, anything else is taken as a side already; the judge is
    chosen the same way, and a judge of no registered type is refused in one line."""
    from lab import play, served

    class Recording(engine.Engine):
        pass
    model = tiny_model("llama")
    for eng in (engine.Engine(model, tokenizer, num_blocks=64),
                Recording(model, tokenizer, num_blocks=64)):
        made = rollout.side(eng, "persuadee", engine.GREEDY, 4, decision="logit")
        assert type(made) is rollout.EngineSide and made.eng is eng and made.decision == "logit"
    model_spec = served.ServedModel("openai:m@http://127.0.0.1:9/v1", key="k")
    made = rollout.side(model_spec, "persuader", engine.GREEDY, 4)
    assert type(made) is served.ServedSide and made.model is model_spec and made.eng is None
    person = play.PersonSide(2, read=lambda prompt: "", write=lambda *a: None)
    assert rollout.side(person, "persuader", engine.GREEDY, 4) is person
    asked = []
    for module in (local_judge, served):
        monkeypatch.setattr(module, "judge_scores", lambda judge, instances, *a, **k: asked.append(
            type(judge)) or ([1.0] * len(instances), [False] * len(instances)))
    for judge in (Recording(model, tokenizer, num_blocks=64), model_spec):
        assert rollout.judge_all(judge, [{}], [[]], 0, [0]) == ([1.0], [False])
    assert asked == [Recording, served.ServedModel]
    with pytest.raises(TypeError, match="a judge is an engine.Engine or a served.ServedModel"):
        rollout.judge_all(object(), [{}], [[]], 0, [0])
    with pytest.raises(ValueError, match="only a local persuadee has; use --decision tag"):
        rollout.side(model_spec, "persuadee", engine.GREEDY, 4, decision="belief")


SIDE_MEMBERS = {"prompt", "room", "prefill", "start", "ready", "speak", "reply", "hear", "free",
                "tokenizer", "max_len", "eng"}


def test_no_isinstance_or_hasattr_chooses_a_side():
    """No file of the method or lab/ asks what a side is: no isinstance against a side's class,
    no hasattr (or getattr with a default) of a Side member; rollout.py asks no isinstance or
    hasattr at all (side() and judge_scores choose by type, functools.singledispatch)."""
    import ast
    from pathlib import Path
    here = Path(__file__).resolve().parent.parent
    side_classes = {dotted.split(".")[1] for dotted in SIDES} | {"Side"}
    found = []
    for path in [*here.glob("*.py"), *here.glob("lab/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            where = f"{path.relative_to(here)}:{node.lineno}"
            if path.name == "rollout.py" and node.func.id in ("isinstance", "hasattr"):
                found.append(where)
            if node.func.id == "isinstance" and len(node.args) == 2:
                names = {getattr(n, "attr", getattr(n, "id", None)) for n in ast.walk(node.args[1])}
                found += [where] if names & side_classes else []
            if node.func.id == "hasattr" or node.func.id == "getattr" and len(node.args) == 3:
                name = node.args[1]
                if isinstance(name, ast.Constant) and name.value in SIDE_MEMBERS:
                    found.append(where)
    assert found == []


def test_an_engine_side_speaks_and_replies_in_typed_records(tokenizer):
    """EngineSide.speak returns an arena.Message a sequence (the engine's ids, log-probs and end
    reason, the text decoded), EngineSide.reply an arena.Reply whose probe values are those a
    second read of the closed context gives (probes.read_engine) and whose decision is the
    tag's; a served side answers in the same records, text only."""
    from lab import served
    inst = arena.load_scenarios(split="heldout")[0]
    eng = engine.Engine(tiny_model("llama", max_position_embeddings=8192), tokenizer,
                        num_blocks=1000)
    speaker = rollout.EngineSide(eng, "persuader", engine.GREEDY, 5)
    root = speaker.prefill(inst)
    [[sid]], _ = speaker.start([root], [1])
    [message] = speaker.speak([sid], [7])
    assert type(message) is arena.Message and 1 <= len(message.ids) <= 5
    assert message.text == tokenizer.decode(message.ids, skip_special_tokens=True).strip()
    assert len(message.logprobs) == len(message.ids) and message.reason in rollout.SPOKEN
    speaker.free(sid)
    replier = rollout.EngineSide(eng, "persuadee", engine.GREEDY, 5, decision="tag")
    [[sid]], [(b0, m0)] = replier.start([replier.prefill(inst)], [1])
    assert len(b0) == len(m0) == len(probes.PROBES)
    replier.hear(sid, "Hello [ACCEPT]")
    [reply] = replier.reply([sid], [3])
    assert type(reply) is arena.Reply and reply.decision == arena.parse_decision(reply.text)
    assert reply.decision_probs is None and reply.accept_prob is None
    again, mass = probes.read_engine(eng, [sid], with_mass=True)
    assert reply.probes == again[0].tolist() and reply.probe_mass == mass[0].tolist()
    replier.free(sid)
    assert eng.free_blocks == eng.cache.num_blocks

    class Answers:  # a served model's stand-in: one answer, no log-probs (no probe values)
        dropped = {"logprobs"}

        def map(self, requests):
            return [dict(text="Fine. [ACCEPT]", reason="stop")] * len(requests)
    persuader, persuadee = (served.ServedSide(Answers(), role, engine.GREEDY, 5)
                            for role in ("persuader", "persuadee"))
    [[sid]], _ = persuader.start([persuader.prefill(inst)], [1])
    assert persuader.speak([sid], [0]) == [arena.Message("Fine. [ACCEPT]", "stop")]
    [[sid]], _ = persuadee.start([persuadee.prefill(inst)], [1])
    persuadee.hear(sid, "Hello")
    assert persuadee.reply([sid], [0]) == [arena.Reply("Fine. [ACCEPT]", "ACCEPT", "stop",
                                                       [None] * 3, [None] * 3)]


def calls_in(function):
    """The dotted names a function's body calls (a.b(...) as "a.b", f(...) as "f")."""
    import ast
    import inspect
    import textwrap
    names = set()
    for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(function)))):
        if isinstance(node, ast.Call):
            f = node.func
            names.add(f.id if isinstance(f, ast.Name) else
                      f"{getattr(f.value, 'id', '?')}.{f.attr}" if isinstance(f, ast.Attribute) else "?")
    return names


def test_the_probes_are_read_three_calls_deep_from_rollout_episodes():
    """rollout_episodes -> the persuadee side's start (b_0) or reply (b_t) -> probes.read_engine
    (and, deciding by logits, probes.read_decisions): three functions from the loop to a read,
    no round function between; train.train calls rollout_episodes itself, the judge a line of
    the step of its own."""
    from persuarena import train
    assert {"rollout.rollout_episodes", "rollout.judge_episodes", "rpo.rewards",
            "rpo.advantages", "policy_update"} <= calls_in(train.train)
    assert {"persuadee.start", "persuadee.reply"} <= calls_in(rollout.rollout_episodes)
    assert "probes.read_engine" in calls_in(rollout.EngineSide.start)
    assert {"probes.read_engine", "probes.read_decisions"} <= calls_in(rollout.EngineSide.reply)
    assert "judge_all" not in calls_in(rollout.EpisodeLoop.__init__)


def test_the_frozen_roles_and_the_judge_share_one_sampling_owner():
    """One owner for the frozen roles' sampling, the cut-off end reasons, the yes/no
    instruction and the 256 new tokens; the persuader never truncates (pi_old exact)."""
    from lab import moves
    from lab import served
    from lab import presets
    assert all(ee is rollout.FROZEN_SAMPLING for _, ee in rollout.SAMPLING.values())
    # the judge's retries have their own value: editing the persuadee's sampling leaves them
    assert rollout.JUDGE_RETRY_SAMPLING == rollout.FROZEN_SAMPLING
    assert rollout.JUDGE_RETRY_SAMPLING is not rollout.FROZEN_SAMPLING
    assert all(er.top_p is None and er.top_k is None for er, _ in rollout.SAMPLING.values())
    assert not hasattr(served, "API_ERROR") and not hasattr(moves, "INSTRUCTION")
    assert arena.API_ERROR in arena.CUT_OFF and {"context", "cache"} <= set(arena.CUT_OFF)
    assert presets.preset_values("paper")["max_new_tokens"] == engine.MAX_NEW_TOKENS


def test_a_typed_line_that_is_not_utf8_is_typed_again_and_the_game_survives(tmp_path, monkeypatch):
    """eval.py --play: invalid UTF-8 (raised by a strict stdin, or kept as lone surrogates by a
    surrogateescape one) is said in one line and typed again; the game in progress goes on."""
    from lab import play
    monkeypatch.chdir(tmp_path)
    typed = iter([UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"),
                  "caf\udce9 au lait?", "Hello, could we talk about the appointment?", ""])

    def read(_):
        line = next(typed)
        if isinstance(line, Exception):
            raise line
        return line
    shown = []
    ep = play.play("heldout-001", "random:tiny-qwen3", seed=0, t_max=3, out_root="evals", read=read,
                   write=shown.append)
    assert [m["text"] for m in ep.transcript if m["role"] == "persuader"] == [
        "Hello, could we talk about the appointment?"]
    assert ep.end_reason == "stopped"
    said = [line for line in shown if "not valid UTF-8" in line]
    assert len(said) == 2 and all("\n" not in line for line in said)
    assert play.person_line(lambda _: "\ud800", shown.append, "") == ""  # bounded: then stopped


def test_the_terminal_reads_invalid_utf8_as_text_to_refuse():
    """typed_line on a real strict-UTF-8 stdin: the bad bytes come back as lone surrogates (no
    exception, no lost buffer), and the next line intact."""
    code = ("from lab import hardening, play\n"
            "a = play.typed_line(''); b = play.typed_line('')\n"
            "print(hardening.invalid_text(a) is not None, b)")
    p = subprocess.run([sys.executable, "-c", code], input=b"caf\xe9\nnext line\n", capture_output=True,
                       timeout=120, env={**os.environ, "PYTHONIOENCODING": "utf-8"}, cwd=os.path.dirname(
                           os.path.abspath(rollout.__file__)))
    assert p.returncode == 0, p.stderr.decode()[-2000:]
    assert p.stdout.decode().split() == ["True", "next", "line"]


def replayed(record, t_max):
    """The outcome, turns and end reason the arena's Dialogue gives the record's decisions."""
    ep = arena.Dialogue(t_max)
    for m in record.transcript:
        if m["role"] == "persuadee":
            ep.step(m["decision"])
    return ep.outcome, ep.turn, ep.end_reason


def test_logit_decisions_on_tiny_random_persuadees_move_outcomes(tokenizer, monkeypatch):
    """--decision logit: tiny random persuadees (which never write a tag) reach outcomes other
    than PENDING; each episode's recorded decisions, replayed through arena.Dialogue, give its
    outcome; and a replay with the same seed decides the same (the keyed stream)."""
    monkeypatch.setattr(rollout, "DECISION", "logit")
    scenarios = arena.load_scenarios(split="heldout")[:6]
    model = tiny_model("qwen3", seed=2, max_position_embeddings=8192)
    play = lambda: rollout.rollout_episodes(
        engine.Engine(tiny_model("llama", seed=1, max_position_embeddings=8192), tokenizer,
                      num_blocks=3000),
        engine.Engine(model, tokenizer, num_blocks=3000), scenarios, 3, group_size=2, seed=5,
        max_new_tokens=4, persuader_sampling=engine.Sampling(1.0))
    records = play()
    assert {r.outcome for r in records} - {"PENDING"}
    for r in records:
        assert replayed(r, 3) == (r.outcome, r.turns, r.end_reason)
    assert [r.outcome for r in play()] == [r.outcome for r in records]


from test_arena import SPENT_BUDGET_TABLE


@pytest.mark.parametrize("decisions, outcome", SPENT_BUDGET_TABLE + [
    (["REJECT", "REJECT"], "REJECT"), (["CONDITIONAL_ACCEPT", "ACCEPT"], "ACCEPT"),
    (["WALK_AWAY"], "WALK_AWAY"), ([None, "PENDING"], "PENDING")])
def test_logit_decisions_obey_the_arenas_transitions(decisions, outcome, tokenizer, monkeypatch):
    """Decisions read as logits go through the same state machine: scripted one-hot read-outs
    (the arena's transition table, T_max 3) end each episode as the table says."""
    monkeypatch.setattr(rollout, "DECISION", "logit")
    choices, script = list(arena.DECISION_WORDS), iter(decisions)
    monkeypatch.setattr(probes, "read_decisions", lambda eng, sids: torch.nn.functional.one_hot(
        torch.tensor([choices.index(next(script)) for _ in sids]), len(choices)).float())
    model = tiny_model("llama", max_position_embeddings=8192)
    er, ee = (engine.Engine(model, tokenizer, num_blocks=1000) for _ in range(2))
    [r] = rollout.rollout_episodes(er, ee, arena.load_scenarios(split="heldout")[:1], 3,
                                   max_new_tokens=3)
    assert r.outcome == outcome and r.turns == len(decisions)
    assert [m["decision"] for m in r.transcript if m["role"] == "persuadee"] == decisions



def test_belief_decisions_follow_the_persuadees_belief(tokenizer, monkeypatch):
    """--decision belief: an episode's decisions are ACCEPT or none and replay through
    arena.Episode to its outcome; a replay with the same seed decides the same; at a threshold
    far below every belief each episode accepts after its first reply, far above none does."""
    monkeypatch.setattr(rollout, "DECISION", "belief")
    scenarios = arena.load_scenarios(split="heldout")[:3]
    persuader = tiny_model("llama", seed=1, max_position_embeddings=8192)
    persuadee = tiny_model("qwen3", seed=2, max_position_embeddings=8192)
    play = lambda: rollout.rollout_episodes(
        engine.Engine(persuader, tokenizer, num_blocks=2000),
        engine.Engine(persuadee, tokenizer, num_blocks=2000), scenarios, 3, group_size=2, seed=5,
        max_new_tokens=3, persuader_sampling=engine.Sampling(1.0))
    beliefs = [b for r in play() for b in r.beliefs[1:]]
    monkeypatch.setattr(probes, "BELIEF_THRESHOLD", sorted(beliefs)[len(beliefs) // 2])
    records = play()
    assert {r.outcome for r in records} == {"ACCEPT", "PENDING"}
    for r in records:
        assert {m["decision"] for m in r.transcript if m["role"] == "persuadee"} <= {"ACCEPT", None}
        assert replayed(r, 3) == (r.outcome, r.turns, r.end_reason)
    assert [r.beliefs for r in play()] == [r.beliefs for r in records]
    monkeypatch.setattr(probes, "BELIEF_THRESHOLD", -10.0)
    assert {(r.outcome, r.turns) for r in play()} == {("ACCEPT", 1)}
    monkeypatch.setattr(probes, "BELIEF_THRESHOLD", 10.0)
    assert {(r.outcome, r.end_reason) for r in play()} == {("PENDING", "budget")}
