"""FedProx client (Li et al., MLSys'20): cross-entropy + (mu/2) ||w - w_global||^2.

The standard proximal form (the FedProx paper, Eq. 2), not the mean smooth-L1 distance that FedRS's
public code uses for its FedProx baseline. The trainer writes the proximal term once, as its
`penalty` on the cross-entropy (the base derives `loss` and the batched engine's `functional_loss`);
the batched engine stacks its clients, each with its own anchor w_global (`batch_extras`).
"""

from __future__ import annotations

import torch
from flwr.app import RecordDict
from torch import nn

from fedskew.client_app.base import BaseTrainer
from fedskew.losses import proximal_term


class FedProxTrainer(BaseTrainer):
    """Adds the proximal term against the downloaded global weights to every mini-batch loss."""

    batched = True

    def load_global(self, model: nn.Module, content: RecordDict) -> None:
        super().load_global(model, content)
        self.global_params = {k: p.detach().clone() for k, p in model.named_parameters()}

    def batch_extras(self) -> dict[str, torch.Tensor]:
        return self.global_params

    def penalty(self, params: dict[str, torch.Tensor], extras: dict[str, torch.Tensor]) -> torch.Tensor:
        """(mu/2) ||w - w_global||^2, the anchor w_global from `extras` (`batch_extras`)."""
        return proximal_term([params[k] for k in extras], extras.values(), self.cfg["fedprox-mu"])
