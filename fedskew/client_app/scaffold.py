"""SCAFFOLD client (Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated
Learning", ICML'20, Alg. 1 lines 7-14). Server side: `fedskew/strategies/scaffold.py`.

One round on client i, from the global model x and the server control variate c (the `control`
record, checked like every server record):

    y <- x;  K times:  y <- y - eta_l (g_i(y) - c_i + c)                      (line 10)
    c_i <- c_i - c + (x - y) / (K eta_l)                                       (line 12, option II)

then y is uploaded. Decisions:
- Option II (line 12), the cheaper of the paper's two updates (option I needs an extra pass over
  the local data for g_i(x)); NIID-Bench and the FedRS authors' code use it too. K is the number of
  steps taken (`local-epochs` x batches), eta_l the round's lr.
- Momentum and weight decay: the local optimiser is the common `sgd` (`momentum`, `weight-decay`,
  `grad-clip`), and the correction -eta_l (c - c_i) is applied after each of its steps, outside
  the momentum buffer, as NIID-Bench does (`fedskew.losses.scaffold.correct_after_step` says why).
  Weight decay is part of g_i (the L2-regularised local loss). With momentum 0 and weight decay 0
  this is Alg. 1 exactly; with c = c_i it is plain local training. The FedRS authors' SCAFFOLD
  (`lxcnju/FedRepo` at 617ee015, algorithms/scaffold.py) uses plain SGD without momentum or weight
  decay: set `momentum=0.0 weight-decay=0.0` for it.
- Control variates cover the trainable parameters only (not BatchNorm statistics), as FedRepo;
  NIID-Bench also corrects buffers, which have no gradient.
- c_i is this client's state (`ClientState`, one model-sized float32 tensor per parameter, written
  with its round). A client without one (its first participation, or a state lost or written by an
  attempt the server discarded) starts from c_i = 0, the paper's initialisation, and logs it.
- The client does not send Delta c_i: the server computes it from what it has (x, y, c, K_i, eta_l)
  with the same function (`fedskew.losses.scaffold.scaffold_control_deltas`), so it cannot be
  forged apart from the model; the client applies it to its own c_i.
Personalized model: the locally trained y.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import torch
from flwr.app import RecordDict
from torch import nn

from fedskew.client_app.base import BaseTrainer
from fedskew.losses.scaffold import correct_after_step, scaffold_control_deltas
from fedskew.methods.scaffold import CONTROL

CLIENT_CONTROL = "control"  # the name of c_i in the client state


def as_numpy(names: list[str], tensors: Iterable[torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: t.detach().cpu().numpy() for k, t in zip(names, tensors, strict=True)}


class ScaffoldTrainer(BaseTrainer):
    """Local SGD with each step corrected by c - c_i, then option II's c_i update."""

    batched = True
    keeps_state = "the control variate c_i"
    kept_arrays = ("params",)

    def load_global(self, model: nn.Module, content: RecordDict) -> None:
        super().load_global(model, content)
        self.names = [k for k, _ in model.named_parameters()]
        self.start = [p.detach().clone() for p in model.parameters()]
        self.control = [self.received[CONTROL][k].to(self.device) for k in self.names]
        self.client_control = self.parameter_state(CLIENT_CONTROL, model)

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        opt = super().optimizer(model)
        correct_after_step(opt, list(self.step_corrections(model).values()))
        return opt

    def step_corrections(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """c - c_i per parameter: what each step subtracts (times lr) after the optimiser's own."""
        return {k: c - ci for k, c, ci in zip(self.names, self.control, self.client_control, strict=True)}

    def after_steps(self, model: nn.Module, stats: dict[str, float]) -> dict[str, float]:
        steps, names = int(stats["train-steps"]), self.names
        c, x, y = (as_numpy(names, t) for t in (self.control, self.start, model.parameters()))
        (delta,) = scaffold_control_deltas(c, x, [y], [steps], self.cfg["lr"])
        new = [ci + torch.from_numpy(delta[k]).to(ci) for k, ci in zip(self.names, self.client_control, strict=True)]
        self.save_parameter_state(CLIENT_CONTROL, model, new)
        gap = sum(float((c - ci).pow(2).sum()) for c, ci in zip(self.control, self.client_control, strict=True))
        return {**stats, "correction-norm": math.sqrt(gap)}
