"""sparse/kernels/decode_attention.py: the decode-step attention kernel (RoPE, q/k norms and the KV
write inside), on CPU under TRITON_INTERPRET=1 (the real kernel, in a subprocess:
tests/sparse_kernel_testing.py) against model.apply_rope / model.RMSNorm and float64 softmax
attention; its sm_90a machine code (compiled on the CPU); and on the GPU (marked `gpu`) on
Llama-3.1-8B's and Qwen3-32B's heads."""
import pytest
import torch

from sparse.kernels import common, decode_attention
from tests import sass
from tests.sparse_kernel_testing import interpreted, relative_error


def reference_attention(q, k_cache, v_cache, keep):
    """float64 softmax(q K^T / sqrt(D)) V with K/V repeated over each group of query heads."""
    group = q.shape[1] // k_cache.shape[1]
    k = k_cache.double().repeat_interleave(group, dim=1)
    v = v_cache.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("bhd,bhsd->bhs", q.double(), k) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~keep[:, None, :], float("-inf"))
    return torch.einsum("bhs,bhsd->bhd", scores.softmax(-1), v)


def assert_arrivals_zeroed():
    """The merge must leave its counters as it found them: the next layer reuses them."""
    assert all(not counters.any() for counters in decode_attention.arrival_counters.values())


def test_block_loop_stages_pipelines_only_splits_of_several_blocks(monkeypatch):
    monkeypatch.setattr(decode_attention, "PIPELINE_STAGES", 2)
    monkeypatch.setattr(decode_attention, "BLOCK_SLOTS", 64)
    assert [decode_attention.block_loop_stages(slots) for slots in (64, 128, 4096)] == [1, 2, 2]


def rotated(x, cos, sin):
    """model.apply_rope for x [B, H, D] and one position per row (cos, sin [B, D])."""
    from model import apply_rope
    return apply_rope(x[:, None], cos[:, None], sin[:, None])[:, 0]


def rope_and_write_case(batch, cache_rows, n_heads, n_kv_heads, n_slots, head_dim, position, pads, dtype,
                        device="cpu", qk_norm=False):
    """decode_attention_with_cache_write's arguments: the unrotated heads of `batch` rows, one qkv
    row each as Attention.forward makes it; the RoPE tables; the left padding of `cache_rows` >=
    batch rows, as the model's buffer holds it; the new token's slot; caches of `cache_rows` rows;
    with qk_norm, Qwen3's q and k norm weights and epsilon."""
    from model import precompute_rope
    g = torch.Generator().manual_seed(position + 17 * batch)
    heads = torch.randn(batch, n_heads + 2 * n_kv_heads, head_dim, generator=g).to(device=device, dtype=dtype)
    caches = [torch.randn(cache_rows, n_kv_heads, n_slots, head_dim, generator=g).to(device=device, dtype=dtype)
              for _ in range(2)]
    cos, sin = precompute_rope(n_slots, head_dim, 500000.0)
    left_pad = torch.tensor(pads + [0] * (cache_rows - batch), device=device)
    norms = ()
    if qk_norm:  # weights away from 1, so that a weight applied to the wrong dims shows
        norms = (*(torch.rand(head_dim, generator=g).add(0.5).to(device=device, dtype=dtype) for _ in range(2)), 1e-6)
    return (heads, cos.to(device), sin.to(device), left_pad, torch.tensor([position], device=device), *caches, *norms)


def rows_rope_and_keep(args, batch):
    """What model.forward gives SDPA for the same step: each row's cos/sin at its own position
    (slot - pad) and the causal mask's row with the padding masked."""
    _, cos, sin, left_pad, write_slot, k_cache = args[:6]
    pad = left_pad[:batch].cpu()
    position = int(write_slot)
    rows = (position - pad).clamp(min=0)
    slots = torch.arange(k_cache.shape[2])
    keep = (slots[None, :] <= position) & (slots[None, :] >= pad[:, None])
    return cos[rows.to(cos.device)], sin[rows.to(cos.device)], keep.to(k_cache.device)


# (batch, cache rows, heads, kv heads, slots, head_dim, position, left pads): a batch smaller than
# the cache, the new slot in a later split with padding in front (a whole 64-slot block of it in
# row 1); the first slot; GQA of 3 (with Qwen3's q/k norms).
ROPE_CASES = [(2, 3, 8, 2, 160, 32, 140, [0, 70]), (1, 1, 4, 4, 64, 16, 0, [0]), (2, 2, 9, 3, 50, 16, 33, [0, 2])]


def check_rope_and_cache_write(case, dtype, bound, device="cpu", qk_norm=False):
    """decode_attention_with_cache_write against model.RMSNorm (qk_norm) and model.apply_rope, the
    cache written as KVCache.update writes it, and float64 attention; every other slot and row of
    the caches must stay as it was."""
    from model import RMSNorm
    batch, position = case[0], case[6]
    args = rope_and_write_case(*case, dtype=dtype, device=device, qk_norm=qk_norm)
    heads, k_cache, v_cache = args[0], args[5], args[6]
    q, new_k, new_v = decode_attention.split_heads(heads, k_cache)
    if qk_norm:
        q_weight, k_weight, eps = args[7:]
        q_norm, k_norm = RMSNorm(q.shape[-1], eps).to(device, dtype), RMSNorm(q.shape[-1], eps).to(device, dtype)
        q_norm.weight.data.copy_(q_weight)
        k_norm.weight.data.copy_(k_weight)
        with torch.no_grad():
            q, new_k = q_norm(q), k_norm(new_k)
    cos, sin, keep = rows_rope_and_keep(args, batch)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected_k[:batch, :, position] = rotated(new_k, cos, sin)
    expected_v[:batch, :, position] = new_v
    reference = reference_attention(rotated(q, cos, sin), expected_k[:batch], expected_v[:batch], keep)
    out = decode_attention.decode_attention_with_cache_write(*args)
    assert relative_error(out, reference) < bound
    assert torch.equal(v_cache, expected_v)
    # The rotated k is rounded from fp32 once either way (the norm adds RMSNorm's two roundings in
    # front); the interpreter truncates bf16, the GPU rounds to nearest: a bf16 step apart at most,
    # three with the norm. In fp32 only the norm's sum of squares runs in another order.
    written = (slice(None, batch), slice(None), position)
    if dtype == torch.bfloat16:
        rtol = (3 if qk_norm else 1) * 2.0 ** -7
    else:
        rtol = 1e-6 if qk_norm else 0.0
    assert torch.allclose(k_cache[written].float(), expected_k[written].float(), rtol=rtol,
                          atol=rtol if qk_norm else 0.0)
    k_cache[written] = expected_k[written]
    assert torch.equal(k_cache, expected_k)


@interpreted
@pytest.mark.parametrize("case,qk_norm", [(case, case == ROPE_CASES[-1]) for case in ROPE_CASES])
@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
# One split of every slot, with the plain and the pipelined loop (which stops at the new token's
# slot: one split of every slot shows it); one block a split (the plain loop), merged by the last.
@pytest.mark.parametrize("programs_target,stages", [(1, 1), (1, 2), (1000, 2)])
def test_attention_with_rope_and_cache_write_matches_the_model_path(case, qk_norm, dtype, bound, programs_target,
                                                                    stages, monkeypatch):
    monkeypatch.setattr(decode_attention, "PROGRAMS_TARGET", programs_target)
    monkeypatch.setattr(decode_attention, "PIPELINE_STAGES", stages)
    if qk_norm and dtype == torch.bfloat16:
        # The interpreter truncates bf16 where the GPU rounds to nearest: with the norm's two
        # roundings in front of RoPE's, q and k come out ~1 % small.
        bound = 2e-2
    check_rope_and_cache_write(case, dtype, bound, qk_norm=qk_norm)
    assert_arrivals_zeroed()


@interpreted
def test_attention_with_cache_write_rejects_mismatched_inputs():
    heads, cos, sin, left_pad, write_slot, k_cache, v_cache, q_weight, k_weight, eps = rope_and_write_case(
        *ROPE_CASES[0], torch.float32, qk_norm=True)
    caches = (k_cache, v_cache)
    attend = decode_attention.decode_attention_with_cache_write
    whole = r"is not \[batch, query heads \+ 2 x 2 KV heads, 32\]"
    with pytest.raises(ValueError, match=r"qkv \(2, 12, 16\) " + whole):
        attend(heads[..., :16], cos, sin, left_pad, write_slot, *caches)
    with pytest.raises(ValueError, match=r"qkv \(2, 5, 32\) " + whole):
        attend(heads[:, 7:], cos, sin, left_pad, write_slot, *caches)
    with pytest.raises(ValueError, match=r"RoPE tables \(100, 32\) / \(100, 32\) do not cover 160 positions of 32"):
        attend(heads, cos[:100], sin[:100], left_pad, write_slot, *caches)
    with pytest.raises(ValueError, match=r"left_pad \(1,\) does not hold 2 rows' padding"):
        attend(heads, cos, sin, left_pad[:1], write_slot, *caches)
    norms = r"q/k norm weights {} / {} are not both \[32\] in torch.float32"
    with pytest.raises(ValueError, match=norms.format(r"\(32,\)", "None")):
        attend(heads, cos, sin, left_pad, write_slot, *caches, q_weight, None, eps)
    with pytest.raises(ValueError, match=norms.format(r"\(32,\)", r"\(16,\)")):
        attend(heads, cos, sin, left_pad, write_slot, *caches, q_weight, k_weight[:16], eps)
    with pytest.raises(ValueError, match=norms.format(r"\(32,\)", r"\(32,\)")):
        attend(heads, cos, sin, left_pad, write_slot, *caches, q_weight, k_weight.double(), eps)


# ---------------------------------------------------------------- GPU

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("batch,position", [(1, 0), (1, 767), (4, 600)])
@pytest.mark.parametrize("stages", [1, 2, 3])
def test_gpu_attention_with_rope_and_cache_write_llama_shape(batch, position, stages, monkeypatch):
    # Llama-3.1-8B's heads in bf16, the batch smaller than an 8-row cache; three calls, so that the
    # merge's counters must come back zeroed for the next.
    monkeypatch.setattr(decode_attention, "PIPELINE_STAGES", stages)
    for _ in range(3):
        check_rope_and_cache_write((batch, 8, 32, 8, 768, 128, position, [0, 5, 300, 0][:batch]), torch.bfloat16,
                                   1e-2, device="cuda")
    assert_arrivals_zeroed()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("batch,position", [(1, 0), (1, 767), (4, 600)])
@pytest.mark.parametrize("stages", [1, 2])
def test_gpu_attention_with_qk_norm_rope_and_cache_write_qwen3_shape(batch, position, stages, monkeypatch):
    # Qwen3-32B's heads (64 query heads, 8 KV heads of 128) in bf16, with its q/k norms in the kernel.
    monkeypatch.setattr(decode_attention, "PIPELINE_STAGES", stages)
    check_rope_and_cache_write((batch, 8, 64, 8, 768, 128, position, [0, 5, 300, 0][:batch]), torch.bfloat16,
                               1e-2, device="cuda", qk_norm=True)


# ---------------------------------------------------------------- machine code (sm_90a, compiled on the CPU)

machine_code = pytest.mark.skipif(common.INTERPRETING, reason="compiles for sm_90a; not the interpreter's kernels")


@machine_code
def test_attention_fits_two_programs_an_sm_without_spills():
    for qk_norm in (False, True):
        report = sass.partial_attention_kernel(stages=2, qk_norm=qk_norm)
        assert report["spill_bytes"] == 0 and report["registers"] <= 2 ** 16 // (2 * 128), report


@machine_code
def test_pipelined_attention_loop_copies_the_next_blocks_asynchronously():
    # The pipeliner must take the K and V loads (cp.async, LDGSTS, straight to shared memory; the
    # plain loop has none) without spills or more registers than the plain loop, in shared memory
    # that leaves three programs an SM (228 KB).
    plain, pipelined = (sass.partial_attention_kernel(stages=s) for s in (1, 2))
    assert plain["async_copies_in_loop"] == 0 and pipelined["async_copies_in_loop"] > 0, (plain, pipelined)
    assert pipelined["spill_bytes"] == 0 and pipelined["registers"] <= plain["registers"], pipelined
    assert 3 * pipelined["shared_bytes"] <= 228 * 1024, pipelined
