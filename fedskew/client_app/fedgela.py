"""FedGELA client (Fan et al., NeurIPS'23, Alg. 1; maths in `fedskew/losses/fedgela.py`).

The server's ETF arrives as the `etf` ArrayRecord with its SHA-256 in the `etf-info` ConfigRecord;
the client checks its shape (d, C), dtype and finite values (`server_records`, as every server
record) and the checksum, then trains only the backbone (the network's features and the
`fedgela-head` layers) with cross-entropy on s * phi_k,c * cos(h, m_c), s = sqrt(E_W) (paper's head; the
authors' code: s * phi_k,c * m_c^T h with s = 1 / T), where phi_k = C n_{k,c} / n_k comes from its
own training labels (computed here, never sent). The ETF and phi are buffers, not parameters: no
gradient, no weight decay, unchanged by training. The upload is the backbone's state dict only. The
personalized model is the trained backbone with the adapted ETF, evaluated right after local
training (no extra fine-tuning: the paper records PA during training); the received global model
(`client-global-accuracy`, the paper's PA of a global model) is the received backbone with the
plain, unadapted ETF.
The gradient norm is clipped to `fedgela-clip` (authors' code: 20; 0 turns it off).
The batched engine stacks the clients of the paper's head (FedAvg's functional loss: the ETF and
phi are buffers, each client's own), not those of the authors' head, whose BatchNorm1d keeps
running statistics (`stacked_refusal`).
"""

from __future__ import annotations

from typing import Any

import torch
from flwr.app import ConfigRecord, RecordDict
from torch import nn

from fedskew.client_app.base import BaseTrainer
from fedskew.losses.fedgela import ETFNet, etf_checksum, feature_head, gela_model, is_simplex_etf, local_phi
from fedskew.methods.fedgela import FEDGELA_ETF, FEDGELA_ETF_INFO
from fedskew.records import Rejected
from fedskew.training import clip_before_step, module_refusal


def verified_etf(etf: torch.Tensor, info: ConfigRecord) -> torch.Tensor:
    """`etf` (already checked: shape, dtype, finite values in [-1, 1]) after checking that it is a
    simplex ETF (a checksum from the same sender proves nothing about an all-zero matrix) and its
    checksum against the `etf-info` record of the same message (checked: a 64-digit hex sha256)."""
    if not is_simplex_etf(etf):
        raise Rejected("FedGELA: the server's 'etf' is not a simplex ETF (unit columns, pairwise cosine -1/(C-1))")
    if etf_checksum(etf) != info["sha256"]:
        raise Rejected(f"FedGELA: ETF checksum {etf_checksum(etf)[:12]} != broadcast {info['sha256'][:12]}")
    return etf


class FedGELATrainer(BaseTrainer):
    """Backbone-only training against the client's adapted simplex ETF."""

    batched = True

    @classmethod
    def stacked_refusal(cls, cfg: dict[str, Any]) -> str | None:
        """The backbone's head too (`fedgela-head`): the authors' ends in a BatchNorm1d."""
        head = feature_head(1, cfg["fedgela-head"])
        return super().stacked_refusal(cfg) or module_refusal(head)

    def receive(self, content: RecordDict) -> dict[str, Any]:
        received = super().receive(content)
        self.etf = verified_etf(received[FEDGELA_ETF]["etf"], received[FEDGELA_ETF_INFO])
        self.phi = local_phi(self.data.train_counts) if self.cfg["fedgela-adapt"] else None
        return received

    def build_model(self) -> ETFNet:
        return gela_model(self.cfg, self.etf, self.phi).to(self.device, self.dtype)

    def received_global_model(self, model: nn.Module) -> nn.Module:
        """The received backbone with the plain ETF (phi = None): the server's global model."""
        return model.plain()

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        opt = super().optimizer(model)
        clip_before_step(opt, self.cfg["fedgela-clip"])
        return opt
