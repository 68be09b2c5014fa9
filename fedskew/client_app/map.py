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
"""

from __future__ import annotations

import copy

from flwr.app import RecordDict
from torch import nn

from fedskew.client_app.fedrs import FedRSTrainer
from fedskew.client_app.hpm import HPMTrainer
from fedskew.losses.map import map_stage_steps
from fedskew.training import built_with_seed, sgd


class MAPTrainer(HPMTrainer, FedRSTrainer):
    """Stage 1 = FedRS local training (uploaded); stage 2 = CE + transfer from the HPM; HPM update."""

    rs_prefix = "map"
    hpm_prefix = "map"

    def stage_steps(self) -> tuple[int, int]:
        """The SGD steps of stage 1 and stage 2 this round (`map-schedule`, `map_stage_steps`)."""
        cfg = self.cfg
        n, b, e = len(self.data.y_train), cfg["batch-size"], cfg["local-epochs"]
        return map_stage_steps(n, b, e, cfg["map-personal-epochs"], cfg["map-schedule"])

    def local_steps(self) -> int:
        """Stage 1's steps (what FedRS's `local_train` runs)."""
        return self.stage_steps()[0]

    def expected_participations(self) -> float:
        """Q T; int(Q T) under the authors' schedule (`generate_mu`: `int(c_ratio * max_round)`)."""
        qt = super().expected_participations()
        return float(int(qt)) if self.cfg["map-schedule"] == "code" else qt

    def local_train(self, model: nn.Module, content: RecordDict) -> dict[str, float]:
        stats = super().local_train(model, content)  # stage 1 (restricted softmax), in place: uploaded
        hpm, z = self.load_hpm(model)
        if hpm is None and self.cfg["map-hpm-init"] == "initial":  # the authors' code: HPM = w^0 at first
            hpm = built_with_seed(self.build_model, self.cfg["seed"]).state_dict()
        self.use_teacher(hpm)  # none at a first participation (paper): stage 2 without transfer, mu = 0

        personal = copy.deepcopy(model)  # stage 2 continues from the stage-1 weights
        stage2 = {"train-loss": float("nan")}
        steps = self.stage_steps()[1]
        if steps > 0:
            lr = self.cfg["lr"] * self.cfg["map-personal-lr-factor"]
            optimizer = sgd(personal.parameters(), {**self.cfg, "lr": lr})
            stage2 = self.run_steps(personal, optimizer, steps, self.personal_loss)
        self.stage2_model = personal

        n = z + 1
        mu = self.fold_into_hpm(hpm, personal, n)
        _, s2_acc = self.evaluate_local(personal)
        return {
            **stats,
            "stage2-loss": stage2["train-loss"],
            "stage2-accuracy": s2_acc,
            "hpm-mu": mu,
            "hpm-participations": n,
            "hpm-transfer": int(self.teacher is not None),
        }
