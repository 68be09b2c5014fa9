"""MAP server (Li et al., TKDE'24, Alg. 1 ServerProcedure). Client side: `fedskew/client_app/map.py`.

The server averages the clients' stage-1 (restricted-softmax) models; the HPMs never leave the
clients. Alg. 1 line 6 averages uniformly, theta_{t+1} = 1/|S_t| sum_k theta^k_{a,t}; that is the
default here (`map-uniform-aggregation=true`); `false` follows `aggregation-weights` (the authors'
code weights by sample count).

The server also counts each partition's accepted replies. A client reports its participation
counter (`hpm-participations`); one lower than the server's count + 1 means its state was lost
(e.g. a SuperNode restarted without `state-dir`): logged and counted in `hpm-state-lost`.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from flwr.app import Message

from fedskew import wire
from fedskew.strategies.aggregate import summarize_clients, weighted_average
from fedskew.strategies.base import BaseStrategy, arrays_to_numpy, numpy_to_arrays

log = logging.getLogger("fedskew.server")


class MAPStrategy(BaseStrategy):
    """FedAvg of the uploaded stage-1 models (uniform by default, as Alg. 1) + HPM bookkeeping."""

    wire = wire.MAP

    def __init__(self, cfg: dict[str, Any], device: torch.device | None = None) -> None:
        super().__init__(cfg, device)
        self.participations: dict[int, int] = {}  # partition id -> accepted replies so far

    def aggregate_arrays(self, server_round: int, replies: list[Message]):
        if not self.cfg["map-uniform-aggregation"]:
            return super().aggregate_arrays(server_round, replies)
        models = [arrays_to_numpy(m.content["arrays"]) for m in replies]
        return numpy_to_arrays(weighted_average(models, [1.0] * len(models)))

    def aggregate_extras(self, server_round: int, replies: list[Message]) -> dict[str, float]:
        counts, mus, stage2, lost = [], [], [], 0
        for msg in replies:
            m = msg.content["metrics"]
            pid, z = int(m["partition-id"]), int(m.get("hpm-participations", 0))
            expected = self.participations.get(pid, 0) + 1
            if z < expected:
                lost += 1
                log.warning(
                    "round %d: partition %d reports participation %d, expected %d: its MAP state (HPM) was "
                    "lost and restarted as a first participation",
                    server_round,
                    pid,
                    z,
                    expected,
                )
            self.participations[pid] = expected
            counts.append(z)
            mus.append(float(m.get("hpm-mu", float("nan"))))
            if math.isfinite(float(m.get("stage2-accuracy", float("nan")))):
                stage2.append(float(m["stage2-accuracy"]))
        return {
            "hpm-participations-min": min(counts),
            "hpm-participations-max": max(counts),
            "hpm-mu-mean": summarize_clients(mus)[0],
            "hpm-first": sum(1 for m in replies if int(m.content["metrics"].get("hpm-transfer", 0)) == 0),
            "hpm-state-lost": lost,
            "stage2-accuracy": summarize_clients(stage2)[0],
        }
