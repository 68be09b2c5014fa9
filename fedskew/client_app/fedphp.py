"""FedPHP client (Li, Zhan, Shao, Li & Song, "FedPHP: Federated Personalization with Inherited
Private Models", ECML-PKDD'21). The paper's text is not in this repository; the method follows the
authors' code `lxcnju/FedRepo` at commit 617ee015046409d95dbd76ba39eebb92d313ab94
(`algorithms/fedphp.py`, with `tools.py` `mmd_rbf_noaccelerate`) and MAP's restatement of the HPM,
which its authors carried over from FedPHP (TKDE'24, Sec. IV-B, Eqs. 10-13). The HPM machinery is
shared with MAP (`fedskew/client_app/hpm.py`, maths in `fedskew/losses/map.py`). Server:
`fedskew/strategies/fedphp.py`.

One round on client k, its n-th participation (`update_local`):
1. train the downloaded global model theta for `local-epochs` on
   ``(1 - lam) CE + lam L_tr(theta; psi)`` with the frozen HPM psi as the teacher: L_tr the logit
   distillation (`fedphp-transfer="distill"`, the code's "KD": ``-sum softmax(o_p / 4) log_softmax(o)``,
   teacher softened only; `distillation_loss` with `soften_student=false` has the same gradient)
   or the multi-Gaussian MMD of the features ("mmd", the code's "MMD"); lam = `fedphp-transfer-weight`;
2. upload the trained theta (unlike MAP, FedPHP has one stage: the model trained with the transfer
   term is the one aggregated);
3. psi <- mu psi + (1 - mu) theta (`update_hpm` after the last step), with the participation schedule
   of `generate_mu`: mu = clip(0.9 cnt / max(int(Q T), 1), 0, 0.9), cnt = n - 1 the earlier
   participations (`hpm_momentum(n, int(Q T), mu_bar, mu_max)`, Q T = fraction-train x rounds);
4. the personalized model is the updated HPM (the code scores `test(model=hpm)`).

Decisions, from the code where the paper could not be read:
- Every HPM starts as the initial global model (`self.hpms[client] = copy.deepcopy(self.model)` before
  round 1), so the transfer is on from the first participation, its teacher the initial network
  (`built_with_seed`: the client builds it itself, as the server does) and mu = 0 then makes psi the
  trained theta. MAP instead starts without an HPM. A lost state (a SuperNode restarted without
  `state-dir`) starts over the same way, logged, and the server counts it (`hpm-state-lost`).
- Defaults: KD with lam 0.1 (the first of the three groups the MAP authors' `train.py` runs for
  FedPHP: (KD, 0.1), (MMD, 0.1), (MMD, 0.01)), temperature 4, mu_bar 0.9, mu clipped at 0.9.
- Local training runs `local-epochs` epochs of fedskew's `sgd` (with `grad-clip`, the code's
  `max_grad_norm`); the code takes max(int(E x batches), 5) steps of a cycling loader.
- The HPM average covers every state-dict entry, integer buffers copied (the code averages them
  too and casts back; the networks here have none that matter).
- Both engines run it through the base's hooks: the HPM (the teacher) is read in `load_global` and
  its tensors are this client's extras (`teacher_extras`), the teacher's network running on them
  (`functional_call`, under vmap on each client's slice); Eq. 13 is written once as `forward_loss`
  on the default cross-entropy (`transfer_objective`: the KD term weighted per example, the MMD's
  means and bandwidth over the batch's real examples); the HPM update in `after_steps`.
"""

from __future__ import annotations

import torch
from flwr.app import RecordDict
from torch import nn

from fedskew.client_app.base import Forward, Tensors
from fedskew.client_app.hpm import HPMTrainer
from fedskew.training import built_with_seed


class FedPHPTrainer(HPMTrainer):
    """The downloaded model trained with CE + transfer from the HPM, uploaded, folded into the HPM."""

    batched = True
    hpm_prefix = "fedphp"

    def expected_participations(self) -> float:
        """int(Q T), as the code's `generate_mu` (`int(c_ratio * max_round)`)."""
        return float(int(self.cfg["fraction-train"] * self.cfg["num-server-rounds"]))

    def load_global(self, model: nn.Module, content: RecordDict) -> None:
        """The received model, then the client's HPM (the initial network at first) as the teacher."""
        super().load_global(model, content)
        hpm, self.earlier = self.load_hpm(model)
        self.start_hpm = hpm if hpm is not None else built_with_seed(self.build_model, self.cfg["seed"]).state_dict()
        self.use_teacher(self.start_hpm)

    def batch_extras(self) -> dict[str, torch.Tensor]:
        return self.teacher_extras()

    def forward_loss(
        self, data: torch.Tensor, fwd: Forward, y: torch.Tensor, weight: torch.Tensor | None, extras: Tensors
    ) -> tuple[torch.Tensor, Tensors]:
        """Eq. 13 on the cross-entropy `data`: the transfer objective."""
        return self.transfer_term(data, fwd, y, weight, extras)

    def after_steps(self, model: nn.Module, stats: dict[str, float]) -> dict[str, float]:
        """psi <- mu psi + (1 - mu) theta at this participation, n = the earlier ones + 1."""
        n = self.earlier + 1
        mu = self.fold_into_hpm(self.start_hpm, model, n)
        return {**stats, "hpm-mu": mu, "hpm-participations": n}
