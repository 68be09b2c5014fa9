"""The server's part of the inherited private model (HPM), shared by FedPHP and MAP: the HPMs never
leave the clients, but the server counts each partition's accepted replies.

A client reports the number of its participation (`hpm-participations`, its counter + 1) and the
momentum it used (`hpm-mu`). A number lower than the server's count + 1 means that its state was
lost (e.g. a SuperNode restarted without `state-dir`): logged and counted in `hpm-state-lost`. The
counts are server state, kept in the checkpoint (a resumed run flags the same losses).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from flwr.app import Message

from fedskew.strategies.aggregate import summarize_clients
from fedskew.strategies.base import BaseStrategy

log = logging.getLogger("fedskew.server")


class HPMStrategy(BaseStrategy):
    """Counts each partition's participations and reports the round's HPM schedule."""

    def __init__(self, cfg: dict[str, Any], device: torch.device | None = None) -> None:
        super().__init__(cfg, device)
        self.participations: dict[int, int] = {}  # partition id -> accepted replies so far

    def state_dict(self) -> dict[str, Any]:
        pids = sorted(self.participations)
        return {
            "hpm-partitions": torch.tensor(pids, dtype=torch.int64),
            "hpm-participations": torch.tensor([self.participations[p] for p in pids], dtype=torch.int64),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pids, counts = state["hpm-partitions"].tolist(), state["hpm-participations"].tolist()
        self.participations = dict(zip(pids, counts, strict=True))

    def hpm_metrics(self, server_round: int, replies: list[Message]) -> dict[str, float]:
        """The round's participation range, mean momentum, first participations and lost states."""
        counts, mus, lost = [], [], 0
        for msg in replies:
            m = msg.content["metrics"]
            pid, z = int(m["partition-id"]), int(m.get("hpm-participations", 0))
            expected = self.participations.get(pid, 0) + 1
            if z < expected:
                lost += 1
                log.warning(
                    "round %d: partition %d reports participation %d, expected %d: its HPM state was "
                    "lost and restarted as a first participation",
                    server_round,
                    pid,
                    z,
                    expected,
                )
            self.participations[pid] = expected
            counts.append(z)
            mus.append(float(m.get("hpm-mu", float("nan"))))
        return {
            "hpm-participations-min": min(counts),
            "hpm-participations-max": max(counts),
            "hpm-mu-mean": summarize_clients(mus)[0],
            "hpm-first": sum(1 for z in counts if z == 1),
            "hpm-state-lost": lost,
        }

    def aggregate_extras(self, server_round: int, replies: list[Message]) -> dict[str, float]:
        return self.hpm_metrics(server_round, replies)
