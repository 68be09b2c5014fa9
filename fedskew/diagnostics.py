"""What label skew does class by class: per-class, balanced, worst-class and head/middle/tail
accuracy from a confusion matrix, the classifier's per-class weight norms and how many of a round's
clients hold each class (pure numpy, no Flower, no torch).

Conventions, used by the server's central evaluation and by the clients' evaluation of their
personalized models on the central test set:

- The confusion matrix M is `[C, C]`, M[i, j] = test images of true class i predicted as j.
- Per-class accuracy (recall) a_c = M[c, c] / sum_j M[c, j]. A class with no test image is
  *absent*: its a_c is None (null in JSON), never 0 or NaN, and it is left out of every mean and of
  the worst class.
- Balanced accuracy = mean of a_c over the present classes (the macro-averaged recall of
  Brodersen et al., ICPR'10); on a balanced test set it equals the plain accuracy.
- Worst class = argmin_c a_c over the present classes (the smallest class id on a tie).
- Head / middle / tail (`frequency_groups`): long-tail papers split classes by their number of
  training images, many-shot > 100, medium-shot 20-100, few-shot < 20 (Liu et al., "Large-Scale
  Long-Tailed Recognition in an Open World", CVPR'19, §5, on ImageNet-LT and Places-LT with
  hundreds of classes). Those absolute thresholds put every class of a 10-class long tail with an
  imbalance factor of 10-100 (60-6,000 images a class on Fashion-MNIST) in one group, so fedskew
  splits relatively: the classes ranked by global training frequency (most frequent first, ties by
  class id) are cut into thirds, head = the first round(C / 3), tail = the last round(C / 3),
  middle = the rest (C = 10: 3 / 4 / 3). The split is made only when the most frequent class has
  at least `LONG_TAIL_MIN_RATIO` times the images of the rarest one: a balanced training set has no
  tail, and thirds of equal counts would be arbitrary. A group's accuracy is the mean a_c over its
  present classes.
- Class holders: how many of the round's clients have at least one training image of each class
  (FedRS's "observed classes" at tau = 1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

LONG_TAIL_MIN_RATIO = 2.0
# the `metrics.jsonl` keys whose value is a list indexed by class (their names end so)
PER_CLASS = ("per-class-accuracy", "classifier-norms", "class-holders")
PerClass = list[float | None]


def is_per_class(key: str) -> bool:
    """Whether the `metrics.jsonl` key `key` holds one value per class."""
    return key.endswith(PER_CLASS)


def per_class_accuracy(cm: np.ndarray) -> PerClass:
    """a_c = M[c, c] / sum_j M[c, j] for every class; None for a class absent from the test set."""
    support = cm.sum(axis=1)
    return [float(cm[c, c] / n) if n > 0 else None for c, n in enumerate(support)]


def mean_over(per_class: Sequence[float | None], classes: Sequence[int] | None = None) -> float | None:
    """Mean accuracy over `classes` (default: all) that are present; None when none is."""
    picked = range(len(per_class)) if classes is None else classes
    values = [per_class[c] for c in picked if per_class[c] is not None]
    return float(np.mean(values)) if values else None


def balanced_accuracy(per_class: Sequence[float | None]) -> float | None:
    """Mean per-class accuracy over the present classes."""
    return mean_over(per_class)


def worst_class(per_class: Sequence[float | None]) -> tuple[int, float] | None:
    """(class, accuracy) of the least accurate present class (the smallest id on a tie)."""
    present = [(a, c) for c, a in enumerate(per_class) if a is not None]
    if not present:
        return None
    acc, cls = min(present)
    return cls, acc


def frequency_groups(train_counts: np.ndarray, min_ratio: float = LONG_TAIL_MIN_RATIO) -> dict[str, list[int]] | None:
    """Head / middle / tail classes by global training frequency (thirds of the ranking, see the
    module docstring); None when the training set is not long-tailed (max / min < `min_ratio`)."""
    counts = np.asarray(train_counts, dtype=np.float64)
    c = len(counts)
    if c < 3 or counts.max() < min_ratio * counts.min():
        return None
    order = [int(i) for i in np.argsort(-counts, kind="stable")]
    k = round(c / 3)
    return {"head": sorted(order[:k]), "middle": sorted(order[k : c - k]), "tail": sorted(order[c - k :])}


def class_holders(client_counts: np.ndarray, partitions: Sequence[int]) -> list[int]:
    """For each class, how many of the clients `partitions` (rows of `client_counts`, clients x
    classes training images) hold at least one training image of it."""
    rows = np.asarray(client_counts)[list(partitions)]
    return [int(v) for v in (rows > 0).sum(axis=0)]


def weight_norms(weights: np.ndarray) -> list[float]:
    """||w_c||_2 of every class vector (rows of the `[C, d]` classifier matrix)."""
    return [float(v) for v in np.linalg.norm(np.asarray(weights, dtype=np.float64), axis=1)]


def class_metrics(
    cm: np.ndarray,
    groups: dict[str, list[int]] | None = None,
    norms: Sequence[float] | None = None,
    holders: Sequence[int] | None = None,
    prefix: str = "global-",
) -> dict[str, Any]:
    """The per-class record of one evaluation (keys as in `metrics.jsonl`): per-class, balanced and
    worst-class accuracy, head / middle / tail accuracy when `groups` is given, the classifier's
    per-class weight norms and the class holders when known."""
    acc = per_class_accuracy(cm)
    worst = worst_class(acc)
    out: dict[str, Any] = {
        f"{prefix}per-class-accuracy": acc,
        f"{prefix}balanced-accuracy": balanced_accuracy(acc),
        f"{prefix}worst-class": None if worst is None else worst[0],
        f"{prefix}worst-class-accuracy": None if worst is None else worst[1],
    }
    for name, classes in (groups or {}).items():
        out[f"{prefix}{name}-accuracy"] = mean_over(acc, classes)
    if norms is not None:
        out[f"{prefix}classifier-norms"] = list(norms)
    if holders is not None:
        out["class-holders"] = list(holders)
    return out


def held_and_missing_accuracy(cm: np.ndarray, held: np.ndarray) -> tuple[float | None, float | None]:
    """Mean per-class accuracy over the classes a client holds (`held[c]` true) and over those it
    lacks, each over the classes present in the test set (None when there is none)."""
    acc = per_class_accuracy(cm)
    held = np.asarray(held, dtype=bool)
    return mean_over(acc, np.flatnonzero(held).tolist()), mean_over(acc, np.flatnonzero(~held).tolist())


def last_rounds_per_class(rows: Sequence[dict[str, Any]], key: str, last: int) -> PerClass | None:
    """Mean of each class's accuracy over the rounds in (R - last, R] that measured it (`rows`:
    `metrics.jsonl` lines, `key` a per-class list); None when no such round has the key."""
    final_round = max((int(r["round"]) for r in rows), default=0)
    lists = [r[key] for r in rows if int(r["round"]) > final_round - last and isinstance(r.get(key), list)]
    if not lists:
        return None
    out: PerClass = []
    for c in range(len(lists[0])):
        values = [v[c] for v in lists if c < len(v) and _number(v[c])]
        out.append(float(np.mean(values)) if values else None)
    return out


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
