"""FedDC's local drift (Gao et al., "FedDC: Federated Learning with Non-IID Data via Local Drift
Decoupling and Correction", CVPR'22; the authors' code `gaoliang13/FedDC` at 13440c23,
utils_general.py `train_model_FedDC`, utils_methods_FedDC.py `train_FedDC`):

    penalty     alpha/2 ||theta_i + h_i - w||^2       (the drift h_i bridges local and global model)
    drift       h_i <- h_i + (theta_i - w)            after local training
    upload      theta_i + h_i                         (the drift-corrected local model)

The gradient correction <theta_i, c - c_i> is SCAFFOLD's (`fedskew.losses.scaffold`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def penalty_target(global_params: Sequence[torch.Tensor], drift: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """w - h_i: the penalty alpha/2 ||theta_i + h_i - w||^2 is the proximal term (`proximal_term`)
    towards it, computed once a round."""
    return [(w - h).detach() for w, h in zip(global_params, drift, strict=True)]


@torch.no_grad()
def drift_update(
    drift: Sequence[torch.Tensor], params: Sequence[torch.Tensor], global_params: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """h_i <- h_i + (theta_i - w)."""
    return [h + (p - w) for h, p, w in zip(drift, params, global_params, strict=True)]
