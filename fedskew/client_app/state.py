"""Per-client state that survives rounds: `context.state` within a bound, or a per-node directory.

Policy (see README, "Client state"):
- By default named tensors and counters live in Flower's `context.state` (kept by the simulation
  engine or the SuperNode between messages). Its array payload is bounded by `state-max-mb`
  (default 64 MB), because a SuperNode silently drops a context of about 200 MB in deployment;
  going over the bound raises `StateTooLargeError` instead of losing the state quietly.
- When the node config sets `state-dir`, the state is written to
  `<state-dir>/run-<run_id>/partition-<id>/` instead (atomic write-then-rename), with no bound
  and surviving a SuperNode restart.
- Either way the state is per run: a new run starts empty, and a method handles an empty state
  the way its paper handles a client's first participation.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

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
        """The tensors saved under `name`, or None if this client has none (yet, or lost)."""
        if self.directory:
            path = self.directory / f"{name}.pt"
            return torch.load(path, weights_only=True) if path.is_file() else None
        rec = self.record.get(f"tensors.{name}")
        return None if rec is None else rec.to_torch_state_dict()

    def save_tensors(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        """Keep `tensors` (moved to CPU) under `name`; refuses to exceed the bound."""
        cpu = {k: v.detach().cpu() for k, v in tensors.items()}
        if self.directory:
            _atomic(self.directory / f"{name}.pt", lambda p: torch.save(cpu, p))
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
        """The dict saved under `name` with `save_values`, or None."""
        if self.directory:
            path = self.directory / f"{name}.json"
            return json.loads(path.read_text()) if path.is_file() else None
        rec = self.record.get(f"values.{name}")
        return None if rec is None else json.loads(str(rec["json"]))

    def save_values(self, name: str, values: dict) -> None:
        text = json.dumps(values)
        if self.directory:
            _atomic(self.directory / f"{name}.json", lambda p: Path(p).write_text(text))
        else:
            self.record[f"values.{name}"] = ConfigRecord({"json": text})

    @staticmethod
    def _nbytes(rec: ArrayRecord) -> int:
        return sum(len(a.data) for a in rec.values())


def _atomic(path: Path, write) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    write(tmp)
    os.replace(tmp, path)
