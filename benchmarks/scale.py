"""Benchmark: 100 vs 1,000 clients with 10 per round (fraction-train = 10 / N), FedAvg, LeNet.

Two runtimes, each for every N in `--clients`:
- `sim`: a real `flwr run` simulation (private SuperLink, Ray, N virtual SuperNodes). Prints the
  ServerApp's start (its wall time minus the rounds: test set, the `query.info` message by which
  the server learns every node's partition, waiting for Ray's actor, the partition plot), round
  times, and the memory of all the processes of the run (peak and median PSS, every 0.5 s);
- `harness`: the real ServerApp main against the real ClientApp in this process (tests' harness,
  no Ray). Prints the time of the `query.info` round to all nodes, the median round time, and the
  Python memory per idle node (tracemalloc: a node's `Context` plus the server's node -> partition
  entry), and the size of a trained client's `context.state`.

Ratios: round time(N_max) / round time(N_min) (should be about 1: a round only touches the sampled
nodes), start-up and memory growth per extra node.

    .venv/bin/python benchmarks/scale.py [--clients 100,1000] [--rounds 5] [--mode sim,harness] [--quick]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

import torch
from _common import (
    TimedGrid,
    config,
    in_process_setup,
    median,
    private_cache,
    read_jsonl,
    run_config,
    simulate,
    tree_pss,
)
from flwr.app import ArrayRecord, Context, RecordDict

from fedskew.server_app.app import main as server_main
from fedskew.strategies.fedavg import FedAvgStrategy

MB = 2**20


class PssSampler(threading.Thread):
    """Samples the PSS of this process's descendants (the SuperLink and all it starts)."""

    def __init__(self, every: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.every, self.samples, self.done = every, [0], threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.every):
            self.samples.append(tree_pss(os.getpid(), include_root=False))


def run_sim(overrides: dict[str, Any], n: int) -> dict[str, float]:
    sampler = PssSampler()
    sampler.start()
    try:
        _, _, summary, timings, metrics = simulate(overrides, n)
    finally:
        sampler.done.set()
        sampler.join()
    return {
        "ServerApp start s": summary["wall_seconds"] - sum(t["seconds"] for t in timings),
        **round_times(timings, metrics),
        "peak PSS MB": max(sampler.samples) / MB,
        "median PSS MB": median(sampler.samples) / MB,
    }


def round_times(timings: list[dict], metrics: list[dict]) -> dict[str, float]:
    """Medians over rounds 2..R of: the round; the round without the central evaluation (the same
    10,000 test images whatever N, and the part most sensitive to the machine's load); and that
    minus the clients' own train time (`train-seconds`: model, data, local training), i.e. server,
    framework and personalized evaluation. A client's data, so its train time, is 60,000 / N samples."""
    steady = list(zip(timings, metrics, strict=True))[1:]
    return {
        "round s": median(t["seconds"] for t, _ in steady),
        "round - central eval s": median(t["seconds"] - t["eval-seconds"] for t, _ in steady),
        "  - client train s": median(
            t["seconds"] - t["eval-seconds"] - t["client-seconds-mean"] * m["replies"] for t, m in steady
        ),
    }


def state_bytes(state: RecordDict) -> int:
    """Bytes held by a context.state: array payloads plus the text of config values."""
    total = 0
    for rec in state.values():
        if isinstance(rec, ArrayRecord):
            total += sum(len(a.data) for a in rec.values())
        else:
            total += sum(len(str(v)) for v in rec.values())
    return total


def idle_node_bytes(rc: dict[str, Any], n: int) -> int:
    """Python memory of n idle nodes' contexts plus the server's discovery of them (tracemalloc)."""
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    grid = TimedGrid(n, rc)
    strategy = FedAvgStrategy(config(**rc))
    strategy.discover(grid)
    grid.calls.clear()
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del grid, strategy
    return held


def run_harness(overrides: dict[str, Any], n: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as out:
        rc = run_config(**overrides, **{"out-dir": out, "run-name": "bench"})
        grid = TimedGrid(n, rc)
        server_main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=rc))
        timings, metrics = (read_jsonl(Path(out) / "bench" / f) for f in ("timings.jsonl", "metrics.jsonl"))
        memory = idle_node_bytes(rc, n)
    trained = [state_bytes(c.state) for c in grid.contexts.values() if len(c.state)]
    return {
        "query.info to all s": grid.seconds("query.info"),
        **round_times(timings, metrics),
        "idle nodes, Python KB": memory / 1024,
        "trained client state B": max(trained, default=0),
    }


def report(mode: str, results: dict[int, dict[str, float]]) -> None:
    ns = sorted(results)
    lo, hi = ns[0], ns[-1]
    print(f"{mode} (round times: medians over rounds 2..R):")
    print(f"  {'quantity':<26}" + "".join(f"{f'N={n}':>12}" for n in ns) + f"{f'ratio {hi}/{lo}':>16}")
    for key in results[lo]:
        a, b = results[lo][key], results[hi][key]
        ratio = b / a if a else float("nan")
        print(f"  {key:<26}" + "".join(f"{results[n][key]:12.3f}" for n in ns) + f"{ratio:16.3f}")
    per_node = {
        "peak PSS MB": ("memory per extra node (peak PSS)", MB, "B"),
        "idle nodes, Python KB": ("Python memory per extra idle node", 1024, "B"),
        "ServerApp start s": ("ServerApp start (mostly query.info) per extra node", 1000, "ms"),
    }
    for key, (label, scale, unit) in per_node.items():
        if key in results[lo] and hi > lo:
            print(f"  {label}: {(results[hi][key] - results[lo][key]) * scale / (hi - lo):.1f} {unit}")
    if "query.info to all s" in results[lo]:
        print(f"  query.info per node at N={hi}: {1000 * results[hi]['query.info to all s'] / hi:.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", default="100,1000", help="total clients N, comma-separated")
    ap.add_argument("--per-round", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--mode", default="sim,harness", help="sim (real flwr run), harness (in-process) or both")
    ap.add_argument("--quick", action="store_true", help="tiny: harness only, N = 20,40, 2 per round, 2 rounds")
    args = ap.parse_args()
    if args.quick:
        args.clients, args.per_round, args.rounds, args.mode = "20,40", 2, 2, "harness"
    ns = sorted(int(n) for n in args.clients.split(","))
    in_process_setup()
    torch.set_num_threads(1)
    print(f"FedAvg, LeNet, {args.per_round} clients per round, {args.rounds} rounds, N = {ns}")
    for mode in args.mode.split(","):
        results = {}
        for n in ns:
            over = {
                "method": "fedavg",
                "num-server-rounds": args.rounds,
                "fraction-train": args.per_round / n,
                "checkpoint-every": 0,
            }
            t0 = time.perf_counter()
            with private_cache():  # every run starts with no cached node data, as a new deployment
                results[n] = run_sim(over, n) if mode == "sim" else run_harness(over, n)
            results[n]["wall s"] = time.perf_counter() - t0
        report(mode, results)


if __name__ == "__main__":
    main()
