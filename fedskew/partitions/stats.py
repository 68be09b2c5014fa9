"""Statistics of a partition: the class-count matrix, a text table and a picture."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def class_counts(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> np.ndarray:
    """`[num_clients, num_classes]` matrix of how many samples of each class each client holds."""
    return np.stack([np.bincount(labels[p], minlength=num_classes) for p in parts])


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
