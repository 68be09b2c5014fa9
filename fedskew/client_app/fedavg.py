"""FedAvg client (McMahan et al., AISTATS'17, Alg. 1 "ClientUpdate"): E local epochs of mini-batch
SGD on cross-entropy from the global model, whose result is uploaded. The personalized model is the
locally trained model ("FedAvg-FT" in reports). Server side: `fedskew/strategies/fedavg.py`.

All of it is the base trainer's default (`fedskew/client_app/base.py`), its functional loss too: the
batched engine trains its clients as one stacked model.
"""

from fedskew.client_app.base import BaseTrainer


class FedAvgTrainer(BaseTrainer):
    """Trains the global model with cross-entropy; the personalized model is the trained model."""

    batched = True
