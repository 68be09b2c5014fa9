"""FedRS server (Li & Zhan, KDD'21, Alg. 1). Client side: `fedskew/client_app/fedrs.py`.

FedRS changes only the client loss (restricted softmax); payload, aggregation and evaluation are
FedAvg's. The paper averages uniformly, the authors' code by sample count; they agree on equal-size
shard partitions. Set `aggregation-weights="uniform"` for the paper's rule.
"""

from fedskew.strategies.base import BaseStrategy


class FedRSStrategy(BaseStrategy):
    """FedAvg aggregation of models trained with the restricted softmax."""
