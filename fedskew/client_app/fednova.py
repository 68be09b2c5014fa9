"""FedNova client (Wang et al., NeurIPS'20): FedAvg's local training with the common `sgd`, whose
model is uploaded; the normalisation by the client's a_i happens on the server
(`fedskew/strategies/fednova.py`), which computes the client's step count itself. Personalized
model: the locally trained model. The batched engine stacks its clients (FedAvg's functional loss).
"""

from fedskew.client_app.base import BaseTrainer


class FedNovaTrainer(BaseTrainer):
    """Plain local training; nothing beyond the model is sent."""

    batched = True
