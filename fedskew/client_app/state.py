"""Per-client state that survives rounds: `context.state` within a bound, or a per-node directory.

Policy (see docs/usage.md, "Client state"):
- By default named tensors and counters live in Flower's `context.state` (kept by the simulation
  engine or the SuperNode between messages). Its array payload is bounded by `state-max-mb`
  (default 64 MB), because a SuperNode silently drops a context of about 200 MB in deployment;
  going over the bound raises `StateTooLargeError` instead of losing the state quietly.
- When the node config sets `state-dir`, the state is written to
  `<state-dir>/run-<run_id>/partition-<id>/` instead (atomic and durable writes), with no bound
  and surviving a SuperNode restart.
- What is read back is verified: a state that does not load, or holds NaN or inf, counts as lost
  (logged), and the method starts the client as its paper starts a new one.
- Either way the state is per run: a new run starts empty, and a method handles an empty state
  the way its paper handles a client's first participation.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from fedskew.files import atomic_write

log = logging.getLogger("fedskew.client")

MB = 1024 * 1024


class StateTooLargeError(RuntimeError):
    """A client's persistent state would exceed its bound."""


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
            self.directory.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ tensors
    def load_tensors(self, name: str) -> dict[str, torch.Tensor] | None:
        """The tensors saved under `name`, or None if this client has none (yet, or lost): a state
        that does not load as a dict of tensors, or holds NaN or inf, is lost (with a warning)."""
        try:
            if self.directory:
                path = self.directory / f"{name}.pt"
                tensors = torch.load(path, weights_only=True) if path.is_file() else None
            else:
                rec = self.record.get(f"tensors.{name}")
                tensors = None if rec is None else rec.to_torch_state_dict()
            if tensors is not None:
                _check_tensors(tensors)
        except Exception as e:  # a damaged or tampered file can raise almost anything on load
            log.warning("partition %d: client state %r refused, treated as lost: %s", self.partition_id, name, e)
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

    # ------------------------------------------------------------------ small values
    def load_values(self, name: str) -> dict | None:
        """The dict saved under `name` with `save_values`, or None (also, with a warning, when what
        is stored is not a JSON object)."""
        if self.directory:
            path = self.directory / f"{name}.json"
            text = path.read_text() if path.is_file() else None
        else:
            rec = self.record.get(f"values.{name}")
            text = None if rec is None else str(rec["json"])
        try:
            values = None if text is None else json.loads(text)
            if values is not None and not isinstance(values, dict):
                raise ValueError(f"a JSON {type(values).__name__}, not an object")
        except ValueError as e:
            log.warning("partition %d: client state %r refused, treated as lost: %s", self.partition_id, name, e)
            return None
        return values

    def save_values(self, name: str, values: dict) -> None:
        text = json.dumps(values)
        if self.directory:
            atomic_write(self.directory / f"{name}.json", lambda f: f.write(text.encode()))
        else:
            self.record[f"values.{name}"] = ConfigRecord({"json": text})

    @staticmethod
    def _nbytes(rec: ArrayRecord) -> int:
        return sum(len(a.data) for a in rec.values())


def _check_tensors(tensors: object) -> None:
    if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise ValueError("not a dict of tensors")
    bad = [k for k, t in tensors.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        raise ValueError(f"tensors {bad[:3]} hold NaN or inf")
