"""MOON's model-contrastive loss (Li, He & Song, "Model-Contrastive Federated Learning", CVPR'21,
Sec. 3.3, Eqs. 1-3). Pure torch.

For a mini-batch with representations z (local model being trained), z_glob (the received global
model) and z_prev (the client's local model of its previous participation), Eq. 1:

    l_con = -log( exp(sim(z, z_glob) / tau) / (exp(sim(z, z_glob) / tau) + exp(sim(z, z_prev) / tau)) )

with sim the cosine similarity, averaged over the batch; the local objective (Eq. 3) is
``CE + mu * l_con``. The authors' code (QinbinLi/MOON at 8fcba3c, `main.py` `train_net_fedcon`)
builds the logits [sim(z, z_glob), sim(z, z_prev)] / tau and takes the cross-entropy with target 0
(the same quantity); with no previous model (its pool is empty in the first round) the logits are
the single positive column, whose cross-entropy is 0: no contrastive term, plain CE.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def model_contrastive_loss(
    z: torch.Tensor,
    z_global: torch.Tensor,
    z_previous: torch.Tensor | None,
    temperature: float,
    weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eq. 1 averaged over the batch: z [B, d] against the positive z_global [B, d] and the negative
    z_previous [B, d] (both detached); `z_previous` None (no previous local model) gives 0. With
    `weight` [B] (the batched engine's: 1/b on a batch's b examples, 0 on padding) the weighted sum
    of the per-example terms instead of their mean."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    if z_previous is None:
        return z.sum() * 0.0
    pos = F.cosine_similarity(z, z_global.detach(), dim=-1)
    neg = F.cosine_similarity(z, z_previous.detach(), dim=-1)
    logits = torch.stack([pos, neg], dim=1) / temperature
    target = torch.zeros(len(z), dtype=torch.long, device=z.device)
    if weight is None:
        return F.cross_entropy(logits, target)
    return (F.cross_entropy(logits, target, reduction="none") * weight).sum()
