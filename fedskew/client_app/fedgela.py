"""FedGELA client (Fan et al., NeurIPS'23, Alg. 1; maths in `fedskew/losses/fedgela.py`).

The server's ETF arrives as the `etf` ArrayRecord with its SHA-256 in the `etf-info` ConfigRecord;
the client checks its shape (d, C), dtype and finite values (`server_records`, as every server
record) and the checksum, then trains only the backbone with cross-entropy on
s * phi_k,c * cos(h, m_c), phi_k = C n_{k,c} / n_k from its own training labels (computed here,
never sent). The ETF and phi are buffers, not parameters: no gradient, no weight
decay, unchanged by training. The upload is the backbone's state dict only. The personalized model
is the trained backbone with the adapted ETF (spec §2.7), evaluated right after local training.
The gradient norm is clipped to `fedgela-clip` (authors' code: 20; 0 turns it off).
"""

from __future__ import annotations

from typing import Any

import torch
from flwr.app import ConfigRecord, RecordDict
from torch import nn

from fedskew.client_app.fedavg import FedAvgTrainer
from fedskew.losses.fedgela import ETFNet, etf_backbone, etf_checksum, local_phi
from fedskew.models import build_model
from fedskew.records import ArraysSpec, Tensor


def verified_etf(etf: torch.Tensor, content: RecordDict) -> torch.Tensor:
    """`etf` (already checked: shape, dtype, finite values) after checking its checksum against
    the `etf-info` record of the same message."""
    info = content.get("etf-info")
    if not isinstance(info, ConfigRecord) or not isinstance(info.get("sha256"), str):
        raise ValueError("FedGELA: the server message lacks the 'etf-info' record with the ETF's sha256")
    if etf_checksum(etf) != info["sha256"]:
        raise ValueError(f"FedGELA: ETF checksum {etf_checksum(etf)[:12]} != broadcast {info['sha256'][:12]}")
    return etf


def clip_before_step(optimizer: torch.optim.Optimizer, max_norm: float) -> None:
    """Clip the gradient norm of the optimiser's parameters before every `step()`."""
    if max_norm <= 0:
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]

    def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        torch.nn.utils.clip_grad_norm_(params, max_norm)

    optimizer.register_step_pre_hook(hook)


class FedGELATrainer(FedAvgTrainer):
    """Backbone-only training against the client's adapted simplex ETF."""

    def server_records(self) -> dict[str, ArraysSpec]:
        net = build_model(self.cfg["model"], self.cfg["dataset"])
        return {"etf": ArraysSpec({"etf": Tensor((net.feature_dim, net.num_classes), "float32")})}

    def receive(self, content: RecordDict) -> dict[str, dict[str, torch.Tensor]]:
        received = super().receive(content)
        self.etf = verified_etf(received["etf"]["etf"], content)
        self.phi = local_phi(self.data.train_counts) if self.cfg["fedgela-adapt"] else None
        return received

    def build_model(self) -> ETFNet:
        net = build_model(self.cfg["model"], self.cfg["dataset"])
        backbone = etf_backbone(net.features, net.feature_dim, self.cfg["fedgela-feature-norm"])
        model = ETFNet(backbone, self.etf, self.cfg["fedgela-ew"], self.phi, self.cfg["fedgela-mode"])
        return model.to(self.device)

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        opt = super().optimizer(model)
        clip_before_step(opt, self.cfg["fedgela-clip"])
        return opt
