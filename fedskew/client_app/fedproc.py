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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from flwr.app import RecordDict
from torch import nn

from fedskew.client_app.prototypes import PrototypeTrainer
from fedskew.losses.fedproc import prototype_weight, prototypical_contrastive_loss
from fedskew.wire import FEDPROC_PROTOTYPES


class FedProcTrainer(PrototypeTrainer):
    """Hybrid prototypical-contrastive + cross-entropy local training; uploads local prototypes."""

    prototype_record = FEDPROC_PROTOTYPES

    def load_global(self, model: nn.Module, content: RecordDict) -> None:
        super().load_global(model, content)
        if self.cfg["fedproc-schedule"] == "constant":
            self.alpha = self.cfg["fedproc-alpha"]
        else:
            self.alpha = prototype_weight(self.ctx.server_round, self.cfg["num-server-rounds"])
        self.use_protos = self.alpha > 0 and bool(self.valid.any())
        self.pc_sum, self.pc_steps = torch.zeros((), device=self.device), 0

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        z = model.features(x)
        ce = F.cross_entropy(model.classifier(z), y)
        if not self.use_protos or not self.valid[y].any():
            return ce
        pc = prototypical_contrastive_loss(z, y, self.prototypes, self.valid, self.cfg["fedproc-temperature"])
        self.pc_sum += pc.detach()
        self.pc_steps += 1
        return self.alpha * pc + (1.0 - self.alpha) * ce

    def local_train(self, model: nn.Module, content: RecordDict) -> dict[str, float]:
        stats = super().local_train(model, content)
        return {
            **stats,
            "proto-loss": float(self.pc_sum) / max(self.pc_steps, 1),
            "proto-alpha": self.alpha,
            "proto-active": int(self.use_protos),
        }
