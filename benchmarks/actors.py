"""Benchmark: clients trained per second with 1, 2, 4 ... Ray actors, on the CPU or sharing the GPU.

For each count in `--actors`, one simulation (FedAvg, `--clients` clients, `--per-round` a round)
with that many ClientApp actors (`fedskew run --actors N`); with CUDA and `--device auto` (or
`cuda`) every actor reserves 1/N of the GPU (`fedskew.resources`). Prints, over rounds 2..R, the
clients trained per second in the clients' part of a round (send to last reply), the busy
fraction of all cores and, where `nvidia-smi` exists, the GPUs' mean utilization; and whether all
runs wrote the same `metrics.jsonl` (they must, whatever the number of actors, on the CPU and, with
the deterministic kernels `training.pick_device` turns on, on a GPU). Run on an H100: docs/benchmarks.md.

    .venv/bin/python benchmarks/actors.py [--actors 1,2,4] [--clients 20] [--per-round 10] [--rounds 4]
"""

from __future__ import annotations

import argparse
import json

from _common import measured_simulation


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--actors", default="1,2,4", help="actor counts, comma-separated")
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--per-round", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--model", default="lenet")
    ap.add_argument("--device", default="auto", help="run-config device: auto (cuda when present), cpu, cuda")
    ap.add_argument("--quick", action="store_true", help="tiny: 1 and 2 actors, 10 clients, 4 a round, 2 rounds")
    args = ap.parse_args()
    if args.quick:
        args.actors, args.clients, args.per_round, args.rounds = "1,2", 10, 4, 2
    over = {
        "method": "fedavg",
        "model": args.model,
        "device": args.device,
        "num-server-rounds": args.rounds,
        "fraction-train": args.per_round / args.clients,
        "checkpoint-every": 0,
    }
    runs = {int(n): measured_simulation(over, args.clients, int(n)) for n in args.actors.split(",")}
    base = min(runs)
    print(f"{args.clients} clients, {args.per_round} per round, rounds 2..{args.rounds}, {args.model}")
    for r in runs.values():
        rate, speedup = args.per_round / r["clients"], runs[base]["clients"] / r["clients"]
        gpu = "-" if r["gpu busy"] is None else f"{r['gpu busy']:.0%}"
        print(
            f"  {r['resources'].describe():<58} clients/s {rate:6.2f}  ratio to {base} actor(s) {speedup:5.2f}  "
            f"CPU busy {r['busy']:4.0%}  GPU busy {gpu}"
        )
    same = len({json.dumps(r["metrics"]) for r in runs.values()}) == 1
    print(f"  same metrics.jsonl for every actor count: {same}")


if __name__ == "__main__":
    main()
