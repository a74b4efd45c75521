"""lab/cpu_bf16.py: the pi_old gap, the importance ratio at a first update between the log-probs
a rollout recorded and the trainer's, on tiny random models: exact statistics on known numbers,
a float32 rollout against the fp32 trainer (kernels apart alone: no gap to speak of), a bf16
rollout copy against the trainer under autocast (a gap, bounded)."""
import math

import pytest
import torch

from persuarena import rpo
from conftest import tiny_model
from lab import cpu_bf16

PROMPTS = [[5, 9, 13, 2, 7, 11, 4], [3, 8, 1, 6], [12, 14, 10, 2, 9, 5, 7, 3, 1]]


def test_gap_stats_on_known_log_probs():
    """Four tokens whose log-ratios are 0, ln 0.5, ln 1.5 and 0.1: the largest |log rho| is
    ln 2, the mean rho (1 + 0.5 + 1.5 + e^0.1) / 4, and two of four lie outside [0.8, 1.28]."""
    old = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    new = old + torch.tensor([0.0, math.log(0.5), math.log(1.5), 0.1], dtype=torch.float64).float()
    s = cpu_bf16.gap_stats(torch.bfloat16, old, new, clip_low=0.2, clip_high=0.28)
    assert s.dtype == "bfloat16" and s.tokens == 4
    assert s.max_abs_log_ratio == pytest.approx(math.log(2), abs=1e-6)
    assert s.mean_abs_log_ratio == pytest.approx((math.log(2) + math.log(1.5) + 0.1) / 4, abs=1e-6)
    assert s.mean_ratio == pytest.approx((1 + 0.5 + 1.5 + math.exp(0.1)) / 4, abs=1e-6)
    assert s.outside_clip_share == 0.5
    assert cpu_bf16.gap_stats("float32", old, old).outside_clip_share == 0.0
    default = cpu_bf16.gap_stats("float32", old, new)  # rpo's own clip: the same two outside
    assert default.outside_clip_share == 0.5 and rpo.CLIP_LOW == 0.2


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_float32_rollout_has_no_gap_and_a_bf16_one_a_bounded_gap(arch):
    """The engine's recorded log-probs against the trainer's full forward of the same tokens:
    in float32 within 1e-5 (every ratio 1 to rounding); a bf16 rollout copy against the fp32
    weights under autocast moves them (the gap is there, so bf16 ran) but by less than 0.1 in
    log-probability (0.02 here), no token outside the clip."""
    policy = tiny_model(arch)
    f32 = cpu_bf16.pi_old_gap(policy, PROMPTS, torch.float32, max_new_tokens=12, temperature=1.0)
    assert f32.tokens == 36 and f32.max_abs_log_ratio < 1e-5
    assert f32.mean_ratio == pytest.approx(1.0, abs=1e-4) and f32.outside_clip_share == 0.0
    bf16 = cpu_bf16.pi_old_gap(policy, PROMPTS, torch.bfloat16, max_new_tokens=12, temperature=1.0)
    assert bf16.tokens == 36
    assert 1e-3 < bf16.max_abs_log_ratio < 0.1 and bf16.outside_clip_share == 0.0
    assert next(policy.parameters()).dtype == torch.float32  # the policy itself untouched


def test_the_trainers_log_probs_are_a_log_softmax_at_the_sampled_ids():
    """trainer_logprobs in float32 equals log softmax(logits / T) of the plain forward, read at
    the ids that follow the prompt (an independent gather over the whole vocabulary)."""
    policy, prompt, ids = tiny_model("llama"), PROMPTS[0], [3, 17, 5]
    got = cpu_bf16.trainer_logprobs(policy, prompt, ids, 0.7, torch.float32)
    with torch.no_grad():
        logits = policy(torch.tensor([prompt + ids])).logits[0]
    want = [torch.log_softmax(logits[len(prompt) - 1 + j] / 0.7, -1)[t] for j, t in enumerate(ids)]
    torch.testing.assert_close(got, torch.stack(want), atol=1e-5, rtol=0)


def test_bad_counts_are_refused_in_one_line(capsys):
    """python -m lab.cpu_bf16 refuses a non-positive count or temperature before any model loads."""
    for argv in (["--openings", "0"], ["--max-new-tokens", "-1"], ["--temperature", "0"]):
        with pytest.raises(SystemExit):
            cpu_bf16.main(argv)
        err = capsys.readouterr().err.strip()
        assert err.startswith("lab.cpu_bf16: ") and "\n" not in err


def test_product_rates_name_every_layout_this_cpu_runs(monkeypatch):
    """product_rates times float32 plain and bf16 plain always, each packed layout where
    cpu_products packs it (bf16 packed only with oneDNN's bf16 kernels), and leaves the
    thread count as it found it."""
    monkeypatch.setattr(cpu_bf16.cpu_products, "onednn_bf16", lambda: False)
    threads = torch.get_num_threads()
    rates = cpu_bf16.product_rates(rows=(2,), repeats=1)
    assert torch.get_num_threads() == threads
    want = {"float32 plain, 2 rows", "bf16 plain, 2 rows"}
    if cpu_bf16.cpu_products.packs("cpu", torch.float32):
        want.add("float32 packed, 2 rows")
    assert set(rates) == want and all(v > 0 for v in rates.values())
