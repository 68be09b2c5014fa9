"""SCAFFOLD's corrected local step (Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging
for Federated Learning", ICML'20, Alg. 1 line 10), also FedDC's gradient correction (and its clip):

    y <- y - eta_l (g_i(y) - c_i + c)

Each client's control-variate update (option II, `scaffold_control_deltas`) is numpy maths that the
client and the server both compute; the server's own c update is `fedskew.strategies.aggregate`'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from fedskew.training import CORRECTION_CLIP, STEP_CORRECTION


def correct_after_step(
    optimizer: torch.optim.Optimizer, corrections: Sequence[torch.Tensor], max_norm: float = 0.0
) -> None:
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

    `max_norm` > 0 (FedDC's clip; the optimiser must not clip itself) clips the corrected gradient
    g_i + c - c_i as one vector before each step, as `clip_grad_norm_` after a loss with the linear
    term <y, c - c_i> does (`gaoliang13/FedDC` utils_general.py `train_model_FedDC`):

        s = min(1, max_norm / (||g_i + c - c_i|| + 1e-6)),   g_i <- s g_i,   correction s (c - c_i)

    With momentum 0 this is the code's step exactly; the scaled correction still bypasses momentum.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if len(params) != len(corrections):
        raise ValueError(f"{len(corrections)} corrections for {len(params)} parameters")
    by_param = dict(zip(map(id, params), corrections, strict=True))
    scale: list[torch.Tensor] = []  # this step's clip factor s (none: unclipped)

    @torch.no_grad()
    def clip(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        norms = [
            torch.linalg.vector_norm(c if p.grad is None else p.grad + c)
            for p, c in zip(params, corrections, strict=True)
        ]
        s = (max_norm / (torch.linalg.vector_norm(torch.stack(norms)) + 1e-6)).clamp(max=1.0)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(s)
        scale[:] = [s]

    @torch.no_grad()
    def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for group in opt.param_groups:
            for p in group["params"]:
                correction = by_param[id(p)]
                p.sub_(correction * scale[0] if scale else correction, alpha=group["lr"])

    if max_norm > 0:  # (norm, hook id): the batched engine clips as this hook does, after the other clips
        setattr(optimizer, CORRECTION_CLIP, (max_norm, optimizer.register_step_pre_hook(clip).id))
    setattr(optimizer, STEP_CORRECTION, True)  # the stacked step applies both the same way
    optimizer.register_step_post_hook(hook)


def scaffold_control_deltas(
    control: Mapping[str, np.ndarray],
    x: Mapping[str, np.ndarray],
    models: Sequence[Mapping[str, np.ndarray]],
    steps: Sequence[int],
    lr: float,
) -> list[dict[str, np.ndarray]]:
    """SCAFFOLD option II (Alg. 1 line 12), each client's Delta c_i = c_i^+ - c_i
    = (x - y_i) / (K_i eta_l) - c, over the arrays of `control` (the trainable parameters); float64."""
    out = []
    for y, k in zip(models, steps, strict=True):
        scale = 1.0 / (k * lr)
        out.append({n: (np.asarray(x[n], np.float64) - y[n]) * scale - c for n, c in control.items()})
    return out
