"""MuPFL's client and server maths (Zhang et al., "Multi-level personalized FL", paper 002), pure torch.

No public reference code exists: where the paper is silent the choice is ours, and says so.

BAVD, biased activation value dropout (Sec. 3.3, Eq. 6). Per BAVD layer a map M, accumulated per
iteration lambda from the batch-mean pre-mask activation h_bar (shape C x H x W: one value per channel and position):

    M^(0) = h_bar^(0),    M^(lambda) = M^(lambda-1) + psi^(lambda) h_bar^(lambda),
    psi^(lambda) = l^(lambda-1) - l^(lambda)    (loss improvement; "paper" takes Eq. 6's printed sign)

and the forward pass at iteration lambda keeps the positions where the min-max normalised map of
iteration lambda-1 is >= its per-channel mean over H x W (the mask is invariant to any
positive affine normalisation), h_out = h * mask; with `rescale` (`mupfl-bavd-rescale`) the kept
positions are scaled by (positions / kept) per channel, as the standard (inverted) dropout layer
BAVD replaces does ("we substitute the standard dropout layer with our BAVD layer", Sec. 3.3). The
zero map keeps everything, and BAVD is the identity in eval mode.

BAVD is attached by forward hooks (`attach_bavd`) after every conv-block ReLU (a ReLU preceded by a
Conv2d/BatchNorm2d inside an nn.Sequential) and after every ResNet BasicBlock, so the model's
state_dict is unchanged. Nets without such layers (mlp) get no BAVD layer.

PKCF, prior-knowledge classifier fine-tuning (Sec. 3.5, Eqs. 16-21). The fedskew classifier is a
bias-free linear head W in R^{K x d}, so the "real feature gradient" of class k has the closed form

    z^k = d/dW mean_j CE(W h_j, k) = mean_j (softmax(W h_j) - e_k) h_j^T          (Eq. 16)

(tested against autograd). The server averages z^k over the clients that uploaded class k (Eq. 17),
then optimises synthetic features h_glo in R^{K x m x d} (labels k) by SGD so that their gradients
z_hat^k (the same closed form, differentiable in h) match z^k_glo (Eqs. 18-20). Both are taken at
one classifier W, the one the clients computed z^k at (CReFF: the server sends it). The distance
(`mupfl-distance`) is CReFF's `distance_wb` by default, summed over the K rows of each class
gradient and over the classes:

    L_match = sum_{k in K_t} sum_{r=1..K} (1 - cos(z_hat^k_r, z^k_r))                    ("creff")

or Eq. 20 read as a distance (1 - its cosine similarity), one cosine of the flattened gradient,
averaged:

    L_match = 1/|K_t| sum_{k in K_t} (1 - cos(vec z_hat^k, vec z^k))                       ("paper")

The clients then fine-tune their classifier on (h_glo, y) for tau epochs (Eq. 21).

Why CReFF's form and lr 1.0: Eq. 20 averages |K_t| cosines where CReFF's distance sums about |K_t| K
row distances, so at CReFF's lr 0.1 each synthetic feature gets a gradient about 100x smaller and
does not move (on real client gradients a classifier trained on such features is at chance); CReFF's
form at lr 1.0 converges within a round (the measurements: `docs/notes/mupfl.md`). The synthesis
loss reported (`pkcf-match-loss-first/last`) is the mean cosine distance per compared vector, in
[0, 2], for either form.
"""

from __future__ import annotations

import copy
import itertools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fedskew.training import minibatches

# ----------------------------------------------------------------------------- BAVD


def bavd_mask(activation_map: torch.Tensor, rescale: bool = False, eps: float = 1e-12) -> torch.Tensor:
    """{0,1} mask of the positions where the min-max normalised map is >= its mean; with `rescale`,
    each slice's kept positions are (positions / kept) instead of 1 (inverted dropout: a slice's
    mask sums to its number of positions).

    A map of shape (C, *spatial) is thresholded per channel over its spatial positions, a 1-D map
    (D,) over all D units. A constant slice (e.g. the zero initial map) keeps every position, and
    every slice keeps at least its maximum.
    """
    m = activation_map.detach().float()
    flat = m.reshape(m.shape[0], -1) if m.dim() >= 2 else m.reshape(1, -1)
    lo, hi = flat.min(1, keepdim=True).values, flat.max(1, keepdim=True).values
    span = hi - lo
    norm = torch.where(span > eps, (flat - lo) / span.clamp_min(eps), torch.zeros_like(flat))
    keep = (norm >= norm.mean(1, keepdim=True) - 1e-6).float()
    if rescale:
        keep = keep * (keep.shape[1] / keep.sum(1, keepdim=True))  # every slice keeps >= 1 position
    return keep.to(activation_map.dtype).reshape(activation_map.shape)


def loss_change(prev_loss: float | None, loss: float, sign: str = "improvement") -> float:
    """psi^(lambda): l^(lambda-1) - l^(lambda) ('improvement') or the literal Eq. 6 sign
    ('paper'); 0 when there is no previous loss."""
    if prev_loss is None:
        return 0.0
    diff = prev_loss - loss
    return diff if sign == "improvement" else -diff


def bavd_update(activation_map: torch.Tensor | None, h_bar: torch.Tensor, iteration: int, psi: float) -> torch.Tensor:
    """Eq. 6: M = h_bar at iteration 0 (or with no map yet), else M + psi * h_bar."""
    h_bar = h_bar.detach()
    if iteration == 0 or activation_map is None:
        return h_bar.clone()
    return activation_map + psi * h_bar


class BAVD(nn.Module):
    """Biased activation value dropout with its activation map (not a parameter, not in state_dict).

    In train mode, `forward` caches the batch mean of its input (pre-mask, detached) and masks the
    input with `self.mask()`, `bavd_mask(self.map, self.rescale)`; `update(iteration, psi)` then folds
    the cached mean into the map (Eq. 6). In eval mode it is the identity.
    """

    def __init__(self, rescale: bool = False) -> None:
        super().__init__()
        self.rescale = rescale
        self.map: torch.Tensor | None = None
        self.h_bar: torch.Tensor | None = None
        self.seconds = 0.0  # wall time spent in BAVD (mask + map update), for the per-module timing

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return h
        t0 = time.perf_counter()
        self.h_bar = h.detach().mean(0)
        out = h if self.map is None else h * self.mask().to(h.device)
        self.seconds += time.perf_counter() - t0
        return out

    def mask(self) -> torch.Tensor:
        """The mask applied in train mode (Eq. 5): `bavd_mask` of the current map."""
        return bavd_mask(self.map, self.rescale)

    def update(self, iteration: int, psi: float) -> None:
        if self.h_bar is not None:
            t0 = time.perf_counter()
            self.map = bavd_update(self.map, self.h_bar, iteration, psi)
            self.h_bar = None
            self.seconds += time.perf_counter() - t0


def _bavd_targets(model: nn.Module) -> list[nn.Module]:
    from fedskew.models import BasicBlock

    targets: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, BasicBlock):
            targets.append(module)
        if isinstance(module, nn.Sequential):
            children = list(module.children())
            for prev, cur in itertools.pairwise(children):
                if isinstance(cur, nn.ReLU) and isinstance(prev, (nn.Conv2d, nn.BatchNorm2d)):
                    targets.append(cur)
    return targets


def attach_bavd(model: nn.Module, make: Callable[[], BAVD] = BAVD) -> list[BAVD]:
    """Hook a BAVD layer (`make()`) after every conv-block ReLU and ResNet block of `model`; return
    the layers. A hooked layer follows the train/eval mode of the module it is attached to.
    """
    layers = []
    for target in _bavd_targets(model):
        layer = make()

        def hook(module: nn.Module, _inputs: tuple, output: torch.Tensor, layer: BAVD = layer) -> torch.Tensor:
            layer.train(module.training)
            return layer(output)

        target.register_forward_hook(hook)
        layers.append(layer)
    return layers


def flat_maps(layers: Sequence[BAVD], shapes: Sequence[torch.Size] | None = None) -> torch.Tensor:
    """The concatenated flattened maps of `layers` (zeros where a layer has no map yet and
    `shapes` gives its shape): the M_i uploaded for ACMU."""
    parts = []
    for i, layer in enumerate(layers):
        if layer.map is not None:
            parts.append(layer.map.detach().flatten().float().cpu())
        elif shapes is not None:
            parts.append(torch.zeros(math.prod(shapes[i])))
    return torch.cat(parts) if parts else torch.zeros(0)


# ----------------------------------------------------------------------------- PKCF


def class_gradients(weight: torch.Tensor, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Closed-form gradients of mean CE w.r.t. a bias-free linear head, one per class.

    weight (K, d), features (n, d), labels (n,) -> (K, K, d) where slice k is
    z^k = mean_{j: y_j = k} (softmax(W h_j) - e_k) h_j^T (zeros for classes with no sample).
    Differentiable in `features` and `weight`.
    """
    k = weight.shape[0]
    err = F.softmax(features @ weight.T, dim=1) - F.one_hot(labels, k).to(features.dtype)  # (n, K)
    onehot = F.one_hot(labels, k).to(features.dtype)  # (n, K) class membership
    counts = onehot.sum(0).clamp_min(1.0)  # (K,)
    # z[c] = sum_j [y_j = c] err_j^T h_j / n_c
    return torch.einsum("jc,jk,jd->ckd", onehot, err, features) / counts.view(-1, 1, 1)


def aggregate_class_gradients(uploads: Sequence[Mapping[int, torch.Tensor]]) -> dict[int, torch.Tensor]:
    """Eq. 17: z^k_glo = mean of z_i^k over exactly the clients that uploaded class k."""
    sums: dict[int, torch.Tensor] = {}
    counts: dict[int, int] = {}
    for upload in uploads:
        for k, z in upload.items():
            sums[k] = sums[k] + z if k in sums else z.clone()
            counts[k] = counts.get(k, 0) + 1
    return {k: sums[k] / counts[k] for k in sorted(sums)}


MATCH_DISTANCES = ("creff", "paper")


def gradient_distance(synth: torch.Tensor, real: torch.Tensor, form: str = "creff") -> torch.Tensor:
    """Distance of synthetic to real class gradients, both (n, K, d): one value per class.

    creff (CReFF's `distance_wb`): D_k = sum_r (1 - cos(z_hat^k_r, z^k_r)) over the K rows r of the
    weight gradient, each row compared on its own; paper (Eq. 20 as a distance):
    D_k = 1 - cos(vec z_hat^k, vec z^k), one cosine over the flattened gradient.
    """
    if form == "creff":
        return (1.0 - F.cosine_similarity(synth, real, dim=2, eps=1e-8)).sum(1)
    if form == "paper":
        return 1.0 - F.cosine_similarity(synth.flatten(1), real.flatten(1), dim=1, eps=1e-8)
    raise ValueError(f"unknown matching distance {form!r}; expected one of {MATCH_DISTANCES}")


def matching_terms(num_targets: int, num_classes: int, form: str = "creff") -> int:
    """How many cosine distances `gradient_matching_loss` adds up: |K_t| K (creff) or 1 (paper, a mean)."""
    return num_targets * num_classes if form == "creff" else 1


def gradient_matching_loss(
    features: torch.Tensor, weight: torch.Tensor, targets: Mapping[int, torch.Tensor], distance: str = "creff"
) -> torch.Tensor:
    """Eq. 20: distance of z_hat^k, the classifier gradient of the synthetic features features[k]
    (shape (K, m, d)) at `weight`, to the real z^k, over the classes k in `targets`:
    the sum over classes of D_k for 'creff' (CReFF), the mean over classes for 'paper' (Eq. 20)."""
    num_classes, m, d = features.shape
    labels = torch.arange(num_classes, device=features.device).repeat_interleave(m)
    z_hat = class_gradients(weight, features.reshape(-1, d), labels)
    ks = sorted(targets)
    real = torch.stack([targets[k].to(features.device, features.dtype) for k in ks])
    per_class = gradient_distance(z_hat[ks], real, distance)
    return per_class.sum() if distance == "creff" else per_class.mean()


def synthesize_features(
    features: torch.Tensor,
    weight: torch.Tensor,
    targets: Mapping[int, torch.Tensor],
    lr: float = 1.0,
    iterations: int = 100,
    distance: str = "creff",
) -> tuple[torch.Tensor, list[float]]:
    """Eqs. 18-20: SGD on the synthetic features (K, m, d) to match the real per-class gradients,
    the classifier `weight` frozen (the one the clients computed z^k with).

    Returns the new features and, per iteration, the mean cosine distance per compared vector
    (the loss / `matching_terms`, in [0, 2]: 1 for orthogonal gradients, 0 when matched)."""
    if not targets or iterations == 0:
        return features.detach().clone(), []
    weight = weight.detach()
    terms = matching_terms(len(targets), weight.shape[0], distance)
    h = features.detach().clone().requires_grad_(True)
    opt = torch.optim.SGD([h], lr=lr)
    losses = []
    for _ in range(iterations):
        loss = gradient_matching_loss(h, weight, targets, distance)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()) / terms)
    return h.detach(), losses


def finetune_classifier(
    classifier: nn.Linear,
    features: torch.Tensor,
    labels: torch.Tensor,
    epochs: int,
    batch_size: int,
    lr: float,
    generator: torch.Generator,
) -> float:
    """Eq. 21: `epochs` passes of plain SGD with CE on (features, labels), classifier only.

    Returns the mean loss (NaN when nothing was trained)."""
    if epochs <= 0 or len(labels) == 0:
        return float("nan")
    device = classifier.weight.device
    features, labels = features.to(device), labels.to(device)
    opt = torch.optim.SGD(classifier.parameters(), lr=lr)
    total, steps = torch.zeros((), dtype=torch.float64, device=device), 0  # summed in double, as floats were
    for _ in range(epochs):
        for idx in minibatches(len(labels), batch_size, generator, device):
            loss = F.cross_entropy(classifier(features[idx]), labels[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.detach()
            steps += 1
    return float(total) / steps


def bavd_map_size(model: nn.Module, info: Any) -> int:
    """Length of a client's flattened BAVD maps: the activations (channels x positions) of every
    layer `attach_bavd` hooks in `model`, measured on one blank batch; 0 when it hooks none."""
    model = copy.deepcopy(model).train()
    layers = attach_bavd(model)
    with torch.no_grad():
        model(torch.zeros(2, info.channels, info.size, info.size))
    return sum(layer.h_bar.numel() for layer in layers)
