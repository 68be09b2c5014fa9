"""SCAFFOLD server (Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated
Learning", ICML'20, Alg. 1 lines 4-5 and 16-17). Client side: `fedskew/client_app/scaffold.py`.

Each round the server sends the global model x and its control variate c (the `control` record,
one array per trainable parameter; zeros at the start, the paper's initialisation) and, from the
replies of the clients S it accepts,

    Delta c_i = (x - y_i) / (K_i eta_l) - c                   (option II, line 12, computed here)
    x <- x + eta_g (avg_i y_i - x)                            (lines 16-17, eta_g = `scaffold-server-lr`)
    c <- c + |S|/N mean_{i in S} Delta c_i = c + (1/N) sum_{i in S} Delta c_i       (lines 16-17)

Decisions:
- Delta c_i is computed on the server from the model it sent, the model it received, its own c, the
  round's lr eta_l and the client's step count K_i, which it derives from the partition's size,
  `local-epochs` and `batch-size` (`BaseStrategy.local_steps`). The client computes the same
  Delta c_i with the same function for its own c_i, so nothing but the model travels up.
- avg_i y_i follows `aggregation-weights` (default by sample count, as NIID-Bench at 61b901ab;
  "uniform" is the paper's 1/|S|, as the FedRS authors' code; the two agree on equal partitions).
- N is the number of clients (partitions); a lost reply does not count in the sum. (A client whose
  reply is lost after it trained keeps its new c_i, which c then lacks: SCAFFOLD assumes that every
  sampled client answers.)
- eta_g = 1 by default: the paper's experiments "always use global step-size eta_g = 1".
- The FedRS authors' SCAFFOLD (`lxcnju/FedRepo` at 617ee015, algorithms/scaffold.py) adds the plain
  mean of the round's Delta c_i to c (no |S|/N); here the paper's rule.
- c is server state (`state_dict`, in `checkpoint.pt`); a retried round restarts from the c its
  first attempt was sent (`RoundState`).
- Robustness (`BaseStrategy.bound_updates`): each y_i - x is clipped to `update-norm-bound` x the
  round's median before Delta c_i is computed, so one client moves c by at most that bound / (K_i
  eta_l N); with `robust-aggregation` the sum over S is |S| times the rule's mean of the Delta c_i.
Metrics: `control-norm` (||c||) and `correction-norm` (the clients' mean ||c - c_i||).
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch
from flwr.app import ArrayRecord, Message

from fedskew.losses.scaffold import scaffold_control_deltas
from fedskew.methods.scaffold import CONTROL
from fedskew.strategies.aggregate import l2_norm, scaffold_control_update, server_step
from fedskew.strategies.base import BaseStrategy, RoundState, arrays_to_numpy, numpy_to_arrays
from fedskew.training import round_lr


class ScaffoldStrategy(BaseStrategy):
    """Averages the models with a server step and keeps the server control variate c."""

    prefix: ClassVar[str] = "scaffold"  # the method's keys: `<prefix>-server-lr`

    def __init__(self, cfg: dict[str, Any], device: torch.device | None = None) -> None:
        super().__init__(cfg, device)
        self.control = RoundState.zeros("control", self.dims)

    def broadcast(self, server_round: int) -> dict[str, Any]:
        return {CONTROL: numpy_to_arrays(self.control.before(server_round))}

    def local_update_models(self, replies: list[Message]) -> list[dict[str, np.ndarray]]:
        """y_i, each client's locally trained parameters (SCAFFOLD: its upload)."""
        return [arrays_to_numpy(m.content["arrays"]) for m in replies]

    def server_step(self, x: dict[str, np.ndarray], average: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return server_step(x, average, self.cfg[f"{self.prefix}-server-lr"])

    def aggregate_arrays(self, server_round: int, replies: list[Message]) -> ArrayRecord:
        x = arrays_to_numpy(self.sent_arrays)
        c = self.control.before(server_round)
        steps = [self.local_steps(m) for m in replies]
        lr = round_lr(self.cfg, server_round)
        deltas = self.pool(scaffold_control_deltas(c, x, self.local_update_models(replies), steps, lr))
        self.control.value = scaffold_control_update(c, deltas, self.num_clients())
        average = arrays_to_numpy(super().aggregate_arrays(server_round, replies))
        return numpy_to_arrays(self.server_step(x, average))

    def aggregate_extras(self, server_round: int, replies: list[Message]) -> dict[str, float]:
        return {"control-norm": l2_norm(self.control.value)}
