"""The server side that methods with global class prototypes share (FedMR, FedProc).

Clients upload their per-class mean features g_k^c and counts N_k^c (`fedskew.wire.prototype_uplink`);
the server keeps the global prototypes

    g_c = sum_k (N_k^c / sum_k' N_k'^c) g_k^c      (count-weighted, `fedskew.losses.fedmr.aggregate_prototypes`)

for every class some reply held this round; a class no reply held keeps its previous prototype, a
class never held stays invalid. The prototypes and their validity mask go to every sampled client
(`fedskew.wire.prototype_downlink`) and into checkpoints. On top of the records' declared form, a
reply whose counts sum to more than its `num-examples` is refused.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch
from flwr.app import Message, RecordDict

from fedskew.losses.fedmr import aggregate_prototypes
from fedskew.records import Rejected
from fedskew.strategies.base import BaseStrategy, numpy_to_arrays


class PrototypeStrategy(BaseStrategy):
    """FedAvg model aggregation plus the count-weighted global class prototypes."""

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
        super().check_reply(content, partition)
        counts, n = content[self.prototype_record]["counts"].numpy(), content["metrics"]["num-examples"]
        total = counts.sum(dtype=np.float64)  # int64 would wrap around for hostile counts
        if total > n:
            raise Rejected(f"prototype counts sum to {total:.0f} > num-examples {n}")

    def aggregate_extras(self, server_round: int, replies: list[Message]) -> dict[str, float]:
        protos = [m.content[self.prototype_record]["prototypes"].numpy() for m in replies]
        counts = [m.content[self.prototype_record]["counts"].numpy().astype(np.float64) for m in replies]
        updated = int((np.stack(counts).sum(0) > 0).sum())
        self.prototypes, self.valid = aggregate_prototypes(protos, counts, self.prototypes, self.valid)
        return {
            "prototype-classes": int(self.valid.sum()),
            "prototype-classes-updated": updated,
            **super().aggregate_extras(server_round, replies),
        }
