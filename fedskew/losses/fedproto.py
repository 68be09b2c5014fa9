"""FedProto maths (Tan et al., "FedProto: Federated Prototype Learning across Heterogeneous Clients",
AAAI'22). Pure torch/numpy, no Flower.

The paper's equations are cited by the section that holds them (the text read here, arXiv
2105.00243, carries no equation numbers). A prototype is a class's mean embedding ("Prototype",
`fedskew.losses.fedmr.class_prototypes`): ``C_i^(j) = 1/|D_ij| sum_{(x, y) in D_ij} f_i(x)``. The
server merges the clients' prototypes per class ("Global Prototype Aggregation",
`global_prototypes`), each client trains ``CE + lambda * L_R`` ("Local Model Update",
`prototype_distance_loss`) and predicts by the nearest global prototype ("Prototype-based model
inference", `prototype_logits`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from fedskew.losses.fedmr import aggregate_prototypes

WEIGHTINGS = ("counts", "clients")


def global_prototypes(
    prototypes: Sequence[np.ndarray],
    counts: Sequence[np.ndarray],
    weighting: str = "counts",
    previous: np.ndarray | None = None,
    previous_valid: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The global prototype of every class some client holds (Sec. "Global Prototype Aggregation"):

        counts:  C_bar^(j) = sum_{i in N_j} |D_ij| C_i^(j) / sum_{i in N_j} |D_ij|
        clients: C_bar^(j) = 1/|N_j| sum_{i in N_j} C_i^(j)

    N_j: the clients with samples of class j. The paper writes ``1/|N_j| sum_{i in N_j} |D_ij| / N_j
    C_i^(j)`` (N_j: the samples of class j): its weights sum to 1/|N_j|, shrinking every prototype
    towards 0 by the number of its holders, so "counts" takes the count weights |D_ij| / N_j of
    the paper's aggregation (and of its optimization objective) normalised; "clients" is the authors' code
    (`lib/utils.py` `proto_aggregation`: the plain mean over the holders). A class no client here
    holds keeps its `previous` prototype and validity (none: zero and invalid). Returns (prototypes
    [C, d] float32, valid [C] bool).
    """
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting={weighting!r}: must be one of {WEIGHTINGS}")
    weights = [np.asarray(c, dtype=np.float64) for c in counts]
    if weighting == "clients":
        weights = [(w > 0).astype(np.float64) for w in weights]
    return aggregate_prototypes(prototypes, weights, previous, previous_valid)


def prototype_distance_loss(
    z: torch.Tensor, y: torch.Tensor, prototypes: torch.Tensor, valid: torch.Tensor, weight: torch.Tensor | None = None
) -> torch.Tensor:
    """L_R ("Local Model Update") per mini-batch, as the authors' code computes it (`lib/update.py`,
    `update_weights_het`: `nn.MSELoss()(proto_new, protos)`):

        L_R = 1/(B d) sum_{i: valid[y_i]} || f(x_i) - C_bar^(y_i) ||^2

    the squared L2 distance of each embedding to its class's global prototype (fixed: no gradient),
    averaged over the batch's B samples and the d dimensions; a sample whose class has no global
    prototype adds 0 (it still counts in B, as in the code). Zero, connected to `z`'s graph, when
    nothing is valid (round 1). With `weight` w (the batched engine's: 1/b on the b examples, 0 on
    padding) the same mean as sum_i w_i [valid y_i] ||.||^2 / d, masked for `vmap`.
    """
    p = prototypes.detach().to(z.dtype)
    if weight is not None:
        return (weight * valid.to(z.dtype)[y] * (z - p[y]).pow(2).sum(1)).sum() / z.shape[1]
    keep = valid.to(torch.bool)[y]
    if not bool(keep.any()):
        return z.sum() * 0.0
    return (z[keep] - p[y[keep]]).pow(2).sum() / z.numel()


def prototype_logits(z: torch.Tensor, prototypes: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Scores whose argmax is the paper's prototype-based prediction ``argmin_j ||f(x) - C_bar^(j)||_2``
    over the classes with a global prototype: ``-||z - C_bar^(j)||_2`` for those, and for the others one less than the
    row's lowest such score (never chosen, finite so that a cross-entropy stays defined). [B, C]."""
    valid = valid.to(torch.bool)
    if not bool(valid.any()):
        raise ValueError("prototype_logits needs at least one valid prototype")
    scores = -torch.cdist(z, prototypes.to(z.dtype))
    floor = scores[:, valid].min(dim=1, keepdim=True).values - 1.0
    return torch.where(valid[None, :], scores, floor)
