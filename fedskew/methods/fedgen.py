"""The card of `fedgen`: its classes, run-config keys, wire and paper.

Its code: server `strategies/fedgen.py`; client `client_app/fedgen.py`; maths `losses/fedgen.py`.
"""

from __future__ import annotations

from typing import Any

from fedskew.methods.card import MethodSpec
from fedskew.records import NON_NEGATIVE, ArraysSpec, Spec, Tensor
from fedskew.schema import Param
from fedskew.wire import Dims, Wire

FEDGEN_COUNTS = "fedgen-counts"
FEDGEN_GENERATOR = "fedgen-generator"


def _fedgen_uplink(dims: Dims) -> dict[str, Spec]:
    """The client's label counts n_k^y over its training set (they sum to its num-examples:
    `FedGenStrategy.check_reply`)."""
    return {FEDGEN_COUNTS: ArraysSpec({"counts": Tensor((dims.num_classes,), "int64", low=0)})}


def _fedgen_downlink(dims: Dims) -> dict[str, Spec]:
    """The server's generator G(z | y) (its state dict: weights and BatchNorm statistics), sent
    once it has been trained (from round 2 on)."""
    from fedskew.losses.fedgen import build_generator
    from fedskew.records import tensor_like

    forms = {
        k: tensor_like(v) for k, v in build_generator(dims.cfg, dims.num_classes, dims.feature_dim).state_dict().items()
    }
    return {FEDGEN_GENERATOR: ArraysSpec(forms, required=False)}


WIRE = Wire(
    {"fedgen-teacher-loss": NON_NEGATIVE, "fedgen-latent-loss": NON_NEGATIVE},
    _fedgen_uplink,
    _fedgen_downlink,
)


def _fedgen_batch_rule(iterations: int, cfg: dict[str, Any]) -> None:
    """FedGen's generator trains on batches of `batch-size` labels through BatchNorm: at least 2."""
    if cfg["method"] == "fedgen" and iterations > 0 and cfg["batch-size"] < 2:
        raise ValueError(f"the generator trains on batches of batch-size={cfg['batch-size']} labels; it needs >= 2")


METHOD = MethodSpec(
    "fedgen",
    strategy="fedskew.strategies.fedgen:FedGenStrategy",
    trainer="fedskew.client_app.fedgen:FedGenTrainer",
    paper='Zhu, Hong & Zhou, "Data-Free Knowledge Distillation for Heterogeneous Federated Learning", ICML 2021',
    wire=WIRE,
    params={
        "fedgen-hidden-dim": Param(int, 256, "FedGen: generator hidden width (authors' code, MNIST/EMNIST)", low=1),
        "fedgen-noise-dim": Param(int, 32, "FedGen: generator noise dimension, eps ~ U[0,1) (authors' code)", low=1),
        "fedgen-lr": Param(
            float, 3e-4, "FedGen: generator Adam lr, x0.98 a round (authors' MNIST)", low=0.0, low_open=True
        ),
        "fedgen-weight-decay": Param(float, 1e-2, "FedGen: generator Adam weight decay (authors' code)", low=0.0),
        "fedgen-iterations": Param(
            int,
            50,
            "FedGen: generator steps a round, batch = batch-size (authors' code)",
            low=0,
            rule=_fedgen_batch_rule,
        ),
        "fedgen-eta": Param(float, 1.0, "FedGen: weight of the generator's diversity loss (authors' code)", low=0.0),
        "fedgen-alpha": Param(float, 10.0, "FedGen client: weight of CE on generated features, x0.98 a round", low=0.0),
        "fedgen-beta": Param(
            float, 10.0, "FedGen client: weight of the code's latent KL term, x0.98 a round (0: paper)", low=0.0
        ),
        "fedgen-gen-batch-size": Param(int, 32, "FedGen client: labels sampled per mini-batch (authors' code)", low=1),
    },
)
