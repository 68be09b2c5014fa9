"""CReFF client (Shang et al., IJCAI'22; the authors' `Local.compute_gradient` and `local_train`).
Maths and defaults: `fedskew/losses/creff.py`; server: `fedskew/strategies/creff.py`.

One round: the server sends the FedAvg model theta^t and the re-trained classifier W^t
(`creff-classifier`). Before training (the code computes the gradients first), for every class k the
client holds, the real feature gradient at W^t of the received backbone (eval mode) is the mean over
`creff-real-repeats` draws of at most `creff-batch-real` random samples of class k (the code: 10
draws of 32, each through its augmentation; here through the configured `augment`, none by default)

    z_i^k = 1/R sum_r d/dW mean_{j in draw r} CE(W h_j, k)     (`class_gradients`, closed form)

Then FedAvg's local training from theta^t, and the reply adds the gradients (`creff-grads`).
`client-global-accuracy` measures CReFF's global model, theta^t's backbone with W^t (what the server
evaluated a round earlier); `personal-accuracy` the locally trained model. No client state. The
batched engine stacks its clients (FedAvg's functional loss; the gradients are drawn in `begin`,
before the local steps, as here).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from flwr.app import ArrayRecord, RecordDict
from torch import nn

from fedskew.client_app.base import BaseTrainer
from fedskew.losses.mupfl import class_gradients
from fedskew.methods.creff import CREFF_CLASSIFIER, CREFF_GRADS
from fedskew.models import SplitNet


class CReFFTrainer(BaseTrainer):
    """FedAvg's local training; class gradients of the received model at the re-trained classifier."""

    batched = True

    def load_global(self, model: nn.Module, content: RecordDict) -> None:
        super().load_global(model, content)
        self.weight = self.received[CREFF_CLASSIFIER]["weight"].to(self.device)
        self.gradients = self.class_gradients(model)

    def received_global_model(self, model: nn.Module) -> nn.Module:
        """CReFF's global model: the received backbone with the re-trained classifier W^t."""
        glo = copy.deepcopy(model)
        with torch.no_grad():
            glo.classifier.weight.copy_(self.weight)
        return glo

    @torch.no_grad()
    def class_gradients(self, model: SplitNet) -> dict[str, torch.Tensor]:
        """{"k": z_i^k} for every class k of the local training set, at W^t (eval mode)."""
        model.eval()
        x, y, out = self.data.x_train, self.data.y_train, {}
        for k in torch.unique(y).tolist():
            members = torch.nonzero(y == k).flatten()
            total = torch.zeros_like(self.weight)
            for _ in range(self.cfg["creff-real-repeats"]):
                idx = members[
                    torch.randperm(len(members), generator=self.ctx.generator)[: self.cfg["creff-batch-real"]]
                ]
                xb = x[idx] if self.augment is None else self.augment(x[idx], self.ctx.generator)
                h = model.features(xb.to(self.device))
                total += class_gradients(self.weight, h, torch.full((len(idx),), k, device=self.device))[k]
            out[str(k)] = (total / self.cfg["creff-real-repeats"]).float().cpu()
        return out

    def extra_records(self, model: nn.Module) -> dict[str, Any]:
        return {CREFF_GRADS: ArrayRecord(self.gradients)}
