"""FedBABU client (Oh, Kim & Yun, "FedBABU: Toward Enhanced Representation for Federated Image
Classification", ICLR'22). Server side: `fedskew/strategies/fedbabu.py`.

FedBABU ("body aggregation and body update") trains and aggregates the body only: the head
(`classifier`) stays at its random initialisation for the whole federated training, the same on
every client (the server sends it and never changes it). Personalization is fine-tuning the global
model on the client's data before the personalized accuracy is measured.

One round on client k:
1. body update: `local-epochs` epochs of SGD on the received model with the head frozen
   (`requires_grad = False`: no gradient, no weight decay, no step); the body is uploaded;
2. personalization: a copy of the received global model (body and random head) fine-tuned for
   `fedbabu-finetune-epochs` epochs at `fedbabu-finetune-lr`, every parameter (`fedbabu-finetune-part
   ="full"`) or the head alone ("head"); the fine-tuned model is the personalized model, the
   received one (the paper's "initial" accuracy) is `client-global-accuracy`. With
   `fedbabu-finetune-every` = N only every N-th round and the last fine-tune (N = 0: the last alone);
   in the others the personalized model is the received global model, unchanged.
Nothing persists on the client: each round personalizes the global model it received.

Decisions (the authors' code `jhoon-oh/FedBABU` at e34c15b4288224f0af1bc13670bc0cdc373c9576):
- Frozen head: `main_fed.py` with `--local_upt_part body --aggr_part body` trains with the head's
  learning rate 0 (`models/Update.py`: body and head parameter groups) and aggregates only the body;
  here the head is not in the optimiser at all (the same: it never moves).
- Fine-tuning (`analysis.ipynb`, the personalized evaluation): the whole network (body and head,
  one learning rate), `personalization_epoch = 5`, learning rate 1e-3, the training momentum (0.9
  in the scripts), no weight decay, the training batch size. Here: `fedbabu-finetune-epochs` = 5,
  `fedbabu-finetune-lr` = 0.001 (not decayed with the training lr), `momentum` and `batch-size` of
  the run, weight decay 0.
- The fine-tuning starts from the received global model, not from this round's body update: the
  paper fine-tunes the global model, and FedGELA (Fan et al., NeurIPS'23, Sec. 5) likewise
  fine-tunes global models for their personal accuracy.
- Both stages are the base's hooks, so both engines run them: the body update is the main steps
  (`optimizer` holds the body alone), the fine-tuning a `Phase` on the copy, its batches drawn from
  the client's generator after the body update's.
- `fedbabu-finetune-every` (default 1: every round, the paper's per-round evaluation) = 0 is PFLlib's
  protocol (`serverbabu.py`: each round evaluates the global model; the clients fine-tune once, after
  the last round), which fine-tunes the model after its last body update where this fine-tunes the
  received one, one body epoch apart. The batched engine stacks each over the round's
  clients, the parameters the optimiser leaves out (the head; the body in a head-only fine-tuning)
  frozen in the forward pass.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import torch
from flwr.app import ArrayRecord, RecordDict
from torch import nn

from fedskew.client_app.base import BaseTrainer, Phase
from fedskew.models import body_state
from fedskew.training import sgd, steps_per_round, train_only


class FedBABUTrainer(BaseTrainer):
    """Body-only local update (head frozen at its random start); personalized = fine-tuned global model."""

    batched = True

    def load_global(self, model: nn.Module, content: RecordDict) -> None:
        super().load_global(model, content)
        self.finetuned = copy.deepcopy(model)  # the global model, fine-tuned after the body update

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """SGD on the body alone: the head is frozen (no gradient, no weight decay, no step)."""
        return sgd(train_only(model, model.features), self.cfg)

    def fine_tunes(self) -> bool:
        """Whether this round fine-tunes: every `fedbabu-finetune-every`-th round and the last (0: the
        last alone)."""
        every, r = self.cfg["fedbabu-finetune-every"], self.ctx.server_round
        return r == self.cfg["num-server-rounds"] or (every > 0 and r % every == 0)

    def later_phases(self, model: nn.Module) -> Iterator[Phase]:
        """The fine-tuning of the received global model: `fedbabu-finetune-epochs` epochs at
        `fedbabu-finetune-lr`, weight decay 0, of every parameter or the head alone; none in a round
        that does not fine-tune (`fine_tunes`)."""
        if not self.fine_tunes():
            return
        net = self.finetuned
        params = train_only(net, net if self.cfg["fedbabu-finetune-part"] == "full" else net.classifier)
        optimizer = sgd(params, {**self.cfg, "lr": self.cfg["fedbabu-finetune-lr"], "weight-decay": 0.0})
        steps = steps_per_round(len(self.data.y_train), self.cfg["fedbabu-finetune-epochs"], self.cfg["batch-size"])
        yield Phase(net, optimizer, steps, self.loss, self.functional_loss, self.end_finetuning)

    def end_finetuning(self, stats: dict[str, float], tuned: dict[str, float]) -> dict[str, float]:
        """The body update's metrics with the fine-tuning's loss (`fedbabu-finetune-loss`)."""
        return {**stats, "fedbabu-finetune-loss": tuned["train-loss"]}

    def personalized_model(self, model: nn.Module) -> nn.Module:
        """The received global model after the fine-tuning (as received in a round without it)."""
        return self.finetuned

    def upload(self, model: nn.Module) -> ArrayRecord:
        return ArrayRecord(body_state(model.state_dict()))
