"""FedAvg server (McMahan et al., AISTATS'17, Alg. 1 "FederatedAveraging").

    w_{t+1} = sum_k (n_k / n) w^k_{t+1}   over the clients k sampled in round t

Client side: `fedskew/client_app/fedavg.py`. The sample-weighted average is the base's default
aggregation (`BaseStrategy.aggregate_arrays`; `aggregation-weights="uniform"` gives 1/|S_t|), so
FedAvg adds nothing to the base.
"""

from fedskew.strategies.base import BaseStrategy


class FedAvgStrategy(BaseStrategy):
    """Sample-weighted (or uniform, `aggregation-weights`) average of the uploaded models."""
