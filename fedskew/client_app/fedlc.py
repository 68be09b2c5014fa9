"""FedLC client (Zhang et al., "Federated Learning with Label Distribution Skew via Logits
Calibration", ICML'22): local training on the cross-entropy of the calibrated logits
f_y(x) - tau * n_{k,y}^{-1/4} (`fedskew/losses/fedlc.py`, with the decisions on the denominator, the
missing classes and tau), n_{k,y} this client's training counts, computed once per round from the
whole local training set when the server's message is received; they never leave the client.
Upload, aggregation, evaluation and the personalized model (the trained model, raw logits) are
FedAvg's: the server is `FedAvgStrategy`. The loss is written once, as `example_losses` (the base
derives `loss` and the batched engine's `functional_loss`); the batched engine stacks its clients,
each with its own offsets (`batch_extras`).
"""

from __future__ import annotations

from typing import Any

import torch
from flwr.app import RecordDict

from fedskew.client_app.base import BaseTrainer
from fedskew.losses.fedlc import calibrated_cross_entropy, calibration


class FedLCTrainer(BaseTrainer):
    """Cross-entropy on logits shifted by tau * n_y^{-1/4} per class."""

    batched = True

    def receive(self, content: RecordDict) -> dict[str, Any]:
        received = super().receive(content)
        counts = torch.from_numpy(self.data.train_counts)
        self.offsets = calibration(counts, self.cfg["fedlc-tau"]).to(self.device)
        return received

    def batch_extras(self) -> dict[str, torch.Tensor]:
        return {"offsets": self.offsets}

    def example_losses(
        self, logits: torch.Tensor, y: torch.Tensor, extras: dict[str, torch.Tensor], reduction: str = "none"
    ) -> torch.Tensor:
        return calibrated_cross_entropy(logits, y, extras["offsets"], reduction)
