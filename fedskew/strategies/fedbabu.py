"""FedBABU server (Oh, Kim & Yun, ICLR'22). Client side: `fedskew/client_app/fedbabu.py`.

The global model is the whole network: the body the clients train, and the head of the run's seeded
initial model, which the server sends every round and never changes. Replies upload the body only
(`expected_upload`: a reply carrying a head is refused); the new global model is the base's
sample-weighted average of the bodies with the sent head unchanged, so no client can move the head.
The authors' `main_fed.py` averages uniformly over equal-size shards, where the two coincide
(`aggregation-weights="uniform"` gives their rule on unequal clients).

Central evaluation scores the global model as it is, body and random head (the paper's accuracy
before fine-tuning); the personalized accuracy comes from each client's fine-tuned copy.
"""

from __future__ import annotations

from flwr.app import ArrayRecord, Message

from fedskew.models import BODY
from fedskew.strategies.base import BaseStrategy


class FedBABUStrategy(BaseStrategy):
    """Average of the uploaded bodies under the fixed initial head."""

    def expected_upload(self, arrays: ArrayRecord) -> dict[str, tuple[tuple[int, ...], str]]:
        """The body's tensors of the model sent this round."""
        return {k: form for k, form in super().expected_upload(arrays).items() if k.startswith(BODY)}

    def aggregate_arrays(self, server_round: int, replies: list[Message]) -> ArrayRecord:
        body = super().aggregate_arrays(server_round, replies)
        return ArrayRecord({k: body[k] if k in body else self.sent_arrays[k] for k in self.sent_arrays.keys()})
