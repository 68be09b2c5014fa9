"""FedMR server (Fan et al., TMLR 2023, Alg. 1; spec `shared/methods/fedmr.md`). Client side:
`fedskew/client_app/fedmr.py`; maths and paper-vs-spec decisions: `fedskew/losses/fedmr.py`.

- The model is aggregated by FedAvg (sample-weighted, BN buffers included; spec 2.4, A16).
- Prototypes: g_c^t = sum_k (N_k^c / sum_k' N_k'^c) g_k^c over this round's replies, per class and
  count-weighted (Sec. 3.3.2). A class no reply held this round keeps its previous prototype (stale,
  spec A6 [rec]); a class never held yet stays invalid and is masked by the clients.
- Downlink (`broadcast`): `fedmr-prototypes` {prototypes [C, d] float32, valid [C] bool} and
  `fedmr-config` {share-mask: bool per partition}. Round 1 sends all-invalid prototypes.
- Reply screening (on top of FedAvg's): a reply is dropped, with the reason logged, when its
  `fedmr-prototypes` record is missing, has other names, shapes or dtypes, holds NaN/inf, negative
  counts, or counts summing to more than its `num-examples`.
- Privacy (paper Sec. 4.4, Table 5): `fedmr-share-fraction` picks once, seeded, the subset of
  partitions allowed to upload prototypes (0: none, i.e. FedMR without prototypes = intra only);
  `fedmr-private-classes` ("3,7" or "all") are never uploaded nor broadcast. The server enforces both
  too (it zeroes such counts) so a misbehaving client cannot leak them into G.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

from fedskew.client_app.fedmr import CONFIG_RECORD, PROTO_RECORD
from fedskew.losses.fedmr import aggregate_prototypes, parse_class_list, sharing_partitions
from fedskew.strategies.fedavg import FedAvgStrategy, numpy_to_arrays

log = logging.getLogger("fedskew.server")


class FedMRStrategy(FedAvgStrategy):
    """FedAvg model aggregation plus count-weighted per-class prototype aggregation."""

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
        return sharing_partitions(max(self.num_partitions, 1), self.cfg["fedmr-share-fraction"], self.cfg["seed"])

    def broadcast(self, server_round: int) -> dict[str, Any]:
        protos = {"prototypes": self.prototypes, "valid": self.valid}
        mask = [bool(v) for v in self.share_mask()]
        return {PROTO_RECORD: numpy_to_arrays(protos), CONFIG_RECORD: ConfigRecord({"share-mask": mask})}

    # ------------------------------------------------------------------ uplink
    def check_reply(self, content: RecordDict, expected: dict[str, tuple[tuple[int, ...], str]]) -> str | None:
        reason = super().check_reply(content, expected)
        if reason is not None:
            return reason
        rec = content.get(PROTO_RECORD)
        if not isinstance(rec, ArrayRecord):
            return f"reply lacks the {PROTO_RECORD!r} ArrayRecord"
        if sorted(rec.keys()) != ["counts", "prototypes"]:
            return f"{PROTO_RECORD!r} holds {sorted(rec.keys())}, expected ['counts', 'prototypes']"
        p, n = rec["prototypes"].numpy(), rec["counts"].numpy()
        c, d = self.num_classes, self.feature_dim
        if p.shape != (c, d) or p.dtype.kind != "f":
            return f"prototypes are {p.dtype}{list(p.shape)}, expected float[{c}, {d}]"
        if n.shape != (c,) or n.dtype.kind not in "iuf":
            return f"prototype counts are {n.dtype}{list(n.shape)}, expected a number per class [{c}]"
        if not (np.isfinite(p).all() and np.isfinite(n).all()):
            return "prototypes or counts hold NaN or inf"
        if (n < 0).any():
            return f"negative prototype counts for classes {np.flatnonzero(n < 0).tolist()}"
        if n.sum() > content["metrics"]["num-examples"]:
            return f"prototype counts sum to {n.sum()} > num-examples {content['metrics']['num-examples']}"
        return None

    def aggregate_extras(self, server_round: int, replies: list[Message]) -> dict[str, float]:
        share = self.share_mask()
        protos, counts = [], []
        for m in replies:
            rec, pid = m.content[PROTO_RECORD], int(m.content["metrics"]["partition-id"])
            n = rec["counts"].numpy().astype(np.float64).copy()
            n[self.private_classes] = 0.0
            if self.cfg["fedmr-share-fraction"] < 1.0 and (pid >= len(share) or not share[pid]):
                if n.any():
                    log.warning(
                        "round %d: partition %d is not in the sharing subset; its prototypes are ignored",
                        server_round,
                        pid,
                    )
                n[:] = 0.0
            protos.append(rec["prototypes"].numpy())
            counts.append(n)
        updated = int((np.stack(counts).sum(0) > 0).sum())
        self.prototypes, self.valid = aggregate_prototypes(protos, counts, self.prototypes, self.valid)
        out = {"prototype-classes": int(self.valid.sum()), "prototype-classes-updated": updated}
        for key in ("intra-loss", "inter-loss"):
            vals = [float(m.content["metrics"][key]) for m in replies if key in m.content["metrics"]]
            if vals:
                out[key] = float(np.mean(vals))
        return out
