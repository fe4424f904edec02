"""
Statistics of paired runs: every comparison here is of two configurations on the same prompts or
problems, so intervals resample the prompts (both runs together) or count discordant pairs.
bench.py's ratios of sums with a paired bootstrap and quartiles; lossy.py's Wilson intervals,
paired accuracy differences (Agresti-Min, McNemar), the problems a difference needs, and rank
correlation.
"""
import math
import statistics

import torch


def quartiles(xs):
    xs = sorted(xs)
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[1], q[2]


def paired_ratio(a: list, b: list, resamples: int = 10000, seed: int = 0) -> dict:
    """Two runs on the same prompts: the ratio of their overall tau (new tokens over target
    forwards, each summed over prompts) and of their tokens/s (summed over prompts), with 95%
    percentile bootstrap intervals that resample prompts, both runs' results together (paired).
    Each also says the smallest effect these prompts detect: the ratio whose distance from 1 is
    (1.96 + 0.84) bootstrap standard errors of the log ratio, found 95% of the time at 80%
    power (a two-sided test). It says nothing of what another training seed would move."""
    def per_prompt(runs, key):
        return torch.tensor([float(r[key]) for r in runs], dtype=torch.double)  # (n,)

    def overall_tau(runs, rows):
        new, forwards = per_prompt(runs, "new_tokens"), per_prompt(runs, "target_forwards")
        return new[rows].sum(-1) / forwards[rows].sum(-1)

    def overall_speed(runs, rows):
        return per_prompt(runs, "wall_tokens_per_s")[rows].sum(-1)

    n = len(a)
    every = torch.arange(n)
    drawn = torch.randint(n, (resamples, n), generator=torch.Generator().manual_seed(seed))  # (resamples, n)
    out = {"prompts": n}
    for name, measure in (("tau", overall_tau), ("tokens_per_s", overall_speed)):
        boot = measure(a, drawn) / measure(b, drawn)  # (resamples,)
        lo, hi = torch.quantile(boot, torch.tensor([0.025, 0.975], dtype=torch.double)).tolist()
        detectable = math.exp((1.96 + 0.84) * boot.log().std().item())
        out[name] = {"ratio": (measure(a, every) / measure(b, every)).item(), "ci95": [lo, hi],
                     "detectable_ratio": detectable}
    return out


def wilson(successes: int, n: int, z: float = 1.96):
    """95% Wilson score interval of a proportion."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def mcnemar_p(only_a: int, only_b: int) -> float:
    """Exact two-sided McNemar test: under no difference, each discordant problem is a fair coin."""
    n, k = only_a + only_b, min(only_a, only_b)
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def paired_difference(a: list, b: list, z: float = 1.96) -> dict:
    """Accuracy of b minus accuracy of a on the same problems, with the Agresti-Min (2005) 95%
    interval (the Wald interval of a paired difference with half a count added to each cell)."""
    n = len(a)
    only_a = sum(x and not y for x, y in zip(a, b))
    only_b = sum(y and not x for x, y in zip(a, b))
    diff = (only_b - only_a) / n
    ca, cb, m = only_a + 0.5, only_b + 0.5, n + 2
    half = z * math.sqrt(max(ca + cb - (cb - ca) ** 2 / m, 0.0)) / m
    centre = (cb - ca) / m
    return {"n": n, "difference": diff, "ci95": (centre - half, centre + half), "only_reference": only_a,
            "only_this": only_b, "discordance": (only_a + only_b) / n, "mcnemar_p": mcnemar_p(only_a, only_b)}


def problems_for_power(discordance: float, delta: float = 0.05, z_alpha: float = 1.96,
                       z_power: float = 0.8416) -> int:
    """Problems a paired test needs to detect an accuracy difference delta (two-sided 5%, 80% power)
    when a fraction `discordance` of problems differ between the two runs (Connor 1987)."""
    if discordance <= delta ** 2:
        return 0
    return math.ceil((z_alpha * math.sqrt(discordance) + z_power * math.sqrt(discordance - delta ** 2)) ** 2
                     / delta ** 2)


def rank_correlation(xs: list, ys: list) -> float:
    """Spearman's rho (no ties expected among these real-valued measurements)."""
    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        return [order.index(i) for i in range(len(v))]
    rx, ry, n = ranks(xs), ranks(ys), len(xs)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry)) / (n * (n * n - 1))


def reliability(pairs: list, bins: int = 10) -> dict:
    """The verification head's calibration from (predicted probability, kept) pairs: per bin of
    predicted probability, how many drafted tokens fell there, their mean prediction and the share
    the verifier kept; and the Brier score (lower is better; a constant at the kept share scores
    share * (1 - share))."""
    if not pairs:
        return {"tokens": 0, "bins": [], "brier": None, "kept_share": None}
    rows = []
    for b in range(bins):
        lo, hi = b / bins, (b + 1) / bins
        inside = [(p, kept) for p, kept in pairs if lo <= p < hi or (b == bins - 1 and p == 1.0)]
        if inside:
            rows.append({"from": lo, "to": hi, "tokens": len(inside),
                         "predicted": statistics.mean(p for p, _ in inside),
                         "kept": statistics.mean(float(kept) for _, kept in inside)})
    return {"tokens": len(pairs), "bins": rows, "kept_share": statistics.mean(float(k) for _, k in pairs),
            "brier": statistics.mean((p - float(kept)) ** 2 for p, kept in pairs)}
