"""FedMR losses and prototype maths (Fan et al., "Federated Learning under Partially Class-Disjoint
Data via Manifold Reshaping", TMLR 2023). Pure torch/numpy.

Local objective (Eq. 5): ``L_k = CE + mu1 * l_intra + mu2 * l_inter``, both extra terms on the
backbone features ``z = f1(x)`` (the input of the linear head, as the authors' code: the paper does not name the layer),
computed per mini-batch.

Intra-class loss (Eq. 3, anti-collapse), per class c present in the batch with n_c >= 2 samples::

    z_hat = (z - mu_c) / sigma_c                      (per-dimension standardisation)
    M_c   = z_hat^T z_hat / (n_c - 1)                 (per-class correlation matrix, d x d)
    paper_fro:     l = mean_c ||M_c||_F^2             (Eq. 3 literally; sigma biased, 1/n)
    paper_offdiag: l = mean_c sum_{i != j} M_c[i,j]^2 (same gradient, 0 when decorrelated)
    ref:           l = sum_c mean_{i != j} G_c[i,j]^2 / sum_c n_c,  G_c = z_hat^T z_hat, sigma unbiased
                   (the authors' released `MR_loss`; the scale at which the paper's tuned mu1 make sense)

Inter-class loss (Eq. 4, anti-invasion) against fixed global prototypes g (no gradient)::

    D_{ci,cj} = mean_{n: y_n = ci} max(||z_n - g_ci|| - ||z_n - g_cj|| + margin, 0)
    l_inter   = mean over the (ci, cj) pairs used of D_{ci,cj}

Decisions where the paper is silent or contradicts itself:
- Negatives c_j: Eq. 4 ranges over the client's own classes only, which contradicts the paper's
  stated purpose (prototypes as "support of the missing classes"; Alg. 1 broadcasts all of them).
  Default ``negatives="all"`` (every class != c_i with a valid global prototype);
  ``"local"`` is the literal Eq. 4 (0 for a single-class client). The normaliser is the number of
  pairs actually used (Eq. 4's 1/(|C_k|(|C_k|-1)) when all are valid).
- The hinge has no margin constant in the paper; ``margin`` (default 0) is an extra (the text
  speaks of a "larger margin"). The
  "margin removed" ablation (``form="pull"``) is the mean distance to the own prototype.
- Classes whose prototype is not valid (round 1, classes no participant has held yet) are masked:
  their samples contribute nothing and they are no negatives. Stale prototypes are kept by the
  server (`aggregate_prototypes`).
- Lite-n (Sec. 4.4): the inter loss on n random samples of the batch (n < 0: whole batch, 0: off).
- The intra loss defaults to ``"ref"`` because the paper's tuned mu1 (0.001-0.1) only make sense at
  that scale; the paper's modes are there for faithful-form runs with a re-tuned mu1.
- Whether the inter loss can act at the paper's weight (Table 9, FMNIST: mu2 = 1e-4): the hinge's
  gradient in z_n is a mean over the pairs of differences of unit vectors,
  (z_n - g_ci) / ||z_n - g_ci|| - (z_n - g_cj) / ||z_n - g_cj||, so its norm is at most 2 per
  sample and mu2 l_inter moves the backbone by at most 2 mu2 per unit of the features' Jacobian,
  against the cross-entropy's softmax error. `gradient_share` measures the ratio of the two in a
  run (the client metric `inter-grad-share`, `fedmr-grad-share-every`); the authors' public code
  (`MediaBrain-SJTU/FedMR`) has no inter-class loss at all, only `MR_loss` (the intra term).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

INTRA_MODES = ("ref", "paper_fro", "paper_offdiag")
NEGATIVES = ("all", "local")
INTER_FORMS = ("hinge", "pull")


def _offdiag_sq(m: torch.Tensor) -> torch.Tensor:
    """Squares of the off-diagonal entries of a square matrix, flattened."""
    d = m.shape[0]
    return m.pow(2).masked_select(~torch.eye(d, dtype=torch.bool, device=m.device))


def intra_class_loss(
    z: torch.Tensor,
    y: torch.Tensor,
    mode: str = "ref",
    eps: float = 1e-8,
    weight: torch.Tensor | None = None,
    num_classes: int = 0,
) -> torch.Tensor:
    """FedMR intra-class decorrelation loss (Eq. 3) of features `z` [B, d] with labels `y` [B].

    Classes with fewer than 2 samples in the batch are skipped; with no class left (or d < 2 for
    the off-diagonal modes) the result is a 0-dim zero tensor connected to `z`'s graph. With
    `weight` (the batched engine's: 0 on padding) over the examples of positive weight, masked for
    `vmap` (`_masked_intra`: all `num_classes` classes at once).
    """
    if mode not in INTRA_MODES:
        raise ValueError(f"intra mode {mode!r}: must be one of {INTRA_MODES}")
    if weight is not None:
        return _masked_intra(z, y, mode, eps, weight, num_classes)
    terms, counts = [], []
    for c in torch.unique(y):
        x = z[y == c]
        n = x.shape[0]
        if n < 2:
            continue
        x = x - x.mean(0, keepdim=True)
        if mode == "ref":
            x = x / torch.sqrt(x.var(0, unbiased=True, keepdim=True) + eps)
            off = _offdiag_sq(x.T @ x)
            terms.append(off.mean() if off.numel() else x.sum() * 0.0)
            counts.append(n)
        else:
            x = x / torch.sqrt(x.pow(2).mean(0, keepdim=True) + eps)
            m = x.T @ x / (n - 1)
            terms.append(m.pow(2).sum() if mode == "paper_fro" else _offdiag_sq(m).sum())
    if not terms:
        return z.sum() * 0.0
    if mode == "ref":
        return torch.stack(terms).sum() / sum(counts)
    return torch.stack(terms).mean()


def _one_hot(y: torch.Tensor, num_classes: int, dtype: torch.dtype) -> torch.Tensor:
    """`F.one_hot(y, num_classes)` in `dtype`, without its check of y's range (an `.item()`: not under `vmap`)."""
    return (y[:, None] == torch.arange(num_classes, device=y.device)).to(dtype)


def _masked_intra(
    z: torch.Tensor, y: torch.Tensor, mode: str, eps: float, weight: torch.Tensor, num_classes: int
) -> torch.Tensor:
    """`intra_class_loss` of the examples of positive `weight`, every class at once: x_c the class's
    standardised rows (the others 0, [C, B, d]); ||x_c^T x_c||_F^2 = ||x_c x_c^T||_F^2 ([C, B, B]
    Gram matrices, not [C, d, d]) and the diagonal of x_c^T x_c is the columns' squared norms."""
    onehot = _one_hot(y, num_classes, z.dtype) * (weight > 0).to(z.dtype)[:, None]  # [B, C]
    n = onehot.sum(0)  # [C]
    m = onehot.T[:, :, None]  # [C, B, 1]
    x = m * (z[None] - (onehot.T @ z / n.clamp(min=1)[:, None])[:, None])  # centred, 0 outside the class
    spread = x.pow(2).sum(1, keepdim=True)  # [C, 1, d]
    scale = (n - 1).clamp(min=1) if mode == "ref" else n.clamp(min=1)  # unbiased / biased sigma
    x = x / torch.sqrt(spread / scale[:, None, None] + eps)
    whole = (x @ x.transpose(1, 2)).pow(2).sum((1, 2))  # ||x^T x||_F^2
    diagonal = x.pow(2).sum(1).pow(2).sum(1)  # sum_i (x^T x)_ii^2
    used = (n >= 2).to(z.dtype)
    d = z.shape[1]
    if mode == "ref":
        term = (whole - diagonal) / max(d * (d - 1), 1)
        return (used * term).sum() / (used * n).sum().clamp(min=1)
    fro = whole if mode == "paper_fro" else whole - diagonal
    return (used * fro / (n - 1).clamp(min=1).pow(2)).sum() / used.sum().clamp(min=1)


def inter_class_loss(
    z: torch.Tensor,
    y: torch.Tensor,
    prototypes: torch.Tensor,
    valid: torch.Tensor,
    local_mask: torch.Tensor | None = None,
    negatives: str = "all",
    margin: float = 0.0,
    form: str = "hinge",
    lite_n: int = -1,
    generator: torch.Generator | None = None,
    weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """FedMR inter-class prototype margin loss (Eq. 4) of features `z` [B, d], labels `y` [B].

    `prototypes` [C, d] are the global prototypes (detached here), `valid` [C] bool says which
    exist, `local_mask` [C] bool the client's own classes (needed for ``negatives="local"``).
    `lite_n` >= 0 keeps that many random samples of the batch (0 disables the term). With `weight`
    (the batched engine's: 0 on padding) over the examples of positive weight, masked for `vmap`
    (no lite sampling: its draws are not the engine's).
    """
    if negatives not in NEGATIVES or form not in INTER_FORMS:
        raise ValueError(f"negatives={negatives!r} / form={form!r}: must be in {NEGATIVES} / {INTER_FORMS}")
    zero = z.sum() * 0.0
    if lite_n == 0:
        return zero
    if weight is not None:
        if 0 < lite_n < z.shape[0]:
            raise ValueError("a weighted (batched) inter-class loss draws no lite samples")
        return _masked_inter(z, y, prototypes, valid, local_mask, negatives, margin, form, weight)
    if 0 < lite_n < z.shape[0]:
        idx = torch.randperm(z.shape[0], generator=generator)[:lite_n].to(z.device)
        z, y = z[idx], y[idx]
    g = prototypes.detach().to(z.dtype)
    valid = valid.to(torch.bool)
    keep = valid[y]
    z, y = z[keep], y[keep]
    if z.shape[0] == 0:
        return zero
    dist = torch.cdist(z, g)  # [b, C] Euclidean
    own = dist.gather(1, y[:, None])  # [b, 1]
    if form == "pull":
        return own.mean()
    hinge = F.relu(own - dist + margin)  # [b, C]
    num_classes = g.shape[0]
    onehot = F.one_hot(y, num_classes).to(z.dtype)  # [b, C]
    n_per_class = onehot.sum(0)  # [C]
    present = n_per_class > 0
    d_pairs = (onehot.T @ hinge) / n_per_class.clamp(min=1)[:, None]  # D[ci, cj]
    neg = valid.clone()
    if negatives == "local":
        if local_mask is None:
            raise ValueError("negatives='local' needs local_mask")
        neg = neg & local_mask.to(torch.bool)
    pairs = present[:, None] & neg[None, :] & ~torch.eye(num_classes, dtype=torch.bool, device=z.device)
    if not pairs.any():
        return zero
    return d_pairs[pairs].mean()


def _masked_inter(
    z: torch.Tensor,
    y: torch.Tensor,
    prototypes: torch.Tensor,
    valid: torch.Tensor,
    local_mask: torch.Tensor | None,
    negatives: str,
    margin: float,
    form: str,
    weight: torch.Tensor,
) -> torch.Tensor:
    """`inter_class_loss` of the examples of positive `weight` whose class is valid, as masks."""
    g = prototypes.detach().to(z.dtype)
    valid = valid.to(torch.bool)
    keep = (valid[y] & (weight > 0)).to(z.dtype)  # [B]
    dist = torch.cdist(z, g)  # [B, C]
    own = dist.gather(1, y[:, None])  # [B, 1]
    if form == "pull":
        return (keep * own[:, 0]).sum() / keep.sum().clamp(min=1)
    hinge = F.relu(own - dist + margin)
    num_classes = g.shape[0]
    onehot = _one_hot(y, num_classes, z.dtype) * keep[:, None]
    n_per_class = onehot.sum(0)
    d_pairs = (onehot.T @ hinge) / n_per_class.clamp(min=1)[:, None]
    neg = valid
    if negatives == "local":
        if local_mask is None:
            raise ValueError("negatives='local' needs local_mask")
        neg = neg & local_mask.to(torch.bool)
    eye = torch.eye(num_classes, dtype=torch.bool, device=z.device)
    pairs = ((n_per_class > 0)[:, None] & neg[None, :] & ~eye).to(z.dtype)
    return (d_pairs * pairs).sum() / pairs.sum().clamp(min=1)


def gradient_share(term: torch.Tensor, reference: torch.Tensor, params: Sequence[torch.Tensor]) -> float:
    """||grad_params term|| / ||grad_params reference||, both gradients over the same parameters
    (the graph is kept for the real backward pass; a parameter a loss does not reach counts 0).
    What an extra loss weighs against the cross-entropy in the update it is added to (NaN when
    the reference's gradient is zero)."""

    def norm(loss: torch.Tensor) -> float:
        grads = torch.autograd.grad(loss, list(params), retain_graph=True, allow_unused=True)
        return math.sqrt(sum(float(g.pow(2).sum()) for g in grads if g is not None))

    base = norm(reference)
    return norm(term) / base if base > 0 else float("nan")


@torch.no_grad()
def class_prototypes(z: torch.Tensor, y: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-class mean feature g_c = (1/N^c) sum_{y_i = c} z_i [C, d] (zero rows for absent classes)
    and the counts N^c [C] (int64)."""
    sums = torch.zeros(num_classes, z.shape[1], dtype=torch.float64, device=z.device)
    sums.index_add_(0, y, z.to(torch.float64))
    counts = torch.bincount(y, minlength=num_classes)
    return (sums / counts.clamp(min=1)[:, None]).to(z.dtype), counts


def aggregate_prototypes(
    prototypes: Sequence[np.ndarray],
    counts: Sequence[np.ndarray],
    previous: np.ndarray | None = None,
    previous_valid: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Server update g_c = sum_k (N_k^c / sum_k' N_k'^c) g_k^c for every class with a positive total
    count; other classes keep `previous` (stale) and its validity, or are zero and invalid.

    Returns (global prototypes [C, d] float32, valid [C] bool). Zero-count rows carry no weight, so
    non-sharing clients (all counts 0) have no influence.
    """
    if not prototypes:
        raise ValueError("aggregate_prototypes needs at least one client")
    p = np.stack([np.asarray(a, dtype=np.float64) for a in prototypes])  # [K, C, d]
    n = np.stack([np.asarray(c, dtype=np.float64) for c in counts])  # [K, C]
    if (n < 0).any():
        raise ValueError("prototype counts must be non-negative")
    total = n.sum(0)  # [C]
    updated = total > 0
    mean = np.einsum("kc,kcd->cd", n, p) / np.where(updated, total, 1.0)[:, None]
    if previous is None:
        out, valid = np.zeros_like(mean), np.zeros(len(total), dtype=bool)
    else:
        out = np.asarray(previous, dtype=np.float64).copy()
        valid = np.zeros(len(total), dtype=bool) if previous_valid is None else np.asarray(previous_valid, bool).copy()
    out[updated] = mean[updated]
    valid |= updated
    return out.astype(np.float32), valid


def sharing_partitions(num_partitions: int, fraction: float, seed: int) -> np.ndarray:
    """Bool mask [num_partitions]: the fixed, seeded subset of round(fraction * K) clients allowed
    to upload prototypes (paper Table 5, chosen once before training)."""
    k = round(fraction * num_partitions)
    mask = np.zeros(num_partitions, dtype=bool)
    mask[np.random.default_rng([seed, 0xFED]).permutation(num_partitions)[:k]] = True
    return mask
