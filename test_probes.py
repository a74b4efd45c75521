"""Probe tests: the fork read-out against a plain full forward of context plus question."""
import pytest
import torch

import models
import probes
from conftest import tiny_model


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_probe_fork_read_matches_reference(arch, tokenizer, paths):
    """Both read-outs (the opening prefilled once and forked per question, a CPU's; each question
    whole in one forward, the padded path's) equal plain full forwards of context + question."""
    model = tiny_model(arch)
    contexts = [models.encode(tokenizer, models.render(tokenizer, msgs, False)) for msgs in [
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
