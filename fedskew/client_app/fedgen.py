"""FedGen client (Zhu, Hong & Zhou, ICML'21): FedAvg's local training plus the generator's
regulariser; it uploads the model and its label counts. Maths, the authors' code read and the
deviations: `fedskew/losses/fedgen.py`; server: `fedskew/strategies/fedgen.py`.

From round 2 on the server sends its generator G (`fedgen-generator`), which the client runs in
eval mode and never trains. Every mini-batch (x, y) then adds to the cross-entropy

    (B_g / B) alpha_t CE(W G(eps, y_hat), y_hat) + beta_t KL(softmax(W G(eps', y)) || softmax(f(x)))

with B_g = `fedgen-gen-batch-size` labels y_hat drawn uniformly from all classes (the code's
`available_labels`), B the configured `batch-size`, alpha_t = max(1e-4, `fedgen-alpha` 0.98^(t-1))
and beta_t likewise from `fedgen-beta`. Round 1 (no generator yet) is FedAvg. The labels and noise
come from their own generator, seeded by (seed, partition, round), so the mini-batch order is
FedAvg's. The reply adds `fedgen-counts`, the training set's label counts. No client state.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, RecordDict
from torch import nn

from fedskew.client_app.base import BaseTrainer
from fedskew.losses.fedgen import Generator, build_generator, client_regulariser, regulariser_weight
from fedskew.wire import FEDGEN_COUNTS, FEDGEN_GENERATOR


class FedGenTrainer(BaseTrainer):
    """Cross-entropy plus the generator's teacher and latent terms once the server sent G."""

    def load_global(self, model: nn.Module, content: RecordDict) -> None:
        super().load_global(model, content)
        self.generator: Generator | None = None
        if FEDGEN_GENERATOR in self.received:
            generator = build_generator(self.cfg, model.num_classes, model.feature_dim)
            generator.load_state_dict(self.received[FEDGEN_GENERATOR])
            self.generator = generator.to(self.device, self.dtype).eval().requires_grad_(False)
        r, pid = self.ctx.server_round, self.ctx.partition_id
        self.alpha = regulariser_weight(self.cfg["fedgen-alpha"], r)
        self.beta = regulariser_weight(self.cfg["fedgen-beta"], r)
        seed = np.random.SeedSequence([self.cfg["seed"], pid, r, 2]).generate_state(1)[0]
        self.noise_rng = torch.Generator().manual_seed(int(seed))  # not the mini-batch stream
        self.term_sums, self.term_steps = torch.zeros(2, device=self.device), 0

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        if self.generator is None:
            return loss
        with torch.no_grad():
            for_batch, _ = self.generator.generate(y, self.noise_rng)
            sampled = torch.randint(model.num_classes, (self.cfg["fedgen-gen-batch-size"],), generator=self.noise_rng)
            sampled = sampled.to(self.device)
            generated, _ = self.generator.generate(sampled, self.noise_rng)
        ratio = self.cfg["fedgen-gen-batch-size"] / self.cfg["batch-size"]
        reg, teacher, latent = client_regulariser(
            model.classifier, logits, for_batch, generated, sampled, self.alpha, self.beta, ratio
        )
        self.term_sums += torch.stack([teacher.detach(), latent.detach()])
        self.term_steps += 1
        return loss + reg

    def local_train(self, model: nn.Module, content: RecordDict) -> dict[str, float]:
        stats = super().local_train(model, content)
        if self.term_steps:
            teacher, latent = (self.term_sums / self.term_steps).tolist()
            stats.update({"fedgen-teacher-loss": teacher, "fedgen-latent-loss": latent})
        return stats

    def extra_records(self, model: nn.Module) -> dict[str, Any]:
        counts = torch.from_numpy(self.data.train_counts.astype(np.int64))
        return {FEDGEN_COUNTS: ArrayRecord({"counts": counts})}
