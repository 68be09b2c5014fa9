"""Benchmark: wall time of a federated simulation against the same local training in a plain loop.

Runs `fedskew run` (FedAvg, `--clients` clients, `--per-round` sampled each round) and, in this
process, a plain PyTorch loop that trains the same model on the same clients' local data (same
samples, epochs, batch size, optimiser), round by round, with the same sampled partitions. Prints:

- start-up: run wall time minus the rounds' time (SuperLink, Ray, actors, data, first import);
- steady state: median round time (rounds 2..R) / median plain-loop time for the same clients,
  with and without the round's evaluation (central + personalized), target <= 1.25 at 10 per round.

    .venv/bin/python benchmarks/sim_overhead.py [--clients 20] [--per-round 10] [--rounds 6]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from _common import simulate

from fedskew.data.clients import load_client_data
from fedskew.models import build_model


def plain_round(cfg: dict, partitions: list[int], num_clients: int) -> float:
    """Seconds to train the given clients' data one after the other in a minimal loop."""
    data = [load_client_data(cfg, p, num_clients) for p in partitions]  # loaded before timing
    t0 = time.perf_counter()
    for d in data:
        model = build_model(cfg["model"], cfg["dataset"])
        opt = torch.optim.SGD(
            model.parameters(), lr=cfg["lr"], momentum=cfg["momentum"], weight_decay=cfg["weight-decay"]
        )
        model.train()
        for _ in range(cfg["local-epochs"]):
            perm = torch.randperm(len(d.y_train))
            for idx in perm.split(cfg["batch-size"]):
                loss = F.cross_entropy(model(d.x_train[idx]), d.y_train[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--per-round", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--model", default="lenet")
    ap.add_argument("--threads", type=int, default=1, help="torch threads, in the ClientApp and here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    over = {
        "method": "fedavg",
        "model": args.model,
        "num-server-rounds": args.rounds,
        "fraction-train": args.per_round / args.clients,
        "checkpoint-every": 0,
        "torch-threads": args.threads,
    }
    cfg, wall, _, timings, metrics = simulate(over, args.clients)
    steady = timings[1:]
    round_s = statistics.median(t["seconds"] for t in steady)
    train_s = statistics.median(t["clients-seconds"] for t in steady)  # send -> all replies in
    plain = statistics.median(plain_round(cfg, m["partitions"], args.clients) for m in metrics[1:])
    startup = wall - sum(t["seconds"] for t in timings)
    print(
        f"{args.clients} clients, {args.per_round} per round, {args.rounds} rounds, {args.model}, "
        f"threads {args.threads}"
    )
    print(f"  start-up (wall - rounds)              {startup:7.1f} s")
    print(f"  round, median of rounds 2..R          {round_s:7.2f} s")
    print(f"  of which clients (send to last reply) {train_s:7.2f} s")
    print(f"  plain loop, same clients and data     {plain:7.2f} s")
    print(f"  ratio round / plain                   {round_s / plain:7.3f}")
    print(f"  ratio clients part / plain            {train_s / plain:7.3f}   (target <= 1.25)")


if __name__ == "__main__":
    main()
