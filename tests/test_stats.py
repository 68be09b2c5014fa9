"""Statistics over seeds (`fedskew.reports.stats`) on hand-made seeds whose answer is known, and the pairing
they rest on: every method of a seed sees the same partitions and the same sampled clients."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedskew.reports.stats import (
    holm,
    paired,
    paired_gain,
    rank_correlation,
    seeds_needed,
    t_interval,
    t_pvalue,
    t_quantile,
    top_k_chance,
    welch_interval,
)


def test_t_interval_of_known_values() -> None:
    """1, 2, 3: mean 2, sd 1, t(0.975, 2) = 4.3027: half-width 4.3027 / sqrt(3) = 2.4842."""
    iv = t_interval([1.0, 2.0, 3.0])
    assert (iv.mean, iv.sd, iv.n) == (2.0, 1.0, 3)
    assert t_quantile(3) == pytest.approx(4.302653, abs=1e-6)
    assert (iv.low, iv.high) == pytest.approx((2 - 2.484138, 2 + 2.484138), abs=1e-6)
    assert not iv.excludes_zero() and iv.sign() == 0 and iv.text() == "+2.0 [-0.5, +4.5]"
    one = t_interval([5.0])
    assert one.n == 1 and math.isnan(one.low) and not one.excludes_zero() and one.text() == "+5.0 (1 seed)"
    with pytest.raises(ValueError):
        t_interval([])


def test_t_pvalue_of_known_values_and_the_interval_agrees_with_it() -> None:
    """1, 2, 3: t = 2 / (1 / sqrt 3) = sqrt 12 on 2 degrees of freedom, whose tail has the closed form
    P(T_2 >= t) = 1/2 - t / (2 sqrt(2 + t^2)): p = 1 - sqrt(12 / 14) = 0.074180; and on random seeds
    p < 0.05 exactly when the 95 % interval excludes 0 (both are the same t statistic)."""
    assert t_pvalue(t_interval([1.0, 2.0, 3.0])) == pytest.approx(1 - math.sqrt(12 / 14), abs=1e-9)
    assert t_pvalue(t_interval([5.0])) == 1.0
    assert t_pvalue(t_interval([2.0, 2.0])) == 0.0 and t_pvalue(t_interval([0.0, 0.0])) == 1.0
    rng = np.random.default_rng(0)
    for _ in range(200):
        iv = t_interval(rng.normal(rng.normal(0, 1), 1, size=int(rng.integers(3, 12))))
        assert (t_pvalue(iv) < 0.05) == iv.excludes_zero()


def test_holm_steps_down_and_stops_at_the_first_p_above_its_threshold() -> None:
    """m = 4, thresholds 0.05/4, 0.05/3, 0.05/2, 0.05/1 in increasing p: d (0.005 <= 0.0125) and a
    (0.01 <= 0.0167) are rejected, c (0.03 > 0.025) stops it, so b (0.04 <= 0.05) is kept too."""
    assert holm({"a": 0.01, "b": 0.04, "c": 0.03, "d": 0.005}) == {"a", "d"}
    assert holm({"a": 0.001, "b": 0.002}) == {"a", "b"}
    assert holm({"a": 0.2}) == set() and holm({}) == set()
    assert holm({"a": 0.05}) == {"a"}  # one test: Holm is the test itself


def test_holm_bounds_the_chance_of_any_false_beat_where_the_intervals_alone_do_not() -> None:
    """2,000 settings of 20 methods that equal the baseline (7 seeds of paired gains ~ N(0, 3)): some
    interval excludes 0 in about 1 - 0.95^20 = 64 % of them, a Holm-corrected verdict in at most 5 %."""
    rng = np.random.default_rng(1)
    any_interval = any_holm = 0
    for _ in range(2000):
        ivs = {f"m{i}": t_interval(rng.normal(0, 3, size=7)) for i in range(20)}
        any_interval += any(iv.excludes_zero() for iv in ivs.values())
        any_holm += bool(holm({m: t_pvalue(iv) for m, iv in ivs.items()}))
    assert 0.55 < any_interval / 2000 < 0.72
    assert any_holm / 2000 <= 0.06


def test_pairing_removes_what_the_seeds_share() -> None:
    """b moves 20 points over the seeds and a = b + 1 on each: the paired gain is exactly +1 with a
    zero-width interval; the same values unpaired (Welch) cannot tell +1 from 0."""
    b = {0: 50.0, 1: 70.0, 2: 60.0, 3: 55.0}
    a = {s: v + 1.0 for s, v in b.items()}
    gain = paired_gain(a, b)
    assert gain is not None and (gain.mean, gain.low, gain.high) == (1.0, 1.0, 1.0) and gain.sign() == 1
    std = float(np.std(list(b.values())))
    welch = welch_interval((float(np.mean(list(a.values()))), std, 4), (float(np.mean(list(b.values()))), std, 4))
    assert welch is not None and welch.mean == pytest.approx(1.0) and not welch.excludes_zero()
    assert paired({0: 1.0, 5: 2.0}, {5: 1.5, 6: 0.0}) == ([5], pytest.approx(np.array([0.5])))
    assert paired_gain({0: 1.0}, {1: 1.0}) is None  # no shared seed


def test_welch_interval_of_known_values() -> None:
    """Two cells of 3 seeds with population stds p: s^2 = p^2 3 / 2; equal variances give df = 4."""
    p = math.sqrt(2 / 3)  # s = 1
    iv = welch_interval((3.0, p, 3), (1.0, p, 3))
    half = t_quantile(5) * math.sqrt(1 / 3 + 1 / 3)  # t with df = 4 is t_quantile(n = 5)
    assert iv is not None and iv.mean == 2.0 and (iv.low, iv.high) == pytest.approx((2 - half, 2 + half))
    assert welch_interval((1.0, 0.0, 1), (0.0, 0.0, 3)) is None


def test_a_95_interval_covers_the_true_gain_95_times_in_100() -> None:
    """10 seeds of normal noise around a true gain of 0.7, 2000 times (seeded): the share of intervals
    holding 0.7 is 0.95 within three binomial stds (0.0146)."""
    rng = np.random.default_rng(0)
    hits = 0
    for _ in range(2000):
        iv = t_interval(0.7 + rng.normal(0.0, 2.0, size=10))
        hits += iv.low <= 0.7 <= iv.high
    assert abs(hits / 2000 - 0.95) < 3 * math.sqrt(0.95 * 0.05 / 2000)


def test_seeds_needed_is_the_smallest_n_whose_interval_is_narrow_enough() -> None:
    """sd 1, half-width 1: n = 6 gives 2.571 / 2.449 = 1.05 > 1, n = 7 gives 2.447 / 2.646 = 0.92."""
    assert seeds_needed(1.0, 1.0) == 7
    assert seeds_needed(0.0, 1.0) == 2
    assert seeds_needed(3.0, 2.0) == 12  # dir01's measured spread at 3 seeds (docs/leaderboard.md)
    with pytest.raises(ValueError):
        seeds_needed(1.0, 0.0)


def test_top_k_chance_of_known_ranks() -> None:
    """a and b are always first and second, c and d swap on every seed: the top two are certain, c and
    d each rank third with chance 1/2 on average (the draws' means decide)."""
    values = {
        "a": {0: 90.0, 1: 91.0, 2: 92.0},
        "b": {0: 80.0, 1: 81.0, 2: 82.0},
        "c": {0: 70.0, 1: 60.0, 2: 70.0},
        "d": {0: 60.0, 1: 70.0, 2: 60.0},
    }
    two = top_k_chance(values, k=2)
    assert two["a"] == 1.0 and two["b"] == 1.0 and two["c"] == 0.0 and two["d"] == 0.0
    three = top_k_chance(values, k=3)
    assert three["c"] + three["d"] == pytest.approx(1.0, abs=0.05) and 0.5 < three["c"] < 0.95  # c wins 2 of 3
    tied = top_k_chance({"a": {0: 1.0}, "b": {0: 1.0}, "c": {0: 0.0}}, k=1)
    assert tied == {"a": 1.0, "b": 1.0, "c": 0.0}  # a tie counts for every tied entry


def test_rank_correlation() -> None:
    assert rank_correlation([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert rank_correlation([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)


def test_every_method_of_a_seed_sees_the_same_partitions_and_client_samples() -> None:
    """The pairing the gains rest on: for each seed, every registered method's strategy samples the
    same partitions in every round, and the clients hold the same data (the partition is a function
    of the data config and the seed, not of the method); another seed samples others."""
    from fedskew.config import validate
    from fedskew.data.clients import client_indices
    from fedskew.registry import METHODS
    from tests.harness import app_defaults

    class Grid:  # discovery's answers: node 100 + i serves partition i
        def __init__(self, n: int) -> None:
            self.n = n

    samples: dict[int, set[tuple]] = {}
    for seed in (0, 1):
        for name, spec in METHODS.items():
            cfg = validate(
                {**app_defaults(), "method": name, "seed": seed, "num-partitions": 20, "fraction-train": 0.25}
            )
            strategy = spec.strategy_class()(cfg)
            strategy.discover = lambda grid: {100 + i: i for i in range(grid.n)}  # type: ignore[method-assign]
            rounds = tuple(tuple(strategy.sample(r, Grid(20))) for r in range(1, 41))
            samples.setdefault(seed, set()).add(rounds)
        parts = {
            tuple(tuple(p) for p, _ in client_indices(validate({**app_defaults(), "method": m, "seed": seed}), 20))
            for m in ("fedavg", "fedrs", "mupfl", "fedproto")
        }
        assert len(parts) == 1
    assert len(samples[0]) == 1 and len(samples[1]) == 1  # one sample sequence per seed, whatever the method
    assert samples[0] != samples[1]
