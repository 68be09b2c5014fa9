"""The card of `fedavgm`: its classes, run-config keys, wire and paper.

Its code: server `strategies/fedavgm.py`; client `client_app/fedavg.py`; maths
`strategies/aggregate.py`.
"""

from __future__ import annotations

from fedskew.methods.card import MethodSpec
from fedskew.schema import Param

METHOD = MethodSpec(
    "fedavgm",
    strategy="fedskew.strategies.fedavgm:FedAvgMStrategy",
    trainer="fedskew.client_app.fedavg:FedAvgTrainer",
    any_classifier=True,
    paper=(
        'Hsu, Qi & Brown, "Measuring the Effects of Non-Identical Data Distribution for Federated Visual '
        'Classification", arXiv 2019'
    ),
    params={
        "fedavgm-server-lr": Param(
            float,
            0.1,
            "FedAvgM: server step size eta, x <- x - eta v (0.1: eta / (1 - beta) = 1)",
            low=0.0,
            low_open=True,
        ),
        "fedavgm-server-momentum": Param(
            float, 0.9, "FedAvgM: server momentum beta, v <- beta v + (x - avg)", low=0.0, high=1.0, high_open=True
        ),
    },
)
