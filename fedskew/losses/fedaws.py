"""FedAwS's spreadout regularizer on the class embeddings (Yu et al., "Federated Learning with Only
Positive Labels", ICML'20, Sec. 3, Alg. 1). Pure torch.

The server averages the clients' models, then moves the rows w_c of the (aggregated) classifier W
[C, d] apart by gradient steps on

    reg_sp(W) = sum_c sum_{c' != c} ( max(0, nu - d(w_c, w_c')) )^2

(pairs closer than the margin nu are pushed to nu; pairs already nu apart give no gradient). Alg. 1
takes one step W <- W - lambda eta grad reg_sp(W) per round; the distance d is

- "euclidean": ||w_c - w_c'||_2 on the raw rows;
- "cosine":    (1 - cos(w_c, w_c')) / 2 in [0, 1], the FedRS authors' FedAwS (lxcnju/FedRepo at
  617ee01, `algorithms/fedaws.py`), the implementation behind FedRS's FedAwS rows: it is the squared
  Euclidean distance of the unit-normalised rows divided by 4, and acts on directions only.

That code takes `aws_steps` (30 or 50) SGD steps with momentum 0.9 and lr `aws_lr` (0.1 or 0.01) on
the *mean* over the C x C entries (diagonal included, a constant); on the sum here, its lr is
aws_lr / C^2 (0.1 -> 0.001 for 10 classes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DISTANCES = ("euclidean", "cosine")


def pairwise_distances(w: torch.Tensor, distance: str) -> torch.Tensor:
    """[C, C] distances d(w_c, w_c') between the rows of `w` [C, d]."""
    if distance == "cosine":
        u = F.normalize(w, dim=1)
        return 0.5 * (1.0 - u @ u.T)
    if distance == "euclidean":
        sq = (w[:, None, :] - w[None, :, :]).pow(2).sum(-1)
        return sq.clamp(min=1e-12).sqrt()  # finite gradient for (near-)equal rows
    raise ValueError(f"distance={distance!r}: must be one of {DISTANCES}")


def spreadout_regularizer(w: torch.Tensor, margin: float, distance: str = "euclidean") -> torch.Tensor:
    """reg_sp(W) = sum over ordered pairs c != c' of max(0, margin - d(w_c, w_c'))^2."""
    d = pairwise_distances(w, distance)
    off = ~torch.eye(len(w), dtype=torch.bool, device=w.device)
    return F.relu(margin - d[off]).pow(2).sum()


def spreadout(
    w: torch.Tensor, margin: float, distance: str, steps: int, lr: float, momentum: float = 0.0
) -> torch.Tensor:
    """W after `steps` SGD steps (lr, momentum; a fresh optimiser) on `spreadout_regularizer`."""
    w = w.detach().clone().requires_grad_(True)
    opt = torch.optim.SGD([w], lr=lr, momentum=momentum)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        spreadout_regularizer(w, margin, distance).backward()
        opt.step()
    return w.detach()
