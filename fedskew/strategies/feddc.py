"""FedDC server (Gao et al., "FedDC: Federated Learning with Non-IID Data via Local Drift Decoupling
and Correction", CVPR'22; the authors' code `gaoliang13/FedDC` at 13440c23, utils_methods_FedDC.py
`train_FedDC`). Client side: `fedskew/client_app/feddc.py`.

The server model is the average of the round's local models plus the mean drift of all N clients,

    w <- mean_{i in S} theta_i + (1/N) sum_{j=1..N} h_j          (the code's
         `cld_mdl_param = avg_mdl_param_sel + np.mean(parameter_drifts, axis=0)`)

with no server step. The server keeps H = sum_j h_j (server state, in `checkpoint.pt`): a client's
drift moves by its local update, h_i <- h_i + (theta_i - w), so H <- H + sum_{i in S} (theta_i - w)
from the replies' `feddc-update`, and no client's drift is held here. Under full participation this
is the average of the uploads theta_i + h_i (on equal partitions); under partial participation the
uploads of the round's few clients carry only their own drifts, whose mean swings with the sample,
while the code adds every client's.
The gradient correction's control c is SCAFFOLD's (`ScaffoldStrategy`): each client's
theta_i = w + (its `feddc-update`) gives Delta c_i = (w - theta_i) / (K_i eta_l) - c, and
c <- c + (1/N) sum_i Delta c_i, as the code's `state_gadient_diffs[-1] += delta_g_sum / n_clnt`.
Decisions:
- mean_{i in S} follows `aggregation-weights` (by sample count by default; the code's plain mean,
  the same on equal partitions). N is `num_clients`; drifts of clients not yet sampled are zero, the
  code's initialisation.
- As SCAFFOLD's c, H misses a drift step whose reply was lost (the server counts the lost reply),
  and keeps the drift of a client that lost its state and restarts from h_i = 0 (which that client
  logs).
- The local update is screened like the upload (declared form, value bound, `max-update-ratio`):
  H and c move by it. The upload theta_i + h_i is screened and its buffers averaged (they carry no
  drift).
- Robustness (`BaseStrategy.bound_updates`): the local update is clipped to `update-norm-bound` x
  the round's median local-update norm (and the upload's buffers, from w's, to their own median), so
  one client moves H and c by at most that bound; with `robust-aggregation` theta-bar is the rule's mean and
  H's sum |S| times the rule's mean of the local updates (`BaseStrategy.pool`).
Metrics: SCAFFOLD's, `feddc-drift-norm` (the clients' mean ||h_i||), `feddc-mean-drift-norm`
(||H / N||, the server's drift term) and `feddc-local-average-accuracy` (the average of the theta_i
without the drift, on the test set, as the authors' code logs it).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Message, RecordDict
from torch import nn

from fedskew.methods.feddc import FEDDC_UPDATE
from fedskew.records import Rejected
from fedskew.strategies.aggregate import l2_norm, update_ratio
from fedskew.strategies.base import RoundState, arrays_to_numpy, numpy_to_arrays
from fedskew.strategies.scaffold import ScaffoldStrategy


class FedDCStrategy(ScaffoldStrategy):
    """Average of the theta_i plus the mean drift of all clients; SCAFFOLD's control variate from
    the uploaded local updates."""

    def __init__(self, cfg: dict[str, Any], device: torch.device | None = None) -> None:
        super().__init__(cfg, device)
        self.drift_sum = RoundState.zeros("drift-sum", self.dims)  # H = sum_j h_j over all clients

    def check_reply(self, content: RecordDict, partition: int) -> None:
        """The base's rules, and the same `max-update-ratio` bound on the local update theta_i - w as
        on the upload: c moves by it, so an extreme one would make every client's next steps extreme."""
        super().check_reply(content, partition)
        start = self.start_arrays(partition)
        local = {k: start[k].astype(np.float64) + v.numpy() for k, v in content[FEDDC_UPDATE].items()}
        ratio, limit = update_ratio(local, start), self.cfg["max-update-ratio"]
        if limit and ratio > limit:
            raise Rejected(
                f"its feddc-update is {ratio:.3g} times the norm of the model sent (max-update-ratio={limit:g})"
            )

    def update_records(self, content: RecordDict, partition: int) -> dict[str, dict[str, np.ndarray] | None]:
        """The local update theta_i - w (an update itself: H, c and theta-bar move by it) and the
        upload's buffers, from the model sent (its trainable part, theta_i + h_i, is not used: it
        carries the client's drift, which differs between honest clients by the rounds they took part)."""
        start = super().update_records(content, partition)["arrays"]
        return {"arrays": {k: v for k, v in start.items() if k not in self.dims.params}, FEDDC_UPDATE: None}

    def local_update_models(self, replies: list[Message]) -> list[dict[str, np.ndarray]]:
        """theta_i = w + (theta_i - w), from each reply's `feddc-update` (its upload is theta_i + h_i);
        keeps their weighted average, theta-bar (`diagnostic_models`)."""
        x = arrays_to_numpy(self.sent_arrays)
        updates = [arrays_to_numpy(m.content[FEDDC_UPDATE]) for m in replies]
        models = [{k: x[k].astype(np.float64) + u[k] for k in u} for u in updates]
        self.local_average = self.mean(models, self.aggregation_weights(replies))
        self.round_updates = self.pool(updates)
        return models

    def aggregate_arrays(self, server_round: int, replies: list[Message]) -> ArrayRecord:
        """SCAFFOLD's control update and the uploads' average (for the buffers), then each trainable
        parameter theta-bar + H / N with H <- H + sum_i (theta_i - w)."""
        h = self.drift_sum.before(server_round)
        average = arrays_to_numpy(super().aggregate_arrays(server_round, replies))
        self.drift_sum.value = {k: (v + sum(u[k] for u in self.round_updates)).astype(np.float32) for k, v in h.items()}
        n = self.num_clients()
        for k, v in self.drift_sum.value.items():
            average[k] = (self.local_average[k] + v.astype(np.float64) / n).astype(average[k].dtype)
        return numpy_to_arrays(average)

    def aggregate_extras(self, server_round: int, replies: list[Message]) -> dict[str, float]:
        mean = {k: v / self.num_clients() for k, v in self.drift_sum.value.items()}
        return {**super().aggregate_extras(server_round, replies), "feddc-mean-drift-norm": l2_norm(mean)}

    def server_step(self, x: dict[str, np.ndarray], average: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The average itself (FedDC has no server learning rate)."""
        return average

    def diagnostic_models(self, arrays: ArrayRecord) -> dict[str, nn.Module]:
        """`feddc-local-average`: the round's local models without their drift, the average of the
        theta_i (buffers from the global model), which the authors' code evaluates beside
        theta-bar + h-bar (`avg_model_sel`, "Cur Sel"): how much of the global model is the drift."""
        state = arrays.to_torch_state_dict()
        state.update({k: torch.from_numpy(v).to(state[k].dtype) for k, v in self.local_average.items()})
        return {"feddc-local-average": self.model_from(state)}
