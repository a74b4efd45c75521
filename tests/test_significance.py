"""Tests of significance.py against hand computations and brute-force enumerations."""
import math

import numpy as np
import pytest

from lab import significance
from test_analyses import exact_signed_rank_p


def test_importing_significance_loads_no_torch():
    import subprocess
    import sys
    code = "from lab import significance; import sys; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_wilson_interval_by_hand():
    """k 3 of n 10 at 95% (z 1.959964): centre (0.3 + z^2 / 20) / (1 + z^2 / 10), half
    z sqrt(0.021 + z^2 / 400) / (1 + z^2 / 10); n 0 has no interval."""
    z = 1.959964
    low, high = significance.wilson_interval(3, 10)
    centre, half = (0.3 + z ** 2 / 20) / (1 + z ** 2 / 10), \
        z * math.sqrt(0.021 + z ** 2 / 400) / (1 + z ** 2 / 10)
    assert (low, high) == pytest.approx((centre - half, centre + half), abs=1e-6)
    assert significance.wilson_interval(0, 0) == (None, None)


def test_t_interval_by_hand():
    """1, 2, 3, 4: mean 2.5, sd 1.290994, t(0.975, 3) = 3.182446: half 3.182446 * 1.290994 / 2."""
    mean, low, high = significance.t_interval([1, 2, 3, 4])
    assert mean == 2.5 and (low, high) == pytest.approx((2.5 - 2.054260, 2.5 + 2.054260), abs=1e-5)
    assert significance.t_interval([7]) == (7.0, None, None)


def test_mcnemar_small_exact():
    # 1 pair only A succeeds, 7 only B, 5 both, 3 neither: p = 2 * (C(8,0) + C(8,1)) / 2^8 = 18/256
    a = [True] * 1 + [False] * 7 + [True] * 5 + [False] * 3
    b = [False] * 1 + [True] * 7 + [True] * 5 + [False] * 3
    assert significance.mcnemar(a, b) == pytest.approx(18 / 256)
    assert significance.mcnemar(b, a) == pytest.approx(18 / 256)


def test_mcnemar_textbook():
    # the classic table a=101, b=121, c=59, d=33 (chi2 = 21.35); exact p = 2 P(X <= 59), X ~ Bin(180, .5)
    a = [True] * 101 + [True] * 121 + [False] * 59 + [False] * 33
    b = [True] * 101 + [False] * 121 + [True] * 59 + [False] * 33
    p = 2 * sum(math.comb(180, k) for k in range(60)) / 2 ** 180
    assert significance.mcnemar(a, b) == pytest.approx(p, rel=1e-9)
    assert 1e-6 < p < 1e-4


def test_mcnemar_no_discordant():
    assert significance.mcnemar([True, False, True], [True, False, True]) == 1.0


def test_wilcoxon_exact_small():
    # differences 1.5 -.5 2.5 3.5 4.5 -5.5 6.5 7.5 and a zero (dropped): n = 8, W- = 1 + 6 = 7;
    # subsets of {1..8} with sum <= 7: 1+1+1+2+2+3+4+5 = 19, so p = 2 * 19/256
    x = [11.5, 9.5, 12.5, 13.5, 14.5, 4.5, 16.5, 17.5, 10.0]
    y = [10.0] * 9
    assert significance.wilcoxon(x, y) == pytest.approx(38 / 256)
    assert significance.wilcoxon(x, y) == pytest.approx(exact_signed_rank_p([a - b for a, b in zip(x, y)]))


def test_wilcoxon_ties_normal_approx():
    # d = 1 1 2 -2 3 3 3 4 -1 5 (+ a zero, dropped): n = 10; |d| ranks 1,1,1 -> 2; 2,2 -> 4.5; 3,3,3 -> 7
    # W- = 4.5 + 2 = 6.5; mean 10*11/4 = 27.5; var 10*11*21/24 - (24 + 6 + 24)/48 = 96.25 - 1.125
    d = [1, 1, 2, -2, 3, 3, 3, 4, -1, 5, 0]
    z = (6.5 - 27.5) / math.sqrt(96.25 - 1.125)
    assert significance.wilcoxon(d, [0] * len(d)) == pytest.approx(math.erfc(abs(z) / math.sqrt(2)), rel=1e-9)


def test_wilcoxon_large_sample_normal_approx():
    # n = 60 > EXACT_WILCOXON_MAX_N, no ties: every third difference negative, ranks 1, 4, ..., 58
    d = [-(i + 1) if i % 3 == 0 else i + 1 for i in range(60)]
    w_minus = sum(range(1, 61, 3))
    z = (w_minus - 60 * 61 / 4) / math.sqrt(60 * 61 * 121 / 24)
    assert significance.wilcoxon(d, [0] * 60) == pytest.approx(math.erfc(abs(z) / math.sqrt(2)), rel=1e-9)


def test_wilcoxon_all_zero():
    assert significance.wilcoxon([1, 2, 3], [1, 2, 3]) == 1.0


def test_message_variance_share_recovers_known_components():
    """Simulated r_t = instance + message + reply noise with message sd 0.02 and reply sd 0.04:
    the share is 0.02^2 / (0.02^2 + 0.04^2) = 0.2, the instance offsets do not count; a message
    that decides nothing gives ~0."""
    rng = np.random.default_rng(0)
    data = [[list(off + m + rng.normal(0, 0.04, 8)) for m in rng.normal(0, 0.02, 60)]
            for off in rng.normal(0, 1.0, 20)]
    out = significance.message_variance_share(data)
    assert out["share"] == pytest.approx(0.2, abs=0.04)
    assert out["s2_persuadee"] == pytest.approx(0.04 ** 2, rel=0.05)
    noise = [[list(rng.normal(0, 0.04, 8)) for _ in range(60)] for _ in range(20)]
    assert significance.message_variance_share(noise)["share"] < 0.03
    with pytest.raises(ValueError):
        significance.message_variance_share([[[1.0]]])


def reference_power(effect, n, alpha=0.05):
    """A paired t test's power by integration: the statistic is (Z + effect sqrt(n)) / sqrt(V /
    df), V chi-square with df = n - 1 degrees of freedom; power = E_V[P(|Z + nc| > c sqrt(V /
    df))], c the t quantile."""
    from scipy import integrate, stats
    df, nc = n - 1, effect * math.sqrt(n)
    c = stats.t.ppf(1 - alpha / 2, df)

    def given(v):
        edge = c * math.sqrt(v / df)
        return (stats.norm.sf(edge - nc) + stats.norm.cdf(-edge - nc)) * stats.chi2.pdf(v, df)
    return integrate.quad(given, 0, math.inf, limit=200)[0]


def test_power_episodes_by_hand():
    """p 0.5 -> 0.6: (1.95996 sqrt(2 .55 .45) + 0.84162 sqrt(.25 + .24))^2 / 0.01 = 387.3 -> 388;
    a mean difference of 0.05 with sd 0.1: 2 (2.80158)^2 0.01 / 0.0025 = 62.8 -> 63 (paired 32)."""
    assert significance.episodes_for_proportions(0.5, 0.6) == 388
    # t, not z (issue 35): d = 0.5 at 80% power, two-sided 0.05 needs 64 a group, 34 pairs
    # (the exact noncentral-t answers, as G*Power gives them; z gave 63 and 32)
    assert significance.episodes_for_mean(0.1, 0.05) == 64
    assert significance.episodes_for_mean(0.1, 0.05, paired=True) == 34
    # exact: 8 pairs detect d = 1.1 with power 80% (the noncentral t against its own integral
    # over the chi-square of the sd, a reference that shares no code with scipy's nct)
    d = significance.detectable_mean(1.0, 8, paired=True)
    assert reference_power(d, 8) == pytest.approx(0.8, abs=1e-6)
    assert 3 / math.sqrt(8) < d < math.sqrt(1 / 8) * (2.364624 + 0.896030) + 0.05
    # at 3 seeds the t-sum approximation said 2.6 sd; the exact power there is short of 80%
    approx3 = math.sqrt(1 / 3) * (4.302653 + 1.060660)
    assert reference_power(approx3, 3) < 0.8 < reference_power(significance.detectable_mean(
        1.0, 3, paired=True) + 1e-9, 3) + 1e-6
    assert significance.detectable_mean(1.0, 1, paired=True) is None
    # the inverses: what those sample sizes detect (to the rounding up of the sizes)
    assert significance.detectable_mean(0.1, 64) == pytest.approx(0.05, rel=0.01)
    assert significance.detectable_mean(0.1, 34, paired=True) == pytest.approx(0.05, rel=0.02)
    assert significance.detectable_mean(0.1, 64) > significance.detectable_mean(0.1, 64, paired=True)
    assert significance.detectable_proportion(0.5, 388) == pytest.approx(0.1, abs=2e-4)
    assert significance.episodes_for_proportions(0.5, 0.5 + significance.detectable_proportion(0.5, 100)) <= 100
    assert significance.detectable_proportion(0.5, 3) is None


def test_paired_t_by_hand():
    """d = (0.1, 0.3, 0.2): mean 0.2, sd 0.1, t = 0.2 / (0.1 / sqrt 3) = 3.4641 on 2 df,
    two-sided p = 0.07418; interval 0.2 -+ 4.302653 * 0.1 / sqrt 3."""
    r = significance.paired_t([1.1, 2.3, 3.2], [1.0, 2.0, 3.0])
    assert r["n"] == 3 and r["diff"] == pytest.approx(0.2) and r["sd"] == pytest.approx(0.1)
    assert r["p"] == pytest.approx(0.07418, abs=1e-4)
    assert r["low"] == pytest.approx(0.2 - 4.302653 * 0.1 / math.sqrt(3), rel=1e-5)
    assert significance.paired_t([1.0], [0.5])["p"] is None
    assert significance.paired_t([1.0, 2.0], [1.0, 2.0])["p"] == 1.0


def test_mean_band_by_hand_uses_student_t():
    """Three seeds at index 0 (1, 2, 6: mean 3, sd sqrt(7)), one at index 1: t with 2 degrees of
    freedom is 4.3027, so the half-width is 4.3027 * sqrt(7) / sqrt(3) (a normal band would be
    2.2 times narrower); a lone row has no band."""
    mean, half = significance.mean_band([[1.0, 5.0], [2.0], [6.0]])
    assert mean.tolist() == [3.0, 5.0]
    assert half[0] == pytest.approx(4.302653 * math.sqrt(7) / math.sqrt(3), rel=1e-5)
    assert half[1] == 0.0


def test_paired_t_power_against_simulation():
    """The exact noncentral-t power of a paired t test against 20,000 simulated tests (10 pairs,
    effect 0.8 sd), and detectable_paired inverts it (and lies above the normal shortcut's
    t-quantile sum at 9 degrees of freedom only by the noncentral correction, under 5%)."""
    import numpy as np
    from scipy import stats
    n, diff, sd = 10, 0.8, 1.0
    x = np.random.default_rng(0).normal(diff, sd, size=(20000, n))
    t = x.mean(1) / (x.std(1, ddof=1) / np.sqrt(n))
    simulated = np.mean(np.abs(t) > stats.t.ppf(0.975, n - 1))
    exact = significance.paired_t_power(diff, sd, n)
    assert abs(exact - simulated) < 0.01 and 0.6 < exact < 0.8
    d = significance.detectable_paired(0.3, n)
    assert significance.paired_t_power(d, 0.3, n) == pytest.approx(0.8, abs=1e-6)
    assert abs(d / significance.detectable_mean(0.3, n, paired=True) - 1) < 0.05
