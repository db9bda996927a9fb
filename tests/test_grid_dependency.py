"""grid_dependency.py: programmatic dependent launch between the SpMV and attention kernels.

Whether the compiled kernels issue the release, the weight loads and the wait in that order is
checked in their machine code (test_kernel_sass.py); here, that it is switched on only where it
can run, and on the GPU that a decode step launched this way reads nothing stale."""
import pytest
import torch

import generate
import grid_dependency
from tests.sparse_kernel_testing import relative_error, sparse_model_and_float64_reference

needs_hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                                  reason="programmatic dependent launch needs a CUDA GPU of compute capability 9.0+")


def test_grid_dependent_launch_only_when_switched_on_and_only_on_a_gpu(monkeypatch):
    monkeypatch.setattr(grid_dependency, "GRID_DEPENDENT_LAUNCH", True)
    assert not grid_dependency.grid_dependent(torch.device("cpu"))
    monkeypatch.setattr(grid_dependency, "GRID_DEPENDENT_LAUNCH", False)
    if torch.cuda.is_available():
        assert not grid_dependency.grid_dependent(torch.device("cuda"))


@pytest.mark.gpu
@needs_hopper
@torch.no_grad()
def test_gpu_grid_dependent_decode_step_replayed_in_a_cuda_graph_matches_float64(monkeypatch):
    """Every kernel of the step waits for the one ahead before reading; were a read to slip above
    its wait, back-to-back replays of the graph would read a layer's input half-written."""
    monkeypatch.setattr(grid_dependency, "GRID_DEPENDENT_LAUNCH", True)
    assert grid_dependency.grid_dependent(torch.device("cuda"))
    model, reference, token = sparse_model_and_float64_reference(1, "cuda", torch.bfloat16)
    position = torch.tensor([5], device="cuda")
    expected = reference(token, torch.tensor([5]))
    static_token = token.cuda()
    model(static_token, position)  # tunes the SpMVs eagerly, outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = model(static_token, position)
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    assert relative_error(logits.float().cpu(), expected) < 3e-2


@pytest.mark.gpu
@needs_hopper
def test_gpu_grid_dependent_compiled_decode_of_a_sparse_model_matches_eager(monkeypatch):
    import sparse
    from model import ModelArgs, Transformer

    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=64, n_layer=2, n_head=4, n_local_heads=2, intermediate_size=96, vocab_size=50,
                                  block_size=64)).eval()
    model = sparse.swap_to_sparse(model, "2:4").cuda()
    prompts = [torch.randint(0, 50, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 9)]
    eager = generate.generate(model, prompts, 24)
    monkeypatch.setattr(grid_dependency, "GRID_DEPENDENT_LAUNCH", True)
    compiled = generate.generate(model, prompts, 24, compile=True)
    assert all(torch.equal(a, b) for a, b in zip(eager.sequences, compiled.sequences))
