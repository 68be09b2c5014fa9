"""The card of `creff`: its classes, run-config keys, wire and paper.

Its code: server `strategies/creff.py`; client `client_app/creff.py`; maths `losses/creff.py` (+
`losses/mupfl.py`).
"""

from __future__ import annotations

from fedskew.methods.card import MethodSpec
from fedskew.schema import Param
from fedskew.wire import Wire, class_gradient_record, classifier_record

CREFF_GRADS = "creff-grads"
CREFF_CLASSIFIER = "creff-classifier"

WIRE = Wire(
    uplink=lambda dims: {CREFF_GRADS: class_gradient_record(dims)},
    downlink=lambda dims: {CREFF_CLASSIFIER: classifier_record(dims)},
)


METHOD = MethodSpec(
    "creff",
    strategy="fedskew.strategies.creff:CReFFStrategy",
    trainer="fedskew.client_app.creff:CReFFTrainer",
    paper=(
        'Shang et al., "Federated Learning on Heterogeneous and Long-Tailed Data via Classifier '
        'Re-Training with Federated Features", IJCAI 2022'
    ),
    revision=1,  # 1: the feature matching's cosine divides by |a| |b| + 1e-6, as the authors' code
    wire=WIRE,
    params={
        "creff-features-per-class": Param(int, 100, "CReFF: federated features per class (authors' code)", low=1),
        "creff-match-iters": Param(int, 100, "CReFF: gradient-matching SGD steps a round (authors' code)", low=0),
        "creff-feature-lr": Param(
            float, 0.1, "CReFF: SGD lr of the federated features (authors' code)", low=0.0, low_open=True
        ),
        "creff-retrain-epochs": Param(int, 300, "CReFF: epochs re-training a fresh classifier (authors' code)", low=0),
        "creff-retrain-lr": Param(
            float, 0.01, "CReFF: SGD lr of the re-training (authors' code)", low=0.0, low_open=True
        ),
        "creff-batch-real": Param(
            int, 32, "CReFF client: samples per class in one gradient draw (authors' code)", low=1
        ),
        "creff-real-repeats": Param(int, 10, "CReFF client: draws averaged per class gradient (authors' code)", low=1),
    },
)
