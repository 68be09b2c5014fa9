"""FedMR server (Fan et al., TMLR 2023, Alg. 1). Client side: `fedskew/client_app/fedmr.py`; maths
and the decisions where the paper is silent: `fedskew/losses/fedmr.py`.

- The model is aggregated by FedAvg (sample-weighted, BN buffers included: the paper
  does not say how BatchNorm is aggregated).
- Prototypes (`fedskew/strategies/prototypes.py`, shared with FedProc): g_c^t = sum_k (N_k^c /
  sum_k' N_k'^c) g_k^c over this round's replies, per class and count-weighted (Sec. 3.3.2). A class
  no reply held this round keeps its previous prototype (stale: the paper is silent, and a stale
  prototype still supports the missing class); a class never held
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

from typing import Any

import numpy as np
import torch
from flwr.app import ConfigRecord, RecordDict

from fedskew.losses.fedmr import sharing_partitions
from fedskew.methods.fedmr import FEDMR_CONFIG, FEDMR_PROTOTYPES
from fedskew.records import Rejected
from fedskew.schema import parse_class_list
from fedskew.strategies.prototypes import PrototypeStrategy


class FedMRStrategy(PrototypeStrategy):
    """FedAvg model aggregation plus count-weighted per-class prototype aggregation."""

    prototype_record = FEDMR_PROTOTYPES

    def __init__(self, cfg: dict[str, Any], device: torch.device | None = None) -> None:
        super().__init__(cfg, device)
        self.private_classes = parse_class_list(cfg["fedmr-private-classes"], self.num_classes)

    # ------------------------------------------------------------------ downlink
    def share_mask(self) -> np.ndarray:
        """Which partitions may upload prototypes (fixed for the run: seeded by `seed`)."""
        return sharing_partitions(max(self.num_partitions or 0, 1), self.cfg["fedmr-share-fraction"], self.cfg["seed"])

    def broadcast(self, server_round: int) -> dict[str, Any]:
        mask = [bool(v) for v in self.share_mask()]
        return {**super().broadcast(server_round), FEDMR_CONFIG: ConfigRecord({"share-mask": mask})}

    # ------------------------------------------------------------------ uplink
    def check_reply(self, content: RecordDict, partition: int) -> None:
        super().check_reply(content, partition)
        counts = content[FEDMR_PROTOTYPES]["counts"].numpy()
        if counts[self.private_classes].any():
            raise Rejected(f"prototype counts for the private classes {self.private_classes}")
        share = self.share_mask()
        shares = self.cfg["fedmr-share-fraction"] == 1.0 or (partition < len(share) and share[partition])
        if counts.any() and not shares:
            raise Rejected(f"prototypes from partition {partition}, which is not in the sharing subset")
