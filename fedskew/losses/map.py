"""MAP's inherited private model (HPM): transfer terms and moving average (Li et al., MAP, TKDE'24,
Sec. IV-B, Eqs. 10-13; the HPM comes from FedPHP, ECML-PKDD'21, which uses these functions too with
its authors' settings: teacher-only softening, mu_max = 0.9, Q T rounded down). Pure torch, no Flower.

    HPM update (Eq. 10, Alg. 1 line 14):   psi <- (1 - mu) theta_hat + mu psi
    momentum schedule (Sec. IV-B):         mu(n) = clip(mu_bar (n - 1) / (Q T), 0, mu_max)
    logit distillation (Eq. 11):           L_kd  = 1/B sum_i KL( softmax(o_p,i / tau) || softmax(o_i / tau) )
    feature MMD (Eq. 12):                  L_mmd = || 1/B sum_i phi(h_i) - 1/B sum_i phi(h_p,i) ||_H^2
    stage-2 loss (Eq. 13):                 L = (1 - lam) CE + lam L_tr

`n` is the 1-based index of this participation: Algorithm 1 updates the HPM (line 14) before it
adjusts mu (line 15), so the n-th participation uses the count n - 1 and the first one uses mu = 0.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F

MAP_SCHEDULES = ("epochs", "algorithm1", "code")


def map_stage_steps(
    num_examples: int, batch_size: int, epochs: int, personal_epochs: int, schedule: str = "epochs"
) -> tuple[int, int]:
    """(stage-1 steps, stage-2 steps) of one MAP round on a client with `num_examples` training
    samples, nb = ceil(n / B) batches a pass:

    - "epochs": `epochs` passes of stage 1, `personal_epochs` of stage 2 (E nb, E_p nb);
    - "algorithm1" (Alg. 1, lines 2 and 8: epochs 1..E/2, then E/2+1..E): the E nb steps of E
      epochs split in halves, ceil(E nb / 2) and floor(E nb / 2) (E/2 passes each for an even E,
      2.5 and 2.5 for E = 5);
    - "code" (the authors' `lxcnju/MAP` `algorithms/fedap.py`, commit 42b1478): stage 1
      max(int(E nb), 5) steps (`update_local`), stage 2 max(int(0.1 x that), 5) (`update_local_hpm`).
    """
    nb = math.ceil(num_examples / batch_size)
    if schedule == "epochs":
        return epochs * nb, personal_epochs * nb
    if schedule == "algorithm1":
        total = epochs * nb
        return (total + 1) // 2, total // 2
    if schedule == "code":
        first = max(epochs * nb, 5)
        return first, max(int(0.1 * first), 5)
    raise ValueError(f"schedule={schedule!r} must be one of {MAP_SCHEDULES}")


def hpm_momentum(participation: int, expected_participations: float, mu_bar: float = 0.9, mu_max: float = 1.0) -> float:
    """mu of a client's `participation`-th selection (1-based): clip(mu_bar (n-1) / max(Q T, 1), 0, mu_max)."""
    if participation < 1:
        raise ValueError(f"participation={participation} must be >= 1")
    mu = mu_bar * (participation - 1) / max(float(expected_participations), 1.0)
    return float(min(max(mu, 0.0), mu_max))


def hpm_update(
    hpm: Mapping[str, torch.Tensor] | None, personalized: Mapping[str, torch.Tensor], mu: float
) -> dict[str, torch.Tensor]:
    """Eq. 10 on every state-dict entry: `(1 - mu) new + mu old` for float tensors; integer buffers
    (BN `num_batches_tracked`) are copied from `personalized`. No HPM yet gives `personalized`."""
    if not 0.0 <= mu <= 1.0:
        raise ValueError(f"mu={mu} must be in [0, 1]")
    out: dict[str, torch.Tensor] = {}
    for key, new in personalized.items():
        new = new.detach()
        if hpm is None or not new.is_floating_point():
            out[key] = new.clone()
        else:
            out[key] = torch.lerp(new, hpm[key].to(new), mu)  # new + mu (old - new)
    return out


def distillation_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    temperature: float = 4.0,
    soften_student: bool = True,
    weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eq. 11: batch-mean KL(softmax(teacher / tau) || softmax(student / tau)), teacher detached, no tau^2;
    with `weight` [B], sum_i weight_i KL_i instead (the batch mean at 1/b on b examples, 0 on padding).

    `soften_student=False` is the authors' code: only the teacher is divided by tau (the loss is then
    the cross-entropy to the soft target minus its entropy, so the same gradient as their CE form).
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    s = student_logits / (temperature if soften_student else 1.0)
    target = F.softmax(teacher_logits.detach() / temperature, dim=1)
    if weight is None:
        return F.kl_div(F.log_softmax(s, dim=1), target, reduction="batchmean")
    return (F.kl_div(F.log_softmax(s, dim=1), target, reduction="none").sum(1) * weight).sum()


def mmd_multi_gaussian(
    h: torch.Tensor,
    h_p: torch.Tensor,
    kernel_mul: float = 2.0,
    kernel_num: int = 5,
    weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eq. 12, biased V-statistic with a sum of Gaussian kernels as in DAN (Long et al., ICML'15):

        MMD^2 = mean k(h, h) + mean k(h_p, h_p) - 2 mean k(h, h_p),
        k(a, b) = sum_m exp(-||a - b||^2 / (b0 kernel_mul^(m - kernel_num // 2))),  m = 0..kernel_num-1,

    with the data-driven base bandwidth b0 = mean pairwise squared distance of [h; h_p] (detached),
    as the authors' `mmd_rbf_noaccelerate`. `h_p` (the HPM's features) is detached. With `weight`
    w [B] (the batched engine's: 1/b on a batch's b examples, 0 on the padding, the same rows of h
    and h_p) each mean is sum_ij w_i w_j k_ij and b0 the mean over the pairs of real rows: the value
    of the b real rows alone.
    """
    h_p = h_p.detach()
    z = torch.cat([h.flatten(1), h_p.flatten(1)], dim=0)
    n, b = z.shape[0], h.shape[0]
    d2 = (z.unsqueeze(0) - z.unsqueeze(1)).pow(2).sum(-1)  # [2B, 2B]; no sqrt, so finite gradients at 0
    if weight is None:
        base = (d2.detach().sum() / max(n * n - n, 1)).clamp(min=1e-12)
    else:
        real = (weight > 0).to(d2.dtype).repeat(2)  # the real rows of [h; h_p]
        pairs = real.sum() * (real.sum() - 1)
        base = ((d2.detach() * real.outer(real)).sum() / pairs.clamp(min=1)).clamp(min=1e-12)
    kernel = sum(torch.exp(-d2 / (base * kernel_mul ** (m - kernel_num // 2))) for m in range(kernel_num))
    if weight is None:
        xx, yy, xy = kernel[:b, :b].mean(), kernel[b:, b:].mean(), kernel[:b, b:].mean()
    else:
        ww = weight.outer(weight)
        xx, yy, xy = ((k * ww).sum() for k in (kernel[:b, :b], kernel[b:, b:], kernel[:b, b:]))
    return xx + yy - 2 * xy


def personalization_loss(ce: torch.Tensor, transfer: torch.Tensor | None, weight: float) -> torch.Tensor:
    """Eq. 13: `(1 - lam) CE + lam L_tr`; plain CE when there is no HPM yet (`transfer` None)."""
    return ce if transfer is None else (1.0 - weight) * ce + weight * transfer
