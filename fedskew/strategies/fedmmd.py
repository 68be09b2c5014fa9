"""FedMMD server (Yao, Huang & Sun, VCIP'18): FedAvg of the local models, which the clients train
with the feature-MMD term against the global model (`fedskew/client_app/fedmmd.py`). The round's
metrics add the client mean of `mmd-loss`.
"""

from fedskew.strategies.base import BaseStrategy


class FedMMDStrategy(BaseStrategy):
    """FedAvg aggregation of models trained with the two-stream MMD loss."""
