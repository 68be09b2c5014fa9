"""Benchmark: what the per-class diagnostics cost at the default run config (FedAvg, LeNet,
Fashion-MNIST, 20 clients, 10 a round, 1 local epoch).

1. Round time, one run per setting, interleaved rounds not possible across runs, so each setting is
   one whole run (`--runtime sim`: a real `flwr run` simulation; `harness`: the real ServerApp and
   ClientApp in this process): the median round time over rounds 2..R and its ratio to `off`, for
   - `off`: `class-metrics=false tensorboard=false` (global accuracy and loss only),
   - `on`: the defaults (per-class record, per-class.png, TensorBoard event files),
   - `on + personalized-central-eval`: every sampled client also evaluates its personalized model
     on the 10,000 central test images.
   Also the median central evaluation (`eval-seconds`, beside the next round's training) per setting.
2. The central evaluation itself, in this process, `--repeats` times interleaved: the forward pass
   with the confusion matrix and the per-class record (and TensorBoard's writing of the round)
   against the accuracy alone (`training.evaluate`), as the ratio on / off and the extra
   milliseconds against the median round of `off`.
3. One client's round (`FedAvgTrainer.fit`, partition 0), `--repeats` times interleaved, with and
   without `personalized-central-eval`: the ratio, i.e. what the option adds to a client's work.

    .venv/bin/python benchmarks/class_metrics.py [--rounds 8] [--repeats 7] [--runtime sim] [--quick]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
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
from fedskew.server_app.app import CentralEvaluation, save_partition
from fedskew.server_app.app import main as server_main
from fedskew.server_app.results import RunOutput
from fedskew.server_app.tracking import Trackers
from fedskew.strategies.fedavg import FedAvgStrategy
from fedskew.training import evaluate, seed_everything

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


def round_times(base: dict[str, Any], clients: int, runtime: str) -> dict[str, tuple[float, float]]:
    """Setting -> (median round seconds, median central evaluation seconds)."""
    out = {}
    for name, over in SETTINGS.items():
        steady = run_once({**base, **over}, clients, runtime)
        out[name] = (median(t["seconds"] for t in steady), median(t["eval-seconds"] for t in steady))
    return out


def central_evaluation(base: dict[str, Any], clients: int, repeats: int) -> tuple[float, float]:
    """Median seconds of the central evaluation with the per-class record and TensorBoard, and of
    the accuracy alone, interleaved."""
    cfg = config(**base)
    strategy = FedAvgStrategy(cfg)
    model = strategy.global_model(strategy.initial_arrays())
    x, y = load_test_set(cfg)
    on, off = [], []
    with tempfile.TemporaryDirectory() as d:
        cfg = {**cfg, "out-dir": d, "run-name": "bench"}
        out = RunOutput(cfg, 1)
        trackers = Trackers(cfg, out.dir, 1)
        central = CentralEvaluation(x, y, cfg, CPU, out, trackers, save_partition(cfg, clients, out))
        partitions = list(range(0, clients, 2))
        for r in range(repeats):
            t = time.perf_counter()
            trackers.log_round({"round": r + 1, **central.evaluate(model, partitions)})
            on.append(time.perf_counter() - t)
            t = time.perf_counter()
            evaluate(model, x, y, cfg["eval-batch-size"], CPU)
            off.append(time.perf_counter() - t)
        trackers.close()
    return median(on), median(off)


def client_round(base: dict[str, Any], clients: int, repeats: int) -> tuple[float, float]:
    """Median seconds of partition 0's round with and without `personalized-central-eval`."""
    cfg = config(**base)
    data = load_client_data(cfg, 0, clients)
    test = load_test_set(cfg)
    arrays = FedAvgStrategy(cfg).initial_arrays()
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(repeats):
        for central in (True, False):
            ctx = TrainerContext(
                {**cfg, "personalized-central-eval": central},
                data,
                CPU,
                ClientState(RecordDict(), 64, 0),
                0,
                1,
                seed_everything(cfg["seed"], 0, 1),
                test if central else None,
            )
            config_record = ConfigRecord({"server-round": 1})
            content = RecordDict({"arrays": ArrayRecord(arrays.to_torch_state_dict()), "config": config_record})
            t = time.perf_counter()
            FedAvgTrainer(ctx).fit(content)
            times[central].append(time.perf_counter() - t)
    return median(times[True]), median(times[False])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--runtime", choices=("sim", "harness"), default="sim")
    ap.add_argument("--quick", action="store_true", help="tiny: harness, MLP, 5 clients, 2 rounds, 1 repeat")
    args = ap.parse_args()
    base: dict[str, Any] = {"num-server-rounds": args.rounds, "checkpoint-every": 0}
    if args.quick:
        args.clients, args.repeats, args.runtime = 5, 1, "harness"
        base = {"num-server-rounds": 2, "checkpoint-every": 0, "model": "mlp"}
    in_process_setup()
    with private_cache():
        rounds = round_times(base, args.clients, args.runtime)
        on, off = central_evaluation(base, args.clients, args.repeats)
        client_on, client_off = client_round(base, args.clients, args.repeats)
    title = f"{args.runtime}, {args.clients} clients, {base['num-server-rounds']} rounds: median round (rounds 2..R)"
    print_ratios(title, [(name, r) for name, (r, _) in rounds.items()])
    print_ratios(
        "median central evaluation of those runs (beside the next round)", [(n, e) for n, (_, e) in rounds.items()]
    )
    print_ratios(
        f"central evaluation in process, median of {args.repeats}",
        [("accuracy only", off), ("+ per-class record, TensorBoard", on)],
    )
    share = 100 * (on - off) / rounds["off"][0]
    print(f"  extra per round: {1000 * (on - off):.1f} ms = {share:.2f} % of the median round (off)")
    print_ratios(
        f"one client's round (partition 0), median of {args.repeats}",
        [("personalized-central-eval off", client_off), ("personalized-central-eval on", client_on)],
    )


if __name__ == "__main__":
    main()
