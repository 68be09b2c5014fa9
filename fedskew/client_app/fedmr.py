"""FedMR client (Fan et al., TMLR 2023, Alg. 1).

Local objective per mini-batch (Eq. 5): ``CE(f2(z), y) + mu1 * l_intra(z, y) + mu2 * l_inter(z, y; G)``
with ``z = f1(x)`` the backbone features. The maths and the decisions where the paper is silent are in
`fedskew/losses/fedmr.py`. Client-side choices:

- The global prototypes G [C, d] and their validity mask [C] arrive in the `fedmr-prototypes`
  ArrayRecord and stay fixed (no gradient) during local training (`fedskew/client_app/prototypes.py`,
  shared with FedProc). Round 1 (nothing valid yet) or a class no participant has held yet: its
  prototype is invalid and masked, so round 1 is CE + intra (the paper does not say how round 1 or a
  missing class is handled). A term whose weight is 0 is
  not computed (mu1 = mu2 = 0 reproduces FedAvg bit for bit).
- After local training, the client computes its per-class prototypes g_k^c (mean feature over the
  whole local training set, eval mode, no augmentation: the paper does not say when or in which
  mode) and the counts N_k^c, inside the timed part of the round, and uploads them as the
  `fedmr-prototypes` record {prototypes [C, d] float32, counts [C] int64}, zero rows for classes it
  does not hold.
- Privacy (paper Sec. 4.4 / Table 5; whether a non-sharing client still uses G is not said: it
  does): a client outside the server's fixed sharing subset (`fedmr-share-fraction`, broadcast as
  `fedmr-config.share-mask`) uploads zero prototypes and zero counts but still uses G; the classes
  in `fedmr-private-classes` are never uploaded by anyone.
- The client keeps no state across rounds.
- Every `fedmr-grad-share-every`-th mini-batch (0: never), the client measures what each weighted
  term weighs against the cross-entropy in the backbone's update, ||grad_body mu2 l_inter|| /
  ||grad_body CE|| (and the same for mu1 l_intra; `gradient_share`, two extra backward passes
  through the backbone that change nothing in training), and reports the round's means as
  `inter-grad-share` and `intra-grad-share`.
- The objective is written once (`feature_loss`); the batched engine stacks a round's clients, each
  client's prototypes and own classes its extras, the terms masked over the padding. Runs with
  gradient shares or a Lite sample smaller than the batch train per client (`stacked_refusal`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from flwr.app import RecordDict
from torch import nn

from fedskew.client_app.base import Tensors
from fedskew.client_app.prototypes import PrototypeTrainer
from fedskew.losses.fedmr import gradient_share, inter_class_loss, intra_class_loss
from fedskew.methods.fedmr import FEDMR_CONFIG, FEDMR_PROTOTYPES
from fedskew.schema import parse_class_list


class FedMRTrainer(PrototypeTrainer):
    """FedAvg local training plus the intra-class and inter-class (prototype) losses."""

    batched = True
    prototype_record = FEDMR_PROTOTYPES

    @classmethod
    def stacked_refusal(cls, cfg: dict[str, Any]) -> str | None:
        """Stacked but with FedMR Lite's sampled inter loss (its own generator's draws in the loss) or
        the gradient shares (extra backward passes through the model's own parameters)."""
        if cfg["fedmr-grad-share-every"]:
            return "FedMR measures its terms' gradient shares (fedmr-grad-share-every) on the model itself"
        if 0 < cfg["fedmr-lite-n"] < cfg["batch-size"]:
            return "FedMR Lite draws the inter loss's samples in the loss (fedmr-lite-n)"
        return super().stacked_refusal(cfg)

    def load_global(self, model: nn.Module, content: RecordDict) -> None:
        super().load_global(model, content)
        self.local_mask = torch.from_numpy(self.data.train_counts > 0).to(self.device)
        conf = self.received.get(FEDMR_CONFIG)
        mask = list(conf["share-mask"]) if conf is not None else None
        pid = self.ctx.partition_id
        self.share = True if mask is None else (pid < len(mask) and bool(mask[pid]))
        self.use_inter = self.cfg["fedmr-mu2"] > 0 and self.cfg["fedmr-lite-n"] != 0 and bool(self.valid.any())
        seed = np.random.SeedSequence([self.cfg["seed"], pid, self.ctx.server_round, 1]).generate_state(1)[0]
        self.lite_generator = torch.Generator().manual_seed(int(seed))  # not the batch-order stream
        self.body = [p for p in model.features.parameters() if p.requires_grad]  # for the gradient shares
        self.term_steps = 0
        self.shares: dict[str, list[float]] = {}  # "intra" / "inter" -> gradient shares measured

    def batch_extras(self) -> dict[str, torch.Tensor]:
        return {**super().batch_extras(), "local": self.local_mask}

    def feature_loss(
        self, data: torch.Tensor, z: torch.Tensor, y: torch.Tensor, weight: torch.Tensor | None, extras: Tensors
    ) -> tuple[torch.Tensor, Tensors]:
        """CE + mu1 l_intra + mu2 l_inter (Eq. 5), a term of weight 0 not computed; the unweighted
        terms reported as "intra" and "inter"."""
        mu1, mu2 = self.cfg["fedmr-mu1"], self.cfg["fedmr-mu2"]
        loss, terms, reports = data, {}, {}
        if mu1 > 0:
            reports["intra"] = intra_class_loss(
                z, y, self.cfg["fedmr-intra-mode"], weight=weight, num_classes=self.dims.num_classes
            )
            terms["intra"] = mu1 * reports["intra"]
            loss = loss + terms["intra"]
        # per client: as `load_global` found the prototypes; stacked: masks give 0 where none is valid
        if self.use_inter if weight is None else mu2 > 0 and self.cfg["fedmr-lite-n"] != 0:
            reports["inter"] = inter_class_loss(
                z,
                y,
                extras["prototypes"],
                extras["valid"],
                extras["local"],
                negatives=self.cfg["fedmr-negatives"],
                margin=self.cfg["fedmr-margin"],
                form=self.cfg["fedmr-inter-form"],
                lite_n=self.cfg["fedmr-lite-n"],
                generator=self.lite_generator,
                weight=weight,
            )
            terms["inter"] = mu2 * reports["inter"]
            loss = loss + terms["inter"]
        every = self.cfg["fedmr-grad-share-every"]
        if weight is None and every and self.term_steps % every == 0:  # never stacked (`stacked_refusal`)
            for name, term in terms.items():  # what each weighted term weighs against the CE
                share = gradient_share(term, data, self.body)
                if math.isfinite(share):
                    self.shares.setdefault(name, []).append(share)
        self.term_steps += 1
        return loss, reports

    def after_steps(self, model: nn.Module, stats: dict[str, float]) -> dict[str, float]:
        stats = super().after_steps(model, stats)
        steps = max(stats["train-steps"], 1)
        shares = {f"{name}-grad-share": sum(v) / len(v) for name, v in self.shares.items()}
        return {
            **stats,
            "intra-loss": self.reported_sum("intra") / steps,
            "inter-loss": self.reported_sum("inter") / steps,
            "inter-active": float(self.use_inter),
            "prototypes-shared": float(self.share),
            **shares,
        }

    def hidden_classes(self) -> list[int]:
        """Every class outside the sharing subset, else the private classes."""
        c = self.dims.num_classes
        return list(range(c)) if not self.share else parse_class_list(self.cfg["fedmr-private-classes"], c)
