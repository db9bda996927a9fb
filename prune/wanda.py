"""Wanda (Sun et al., 2023): score each weight by |W_ij| · ||X_j||_2, the size of its contribution
to the output on the calibration inputs, and drop the smallest, without any weight update.

The scores are compared within each output row (unstructured) or within each m-group (N:M):
each row's output is reconstructed on its own, so ranking across rows would mix scales.
"""
from torch import Tensor

from prune.magnitude import keep_largest


def wanda_prune(weight: Tensor, input_sq_norms: Tensor, pattern: str) -> tuple[Tensor, Tensor]:
    """input_sq_norms: (in_features,) sum over calibration tokens of x_j^2. Returns (pruned weight, keep mask)."""
    scores = weight.abs().float() * input_sq_norms.float().sqrt()[None, :]
    keep = keep_largest(scores, pattern, per_row=True)
    return weight * keep, keep
