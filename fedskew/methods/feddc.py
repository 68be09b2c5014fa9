"""The card of `feddc`: its classes, run-config keys, wire and paper.

Its code: server `strategies/feddc.py`; client `client_app/feddc.py`; maths `losses/feddc.py`,
`losses/scaffold.py`.
"""

from __future__ import annotations

from fedskew.methods import scaffold
from fedskew.methods.card import MethodSpec
from fedskew.records import NON_NEGATIVE, ArraysSpec, Spec
from fedskew.schema import Param
from fedskew.wire import Dims

# Down: the gradient-correction control c (as SCAFFOLD's). Up: the drift-corrected model theta_i + h_i
# as the model arrays, and the local update theta_i - w (`feddc-update`, one array per trainable
# parameter), from which the server updates c.
FEDDC_UPDATE = "feddc-update"


def _feddc_uplink(dims: Dims) -> dict[str, Spec]:
    return {FEDDC_UPDATE: ArraysSpec(dict(dims.params))}


WIRE = scaffold.WIRE.extend({"feddc-drift-norm": NON_NEGATIVE}, _feddc_uplink)


METHOD = MethodSpec(
    "feddc",
    strategy="fedskew.strategies.feddc:FedDCStrategy",
    trainer="fedskew.client_app.feddc:FedDCTrainer",
    paper=(
        'Gao et al., "FedDC: Federated Learning with Non-IID Data via Local Drift Decoupling and Correction", CVPR 2022'
    ),
    revision=1,  # 1: grad-clip clips the correction with the loss gradient, as the authors' code
    wire=WIRE,
    params={
        "feddc-alpha": Param(
            float,
            0.01,
            "FedDC: weight alpha of the drift penalty alpha/2 ||theta + h - w||^2 (authors' code: 0.01)",
            low=0.0,
        ),
    },
)
