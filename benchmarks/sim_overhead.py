"""Benchmark: a simulation's rounds against the same work in a plain single-thread loop, with one
Ray actor (one client at a time: what `fedskew run` did before it filled the cores) and with the
default resources (every core busy, `fedskew.resources`), in one run of this script.

Runs `fedskew run`'s simulation (FedAvg, `--clients` clients, `--per-round` sampled each round)
twice, then, in this process with one torch thread, two plain loops over the same sampled clients
(same samples, model, epochs, batch size, optimiser):

- "train": the clients' local training only;
- "round's work": the same training, plus each client's two evaluations on its local test split
  (the received global model before training: `client-global-accuracy`; the trained model after:
  personalized accuracy) and the central evaluation on the test set: everything a fedskew round
  computes.

Prints the median round time (rounds 2..R) of each simulation over each plain loop, the CPU busy
fraction of all cores during rounds 2..R (the run's own processes only: other users' load does not
count, but it slows the run), the start-up (run wall time minus its rounds), and whether both
simulations wrote the same `metrics.jsonl` (they must: clients are seeded by seed, partition and
round, and replies are sorted by partition).

    .venv/bin/python benchmarks/sim_overhead.py [--clients 20] [--per-round 10] [--rounds 6] [--epochs 1]
        [--also-actors N] [--no-one-actor]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from _common import measured_simulation

from fedskew.data.clients import load_client_data, load_test_set
from fedskew.models import build_model
from fedskew.resources import available_cores
from fedskew.training import evaluate


def plain_round(cfg: dict, partitions: list[int], num_clients: int, with_eval: bool) -> float:
    """Seconds to train the given clients one after the other in a minimal loop (and, with
    `with_eval`, to evaluate each on its local test split before and after training, then one model
    on the test set)."""
    data = [load_client_data(cfg, p, num_clients) for p in partitions]  # loaded before timing
    x_test, y_test = load_test_set(cfg)
    cpu = torch.device("cpu")
    t0 = time.perf_counter()
    for d in data:
        model = build_model(cfg["model"], cfg["dataset"])
        opt = torch.optim.SGD(
            model.parameters(), lr=cfg["lr"], momentum=cfg["momentum"], weight_decay=cfg["weight-decay"]
        )
        if with_eval:
            evaluate(model, d.x_test, d.y_test, cfg["eval-batch-size"], cpu)
        model.train()
        for _ in range(cfg["local-epochs"]):
            perm = torch.randperm(len(d.y_train))
            for idx in perm.split(cfg["batch-size"]):
                loss = F.cross_entropy(model(d.x_train[idx]), d.y_train[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        if with_eval:
            evaluate(model, d.x_test, d.y_test, cfg["eval-batch-size"], cpu)
    if with_eval:
        evaluate(model, x_test, y_test, cfg["eval-batch-size"], cpu)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--per-round", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--model", default="lenet")
    ap.add_argument("--epochs", type=int, default=1, help="local epochs (more: less overhead per sample)")
    ap.add_argument("--also-actors", type=int, default=0, help="a third simulation with this many actors")
    ap.add_argument(
        "--one-actor",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also simulate with one actor (--no-one-actor: the default resources only, half the time)",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    cores = available_cores()
    over = {
        "method": "fedavg",
        "model": args.model,
        "num-server-rounds": args.rounds,
        "fraction-train": args.per_round / args.clients,
        "checkpoint-every": 0,
        "local-epochs": args.epochs,
    }
    runs = {"one actor": measured_simulation(over, args.clients, 1)} if args.one_actor else {}
    runs["default"] = measured_simulation(over, args.clients)
    if args.also_actors:
        runs[f"{args.also_actors} actors"] = measured_simulation(over, args.clients, args.also_actors)
    cfg, sampled = runs["default"]["cfg"], [m["partitions"] for m in runs["default"]["metrics"][1:]]
    plain_train = statistics.median(plain_round(cfg, p, args.clients, False) for p in sampled)
    plain_work = statistics.median(plain_round(cfg, p, args.clients, True) for p in sampled)
    same = all(json.dumps(r["metrics"]) == json.dumps(runs["default"]["metrics"]) for r in runs.values())
    print(
        f"{args.clients} clients, {args.per_round} per round, {args.rounds} rounds, {args.model}, "
        f"{args.epochs} local epoch(s), {cores} cores"
    )
    print(f"  plain loop, 1 thread: train {plain_train:.2f} s, round's work (train + evaluations) {plain_work:.2f} s")
    for name, r in runs.items():
        print(f"  {name}: {r['resources'].describe()}")
        print(f"    start-up (wall - rounds)                 {r['startup']:7.1f} s")
        print(f"    round, median of rounds 2..R             {r['round']:7.2f} s")
        print(f"    of which clients (send to last reply)    {r['clients']:7.2f} s")
        print(f"    ratio round / plain round's work         {r['round'] / plain_work:7.3f}   (target <= 0.60)")
        print(f"    ratio round / plain train                {r['round'] / plain_train:7.3f}")
        print(f"    CPU busy, all cores, rounds 2..R         {r['busy']:7.1%}   (target >= 85 %)")
    if args.one_actor:
        ratio = runs["default"]["round"] / runs["one actor"]["round"]
        print(f"  ratio round default / one actor            {ratio:7.3f}")
    print(f"  same metrics.jsonl in every simulation: {same}")


if __name__ == "__main__":
    main()
