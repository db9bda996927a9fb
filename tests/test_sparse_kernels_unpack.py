"""sparse/kernels/unpack.py: the expansion to dense, on CPU under TRITON_INTERPRET=1 (the real
kernel, in a subprocess: tests/sparse_kernel_testing.py) against sparse.format.unpack, and on the GPU
(marked `gpu`)."""
import pytest
import torch

from sparse.format import unpack
from sparse.kernels.unpack import unpack_to_dense
from tests.sparse_kernel_testing import interpreted, random_packed


@interpreted
@pytest.mark.parametrize("pattern", ["2:4", "16:32", "1:4", "1:32"])
def test_unpack_to_dense_matches_unpack(pattern):
    values, mask = random_packed(37, 160, pattern, 3)  # 5 words: the last program is half full
    out = torch.full((37, 160), float("nan"))
    assert torch.equal(unpack_to_dense(values, mask, out=out), unpack(values, mask))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("pattern", ["2:4", "16:32", "1:4", "1:8", "1:16", "1:32"])  # 16, 16, 8, 4, 2, 1 a word
def test_gpu_unpack_to_dense_matches_unpack(pattern):
    # The prefill's expansion, compiled for the GPU (16-byte loads, shuffles): a real shape and a
    # ragged one (100 rows, 11 words: neither a multiple of a program's 64 rows nor of its 4 words).
    for out_features, in_features in [(6144, 4096), (100, 352)]:
        values, mask = random_packed(out_features, in_features, pattern, 7, device="cuda", dtype=torch.bfloat16)
        out = torch.full((out_features, in_features), float("nan"), device="cuda", dtype=torch.bfloat16)
        assert torch.equal(unpack_to_dense(values, mask, out=out), unpack(values, mask)), (out_features, pattern)
