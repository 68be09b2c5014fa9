"""FedProc's prototypical contrastive loss and its round schedule (Mu et al., "FedProc: Prototypical
Contrastive Federated Learning on Non-IID Data", arXiv 2109.12273 / FGCS 2023). Pure torch.

Global prototypes c_j (the count-weighted mean feature of class j over the clients, the server's
`fedskew.losses.fedmr.aggregate_prototypes`) pull each sample's feature z_i to its own class and push
it from the others:

    L_pc = -1/|B'| sum_{i in B'} log( exp(s(z_i, c_{y_i}) / T) / sum_{j valid} exp(s(z_i, c_j) / T) )

with s the cosine similarity, B' the samples whose class has a prototype, and the hybrid local loss

    L = alpha_t L_pc + (1 - alpha_t) CE,      alpha_t = 1 - (t - 1) / (R - 1)   (round t of R)

which starts on the prototypes and ends on plain cross-entropy.

Decisions (there is no public code from the authors, and the paper's full text could not be read
here): the form above follows the public re-implementation in WenkeHuang/RethinkFL (1119dbd,
`models/fedproc.py`: cosine similarity, no temperature, so T = 1 by default, alpha = 1 - e / (E - 1)
over 0-based rounds e). That re-implementation averages prototypes uniformly over clients and sends
a class only when someone held it this round; here they are count-weighted and kept when stale
(the FedMR prototype record, shared). A sample whose class has no prototype yet is left out of L_pc
(the re-implementation does the same, but divides by the whole batch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def prototype_weight(server_round: int, num_rounds: int) -> float:
    """alpha_t = 1 - (t - 1) / (R - 1) for round t in 1..R: 1 in round 1, 0 in the last (1 when R = 1)."""
    if not 1 <= server_round <= num_rounds:
        raise ValueError(f"server_round={server_round} is outside [1, {num_rounds}]")
    return 1.0 - (server_round - 1) / max(num_rounds - 1, 1)


def prototypical_contrastive_loss(
    z: torch.Tensor,
    y: torch.Tensor,
    prototypes: torch.Tensor,
    valid: torch.Tensor,
    temperature: float = 1.0,
    weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """L_pc of features `z` [B, d] with labels `y` [B] against the fixed global `prototypes` [C, d]
    (detached) of which `valid` [C] exist; 0 (connected to `z`) when no sample's class has one.
    With `weight` w (the batched engine's: 1/b on the b examples, 0 on padding) the same mean over
    B' as sum_i w_i [valid y_i] l_i / sum_i w_i [valid y_i], masked for `vmap` (the invalid classes'
    logits the dtype's lowest finite value: exp gives the same 0 as -inf, and a row with no valid
    class stays finite)."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    valid = valid.to(torch.bool)
    protos = F.normalize(prototypes.detach().to(z.dtype), dim=1)
    if weight is not None:
        logits = (F.normalize(z, dim=1) @ protos.T / temperature).masked_fill(~valid[None, :], torch.finfo(z.dtype).min)
        keep = weight * valid[y].to(z.dtype)
        total = keep.sum()
        return (keep * F.cross_entropy(logits, y, reduction="none")).sum() / total.clamp(min=torch.finfo(z.dtype).tiny)
    keep = valid[y]
    if not keep.any():
        return z.sum() * 0.0
    sims = F.normalize(z[keep], dim=1) @ protos.T  # [b, C]
    logits = sims.masked_fill(~valid[None, :], float("-inf")) / temperature
    return F.cross_entropy(logits, y[keep])
