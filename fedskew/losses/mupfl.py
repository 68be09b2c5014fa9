"""MuPFL's client and server maths (Zhang et al., "Multi-level Personalized Federated Learning on
Heterogeneous and Long-Tailed Data"), pure torch. The paper has no public code: where it is silent
the choice is ours; the readings, the paper's words behind each and the runs that chose the
defaults are in `docs/notes/mupfl.md` ("The maths' readings").

BAVD, biased activation value dropout (Sec. 3.3, Eq. 6). Per BAVD layer a map M, accumulated per
iteration lambda from the batch-mean pre-mask activation h_bar (C x H x W):

    M^(0) = h_bar^(0),    M^(lambda) = M^(lambda-1) + psi^(lambda) h_bar^(lambda),
    psi^(lambda) = l^(lambda-1) - l^(lambda)    (loss improvement; "paper" takes Eq. 6's printed sign)

The map is what ACMU compares (Eq. 8). The mask (`mupfl-bavd-mask`, `BAVD_READINGS`; Eq. 6, Sec. 3.3,
Sec. 3.6 and Fig. 4 do not pin one rule down), each {0, 1}: "batch", one mask for every sample where
the min-max normalised map is >= its per-channel mean (`bavd_mask`); "sample-mean", each sample's
own normalised activations below their mean (`sample_mean_mask`); "sample-topk" (default), each
sample-channel slice keeps its ceil(K H W) largest (`sample_topk_mask`, K = `mupfl-bavd-top`, Sec.
3.6's torch.topk); "map-threshold", the map's channel mean applied to each sample's normalised
activations (`map_threshold_mask`). `mupfl-bavd-rescale` scales the kept values by positions / kept
(inverted dropout). Identity in eval mode; `dropped_fractions` records the positions and the mass
zeroed. Forward hooks (`attach_bavd`, state_dict unchanged) at `mupfl-bavd-site`: after every
conv-block ReLU and ResNet block ("convs", Sec. 3.3), the last only ("last-conv"), or the
classifier's input ("features", default; the only site of an mlp).

PKCF, prior-knowledge classifier fine-tuning (Sec. 3.5, Eqs. 16-21). The classifier is a bias-free
W in R^{K x d}, so the real feature gradient of class k has the closed form (tested against autograd)

    z^k = d/dW mean_j CE(W h_j, k) = mean_j (softmax(W h_j) - e_k) h_j^T          (Eq. 16)

The server averages z^k over the clients holding k (Eq. 17) and moves h_glo in R^{K x m x d} by SGD
so that its gradients z_hat^k, taken at the same W, match (Eqs. 18-20; `mupfl-distance`):

    L_match = sum_{k in K_t} sum_{r=1..K} (1 - cos(z_hat^k_r, z^k_r))     ("creff": CReFF's distance_wb)
    L_match = 1/|K_t| sum_{k in K_t} (1 - cos(vec z_hat^k, vec z^k))       ("paper": Eq. 20)

cos is `F.cosine_similarity` (norms floored at 1e-8; CReFF's code: ||a|| ||b|| + 1e-6). The default
is CReFF's form at lr 1.0: Eq. 20's mean of |K_t| cosines gives each feature a gradient about 100x
smaller than CReFF's sum, which at lr 0.1 leaves the features where they start. The reported loss
(`pkcf-match-loss-first/last`) is the mean distance per compared vector, in [0, 2]. h_glo starts
(`mupfl-feature-init`) as the global extractor's outputs on N(0, 1) inputs ("extractor", default,
Eq. 18), N(0, 1) ("normal", CReFF's code) or N(0, 1) rescaled to the real features' norm. The
clients then fine-tune their classifier on (h_glo, y) for tau epochs (Eq. 21).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fedskew.models import BasicBlock
from fedskew.training import minibatches

# ----------------------------------------------------------------------------- BAVD

BAVD_READINGS = ("batch", "sample-mean", "sample-topk", "map-threshold")
BAVD_SITES = ("convs", "last-conv", "features")


def _slices(x: torch.Tensor, batched: bool) -> torch.Tensor:
    """`x` as (slices, positions). A map (C, *spatial) has one slice per channel, a 1-D map (D,) one
    slice; a batch (B, C, *spatial) one per sample and channel (row b C + c), a batch (B, D) one per
    sample."""
    if batched:
        return x.reshape(x.shape[0] * x.shape[1], -1) if x.dim() >= 3 else x.reshape(x.shape[0], -1)
    return x.reshape(x.shape[0], -1) if x.dim() >= 2 else x.reshape(1, -1)


def _minmax(flat: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """Each row min-max normalised to [0, 1]; a constant row (the zero map, a dead channel) is all 0."""
    lo, hi = flat.min(1, keepdim=True).values, flat.max(1, keepdim=True).values
    span = hi - lo
    return torch.where(span > eps, (flat - lo) / span.clamp_min(eps), torch.zeros_like(flat))


def _as_mask(keep: torch.Tensor, rescale: bool, like: torch.Tensor) -> torch.Tensor:
    """{0,1} rows `keep` (slices, positions) as a mask shaped like `like`; with `rescale` each row's
    kept positions are (positions / kept) instead of 1 (inverted dropout: a row sums to its size)."""
    keep = keep.float()
    if rescale:
        keep = keep * (keep.shape[1] / keep.sum(1, keepdim=True).clamp_min(1.0))
    return keep.to(like.dtype).reshape(like.shape)


def _above_mean(flat: torch.Tensor) -> torch.Tensor:
    """Rows' positions whose min-max normalised value is >= the row's normalised mean (a constant row
    keeps everything, every row keeps at least its maximum)."""
    norm = _minmax(flat)
    return norm >= norm.mean(1, keepdim=True) - 1e-6


def bavd_mask(activation_map: torch.Tensor, rescale: bool = False) -> torch.Tensor:
    """Reading "batch": {0,1} mask of the positions where the min-max normalised map is >= its mean,
    one mask for every sample of the batch (with `rescale`: inverted dropout, `_as_mask`).

    A map of shape (C, *spatial) is thresholded per channel over its spatial positions, a 1-D map
    (D,) over all D units. A constant slice (e.g. the zero initial map) keeps every position, and
    every slice keeps at least its maximum.
    """
    m = activation_map.detach().float()
    return _as_mask(_above_mean(_slices(m, batched=False)), rescale, activation_map)


def sample_mean_mask(h: torch.Tensor, rescale: bool = False) -> torch.Tensor:
    """Reading "sample-mean": each sample's own activations h_b (B, C, *spatial) or (B, D), min-max
    normalised per sample and channel, zeroed below their own mean (Sec. 3.3: "activation values h
    below this threshold ... are zeroed"; Eq. 6 indexes h and M by the sample b). A mask per sample."""
    flat = _slices(h.detach().float(), batched=True)
    return _as_mask(_above_mean(flat), rescale, h)


def sample_topk_mask(h: torch.Tensor, top: float, rescale: bool = False) -> torch.Tensor:
    """Reading "sample-topk" (Sec. 3.6: torch.topk finds "the top K values in each H x W area of the
    batch and channel dimensions ... across all B x C slices"): each sample and channel keeps its
    ceil(top x H W) largest activations (the paper never gives K); for (B, D) features, per sample."""
    if not 0.0 < top <= 1.0:
        raise ValueError(f"top={top} must be in (0, 1]")
    flat = _slices(h.detach().float(), batched=True)
    k = max(1, math.ceil(top * flat.shape[1]))
    keep = torch.zeros_like(flat).scatter(1, flat.topk(k, dim=1).indices, 1.0)  # out of place: vmap's rule
    return _as_mask(keep, rescale, h)


def map_threshold_mask(h: torch.Tensor, activation_map: torch.Tensor, rescale: bool = False) -> torch.Tensor:
    """Reading "map-threshold" (Sec. 3.3: the mean mu_i of the normalised map M^norm "utilized as a
    threshold", activations h below it zeroed): mu_c = mean of channel c of the min-max normalised
    map, applied to each sample's own min-max normalised activations h^norm_bc (keep h^norm >= mu_c).
    The map sets the level, the sample which positions pass it."""
    mu = _minmax(_slices(activation_map.detach().float(), batched=False)).mean(1)  # (C,) or (1,)
    flat = _minmax(_slices(h.detach().float(), batched=True))  # rows b C + c
    return _as_mask(flat >= mu.repeat(h.shape[0]).unsqueeze(1) - 1e-6, rescale, h)


def dropped_fractions(h: torch.Tensor, mask: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """(fraction of positions, fraction of activation mass sum |h|) that `mask` (broadcast to h's
    shape: a batch map's mask is one for all samples) zeroes, as a 2-vector; with `weight` (one per
    sample, 0 on a stacked batch's padding) over the samples of weight > 0 (the count of dropped
    positions is exact in float32, so their fraction is the unweighted one's)."""
    h = h.detach().abs().float()
    dropped = (mask == 0).expand_as(h)
    if weight is None:
        mass = (h * dropped).sum() / h.sum().clamp_min(1e-12)
        return torch.stack([dropped.float().mean(), mass])
    real = (weight > 0).float().view(-1, *([1] * (h.dim() - 1)))
    positions = (dropped * real).sum() / (real.sum() * math.prod(h.shape[1:]))
    return torch.stack([positions, (h * dropped * real).sum() / (h * real).sum().clamp_min(1e-12)])


def batch_mean(h: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """h_bar: the batch mean of the activations `h` (detached), or with `weight` (1/b on a stacked
    batch's b examples, 0 on its padding) their weighted sum: the mean of the b examples."""
    h = h.detach()
    return h.mean(0) if weight is None else (h * weight.to(h.dtype).view(-1, *([1] * (h.dim() - 1)))).sum(0)


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


def bavd_fold(
    activation_map: torch.Tensor, h_bar: torch.Tensor, fresh: torch.Tensor, psi: torch.Tensor
) -> torch.Tensor:
    """`bavd_update` in tensor form, for the batched engine: h_bar where `fresh` (iteration 0, or no
    map yet), else M + psi h_bar."""
    return torch.where(fresh, h_bar, activation_map + psi * h_bar)


def bavd_keep(
    h: torch.Tensor, activation_map: torch.Tensor | None, reading: str, top: float, rescale: bool
) -> torch.Tensor | None:
    """The mask of the batch `h` under `reading` (`BAVD_READINGS`); None (keep all) while a map-based
    reading ("batch", "map-threshold") has no map yet. A zero map keeps every position (its slices
    are constant: `_minmax`), as no map does."""
    if reading == "sample-mean":
        return sample_mean_mask(h, rescale)
    if reading == "sample-topk":
        return sample_topk_mask(h, top, rescale)
    if activation_map is None:
        return None
    if reading == "map-threshold":
        return map_threshold_mask(h, activation_map.to(h.device), rescale)
    return bavd_mask(activation_map, rescale)


MAP_READINGS = ("batch", "map-threshold")  # the readings whose mask reads the map


def bavd_pass(
    h: torch.Tensor, activation_map: torch.Tensor, reading: str, top: float, rescale: bool, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A BAVD layer's training pass in functional form (the batched engine's; `BAVD.forward` on a
    module): (the masked activations, h_bar, the `dropped_fractions`) of the stacked batch `h`, its
    samples weighted by `weight` (0 on padding), masked under `reading` with `activation_map` (zeros
    while there is none: every position kept)."""
    keep = bavd_keep(h, activation_map, reading, top, rescale)
    assert keep is not None  # a map is always given here
    keep = keep.to(h.device)
    return h * keep, batch_mean(h, weight), dropped_fractions(h, keep, weight)


class BAVD(nn.Module):
    """Biased activation value dropout with its activation map (not a parameter, not in state_dict).

    In train mode, `forward` caches the batch mean of its input (pre-mask, detached) and multiplies
    the input by the mask of its `reading` (`BAVD_READINGS`; the batch-map mask is `self.mask()`);
    `update(iteration, psi)` then folds the cached mean into the map (Eq. 6), whichever the reading
    (the map is also what ACMU compares). `dropped()` is the mean over the masked passes of the
    fraction of positions and of activation mass the masks zeroed. In eval mode it is the identity.
    """

    def __init__(self, rescale: bool = False, reading: str = "batch", top: float = 0.5) -> None:
        super().__init__()
        if reading not in BAVD_READINGS:
            raise ValueError(f"reading={reading!r} must be one of {BAVD_READINGS}")
        self.rescale, self.reading, self.top = rescale, reading, top
        self.map: torch.Tensor | None = None
        self.h_bar: torch.Tensor | None = None
        self.seconds = 0.0  # wall time spent in BAVD (mask + map update), for the per-module timing
        self.dropped_sum: torch.Tensor | None = None  # summed dropped_fractions of the masked passes
        self.masked = 0

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return h
        t0 = time.perf_counter()
        self.h_bar = batch_mean(h)
        keep = self.keep(h)
        out = h
        if keep is not None:
            keep = keep.to(h.device)
            out = h * keep
            frac = dropped_fractions(h, keep)
            self.dropped_sum = frac if self.dropped_sum is None else self.dropped_sum + frac
            self.masked += 1
        self.seconds += time.perf_counter() - t0
        return out

    def keep(self, h: torch.Tensor) -> torch.Tensor | None:
        """The mask of this batch under the layer's reading; None (keep all) while a map-based
        reading has no map yet (`bavd_keep`; the batch-map mask by `mask`, which a reading may override)."""
        if self.reading == "batch" and self.map is not None:
            return self.mask()
        return bavd_keep(h, self.map, self.reading, self.top, self.rescale)

    def mask(self) -> torch.Tensor:
        """The batch-map mask (reading "batch", Eq. 5): `bavd_mask` of the current map."""
        return bavd_mask(self.map, self.rescale)

    def dropped(self) -> tuple[float, float] | None:
        """(positions, activation mass) zeroed, each the mean fraction over the masked passes; None
        when no pass was masked."""
        if self.dropped_sum is None:
            return None
        positions, mass = (self.dropped_sum / self.masked).tolist()
        return positions, mass

    def update(self, iteration: int, psi: float) -> None:
        if self.h_bar is not None:
            t0 = time.perf_counter()
            self.map = bavd_update(self.map, self.h_bar, iteration, psi)
            self.h_bar = None
            self.seconds += time.perf_counter() - t0


def _bavd_targets(model: nn.Module, site: str = "convs") -> list[nn.Module]:
    """The modules whose outputs BAVD masks: "convs", every conv-block ReLU (a ReLU after a Conv2d or
    BatchNorm2d inside an nn.Sequential) and ResNet BasicBlock; "last-conv", the last of those;
    "features", the network's feature extractor (its flattened output, the classifier's input)."""
    if site not in BAVD_SITES:
        raise ValueError(f"site={site!r} must be one of {BAVD_SITES}")
    if site == "features":
        return [model.features]
    targets: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, BasicBlock):
            targets.append(module)
        if isinstance(module, nn.Sequential):
            children = list(module.children())
            for prev, cur in itertools.pairwise(children):
                if isinstance(cur, nn.ReLU) and isinstance(prev, (nn.Conv2d, nn.BatchNorm2d)):
                    targets.append(cur)
    return targets[-1:] if site == "last-conv" else targets


def attach_bavd(model: nn.Module, make: Callable[[], BAVD] = BAVD, site: str = "convs") -> list[BAVD]:
    """Hook a BAVD layer (`make()`) on the outputs of the `site`'s modules (`_bavd_targets`); return
    the layers. A hooked layer follows the train/eval mode of the module it is attached to.
    """
    layers = []
    for target in _bavd_targets(model, site):
        layer = make()

        def hook(module: nn.Module, _inputs: tuple, output: torch.Tensor, layer: BAVD = layer) -> torch.Tensor:
            layer.train(module.training)
            return layer(output)

        target.register_forward_hook(hook)
        layers.append(layer)
    return layers


@contextlib.contextmanager
def bavd_hooks(model: nn.Module, site: str, apply: Callable[[int, torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """While open: the output of the j-th module BAVD hooks at `site` in `model` (`_bavd_targets`) is
    `apply(j, output)` (the batched engine's BAVD, `bavd_pass`, on a network without layers of its own)."""
    handles = [
        target.register_forward_hook(lambda _m, _i, out, j=j: apply(j, out))
        for j, target in enumerate(_bavd_targets(model, site))
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


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
COSINES = ("torch", "creff-code")  # the cosine's denominator (`cosine`)
FEATURE_INITS = ("normal", "extractor", "rescaled")


def initial_features(
    init: str,
    shape: tuple[int, int, int],
    generator: torch.Generator,
    extractor: nn.Module | None = None,
    input_shape: tuple[int, ...] = (),
    real_norm: float = float("nan"),
) -> torch.Tensor:
    """The synthetic features h_glo (K, m, d) before their first synthesis, drawn from `generator`:

    - "normal": N(0, 1) (CReFF's code), each feature of norm about sqrt(d);
    - "extractor": the global feature extractor's outputs, h_glo = f_glo(x; u_glo) (Sec. 3.5, Eq.
      18: "we can initiate the global federated feature h_glo = f_glo(u_glo)"), on K m inputs
      x ~ N(0, 1) of shape `input_shape` (the server holds no data and the paper names no inputs;
      the images are standardised, so N(0, 1) pixels are in their range), in eval mode;
    - "rescaled": N(0, 1) with every feature scaled to the norm `real_norm` (the clients' real features').
    """
    k, m, d = shape
    if init == "extractor":
        if extractor is None:
            raise ValueError("init 'extractor' needs the global extractor")
        device = next(extractor.parameters()).device
        x = torch.randn(k * m, *input_shape, generator=generator).to(device)
        was_training = extractor.training
        with torch.no_grad():
            h = extractor.eval()(x)
        extractor.train(was_training)
        return h.reshape(k, m, d)
    h = torch.randn(shape, generator=generator)
    if init == "rescaled":
        if not math.isfinite(real_norm) or real_norm < 0:
            raise ValueError(f"init 'rescaled' needs a finite real-feature norm >= 0, got {real_norm}")
        return F.normalize(h, dim=2) * real_norm
    if init != "normal":
        raise ValueError(f"init={init!r} must be one of {FEATURE_INITS}")
    return h


def feature_norm(features: torch.Tensor) -> float:
    """The mean Euclidean norm of the features (rows of the last dimension)."""
    return float(features.detach().norm(dim=-1).mean())


def cosine_similarity(a: torch.Tensor, b: torch.Tensor, dim: int, cosine: str = "torch") -> torch.Tensor:
    """cos(a, b) along `dim`. "torch": `F.cosine_similarity` with eps 1e-8, <a, b> / (max(||a||, eps)
    max(||b||, eps)) (MuPFL's, as its runs were recorded); "creff-code": <a, b> / (||a|| ||b|| + 1e-6),
    CReFF's code (shangxinyi/CReFF-FL, Dataset/Gradient_matching_loss.py `distance_wb`). The two
    differ where ||a|| ||b|| is not far above 1e-6, e.g. the near-zero gradient rows of a confident
    classifier."""
    if cosine == "torch":
        return F.cosine_similarity(a, b, dim=dim, eps=1e-8)
    if cosine == "creff-code":
        return (a * b).sum(dim) / (torch.linalg.vector_norm(a, dim=dim) * torch.linalg.vector_norm(b, dim=dim) + 1e-6)
    raise ValueError(f"unknown cosine {cosine!r}; expected one of {COSINES}")


def gradient_distance(
    synth: torch.Tensor, real: torch.Tensor, form: str = "creff", cosine: str = "torch"
) -> torch.Tensor:
    """Distance of synthetic to real class gradients, both (n, K, d): one value per class.

    creff (CReFF's `distance_wb`): D_k = sum_r (1 - cos(z_hat^k_r, z^k_r)) over the K rows r of the
    weight gradient, each row compared on its own; paper (Eq. 20 as a distance):
    D_k = 1 - cos(vec z_hat^k, vec z^k), one cosine over the flattened gradient. `cosine`: the
    cosine's arithmetic (`cosine_similarity`).
    """
    if form == "creff":
        return (1.0 - cosine_similarity(synth, real, 2, cosine)).sum(1)
    if form == "paper":
        return 1.0 - cosine_similarity(synth.flatten(1), real.flatten(1), 1, cosine)
    raise ValueError(f"unknown matching distance {form!r}; expected one of {MATCH_DISTANCES}")


def matching_terms(num_targets: int, num_classes: int, form: str = "creff") -> int:
    """How many cosine distances `gradient_matching_loss` adds up: |K_t| K (creff) or 1 (paper, a mean)."""
    return num_targets * num_classes if form == "creff" else 1


def gradient_matching_loss(
    features: torch.Tensor,
    weight: torch.Tensor,
    targets: Mapping[int, torch.Tensor],
    distance: str = "creff",
    cosine: str = "torch",
) -> torch.Tensor:
    """Eq. 20: distance of z_hat^k, the classifier gradient of the synthetic features features[k]
    (shape (K, m, d)) at `weight`, to the real z^k, over the classes k in `targets`:
    the sum over classes of D_k for 'creff' (CReFF), the mean over classes for 'paper' (Eq. 20)."""
    num_classes, m, d = features.shape
    labels = torch.arange(num_classes, device=features.device).repeat_interleave(m)
    z_hat = class_gradients(weight, features.reshape(-1, d), labels)
    ks = sorted(targets)
    real = torch.stack([targets[k].to(features.device, features.dtype) for k in ks])
    per_class = gradient_distance(z_hat[ks], real, distance, cosine)
    return per_class.sum() if distance == "creff" else per_class.mean()


def synthesize_features(
    features: torch.Tensor,
    weight: torch.Tensor,
    targets: Mapping[int, torch.Tensor],
    lr: float = 1.0,
    iterations: int = 100,
    distance: str = "creff",
    cosine: str = "torch",
) -> tuple[torch.Tensor, list[float]]:
    """Eqs. 18-20: SGD on the synthetic features (K, m, d) to match the real per-class gradients,
    the classifier `weight` frozen (the one the clients computed z^k with); `cosine`: MuPFL's
    "torch", CReFF's "creff-code" (`cosine_similarity`).

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
        loss = gradient_matching_loss(h, weight, targets, distance, cosine)
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


def bavd_shapes(model: nn.Module, info: Any, site: str = "convs") -> list[torch.Size]:
    """The shapes of the BAVD maps of the layers `attach_bavd` hooks at `site` in `model` (the
    activations' channels x positions), measured on one blank batch on the model's device and dtype."""
    model = copy.deepcopy(model).train()
    layers = attach_bavd(model, site=site)
    first = next(model.parameters())
    with torch.no_grad():
        model(torch.zeros(2, info.channels, info.size, info.size, device=first.device, dtype=first.dtype))
    return [layer.h_bar.shape for layer in layers]


def bavd_map_size(model: nn.Module, info: Any, site: str = "convs") -> int:
    """Length of a client's flattened BAVD maps (`bavd_shapes`); 0 when BAVD hooks no layer at `site`."""
    return sum(math.prod(shape) for shape in bavd_shapes(model, info, site))
