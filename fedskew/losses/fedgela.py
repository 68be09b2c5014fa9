"""FedGELA maths (Fan et al., "Federated Learning with Bilateral Curation for Partially
Class-Disjoint Data", NeurIPS'23): a globally fixed simplex ETF classifier, locally adapted.

    M     = sqrt(C/(C-1)) U (I_C - 1 1^T / C),   U in R^{d x C}, U^T U = I_C          (§3.1)
    W^L   = sqrt(E_W) M            (global classifier, frozen, never aggregated)        (§3.3)
    phi_k,c = n_{k,c} / (n_k gamma) = C n_{k,c} / n_k,   W^L_k = W^L diag(phi_k)         (Eq. 4)
    z_c   = sqrt(E_W) phi_k,c m_c^T h / ||h||       (features L2-normalised: E_H = 1)     (Eq. 5)

Decisions where the paper is silent or the authors' code differs:

- ETF for d = C-1 (the paper's formula needs d >= C): M = sqrt(C/(C-1)) R B^T with B an orthonormal
  basis of 1_C^perp and R a random orthogonal (d x d) matrix; d < C-1 raises.
- U is drawn as the reduced QR of a uniform (d, C) matrix from `np.random.default_rng(seed)` (the
  authors' code draws `np.random.random` too); computed in float64, returned float32.
- Phi_k is a per-column scaling, not a matrix product (matching the authors' code), with
  gamma = 1/C multiplying by C.
- Softmax support: Eq. (5) normalises over the local classes C_k only (`mode="local"`,
  missing logits -inf). That loss is identically 0 on a single-class client, which then never
  learns, so the default is the authors' code: `mode="all"`, a C-way softmax in which missing
  classes have logit exactly 0 (phi = 0). "local" is kept as the paper's literal variant. The
  same mode is used for training and for personalized inference.
- Feature head. Default `head="paper"`: the backbone is the network's features followed
  by one FC layer Linear(d, d) ("ResNet18 with one FC layer as the backbone", §5), its output is
  L2-normalised ("we normalize features with length 1", E_H = 1) and the logits are scaled by
  s = sqrt(E_W). The FC layer is needed because fedskew's backbones end in a ReLU: features
  h >= 0 have cos(h, m_c) <= ||max(m_c, 0)||, which is 0.05 for class 0 of LeNet's 84 x 10 ETF,
  so a plain L2 head cannot reach the ETF of Theorem 1. For a model with a linear classifier
  (FedAvg) the same layer would only re-parametrise the classifier; here it is trained and
  communicated with the backbone. Large s * phi gives large gradients, so the client clips the
  gradient norm (20, as the authors' code).
- `head="code"` is the authors' code exactly (`model.py`, `FedGELA.py` `train_net`): features,
  their `encoder` Linear(d, d) - ReLU - Linear(d, d), their "etf" proxy BatchNorm1d(d), no L2
  step, logits (phi * M)^T h / T with `temperature` T (their default 0.2; E_W is unused), a C-way
  softmax and clipping at 20. Evaluated as their `compute_accuracy_g` / `compute_accuracy_l`
  (`MediaBrain-SJTU/FedGELA` commit b5b20d5): the logits h^T (phi * M) are not divided by T, so the
  predictions are those of the trained logits and the logged losses (cross-entropy of those
  logits, as their `compute_accuracy_g`) are theirs; their `compute_accuracy_l` logs NLLLoss of the
  raw logits (-logit_y, not a loss), which is not copied. Its loss and gradients equal a re-statement of `train_net`
  (`tests/test_fedgela.py`). Deviation: a training batch of one sample uses the running statistics
  (their loader drops the last batch). Under label skew the averaged BatchNorm running statistics
  are miscalibrated for the balanced test set, which is why this is not the default.
- E_W = 300 (`fedgela-ew`), from the sweep `suites/fmnist-fedgela-ew.yaml`, below the paper's tuned
  range 1e3..1e6 (ResNet-18, 10 local epochs); the logits are sqrt(E_W) times a cosine, so E_W
  scales the cross-entropy's gradient. The sweep, the paper's range at its own protocol
  (`suites/paper-fedgela.yaml`) and the reasoning: `docs/notes/fedgela.md` ("E_W").
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedskew.data import dataset_info
from fedskew.models import build_model

MODES = ("all", "local")
HEADS = ("paper", "code")


def make_etf(d: int, num_classes: int, seed: int) -> torch.Tensor:
    """A random simplex ETF `[d, C]` float32: unit columns, pairwise cosine -1/(C-1), M 1_C = 0.

    d >= C: sqrt(C/(C-1)) U (I - 11^T/C) with U the reduced QR of a seeded uniform matrix;
    d == C-1: sqrt(C/(C-1)) R B^T (B: orthonormal basis of 1^perp, R: random orthogonal).
    """
    c = num_classes
    if c < 2:
        raise ValueError(f"a simplex ETF needs at least 2 classes, got {c}")
    rng = np.random.default_rng(seed)
    centre = np.eye(c) - np.ones((c, c)) / c
    if d >= c:
        u, _ = np.linalg.qr(rng.random((d, c)))
        m = u @ centre
    elif d == c - 1:
        basis = np.linalg.svd(centre)[0][:, : c - 1]  # columns span 1^perp
        r, _ = np.linalg.qr(rng.standard_normal((d, d)))
        m = r @ basis.T
    else:
        raise ValueError(f"a simplex ETF of {c} classes needs feature dim d >= {c - 1}, got d={d}")
    return torch.from_numpy(np.sqrt(c / (c - 1)) * m).to(torch.float32).contiguous()


def is_simplex_etf(m: torch.Tensor, atol: float = 1e-4) -> bool:
    """Whether `m` `[d, C]` is a simplex ETF: M^T M = C/(C-1) (I - 11^T/C), i.e. unit columns with
    pairwise cosine -1/(C-1) (Fan et al., NeurIPS'23, Def. 1), within `atol`."""
    c = m.shape[1]
    if c < 2:
        return False
    gram = m.double().T @ m.double()
    want = (torch.eye(c, dtype=torch.float64) - 1.0 / c) * (c / (c - 1))
    return bool(torch.allclose(gram, want, atol=atol, rtol=0.0))


def etf_checksum(etf: torch.Tensor) -> str:
    """SHA-256 of the matrix's float32 bytes (shape included): equal checksums = identical matrices."""
    a = etf.detach().cpu().to(torch.float32).contiguous().numpy()
    return hashlib.sha256(str(tuple(a.shape)).encode() + a.tobytes()).hexdigest()


def local_phi(counts: np.ndarray | torch.Tensor) -> torch.Tensor:
    """phi_k = C n_{k,c} / n_k `[C]` from the client's own training label counts (sums to C)."""
    n = torch.as_tensor(np.asarray(counts), dtype=torch.float32)
    total = n.sum()
    if total <= 0:
        raise ValueError("local_phi needs at least one training sample")
    return len(n) * n / total


def gela_logits(
    features: torch.Tensor,
    etf: torch.Tensor,
    scale: float,
    phi: torch.Tensor | None = None,
    mode: str = "all",
    normalize: bool = True,
) -> torch.Tensor:
    """`[B, C]` logits z_c = s * phi_c * m_c^T f(h); phi=None gives the global (plain ETF) logits.

    f(h) = h / ||h|| (the paper's E_H = 1) when `normalize`, else h (the authors' code).
    mode "all": missing classes (phi_c = 0) keep logit 0 in a C-way softmax (authors' code);
    mode "local": their logits are -inf, i.e. the softmax runs over C_k only (Eq. 5).
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} must be one of {MODES}")
    h = F.normalize(features, dim=1) if normalize else features
    z = scale * h @ etf
    if phi is None:
        return z
    z = z * phi.unsqueeze(0)
    if mode == "local":
        z = z.masked_fill(phi.unsqueeze(0) == 0, float("-inf"))
    return z


class _BatchNorm1dAnyBatch(nn.BatchNorm1d):
    """BatchNorm1d that uses its running statistics for a training batch of one sample."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and x.shape[0] == 1:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
        return super().forward(x)


def feature_head(feature_dim: int, head: str = "paper") -> nn.Module:
    """The trained layers between the network's features and the ETF, part of the backbone.

    "paper": one FC layer Linear(d, d) ("ResNet18 with one FC layer as the backbone", §5), whose
    output is L2-normalised in the logits; "code": the authors' `encoder` Linear(d, d) - ReLU -
    Linear(d, d) and their "etf" proxy BatchNorm1d(d), not normalised (`model.py`).
    """
    d = feature_dim
    if head == "paper":
        return nn.Linear(d, d)
    if head == "code":
        return nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d), _BatchNorm1dAnyBatch(d))
    raise ValueError(f"head={head!r} must be one of {HEADS}")


def logit_scale(head: str, ew: float, temperature: float, training: bool = True) -> float:
    """s = sqrt(E_W) for the paper's head (§3.3); for the authors' code s = 1 / T in training
    (`train_net`: `sfm(out_g / temperature)`) and 1 in evaluation (`compute_accuracy_g` /
    `compute_accuracy_l` take `out = h @ (phi * ETF)` as the logits, undivided)."""
    if head == "paper":
        return math.sqrt(ew)
    return 1.0 / temperature if training else 1.0


class ETFNet(nn.Module):
    """A backbone `features` followed by the frozen (optionally adapted) ETF classifier.

    The logits are scaled by `scale` in train mode and by `eval_scale` (default: `scale`) in eval
    mode: the authors' code divides by its temperature in training only (`logit_scale`).
    The ETF and phi are non-persistent buffers: they are no parameters (no gradient, no weight
    decay, not in the optimiser) and not in `state_dict()`, which therefore holds exactly the
    backbone's tensors (`features.*`), i.e. what is communicated.
    """

    def __init__(
        self,
        features: nn.Module,
        etf: torch.Tensor,
        scale: float,
        phi: torch.Tensor | None = None,
        mode: str = "all",
        normalize: bool = True,
        eval_scale: float | None = None,
    ) -> None:
        super().__init__()
        self.features = features
        self.scale = scale
        self.eval_scale = scale if eval_scale is None else eval_scale
        self.mode = mode
        self.normalize = normalize
        self.register_buffer("etf", etf.detach().clone(), persistent=False)
        self.register_buffer("phi", None if phi is None else phi.detach().clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.scale if self.training else self.eval_scale
        return gela_logits(self.features(x), self.etf, scale, self.phi, self.mode, self.normalize)

    def plain(self) -> ETFNet:
        """The same backbone (shared, not copied) with the plain ETF (phi = None): the global model."""
        return ETFNet(self.features, self.etf, self.scale, None, self.mode, self.normalize, self.eval_scale)

    def class_weights(self) -> torch.Tensor:
        """`[C, d]`: row c is class c's classifier vector s * phi_c * m_c (`gela_logits`; phi = 1
        without adaptation), the vector the normalised feature f(h) is scored against, s the scale
        of the current mode (the evaluation's for a model in eval mode, as `forward`)."""
        w = (self.scale if self.training else self.eval_scale) * self.etf
        return (w if self.phi is None else w * self.phi.unsqueeze(0)).T


def etf_net(
    trunk: nn.Module,
    feature_dim: int,
    etf: torch.Tensor,
    head: str,
    ew: float,
    temperature: float,
    phi: torch.Tensor | None = None,
    mode: str = "all",
) -> ETFNet:
    """FedGELA's network: backbone = `trunk` + `feature_head(head)`, classifier = the ETF."""
    backbone = nn.Sequential(trunk, feature_head(feature_dim, head))
    train, evaluation = logit_scale(head, ew, temperature), logit_scale(head, ew, temperature, training=False)
    return ETFNet(backbone, etf, train, phi, mode, normalize=head == "paper", eval_scale=evaluation)


def gela_model(cfg: dict[str, Any], etf: torch.Tensor, phi: torch.Tensor | None = None) -> ETFNet:
    """The run's FedGELA network (`fedgela-head`): a client's with its phi, the server's without."""
    net = build_model(cfg["model"], dataset_info(cfg))
    head, ew, temperature = cfg["fedgela-head"], cfg["fedgela-ew"], cfg["fedgela-temperature"]
    return etf_net(net.features, net.feature_dim, etf, head, ew, temperature, phi, cfg["fedgela-mode"])


def class_geometry(h: torch.Tensor, y: torch.Tensor, w: torch.Tensor, num_classes: int) -> dict[str, float]:
    """How close features `h [N, d]` with labels `y` and classifier vectors `w [C, d]` are to the
    simplex ETF that FedGELA fixes (the neural-collapse measures of Papyan et al., PNAS'20):

        within / between = (1/N) sum_i ||h_i - mu_{y_i}||^2  /  (1/C) sum_c ||mu_c - mu_G||^2
        cos(mu_c - mu_G, mu_c' - mu_G), c != c': their mean and std (a simplex ETF: all -1/(C-1))
        cos(mu_c - mu_G, w_c - w_G): the class mean against its classifier vector (1: aligned)

    with mu_c the class means, mu_G their mean and w_G the mean classifier vector (0 for an ETF).
    Classes absent from `y` are left out."""
    present = [c for c in range(num_classes) if bool((y == c).any())]
    if len(present) < 2:
        raise ValueError(f"class_geometry needs at least 2 classes in y, got {present}")
    h = h.double()
    means = torch.stack([h[y == c].mean(0) for c in present])
    within = sum(float(((h[y == c] - means[i]) ** 2).sum()) for i, c in enumerate(present)) / sum(
        int((y == c).sum()) for c in present
    )
    centred = means - means.mean(0)
    unit = F.normalize(centred, dim=1)
    cos = unit @ unit.T
    off = cos[~torch.eye(len(present), dtype=torch.bool)]
    wc = w.double()[present]
    align = (unit * F.normalize(wc - w.double().mean(0), dim=1)).sum(1)
    return {
        "within / between": within / float((centred**2).sum(1).mean()),
        "cos between class means": float(off.mean()),
        "std of those cosines": float(off.std()),
        "cos class mean / classifier": float(align.mean()),
    }
