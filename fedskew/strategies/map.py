"""MAP server (Li et al., TKDE'24, Alg. 1 ServerProcedure). Client side: `fedskew/client_app/map.py`.

The server averages the clients' stage-1 (restricted-softmax) models; the HPMs never leave the
clients.

Aggregation weights. Alg. 1 line 6 (and Sec. III-A's description of FedAvg) write the uniform
mean theta_{t+1} = sum_{k in S_t} theta^k_{a,t} / |S_t|, but Eq. 2 weights clients by p_k, the
paper "follow[s] the architecture and training paradigm of FedAvg [7]" (Sec. IV-C), whose
aggregation weights by sample count, and the authors' code, which produced the paper's numbers,
weights by sample count (`lxcnju/MAP` `algorithms/fedap.py` `train`: weights = n_k / sum n, commit
42b1478). Decision: the uniform mean by default (`map-uniform-aggregation=true`), Algorithm 1 as
printed together with its E/2 + E/2 schedule (`map-schedule`), the reading measured best on both
models (`docs/notes/map.md`); `false` weights by sample count (`aggregation-weights`, the code), and
with `map-schedule="epochs"` MAP's global model is then FedRS's, the comparison Sec. IV-C makes.

The server also counts each partition's accepted replies to flag lost HPM states (`HPMStrategy`,
shared with FedPHP: `fedskew/strategies/hpm.py`).
"""

from __future__ import annotations

import math

from flwr.app import Message

from fedskew.strategies.aggregate import summarize_clients
from fedskew.strategies.base import arrays_to_numpy, numpy_to_arrays
from fedskew.strategies.hpm import HPMStrategy


class MAPStrategy(HPMStrategy):
    """The mean of the uploaded stage-1 models (uniform as Alg. 1 line 6 by default; sample-weighted
    without `map-uniform-aggregation`) + HPM bookkeeping."""

    def aggregate_arrays(self, server_round: int, replies: list[Message]):
        if not self.cfg["map-uniform-aggregation"]:
            return super().aggregate_arrays(server_round, replies)
        models = [arrays_to_numpy(m.content["arrays"]) for m in replies]
        return numpy_to_arrays(self.mean(models, [1.0] * len(models)))

    def aggregate_extras(self, server_round: int, replies: list[Message]) -> dict[str, float]:
        stage2 = [float(m.content["metrics"].get("stage2-accuracy", float("nan"))) for m in replies]
        return {
            **self.hpm_metrics(server_round, replies),
            "stage2-accuracy": summarize_clients([a for a in stage2 if math.isfinite(a)])[0],
        }
