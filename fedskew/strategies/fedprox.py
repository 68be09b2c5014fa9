"""FedProx server (Li et al., MLSys'20). Client side: `fedskew/client_app/fedprox.py`.

The server is the base's (FedAvg's sample-weighted average); the method lives in the client's
proximal term (`fedprox-mu`).
"""

from fedskew.strategies.base import BaseStrategy


class FedProxStrategy(BaseStrategy):
    """FedAvg aggregation; clients add (mu/2)||w - w_global||^2 to their loss."""
