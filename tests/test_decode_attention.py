"""decode_attention.py: the decode-step attention kernels, on CPU under TRITON_INTERPRET=1 (the
real kernels) against float64 softmax attention, and on the GPU (marked `gpu`) on Llama-3.1-8B's
shape, eagerly and inside a compiled model."""
import pytest
import torch

import decode_attention
from sparse import kernels
from tests.sparse_kernel_testing import case_seed, interpreted, relative_error, rerun_under_interpreter


@pytest.mark.skipif(kernels.INTERPRETING, reason="this is the subprocess")
def test_decode_attention_under_the_interpreter():
    rerun_under_interpreter(__file__)


def reference_attention(q, k_cache, v_cache, keep):
    """float64 softmax(q K^T / sqrt(D)) V with K/V repeated over each group of query heads."""
    group = q.shape[1] // k_cache.shape[1]
    k = k_cache.double().repeat_interleave(group, dim=1)
    v = v_cache.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("bhd,bhsd->bhs", q.double(), k) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~keep[:, None, :], float("-inf"))
    return torch.einsum("bhs,bhsd->bhd", scores.softmax(-1), v)


def random_case(batch, n_heads, n_kv_heads, n_slots, head_dim, position, pads, dtype, device="cpu", seed=0):
    """A cache of n_slots slots of which each row attends [pad, position] (left padding + causal)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, n_heads, head_dim, generator=g).to(device=device, dtype=dtype)
    k = torch.randn(batch, n_kv_heads, n_slots, head_dim, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(batch, n_kv_heads, n_slots, head_dim, generator=g).to(device=device, dtype=dtype)
    slots = torch.arange(n_slots)
    keep = (slots[None, :] <= position) & (slots[None, :] >= torch.tensor(pads)[:, None])
    return q, k, v, keep.to(device)


# (batch, heads, kv heads, slots, head_dim, position, left pads): Llama's GQA group of 4, SmolLM2's
# 3 (not a power of two), plain multi-head; a position inside the first block; slots not a
# multiple of the block; a row whose first blocks are all padding.
CASES = [(1, 8, 2, 96, 16, 70, [0]), (2, 9, 3, 50, 32, 3, [0, 2]), (2, 4, 4, 200, 16, 150, [0, 100])]


@interpreted
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_decode_attention_matches_float64(case, dtype, bound):
    q, k, v, keep = random_case(*case, dtype=dtype, seed=case_seed(case))
    out = decode_attention.decode_attention(q, k, v, keep)
    assert out.shape == q.shape and out.dtype == dtype
    assert relative_error(out, reference_attention(q, k, v, keep)) < bound


@interpreted
def test_decode_attention_splits_over_slots(monkeypatch):
    # Few programs wanted -> many slots per split; many wanted -> one block per split.
    q, k, v, keep = random_case(1, 8, 2, 160, 16, 140, [0], torch.float32, seed=3)
    reference = reference_attention(q, k, v, keep)
    for target in (1, 1000):
        monkeypatch.setattr(decode_attention, "PROGRAMS_TARGET", target)
        assert relative_error(decode_attention.decode_attention(q, k, v, keep), reference) < 1e-5


# ---------------------------------------------------------------- GPU

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("batch,position", [(1, 0), (1, 767), (4, 600)])
def test_gpu_decode_attention_llama_shape(batch, position):
    q, k, v, keep = random_case(batch, 32, 8, 768, 128, position, [0, 5, 300, 0][:batch], torch.bfloat16,
                                device="cuda", seed=position)
    out = decode_attention.decode_attention(q, k, v, keep)
    assert relative_error(out, reference_attention(q, k, v, keep)) < 1e-2


@pytest.mark.gpu
@needs_cuda
def test_gpu_model_decode_matches_sdpa(monkeypatch):
    # A model whose decode steps go through the kernels, against the same model on SDPA, with a
    # batch of prompts of different lengths (left padding), eagerly and compiled.
    import generate
    from model import ModelArgs, Transformer

    torch.manual_seed(0)
    model = Transformer(ModelArgs(block_size=128, vocab_size=64, n_layer=2, n_head=8, n_local_heads=2, dim=512,
                                  intermediate_size=256)).cuda().eval()
    prompts = [torch.randint(0, 64, (n,)) for n in (5, 17)]
    with monkeypatch.context() as patch:
        patch.setattr(decode_attention, "supports", lambda head_dim: False)
        reference = generate.generate(model, prompts, 20)
    for compile in (False, True):
        result = generate.generate(model, prompts, 20, compile=compile)
        assert all(torch.equal(a, b) for a, b in zip(result.sequences, reference.sequences)), compile
