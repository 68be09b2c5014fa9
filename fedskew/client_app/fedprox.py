"""FedProx client (Li et al., MLSys'20): cross-entropy + (mu/2) ||w - w_global||^2.

The standard proximal form (the FedProx paper, Eq. 2), not the mean smooth-L1 distance that FedRS's
public code uses for its FedProx baseline.
"""

from __future__ import annotations

import torch
from flwr.app import RecordDict
from torch import nn

from fedskew.client_app.base import BaseTrainer
from fedskew.losses import proximal_term
from fedskew.training import cross_entropy_loss


class FedProxTrainer(BaseTrainer):
    """Adds the proximal term against the downloaded global weights to every mini-batch loss."""

    def load_global(self, model: nn.Module, content: RecordDict) -> None:
        super().load_global(model, content)
        self.global_params = [p.detach().clone() for p in model.parameters()]

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        prox = proximal_term(model.parameters(), self.global_params, self.cfg["fedprox-mu"])
        return cross_entropy_loss(model, x, y) + prox
