"""The card of `scaffold-rs`: its classes, run-config keys, wire and paper.

Its code: server `strategies/scaffold_rs.py`; client `client_app/scaffold_rs.py`; maths as
`scaffold` and `fedrs`.
"""

from __future__ import annotations

from fedskew.methods import fedrs, scaffold
from fedskew.methods.card import MethodSpec

# SCAFFOLD's control variates with FedRS's observed classes
WIRE = scaffold.WIRE.extend(fedrs.WIRE.metrics)


METHOD = MethodSpec(
    "scaffold-rs",
    strategy="fedskew.strategies.scaffold_rs:ScaffoldRSStrategy",
    trainer="fedskew.client_app.scaffold_rs:ScaffoldRSTrainer",
    paper="SCAFFOLD (Karimireddy et al., ICML 2020) with FedRS's restricted softmax (Li & Zhan, KDD 2021)",
    revision=1,  # 1: update-norm-bound clips its diverging honest updates on 2-class splits
    wire=WIRE,
    params={
        "scaffold-rs-server-lr": scaffold.METHOD.params["scaffold-server-lr"],
        "scaffold-rs-alpha": fedrs.METHOD.params["fedrs-alpha"],
        "scaffold-rs-scale": fedrs.METHOD.params["fedrs-scale"],
        "scaffold-rs-tau": fedrs.METHOD.params["fedrs-tau"],
    },
)
