"""The base of every fedskew strategy (server side): discovery, sampling, reply screening,
aggregation hooks and state. A method is a subclass that overrides only what differs (FL-bench
style); FedAvg (`fedavg.py`) overrides nothing.

What the base does for every method:

- deterministic sampling: nodes are identified by the `partition-id` they report (a `query.info`
  message, asked once per node), and each round samples max(1, floor(fraction-train * K))
  partitions with a numpy generator seeded by (seed, round), so a run (and a resumed run) samples
  the same clients whatever the random node IDs;
- node discovery that trusts no report (`discovery.py`): the partition count comes from the run
  config (`num-partitions`; only when it is 0, from a strict majority of the nodes), a node that
  reports another count, a malformed report or more partitions than the data set has examples
  serves nothing, and a partition two nodes claim is served by neither while contested; refusals
  are logged, counted with the next round's failures, and asked again at the next discovery;
- reply screening before any method sees a reply (`screen`): every record is checked against the
  method's declared wire records (`wire`, the `fedskew.wire.Wire` on its card,
  `fedskew/methods/<name>.py`: arrays decoded from their bytes and checked, metrics typed and in
  range, no undeclared record), then
  `check_reply` ties the reply to its node's partition, bounds `num-examples` by that partition's
  size and the update's norm by `max-update-ratio` times the norm of the model sent (a finite but
  extreme model never enters the average). A reply that fails is dropped, logged with node,
  partition and reason, and counted in
  `self.failures` (failures.jsonl);
- robustness against a client within every bound (`bound_updates`, before any method aggregates):
  each accepted update is clipped to `update-norm-bound` times the round's median update norm, and
  `robust-aggregation` (`mean`, `pool`) may replace the means and the sums of server state by a
  coordinate-wise median or trimmed mean; an uploaded class statistic beyond `statistic-norm-bound`
  times the round's median is dropped (`bound_statistics`);
- replies sorted by partition id before aggregation (bit-exact runs);
- hooks for subclasses: `broadcast` (extra records sent to every client), `expected_upload`,
  `check_reply` (the method's rules for a well-formed reply), `update_records` (which reply records
  are model updates, for `bound_updates`), `aggregate_arrays` (default: the
  sample-weighted average, or uniform with `aggregation-weights`: `aggregation_weights`),
  `aggregate_extras` (extra reply records and the method's own metrics; every metric the method's
  wire declares that it does not return is logged as the unweighted mean over the round's replies),
  `global_model` (the model evaluated centrally), `diagnostic_models` (others evaluated beside it),
  `state_dict` / `load_state_dict` (checkpoints);
- what the server computes instead of trusting a reply: `local_steps` (a client's local SGD steps
  this round, from its partition's size) and `num_clients` (N);
- `RoundState` for server state that each round's aggregation replaces, so that a retried round
  starts again from the state of its first attempt.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from torch import nn

from fedskew.data import load_arrays
from fedskew.data.clients import client_class_counts, client_indices
from fedskew.models import SplitNet, run_model
from fedskew.reasons import short_reason
from fedskew.records import Rejected, Spec, Tensor, check_content
from fedskew.registry import DeclaredWire
from fedskew.strategies.aggregate import (
    clip_update,
    norm_bound,
    pooled_accuracy,
    robust_mean,
    robust_pool,
    summarize_clients,
    update_norm,
    update_ratio,
)
from fedskew.strategies.discovery import assign_partitions, majority_count
from fedskew.training import built_with_seed, steps_per_round
from fedskew.wire import CENTRAL_EVAL_METRICS, Dims

log = logging.getLogger("fedskew.server")


def arrays_to_numpy(rec: ArrayRecord) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in rec.items()}


def numpy_to_arrays(arrays: dict[str, np.ndarray]) -> ArrayRecord:
    # np.array keeps 0-d arrays 0-d (np.ascontiguousarray would make them 1-d)
    return ArrayRecord({k: torch.from_numpy(np.array(v, order="C")) for k, v in arrays.items()})


class RoundState:
    """Server state that a round's aggregation replaces (SCAFFOLD's c, FedDyn's h): `before(r)` is
    the state round r started from, so that a retried round (`round-retries`), whose discarded
    attempt was aggregated too, starts again from the same state instead of counting twice."""

    def __init__(self, prefix: str, value: dict[str, np.ndarray]) -> None:
        self.prefix = prefix  # its keys in the strategy's checkpoint: `<prefix>/<name>`
        self.value = value
        self._round: int | None = None
        self._before = value

    @classmethod
    def zeros(cls, prefix: str, dims: Dims) -> RoundState:
        """A float32 zero for each trainable parameter (the papers' initial c and h)."""
        return cls(prefix, {k: np.zeros(f.shape, np.float32) for k, f in dims.params.items()})

    def before(self, server_round: int) -> dict[str, np.ndarray]:
        if server_round != self._round:
            self._round, self._before = server_round, self.value
        return self._before

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"{self.prefix}/{k}": torch.from_numpy(np.array(v, order="C")) for k, v in self.value.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The state from `state_dict` (a checkpoint); the next round starts from it."""
        self.value = {
            k: state[f"{self.prefix}/{k}"].numpy().astype(v.dtype).reshape(v.shape) for k, v in self.value.items()
        }
        self._round, self._before = None, self.value


class BaseStrategy(Strategy):
    """A fedskew method's server side; subclasses override the hooks that differ; its
    records (`wire`) are its card's (`fedskew/methods/<name>.py`)."""

    wire = DeclaredWire()  # the method's records beyond the model: its card's `MethodSpec.wire`

    def __init__(self, cfg: dict[str, Any], device: torch.device | None = None) -> None:
        self.cfg = cfg
        self.dims = Dims.of(cfg)
        self.device = device or torch.device("cpu")
        self.reports: dict[int, tuple[int, int]] = {}  # node -> (partition-id, num-partitions) reported
        self.node_partitions: dict[int, int] = {}  # node -> partition, of the nodes that serve one
        self.num_partitions: int | None = cfg["num-partitions"] or None  # (0: nodes with their own data)
        self.refused: dict[int, str] = {}  # node -> why it serves nothing (asked again next discovery)
        self.failures: list[dict[str, Any]] = []  # of the last aggregated round
        self.pending: dict[int, dict[str, Any]] = {}  # refusals at discovery, counted with the next round
        self.update_ratios: dict[int, float] = {}  # partition -> its reply's update ratio this round
        self.class_counts: np.ndarray | None = None  # [K, C] training counts of the K partitions
        self._start: dict[str, np.ndarray] | None = None  # the sent arrays, decoded once a round
        self.sent_arrays = ArrayRecord()  # the global arrays of the current round
        self.sent_messages: list[Message] = []  # this round's train messages (ids are set when pushed)

    # ------------------------------------------------------------------ model
    def build_model(self) -> SplitNet:
        return run_model(self.cfg)

    def initial_arrays(self) -> ArrayRecord:
        """The initial global model: the network built under the run's `seed` (`built_with_seed`)."""
        return ArrayRecord(built_with_seed(self.build_model, self.cfg["seed"]).state_dict())

    def expected_upload(self, arrays: ArrayRecord) -> dict[str, tuple[tuple[int, ...], str]]:
        """Names -> (shape, dtype) every client must upload (default: the global model's)."""
        return {k: (tuple(v.shape), v.dtype) for k, v in arrays.items()}

    def global_model(self, arrays: ArrayRecord) -> nn.Module | None:
        """The model evaluated centrally on the test set; None for a method without a single global
        model (FedProto): the central evaluation is skipped and no `model.pt` is written."""
        return self.model_from(arrays.to_torch_state_dict())

    def diagnostic_models(self, arrays: ArrayRecord) -> dict[str, nn.Module]:
        """Other models of the round just aggregated (the new global `arrays`), evaluated on the test
        set beside the global model, their accuracy logged as `<name>-accuracy`: what a method's own
        diagnostic compares the global model with. None by default."""
        return {}

    def model_from(self, state: Mapping[str, torch.Tensor]) -> nn.Module:
        """The configured network holding the state dict `state` (every name), on the server's device."""
        model = self.build_model()
        model.load_state_dict(state, strict=True)
        return model.to(self.device)

    def state_dict(self) -> dict[str, Any]:
        """Server-side method state for checkpoints (tensors and plain values): every `RoundState`
        the strategy holds (SCAFFOLD's c, FedDyn's h ...; none by default). Other state: extend it."""
        return {k: v for held in self._round_states() for k, v in held.state_dict().items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        for held in self._round_states():
            held.load_state_dict(state)

    def _round_states(self) -> list[RoundState]:
        return [v for v in vars(self).values() if isinstance(v, RoundState)]

    # ------------------------------------------------------------------ downlink
    def broadcast(self, server_round: int) -> dict[str, Any]:
        """Extra records sent to every sampled client this round (none by default)."""
        return {}

    def discover(self, grid: Grid) -> dict[int, int]:
        """node id -> partition id of every connected node that serves one (`fedskew.strategies.
        discovery`). Nodes that serve nothing yet (new, refused or contesting) are asked for their
        partition; the reports of the others are kept."""
        node_ids = sorted(grid.get_node_ids())
        self.reports = {n: r for n, r in self.reports.items() if n in set(node_ids)}  # gone nodes
        ask = [n for n in node_ids if n not in self.node_partitions]
        if ask:
            msgs = [Message(RecordDict(), dst_node_id=n, message_type=f"{MessageType.QUERY}.info") for n in ask]
            for reply in grid.send_and_receive(msgs, timeout=self.cfg["round-timeout"]):
                src = reply.metadata.src_node_id
                self.reports.pop(src, None)
                if reply.has_error():
                    log.warning("node %d did not say its partition: %s", src, reply.error.reason)
                    continue
                try:
                    self.reports[src] = self.node_report(reply.content)
                except Rejected as e:
                    self.refuse(src, str(e))
        expected = self.cfg["num-partitions"] or majority_count(self.reports)
        self.node_partitions, refused = assign_partitions(self.reports, expected, self.cfg["partition-bindings"])
        for node, reason in refused.items():
            self.refuse(node, reason)
        if expected is not None:
            self.num_partitions = expected
        return {n: self.node_partitions[n] for n in node_ids if n in self.node_partitions}

    def refuse(self, node: int, reason: str) -> None:
        """Count `node`'s refusal with the next round's failures (once per node), log a new reason."""
        if self.refused.get(node) != reason:
            log.warning("node %d refused at discovery: %s", node, reason)
        self.refused[node] = reason
        self.pending[node] = {"node": node, "partition": -1, "reason": f"refused at discovery: {reason}"}

    def node_report(self, content: RecordDict) -> tuple[int, int]:
        """(partition-id, num-partitions) of a `query.info` reply; raises `Rejected` unless both are
        integers, the count is at most the data set's size and the partition is in range."""
        info = content.get("info")
        if not isinstance(info, ConfigRecord):
            raise Rejected("the reply lacks the 'info' ConfigRecord")
        pid, num = info.get("partition-id"), info.get("num-partitions")
        for key, value in (("partition-id", pid), ("num-partitions", num)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise Rejected(f"{key}={value!r} is not an integer")
        if not 0 <= num <= self.train_size():
            raise Rejected(f"num-partitions={num} is outside [0, {self.train_size()}] (the training set's size)")
        if pid < 0 or (num and pid >= num):
            raise Rejected(f"partition-id={pid} is outside [0, {num or 'inf'})")
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

    def test_bound(self, partition: int) -> int:
        """The most local test samples a reply of `partition` may claim: its local test split's size
        when the nodes serve partitions of the data set, else `example_bound`'s."""
        if self.num_partitions:
            return len(client_indices(self.cfg, self.num_partitions)[partition][1])
        return self.example_bound(partition)

    def partition_class_counts(self, partition: int) -> np.ndarray | None:
        """The training class counts of `partition` when the nodes serve partitions of the data set
        (what a reply's per-class counts are checked against), else None."""
        if not self.num_partitions:
            return None
        if self.class_counts is None or len(self.class_counts) != self.num_partitions:
            self.class_counts = client_class_counts(self.cfg, self.num_partitions)[0]
        return self.class_counts[partition]

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
        self.sent_arrays, self._start = arrays, None
        record = RecordDict({"arrays": arrays, "config": config, **self.broadcast(server_round)})
        self.sent_messages = [Message(record, dst_node_id=n, message_type=MessageType.TRAIN) for n in node_ids]
        return self.sent_messages

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """None: the global model is evaluated centrally by the ServerApp, clients evaluate in `train`."""
        return []

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return None

    def summary(self) -> None:
        log.info("fedskew strategy %s", type(self).__name__)

    # ------------------------------------------------------------------ uplink
    def reply_schema(self) -> dict[str, Spec]:
        """The records a reply holds: the uploaded arrays (`expected_upload` of this round's arrays),
        the metrics and the method's uplink records, as its `wire` declares them."""
        upload = {k: Tensor(shape, dtype) for k, (shape, dtype) in self.expected_upload(self.sent_arrays).items()}
        return self.wire.reply_schema(self.dims, upload)

    def check_reply(self, content: RecordDict, partition: int) -> None:
        """The method's rules for a reply whose records have their declared form (raise `Rejected`):
        it is for the partition its node reported, claims no more examples (training and local test)
        than it holds, and its update is within `max-update-ratio` times the norm of the model it
        started from (`fedskew.strategies.aggregate.update_ratio`)."""
        metrics = content["metrics"]
        if metrics["partition-id"] != partition:
            raise Rejected(f"the reply claims partition {metrics['partition-id']}, its node serves {partition}")
        bound = self.example_bound(partition)
        if metrics["num-examples"] > bound:
            raise Rejected(f"num-examples={metrics['num-examples']} > {bound}, the size of partition {partition}")
        tested, bound = metrics.get("personal-num-test", 0), self.test_bound(partition)
        if tested > bound:  # its weight in the pooled personalized accuracy
            raise Rejected(f"personal-num-test={tested} > {bound}, the local test split of partition {partition}")
        ratio = update_ratio(arrays_to_numpy(content["arrays"]), self.start_arrays(partition))
        limit = self.cfg["max-update-ratio"]
        if limit and ratio > limit:
            raise Rejected(f"its update is {ratio:.3g} times the norm of the model sent (max-update-ratio={limit:g})")
        self.update_ratios[partition] = ratio

    def start_arrays(self, partition: int) -> dict[str, np.ndarray]:
        """The arrays the client of `partition` started from this round (default: the global ones)."""
        if self._start is None:
            self._start = arrays_to_numpy(self.sent_arrays)
        return self._start

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
        self.failures, ok, answered = list(self.pending.values()), [], set()
        self.pending, self.update_ratios = {}, {}
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

    def aggregation_weights(self, replies: list[Message]) -> list[float]:
        """One weight per reply: its num-examples, or 1 with `aggregation-weights="uniform"`."""
        uniform = self.cfg["aggregation-weights"] == "uniform"
        return [1.0 if uniform else float(m.content["metrics"]["num-examples"]) for m in replies]

    def aggregate_arrays(self, server_round: int, replies: list[Message]) -> ArrayRecord:
        """Weighted mean of the uploaded arrays (`aggregation_weights`; `mean`)."""
        models = [arrays_to_numpy(m.content["arrays"]) for m in replies]
        return numpy_to_arrays(self.mean(models, self.aggregation_weights(replies)))

    # ------------------------------------------------------------------ robustness
    def mean(self, models: list[dict[str, np.ndarray]], weights: list[float]) -> dict[str, np.ndarray]:
        """The round's mean of per-client arrays: the weighted average, or with `robust-aggregation`
        the coordinate-wise median or trimmed mean, which weigh every client alike
        (`fedskew.strategies.aggregate.robust_mean`)."""
        return robust_mean(models, weights, self.cfg["robust-aggregation"], self.cfg["trim-fraction"])

    def pool(
        self, values: list[dict[str, np.ndarray]], origin: dict[str, np.ndarray] | None = None
    ) -> list[dict[str, np.ndarray]]:
        """What a server state sums over the round's clients (control variates, FedDyn's h, FedDC's
        drift): the values themselves, or with `robust-aggregation` one value that moves the state as
        |S| clients at the robust mean (`fedskew.strategies.aggregate.robust_pool`)."""
        return robust_pool(values, self.cfg["robust-aggregation"], self.cfg["trim-fraction"], origin)

    def update_records(self, content: RecordDict, partition: int) -> dict[str, dict[str, np.ndarray] | None]:
        """The reply records that are model updates, each with the arrays its update is measured from
        (None: the record holds the update itself); default: the uploaded arrays, from the arrays the
        client started from (`start_arrays`)."""
        return {"arrays": self.start_arrays(partition)}

    def bound_updates(self, server_round: int, replies: list[Message]) -> dict[str, float]:
        """Norm bounding against the round's majority (Sun et al., "Can You Really Backdoor Federated
        Learning?", 2019, Sec. 4), on the screened replies before any method sees them:

            Delta_i <- Delta_i min(1, M / ||Delta_i||),   M = `update-norm-bound` x median_j ||Delta_j||

        for every record of `update_records`, so that all a method builds from the uploads (its
        average, control variates, h, drift) moves by at most M per client: one client's share of an
        n-client mean is at most M / n. Clipped, not refused: an honest client whose update is long
        (more data, more steps, a stale control variate) keeps its direction, and a diverging run's
        spike is damped rather than lost. `max-update-ratio` cannot give this, its bound being
        relative to the model an attacker has already inflated. With two replies the median is their
        mean, which neither exceeds twice (one reply is its own median): no majority, no clip. Nothing
        is rewritten where nothing exceeds M (the round is then bit-identical to one without the
        bound). Each clip is logged; returns the round's `update-clipped` (replies) and
        `update-norm-ratio-max` (largest norm / median: what `benchmarks/update_norm.py` reads)."""
        pids = [int(m.content["metrics"]["partition-id"]) for m in replies]
        starts = [self.update_records(m.content, p) for m, p in zip(replies, pids, strict=True)]
        clipped: set[int] = set()
        largest = 0.0
        for name in starts[0] if starts else {}:
            uploads = [arrays_to_numpy(m.content[name]) for m in replies]
            norms = [update_norm(u, s[name]) for u, s in zip(uploads, starts, strict=True)]
            median = float(np.median(norms))
            largest = max(largest, max(norms) / median if median > 0 else 0.0)
            bound = norm_bound(norms, self.cfg["update-norm-bound"])
            for msg, pid, upload, start, norm in zip(replies, pids, uploads, starts, norms, strict=True):
                if norm <= bound:
                    continue
                msg.content[name] = numpy_to_arrays(clip_update(upload, start[name], bound))
                clipped.add(pid)
                log.warning(
                    "round %d: clipped the %s update of partition %d from %.4g to %.4g (update-norm-bound=%g x "
                    "the median %.4g)",
                    server_round,
                    name,
                    pid,
                    norm,
                    bound,
                    self.cfg["update-norm-bound"],
                    median,
                )
        return {"update-clipped": len(clipped), "update-norm-ratio-max": largest}

    def bound_statistics(
        self, server_round: int, what: str, rows: list[np.ndarray], active: list[np.ndarray], partitions: list[int]
    ) -> tuple[list[np.ndarray], int, float]:
        """The bound on uploaded class statistics: of each client's active rows (`rows[i]` [r, d],
        `active[i]` [r]: its prototypes of the classes it counts, its class gradients), those whose
        norm exceeds `statistic-norm-bound` times the median norm of every active row of the round are
        dropped, as if the client had not held that class. Dropped, not clipped: a statistic is a class
        mean the client measured, and a clipped one is a point nobody measured, pointing where its
        sender chose; the class is left to its other holders (or to its previous value). Honest
        statistics differ more than updates (a class's features can be 20-30 times the median norm, a
        class a client holds a few examples of is noisy), hence the larger multiple: it drops the
        orders-of-magnitude outlier (9.99e5 prototypes) and leaves any within it bit for bit. Returns
        each client's rows kept (`active` where nothing was dropped), how many were dropped and the
        round's largest norm / median (0 without a median)."""
        norms = [np.linalg.norm(np.asarray(r, np.float64), axis=-1) for r in rows]
        active_norms = np.concatenate([n[a] for n, a in zip(norms, active, strict=True)])
        if not active_norms.size:
            return active, 0, 0.0
        median = float(np.median(active_norms))
        bound = norm_bound(active_norms.tolist(), self.cfg["statistic-norm-bound"])
        kept, dropped = [], 0
        for n, a, pid in zip(norms, active, partitions, strict=True):
            over = a & (n > bound)
            kept.append(a & ~over if over.any() else a)
            if over.any():
                dropped += int(over.sum())
                log.warning(
                    "round %d: dropped %d %s rows of partition %d: norms up to %.4g > %.4g (statistic-norm-bound=%g "
                    "x the median %.4g)",
                    server_round,
                    int(over.sum()),
                    what,
                    pid,
                    float(n[over].max()),
                    bound,
                    self.cfg["statistic-norm-bound"],
                    median,
                )
        return kept, dropped, float(active_norms.max()) / median if median > 0 else 0.0

    def local_steps(self, reply: Message) -> int:
        """The local SGD steps K_i a screened reply's client took this round, computed here: from the
        size of its partition when the nodes serve partitions of the data set, else (nodes with their
        own data) from its num-examples, which `check_reply` bounds."""
        metrics = reply.content["metrics"]
        partition = int(metrics["partition-id"])
        if self.num_partitions:
            n = len(client_indices(self.cfg, self.num_partitions)[partition][0])
        else:
            n = int(metrics["num-examples"])
        return steps_per_round(n, self.cfg["local-epochs"], self.cfg["batch-size"])

    def num_clients(self) -> int:
        """N, the number of clients of the federation: the partitions, or the nodes accepted so far
        when they hold their own data."""
        return self.num_partitions or max(len(self.node_partitions), 1)

    def aggregate_extras(self, server_round: int, replies: list[Message]) -> dict[str, float]:
        """Handle extra reply records (prototypes, gradients ...); return the metrics the server
        computes. The declared client metrics it leaves out are logged as client means
        (`declared_means`)."""
        return {}

    def declared_means(self, replies: list[Message]) -> dict[str, float]:
        """The unweighted client mean of each metric the method's wire declares that some reply
        holds, in the wire's order."""
        out = {}
        for key in self.wire.metrics:
            vals = [float(m.content["metrics"][key]) for m in replies if key in m.content["metrics"]]
            if vals:
                out[key] = float(np.mean(vals))
        return out

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord]:
        """Screen, sort and aggregate one round's replies against the arrays sent this round.

        Returns the new global arrays (None when no reply is usable) and the round's metrics.
        """
        ok = self.accept(server_round, replies)
        metrics: dict[str, Any] = {"replies": len(ok), "failures": len(self.failures)}
        if not ok:
            return None, MetricRecord(metrics)
        t0 = time.perf_counter()
        bounded = self.bound_updates(server_round, ok)
        new = self.aggregate_arrays(server_round, ok)
        metrics.update(self.aggregate_extras(server_round, ok))
        metrics.update({k: v for k, v in self.declared_means(ok).items() if k not in metrics})
        metrics["server-seconds"] = time.perf_counter() - t0
        metrics.update(self.client_metrics(ok))
        ratios = [self.update_ratios[m.content["metrics"]["partition-id"]] for m in ok]
        metrics["update-ratio-max"] = max(ratios)  # the evidence that max-update-ratio drops no honest reply
        metrics.update(bounded)  # and that update-norm-bound clips none
        return new, MetricRecord(metrics)

    @staticmethod
    def client_metrics(replies: list[Message]) -> dict[str, Any]:
        """Personalized accuracy and client-global accuracy (each the unweighted mean and std over
        clients of a per-client test accuracy), the personalized accuracy pooled (the clients' correct
        answers over their test samples: each accuracy weighted by its `personal-num-test`, as PFLlib
        and many pFL papers report it), with `personalized-central-eval` the personalized models'
        accuracy on the classes their clients hold and lack (over the clients that reported it),
        training loss and times."""
        ms = [m.content["metrics"] for m in replies]
        out: dict[str, Any] = {}
        for client_key, key in (
            ("personal-accuracy", "personalized-accuracy"),
            ("client-global-accuracy", "client-global-accuracy"),
        ):
            out[key], out[f"{key}-std"] = summarize_clients([float(m[client_key]) for m in ms if client_key in m])
        out["personalized-pooled-accuracy"] = pooled_accuracy(
            [
                (float(m["personal-accuracy"]), float(m.get("personal-num-test", 0)))
                for m in ms
                if "personal-accuracy" in m
            ]
        )
        for client_key in CENTRAL_EVAL_METRICS:
            values = [float(m[client_key]) for m in ms if client_key in m]
            if values:
                key = client_key.replace("personal-", "personalized-")
                out[key], out[f"{key}-std"] = summarize_clients(values)
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
