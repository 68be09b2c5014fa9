"""The server side that FedMR and FedProto share: global class prototypes as server state.

A prototype method holds the global prototypes G [C, d] and which classes have one (`valid` [C]),
sends both in its `record` (`fedskew.wire.global_prototypes`), screens the clients' uploads
(`fedskew.wire.local_prototypes`: per-class mean features and the counts behind them) and keeps
G and `valid` in its checkpoint. The aggregation rule itself is the method's (`aggregate_extras`).
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch
from flwr.app import Message, RecordDict

from fedskew.records import Rejected
from fedskew.strategies.base import BaseStrategy, numpy_to_arrays


class PrototypeStrategy(BaseStrategy):
    """Holds, broadcasts, screens and checkpoints global class prototypes; subclasses set `record`."""

    record: ClassVar[str]  # the name of the prototype records, both ways

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
        return {self.record: numpy_to_arrays({"prototypes": self.prototypes, "valid": self.valid})}

    def check_reply(self, content: RecordDict, partition: int) -> None:
        """The base's rules, and the prototype counts sum to at most the reply's `num-examples`."""
        super().check_reply(content, partition)
        counts, n = content[self.record]["counts"].numpy(), content["metrics"]["num-examples"]
        total = counts.sum(dtype=np.float64)  # int64 would wrap around for hostile counts
        if total > n:
            raise Rejected(f"prototype counts sum to {total:.0f} > num-examples {n}")

    def uploads(self, replies: list[Message]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """The replies' prototypes [C, d] and counts [C] (float64), in reply order."""
        protos = [m.content[self.record]["prototypes"].numpy() for m in replies]
        counts = [m.content[self.record]["counts"].numpy().astype(np.float64) for m in replies]
        return protos, counts
