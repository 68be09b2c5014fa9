"""MOON client (Li, He & Song, "Model-Contrastive Federated Learning", CVPR'21, Alg. 1): local
training on ``CE + mu * l_con`` (Eq. 3), the model-contrastive loss of `fedskew/losses/moon.py`
pulling the representation z of the model being trained towards the received global model's
(positive) and away from this client's previous local model's (negative). Server: FedAvg
(`fedskew/strategies/moon.py` adds only the metrics). Authors' code read: QinbinLi/MOON at 8fcba3c.

Decisions:
- Where z is taken: the paper's network has a base encoder, a two-layer projection head (out_dim 256
  in the code) and the output layer on top of the projection. The papers that compare against MOON
  here run every method on the same network (FedMR Sec. 4.1, FedGELA Sec. 5), and fedskew's
  networks are `features` + a bias-free linear `classifier`, so z = `features(x)`, the classifier's
  input: the authors' own `use_project_head=0` path (`ModelFedCon_noheader`, which contrasts h).
- Defaults: tau = 0.5 (paper Sec. 4.1 and code); mu = 1 (the code's default; the paper tunes mu in
  {0.1, 1, 5, 10} and reports 5 for CIFAR-10, 1 for CIFAR-100 and Tiny-ImageNet).
- The global model and the previous model are frozen and in eval mode, as in the code; the
  cross-entropy and z come from the model being trained (train mode).
- The previous local model is client state (`ClientState`, tensors "moon-previous", one model
  state dict; the code's `model_buffer_size` = 1). A client with none (first participation, or a lost
  state, logged) trains without the negative; its l_con is then 0 (see the loss module), which is
  what the code does in round 1, when its pool is empty. Deviation: after round 1 the code's pool holds
  a model for *every* party, so a party sampled for the first time later (partial participation)
  contrasts against its never-trained random initialisation; here it has no negative.
- Retries and resume: the model of round t must not become round t's own negative when the round is
  sent again (a retry, or a resumed run repeating it), so the state keeps the two latest local models
  with their rounds ("moon-previous" and "moon-before", values "moon") and round t uses the latest one
  trained before t.
- Written once (`forward_loss`), so the batched engine stacks a round's clients: the global and
  previous models' weights are each client's extras (`frozen_extras`) and z_glob, z_prev their
  forwards on the batch (`frozen_features` in `forward_loss`). Per client, a client without a
  previous model runs neither (plain CE); stacked, its extras hold the global model as a stand-in
  negative and a flag 0 that zeroes its term. Both engines read the previous model in `load_global`
  and keep the trained one in `after_steps`.
"""

from __future__ import annotations

import copy
import logging

import torch
from flwr.app import RecordDict
from torch import nn

from fedskew.client_app.base import BaseTrainer, Forward, Tensors, frozen, frozen_extras, frozen_features
from fedskew.losses.moon import model_contrastive_loss
from fedskew.records import Number

log = logging.getLogger("fedskew.client")

SLOTS = ("moon-previous", "moon-before")  # the latest local model, the one before it
ROUNDS = "moon"  # values: {slot: round it was trained in}
GLOBAL, PREVIOUS = "global.", "previous."  # the extras' prefixes of the two frozen models' tensors


class MOONTrainer(BaseTrainer):
    """Cross-entropy plus the model-contrastive term against the global and previous models."""

    batched = True
    keeps_state = "the previous local model"
    kept_arrays = ("model", "model")  # the latest local model and the one before

    # ------------------------------------------------------------------ state
    def stored_models(self, reference: nn.Module) -> list[tuple[int, dict[str, torch.Tensor]]]:
        """(round, state dict) of the stored local models, newest first; a round outside [1,
        num-server-rounds] loses the whole record (`ClientState.load_values`), tensors that do not fit
        `reference` lose their entry."""
        last = Number(int, 1, self.cfg["num-server-rounds"])
        rounds = self.ctx.state.load_values(ROUNDS, dict.fromkeys(SLOTS, last)) or {}
        ref = reference.state_dict()
        out = []
        for slot in SLOTS:
            r = rounds.get(slot)
            tensors = None if r is None else self.ctx.state.load_tensors(slot)
            if tensors is None:  # an unused slot (the values name the live ones), or a lost state
                continue
            fits = list(tensors) == list(ref) and all(tensors[k].shape == ref[k].shape for k in ref)
            if not fits:
                log.warning("partition %d: MOON state %r inconsistent: discarded", self.ctx.partition_id, slot)
                continue
            out.append((r, tensors))
        return sorted(out, key=lambda e: -e[0])

    def previous_model(self, reference: nn.Module) -> dict[str, torch.Tensor] | None:
        """The state dict of this client's local model of its latest participation before this round
        (on the device), or None."""
        earlier = [sd for r, sd in self.stored_models(reference) if r < self.ctx.server_round]
        if not earlier:
            log.info(
                "partition %d, round %d: no previous local model (first participation or lost state): no negative",
                self.ctx.partition_id,
                self.ctx.server_round,
            )
            return None
        model = self.build_model()
        model.load_state_dict(earlier[0])
        return model.state_dict()

    def save_model(self, model: nn.Module) -> None:
        """Keep this round's local model and the latest one from an earlier round."""
        t = self.ctx.server_round
        keep = [e for e in self.stored_models(model) if e[0] < t][:1]
        entries = [(t, model.state_dict()), *keep]
        for slot, (_, sd) in zip(SLOTS, entries, strict=False):
            self.ctx.state.save_tensors(slot, sd)
        self.ctx.state.save_values(ROUNDS, {slot: r for slot, (r, _) in zip(SLOTS, entries, strict=False)})

    # ------------------------------------------------------------------ hooks
    def load_global(self, model: nn.Module, content: RecordDict) -> None:
        super().load_global(model, content)
        self.global_model = frozen(copy.deepcopy(model))
        self.previous = self.previous_model(model)
        self.global_extras = frozen_extras(GLOBAL, self.global_model)

    def batch_extras(self) -> dict[str, torch.Tensor]:
        """The global model's tensors, the previous model's (the global one's without one) and the
        flag "negative" (1: a previous model; 0: none, the term off)."""
        negative = self.previous is not None
        own = self.global_model.state_dict() if self.previous is None else self.previous
        previous = {PREVIOUS + k: t for k, t in own.items()}
        flag = torch.tensor(float(negative), dtype=self.dtype, device=self.device)
        return {**self.global_extras, **previous, "negative": flag}

    def forward_loss(
        self, data: torch.Tensor, fwd: Forward, y: torch.Tensor, weight: torch.Tensor | None, extras: Tensors
    ) -> tuple[torch.Tensor, Tensors]:
        """CE + mu l_con (Eq. 3), z_glob and z_prev the frozen global and previous models' features of
        the batch (`frozen_features`), l_con reported as "con"; CE alone without a previous model (per
        client: as it is, neither model run; stacked: l_con times the flag 0)."""
        if weight is None and self.previous is None:
            return data, {}
        net = self.global_model  # the frozen network both run in
        z_global, z_previous = (frozen_features(net, prefix, fwd.x, extras) for prefix in (GLOBAL, PREVIOUS))
        con = model_contrastive_loss(fwd.z, z_global, z_previous, self.cfg["moon-temperature"], weight)
        if weight is not None:
            con = extras["negative"] * con
        return data + self.cfg["moon-mu"] * con, {"con": con}

    def after_steps(self, model: nn.Module, stats: dict[str, float]) -> dict[str, float]:
        """Keep the trained model (the next participation's negative) and report l_con's mean."""
        stats = super().after_steps(model, stats)
        self.save_model(model)
        negative = self.previous is not None
        return {
            **stats,
            "moon-loss": self.reported_sum("con") / max(stats["train-steps"], 1) if negative else 0.0,
            "moon-negative": int(negative),
        }
