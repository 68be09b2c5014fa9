"""FedAvg server (McMahan et al., AISTATS'17), and the base class of every fedskew strategy.

Client side: `fedskew/client_app/fedavg.py`. What the base adds to Flower's FedAvg:

- deterministic sampling: nodes are identified by the `partition-id` they report (a `query.info`
  message, asked once per node), and each round samples max(1, floor(fraction-train * K))
  partitions with a numpy generator seeded by (seed, round), so a run (and a resumed run) samples
  the same clients whatever the random node IDs;
- reply screening before anything is aggregated: errors are logged with node and partition, and a
  reply whose arrays have unexpected names, shapes or dtypes or are not finite is dropped and logged;
- replies sorted by partition id before aggregation (bit-exact runs);
- hooks for subclasses: `broadcast` (extra records sent to every client), `expected_upload`,
  `aggregate_arrays`, `aggregate_extras`, `global_model` (the model evaluated centrally).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from torch import nn

from fedskew.models import SplitNet, build_model
from fedskew.strategies.aggregate import summarize_clients, weighted_average

log = logging.getLogger("fedskew.server")


def arrays_to_numpy(rec: ArrayRecord) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in rec.items()}


def numpy_to_arrays(arrays: dict[str, np.ndarray]) -> ArrayRecord:
    # np.array keeps 0-d arrays 0-d (np.ascontiguousarray would make them 1-d)
    return ArrayRecord({k: torch.from_numpy(np.array(v, order="C")) for k, v in arrays.items()})


class FedAvgStrategy(FedAvg):
    """Sample-weighted (or uniform, `aggregation-weights`) average of the uploaded models."""

    def __init__(self, cfg: dict[str, Any], device: torch.device | None = None) -> None:
        super().__init__(
            fraction_train=cfg["fraction-train"],
            fraction_evaluate=0.0,
            min_train_nodes=1,
            min_evaluate_nodes=0,
            min_available_nodes=1,
        )
        self.cfg = cfg
        self.device = device or torch.device("cpu")
        self.node_partitions: dict[int, int] = {}
        self.num_partitions = 0  # as the nodes report it
        self.failures: list[dict[str, Any]] = []  # of the last aggregated round
        self.sent_arrays = ArrayRecord()  # the global arrays of the current round
        self.sent_messages: list[Message] = []  # this round's train messages (ids are set when pushed)

    # ------------------------------------------------------------------ model
    def build_model(self) -> SplitNet:
        return build_model(self.cfg["model"], self.cfg["dataset"])

    def initial_arrays(self) -> ArrayRecord:
        torch.manual_seed(self.cfg["seed"])
        return ArrayRecord(self.build_model().state_dict())

    def expected_upload(self, arrays: ArrayRecord) -> dict[str, tuple[tuple[int, ...], str]]:
        """Names -> (shape, dtype) every client must upload (default: the global model's)."""
        return {k: (tuple(v.shape), v.dtype) for k, v in arrays.items()}

    def global_model(self, arrays: ArrayRecord) -> nn.Module:
        """The model evaluated centrally on the test set."""
        model = self.build_model()
        model.load_state_dict(arrays.to_torch_state_dict(), strict=True)
        return model.to(self.device)

    def state_dict(self) -> dict[str, Any]:
        """Server-side method state for checkpoints (tensors and plain values); FedAvg has none."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""

    # ------------------------------------------------------------------ downlink
    def broadcast(self, server_round: int) -> dict[str, Any]:
        """Extra records sent to every sampled client this round (none for FedAvg)."""
        return {}

    def discover(self, grid: Grid) -> dict[int, int]:
        """node id -> partition id for every connected node, asking only new nodes."""
        node_ids = sorted(grid.get_node_ids())
        new = [n for n in node_ids if n not in self.node_partitions]
        if new:
            msgs = [Message(RecordDict(), dst_node_id=n, message_type=f"{MessageType.QUERY}.info") for n in new]
            for reply in grid.send_and_receive(msgs, timeout=self.cfg["round-timeout"]):
                src = reply.metadata.src_node_id
                if reply.has_error():
                    log.warning("node %d did not say its partition: %s", src, reply.error.reason)
                    continue
                self.node_partitions[src] = int(reply.content["info"]["partition-id"])
                self.num_partitions = int(reply.content["info"]["num-partitions"])
        return {n: self.node_partitions[n] for n in node_ids if n in self.node_partitions}

    def sample(self, server_round: int, grid: Grid) -> list[int]:
        """Seeded sample of max(1, floor(fraction * K)) nodes, chosen by partition id."""
        nodes = sorted(self.discover(grid).items(), key=lambda kv: kv[1])
        if not nodes:
            return []
        k = max(1, math.floor(self.cfg["fraction-train"] * len(nodes)))
        rng = np.random.default_rng([self.cfg["seed"], server_round])
        picked = np.sort(rng.choice(len(nodes), size=k, replace=False))
        return [nodes[i][0] for i in picked]

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        node_ids = self.sample(server_round, grid)
        config["server-round"] = server_round
        self.sent_arrays = arrays
        record = RecordDict({"arrays": arrays, "config": config, **self.broadcast(server_round)})
        self.sent_messages = list(self._construct_messages(record, node_ids, MessageType.TRAIN))
        return self.sent_messages

    # ------------------------------------------------------------------ uplink
    def check_reply(self, content: RecordDict, expected: dict[str, tuple[tuple[int, ...], str]]) -> str | None:
        """Why a reply must be dropped, or None if it is fine."""
        arrays, metrics = content.get("arrays"), content.get("metrics")
        if not isinstance(arrays, ArrayRecord) or not isinstance(metrics, MetricRecord):
            return "reply lacks the 'arrays' ArrayRecord or the 'metrics' MetricRecord"
        for key in ("num-examples", "partition-id"):
            if not isinstance(metrics.get(key), int) or metrics[key] < 0:
                return f"metric {key!r} missing or not a non-negative int"
        if list(arrays.keys()) != list(expected):
            missing = set(expected) - set(arrays.keys())
            extra = set(arrays.keys()) - set(expected)
            return f"array names differ (missing {sorted(missing)[:3]}, unexpected {sorted(extra)[:3]})"
        for key, (shape, dtype) in expected.items():
            a = arrays[key]
            if tuple(a.shape) != shape or a.dtype != dtype:
                return f"array {key!r} is {a.dtype}{list(a.shape)}, expected {dtype}{list(shape)}"
            v = a.numpy()
            if v.dtype.kind == "f" and not np.isfinite(v).all():
                return f"array {key!r} holds NaN or inf"
        return None

    def accept(self, server_round: int, replies: Iterable[Message], expected: dict) -> list[Message]:
        """Drop failed or malformed replies (logged, counted in `self.failures`), also count the
        sampled nodes that did not reply at all (a dead node, the round timed out); sort the rest
        by partition id."""
        self.failures, ok, answered = [], [], set()
        dst = {m.metadata.message_id: m.metadata.dst_node_id for m in self.sent_messages if m.metadata.message_id}
        for msg in replies:
            # the SuperLink itself answers for a node that stopped sending heartbeats (src = SuperLink)
            node = dst.get(msg.metadata.reply_to_message_id or None, msg.metadata.src_node_id)
            answered.add(node)
            reason = msg.error.reason if msg.has_error() else self.check_reply(msg.content, expected)
            if reason is None:
                ok.append(msg)
            else:
                self.fail(server_round, node, str(reason))
        for node in (m.metadata.dst_node_id for m in self.sent_messages):
            if node not in answered:
                self.fail(server_round, node, f"no reply within round-timeout={self.cfg['round-timeout']:g} s")
        return sorted(ok, key=lambda m: int(m.content["metrics"]["partition-id"]))

    def fail(self, server_round: int, node: int, reason: str) -> None:
        pid = self.node_partitions.get(node, -1)
        self.failures.append({"node": node, "partition": pid, "reason": reason[:500]})
        log.warning("round %d: dropped reply of node %d (partition %d): %s", server_round, node, pid, reason)

    def aggregate_arrays(self, server_round: int, replies: list[Message]) -> ArrayRecord:
        """Weighted mean of the uploaded arrays (weights: num-examples, or 1 when uniform)."""
        uniform = self.cfg["aggregation-weights"] == "uniform"
        weights = [1.0 if uniform else float(m.content["metrics"]["num-examples"]) for m in replies]
        return numpy_to_arrays(weighted_average([arrays_to_numpy(m.content["arrays"]) for m in replies], weights))

    def aggregate_extras(self, server_round: int, replies: list[Message]) -> dict[str, float]:
        """Handle extra reply records (prototypes, gradients ...); return metrics to log."""
        return {}

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord]:
        """Screen, sort and aggregate one round's replies against the arrays sent this round.

        Returns the new global arrays (None when no reply is usable) and the round's metrics.
        """
        ok = self.accept(server_round, replies, self.expected_upload(self.sent_arrays))
        metrics: dict[str, Any] = {"replies": len(ok), "failures": len(self.failures)}
        if not ok:
            return None, MetricRecord(metrics)
        t0 = time.perf_counter()
        new = self.aggregate_arrays(server_round, ok)
        metrics.update(self.aggregate_extras(server_round, ok))
        metrics["server-seconds"] = time.perf_counter() - t0
        metrics.update(self.client_metrics(ok))
        return new, MetricRecord(metrics)

    @staticmethod
    def client_metrics(replies: list[Message]) -> dict[str, Any]:
        """Personalized accuracy and client-global accuracy (each the unweighted mean and std over
        clients of a per-client test accuracy), training loss and times."""
        ms = [m.content["metrics"] for m in replies]
        out: dict[str, Any] = {}
        for client_key, key in (
            ("personal-accuracy", "personalized-accuracy"),
            ("client-global-accuracy", "client-global-accuracy"),
        ):
            out[key], out[f"{key}-std"] = summarize_clients([float(m[client_key]) for m in ms if client_key in m])
        n = np.array([float(m["num-examples"]) for m in ms])
        loss = np.array([float(m.get("train-loss", np.nan)) for m in ms])
        secs = [float(m.get("train-seconds", np.nan)) for m in ms]
        return {
            **out,
            "train-loss": float((n * loss).sum() / max(n.sum(), 1.0)),
            "client-seconds-mean": float(np.mean(secs)),
            "client-seconds-max": float(np.max(secs)),
            "partitions": [int(m["partition-id"]) for m in ms],
            "participations": [int(m.get("participations", 0)) for m in ms],
        }
