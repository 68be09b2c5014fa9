"""FedProc server (Mu et al., arXiv 2109.12273): FedAvg of the local models plus the global class
prototypes, c_j the count-weighted mean of the clients' class-j prototypes, kept when no client held
class j this round (`fedskew/strategies/prototypes.py`, shared with FedMR; record
`fedproc-prototypes`, screened like FedMR's). Client side: `fedskew/client_app/fedproc.py`. The
round's metrics add the client means of `proto-loss` and `proto-alpha`.
"""

from fedskew.methods.fedproc import FEDPROC_PROTOTYPES
from fedskew.strategies.prototypes import PrototypeStrategy


class FedProcStrategy(PrototypeStrategy):
    """FedAvg aggregation plus count-weighted global class prototypes."""

    prototype_record = FEDPROC_PROTOTYPES
