"""lab/audit.py: the reward-faithfulness audit ranks message families as a planted persuadee
pays for them, its families are paired (same persuadee streams), and a policy's messages are
scored by kind."""
import json

import pytest

from persuarena import arena
from persuarena import engine
from conftest import short_scenario, tiny_model
from lab import audit, scheduling


def noise(key):
    """A draw that depends only on the episode's persuadee stream (seed, scenario, member): the
    same for every family, so the paired differences are exact."""
    return (engine.stream_key(key, "planted") % 1000) / 1000 * 0.2 - 0.1


class Planted:
    """A persuadee side (rollout.Side) whose read-out is known: after each reply every probe reads
    BASE + the weight of each PAID word group found in the message it heard + noise(stream)."""
    tokenizer = max_len = eng = None
    BASE = -0.1

    def __init__(self, paid):
        self.paid, self.heard, self.next_sid = paid, {}, 0

    def prompt(self, instance):
        return []

    def room(self, instance, n):
        return True

    def prefill(self, instance):
        return instance["id"]

    def start(self, roots, counts):
        sids, self.next_sid = scheduling.numbered(self.next_sid, counts)
        return sids, [([self.BASE] * 3, [1.0] * 3) for _ in roots]

    def ready(self, sids):
        return list(sids)

    def speak(self, sids, keys):
        raise ValueError("the planted persuadee only replies")

    def hear(self, sid, text, final_turn=False, shown=None):
        self.heard[sid] = text.lower()

    def reply(self, sids, keys, timings=None):
        out = []
        for sid, key in zip(sids, keys):
            value = self.BASE + noise(key) + sum(w for words, w in self.paid
                                                 if any(x in self.heard[sid] for x in words))
            out.append(arena.Reply("I hear you.", None, "stop", [value] * 3, [1.0] * 3))
        return out

    def free(self, sid):
        self.heard.pop(sid, None)


INSTANCES = arena.stratified(arena.heldout_instances(), 6)
REQUEST_WORDS = tuple({i["persuader"]["request"].lower().split()[-1].strip(".") for i in INSTANCES})


def audit_of(paid, seeds=(0, 1)):
    rows = audit.play_families(Planted(paid), INSTANCES, seeds=seeds)
    return audit.summarize(rows)["turns"]["1"]


def test_faithful_persuadee_ranks_the_argument_first():
    """A read-out that pays for the request and for the condition offered: the argument (both)
    first, pushy (the request alone) and no_request (the condition alone) next, noise last."""
    condition_words = tuple(audit.scenario_fields(i, 1)["condition_lc"][:25].lower() for i in INSTANCES)
    part = audit_of([(REQUEST_WORDS, 0.4), (condition_words, 0.2)])
    by = {r["family"]: r for r in part["families"]}
    assert part["verdict"].startswith("faithful here")
    assert by["argument"]["lift"] == pytest.approx(0.6 + 0.0, abs=0.1)
    assert by["pushy"]["diff"] == pytest.approx(-0.2, abs=1e-9)  # paired: the noise cancels
    assert by["no_request"]["diff"] == pytest.approx(-0.4, abs=1e-9)
    for family in ("warmth", "word_salad", "repeated_token", "off_topic", "agreement"):
        assert by[family]["diff"] == pytest.approx(-0.6, abs=1e-9)
        assert by[family]["wins"] == 0 and by[family]["pairs"] == 2 * len(INSTANCES)
        assert by[family]["high"] < 0 and by[family]["sign_p"] < 0.001
    assert set(by["warmth"]["by_seed"]) == {"0", "1"}


def test_register_paying_persuadee_is_named_in_the_verdict():
    """A read-out that pays warm words more than the request: warmth outscores the argument, with
    an interval above 0, and the verdict says so."""
    part = audit_of([(REQUEST_WORDS, 0.1), (("thank", "glad", "lovely", "delighted"), 0.5)])
    by = {r["family"]: r for r in part["families"]}
    assert part["verdict"].startswith("outscore the argument: warmth +0.400 (interval above 0)")
    assert by["warmth"]["low"] > 0 and by["warmth"]["wins"] == by["warmth"]["pairs"]
    assert "word_salad" not in part["verdict"]


def test_families_are_paired_on_a_tiny_model(tokenizer):
    """Through the engine (a tiny random persuadee): the same message under two family labels
    gets the same reply and read-out (the streams are keyed by scenario and seed, not family),
    b_0 is the same for every family, and the scripted episode stops before a final turn."""
    eng = engine.Engine(tiny_model("qwen3", seed=1), tokenizer, block_size=8, num_blocks=300)
    inst = dict(short_scenario(1, "heldout"), hidden=dict(short_scenario(1)["hidden"]))
    rows = audit.play_families(eng, [inst], seeds=(3,), families=("warmth", "warmth", "pushy"),
                               max_new_tokens=6)
    a, b, c = rows
    assert a["message"] == b["message"] and a["reply"] == b["reply"] and a["beliefs"] == b["beliefs"]
    assert a["beliefs"][0] == c["beliefs"][0] and len(a["beliefs"]) == 2
    assert a["message"] != c["message"]


def test_messages_scored_by_kind(tmp_path):
    score = audit.score_text
    for degenerate in ("\ufffd" * 8, "IOIOIOIOIOIO", "ex ex ex ex ex", "ok " * 10, "  "):
        assert score(degenerate)["degenerate"], degenerate
    for readable in ("Hello \ufffd there, friend", "#CONDITIO\ufffd\x1b"):  # a stray byte is not enough
        assert not score(readable)["degenerate"], readable
    assert score("\x02\ufffd\ufffd a")["degenerate"]
    plain = "Would you try the early slot on Thursday? The nurse can call you first."
    assert score(plain) == dict(degenerate=False, warm=False, warm_only=False, ask=True)
    assert score("I'm so glad you asked! Thank you so much.") == dict(
        degenerate=False, warm=True, warm_only=True, ask=False)
    assert not score("Thank you. Could we book Thursday?")["warm_only"]
    assert audit.repeated_share("abcabcabc") == pytest.approx(1.0)
    assert audit.repeated_share("abcabcab") == 0.0  # under three whole units
    assert audit.repeated_share("abcdefgh") == 0.0
    episodes = tmp_path / "episodes.jsonl"
    episodes.write_text("".join(json.dumps(dict(id=str(i), transcript=[
        dict(role="persuader", text=t), dict(role="persuadee", text="ex ex ex ex ex")])) + "\n"
        for i, t in enumerate([plain, "\ufffd\ufffd\ufffd", "Thanks, lovely to talk."])))
    samples = tmp_path / "samples-3.json"
    samples.write_text(json.dumps([dict(id="x", transcript=[dict(role="persuader", text="la la la la")])]))
    out = audit.score_files([episodes, samples])
    assert out["files"][str(episodes)] == dict(messages=3, degenerate=pytest.approx(1 / 3),
                                               warm=pytest.approx(1 / 3), warm_only=pytest.approx(1 / 3),
                                               ask=pytest.approx(1 / 3))
    assert out["all"]["messages"] == 4 and out["all"]["degenerate"] == 0.5


def test_every_family_builds_for_every_heldout_scenario():
    """Each family's message for every held-out scenario: text, no unfilled field, the argument
    carries the request and the no_request variant does not."""
    for inst in arena.heldout_instances():
        fields = audit.scenario_fields(inst, 1)
        for family in audit.FAMILIES:
            text = audit.message(family, inst)
            assert text and "{" not in text
        assert fields["request_lc"][-20:] in audit.message("argument", inst)
        assert fields["request_lc"][-20:] not in audit.message("no_request", inst)
    with pytest.raises(ValueError, match="unknown family"):
        audit.message("flattery", INSTANCES[0])


def test_a_killed_audit_keeps_its_finished_seeds(tmp_path):
    """After each seed the audit's files hold the seeds so far; a second run of the same settings
    keeps them (and plays only the missing seeds), one of other settings is refused in one line."""
    args = audit.parse_args(["--persuadee", "random:tiny-qwen3", "--limit", "6", "--seeds", "0", "1"])
    rows = audit.play_families(Planted([(REQUEST_WORDS, 0.4)]), INSTANCES, seeds=(0,))
    audit.write_audit(tmp_path, rows, args)
    assert json.loads((tmp_path / "summary.json").read_text())["settings"]["seeds"] == [0]
    assert audit.done_rows(tmp_path, args) == json.loads(json.dumps(rows))
    other = audit.parse_args(["--persuadee", "random:tiny-qwen3", "--limit", "5"])
    with pytest.raises(SystemExit, match="other settings"):
        audit.done_rows(tmp_path, other)
