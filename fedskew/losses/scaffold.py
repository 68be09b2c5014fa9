"""SCAFFOLD's corrected local step (Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging
for Federated Learning", ICML'20, Alg. 1 line 10), also FedDC's gradient correction:

    y <- y - eta_l (g_i(y) - c_i + c)

The control variates' updates are numpy maths shared with the server
(`fedskew.strategies.aggregate.scaffold_control_deltas`, option II).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def correct_after_step(optimizer: torch.optim.Optimizer, corrections: Sequence[torch.Tensor]) -> None:
    """After every `optimizer.step()`, move each parameter by -lr * (c - c_i) (`corrections`, one
    tensor per parameter in the optimiser's order; lr of its group).

    The step is split as the optimiser's own step on g_i(y) (momentum and weight decay included)
    followed by the correction, outside the momentum buffer: with momentum 0 and weight decay 0 the
    two together are exactly Alg. 1's step. This is how NIID-Bench (Xtra-Computing/NIID-Bench at
    61b901ab, experiments.py `train_net_scaffold`) combines SCAFFOLD with momentum SGD; with option
    II's c_i = c_i - c + (x - y) / (K eta_l) the client's c_i then settles at its momentum-scaled
    mean gradient g_i / (1 - rho), the same scale as the steps it corrects. Passing the correction
    through the momentum buffer instead would amplify it by 1 / (1 - rho) while option II still
    divides by K: the deviation c_i - c would then be multiplied by -rho / (1 - rho) (-9 at rho 0.9)
    every round, which diverges.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if len(params) != len(corrections):
        raise ValueError(f"{len(corrections)} corrections for {len(params)} parameters")
    by_param = dict(zip(map(id, params), corrections, strict=True))

    @torch.no_grad()
    def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for group in opt.param_groups:
            for p in group["params"]:
                p.sub_(by_param[id(p)], alpha=group["lr"])

    optimizer.register_step_post_hook(hook)
