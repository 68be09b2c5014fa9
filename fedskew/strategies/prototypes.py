"""The server side that methods with global class prototypes share (FedMR, FedProc, FedProto).

Clients upload their per-class mean features g_k^c and counts N_k^c (`fedskew.wire.prototype_uplink`);
the server keeps global prototypes G [C, d] and which classes have one (`valid` [C]), merged from
each round's uploads (`merge_prototypes`; by default count-weighted,

    g_c = sum_k (N_k^c / sum_k' N_k'^c) g_k^c      (`fedskew.losses.fedmr.aggregate_prototypes`)

for every class some reply held this round; a class no reply held keeps its previous prototype, a
class never held stays invalid). The prototypes and their validity mask go to every sampled client
(`fedskew.wire.prototype_downlink`) and into checkpoints. On top of the records' declared form, a
reply whose counts sum to more than its `num-examples`, or (where the server knows the partitions)
exceed its partition's training count of some class, is refused.

Robustness: an uploaded prototype (of a class the client counts) whose norm exceeds
`statistic-norm-bound` times the round's median prototype norm is dropped: it weighs 0, as if the
client had not held the class this round (`BaseStrategy.bound_statistics`; a prototype of 9.99e5
per entry, within the value bound, pulled every client's features of its class towards it). With
`robust-aggregation` a class's prototype is the rule's coordinate-wise mean over its holders
(`class_robust_mean`), not the count-weighted one.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch
from flwr.app import Message, RecordDict

from fedskew.losses.fedmr import aggregate_prototypes
from fedskew.records import Rejected
from fedskew.strategies.aggregate import class_robust_mean
from fedskew.strategies.base import BaseStrategy, numpy_to_arrays


class PrototypeStrategy(BaseStrategy):
    """Holds, broadcasts, screens, merges and checkpoints global class prototypes; subclasses set
    `prototype_record` and may change the merge rule (`merge_prototypes`)."""

    prototype_record: ClassVar[str]  # the name of the prototype record, up and down

    def __init__(self, cfg: dict[str, Any], device: torch.device | None = None) -> None:
        super().__init__(cfg, device)
        self.num_classes, self.feature_dim = self.dims.num_classes, self.dims.feature_dim
        self.prototypes = np.zeros((self.num_classes, self.feature_dim), dtype=np.float32)
        self.valid = np.zeros(self.num_classes, dtype=bool)

    def state_dict(self) -> dict[str, Any]:
        """The global prototypes and which classes have one (for checkpoints)."""
        return {"prototypes": torch.from_numpy(self.prototypes.copy()), "valid": torch.from_numpy(self.valid.copy())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prototypes = state["prototypes"].numpy().astype(np.float32)
        self.valid = state["valid"].numpy().astype(bool)

    def broadcast(self, server_round: int) -> dict[str, Any]:
        return {self.prototype_record: numpy_to_arrays({"prototypes": self.prototypes, "valid": self.valid})}

    def check_reply(self, content: RecordDict, partition: int) -> None:
        """The base's rules, and the prototype counts sum to at most the reply's `num-examples` and,
        where the server knows the partitions, none exceeds the partition's count of its class."""
        super().check_reply(content, partition)
        counts, n = content[self.prototype_record]["counts"].numpy(), content["metrics"]["num-examples"]
        total = counts.sum(dtype=np.float64)  # int64 would wrap around for hostile counts
        if total > n:
            raise Rejected(f"prototype counts sum to {total:.0f} > num-examples {n}")
        held = self.partition_class_counts(partition)
        if held is not None and (counts > held).any():
            raise Rejected(f"prototype counts {counts.tolist()} exceed partition {partition}'s {held.tolist()}")

    def uploads(self, replies: list[Message]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """The replies' prototypes [C, d] and counts [C] (float64), in reply order."""
        protos = [m.content[self.prototype_record]["prototypes"].numpy() for m in replies]
        counts = [m.content[self.prototype_record]["counts"].numpy().astype(np.float64) for m in replies]
        return protos, counts

    def merge_prototypes(self, protos: list[np.ndarray], counts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """The new (prototypes, valid) from this round's uploads (default: count-weighted)."""
        return aggregate_prototypes(protos, counts, self.prototypes, self.valid)

    def robust_merge(self, protos: list[np.ndarray], counts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """With `robust-aggregation`: each class some reply counts takes the rule's coordinate-wise
        mean of its holders' prototypes; the others keep theirs (as `merge_prototypes`)."""
        uploads = [{c: p[c] for c in np.flatnonzero(n > 0)} for p, n in zip(protos, counts, strict=True)]
        means = class_robust_mean(uploads, self.cfg["robust-aggregation"], self.cfg["trim-fraction"])
        out, valid = self.prototypes.copy(), self.valid.copy()
        for c, v in means.items():
            out[c], valid[c] = v.astype(np.float32), True
        return out, valid

    def aggregate_extras(self, server_round: int, replies: list[Message]) -> dict[str, float]:
        protos, counts = self.uploads(replies)
        pids = [int(m.content["metrics"]["partition-id"]) for m in replies]
        kept, dropped, ratio = self.bound_statistics(server_round, "prototype", protos, [n > 0 for n in counts], pids)
        counts = [np.where(keep, n, 0.0) for n, keep in zip(counts, kept, strict=True)]  # a dropped row weighs 0
        bounded = {"prototype-dropped": dropped, "prototype-norm-ratio-max": ratio}
        updated = int((np.stack(counts).sum(0) > 0).sum())
        merge = self.merge_prototypes if self.cfg["robust-aggregation"] == "none" else self.robust_merge
        self.prototypes, self.valid = merge(protos, counts)
        return {
            "prototype-classes": int(self.valid.sum()),
            "prototype-classes-updated": updated,
            **bounded,
            **super().aggregate_extras(server_round, replies),
        }
