"""FedRS client (Li & Zhan, KDD'21): local training with the restricted softmax.

Each missing class's logit is scaled by `fedrs-alpha` (binary rule of the paper by default;
`fedrs-scale="count"` gives the authors' count-proportional code rule). The scale comes from the
client's whole local training set once per round (never per batch: the A7 compounding bug) and
never leaves the client. Upload, aggregation and evaluation are FedAvg's.
"""

from __future__ import annotations

import torch
from flwr.app import RecordDict
from torch import nn

from fedskew import wire
from fedskew.client_app.base import BaseTrainer
from fedskew.losses import fedrs_scale, restricted_softmax_cross_entropy


class FedRSTrainer(BaseTrainer):
    """Cross-entropy on `(h W^T) * s`, with s_c = 1 for observed classes and alpha for missing.

    `rs_prefix` names the run-config keys `<prefix>-alpha`, `<prefix>-tau`, `<prefix>-scale`, so a
    method that reuses the restricted softmax (MAP) subclasses this trainer with its own keys.
    """

    wire = wire.FEDRS
    rs_prefix = "fedrs"

    def local_train(self, model: nn.Module, content: RecordDict) -> dict[str, float]:
        p, tau = self.rs_prefix, self.cfg[f"{self.rs_prefix}-tau"]
        self.scale = fedrs_scale(self.data.train_counts, self.cfg[f"{p}-alpha"], tau, self.cfg[f"{p}-scale"])
        self.scale = self.scale.to(self.device)
        stats = super().local_train(model, content)
        return {**stats, "observed-classes": float((self.data.train_counts >= tau).sum())}

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return restricted_softmax_cross_entropy(model(x), y, self.scale)
