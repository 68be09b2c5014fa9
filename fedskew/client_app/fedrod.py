"""FedRoD client (Chen & Chao, "On Bridging Generic and Personalized Federated Learning for Image
Classification", ICLR'22, the linear personalized head "Fed-RoD (linear)"). Maths in
`fedskew/losses/fedrod.py`; server in `fedskew/strategies/fedrod.py`.

The network is a shared body (`features`), a generic head (G-head, `classifier`) and a personalized
head (P-head, a bias-free linear layer of the classifier's shape) of client m:
- generic predictor g(x) = G(f(x)), trained with the balanced softmax L_BSM (the logits shifted by
  gamma log N_{m,c}, the log prior of the client's training labels, `fedrod-gamma`): body and G-head
  are uploaded and averaged, and the global model is this generic predictor;
- personalized predictor argmax_c g_c(x) + p_c(x), p(x) = P(f(x)), the P-head trained on the
  empirical risk CE(g + p, y) with the body's features and the G-head's logits held constant; the
  P-head persists in the client's state ("fedrod-personal-head") and never leaves the client.
Each mini-batch takes one step on both losses: L_BSM moves body and G-head, CE(g + p) the P-head
(the two gradients touch disjoint parameters, so one backward pass of their sum is both steps).

Decisions (the authors published no code, `hongyouc/Fed-RoD` holds a README only; PFLlib's
`TsingZ0/PFLlib` `system/flcore/clients/clientrod.py` at 04240b9708b520f21882387945aefd34f740b975
was read for what the paper leaves open):
- Linear P-head, no hypernetwork (the paper's main variant; its hypernetwork serves clients that
  never trained).
- A client's first P-head is the run's initial model's head w^0 (PFLlib copies the initial model's
  head for every client), drawn on the client from the run's seed; a lost state restarts the same
  way (logged).
- BSM with gamma = 1 (Ren et al.'s balanced softmax, as in PFLlib); classes the client lacks leave
  its softmax (log 0 = -inf).
- One optimiser for both heads and the body: the common `sgd` (PFLlib: two plain SGD optimisers
  at the same learning rate).
- `train-loss` is L_BSM + CE(g + p), reported apart as `fedrod-bsm-loss` and `fedrod-personal-loss`;
  `client-global-accuracy` is the received generic model on the local test split, `personal-accuracy`
  the personalized predictor after training (FedGELA, Sec. 5: FedRoD's PA and GA are read during
  training, without fine-tuning).
"""

from __future__ import annotations

import torch
from flwr.app import RecordDict
from torch import nn

from fedskew.client_app.base import BaseTrainer
from fedskew.losses.fedrod import balanced_softmax_loss, class_log_prior, personalized_risk
from fedskew.models import SplitNet
from fedskew.training import sgd

PERSONAL_HEAD = "fedrod-personal-head"


class TwoHeads(nn.Module):
    """The personalized predictor: logits G(f(x)) + P(f(x))."""

    def __init__(self, model: SplitNet, personal: nn.Module) -> None:
        super().__init__()
        self.model, self.personal = model, personal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.model.features(x)
        return self.model.classifier(h) + self.personal(h)


class FedRoDTrainer(BaseTrainer):
    """Body and generic head on the balanced softmax; the personal head on the empirical risk of g + p."""

    keeps_state = "the personalized head"
    kept_arrays = ("head",)

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """L_BSM(g) + CE(g + p) on one mini-batch; each step's parts are summed for the metrics."""
        h = model.features(x)
        g = model.classifier(h)
        bsm = balanced_softmax_loss(g, y, self.log_prior)
        er = personalized_risk(g, self.personal(h.detach()), y)
        self.parts += torch.stack([bsm.detach(), er.detach()])
        return bsm + er

    def local_train(self, model: nn.Module, content: RecordDict) -> dict[str, float]:
        self.log_prior = class_log_prior(self.data.train_counts, self.cfg["fedrod-gamma"]).to(self.device)
        self.personal = self.initial_model().classifier
        self.restore(PERSONAL_HEAD, self.personal)
        self.parts = torch.zeros(2, device=self.device)
        params = [*model.parameters(), *self.personal.parameters()]
        stats = self.run_epochs(model, sgd(params, self.cfg), self.cfg["local-epochs"])
        self.keep(PERSONAL_HEAD, self.personal)
        bsm, er = (self.parts / max(stats["train-steps"], 1.0)).tolist()
        return {**stats, "fedrod-bsm-loss": bsm, "fedrod-personal-loss": er}

    def personalized_model(self, model: nn.Module) -> nn.Module:
        return TwoHeads(model, self.personal)
