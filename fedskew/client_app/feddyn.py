"""FedDyn client (Acar et al., "Federated Learning Based on Dynamic Regularization", ICLR'21,
Alg. 1, the clients' part). Server side: `fedskew/strategies/feddyn.py`; maths: `fedskew/losses/feddyn.py`.

Client k trains from the server model theta^{t-1} on

    L_k(theta) - <g_k, theta> + alpha/2 ||theta - theta^{t-1}||^2,     g_k = grad L_k(theta_k^{t-1})

uploads theta_k^t and keeps g_k <- g_k - alpha (theta_k^t - theta^{t-1}). Decisions:
- L_k is the mini-batch cross-entropy; the local optimiser is the common `sgd`. Its weight decay
  is an L2 term of L_k (the authors' code, `alpemreacar/FedDyn` at 48a19fac, utils_general.py
  `train_feddyn_mdl`, puts alpha + weight_decay into SGD's weight decay and the linear term
  alpha <theta, -theta^{t-1} + lambda_k> into the loss, which is the same objective). The update of
  g_k is the first-order condition of the local problem, so momentum does not change it.
- `grad-clip` (default off; the code clips at norm 10) clips what the code clips: the gradient
  less the alpha theta that the code keeps in its weight decay, clip(G - alpha theta) + alpha theta
  (`clip_outside_decay`); weight decay stays outside the clip.
- `train-loss` is the mean L_k (cross-entropy) without the regulariser, whose linear term can be
  negative (a loss metric is declared >= 0): the loss reports it beside the objective
  (`reports_data_loss`).
- The regulariser is written once, as the trainer's `penalty` on the cross-entropy (the base derives
  `loss` and the batched engine's `functional_loss`). The batched engine stacks its clients, each
  with its theta^{t-1} and g_k as extras, at `grad-clip` 0; with a clip they train one by one
  (`stacked_refusal`: the stacked step does not clip outside alpha theta).
- g_k is this client's state (`ClientState`, one model-sized float32 tensor per trainable
  parameter, written with its round); a client without one starts from g_k = 0 (Alg. 1 initialises
  grad L_k(theta_k^0) = 0) and logs it.
Personalized model: the locally trained theta_k^t. Metric: `feddyn-gradient-norm` (||g_k|| after
the update).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from flwr.app import RecordDict
from torch import nn

from fedskew.client_app.base import BaseTrainer
from fedskew.losses.feddyn import clip_outside_decay, feddyn_gradient_update, feddyn_penalty
from fedskew.training import sgd

GRADIENT_STATE = "feddyn-gradient"


class FedDynTrainer(BaseTrainer):
    """Cross-entropy plus the dynamic regulariser; keeps the client's gradient state."""

    batched = True
    reports_data_loss = True  # `train-loss`: the cross-entropy alone
    keeps_state = "the gradient state"
    kept_arrays = ("params",)

    @classmethod
    def stacked_refusal(cls, cfg: dict[str, Any]) -> str | None:
        if cfg["grad-clip"] > 0:
            return "the stacked step does not clip FedDyn's gradient outside alpha theta (grad-clip > 0)"
        return super().stacked_refusal(cfg)

    def load_global(self, model: nn.Module, content: RecordDict) -> None:
        super().load_global(model, content)
        self.names = [k for k, _ in model.named_parameters()]
        self.start = [p.detach().clone() for p in model.parameters()]
        self.gradient_state = self.parameter_state(GRADIENT_STATE, model)

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """The common `sgd` with `grad-clip` acting outside alpha theta (`clip_outside_decay`)."""
        opt = sgd(model.parameters(), {**self.cfg, "grad-clip": 0.0})
        clip_outside_decay(opt, self.cfg["grad-clip"], self.cfg["feddyn-alpha"])
        return opt

    def batch_extras(self) -> dict[str, torch.Tensor]:
        start = {f"start/{k}": w for k, w in zip(self.names, self.start, strict=True)}
        return {**start, **{f"gradient/{k}": g for k, g in zip(self.names, self.gradient_state, strict=True)}}

    def penalty(self, params: dict[str, torch.Tensor], extras: dict[str, torch.Tensor]) -> torch.Tensor:
        """The dynamic regulariser (`feddyn_penalty`), theta^{t-1} and g_k from `extras` (`batch_extras`)."""
        start, gradient = ([extras[f"{part}/{k}"] for k in self.names] for part in ("start", "gradient"))
        return feddyn_penalty([params[k] for k in self.names], start, gradient, self.cfg["feddyn-alpha"])

    def after_steps(self, model: nn.Module, stats: dict[str, float]) -> dict[str, float]:
        alpha = self.cfg["feddyn-alpha"]
        new = feddyn_gradient_update(self.gradient_state, list(model.parameters()), self.start, alpha)
        self.save_parameter_state(GRADIENT_STATE, model, new)
        return {**stats, "feddyn-gradient-norm": math.sqrt(sum(float(g.pow(2).sum()) for g in new))}
