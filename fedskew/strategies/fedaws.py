"""FedAwS server (Yu et al., "Federated Learning with Only Positive Labels", ICML'20, Alg. 1):
average the clients' models (FedAvg), then spread the class embeddings, the rows of the aggregated
bias-free classifier W [C, d] (`classifier.weight`), apart with the spreadout regularizer
(`fedskew/losses/fedaws.py`): `fedaws-steps` SGD steps of lr `fedaws-lr` and momentum
`fedaws-momentum` on sum_{c != c'} max(0, nu - d(w_c, w_c'))^2, nu = `fedaws-margin`, d =
`fedaws-distance`. The body and the BN buffers are FedAvg's.

Client side: FedAvg's trainer (softmax cross-entropy over all C classes). The paper's clients hold
one class each and, without negatives, train only a positive loss on their own class embedding; with
label skew (clients holding several classes) the FedRS authors' FedAwS trains the ordinary softmax
cross-entropy (lxcnju/FedRepo at 617ee01, `algorithms/fedaws.py` `update_local`), which is how FedRS's
Tables 1, 4 and 5 ran FedAwS, and is followed here.

Defaults: the paper's nu and lambda*eta are for its one-class-per-client setting and could not be read
here; the defaults are that FedAwS's first setting (`train_lab.py`: margin 0.8, 30 steps, lr 0.1,
momentum 0.9, cosine distance), its lr 0.1 on the C x C mean being 0.001 on the sum for 10 classes.
The regularizer's value before and after the steps is logged (`spreadout-before`, `spreadout-after`).
The server keeps no state across rounds (a fresh optimiser each round, as that code).
"""

from __future__ import annotations

from flwr.app import ArrayRecord, Message

from fedskew.losses.fedaws import spreadout, spreadout_regularizer
from fedskew.strategies.base import BaseStrategy

CLASSIFIER = "classifier.weight"


class FedAwSStrategy(BaseStrategy):
    """FedAvg, then gradient steps on the spreadout regularizer of the classifier's rows."""

    def aggregate_arrays(self, server_round: int, replies: list[Message]) -> ArrayRecord:
        arrays = super().aggregate_arrays(server_round, replies).to_torch_state_dict()
        w, cfg = arrays[CLASSIFIER], self.cfg
        margin, distance = cfg["fedaws-margin"], cfg["fedaws-distance"]
        new = spreadout(w, margin, distance, cfg["fedaws-steps"], cfg["fedaws-lr"], cfg["fedaws-momentum"])
        self.spread = {
            "spreadout-before": float(spreadout_regularizer(w, margin, distance)),
            "spreadout-after": float(spreadout_regularizer(new, margin, distance)),
        }
        arrays[CLASSIFIER] = new.to(w.dtype)
        return ArrayRecord(arrays)

    def aggregate_extras(self, server_round: int, replies: list[Message]) -> dict[str, float]:
        return {**super().aggregate_extras(server_round, replies), **self.spread}
