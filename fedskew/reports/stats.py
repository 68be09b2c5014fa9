"""Statistics over seeds: paired gains with 95 % intervals, seeds needed, ranks with their chance.

A suite runs every method of a seed on the same partition and the same sampled clients (the server
samples with a generator seeded by (seed, round), `fedskew.strategies.base.BaseStrategy.sample`), so
a method's gain over a baseline is measured seed by seed: d_s = a_s - b_s. The seeds' partitions
and samples move accuracy by several points at a 40-round budget, far more than most methods do;
pairing removes that shared part, which an unpaired comparison (mean_a - mean_b against
std_a + std_b) leaves in.

Interval: Student's t over the n paired differences,

    mean(d) +- t_{0.975, n-1} * sd(d) / sqrt(n),      sd with n - 1 in the denominator,

exact when the differences are normal and close to it for sums of many rounds' accuracies; a
percentile bootstrap over n = 3-10 seeds is too narrow (it ignores t's tails and shrinks sd by
sqrt((n-1)/n)), so it serves only where no closed form exists: the chance of a rank, from
resampling whole seeds (every method's value of a drawn seed together, keeping the pairing).

"Beats" is said only where the interval excludes 0. A setting asks that of many methods at once: with
m of them at the 95 % level, about 0.05 m intervals exclude 0 by chance alone when no method differs
from the baseline. Holm's step-down procedure (Holm 1979) bounds that family-wise error at 5 %: sort
the paired t-tests' two-sided p-values p_(1) <= ... <= p_(m), reject while p_(i) <= 0.05 / (m - i + 1)
and stop at the first that is not; the page marks the verdicts that survive it.

The seeds a comparison needs: the smallest n with t_{0.975, n-1} * sd / sqrt(n) <= h, the half-width
that separates a difference of h from 0.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats as sp

LEVEL = 0.95


@dataclass(frozen=True)
class Interval:
    """A mean over `n` seeds with its two-sided `LEVEL` interval (`low`, `high`; NaN when n < 2)."""

    mean: float
    low: float
    high: float
    n: int
    sd: float  # of the values the interval is over (n - 1 denominator; NaN when n < 2)

    @property
    def half(self) -> float:
        return (self.high - self.low) / 2

    def excludes_zero(self) -> bool:
        return self.n >= 2 and (self.low > 0 or self.high < 0)

    def sign(self) -> int:
        """+1 / -1 when the interval lies above / below 0, else 0 (not established)."""
        if not self.excludes_zero():
            return 0
        return 1 if self.low > 0 else -1

    def text(self, digits: int | None = None) -> str:
        """'+3.2 [+1.1, +5.3]' (one decimal from a magnitude of 1 up, else two); '+3.2 (1 seed)'."""
        d = digits if digits is not None else (1 if abs(self.mean) >= 1 or self.half >= 1 else 2)
        if self.n < 2:
            return f"{self.mean:+.{d}f} (1 seed)"
        return f"{self.mean:+.{d}f} [{self.low:+.{d}f}, {self.high:+.{d}f}]"


def t_quantile(n: int, level: float = LEVEL) -> float:
    """t_{(1 + level) / 2, n - 1}: 4.30 for 3 seeds, 2.26 for 10, 1.96 in the limit."""
    return float(sp.t.ppf((1 + level) / 2, n - 1))


def t_interval(values: Sequence[float], level: float = LEVEL) -> Interval:
    """The mean of `values` (one per seed) with its Student-t interval (module docstring)."""
    x = np.asarray(values, dtype=np.float64)
    n = len(x)
    if n == 0:
        raise ValueError("an interval needs at least one value")
    mean = float(x.mean())
    if n < 2:
        return Interval(mean, math.nan, math.nan, 1, math.nan)
    sd = float(x.std(ddof=1))
    half = t_quantile(n, level) * sd / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n, sd)


def paired(a: Mapping[int, float], b: Mapping[int, float]) -> tuple[list[int], np.ndarray]:
    """The seeds both `a` and `b` (seed -> value) hold, and a - b on each of them."""
    seeds = sorted(set(a) & set(b))
    return seeds, np.array([a[s] - b[s] for s in seeds], dtype=np.float64)


def paired_gain(a: Mapping[int, float], b: Mapping[int, float], level: float = LEVEL) -> Interval | None:
    """The gain of `a` over `b` paired by seed, with its interval; None when they share no seed."""
    seeds, d = paired(a, b)
    return t_interval(d, level) if seeds else None


def welch_interval(a: tuple[float, float, int], b: tuple[float, float, int], level: float = LEVEL) -> Interval | None:
    """The unpaired gain a - b from each side's (mean, population std over its seeds, seeds), with
    Welch's interval: sd^2 = s_a^2 / n_a + s_b^2 / n_b (s the n - 1 std) and the
    Welch-Satterthwaite degrees of freedom. For cells that did not keep their per-seed values: wider
    than a paired interval, since the seeds' shared part stays in. None with fewer than 2 seeds a side."""
    (ma, pa, na), (mb, pb, nb) = a, b
    if na < 2 or nb < 2:
        return None
    va, vb = pa**2 / (na - 1), pb**2 / (nb - 1)  # s^2 / n, s^2 = p^2 n / (n - 1)
    se2 = va + vb
    mean = ma - mb
    if se2 == 0:
        return Interval(mean, mean, mean, min(na, nb), 0.0)
    df = se2**2 / (va**2 / (na - 1) + vb**2 / (nb - 1))
    half = float(sp.t.ppf((1 + level) / 2, df)) * math.sqrt(se2)
    return Interval(mean, mean - half, mean + half, min(na, nb), math.sqrt(se2 * min(na, nb)))


def t_pvalue(iv: Interval) -> float:
    """The two-sided p-value of a one-sample t-test of mean 0 on the values `iv` is over:
    2 P(T_{n-1} >= |mean| / (sd / sqrt(n))); 1 for a single value, 0 for a nonzero mean with sd 0."""
    if iv.n < 2:
        return 1.0
    if iv.sd == 0:
        return 0.0 if iv.mean != 0 else 1.0
    t = abs(iv.mean) / (iv.sd / math.sqrt(iv.n))
    return float(2 * sp.t.sf(t, iv.n - 1))


def holm(pvalues: Mapping[str, float], alpha: float = 1 - LEVEL) -> set[str]:
    """The entries Holm's step-down procedure rejects at family-wise error `alpha` (module docstring):
    in increasing p, reject while p_(i) <= alpha / (m - i + 1), i = 1..m; ties keep their order."""
    order = sorted(pvalues, key=lambda name: pvalues[name])
    m = len(order)
    rejected: set[str] = set()
    for i, name in enumerate(order):
        if pvalues[name] > alpha / (m - i):
            break
        rejected.add(name)
    return rejected


def seeds_needed(sd: float, half_width: float, level: float = LEVEL, most: int = 1000) -> int:
    """The smallest n >= 2 whose interval half-width t_{n-1} sd / sqrt(n) is at most `half_width`
    (`most` when none up to it is)."""
    if half_width <= 0:
        raise ValueError(f"half_width={half_width!r}: must be > 0")
    for n in range(2, most + 1):
        if t_quantile(n, level) * sd / math.sqrt(n) <= half_width:
            return n
    return most


def top_k_chance(
    values: Mapping[str, Mapping[int, float]], k: int = 3, draws: int = 4000, seed: int = 0
) -> dict[str, float]:
    """Each entry's chance of ranking among the top `k` (highest mean) when the seeds are drawn again:
    `draws` bootstrap samples of the seeds every entry holds, with replacement, each entry's mean over
    the drawn seeds (one draw for all: the pairing kept), ties counted for every tied entry."""
    names = list(values)
    seeds = sorted(set.intersection(*(set(v) for v in values.values()))) if names else []
    if not seeds:
        return {name: math.nan for name in names}
    table = np.array([[values[name][s] for s in seeds] for name in names])  # [entries, seeds]
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(seeds), size=(draws, len(seeds)))
    means = table[:, picks].mean(axis=2)  # [entries, draws]
    kth = -np.sort(-means, axis=0)[min(k, len(names)) - 1]  # the k-th best mean of each draw
    return {name: float((means[i] >= kth).mean()) for i, name in enumerate(names)}


def rank_correlation(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation of two scores of the same entries (e.g. two budgets)."""
    return float(sp.spearmanr(a, b).statistic)
