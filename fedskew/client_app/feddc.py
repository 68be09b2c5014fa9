"""FedDC client (Gao et al., "FedDC: Federated Learning with Non-IID Data via Local Drift Decoupling
and Correction", CVPR'22). Server side: `fedskew/strategies/feddc.py`; maths:
`fedskew/losses/feddc.py` (drift) and `fedskew/losses/scaffold.py` (gradient correction).

Client i keeps a local drift h_i and a gradient-correction control c_i; from the global model w and
the server's control c it trains theta_i (starting at w) on

    L_i(theta) + alpha/2 ||theta + h_i - w||^2      with every step corrected by -eta_l (c - c_i)

then h_i <- h_i + (theta_i - w), c_i <- c_i - c + (w - theta_i) / (K eta_l), and uploads the
drift-corrected model theta_i + h_i with the local update theta_i - w (`feddc-update`).

Decisions (the paper's text was not at hand; the details follow the authors' code,
`gaoliang13/FedDC` at 13440c23, utils_general.py `train_model_FedDC` and utils_methods_FedDC.py
`train_FedDC`):
- The gradient correction is the code's: the linear term <theta, c - c_i> with c_i updated as
  SCAFFOLD's option II (`state_gadient_diffs`, beta = 1 / (K eta_l)), so this trainer is
  `ScaffoldTrainer` plus the drift. As for SCAFFOLD, the correction is applied after each step of
  the common `sgd`, outside its momentum buffer (identical to the code's loss term without
  momentum, which the code uses; see `correct_after_step` for why not through the momentum).
- `grad-clip` (default off; the code clips at max_norm = 10) clips what the code's
  `clip_grad_norm_` clips: the gradient of CE + penalty and the correction c - c_i as one vector,
  s = min(1, clip / (||grad + c - c_i|| + 1e-6)), both parts scaled by s (`correct_after_step`);
  weight decay stays outside the clip, as in the code's optimiser.
- K is this client's own step count; the code uses one K for all clients (that of the mean client
  size), the same on equal partitions. alpha is the same for every client (`feddc-alpha`); the code
  divides it, and c, by the client's relative data size, which is 1 on equal partitions.
- Upload: theta_i + h_i (the drift-corrected model) for the trainable parameters; buffers as
  trained; and theta_i - w. The server, as the code, averages the theta_i over the round's clients
  and adds the mean drift of all clients, which it keeps as their sum from the local updates
  (`fedskew/strategies/feddc.py`). The server's `max-update-ratio` bound applies to this upload,
  drift included, and to the local update.
- h_i and c_i are this client's state (two model-sized float32 tensors per trainable parameter,
  each written with its round); a client without them starts from zero (the code's
  initialisation) and logs it. Both are read in `load_global` and written in `after_steps` (c_i,
  then h_i), on either engine.
- The penalty is written once, as the trainer's `penalty` on the cross-entropy, its target w - h_i
  a per-client extra (`batch_extras`): the batched engine stacks the clients, each with its own
  correction c - c_i and, with `grad-clip`, the same joint clip per client
  (`fedskew.batched.stacked.StackedSGD`).
Personalized model: the locally trained theta_i (not the drift-corrected upload). Metric:
`feddc-drift-norm` (||h_i|| after the update).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from flwr.app import ArrayRecord, RecordDict
from torch import nn

from fedskew.client_app.scaffold import ScaffoldTrainer
from fedskew.losses import proximal_term
from fedskew.losses.feddc import drift_update, penalty_target
from fedskew.losses.scaffold import correct_after_step
from fedskew.methods.feddc import FEDDC_UPDATE
from fedskew.training import sgd

DRIFT = "feddc-drift"


class FedDCTrainer(ScaffoldTrainer):
    """SCAFFOLD's corrected local training plus the drift penalty; uploads theta_i + h_i."""

    batched = True
    keeps_state = "the drift h_i and the control variate c_i"
    kept_arrays = ("params", "params")

    def load_global(self, model: nn.Module, content: RecordDict) -> None:
        super().load_global(model, content)
        self.drift = self.parameter_state(DRIFT, model)
        self.target = penalty_target(self.start, self.drift)

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """The common `sgd` without its own clip: `grad-clip` clips the loss gradient and the
        correction together (`correct_after_step`)."""
        opt = sgd(model.parameters(), {**self.cfg, "grad-clip": 0.0})
        correct_after_step(opt, list(self.step_corrections(model).values()), self.cfg["grad-clip"])
        return opt

    def batch_extras(self) -> dict[str, torch.Tensor]:
        return {f"target/{k}": t for k, t in zip(self.names, self.target, strict=True)}

    def penalty(self, params: dict[str, torch.Tensor], extras: dict[str, torch.Tensor]) -> torch.Tensor:
        """alpha/2 ||theta + h_i - w||^2, the proximal term towards w - h_i from `extras` (`batch_extras`)."""
        target = [extras[f"target/{k}"] for k in self.names]
        return proximal_term([params[k] for k in self.names], target, self.cfg["feddc-alpha"])

    def after_steps(self, model: nn.Module, stats: dict[str, float]) -> dict[str, float]:
        """SCAFFOLD's c_i update, then h_i <- h_i + (theta_i - w), each kept in the client's state."""
        stats = super().after_steps(model, stats)
        self.drift = drift_update(self.drift, list(model.parameters()), self.start)
        self.save_parameter_state(DRIFT, model, self.drift)
        norm = math.sqrt(sum(float(h.pow(2).sum()) for h in self.drift))
        return {**stats, "feddc-drift-norm": norm}

    def upload(self, model: nn.Module) -> ArrayRecord:
        """theta_i + h_i for the trainable parameters, the trained buffers as they are."""
        state = model.state_dict()
        for name, h in zip(self.names, self.drift, strict=True):
            state[name] = state[name] + h
        return ArrayRecord(state)

    def extra_records(self, model: nn.Module) -> dict[str, Any]:
        update = {n: (p.detach() - w).cpu() for (n, p), w in zip(model.named_parameters(), self.start, strict=True)}
        return {FEDDC_UPDATE: ArrayRecord(update)}
