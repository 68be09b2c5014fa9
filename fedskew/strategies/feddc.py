"""FedDC server (Gao et al., "FedDC: Federated Learning with Non-IID Data via Local Drift Decoupling
and Correction", CVPR'22; the authors' code `gaoliang13/FedDC` at 13440c23, utils_methods_FedDC.py
`train_FedDC`). Client side: `fedskew/client_app/feddc.py`.

The server model is the average of the clients' drift-corrected models theta_i + h_i (their
uploads, `aggregation-weights`; no server step). The gradient correction's control c is SCAFFOLD's
(`ScaffoldStrategy`): each client's theta_i = w + (its `feddc-update`) gives
Delta c_i = (w - theta_i) / (K_i eta_l) - c, and c <- c + (1/N) sum_i Delta c_i, as the code's
`state_gadient_diffs[-1] += delta_g_sum / n_clnt`. c is server state (in `checkpoint.pt`). The
local update is screened like the upload (declared form, value bound, `max-update-ratio`).
Metrics: SCAFFOLD's, `feddc-drift-norm` (the clients' mean ||h_i||) and `feddc-local-average-accuracy`
(the average of the theta_i without their drift, on the test set, as the authors' code logs it).
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import ArrayRecord, Message, RecordDict
from torch import nn

from fedskew import wire
from fedskew.records import Rejected
from fedskew.strategies.aggregate import update_ratio, weighted_average
from fedskew.strategies.base import arrays_to_numpy
from fedskew.strategies.scaffold import ScaffoldStrategy
from fedskew.wire import FEDDC_UPDATE


class FedDCStrategy(ScaffoldStrategy):
    """Average of theta_i + h_i; SCAFFOLD's control variate from the uploaded local updates."""

    wire = wire.FEDDC

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

    def local_update_models(self, replies: list[Message]) -> list[dict[str, np.ndarray]]:
        """theta_i = w + (theta_i - w), from each reply's `feddc-update` (its upload is theta_i + h_i);
        keeps their weighted average, theta-bar (`diagnostic_models`)."""
        x = arrays_to_numpy(self.sent_arrays)
        updates = [arrays_to_numpy(m.content[FEDDC_UPDATE]) for m in replies]
        models = [{k: x[k].astype(np.float64) + u[k] for k in u} for u in updates]
        self.local_average = weighted_average(models, self.aggregation_weights(replies))
        return models

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
