"""harness/stats.py: the intervals, tests and power the experiments report, checked against their
closed forms and by simulation (an interval covers the truth as often as it says)."""
import random

import pytest

from harness import stats


def test_wilson_interval():
    lo, hi = stats.wilson(50, 100)
    assert lo == pytest.approx(0.4038, abs=1e-3) and hi == pytest.approx(0.5962, abs=1e-3)
    assert stats.wilson(0, 10)[0] == 0.0 and stats.wilson(10, 10)[1] == 1.0


def test_mcnemar_is_the_exact_binomial_test():
    assert stats.mcnemar_p(0, 10) == pytest.approx(2 / 1024)
    assert stats.mcnemar_p(7, 7) == 1.0 and stats.mcnemar_p(0, 0) == 1.0
    assert stats.mcnemar_p(3, 12) == stats.mcnemar_p(12, 3)
    # P(X <= 3) for X ~ Binomial(15, 1/2), doubled
    assert stats.mcnemar_p(3, 12) == pytest.approx(2 * (1 + 15 + 105 + 455) / 2 ** 15)


def simulate_pairs(n, only_a, only_b, rng):
    """n problems: each correct under a only with probability only_a, under b only with only_b,
    under both or neither (equally) otherwise."""
    a, b = [], []
    for _ in range(n):
        u = rng.random()
        if u < only_a:
            a.append(True), b.append(False)
        elif u < only_a + only_b:
            a.append(False), b.append(True)
        else:
            both = rng.random() < 0.5
            a.append(both), b.append(both)
    return a, b


def test_paired_interval_covers_the_true_difference_95_percent_of_the_time():
    rng = random.Random(0)
    only_a, only_b, n = 0.12, 0.06, 200  # a true difference of -6 points, 18% discordant
    runs = [stats.paired_difference(*simulate_pairs(n, only_a, only_b, rng)) for _ in range(1000)]
    coverage = sum(r["ci95"][0] <= only_b - only_a <= r["ci95"][1] for r in runs) / len(runs)
    assert 0.93 <= coverage <= 0.97
    r = runs[0]
    assert r["difference"] == (r["only_this"] - r["only_reference"]) / n
    assert r["discordance"] == (r["only_this"] + r["only_reference"]) / n


def test_paired_interval_is_agresti_mins_worked_by_hand():
    """Agresti-Min: half a count added to each of the four cells. 50 problems, 3 only a, 10 only b:
    (10.5 - 3.5) / 52 = 0.13462 +- 1.96 sqrt(14 - 7^2 / 52) / 52 = 0.13620."""
    a = [True] * 3 + [False] * 10 + [True] * 20 + [False] * 17
    b = [False] * 3 + [True] * 10 + [True] * 20 + [False] * 17
    r = stats.paired_difference(a, b)
    assert r["difference"] == pytest.approx(7 / 50)
    assert r["ci95"] == pytest.approx((0.13462 - 0.13620, 0.13462 + 0.13620), abs=1e-4)


def test_the_detectable_ratio_is_2_8_standard_errors_from_1():
    """80% power at a two-sided 5% level: (1.96 + 0.84) bootstrap standard errors of the log ratio,
    against the interval's 1.96: on 60 prompts, whose bootstrap is near normal, the detectable log
    ratio is 2.8 / 1.96 of the interval's half-width in logs."""
    import math
    rng = random.Random(2)
    b = [{"new_tokens": 100, "target_forwards": rng.randint(40, 80), "wall_tokens_per_s": rng.uniform(20, 40)}
         for _ in range(60)]
    a = [dict(r, target_forwards=max(1, r["target_forwards"] - rng.randint(0, 20))) for r in b]
    r = stats.paired_ratio(a, b)["tau"]
    half_width = (math.log(r["ci95"][1]) - math.log(r["ci95"][0])) / 2
    assert math.log(r["detectable_ratio"]) / half_width == pytest.approx(2.8 / 1.96, rel=0.1)


def test_problems_for_power_gives_80_percent_power():
    d, delta = 0.2, 0.05
    n = stats.problems_for_power(d, delta)
    assert 600 <= n <= 650  # Connor (1987): ((1.96 sqrt(.2) + 0.84 sqrt(.2 - .0025)) / .05)^2 = 626
    rng = random.Random(1)
    rejected = 0
    for _ in range(400):
        r = stats.paired_difference(*simulate_pairs(n, (d + delta) / 2, (d - delta) / 2, rng))
        rejected += r["mcnemar_p"] < 0.05
    assert 0.72 <= rejected / 400 <= 0.88
    assert stats.problems_for_power(0.0, 0.05) == 0


def test_rank_correlation_is_spearmans_rho():
    assert stats.rank_correlation([1, 2, 3, 4], [10, 20, 30, 40]) == 1
    assert stats.rank_correlation([1, 2, 3, 4], [4, 3, 2, 1]) == -1
    # ranks (0 1 2 3 4) against (1 0 2 4 3): d^2 = 1 + 1 + 0 + 1 + 1 = 4, rho = 1 - 6 * 4 / (5 * 24) = 0.8
    assert stats.rank_correlation([0.1, 0.2, 0.3, 0.4, 0.5], [2.0, 1.0, 3.0, 9.0, 5.0]) == pytest.approx(0.8)
