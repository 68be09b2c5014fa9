"""Statistics of a partition: the class-count matrix, its skew, a text table and a picture."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def class_counts(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> np.ndarray:
    """`[num_clients, num_classes]` matrix of how many samples of each class each client holds."""
    return np.stack([np.bincount(labels[p], minlength=num_classes) for p in parts])


DOMINANCE = 0.9


def partition_skew(counts: np.ndarray, dominance: float = DOMINANCE) -> dict[str, Any]:
    """How label-skewed a partition (`[K, C]` training images per client and class) is:

    - `classes-per-client`: mean, min and max number of classes a client holds (>= 1 image);
    - `label-distance`: the mean and max over clients of the total variation distance between a
      client's label distribution p_k and the global one p, TV(p_k, p) = 1/2 sum_c |p_k,c - p_c| in
      [0, 1]: the share of the client's images whose class would have to change for its mix to be
      the global one (IID: near 0; a client holding one class of ten balanced ones: 0.9). Total
      variation rather than Jensen-Shannon or KL because it is bounded, symmetric, finite when a
      client lacks a class, and reads as a share of images;
    - `dominated-classes`: every class of which one client holds more than `dominance` (90 %) of the
      training images, with that client (its partition id) and its share, largest share first. Such
      a class is learnt by one client only; averaging can lose it (FedGELA's global model at full
      participation and Dirichlet 0.1 lost exactly such a class).
    """
    counts = np.asarray(counts, dtype=np.int64)
    held = (counts > 0).sum(axis=1)
    sizes = counts.sum(axis=1, keepdims=True)
    p_k = counts / np.maximum(sizes, 1)
    p = counts.sum(axis=0) / max(int(counts.sum()), 1)
    tv = 0.5 * np.abs(p_k - p).sum(axis=1)[sizes[:, 0] > 0]
    totals = counts.sum(axis=0)
    dominated = []
    for c in np.flatnonzero(totals):
        owner = int(np.argmax(counts[:, c]))
        share = float(counts[owner, c] / totals[c])
        if share > dominance:
            dominated.append({"class": int(c), "client": owner, "share": share})
    return {
        "classes-per-client": {"mean": float(held.mean()), "min": int(held.min()), "max": int(held.max())},
        "label-distance": {
            "measure": "total-variation",
            "mean": float(tv.mean()) if len(tv) else 0.0,
            "max": float(tv.max()) if len(tv) else 0.0,
        },
        "dominance": dominance,
        "dominated-classes": sorted(dominated, key=lambda d: (-d["share"], d["class"])),
    }


def format_skew(skew: dict[str, Any]) -> str:
    """`partition_skew` in one line."""
    cpc, tv = skew["classes-per-client"], skew["label-distance"]
    owned = ", ".join(
        f"class {d['class']} ({100 * d['share']:.0f} % on client {d['client']})" for d in skew["dominated-classes"]
    )
    return (
        f"classes per client {cpc['mean']:.1f} (min {cpc['min']}, max {cpc['max']}); total variation distance of the "
        f"clients' label distributions to the global one: mean {tv['mean']:.3f}, max {tv['max']:.3f}; "
        f"classes held > {100 * skew['dominance']:.0f} % by one client: {owned or 'none'}"
    )


def format_counts(counts: np.ndarray, max_rows: int = 20) -> str:
    """A fixed-width table: one row per client (first `max_rows`), one column per class."""
    k, c = counts.shape
    width = max(5, len(str(int(counts.max(initial=0)))) + 1)
    head = "client " + "".join(f"{j:>{width}}" for j in range(c)) + f"{'total':>8}{'classes':>8}"
    rows = [head]
    for i in range(min(k, max_rows)):
        row = counts[i]
        rows.append(
            f"{i:>6} " + "".join(f"{int(v):>{width}}" for v in row) + f"{int(row.sum()):>8}{int((row > 0).sum()):>8}"
        )
    if k > max_rows:
        rows.append(f"... ({k - max_rows} more clients)")
    return "\n".join(rows)


def plot_counts(counts: np.ndarray, path: str | Path, title: str = "", max_inches: float = 16.0) -> None:
    """Save a bubble chart (client on x, class on y, area proportional to the count); with more
    than 60 clients or classes a heatmap instead, so the figure stays at most `max_inches` wide."""
    from matplotlib.figure import Figure  # not pyplot: safe in a thread (the ServerApp draws it in one)

    k, c = counts.shape
    size = (min(max_inches, max(4.0, 0.3 * k + 2)), min(max_inches, max(3.0, 0.3 * c + 1.5)))
    fig = Figure(figsize=size)
    ax = fig.subplots()
    if k <= 60 and c <= 60:
        xs, ys = np.meshgrid(np.arange(k), np.arange(c), indexing="ij")
        sizes = 400.0 * counts / max(counts.max(), 1)
        ax.scatter(xs.ravel(), ys.ravel(), s=sizes.ravel(), c="tab:red", alpha=0.6)
        ax.set_yticks(range(c) if c <= 20 else range(0, c, max(1, c // 10)))
    else:
        image = ax.imshow(counts.T, aspect="auto", origin="lower", cmap="Reds", interpolation="nearest")
        fig.colorbar(image, ax=ax, label="samples")
    ax.set_xlabel("client")
    ax.set_ylabel("class")
    ax.set_title(title or f"{k} clients, {c} classes")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
