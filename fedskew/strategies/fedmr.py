"""FedMR server (Fan et al., TMLR 2023, Alg. 1). Client side: `fedskew/client_app/fedmr.py`; maths
and the decisions where the paper is silent: `fedskew/losses/fedmr.py`.

- The model is aggregated by FedAvg (sample-weighted, BN buffers included: the paper
  does not say how BatchNorm is aggregated).
- Prototypes: g_c^t = sum_k (N_k^c / sum_k' N_k'^c) g_k^c over this round's replies, per class and
  count-weighted (Sec. 3.3.2). A class no reply held this round keeps its previous prototype (stale:
  the paper is silent, and a stale prototype still supports the missing class); a class never held
  yet stays invalid and is masked by the clients.
- Downlink (`broadcast`): `fedmr-prototypes` {prototypes [C, d] float32, valid [C] bool} and
  `fedmr-config` {share-mask: bool per partition}. Round 1 sends all-invalid prototypes.
- Reply screening (on top of FedAvg's, `fedskew.records`): a reply is dropped, and counted as a
  failure, when its `fedmr-prototypes` record is missing, has other names, shapes or dtypes, holds
  NaN/inf or negative counts, or counts summing to more than its `num-examples`.
- Privacy (paper Sec. 4.4, Table 5): `fedmr-share-fraction` picks once, seeded, the subset of
  partitions allowed to upload prototypes (0: none, i.e. FedMR without prototypes = intra only);
  `fedmr-private-classes` ("3,7" or "all") are never uploaded nor broadcast. The server enforces both
  too: a reply with counts for a private class, or from a node outside the sharing subset with any
  count, is dropped (the partition a reply claims is its node's, so no node can pose as a sharer).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from flwr.app import ConfigRecord, Message, RecordDict

from fedskew import wire
from fedskew.config import parse_class_list
from fedskew.losses.fedmr import aggregate_prototypes, sharing_partitions
from fedskew.records import Rejected
from fedskew.strategies.base import BaseStrategy, numpy_to_arrays
from fedskew.wire import FEDMR_CONFIG, FEDMR_PROTOTYPES

log = logging.getLogger("fedskew.server")


class FedMRStrategy(BaseStrategy):
    """FedAvg model aggregation plus count-weighted per-class prototype aggregation."""

    wire = wire.FEDMR

    def __init__(self, cfg: dict[str, Any], device: torch.device | None = None) -> None:
        super().__init__(cfg, device)
        model = self.build_model()
        self.num_classes, self.feature_dim = model.num_classes, model.feature_dim
        self.prototypes = np.zeros((self.num_classes, self.feature_dim), dtype=np.float32)
        self.valid = np.zeros(self.num_classes, dtype=bool)
        self.private_classes = parse_class_list(cfg["fedmr-private-classes"], self.num_classes)

    # ------------------------------------------------------------------ downlink
    def state_dict(self) -> dict[str, Any]:
        """The global prototypes and which classes have one (for checkpoints)."""
        return {"prototypes": torch.from_numpy(self.prototypes.copy()), "valid": torch.from_numpy(self.valid.copy())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prototypes = state["prototypes"].numpy().astype(np.float32)
        self.valid = state["valid"].numpy().astype(bool)

    def share_mask(self) -> np.ndarray:
        """Which partitions may upload prototypes (fixed for the run: seeded by `seed`)."""
        return sharing_partitions(max(self.num_partitions or 0, 1), self.cfg["fedmr-share-fraction"], self.cfg["seed"])

    def broadcast(self, server_round: int) -> dict[str, Any]:
        protos = {"prototypes": self.prototypes, "valid": self.valid}
        mask = [bool(v) for v in self.share_mask()]
        return {FEDMR_PROTOTYPES: numpy_to_arrays(protos), FEDMR_CONFIG: ConfigRecord({"share-mask": mask})}

    # ------------------------------------------------------------------ uplink
    def check_reply(self, content: RecordDict, partition: int) -> None:
        super().check_reply(content, partition)
        counts, n = content[FEDMR_PROTOTYPES]["counts"].numpy(), content["metrics"]["num-examples"]
        total = counts.sum(dtype=np.float64)  # int64 would wrap around for hostile counts
        if total > n:
            raise Rejected(f"prototype counts sum to {total:.0f} > num-examples {n}")
        if counts[self.private_classes].any():
            raise Rejected(f"prototype counts for the private classes {self.private_classes}")
        share = self.share_mask()
        shares = self.cfg["fedmr-share-fraction"] == 1.0 or (partition < len(share) and share[partition])
        if counts.any() and not shares:
            raise Rejected(f"prototypes from partition {partition}, which is not in the sharing subset")

    def aggregate_extras(self, server_round: int, replies: list[Message]) -> dict[str, float]:
        protos = [m.content[FEDMR_PROTOTYPES]["prototypes"].numpy() for m in replies]
        counts = [m.content[FEDMR_PROTOTYPES]["counts"].numpy().astype(np.float64) for m in replies]
        updated = int((np.stack(counts).sum(0) > 0).sum())
        self.prototypes, self.valid = aggregate_prototypes(protos, counts, self.prototypes, self.valid)
        out = {"prototype-classes": int(self.valid.sum()), "prototype-classes-updated": updated}
        for key in ("intra-loss", "inter-loss"):
            vals = [float(m.content["metrics"][key]) for m in replies if key in m.content["metrics"]]
            if vals:
                out[key] = float(np.mean(vals))
        return out
