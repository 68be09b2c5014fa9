"""Run-config schema and validation, shared by the CLI, the ServerApp and the ClientApp.

Every key a user can set lives here (common keys) or in the method's registry line
(`fedskew.registry`, keys prefixed by the method name). Validation turns the raw
`context.run_config` (TOML types) into a plain dict of checked, typed values, or raises
`ConfigError` with one line naming the key, the value and what is allowed.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DATASETS = ("fashion-mnist", "mnist", "cifar10", "cifar100", "svhn")
MODELS = ("lenet", "map-lenet", "mupfl-cnn", "mlp", "tfcnn", "vgg11", "resnet8", "resnet18")
PARTITIONS = ("iid", "dirichlet", "classes-per-client", "long-tail", "map-random")


class ConfigError(ValueError):
    """A run-config value is missing, unknown, of the wrong type or out of range."""


@dataclass(frozen=True)
class Param:
    """One run-config key: its type, default, allowed values and a short help text.

    `low`/`high` bound numbers; `low_open`/`high_open` make a bound exclusive.
    """

    kind: type
    default: Any
    help: str
    choices: tuple[Any, ...] | None = None
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def allowed(self) -> str:
        if self.choices is not None:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        if self.low is None and self.high is None:
            return f"a {self.kind.__name__}"
        lo = "-inf" if self.low is None else f"{self.low:g}"
        hi = "inf" if self.high is None else f"{self.high:g}"
        left = "(" if self.low_open or self.low is None else "["
        right = ")" if self.high_open or self.high is None else "]"
        return f"a {self.kind.__name__} in {left}{lo}, {hi}{right}"

    def check(self, key: str, value: Any) -> Any:
        """Return `value` converted to this param's type, or raise `ConfigError`."""
        value = _coerce(key, value, self.kind)
        bad = self.choices is not None and value not in self.choices
        if self.kind in (int, float) and not bad:
            if not math.isfinite(value):
                bad = True
            if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
                bad = True
            if self.high is not None and (value > self.high or (self.high_open and value == self.high)):
                bad = True
        if bad:
            raise ConfigError(f"{key}={value!r} is not allowed: must be {self.allowed()}")
        return value


def _coerce(key: str, value: Any, kind: type) -> Any:
    if kind is bool:
        if isinstance(value, bool):
            return value
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif kind is str:
        if isinstance(value, str):
            return value
    raise ConfigError(
        f"{key}={value!r} has type {type(value).__name__}: must be a {kind.__name__}"
        + (' (quote strings: key="value")' if kind is str else "")
    )


COMMON: dict[str, Param] = {
    "method": Param(str, "fedavg", "the federated method (strategy + client trainer)"),
    "dataset": Param(str, "fashion-mnist", "the data set", choices=DATASETS),
    "data-root": Param(str, "", "folder holding the data files ('' = ./data, then system paths)"),
    "model": Param(str, "lenet", "the network", choices=MODELS),
    "partition": Param(str, "classes-per-client", "how labels are split", choices=PARTITIONS),
    "classes-per-client": Param(int, 2, "classes each client holds (classes-per-client)", low=1),
    "classes-per-client-mode": Param(
        str,
        "pmcn",
        "'pmcn': FedGELA/FedMR PmCn dealing (any m); 'shards': FedRS exact-m shards (m divides C)",
        choices=("pmcn", "shards"),
    ),
    "dirichlet-alpha": Param(float, 0.5, "Dirichlet concentration", low=0.0, low_open=True),
    "min-partition-size": Param(int, 10, "Dirichlet resamples until every client has this many", low=1),
    "imbalance-factor": Param(float, 10.0, "long-tail: largest/smallest class size", low=1.0),
    "map-sigma": Param(float, 0.3, "map-random: log-normal sigma of client sizes", low=0.0),
    "local-test-fraction": Param(
        float, 0.2, "share of each client's data kept as its local test split", low=0.0, high=0.9
    ),
    "num-server-rounds": Param(int, 20, "federated rounds", low=1),
    "fraction-train": Param(float, 0.5, "share of clients sampled each round", low=0.0, high=1.0, low_open=True),
    "local-epochs": Param(int, 1, "local epochs per round", low=1),
    "batch-size": Param(int, 64, "local mini-batch size", low=1),
    "lr": Param(float, 0.01, "local SGD learning rate", low=0.0, low_open=True),
    "lr-warmup-rounds": Param(
        int, 0, "linear lr warm-up: round r trains at lr * min(r / N, 1); 0 = off (MAP/FedRS code: 5)", low=0
    ),
    "lr-decay": Param(
        float,
        1.0,
        "lr decay over rounds: round r trains at lr * lr-decay ** floor((r - 1) / lr-decay-every) (MuPFL: 0.995, 3)",
        low=0.0,
        high=1.0,
        low_open=True,
    ),
    "lr-decay-every": Param(int, 1, "rounds between two lr decay steps", low=1),
    "momentum": Param(float, 0.9, "local SGD momentum", low=0.0, high=1.0, high_open=True),
    "weight-decay": Param(float, 1e-4, "local SGD weight decay", low=0.0),
    "grad-clip": Param(
        float, 0.0, "clip each local step's gradient norm to this (0 = off; MAP/FedRS code: 100)", low=0.0
    ),
    "aggregation-weights": Param(
        str,
        "num-examples",
        "weight client models by sample count or uniformly",
        choices=("num-examples", "uniform"),
    ),
    "seed": Param(int, 0, "seed of every RNG (partition, sampling, init, training)", low=0),
    "eval-every": Param(int, 1, "central evaluation every N rounds (the last round always)", low=1),
    "eval-batch-size": Param(int, 1024, "batch size of evaluation", low=1),
    "device": Param(str, "auto", "'auto' (cuda when present), 'cpu', 'cuda' or 'cuda:N'"),
    "torch-threads": Param(int, 1, "torch CPU threads per ClientApp (0 = torch default)", low=0),
    "min-nodes": Param(int, 1, "the server waits for this many connected nodes before round 1", low=1),
    "round-timeout": Param(float, 600.0, "seconds the server waits for a round's replies", low=0.0, low_open=True),
    "min-replies": Param(int, 1, "usable replies a round needs (else it is retried, then the run stops)", low=1),
    "round-retries": Param(int, 1, "times a round with too few usable replies is sent again", low=0),
    "checkpoint-every": Param(int, 5, "write checkpoint.pt every N rounds (0 = never)", low=0),
    "resume": Param(bool, False, "continue from the run folder's checkpoint.pt (`fedskew run --resume DIR`)"),
    "state-max-mb": Param(float, 64.0, "bound on a client's persistent state kept in context.state", low=0.0),
    "out-dir": Param(str, "outputs", "results folder (made absolute by `fedskew run`)"),
    "run-name": Param(str, "", "results subfolder ('' = method-dataset-partition-seed-time)"),
}


def _device_ok(value: str) -> bool:
    if value in ("auto", "cpu", "cuda"):
        return True
    return value.startswith("cuda:") and value[5:].isdigit()


def validate(raw: Mapping[str, Any]) -> dict[str, Any]:
    """Check a raw run config and return it typed, with defaults for absent keys.

    Raises `ConfigError` (one line) for an unknown key, a wrong type or an out-of-range value.
    """
    from fedskew.registry import METHODS  # late: the registry imports this module

    method = COMMON["method"].check("method", raw.get("method", COMMON["method"].default))
    if method not in METHODS:
        raise ConfigError(f"method={method!r} is not allowed: must be one of " + ", ".join(sorted(METHODS)))
    schema = all_params()
    unknown = [k for k in raw if k not in schema]
    if unknown:
        key = unknown[0]
        hint = difflib.get_close_matches(key, list(schema), n=1)
        raise ConfigError(f"{key}: unknown run-config key" + (f" (did you mean {hint[0]!r}?)" if hint else ""))
    cfg = {key: p.check(key, raw.get(key, p.default)) for key, p in schema.items()}
    _check_cross(cfg)
    return cfg


def all_params() -> dict[str, Param]:
    """Every known key: the common ones plus every registered method's own."""
    from fedskew.registry import METHODS

    schema = dict(COMMON)
    for spec in METHODS.values():
        schema.update(spec.params)
    return schema


def _check_cross(cfg: dict[str, Any]) -> None:
    from fedskew.data import DATASET_INFO

    if not _device_ok(cfg["device"]):
        raise ConfigError(f"device={cfg['device']!r} is not allowed: must be 'auto', 'cpu', 'cuda' or 'cuda:N'")
    num_classes = DATASET_INFO[cfg["dataset"]].num_classes
    m = cfg["classes-per-client"]
    if cfg["partition"] == "classes-per-client" and m > num_classes:
        raise ConfigError(f"classes-per-client={m} is not allowed: {cfg['dataset']} has {num_classes} classes")
    if cfg["partition"] == "classes-per-client" and cfg["classes-per-client-mode"] == "shards" and num_classes % m:
        raise ConfigError(
            f"classes-per-client={m} is not allowed with classes-per-client-mode='shards': "
            f"it must divide the {num_classes} classes (or use mode 'pmcn')"
        )


def to_toml(params: dict[str, Param]) -> str:
    """`key = default  # help` lines for pyproject's [tool.flwr.app.config]."""
    import json

    lines = []
    for key, p in params.items():
        value = ("true" if p.default else "false") if p.kind is bool else json.dumps(p.default)
        if p.kind is float:
            value = repr(float(p.default))
        lines.append(f"{key} = {value}")
    return "\n".join(lines)


def parse_overrides(text: str) -> dict[str, Any]:
    """Parse flwr's `--run-config 'k1=v1 k2="s"'` syntax (TOML values) into a dict."""
    import tomllib

    out: dict[str, Any] = {}
    for item in _split_top(text):
        if "=" not in item:
            raise ConfigError(f'{item!r}: expected key=value (strings in quotes: key="value")')
        key, value = item.split("=", 1)
        key = key.strip()
        try:
            out[key] = tomllib.loads(f"v = {value.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            raise ConfigError(
                f'{key}={value.strip()}: not a TOML value (quote strings: {key}="{value.strip()}")'
            ) from None
    return out


def _split_top(text: str) -> list[str]:
    """Split on whitespace outside quotes and brackets."""
    items, cur, quote, depth = [], "", "", 0
    for ch in text:
        if quote:
            cur += ch
            if ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
            cur += ch
        elif ch in "[{":
            depth += 1
            cur += ch
        elif ch in "]}":
            depth -= 1
            cur += ch
        elif ch.isspace() and depth == 0:
            if cur:
                items.append(cur)
            cur = ""
        else:
            cur += ch
    if cur:
        items.append(cur)
    return items
