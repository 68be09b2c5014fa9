"""FedRS restricted softmax (Li & Zhan, KDD'21, Eq. 8).

    p_{i,c} = exp(a_c w_c^T h_i) / sum_j exp(a_j w_j^T h_i),   a_c = 1{c in O} + alpha 1{c in M}

where O are the client's observed classes (>= tau local training samples) and M the missing ones.
The gradient reaching a missing class's proxy w_c is alpha times the restricted-softmax gradient
(Eq. 9-10); at alpha = 1 the loss is plain cross-entropy.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def fedrs_scale(counts: np.ndarray | torch.Tensor, alpha: float, tau: int = 1, mode: str = "binary") -> torch.Tensor:
    """Per-class logit scale `[C]` from the client's whole-dataset label counts.

    - `binary` (the paper): 1 for observed classes (count >= tau), alpha for missing ones.
    - `count` (the authors' later code, `lxcnju/FedRepo` `algorithms/fedrs.py` `update_local`):
      alpha + (1 - alpha) n_c / max_j n_j; classes below tau get alpha.
    - `fraction` (MAP's authors' code, `lxcnju/MAP` `algorithms/fedap.py` `update_local`): the rule
      applied to the class *fractions* n_c / n, 1 where n_c / n >= tau, else alpha. With their
      `min_samples` = 1 (tau here) only a single-class client has a class at 1: for every other
      client every logit is scaled by alpha (a plain softmax at temperature 1 / alpha).
    Computed once per round from the local data, never per mini-batch: the paper defines the observed
    classes on the client's training set, and an early version of the authors' code that rebuilt
    the scale inside the step loop compounded it towards 1 (FedAvg after a few steps).
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha} must be in [0, 1]")
    n = torch.as_tensor(np.asarray(counts), dtype=torch.float32)
    observed = n >= tau
    if mode == "binary":
        return torch.where(observed, torch.ones_like(n), torch.full_like(n, alpha))
    if mode == "count":
        prop = alpha + (1.0 - alpha) * n / n.max().clamp(min=1.0)
        return torch.where(observed, prop, torch.full_like(n, alpha))
    if mode == "fraction":
        dist = n / n.sum().clamp(min=1.0)
        return torch.where(dist >= tau, torch.ones_like(n), torch.full_like(n, alpha))
    raise ValueError(f"mode={mode!r} must be 'binary', 'count' or 'fraction'")


def restricted_softmax_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, scale: torch.Tensor, reduction: str = "mean"
) -> torch.Tensor:
    """Cross-entropy on `logits * scale` (logits = h W^T, bias-free; scale `[C]`), the batch mean or
    (`reduction="none"`) one value per example."""
    return F.cross_entropy(logits * scale.to(logits.device).unsqueeze(0), target, reduction=reduction)
