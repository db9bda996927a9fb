"""sparse/kernels.py: the real Triton kernels, on CPU under TRITON_INTERPRET=1, against float64.

The interpreter must be switched on before Triton decorates the kernels, and other test modules
import `sparse` first; so the checks run in a fresh Python process (the first test), where this
module is imported with TRITON_INTERPRET=1 already set.
"""
import pytest
import torch

from sparse import kernels
from sparse.format import unpack
from tests.sparse_kernel_testing import case_seed, interpreted, random_packed, relative_error, rerun_under_interpreter

PATTERNS = ["2:4", "4:8", "8:16", "16:32", "1:4"]


@pytest.mark.skipif(kernels.INTERPRETING, reason="this is the subprocess")
def test_kernels_under_the_interpreter():
    rerun_under_interpreter(__file__)


# Every pattern at batch 1 and 3 (padded to 4 lanes); wider batches on two patterns (the
# interpreter is slow on them).
CASES = [(p, b) for p in PATTERNS for b in (1, 3)] + [("2:4", 16), ("16:32", 8), ("4:8", 4)]


@interpreted
@pytest.mark.parametrize("pattern,batch", CASES)
def test_spmv_matches_float64(pattern, batch):
    # 37 rows: not a multiple of the 32-row tile. 96 columns = 3 words, split 2 + 1 words per
    # program: in_features a multiple of 32 but not of the split-K tile.
    seed = case_seed(pattern, batch)
    values, mask = random_packed(37, 96, pattern, seed)
    reference_weight = unpack(values, mask).double()
    # (rows per thread, warps, split, words per step): one word per step; a 2-word step whose
    # second word is past the end; a split of 2 words in 2 steps; 4 words covering all 3.
    configs = [(1, 1, 1, 1), (1, 1, 2, 2), (1, 1, 2, 1)] + ([(2, 1, 3, 1), (1, 1, 1, 4)] if batch == 1 else [])
    for config in configs:
        x = torch.randn(batch, 96, generator=torch.Generator().manual_seed(seed + config[2] + 10 * config[3]))
        lanes = 1 << (batch - 1).bit_length()
        out = torch.full((lanes, 37), float("nan"))  # poisoned: an unwritten element fails
        y = kernels.spmv(x, values, mask, config=config, out=out)
        assert y.shape == (batch, 37)
        assert relative_error(y, x.double() @ reference_weight.T) < 1e-6, config
        workspace, arrivals = kernels._workspace(x.device, 0, 0)
        assert not workspace.any() and not arrivals.any(), "split-K must leave its workspace zeroed"


@interpreted
def test_spmv_bfloat16():
    values, mask = random_packed(40, 64, "2:4", 7)
    values = values.bfloat16()
    x = torch.randn(1, 64).bfloat16()
    y = kernels.spmv(x, values, mask, config=(1, 1, 2, 1))
    assert y.dtype == torch.bfloat16
    assert relative_error(y, x.double() @ unpack(values, mask).double().T) < 1e-2


@interpreted
@pytest.mark.parametrize("pattern", ["2:4", "16:32", "1:4"])
def test_unpack_to_dense_matches_unpack(pattern):
    values, mask = random_packed(37, 160, pattern, 3)  # 5 words: the last program is half full
    out = torch.full((37, 160), float("nan"))
    assert torch.equal(kernels.unpack_to_dense(values, mask, out=out), unpack(values, mask))


@interpreted
def test_sparse_linear_dispatch_under_interpreter():
    from sparse import SparseLinear
    layer = SparseLinear.from_dense(torch.randn(24, 64), "4:8")
    dense = unpack(layer.values, layer.mask).double()
    for rows in [1, 5, 17]:  # spmv, small batch, prefill (dense expansion + F.linear)
        x = torch.randn(1, rows, 64)
        assert relative_error(layer(x), x.double() @ dense.T) < 1e-6
