"""Pure torch losses of the label-skew methods (no Flower); each docstring gives the equation."""

from fedskew.losses.proximal import proximal_term
from fedskew.losses.restricted_softmax import fedrs_scale, restricted_softmax_cross_entropy

__all__ = ["fedrs_scale", "proximal_term", "restricted_softmax_cross_entropy"]
