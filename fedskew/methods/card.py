"""A method's card (`MethodSpec`): where its strategy and trainer live, its run-config keys, its wire
and its paper. Each method's module in `fedskew/methods/` holds one, and `fedskew/registry.py`
collects them. Cards import no torch: the config validator reads them all; the classes are imported
by dotted path when asked.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from fedskew.data import DATASET_INFO
from fedskew.schema import Param, parse_class_list
from fedskew.wire import BASE, Wire


@dataclass(frozen=True)
class MethodSpec:
    """A registered method: its name, its strategy and trainer ("module:Class"), its own config keys
    (each prefixed by its name), its paper (what `fedskew config` lists beside the name), its
    `revision` and its records beyond the model arrays (`wire`, the one declaration both its strategy
    and its trainer read: `fedskew.registry.DeclaredWire`)."""

    name: str
    strategy: str
    trainer: str
    params: dict[str, Param] = field(default_factory=dict)
    paper: str = ""
    # raised when the method's arithmetic changes under the same config (a fix), so that results of
    # the earlier code no longer share a hash with the new ones (`fedskew.reports.resultfile.config_sha256`)
    revision: int = 0
    wire: Wire = BASE
    # its strategy and trainer treat the classifier as any other layer (no class vectors read, no logit
    # arithmetic), so `classifier-bias` may give it a bias (`fedskew.config.classifier_bias_rule`)
    any_classifier: bool = False

    def __post_init__(self) -> None:
        if bad := [k for k in self.params if not k.startswith(f"{self.name}-")]:
            raise ValueError(f"method {self.name!r}: keys {bad} do not start with '{self.name}-'")

    def strategy_class(self) -> Any:
        return load(self.strategy)

    def trainer_class(self) -> Any:
        return load(self.trainer)

    def resume_note(self, cfg: dict[str, Any]) -> str:
        """'' when a resumed simulation of this method under the validated `cfg` equals the
        uninterrupted run, else why not: its clients keep state across rounds
        (`BaseTrainer.kept_state`) that a resumed run, a new Flower run whose clients start empty,
        does not have."""
        if kept := self.trainer_class().kept_state(cfg):
            return f"{self.name}'s clients keep {kept} across rounds, which a resumed simulation starts without"
        return ""


def load(path: str) -> Any:
    """The attribute a "module:attribute" path names."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def class_list_rule(text: str, cfg: dict[str, Any]) -> None:
    """A `Param.rule`: `text` is a class list of the configured data set (for an `hf:` data set,
    whose classes are known only from the data, the ids are checked when the strategy starts)."""
    info = DATASET_INFO.get(cfg["dataset"])
    parse_class_list(text, info.num_classes if info else 2**31)
