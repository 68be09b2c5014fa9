"""FedRoD server (Chen & Chao, ICLR'22). Client side: `fedskew/client_app/fedrod.py`.

The server averages the uploaded body and generic head (the base's sample-weighted FedAvg) and
evaluates that generic model centrally: FedRoD's generic accuracy, read directly (FedGELA, Sec. 5).
The personalized heads never leave the clients.

`global-accuracy`: the generic model (body + G-head, argmax of its plain logits, no prior shift) on
the central test set (`load_test_set`: the official split, balanced on Fashion-MNIST), as every
method's global model.
"""

from __future__ import annotations

from fedskew.strategies.base import BaseStrategy


class FedRoDStrategy(BaseStrategy):
    """FedAvg of body + generic head; the personalized heads stay on the clients."""
