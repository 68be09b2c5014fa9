"""FedGELA server (Fan et al., NeurIPS'23, Alg. 1). Client side: `fedskew/client_app/fedgela.py`.

The server draws the simplex ETF once (`make_etf(d, C, fedgela-etf-seed)`) and never changes it.
Distribution: the matrix itself is broadcast every round as the `etf` ArrayRecord, beside its
SHA-256 in the `etf-info` ConfigRecord, which the client verifies. Sending the matrix rather than a
seed means no node depends on its own LAPACK giving bit-identical QR output (different BLAS builds
need not), and the checksum proves every node trains against the same bytes; the cost is d*C
floats (3.4 KB for LeNet, 1.7 % of its backbone). The ETF is not part of the model arrays: the
downlink, the replies and the average are the backbone (`features.*`) only, and
`expected_upload` drops any reply that is not exactly the backbone's names and shapes. The
centrally evaluated global model is the aggregated backbone with the plain (unadapted) ETF.
"""

from __future__ import annotations

from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord

from fedskew.losses.fedgela import ETFNet, etf_checksum, gela_model, make_etf
from fedskew.methods.fedgela import FEDGELA_ETF, FEDGELA_ETF_INFO
from fedskew.strategies.base import BaseStrategy

BACKBONE = "features."


class FedGELAStrategy(BaseStrategy):
    """FedAvg over backbones; a fixed, broadcast simplex ETF is the classifier."""

    def __init__(self, cfg: dict[str, Any], device: torch.device | None = None) -> None:
        super().__init__(cfg, device)
        net = super().build_model()
        self.etf = make_etf(net.feature_dim, net.num_classes, cfg["fedgela-etf-seed"])
        self.etf_sha256 = etf_checksum(self.etf)

    def build_model(self) -> ETFNet:
        """Backbone + plain ETF: the centrally evaluated global model. Its state dict is the
        backbone only, so the base's `initial_arrays` (FedAvg's seeded backbone weights),
        `global_model` and `aggregate_arrays` all work on backbones."""
        return gela_model(self.cfg, self.etf)

    def expected_upload(self, arrays: ArrayRecord) -> dict[str, tuple[tuple[int, ...], str]]:
        """Exactly the backbone's tensors (from the model definition, not from what was sent)."""
        backbone = ArrayRecord(self.build_model().state_dict())
        expected = super().expected_upload(backbone)
        if not all(k.startswith(BACKBONE) for k in expected):
            raise RuntimeError(f"FedGELA uploads the backbone only, not {sorted(expected)}")
        return expected

    def broadcast(self, server_round: int) -> dict[str, Any]:
        return {
            FEDGELA_ETF: ArrayRecord({"etf": self.etf}),
            FEDGELA_ETF_INFO: ConfigRecord({"sha256": self.etf_sha256, "seed": self.cfg["fedgela-etf-seed"]}),
        }
