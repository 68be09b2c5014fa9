"""Per-client state that survives rounds: `context.state` within a bound, or a per-node directory.

Policy (see docs/usage.md, "Client state"):
- By default named tensors and counters live in Flower's `context.state` (kept by the simulation
  engine or the SuperNode between messages). Its array payload is bounded by `state-max-mb`
  (default 64 MB), because a SuperNode silently drops a context of about 200 MB in deployment;
  going over the bound raises `StateTooLargeError` instead of losing the state quietly.
- When the node config sets `state-dir`, the state is written to
  `<state-dir>/run-<run_id>/partition-<id>/` instead (atomic and durable writes), with no bound
  and surviving a SuperNode restart.
- What is read back is verified: a state that does not load (unreadable, not UTF-8, not JSON, not
  tensors, a folder where a file should be), holds NaN, inf or a floating value beyond +-1e6 (the
  value bound of every record on the wire, `fedskew.records.VALUE_BOUND`), or whose values do not have the
  declared form (`load_values(name, schema)`: each key's kind and range, e.g. a participation count
  between 1 and the trainings the run can have sent so far, `most_trainings`) counts as lost
  (logged), and the method starts the client as its paper starts a new one. A folder or other
  non-file in the way of a state file is renamed aside (`<name>.lost-<random>`), never deleted, so
  the next save succeeds; a damaged file is simply replaced by that save.
- Either way the state is per run: a new run starts empty, and a method handles an empty state
  the way its paper handles a client's first participation.
- Tensors kept with `save_round_tensors` carry the round that wrote them; `load_round_tensors`
  refuses one written in the current round or later (by an attempt the server discarded: a retried
  round, a resume from an earlier checkpoint), whose effect the server's state does not hold.
"""

from __future__ import annotations

import json
import logging
import math
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from fedskew.files import atomic_write
from fedskew.models import run_model
from fedskew.records import VALUE_BOUND, Number, check_number
from fedskew.registry import get_method

log = logging.getLogger("fedskew.client")

MB = 1024 * 1024
ROUND_KEY = "fedskew.written-in-round"  # kept beside the tensors; no parameter of the networks is so named


class StateTooLargeError(RuntimeError):
    """A client's persistent state would exceed its bound."""


@dataclass(frozen=True)
class ListOf:
    """A stored value that is a list of at most `max_len` numbers of the form `item`."""

    item: Number
    max_len: int


ValueForm = Number | ListOf


def most_trainings(cfg: Mapping[str, Any], server_round: int) -> int:
    """The most train messages one client can have had by round `server_round` (this one included):
    one per attempt of each round, and a round is sent at most `round-retries` + 1 times."""
    return server_round * (int(cfg["round-retries"]) + 1)


def check_values(values: object, schema: Mapping[str, ValueForm]) -> dict[str, Any]:
    """`values` if it is a dict holding only keys of `schema`, each of its declared form (required
    numbers present); raises ValueError naming the first key that is not."""
    if not isinstance(values, dict):
        raise ValueError(f"a JSON {type(values).__name__}, not an object")
    unexpected = [k for k in values if k not in schema]
    missing = [k for k, form in schema.items() if isinstance(form, Number) and form.required and k not in values]
    if unexpected or missing:
        raise ValueError(f"unexpected keys {unexpected[:3]}, missing keys {missing[:3]}")
    for key, value in values.items():
        form = schema[key]
        if isinstance(form, ListOf):
            if not isinstance(value, list) or len(value) > form.max_len:
                raise ValueError(f"{key} must be a list of at most {form.max_len} numbers")
            for i, item in enumerate(value):
                check_number(item, form.item, f"{key}[{i}]")
        else:
            check_number(value, form, key)
    return values


class ClientState:
    """Named tensor dicts and small JSON-able dicts kept across rounds for one client."""

    def __init__(
        self,
        record: RecordDict,
        max_mb: float,
        partition_id: int,
        directory: str | Path | None = None,
    ) -> None:
        self.record = record
        self.max_bytes = int(max_mb * MB)
        self.partition_id = partition_id
        self.directory = Path(directory) if directory else None
        if self.directory:
            if self.directory.exists() and not self.directory.is_dir():
                self._set_aside(self.directory)
            self.directory.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ tensors
    def load_tensors(self, name: str) -> dict[str, torch.Tensor] | None:
        """The tensors saved under `name`, or None if this client has none (yet, or lost): a state
        that does not load as a dict of tensors, or holds NaN, inf or a floating value beyond
        +-`VALUE_BOUND`, is lost (with a warning)."""
        try:
            if self.directory:
                path = self.directory / f"{name}.pt"
                tensors = torch.load(path, weights_only=True) if self._stored(path) else None
            else:
                rec = self.record.get(f"tensors.{name}")
                tensors = None if rec is None else rec.to_torch_state_dict()
            if tensors is not None:
                _check_tensors(tensors)
        except Exception as e:  # a damaged or tampered file can raise almost anything on load
            self._lost(name, e)
            return None
        return tensors

    def save_tensors(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        """Keep `tensors` (moved to CPU) under `name`; refuses to exceed the bound."""
        cpu = {k: v.detach().cpu() for k, v in tensors.items()}
        if self.directory:
            atomic_write(self.directory / f"{name}.pt", lambda f: torch.save(cpu, f))
            return
        new = sum(t.numel() * t.element_size() for t in cpu.values())
        others = sum(
            self._nbytes(v) for k, v in self.record.items() if isinstance(v, ArrayRecord) and k != f"tensors.{name}"
        )
        if new + others > self.max_bytes:
            raise StateTooLargeError(
                f"client state of partition {self.partition_id} would be "
                f"{(new + others) / MB:.1f} MB (saving {name!r}) > state-max-mb="
                f'{self.max_bytes / MB:g}: set node config state-dir="/path" to keep it on disk, '
                "or raise state-max-mb (Flower drops ~200 MB states silently in deployment)"
            )
        self.record[f"tensors.{name}"] = ArrayRecord(cpu)

    # ------------------------------------------------------------------ tensors of a round
    def load_round_tensors(
        self, name: str, like: Mapping[str, torch.Tensor], server_round: int
    ) -> dict[str, torch.Tensor] | None:
        """The tensors `save_round_tensors` kept under `name` in an earlier round, or None: when there
        are none (first participation or lost state), when they differ from `like` in names, shapes
        or dtypes, or when they were written in round `server_round` or later, i.e. by an attempt the
        server discarded (a retried round, a run resumed from an earlier checkpoint): such a state is
        ahead of the server's and is dropped like a lost one. Each case but the first is logged."""
        tensors = self.load_tensors(name)
        if tensors is None:
            return None
        tag = tensors.pop(ROUND_KEY, None)
        integral = isinstance(tag, torch.Tensor) and tag.dim() == 0 and not tag.is_floating_point()
        written = int(tag) if integral else -1  # -1: no round, or not one integer
        reason = None
        if list(tensors) != list(like) or any(
            tensors[k].shape != v.shape or tensors[k].dtype != v.dtype for k, v in like.items()
        ):
            reason = "its names, shapes or dtypes differ from the model's"
        elif not 0 < written < server_round:
            reason = f"it was written in round {written}, not before round {server_round} (a discarded attempt)"
        if reason:
            self._lost(name, ValueError(reason))
            return None
        return tensors

    def save_round_tensors(self, name: str, tensors: Mapping[str, torch.Tensor], server_round: int) -> None:
        """Keep `tensors` under `name`, tagged with the round that wrote them (`load_round_tensors`)."""
        self.save_tensors(name, {**tensors, ROUND_KEY: torch.tensor(server_round, dtype=torch.int64)})

    # ------------------------------------------------------------------ small values
    def load_values(self, name: str, schema: Mapping[str, ValueForm]) -> dict[str, Any] | None:
        """The dict saved under `name` with `save_values`, or None if this client has none (yet, or
        lost): what is stored must be UTF-8 JSON of the form `schema` declares (`check_values`), else
        it is lost (with a warning)."""
        try:
            if self.directory:
                path = self.directory / f"{name}.json"
                text = path.read_bytes().decode() if self._stored(path) else None
            else:
                rec = self.record.get(f"values.{name}")
                text = None if rec is None else rec["json"]
            if text is None:
                return None
            if not isinstance(text, str):
                raise ValueError(f"a {type(text).__name__}, not JSON text")
            return check_values(json.loads(text), schema)
        except Exception as e:  # unreadable, not UTF-8, not JSON, or not of its declared form
            self._lost(name, e)
            return None

    def save_values(self, name: str, values: dict) -> None:
        text = json.dumps(values)
        if self.directory:
            atomic_write(self.directory / f"{name}.json", lambda f: f.write(text.encode()))
        else:
            self.record[f"values.{name}"] = ConfigRecord({"json": text})

    # ------------------------------------------------------------------ damaged state
    def _stored(self, path: Path) -> bool:
        """Whether a state file is stored at `path`; anything else there (a folder, a socket) is
        renamed aside and raises, so the state counts as lost and the next save succeeds."""
        if not os.path.lexists(path):
            return False
        if path.is_file():
            return True
        self._set_aside(path)
        raise ValueError(f"{path.name} is not a regular file (renamed aside)")

    def _set_aside(self, path: Path) -> None:
        aside = path.with_name(f"{path.name}.lost-{uuid.uuid4().hex[:8]}")
        os.replace(path, aside)
        log.warning("partition %d: %s is not a file of client state: renamed to %s", self.partition_id, path, aside)

    def _lost(self, name: str, error: BaseException) -> None:
        reason = f"{type(error).__name__}: {error}"[:300]
        log.warning("partition %d: client state %r refused, treated as lost: %s", self.partition_id, name, reason)

    @staticmethod
    def _nbytes(rec: ArrayRecord) -> int:
        return sum(len(a.data) for a in rec.values())


def matches(tensors: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> bool:
    """Whether a stored state dict has exactly the names (in order) and shapes of `reference` (the
    network it is loaded into); one that does not is discarded by its method, as a lost state."""
    return list(tensors) == list(reference) and all(tensors[k].shape == reference[k].shape for k in reference)


def _check_tensors(tensors: object) -> None:
    if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise ValueError("not a dict of tensors")
    bad = [k for k, t in tensors.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        raise ValueError(f"tensors {bad[:3]} hold NaN or inf")
    # the bound replies are held to: trained weights, statistics, control variates and drifts are
    # orders of magnitude below it; a finite extreme (1e30) would fail the node every round
    extreme = [k for k, t in tensors.items() if t.is_floating_point() and t.numel() and t.abs().max() > VALUE_BOUND]
    if extreme:
        raise ValueError(f"tensors {extreme[:3]} hold values beyond +-{VALUE_BOUND:g}")


def kept_state_bytes(cfg: Mapping[str, Any]) -> int:
    """The most bytes of tensors a client of a run under the validated `cfg` keeps in `context.state`,
    as `save_tensors` counts them: each model-sized array its trainer declares (`kept_arrays`: the
    network's state dict, its parameters or its head) with the round tag, serialised as Flower holds
    them. 0 for a method whose clients keep no state under `cfg` (`kept_state`); small states
    (counters, MuPFL's BAVD maps: a few KB) are not counted."""
    trainer = get_method(cfg["method"]).trainer_class()
    if not trainer.kept_state(cfg) or not trainer.kept_arrays:
        return 0
    model = run_model(cfg)
    parts = {
        "model": model.state_dict(),
        "params": {k: p.detach() for k, p in model.named_parameters()},
        "head": model.classifier.state_dict(),
    }
    tag = {ROUND_KEY: torch.tensor(0, dtype=torch.int64)}
    return sum(ClientState._nbytes(ArrayRecord({**parts[part], **tag})) for part in trainer.kept_arrays)


def state_bound_problem(cfg: Mapping[str, Any]) -> str:
    """'' when what a client of the validated `cfg` keeps fits `state-max-mb` (`kept_state_bytes`),
    else one line naming the key, its value and the smallest value that works: such a client would
    raise `StateTooLargeError` at the end of every round it trains, and never answer."""
    need = kept_state_bytes(cfg)
    if need <= cfg["state-max-mb"] * MB:
        return ""
    kept = get_method(cfg["method"]).trainer_class().kept_state(cfg)
    return (
        f"state-max-mb={cfg['state-max-mb']:g} is below the {need / MB:.2f} MB that each {cfg['method']} client "
        f"keeps ({kept}) with model={cfg['model']!r}: set state-max-mb >= {math.ceil(need / MB * 100) / 100:g}"
    )
