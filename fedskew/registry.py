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
            "fedgela",
            "fedgela:FedGELAStrategy",
            "fedgela:FedGELATrainer",
            ew=Param(
                float,
                1e4,
                "FedGELA: classifier length E_W; logits scale sqrt(E_W) (paper: 1e3..1e6)",
                low=0.0,
                low_open=True,
            ),
            mode=Param(
                str,
                "all",
                "FedGELA softmax: 'all' C-way, missing logits 0 (code); 'local' over C_k (Eq. 5)",
                choices=("all", "local"),
            ),
            adapt=Param(bool, True, "FedGELA: local adaptation phi_k (false = FedGE ablation, plain ETF)"),
            etf_seed=Param(int, 0, "FedGELA: seed of the server's random simplex ETF", low=0),
            feature_norm=Param(
                str,
                "l2",
                "FedGELA features: 'l2' (paper) or 'bn' (BatchNorm1d, authors' code) then L2",
                choices=("l2", "bn"),
            ),
            clip=Param(float, 20.0, "FedGELA: local gradient-norm clip (authors' code; 0 = off)", low=0.0),
        ),
    )
}


def get_method(name: str) -> MethodSpec:
    """The registered method `name`; raises KeyError listing the known ones."""
    try:
        return METHODS[name]
    except KeyError:
        raise KeyError(f"unknown method {name!r}: known are {', '.join(sorted(METHODS))}") from None
