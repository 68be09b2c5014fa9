"""The card of `moon`: its classes, run-config keys, wire and paper.

Its code: server `strategies/moon.py`; client `client_app/moon.py`; maths `losses/moon.py`.
"""

from __future__ import annotations

from fedskew.methods.card import MethodSpec
from fedskew.records import NON_NEGATIVE, Number
from fedskew.schema import Param
from fedskew.wire import Wire

# moon-negative: 1 when the client had its previous local model (the negative), 0 at a first participation
WIRE = Wire({"moon-loss": NON_NEGATIVE, "moon-negative": Number(int, 0, 1)})


METHOD = MethodSpec(
    "moon",
    strategy="fedskew.strategies.moon:MOONStrategy",
    trainer="fedskew.client_app.moon:MOONTrainer",
    paper='Li, He & Song, "Model-Contrastive Federated Learning", CVPR 2021',
    wire=WIRE,
    params={
        "moon-mu": Param(float, 1.0, "MOON: weight of the model-contrastive loss (authors' code default)", low=0.0),
        "moon-temperature": Param(
            float, 0.5, "MOON: temperature tau of the contrastive loss (paper and code)", low=0.0, low_open=True
        ),
    },
)
