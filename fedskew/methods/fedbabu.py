"""The card of `fedbabu`: its classes, run-config keys, wire and paper.

Its code: server ; client .
"""

from __future__ import annotations

from fedskew.methods.card import MethodSpec
from fedskew.records import NON_NEGATIVE
from fedskew.schema import Param
from fedskew.wire import Wire

# Uplink: the body only (`FedBABUStrategy.expected_upload`); the fixed head travels down only.
WIRE = Wire({"fedbabu-finetune-loss": NON_NEGATIVE})


METHOD = MethodSpec(
    "fedbabu",
    strategy="fedskew.strategies.fedbabu:FedBABUStrategy",
    trainer="fedskew.client_app.fedbabu:FedBABUTrainer",
    paper='Oh, Kim & Yun, "FedBABU: Toward Enhanced Representation for Federated Image Classification", ICLR 2022',
    wire=WIRE,
    params={
        "fedbabu-finetune-epochs": Param(
            int,
            5,
            "FedBABU: fine-tuning epochs of the personalized model (code: 5; at most 1000)",
            low=0,
            high=1000,
        ),
        "fedbabu-finetune-lr": Param(
            float, 0.001, "FedBABU: fine-tuning lr (authors' analysis.ipynb: 1e-3)", low=0.0, low_open=True
        ),
        "fedbabu-finetune-every": Param(
            int,
            1,
            "FedBABU: fine-tune in every N-th round and the last; 0: the last round only (PFLlib's"
            " serverbabu.py); other rounds' personalized model is the received global model",
            low=0,
            neutral=True,  # at 1 every round fine-tunes, as before the key
        ),
        "fedbabu-finetune-part": Param(
            str, "full", "FedBABU: fine-tune the whole model (code) or the head only", choices=("full", "head")
        ),
    },
)
