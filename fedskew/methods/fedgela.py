"""The card of `fedgela`: its classes, run-config keys, wire and paper.

Its code: server `strategies/fedgela.py`; client `client_app/fedgela.py`; maths `losses/fedgela.py`.
"""

from __future__ import annotations

from fedskew.methods.card import MethodSpec
from fedskew.records import ArraysSpec, ConfigSpec, Number, Spec, Tensor, Text
from fedskew.schema import Param
from fedskew.wire import Dims, Wire

FEDGELA_ETF = "etf"
FEDGELA_ETF_INFO = "etf-info"


def _fedgela_downlink(dims: Dims) -> dict[str, Spec]:
    etf = Tensor((dims.feature_dim, dims.num_classes), "float32", -1.0, 1.0)  # unit-norm columns
    info = {"sha256": Text(64, "0123456789abcdef", required=True), "seed": Number(int, 0)}
    return {FEDGELA_ETF: ArraysSpec({"etf": etf}), FEDGELA_ETF_INFO: ConfigSpec(info)}


WIRE = Wire(downlink=_fedgela_downlink)


METHOD = MethodSpec(
    "fedgela",
    strategy="fedskew.strategies.fedgela:FedGELAStrategy",
    trainer="fedskew.client_app.fedgela:FedGELATrainer",
    paper=(
        'Fan et al., "Federated Learning with Bilateral Curation for Partially Class-Disjoint Data" '
        "(FedGELA), NeurIPS 2023"
    ),
    wire=WIRE,
    params={
        "fedgela-head": Param(
            str,
            "paper",
            "FedGELA feature head: 'paper' (FC layer, L2-normalised, x sqrt(E_W)) or 'code' (authors' "
            "MLP + BatchNorm1d, no L2, / temperature)",
            choices=("paper", "code"),
        ),
        "fedgela-ew": Param(
            float,
            300.0,
            "FedGELA head 'paper': classifier length E_W, logits x sqrt(E_W) (paper 1e3..1e6; 300 from "
            "suites/fmnist-fedgela-ew.yaml)",
            low=0.0,
            low_open=True,
        ),
        "fedgela-temperature": Param(
            float,
            0.2,
            "FedGELA head 'code': logits / T (authors' --temperature, default 0.2)",
            low=0.0,
            low_open=True,
        ),
        "fedgela-mode": Param(
            str,
            "all",
            "FedGELA softmax: 'all' C-way, missing logits 0 (code); 'local' over C_k (Eq. 5)",
            choices=("all", "local"),
        ),
        "fedgela-adapt": Param(bool, True, "FedGELA: local adaptation phi_k (false = FedGE ablation, plain ETF)"),
        "fedgela-etf-seed": Param(int, 0, "FedGELA: seed of the server's random simplex ETF", low=0),
        "fedgela-clip": Param(float, 20.0, "FedGELA: local gradient-norm clip (authors' code; 0 = off)", low=0.0),
    },
)
