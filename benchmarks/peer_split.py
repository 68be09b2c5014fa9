"""Is PFLlib's Dir(0.1) split easier for a personalized model than the suite's? Their split replayed
from their code, set beside `peer-pfllib`'s `dir01`, and both scored by one measure of how far a
client's label prior alone carries a classifier.

The replay transcribes PFLlib's `dataset/utils/dataset_utils.py` `separate_data` ("dir", at b9565b0c)
as `dataset/generate_FashionMNIST.py` (6576ab85) calls it: Fashion-MNIST's 60,000 training labels then
its 10,000 test labels, `np.random.seed(1)`, 20 clients, alpha 0.1, redrawn until every client holds
least_samples = min(batch 10 / test share 0.25, N / 2K) = 40 images. The draws depend on the labels
only (their loaders do not shuffle), so the replay gives their clients' class counts exactly.

For each split, beside the concentration of its clients' labels (the pooled share of each client's
largest class; exp of the sample-weighted label entropy), the prior-adjusted accuracy under a global
model g: client k predicts argmax_c log g_c(x) + log pi_kc (pi_k its label shares; the Bayes rule for
its prior when g is calibrated on balanced classes), scored on the central test set per class and
weighed by pi_k, then pooled over clients by their sizes, as PFLlib pools its personalized accuracy.
One classifier for both splits, so the difference is the split's alone.

    .venv/bin/python benchmarks/peer_split.py outputs/suites/peer-pfllib/dir01--fedavg--s0 [--doc docs/notes/peers.md]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from _common import as_page_names, write_block

from fedskew.data import load_arrays
from fedskew.data.clients import load_test_set
from fedskew.models import build_model

BLOCK = "pfllib-split"


def pfllib_dirichlet_counts(
    labels: np.ndarray, num_clients: int = 20, alpha: float = 0.1, seed: int = 1, least: int = 40
) -> np.ndarray:
    """The clients' class counts [clients, classes] of PFLlib's "dir" split of `labels` (their loop,
    their legacy global generator as a `RandomState` of the same seed: the same draws)."""
    rng = np.random.RandomState(seed)
    classes, n = int(labels.max()) + 1, len(labels)
    sizes = [0] * num_clients
    while min(sizes) < least:
        batches: list[list[int]] = [[] for _ in range(num_clients)]
        for k in range(classes):
            idx = np.where(labels == k)[0]
            rng.shuffle(idx)
            shares = rng.dirichlet(np.repeat(alpha, num_clients))
            shares = np.array([p * (len(b) < n / num_clients) for p, b in zip(shares, batches, strict=True)])
            cuts = (np.cumsum(shares / shares.sum()) * len(idx)).astype(int)[:-1]
            batches = [b + part.tolist() for b, part in zip(batches, np.split(idx, cuts), strict=True)]
            sizes = [len(b) for b in batches]
    return np.array([np.bincount(labels[b], minlength=classes) for b in batches])


def concentration(counts: np.ndarray) -> tuple[float, float]:
    """(pooled share of each client's largest class, exp of the sample-weighted label entropy)."""
    n = counts.sum(1)
    p = counts / n[:, None]
    entropy = -(p * np.log(np.where(p > 0, p, 1.0))).sum(1)  # 0 log 0 = 0: log 1 where p = 0
    return float(counts.max(1).sum() / counts.sum()), float(np.exp((entropy * n).sum() / n.sum()))


def prior_adjusted_accuracy(log_probs: np.ndarray, y: np.ndarray, counts: np.ndarray) -> float:
    """Pooled over clients (weights: their sizes) of sum_c pi_kc acc_k(c), acc_k(c) the share of test
    images of class c that argmax_j log_probs_j + log pi_kj labels c."""
    total = correct = 0.0
    for c_k in counts.astype(np.float64):
        pi = c_k / c_k.sum()
        with np.errstate(divide="ignore"):
            pred = (log_probs + np.log(pi)).argmax(1)
        acc = np.array([(pred[y == c] == c).mean() if pi[c] > 0 else 0.0 for c in range(len(pi))])
        total += c_k.sum()
        correct += c_k.sum() * float(pi @ acc)
    return correct / total


def global_log_probs(run: Path) -> tuple[np.ndarray, np.ndarray, dict]:
    """The run's last global model's log-probabilities on the central test set, its labels and config."""
    cfg = json.loads((run / "config.json").read_text())
    model = build_model(cfg["model"], cfg["dataset"])
    ckpt = torch.load(run / "checkpoint.pt", map_location="cpu", weights_only=True)  # tensors only, no code
    model.load_state_dict(ckpt["arrays"])
    x, y = load_test_set(cfg)
    with torch.no_grad():
        return torch.log_softmax(model.eval()(x), 1).numpy(), y.numpy(), cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="dir01 run folders of peer-pfllib (config.json, checkpoint.pt)")
    ap.add_argument("--doc", type=Path, help=f"also write the table into this file's `{BLOCK}` block")
    args = ap.parse_args()
    scored = {run.name: global_log_probs(run) for run in args.runs}
    cfg = next(iter(scored.values()))[2]
    _, y_train, _, y_test = load_arrays(cfg)
    partition = json.loads((args.runs[0] / "partition.json").read_text())
    ours = np.array(partition["train"]) + np.array(partition["test"])  # each client's images, both splits
    splits = {
        "PFLlib's Dir(0.1), replayed (70,000 images)": pfllib_dirichlet_counts(np.concatenate([y_train, y_test])),
        f"ours, `dir01` of {args.runs[0].name} ({ours.sum():,} images)": ours,
    }
    names = list(scored)
    lines = [
        "| split | pooled share of a client's largest class | effective classes a client | "
        + " | ".join(f"prior-adjusted accuracy, {n}'s last global model" for n in names)
        + " |",
        "|---|---|---|" + "---|" * len(names),
    ]
    for split, counts in splits.items():
        share, effective = concentration(counts)
        accs = [100 * prior_adjusted_accuracy(lp, y, counts) for lp, y, _ in scored.values()]
        lines.append(
            f"| {split} | {100 * share:.1f} % | {effective:.2f} | " + " | ".join(f"{a:.2f}" for a in accs) + " |"
        )
    print("\n".join(lines))
    if args.doc:
        where = " ".join(as_page_names(r) for r in args.runs)
        write_block(args.doc, BLOCK, f".venv/bin/python benchmarks/peer_split.py {where} --doc {args.doc}", lines)


if __name__ == "__main__":
    main()
