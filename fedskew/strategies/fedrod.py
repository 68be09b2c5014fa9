"""FedRoD server (Chen & Chao, ICLR'22). Client side: `fedskew/client_app/fedrod.py`.

The server averages the uploaded body and generic head (the base's sample-weighted FedAvg) and
evaluates that generic model centrally: FedRoD's generic accuracy, read directly (FedGELA, Sec. 5).
The personalized heads never leave the clients.
"""

from __future__ import annotations

from fedskew import wire
from fedskew.strategies.base import BaseStrategy


class FedRoDStrategy(BaseStrategy):
    """FedAvg of body + generic head; the personalized heads stay on the clients."""

    wire = wire.FEDROD
