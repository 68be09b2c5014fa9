"""Benchmark: fedskew's local training loop against the fastest plain PyTorch loop.

Same model, samples, epochs, batch size and optimizer; the plain loop is the minimal in-memory
loop (randperm slices, no DataLoader); a DataLoader loop is shown for reference. Prints ratios
measured in one run (the machines are noisy): target fedskew / plain <= 1.1.

    .venv/bin/python benchmarks/train_loop.py [--model lenet] [--samples 6000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from fedskew.config import validate
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="lenet")
    ap.add_argument("--samples", type=int, default=6000)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = validate({"model": args.model, "batch-size": args.batch_size})
    x, y = load_test_set(cfg)  # real FMNIST images, in memory
    x, y = x[: args.samples], y[: args.samples]
    dev = torch.device("cpu")

    def fedskew_loop(model, x, y, opt, epochs, bs, g):
        train_epochs(model, x, y, cross_entropy_loss, opt, epochs, bs, g, dev)

    loops = {"plain": plain_loop, "fedskew": fedskew_loop, "dataloader": dataloader_loop}
    best = {k: float("inf") for k in loops}
    for _ in range(args.repeats):  # interleaved, best of N, so load spikes hit all loops alike
        for name, loop in loops.items():
            torch.manual_seed(0)
            model = build_model(args.model, "fashion-mnist")
            opt = sgd(model.parameters(), cfg)
            t0 = time.perf_counter()
            loop(model, x, y, opt, args.epochs, args.batch_size, torch.Generator().manual_seed(0))
            best[name] = min(best[name], time.perf_counter() - t0)
    n = args.samples * args.epochs
    print(
        f"model={args.model} samples={args.samples} epochs={args.epochs} batch={args.batch_size} "
        f"threads={args.threads} (best of {args.repeats})"
    )
    for name, t in best.items():
        print(f"  {name:<11} {t:7.3f} s  {n / t:9.0f} samples/s  ratio to plain {t / best['plain']:.3f}")


if __name__ == "__main__":
    main()
