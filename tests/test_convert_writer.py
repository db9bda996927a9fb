"""convert/writer.py: the HF-name mapping covers our state dict exactly, and the q/k row permutation
rotates like interleaved RoPE."""
import pytest
import torch

from convert.writer import hf_sources, interleaved_to_half
from model import ModelArgs, Transformer


@pytest.mark.parametrize("name", ["Llama-2-7b", "Llama-3.2-1B", "Qwen3-0.6B", "Qwen3-8B"])
def test_hf_sources_cover_exactly_our_state_dict(name):
    config = ModelArgs.from_name(name)
    with torch.device("meta"):
        keys = set(Transformer(config).state_dict())
    assert set(hf_sources(config)) | ({"output.weight"} if config.tie_embeddings else set()) == keys


def test_interleaved_to_half_pairs_rotate_like_interleaved_rope():
    """Rotating interleaved pairs of x·W equals rotating halves of x·W' with W' = interleaved_to_half(W)."""
    n_heads, head_dim, dim = 2, 8, 5
    weight, x = torch.randn(n_heads * head_dim, dim, dtype=torch.float64), torch.randn(dim, dtype=torch.float64)
    angles = torch.rand(head_dim // 2, dtype=torch.float64) * 6
    pairs = (weight @ x).view(n_heads, head_dim // 2, 2)
    interleaved = torch.stack([pairs[..., 0] * angles.cos() - pairs[..., 1] * angles.sin(),
                               pairs[..., 0] * angles.sin() + pairs[..., 1] * angles.cos()], dim=-1)
    halves = (interleaved_to_half(weight, n_heads) @ x).view(n_heads, 2, head_dim // 2)
    rotated = torch.stack([halves[:, 0] * angles.cos() - halves[:, 1] * angles.sin(),
                           halves[:, 0] * angles.sin() + halves[:, 1] * angles.cos()], dim=1)
    torch.testing.assert_close(rotated, interleaved.transpose(1, 2))
