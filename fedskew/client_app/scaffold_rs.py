"""SCAFFOLD + restricted softmax (the last row of FedRS's Tables 1, 4 and 5, Li & Zhan, KDD'21,
Sec. 5: "our method can be easily combined with other methods, e.g., Scaffold"): SCAFFOLD's
corrected local steps and control variates (`ScaffoldTrainer`) on FedRS's restricted-softmax loss
(`FedRSTrainer`, keys `scaffold-rs-alpha`, `scaffold-rs-tau`, `scaffold-rs-scale` as `fedrs-*`).
The FedRS authors' code for this row (`lxcnju/FedRepo` at 617ee015, algorithms/scaffoldrs.py) is
their SCAFFOLD with the count-proportional scale (`scaffold-rs-scale="count"`); the default is the
paper's binary rule, as for `fedrs`. Server side: `fedskew/strategies/scaffold_rs.py`.

The combination is the method resolution order: `ScaffoldTrainer.local_train` runs
`FedRSTrainer.local_train` (the client's scale from its label counts), which runs the base loop with
FedRS's `loss` and SCAFFOLD's corrected `optimizer`; then SCAFFOLD updates c_i.
"""

from fedskew.client_app.fedrs import FedRSTrainer
from fedskew.client_app.scaffold import ScaffoldTrainer


class ScaffoldRSTrainer(ScaffoldTrainer, FedRSTrainer):
    """SCAFFOLD's local procedure on the restricted-softmax cross-entropy."""

    batched = True
    rs_prefix = "scaffold-rs"
