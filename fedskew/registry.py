"""The methods: each name maps to its server strategy, its client trainer and its own run-config keys.

Adding a method means one strategy module (`strategies/<name>.py`), one trainer module
(`client_app/<name>.py`) and one line here. The classes are imported lazily by dotted path so
that the config validator can list methods without importing torch code.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from fedskew.config import Param


@dataclass(frozen=True)
class MethodSpec:
    """A registered method: where its strategy and trainer live, and its own config keys."""

    name: str
    strategy: str  # "module:Class"
    trainer: str  # "module:Class"
    params: dict[str, Param] = field(default_factory=dict)

    def strategy_class(self) -> Any:
        return _load(self.strategy)

    def trainer_class(self) -> Any:
        return _load(self.trainer)


def _load(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def _m(name: str, strategy: str, trainer: str, **params: Param) -> MethodSpec:
    keys = {f"{name}-{k.replace('_', '-')}": p for k, p in params.items()}
    return MethodSpec(name, f"fedskew.strategies.{strategy}", f"fedskew.client_app.{trainer}", keys)


METHODS: dict[str, MethodSpec] = {
    spec.name: spec
    for spec in (
        _m("fedavg", "fedavg:FedAvgStrategy", "fedavg:FedAvgTrainer"),
        _m(
            "fedprox",
            "fedprox:FedProxStrategy",
            "fedprox:FedProxTrainer",
            mu=Param(float, 0.01, "FedProx proximal weight: loss + mu/2 ||w - w_global||^2", low=0.0),
        ),
        _m(
            "fedrs",
            "fedrs:FedRSStrategy",
            "fedrs:FedRSTrainer",
            alpha=Param(float, 0.5, "FedRS: scale of missing classes' logits", low=0.0, high=1.0),
            scale=Param(
                str, "binary", "FedRS: 'binary' (paper) or 'count' (authors' code)", choices=("binary", "count")
            ),
            tau=Param(int, 1, "FedRS: a class is observed when the client has >= tau samples", low=1),
        ),
        _m(
            "map",
            "map:MAPStrategy",
            "map:MAPTrainer",
            alpha=Param(
                float, 0.5, "MAP stage 1: restricted-softmax scale of missing classes' logits", low=0.0, high=1.0
            ),
            scale=Param(str, "binary", "MAP: RS rule, 'binary' (paper) or 'count'", choices=("binary", "count")),
            tau=Param(int, 1, "MAP: a class is observed when the client has >= tau samples", low=1),
            transfer=Param(str, "distill", "MAP stage 2: HPM transfer term (Eq. 11 / 12)", choices=("distill", "mmd")),
            transfer_weight=Param(float, 0.1, "MAP: lambda in (1-lambda) CE + lambda L_tr (Eq. 13)", low=0.0, high=1.0),
            temperature=Param(float, 4.0, "MAP: distillation temperature tau", low=0.0, low_open=True),
            soften_student=Param(bool, True, "MAP: divide the student's logits by tau too (paper; false = code)"),
            personal_epochs=Param(int, 1, "MAP: stage-2 (personalization) epochs", low=0),
            personal_lr_factor=Param(float, 1.0, "MAP: stage-2 lr = lr * factor (code: 0.2)", low=0.0, low_open=True),
            mu_bar=Param(float, 0.9, "MAP: macro momentum; mu = mu_bar (n-1) / (Q T)", low=0.0),
            mu_max=Param(float, 1.0, "MAP: upper clip of the HPM momentum (paper 1.0, code 0.9)", low=0.0, high=1.0),
            mmd_kernels=Param(int, 5, "MAP: number of Gaussian kernels of the MMD", low=1),
            mmd_kernel_mul=Param(float, 2.0, "MAP: bandwidth ratio between MMD kernels", low=1.0, low_open=True),
            uniform_aggregation=Param(
                bool, True, "MAP: average uploads uniformly (Alg. 1); false = aggregation-weights"
            ),
        ),
    )
}


def get_method(name: str) -> MethodSpec:
    """The registered method `name`; raises KeyError listing the known ones."""
    try:
        return METHODS[name]
    except KeyError:
        raise KeyError(f"unknown method {name!r}: known are {', '.join(sorted(METHODS))}") from None
