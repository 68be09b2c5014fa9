"""FedProx proximal term (Li et al., MLSys'20): (mu / 2) ||w - w_global||^2."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def proximal_term(params: Iterable[torch.Tensor], global_params: Iterable[torch.Tensor], mu: float) -> torch.Tensor:
    """`mu/2 * sum_l ||w_l - w_global_l||^2` over matching parameter tensors (globals detached)."""
    terms = [(p - g.detach()).pow(2).sum() for p, g in zip(params, global_params, strict=True)]
    return 0.5 * mu * torch.stack(terms).sum()
