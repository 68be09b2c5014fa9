"""Ditto client (Li, Hu, Beirami & Smith, "Ditto: Fair and Robust Federated Learning Through
Personalization", ICML'21, Eq. 2 and Alg. 1). Server side: `fedskew/strategies/ditto.py`.

Ditto's objective for client k, given the global model w* of a global FL objective G (FedAvg here):

    min_{v_k}  h_k(v_k; w*) = F_k(v_k) + (lambda / 2) ||v_k - w*||^2                    (Eq. 2)

One round on client k (Alg. 1, with UPDATE_GLOBAL = FedAvg's local update):
1. global update: train the received w^t with cross-entropy for `local-epochs` (the base's
   `local_train`); this model w_k^t, and only it, is uploaded;
2. personal update: s steps of v_k <- v_k - eta (grad F_k(v_k) + lambda (v_k - w^t)) on the client's
   own model v_k (`proximal_term` of `fedskew/losses/proximal.py`, the same (lambda / 2) ||.||^2 as
   FedProx's), against the w^t the round received; v_k is kept in the client's state ("ditto-personal")
   and is the personalized model. It never leaves the client.

Decisions (the authors' code `litian96/ditto` at 26d9b29a62f3872dcdf071be08e897607c283bb4,
`flearn/trainers_MTL/ditto.py` and `fedbase.py`, and its PyTorch port in FedRep's repository
`lgcollins/FedRep` at d82e62982e107bb3322541604f059c0ff28bd289, `main_ditto.py`):
- Personal steps s: as many as the global update's (`ditto-personal-epochs=-1`: `local-epochs`
  epochs), as both codes do (litian96: `local_iters` personal and `local_iters` global steps a round;
  FedRep's port: `local_ep` epochs each). Deviation: the personal epochs run after the global ones on
  their own batch order; litian96 interleaves one personal and one global step on each mini-batch.
- lambda (`ditto-lambda`) = 1: the authors' Fashion-MNIST script (`run_fashion_clean_ditto_lam1.sh`)
  and FedRep's `--lam_ditto` default. The paper also selects lambda per device on validation data
  from {0.1, 1, 2} (`dynamic_lam`); not done here (no validation split).
- A client's first v_k is the run's initial model w^0 (litian96 `fedbase.py`: every local model
  starts as a copy of the initial global model; FedRep's port likewise), drawn on the client from the
  run's seed (`BaseTrainer.initial_model`); a lost state restarts the same way (logged).
- The optimiser is the common `sgd` (momentum and weight decay as for the global update) on the
  objective h_k, the lambda term inside the loss; with momentum 0 and weight decay 0 each step is
  exactly the codes' `v - lr (grad + lambda (v - w^t))`. Under momentum beta the pull towards w^t
  takes momentum too: lr lambda / (1 - beta) well below 2 keeps it a contraction (lr 0.01, beta 0.9,
  lambda 1: 0.1). The term covers the parameters; BatchNorm running statistics are v_k's own.
- Metrics: `ditto-loss` (mean h_k over the personal steps) and `ditto-distance` ||v_k - w^t||_2 over
  the parameters after the update; `client-global-accuracy` is w^t on the local test split,
  `personal-accuracy` v_k's.
- The personal update is a `Phase` after the global one (`BaseTrainer.later_phases`): v_k is read
  from the state when the phase starts and kept when it ends, on both engines; the batched engine
  trains the round's global updates as one stacked model, then their personal models as another,
  each client's w^t an extra. Its objective is written once, `personal_penalty` beside the
  cross-entropy; the base derives both forms (`loss_of`, `functional_loss_of`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from flwr.app import RecordDict
from torch import nn

from fedskew.client_app.base import BaseTrainer, Phase
from fedskew.losses import proximal_term
from fedskew.training import sgd, steps_per_round

PERSONAL = "ditto-personal"


def parameter_distance(params: Iterable[torch.Tensor], reference: Iterable[torch.Tensor]) -> float:
    """||w - w_ref||_2 over matching parameter tensors."""
    return sum(float((p.detach() - r).pow(2).sum()) for p, r in zip(params, reference, strict=True)) ** 0.5


class DittoTrainer(BaseTrainer):
    """FedAvg's local update for the upload; the personal model v_k trained on F_k + lambda/2 ||v - w^t||^2."""

    batched = True
    keeps_state = "the personal model"
    kept_arrays = ("model",)

    def load_global(self, model: nn.Module, content: RecordDict) -> None:
        super().load_global(model, content)
        self.anchor = {k: p.detach().clone() for k, p in model.named_parameters()}  # w^t, the received global model

    def personal_penalty(self, params: dict[str, torch.Tensor], extras: dict[str, torch.Tensor]) -> torch.Tensor:
        """h_k's term (lambda / 2) ||v - w^t||^2 against this client's w^t (`extras`: `self.anchor`,
        or under vmap one client's slice); with the default cross-entropy it is h_k on a batch."""
        return proximal_term([params[k] for k in extras], extras.values(), self.cfg["ditto-lambda"])

    def personal_epochs(self) -> int:
        epochs = self.cfg["ditto-personal-epochs"]
        return self.cfg["local-epochs"] if epochs < 0 else epochs

    def later_phases(self, model: nn.Module) -> Iterator[Phase]:
        """The personal update after the global one: v_k (w^0 unless the client has its v_k) for
        `personal_epochs` epochs on h_k."""
        self.personal = self.initial_model()
        self.restore(PERSONAL, self.personal)
        steps = steps_per_round(len(self.data.y_train), self.personal_epochs(), self.cfg["batch-size"])
        optimizer = sgd(self.personal.parameters(), self.cfg)
        yield Phase(
            self.personal,
            optimizer,
            steps,
            self.loss_of(self.personal_penalty, self.anchor),
            self.functional_loss_of(self.personal_penalty),
            self.end_personal,
            extras=self.anchor,
        )

    def end_personal(self, stats: dict[str, float], personal: dict[str, float]) -> dict[str, float]:
        """Keep v_k; the global update's metrics with `ditto-loss` and `ditto-distance`."""
        self.keep(PERSONAL, self.personal)
        return {
            **stats,
            "ditto-loss": personal["train-loss"],
            "ditto-distance": parameter_distance(self.personal.parameters(), self.anchor.values()),
        }

    def personalized_model(self, model: nn.Module) -> nn.Module:
        """v_k after this round's personal update."""
        return self.personal
