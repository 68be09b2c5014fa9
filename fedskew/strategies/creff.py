"""CReFF server (Shang et al., IJCAI'22): FedAvg for the model the clients train, and a classifier
re-trained on federated features for the model that is evaluated. Client side:
`fedskew/client_app/creff.py`; maths, defaults and the authors' code read (shangxinyi/CReFF-FL at
commit fbec98f1a49dfb8d9f346d98bf3f9568d9004687): `fedskew/losses/creff.py`.

Round t (the code's `CReFF()` loop, and the paper's Fig. 3: "the server sends the aggregated global
model and the re-trained model to clients"):
1. broadcast the FedAvg model theta^t (what the clients train from) and the re-trained classifier
   W^t (`creff-classifier`, the one they take their class gradients at; round 1: a fresh random
   classifier, the code's `temp_model`);
2. each reply carries the trained model and one gradient z_i^k per class the client holds
   (`creff-grads`, the record form of MuPFL's `mupfl-grads`), taken at theta^t's backbone and W^t;
   a z_i^k beyond `statistic-norm-bound` x the round's median class-gradient norm is dropped
   (`fedskew.strategies.mupfl.class_targets`, MuPFL's too);
3. theta^{t+1} = the sample-weighted average of the models (`initialize_for_model_fusion`);
4. z^k = mean of z_i^k over the clients holding k; the federated features S take
   `creff-match-iters` SGD steps (lr `creff-feature-lr`) to match them at W^t (`update_feature_syn`);
5. W^{t+1} = a fresh classifier trained on S (`feature_re_train`).
The model evaluated (`global_model`, and the `model.pt` of a run) is theta^{t+1}'s backbone with
W^{t+1}; the next round's arrays are theta^{t+1} with its own averaged classifier.

Server state (`state_dict`, in every checkpoint): S and W^t. Its randomness (the initial S and W,
each round's fresh classifier and re-training batch order) comes from generators seeded by the seed
and the round, so a resumed run equals an uninterrupted one. Deviations from the code: the
classifier has no bias (fedskew's SplitNet), and with no class gradient in a round (no reply held a
class) S is left unchanged (the code would fail on an empty matching loss).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Message
from torch import nn

from fedskew.losses.creff import fresh_classifier, retrain_classifier
from fedskew.losses.mupfl import synthesize_features
from fedskew.methods.creff import CREFF_CLASSIFIER, CREFF_GRADS
from fedskew.strategies.base import BaseStrategy
from fedskew.strategies.mupfl import class_targets
from fedskew.training import torch_threads


def seeded(*parts: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(np.random.SeedSequence(list(parts)).generate_state(1)[0]))


class CReFFStrategy(BaseStrategy):
    """FedAvg of the models; federated features matched to the clients' class gradients; a
    classifier re-trained on them for the evaluated model."""

    def __init__(self, cfg: dict[str, Any], device: torch.device | None = None) -> None:
        super().__init__(cfg, device)
        k, d, m = self.dims.num_classes, self.dims.feature_dim, cfg["creff-features-per-class"]
        self.features = torch.randn(k, m, d, generator=seeded(cfg["seed"], 0, 1)).to(self.device)
        self.classifier = fresh_classifier(k, d, seeded(cfg["seed"], 0, 2)).to(self.device)

    def state_dict(self) -> dict[str, Any]:
        """The federated features S and the re-trained classifier W."""
        return {"features": self.features.detach().cpu().clone(), "classifier": self.classifier.detach().cpu().clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.features = state["features"].to(self.device)
        self.classifier = state["classifier"].to(self.device)

    def broadcast(self, server_round: int) -> dict[str, Any]:
        return {CREFF_CLASSIFIER: ArrayRecord({"weight": self.classifier.detach().cpu().clone()})}

    def global_model(self, arrays: ArrayRecord) -> nn.Module:
        """theta's backbone with the re-trained classifier W."""
        model = super().global_model(arrays)
        with torch.no_grad():
            model.classifier.weight.copy_(self.classifier)
        return model

    def aggregate_extras(self, server_round: int, replies: list[Message]) -> dict[str, Any]:
        """Match S to this round's class gradients at W^t, then re-train W^{t+1} on S."""
        targets, metrics = class_targets(self, server_round, replies, CREFF_GRADS)
        targets = {k: z.to(self.device) for k, z in targets.items()}
        with torch_threads(self.device, self.cfg["torch-threads"]):
            if targets:
                self.features, losses = synthesize_features(
                    self.features,
                    self.classifier,
                    targets,
                    self.cfg["creff-feature-lr"],
                    self.cfg["creff-match-iters"],
                    "creff",
                    cosine="creff-code",  # <a, b> / (|a| |b| + 1e-6), as the authors' code's matching
                )
                if losses:
                    metrics.update({"creff-match-loss-first": losses[0], "creff-match-loss-last": losses[-1]})
            self.classifier, loss = retrain_classifier(
                self.features,
                self.cfg["creff-retrain-epochs"],
                self.cfg["batch-size"],
                self.cfg["creff-retrain-lr"],
                seeded(self.cfg["seed"], server_round, 3),
            )
        metrics["creff-classes"] = len(targets)
        if np.isfinite(loss):
            metrics["creff-retrain-loss"] = loss
        return metrics
