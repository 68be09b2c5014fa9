"""The card of `fedaws`: its classes, run-config keys, wire and paper.

Its code: server `strategies/fedaws.py`; client `client_app/fedavg.py`; maths `losses/fedaws.py`.
"""

from __future__ import annotations

from fedskew.methods.card import MethodSpec
from fedskew.schema import Param

METHOD = MethodSpec(
    "fedaws",
    strategy="fedskew.strategies.fedaws:FedAwSStrategy",
    trainer="fedskew.client_app.fedavg:FedAvgTrainer",
    paper='Yu et al., "Federated Learning with Only Positive Labels", ICML 2020',
    params={
        "fedaws-margin": Param(
            float, 0.8, "FedAwS: spreadout margin nu on the class-embedding distance (FedRS authors' code)", low=0.0
        ),
        "fedaws-distance": Param(
            str,
            "cosine",
            "FedAwS: 'cosine' (1 - cos)/2 (FedRS authors' code) or 'euclidean' ||w_c - w_c'||",
            choices=("cosine", "euclidean"),
        ),
        "fedaws-steps": Param(
            int, 30, "FedAwS: server SGD steps on the spreadout regularizer per round (FedRS authors' code)", low=0
        ),
        "fedaws-lr": Param(
            float,
            1e-3,
            "FedAwS: lr of those steps on the sum over class pairs (FedRS code's 0.1 on the C x C mean, C = 10)",
            low=0.0,
        ),
        "fedaws-momentum": Param(
            float,
            0.9,
            "FedAwS: momentum of those steps, fresh each round (FedRS authors' code)",
            low=0.0,
            high=1.0,
            high_open=True,
        ),
    },
)
