"""FedGELA client (Fan et al., NeurIPS'23, Alg. 1; maths in `fedskew/losses/fedgela.py`).

The server's ETF arrives as the `etf` ArrayRecord with its SHA-256 in the `etf-info` ConfigRecord;
the client checks the checksum and the shape (d, C), then trains only the backbone (the network's
features and the `fedgela-head` layers) with cross-entropy on s * phi_k,c * cos(h, m_c),
s = sqrt(E_W) (paper's head; the authors' code: s * phi_k,c * m_c^T h with s = 1 / T), where
phi_k = C n_{k,c} / n_k comes from its own training labels (computed here, never sent). The ETF
and phi are buffers, not parameters: no gradient, no weight decay, unchanged by training. The
upload is the backbone's state dict only. The personalized model is the trained backbone with the
adapted ETF (spec §2.7), evaluated right after local training. The gradient norm is clipped to
`fedgela-clip` (authors' code: 20; 0 turns it off).
"""

from __future__ import annotations

from typing import Any

import torch
from flwr.app import RecordDict
from torch import nn

from fedskew.client_app.fedavg import FedAvgTrainer
from fedskew.losses.fedgela import ETFNet, etf_checksum, etf_net, local_phi
from fedskew.models import build_model


def received_etf(content: RecordDict, feature_dim: int, num_classes: int) -> torch.Tensor:
    """The broadcast ETF `[d, C]`, after checking its shape and its checksum against `etf-info`."""
    if "etf" not in content or "etf-info" not in content:
        raise ValueError("FedGELA: the server message lacks the 'etf' / 'etf-info' records")
    etf = torch.from_numpy(content["etf"]["etf"].numpy())
    if tuple(etf.shape) != (feature_dim, num_classes):
        raise ValueError(f"FedGELA: ETF has shape {tuple(etf.shape)}, the model needs ({feature_dim}, {num_classes})")
    expected = str(content["etf-info"]["sha256"])
    if etf_checksum(etf) != expected:
        raise ValueError(f"FedGELA: ETF checksum {etf_checksum(etf)[:12]} != broadcast {expected[:12]}")
    return etf


def gela_model(cfg: dict[str, Any], etf: torch.Tensor, phi: torch.Tensor | None = None) -> ETFNet:
    """The run's FedGELA network (`fedgela-head`): a client's with its phi, the server's without."""
    net = build_model(cfg["model"], cfg["dataset"])
    head, ew, temperature = cfg["fedgela-head"], cfg["fedgela-ew"], cfg["fedgela-temperature"]
    return etf_net(net.features, net.feature_dim, etf, head, ew, temperature, phi, cfg["fedgela-mode"])


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

    def fit(self, content: RecordDict) -> RecordDict:
        info = build_model(self.cfg["model"], self.cfg["dataset"])
        self.etf = received_etf(content, info.feature_dim, info.num_classes)
        self.phi = local_phi(self.data.train_counts) if self.cfg["fedgela-adapt"] else None
        return super().fit(content)

    def build_model(self) -> ETFNet:
        return gela_model(self.cfg, self.etf, self.phi).to(self.device)

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        opt = super().optimizer(model)
        clip_before_step(opt, self.cfg["fedgela-clip"])
        return opt
