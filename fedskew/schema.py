"""The run config's types: a key (`Param`), the error a bad value raises (`ConfigError`) and the one
a run that does not complete raises (`RunFailed`), the integer range a run config carries (`INT64`),
and the parsers of values that several layers read (class lists, partition bindings). It imports
nothing of fedskew, so every module may import it: the config (`fedskew.config`: the common keys and
`validate`), the methods' cards (`fedskew/methods/<name>.py`: each method's keys) and the modules below them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

NODE_ID_MAX = 2**64 - 1  # Flower's node ids are unsigned 64-bit integers


class ConfigError(ValueError):
    """A run-config value is missing, unknown, of the wrong type or out of range."""


class RunFailed(RuntimeError):
    """The federated run did not complete (raised by the launcher and by the batched engine)."""


@dataclass(frozen=True)
class Param:
    """One run-config key: its type, default, allowed values and a short help text.

    `low`/`high` bound numbers; `low_open`/`high_open` make a bound exclusive; `rule(value, cfg)`
    is a further check that may read the other (typed) values and raises ValueError with the reason.
    """

    kind: type
    default: Any
    help: str
    choices: tuple[Any, ...] | None = None
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    rule: Callable[[Any, dict[str, Any]], object] | None = None
    # the default reproduces, to the last digit, runs made before the key existed: a run config with
    # the key at its default hashes as one without it (`fedskew.reports.resultfile.config_sha256`)
    neutral: bool = False

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


INT64 = (-(2**63), 2**63 - 1)  # what a run config can carry (Flower sends integers as sint64)


def _coerce(key: str, value: Any, kind: type) -> Any:
    if kind is bool:
        if isinstance(value, bool):
            return value
    elif kind is int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            if not INT64[0] <= value <= INT64[1]:
                raise ConfigError(f"{key}={value!r} is not allowed: must be a 64-bit integer")
            return value
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


def parse_class_list(text: str, num_classes: int) -> list[int]:
    """`"3,7"` -> [3, 7]; `"all"` -> every class; `""` -> none. Raises ValueError when invalid."""
    text = text.strip()
    if not text:
        return []
    if text == "all":
        return list(range(num_classes))
    try:
        out = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        raise ValueError(f"class list {text!r}: expected comma-separated class ids or 'all'") from None
    bad = [c for c in out if not 0 <= c < num_classes]
    if bad:
        raise ValueError(f"class list {text!r}: ids {bad} are outside [0, {num_classes})")
    return out


def parse_bindings(text: str) -> dict[int, int]:
    """node id -> partition of a `partition-bindings` text ("1000:0, 1017:1"; "" = none); ValueError
    (what is wrong, in one line) unless each pair is two whole numbers, a node id in [0, 2**64) and
    no node or partition named twice."""
    bindings: dict[int, int] = {}
    for pair in filter(None, (p.strip() for p in text.split(","))):
        match = re.fullmatch(r"(\d+)\s*:\s*(\d+)", pair)
        if match is None:
            raise ValueError(f"{pair!r} is not NODE:PARTITION (two whole numbers, e.g. 1000:0)")
        node, partition = int(match[1]), int(match[2])
        if node > NODE_ID_MAX:
            raise ValueError(f"node id {node} is not a Flower node id (at most 2**64 - 1)")
        if node in bindings or partition in bindings.values():
            raise ValueError(f"{pair!r}: node {node} or partition {partition} is bound twice")
        bindings[node] = partition
    return bindings
