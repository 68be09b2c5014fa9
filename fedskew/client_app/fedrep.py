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
- Optimiser: the common `sgd` (the code: SGD, momentum 0.5, weight decay 1e-4 on weights), one per
  phase: the code's single optimiser touches only parameters with a gradient, so it is the same.
- `client-global-accuracy` is the round's start model on the local test split: the received body
  under the client's head (its personalized model of its last participation with the new body; a
  first-time client's w^0 head). There is no single global model: see `FedRepStrategy`.
- `train-loss` is the body epochs' loss, `fedrep-head-loss` the head epochs', `train-steps` both.
"""

from __future__ import annotations

from flwr.app import ArrayRecord, RecordDict
from torch import nn

from fedskew import wire
from fedskew.client_app.base import BaseTrainer, checked_arrays
from fedskew.models import body_state
from fedskew.training import sgd, train_only

HEAD = "fedrep-head"


class FedRepTrainer(BaseTrainer):
    """Head epochs (body frozen), then body epochs (head frozen); the body travels, the head stays."""

    wire = wire.FEDREP
    keeps_state = "the personal head"

    def load_global(self, model: nn.Module, content: RecordDict) -> None:
        """The received body (exactly the body's names, shapes and dtypes) under the client's head."""
        body = checked_arrays(content, body_state(model.state_dict()))
        model.load_state_dict(body, strict=False)  # the server sends no head: only the body's keys
        model.classifier.load_state_dict(self.initial_model().classifier.state_dict())
        self.restore(HEAD, model.classifier)

    def local_train(self, model: nn.Module, content: RecordDict) -> dict[str, float]:
        epochs = self.cfg["fedrep-head-epochs"]
        head = self.run_epochs(model, sgd(train_only(model, model.classifier), self.cfg), epochs)
        body = self.run_epochs(model, sgd(train_only(model, model.features), self.cfg), self.cfg["local-epochs"])
        model.requires_grad_(True)
        self.keep(HEAD, model.classifier)
        steps = head["train-steps"] + body["train-steps"]
        return {**body, "train-steps": steps, "fedrep-head-loss": head["train-loss"]}

    def upload(self, model: nn.Module) -> ArrayRecord:
        return ArrayRecord(body_state(model.state_dict()))
