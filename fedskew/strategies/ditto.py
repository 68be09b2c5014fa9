"""Ditto server (Li, Hu, Beirami & Smith, ICML'21, Alg. 1). Client side: `fedskew/client_app/ditto.py`.

Ditto's global model is the global objective's, here FedAvg's: the server averages the uploaded
global updates w_k^t (the base's sample-weighted aggregation; the authors' code, `litian96/ditto` at
26d9b29a62f3872dcdf071be08e897607c283bb4, averages the updates uniformly, `simple_average`:
`aggregation-weights="uniform"`) and is evaluated centrally like FedAvg's. The
personal models v_k never leave the clients; the server logs the mean of their distances to the
round's w^t (`ditto-distance`) and of their objective (`ditto-loss`).
"""

from __future__ import annotations

from fedskew.strategies.base import BaseStrategy


class DittoStrategy(BaseStrategy):
    """FedAvg on the uploaded global updates; the personal models stay on the clients."""
