"""Magnitude pruning: keep the weights of largest |w|; and the mask rule every backend shares.

Patterns are strings as in sparse/: "2:4" keeps 2 of every 4 consecutive weights along a row
(groups run along in_features, the axis the sparse kernel reduces over); "50%" prunes that
fraction of the weights with no structure.

Unstructured magnitude pruning ranks the whole matrix at once (one threshold per layer), the
classic baseline; Wanda instead ranks within each output row, because its scores multiply in
per-input norms that are only comparable along a row.
"""
import math

import torch
from torch import Tensor

from sparse.format import keep_largest as keep_largest_per_group, parse_pattern


def keep_largest(scores: Tensor, pattern: str, per_row: bool = True) -> Tensor:
    """Boolean keep-mask of `scores`' shape (scores >= 0): the n largest of each m-group for
    "n:m"; for "p%", all but the smallest p% of each row, or of the whole matrix if not per_row."""
    sparsity = parse_pattern(pattern)
    if isinstance(sparsity, tuple):
        return keep_largest_per_group(scores, pattern)
    rows, cols = scores.shape
    if per_row:
        return keep_all_but_smallest(scores, pruned_count(cols, sparsity))
    return keep_all_but_smallest(scores.reshape(1, -1), pruned_count(rows * cols, sparsity)).reshape(rows, cols)


def keep_all_but_smallest(scores: Tensor, n_prune: int) -> Tensor:
    """Keep-mask dropping exactly the n_prune smallest scores of each row (ties broken by position)."""
    drop = scores.argsort(dim=1, stable=True)[:, :n_prune]
    return torch.ones_like(scores, dtype=torch.bool).scatter_(1, drop, False)


def pruned_count(total: int, sparsity: float) -> int:
    """How many of `total` weights an unstructured `sparsity` prunes (floor; the epsilon keeps
    0.29 * 100 = 28.999999999999996 at 29)."""
    return math.floor(total * sparsity + 1e-9)


def magnitude_prune(weight: Tensor, pattern: str) -> tuple[Tensor, Tensor]:
    """Returns (pruned weight, keep mask)."""
    keep = keep_largest(weight.abs().float(), pattern, per_row=False)
    return weight * keep, keep
