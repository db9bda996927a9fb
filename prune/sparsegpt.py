"""SparseGPT (Frantar & Alistarh, 2023): prune one linear layer so that its outputs on the
calibration inputs change as little as possible, in one pass over the columns.

With H = 2 X X^T / n (X: the layer's inputs, one column per calibration token), removing weight
w_q of a row and optimally re-fitting that row's remaining weights costs w_q^2 / [H^-1]_qq (OBS).
SparseGPT walks the columns left to right; when a column's pruned weights are removed, the error
is spread over the columns to its right through the row of the upper Cholesky factor U of H^-1
(U^T U = H^-1), which equals the OBS update after all earlier columns have been frozen. Updates
are applied lazily: inside a block of `blocksize` columns immediately, to the rest of the matrix
once per block (one matmul), which is what makes it fast.

Mask choice: for N:M, the m-group starting at each column is decided when the walk reaches it,
from the updated weights (score w^2 / U_jj^2, keep the n largest); unstructured sparsity picks a
threshold per block of columns over all rows (as in the paper), with per-block counts chosen so
that the whole matrix ends up with exactly the requested number of zeros.
"""
import torch
from torch import Tensor

from prune.magnitude import keep_all_but_smallest, keep_largest, pruned_count
from sparse.format import parse_pattern


def sparsegpt_prune(weight: Tensor, hessian: Tensor, pattern: str, blocksize: int = 128,
                    damp_fraction: float = 0.01) -> tuple[Tensor, Tensor]:
    """weight (out, in); hessian (in, in) = 2 X X^T / n. Computes in hessian's dtype (float32 or
    float64). Returns (pruned weight in weight's dtype, keep mask)."""
    rows, cols = weight.shape
    sparsity = parse_pattern(pattern)
    group = sparsity[1] if isinstance(sparsity, tuple) else 0  # m of n:m; 0 for unstructured
    if group and blocksize % group:
        raise ValueError(f"blocksize {blocksize} must be a multiple of m={group}")
    W = weight.to(hessian.dtype).clone()
    H = hessian.clone()
    # Inputs that were always zero carry no information: their weights can go (they never
    # contributed), and a unit diagonal keeps H invertible.
    dead = torch.diagonal(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H.diagonal().add_(damp_fraction * torch.diagonal(H).mean())
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)

    keep = torch.ones(rows, cols, dtype=torch.bool, device=W.device)
    pruned_so_far = 0
    for start in range(0, cols, blocksize):
        end = min(start + blocksize, cols)
        Wb, Ub, keep_b = W[:, start:end].clone(), U[start:end, start:end], keep[:, start:end]
        Ub_diag = torch.diagonal(Ub)
        # err_j = w_j * drop_scale_j: the pruned weight over U_jj (zero where the weight stays).
        drop_scale = torch.zeros_like(Wb)
        errors = torch.empty_like(Wb)
        if not group:
            n_prune = pruned_count(rows * end, sparsity) - pruned_so_far
            pruned_so_far += n_prune
            scores = Wb.pow(2) / Ub_diag.pow(2)[None, :]
            keep_b[:] = keep_all_but_smallest(scores.reshape(1, -1), n_prune).reshape(scores.shape)
            drop_scale[:] = ~keep_b / Ub_diag
        # The walk is inherently one column at a time; on a GPU its cost is the kernel launches
        # per column (two here, plus the group's mask choice every m columns), not arithmetic.
        for j in range(end - start):
            if group and j % group == 0:
                g = slice(j, j + group)
                keep_b[:, g] = keep_largest(Wb[:, g].pow(2) / Ub_diag[g].pow(2)[None, :], pattern)
                drop_scale[:, g] = ~keep_b[:, g] / Ub_diag[g]
            torch.mul(Wb[:, j], drop_scale[:, j], out=errors[:, j])
            Wb[:, j + 1:].addr_(errors[:, j], Ub[j, j + 1:], alpha=-1)
        # Column j is never read again after its step, so its pruned weights are zeroed here.
        W[:, start:end] = Wb * keep_b
        W[:, end:].addmm_(errors, U[start:end, end:], alpha=-1)
    return W.to(weight.dtype), keep
