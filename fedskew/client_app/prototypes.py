"""The client side that methods with global class prototypes share (FedMR, FedProc, FedProto).

The global prototypes G [C, d] and their validity mask [C] arrive in the method's prototype record
(`fedskew.wire.prototype_downlink`; absent or all-invalid in round 1) and stay fixed (no gradient)
during local training. After local training the client computes its per-class prototypes g_k^c, the
mean feature z = f1(x) (the classifier's input) over its whole local training set with the final
local model (eval mode, no augmentation), and the counts N_k^c, inside the timed part of the round,
and uploads them {prototypes [C, d] float32, counts [C] int64} (`fedskew.wire.prototype_uplink`),
zero rows for the classes it does not hold or does not report (`hidden_classes`).

On the batched engine the global prototypes are each client's `batch_extras` ("prototypes",
"valid"), read by the method's `feature_loss`; the local prototypes are computed per client in
`after_steps`, from its model holding its slice of the stacked one (the per-client path's code).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from flwr.app import ArrayRecord, RecordDict
from torch import nn

from fedskew.client_app.base import BaseTrainer
from fedskew.losses.fedmr import class_prototypes
from fedskew.training import extract_features


class PrototypeTrainer(BaseTrainer):
    """Local training with the server's prototypes at hand; uploads the local prototypes."""

    prototype_record: ClassVar[str]  # the name of the prototype record, up and down

    def load_global(self, model: nn.Module, content: RecordDict) -> None:
        super().load_global(model, content)
        self.receive_prototypes(model)

    def receive_prototypes(self, model: nn.Module) -> None:
        """The global prototypes G and their validity mask (none valid without the record)."""
        c, d = model.num_classes, model.feature_dim
        none = {"prototypes": torch.zeros(c, d, dtype=self.dtype), "valid": torch.zeros(c, dtype=torch.bool)}
        rec = self.received.get(self.prototype_record, none)
        self.prototypes = rec["prototypes"].to(self.device)
        self.valid = rec["valid"].to(self.device)

    def batch_extras(self) -> dict[str, torch.Tensor]:
        return {"prototypes": self.prototypes, "valid": self.valid}

    def after_steps(self, model: nn.Module, stats: dict[str, float]) -> dict[str, float]:
        stats = super().after_steps(model, stats)
        self.local_prototypes, self.local_counts = self.compute_prototypes(model)
        return stats

    def compute_prototypes(self, model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """g_k^c and N_k^c over the whole local training set with the final local model (eval mode)."""
        z = extract_features(model, self.data.x_train, self.cfg["eval-batch-size"], self.device)
        return class_prototypes(z, self.data.y_train.to(self.device), model.num_classes)

    def hidden_classes(self) -> list[int]:
        """Classes whose prototype and count are not uploaded (none by default)."""
        return []

    def extra_records(self, model: nn.Module) -> dict[str, Any]:
        protos, counts = self.local_prototypes.float().cpu().clone(), self.local_counts.to(torch.int64).cpu().clone()
        hidden = self.hidden_classes()
        protos[hidden] = 0.0
        counts[hidden] = 0
        return {self.prototype_record: ArrayRecord({"prototypes": protos, "counts": counts})}
