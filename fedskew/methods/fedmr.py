"""The card of `fedmr`: its classes, run-config keys, wire and paper.

Its code: server `strategies/fedmr.py` (+ `strategies/prototypes.py`); client `client_app/fedmr.py`
(+ `client_app/prototypes.py`); maths `losses/fedmr.py`.
"""

from __future__ import annotations

from fedskew.methods.card import MethodSpec, class_list_rule
from fedskew.records import FRACTION, NON_NEGATIVE, ConfigSpec, Flags, Spec
from fedskew.schema import Param
from fedskew.wire import MAX_PARTITIONS, Dims, Wire, prototype_downlink, prototype_uplink

FEDMR_PROTOTYPES = "fedmr-prototypes"
FEDMR_CONFIG = "fedmr-config"


def _fedmr_config(dims: Dims) -> dict[str, Spec]:
    return {FEDMR_CONFIG: ConfigSpec({"share-mask": Flags(MAX_PARTITIONS, required=True)}, required=False)}


WIRE = Wire(
    {
        "intra-loss": NON_NEGATIVE,
        "inter-loss": NON_NEGATIVE,
        "inter-active": FRACTION,
        "prototypes-shared": FRACTION,
        "intra-grad-share": NON_NEGATIVE,  # ||grad_body mu1 l_intra|| / ||grad_body CE||, round mean
        "inter-grad-share": NON_NEGATIVE,  # ||grad_body mu2 l_inter|| / ||grad_body CE||
    },
    prototype_uplink(FEDMR_PROTOTYPES),
    prototype_downlink(FEDMR_PROTOTYPES),
).extend(downlink=_fedmr_config)


METHOD = MethodSpec(
    "fedmr",
    strategy="fedskew.strategies.fedmr:FedMRStrategy",
    trainer="fedskew.client_app.fedmr:FedMRTrainer",
    paper='Fan et al., "Federated Learning under Partially Class-Disjoint Data via Manifold Reshaping", TMLR 2023',
    wire=WIRE,
    params={
        "fedmr-mu1": Param(float, 0.01, "FedMR: weight of the intra-class decorrelation loss", low=0.0),
        "fedmr-mu2": Param(float, 1e-4, "FedMR: weight of the inter-class prototype loss", low=0.0),
        "fedmr-intra-mode": Param(
            str,
            "ref",
            "FedMR intra scale: 'ref' (authors' code; paper's tuned mu1), 'paper_fro' (Eq. 3), 'paper_offdiag'",
            choices=("ref", "paper_fro", "paper_offdiag"),
        ),
        "fedmr-negatives": Param(
            str,
            "all",
            "FedMR inter loss negatives: 'all' classes with a prototype, or 'local' (Eq. 4 literally)",
            choices=("all", "local"),
        ),
        "fedmr-margin": Param(float, 0.0, "FedMR: margin inside the inter-loss hinge (paper: 0)", low=0.0),
        "fedmr-inter-form": Param(
            str,
            "hinge",
            "FedMR inter loss: 'hinge' (Eq. 4) or 'pull' (margin-removed: distance to own prototype)",
            choices=("hinge", "pull"),
        ),
        "fedmr-lite-n": Param(int, -1, "FedMR Lite: inter loss on n samples per batch (-1 all, 0 off)", low=-1),
        "fedmr-grad-share-every": Param(
            int,
            0,
            "FedMR: every n-th batch, log each term's backbone-gradient norm against the CE's (0 = never)",
            low=0,
        ),
        "fedmr-share-fraction": Param(
            float, 1.0, "FedMR privacy: share of clients (fixed, seeded) that upload prototypes", low=0.0, high=1.0
        ),
        "fedmr-private-classes": Param(
            str, "", "FedMR privacy: classes never uploaded, e.g. '3,7' or 'all' ('' = none)", rule=class_list_rule
        ),
    },
)
