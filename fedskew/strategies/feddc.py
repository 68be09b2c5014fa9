"""FedDC server (Gao et al., "FedDC: Federated Learning with Non-IID Data via Local Drift Decoupling
and Correction", CVPR'22; the authors' code `gaoliang13/FedDC` at 13440c23, utils_methods_FedDC.py
`train_FedDC`). Client side: `fedskew/client_app/feddc.py`.

The server model is the average of the clients' drift-corrected models theta_i + h_i (their
uploads, `aggregation-weights`; no server step). The gradient correction's control c is SCAFFOLD's
(`ScaffoldStrategy`): each client's theta_i = w + (its `feddc-update`) gives
Delta c_i = (w - theta_i) / (K_i eta_l) - c, and c <- c + (1/N) sum_i Delta c_i, as the code's
`state_gadient_diffs[-1] += delta_g_sum / n_clnt`. c is server state (in `checkpoint.pt`).
"""

from __future__ import annotations

import numpy as np
from flwr.app import Message

from fedskew import wire
from fedskew.strategies.base import arrays_to_numpy
from fedskew.strategies.scaffold import ScaffoldStrategy
from fedskew.wire import FEDDC_UPDATE


class FedDCStrategy(ScaffoldStrategy):
    """Average of theta_i + h_i; SCAFFOLD's control variate from the uploaded local updates."""

    wire = wire.FEDDC
    prefix = "feddc"

    def local_update_models(self, replies: list[Message]) -> list[dict[str, np.ndarray]]:
        """theta_i = w + (theta_i - w), from each reply's `feddc-update` (its upload is theta_i + h_i)."""
        x = arrays_to_numpy(self.sent_arrays)
        updates = [arrays_to_numpy(m.content[FEDDC_UPDATE]) for m in replies]
        return [{k: x[k].astype(np.float64) + u[k] for k in u} for u in updates]

    def server_step(self, x: dict[str, np.ndarray], average: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The average itself (FedDC has no server learning rate)."""
        return average
