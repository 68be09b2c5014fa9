"""FedGen's maths (Zhu, Hong & Zhou, "Data-Free Knowledge Distillation for Heterogeneous Federated
Learning", ICML 2021), pure torch. Server: `fedskew/strategies/fedgen.py`; client:
`fedskew/client_app/fedgen.py`. Read in the authors' code, zhuangdizhu/FedGen at commit
dd5807c5625404e99035d97e2ef8c712c2e007a6 (`FLAlgorithms/trainmodel/generator.py`,
`servers/serverpFedGen.py`, `users/userpFedGen.py`, `utils/model_config.py`). The reasons in full
and the runs: docs/notes/fedgen.md.

The generator G(z | y) maps noise and a label to the feature space of the shared network (the
input of its classifier: the authors' `latent_layer_idx = -1`):

    G(eps, y) = W_2 ReLU(BN(W_1 [eps, onehot(y)] + b_1)) + b_2,    eps ~ U[0, 1)^noise_dim

(`Generator`; hidden width 256, noise dimension 32: `GENERATORCONFIGS["mnist"]`; output width the
feature dimension d of the configured network; eps uniform, as the code's `torch.rand` draws it.)

Server, each round, after the clients answered (knowledge extraction): with n_k^y the label counts
client k uploaded, the per-class client weights are

    a_{y,k} = n_k^y / sum_k' n_k'^y                                   (`label_weights`)

and the generator minimises, on batches of labels y_i drawn uniformly from the labels some client
holds ("qualified labels") and fresh noise,

    L_G = 1/B sum_i sum_k a_{y_i,k} CE(W_k G(eps_i, y_i), y_i)  +  eta * L_div      (`teacher_loss`)

where W_k is client k's uploaded classifier and L_div the authors' `DiversityLoss(metric="l1")`:

    L_div = exp(-mean_{i,j} ||eps_i - eps_j||^2_mean * |G_i - G_j|_mean)          (`diversity_loss`)

(means over the coordinates). Adam, lr 3e-4, weight decay 1e-2 (`RUNCONFIGS["mnist"]`), 50 steps a
round (`ensemble_epochs // n_teacher_iters`), batch = the local batch size, lr x 0.98 a round
(`ExponentialLR(0.98)`); the student term (`ensemble_beta = 0` in the code) is not implemented.

Client, from round 2 on (the code's `glob_iter > 0`), every mini-batch (x, y) adds

    (B_g / B) alpha_t CE(W G(eps, y_hat), y_hat)  +  beta_t KL(softmax(W G(eps', y)) || softmax(f(x)))

(`client_regulariser`) to its cross-entropy: y_hat ~ U(all classes), B_g = 32 (`gen_batch_size`), the
KL target detached, alpha_t = max(1e-4, alpha 0.98^(t-1)), beta_t likewise (`regulariser_weight`;
`exp_lr_scheduler(glob_iter)`, alpha = beta = 10 for MNIST). The first term is the paper's
regulariser, the second ("latent loss") the code's. The code's clients take plain SGD steps; with
momentum 0.9 these defaults can diverge (docs/notes/fedgen.md).

Deviations from the code:
- the teacher loss weights each sample by a_{y_i,k} (the code's broadcast gives mean(CE) * mean(a));
- label counts are the client's training-set histogram (the code's: its batches' labels, from 1);
- `early_stop = 20` never acts in the authors' runs (20 local epochs) and is not implemented.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fedskew.losses.map import distillation_loss

GENERATOR_LR_DECAY = 0.98  # ExponentialLR(gamma=0.98), stepped once a round (serverpFedGen.py)
REGULARISER_DECAY = 0.98  # userpFedGen.py: exp_lr_scheduler(glob_iter, decay=0.98, ...)
REGULARISER_FLOOR = 1e-4  # ... max(1e-4, init_lr * decay ** glob_iter)


class Generator(nn.Module):
    """G(eps, y): Linear(noise_dim + K, hidden) - BatchNorm1d - ReLU - Linear(hidden, d)."""

    def __init__(self, num_classes: int, feature_dim: int, hidden_dim: int = 256, noise_dim: int = 32) -> None:
        super().__init__()
        self.num_classes, self.noise_dim = num_classes, noise_dim
        self.hidden = nn.Sequential(
            nn.Linear(noise_dim + num_classes, hidden_dim), nn.BatchNorm1d(hidden_dim), nn.ReLU()
        )
        self.representation = nn.Linear(hidden_dim, feature_dim)

    def forward(self, labels: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        # F.one_hot's values by comparison: F.one_hot checks the labels' range on the host, which
        # torch.func's grad transform cannot run (the batched engine runs G under it)
        onehot = (labels.unsqueeze(-1) == torch.arange(self.num_classes, device=labels.device)).to(noise.dtype)
        return self.representation(self.hidden(torch.cat([noise, onehot], dim=1)))

    def noise(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """eps ~ U[0, 1)^noise_dim (`uniform_noise`), in the generator's device and dtype."""
        weight = self.representation.weight
        return uniform_noise(n, self.noise_dim, generator).to(weight.device, weight.dtype)

    def generate(self, labels: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(G(eps, labels), eps) with fresh noise."""
        eps = self.noise(len(labels), generator)
        return self(labels, eps), eps


def uniform_noise(n: int, noise_dim: int, generator: torch.Generator) -> torch.Tensor:
    """n draws of eps ~ U[0, 1)^noise_dim on the CPU in float32: the same draws on every device and
    in every compute dtype."""
    return torch.rand(n, noise_dim, generator=generator)


def build_generator(cfg: Mapping[str, Any], num_classes: int, feature_dim: int) -> Generator:
    return Generator(num_classes, feature_dim, cfg["fedgen-hidden-dim"], cfg["fedgen-noise-dim"])


def diversity_loss(noise: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """exp(-mean_{i,j} d2(eps_i, eps_j) d1(G_i, G_j)), d2 the mean squared and d1 the mean absolute
    difference over coordinates (the authors' `DiversityLoss('l1')`): near 1 when different noise
    gives the same feature (mode collapse), smaller as outputs spread with their noise."""
    feature_dist = (features.unsqueeze(0) - features.unsqueeze(1)).abs().mean(2)
    noise_dist = (noise.unsqueeze(0) - noise.unsqueeze(1)).pow(2).mean(2)
    return torch.exp(-(noise_dist * feature_dist).mean())


def label_weights(counts: torch.Tensor) -> torch.Tensor:
    """a_{y,k} = n_k^y / sum_k' n_k'^y from counts (N clients, K classes): shape (K, N), each held
    label's row sums to 1, a label nobody holds has a zero row."""
    counts = counts.to(torch.float64).T
    return (counts / counts.sum(1, keepdim=True).clamp_min(1.0)).float()


def teacher_loss(
    features: torch.Tensor, labels: torch.Tensor, classifiers: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """1/B sum_i sum_k a_{y_i,k} CE(W_k h_i, y_i): the ensemble of the clients' classifiers
    (N, K, d) on features h (B, d), each client weighted per label by `weights` (K, N)."""
    logits = torch.einsum("bd,nkd->nbk", features, classifiers)  # (N, B, K)
    ce = torch.stack([F.cross_entropy(z, labels, reduction="none") for z in logits])  # (N, B)
    return (weights[labels].T * ce).sum(0).mean()


def train_generator(
    generator: Generator,
    optimizer: torch.optim.Optimizer,
    classifiers: torch.Tensor,
    counts: torch.Tensor,
    iterations: int,
    batch_size: int,
    eta: float,
    rng: torch.Generator,
) -> dict[str, float]:
    """`iterations` Adam steps on L_G = teacher + eta * diversity (train mode) against the frozen
    classifiers (N, K, d) weighted by the label counts (N, K). Labels are drawn uniformly from the
    labels some client holds. Returns the mean teacher and diversity losses and the first and
    last total losses."""
    device = classifiers.device
    weights = label_weights(counts).to(device)
    held = torch.nonzero(counts.sum(0) > 0).flatten()
    classifiers = classifiers.detach()
    generator.train()
    sums, totals = torch.zeros(2, device=device), []
    for _ in range(iterations):
        labels = held[torch.randint(len(held), (batch_size,), generator=rng)].to(device)
        features, eps = generator.generate(labels, rng)
        teacher = teacher_loss(features, labels, classifiers, weights)
        diversity = diversity_loss(eps, features)
        loss = teacher + eta * diversity
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        sums += torch.stack([teacher.detach(), diversity.detach()])
        totals.append(loss.detach())
    teacher_mean, diversity_mean = (sums / max(iterations, 1)).tolist()  # one device sync, not one a step
    out = {"teacher-loss": teacher_mean, "diversity-loss": diversity_mean}
    if totals:
        out.update({"loss-first": float(totals[0]), "loss-last": float(totals[-1])})
    return out


def regulariser_weight(base: float, server_round: int) -> float:
    """alpha_t = max(1e-4, base * 0.98^(t - 1)) for round t >= 1 (the code's glob_iter = t - 1);
    0 when base is 0 (the term is off; the code's floor would keep 1e-4 of it)."""
    return max(REGULARISER_FLOOR, base * REGULARISER_DECAY ** (server_round - 1)) if base > 0 else 0.0


def client_regulariser(
    classifier: Callable[[torch.Tensor], torch.Tensor],
    logits: torch.Tensor,
    generated_for_batch: torch.Tensor,
    generated: torch.Tensor,
    sampled_labels: torch.Tensor,
    weights: torch.Tensor,
    weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(total, teacher, latent) of the client's generator terms for one mini-batch:

        teacher = CE(W G(eps, y_hat), y_hat)                         (generated, sampled_labels)
        latent  = KL(softmax(W G(eps', y)) || softmax(logits))       (generated_for_batch)
        total   = weights[0] * teacher + weights[1] * latent         (weights = (ratio alpha, beta))

    `logits` are the model's on the real batch, `classifier` is W; the KL target is detached (the
    code's `.clone().detach()`); the generated features carry no gradient. The KL term is
    `distillation_loss` at temperature 1: the batch mean with `weight` None, else sum_i weight_i KL_i
    over the batch's rows (the batched engine's weights: 1/b on its b examples, 0 on padding); the
    teacher term is the mean over the sampled labels either way (none of them is padding)."""
    teacher = F.cross_entropy(classifier(generated.detach()), sampled_labels)
    latent = distillation_loss(logits, classifier(generated_for_batch.detach()), 1.0, False, weight)
    return weights[0] * teacher + weights[1] * latent, teacher, latent
