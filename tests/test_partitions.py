"""Property tests of the label-skew partitions (pure numpy)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from fedskew.config import validate
from fedskew.partitions import (
    PartitionError,
    class_counts,
    classes_per_client_label_quantity,
    classes_per_client_pfllib_pat,
    classes_per_client_pmcn,
    classes_per_client_shards,
    dirichlet,
    format_counts,
    iid,
    long_tail,
    map_random,
    partition,
    plot_counts,
    split_local_test,
)

LABELS = np.repeat(np.arange(10), 500)  # 10 classes x 500
np.random.default_rng(0).shuffle(LABELS)


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def assert_disjoint(parts: list[np.ndarray], n: int, complete: bool = True) -> None:
    allidx = np.concatenate(parts)
    assert len(np.unique(allidx)) == len(allidx), "an index is used twice"
    assert allidx.min() >= 0 and allidx.max() < n
    if complete:
        assert len(allidx) == n, "every index must be used"


@pytest.mark.parametrize("seed", range(3))
def test_iid_is_balanced_and_complete(seed: int) -> None:
    parts = iid(LABELS, 7, rng(seed))
    assert_disjoint(parts, len(LABELS))
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize(("alpha", "k"), [(0.1, 10), (0.5, 20), (100.0, 5)])
def test_dirichlet_complete_with_min_size(alpha: float, k: int) -> None:
    parts = dirichlet(LABELS, k, alpha, rng(1), min_size=10)
    assert_disjoint(parts, len(LABELS))
    assert min(len(p) for p in parts) >= 10


def test_dirichlet_skew_grows_as_alpha_shrinks() -> None:
    def mean_classes(alpha: float) -> float:
        counts = class_counts(LABELS, dirichlet(LABELS, 10, alpha, rng(2)), 10)
        return float(((counts / counts.sum(1, keepdims=True)) > 0.05).sum(1).mean())

    assert mean_classes(0.05) < mean_classes(1.0) < mean_classes(100.0) + 1e-9


def test_dirichlet_impossible_min_size_raises() -> None:
    with pytest.raises(PartitionError, match="min-partition-size"):
        dirichlet(LABELS, 10, 0.5, rng(), min_size=1000)


@pytest.mark.parametrize(("k", "m"), [(10, 2), (5, 2), (20, 3), (7, 10), (10, 1)])
def test_pmcn_gives_exactly_m_classes_and_covers_all(k: int, m: int) -> None:
    parts = classes_per_client_pmcn(LABELS, k, m, rng(3))
    assert_disjoint(parts, len(LABELS))
    counts = class_counts(LABELS, parts, 10)
    assert ((counts > 0).sum(1) == m).all()
    assert (counts.sum(0) == 500).all()
    if k * m == 10:  # P5C2: fully class-disjoint
        assert ((counts > 0).sum(0) == 1).all()


def test_pmcn_splits_each_class_evenly_among_holders() -> None:
    counts = class_counts(LABELS, classes_per_client_pmcn(LABELS, 20, 2, rng(4)), 10)
    for c in range(10):
        held = counts[:, c][counts[:, c] > 0]
        assert held.max() - held.min() <= 1


def test_pmcn_rejects_uncoverable_requests() -> None:
    with pytest.raises(PartitionError, match="no client"):
        classes_per_client_pmcn(LABELS, 3, 2, rng())
    with pytest.raises(PartitionError):
        classes_per_client_pmcn(LABELS, 30, 11, rng())


@pytest.mark.parametrize("m", [1, 2, 5])
def test_shards_match_fedrs_c10_100_m(m: int) -> None:
    labels = np.repeat(np.arange(10), 5000)
    parts = classes_per_client_shards(labels, 100, m, rng(5))
    assert_disjoint(parts, len(labels))
    counts = class_counts(labels, parts, 10)
    assert ((counts > 0).sum(1) == m).all()
    assert (counts.sum(1) == 500).all()  # exactly 500 samples per client
    assert ((counts > 0).sum(0) == 100 * m // 10).all()  # each class on K m / C clients


def test_shards_require_m_to_divide_classes() -> None:
    with pytest.raises(PartitionError, match="divide"):
        classes_per_client_shards(LABELS, 10, 3, rng())


@pytest.mark.parametrize(("k", "m"), [(10, 2), (20, 2), (13, 3), (10, 1), (10, 10)])
def test_label_quantity_gives_client_k_class_k_mod_c_and_m_classes(k: int, m: int) -> None:
    """NIID-Bench #C=m: client k holds class k mod C and exactly m distinct classes; every sample is
    used, each class split evenly among its holders."""
    parts = classes_per_client_label_quantity(LABELS, k, m, rng(11))
    assert_disjoint(parts, len(LABELS))
    counts = class_counts(LABELS, parts, 10)
    assert ((counts > 0).sum(1) == m).all()
    assert all(counts[i, i % 10] > 0 for i in range(k))
    for c in range(10):
        held = counts[:, c][counts[:, c] > 0]
        assert held.max() - held.min() <= 1


def test_label_quantity_draws_the_other_classes_uniformly() -> None:
    """Client 0's second class over 900 seeds: each of the 9 others about 100 times (a binomial's
    sd is 9.4: 5 sd either side), never class 0 itself; and the holders differ from seed to seed,
    unlike pmcn's fixed first pairs."""
    seen = np.zeros(10, dtype=int)
    for seed in range(900):
        counts = class_counts(LABELS, classes_per_client_label_quantity(LABELS, 10, 2, rng(seed)), 10)
        seen[np.flatnonzero(counts[0])] += 1
    assert seen[0] == 900 and (abs(seen[1:] - 100) < 47).all()


def test_the_run_config_picks_label_quantity() -> None:
    cfg = validate({"partition": "classes-per-client", "classes-per-client-mode": "label-quantity"})
    expected = classes_per_client_label_quantity(LABELS, 10, 2, rng(5))
    assert all(np.array_equal(a, b) for a, b in zip(partition(LABELS, 10, cfg, seed=5), expected, strict=True))


def digest(parts: list[np.ndarray]) -> str:
    return hashlib.sha256(np.concatenate([np.sort(p).astype(np.int64) for p in parts]).tobytes()).hexdigest()


# Flower's niid_bench (`baselines/niid_bench/niid_bench/dataset_preparation.py` at 4facb3fc,
# `partition_data_dirichlet` and `partition_data_label_quantity`) run on LABELS at its seed 42 with 10
# clients (Dirichlet 0.5; 2 labels a client): the sizes, the classes and the sha256 of the clients'
# sorted indices (`digest`) their code gives.
NIID_BENCH_42 = {
    "dirichlet": (
        [261, 527, 533, 732, 284, 873, 516, 558, 199, 517],
        "62868a05b76d8e409d491a8ed4f08b71c1a99b5b6b3418aee89b1efdf1590165",
    ),
    "label-quantity": (
        [334, 750, 417, 667, 416, 417, 500, 333, 500, 666],
        "066ea1dbf4717a6d7bce463fed602d1a20340cc4edca54646a08dc59c8035280",
    ),
}
NIID_BENCH_42_CLASSES = [[0, 7], [1, 6], [2, 4], [3, 4], [4, 8], [0, 5], [2, 6], [0, 7], [5, 8], [7, 9]]


def test_niid_bench_splits_are_theirs_index_for_index_at_their_seed() -> None:
    """`dirichlet` and `label-quantity` make niid_bench's draws call for call, so the same seed gives
    their split: the one every run of their table used (seed 42)."""
    for name, parts in (
        ("dirichlet", dirichlet(LABELS, 10, 0.5, rng(42))),
        ("label-quantity", classes_per_client_label_quantity(LABELS, 10, 2, rng(42))),
    ):
        assert ([len(p) for p in parts], digest(parts)) == NIID_BENCH_42[name], name
    counts = class_counts(LABELS, classes_per_client_label_quantity(LABELS, 10, 2, rng(42)), 10)
    assert [sorted(np.flatnonzero(c).tolist()) for c in counts] == NIID_BENCH_42_CLASSES


def test_label_quantity_needs_a_client_per_class() -> None:
    with pytest.raises(PartitionError, match="at least 10 clients"):
        classes_per_client_label_quantity(LABELS, 9, 2, rng())
    with pytest.raises(PartitionError, match="11 > 10 classes"):
        classes_per_client_label_quantity(LABELS, 10, 11, rng())


def test_pfllib_pat_deals_classes_in_order_in_unequal_random_parts() -> None:
    """PFLlib's pathological split, 20 clients x 2 classes: clients 4j..4j+3 hold classes 2j and
    2j+1; each class's first three parts lie in [int(s / 10), int(s)), s = 500 / 4, the fourth is the
    rest; client sizes differ and move with the seed."""
    parts = classes_per_client_pfllib_pat(LABELS, 20, 2, rng(12))
    assert_disjoint(parts, len(LABELS))
    counts = class_counts(LABELS, parts, 10)
    for k in range(20):
        assert set(np.flatnonzero(counts[k])) == {2 * (k // 4), 2 * (k // 4) + 1}
    for c in range(10):
        first = counts[4 * (c // 2) : 4 * (c // 2) + 3, c]
        assert ((first >= 12) & (first < 125)).all() and counts[:, c].sum() == 500
    sizes = [len(p) for p in parts]
    assert len(set(sizes)) > 10
    assert sizes != [len(p) for p in classes_per_client_pfllib_pat(LABELS, 20, 2, rng(13))]


def test_pfllib_pat_refuses_a_class_without_a_client() -> None:
    with pytest.raises(PartitionError, match=r"class 8 \(500 samples\) finds 0 clients with room"):
        classes_per_client_pfllib_pat(LABELS, 7, 2, rng())


def test_long_tail_profile_then_dirichlet() -> None:
    labels = np.repeat(np.arange(10), 1000)
    parts = long_tail(labels, 10, 10.0, 0.5, rng(6), min_size=5)
    assert_disjoint(parts, len(labels), complete=False)
    total = class_counts(labels, parts, 10).sum(0)
    expected = np.floor(1000 * 10.0 ** (-np.arange(10) / 9)).astype(int)
    assert (total == expected).all()
    assert total[0] / total[-1] == pytest.approx(10, rel=0.01)


def test_map_random_classes_and_sizes() -> None:
    parts = map_random(LABELS, 20, rng(7), sigma=0.3, min_size=5)
    assert_disjoint(parts, len(LABELS), complete=False)
    counts = class_counts(LABELS, parts, 10)
    held = (counts > 0).sum(1)
    assert (held >= 2).all() and (held <= 10).all()
    assert min(len(p) for p in parts) >= 5
    assert counts.sum() >= len(LABELS) - 10 * 20  # rounding loses at most a few per class


def test_split_local_test_follows_the_label_distribution() -> None:
    part = classes_per_client_pmcn(LABELS, 10, 2, rng(8))[0]
    tr, te = split_local_test(part, LABELS, 0.2, rng(9))
    assert len(np.intersect1d(tr, te)) == 0 and len(tr) + len(te) == len(part)
    for c in np.unique(LABELS[part]):
        n_c = int((LABELS[part] == c).sum())
        assert int((LABELS[te] == c).sum()) == int(np.floor(0.2 * n_c))
    assert set(np.unique(LABELS[te])) <= set(np.unique(LABELS[part]))
    tr, te = split_local_test(part[:3], LABELS, 0.2, rng())  # tiny client: still one test sample
    assert len(te) == 1 and len(tr) == 2


@pytest.mark.parametrize(
    ("name", "mode"),
    [(n, "pmcn") for n in ("iid", "dirichlet", "classes-per-client", "long-tail", "map-random")]
    + [("classes-per-client", m) for m in ("shards", "label-quantity", "pfllib-pat")],
)
def test_partition_is_deterministic_for_a_seed(name: str, mode: str) -> None:
    cfg = validate({"partition": name, "classes-per-client-mode": mode})
    a, b = partition(LABELS, 10, cfg, seed=3), partition(LABELS, 10, cfg, seed=3)
    c = partition(LABELS, 10, cfg, seed=4)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert any(not np.array_equal(x, y) for x, y in zip(a, c, strict=True))


def test_statistics_table_and_picture(tmp_path) -> None:
    counts = class_counts(LABELS, classes_per_client_pmcn(LABELS, 5, 2, rng()), 10)
    text = format_counts(counts)
    assert text.splitlines()[0].startswith("client") and len(text.splitlines()) == 6
    assert "1000" in text  # 500 + 500 samples of two classes
    plot_counts(counts, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_picture_of_many_clients_stays_bounded(tmp_path) -> None:
    """1,000 clients give a heatmap at most 16 inches (1,600 px at 100 dpi) wide, not 30,000 px."""
    import struct

    counts = np.random.default_rng(0).integers(0, 50, size=(1000, 10))
    plot_counts(counts, tmp_path / "p.png")
    width, height = struct.unpack(">II", (tmp_path / "p.png").read_bytes()[16:24])
    assert width <= 1600 and height <= 1600
