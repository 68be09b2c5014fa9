"""FedProc client (Mu et al., "FedProc: Prototypical Contrastive Federated Learning on Non-IID
Data", arXiv 2109.12273): local training on the hybrid loss

    L = alpha_t L_pc(z, y; C) + (1 - alpha_t) CE,     alpha_t = 1 - (t - 1) / (R - 1)

with L_pc the prototypical contrastive loss against the server's global prototypes C and z =
`features(x)`, the classifier's input (`fedskew/losses/fedproc.py`, with the decisions). The
prototypes' download, local computation and upload are FedMR's (`fedskew/client_app/prototypes.py`,
record `fedproc-prototypes`); server: `fedskew/strategies/fedproc.py`.

- `fedproc-schedule="anneal"` (default) is alpha_t above; `"constant"` holds alpha_t =
  `fedproc-alpha` (the form in which FedMR's Table 9 reports one tuned value for FedProc).
- Round 1, or while no class of the batch has a prototype: L_pc is absent and the loss is plain CE
  (weight 1, not 1 - alpha_t: the re-implementation's (1 - alpha_1) CE with alpha_1 = 1 trains
  nothing in round 1).
- The client keeps no state across rounds; its personalized model is the trained model.
- The objective is written once (`feature_loss`); the batched engine stacks a round's clients, each
  client's prototypes and alpha_t its extras, the branches above as masks.
"""

from __future__ import annotations

import torch
from flwr.app import RecordDict
from torch import nn

from fedskew.client_app.base import Tensors
from fedskew.client_app.prototypes import PrototypeTrainer
from fedskew.losses.fedproc import prototype_weight, prototypical_contrastive_loss
from fedskew.methods.fedproc import FEDPROC_PROTOTYPES


class FedProcTrainer(PrototypeTrainer):
    """Hybrid prototypical-contrastive + cross-entropy local training; uploads local prototypes."""

    batched = True
    prototype_record = FEDPROC_PROTOTYPES

    def load_global(self, model: nn.Module, content: RecordDict) -> None:
        super().load_global(model, content)
        if self.cfg["fedproc-schedule"] == "constant":
            self.alpha = self.cfg["fedproc-alpha"]
        else:
            self.alpha = prototype_weight(self.ctx.server_round, self.cfg["num-server-rounds"])
        self.use_protos = self.alpha > 0 and bool(self.valid.any())

    def batch_extras(self) -> dict[str, torch.Tensor]:
        return {**super().batch_extras(), "alpha": torch.tensor(self.alpha, dtype=self.dtype, device=self.device)}

    def feature_loss(
        self, data: torch.Tensor, z: torch.Tensor, y: torch.Tensor, weight: torch.Tensor | None, extras: Tensors
    ) -> tuple[torch.Tensor, Tensors]:
        """alpha_t L_pc + (1 - alpha_t) CE, plain CE while no class of the batch has a prototype (or
        alpha_t = 0); L_pc reported as "proto" over the "proto-steps" it acts in."""
        protos, valid, temperature = extras["prototypes"], extras["valid"], self.cfg["fedproc-temperature"]
        if weight is None:  # the per-client path: the batch as it is, its branches in Python
            if not self.use_protos or not valid[y].any():
                return data, {}
            pc = prototypical_contrastive_loss(z, y, protos, valid, temperature)
            return self.alpha * pc + (1.0 - self.alpha) * data, {"proto": pc, "proto-steps": torch.ones_like(pc)}
        alpha = extras["alpha"]
        pc = prototypical_contrastive_loss(z, y, protos, valid, temperature, weight)
        active = (alpha > 0) & (weight * valid[y]).gt(0).any()
        mixed = torch.where(active, alpha * pc + (1.0 - alpha) * data, data)
        return mixed, {"proto": torch.where(active, pc, 0.0), "proto-steps": active.to(pc.dtype)}

    def after_steps(self, model: nn.Module, stats: dict[str, float]) -> dict[str, float]:
        stats = super().after_steps(model, stats)
        return {
            **stats,
            "proto-loss": self.reported_sum("proto") / max(self.reported_sum("proto-steps"), 1),
            "proto-alpha": self.alpha,
            "proto-active": int(self.use_protos),
        }
