"""FedRoD's two losses (Chen & Chao, "On Bridging Generic and Personalized Federated Learning for
Image Classification", ICLR'22): the balanced softmax of the generic head and the empirical
risk of the personalized prediction.

Balanced softmax (BSM; Ren et al., NeurIPS'20, the robust loss FedRoD trains its generic predictor
with): with N_{m,c} client m's training samples of class c and g(x) the generic head's logits,

    L_BSM(x, y) = -log( N_{m,y}^gamma exp(g_y(x)) / sum_c N_{m,c}^gamma exp(g_c(x)) )
                = CE(g(x) + gamma log N_m, y),

i.e. cross-entropy on the logits shifted by the log prior of the client's label distribution. A
class the client lacks (N_{m,c} = 0, gamma > 0) gets the shift -inf: it leaves the softmax, and the
client neither pushes it down nor up. gamma = 1 is Ren et al.'s BSM.

Personalized prediction: the personalized head's logits p(x) are added to the generic head's,
y_hat = argmax_c g_c(x) + p_c(x), and the personalized head alone minimises the client's empirical
risk CE(g(x) + p(x), y) (the generic logits and the features are constants for it).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def class_log_prior(counts: np.ndarray | torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """gamma log N_c per class `[C]` (float32): -inf for a class without samples when gamma > 0,
    0 everywhere when gamma = 0 (plain cross-entropy)."""
    if gamma < 0:
        raise ValueError(f"gamma={gamma} must be >= 0")
    n = torch.as_tensor(np.asarray(counts), dtype=torch.float32)
    if (n < 0).any():
        raise ValueError("class counts must be >= 0")
    return n.pow(gamma).log()  # 0 ** 0 = 1: gamma = 0 gives 0, not 0 * -inf


def balanced_softmax_loss(
    logits: torch.Tensor, target: torch.Tensor, log_prior: torch.Tensor, reduction: str = "mean"
) -> torch.Tensor:
    """L_BSM, the batch mean (or per example: `reduction`, as `F.cross_entropy`'s): cross-entropy on
    `logits + log_prior` (`class_log_prior`). Every target class must have samples (a finite prior);
    absent classes contribute nothing and get no gradient."""
    return F.cross_entropy(logits + log_prior.to(logits.device).unsqueeze(0), target, reduction=reduction)


def personalized_risk(
    generic: torch.Tensor, personal: torch.Tensor, target: torch.Tensor, reduction: str = "mean"
) -> torch.Tensor:
    """CE(g + p, y), the batch mean (or per example: `reduction`), with the generic logits `g` held
    constant: its gradient reaches the personalized head only."""
    return F.cross_entropy(generic.detach() + personal, target, reduction=reduction)
