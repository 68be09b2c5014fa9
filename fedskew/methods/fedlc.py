"""The card of `fedlc`: its classes, run-config keys, wire and paper.

Its code: server `strategies/fedavg.py`; client `client_app/fedlc.py`; maths `losses/fedlc.py`.
"""

from __future__ import annotations

from fedskew.methods.card import MethodSpec
from fedskew.schema import Param

METHOD = MethodSpec(
    "fedlc",
    strategy="fedskew.strategies.fedavg:FedAvgStrategy",
    trainer="fedskew.client_app.fedlc:FedLCTrainer",
    paper='Zhang et al., "Federated Learning with Label Distribution Skew via Logits Calibration", ICML 2022',
    params={
        "fedlc-tau": Param(
            float,
            1.0,
            "FedLC: logits calibrated by -tau * n_y^(-1/4), 0 = FedAvg (paper silent; FL-bench, PFLlib: 1)",
            low=0.0,
        ),
    },
)
