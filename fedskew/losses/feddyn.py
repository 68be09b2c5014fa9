"""FedDyn's local objective and gradient state (Acar et al., "Federated Learning Based on Dynamic
Regularization", ICLR'21, Alg. 1):

    theta_k^t = argmin_theta  L_k(theta) - <g_k, theta> + alpha/2 ||theta - theta^{t-1}||^2,
    g_k <- g_k - alpha (theta_k^t - theta^{t-1}),          g_k = grad L_k(theta_k^{t-1}), 0 at first.

The second line is the first-order condition of the first at its minimiser, so it holds whatever
optimiser finds that minimiser (momentum SGD included). The authors' code (`alpemreacar/FedDyn` at
48a19fac) stores lambda_k = -g_k / alpha instead of g_k. The server's h and model are
`fedskew.strategies.aggregate.feddyn_server_update`.

The code (utils_general.py `train_feddyn_mdl`) splits the regulariser: the loss holds the linear
term alpha <theta, -theta^{t-1} + lambda_k>, the optimiser's weight decay alpha + weight_decay the
rest, so its `clip_grad_norm_` (max_norm = 10) clips grad L_k - g_k - alpha theta^{t-1} and never
alpha theta. `clip_outside_decay` clips that vector of the same gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def feddyn_penalty(
    params: Sequence[torch.Tensor],
    global_params: Sequence[torch.Tensor],
    gradient_state: Sequence[torch.Tensor],
    alpha: float,
) -> torch.Tensor:
    """The dynamic regulariser -<g_k, theta - theta^{t-1}> + alpha/2 ||theta - theta^{t-1}||^2, summed
    over matching tensors (theta^{t-1} and g_k detached): Alg. 1's linear and quadratic terms, less
    the constant <g_k, theta^{t-1}>, so that it is 0 at the round's start; gradient -g_k + alpha
    (theta - theta^{t-1})."""
    terms = []
    for p, w, g in zip(params, global_params, gradient_state, strict=True):
        d = p - w.detach()
        terms.append(0.5 * alpha * d.pow(2).sum() - (g.detach() * d).sum())
    return torch.stack(terms).sum()


@torch.no_grad()
def feddyn_gradient_update(
    gradient_state: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    global_params: Sequence[torch.Tensor],
    alpha: float,
) -> list[torch.Tensor]:
    """g_k <- g_k - alpha (theta_k^t - theta^{t-1})."""
    return [g - alpha * (p - w) for g, p, w in zip(gradient_state, params, global_params, strict=True)]


def clip_outside_decay(optimizer: torch.optim.Optimizer, max_norm: float, alpha: float) -> None:
    """Before every step (`max_norm` > 0; the optimiser must not clip itself), clip the gradient of
    L_k + regulariser less its alpha theta part, as the code clips the gradient of its loss with
    alpha theta in the weight decay:

        G = grad L_k - g_k + alpha (theta - theta^{t-1}),     G <- clip(G - alpha theta) + alpha theta

    (`clip_grad_norm_`'s arithmetic). The optimiser's own weight decay is applied after, unclipped."""
    if max_norm <= 0:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]

    @torch.no_grad()
    def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        with_grad = [p for p in params if p.grad is not None]
        for p in with_grad:
            p.grad.sub_(p, alpha=alpha)
        torch.nn.utils.clip_grad_norm_(with_grad, max_norm)
        for p in with_grad:
            p.grad.add_(p, alpha=alpha)

    optimizer.register_step_pre_hook(hook)
