"""FedAvg client (McMahan et al., AISTATS'17), and the base class of every fedskew trainer.

One `train` message per round: load the global model and evaluate it on the local test split
(`client-global-accuracy`: the "average client test accuracy" of MuPFL's Table II and FedGELA's PA
for a global model), run E local epochs of SGD, evaluate the client's personalized model on the same
split (`personal-accuracy`; FedAvg's is its locally trained model, "FedAvg-FT" in reports), and
reply with the model, the sample count and metrics. Subclasses override only the hooks that differ (FL-bench style):

    build_model      the network (default: `model` from the run config)
    load_global      how the downloaded arrays enter the model
    loss             the local objective on one mini-batch (default: cross-entropy)
    optimizer        the local optimiser (default: `sgd` from the run config, fresh each round)
    local_train      the whole local procedure (default: `train_epochs` on `loss`)
    received_global_model  the global model as received, for `client-global-accuracy` (default: the
                       model right after `load_global`)
    personalized_model  what "personalized accuracy" measures (default: the trained model)
    upload           the ArrayRecord sent back (default: the whole state dict)
    extra_records    more records in the reply (prototypes, counts, gradients ...)
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from flwr.app import ArrayRecord, MetricRecord, RecordDict
from torch import nn

from fedskew.client_app.state import ClientState
from fedskew.data.clients import ClientData
from fedskew.models import SplitNet, build_model
from fedskew.training import cross_entropy_loss, evaluate, sgd, train_epochs


def checked_arrays(
    content: RecordDict, expected: dict[str, torch.Tensor], key: str = "arrays"
) -> dict[str, torch.Tensor]:
    """The server's arrays as tensors, after checking names, shapes, dtypes and finiteness against
    `expected`; raises ValueError naming the first problem (the server logs it as this node's failure)."""
    record = content.get(key)
    if not isinstance(record, ArrayRecord):
        raise ValueError(f"server message lacks the {key!r} ArrayRecord")
    arrays = record.to_torch_state_dict()
    if list(arrays) != list(expected):
        missing, extra = set(expected) - set(arrays), set(arrays) - set(expected)
        raise ValueError(
            f"server arrays differ from the model: missing {sorted(missing)[:3]}, extra {sorted(extra)[:3]}"
        )
    for name, t in arrays.items():
        want = expected[name]
        if t.shape != want.shape or t.dtype != want.dtype:
            raise ValueError(
                f"server array {name!r} is {t.dtype}{list(t.shape)}, expected {want.dtype}{list(want.shape)}"
            )
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise ValueError(f"server array {name!r} holds NaN or inf")
    return arrays


@dataclass
class TrainerContext:
    """Everything a trainer needs for one round on one client."""

    cfg: dict[str, Any]
    data: ClientData
    device: torch.device
    state: ClientState
    partition_id: int
    server_round: int
    generator: torch.Generator


class FedAvgTrainer:
    """Trains the global model with cross-entropy; the personalized model is the trained model."""

    def __init__(self, ctx: TrainerContext) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.data = ctx.data
        self.device = ctx.device

    # ------------------------------------------------------------------ hooks
    def build_model(self) -> SplitNet:
        return build_model(self.cfg["model"], self.cfg["dataset"]).to(self.device)

    def load_global(self, model: nn.Module, content: RecordDict) -> None:
        model.load_state_dict(checked_arrays(content, model.state_dict()), strict=True)

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return cross_entropy_loss(model, x, y)

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return sgd(model.parameters(), self.cfg)

    def local_train(self, model: nn.Module, content: RecordDict) -> dict[str, float]:
        return train_epochs(
            model,
            self.data.x_train,
            self.data.y_train,
            self.loss,
            self.optimizer(model),
            self.cfg["local-epochs"],
            self.cfg["batch-size"],
            self.ctx.generator,
            self.device,
        )

    def received_global_model(self, model: nn.Module) -> nn.Module:
        """The global model as the server sent it, called right after `load_global`."""
        return model

    def personalized_model(self, model: nn.Module) -> nn.Module:
        return model

    def upload(self, model: nn.Module) -> ArrayRecord:
        return ArrayRecord(model.state_dict())

    def extra_records(self, model: nn.Module) -> dict[str, Any]:
        return {}

    # ------------------------------------------------------------------ the round
    def evaluate_local(self, model: nn.Module) -> tuple[float, float]:
        """(loss, accuracy) of `model` on this client's local test split (NaN when it is empty)."""
        return evaluate(model, self.data.x_test, self.data.y_test, self.cfg["eval-batch-size"], self.device)

    def fit(self, content: RecordDict) -> RecordDict:
        """One round: returns the reply content (arrays, metrics and any extra records)."""
        t0 = time.perf_counter()
        model = self.build_model()
        self.load_global(model, content)
        g_loss, g_acc = self.evaluate_local(self.received_global_model(model))
        stats = self.local_train(model, content)
        train_seconds = time.perf_counter() - t0
        p_loss, p_acc = self.evaluate_local(self.personalized_model(model))
        metrics = {
            "num-examples": len(self.data.y_train),
            "partition-id": self.ctx.partition_id,
            "personal-num-test": len(self.data.y_test),
            "train-seconds": train_seconds,
            **stats,
        }
        if len(self.data.y_test):
            metrics.update(
                {
                    "personal-accuracy": p_acc,
                    "personal-loss": p_loss,
                    "client-global-accuracy": g_acc,
                    "client-global-loss": g_loss,
                }
            )
        return RecordDict({"arrays": self.upload(model), "metrics": MetricRecord(metrics), **self.extra_records(model)})
