"""CReFF's maths (Shang, Lu, Huang & Wang, "Federated Learning on Heterogeneous and Long-Tailed Data
via Classifier Re-Training with Federated Features", IJCAI 2022), pure torch. Server:
`fedskew/strategies/creff.py`; client: `fedskew/client_app/creff.py`. Read in the authors' code,
shangxinyi/CReFF-FL at commit fbec98f1a49dfb8d9f346d98bf3f9568d9004687 (`main.py`, `options.py`,
`Dataset/Gradient_matching_loss.py`).

The synthesis is MuPFL's PKCF, which follows CReFF, and is reused from `fedskew/losses/mupfl.py`:
per class k held by client i, the "real feature gradient" of the classifier W (bias-free here)

    z_i^k = d/dW mean_j CE(W h_j, k)                    (`class_gradients`, closed form)

is averaged over the clients that hold k, z^k = mean_i z_i^k (`aggregate_class_gradients`, the
code's uniform `1 / len(...)`), and the federated features S (K x m x d, N(0, 1) at start, kept and
warm-started across rounds, the code's `feature_syn`) take `creff-match-iters` SGD steps on

    L_match = sum_k sum_r (1 - cos(z_hat^k_r, z^k_r))   (`synthesize_features`, distance "creff")

(the code's `match_loss` with `dis_metric="ours"`: `distance_wb` per row of each class gradient,
summed over rows and classes, its cosine <a, b> / (|a| |b| + 1e-6): `cosine="creff-code"`), z_hat^k
the gradient of S_k at the same classifier W. Then a *fresh*
classifier (the code builds `nn.Linear(256, 10)` every round: PyTorch's default initialisation,
U(-1/sqrt(d), 1/sqrt(d))) is trained on all K m features with their labels (a class no client has
uploaded a gradient for yet keeps its N(0, 1) features, as in the code), `creff-retrain-epochs`
epochs of plain SGD (`finetune_classifier`), batch = the local batch size (the code passes
`batch_size_local_training`): `retrain_classifier`.

CReFF's defaults (`options.py`), which differ from MuPFL's PKCF defaults: m = 100 features per class
(MuPFL 20), feature lr 0.1 (MuPFL 1.0, its measured choice), re-training 300 epochs at lr 0.01 on a
fresh classifier (MuPFL: the clients fine-tune their own classifier 30 epochs at the local lr), and
real gradients from 10 draws of 32 samples per class (MuPFL: one draw of 64); both run 100 matching
iterations.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from fedskew.losses.mupfl import finetune_classifier


def fresh_classifier(num_classes: int, feature_dim: int, generator: torch.Generator) -> torch.Tensor:
    """W (K x d) ~ U(-1/sqrt(d), 1/sqrt(d)): the distribution of a new `nn.Linear(d, K)`'s weight,
    drawn from `generator`."""
    bound = 1.0 / math.sqrt(feature_dim)
    return (torch.rand(num_classes, feature_dim, generator=generator) * 2.0 - 1.0) * bound


def retrain_classifier(
    features: torch.Tensor, epochs: int, batch_size: int, lr: float, generator: torch.Generator
) -> tuple[torch.Tensor, float]:
    """A fresh bias-free classifier trained on the federated features (K, m, d), features[k] of
    label k: `epochs` of plain SGD with cross-entropy. Returns its weight (K, d) and the mean loss."""
    num_classes, m, d = features.shape
    classifier = nn.Linear(d, num_classes, bias=False).to(features.device)
    with torch.no_grad():
        classifier.weight.copy_(fresh_classifier(num_classes, d, generator))
    labels = torch.arange(num_classes, device=features.device).repeat_interleave(m)
    loss = finetune_classifier(classifier, features.detach().reshape(-1, d), labels, epochs, batch_size, lr, generator)
    return classifier.weight.detach(), loss
