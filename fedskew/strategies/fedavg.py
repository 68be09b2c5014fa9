"""FedAvg server (McMahan et al., AISTATS'17), and the base class of every fedskew strategy.

Client side: `fedskew/client_app/fedavg.py`. What the base adds to Flower's FedAvg:

- deterministic sampling: nodes are identified by the `partition-id` they report (a `query.info`
  message, asked once per node), and each round samples max(1, floor(fraction-train * K))
  partitions with a numpy generator seeded by (seed, round), so a run (and a resumed run) samples
  the same clients whatever the random node IDs;
- node discovery that trusts no report: a node whose `query.info` lacks an integer partition id
  and partition count, reports another count than the other nodes or more partitions than the data
  set has examples, or claims a partition another connected node serves is refused (logged, and
  counted with the next round's failures);
- reply screening before any method sees a reply (`screen`): every record is checked against the
  method's `reply_schema` (`fedskew.records`: arrays decoded from their bytes and checked, metrics
  typed and in range, no undeclared record), then `check_reply` ties the reply to its node's
  partition and bounds `num-examples` by that partition's size. A reply that fails is dropped,
  logged with node, partition and reason, and counted in `self.failures` (failures.jsonl);
- replies sorted by partition id before aggregation (bit-exact runs);
- hooks for subclasses: `broadcast` (extra records sent to every client), `expected_upload`,
  `reply_metrics` / `reply_schema` / `check_reply` (the form and rules of the method's replies),
  `aggregate_arrays`, `aggregate_extras`, `global_model` (the model evaluated centrally).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from typing import Any, ClassVar

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from torch import nn

from fedskew.data import dataset_info, load_arrays
from fedskew.data.clients import client_indices
from fedskew.models import SplitNet, build_model
from fedskew.reasons import short_reason
from fedskew.records import ArraysSpec, MetricsSpec, Number, Rejected, Spec, Tensor, check_content
from fedskew.strategies.aggregate import summarize_clients, weighted_average

log = logging.getLogger("fedskew.server")

FRACTION = Number(float, 0.0, 1.0)
NON_NEGATIVE = Number(float, 0.0)
# What every client reports (client_app/fedavg.py and app.py). num-examples is bounded above by the
# size of the reply's partition (`check_reply`).
CLIENT_METRICS: dict[str, Number] = {
    "num-examples": Number(int, 1, required=True),
    "partition-id": Number(int, 0, required=True),
    "personal-num-test": Number(int, 0),
    "personal-accuracy": FRACTION,
    "personal-loss": NON_NEGATIVE,
    "client-global-accuracy": FRACTION,
    "client-global-loss": NON_NEGATIVE,
    "train-loss": NON_NEGATIVE,
    "train-steps": NON_NEGATIVE,
    "train-seconds": NON_NEGATIVE,
    "participations": Number(int, 0),
}


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
        self.num_partitions: int | None = None  # as the first accepted node reports it (0: own data)
        self.refused: set[int] = set()  # nodes whose report was refused (never asked again)
        self.failures: list[dict[str, Any]] = []  # of the last aggregated round
        self.pending: list[dict[str, Any]] = []  # refusals at discovery, counted with the next round
        self.sent_arrays = ArrayRecord()  # the global arrays of the current round
        self.sent_messages: list[Message] = []  # this round's train messages (ids are set when pushed)

    # ------------------------------------------------------------------ model
    def build_model(self) -> SplitNet:
        return build_model(self.cfg["model"], dataset_info(self.cfg))

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
        new = [n for n in node_ids if n not in self.node_partitions and n not in self.refused]
        if new:
            msgs = [Message(RecordDict(), dst_node_id=n, message_type=f"{MessageType.QUERY}.info") for n in new]
            for reply in grid.send_and_receive(msgs, timeout=self.cfg["round-timeout"]):
                src = reply.metadata.src_node_id
                if reply.has_error():
                    log.warning("node %d did not say its partition: %s", src, reply.error.reason)
                    continue
                try:
                    pid, num = self.node_report(reply.content, node_ids)
                except Rejected as e:
                    self.refused.add(src)
                    self.pending.append({"node": src, "partition": -1, "reason": f"refused at discovery: {e}"})
                    log.warning("node %d refused: %s", src, e)
                    continue
                self.node_partitions[src], self.num_partitions = pid, num
        return {n: self.node_partitions[n] for n in node_ids if n in self.node_partitions}

    def node_report(self, content: RecordDict, connected: list[int]) -> tuple[int, int]:
        """(partition-id, num-partitions) of a `query.info` reply; raises `Rejected` unless both are
        integers, the count equals the other nodes' and is at most the data set's size, and the
        partition is in range and not served by another connected node."""
        info = content.get("info")
        if not isinstance(info, ConfigRecord):
            raise Rejected("the reply lacks the 'info' ConfigRecord")
        pid, num = info.get("partition-id"), info.get("num-partitions")
        for key, value in (("partition-id", pid), ("num-partitions", num)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise Rejected(f"{key}={value!r} is not an integer")
        if not 0 <= num <= self.train_size():
            raise Rejected(f"num-partitions={num} is outside [0, {self.train_size()}] (the training set's size)")
        if self.num_partitions is not None and num != self.num_partitions:
            raise Rejected(f"num-partitions={num}, but the other nodes report {self.num_partitions}")
        if pid < 0 or (num and pid >= num):
            raise Rejected(f"partition-id={pid} is outside [0, {num or 'inf'})")
        owner = next((n for n in connected if self.node_partitions.get(n) == pid), None)
        if owner is not None:
            raise Rejected(f"partition {pid} is already served by node {owner}")
        return pid, num

    def train_size(self) -> int:
        """Examples in the configured data set's training split."""
        return len(load_arrays(self.cfg)[1])

    def example_bound(self, partition: int) -> int:
        """The most training examples a reply of `partition` may claim: that partition's size when
        the nodes serve partitions of the data set (the server computes the same partition), else
        (nodes with their own data) `max-num-examples`, or the data set's training-set size."""
        if self.num_partitions:
            return len(client_indices(self.cfg, self.num_partitions)[partition][0])
        return self.cfg["max-num-examples"] or self.train_size()

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
    reply_metrics: ClassVar[dict[str, Number]] = {}  # the method's own metrics, beside CLIENT_METRICS

    def reply_schema(self) -> dict[str, Spec]:
        """The records a reply holds: the uploaded arrays (`expected_upload` of this round's arrays)
        and the metrics; methods add their extra records."""
        upload = {k: Tensor(shape, dtype) for k, (shape, dtype) in self.expected_upload(self.sent_arrays).items()}
        return {"arrays": ArraysSpec(upload), "metrics": MetricsSpec({**CLIENT_METRICS, **self.reply_metrics})}

    def check_reply(self, content: RecordDict, partition: int) -> None:
        """The method's rules for a reply whose records have their declared form (raise `Rejected`):
        it is for the partition its node reported, and claims no more examples than it holds."""
        metrics = content["metrics"]
        if metrics["partition-id"] != partition:
            raise Rejected(f"the reply claims partition {metrics['partition-id']}, its node serves {partition}")
        bound = self.example_bound(partition)
        if metrics["num-examples"] > bound:
            raise Rejected(f"num-examples={metrics['num-examples']} > {bound}, the size of partition {partition}")

    def screen(self, msg: Message, node: int, schema: dict[str, Spec]) -> RecordDict:
        """The reply's content cut to its declared records, after every check; raises `Rejected`."""
        if msg.has_error():
            raise Rejected(msg.error.reason)
        if node not in self.node_partitions:
            raise Rejected("the node never reported its partition")
        content = check_content(msg.content, schema)
        self.check_reply(content, self.node_partitions[node])
        return content

    def accept(self, server_round: int, replies: Iterable[Message]) -> list[Message]:
        """Screen every reply (a failure is logged and counted in `self.failures`), also count the
        sampled nodes that did not reply at all (a dead node, the round timed out); sort the rest
        by partition id."""
        self.failures, self.pending, ok, answered = self.pending, [], [], set()
        schema = self.reply_schema()
        dst = {m.metadata.message_id: m.metadata.dst_node_id for m in self.sent_messages if m.metadata.message_id}
        for msg in replies:
            # the SuperLink itself answers for a node that stopped sending heartbeats (src = SuperLink)
            node = dst.get(msg.metadata.reply_to_message_id or None, msg.metadata.src_node_id)
            answered.add(node)
            try:
                msg.content = self.screen(msg, node, schema)
            except Rejected as e:
                self.fail(server_round, node, str(e))
                continue
            ok.append(msg)
        for node in (m.metadata.dst_node_id for m in self.sent_messages):
            if node not in answered:
                self.fail(server_round, node, f"no reply within round-timeout={self.cfg['round-timeout']:g} s")
        return sorted(ok, key=lambda m: m.content["metrics"]["partition-id"])

    def fail(self, server_round: int, node: int, reason: str) -> None:
        pid, reason = self.node_partitions.get(node, -1), short_reason(reason)  # the exception, one line
        self.failures.append({"node": node, "partition": pid, "reason": reason})
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
        ok = self.accept(server_round, replies)
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
