"""Probe tests: the fork read-out against a plain full forward of context plus question."""
import math

import pytest
import torch

from persuarena import engine
from persuarena import models
from persuarena import probes
from conftest import tiny_model
from test_engine import PROMPTS


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_probe_fork_read_matches_reference(arch, tokenizer, paths):
    """Both read-outs (the opening prefilled once and forked per question, a CPU's; each question
    whole in one forward, the padded path's) equal plain full forwards of context + question."""
    model = tiny_model(arch)
    contexts = [models.encode(tokenizer, models.render(tokenizer, msgs, False)) for msgs in [
        [{"role": "system", "content": "You are Ana, a nurse."}],
        [{"role": "system", "content": "You are Bo."}, {"role": "user", "content": "Could we book it?"},
         {"role": "assistant", "content": "I need to see the numbers first."}]]]
    eng = engine.Engine(model, tokenizer)
    fork, fork_mass = probes.read_beliefs(eng, contexts, with_mass=True)
    ref, ref_mass = probes.read_beliefs_reference(model, tokenizer, contexts, with_mass=True)
    assert fork.shape == (2, 3) == fork_mass.shape and (fork.abs() <= 1).all()
    assert ((fork_mass > 0) & (fork_mass <= 1)).all()
    torch.testing.assert_close(fork, ref, atol=1e-4, rtol=0)
    torch.testing.assert_close(fork_mass, ref_mass, atol=1e-5, rtol=0)
    torch.testing.assert_close(probes.read_beliefs(eng, contexts), fork, atol=0, rtol=0)
    assert eng.free_blocks == eng.cache.num_blocks  # every context and fork freed


def test_probe_value_is_yes_vs_no_probability(tokenizer):
    """v = 2p - 1 with p = P(yes ids) / (P(yes ids) + P(no ids)), computed directly."""
    logits = torch.randn(2, len(tokenizer))
    probs = logits.softmax(-1)
    yes = probs[:, probes.answer_ids(tokenizer, probes.YES_WORDS)].sum(-1)
    no = probs[:, probes.answer_ids(tokenizer, probes.NO_WORDS)].sum(-1)
    torch.testing.assert_close(probes.values_from_logits(logits, tokenizer, "prob"), 2 * yes / (yes + no) - 1)




def test_logodds_space_signs_and_mass_by_hand(tokenizer, monkeypatch):
    """logodds: v = clip(log P(yes) - log P(no), +-LOGODDS_CLIP) / LOGODDS_CLIP; a -1 sign flips
    that probe's column only; the mass is P(yes ids) + P(no ids) over the whole vocabulary."""
    yes_ids, no_ids = probes.answer_ids(tokenizer, probes.YES_WORDS), probes.answer_ids(tokenizer, probes.NO_WORDS)
    logits = torch.zeros(3, len(tokenizer))
    logits[0, yes_ids[0]] = 1.0   # one yes id a little ahead: small log-odds
    logits[1, no_ids[0]] = 30.0   # a near-certain No: saturates
    logits[2, 0] = 0.5            # Yes and No level (not a collapsed row, which reads NaN)
    probs = logits.softmax(-1)
    yes, no = probs[:, yes_ids].sum(-1), probs[:, no_ids].sum(-1)
    log_odds = (yes / no).log()
    expected = log_odds.clamp(-probes.LOGODDS_CLIP, probes.LOGODDS_CLIP) / probes.LOGODDS_CLIP
    torch.testing.assert_close(probes.values_from_logits(logits, tokenizer, "logodds"), expected)
    assert expected[1] == -1.0 and 0 < expected[0] < 1 and expected[2] == 0.0
    torch.testing.assert_close(probes.yes_no_mass(logits, tokenizer), yes + no)
    with pytest.raises(ValueError, match="PROBE_SPACE must be one of"):
        probes.values_from_logits(logits, tokenizer, "bits")
    monkeypatch.setitem(probes.PROBES, "PE", {**probes.PROBES["PE"], "sign": -1})
    values, mass = probes._readout(torch.cat([logits] * 2), tokenizer, 2)   # 2 reads of 3 questions
    plain = probes.values_from_logits(logits, tokenizer)
    torch.testing.assert_close(values[0], plain * torch.tensor([1.0, -1.0, 1.0]))
    torch.testing.assert_close(mass[1], yes + no)
    monkeypatch.setattr(probes, "PROBE_SPACE", "logodds")
    values, _ = probes._readout(logits, tokenizer, 1)
    torch.testing.assert_close(values[0], expected * torch.tensor([1.0, -1.0, 1.0]))


def test_overflowed_or_collapsed_logits_read_as_nan(tokenizer):
    """An overflowing persuadee (inf or NaN logits) or a collapsed one (all logits equal, which
    would read as exactly 0) gives NaN, never a silent value; other rows are untouched."""
    logits = torch.randn(4, len(tokenizer))
    logits[1, 7] = float("inf")
    logits[2, 3] = float("nan")
    logits[3] = 0.5
    v = probes.values_from_logits(logits, tokenizer)
    assert torch.isfinite(v[0]) and v[1:].isnan().all()
    assert v[0] == probes.values_from_logits(logits[:1], tokenizer)[0]


def test_a_probe_read_on_a_nearly_full_pool_fits_its_forks_or_says_so(tokenizer):
    """Free blocks for one sequence's forks at a time: the reads go one by one and equal the
    reference; fewer than one read needs: a clear error, nothing changed (no IndexError)."""
    model = tiny_model("qwen3")
    contexts = [PROMPTS[0], PROMPTS[2], PROMPTS[1] + [9, 9]]
    eng = engine.Engine(model, tokenizer, block_size=4, num_blocks=200)
    sids = [eng.new(c) for c in contexts]
    eng.forward(sids)
    need = probes.read_blocks(eng)
    filler = eng.new([5] * 4 * (eng.free_blocks - need - need // 2))
    eng.forward([filler])  # leaves room for one read, not two
    assert need <= eng.free_blocks < 2 * need
    torch.testing.assert_close(probes.read_engine(eng, sids),
                               probes.read_beliefs_reference(model, tokenizer, contexts),
                               atol=1e-4, rtol=0)
    eng.free(filler)
    filler = eng.new([5] * 4 * (eng.free_blocks - need + 1))
    eng.forward([filler])
    free, tables = eng.free_blocks, {s: list(eng.cache.tables[s]) for s in sids}
    with pytest.raises(RuntimeError, match=f"takes up to {need} KV blocks"):
        probes.read_engine(eng, sids)
    assert eng.free_blocks == free and {s: eng.cache.tables[s] for s in sids} == tables


def test_the_vocabulary_reference_counts_every_answer_token(tokenizer):
    """vocabulary_answer_ids holds every token that reads "yes" or "no" whatever its case or
    spacing (here two added ones), and the reference read-out sums over them, by hand."""
    tok = models.tiny_tokenizer()
    tok.add_tokens(["YES", " NO"])
    yes_ids, no_ids = probes.vocabulary_answer_ids(tok)
    big_yes, big_no = tok.convert_tokens_to_ids("YES"), tok.convert_tokens_to_ids(" NO")
    assert big_yes in yes_ids and big_no in no_ids
    assert all(tok.decode([i]).strip().lower() == "yes" for i in yes_ids)
    assert all(tok.decode([i]).strip().lower() == "no" for i in no_ids)
    logits = torch.zeros(1, len(tok))
    logits[0, big_yes] = 3.0  # the model answers "YES", a spelling the four words miss
    p = logits.softmax(-1)[0]
    p_yes, p_no = p[list(yes_ids)].sum(), p[list(no_ids)].sum()
    expected = 2 * p_yes / (p_yes + p_no) - 1
    got = probes.values_from_logits(logits, tok, "prob", probes.vocabulary_answer_ids(tok))
    torch.testing.assert_close(got[0], expected)
    assert got[0] > probes.values_from_logits(logits, tok, "prob")[0] + 0.5


def test_probe_signs_parse_from_a_flag():
    import argparse
    assert probes.parse_signs("PE=-1") == {**probes.probe_signs(), "PE": -1} == {"CA": 1, "PE": -1, "AC": 1}
    with pytest.raises(argparse.ArgumentTypeError, match="NAME one of CA, PE, AC"):
        probes.parse_signs("XX=2")


def test_gpu_path_probe_read_has_no_math_only_call_and_matches_reference(tokenizer, monkeypatch):
    """A probe read on the GPU's code path (COMPUTE_BOUND_DEVICES emptied, each question's fork
    whole in one forward) on a grouped-query model: no SDPA call only MATH runs, and the
    read-outs equal plain full forwards."""
    from test_fastpath import math_only, record_sdpa
    model = tiny_model("qwen3")
    contexts = [PROMPTS[0], PROMPTS[2], PROMPTS[1] + [9, 9]]
    ref = probes.read_beliefs_reference(model, tokenizer, contexts)
    monkeypatch.setattr(engine, "COMPUTE_BOUND_DEVICES", ())
    calls = record_sdpa(monkeypatch)
    fork = probes.read_beliefs(engine.Engine(model, tokenizer, block_size=16), contexts)
    assert calls and not [c for c in calls if math_only(c)]
    torch.testing.assert_close(fork, ref, atol=1e-4, rtol=0)


def test_read_beliefs_reads_many_contexts_in_chunks_its_pool_takes(tokenizer):
    """read_beliefs on an engine whose pool holds about two contexts and their forks: all five
    read (in admitted chunks), equal the reference, and leave the pool as it was; a context
    that cannot fit even alone is refused in one line."""
    model = tiny_model("llama")
    contexts = [PROMPTS[2], PROMPTS[0], PROMPTS[2][::-1], PROMPTS[1] + [9, 9], PROMPTS[0][::-1]]
    eng = engine.Engine(model, tokenizer, block_size=4, num_blocks=200)
    need = probes.read_blocks(eng)
    eng = engine.Engine(model, tokenizer, block_size=4, num_blocks=2 * (need + 15) + 4)
    fork, mass = probes.read_beliefs(eng, contexts, with_mass=True)
    ref, ref_mass = probes.read_beliefs_reference(model, tokenizer, contexts, with_mass=True)
    torch.testing.assert_close(fork, ref, atol=1e-4, rtol=0)
    torch.testing.assert_close(mass, ref_mass, atol=1e-5, rtol=0)
    assert eng.free_blocks == eng.cache.num_blocks
    small = engine.Engine(model, tokenizer, block_size=4, num_blocks=need + 3)
    with pytest.raises(RuntimeError, match="context 0 .60 tokens. and its probe forks take"):
        probes.read_beliefs(small, contexts)


def test_evaluation_fidelity_reads_on_the_persuadees_pool(tmp_path, monkeypatch):
    """The evaluation's fidelity check when a fresh default pool would hold about two contexts
    (engine.CACHE_GB_CPU made small): it reads on the persuadee's own engine, finishes, and
    equals the reference."""
    from persuarena import arena
    from persuarena import eval as evaluation
    model, tok = models.load_model("random:tiny-qwen3")
    engines = [engine.Engine(model, tok, num_blocks=600) for _ in range(2)]
    context = len(models.chat_ids(tok, arena.persuadee_messages(arena.heldout_instances()[0]),
                                  False))
    monkeypatch.setattr(engine, "CACHE_GB_CPU", 2 * context * engines[0].token_bytes / 2**30)
    summary = evaluation.evaluate(*engines, arena.heldout_instances()[:3], tmp_path / "run", t_max=2,
                          fidelity=6, max_new_tokens=6)
    assert summary["probe_fidelity"]["n"] == 6 * 3
    assert summary["probe_fidelity"]["max_abs_diff"] < 1e-4
    assert all(eng.free_blocks == 600 for eng in engines)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_decision_fork_read_matches_reference(arch, tokenizer, paths):
    """The logit decision's probabilities over arena.DECISION_WORDS, read in a fork, equal a plain
    full forward of context + decision question, and are the choices' first-token probabilities
    renormalised (by hand from the reference's logits)."""
    model = tiny_model(arch, max_position_embeddings=4096)
    contexts = [models.encode(tokenizer, models.render(tokenizer, msgs, False)) for msgs in [
        [{"role": "system", "content": "You are Ana, a nurse."}],
        [{"role": "system", "content": "You are Bo."}, {"role": "user", "content": "Could we book it?"},
         {"role": "assistant", "content": "I need to see the numbers first."}]]]
    eng = engine.Engine(model, tokenizer)
    sids = [eng.new(c) for c in contexts]
    eng.forward(sids)
    fork = probes.read_decisions(eng, sids)
    free = eng.free_blocks
    ref = probes.read_decisions_reference(model, tokenizer, contexts)
    assert fork.shape == (2, len(probes.decision_ids(tokenizer)[1])) and free == eng.free_blocks
    torch.testing.assert_close(fork, ref, atol=1e-5, rtol=0)
    turn, own = probes.decision_ids(tokenizer)
    with torch.no_grad():
        p = model(torch.tensor([contexts[1] + turn])).logits[0, -1].softmax(-1)
    by_hand = torch.stack([p[list(ids)].sum() for ids in own])
    torch.testing.assert_close(ref[1], by_hand / by_hand.sum(), atol=1e-5, rtol=0)
    assert all(not set(a) & set(b) for a in own for b in own if a is not b)


def test_a_fourth_probe_is_one_edit_in_the_probes_dict(tmp_path, short_scenarios, monkeypatch,
                                                      figures):
    """A probe added to probes.PROBES alone: a tiny training run (with its held-out evaluation)
    and a tiny evaluation complete, and every read-out of every episode holds four values, the
    fourth signed by the new probe's own sign; the records, summaries and figures follow."""
    import json

    from persuarena import eval as evaluation
    from persuarena import rollout
    from persuarena import train
    from lab import records
    monkeypatch.setitem(probes.PROBES, "XT", dict(
        question="Would you rather end this conversation now?", sign=-1, title="wants out (XT)"))
    played = []
    original = rollout.rollout_episodes

    def spy(*args, **kwargs):
        played.extend(out := original(*args, **kwargs))
        return out
    monkeypatch.setattr(rollout, "rollout_episodes", spy)
    monkeypatch.chdir(tmp_path)
    train.main(["--preset", "tiny", "--judge", "none", "--save-every", "1000", "--scenarios",
                short_scenarios, "--out", str(tmp_path / "runs"), "--name", "four", "--steps", "1",
                "--eval-every", "1", "--eval-limit", "1"])
    trained = len(played)
    evaluation.main(["--persuader", "random:tiny-qwen3", "--persuadee", "random:tiny-qwen3", "--limit", "1",
               "--t-max", "2", "--max-new-tokens", "3", "--name", "four", "--judge", "none"])
    assert trained and len(played) > trained  # training rollouts and both evaluations ran
    rows = [row for ep in played for row in ep.probes]
    assert rows and all(row is not None and len(row) == 4 for row in rows)
    for folder in (tmp_path / "runs" / "four" / "eval-1", tmp_path / "evals" / "four"):
        saved = records.load_episodes(folder)  # the record's columns: four, checked on reading
        assert all(len(row) == 4 for ep in saved for row in ep.probes)
        summary = json.loads((folder / "summary.json").read_text())
        assert (folder / "probes.png").is_file() and summary
    # the fourth value is the new question's read-out under its sign, as the reference reads it
    model, tok = models.random_model("tiny-qwen3")
    context = models.chat_ids(tok, [{"role": "system", "content": "You are Ana."}], False)
    signed = probes.read_beliefs_reference(model, tok, [context])
    monkeypatch.setitem(probes.PROBES, "XT", {**probes.PROBES["XT"], "sign": 1})
    assert signed[0, 3] == -probes.read_beliefs_reference(model, tok, [context])[0, 3]


def test_reference_and_vocabulary_read_outs_come_from_one_forward_each(tokenizer):
    """probes.read_beliefs_references: one forward per context plus one per question on a copy
    of its KV cache (counted) gives both the answer words' values and the whole vocabulary's,
    each equal to its own read_beliefs_reference with cache=True, and within 1e-5 of the plain
    forwards of each context and question (counted too)."""
    model = tiny_model("llama")
    contexts = [models.encode(tokenizer, models.render(tokenizer, msgs, False)) for msgs in [
        [{"role": "system", "content": "You are Ana, a nurse."}],
        [{"role": "system", "content": "You are Bo."}, {"role": "user", "content": "Could we book it?"}]]]
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    words, vocabulary = probes.read_beliefs_references(model, tokenizer, contexts)
    assert len(calls) == len(contexts) * (1 + len(probes.PROBES))
    torch.testing.assert_close(words, probes.read_beliefs_reference(model, tokenizer, contexts,
                                                                    cache=True), atol=0, rtol=0)
    torch.testing.assert_close(vocabulary, probes.read_beliefs_reference(
        model, tokenizer, contexts, vocabulary=True, cache=True), atol=0, rtol=0)
    assert not torch.equal(words, vocabulary)  # the two read-outs differ: both were computed
    calls.clear()  # the plain forwards: one per context and question
    plain = probes.read_beliefs_reference(model, tokenizer, contexts)
    assert len(calls) == len(contexts) * len(probes.PROBES)
    torch.testing.assert_close(words, plain, atol=1e-5, rtol=0)
    torch.testing.assert_close(vocabulary, probes.read_beliefs_reference(
        model, tokenizer, contexts, vocabulary=True), atol=1e-5, rtol=0)


def test_belief_acceptance_probability_against_hand_computed_values():
    """p = sigmoid((b - threshold) / temperature): b 0.13 at threshold 0.10, temperature 0.02 is
    sigmoid(1.5) = 0.8175744761936437 (by hand); symmetric about the threshold; no overflow far
    from it; an absent belief never accepts."""
    assert probes.belief_accept_prob(0.13, 0.10, 0.02) == pytest.approx(0.8175744761936437, abs=1e-12)
    assert probes.belief_accept_prob(0.07, 0.10, 0.02) == pytest.approx(1 - 0.8175744761936437, abs=1e-12)
    assert probes.belief_accept_prob(0.10, 0.10, 0.02) == 0.5
    assert probes.belief_accept_prob(-1.0, 0.5, 1e-4) == 0.0 and probes.belief_accept_prob(1.0, -0.5, 1e-4) == 1.0
    assert probes.belief_accept_prob(None) == 0.0
    z = (0.05 - probes.BELIEF_THRESHOLD) / probes.BELIEF_TEMPERATURE  # the constants are the defaults
    assert probes.belief_accept_prob(0.05) == pytest.approx(1 / (1 + math.exp(-z)))


def test_belief_decisions_are_keyed_draws_at_the_acceptance_probability(monkeypatch):
    """The draw is a pure function of (stream key, position): the same rows give the same
    decisions, alone or beside others (batch-invariant); over many streams ACCEPT comes at the
    rate p sets (b at threshold + temperature * logit(0.3): p 0.3), and p 0 or 1 never / always."""
    monkeypatch.setattr(probes, "BELIEF_THRESHOLD", 0.1)
    monkeypatch.setattr(probes, "BELIEF_TEMPERATURE", 0.02)
    n, b = 4000, 0.1 + 0.02 * math.log(0.3 / 0.7)
    keys, positions = [(7, f"inst-{i}", i % 8) for i in range(n)], [40 + i % 13 for i in range(n)]
    decisions, p = probes.belief_decisions([b] * n, keys, positions)
    assert p[0] == pytest.approx(0.3) and set(decisions) == {"ACCEPT", None}
    assert abs(decisions.count("ACCEPT") / n - 0.3) < 0.03  # 4.1 binomial sd
    assert probes.belief_decisions([b] * n, keys, positions)[0] == decisions
    assert [probes.belief_decisions([b], [k], [q])[0][0] for k, q in
            zip(keys[:50], positions[:50])] == decisions[:50]
    assert probes.belief_decisions([1.0, -1.0, None], keys[:3], positions[:3])[0] == ["ACCEPT", None, None]
    assert probes.belief_decisions([], [], []) == ([], [])
