"""FedLC's calibrated cross-entropy (Zhang et al., "Federated Learning with Label Distribution Skew
via Logits Calibration", ICML'22, Sec. 4). Pure torch.

Client k with n_{k,y} training examples of class y calibrates every logit before the softmax:

    f~_y(x) = f_y(x) - tau * n_{k,y}^{-1/4}
    L_cal   = -log( exp(f~_y(x)) / sum_{y'} exp(f~_{y'}(x)) )       (cross-entropy on f~)

so rarer local classes get a larger margin (the pairwise margin tau (n_y^{-1/4} - n_{y'}^{-1/4})).
Only training is calibrated; the model is evaluated, uploaded and aggregated with raw logits.

Decisions (the authors released no code):
- Denominator: the paper's loss writes the sum over y' != y. That form is unbounded below (scaling
  the classifier drives f~_y - max_{y' != y} f~_{y'} and the loss to -inf) and is -inf outright for a
  client holding one class, so training on it collapses. FL-bench (06e658b, `src/client/fedlc.py`),
  FedDecorr's FedLC (bytedance/FedDecorr, `approach/fedlogitcal.py`) and Flower's FedLC baseline all
  use the full softmax, as here.
- Missing classes: n^{-1/4} is infinite for n = 0, whose limit removes the class from the softmax.
  The counts are floored at 1e-8 as FL-bench does (offset 100 tau: exp(-100) for tau = 1, a removal
  in effect), which keeps tau = 0 exactly FedAvg (FedDecorr's 0^{-1/4} = inf gives NaN there).
- tau: the paper does not state its value (Flower's baseline README says so too); the default 1.0 is
  FL-bench's and PFLlib's (FedDecorr 0.1, Flower's baseline 0.5). PFLlib calibrates with the
  *global* class counts, not the client's; that is not the paper's n_{k,y} and is not followed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

COUNT_FLOOR = 1e-8  # FL-bench's count for a class the client lacks


def calibration(counts: torch.Tensor, tau: float) -> torch.Tensor:
    """The offsets tau * n_y^{-1/4} [C] of the client's class counts `counts` [C] (floored at 1e-8)."""
    if tau < 0:
        raise ValueError(f"tau={tau} must be >= 0")
    return tau * counts.to(torch.float64).clamp(min=COUNT_FLOOR).pow(-0.25)


def calibrated_cross_entropy(
    logits: torch.Tensor, y: torch.Tensor, offsets: torch.Tensor, reduction: str = "mean"
) -> torch.Tensor:
    """Cross-entropy of the calibrated logits f - offsets (`calibration`), the batch mean or
    (`reduction="none"`) one value per example."""
    return F.cross_entropy(logits - offsets.to(logits), y, reduction=reduction)
