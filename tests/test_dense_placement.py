"""scripts/dense_placement.py: the move of a model's weights to fresh storage (CPU; the timing
itself needs a GPU, docs/BENCHMARKS.md session 18)."""
import torch

from scripts import dense_placement
from tests.evaluation_tiny_models import tiny_model


def test_every_weight_and_buffer_moves_and_keeps_its_values():
    model = tiny_model()
    model.setup_caches(1, 32)
    tensors = list(model.parameters()) + list(model.buffers())
    before = [(t, t.data_ptr(), t.detach().clone()) for t in tensors]
    dense_placement.move_to_fresh_storage(model)
    for tensor, address, values in before:
        assert tensor.data_ptr() != address  # new storage ...
        assert torch.equal(tensor, values)  # ... same values, same tensor object (the module still holds it)
    assert all(a is b for a, b in zip(tensors, list(model.parameters()) + list(model.buffers())))


def test_one_allocation_holds_every_tensor_on_its_own_aligned_start():
    model = tiny_model()
    model.setup_caches(1, 32)
    tensors = list(model.parameters()) + list(model.buffers())
    values = [t.detach().clone() for t in tensors]
    arena = dense_placement.move_to_one_allocation(model, align=4096)
    base = arena.data_ptr()
    spans = sorted((t.data_ptr() - base, t.numel() * t.element_size()) for t in tensors)
    assert all(t.untyped_storage().data_ptr() == base for t in tensors)
    assert all(start % 4096 == 0 for start, _ in spans)
    assert all(start + size <= next_start for (start, size), (next_start, _) in zip(spans, spans[1:]))  # no overlap
    assert all(torch.equal(t, v) for t, v in zip(tensors, values))
    logits = model(torch.tensor([[1, 2, 3]]), torch.arange(3))
    assert torch.isfinite(logits).all()  # the model runs on the views
