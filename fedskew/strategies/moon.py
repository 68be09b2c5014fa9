"""MOON server (Li, He & Song, CVPR'21, Alg. 1): FedAvg of the local models, which the clients
train with the model-contrastive loss (`fedskew/client_app/moon.py`); the previous local models stay
on the clients. The round's metrics add the client means of `moon-loss` (the contrastive term) and
`moon-negative` (the share of clients that had their previous model).
"""

from fedskew.strategies.base import BaseStrategy


class MOONStrategy(BaseStrategy):
    """FedAvg aggregation of models trained with the model-contrastive loss."""
