"""FedRep server (Collins et al., ICML'21, Alg. 1). Client side: `fedskew/client_app/fedrep.py`.

The server holds, averages and sends the shared body phi only (`features`): its initial arrays are
the body of the run's seeded initial model, every reply must upload exactly the body (the base's
`expected_upload` of the body it sent: a reply carrying a head is refused), and the average is the
base's sample-weighted one (the code's `main_fedrep.py` weights by local sample counts).

FedRep has no single global model: each client's model is the shared body under its own head, and
the server never holds a head. So there is no central evaluation (`global_model` is None):
`global-accuracy` stays empty rather than scoring the body under a head no client has, and no
`model.pt` is written (the checkpoint holds the body). FedRep's generic accuracy, as FedGELA (Fan
et al., NeurIPS'23, Sec. 5) and FedRoD (Chen & Chao, ICLR'22) define it for personalized methods, is
the mean accuracy of the clients' personalized models on the central test set: a client-side
measurement.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from flwr.app import ArrayRecord
from torch import nn

from fedskew.models import body_state
from fedskew.strategies.base import BaseStrategy

log = logging.getLogger("fedskew.server")


class FedRepStrategy(BaseStrategy):
    """Average of the uploaded bodies; the heads stay on the clients; no central evaluation."""

    def __init__(self, cfg: dict[str, Any], device: torch.device | None = None) -> None:
        super().__init__(cfg, device)
        log.info("fedrep: no single global model (the heads stay on the clients): no central evaluation")

    def initial_arrays(self) -> ArrayRecord:
        """The body of the run's seeded initial model."""
        return ArrayRecord(body_state(super().initial_arrays().to_torch_state_dict()))

    def global_model(self, arrays: ArrayRecord) -> nn.Module | None:
        return None
