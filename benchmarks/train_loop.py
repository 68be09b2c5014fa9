"""Benchmark: fedskew's local training loop against the fastest plain PyTorch loop, and the cost of
the training augmentation (random crop + flip on the batch, `fedskew.data.augment`).

Same model, samples, epochs, batch size and optimizer; the plain loop is the minimal in-memory
loop (randperm slices, no DataLoader); a DataLoader loop is shown for reference. Prints ratios
measured in one run (the machines are noisy): target fedskew / plain <= 1.1.
`--dataset cifar10` times 32x32 RGB batches (random images of that shape when CIFAR-10 is absent:
the timing does not depend on the pixels).

    .venv/bin/python benchmarks/train_loop.py [--model lenet] [--dataset cifar10] [--samples 6000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from fedskew.config import validate
from fedskew.data import DataMissingError, dataset_info
from fedskew.data.augment import augmentation
from fedskew.data.clients import load_test_set
from fedskew.models import build_model
from fedskew.training import cross_entropy_loss, sgd, train_epochs


def plain_loop(model, x, y, opt, epochs: int, bs: int, g: torch.Generator) -> None:
    model.train()
    for _ in range(epochs):
        perm = torch.randperm(len(x), generator=g)
        for i in range(0, len(x), bs):
            idx = perm[i : i + bs]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()


def dataloader_loop(model, x, y, opt, epochs: int, bs: int, g: torch.Generator) -> None:
    model.train()
    loader = DataLoader(TensorDataset(x, y), batch_size=bs, shuffle=True, generator=g)
    for _ in range(epochs):
        for xb, yb in loader:
            loss = F.cross_entropy(model(xb), yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()


def images(cfg: dict, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data set's test images (real when present, else random ones of its shape), in memory."""
    try:
        x, y = load_test_set(cfg)
    except DataMissingError:
        info = dataset_info(cfg)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(samples, info.channels, info.size, info.size, generator=g)
        y = torch.randint(0, info.num_classes, (samples,), generator=g)
    return x[:samples], y[:samples]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="lenet")
    ap.add_argument("--dataset", default="fashion-mnist")
    ap.add_argument("--augment", default="crop-flip", help="the augmentation timed in the last loop")
    ap.add_argument("--samples", type=int, default=6000)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--pairs", type=int, default=40, help="paired short runs for the augmentation ratio")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    args = ap.parse_args()
    if args.quick:
        args.samples, args.repeats, args.pairs = 640, 1, 2
    torch.set_num_threads(args.threads)
    cfg = validate(
        {"model": args.model, "dataset": args.dataset, "batch-size": args.batch_size, "augment": args.augment}
    )
    x, y = images(cfg, args.samples)
    dev = torch.device("cpu")
    augment = augmentation(cfg, dataset_info(cfg))

    def fedskew_loop(model, x, y, opt, epochs, bs, g):
        train_epochs(model, x, y, cross_entropy_loss, opt, epochs, bs, g, dev)

    def augmented_loop(model, x, y, opt, epochs, bs, g):
        train_epochs(model, x, y, cross_entropy_loss, opt, epochs, bs, g, dev, augment)

    loops = {"plain": plain_loop, "fedskew": fedskew_loop, "dataloader": dataloader_loop, "augmented": augmented_loop}
    best = {k: float("inf") for k in loops}
    for _ in range(args.repeats):  # interleaved, best of N, so load spikes hit all loops alike
        for name, loop in loops.items():
            torch.manual_seed(0)
            model = build_model(args.model, dataset_info(cfg))
            opt = sgd(model.parameters(), cfg)
            t0 = time.perf_counter()
            loop(model, x, y, opt, args.epochs, args.batch_size, torch.Generator().manual_seed(0))
            best[name] = min(best[name], time.perf_counter() - t0)
    n = len(x) * args.epochs
    print(
        f"model={args.model} dataset={args.dataset} samples={len(x)} epochs={args.epochs} batch={args.batch_size} "
        f"threads={args.threads} augmented: {args.augment} (best of {args.repeats})"
    )
    for name, t in best.items():
        print(f"  {name:<11} {t:7.3f} s  {n / t:9.0f} samples/s  ratio to plain {t / best['plain']:.3f}")
    ratios = paired_ratios(fedskew_loop, augmented_loop, args, cfg, x[: 10 * args.batch_size], y)
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    print(
        f"  ratio augmented / fedskew {best['augmented'] / best['fedskew']:.3f} (best of {args.repeats}); "
        f"median of {len(ratios)} back-to-back pairs of 10 batches {statistics.median(ratios):.3f} "
        f"(quartiles {q1:.3f}-{q3:.3f})"
    )
    t_aug, t_step = per_batch_seconds(augment, args, cfg, x[: args.batch_size], y[: args.batch_size])
    print(
        f"  per batch, fastest of many: augmentation {1e3 * t_aug:.3f} ms, training step {1e3 * t_step:.2f} ms, "
        f"ratio (step + augmentation) / step {(t_step + t_aug) / t_step:.3f}"
    )


def per_batch_seconds(augment, args, cfg: dict, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """The fastest of many timings of one batch's augmentation and of one training step (the minimum
    is the least disturbed by other processes)."""
    model = build_model(args.model, dataset_info(cfg))
    opt = sgd(model.parameters(), cfg)
    g = torch.Generator().manual_seed(0)

    def fastest(fn, n: int) -> float:
        best = float("inf")
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        return best

    def step() -> None:
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return fastest(lambda: augment(x, g), 10 * args.pairs), fastest(step, 2 * args.pairs)


def paired_ratios(base, other, args, cfg: dict, x: torch.Tensor, y: torch.Tensor) -> list[float]:
    """t(other) / t(base) over short runs timed back to back (order alternating): on a busy machine
    the load changes slowly compared with a pair, so each ratio is fair even when the times are not."""
    model = build_model(args.model, dataset_info(cfg))
    opt = sgd(model.parameters(), cfg)
    ratios = []
    for i in range(args.pairs):
        times = {}
        for loop in (base, other) if i % 2 == 0 else (other, base):
            t0 = time.perf_counter()
            loop(model, x, y[: len(x)], opt, 1, args.batch_size, torch.Generator().manual_seed(i))
            times[loop] = time.perf_counter() - t0
        ratios.append(times[other] / times[base])
    return ratios


if __name__ == "__main__":
    main()
