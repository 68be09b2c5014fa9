"""MAP client (Li et al., "MAP: Model Aggregation and Personalization in FL with Incomplete Classes",
TKDE'24, Alg. 1 ClientProcedure): restricted softmax for the upload, inherited private model (HPM)
for personalization. Maths in `fedskew/losses/map.py`; server in `fedskew/strategies/map.py`; the
authors' code as a whole, client state and deployment, and the runs behind the defaults:
`docs/notes/map.md` ("Client: the authors' code, state and deployment").

One round on client k (participation n = z^k + 1):
1. stage 1: train the downloaded global model with the restricted softmax (FedRS Eq. 8, keys
   `map-alpha`, `map-tau`, `map-scale`); this model, and only this, is uploaded;
2. stage 2: continue from a copy of it with `(1 - lam) CE + lam L_tr(HPM)` (Eq. 13), L_tr = logit
   distillation (`map-transfer="distill"`, Eq. 11) or multi-kernel feature MMD ("mmd", Eq. 12), at
   `lr * map-personal-lr-factor`, giving theta_hat;
3. fold theta_hat into the HPM: psi <- (1 - mu) theta_hat + mu psi, mu = clip(mu_bar (n-1)/(Q T), 0,
   mu_max) (Eq. 10, Sec. IV-B), and count the participation. The HPM never leaves the client (its
   `ClientState`, shared with FedPHP: `fedskew/client_app/hpm.py`) and is the model that
   `personal-accuracy` measures; theta_hat's accuracy is `stage2-accuracy`.

Stage lengths (`map-schedule`, `fedskew.losses.map.map_stage_steps`, nb = ceil(n / B)):
- "algorithm1" (default, Alg. 1 as printed): E = `local-epochs` split in halves, both at the same lr:
  ceil(E nb / 2) and floor(E nb / 2) steps of a cycling loader; uniform mean (Alg. 1 line 6);
- "epochs": stage 1 `local-epochs` passes, stage 2 `map-personal-epochs` passes (default 1);
- "code": the authors' `lxcnju/MAP` `algorithms/fedap.py` (commit 42b1478): max(int(E nb), 5) steps,
  then max(int(0.1 x that), 5), and `generate_mu` divides by int(Q T).

Decisions (the paper against the authors' code `lxcnju/MAP`):
- Restricted softmax: the paper's binary rule on raw training counts (count >= `map-tau`), reusing
  `FedRSTrainer`; the code's rule on class fractions is `map-scale="fraction"`.
- KD: both logits divided by tau = `map-temperature` (4.0), batch-mean KL, no tau^2 (paper);
  `map-soften-student=false` gives the code's teacher-only softening.
- MMD: 5 Gaussian kernels, bandwidths b0 * 2^{-2..2}, b0 the mean pairwise squared distance (code).
- First participation: the paper skips the transfer in round 1 "because we have not stored the HPM";
  read per client: with no HPM the stage-2 loss is plain CE and mu = 0, so the HPM becomes theta_hat.
  The code instead starts every HPM at the initial global model (`map-hpm-init="initial"`).
- mu: pre-increment count (Alg. 1 line 14 before 15), Q T = fraction-train * num-server-rounds
  (at least 1), clipped to [0, `map-mu-max`] = [0, 1] (paper; the code clips at 0.9 and takes
  int(Q T), as `map-schedule="code"` does).
- The HPM average covers every state-dict entry (integer buffers copied); the code's recomputation of
  the HPM's BatchNorm statistics is not done (no network here has BatchNorm).
- Both engines: stage 1 is FedRS's local training (`local_steps` = its steps), stage 2 a `Phase`
  (`later_phases`: the HPM read, the stage-2 copy and its optimiser) whose `end` folds theta_hat into
  the HPM and reports stage 2's metrics. Its loss is written once (`HPMTrainer.personal_loss`:
  `cross_entropy` and `transfer_term` through the base's `loss_of` / `functional_loss_of`); the
  batched engine stacks the round's stage 2s in one model, each client's HPM tensors and the
  weights (1 - lam, lam) its extras. A first participation has no teacher: per client plain CE;
  stacked, its own stage-1 weights stand in for the HPM (finite) at weights (1, 0), so it gets
  exactly CE in the same stack as the clients with a teacher.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator

import torch
from torch import nn

from fedskew.client_app.base import Phase, frozen
from fedskew.client_app.fedrs import FedRSTrainer
from fedskew.client_app.hpm import HPMTrainer
from fedskew.losses.map import map_stage_steps
from fedskew.training import built_with_seed, sgd


class MAPTrainer(HPMTrainer, FedRSTrainer):
    """Stage 1 = FedRS local training (uploaded); stage 2 = CE + transfer from the HPM, a later
    phase; HPM update."""

    batched = True
    rs_prefix = "map"
    hpm_prefix = "map"

    def stage_steps(self) -> tuple[int, int]:
        """The SGD steps of stage 1 and stage 2 this round (`map-schedule`, `map_stage_steps`)."""
        cfg = self.cfg
        n, b, e = len(self.data.y_train), cfg["batch-size"], cfg["local-epochs"]
        return map_stage_steps(n, b, e, cfg["map-personal-epochs"], cfg["map-schedule"])

    def local_steps(self) -> int:
        """Stage 1's steps (the inherited FedRS training's)."""
        return self.stage_steps()[0]

    def expected_participations(self) -> float:
        """Q T; int(Q T) under the authors' schedule (`generate_mu`: `int(c_ratio * max_round)`)."""
        qt = super().expected_participations()
        return float(int(qt)) if self.cfg["map-schedule"] == "code" else qt

    def later_phases(self, model: nn.Module) -> Iterator[Phase]:
        """Stage 2 after stage 1 (`model`, uploaded): a copy of it trained on `personal_loss` at
        `lr * map-personal-lr-factor`, the HPM read now its teacher (none at a first participation,
        the paper's: plain CE, mu = 0; stacked, `model`'s frozen copy stands in with weight 0)."""
        hpm, z = self.load_hpm(model)
        if hpm is None and self.cfg["map-hpm-init"] == "initial":  # the authors' code: HPM = w^0 at first
            hpm = built_with_seed(self.build_model, self.cfg["seed"]).state_dict()
        self.use_teacher(hpm, frozen(copy.deepcopy(model)) if hpm is None else None)
        self.stage2_model = copy.deepcopy(model)  # stage 2 continues from the stage-1 weights
        lr = self.cfg["lr"] * self.cfg["map-personal-lr-factor"]
        optimizer = sgd(self.stage2_model.parameters(), {**self.cfg, "lr": lr})
        steps = self.stage_steps()[1]
        yield Phase(
            self.stage2_model,
            optimizer,
            steps,
            self.personal_loss,
            self.personal_functional_loss(),
            functools.partial(self.end_stage2, hpm, z + 1, steps),
            extras=self.teacher_extras(),
        )

    def end_stage2(
        self, hpm: dict[str, torch.Tensor] | None, n: int, steps: int, stats: dict[str, float], stage2: dict[str, float]
    ) -> dict[str, float]:
        """Fold theta_hat into the HPM at this n-th participation; stage 1's metrics with stage 2's."""
        mu = self.fold_into_hpm(hpm, self.stage2_model, n)
        _, s2_acc = self.evaluate_local(self.stage2_model)
        return {
            **stats,
            "stage2-loss": stage2["train-loss"] if steps > 0 else float("nan"),
            "stage2-accuracy": s2_acc,
            "hpm-mu": mu,
            "hpm-participations": n,
            "hpm-transfer": int(self.teacher is not None),
        }
