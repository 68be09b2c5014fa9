"""FedLC client (Zhang et al., "Federated Learning with Label Distribution Skew via Logits
Calibration", ICML'22): local training on the cross-entropy of the calibrated logits
f_y(x) - tau * n_{k,y}^{-1/4} (`fedskew/losses/fedlc.py`, with the decisions on the denominator, the
missing classes and tau), n_{k,y} this client's training counts, computed once per round from the
whole local training set; they never leave the client. Upload, aggregation, evaluation and the
personalized model (the trained model, raw logits) are FedAvg's: the server is `FedAvgStrategy`.
"""

from __future__ import annotations

import torch
from flwr.app import RecordDict
from torch import nn

from fedskew.client_app.base import BaseTrainer
from fedskew.losses.fedlc import calibrated_cross_entropy, calibration


class FedLCTrainer(BaseTrainer):
    """Cross-entropy on logits shifted by tau * n_y^{-1/4} per class."""

    def local_train(self, model: nn.Module, content: RecordDict) -> dict[str, float]:
        counts = torch.from_numpy(self.data.train_counts)
        self.offsets = calibration(counts, self.cfg["fedlc-tau"]).to(self.device)
        return super().local_train(model, content)

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return calibrated_cross_entropy(model(x), y, self.offsets)
