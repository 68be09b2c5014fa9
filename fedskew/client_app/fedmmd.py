"""FedMMD client (Yao, Huang & Sun, "Two-Stream Federated Learning: Reduce the Communication Costs",
VCIP'18): the "two-stream" local model, i.e. the model being trained beside a frozen copy of the
received global model, trained on

    L = CE(f(x), y) + lambda * MMD^2(h(x), h_glob(x))

on every mini-batch, h the local model's features and h_glob the frozen global model's on the same
batch. Server: FedAvg (`fedskew/strategies/fedmmd.py` adds only the metric).

Decisions (no public code from the authors):
- The MMD is the multi-kernel one (a sum of Gaussian kernels, DAN-style MK-MMD, which the paper builds
  on), reused from MAP: `fedskew.losses.map.mmd_multi_gaussian`, 5 kernels with bandwidths b0 x 2^{-2..2},
  b0 the batch's mean pairwise squared distance. It is the FedRS authors' `mmd_rbf_noaccelerate`, the
  function their FedMMD baseline calls (lxcnju/FedRepo at 617ee01, `algorithms/fedreg.py`,
  `reg_way="fedmmd"`), which is how FedRS's Tables 1, 4 and 5 ran FedMMD.
- Where: on the features h (the classifier's input), as that code does (`hs` of both models), the
  global model in eval mode and detached.
- lambda (`fedmmd-lambda`) = 1e-3: FedRS's paper runs {1e-4, 1e-3}, its code {1e-2, 1e-3}.
- Written once (`forward_loss`), so the batched engine stacks a round's clients: the global model's
  weights are each client's extras (`frozen_extras`) and h_glob its forward on them
  (`frozen_features` in `forward_loss`); padding rows of a short batch weigh 0 in the MMD's means
  and its bandwidth. At lambda 0 neither form runs the global model (plain CE, FedAvg's step).
"""

from __future__ import annotations

import copy

import torch
from flwr.app import RecordDict
from torch import nn

from fedskew.client_app.base import BaseTrainer, Forward, Tensors, frozen, frozen_extras, frozen_features
from fedskew.losses import mmd_multi_gaussian

GLOBAL = "global."  # the extras' prefix of the global model's tensors


class FedMMDTrainer(BaseTrainer):
    """Cross-entropy plus lambda x the feature MMD to the frozen global model."""

    batched = True

    def load_global(self, model: nn.Module, content: RecordDict) -> None:
        super().load_global(model, content)
        self.global_model = frozen(copy.deepcopy(model))
        self.global_extras = frozen_extras(GLOBAL, self.global_model) if self.cfg["fedmmd-lambda"] else {}

    def batch_extras(self) -> dict[str, torch.Tensor]:
        return self.global_extras

    def forward_loss(
        self, data: torch.Tensor, fwd: Forward, y: torch.Tensor, weight: torch.Tensor | None, extras: Tensors
    ) -> tuple[torch.Tensor, Tensors]:
        """CE + lambda MMD^2(h, h_glob), h_glob the frozen global model's features of the batch
        (`frozen_features`), the MMD reported as "mmd"."""
        lam = self.cfg["fedmmd-lambda"]
        if lam == 0:
            return data, {}
        h_global = frozen_features(self.global_model, GLOBAL, fwd.x, extras)
        mmd = mmd_multi_gaussian(fwd.z, h_global, weight=weight)
        return data + lam * mmd, {"mmd": mmd}

    def after_steps(self, model: nn.Module, stats: dict[str, float]) -> dict[str, float]:
        stats = super().after_steps(model, stats)
        return {**stats, "mmd-loss": self.reported_sum("mmd") / max(stats["train-steps"], 1)}
