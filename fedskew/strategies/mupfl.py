"""MuPFL server (Zhang et al., "Multi-level Personalized Federated Learning on Heterogeneous and
Long-Tailed Data", Alg. 1): ACMU + PKCF. The paper has no public code; each decision below, its
source and the runs that chose the defaults are in `docs/notes/mupfl.md` ("Implementation
decisions").

Client side: `fedskew/client_app/mupfl.py`; maths: `fedskew/losses/mupfl.py` (BAVD, PKCF) and
`fedskew/strategies/clustering.py` (ACMU). The paper's three tiers (client / edge "interface" /
cloud) run as the client trainer and this one strategy.

Round t on the server:
1. each sampled client gets its start (`mupfl-init`): the global model w_glo ("global", default;
   Sec. 3.4-3.5, Table I's "FedAvg with clustering"), its own w~_i ("personal", Alg. 1 L6 read
   literally) or w~_i's feature extractor with the global classifier ("cluster", Sec. 3.5's
   (u_i, v_glo)); w_glo on a first participation. "personal" and "cluster" keep every w~_i on the
   server (N models) and send w_glo beside the start (`mupfl-global`). With PKCF also the classifier
   of the global model sent this round (`mupfl-classifier`: clients take z_i^k at it, the synthesis
   matches at it, as CReFF) and the synthetic features h_glo of the classes seen so far;
2. ACMU (`mupfl-acmu`): dw_i = w_i - start_i over the trainable parameters (Eq. 7); clients are
   clustered on Eq. 8's similarity (update cosine and BAVD-map cosine, weight `mupfl-alpha`; update
   cosine only with BAVD off) with k-means, kappa in [k-min, min(k-max, n-1)] by silhouette
   (Eqs. 9-13); w~_i = start_i + mean dw of i's cluster (Eq. 14). ACMU off = one cluster. BN
   buffers are the client's own;
3. w_glo = sum_i n_i/n w~_i over the sampled clients (Eq. 15; `aggregation-weights` applies);
4. PKCF (`mupfl-pkcf`): z^k_glo = mean of the uploaded z_i^k over the clients holding class k
   (Eq. 17; a z_i^k beyond `statistic-norm-bound` x the round's median is dropped: `class_targets`);
   h_glo (K x m x d) is optimised on `self.device` so that the gradients of the classifier sent this
   round on it match z^k_glo (Eqs. 18-20; `mupfl-distance`, `mupfl-feature-init`, warm-started,
   `mupfl-match-iters` = 100 SGD steps at `mupfl-feature-lr` = 1.0: CReFF's code); it is sent next
   round. PKCF also runs after the last round, so every round is timed.
ACMU and PKCF are timed each round (metrics `acmu-seconds`, `pkcf-seconds`; CUDA synchronised).

Other decisions: m = 20 features per class and tau = 30 fine-tune epochs (Sec. 4.5's fixed values);
the classifier is bias-free (SplitNet), so z_i^k is the K x d weight gradient; the local optimiser
is the common `sgd` (the paper: plain SGD), so MuPFL and FedAvg differ only by MuPFL's modules.
Metrics: `personal-accuracy` is the trained w_i on the client's test split, `client-global-accuracy`
w_glo before training, `start-accuracy` ("personal", "cluster") the start the client received.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from fedskew.data import dataset_info
from fedskew.losses.mupfl import aggregate_class_gradients, feature_norm, initial_features, synthesize_features
from fedskew.methods.mupfl import MUPFL_CLASSIFIER as CLASSIFIER
from fedskew.methods.mupfl import MUPFL_FEATURES as FEATURES
from fedskew.methods.mupfl import MUPFL_GLOBAL as GLOBAL
from fedskew.methods.mupfl import MUPFL_GRADS as GRADS
from fedskew.methods.mupfl import MUPFL_MAPS as MAPS
from fedskew.methods.mupfl import MUPFL_TIMES as TIMES
from fedskew.strategies.aggregate import class_robust_mean
from fedskew.strategies.base import BaseStrategy, arrays_to_numpy, numpy_to_arrays
from fedskew.strategies.clustering import cluster_update, select_clusters
from fedskew.training import torch_threads

log = logging.getLogger("fedskew.server")


def class_uploads(replies: list[Message], record: str) -> list[dict[int, torch.Tensor]]:
    """Every reply's {class: z_i^k} from its `record` (screened: class ids, shapes and values are
    valid; a reply without it uploaded none)."""
    return [
        {int(k): torch.from_numpy(a.numpy().copy()) for k, a in m.content[record].items()}
        if record in m.content
        else {}
        for m in replies
    ]


def class_targets(
    strategy: BaseStrategy, server_round: int, replies: list[Message], record: str
) -> tuple[dict[int, torch.Tensor], dict[str, float]]:
    """z^k_glo of every class some reply holds (Eq. 17, `aggregate_class_gradients`; CReFF's rule
    too), from the uploads of `record` less each z_i^k beyond `statistic-norm-bound` times the round's
    median norm (`BaseStrategy.bound_statistics`); with `robust-aggregation` the rule's
    coordinate-wise mean over the holders of k. Returns the targets and the bound's metrics."""
    uploads = class_uploads(replies, record)
    rows = [np.stack([z.flatten().numpy() for z in u.values()]) if u else np.zeros((0, 1)) for u in uploads]
    pids = [int(m.content["metrics"]["partition-id"]) for m in replies]
    active = [np.ones(len(r), bool) for r in rows]
    kept, dropped, ratio = strategy.bound_statistics(server_round, "class-gradient", rows, active, pids)
    uploads = [
        u if keep.all() else {k: z for (k, z), ok in zip(u.items(), keep, strict=True) if ok}
        for u, keep in zip(uploads, kept, strict=True)
    ]
    metrics = {"class-gradient-dropped": dropped, "class-gradient-norm-ratio-max": ratio}
    rule = strategy.cfg["robust-aggregation"]
    if rule == "none":
        return aggregate_class_gradients(uploads), metrics
    numpy_uploads = [{k: z.numpy() for k, z in u.items()} for u in uploads]
    means = class_robust_mean(numpy_uploads, rule, strategy.cfg["trim-fraction"])
    return {k: torch.from_numpy(v.astype(np.float32)) for k, v in means.items()}, metrics


class MuPFLStrategy(BaseStrategy):
    """Per-client start models, ACMU cluster updates and PKCF feature synthesis."""

    def __init__(self, cfg: dict[str, Any], device: torch.device | None = None) -> None:
        super().__init__(cfg, device)
        model = self.build_model()
        self.trainable = [name for name, _ in model.named_parameters()]
        self.num_classes, self.feature_dim = model.num_classes, model.feature_dim
        self.personal: dict[int, dict[str, np.ndarray]] = {}  # w~_i by partition id (init "personal")
        self.bases: dict[int, dict[str, np.ndarray]] = {}  # start models sent this round
        self.features: torch.Tensor | None = None  # h_glo (K, m, d) on self.device
        self.seen: set[int] = set()
        self.global_arrays: dict[str, np.ndarray] = {}
        self.acmu_metrics: dict[str, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        """Personalized start models, synthetic features and seen classes (for checkpoints)."""
        state: dict[str, Any] = {"seen": torch.tensor(sorted(self.seen), dtype=torch.long)}
        if self.features is not None:
            state["features"] = self.features.detach().cpu()
        for pid, arrays in self.personal.items():
            for name, value in arrays.items():
                state[f"personal/{pid}/{name}"] = torch.from_numpy(np.ascontiguousarray(value))
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = {int(k) for k in state["seen"].tolist()}
        self.features = state["features"].to(self.device) if "features" in state else None
        self.personal = {}
        for key, value in state.items():
            if key.startswith("personal/"):
                _, pid, name = key.split("/", 2)
                self.personal.setdefault(int(pid), {})[name] = value.numpy()

    def initial_features(self, real_norm: float) -> torch.Tensor:
        """h_glo's start, on `self.device` (`mupfl-feature-init`, `initial_features`): the extractor
        is the global model's sent this round (the one whose classifier the synthesis matches at)."""
        g = torch.Generator().manual_seed(self.cfg["seed"])
        shape = (self.num_classes, self.cfg["mupfl-features-per-class"], self.feature_dim)
        init = self.cfg["mupfl-feature-init"]
        extractor = None
        if init == "extractor":
            model = self.build_model()
            model.load_state_dict(self.sent_arrays.to_torch_state_dict())
            extractor = model.features.to(self.device)
        info = dataset_info(self.cfg)
        with torch_threads(self.device, self.cfg["torch-threads"]):
            h = initial_features(init, shape, g, extractor, (info.channels, info.size, info.size), real_norm)
        return h.to(self.device)

    # ------------------------------------------------------------------ downlink
    def match_classifier(self) -> torch.Tensor:
        """The classifier of the global model sent this round: clients take z_i^k at it, and the
        synthesis matches its gradients at it (one classifier on both sides, as CReFF)."""
        return torch.from_numpy(self.sent_arrays["classifier.weight"].numpy().copy())

    def broadcast(self, server_round: int) -> dict[str, Any]:
        """w_glo when clients start from w~_i (for `client-global-accuracy`); PKCF: the matching
        classifier, and the synthetic features of the classes seen so far."""
        records: dict[str, Any] = {GLOBAL: self.sent_arrays} if self.cfg["mupfl-init"] != "global" else {}
        if not self.cfg["mupfl-pkcf"]:
            return records
        records[CLASSIFIER] = ArrayRecord({"weight": self.match_classifier()})
        if self.features is not None and self.seen:
            ks = sorted(self.seen)
            m = self.features.shape[1]
            feats = self.features[ks].reshape(-1, self.feature_dim).cpu()
            labels = torch.tensor(ks, dtype=torch.long).repeat_interleave(m)
            records[FEATURES] = ArrayRecord({"features": feats, "labels": labels})
        return records

    def start_model(self, partition_id: int, arrays: ArrayRecord) -> dict[str, np.ndarray]:
        """A returning client's own start: its w~_i (init 'personal'), or its feature extractor from
        w~_i with the global classifier (init 'cluster'); else (a first participation, init 'global')
        the global model."""
        init = self.cfg["mupfl-init"]
        glo = arrays_to_numpy(arrays)
        if init == "global" or partition_id not in self.personal:
            return glo
        own = self.personal[partition_id]
        if init == "personal":
            return own
        return {k: glo[k] if k.startswith("classifier.") else own[k] for k in glo}

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """FedAvg's messages, each with the node's own start model instead of the global one."""
        self.bases, out = {}, []
        for msg in super().configure_train(server_round, arrays, config, grid):
            node = msg.metadata.dst_node_id
            pid = self.node_partitions[node]
            self.bases[pid] = self.start_model(pid, arrays)
            content = RecordDict({**dict(msg.content.items()), "arrays": numpy_to_arrays(self.bases[pid])})
            out.append(Message(content=content, message_type=msg.metadata.message_type, dst_node_id=node))
        self.sent_messages = out  # what lost-node detection matches replies against
        return out

    # ------------------------------------------------------------------ uplink
    def start_arrays(self, partition: int) -> dict[str, np.ndarray]:
        """The start model sent to `partition` this round (w~_i under init "personal")."""
        return self.bases[partition] if partition in self.bases else super().start_arrays(partition)

    def flat(self, arrays: dict[str, np.ndarray]) -> np.ndarray:
        return np.concatenate([np.asarray(arrays[k], dtype=np.float64).ravel() for k in self.trainable])

    def unflat(self, vector: np.ndarray, like: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """`like` with its trainable tensors replaced by the slices of `vector`."""
        out, i = dict(like), 0
        for k in self.trainable:
            n = like[k].size
            out[k] = vector[i : i + n].reshape(like[k].shape).astype(like[k].dtype)
            i += n
        return out

    def client_maps(self, replies: list[Message]) -> np.ndarray | None:
        """The BAVD maps of all replies as rows, or None (BAVD off, or a reply lacks / differs)."""
        if not self.cfg["mupfl-bavd"]:
            return None
        rows = []
        for msg in replies:
            rec = msg.content.get(MAPS)
            if not isinstance(rec, ArrayRecord) or "map" not in rec:
                return None
            rows.append(rec["map"].numpy().astype(np.float64).ravel())
        if not rows or len({r.size for r in rows}) != 1 or rows[0].size == 0 or not np.isfinite(rows).all():
            return None
        return np.stack(rows)

    def aggregate_arrays(self, server_round: int, replies: list[Message]) -> ArrayRecord:
        """ACMU (Eqs. 7-14) then Eq. 15; stores every sampled client's w~_i."""
        t0 = time.perf_counter()
        pids = [int(m.content["metrics"]["partition-id"]) for m in replies]
        models = [arrays_to_numpy(m.content["arrays"]) for m in replies]
        bases = [self.flat(self.bases.get(p, self.global_arrays or models[i])) for i, p in enumerate(pids)]
        updates = np.stack([self.flat(w) - b for w, b in zip(models, bases, strict=True)])
        if self.cfg["mupfl-acmu"]:
            rng = np.random.default_rng([self.cfg["seed"], server_round, 6])
            labels, kappa, score = select_clusters(
                updates,
                self.client_maps(replies),
                self.cfg["mupfl-alpha"],
                self.cfg["mupfl-k-min"],
                self.cfg["mupfl-k-max"],
                rng,
            )
        else:
            labels, kappa, score = np.zeros(len(replies), dtype=int), 1, float("nan")
        personal = [self.unflat(v, w) for v, w in zip(cluster_update(bases, updates, labels), models, strict=True)]
        if self.cfg["mupfl-init"] != "global":  # the next start models (N models kept on the server)
            self.personal.update(zip(pids, personal, strict=True))
        uniform = self.cfg["aggregation-weights"] == "uniform"
        weights = [1.0 if uniform else float(m.content["metrics"]["num-examples"]) for m in replies]
        self.global_arrays = self.mean(personal, weights)
        self.acmu_metrics = {
            "acmu-seconds": time.perf_counter() - t0,
            "acmu-kappa": int(kappa),
            "acmu-clusters": [int(c) for c in labels],
        }
        if np.isfinite(score):
            self.acmu_metrics["acmu-silhouette"] = float(score)
        return numpy_to_arrays(self.global_arrays)

    def aggregate_extras(self, server_round: int, replies: list[Message]) -> dict[str, Any]:
        """PKCF server part (Eqs. 17-20) on `self.device`; ACMU and PKCF metrics."""
        metrics: dict[str, Any] = dict(self.acmu_metrics)
        grads = [float(m.content[TIMES]["grads-seconds"]) for m in replies if TIMES in m.content]
        if grads:
            metrics["pkcf-grads-seconds"] = float(np.mean(grads))
        norms = [float(m.content[TIMES]["real-norm"]) for m in replies if TIMES in m.content]
        real_norm = float(np.median(norms)) if norms else float("nan")  # the median: one client cannot set it
        if norms:
            metrics["pkcf-real-norm"] = real_norm
        if not self.cfg["mupfl-pkcf"]:
            return metrics
        t0 = time.perf_counter()
        targets, bounded = class_targets(self, server_round, replies, GRADS)
        metrics.update(bounded)
        targets = {k: z.to(self.device) for k, z in targets.items()}
        if targets:
            if self.features is None:
                self.features = self.initial_features(real_norm)
                metrics["pkcf-initial-norm"] = feature_norm(self.features)
            weight = self.match_classifier()
            with torch_threads(self.device, self.cfg["torch-threads"]):
                self.features, losses = synthesize_features(
                    self.features,
                    weight.to(self.device),
                    targets,
                    self.cfg["mupfl-feature-lr"],
                    self.cfg["mupfl-match-iters"],
                    self.cfg["mupfl-distance"],
                )
            self.seen |= set(targets)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            if losses:
                metrics.update({"pkcf-match-loss-first": losses[0], "pkcf-match-loss-last": losses[-1]})
            metrics["pkcf-synthetic-norm"] = feature_norm(self.features[sorted(self.seen)])
        metrics["pkcf-seconds"] = time.perf_counter() - t0
        metrics["pkcf-classes"] = len(targets)
        return metrics
