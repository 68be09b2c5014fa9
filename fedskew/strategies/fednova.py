"""FedNova server (Wang et al., "Tackling the Objective Inconsistency Problem in Heterogeneous
Federated Optimization", NeurIPS'20, Sec. 4-5). Client side: `fedskew/client_app/fednova.py`
(FedAvg's local training).

FedAvg weighs a client's update y_i - x by p_i whatever the number of local steps tau_i it took, so
the federation minimises a surrogate objective that over-weights clients with more steps. FedNova
normalises each update by a_i, the total weight its local optimiser gave to its gradients, then
rescales by tau_eff:

    x+ = x - tau_eff sum_i p_i (x - y_i) / a_i,    tau_eff = sum_i p_i a_i,
    a_i = tau_i (plain SGD),   a_i = [tau_i - rho (1 - rho^tau_i) / (1 - rho)] / (1 - rho)  (momentum rho)

(`fedskew.strategies.aggregate.normalized_average`, `fednova_normalizer`). Decisions:
- tau_i is computed here from the partition's size, `local-epochs` and `batch-size`
  (`BaseStrategy.local_steps`), never read from the reply; rho is the run's `momentum` (torch's SGD
  starts its buffer at the first gradient, as the a_i above and `JYWa/FedNova` at 47b4e096,
  distoptim/FedNova.py, assume). Weight decay and gradient clipping change g, not a_i.
- p_i follows `aggregation-weights` (default n_i / sum n_j over this round's replies, as NIID-Bench
  at 61b901ab, experiments.py; the paper's p_i = n_i / n); tau_eff = sum_i p_i a_i, the authors'
  default (`JYWa/FedNova`, `average`).
- Only the trainable parameters are normalised; buffers (BatchNorm statistics, counters) are
  averaged with the same p_i (the authors' code leaves buffers out of the update; NIID-Bench
  normalises them too, which has no meaning for running statistics).
- No server momentum (`gmf` = 0 in the authors' code), no proximal variant.
- With `robust-aggregation` the p-weighted sum becomes the rule's coordinate-wise mean of the terms
  x - tau_eff (x - y_i) / a_i (`normalized_models`); the y_i are clipped first (`bound_updates`).
Metric: `tau-eff`.
"""

from __future__ import annotations

from flwr.app import ArrayRecord, Message

from fedskew.strategies.aggregate import fednova_normalizer, normalized_average, normalized_models
from fedskew.strategies.base import BaseStrategy, arrays_to_numpy, numpy_to_arrays


class FedNovaStrategy(BaseStrategy):
    """Normalised averaging of the local updates by each client's a_i."""

    def normalizers(self, replies: list[Message]) -> list[float]:
        return [fednova_normalizer(self.local_steps(m), self.cfg["momentum"]) for m in replies]

    def aggregate_arrays(self, server_round: int, replies: list[Message]) -> ArrayRecord:
        x = arrays_to_numpy(self.sent_arrays)
        models = [arrays_to_numpy(m.content["arrays"]) for m in replies]
        weights = self.aggregation_weights(replies)
        out = self.mean(models, weights)
        params = {k: x[k] for k in self.dims.params}
        a = self.normalizers(replies)
        if self.cfg["robust-aggregation"] == "none":
            out.update(normalized_average(params, models, weights, a))
        else:
            robust = self.mean(normalized_models(params, models, weights, a), weights)
            out.update({k: v.astype(x[k].dtype) for k, v in robust.items()})
        return numpy_to_arrays(out)

    def aggregate_extras(self, server_round: int, replies: list[Message]) -> dict[str, float]:
        w, a = self.aggregation_weights(replies), self.normalizers(replies)
        return {"tau-eff": sum(wi * ai for wi, ai in zip(w, a, strict=True)) / sum(w)}
