"""The records that cross the network: their declared form, and the one checker both sides use.

A client's reply and a server message are `RecordDict`s of named `ArrayRecord`s, `MetricRecord`s
and `ConfigRecord`s. Each method declares their form once (`ArraysSpec`, `MetricsSpec`,
`ConfigSpec`), on its card (`fedskew/methods/<name>.py`); the server's base strategy screens every
reply and the client's base trainer every server message with `check_content`, so no method reads an unchecked payload.

An array is decoded from its bytes and the decoded array is what is checked: its dtype and shape
(which must also equal what the array declares), finite values and value range. A floating array
whose form declares no range may hold no value beyond +-`VALUE_BOUND` (1e6), in either direction:
trained weights, BatchNorm statistics of normalised inputs, features, prototypes, gradients and
control variates are orders of magnitude below it, and a larger value can only be hostile (a
finite 3.4e38 model averaged in turns every client's next round into NaN). A metric must be
a number of its declared kind (never a list or a bool) in its range; a config value a number, a
text or a list of flags of its declared form. The first problem raises
`Rejected` with one line naming the record, the entry and what was expected.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from fedskew.schema import INT64

VALUE_BOUND = 1e6


class Rejected(ValueError):
    """A record does not have its declared form."""


@dataclass(frozen=True)
class Tensor:
    """One array: its shape (None: any length on that axis), numpy dtype name and value range."""

    shape: tuple[int | None, ...]
    dtype: str
    low: float | None = None
    high: float | None = None


@dataclass(frozen=True)
class ArraysSpec:
    """An ArrayRecord: its arrays by name (in order); `partial`: any subset of them may be sent."""

    arrays: Mapping[str, Tensor]
    required: bool = True
    partial: bool = False


@dataclass(frozen=True)
class Number:
    """One metric: int or float, its closed range, whether it must be present, whether NaN
    (a value the client could not measure) is allowed. Infinite values never are."""

    kind: type = float
    low: float = -math.inf
    high: float = math.inf
    required: bool = False
    nan: bool = False


@dataclass(frozen=True)
class MetricsSpec:
    """A MetricRecord: its metrics by name; any other name is refused."""

    values: Mapping[str, Number] = field(default_factory=dict)
    required: bool = True


@dataclass(frozen=True)
class Text:
    """A config value that is a string of at most `max_len` characters from `alphabet` (None: any)."""

    max_len: int
    alphabet: str | None = None
    required: bool = False


@dataclass(frozen=True)
class Flags:
    """A config value that is a list of at most `max_len` booleans."""

    max_len: int
    required: bool = False


@dataclass(frozen=True)
class ConfigSpec:
    """A ConfigRecord: its values by name (numbers, texts, lists of flags); any other name is refused."""

    values: Mapping[str, Number | Text | Flags] = field(default_factory=dict)
    required: bool = True


Spec = ArraysSpec | MetricsSpec | ConfigSpec

FRACTION = Number(float, 0.0, 1.0)
NON_NEGATIVE = Number(float, 0.0)


def tensor_like(value: Any) -> Tensor:
    """The exact form of an array (numpy array or torch tensor)."""
    dtype = str(value.dtype).removeprefix("torch.")
    return Tensor(tuple(value.shape), dtype)


def decode(array: Array, where: str) -> np.ndarray:
    """The array held by `array`'s bytes; it must be the dtype and shape the array declares."""
    try:
        value = array.numpy()
    except Exception as e:  # np.load on hostile bytes can raise almost anything
        raise Rejected(f"{where} does not decode: {type(e).__name__}: {e}") from None
    if str(value.dtype) != array.dtype or list(value.shape) != list(array.shape):
        raise Rejected(f"{where} declares {array.dtype}{list(array.shape)} but holds {value.dtype}{list(value.shape)}")
    return value


def check_tensor(value: np.ndarray, form: Tensor, where: str) -> None:
    """dtype, shape, finite values and range of one decoded array."""
    shape_ok = len(value.shape) == len(form.shape) and all(
        want is None or got == want for got, want in zip(value.shape, form.shape, strict=True)
    )
    if value.dtype != np.dtype(form.dtype) or not shape_ok:
        want = [("*" if d is None else d) for d in form.shape]
        raise Rejected(f"{where} is {value.dtype}{list(value.shape)}, expected {form.dtype}{want}")
    floating = value.dtype.kind == "f"
    if floating and not np.isfinite(value).all():
        raise Rejected(f"{where} holds NaN or inf")
    low, high = form.low, form.high
    if floating and low is None and high is None:
        low, high = -VALUE_BOUND, VALUE_BOUND
    if value.size and low is not None and value.min() < low:
        raise Rejected(f"{where} holds {value.min():.4g} < {low:g}")
    if value.size and high is not None and value.max() > high:
        raise Rejected(f"{where} holds {value.max():.4g} > {high:g}")


def check_arrays(record: object, spec: ArraysSpec, name: str) -> dict[str, np.ndarray]:
    """The decoded arrays of `record` after checking them against `spec`."""
    if not isinstance(record, ArrayRecord):
        raise Rejected(f"{name!r} is a {type(record).__name__}, expected an ArrayRecord")
    keys, wanted = list(record.keys()), list(spec.arrays)
    unexpected = [k for k in keys if k not in spec.arrays]
    if unexpected or (not spec.partial and keys != wanted):
        missing = [k for k in wanted if k not in keys]
        raise Rejected(f"{name!r} array names differ (missing {missing[:3]}, unexpected {unexpected[:3]})")
    out = {}
    for key in keys:
        out[key] = decode(record[key], f"array {key!r} of {name!r}")
        check_tensor(out[key], spec.arrays[key], f"array {key!r} of {name!r}")
    return out


def check_metrics(record: object, spec: MetricsSpec, name: str) -> None:
    """Check the names, kinds and ranges of the metrics in `record` against `spec`."""
    _check_names(record, MetricRecord, spec.values, name, "metrics")
    for key, value in record.items():
        check_number(value, spec.values[key], f"metric {key} of {name!r}")


def check_number(value: object, form: Number, where: str) -> None:
    """`value` is a number of `form`'s kind (never a bool or a list), finite (NaN where allowed)
    and in its range."""
    kinds = (int,) if form.kind is int else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise Rejected(f"{where}={_short(value)} is not of kind {form.kind.__name__}")
    if isinstance(value, float) and math.isnan(value) and form.nan:
        return
    finite = math.isfinite(value) if isinstance(value, float) else INT64[0] <= value <= INT64[1]
    if not (finite and form.low <= value <= form.high):
        raise Rejected(f"{where}={_short(value)} is outside [{form.low:g}, {form.high:g}]")


def check_config(record: object, spec: ConfigSpec, name: str) -> None:
    """Check the names and values of the ConfigRecord `record` against `spec`."""
    _check_names(record, ConfigRecord, spec.values, name, "values")
    for key, value in record.items():
        form, where = spec.values[key], f"value {key} of {name!r}"
        if isinstance(form, Number):
            check_number(value, form, where)
        elif isinstance(form, Text):
            ok = isinstance(value, str) and len(value) <= form.max_len
            if not ok or (form.alphabet is not None and any(c not in form.alphabet for c in value)):
                raise Rejected(f"{where}={_short(value)} is not a text of at most {form.max_len} allowed characters")
        elif not (isinstance(value, list) and len(value) <= form.max_len and all(isinstance(v, bool) for v in value)):
            raise Rejected(f"{where}={_short(value)} is not a list of at most {form.max_len} booleans")


def decoded_content(content: RecordDict, schema: Mapping[str, Spec]) -> dict[str, Any]:
    """Every declared record of `content` after checking it: ArrayRecords as their decoded numpy
    arrays, MetricRecords and ConfigRecords as they are. A required record missing or a record the
    schema does not declare is refused."""
    unexpected = [k for k in content.keys() if k not in schema]
    if unexpected:
        raise Rejected(f"unexpected records {unexpected[:3]}")
    out: dict[str, Any] = {}
    for name, spec in schema.items():
        if name not in content:
            if spec.required:
                raise Rejected(f"the {name!r} record is missing")
            continue
        if isinstance(spec, ArraysSpec):
            out[name] = check_arrays(content[name], spec, name)
            continue
        if isinstance(spec, MetricsSpec):
            check_metrics(content[name], spec, name)
        else:
            check_config(content[name], spec, name)
        out[name] = content[name]
    return out


def check_content(content: RecordDict, schema: Mapping[str, Spec]) -> RecordDict:
    """`content` cut to its declared records, after checking each (`decoded_content`)."""
    return RecordDict({name: content[name] for name in decoded_content(content, schema)})


def _check_names(record: object, kind: type, forms: Mapping[str, Any], name: str, what: str) -> None:
    """`record` is a `kind` whose entries are named in `forms`, each required one present."""
    if not isinstance(record, kind):
        raise Rejected(f"{name!r} is a {type(record).__name__}, expected a {kind.__name__}")
    unexpected = [k for k in record.keys() if k not in forms]
    if unexpected:
        raise Rejected(f"{name!r} holds unexpected {what} {unexpected[:3]}")
    missing = [k for k, form in forms.items() if form.required and k not in record]
    if missing:
        raise Rejected(f"{name!r} lacks the {what} {missing[:3]}")


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
