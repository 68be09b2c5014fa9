"""Benchmark: what the per-class diagnostics cost at the default run config (FedAvg, LeNet,
Fashion-MNIST, 20 clients, 10 a round, 1 local epoch).

1. Round time: whole runs (`--runtime sim`: real `flwr run` simulations; `harness`: the real
   ServerApp and ClientApp in this process), `--runs` of each setting, the settings interleaved:
   the median round over rounds 2..R of all its runs and its ratio to `off`, for
   - `off`: `class-metrics=false tensorboard=false` (global accuracy and loss only),
   - `on`: the defaults (per-class record, per-class.png, TensorBoard event files),
   - `on + personalized-central-eval`: every sampled client also evaluates its personalized model
     on the 10,000 central test images.
   Whole runs one after the other are at the mercy of the machine's load (a shared machine's rounds
   drift by tens of percent), so parts 2 and 3 measure what the diagnostics add, step by step.
2. The central evaluation, in this process, `--repeats` times interleaved: the forward pass with
   the accuracy count alone (the evaluation before the diagnostics), with the confusion matrix (the
   same pass: one `bincount` a batch), the per-class record computed from the matrix, and
   TensorBoard's writing of a round. Extra per round = the matrix's `bincount` + the record +
   TensorBoard, as a share of the median round of `off`.
3. One client's round with one torch thread (a ClientApp's default), `--repeats` times: the round
   (`FedAvgTrainer.fit`, partition 0) with `personalized-central-eval` off, and what the option
   adds: the central test set's conversion to tensors and the evaluation of the personalized model
   on it; ratio (round + both) / round.

    .venv/bin/python benchmarks/class_metrics.py [--rounds 8] [--runs 2] [--repeats 7] [--runtime sim] [--quick]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _common import (
    TimedGrid,
    config,
    in_process_setup,
    median,
    print_ratios,
    private_cache,
    read_jsonl,
    run_config,
    simulate,
)
from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict

from fedskew.client_app.base import TrainerContext
from fedskew.client_app.fedavg import FedAvgTrainer
from fedskew.client_app.state import ClientState
from fedskew.data.clients import load_client_data, load_test_set
from fedskew.diagnostics import class_holders, class_metrics, weight_norms
from fedskew.server_app.app import main as server_main
from fedskew.server_app.app import save_partition
from fedskew.server_app.results import RunOutput
from fedskew.server_app.tracking import Trackers
from fedskew.strategies.fedavg import FedAvgStrategy
from fedskew.training import confusion, seed_everything

CPU = torch.device("cpu")
OFF = {"class-metrics": False, "tensorboard": False}
SETTINGS = {"off": OFF, "on": {}, "on + personalized-central-eval": {"personalized-central-eval": True}}


def run_once(overrides: dict[str, Any], clients: int, runtime: str) -> list[dict[str, Any]]:
    """timings.jsonl of one run (rounds 2..R)."""
    if runtime == "sim":
        return simulate(overrides, clients)[3][1:]
    with tempfile.TemporaryDirectory() as out:
        rc = run_config(**overrides, **{"out-dir": out, "run-name": "bench"})
        server_main(
            TimedGrid(clients, rc), Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=rc)
        )
        return read_jsonl(Path(out) / "bench" / "timings.jsonl")[1:]


def round_times(base: dict[str, Any], clients: int, runtime: str, runs: int) -> dict[str, tuple[float, float]]:
    """Setting -> (median round seconds, median central evaluation seconds) over its runs' rounds 2..R."""
    steady: dict[str, list[dict[str, Any]]] = {name: [] for name in SETTINGS}
    for _ in range(runs):
        for name, over in SETTINGS.items():
            steady[name] += run_once({**base, **over}, clients, runtime)
    return {
        name: (median(t["seconds"] for t in rows), median(t["eval-seconds"] for t in rows))
        for name, rows in steady.items()
    }


@torch.no_grad()
def accuracy_only(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int) -> float:
    """The central evaluation before the diagnostics: forward, loss and a count of right answers."""
    model.eval()
    loss, correct = 0.0, 0
    for i in range(0, len(x), batch_size):
        out = model(x[i : i + batch_size])
        loss += float(F.cross_entropy(out, y[i : i + batch_size], reduction="sum"))
        correct += int((out.argmax(1) == y[i : i + batch_size]).sum())
    return correct / len(x)


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def central_evaluation(base: dict[str, Any], clients: int, repeats: int) -> dict[str, float]:
    """Median seconds of each step of the central evaluation (interleaved)."""
    cfg = config(**base)
    strategy = FedAvgStrategy(cfg)
    model = strategy.global_model(strategy.initial_arrays())
    x, y = load_test_set(cfg)
    batch = cfg["eval-batch-size"]
    with torch.no_grad():
        pred = model(x).argmax(1)
    times: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as d:
        cfg = {**cfg, "out-dir": d, "run-name": "bench"}
        out = RunOutput(cfg, 1)
        trackers = Trackers(cfg, out.dir, 1)
        part = save_partition(cfg, clients, out)
        partitions = list(range(0, clients, 2))
        _, cm = confusion(model, x, y, batch, CPU)

        def record() -> dict[str, Any]:
            norms = weight_norms(model.class_weights().detach().numpy())
            return class_metrics(cm, part.groups, norms, class_holders(part.train, partitions))

        row = {"round": 1, "global-accuracy": 0.5, "global-loss": 1.0, **record()}
        steps: dict[str, Callable[[], object]] = {
            "forward + accuracy count (before)": lambda: accuracy_only(model, x, y, batch),
            "forward + confusion matrix (now)": lambda: confusion(model, x, y, batch, CPU),
            "confusion matrix's bincount alone": lambda: torch.bincount(y * len(cm) + pred, minlength=cm.size),
            "per-class record from the matrix": record,
            "TensorBoard, one round": lambda: trackers.log_round(row),
        }
        for _ in range(repeats):
            for name, step in steps.items():
                times.setdefault(name, []).append(timed(step))
        trackers.close()
    return {name: median(ts) for name, ts in times.items()}


def client_round(base: dict[str, Any], clients: int, repeats: int) -> dict[str, float]:
    """Median seconds of partition 0's round without `personalized-central-eval`, and of what the
    option adds (interleaved), with one torch thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cfg = config(**base)
    data = load_client_data(cfg, 0, clients)
    arrays = FedAvgStrategy(cfg).initial_arrays()
    x, y = load_test_set(cfg)

    def fit() -> None:
        ctx = TrainerContext(cfg, data, CPU, ClientState(RecordDict(), 64, 0), 0, 1, seed_everything(cfg["seed"], 0, 1))
        config_record = ConfigRecord({"server-round": 1})
        FedAvgTrainer(ctx).fit(
            RecordDict({"arrays": ArrayRecord(arrays.to_torch_state_dict()), "config": config_record})
        )

    model = FedAvgStrategy(cfg).global_model(arrays)
    steps: dict[str, Callable[[], object]] = {
        "client round, option off": fit,
        "+ central test set to tensors": lambda: load_test_set(cfg),
        "+ personalized model on it": lambda: confusion(model, x, y, cfg["eval-batch-size"], CPU),
    }
    times: dict[str, list[float]] = {}
    for _ in range(repeats):
        for name, step in steps.items():
            times.setdefault(name, []).append(timed(step))
    torch.set_num_threads(threads)
    return {name: median(ts) for name, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--runs", type=int, default=2, help="runs of each setting (interleaved)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--runtime", choices=("sim", "harness"), default="sim")
    ap.add_argument("--quick", action="store_true", help="tiny: harness, MLP, 5 clients, 2 rounds, 1 run, 1 repeat")
    args = ap.parse_args()
    base: dict[str, Any] = {"num-server-rounds": args.rounds, "checkpoint-every": 0}
    if args.quick:
        args.clients, args.runs, args.repeats, args.runtime = 5, 1, 1, "harness"
        base = {"num-server-rounds": 2, "checkpoint-every": 0, "model": "mlp"}
    in_process_setup()
    with private_cache():
        rounds = round_times(base, args.clients, args.runtime, args.runs)
        central = central_evaluation(base, args.clients, args.repeats)
        client = client_round(base, args.clients, args.repeats)
    runs = f"{args.runs} run(s) each"
    print_ratios(
        f"{args.runtime}, {args.clients} clients, {runs}: median round (rounds 2..R)",
        [(n, r) for n, (r, _) in rounds.items()],
    )
    print_ratios(
        "median central evaluation of those runs (beside the next round)", [(n, e) for n, (_, e) in rounds.items()]
    )
    print_ratios(f"central evaluation in process, median of {args.repeats}", list(central.items()))
    extra = sum(
        central[k]
        for k in ("confusion matrix's bincount alone", "per-class record from the matrix", "TensorBoard, one round")
    )
    share = 100 * extra / rounds["off"][0]
    print(
        f"  extra per round (bincount + record + TensorBoard): {1000 * extra:.2f} ms = {share:.3f} % of a round (off)"
    )
    print_ratios(f"one client's round, 1 torch thread, median of {args.repeats}", list(client.items()))
    added = client["+ central test set to tensors"] + client["+ personalized model on it"]
    base_round = client["client round, option off"]
    print(f"  ratio (round + central test set + evaluation) / round: {(base_round + added) / base_round:.3f}")


if __name__ == "__main__":
    main()
