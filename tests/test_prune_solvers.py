"""The three pruning backends on one weight matrix: exact patterns, error ordering, and SparseGPT
against a float64 OBS reference written from the definition (no Cholesky, no lazy batching)."""
import math

import pytest
import torch

from prune.magnitude import magnitude_prune
from prune.sparsegpt import sparsegpt_prune
from prune.wanda import wanda_prune

PATTERNS = ["2:4", "4:8", "8:16", "16:32", "50%", "60%"]


def calibration_inputs(n_features=256, n_tokens=2048, seed=0):
    """LLM-like layer inputs: correlated features, a few outlier channels with large norms."""
    g = torch.Generator().manual_seed(seed)
    mixing = torch.eye(n_features, dtype=torch.float64) + 0.3 * torch.randn(n_features, n_features, generator=g,
                                                                              dtype=torch.float64) / n_features ** 0.5
    scales = torch.rand(n_features, generator=g, dtype=torch.float64) * 2 + 0.1
    scales[torch.randperm(n_features, generator=g)[:8]] *= 10
    return scales[:, None] * (mixing @ torch.randn(n_features, n_tokens, generator=g, dtype=torch.float64))


def prune_all(weight, X, pattern):
    H = 2 * X @ X.T / X.shape[1]
    return {
        "sparsegpt": sparsegpt_prune(weight, H, pattern),
        "wanda": wanda_prune(weight, (X * X).sum(1), pattern),
        "magnitude": magnitude_prune(weight, pattern),
    }


@pytest.mark.parametrize("pattern", PATTERNS)
def test_every_backend_meets_the_pattern_exactly(pattern):
    X = calibration_inputs()
    weight = torch.randn(96, 256, dtype=torch.float64)
    for method, (pruned, keep) in prune_all(weight, X, pattern).items():
        assert keep.dtype == torch.bool and keep.shape == weight.shape
        assert (pruned[~keep] == 0).all(), method
        if ":" in pattern:
            n, m = map(int, pattern.split(":"))
            assert (keep.reshape(96, -1, m).sum(-1) == n).all(), method
        else:
            sparsity = float(pattern[:-1]) / 100
            if method == "wanda":  # per output row
                assert (keep.sum(1) == 256 - math.floor(256 * sparsity)).all()
            else:  # per layer
                assert keep.sum() == weight.numel() - math.floor(weight.numel() * sparsity + 1e-9)
        if method != "sparsegpt":  # without weight updates the kept weights are the original ones
            assert torch.equal(pruned[keep], weight[keep]), method


@pytest.mark.parametrize("pattern", ["2:4", "4:8", "16:32", "50%"])
def test_reconstruction_error_sparsegpt_below_wanda_below_magnitude(pattern):
    X = calibration_inputs(seed=1)
    weight = torch.randn(128, 256, dtype=torch.float64)
    errors = {method: ((weight - pruned) @ X).norm().item()
              for method, (pruned, _) in prune_all(weight, X, pattern).items()}
    assert errors["sparsegpt"] < errors["wanda"] < errors["magnitude"], errors


def obs_reference(weight, H, pattern, damp_fraction=0.01):
    """SparseGPT from its definition, in float64: walk the columns left to right; a pruned weight
    w_j is removed with the OBS update of the not-yet-frozen columns j.. (inverse of H restricted to
    them); an m-group's mask is chosen at its first column by w^2 / [H_F^-1]_kk."""
    W = weight.double().clone()
    H = H.double() + damp_fraction * torch.diagonal(H).mean() * torch.eye(H.shape[0], dtype=torch.float64)
    n, m = map(int, pattern.split(":"))
    cols = W.shape[1]
    diag_of_inverse = torch.tensor([torch.linalg.inv(H[k:, k:])[0, 0] for k in range(cols)], dtype=torch.float64)
    keep = torch.zeros_like(W, dtype=torch.bool)
    for j in range(cols):
        if j % m == 0:
            scores = W[:, j:j + m] ** 2 / diag_of_inverse[j:j + m]
            keep[:, j:j + m].scatter_(1, scores.topk(n, dim=1).indices, True)
        Hinv = torch.linalg.inv(H[j:, j:])
        pruned_rows = ~keep[:, j]
        W[pruned_rows, j:] -= (W[pruned_rows, j] / Hinv[0, 0])[:, None] * Hinv[0][None, :]
        W[pruned_rows, j] = 0
    return W, keep


@pytest.mark.parametrize("blocksize", [8, 64])
def test_sparsegpt_matches_the_obs_definition(blocksize):
    X = calibration_inputs(n_features=48, n_tokens=512, seed=2)
    weight = torch.randn(20, 48, dtype=torch.float64)
    H = 2 * X @ X.T / X.shape[1]
    pruned, keep = sparsegpt_prune(weight, H, "2:4", blocksize=blocksize)
    expected, expected_keep = obs_reference(weight, H, "2:4")
    assert torch.equal(keep, expected_keep)
    torch.testing.assert_close(pruned, expected, rtol=1e-9, atol=1e-9)


def test_sparsegpt_survives_dead_inputs():
    X = calibration_inputs(n_features=64, n_tokens=256, seed=3)
    X[[3, 17, 40]] = 0  # inputs that never fired during calibration
    weight = torch.randn(32, 64)
    H = (2 * X @ X.T / X.shape[1]).float()
    for pattern in ("2:4", "50%"):
        pruned, keep = sparsegpt_prune(weight, H, pattern)
        assert torch.isfinite(pruned).all()
        assert (pruned[:, [3, 17, 40]] == 0).all()  # they carry nothing, so they are pruned first
        assert pruned.dtype == weight.dtype


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("pattern", ["2:4", "50%"])
def test_sparsegpt_on_cuda_matches_the_cpu(pattern):
    X = calibration_inputs(n_features=512, n_tokens=4096, seed=4)
    weight = torch.randn(384, 512, dtype=torch.float64)
    H = 2 * X @ X.T / X.shape[1]
    expected, expected_keep = sparsegpt_prune(weight, H, pattern)
    pruned, keep = sparsegpt_prune(weight.cuda(), H.cuda(), pattern)
    assert torch.equal(keep.cpu(), expected_keep)  # float64 either way: no near-ties to flip
    torch.testing.assert_close(pruned.cpu(), expected, rtol=1e-6, atol=1e-6)
