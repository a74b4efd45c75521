"""
Probe-RPO: GRPO whose outcome advantage is mixed with a dense, belief-based process reward.

After every persuader turn t the persuadee's implicit belief b_t in [-1, 1] is read from its own
next-token logits (DECISIONS.md: Probe wording); b_0 is read before the first message. This
file turns beliefs, outcomes and strategy scores into per-token advantages and the policy loss
(DECISIONS.md: Centred dense term, Loss normalisation):

  process reward     r_t = (b_t - b_{t-1}) / 2,    t = 1..T,    sum_t r_t = (b_T - b_0) / 2
  terminal anchor    off by default: b_T is the measured belief, as in the paper (whose shaping
                     return is accept-blind: 0.479 ACCEPT vs 0.461 CONDITIONAL at lambda 0.5);
                     the ablation ANCHOR = True sets b_T := ANCHOR_BELIEF[outcome]
  outcome reward     R = GOAL[outcome] + STRATEGY_WEIGHT * s,   s in [-2, 2] from the strategy judge
  group advantage    for a group of G episodes of one scenario instance, episode i, turn t:
                       A_out_i  = (R_i - mean_j R_j) / (std_j R_j + STD_EPS)   (std with ddof = 1;
                                  0 for a dead group, all R equal, and for a group of one)
                       D_{i,t}  = sum_{k >= t} r_{i,k}                          (dense return-to-go)
                       D~_{i,t} = D_{i,t} - mean of D_{j,t} over the group's episodes that
                                  reached turn t  (DENSE_BASELINE "turn"; the ablation "pooled":
                                  one mean over every (j, k) of the group)
                       A_{i,t}  = A_out_i + LAMBDA * D~_{i,t}          (LAMBDA = 0: plain GRPO)
  token loss         every token the persuader generated in message t carries A_{i,t}; with
                       rho = exp(logp - old_logp),  d = ref_logp - logp,
                       k3  = exp(d) - d - 1   (>= 0, unbiased KL(pi || pi_ref) estimator)
                       l   = -min(rho A, clip(rho, 1 - CLIP_LOW, 1 + CLIP_HIGH) A) + KL_BETA k3
                       L   = sum over persuader tokens of l / N,  N = persuader tokens in the global
                             mini-batch (all ranks, all micro-batches): summed micro-batch losses = mean.
  updates            the step's episodes split into UPDATES_PER_BATCH mini-batches, one AdamW step
                     each, in order (mini_batches); old_logp is always the rollout's, so from the
                     second update on rho != 1 and the clip acts (DECISIONS.md: Updates per batch).

From episodes (rollout.Episode) of whole groups to the loss: rewards gives each group's R
and r_t, advantages each episode's A_{i,t} (a belief that could not be read counted and left out
of its group's dense term), and micro_batch_loss takes a micro-batch of episodes to L: the policy's log-probs at the persuader's
tokens (logits only where the row predicts a persuader token; lab/steps.kept_logits runs a group's
shared prompt once), the frozen reference's, and policy_loss over them with the global token count.
train.py keeps the backward, its scale over ranks, clipping and the optimizer.

Alignment: the logits at position p predict ids[:, p + 1], so micro_batch_loss keeps the positions
p where turn_ids[:, p + 1] > 0 and reads the targets, old log-probs and advantages (built over the
L input positions by batch_token_advantages) at p + 1 before target_logprobs and policy_loss.

Constants: every function reads the constants above when it is called, never when it was
defined: an argument a constant owns (anchor, lam, clip_low, clip_high, beta) defaults to None,
which means "the constant, now", so `rpo.LAMBDA = 0` in a notebook acts as an edit of the file.

torch is imported inside the functions that make tensors, so that the reward math (process_rewards,
dense_return, GOAL) serves lab/analyses.py without loading torch.

Tests: python -m pytest -q tests/test_rpo.py
"""
import math


LAMBDA = 0.5  # weight of the dense process term; 0 recovers outcome-only GRPO
ANCHOR = False  # ablation: replace the last belief by the outcome's anchor belief (DECISIONS.md: Terminal anchor)
GOAL = {"ACCEPT": 3.0, "CONDITIONAL_ACCEPT": 1.0, "PENDING": 0.0, "REJECT": -1.0, "WALK_AWAY": -2.0}  # goal reward per outcome
ANCHOR_BELIEF = {"ACCEPT": 1.0, "CONDITIONAL_ACCEPT": 0.5, "PENDING": 0.0, "REJECT": -1.0, "WALK_AWAY": -1.0}  # b_T under ANCHOR
STRATEGY_WEIGHT = 0.5  # weight of the judge's strategy score s in the outcome reward (inert under
# the cpu and tiny presets: --judge none, s = 0)
CLIP_LOW = 0.2  # ratio clipped below at 1 - CLIP_LOW
CLIP_HIGH = 0.28  # ratio clipped above at 1 + CLIP_HIGH (asymmetric, "clip-higher")
KL_BETA = 0.01  # weight of the k3 penalty against the frozen initial policy
UPDATES_PER_BATCH = 4  # AdamW steps a rollout batch, one a mini-batch of its episodes (verl's
# default, 1024 / 256; 1: on-policy, rho = 1 and the clip inert; DECISIONS.md: Updates per batch)
STD_EPS = 1e-6  # added to the group std, as in TRL and verl
DENSE_BASELINE = "turn"  # the dense term's baseline: per turn index; "pooled", one over all turns (DECISIONS.md: Dense baseline)
DIAG_EPS = 1e-9  # |A| above this counts as a nonzero advantage in diagnostic_sums


# -----------------------------------------------------------------------------
# rewards

def process_rewards(beliefs: list[float], outcome: str | None,
                    anchor: bool | None = None) -> list[float]:
    """[b_0..b_T] -> [r_1..r_T], r_t = (b_t - b_{t-1}) / 2; b_T anchored to the outcome if asked
    (anchor None: ANCHOR)."""
    b = [float(x) for x in beliefs]
    if len(b) < 2:
        return []
    if ANCHOR if anchor is None else anchor:
        b[-1] = ANCHOR_BELIEF[outcome]
    return [(b[t] - b[t - 1]) / 2 for t in range(1, len(b))]


def dense_return(beliefs: list[float], outcome: str | None, anchor: bool | None = None,
                 lam: float = 1.0) -> float:
    """lam * sum_t r_t: the shaping return of an episode (lam = 1: the lambda-free dense return)."""
    return lam * sum(process_rewards(beliefs, outcome, anchor))


def negative_process_counts(beliefs_per_episode) -> tuple[int, int]:
    """(turns whose process reward is negative, turns), on the measured beliefs (never the anchor);
    counts add over ranks before negative_process_share's division."""
    rewards = [r for beliefs in beliefs_per_episode for r in process_rewards(beliefs, None, anchor=False)]
    return sum(r < 0 for r in rewards), len(rewards)


def collapsed_groups(episodes: list, group_size: int) -> tuple[int, int]:
    """(groups whose members all sent the identical persuader messages, groups of two or more):
    a collapsed group's advantages sum to zero over one and the same token sequence, so its
    gradient is exactly 0 in both terms, whatever the persuadee did. Counts add over ranks."""
    collapsed = groups = 0
    for g in range(0, len(episodes), group_size):
        members = episodes[g:g + group_size]
        if len(members) < 2:
            continue
        said = {tuple((i, t) for i, t in zip(e.ids, e.turn_ids) if t) for e in members}
        groups, collapsed = groups + 1, collapsed + (len(said) == 1)
    return collapsed, groups


def negative_process_share(beliefs_per_episode) -> float:
    """Share of turns whose process reward is negative, on the measured beliefs (never the anchor):
    how often a persuader turn lowers the persuadee's belief. The one definition train and eval log."""
    negative, turns = negative_process_counts(beliefs_per_episode)
    return negative / turns if turns else 0.0


def outcome_reward(outcome: str, strategy: float) -> float:
    return GOAL[outcome] + STRATEGY_WEIGHT * float(strategy)


# -----------------------------------------------------------------------------
# advantages

def _is_dead(outcome_rewards):
    # a group of one has no baseline, a group of equal rewards no signal
    return len(outcome_rewards) < 2 or max(outcome_rewards) == min(outcome_rewards)


def _readable(process_rewards):
    """False for an episode whose beliefs held a non-finite probe value (a NaN from an overflowing
    persuadee): its dense term is excluded from the group, and counted, never a silent 0."""
    return all(math.isfinite(float(x)) for x in process_rewards)


def _group_terms(outcome_rewards, process_rewards):
    """One group -> (A_out per episode, centred dense return-to-go D~ per episode and turn).
    An episode with a non-finite process reward keeps its outcome advantage; its dense terms are
    0 and it is left out of the pooled baseline."""
    R = [float(x) for x in outcome_rewards]
    assert len(R) == len(process_rewards), "one list of process rewards per episode"
    G = len(R)
    if _is_dead(R):
        a_out = [0.0] * G
    else:
        mean = sum(R) / G
        std = math.sqrt(sum((x - mean) ** 2 for x in R) / (G - 1))
        a_out = [(x - mean) / (std + STD_EPS) for x in R]
    D, readable = [], [_readable(r) for r in process_rewards]
    for r, ok in zip(process_rewards, readable):  # return-to-go, right to left
        d, acc = [0.0] * len(r), 0.0
        if not ok:
            D.append(d)
            continue
        for t in reversed(range(len(r))):
            acc += float(r[t])
            d[t] = acc
        D.append(d)
    baseline = _dense_baseline([d for d, ok in zip(D, readable) if ok])
    return a_out, [[x - b for x, b in zip(d, baseline)] if ok else d for d, ok in zip(D, readable)]


def _dense_baseline(kept):
    """The group's baseline for turns 1, 2, ... (the longest readable episode's), from the
    readable episodes' D: DENSE_BASELINE "pooled", one mean over every (j, k); "turn", the mean of
    D_{j,t} over the episodes that reached turn t (DECISIONS.md: Dense baseline)."""
    turns = max((len(d) for d in kept), default=0)
    if DENSE_BASELINE == "pooled":
        n = sum(len(d) for d in kept)
        return [sum(sum(d) for d in kept) / n if n else 0.0] * turns
    at = [[d[t] for d in kept if len(d) > t] for t in range(turns)]
    return [sum(v) / len(v) for v in at]


def group_advantages(outcome_rewards: list[float], process_rewards: list[list[float]],
                     lam: float | None = None) -> list[list[float]]:
    """G outcome rewards and G lists of process rewards (ragged) -> A_{i,t} as G lists (lam
    None: LAMBDA)."""
    lam = LAMBDA if lam is None else lam
    a_out, dense = _group_terms(outcome_rewards, process_rewards)
    return [[a + lam * x for x in d] for a, d in zip(a_out, dense)]


def batch_token_advantages(turn_ids: "torch.Tensor", advantages: list[list[float]]) -> "torch.Tensor":
    """turn_ids [B, L] (t >= 1 on persuader tokens of message t, else 0), advantages a list of B
    (ragged) lists -> float [B, L]: A_t on the tokens of message t, 0 elsewhere."""
    import torch
    B = turn_ids.shape[0]
    assert len(advantages) == B
    for i, (row, a) in enumerate(zip(turn_ids.max(1).values.tolist(), advantages)):
        if row > len(a):  # a message tagged with a turn that has no advantage: never a silent 0
            raise ValueError(f"rpo.py: episode {i} has tokens of persuader message {row} but "
                             f"advantages for {len(a)} turns; a message without a reply must "
                             "carry turn id 0 (rollout.py masks it)")
    table = torch.zeros(B, 1 + max((len(a) for a in advantages), default=0), device=turn_ids.device)
    for i, a in enumerate(advantages):
        table[i, 1:1 + len(a)] = torch.tensor([float(x) for x in a])
    return table.gather(1, turn_ids)


def numeric(beliefs: list[float | None]) -> list[float]:
    """A record's beliefs as the reward arithmetic takes them: NaN where none was read (a served
    persuadee without log-probs), which _readable counts. A record itself holds None."""
    return [math.nan if b is None else b for b in beliefs]


def rewards(episodes: list, group_size: int, anchor: bool | None = None) -> list[tuple]:
    """The rewards of whole groups of episodes (rollout.Episode), per group (outcome rewards R_i =
    GOAL[outcome] + STRATEGY_WEIGHT * s_i, process rewards r_{i,t} from the beliefs, goals
    GOAL[outcome]): what advantages turns into A_{i,t} and diagnostic_sums reads."""
    groups = []
    for g in range(0, len(episodes), group_size):
        group = episodes[g:g + group_size]
        groups.append(([outcome_reward(e.outcome, e.judge) for e in group],
                       [process_rewards(numeric(e.beliefs), e.outcome, anchor) for e in group],
                       [GOAL[e.outcome] for e in group]))
    return groups


def advantages(groups: list[tuple], lam: float | None = None) -> list[list[float]]:
    """The Probe-RPO turn advantages A_{i,t} of each episode, in order, from its group's
    rewards (rewards)."""
    return [a for outcome, process, _ in groups for a in group_advantages(outcome, process, lam)]


# -----------------------------------------------------------------------------
# log-probs and loss

def _clips(clip_low, clip_high, beta):
    """The loss's constants as called: each None is CLIP_LOW, CLIP_HIGH, KL_BETA now."""
    return (CLIP_LOW if clip_low is None else clip_low, CLIP_HIGH if clip_high is None else clip_high,
            KL_BETA if beta is None else beta)


def target_logprobs(logits: "torch.Tensor", targets: "torch.Tensor",
                    temperature: float = 1.0) -> "torch.Tensor":
    """log softmax(logits / temperature) at targets: [B, K, V] and [B, K] -> float32 [B, K].

    One row at a time, via logsumexp + gather, so at most one [K, V] float32 copy is made per row
    (the copy autograd keeps anyway) instead of a full log_softmax over [B, K, V].
    """
    import torch
    out = []
    for b in range(logits.shape[0]):
        row = logits[b].float()  # no copy for float32 logits
        if temperature != 1.0:
            row = row / temperature  # must match the sampling distribution softmax(logits / T)
        picked = row.gather(-1, targets[b, :, None]).squeeze(-1)
        out.append(picked - torch.logsumexp(row, dim=-1))
    return torch.stack(out)


def policy_loss(logp, old_logp, ref_logp, advantages, mask, num_tokens: float,
                clip_low: float | None = None, clip_high: float | None = None,
                beta: float | None = None) -> tuple["torch.Tensor", dict]:
    """Clipped token-level surrogate + beta * k3 over masked tokens, summed and divided by the
    GLOBAL persuader-token count num_tokens. All tensors share one shape; ref_logp may be None.
    clip_low, clip_high, beta None: CLIP_LOW, CLIP_HIGH, KL_BETA."""
    import torch
    clip_low, clip_high, beta = _clips(clip_low, clip_high, beta)
    mask = mask.bool()
    # zero the log-ratio off the mask before exp: unmasked positions may hold anything (padding),
    # and exp(inf) * 0 would turn their exactly-zero gradient into nan
    log_ratio = torch.where(mask, logp - old_logp, torch.zeros_like(logp))
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    per_token = torch.maximum(-ratio * advantages, -clipped * advantages)
    if ref_logp is not None:
        d = torch.where(mask, ref_logp - logp, torch.zeros_like(logp))
        k3 = torch.exp(d) - d - 1
        per_token = per_token + beta * k3
    loss = torch.where(mask, per_token, torch.zeros_like(per_token)).sum() / max(float(num_tokens), 1.0)

    with torch.no_grad():
        n = int(mask.sum())
        # clipped "in the direction that matters": the clip removes this token's gradient
        hit = ((advantages > 0) & (ratio > 1 + clip_high)) | ((advantages < 0) & (ratio < 1 - clip_low))
        stats = {
            "kl": float(k3[mask].sum()) / n if n and ref_logp is not None else 0.0,
            "clip_frac": float(hit[mask].sum()) / n if n else 0.0,
            "ratio_mean": float(ratio[mask].sum()) / n if n else 0.0,
            "tokens": n,
        }
    return loss, stats


def mini_batches(episodes, updates=UPDATES_PER_BATCH):
    """The slices of a rank's `episodes` (in order, whole groups first) that its `updates`
    optimizer steps take, one each: contiguous, sizes within one of each other, the larger
    first. Every rank holds as many episodes, so every rank splits alike (FSDP's collectives
    meet); one process and W ranks take the same global mini-batches when each rank's groups
    divide by `updates` (the split then falls between groups, the ranks' instances interleaved)."""
    if not 1 <= updates <= episodes:
        raise ValueError(f"rpo.py: {updates} updates cannot split {episodes} episodes (1 to "
                         f"{episodes}: at least one episode a mini-batch)")
    size, extra = divmod(episodes, updates)
    starts = [k * size + min(k, extra) for k in range(updates + 1)]
    return [slice(a, b) for a, b in zip(starts, starts[1:])]


def persuader_tokens(episodes: list) -> int:
    """The tokens the loss is taken over: every predicted token of a persuader message."""
    return sum(sum(1 for t in e.turn_ids[1:] if t) for e in episodes)


def plain_logits(model, ids, keep, rows):
    """model(ids).logits at each row's own kept positions, rows [B, K] indices into keep:
    [B, K, V] (train.py passes lab/steps.kept_logits instead, which runs the output layer on
    those positions only and a group's shared prompt once)."""
    kept = model(ids, use_cache=False).logits[:, keep]
    return kept.gather(1, rows[..., None].expand(-1, -1, kept.shape[-1]))


def micro_batch_loss(policy, reference, episodes: list, turn_advantages: list[list[float]],
                     num_tokens: float, *, temperature: float = 1.0, clip_low: float | None = None,
                     clip_high: float | None = None, beta: float | None = None, logits=None,
                     context=None) -> tuple["torch.Tensor", dict]:
    """The loss of one micro-batch of episodes (rollout.Episode: ids, turn_ids, the sampled
    logprobs) and
    their turn advantages: the policy's and the frozen reference's log-probs of the persuader's
    tokens, policy_loss over them with the GLOBAL token count num_tokens (so the micro-batches'
    losses, summed over ranks, are the batch mean). context(model), when given, is where each
    forward runs (precision, attention backend); logits(model, ids, keep, rows), when given, how
    each model's logits at the kept positions are taken (default plain_logits). Returns the loss and its
    stats: its value, kl, clip_frac, ratio_mean weighted by this micro-batch's share of
    num_tokens, and under "nonfinite" 1 for each of logprobs, advantages, loss that is not
    finite (counted by the caller, which then does not step)."""
    import contextlib

    import torch
    clip_low, clip_high, beta = _clips(clip_low, clip_high, beta)
    context = context or (lambda model: contextlib.nullcontext())
    device = next(policy.parameters()).device
    width = max(len(e.ids) for e in episodes)
    pad = lambda rows, fill, dtype: torch.tensor(
        [row + [fill] * (width - len(row)) for row in rows], dtype=dtype, device=device)
    ids = pad([e.ids for e in episodes], 0, torch.long)
    turn_ids = pad([e.turn_ids for e in episodes], 0, torch.long)
    adv = batch_token_advantages(turn_ids.cpu(), turn_advantages)
    # logits only where some row predicts a persuader token: the lm_head and softmax over the
    # vocabulary are skipped for the prompts and the persuadee's text
    keep = (turn_ids[:, 1:] > 0).any(0).nonzero()[:, 0]
    # the output layer then runs on each row's own kept positions, left-aligned:
    # rows [B, K], K the most a row keeps, indices into keep (kept ones first, in order)
    kept = turn_ids[:, keep + 1] > 0
    rows = torch.argsort((~kept).to(torch.uint8), dim=1, stable=True)[:, :int(kept.sum(1).max())]
    targets, mask = ids[:, keep + 1].gather(1, rows), kept.gather(1, rows)
    old = pad([e.logprobs for e in episodes], 0.0, torch.float32)[:, keep + 1].gather(1, rows)
    adv = adv[:, 1:].to(device)[:, keep].gather(1, rows)
    logits = logits or plain_logits
    with context(policy):
        logp = target_logprobs(logits(policy, ids, keep, rows), targets, temperature)
    ref = None
    if beta > 0:
        with torch.no_grad(), context(reference):
            ref = target_logprobs(logits(reference, ids, keep, rows), targets, temperature)
    loss, s = policy_loss(logp, old, ref, adv, mask, num_tokens, clip_low, clip_high, beta)
    with torch.no_grad():
        weight = s["tokens"] / max(num_tokens, 1)
        logprobs = [x[mask] for x in (logp, old) + ((ref,) if ref is not None else ())]
        nonfinite = dict(logprobs=int(not all(torch.isfinite(x).all() for x in logprobs)),
                         advantages=int(not torch.isfinite(adv[mask]).all()),
                         loss=int(not torch.isfinite(loss)))
        stats = dict(loss=loss.item(), **{k: s[k] * weight for k in ("kl", "clip_frac", "ratio_mean")},
                     nonfinite=nonfinite)
    return loss, stats


# -----------------------------------------------------------------------------
# per-step logging: the paper's dead groups, rescued share and dense share of |A| (section F)

DIAGNOSTIC_SUMS = ("groups", "dead", "rescued", "goal_groups", "dead_goal", "abs_out", "abs_dense",
                   "abs_total", "turns", "episodes", "unreadable")  # what diagnostic_sums adds up


def diagnostic_sums(groups: list[tuple], lam: float | None = None) -> dict:
    """groups: list of (outcome_rewards, process_rewards[, goals]) -> the counts and sums whose
    ratios are the diagnostics. Sums add: over the ranks of a step (all-reduced before dividing,
    so torchrun gives one process's figure) and over the steps of a run (the run-level figure).
    dead: all R equal (no outcome advantage); dead_goal, over the groups that carry their goals
    (GOAL[outcome] per episode): identical outcomes, the paper's words."""
    lam = LAMBDA if lam is None else lam
    sums = dict.fromkeys(DIAGNOSTIC_SUMS, 0.0)
    for R, P, *goals in groups:
        sums["groups"] += 1
        sums["episodes"] += len(P)
        sums["unreadable"] += sum(not _readable(r) for r in P)
        a_out, dense = _group_terms(R, P)
        A = group_advantages(R, P, lam)
        if _is_dead(R):
            sums["dead"] += 1
            sums["rescued"] += any(abs(x) > DIAG_EPS for a in A for x in a)
        if goals:
            sums["goal_groups"] += 1
            sums["dead_goal"] += _is_dead(goals[0])
        sums["abs_out"] += sum(abs(a) * len(d) for a, d in zip(a_out, dense))
        sums["abs_dense"] += sum(abs(lam * x) for d in dense for x in d)
        sums["abs_total"] += sum(abs(x) for a in A for x in a)
        sums["turns"] += sum(len(r) for r in P)
    return sums


def diagnostics(sums: dict) -> dict:
    """diagnostic_sums (of one rank, all ranks, or a whole run) -> dead-group share (all R equal),
    dead_goal_share (identical outcomes), share of dead groups rescued by the dense term, the dense
    term's share of sum |A|, and the two terms' mean |.| per turn (outcome_term_abs = |A_out|,
    dense_term_abs = |lam D~|); a ratio with nothing to count is 0."""
    ratio = lambda num, den: sums[num] / sums[den] if sums[den] else 0.0
    return {
        "dead_group_share": ratio("dead", "groups"),
        "dead_goal_share": ratio("dead_goal", "goal_groups"),
        "dead_rescued_share": ratio("rescued", "dead"),
        "dense_share": ratio("abs_dense", "abs_total"),
        "outcome_term_abs": ratio("abs_out", "turns"),
        "dense_term_abs": ratio("abs_dense", "turns"),
        # episodes whose dense term was excluded for a non-finite probe value
        "nonfinite_belief_share": ratio("unreadable", "episodes"),
    }
