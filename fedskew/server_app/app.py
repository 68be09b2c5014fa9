"""The fedskew ServerApp: validate the run config, build the method's strategy, run the rounds,
evaluate the global model centrally each round and write the results folder.

The round loop is ours (not `Strategy.start`) so that every round is timed, logged and written as
it ends: configure_train -> send_and_receive -> aggregate_train -> central evaluation. Round r's
central evaluation runs in a thread beside round r + 1's training, so round r + 1's messages do not
wait for it (on a machine whose cores the clients already fill it competes with them instead: see
docs/benchmarks.md); that thread writes round r's records as soon as it is done, in round order.
The central evaluation's one forward pass gives the accuracy and the confusion matrix, from which
the per-class record (`fedskew.diagnostics`, run-config key `class-metrics`) is computed.
"""

from __future__ import annotations

import concurrent.futures
import copy
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message
from flwr.serverapp import Grid, ServerApp

from fedskew.client_app.state import state_bound_problem
from fedskew.config import ConfigError, validate
from fedskew.data import dataset_info
from fedskew.data.clients import client_class_counts, load_test_set
from fedskew.diagnostics import class_holders, class_metrics, frequency_groups, weight_norms
from fedskew.partitions import format_counts, format_skew, partition_skew, plot_counts
from fedskew.registry import get_method
from fedskew.server_app.results import RESUME_FIXED, RunOutput, class_labels, read_jsonl, round_statistics, write_json
from fedskew.server_app.tracking import Trackers
from fedskew.strategies.base import BaseStrategy
from fedskew.training import confusion, evaluate, pick_device, processor, seed_everything

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


def wait_for_nodes(grid: Grid, strategy: BaseStrategy, minimum: int, timeout: float) -> dict[int, int]:
    """Block until `minimum` nodes reported their partition (or fail after `timeout` s)."""
    t0 = time.monotonic()
    while True:
        nodes = strategy.discover(grid)
        if len(nodes) >= minimum:
            return nodes
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"only {len(nodes)} of min-nodes={minimum} nodes connected after {timeout:.0f} s")
        time.sleep(1.0)


@dataclass(frozen=True)
class PartitionReport:
    """The configured partition as the server computes it: training images per client and class,
    its skew (`partition_skew`) and, on a long tail, its head / middle / tail classes."""

    train: np.ndarray
    skew: dict[str, Any]
    groups: dict[str, list[int]] | None


def save_partition(cfg: dict[str, Any], num_partitions: int, out: RunOutput) -> PartitionReport:
    """Write the class counts per client and the skew (text, JSON) of the configured partition and log
    them; return them (the training counts also feed its picture, `plot_counts`)."""
    train, test = client_class_counts(cfg, num_partitions)
    report = PartitionReport(train, partition_skew(train), frequency_groups(train.sum(axis=0)))
    skew = format_skew(report.skew)
    (out.dir / "partition.txt").write_text(format_counts(train, max_rows=10_000) + "\n\n" + skew + "\n")
    write_json(
        out.dir / "partition.json",
        {"train": train.tolist(), "test": test.tolist(), "skew": report.skew, "frequency-groups": report.groups},
    )
    log.info("partition (train samples per class, first clients):\n%s", format_counts(train, max_rows=10))
    log.info("partition skew: %s", skew)
    return report


def round_line(r: int, rounds: int, seconds: float, g: dict[str, Any], m: dict[str, Any]) -> str:
    """One log line per round: central global accuracy (with `class-metrics` its balanced accuracy
    and worst class), then the clients' means ± std of the global model on their local test splits
    (client-global) and of their personalized models."""
    g_acc = g.get("global-accuracy")
    g_text = "   -  " if g_acc is None else f"{g_acc:.4f}"
    if g.get("global-balanced-accuracy") is not None:
        g_text += f" (balanced {g['global-balanced-accuracy']:.4f}, worst class {g['global-worst-class']}"
        g_text += f" {g['global-worst-class-accuracy']:.4f})"
    nan = float("nan")
    cg, cgs = m.get("client-global-accuracy", nan), m.get("client-global-accuracy-std", nan)
    p, s = m.get("personalized-accuracy", nan), m.get("personalized-accuracy-std", nan)
    fails = f" | {m['failures']} failed" if m.get("failures") else ""
    return (
        f"round {r:>3}/{rounds} | {seconds:6.1f} s | global acc {g_text} | client-global acc {cg:.4f} ± {cgs:.4f} | "
        f"personalized acc {p:.4f} ± {s:.4f} | clients {m.get('replies', 0)}{fails}"
    )


def train_round(
    strategy: BaseStrategy, grid: Grid, r: int, arrays: ArrayRecord, cfg: dict[str, Any]
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


@dataclass
class CentralEvaluation:
    """What every round's central evaluation needs and where its records go: the test set, the run
    folder and trackers, and for the per-class record the partition (None: the nodes serve their
    own data, whose classes the server does not know)."""

    x_test: Any
    y_test: Any
    cfg: dict[str, Any]
    device: Any
    out: RunOutput
    trackers: Trackers
    partition: PartitionReport | None

    def evaluate(self, model: Any, partitions: list[int]) -> dict[str, Any]:
        """Global accuracy and loss of `model` and, with `class-metrics`, its per-class record
        (`class_metrics`: the holders are counted over this round's clients, `partitions`)."""
        loss, cm = confusion(model, self.x_test, self.y_test, self.cfg["eval-batch-size"], self.device)
        record: dict[str, Any] = {"global-accuracy": float(np.trace(cm) / max(cm.sum(), 1)), "global-loss": loss}
        if self.cfg["class-metrics"]:
            weights = model.class_weights().detach().cpu().numpy() if hasattr(model, "class_weights") else None
            p = self.partition
            record.update(
                class_metrics(
                    cm,
                    p.groups if p else None,
                    None if weights is None else weight_norms(weights),
                    class_holders(p.train, partitions) if p else None,
                )
            )
        return record


@dataclass
class EvaluatedRound:
    """A trained round whose central evaluation runs beside the next round's training.

    `finish` (the evaluation thread, one round after the other) evaluates the global model, then,
    once the next round has started (`next_round_started`), appends the round's records (its wall
    time runs to the next round's start), saves its checkpoint and logs its line."""

    r: int
    rounds: int
    t0: float
    started_at: float
    t_clients: float
    metrics: dict[str, Any]
    failures: list[dict[str, Any]]
    checkpoint: dict[str, Any] | None
    future: concurrent.futures.Future = field(default=None, repr=False)  # type: ignore[assignment]
    _next_start: float | None = None
    _next: threading.Event = field(default_factory=threading.Event, repr=False)

    def next_round_started(self, t0: float | None) -> None:
        """The next round began at `t0` (None: this was the last round; its time ends when it is written)."""
        if not self._next.is_set():
            self._next_start = t0
            self._next.set()

    def finish(self, model: Any, central: CentralEvaluation, others: dict[str, Any] | None = None) -> dict:
        """Evaluate (the global model, and `others`: the strategy's `diagnostic_models`), write the
        records and checkpoint, log the round's line; the round's metrics."""
        t = time.perf_counter()
        g: dict[str, Any] = {"global-accuracy": None, "global-loss": None}
        if model is not None:
            g = central.evaluate(model, self.metrics.get("partitions", []))
        batch = central.cfg["eval-batch-size"]
        for name, other in (others or {}).items():
            g[f"{name}-accuracy"] = evaluate(other, central.x_test, central.y_test, batch, central.device)[1]
        eval_seconds = time.perf_counter() - t
        out = central.out
        self._next.wait()
        end = self._next_start if self._next_start is not None else time.perf_counter()
        metrics = dict(self.metrics)
        # metrics.jsonl stays deterministic (also across a resume): times and client-state counters go aside
        timings = {k: metrics.pop(k) for k in list(metrics) if "seconds" in k or k == "participations"}
        row = {"round": self.r, **g, **metrics}
        out.log_round(
            row,
            {
                "round": self.r,
                "started-at": self.started_at,  # epoch seconds, to line the round up with other logs
                "seconds": max(end, self.t0 + self.t_clients) - self.t0,  # to the next round's start
                "clients-seconds": self.t_clients,
                "eval-seconds": eval_seconds,  # beside the next round's training
                **timings,
            },
            self.failures,
        )
        central.trackers.log_round(row)
        if self.checkpoint is not None:
            out.save_checkpoint({**self.checkpoint, "global-accuracy": g["global-accuracy"], "metrics": metrics})
        log.info(round_line(self.r, self.rounds, time.perf_counter() - self.t0, g, self.metrics))
        return metrics


def where_ran(cfg: dict[str, Any], device: Any) -> dict[str, Any]:
    """What `summary.json` (and a stopped run's `stopped.json`) say of how the run computed."""
    return {
        "method-revision": get_method(cfg["method"]).revision,  # its arithmetic's (`MethodSpec.revision`)
        "device": device.type,  # the server's: `device="auto"` says which it was
        "processor": processor(device),  # the server's (in simulation, its clients' too)
    }


class RoundFailedError(RuntimeError):
    """A round without enough usable replies after every retry; `failures` lists each lost reply."""

    def __init__(self, message: str, failures: list[dict[str, Any]]) -> None:
        super().__init__(message)
        self.failures = failures


@app.main()
def main(grid: Grid, context: Context) -> None:
    t_start, started_at = time.perf_counter(), time.time()
    batched_engine = getattr(grid, "batched_engine", False) is True  # `fedskew.batched.grid.BatchedGrid`
    restored = getattr(grid, "node_states_restored", None)  # the round whose nodes' states an in-process grid put back
    if hasattr(grid, "push_messages"):  # Flower's Grids (the tests' in-process one has no push/pull)
        grid = PromptGrid(grid)
    try:  # the config and the results folder: refused with one line before anything starts
        cfg = validate(dict(context.run_config))
        seed_everything(cfg["seed"])
        device = pick_device(cfg["device"])
        out = RunOutput(cfg, context.run_id)
    except ConfigError as e:
        log.error("fedskew: config error: %s", e)
        raise
    if cfg["engine"] == "batched" and not batched_engine:
        log.warning("fedskew: engine='batched' is for `fedskew run` and suites: these clients run on Flower's runtime")
    # the test set loads while the strategy is built and the nodes are discovered (their ClientApps
    # are starting meanwhile), the partition's picture is drawn while round 1 trains
    background = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedskew-start")
    test_set = background.submit(load_test_set, cfg)
    strategy: BaseStrategy = get_method(cfg["method"]).strategy_class()(cfg, device)
    if problem := state_bound_problem(cfg):  # `fedskew run` refuses it; a deployment's nodes may keep state on disk
        log.warning(
            "fedskew: %s, or give the nodes a state-dir: a node without one fails every round it trains", problem
        )
    try:
        ckpt = out.resume(strategy)  # a resume's checkpoint, checked against the strategy and restored into it
        out.node_states_restored = ckpt is not None and type(restored) is int and restored == out.resumed_after
    except ConfigError as e:
        background.shutdown(wait=False, cancel_futures=True)
        log.error("fedskew: config error: %s", e)
        raise
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
    num_partitions = strategy.num_partitions or len(nodes)
    t_partition = time.perf_counter()
    partition = save_partition(cfg, num_partitions, out)
    title = f"{cfg['partition']}: {num_partitions} clients"
    picture = None
    if cfg["plots"]:
        picture = background.submit(plot_counts, partition.train, out.dir / "partition.png", title)
    background.shutdown(wait=False)  # its thread ends after the picture
    start_seconds = {  # where the ServerApp's own start goes (the rest of a run's start is Flower's)
        "config": t_nodes - t_start,
        "node_discovery_and_test_set": t_partition - t_nodes,  # the test set loads beside the discovery
        "partition_files": time.perf_counter() - t_partition,
    }

    absent = absent_classes(y_test, dataset_info(cfg).num_classes)
    if absent:
        log.warning("fedskew: the test set has no image of classes %s: their accuracy is absent (null)", absent)

    arrays = strategy.initial_arrays()
    if strategy.global_model(arrays) is None:
        log.info("fedskew: %s has no single global model: no central evaluation, no model.pt", cfg["method"])
    rounds = cfg["num-server-rounds"]
    last_metrics, start = {}, 1
    if ckpt is not None:
        arrays = ArrayRecord(ckpt["arrays"])
        last_metrics, start = ckpt.get("metrics", {}), ckpt["round"] + 1
        log.info("fedskew: resuming after round %d from %s", ckpt["round"], out.dir / "checkpoint.pt")
    trackers = Trackers(cfg, out.dir, start)
    try:
        if start == 1:
            trackers.log_partition(partition.skew)
        known = partition if strategy.num_partitions else None  # nodes with their own data: unknown
        central = CentralEvaluation(x_test, y_test, cfg, device, out, trackers, known)
        arrays, last_metrics = run_rounds(strategy, grid, cfg, arrays, start, last_metrics, central)
        if picture is not None and (error := picture.exception()) is not None:  # a picture is not worth the run
            log.warning("fedskew: %s not written: %s", out.dir / "partition.png", error)

        final_model = strategy.global_model(arrays)
        summary = {
            "method": cfg["method"],
            **where_ran(cfg, device),
            "dataset": cfg["dataset"],
            "model": cfg["model"],
            "partition": cfg["partition"],
            "seed": cfg["seed"],
            "num-clients": num_partitions,
            "rounds": rounds,
            **round_statistics(read_jsonl(out.dir / "metrics.jsonl")),
            "final_client_global_accuracy_std": last_metrics.get("client-global-accuracy-std"),
            "final_personalized_accuracy_std": last_metrics.get("personalized-accuracy-std"),
            "dominated_classes": known.skew["dominated-classes"] if known else None,
            "test_absent_classes": absent,
            "wall_seconds": time.perf_counter() - t_start,
            "started_at": started_at,
            "start_seconds": start_seconds,
            "run_dir": str(out.dir),
        }
        labels = class_labels(
            dataset_info(cfg).num_classes, known.skew if known else None, known.groups if known else None
        )
        figure = out.finish(summary, None if final_model is None else final_model.state_dict(), labels, cfg["plots"])
        if figure is not None:
            trackers.log_figure("per-class-accuracy", figure, rounds)
    finally:
        trackers.close()
    out.write_summary(summary)  # last: the event files are closed, every file of the run is written
    nan = float("nan")
    worst = summary["last10_worst_class"]
    log.info(
        "fedskew: done in %.1f s; mean of the last 10 rounds: global acc %.4f (balanced %.4f, worst class %s "
        "%.4f), client-global acc %.4f, personalized acc %.4f -> %s",
        summary["wall_seconds"],
        summary["last10_global_accuracy"] or nan,
        summary["last10_global_balanced_accuracy"] or nan,
        "-" if worst is None else worst,
        nan if worst is None else summary["last10_per_class_accuracy"][worst],
        summary["last10_client_global_accuracy"] or nan,
        summary["last10_personalized_accuracy"] or nan,
        out.dir,
    )


def run_rounds(
    strategy: BaseStrategy,
    grid: Grid,
    cfg: dict[str, Any],
    arrays: ArrayRecord,
    start: int,
    last_metrics: dict[str, Any],
    central: CentralEvaluation,
) -> tuple[ArrayRecord, dict[str, Any]]:
    """Rounds `start`..R; return the final global arrays and the last round's metrics.

    Round r's central evaluation runs in a thread of its own while round r + 1 trains; it writes
    round r's records as soon as it is done (one round after the other), the checkpoint from a
    round-end snapshot."""
    rounds = cfg["num-server-rounds"]
    evaluator = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedskew-eval")
    pending: EvaluatedRound | None = None
    try:
        for r in range(start, rounds + 1):
            seed_everything(cfg["seed"], r)  # server randomness depends on (seed, round) only: resumable
            t0, round_started_at = time.perf_counter(), time.time()
            if pending is not None:
                pending.next_round_started(t0)
            try:
                new, metrics, failures = train_round(strategy, grid, r, arrays, cfg)
            except RoundFailedError as e:
                if pending is not None:  # the round before is kept
                    pending.future.result()
                central.out.log_failures(r, e.failures)  # the run stops: keep the reasons on disk
                try:  # the record of the stop must not hide the stop's own error
                    central.out.write_stopped(r, str(e), where_ran(cfg, central.device))
                except OSError as why:
                    log.warning("fedskew: %s not written: %s", central.out.dir / "stopped.json", why)
                raise
            t_clients = time.perf_counter() - t0
            if new is None:
                log.warning("round %d: no usable reply; the global model is unchanged", r)
            else:
                arrays = new
            if pending is not None:
                last_metrics = pending.future.result()  # re-raises its error
            checkpoint = None
            if cfg["checkpoint-every"] and (r % cfg["checkpoint-every"] == 0 or r == rounds):
                checkpoint = {  # the state at this round's end (the strategy's may change next round)
                    "round": r,
                    "arrays": arrays.to_torch_state_dict(),
                    "strategy": copy.deepcopy(strategy.state_dict()),
                    "run": {key: cfg[key] for key in RESUME_FIXED},  # what the arrays and state belong to
                }
            due = r % cfg["eval-every"] == 0 or r == rounds
            model = strategy.global_model(arrays) if due else None
            others = strategy.diagnostic_models(arrays) if due and new is not None else {}
            pending = EvaluatedRound(r, rounds, t0, round_started_at, t_clients, metrics, failures, checkpoint)
            pending.future = evaluator.submit(pending.finish, model, central, others)
        if pending is not None:
            pending.next_round_started(None)  # the last round's wall time ends with its evaluation
            last_metrics = pending.future.result()
    finally:
        if pending is not None:
            pending.next_round_started(None)  # never leave the evaluation thread waiting
        evaluator.shutdown(wait=True, cancel_futures=True)
    return arrays, last_metrics


def absent_classes(y_test: Any, num_classes: int) -> list[int]:
    """The classes of which the central test set holds no image."""
    return [int(c) for c in np.flatnonzero(np.bincount(np.asarray(y_test), minlength=num_classes) == 0)]
