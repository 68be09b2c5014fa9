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
- Both engines run it through the base's hooks: the P-head, read in `load_global`, rides on the
  model as its submodule `personal` (outside `features` and `classifier`: not in its forward, not
  uploaded), so the base `optimizer` holds body, G-head and P-head in that order and the batched
  engine stacks the P-head with the rest; the objective is written once as `example_losses` (L_BSM,
  the log prior an extra) and `forward_loss` (CE(g + p) on the P-head's output); the P-head is kept
  and the terms' means reported in `after_steps`.
"""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, RecordDict
from torch import nn

from fedskew.client_app.base import BaseTrainer, Forward, Tensors
from fedskew.losses.fedrod import balanced_softmax_loss, class_log_prior, personalized_risk
from fedskew.models import SplitNet
from fedskew.training import weighted_sum

PERSONAL_HEAD = "fedrod-personal-head"
PERSONAL = "personal"  # the P-head's name as the model's submodule during the round
TERMS = ("fedrod-bsm-loss", "fedrod-personal-loss")  # L_BSM and CE(g + p), reported per step


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

    batched = True
    keeps_state = "the personalized head"
    kept_arrays = ("head",)

    def load_global(self, model: nn.Module, content: RecordDict) -> None:
        """The received generic model, then the client's P-head (w^0's head at first) as its submodule
        `personal`, and the log prior of its training labels."""
        super().load_global(model, content)
        self.log_prior = class_log_prior(self.data.train_counts, self.cfg["fedrod-gamma"]).to(self.device)
        self.personal = self.initial_model().classifier
        self.restore(PERSONAL_HEAD, self.personal)
        model.add_module(PERSONAL, self.personal)

    def batch_extras(self) -> dict[str, torch.Tensor]:
        return {"log-prior": self.log_prior}

    def example_losses(
        self, logits: torch.Tensor, y: torch.Tensor, extras: dict[str, torch.Tensor], reduction: str = "none"
    ) -> torch.Tensor:
        """L_BSM of the generic logits g."""
        return balanced_softmax_loss(logits, y, extras["log-prior"], reduction)

    def forward_loss(
        self, data: torch.Tensor, fwd: Forward, y: torch.Tensor, weight: torch.Tensor | None, extras: Tensors
    ) -> tuple[torch.Tensor, Tensors]:
        """L_BSM(g) + CE(g + p), p = P(f(x)) on the detached features (the P-head's step alone)."""
        p = fwd.run(PERSONAL, fwd.z.detach())
        if weight is None:
            er = personalized_risk(fwd.logits, p, y)
        else:
            er = weighted_sum(personalized_risk(fwd.logits, p, y, "none"), weight)
        return data + er, dict(zip(TERMS, (data.detach(), er.detach()), strict=True))

    def after_steps(self, model: nn.Module, stats: dict[str, float]) -> dict[str, float]:
        """Keep the P-head; each term's mean over the steps."""
        self.keep(PERSONAL_HEAD, self.personal)
        steps = max(stats["train-steps"], 1.0)
        return {**stats, **{name: float(torch.as_tensor(self.reported.get(name, 0.0)) / steps) for name in TERMS}}

    def upload(self, model: nn.Module) -> ArrayRecord:
        """Body and G-head: the model without its P-head."""
        return ArrayRecord({k: t for k, t in model.state_dict().items() if not k.startswith(f"{PERSONAL}.")})

    def personalized_model(self, model: nn.Module) -> nn.Module:
        return TwoHeads(model, self.personal)
