"""FedProx server (Li et al., MLSys'20). Client side: `fedskew/client_app/fedprox.py`.

The server is FedAvg's; the method lives in the client's proximal term (`fedprox-mu`).
"""

from fedskew.strategies.fedavg import FedAvgStrategy


class FedProxStrategy(FedAvgStrategy):
    """FedAvg aggregation; clients add (mu/2)||w - w_global||^2 to their loss."""
