"""FedPHP server (Li, Zhan, Shao, Li & Song, "FedPHP: Federated Personalization with Inherited
Private Models", ECML-PKDD'21; the authors' code `lxcnju/FedRepo` at commit
617ee015046409d95dbd76ba39eebb92d313ab94, `algorithms/fedphp.py`). Client side:
`fedskew/client_app/fedphp.py`.

The clients upload the global model they trained with the HPM's transfer term; the server averages
the uploads weighted by the clients' sample counts (`update_global` with weights
``n_k / sum n_k``: the base's `aggregation-weights="num-examples"`). The HPMs never leave the
clients; the server counts each partition's participations (`HPMStrategy`, shared with MAP).
"""

from __future__ import annotations

from fedskew.strategies.hpm import HPMStrategy


class FedPHPStrategy(HPMStrategy):
    """FedAvg of the uploads + HPM bookkeeping."""
