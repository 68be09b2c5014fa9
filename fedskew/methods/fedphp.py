"""The card of `fedphp`: its classes, run-config keys, wire and paper.

Its code: server `strategies/fedphp.py` (+ `strategies/hpm.py`); client `client_app/fedphp.py` (+
`client_app/hpm.py`); maths `losses/map.py`.
"""

from __future__ import annotations

from fedskew.methods.card import MethodSpec
from fedskew.records import FRACTION, Number
from fedskew.schema import Param
from fedskew.wire import Wire

# The inherited private model's schedule, reported by FedPHP and MAP: the momentum of this
# participation and the participation's number (the server counts them too, `strategies/hpm.py`).
HPM_METRICS: dict[str, Number] = {"hpm-mu": FRACTION, "hpm-participations": Number(int, 1)}

WIRE = Wire(HPM_METRICS)


def hpm_keys(method: str, label: str, *, soften_student: bool, mu_max: float) -> dict[str, Param]:
    """The inherited private model's keys (`fedskew/client_app/hpm.py`), shared by FedPHP and MAP:
    `<method>-transfer`, `-transfer-weight`, `-temperature`, `-soften-student`, `-mu-bar`, `-mu-max`,
    `-mmd-kernels` and `-mmd-kernel-mul`; `soften_student` and `mu_max` default to MAP's paper
    (true, 1.0) or the authors' code (false, 0.9)."""
    keys = {
        "transfer": Param(
            str, "distill", f"{label}: HPM transfer term, logit distillation or feature MMD", choices=("distill", "mmd")
        ),
        "transfer-weight": Param(float, 0.1, f"{label}: lambda in (1-lambda) CE + lambda L_tr", low=0.0, high=1.0),
        "temperature": Param(float, 4.0, f"{label}: distillation temperature tau", low=0.0, low_open=True),
        "soften-student": Param(
            bool,
            soften_student,
            f"{label}: divide the student's logits by tau too (MAP's paper; false = authors' code)",
        ),
        "mu-bar": Param(float, 0.9, f"{label}: macro momentum; mu = mu_bar (n-1) / (Q T)", low=0.0),
        "mu-max": Param(
            float, mu_max, f"{label}: upper clip of the HPM momentum (MAP's paper 1.0, code 0.9)", low=0.0, high=1.0
        ),
        "mmd-kernels": Param(
            int, 5, f"{label}: number of Gaussian kernels of the MMD (MAP's paper: 5; at most 64)", low=1, high=64
        ),
        "mmd-kernel-mul": Param(float, 2.0, f"{label}: bandwidth ratio between MMD kernels", low=1.0, low_open=True),
    }
    return {f"{method}-{k}": p for k, p in keys.items()}


METHOD = MethodSpec(
    "fedphp",
    strategy="fedskew.strategies.fedphp:FedPHPStrategy",
    trainer="fedskew.client_app.fedphp:FedPHPTrainer",
    paper='Li, Zhan et al., "FedPHP: Federated Personalization with Inherited Private Models", ECML-PKDD 2021',
    wire=WIRE,
    params={
        **hpm_keys("fedphp", "FedPHP", soften_student=False, mu_max=0.9),
    },
)
