"""
significance.py: intervals, paired tests, correlations and sample sizes: the statistics that the
paper's comparisons rest on (scipy and numpy; no torch, no episode records).

  wilson_interval          a proportion's Wilson score interval (the main table's acceptance; scipy)
  t_interval               a mean's Student-t interval (belief changes, the sweep's differences)
  mean_band                means by index over ragged rows with 95% Student-t half-widths (figures)
  welch_difference         a difference of means with its Welch interval (move effects)
  proportion_difference    a difference of proportions with its Wald interval
  mcnemar                  exact McNemar on paired booleans (acceptance, same scenarios)
  wilcoxon                 Wilcoxon signed-rank on paired numbers (goal reward, b_T - b_0)
  spearman, pearson        correlations, None where undefined
  message_variance_share   the share of r_t's variance the persuader's message decides
  episodes_for_proportions, episodes_for_mean   episodes a comparison needs (power; exact
                           noncentral t for means: t_test_power, detectable_mean)
  paired_t                 a paired t test over few units (the sweep's seed-level comparisons)

analyses.py applies these to episode records; sweep.py and bench.py call them directly.
Tests: python -m pytest -q test_significance.py
"""
import math

import numpy as np

from lab.jsonl import finite

Z95 = 1.959964  # two-sided 95% normal quantile for the confidence bands and Wald intervals
CONFIDENCE = 0.95  # level of the Welch intervals of the move effects
EXACT_WILCOXON_MAX_N = 50  # exact signed-rank null up to this many nonzero differences (as scipy)


def scipy_stats():
    """scipy.stats, imported at the first test that needs it: a second of start-up that a process
    which only plays (a rank, a server, a CLI's --help) never pays."""
    from scipy import stats
    return stats


def finite_or_none(x):
    """A float for JSON, None where a statistic is undefined (nan: too few or constant values)."""
    return None if x is None else finite(float(x))


def wilson_interval(k, n, level=CONFIDENCE):
    """The Wilson score interval of a proportion k / n (DECISIONS.md: Main table), scipy's
    binomtest(k, n).proportion_ci(method="wilson")."""
    if n == 0:
        return None, None
    ci = scipy_stats().binomtest(int(k), int(n)).proportion_ci(confidence_level=level, method="wilson")
    return float(ci.low), float(ci.high)


def t_interval(values, level=CONFIDENCE):
    """Mean and its Student-t interval; None bounds below two values."""
    x = np.asarray(values, dtype=float)
    if x.size < 2:
        return (float(x.mean()) if x.size else None), None, None
    half = scipy_stats().t.ppf((1 + level) / 2, x.size - 1) * x.std(ddof=1) / math.sqrt(x.size)
    return float(x.mean()), float(x.mean() - half), float(x.mean() + half)


def mean_band(rows):
    """Mean by index over ragged rows and its 95% Student-t half-width (0 where one row): the
    figures' bands are over few units (a sweep's seeds), where the normal quantile would draw
    them too narrow (t with 2 degrees of freedom is 4.30, not 1.96)."""
    length = max((len(r) for r in rows), default=0)
    mean, half = np.zeros(length), np.zeros(length)
    for t in range(length):
        v = np.array([r[t] for r in rows if len(r) > t], dtype=float)
        mean[t] = v.mean()
        quantile = scipy_stats().t.ppf((1 + CONFIDENCE) / 2, v.size - 1) if v.size > 1 else 0.0
        half[t] = quantile * v.std(ddof=1) / math.sqrt(v.size) if v.size > 1 else 0.0
    return mean, half


def welch_difference(with_label, without_label):
    """Difference of means (with - without) and its Welch 95% interval; None below two of each."""
    if len(with_label) < 2 or len(without_label) < 2:
        return None
    diff = float(np.mean(with_label) - np.mean(without_label))
    test = scipy_stats().ttest_ind(with_label, without_label, equal_var=False)
    low, high = test.confidence_interval(CONFIDENCE)
    return {"diff": diff, "low": finite_or_none(low), "high": finite_or_none(high), "n_with": len(with_label),
            "n_without": len(without_label)}


def proportion_difference(with_label, without_label):
    """Difference of two proportions (booleans) with its Wald 95% interval; None if a side is empty."""
    if not with_label or not without_label:
        return None
    p1, p2 = float(np.mean(with_label)), float(np.mean(without_label))
    half = Z95 * math.sqrt(p1 * (1 - p1) / len(with_label) + p2 * (1 - p2) / len(without_label))
    return {"diff": p1 - p2, "low": p1 - p2 - half, "high": p1 - p2 + half, "n_with": len(with_label),
            "n_without": len(without_label)}


def mcnemar(a, b):
    """Two-sided exact McNemar p-value for paired booleans: a binomial test on the discordant pairs."""
    if len(a) != len(b):
        raise ValueError(f"mcnemar needs paired samples, got {len(a)} and {len(b)}")
    only_a = sum(bool(x) and not bool(y) for x, y in zip(a, b))
    only_b = sum(bool(y) and not bool(x) for x, y in zip(a, b))
    if only_a + only_b == 0:
        return 1.0
    return float(scipy_stats().binomtest(only_a, only_a + only_b, 0.5).pvalue)


def wilcoxon(x, y):
    """Two-sided Wilcoxon signed-rank p-value of x - y, zero differences dropped.
    Exact null distribution for up to EXACT_WILCOXON_MAX_N differences without ties in |d|; otherwise
    the normal approximation with scipy's tie-corrected variance and no continuity correction."""
    d = np.asarray(x, dtype=float) - np.asarray(y, dtype=float)
    d = d[d != 0]
    if d.size == 0:
        return 1.0
    ties = np.unique(np.abs(d)).size < d.size
    method = "exact" if d.size <= EXACT_WILCOXON_MAX_N and not ties else "asymptotic"
    return float(scipy_stats().wilcoxon(d, zero_method="wilcox", correction=False,
                                        alternative="two-sided", method=method).pvalue)


def paired_t(x, y, level=CONFIDENCE):
    """A paired t test of x - y over few units (seeds): {n, diff, low, high, p, sd}, the interval
    and p None below two pairs or with no spread."""
    d = np.asarray(x, dtype=float) - np.asarray(y, dtype=float)
    mean, low, high = t_interval(d, level)
    sd = float(d.std(ddof=1)) if d.size > 1 else None
    p = (finite_or_none(scipy_stats().ttest_1samp(d, 0.0).pvalue) if d.size > 1 and sd else
         (1.0 if d.size > 1 and mean == 0 else None))
    return dict(n=int(d.size), diff=mean, low=low, high=high, p=p, sd=sd)


def spearman(x, y):
    """{rho, p} of scipy's Spearman rank correlation; None where undefined (n < 3 or a constant)."""
    if len(x) < 3 or len(set(x)) < 2 or len(set(y)) < 2:
        return None
    r = scipy_stats().spearmanr(x, y)
    return {"rho": finite_or_none(r.statistic), "p": finite_or_none(r.pvalue), "n": len(x)}


def pearson(x, y):
    """{r, p} of scipy's Pearson correlation; None where undefined (n < 3 or a constant)."""
    if len(x) < 3 or len(set(x)) < 2 or len(set(y)) < 2:
        return None
    r = scipy_stats().pearsonr(x, y)
    return {"r": finite_or_none(r.statistic), "p": finite_or_none(r.pvalue), "n": len(x)}


def message_variance_share(rewards):
    """rewards: per instance, per persuader message, the r_t of several persuadee replies to that
    one message (each with its own random stream). One-way random-effects ANOVA within each
    instance, sums of squares pooled over instances: the message component
    s2_message = max(0, (MS_between - MS_within) / n0) and the persuadee's sampling component
    s2_persuadee = MS_within; share = s2_message / (s2_message + s2_persuadee), the part of r_t's
    within-instance variance that the persuader's message decides (a group's contrast)."""
    ss_w = ss_b = df_w = df_b = 0.0
    sizes = []
    for messages in rewards:
        groups = [np.asarray(g, dtype=float) for g in messages if len(g)]
        if len(groups) < 2:
            continue
        grand = np.concatenate(groups).mean()
        ss_w += sum(((g - g.mean()) ** 2).sum() for g in groups)
        ss_b += sum(g.size * (g.mean() - grand) ** 2 for g in groups)
        df_w += sum(g.size - 1 for g in groups)
        df_b += len(groups) - 1
        sizes += [g.size for g in groups]
    if not df_w or not df_b:
        raise ValueError("message_variance_share needs two messages with two replies each")
    ms_w, ms_b = ss_w / df_w, ss_b / df_b
    n0 = float(np.mean(sizes))
    s2_message = max(0.0, (ms_b - ms_w) / n0)
    total = s2_message + ms_w
    return dict(share=float(s2_message / total) if total else 0.0, s2_message=float(s2_message),
                s2_persuadee=float(ms_w), ms_between=float(ms_b), messages=len(sizes),
                replies=int(sum(sizes)))


def episodes_for_proportions(p0, p1, alpha=0.05, power=0.8):
    """Episodes per arm for a two-sided test of two independent proportions p0, p1 (normal
    approximation): (z_a sqrt(2 pbar qbar) + z_b sqrt(p0 q0 + p1 q1))^2 / (p1 - p0)^2."""
    za, zb = scipy_stats().norm.ppf([1 - alpha / 2, power])
    pbar = (p0 + p1) / 2
    n = (za * math.sqrt(2 * pbar * (1 - pbar)) + zb * math.sqrt(p0 * (1 - p0) + p1 * (1 - p1))) ** 2
    return math.ceil(n / (p1 - p0) ** 2)


def t_test_power(effect, n, alpha=0.05, paired=False):
    """The exact power of a two-sided t test of a standardised mean difference `effect`
    (delta / sd) with n pairs (paired, df n - 1) or n a group (df 2 (n - 1)): under the
    alternative the statistic is noncentral t with nc = effect sqrt(n / k), k 1 paired, 2 not,
    and the power is P(T > t_{1-alpha/2}) + P(T < -t_{1-alpha/2}) (scipy's nct)."""
    df, k = (n - 1) * (1 if paired else 2), 1 if paired else 2
    stats = scipy_stats()
    nc, critical = effect * math.sqrt(n / k), stats.t.ppf(1 - alpha / 2, df)
    power = float(stats.nct.sf(critical, df, nc) + stats.nct.cdf(-critical, df, nc))
    return power if math.isfinite(power) else float(abs(nc) > critical)  # far tails: 0 or 1


def episodes_for_mean(sd, delta, alpha=0.05, power=0.8, paired=False):
    """Episodes per arm (pairs when paired, sd then the sd of the paired differences) for a
    two-sided t test of a mean difference delta: the least n whose exact power (t_test_power)
    reaches `power` (d = 0.5 needs 34 pairs or 64 a group)."""
    n = 2
    while t_test_power(abs(delta) / sd, n, alpha, paired) < power:
        n += 1
    return n


def detectable_mean(sd, n, alpha=0.05, power=0.8, paired=False):
    """The smallest mean difference n episodes per arm (pairs when paired) detect with a t test
    at `power`, exactly (t_test_power solved for the effect); None below two."""
    if n < 2:
        return None
    from scipy.optimize import brentq
    high = 1.0
    while t_test_power(high, n, alpha, paired) < power:
        high *= 2
    effect = brentq(lambda d: t_test_power(d, n, alpha, paired) - power, 1e-9, high, xtol=1e-12)
    return effect * sd


def paired_t_power(diff, sd, n, alpha=0.05):
    """The exact power of a two-sided paired t test over n pairs whose differences have mean diff
    and sd: P(|T| > t_{1-alpha/2, n-1}) with T noncentral t (df n - 1, noncentrality
    diff sqrt(n) / sd). What a pre-registration states for seeds as the unit."""
    df, nc = n - 1, diff * math.sqrt(n) / sd
    stats = scipy_stats()
    t = stats.t.ppf(1 - alpha / 2, df)
    power = float(stats.nct.sf(t, df, nc) + stats.nct.cdf(-t, df, nc))
    return power if math.isfinite(power) else 1.0  # scipy's nct gives NaN far out (|nc| > ~37)


def detectable_paired(sd, n, alpha=0.05, power=0.8):
    """The smallest mean difference a paired t test over n pairs detects with the given power,
    exactly (paired_t_power solved for diff; detectable_mean is its normal-quantile shortcut)."""
    from scipy.optimize import brentq
    high = sd
    while paired_t_power(high, sd, n, alpha) < power:  # doubled until it brackets the root
        high *= 2
    return brentq(lambda d: paired_t_power(d, sd, n, alpha) - power, 0.0, high)


def detectable_proportion(p0, n, alpha=0.05, power=0.8):
    """The smallest rise from p0 that n episodes per arm detect (episodes_for_proportions at most
    n), to 1e-4; None when not even p0 to 1 is detectable."""
    low, high = p0, 1.0
    if p0 >= 1 or episodes_for_proportions(p0, high - 1e-9, alpha, power) > n:
        return None
    while high - low > 1e-4:
        mid = (low + high) / 2
        low, high = (mid, high) if episodes_for_proportions(p0, mid, alpha, power) > n else (low, mid)
    return high - p0
