"""FedProto server (Tan et al., AAAI'22, Alg. 1; the authors' code `yuetan031/FedProto` at commit
97e42e2741e1ae2e2fce2465e80f38f6997f8836). Client side: `fedskew/client_app/fedproto.py`; maths:
`fedskew/losses/fedproto.py`.

Only class prototypes travel. The server has no model: it sends the global prototypes
{prototypes [C, d], valid [C]} (round 1: none valid) and an empty `arrays` record, and a reply's
`arrays` must be empty too (the screen refuses any array in it). Each round the global prototype of
every class a participant holds is aggregated from that round's uploads (Alg. 1; the code's
`proto_aggregation` of the round's `local_protos`), weighted by `fedproto-weighting`: "counts"
(the paper's |D_ij| / N_j, normalised) or "clients" (the code's plain mean over the holders).

Deviation, for partial participation, which the paper does not run (all 20 clients every round, so
every class is refreshed every round): a class no participant holds this round keeps its last
global prototype (as FedMR's server does). Rebuilt from the round's uploads alone, as the code does,
a class-disjoint client whose classes nobody else held that round gets no prototype to train towards
or to predict by (its prototype-based personal accuracy falls to 0: `docs/notes/fedproto.md`). With
full participation both rules are the same.

Reply screening, beyond the base's: the prototype record has its declared form (finite float32
[C, d], int64 counts >= 0), the counts sum to at most `num-examples` and, where the server knows the
partitions (nodes serving partitions of a data set), equal the partition's training class counts:
the weights are the server's own numbers, not the client's word. The prototypes themselves are
bounded and, with `robust-aggregation`, robustly merged as every prototype method's
(`fedskew/strategies/prototypes.py`).

There is no single global model, so there is no central evaluation and no `model.pt`
(`global_model` is None, the global accuracy stays null). FedGELA (§5) and FedRoD define the generic
accuracy of a personalized method as the mean of the personal models on the central test set, which
only the clients can measure (their models never leave them).
"""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord, Message, RecordDict
from torch import nn

from fedskew.losses.fedproto import global_prototypes
from fedskew.methods.fedproto import FEDPROTO_PROTOTYPES
from fedskew.records import Rejected
from fedskew.strategies.prototypes import PrototypeStrategy


class FedProtoStrategy(PrototypeStrategy):
    """Aggregates class prototypes only; no model arrays either way."""

    prototype_record = FEDPROTO_PROTOTYPES

    def initial_arrays(self) -> ArrayRecord:
        """Nothing: each client builds and keeps its own model."""
        return ArrayRecord()

    def expected_upload(self, arrays: ArrayRecord) -> dict[str, tuple[tuple[int, ...], str]]:
        """No model array: a reply's `arrays` record must be empty."""
        return {}

    def aggregate_arrays(self, server_round: int, replies: list[Message]) -> ArrayRecord:
        return ArrayRecord()

    def global_model(self, arrays: ArrayRecord) -> nn.Module | None:
        return None

    def check_reply(self, content: RecordDict, partition: int) -> None:
        super().check_reply(content, partition)
        expected = self.partition_class_counts(partition)
        counts = content[self.prototype_record]["counts"].numpy()
        if expected is not None and not np.array_equal(counts, expected):
            raise Rejected(
                f"prototype counts {counts.tolist()} differ from partition {partition}'s {expected.tolist()}"
            )

    def merge_prototypes(self, protos: list[np.ndarray], counts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """The round's prototypes weighted by `fedproto-weighting` (classes no reply held keep theirs)."""
        weighting = self.cfg["fedproto-weighting"]
        return global_prototypes(protos, counts, weighting, self.prototypes, self.valid)
