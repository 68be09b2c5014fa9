"""FedAvgM server (Hsu, Qi & Brown, "Measuring the Effects of Non-Identical Data Distribution for
Federated Visual Classification", arXiv:1909.06335, 2019, Sec. 3): FedAvg whose server applies
momentum to the round's pseudo-gradient, the mean update Delta = x - avg_k w_k:

    v <- beta v + Delta,   x <- x - eta v                (`strategies/aggregate.py`, server_momentum_step)

Clients train as FedAvg's (`fedskew/client_app/fedavg.py`); only the server differs.

Decisions:
- beta = 0.9 and eta = 0.1 (`fedavgm-server-momentum`, `fedavgm-server-lr`): the effective rate
  eta / (1 - beta) = 1, FedAvg's step once v has built up, so that momentum averages the sampled
  clients' pseudo-gradients over about 10 rounds instead of taking 10 times the step. The paper
  compares settings by that effective rate and warns that client updates diverge unless the rates
  stay low (Sec. 5); the Flower baseline that reproduces it (adap/flower at 0cb7993,
  `baselines/fedavgm/`) keeps eta = 1, beta = 0.9 with client lr 0.0003-0.003. At this project's
  client lr 0.01 with momentum 0.9, eta = 1 oscillated (docs/notes/fedavgm.md).
- v covers the trainable parameters and starts at zero (so round 1's v is its Delta, as Flower's
  `FedAvgM`); BatchNorm's statistics take the plain average, as the papers' FedAvg.
- avg follows `aggregation-weights` (default by sample count, the paper's n_k / n).
- v is server state (`checkpoint.pt`); a retried round restarts from the v of its first attempt
  (`RoundState`).
Metric: `momentum-norm` (||v||).
"""

from __future__ import annotations

from typing import Any

import torch
from flwr.app import ArrayRecord, Message

from fedskew.strategies.aggregate import l2_norm, server_momentum_step
from fedskew.strategies.base import BaseStrategy, RoundState, arrays_to_numpy, numpy_to_arrays


class FedAvgMStrategy(BaseStrategy):
    """The averaged models applied through server momentum."""

    def __init__(self, cfg: dict[str, Any], device: torch.device | None = None) -> None:
        super().__init__(cfg, device)
        self.momentum = RoundState.zeros("momentum", self.dims)

    def aggregate_arrays(self, server_round: int, replies: list[Message]) -> ArrayRecord:
        average = arrays_to_numpy(super().aggregate_arrays(server_round, replies))
        x, v = arrays_to_numpy(self.sent_arrays), self.momentum.before(server_round)
        lr, beta = self.cfg["fedavgm-server-lr"], self.cfg["fedavgm-server-momentum"]
        new, self.momentum.value = server_momentum_step(x, average, v, lr, beta)
        return numpy_to_arrays(new)

    def aggregate_extras(self, server_round: int, replies: list[Message]) -> dict[str, float]:
        return {"momentum-norm": l2_norm(self.momentum.value)}
