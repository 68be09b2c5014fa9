"""FedMR client (Fan et al., TMLR 2023, Alg. 1; spec `shared/methods/fedmr.md`).

Local objective per mini-batch (Eq. 5): ``CE(f2(z), y) + mu1 * l_intra(z, y) + mu2 * l_inter(z, y; G)``
with ``z = f1(x)`` the backbone features. The maths and the paper-vs-spec decisions are in
`fedskew/losses/fedmr.py`. Client-side choices:

- The global prototypes G [C, d] and their validity mask [C] arrive in the `fedmr-prototypes`
  ArrayRecord and stay fixed (no gradient) during local training. Round 1 (nothing valid yet) or a
  class no participant has held yet: its prototype is invalid and masked, so round 1 is CE + intra
  (spec A6). A term whose weight is 0 is not computed (mu1 = mu2 = 0 reproduces FedAvg bit for bit).
- After local training, the client computes its per-class prototypes g_k^c (mean feature over the
  whole local training set, eval mode, no augmentation; spec A5) and the counts N_k^c, inside the
  timed part of the round, and uploads them as the `fedmr-prototypes` record {prototypes [C, d]
  float32, counts [C] int64}, zero rows for classes it does not hold.
- Privacy (paper Sec. 4.4 / Table 5, spec A15): a client outside the server's fixed sharing subset
  (`fedmr-share-fraction`, broadcast as `fedmr-config.share-mask`) uploads zero prototypes and zero
  counts but still uses G; the classes in `fedmr-private-classes` are never uploaded by anyone.
- The client keeps no state across rounds.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, RecordDict
from torch import nn

from fedskew import wire
from fedskew.client_app.base import BaseTrainer
from fedskew.config import parse_class_list
from fedskew.losses.fedmr import class_prototypes, inter_class_loss, intra_class_loss
from fedskew.training import extract_features
from fedskew.wire import FEDMR_CONFIG, FEDMR_PROTOTYPES


class FedMRTrainer(BaseTrainer):
    """FedAvg local training plus the intra-class and inter-class (prototype) losses."""

    wire = wire.FEDMR

    def load_global(self, model: nn.Module, content: RecordDict) -> None:
        super().load_global(model, content)
        c, d = model.num_classes, model.feature_dim
        rec = self.received.get(
            FEDMR_PROTOTYPES, {"prototypes": torch.zeros(c, d), "valid": torch.zeros(c, dtype=torch.bool)}
        )
        self.prototypes = rec["prototypes"].to(self.device)
        self.valid = rec["valid"].to(self.device)
        self.local_mask = torch.from_numpy(self.data.train_counts > 0).to(self.device)
        conf = self.received.get(FEDMR_CONFIG)
        mask = list(conf["share-mask"]) if conf is not None else None
        pid = self.ctx.partition_id
        self.share = True if mask is None else (pid < len(mask) and bool(mask[pid]))
        self.use_inter = self.cfg["fedmr-mu2"] > 0 and self.cfg["fedmr-lite-n"] != 0 and bool(self.valid.any())
        seed = np.random.SeedSequence([self.cfg["seed"], pid, self.ctx.server_round, 1]).generate_state(1)[0]
        self.lite_generator = torch.Generator().manual_seed(int(seed))  # not the batch-order stream
        self.term_sums = torch.zeros(2, device=self.device)
        self.term_steps = 0

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        z = model.features(x)
        loss = F.cross_entropy(model.classifier(z), y)
        mu1, mu2 = self.cfg["fedmr-mu1"], self.cfg["fedmr-mu2"]
        if mu1 > 0:
            intra = intra_class_loss(z, y, self.cfg["fedmr-intra-mode"])
            loss = loss + mu1 * intra
            self.term_sums[0] += intra.detach()
        if self.use_inter:
            inter = inter_class_loss(
                z,
                y,
                self.prototypes,
                self.valid,
                self.local_mask,
                negatives=self.cfg["fedmr-negatives"],
                margin=self.cfg["fedmr-margin"],
                form=self.cfg["fedmr-inter-form"],
                lite_n=self.cfg["fedmr-lite-n"],
                generator=self.lite_generator,
            )
            loss = loss + mu2 * inter
            self.term_sums[1] += inter.detach()
        self.term_steps += 1
        return loss

    def local_train(self, model: nn.Module, content: RecordDict) -> dict[str, float]:
        stats = super().local_train(model, content)
        self.local_prototypes, self.local_counts = self.compute_prototypes(model)
        intra, inter = (self.term_sums / max(self.term_steps, 1)).tolist()
        return {
            **stats,
            "intra-loss": intra,
            "inter-loss": inter,
            "inter-active": float(self.use_inter),
            "prototypes-shared": float(self.share),
        }

    def compute_prototypes(self, model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """g_k^c and N_k^c over the whole local training set with the final local model (eval mode)."""
        z = extract_features(model, self.data.x_train, self.cfg["eval-batch-size"], self.device)
        return class_prototypes(z, self.data.y_train.to(self.device), model.num_classes)

    def extra_records(self, model: nn.Module) -> dict[str, Any]:
        protos, counts = self.local_prototypes.float().cpu().clone(), self.local_counts.to(torch.int64).cpu().clone()
        hidden = (
            list(range(len(counts)))
            if not self.share
            else parse_class_list(self.cfg["fedmr-private-classes"], len(counts))
        )
        protos[hidden] = 0.0
        counts[hidden] = 0
        return {FEDMR_PROTOTYPES: ArrayRecord({"prototypes": protos, "counts": counts})}
