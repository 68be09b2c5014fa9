"""The fedskew ServerApp: validate the run config, build the method's strategy, run the rounds,
evaluate the global model centrally each round and write the results folder.

The round loop is ours (not `Strategy.start`) so that every round is timed, logged and written as
it ends: configure_train -> send_and_receive -> aggregate_train -> central evaluation.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Iterable
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context, Message
from flwr.serverapp import Grid, ServerApp

from fedskew.config import validate
from fedskew.data import dataset_info, load_arrays
from fedskew.data.clients import client_indices, load_test_set
from fedskew.partitions import class_counts, format_counts, plot_counts
from fedskew.registry import get_method
from fedskew.server_app.results import RunOutput, read_jsonl, round_statistics, write_json
from fedskew.strategies.fedavg import FedAvgStrategy
from fedskew.training import evaluate, pick_device, seed_everything

log = logging.getLogger("flwr.fedskew")  # a child of Flower's logger, so it shows in `flwr log`
app = ServerApp()


class PromptGrid:
    """The run's Grid, except that `send_and_receive` looks for replies often: Flower's deployment
    Grid (`HttpGrid`) sleeps 3 s between pulls (a round waited 1.5 s on average after its last
    reply), its simulation Grid 0.1 s. Here the pause is 20 times what the last pull took, between
    0.01 s (simulation: an in-memory query) and 0.1 s (deployment: an HTTP request), so polling
    costs at most about 5 % of a core. Everything else is delegated to the wrapped Grid."""

    def __init__(self, grid: Grid) -> None:
        self._grid = grid

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        waiting = set(self._grid.push_messages(messages))
        end = None if timeout is None else time.monotonic() + timeout
        replies: list[Message] = []
        while waiting:
            t0 = time.monotonic()
            got = list(self._grid.pull_messages(waiting))
            replies += got
            waiting -= {m.metadata.reply_to_message_id for m in got}
            if not waiting or (end is not None and time.monotonic() >= end):
                break
            time.sleep(min(max(20 * (time.monotonic() - t0), 0.01), 0.1))
        return replies


def wait_for_nodes(grid: Grid, strategy: FedAvgStrategy, minimum: int, timeout: float) -> dict[int, int]:
    """Block until `minimum` nodes reported their partition (or fail after `timeout` s)."""
    t0 = time.monotonic()
    while True:
        nodes = strategy.discover(grid)
        if len(nodes) >= minimum:
            return nodes
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"only {len(nodes)} of min-nodes={minimum} nodes connected after {timeout:.0f} s")
        time.sleep(1.0)


def save_partition(cfg: dict[str, Any], num_partitions: int, out: RunOutput) -> None:
    """Write the class counts per client (text, JSON, picture) of the configured partition."""
    _, y_train, _, _ = load_arrays(cfg)
    parts = client_indices(cfg, num_partitions)
    c = dataset_info(cfg).num_classes
    train = class_counts(y_train, [tr for tr, _ in parts], c)
    test = class_counts(y_train, [te for _, te in parts], c)
    (out.dir / "partition.txt").write_text(format_counts(train, max_rows=10_000) + "\n")
    write_json(out.dir / "partition.json", {"train": train.tolist(), "test": test.tolist()})
    plot_counts(train, out.dir / "partition.png", f"{cfg['partition']}: {num_partitions} clients")
    log.info("partition (train samples per class, first clients):\n%s", format_counts(train, max_rows=10))


def round_line(r: int, rounds: int, seconds: float, g_acc: float | None, m: dict[str, Any]) -> str:
    """One log line per round: central global accuracy, then the clients' means ± std of the global
    model on their local test splits (client-global) and of their personalized models."""
    g = "   -  " if g_acc is None else f"{g_acc:.4f}"
    nan = float("nan")
    cg, cgs = m.get("client-global-accuracy", nan), m.get("client-global-accuracy-std", nan)
    p, s = m.get("personalized-accuracy", nan), m.get("personalized-accuracy-std", nan)
    fails = f" | {m['failures']} failed" if m.get("failures") else ""
    return (
        f"round {r:>3}/{rounds} | {seconds:6.1f} s | global acc {g} | client-global acc {cg:.4f} ± {cgs:.4f} | "
        f"personalized acc {p:.4f} ± {s:.4f} | clients {m.get('replies', 0)}{fails}"
    )


def train_round(
    strategy: FedAvgStrategy, grid: Grid, r: int, arrays: ArrayRecord, cfg: dict[str, Any]
) -> tuple[ArrayRecord | None, dict[str, Any], list[dict[str, Any]]]:
    """Send one round, wait up to `round-timeout`, aggregate what arrived.

    A node that errs, sends a bad payload or does not answer in time is a logged failure. The round
    stands when at least `min-replies` usable replies arrived (all of them when fewer nodes were sampled);
    otherwise it is tried again up to `round-retries` times, then the run stops with the reason.
    """
    lost: list[dict[str, Any]] = []  # every attempt's failures, so none is lost if the round fails
    for attempt in range(cfg["round-retries"] + 1):
        messages = list(strategy.configure_train(r, arrays, ConfigRecord({"attempt": attempt}), grid))
        replies = list(grid.send_and_receive(messages, timeout=cfg["round-timeout"]))
        new, record = strategy.aggregate_train(r, replies)  # logs and records every lost node
        lost += [{**f, "attempt": attempt} for f in strategy.failures]
        metrics = dict(record)
        if messages and metrics["replies"] >= min(cfg["min-replies"], len(messages)):
            return new, metrics, lost
        log.warning(
            "round %d: %d usable replies of %d sent (min-replies=%d), attempt %d of %d",
            r,
            metrics["replies"],
            len(messages),
            cfg["min-replies"],
            attempt + 1,
            cfg["round-retries"] + 1,
        )
    raise RoundFailedError(
        f"round {r}: only {metrics['replies']} usable replies (min-replies={cfg['min-replies']}) after "
        f"{cfg['round-retries'] + 1} attempts; the reasons are in the log and failures.jsonl",
        lost,
    )


class RoundFailedError(RuntimeError):
    """A round without enough usable replies after every retry; `failures` lists each lost reply."""

    def __init__(self, message: str, failures: list[dict[str, Any]]) -> None:
        super().__init__(message)
        self.failures = failures


@app.main()
def main(grid: Grid, context: Context) -> None:
    t_start, started_at = time.perf_counter(), time.time()
    if hasattr(grid, "push_messages"):  # Flower's Grids (the tests' in-process one has no push/pull)
        grid = PromptGrid(grid)
    cfg = validate(dict(context.run_config))
    seed_everything(cfg["seed"])
    device = pick_device(cfg["device"])
    out = RunOutput(cfg, context.run_id)
    # the test set loads while the nodes are discovered (their ClientApps are starting meanwhile)
    loader = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    test_set = loader.submit(load_test_set, cfg)
    strategy: FedAvgStrategy = get_method(cfg["method"]).strategy_class()(cfg, device)
    log.info(
        "fedskew: method=%s dataset=%s model=%s partition=%s -> %s",
        cfg["method"],
        cfg["dataset"],
        cfg["model"],
        cfg["partition"],
        out.dir,
    )

    t_nodes = time.perf_counter()
    nodes = wait_for_nodes(grid, strategy, cfg["min-nodes"], cfg["round-timeout"])
    x_test, y_test = test_set.result()
    loader.shutdown()
    num_partitions = strategy.num_partitions or len(nodes)
    t_partition = time.perf_counter()
    save_partition(cfg, num_partitions, out)
    start_seconds = {  # where the ServerApp's own start goes (the rest of a run's start is Flower's)
        "config": t_nodes - t_start,
        "node_discovery_and_test_set": t_partition - t_nodes,  # the test set loads beside the discovery
        "partition_files": time.perf_counter() - t_partition,
    }

    arrays = strategy.initial_arrays()
    rounds = cfg["num-server-rounds"]
    g_acc, last_metrics, start = None, {}, 1
    ckpt = out.load_checkpoint() if cfg["resume"] else None
    if ckpt is not None:
        arrays = ArrayRecord(ckpt["arrays"])
        strategy.load_state_dict(ckpt["strategy"])
        g_acc, last_metrics, start = ckpt["global-accuracy"], ckpt["metrics"], ckpt["round"] + 1
        log.info("fedskew: resuming after round %d from %s", ckpt["round"], out.dir / "checkpoint.pt")
    for r in range(start, rounds + 1):
        seed_everything(cfg["seed"], r)  # server randomness depends on (seed, round) only: resumable
        t0, round_started_at = time.perf_counter(), time.time()
        try:
            new, metrics, failures = train_round(strategy, grid, r, arrays, cfg)
        except RoundFailedError as e:
            out.log_failures(r, e.failures)  # the run stops: keep the reasons on disk
            raise
        t_clients = time.perf_counter() - t0
        if new is None:
            log.warning("round %d: no usable reply; the global model is unchanged", r)
        else:
            arrays = new
        t_eval = time.perf_counter()
        g_acc = g_loss = None
        if r % cfg["eval-every"] == 0 or r == rounds:
            g_loss, g_acc = evaluate(strategy.global_model(arrays), x_test, y_test, cfg["eval-batch-size"], device)
        seconds = time.perf_counter() - t0
        # metrics.jsonl stays deterministic (also across a resume): times and client-state counters go aside
        timings = {k: metrics.pop(k) for k in list(metrics) if "seconds" in k or k == "participations"}
        out.log_round(
            {"round": r, "global-accuracy": g_acc, "global-loss": g_loss, **metrics},
            {
                "round": r,
                "started-at": round_started_at,  # epoch seconds, to line the round up with other logs
                "seconds": seconds,
                "clients-seconds": t_clients,
                "eval-seconds": time.perf_counter() - t_eval,
                **timings,
            },
            failures,
        )
        log.info(round_line(r, rounds, seconds, g_acc, metrics))
        last_metrics = metrics
        if cfg["checkpoint-every"] and (r % cfg["checkpoint-every"] == 0 or r == rounds):
            out.save_checkpoint(
                {
                    "round": r,
                    "arrays": arrays.to_torch_state_dict(),
                    "strategy": strategy.state_dict(),
                    "global-accuracy": g_acc,
                    "metrics": last_metrics,
                }
            )

    final_model = strategy.global_model(arrays)
    summary = {
        "method": cfg["method"],
        "dataset": cfg["dataset"],
        "model": cfg["model"],
        "partition": cfg["partition"],
        "seed": cfg["seed"],
        "num-clients": num_partitions,
        "rounds": rounds,
        **round_statistics(read_jsonl(out.dir / "metrics.jsonl")),
        "final_client_global_accuracy_std": last_metrics.get("client-global-accuracy-std"),
        "final_personalized_accuracy_std": last_metrics.get("personalized-accuracy-std"),
        "wall_seconds": time.perf_counter() - t_start,
        "started_at": started_at,
        "start_seconds": start_seconds,
        "run_dir": str(out.dir),
    }
    out.finish(summary, final_model.state_dict())
    nan = float("nan")
    log.info(
        "fedskew: done in %.1f s; mean of the last 10 rounds: global acc %.4f, client-global acc %.4f, "
        "personalized acc %.4f -> %s",
        summary["wall_seconds"],
        summary["last10_global_accuracy"] or nan,
        summary["last10_client_global_accuracy"] or nan,
        summary["last10_personalized_accuracy"] or nan,
        out.dir,
    )
