"""FedRep client (Collins, Hassani, Mokhtari & Shakkottai, "Exploiting Shared Representations for
Personalized Federated Learning", ICML'21, Alg. 1). Server side: `fedskew/strategies/fedrep.py`.

The network is a shared body phi (the representation, `features`) and a head h_i (`classifier`)
that belongs to client i. One round on client i (Alg. 1):
1. load the received body phi^t under its own head h_i (kept in the client's state, "fedrep-head");
2. head update, body frozen: `fedrep-head-epochs` epochs of SGD on h_i alone;
3. body update, head frozen: `local-epochs` epochs of SGD on phi alone, under the new head;
4. upload the body only; keep the head. The personalized model is (phi_i, h_i) after both updates.
The server averages the bodies and never holds a head (`FedRepStrategy`).

Decisions (the authors' code `lgcollins/FedRep` at d82e62982e107bb3322541604f059c0ff28bd289,
`models/Update.py` `LocalUpdate.train` and `main_fedrep.py`):
- Epochs: the paper's experiments and the code's scripts (`scripts/FedRep_cifar10_2shards.sh`:
  `--local_ep 11 --local_rep_ep 1`, i.e. 10 head epochs then 1 body epoch): `fedrep-head-epochs` = 10
  and the body trains `local-epochs` epochs (fedskew's default 1). The code's `local_ep` (the total) is
  `fedrep-head-epochs + local-epochs` here.
- A client's first head is the head of the run's initial model w^0 (`main_fedrep.py`: every user's
  local weights start as the initial global model's), drawn on the client from the run's seed
  (`BaseTrainer.initial_model`), so nothing but the body ever travels; a lost state restarts the same
  way (logged).
- Freezing is `requires_grad = False` on the other part, as the code does (no gradient, no weight
  decay, no update); BatchNorm running statistics of the body still move during the head epochs
  (the code keeps `net.train()` throughout).
- Optimiser: the common `sgd` (`momentum`, `weight-decay`, `grad-clip`; the code: SGD, momentum 0.5,
  weight decay 1e-4) with the code's two parameter groups: `weight-decay` on the weights, 0 on the
  biases (a parameter whose name holds "bias", as the code splits them; `decay_groups`).
- Both updates are the base's hooks, so both engines run them: the head epochs are the main steps
  (`optimizer`, `local_steps`), the body epochs a `Phase` on the same model, the head kept when it
  ends. The batched engine stacks each over the round's clients, the part the optimiser leaves out
  frozen in the forward pass, each group with its weight decay; h_i is read in `load_global` and
  kept at the phase's end on both, a part of the stacked model in between.
- One optimiser per phase where the code keeps one for both: the same steps under torch >= 2.0,
  whose `zero_grad` leaves a frozen part without a gradient, so its step skips it. Under torch 1.x's
  in-place zeroing the code's head would keep moving by momentum and weight decay during the body
  epochs; that is not reproduced.
- `client-global-accuracy` is the round's start model on the local test split: the received body
  under the client's head (its personalized model of its last participation with the new body; a
  first-time client's w^0 head). There is no single global model: see `FedRepStrategy`.
- `train-loss` is the body epochs' loss, `fedrep-head-loss` the head epochs', `train-steps` both.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import torch
from flwr.app import ArrayRecord, RecordDict
from torch import nn

from fedskew.client_app.base import BaseTrainer, Phase, checked_arrays
from fedskew.models import body_state
from fedskew.training import sgd, steps_per_round, train_only

HEAD = "fedrep-head"


def decay_groups(model: nn.Module, part: nn.Module) -> list[dict[str, Any]]:
    """`part` alone trainable (`train_only`), as the optimiser's parameter groups of the authors' code
    (`models/Update.py` `LocalUpdate.train`: `weight_p` with weight decay, `bias_p` with 0): its
    parameters whose name holds "bias" in a group of weight decay 0, the others in the default group
    (`weight-decay`). An empty group is left out."""
    train_only(model, part)
    named = list(part.named_parameters())
    weights = [p for name, p in named if "bias" not in name]
    biases = [p for name, p in named if "bias" in name]
    groups = [{"params": weights}, {"params": biases, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


class FedRepTrainer(BaseTrainer):
    """Head epochs (body frozen), then body epochs (head frozen); the body travels, the head stays."""

    batched = True
    keeps_state = "the personal head"
    kept_arrays = ("head",)

    def load_global(self, model: nn.Module, content: RecordDict) -> None:
        """The received body (exactly the body's names, shapes and dtypes) under the client's head."""
        body = checked_arrays(content, body_state(model.state_dict()))
        model.load_state_dict(body, strict=False)  # the server sends no head: only the body's keys
        model.classifier.load_state_dict(self.initial_model().classifier.state_dict())
        self.restore(HEAD, model.classifier)

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """The head epochs' SGD: the head alone, weights and biases in their decay groups."""
        return sgd(decay_groups(model, model.classifier), self.cfg)

    def local_steps(self) -> int:
        """The main steps are the head epochs: `fedrep-head-epochs` passes."""
        return steps_per_round(len(self.data.y_train), self.cfg["fedrep-head-epochs"], self.cfg["batch-size"])

    def later_phases(self, model: nn.Module) -> Iterator[Phase]:
        """The body epochs after the head's: `local-epochs` passes on the body alone, the head frozen."""
        optimizer = sgd(decay_groups(model, model.features), self.cfg)
        steps = steps_per_round(len(self.data.y_train), self.cfg["local-epochs"], self.cfg["batch-size"])
        yield Phase(model, optimizer, steps, self.loss, self.functional_loss, functools.partial(self.end_body, model))

    def end_body(self, model: nn.Module, head: dict[str, float], body: dict[str, float]) -> dict[str, float]:
        """Keep h_i (`model`'s head); the body epochs' loss as `train-loss`, the head epochs' as
        `fedrep-head-loss`, the steps of both."""
        self.keep(HEAD, model.classifier)
        steps = head["train-steps"] + body["train-steps"]
        return {**body, "train-steps": steps, "fedrep-head-loss": head["train-loss"]}

    def upload(self, model: nn.Module) -> ArrayRecord:
        return ArrayRecord(body_state(model.state_dict()))
