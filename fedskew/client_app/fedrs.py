"""FedRS client (Li & Zhan, KDD'21): local training with the restricted softmax.

Each missing class's logit is scaled by `fedrs-alpha` (binary rule of the paper by default;
`fedrs-scale="count"` gives the authors' count-proportional code rule). The scale comes from the
client's whole local training set once per round, when the server's message is received (never per
batch, where it would compound over the batches) and never leaves the client. Upload, aggregation and evaluation are
FedAvg's. The loss is written once, as `example_losses` (the base derives `loss` and the batched
engine's `functional_loss`); the batched engine stacks its clients, each with its own scale
(`batch_extras`).
"""

from __future__ import annotations

from typing import Any

import torch
from flwr.app import RecordDict

from fedskew.client_app.base import BaseTrainer
from fedskew.losses import fedrs_scale, restricted_softmax_cross_entropy


class FedRSTrainer(BaseTrainer):
    """Cross-entropy on `(h W^T) * s`, with s_c = 1 for observed classes and alpha for missing.

    `rs_prefix` names the run-config keys `<prefix>-alpha`, `<prefix>-tau`, `<prefix>-scale`, so a
    method that reuses the restricted softmax (MAP) subclasses this trainer with its own keys.
    """

    rs_prefix = "fedrs"
    batched = True

    def receive(self, content: RecordDict) -> dict[str, Any]:
        received = super().receive(content)
        p, counts = self.rs_prefix, self.data.train_counts
        scale = fedrs_scale(counts, self.cfg[f"{p}-alpha"], self.cfg[f"{p}-tau"], self.cfg[f"{p}-scale"])
        self.scale = scale.to(self.device)
        return received

    def train_metrics(self) -> dict[str, float]:
        observed = (self.data.train_counts >= self.cfg[f"{self.rs_prefix}-tau"]).sum()
        return {**super().train_metrics(), "observed-classes": float(observed)}

    def batch_extras(self) -> dict[str, torch.Tensor]:
        return {"scale": self.scale}

    def example_losses(
        self, logits: torch.Tensor, y: torch.Tensor, extras: dict[str, torch.Tensor], reduction: str = "none"
    ) -> torch.Tensor:
        return restricted_softmax_cross_entropy(logits, y, extras["scale"], reduction)
