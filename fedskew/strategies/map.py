"""MAP server (Li et al., TKDE'24, Alg. 1 ServerProcedure). Client side: `fedskew/client_app/map.py`.

The server averages the clients' stage-1 (restricted-softmax) models; the HPMs never leave the
clients. Alg. 1 line 6 averages uniformly, theta_{t+1} = 1/|S_t| sum_k theta^k_{a,t}; that is the
default here (`map-uniform-aggregation=true`); `false` follows `aggregation-weights` (the authors'
code weights by sample count).

The server also counts each partition's accepted replies to flag lost HPM states (`HPMStrategy`,
shared with FedPHP: `fedskew/strategies/hpm.py`).
"""

from __future__ import annotations

import math

from flwr.app import Message

from fedskew import wire
from fedskew.strategies.aggregate import summarize_clients, weighted_average
from fedskew.strategies.base import arrays_to_numpy, numpy_to_arrays
from fedskew.strategies.hpm import HPMStrategy


class MAPStrategy(HPMStrategy):
    """FedAvg of the uploaded stage-1 models (uniform by default, as Alg. 1) + HPM bookkeeping."""

    wire = wire.MAP

    def aggregate_arrays(self, server_round: int, replies: list[Message]):
        if not self.cfg["map-uniform-aggregation"]:
            return super().aggregate_arrays(server_round, replies)
        models = [arrays_to_numpy(m.content["arrays"]) for m in replies]
        return numpy_to_arrays(weighted_average(models, [1.0] * len(models)))

    def aggregate_extras(self, server_round: int, replies: list[Message]) -> dict[str, float]:
        stage2 = [float(m.content["metrics"].get("stage2-accuracy", float("nan"))) for m in replies]
        return {
            **self.hpm_metrics(server_round, replies),
            "stage2-accuracy": summarize_clients([a for a in stage2 if math.isfinite(a)])[0],
        }
