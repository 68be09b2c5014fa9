"""FedGen client (Zhu, Hong & Zhou, ICML'21): FedAvg's local training plus the generator's
regulariser; it uploads the model and its label counts. Maths, the authors' code read and the
deviations: `fedskew/losses/fedgen.py`; server: `fedskew/strategies/fedgen.py`.

From round 2 on the server sends its generator G (`fedgen-generator`), which the client runs in
eval mode and never trains. Every mini-batch (x, y) of b examples then adds to the cross-entropy

    (B_g / B) alpha_t CE(W G(eps, y_hat), y_hat) + beta_t KL(softmax(W G(eps', y)) || softmax(f(x)))

with W the model's classifier, B_g = `fedgen-gen-batch-size` labels y_hat drawn uniformly from all
classes (the code's `available_labels`), B the configured `batch-size`, alpha_t = max(1e-4,
`fedgen-alpha` 0.98^(t-1)) and beta_t likewise from `fedgen-beta`. Round 1 (no generator yet) is
FedAvg. Each step draws, in this order, eps' (b x noise), y_hat and eps (B_g x noise) from the
client's own generator, seeded by (seed, partition, round), so the mini-batch order is FedAvg's.
The reply adds `fedgen-counts`, the training set's label counts, and the terms' means over the
steps (`fedgen-teacher-loss`, `fedgen-latent-loss`). No client state.

Both engines run it through the base's hooks: a step's draws are its `step_extras` (the per-client
loss draws them at the step, the batched engine all the steps' before training, padded to B rows
for a short batch); G's tensors and (B_g / B) alpha_t, beta_t are the client's extras (runs stacked
together may be at other rounds, with other generators), G running on them (`functional_call`,
under vmap each client's own: eval mode, its BatchNorm a pure function of its running statistics);
the objective is `forward_loss` on the default cross-entropy, W G(.) through `Forward.run`, the KL
term weighted per example by the engine's weights (the batch mean per client).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, RecordDict
from torch import nn
from torch.func import functional_call

from fedskew.client_app.base import BaseTrainer, Forward, Tensors, frozen_extras, frozen_state
from fedskew.losses.fedgen import Generator, build_generator, client_regulariser, regulariser_weight, uniform_noise
from fedskew.methods.fedgen import FEDGEN_COUNTS, FEDGEN_GENERATOR

GENERATOR = "fedgen-generator."  # G's tensors among the extras
WEIGHTS = "fedgen-weights"  # ((B_g / B) alpha_t, beta_t)
NOISE, SAMPLED, SAMPLED_NOISE = "fedgen-noise", "fedgen-sampled", "fedgen-sampled-noise"  # a step's draws
TERMS = ("fedgen-teacher-loss", "fedgen-latent-loss")  # each term's sum over the steps, reported


class FedGenTrainer(BaseTrainer):
    """Cross-entropy plus the generator's teacher and latent terms once the server sent G."""

    batched = True

    def load_global(self, model: nn.Module, content: RecordDict) -> None:
        super().load_global(model, content)
        self.generator: Generator | None = None
        self.generator_extras: Tensors = {}
        r, pid = self.ctx.server_round, self.ctx.partition_id
        if FEDGEN_GENERATOR in self.received:
            generator = build_generator(self.cfg, model.num_classes, model.feature_dim)
            generator.load_state_dict(self.received[FEDGEN_GENERATOR])
            self.generator = generator.to(self.device, self.dtype).eval().requires_grad_(False)
            ratio = self.cfg["fedgen-gen-batch-size"] / self.cfg["batch-size"]
            alpha = regulariser_weight(self.cfg["fedgen-alpha"], r)
            beta = regulariser_weight(self.cfg["fedgen-beta"], r)
            weights = torch.tensor([ratio * alpha, beta], dtype=self.dtype, device=self.device)
            self.generator_extras = {**frozen_extras(GENERATOR, self.generator), WEIGHTS: weights}
        seed = np.random.SeedSequence([self.cfg["seed"], pid, r, 2]).generate_state(1)[0]
        self.noise_rng = torch.Generator().manual_seed(int(seed))  # not the mini-batch stream

    def batch_extras(self) -> dict[str, torch.Tensor]:
        """G's tensors and the terms' weights (none in round 1)."""
        return self.generator_extras

    def step_extras(self, sizes: list[int], width: int) -> dict[str, torch.Tensor]:
        """Each step's eps' `[width, noise]` (its b rows, zeros after), y_hat `[B_g]` and eps
        `[B_g, noise]`, drawn on the CPU in that order, step after step, in the compute dtype (none
        without G)."""
        if self.generator is None:
            return {}
        n, dim, k = self.cfg["fedgen-gen-batch-size"], self.generator.noise_dim, self.generator.num_classes
        noise, sampled = torch.zeros(len(sizes), width, dim), torch.empty(len(sizes), n, dtype=torch.long)
        sampled_noise = torch.empty(len(sizes), n, dim)
        for s, b in enumerate(sizes):
            noise[s, :b] = uniform_noise(b, dim, self.noise_rng)
            sampled[s] = torch.randint(k, (n,), generator=self.noise_rng)
            sampled_noise[s] = uniform_noise(n, dim, self.noise_rng)
        return {NOISE: noise.to(self.dtype), SAMPLED: sampled, SAMPLED_NOISE: sampled_noise.to(self.dtype)}

    def forward_loss(
        self, data: torch.Tensor, fwd: Forward, y: torch.Tensor, weight: torch.Tensor | None, extras: Tensors
    ) -> tuple[torch.Tensor, Tensors]:
        """CE plus (B_g / B) alpha_t teacher + beta_t latent (`client_regulariser`), G run on this
        client's tensors and this step's draws; CE alone without G."""
        if self.generator is None:
            return data, {}
        state = frozen_state(GENERATOR, extras)
        with torch.no_grad():
            for_batch = functional_call(self.generator, state, (y, extras[NOISE]))
            generated = functional_call(self.generator, state, (extras[SAMPLED], extras[SAMPLED_NOISE]))
        classifier = functools.partial(fwd.run, "classifier")
        reg, teacher, latent = client_regulariser(
            classifier, fwd.logits, for_batch, generated, extras[SAMPLED], extras[WEIGHTS], weight
        )
        return data + reg, dict(zip(TERMS, (teacher, latent), strict=True))

    def after_steps(self, model: nn.Module, stats: dict[str, float]) -> dict[str, float]:
        """Each term's mean over the steps (with G and at least one step)."""
        if self.generator is None or not stats["train-steps"]:
            return stats
        return {**stats, **{name: float(self.reported[name] / stats["train-steps"]) for name in TERMS}}

    def extra_records(self, model: nn.Module) -> dict[str, Any]:
        counts = torch.from_numpy(self.data.train_counts.astype(np.int64))
        return {FEDGEN_COUNTS: ArrayRecord({"counts": counts})}
