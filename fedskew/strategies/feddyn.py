"""FedDyn server (Acar et al., "Federated Learning Based on Dynamic Regularization", ICLR'21,
Alg. 1). Client side: `fedskew/client_app/feddyn.py`; maths: `fedskew/losses/feddyn.py` and
`fedskew.strategies.aggregate.feddyn_server_update`.

From the models theta_k of the clients P_t it accepts in round t, the server updates its state h
and the server model theta^t (what is sent next round and evaluated):

    h^t = h^{t-1} - alpha (1/m) sum_{k in P_t} (theta_k^t - theta^{t-1})
    theta^t = avg_{k in P_t} theta_k^t - h^t / alpha

Decisions:
- h needs nothing beyond the uploaded models (theta^{t-1} is the model this round sent); m is the
  number of clients (partitions). The authors' code (`alpemreacar/FedDyn` at 48a19fac,
  utils_methods.py `train_FedDyn`) computes -h / alpha as the mean over all m clients of their
  stored -grad L_k / alpha, which is the same quantity.
- avg follows `aggregation-weights` (default by sample count; "uniform" is the paper's and the
  code's 1/|P_t|; they agree on equal partitions).
- h and the correction cover the trainable parameters; buffers are averaged.
- alpha is the same for every client (`feddyn-alpha`, paper Alg. 1). The authors' code divides it
  by each client's relative data size n_k / mean(n), which equals the paper on equal partitions.
- h is server state (`state_dict`, in `checkpoint.pt`); a retried round restarts from its first
  attempt's h (`RoundState`).
- Robustness (`BaseStrategy.bound_updates`): h moves by the clipped theta_k - theta^{t-1}, at most
  alpha / m times `update-norm-bound` x the round's median per client; with `robust-aggregation` the
  sum over P_t is |P_t| times the rule's mean (`BaseStrategy.pool`), and avg is the rule's too.
Metrics: `feddyn-h-norm` (||h||) and `feddyn-gradient-norm` (the clients' mean ||grad L_k||).
"""

from __future__ import annotations

from typing import Any

import torch
from flwr.app import ArrayRecord, Message

from fedskew.strategies.aggregate import feddyn_server_update, l2_norm
from fedskew.strategies.base import BaseStrategy, RoundState, arrays_to_numpy, numpy_to_arrays


class FedDynStrategy(BaseStrategy):
    """Averages the models and subtracts h / alpha; keeps h."""

    def __init__(self, cfg: dict[str, Any], device: torch.device | None = None) -> None:
        super().__init__(cfg, device)
        self.h = RoundState.zeros("h", self.dims)

    def aggregate_arrays(self, server_round: int, replies: list[Message]) -> ArrayRecord:
        average = arrays_to_numpy(super().aggregate_arrays(server_round, replies))
        models = [arrays_to_numpy(m.content["arrays"]) for m in replies]
        x = arrays_to_numpy(self.sent_arrays)
        h = self.h.before(server_round)
        alpha, n = self.cfg["feddyn-alpha"], self.num_clients()
        self.h.value, theta = feddyn_server_update(h, x, self.pool(models, origin=x), average, alpha, n)
        return numpy_to_arrays({**average, **theta})

    def aggregate_extras(self, server_round: int, replies: list[Message]) -> dict[str, float]:
        return {"feddyn-h-norm": l2_norm(self.h.value)}
