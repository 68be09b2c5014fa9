"""Pure torch losses of the label-skew methods (no Flower); each docstring gives the equation."""

from fedskew.losses.map import (
    distillation_loss,
    hpm_momentum,
    hpm_update,
    mmd_multi_gaussian,
    personalization_loss,
)
from fedskew.losses.proximal import proximal_term
from fedskew.losses.restricted_softmax import fedrs_scale, restricted_softmax_cross_entropy

__all__ = [
    "distillation_loss",
    "fedrs_scale",
    "hpm_momentum",
    "hpm_update",
    "mmd_multi_gaussian",
    "personalization_loss",
    "proximal_term",
    "restricted_softmax_cross_entropy",
]
