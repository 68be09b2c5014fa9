"""FedProto client (Tan et al., "FedProto: Federated Prototype Learning across Heterogeneous
Clients", AAAI'22, Alg. 1 LocalUpdate; the authors' code `yuetan031/FedProto` at commit
97e42e2741e1ae2e2fce2465e80f38f6997f8836, `lib/update.py`). Server: `fedskew/strategies/fedproto.py`;
maths: `fedskew/losses/fedproto.py`.

One round on client i (the paper's sections in quotes):
1. take its own model from its state (no model arrives: the server's `arrays` record is empty and
   any array in it is refused) and the global prototypes C_bar with their validity mask;
2. train it for `local-epochs` on ``CE(F(x), y) + lambda * L_R`` ("Local Model Update"), L_R the
   squared distance of each embedding f(x) (the classifier's input) to its class's global
   prototype, averaged over the batch and the dimensions as the code's `nn.MSELoss`; lambda =
   `fedproto-lambda` (code default 1, its README's MNIST/FEMNIST value; 0.1 for its CIFAR-10
   command). Round 1 (no global prototype) and classes without one train on CE alone, as the code
   does (`loss2 = 0 * loss1`);
3. compute its prototypes C_i^(j) ("Prototype": the mean embedding of class j over the whole local
   training set with the trained model, eval mode) and the counts |D_ij|; upload both, and keep the
   model (`fedskew/client_app/prototypes.py`, shared with FedMR and FedProc).

The objective is written once (`feature_loss`): the batched engine stacks a round's clients, each
client's global prototypes its extras.

The personalized model is the client's own model. `fedproto-inference="prototype"` (default)
predicts as "Prototype-based model inference": the class whose global prototype is nearest to f(x)
(the code's "with protos" accuracy); "classifier" uses the model's own head (the code's "w/o
protos" accuracy). Until each class the client holds has a global prototype (round 1; under partial
participation a class no participant has held yet) the head predicts; `prototype-inference` (0/1)
reports which one did. `client-global-accuracy` is not reported: no global model reaches the client.

Decisions and deviations (paper vs the authors' code):
- Prototypes over the whole local training set with the trained model (paper), not the code's mean
  of the last epoch's training-mode batch embeddings taken while the model still changes.
- The distance: the code's squared L2 averaged over batch and dimensions (the scale its lambda goes
  with); the paper names the L2 distance and sums over classes.
- A client seen for the first time starts from the run's initial network (`built_with_seed`: the
  network every fedskew method starts from, here built by the client itself), as FL benchmarks start
  P-FL baselines from one initial model; the code draws each client's model independently (and for
  CIFAR-10 loads ImageNet weights). A lost state (a SuperNode restarted without `state-dir`) starts
  over the same way, logged.
- Prototype inference ranges over every class with a global prototype (the paper's argmin over j);
  the code's evaluation also restricts it to the client's own classes, which would make the personal
  model blind to the other classes on a central test set.
- The local optimiser is fedskew's (`sgd`: `lr`, `momentum`, `weight-decay` of the run config), fresh
  each round; the code's is SGD with momentum 0.5 and lr 0.01, batch 4.

Client state (`self.ctx.state`): the tensors "fedproto-model" (one state dict, within `state-max-mb`;
see `fedskew/client_app/state.py`).
"""

from __future__ import annotations

import logging

import torch
from flwr.app import ArrayRecord, RecordDict
from torch import nn

from fedskew.client_app.base import Tensors, checked_arrays
from fedskew.client_app.prototypes import PrototypeTrainer
from fedskew.client_app.state import matches
from fedskew.losses.fedproto import prototype_distance_loss, prototype_logits
from fedskew.methods.fedproto import FEDPROTO_PROTOTYPES
from fedskew.training import built_with_seed

log = logging.getLogger("fedskew.client")

MODEL_TENSORS = "fedproto-model"


class PrototypeClassifier(nn.Module):
    """A network that predicts by the nearest global prototype of its embedding."""

    def __init__(self, net: nn.Module, prototypes: torch.Tensor, valid: torch.Tensor) -> None:
        super().__init__()
        self.net = net
        self.register_buffer("prototypes", prototypes)
        self.register_buffer("valid", valid)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return prototype_logits(self.net.features(x), self.prototypes, self.valid)


class FedProtoTrainer(PrototypeTrainer):
    """The client's own model, trained with CE + lambda x distance to the global prototypes."""

    batched = True
    prototype_record = FEDPROTO_PROTOTYPES
    keeps_state = "the personal model"
    kept_arrays = ("model",)

    def load_global(self, model: nn.Module, content: RecordDict) -> None:
        """No model arrives (an array in `arrays` is refused): the client's own model from its state,
        or the run's initial network; then the global prototypes."""
        checked_arrays(content, {})
        own = self.ctx.state.load_tensors(MODEL_TENSORS)
        if own is not None and not matches(own, model.state_dict()):
            log.warning("partition %d: FedProto model state does not fit the network: discarded", self.ctx.partition_id)
            own = None
        if own is None:
            log.info(
                "partition %d, round %d: no own model (first participation or lost state): the initial network",
                self.ctx.partition_id,
                self.ctx.server_round,
            )
            own = built_with_seed(self.build_model, self.cfg["seed"]).state_dict()
        model.load_state_dict(own, strict=True)
        self.receive_prototypes(model)

    def received_global_model(self, model: nn.Module) -> nn.Module | None:
        return None

    def feature_loss(
        self, data: torch.Tensor, z: torch.Tensor, y: torch.Tensor, weight: torch.Tensor | None, extras: Tensors
    ) -> tuple[torch.Tensor, Tensors]:
        """CE + lambda L_R (step 2), L_R reported as "proto"."""
        distance = prototype_distance_loss(z, y, extras["prototypes"], extras["valid"], weight)
        return data + self.cfg["fedproto-lambda"] * distance, {"proto": distance}

    def after_steps(self, model: nn.Module, stats: dict[str, float]) -> dict[str, float]:
        stats = super().after_steps(model, stats)  # the local prototypes (step 3)
        self.ctx.state.save_tensors(MODEL_TENSORS, model.state_dict())
        return {
            **stats,
            "proto-loss": self.reported_sum("proto") / max(stats["train-steps"], 1),
            "prototype-inference": int(self.by_prototype()),
        }

    def by_prototype(self) -> bool:
        """Prototype inference, once every class the client holds has a global prototype."""
        own = torch.from_numpy(self.data.train_counts > 0).to(self.device)
        return self.cfg["fedproto-inference"] == "prototype" and bool(self.valid[own].all())

    def personalized_model(self, model: nn.Module) -> nn.Module:
        return PrototypeClassifier(model, self.prototypes, self.valid) if self.by_prototype() else model

    def upload(self, model: nn.Module) -> ArrayRecord:
        return ArrayRecord()
