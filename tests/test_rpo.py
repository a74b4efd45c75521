"""Tests for rpo.py. Expected values are worked out by hand in each test, never read off the code."""
import math
import statistics

import pytest
import torch
from hypothesis import given, settings, strategies as st

from persuarena import rpo
from persuarena.rollout import Episode
from lab import steps
from conftest import token_logprobs

EPS = rpo.STD_EPS


def close(a, b, tol=1e-9):
    """Nested lists of floats equal within tol, with the same ragged shape."""
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(close(x, y, tol) for x, y in zip(a, b))
    return abs(a - b) <= tol


# -----------------------------------------------------------------------------
# rewards

@pytest.fixture
def pooled_baseline(monkeypatch):
    """The dense term's baseline pooled over every turn of the group (rpo.DENSE_BASELINE "pooled",
    the ablation): the by-hand figures of the tests that use it are pooled means."""
    monkeypatch.setattr(rpo, "DENSE_BASELINE", "pooled")


def test_process_rewards_without_anchor():
    r = rpo.process_rewards([0.0, 0.4, -0.2, 0.6], "ACCEPT", anchor=False)
    assert close(r, [0.2, -0.3, 0.4])
    assert close(sum(r), (0.6 - 0.0) / 2)  # telescopes to (b_T - b_0) / 2


def test_process_rewards_anchor_replaces_last_belief():
    beliefs = [0.0, 0.4, -0.2, 0.6]
    for outcome, anchor in rpo.ANCHOR_BELIEF.items():
        r = rpo.process_rewards(beliefs, outcome, anchor=True)
        # the earlier rewards are untouched; the last is (anchor - (-0.2)) / 2
        assert close(r, [0.2, -0.3, (anchor + 0.2) / 2])
        assert close(sum(r), (anchor - 0.0) / 2)
    default = [0.2, -0.3, (rpo.ANCHOR_BELIEF["ACCEPT"] + 0.2) / 2] if rpo.ANCHOR else [0.2, -0.3, 0.4]
    assert close(rpo.process_rewards(beliefs, "ACCEPT"), default)


def test_accept_and_conditional_at_one_belief_same_dense_return_unless_anchored():
    """DECISIONS.md: Terminal anchor: the default dense return is accept-blind (the paper's 0.479 vs 0.461); the anchor
    ablation separates the two outcomes by lambda * the anchor gap / 2."""
    beliefs = [-0.96, -0.2, 0.5, 0.9]
    lam = 0.5
    raw = lam * (0.9 + 0.96) / 2
    for outcome in ("ACCEPT", "CONDITIONAL_ACCEPT"):
        assert rpo.dense_return(beliefs, outcome, anchor=False, lam=lam) == pytest.approx(raw)
    accept = rpo.dense_return(beliefs, "ACCEPT", anchor=True, lam=lam)
    conditional = rpo.dense_return(beliefs, "CONDITIONAL_ACCEPT", anchor=True, lam=lam)
    gap = rpo.ANCHOR_BELIEF["ACCEPT"] - rpo.ANCHOR_BELIEF["CONDITIONAL_ACCEPT"]
    assert accept - conditional == pytest.approx(lam * gap / 2)
    assert accept == pytest.approx(lam * (rpo.ANCHOR_BELIEF["ACCEPT"] + 0.96) / 2)
    # a group of the two: with the default reward their dense advantages are equal
    process = [rpo.process_rewards(beliefs, o) for o in ("ACCEPT", "CONDITIONAL_ACCEPT")]
    if not rpo.ANCHOR:
        assert process[0] == process[1]
    anchored = [rpo.process_rewards(beliefs, o, anchor=True) for o in ("ACCEPT", "CONDITIONAL_ACCEPT")]
    A = rpo.group_advantages([0.0, 0.0], anchored, lam=lam)  # outcome term 0: dense only
    assert A[0][-1] - A[1][-1] == pytest.approx(lam * gap / 2)


def test_negative_process_share_uses_measured_beliefs():
    # changes: +.4 -.6 +.8 | -.2 | (none) | 0 -> 2 negative of 5 turns; an anchor would not change it
    episodes = [[0.0, 0.4, -0.2, 0.6], [0.1, -0.1], [0.3], [0.5, 0.5]]
    assert rpo.negative_process_share(episodes) == pytest.approx(2 / 5)
    assert rpo.negative_process_share([]) == 0.0


def test_process_rewards_short_episodes():
    assert rpo.process_rewards([0.3], "PENDING") == []  # T = 0
    assert close(rpo.process_rewards([0.2, 0.9], "PENDING", anchor=True),
                 [(rpo.ANCHOR_BELIEF["PENDING"] - 0.2) / 2])
    assert close(rpo.process_rewards([0.2, 0.9], "PENDING", anchor=False), [0.35])


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-1, 1), min_size=2, max_size=12))
def test_process_rewards_telescope(beliefs):
    r = rpo.process_rewards(beliefs, "REJECT", anchor=False)
    assert len(r) == len(beliefs) - 1
    assert abs(sum(r) - (beliefs[-1] - beliefs[0]) / 2) < 1e-9
    assert all(abs(x) <= 1 for x in r)


def test_outcome_reward():
    for outcome, goal in rpo.GOAL.items():
        for s in (-2.0, 0.0, 0.5, 2.0):
            assert rpo.outcome_reward(outcome, s) == goal + rpo.STRATEGY_WEIGHT * s


# -----------------------------------------------------------------------------
# advantages

def test_group_advantage_outcome_only_by_hand():
    # R = [3, 0, 0]: mean 1, deviations (2, -1, -1), var (4 + 1 + 1) / 2 = 3, std sqrt(3)
    s = math.sqrt(3) + EPS
    P = [[0.2, 0.3], [-0.1], [0.0, 0.1, -0.2]]
    A = rpo.group_advantages([3.0, 0.0, 0.0], P, lam=0.0)
    assert close(A, [[2 / s, 2 / s], [-1 / s], [-1 / s, -1 / s, -1 / s]], 1e-12)


@pytest.mark.usefixtures("pooled_baseline")
def test_group_advantage_dense_ragged_by_hand():
    s = math.sqrt(3) + EPS
    P = [[0.2, 0.3], [-0.1], [0.0, 0.1, -0.2]]
    # return-to-go: [0.5, 0.3], [-0.1], [-0.1, -0.1, -0.2]; pooled mean over 6 turns = 0.3 / 6 = 0.05
    # centred: [0.45, 0.25], [-0.15], [-0.15, -0.15, -0.25]; times lambda = 0.5
    A = rpo.group_advantages([3.0, 0.0, 0.0], P, lam=0.5)
    assert close(A, [[2 / s + 0.225, 2 / s + 0.125], [-1 / s - 0.075],
                     [-1 / s - 0.075, -1 / s - 0.075, -1 / s - 0.125]], 1e-12)
    default = rpo.group_advantages([3.0, 0.0, 0.0], P)  # default lambda: the same terms scaled by it
    assert close(default, [[2 / s + rpo.LAMBDA * 0.45, 2 / s + rpo.LAMBDA * 0.25], [-1 / s - rpo.LAMBDA * 0.15],
                           [-1 / s - rpo.LAMBDA * 0.15, -1 / s - rpo.LAMBDA * 0.15, -1 / s - rpo.LAMBDA * 0.25]], 1e-12)


def test_group_advantage_dense_turn_baseline_by_hand(monkeypatch):
    """DENSE_BASELINE "turn": each turn index's own mean over the episodes that reached it."""
    monkeypatch.setattr(rpo, "DENSE_BASELINE", "turn")
    s = math.sqrt(3) + EPS
    P = [[0.2, 0.3], [-0.1], [0.0, 0.1, -0.2]]
    # return-to-go: [0.5, 0.3], [-0.1], [-0.1, -0.1, -0.2]; turn means: t1 (0.5 - 0.1 - 0.1) / 3 =
    # 0.1, t2 (0.3 - 0.1) / 2 = 0.1, t3 -0.2 (one episode); centred [0.4, 0.2], [-0.2], [-0.2, -0.2, 0]
    A = rpo.group_advantages([3.0, 0.0, 0.0], P, lam=0.5)
    assert close(A, [[2 / s + 0.2, 2 / s + 0.1], [-1 / s - 0.1], [-1 / s - 0.1, -1 / s - 0.1, -1 / s]], 1e-12)
    # members whose beliefs moved alike at every turn get no dense advantage at all (pooled, they
    # would: D = [-0.1, -0.2] twice, pool -0.15, so +0.05 on turn 1 and -0.05 on turn 2)
    assert rpo.group_advantages([0.0, 0.0], [[0.1, -0.2], [0.1, -0.2]], lam=1) == [[0.0, 0.0], [0.0, 0.0]]
    # a group of one has no baseline at any turn: no dense advantage (and no outcome advantage)
    assert rpo.group_advantages([1.0], [[0.3, 0.2]], lam=1) == [[0.0, 0.0]]


def test_lambda_zero_is_plain_grpo():
    R = [1.5, -2.0, 3.25, 0.0, 1.0]
    mean, std = statistics.mean(R), statistics.stdev(R)  # stdev: ddof = 1
    grpo = [(r - mean) / (std + EPS) for r in R]
    P1 = [[0.1], [0.4, -0.3], [], [0.2, 0.2, 0.2], [-0.5]]
    P2 = [[-0.9], [0.0, 0.7], [], [0.1, -0.1, 0.3], [0.5]]
    A1 = rpo.group_advantages(R, P1, lam=0.0)
    assert close(A1, [[g] * len(p) for g, p in zip(grpo, P1)], 1e-12)
    assert A1 == rpo.group_advantages(R, P2, lam=0.0)  # exactly: beliefs play no part at lambda 0


@pytest.mark.usefixtures("pooled_baseline")
def test_dead_group_rescued_by_dense_term():
    P = [[0.2], [-0.1], [0.3, 0.0]]
    assert rpo.group_advantages([1.0, 1.0, 1.0], P, lam=0.0) == [[0.0], [0.0], [0.0, 0.0]]
    # return-to-go [0.2], [-0.1], [0.3, 0.0]; pooled mean 0.4 / 4 = 0.1; centred [0.1], [-0.2], [0.2, -0.1]
    A = rpo.group_advantages([1.0, 1.0, 1.0], P, lam=0.5)
    assert close(A, [[0.05], [-0.1], [0.1, -0.05]], 1e-12)
    # equal beliefs everywhere: nothing to learn from
    assert close(rpo.group_advantages([2.0, 2.0], [[0.0], [0.0, 0.0]], lam=0.5), [[0.0], [0.0, 0.0]], 0.0)


@pytest.mark.usefixtures("pooled_baseline")
def test_group_of_one():
    assert rpo.group_advantages([3.0], [[0.1, 0.2]], lam=0.0) == [[0.0, 0.0]]
    # return-to-go [0.3, 0.2], pooled mean 0.25, centred [0.05, -0.05], times 0.5
    assert close(rpo.group_advantages([3.0], [[0.1, 0.2]], lam=0.5), [[0.025, -0.025]], 1e-12)
    assert close(rpo.group_advantages([3.0], [[0.4]], lam=0.5), [[0.0]], 0.0)


def step_diagnostics(groups, lam):
    """The diagnostics of one process's groups, as train.py pools them (rpo.diagnostics)."""
    return rpo.diagnostics(rpo.diagnostic_sums(groups, lam))


def test_token_advantages_maps_turns():
    ids = torch.tensor([[0, 0, 1, 1, 0, 2, 3, 3]])
    out = rpo.batch_token_advantages(ids, [[0.5, -1.0, 2.0]])
    assert out[0].tolist() == [0.0, 0.0, 0.5, 0.5, 0.0, -1.0, 2.0, 2.0]


def test_batch_token_advantages_ragged():
    ids = torch.tensor([[0, 1, 1, 0, 2, 2], [0, 0, 1, 0, 0, 0]])
    out = rpo.batch_token_advantages(ids, [[0.25, -0.75], [1.5]])
    assert out.tolist() == [[0.0, 0.25, 0.25, 0.0, -0.75, -0.75], [0.0, 0.0, 1.5, 0.0, 0.0, 0.0]]


# -----------------------------------------------------------------------------
# log-probs

@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_matches_naive(temperature):
    torch.manual_seed(0)
    logits = (3 * torch.randn(2, 6, 13)).requires_grad_()
    ids = torch.randint(0, 13, (2, 6))
    got = token_logprobs(logits, ids, temperature)
    naive = torch.log_softmax(logits[:, :-1] / temperature, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert got.shape == (2, 5)
    torch.testing.assert_close(got, naive, atol=1e-6, rtol=0)
    w = torch.randn(2, 5)
    g_got, = torch.autograd.grad((got * w).sum(), logits)
    g_naive, = torch.autograd.grad((naive * w).sum(), logits)
    torch.testing.assert_close(g_got, g_naive, atol=1e-6, rtol=0)


def test_token_logprobs_bf16_logits_give_float32():
    torch.manual_seed(1)
    logits = torch.randn(1, 4, 9).bfloat16()
    ids = torch.randint(0, 9, (1, 4))
    got = token_logprobs(logits, ids)
    assert got.dtype == torch.float32
    naive = torch.log_softmax(logits.float()[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(got, naive, atol=1e-6, rtol=0)


# -----------------------------------------------------------------------------
# loss

def grad_of_loss(logp, old, ref, adv, mask, n, **kw):
    logp = logp.clone().requires_grad_()
    loss, stats = rpo.policy_loss(logp, old, ref, adv, mask, n, **kw)
    g, = torch.autograd.grad(loss, logp)
    return loss, g, stats


def test_loss_gradient_on_policy_is_minus_advantage():
    logp = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-0.1, -4.0, -1.2, -0.7]])
    mask = torch.tensor([[True, True, False, True], [False, True, True, False]])
    old = torch.where(mask, logp, torch.full_like(logp, -1e4))  # garbage off the mask: exp would overflow
    adv = torch.tensor([[1.5, -2.0, 9.0, 0.7], [9.0, 3.0, -1.0, 9.0]])  # nonzero off the mask too
    n = 10  # global count (other ranks / micro-batches hold the rest)
    loss, g, stats = grad_of_loss(logp, old, None, adv, mask, n, beta=0.0)
    expected = [[-1.5 / n, 2.0 / n, 0.0, -0.7 / n], [0.0, -3.0 / n, 1.0 / n, 0.0]]
    torch.testing.assert_close(g, torch.tensor(expected), atol=1e-7, rtol=0)
    assert (g[~mask] == 0).all()
    assert abs(loss.item() - (-(1.5 - 2.0 + 0.7 + 3.0 - 1.0) / n)) < 1e-7
    assert stats["clip_frac"] == 0.0 and abs(stats["ratio_mean"] - 1.0) < 1e-7 and stats["kl"] == 0.0


def test_loss_clipping():
    ratio = torch.tensor([1.5, 1.5, 0.5, 0.5, 1.1])
    adv = torch.tensor([2.0, -2.0, -2.0, 2.0, 1.0])
    old = torch.zeros(5)
    logp = torch.log(ratio)
    mask = torch.ones(5, dtype=torch.bool)
    n = 5
    loss, g, stats = grad_of_loss(logp, old, None, adv, mask, n, beta=0.0, clip_low=0.2, clip_high=0.28)
    # d(-rho A)/d logp = -rho A where unclipped; zero where the clip binds (A > 0 above 1.28, A < 0 below 0.8)
    expected = [0.0, 1.5 * 2.0 / n, 0.0, -0.5 * 2.0 / n, -1.1 / n]
    torch.testing.assert_close(g, torch.tensor(expected), atol=1e-7, rtol=0)
    # per token: -1.28*2, -(-3), -(0.8*-2), -(0.5*2), -1.1  -> sum -0.06
    assert abs(loss.item() - (-2.56 + 3.0 + 1.6 - 1.0 - 1.1) / n) < 1e-6
    assert stats["clip_frac"] == 2 / 5
    assert abs(stats["ratio_mean"] - 5.1 / 5) < 1e-6


def test_k3_penalty():
    logp = torch.tensor([-1.0, -2.0, -0.5])
    delta = torch.tensor([0.0, math.log(2), -math.log(2)])  # ref - logp
    ref, adv, mask, n, beta = logp + delta, torch.zeros(3), torch.ones(3, dtype=torch.bool), 3, 0.5
    loss, g, stats = grad_of_loss(logp, logp, ref, adv, mask, n, beta=beta)
    # k3 = e^d - d - 1: 0, 1 - ln2 (> 0), 1/2 + ln2 - 1 (> 0); the two sum to 1/2
    k3 = [0.0, 1 - math.log(2), math.log(2) - 0.5]
    assert k3[1] > 0 and k3[2] > 0
    assert abs(loss.item() - beta * sum(k3) / n) < 1e-6
    assert abs(stats["kl"] - 0.5 / 3) < 1e-6
    # d k3 / d logp = 1 - e^d: 0, -1, 1/2
    torch.testing.assert_close(g, torch.tensor([0.0, -beta / n, 0.5 * beta / n]), atol=1e-7, rtol=0)
    loss0, g0, _ = grad_of_loss(logp, logp, None, adv, mask, n, beta=beta)  # no reference: no penalty
    assert loss0.item() == 0.0 and (g0 == 0).all()


def test_advantage_sign_flips_gradient():
    ratio = torch.tensor([0.9, 1.0, 1.2])  # inside [0.8, 1.28]: no clip for either sign
    adv = torch.tensor([1.0, -0.5, 2.0])
    logp, old, mask, n = torch.log(ratio), torch.zeros(3), torch.ones(3, dtype=torch.bool), 4
    clip = dict(beta=0.0, clip_low=0.2, clip_high=0.28)
    _, g_pos, _ = grad_of_loss(logp, old, None, adv, mask, n, **clip)
    _, g_neg, _ = grad_of_loss(logp, old, None, -adv, mask, n, **clip)
    torch.testing.assert_close(g_pos, torch.tensor([-0.9 / 4, 0.5 / 4, -2.4 / 4]), atol=1e-7, rtol=0)
    torch.testing.assert_close(g_neg, -g_pos, atol=1e-7, rtol=0)


def test_micro_batches_sum_to_full_batch():
    torch.manual_seed(2)
    logp = -torch.rand(5, 7) * 3
    old = logp + 0.3 * torch.randn(5, 7)
    ref = logp + 0.3 * torch.randn(5, 7)
    adv = torch.randn(5, 7)
    mask = torch.rand(5, 7) > 0.4
    n = int(mask.sum())
    whole, g_whole, _ = grad_of_loss(logp, old, ref, adv, mask, n)
    parts, grads = 0.0, []
    for sl in (slice(0, 2), slice(2, 5)):
        loss, g, _ = grad_of_loss(logp[sl], old[sl], ref[sl], adv[sl], mask[sl], n)
        parts, grads = parts + loss.item(), grads + [g]
    assert abs(parts - whole.item()) < 1e-6
    torch.testing.assert_close(torch.cat(grads), g_whole, atol=1e-7, rtol=0)


# -----------------------------------------------------------------------------
# diagnostics

@pytest.mark.usefixtures("pooled_baseline")
def test_step_diagnostics_by_hand():
    a = 1 / (math.sqrt(2) + EPS)  # R = [1, -1]: mean 0, std sqrt(2)
    groups = [
        ([1.0, -1.0], [[0.2], [-0.2]]),  # live; centred return-to-go +-0.2 -> dense +-0.1
        ([0.0, 0.0], [[0.4], [0.0, -0.2]]),  # dead; return-to-go 0.4 | -0.2, -0.2, pooled mean 0 -> rescued
        ([2.0, 2.0], [[0.1], [0.1]]),  # dead; both return-to-go equal the pool -> all zero
        ([3.0], [[-0.3]]),  # group of one, one turn -> dead, all zero
    ]
    d = step_diagnostics(groups, lam=0.5)
    assert d["dead_group_share"] == 3 / 4
    assert abs(d["dead_rescued_share"] - 1 / 3) < 1e-12
    # |dense|: 0.1 + 0.1 + 0.2 + 0.1 + 0.1 = 0.6; |A|: 2 (a + 0.1) + 0.4
    assert abs(d["dense_share"] - 0.6 / (2 * (a + 0.1) + 0.4)) < 1e-12
    # per turn (8 turns): |A_out| is a on the live group's 2 turns, else 0; |lam D~| sums to 0.6
    assert d["outcome_term_abs"] == pytest.approx(2 * a / 8) and d["dense_term_abs"] == pytest.approx(0.6 / 8)
    d0 = step_diagnostics(groups, lam=0.0)
    assert d0["dead_rescued_share"] == 0.0 and d0["dense_share"] == 0.0 and d0["dense_term_abs"] == 0.0
    assert d0["dead_group_share"] == 3 / 4


@pytest.mark.usefixtures("pooled_baseline")
def test_a_non_finite_belief_is_excluded_from_its_group_and_counted():
    """An episode whose probes gave NaN keeps its outcome advantage, gets no dense term and is
    left out of the pooled baseline: the others' advantages are those of the group without its
    dense returns; the diagnostics count it."""
    R = [3.0, 0.0, -1.0]
    P = [[0.1, 0.2], [float("nan"), 0.3], [-0.1]]
    A = rpo.group_advantages(R, P, 0.5)
    a_out, _ = rpo._group_terms(R, [[0.0, 0.0], [0.0, 0.0], [0.0]])
    pool = ((0.3 + 0.2) + (-0.1)) / 3  # return-to-go of the readable turns, pooled
    assert A[0] == pytest.approx([a_out[0] + 0.5 * (0.3 - pool), a_out[0] + 0.5 * (0.2 - pool)])
    assert A[1] == [a_out[1], a_out[1]]
    assert A[2] == pytest.approx([a_out[2] + 0.5 * (-0.1 - pool)])
    assert all(math.isfinite(x) for a in A for x in a)
    assert step_diagnostics([(R, P)], 0.5)["nonfinite_belief_share"] == pytest.approx(1 / 3)
    assert step_diagnostics([(R, [[0.1, 0.2], [0.0, 0.3], [-0.1]])], 0.5)["nonfinite_belief_share"] == 0


def test_diagnostic_sums_add_over_shards_and_count_identical_outcomes():
    """Sums of two shards (two ranks, or two steps) give the diagnostics of the whole; the
    goal-bucket dead share counts groups with identical outcomes, whatever their judge scores."""
    groups = [
        ([3.5, 3.0], [[0.2], [0.1]], [3.0, 3.0]),      # both ACCEPT, judges differ: live by R, dead by goal
        ([0.0, 0.0], [[0.4], [0.0, -0.2]], [0.0, 0.0]),  # dead both ways, rescued
        ([1.0, -1.0], [[0.2], [-0.2]], [1.0, -1.0]),   # live both ways
    ]
    whole = step_diagnostics(groups, lam=0.5)
    assert whole["dead_group_share"] == pytest.approx(1 / 3) and whole["dead_goal_share"] == pytest.approx(2 / 3)
    assert whole["dead_rescued_share"] == 1.0
    shards = [rpo.diagnostic_sums(groups[:1], 0.5), rpo.diagnostic_sums(groups[1:], 0.5)]
    assert rpo.diagnostics({k: shards[0][k] + shards[1][k] for k in rpo.DIAGNOSTIC_SUMS}) == pytest.approx(whole)
    # the mean of the shards' own ratios is not the pooled figure: shard 0 has no dead group
    own = [rpo.diagnostics(s)["dead_rescued_share"] for s in shards]
    assert sum(own) / 2 == 0.5 != whole["dead_rescued_share"]
    assert step_diagnostics([g[:2] for g in groups], 0.5)["dead_goal_share"] == 0.0  # no goals given


def test_collapsed_groups_count_identical_persuader_messages():
    """A group is collapsed when every member's persuader tokens (turn id > 0) are the same,
    whatever the persuadee's tokens (turn id 0) between them; groups of one are not counted."""
    ep = lambda said, heard=(9,): Episode(ids=[1, *said, *heard], turn_ids=[0, *[1] * len(said),
                                                                        *[0] * len(heard)])
    records = [ep([5, 6]), ep([5, 6], heard=(8, 8)),   # collapsed: only the persuadee differs
               ep([5, 6]), ep([5, 7]),                  # one token differs
               ep([5])]                                 # a group of one (the last, short group)
    assert rpo.collapsed_groups(records, 2) == (1, 2)
    assert rpo.collapsed_groups(records[:2], 2) == (1, 1)


# -----------------------------------------------------------------------------
# from episode records to the loss, without train.py

def record(outcome, judge, beliefs, end_reason="accept"):
    return Episode(outcome=outcome, judge=judge, beliefs=beliefs, end_reason=end_reason, id="x")


def test_advantages_from_records_by_hand():
    """Two groups of two records: R = GOAL + STRATEGY_WEIGHT * s; a None belief reads as NaN,
    which leaves the episode's dense term out of its group (and its outcome term in)."""
    recs = [record("ACCEPT", 1.0, [0.0, 0.4]), record("REJECT", 0.0, [0.0, -0.2]),
            record("PENDING", 0.0, [0.0, None]), record("PENDING", 2.0, [0.2, 0.2])]
    groups = rpo.rewards(recs, 2, anchor=False)
    per_episode = rpo.advantages(groups, lam=0.5)
    # group 1: R = 3.5, -1.0; std (ddof 1) = 4.5 / sqrt 2; A_out = +-(2.25 / std)
    a = 2.25 / (4.5 / math.sqrt(2) + EPS)
    # D = 0.2 and -0.1, pooled mean 0.05: D~ = 0.15, -0.15
    assert close(per_episode[:2], [[a + 0.5 * 0.15], [-a - 0.5 * 0.15]])
    # group 2: R = 0, 1; the first episode unreadable: dense 0, pooled over the second alone (D = 0)
    b = 0.5 / (math.sqrt(0.5) + EPS)
    assert close(per_episode[2:], [[-b], [b]])
    assert groups[0][0] == [3.5, -1.0] and groups[0][2] == [3.0, -1.0]
    assert math.isnan(groups[1][1][0][0])


def policy_and_reference(seed):
    """A tiny trainable policy and a frozen reference 0.02 noise away from it."""
    import copy

    from persuarena import models
    torch.manual_seed(seed)
    policy = models.random_model("tiny-llama")[0].requires_grad_(True)
    reference = copy.deepcopy(policy).requires_grad_(False)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return policy, reference


def kept_logits(share_stem):
    """The update's logits as train.py takes them (lab/steps.kept_logits), None: rpo's plain ones."""
    return None if share_stem is None else (
        lambda model, *a: steps.kept_logits(model, *a, share_stem=share_stem))


@pytest.mark.parametrize("share_stem", [None, False, True])
def test_micro_batch_loss_is_the_hand_loss_of_plain_forwards(share_stem):
    """rpo.micro_batch_loss on two right-padded records against the loss written out from plain
    full forwards of the policy and the reference (log_softmax over the whole vocabulary at T):
    the clipped surrogate plus KL_BETA * k3 on each persuader token, summed and divided by the
    global token count; the same value and the same gradients, shared prompt or not."""
    policy, reference = policy_and_reference(0)
    stem = torch.randint(3, 600, (6,)).tolist()
    ids = [stem + torch.randint(3, 600, (6,)).tolist(), stem + torch.randint(3, 600, (3,)).tolist()]
    turn_ids = [[0] * 6 + [1, 1, 0, 2, 2, 2], [0] * 6 + [1, 1, 1]]
    old = [[-7.0 + 0.1 * k if t else 123.0 for k, t in enumerate(row)] for row in turn_ids]
    recs = [Episode(ids=i, turn_ids=t, logprobs=o) for i, t, o in zip(ids, turn_ids, old)]
    advantages = [[0.7, -1.2], [0.4]]
    T, beta, low, high, N = 0.9, 0.05, 0.2, 0.28, 11  # N: more tokens than here (other ranks)
    loss, stats = rpo.micro_batch_loss(policy, reference, recs, advantages, N, temperature=T,
                                       clip_low=low, clip_high=high, beta=beta,
                                       logits=kept_logits(share_stem))
    loss.backward()
    got = {k: p.grad.clone() for k, p in policy.named_parameters()}
    policy.zero_grad()
    expected = 0.0
    for row, turns, sampled, adv in zip(ids, turn_ids, old, advantages):
        x = torch.tensor([row])
        logp = torch.log_softmax(policy(x).logits[0].float() / T, -1)
        with torch.no_grad():
            ref = torch.log_softmax(reference(x).logits[0].float() / T, -1)
        for k in range(1, len(row)):
            if not turns[k]:
                continue
            lp, rp, a = logp[k - 1, row[k]], ref[k - 1, row[k]], adv[turns[k] - 1]
            ratio = torch.exp(lp - sampled[k])
            surrogate = torch.maximum(-ratio * a, -ratio.clamp(1 - low, 1 + high) * a)
            d = rp - lp
            expected = expected + surrogate + beta * (torch.exp(d) - d - 1)
    expected = expected / N
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)
    assert stats["loss"] == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)
    assert stats["nonfinite"] == dict(logprobs=0, advantages=0, loss=0)
    for name, p in policy.named_parameters():
        assert (got[name] - p.grad).abs().max() <= 1e-5 * max(p.grad.abs().max(), 1e-8), name
    assert stats["kl"] > 0


def test_micro_batch_loss_counts_a_non_finite_log_prob():
    from persuarena import models
    policy = models.random_model("tiny-llama")[0]
    recs = [Episode(ids=[5, 6, 7, 8], turn_ids=[0, 1, 1, 0], logprobs=[0.0, math.nan, -1.0, 0.0])]
    loss, stats = rpo.micro_batch_loss(policy, None, recs, [[1.0]], 2, beta=0.0)
    assert stats["nonfinite"]["logprobs"] == 1


@pytest.mark.parametrize("first_kept", [9, 5])
def test_a_shared_prompt_runs_once_with_the_plain_forwards_logits_and_gradients(first_kept):
    """steps.kept_logits with share_stem: three right-padded rows whose first 12 tokens agree
    (a group's prompt). The prefix runs once, its keys and values repeated for the rows; the
    logits at the kept positions and every weight's gradient equal the plain forward's. The
    prefix stops at the first kept position (5: inside the shared part)."""
    import copy

    import torch

    from persuarena import models
    model = models.random_model("tiny-llama")[0].requires_grad_(True)
    torch.manual_seed(1)
    stem = torch.randint(3, 600, (12,)).tolist()
    rows = [stem + torch.randint(3, 600, (n,)).tolist() for n in (6, 9, 3)]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    keep = torch.arange(first_kept, width - 1)
    weights = torch.randn(3, len(keep), model.config.vocab_size)
    out = {}
    for share in (False, True):
        m = copy.deepcopy(model).train()
        logits = steps.kept_logits(m, ids, keep, share_stem=share)
        (logits * weights).sum().backward()
        out[share] = logits.detach(), {k: p.grad for k, p in m.named_parameters()}
    assert out[True][0].shape == out[False][0].shape == (3, len(keep), model.config.vocab_size)
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-5, atol=1e-5)
    for name, grad in out[False][1].items():  # float32 sums in another order: 1e-6 of the scale
        assert (out[True][1][name] - grad).abs().max() <= 1e-5 * grad.abs().max(), name
    assert any(g.abs().sum() > 0 for g in out[True][1].values())


def test_a_model_that_returns_no_cache_gets_the_plain_forward():
    """steps.kept_logits with share_stem on a model that drops the stem's cache (transformers 5.17
    in train mode with activation checkpointing): the plain forward's logits, no KeyError."""
    import torch

    from persuarena import models
    model = models.random_model("tiny-llama")[0].eval()

    def no_cache(*args, **kwargs):
        out = model(*args, **kwargs)
        out["past_key_values"] = None
        return out
    torch.manual_seed(1)
    stem = torch.randint(3, 600, (12,)).tolist()
    ids = torch.tensor([stem + torch.randint(3, 600, (5,)).tolist() for _ in range(3)])
    keep = torch.arange(9, ids.shape[1] - 1)
    with torch.no_grad():
        want = model(ids, use_cache=False).logits[:, keep]
        torch.testing.assert_close(steps.kept_logits(no_cache, ids, keep, share_stem=True), want)


@pytest.mark.parametrize("share_stem", [False, True])
def test_the_update_takes_logits_of_each_rows_own_kept_positions(share_stem, monkeypatch):
    """Two rows whose replies sit at different positions (their union keeps 8 positions, a row 4
    at most): the output layer runs on [2, 4, V] (what lab/plan.py counts), and the loss and every
    gradient equal those of the union's logits [2, 8, V] (rows=None) with the union's mask."""
    policy, reference = policy_and_reference(3)
    stem = torch.randint(3, 600, (5,)).tolist()
    ids = [stem + torch.randint(3, 600, (10,)).tolist(), stem + torch.randint(3, 600, (6,)).tolist()]
    turn_ids = [[0] * 5 + [1, 1, 1, 1] + [0] * 6, [0] * 9 + [1, 1, 0, 2, 2]]
    recs = [Episode(ids=i, turn_ids=t, logprobs=[-6.0] * len(t)) for i, t in zip(ids, turn_ids)]
    advantages = [[0.8], [-0.5, 1.1]]
    widths, plain = [], rpo.target_logprobs
    monkeypatch.setattr(rpo, "target_logprobs",
                        lambda logits, *a: widths.append(logits.shape) or plain(logits, *a))
    loss, _ = rpo.micro_batch_loss(policy, reference, recs, advantages, 9, beta=0.05,
                                   logits=kept_logits(share_stem))
    loss.backward()
    got = {k: p.grad.clone() for k, p in policy.named_parameters()}
    policy.zero_grad()
    assert widths == [(2, 4, policy.config.vocab_size)] * 2
    # the union's logits, each row's own picked out after the output layer
    width = max(map(len, ids))
    x = torch.tensor([i + [0] * (width - len(i)) for i in ids])
    t = torch.tensor([i + [0] * (width - len(i)) for i in turn_ids])
    keep = (t[:, 1:] > 0).any(0).nonzero()[:, 0]
    assert len(keep) == 8
    # the union's own loss (every kept position of every row, the other rows' masked): no
    # row selection at all, so a row picking a wrong position would show
    kept = t[:, keep + 1] > 0
    logp = plain(steps.kept_logits(policy, x, keep), x[:, keep + 1])
    with torch.no_grad():
        ref = plain(steps.kept_logits(reference, x, keep), x[:, keep + 1])
    adv = rpo.batch_token_advantages(t, advantages)[:, 1:][:, keep]
    want, _ = rpo.policy_loss(logp, torch.full_like(logp, -6.0), ref, adv, kept, 9, beta=0.05)
    want.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-5, abs=1e-7)
    for name, p in policy.named_parameters():
        assert (got[name] - p.grad).abs().max() <= 1e-5 * max(p.grad.abs().max(), 1e-8), name


@given(st.integers(1, 40), st.integers(1, 40))
@settings(max_examples=60, deadline=None)
def test_mini_batches_split_every_episode_once_in_order(episodes, updates):
    """rpo.mini_batches: `updates` contiguous slices covering 0..episodes-1 once, in order, sizes
    within one of each other (the larger first); more updates than episodes is refused."""
    if updates > episodes:
        with pytest.raises(ValueError, match="cannot split"):
            rpo.mini_batches(episodes, updates)
        return
    parts = rpo.mini_batches(episodes, updates)
    assert len(parts) == updates
    assert [i for p in parts for i in range(episodes)[p]] == list(range(episodes))
    sizes = [p.stop - p.start for p in parts]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] - sizes[-1] <= 1 and sizes[-1] >= 1


def test_mini_batches_of_whole_groups_are_the_same_in_one_process_and_on_ranks():
    """The ranks' k-th mini-batches together are one process's k-th when each rank's groups divide
    by the updates (instances dealt to the ranks in turn, as train.step_instances does)."""
    instances, group, world, updates = 8, 3, 2, 2
    episodes = [(i, m) for i in range(instances) for m in range(group)]  # one process, in order
    one = [set(episodes[p]) for p in rpo.mini_batches(len(episodes), updates)]
    ranks = [[(i, m) for i in range(instances)[r::world] for m in range(group)] for r in range(world)]
    split = [[mine[p] for p in rpo.mini_batches(len(mine), updates)] for mine in ranks]
    assert one == [set(split[0][k]) | set(split[1][k]) for k in range(updates)]



# -----------------------------------------------------------------------------
# the dense baseline when the policy's own messages decide when an episode ends (verl #7244)

# A toy persuader, one parameter a turn: at turn t it closes with p_t = sigmoid(theta_t), which
# moves the belief by CLOSE[t] and ends the episode (a decision), or builds, which moves it by
# BUILD[t] and goes on, up to a budget of three turns: its action both moves the belief and sets
# the episode's length. Its dense return J(theta) = E[sum_t r_t], r_t = (b_t - b_{t-1}) / 2.
THETA = (0.3, -0.4, 0.8)
CLOSE, BUILD = (0.1, 0.6, 0.9), (0.2, 0.1, -0.3)


def toy_trajectories(theta):
    """(p_t, every trajectory as (its probability, its process rewards, the closing indicator
    a_t of each turn it played))."""
    p = [1 / (1 + math.exp(-x)) for x in theta]
    out = []
    for close in (0, 1, 2, None):  # the turn it closes at, or None: the budget ends it
        a = [int(t == close) for t in range(3 if close is None else close + 1)]
        prob = math.prod(p[t] if a_t else 1 - p[t] for t, a_t in enumerate(a))
        out.append((prob, [(CLOSE if a_t else BUILD)[t] / 2 for t, a_t in enumerate(a)], a))
    return p, out


def toy_return(theta):
    return sum(prob * sum(r) for prob, r, _ in toy_trajectories(theta)[1])


def mean_gradient(group_size, advantages):
    """The exact mean, over every group of group_size episodes weighted by its probability, of
    the policy gradient (1 / G) sum_i sum_t d log pi(a_{i,t}) / d theta * A_{i,t}, with
    advantages(process rewards of a group) giving A (the score of a sigmoid: a - p)."""
    import itertools
    p, trajectories = toy_trajectories(THETA)
    mean = [0.0] * 3
    for group in itertools.product(trajectories, repeat=group_size):
        weight = math.prod(prob for prob, _, _ in group)
        for (_, _, a), adv in zip(group, advantages([r for _, r, _ in group])):
            for t, (a_t, adv_t) in enumerate(zip(a, adv)):
                mean[t] += weight * (a_t - p[t]) * adv_t / group_size
    return mean


def rpo_dense(baseline, monkeypatch):
    """rpo's dense advantage lam * D~ (lam = 1; equal outcome rewards: no outcome term)."""
    monkeypatch.setattr(rpo, "DENSE_BASELINE", baseline)
    return lambda rewards: rpo.group_advantages([0.0] * len(rewards), rewards, lam=1.0)


def leave_one_out(rewards):
    """D_{i,t} minus the mean of D_{j,t} over the other episodes that reached t (0: none)."""
    D = [[sum(r[t:]) for t in range(len(r))] for r in rewards]
    others = lambda i, t: [d[t] for j, d in enumerate(D) if j != i and len(d) > t]
    return [[d[t] - (sum(others(i, t)) / len(others(i, t)) if others(i, t) else 0.0)
             for t in range(len(d))] for i, d in enumerate(D)]


def normalised_per_turn_index(rewards):
    """verl #7244's construction: each r_{i,k} less the mean of r_{j,k} over the episodes that
    reached k, summed from t to the episode's own end (as many terms as it played)."""
    reached = lambda k: [r[k] for r in rewards if len(r) > k]
    mean = [sum(reached(k)) / len(reached(k)) for k in range(max(map(len, rewards)))]
    return [[sum(r[k] - mean[k] for k in range(t, len(r))) for t in range(len(r))] for r in rewards]


def test_the_per_turn_baseline_shrinks_turns_but_never_tilts_them_when_messages_end_episodes(
        monkeypatch):
    """Against the exact gradient of J (J in closed form, differentiated numerically: no
    estimator in it), the exact mean of each estimator over every group of four:
    - leave-one-out per turn index: the exact gradient (the harness can tell);
    - rpo "turn" (the mean of D_{j,t} over the n_t members that reached t, i included): the exact
      gradient turn by turn times c_t = E[1 - 1/n_t] (n_t - 1 ~ Binomial(G - 1, q_t), q_t the
      chance of reaching t): episode i's own share of its baseline, never of the wrong sign, but
      smaller at turns fewer members reach (0.75, 0.48, 0.32 here);
    - rpo "pooled" (one mean over every (j, k)): off by more than any such share (turn 1 at 0.79
      > 1 - 1/G): its baseline holds i's own turns, as many as i played;
    - verl #7244's per-turn normalisation summed to the episode's end: turn 2's gradient
      reversed. DECISIONS.md: Dense baseline."""
    G, h = 4, 1e-6
    exact = [(toy_return([x + h * (k == t) for k, x in enumerate(THETA)])
              - toy_return([x - h * (k == t) for k, x in enumerate(THETA)])) / (2 * h)
             for t in range(3)]
    assert mean_gradient(G, leave_one_out) == pytest.approx(exact, abs=1e-9)
    p, _ = toy_trajectories(THETA)
    reach = [1.0, 1 - p[0], (1 - p[0]) * (1 - p[1])]
    share = [sum(math.comb(G - 1, m) * q ** m * (1 - q) ** (G - 1 - m) * (1 - 1 / (1 + m))
                 for m in range(G)) for q in reach]
    per_turn = mean_gradient(G, rpo_dense("turn", monkeypatch))
    assert per_turn == pytest.approx([c * g for c, g in zip(share, exact)], abs=1e-9)
    assert share[0] == pytest.approx(1 - 1 / G) and share[2] < share[1] < share[0]
    pooled = mean_gradient(G, rpo_dense("pooled", monkeypatch))
    assert pooled[0] / exact[0] > 1 - 1 / G + 0.04  # no leave-in share gives more than 1 - 1/G
    verl = mean_gradient(G, normalised_per_turn_index)
    assert verl[1] * exact[1] < 0 and abs(verl[1]) > abs(exact[1])


def test_every_function_reads_its_constants_when_called(monkeypatch):
    """An edit of rpo's constants in a running process (a notebook) acts as an edit of the file:
    lambda, the anchor and the loss's clips and beta are read when a function is called."""
    R, P = [1.0, 0.0], [[0.2], [-0.2]]
    monkeypatch.setattr(rpo, "LAMBDA", 0.0)
    plain = rpo.group_advantages(R, P)
    assert plain[0][0] == -plain[1][0] == pytest.approx(0.5 / (math.sqrt(0.5) + EPS))
    assert rpo.diagnostic_sums([(R, P)])["abs_dense"] == 0.0
    monkeypatch.setattr(rpo, "LAMBDA", 1.0)
    assert rpo.group_advantages(R, P)[0][0] == pytest.approx(plain[0][0] + 0.2)
    monkeypatch.setattr(rpo, "ANCHOR", True)
    assert rpo.process_rewards([0.0, 0.2], "ACCEPT") == [pytest.approx(0.5)]
    ones = torch.ones(1, 2)
    monkeypatch.setattr(rpo, "CLIP_HIGH", 0.0)
    monkeypatch.setattr(rpo, "KL_BETA", 0.0)
    loss, stats = rpo.policy_loss(ones.log() + 0.5, ones.log(), ones.log(), ones, ones, 2)
    assert stats["clip_frac"] == 1.0 and loss.item() == pytest.approx(-1.0)  # clipped at 1 + 0, no k3
