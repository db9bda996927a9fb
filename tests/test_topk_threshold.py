"""topk_threshold.py: the k-th largest value of each row, on CPU under TRITON_INTERPRET=1 (the real
kernels) against torch.topk, exactly; on the GPU (marked) at Llama-3's vocabulary."""
import pytest
import torch

import generate
import topk_threshold
from tests.sparse_kernel_testing import interpreted, rerun_under_interpreter


@pytest.mark.skipif(topk_threshold.INTERPRETING, reason="this is the subprocess")
def test_topk_threshold_under_the_interpreter():
    rerun_under_interpreter(__file__)


def awkward_rows(batch: int, width: int, seed: int) -> torch.Tensor:
    """Random logits with what a threshold must get right: a run of ties across it (row 0), -inf
    entries (row 1), few distinct values (row 2), negative and positive zeros (row 3)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, width, generator=g) * 4
    x[0, 100:400] = 3.5
    if batch > 1:
        x[1, ::3] = float("-inf")
    if batch > 2:
        x[2] = torch.randint(-3, 3, (width,), generator=g).float()
    if batch > 3:
        x[3, : width // 2] = -0.0
        x[3, width // 2:] = 0.0
    return x


@interpreted
@pytest.mark.parametrize("batch,width,k", [(4, 1500, 1), (4, 2100, 16), (2, 4096, 60)])
def test_kth_largest_is_torch_topks_last_value(batch, width, k):
    x = awkward_rows(batch, width, seed=width + k)
    assert topk_threshold.handles(x, k)
    got = topk_threshold.kth_largest(x, k)
    assert got.shape == (batch, 1)
    assert torch.equal(got, torch.topk(x, k).values[:, -1:])


@interpreted
def test_kth_largest_falls_back_to_torch_topk_where_the_kernels_do_not_fit():
    x = awkward_rows(3, 1000, seed=1)
    for k in (40, 300):  # slices narrower than k; k above MAX_K
        assert not topk_threshold.handles(x, k)
        assert torch.equal(topk_threshold.kth_largest(x, k), torch.topk(x, k).values[:, -1:])
    # k = 4 fits slices of 1000 columns: only the dtype, or the stride, rules these out
    strided = awkward_rows(3, 2000, seed=2)[:, ::2]
    assert not topk_threshold.handles(x.double(), 4) and not topk_threshold.handles(strided, 4)
    assert topk_threshold.handles(x, 4) and topk_threshold.handles(strided.contiguous(), 4)


@interpreted
def test_top_k_sampling_keeps_the_same_tokens_with_the_kernel(monkeypatch):
    logits = awkward_rows(2, 2048, seed=7)[:, None, :]  # [B, 1, V] as a decode step's
    top_k, top_k_and_p = (generate.kept_logits(logits, 0.7, 30, top_p) for top_p in (None, 0.9))
    monkeypatch.setattr(generate, "TOPK_KERNEL", True)
    assert torch.equal(generate.kept_logits(logits, 0.7, 30), top_k)
    assert torch.equal(generate.kept_logits(logits, 0.7, 30, 0.9), top_k_and_p)  # top-p: torch.topk, sorted


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("batch", [1, 8])
def test_gpu_kth_largest_at_llama3s_vocabulary(batch):
    x = awkward_rows(batch, 128256, seed=batch).cuda()
    for k in (1, 50, 200, 256):
        assert torch.equal(topk_threshold.kth_largest(x, k), torch.topk(x, k).values[:, -1:]), k
    compiled = torch.compile(lambda logits: topk_threshold.kth_largest(logits, 200), fullgraph=True)
    assert torch.equal(compiled(x), torch.topk(x, 200).values[:, -1:])
