"""Benchmark: each method's client time per round relative to FedAvg.

The same `--clients` nodes (partitions 0.. of `--partitions`, real Fashion-MNIST) train every round
for every method, through the real ClientApp (`fedskew.client_app.app`, called in-process with a
persistent `Context` per node, as the tests' harness does) and the method's real strategy (its
messages, its aggregation, so the server extras of round r+1 come from round r). Rounds are
interleaved across methods (order rotated each round), and only rounds >= 2 count: MAP's HPM,
FedMR's prototypes and MuPFL's start models and synthetic features exist from round 2 on.
A client's time is the whole ClientApp call: data from the node cache, training, personalized
evaluation, state. Prints per method the median over rounds 2..R of the round's summed client
seconds, and its ratio to FedAvg.

    .venv/bin/python benchmarks/client_time.py [--partitions 20] [--clients 4] [--rounds 7] [--quick]
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import TimedGrid, config, in_process_setup, median, print_ratios, private_cache, run_config
from flwr.app import ConfigRecord

from fedskew.registry import METHODS, get_method


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--methods", help="comma-separated (default: all; --quick: the five seed methods); with fedavg")
    ap.add_argument("--partitions", type=int, default=20, help="clients in the partition (data per client)")
    ap.add_argument("--clients", type=int, default=4, help="the nodes that train every round")
    ap.add_argument("--rounds", type=int, default=7, help="rounds; 2..R are measured")
    ap.add_argument("--model", default="lenet")
    ap.add_argument("--quick", action="store_true", help="tiny: 200 partitions, 2 clients, 2 rounds, 5 methods")
    args = ap.parse_args()
    if args.quick:
        args.partitions, args.clients, args.rounds = 200, 2, 2
        args.methods = args.methods or "fedrs,map,mupfl,fedgela,fedmr"
    args.methods = args.methods or ",".join(METHODS)
    methods = ["fedavg", *(m for m in args.methods.split(",") if m != "fedavg")]
    in_process_setup()
    torch.set_num_threads(1)
    base = {"model": args.model, "fraction-train": 1.0, "checkpoint-every": 0}
    with private_cache():
        strategies, grids, arrays = {}, {}, {}
        for m in methods:
            rc = run_config(**base, method=m)
            strategies[m] = get_method(m).strategy_class()(config(**rc))
            grids[m] = TimedGrid(args.partitions, rc, visible=args.clients)
            arrays[m] = strategies[m].initial_arrays()
        per_round: dict[str, list[float]] = {m: [] for m in methods}
        t0 = time.perf_counter()
        for r in range(1, args.rounds + 1):
            order = methods[r % len(methods) :] + methods[: r % len(methods)]
            for m in order:
                strategy, grid = strategies[m], grids[m]
                before = len(grid.calls)
                messages = list(strategy.configure_train(r, arrays[m], ConfigRecord(), grid))
                replies = grid.send_and_receive(messages)
                new, metrics = strategy.aggregate_train(r, replies)
                if new is None or metrics["failures"]:
                    raise RuntimeError(f"{m} round {r}: {strategy.failures}")
                arrays[m] = new
                per_round[m].append(sum(s for t, _, s in grid.calls[before:] if t == "train"))
    steady = {m: median(v[1:] if len(v) > 1 else v) for m, v in per_round.items()}
    print(
        f"{args.clients} clients of {args.partitions} partitions, {args.model}, rounds 2..{args.rounds} "
        f"(wall {time.perf_counter() - t0:.0f} s)"
    )
    print_ratios("client seconds per round (sum over clients, median of rounds), ratio to fedavg", list(steady.items()))


if __name__ == "__main__":
    main()
