"""The inherited private model (HPM) on the client, shared by FedPHP (Li, Zhan et al., ECML-PKDD'21),
where it comes from, and MAP (Li et al., TKDE'24, Sec. IV-B), which reuses it. Maths in
`fedskew/losses/map.py`.

Each client keeps psi, a moving average of its personalized models, and a participation counter z:
- a personalization step trains on ``(1 - lam) CE + lam L_tr(psi)`` (MAP Eq. 13), L_tr the logit
  distillation from psi (`<prefix>-transfer="distill"`, Eq. 11, temperature `<prefix>-temperature`,
  student softened too unless `<prefix>-soften-student=false`) or the multi-Gaussian MMD between the
  features (`"mmd"`, Eq. 12), psi frozen;
- then psi <- (1 - mu) theta_hat + mu psi (Eq. 10), mu = clip(mu_bar (n - 1) / (Q T), 0, mu_max) at the
  n-th participation (`hpm_momentum`; `expected_participations` gives Q T), and z <- n.

Both engines run the transfer through the base's hooks (`transfer_term`, in `forward_loss`'s form): the
teacher's tensors and the weights (1 - lam, lam) of Eq. 13 are this client's extras (`teacher_extras`),
the teacher's network running on them. Per client a client without a teacher runs none (plain CE,
`personalization_loss(ce, None, lam)`); stacked, where the loss is one client's and every client's
extras have the same keys, such a client gives a stand-in network's tensors (finite: its term is
finite) and the weights (1, 0): exactly CE plus 0.

`hpm_prefix` names the run-config keys (`<prefix>-transfer`, `-transfer-weight`, `-temperature`,
`-soften-student`, `-mmd-kernels`, `-mmd-kernel-mul`, `-mu-bar`, `-mu-max`) and the client state:
the tensors "hpm" (one model state dict) and the values `<prefix>` = {"participations": z}, z an integer
from 1 to the trainings the run can have sent the client before this round (`most_trainings`; any
other stored value counts as a lost state).
"""

from __future__ import annotations

import logging
from typing import ClassVar

import torch
from torch import nn

from fedskew.client_app.base import (
    BaseTrainer,
    Forward,
    FunctionalLoss,
    Tensors,
    cross_entropy,
    frozen_extras,
    frozen_state,
)
from fedskew.client_app.state import matches, most_trainings
from fedskew.losses import distillation_loss, hpm_momentum, hpm_update, mmd_multi_gaussian, personalization_loss
from fedskew.records import Number
from fedskew.training import functional_split_forward

log = logging.getLogger("fedskew.client")

HPM_TENSORS = "hpm"
TEACHER = "hpm."  # the prefix of the frozen HPM's tensors among a client's extras (`teacher_extras`)
WEIGHTS = "hpm-weights"  # the extras' (1 - lam, lam) of Eq. 13: (1, 0) for a client without a teacher


class HPMTrainer(BaseTrainer):
    """Load, use as a teacher, update and save a client's HPM; the personalized model is the HPM."""

    hpm_prefix: ClassVar[str]
    keeps_state = "the inherited private model (HPM)"
    kept_arrays = ("model",)

    def key(self, name: str) -> str:
        return f"{self.hpm_prefix}-{name}"

    # ------------------------------------------------------------------ state
    def load_hpm(self, reference: nn.Module) -> tuple[dict[str, torch.Tensor] | None, int]:
        """(HPM state dict or None, participations so far); an inconsistent state counts as lost."""
        most = most_trainings(self.cfg, self.ctx.server_round) - 1  # before this round's training
        values = self.ctx.state.load_values(self.hpm_prefix, {"participations": Number(int, 1, most, required=True)})
        z = values["participations"] if values else 0
        hpm = self.ctx.state.load_tensors(HPM_TENSORS)
        if hpm is not None and (z < 1 or not matches(hpm, reference.state_dict())):
            log.warning(
                "partition %d: HPM state inconsistent (participations=%d, HPM keys/shapes differ "
                "from the model): discarded, treated as a first participation",
                self.ctx.partition_id,
                z,
            )
            hpm, z = None, 0
        elif hpm is None:
            log.info(
                "partition %d, round %d: no HPM (first participation%s)",
                self.ctx.partition_id,
                self.ctx.server_round,
                f"; the counter said {z}, so the state was lost" if z else " or lost state",
            )
            z = 0
        return hpm, z

    def use_teacher(self, hpm: dict[str, torch.Tensor] | None, stand_in: nn.Module | None = None) -> None:
        """The frozen HPM that L_tr transfers from (`self.teacher`; None: no transfer) and the network
        `transfer_loss` runs its tensors in (`self.teacher_net`): the teacher, or without one
        `stand_in`, a frozen network of the same shapes whose tensors stand in for it in the stacked
        objective (`teacher_extras`)."""
        self.teacher = None
        if hpm is not None:
            self.teacher = self.build_model()
            self.teacher.load_state_dict(hpm)
            self.teacher.eval().requires_grad_(False)
        self.teacher_net = self.teacher if self.teacher is not None else stand_in

    def expected_participations(self) -> float:
        """Q T, the expected number of times a client is selected: fraction-train x rounds."""
        return self.cfg["fraction-train"] * self.cfg["num-server-rounds"]

    def fold_into_hpm(self, hpm: dict[str, torch.Tensor] | None, personal: nn.Module, n: int) -> float:
        """Eq. 10 at the n-th participation: the new HPM (saved with the counter, and kept as
        `self.hpm`, the personalized model); returns mu."""
        mu = hpm_momentum(n, self.expected_participations(), self.cfg[self.key("mu-bar")], self.cfg[self.key("mu-max")])
        new_hpm = hpm_update(hpm, personal.state_dict(), mu)
        self.ctx.state.save_tensors(HPM_TENSORS, new_hpm)
        self.ctx.state.save_values(self.hpm_prefix, {"participations": n})
        self.hpm = self.build_model()
        self.hpm.load_state_dict(new_hpm)
        return mu

    # ------------------------------------------------------------------ objective
    def teacher_extras(self) -> Tensors:
        """The frozen HPM's tensors (`TEACHER` + state-dict name) that `transfer_loss` runs it on and
        the weights (1 - lam, lam) of Eq. 13 (`WEIGHTS`): a client's own, stacked by the batched
        engine. Without a teacher: the stand-in's tensors and (1, 0); none without either."""
        if self.teacher_net is None:
            return {}
        lam = self.cfg[self.key("transfer-weight")] if self.teacher is not None else 0.0
        weights = torch.tensor([1.0 - lam, lam], dtype=self.dtype, device=self.device)
        return {**frozen_extras(TEACHER, self.teacher_net), WEIGHTS: weights}

    def transfer_loss(self, fwd: Forward, weight: torch.Tensor | None, extras: Tensors) -> torch.Tensor:
        """L_tr of Eq. 13 against the frozen HPM, `self.teacher_net`'s network on this client's HPM
        tensors in `extras` (`teacher_extras`; under vmap its slice), on the student's pass `fwd`;
        `weight` as in `BaseTrainer.forward_loss` (None: the batch as it is)."""
        hpm = frozen_state(TEACHER, extras)  # frozen tensors: no gradient
        h_p, o_p = functional_split_forward(self.teacher_net, hpm, {}, fwd.x)
        if self.cfg[self.key("transfer")] == "distill":
            return distillation_loss(
                fwd.logits, o_p, self.cfg[self.key("temperature")], self.cfg[self.key("soften-student")], weight
            )
        mul, kernels = self.cfg[self.key("mmd-kernel-mul")], self.cfg[self.key("mmd-kernels")]
        return mmd_multi_gaussian(fwd.z, h_p, mul, kernels, weight)

    def transfer_objective(
        self, ce: torch.Tensor, fwd: Forward, weight: torch.Tensor | None, extras: Tensors
    ) -> torch.Tensor:
        """Eq. 13 `(1 - lam) CE + lam L_tr` from the cross-entropy `ce`; plain CE at lam = 0, and per
        client (`weight` None) without a teacher. Stacked, the weights are this client's extras
        (`WEIGHTS`): (1, 0) for a client without a teacher, whose stand-in's term is finite."""
        lam = self.cfg[self.key("transfer-weight")]
        if weight is not None and lam != 0:
            w_ce, w_tr = extras[WEIGHTS].unbind()
            return w_ce * ce + w_tr * self.transfer_loss(fwd, weight, extras)
        transfer = None if self.teacher is None or lam == 0 else self.transfer_loss(fwd, weight, extras)
        return personalization_loss(ce, transfer, lam)

    def transfer_term(
        self, data: torch.Tensor, fwd: Forward, y: torch.Tensor, weight: torch.Tensor | None, extras: Tensors
    ) -> tuple[torch.Tensor, Tensors]:
        """`transfer_objective` on the data loss `data`, in `BaseTrainer.forward_loss`'s form."""
        return self.transfer_objective(data, fwd, weight, extras), {}

    def personal_loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`transfer_objective` on the cross-entropy of one mini-batch through `model` (MAP's stage 2,
        per client; `personal_functional_loss` its stacked form)."""
        return self.loss_of(None, self.teacher_extras(), cross_entropy, self.transfer_term)(model, x, y)

    def personal_functional_loss(self) -> FunctionalLoss:
        """`personal_loss` in `BaseTrainer.functional_loss`'s form."""
        return self.functional_loss_of(None, cross_entropy, self.transfer_term)

    def personalized_model(self, model: nn.Module) -> nn.Module:
        """The updated HPM (what the authors' code scores)."""
        return self.hpm
