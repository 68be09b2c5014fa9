"""FedGELA client (Fan et al., NeurIPS'23, Alg. 1; maths in `fedskew/losses/fedgela.py`).

The server's ETF arrives as the `etf` ArrayRecord with its SHA-256 in the `etf-info` ConfigRecord;
the client checks the checksum and the shape (d, C), then trains only the backbone with
cross-entropy on s * phi_k,c * cos(h, m_c), phi_k = C n_{k,c} / n_k from its own training labels
(computed here, never sent). The ETF and phi are buffers, not parameters: no gradient, no weight
decay, unchanged by training. The upload is the backbone's state dict only. The personalized model
is the trained backbone with the adapted ETF (spec §2.7), evaluated right after local training; the
received global model (`client-global-accuracy`, the paper's PA of a global model) is the received
backbone with the plain, unadapted ETF.
The gradient norm is clipped to `fedgela-clip` (authors' code: 20; 0 turns it off).
"""

from __future__ import annotations

import torch
from flwr.app import RecordDict
from torch import nn

from fedskew.client_app.fedavg import FedAvgTrainer
from fedskew.losses.fedgela import ETFNet, etf_backbone, etf_checksum, local_phi
from fedskew.models import build_model
from fedskew.training import clip_before_step


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


class FedGELATrainer(FedAvgTrainer):
    """Backbone-only training against the client's adapted simplex ETF."""

    def fit(self, content: RecordDict) -> RecordDict:
        info = build_model(self.cfg["model"], self.cfg["dataset"])
        self.etf = received_etf(content, info.feature_dim, info.num_classes)
        self.phi = local_phi(self.data.train_counts) if self.cfg["fedgela-adapt"] else None
        return super().fit(content)

    def build_model(self) -> ETFNet:
        net = build_model(self.cfg["model"], self.cfg["dataset"])
        backbone = etf_backbone(net.features, net.feature_dim, self.cfg["fedgela-feature-norm"])
        model = ETFNet(backbone, self.etf, self.cfg["fedgela-ew"], self.phi, self.cfg["fedgela-mode"])
        return model.to(self.device)

    def received_global_model(self, model: nn.Module) -> nn.Module:
        """The received backbone with the plain ETF (phi = None): the server's global model."""
        return ETFNet(model.features, self.etf, self.cfg["fedgela-ew"], None, self.cfg["fedgela-mode"])

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        opt = super().optimizer(model)
        clip_before_step(opt, self.cfg["fedgela-clip"])
        return opt
