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
