"""MuPFL client (Zhang et al., "Multi-level Personalized FL", Alg. 1 CLIENTUPDATE): PKCF classifier fine-tune, BAVD
local training, per-class classifier gradients. Maths: `fedskew/losses/mupfl.py`; server:
`fedskew/strategies/mupfl.py`; decisions and their sources: `docs/notes/mupfl.md`.

One round on client i:
1. load the start model the server sent: w_glo (`mupfl-init="global"`, evaluated on the local test
   split as every method's `client-global-accuracy`), its personalized model w~_i ("personal"), or
   w~_i's feature extractor with the global classifier ("cluster"); under both its accuracy is
   `start-accuracy` and the server also sends w_glo, `mupfl-global`, for `client-global-accuracy`;
2. PKCF (`mupfl-pkcf`): when the server sent synthetic features, fine-tune the classifier only on
   them for `mupfl-tau` epochs (Eq. 21, plain SGD with `lr`, batch `mupfl-feature-batch`), and
   evaluate the result (`pkcf-accuracy`: under "cluster", the paper's personalized model);
3. local training of the whole model with BAVD layers (`mupfl-bavd`, the mask reading
   `mupfl-bavd-mask` at `mupfl-bavd-site`) whose maps are updated after every batch with psi = loss
   improvement (Eq. 6), reporting the fractions of positions and of activation mass the masks
   zeroed (`bavd-dropped-positions`, `bavd-dropped-mass`); the optimiser is the common `sgd`;
4. upload the model, the flattened BAVD maps (`mupfl-map`, for ACMU) and, for each class present
   locally, the classifier gradient z_i^k on <= `mupfl-n-real` samples in eval mode (`mupfl-grads`):
   features of the trained extractor u_i (Alg. 1 L19-20: after local training), gradient taken at
   the classifier the server sent (`mupfl-classifier`, w_glo's of the previous round), the one the
   server matches the synthetic gradients at (CReFF: real and synthetic gradients at one classifier),
   with the mean norm of the real features they were taken on (`mupfl-times` "real-norm").

Client state (`ClientState`): with `mupfl-bavd-reset="never"` the BAVD maps persist across rounds
(tensors "mupfl-maps"); with the default "epoch" (literal Eq. 6) or "round" they restart each round,
so nothing is kept. The previous and personalized models live on the server (the ACMU update w~_i, Eq. 14, needs
every cluster member's update, which only the server has).

The batched engine stacks step 3; steps 1-2 run in `begin` and step 4 in `extra_records`, per client
on both paths, so the client's generator is drawn in one order: PKCF's batches, the local steps', the
real samples of the gradients. In the stacked step BAVD is `bavd_pass` at the same sites of a network
without layers of its own (`bavd_hooks`), and each layer's map M, whether it has one, its dropped
fractions, the previous loss and the iteration are a state carried from step to step among the
extras (`batch_extras`, `fold`): the step's weighted batch mean h_bar (padding weighted 0), psi from
the step's own loss, M <- h_bar where the iteration restarts the map (`mupfl-bavd-reset`) or there is
none, else M + psi h_bar; a map-based reading's mask reads a zero map while there is none, which
keeps every position, and counts no dropped fraction then. The engine leaves the last state in
`carried`, which `after_steps` puts into the BAVD layers; `bavd-seconds` is 0 there (BAVD runs inside
the stacked step).
"""

from __future__ import annotations

import functools
import math
import time
from typing import Any

import torch
from flwr.app import ArrayRecord, MetricRecord, RecordDict
from torch import nn

from fedskew.client_app.base import BaseTrainer, Started
from fedskew.data import dataset_info
from fedskew.losses.mupfl import (
    BAVD,
    MAP_READINGS,
    attach_bavd,
    bavd_fold,
    bavd_hooks,
    bavd_pass,
    bavd_shapes,
    class_gradients,
    finetune_classifier,
    flat_maps,
    loss_change,
)
from fedskew.methods.mupfl import MUPFL_CLASSIFIER as CLASSIFIER
from fedskew.methods.mupfl import MUPFL_FEATURES as FEATURES
from fedskew.methods.mupfl import MUPFL_GLOBAL as GLOBAL
from fedskew.methods.mupfl import MUPFL_GRADS as GRADS
from fedskew.methods.mupfl import MUPFL_MAPS as MAPS
from fedskew.methods.mupfl import MUPFL_TIMES as TIMES
from fedskew.models import SplitNet, build_model
from fedskew.records import Rejected
from fedskew.training import cross_entropy_loss

CARRIED = "mupfl-bavd-"  # the prefix of the BAVD state the batched engine carries among the extras


class MuPFLTrainer(BaseTrainer):
    """FedAvg's round with MuPFL's classifier fine-tune, BAVD training and gradient upload."""

    batched = True
    keeps_state = "the BAVD activation map"

    @classmethod
    def kept_state(cls, cfg: dict[str, Any]) -> str:
        """The activation map, kept only when BAVD never resets it."""
        return cls.keeps_state if cfg["mupfl-bavd"] and cfg["mupfl-bavd-reset"] == "never" else ""

    def build_model(self) -> SplitNet:
        model = super().build_model()
        cfg = self.cfg
        make = functools.partial(
            BAVD, rescale=cfg["mupfl-bavd-rescale"], reading=cfg["mupfl-bavd-mask"], top=cfg["mupfl-bavd-top"]
        )
        self.bavd: list[BAVD] = attach_bavd(model, make, cfg["mupfl-bavd-site"]) if cfg["mupfl-bavd"] else []
        return model

    def load_global(self, model: nn.Module, content: RecordDict) -> None:
        super().load_global(model, content)
        if self.cfg["mupfl-bavd-reset"] == "never" and self.bavd:
            saved = self.ctx.state.load_tensors("mupfl-maps") or {}
            for i, layer in enumerate(self.bavd):
                if f"{i}" in saved:
                    layer.map = saved[f"{i}"].to(self.device)

    def begin(self, content: RecordDict) -> Started:
        """The base's start, then what precedes the local steps (`before_steps`)."""
        started = super().begin(content)
        self.early = self.before_steps(started.model)
        return started

    def before_steps(self, model: nn.Module) -> dict[str, float]:
        """Steps 1-2 of the round on the loaded model: `start-accuracy`, PKCF and its metrics."""
        stats: dict[str, float] = {}
        if self.cfg["mupfl-pkcf"]:
            self.match_weight = self.received[CLASSIFIER]["weight"].to(self.device)
        if self.cfg["mupfl-init"] != "global" and len(self.data.y_test):
            _, stats["start-accuracy"] = self.evaluate_local(model)
        if self.cfg["mupfl-pkcf"] and FEATURES in self.received:
            t0 = time.perf_counter()
            feats = self.received[FEATURES]
            if len(feats["features"]) != len(feats["labels"]):
                n, m = len(feats["features"]), len(feats["labels"])
                raise Rejected(f"server {FEATURES!r} holds {n} features but {m} labels")
            loss = finetune_classifier(
                model.classifier,
                feats["features"].to(self.device),
                feats["labels"].to(self.device),
                self.cfg["mupfl-tau"],
                self.cfg["mupfl-feature-batch"],
                self.cfg["lr"],
                self.ctx.generator,
            )
            if math.isfinite(loss):  # NaN: nothing was trained (tau = 0), no loss to report
                stats["finetune-loss"] = loss
            stats["pkcf-client-seconds"] = time.perf_counter() - t0
            if len(self.data.y_test):  # the start model after the fine-tune, before local training
                _, stats["pkcf-accuracy"] = self.evaluate_local(model)
        self._iteration, self._prev_loss = 0, None
        self._per_epoch = max(1, math.ceil(len(self.data.y_train) / self.cfg["batch-size"]))
        return stats

    def after_steps(self, model: nn.Module, stats: dict[str, float]) -> dict[str, float]:
        """The round's metrics: `before_steps`'s, the steps', and what the BAVD masks zeroed (from the
        engine's carried state where it stacked the steps)."""
        if self.carried:
            self.keep_carried()
        stats = {**self.early, **stats}
        if self.bavd:
            stats["bavd-seconds"] = sum(layer.seconds for layer in self.bavd)
            dropped = [d for d in (layer.dropped() for layer in self.bavd) if d is not None]
            if dropped:  # the mean over the BAVD layers of what their masks zeroed this round
                stats["bavd-dropped-positions"] = sum(d[0] for d in dropped) / len(dropped)
                stats["bavd-dropped-mass"] = sum(d[1] for d in dropped) / len(dropped)
        return stats

    def received_global_model(self, model: nn.Module) -> nn.Module:
        """w_glo: the received model, or under init 'personal' / 'cluster' the `mupfl-global` the server
        sent beside the client's own start (in a model without BAVD layers: they are the identity at
        evaluation)."""
        if self.cfg["mupfl-init"] == "global":
            return model
        glo = super().build_model()
        glo.load_state_dict(self.received[GLOBAL])
        return glo

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Cross-entropy; then fold this batch's activations into the BAVD maps (Eq. 6)."""
        loss = cross_entropy_loss(model, x, y)
        if self.bavd:
            reset = self.cfg["mupfl-bavd-reset"]
            lam = self._iteration % self._per_epoch if reset == "epoch" else self._iteration
            if reset == "never" and self._iteration == 0 and self.bavd[0].map is not None:
                lam = 1  # a persisted map keeps accumulating (psi = 0 for the round's first batch)
            value = float(loss.detach())
            prev = None if lam == 0 else self._prev_loss
            psi = loss_change(prev, value, self.cfg["mupfl-psi-sign"])
            for layer in self.bavd:
                layer.update(lam, psi)
            self._prev_loss = value
        self._iteration += 1
        return loss

    # ------------------------------------------------------------------ the batched engine's BAVD
    @functools.cached_property
    def network(self) -> SplitNet:
        """The network without BAVD layers, on the meta device: the stacked step's template, BAVD at
        its sites by `bavd_hooks`."""
        with torch.device("meta"):
            return build_model(self.cfg["model"], dataset_info(self.cfg)).to(dtype=self.dtype).train()

    def batch_extras(self) -> dict[str, torch.Tensor]:
        """The BAVD state at the start of the steps, carried by the engine (`fold`): per layer j its
        map (zeros where it has none), whether it has one, the summed dropped fractions and the
        masked passes; the iteration, the previous loss, and the steps of an epoch."""
        if not self.bavd:
            return {}

        def scalar(value: Any, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.tensor(value, dtype=dtype, device=self.device)

        shapes = bavd_shapes(self.network, dataset_info(self.cfg), self.cfg["mupfl-bavd-site"])
        extras = {f"{CARRIED}per-epoch": scalar(self._per_epoch), f"{CARRIED}iteration": scalar(0)}
        extras[f"{CARRIED}prev-loss"] = scalar(0.0, self.dtype)
        for j, (layer, shape) in enumerate(zip(self.bavd, shapes, strict=True)):
            has = layer.map is not None
            start = layer.map if has else torch.zeros(shape, dtype=self.dtype, device=self.device)
            extras[f"{CARRIED}map-{j}"] = start.to(self.device, self.dtype)
            extras[f"{CARRIED}has-map-{j}"] = scalar(has, torch.bool)
            extras[f"{CARRIED}dropped-{j}"] = torch.zeros(2, device=self.device)
            extras[f"{CARRIED}masked-{j}"] = scalar(0)
        return extras

    def functional_loss(
        self,
        model: nn.Module,
        params: dict[str, torch.Tensor],
        buffers: dict[str, torch.Tensor],
        x: torch.Tensor,
        y: torch.Tensor,
        weight: torch.Tensor,
        extras: dict[str, torch.Tensor],
    ) -> Any:
        """The cross-entropy through `network` with each BAVD site masked by `bavd_pass` from the
        carried map, and the carried state after this batch (`fold`)."""
        if not self.bavd:
            return super().functional_loss(model, params, buffers, x, y, weight, extras)
        cfg = self.cfg
        passes: list[tuple[torch.Tensor, torch.Tensor]] = []

        def bavd(j: int, h: torch.Tensor) -> torch.Tensor:
            reading, top, rescale = cfg["mupfl-bavd-mask"], cfg["mupfl-bavd-top"], cfg["mupfl-bavd-rescale"]
            out, h_bar, frac = bavd_pass(h, extras[f"{CARRIED}map-{j}"], reading, top, rescale, weight)
            passes.append((h_bar, frac))
            return out

        with bavd_hooks(self.network, cfg["mupfl-bavd-site"], bavd):
            loss = super().functional_loss(self.network, params, buffers, x, y, weight, extras)
        return loss, loss, {}, self.fold(extras, loss.detach(), passes)

    def fold(
        self, extras: dict[str, torch.Tensor], value: torch.Tensor, passes: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> dict[str, torch.Tensor]:
        """The carried BAVD state after a step of loss `value` whose layer j saw (h_bar, dropped
        fractions) `passes[j]`: `loss`'s update in tensor form (no host synchronisation)."""
        if len(passes) != len(self.bavd):
            raise RuntimeError(f"{len(passes)} BAVD passes in a step of {len(self.bavd)} layers")
        it, reset = extras[f"{CARRIED}iteration"], self.cfg["mupfl-bavd-reset"]
        if reset == "epoch":
            fresh = it % extras[f"{CARRIED}per-epoch"] == 0
        elif reset == "round":
            fresh = it == 0
        else:  # a persisted map keeps accumulating
            fresh = (it == 0) & ~extras[f"{CARRIED}has-map-0"]
        change = loss_change(extras[f"{CARRIED}prev-loss"], value, self.cfg["mupfl-psi-sign"])
        psi = torch.where(it == 0, torch.zeros_like(change), change)  # no previous loss yet
        out = {f"{CARRIED}iteration": it + 1, f"{CARRIED}prev-loss": value}
        for j, (h_bar, frac) in enumerate(passes):
            has = extras[f"{CARRIED}has-map-{j}"]
            counted = has if self.cfg["mupfl-bavd-mask"] in MAP_READINGS else torch.ones_like(has)
            out[f"{CARRIED}map-{j}"] = bavd_fold(extras[f"{CARRIED}map-{j}"], h_bar, fresh | ~has, psi)
            out[f"{CARRIED}has-map-{j}"] = torch.ones_like(has)
            dropped = extras[f"{CARRIED}dropped-{j}"]
            out[f"{CARRIED}dropped-{j}"] = torch.where(counted, dropped + frac, dropped)
            out[f"{CARRIED}masked-{j}"] = extras[f"{CARRIED}masked-{j}"] + counted.long()
        return out

    def keep_carried(self) -> None:
        """The engine's last carried BAVD state into the BAVD layers, as the per-client steps leave them."""
        for j, layer in enumerate(self.bavd):
            layer.map = self.carried[f"{CARRIED}map-{j}"] if bool(self.carried[f"{CARRIED}has-map-{j}"]) else None
            layer.masked = int(self.carried[f"{CARRIED}masked-{j}"])
            layer.dropped_sum = self.carried[f"{CARRIED}dropped-{j}"] if layer.masked else None

    def class_gradients(self, model: SplitNet) -> tuple[dict[str, torch.Tensor], float]:
        """z_i^k (Eq. 16) for every class present locally, on <= n-real random samples of the trained
        extractor's features (eval mode), at the classifier the server sent; and the mean norm of
        those real features (what the synthetic features are compared with)."""
        model.eval()
        out, norms = {}, []
        y = self.data.y_train
        for k in torch.unique(y).tolist():
            idx = torch.nonzero(y == k).flatten()
            idx = idx[torch.randperm(len(idx), generator=self.ctx.generator)[: self.cfg["mupfl-n-real"]]]
            with torch.no_grad():
                h = model.features(self.data.x_train[idx].to(self.device))
            labels = torch.full((len(idx),), k, dtype=torch.long, device=self.device)
            out[str(k)] = class_gradients(self.match_weight, h, labels)[k].cpu()
            norms.append(h.norm(dim=1))
        return out, float(torch.cat(norms).mean())

    def extra_records(self, model: nn.Module) -> dict[str, Any]:
        records: dict[str, Any] = {}
        if self.bavd:
            if self.cfg["mupfl-bavd-reset"] == "never":
                self.ctx.state.save_tensors(
                    "mupfl-maps", {f"{i}": layer.map for i, layer in enumerate(self.bavd) if layer.map is not None}
                )
            records[MAPS] = ArrayRecord({"map": flat_maps(self.bavd)})
        if self.cfg["mupfl-pkcf"]:
            t0 = time.perf_counter()
            grads, norm = self.class_gradients(model)
            records[GRADS] = ArrayRecord(grads)
            records[TIMES] = MetricRecord({"grads-seconds": time.perf_counter() - t0, "real-norm": norm})
        return records
