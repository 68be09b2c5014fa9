"""The card of `scaffold`: its classes, run-config keys, wire and paper.

Its code: server `strategies/scaffold.py`; client `client_app/scaffold.py`; maths
`losses/scaffold.py`, `strategies/aggregate.py`.
"""

from __future__ import annotations

from fedskew.methods.card import MethodSpec
from fedskew.records import NON_NEGATIVE, ArraysSpec, Spec
from fedskew.schema import Param
from fedskew.wire import Dims, Wire

# The server control variate c travels down (one array per trainable parameter); nothing but the
# model travels up: option II's client update Delta c_i = (x - y_i) / (K_i eta_l) - c is computed by
# the server from the model it sent, the model it received, its own c and K_i (`strategies/scaffold.py`).
CONTROL = "control"


def _control_downlink(dims: Dims) -> dict[str, Spec]:
    return {CONTROL: ArraysSpec(dict(dims.params))}


WIRE = Wire({"correction-norm": NON_NEGATIVE}, downlink=_control_downlink)  # ||c - c_i|| of the round


METHOD = MethodSpec(
    "scaffold",
    strategy="fedskew.strategies.scaffold:ScaffoldStrategy",
    trainer="fedskew.client_app.scaffold:ScaffoldTrainer",
    any_classifier=True,
    paper='Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated Learning", ICML 2020',
    revision=1,  # 1: update-norm-bound clips its diverging honest updates on 2-class splits
    wire=WIRE,
    params={
        "scaffold-server-lr": Param(
            float, 1.0, "SCAFFOLD: server step size eta_g, x + eta_g (mean y_i - x) (paper: 1)", low=0.0, low_open=True
        ),
    },
)
