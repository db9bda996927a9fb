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


def assert_arrivals_zeroed():
    """The fused merge must leave its counters as it found them: the next layer reuses them."""
    assert all(not counters.any() for counters in decode_attention._arrivals.values())


@interpreted
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
# The plain loop at each merge / V-with-K setting, and the software-pipelined one (PIPELINE_STAGES 2,
# one split of every slot: a split of one block would take the plain loop).
@pytest.mark.parametrize("merge_in_last_split,v_with_k,stages",
                         [(False, False, 1), (True, False, 1), (True, True, 1), (True, False, 2)])
def test_decode_attention_matches_float64(case, dtype, bound, merge_in_last_split, v_with_k, stages, monkeypatch):
    monkeypatch.setattr(decode_attention, "MERGE_IN_LAST_SPLIT", merge_in_last_split)
    monkeypatch.setattr(decode_attention, "LOAD_V_WITH_K", v_with_k)
    monkeypatch.setattr(decode_attention, "PIPELINE_STAGES", stages)
    if stages > 1:
        monkeypatch.setattr(decode_attention, "PROGRAMS_TARGET", 1)
    q, k, v, keep = random_case(*case, dtype=dtype, seed=case_seed(case))
    out = decode_attention.decode_attention(q, k, v, keep)
    assert out.shape == q.shape and out.dtype == dtype
    assert relative_error(out, reference_attention(q, k, v, keep)) < bound
    assert_arrivals_zeroed()


def test_block_loop_stages_pipelines_only_splits_of_several_blocks(monkeypatch):
    monkeypatch.setattr(decode_attention, "PIPELINE_STAGES", 2)
    monkeypatch.setattr(decode_attention, "BLOCK_SLOTS", 64)
    assert [decode_attention.block_loop_stages(slots) for slots in (64, 128, 4096)] == [1, 2, 2]


@interpreted
@pytest.mark.parametrize("merge_in_last_split,stages", [(False, 1), (True, 1), (True, 2)])
def test_decode_attention_splits_over_slots(merge_in_last_split, stages, monkeypatch):
    # Few programs wanted -> many slots per split; many wanted -> one block per split. The second
    # row's first block is all padding: in one split, the pipelined loop (no branch around empty
    # blocks) meets it before any kept slot.
    monkeypatch.setattr(decode_attention, "MERGE_IN_LAST_SPLIT", merge_in_last_split)
    monkeypatch.setattr(decode_attention, "PIPELINE_STAGES", stages)
    q, k, v, keep = random_case(2, 8, 2, 200, 16, 150, [0, 100], torch.float32, seed=3)
    reference = reference_attention(q, k, v, keep)
    for target in (1, 1000):
        monkeypatch.setattr(decode_attention, "PROGRAMS_TARGET", target)
        assert relative_error(decode_attention.decode_attention(q, k, v, keep), reference) < 1e-5
        assert_arrivals_zeroed()


def rotated(x, cos, sin):
    """model.apply_rope for x [B, H, D] and one position per row (cos, sin [B, D])."""
    from model import apply_rope
    return apply_rope(x[:, None], cos[:, None], sin[:, None])[:, 0]


def rope_and_write_case(batch, cache_rows, n_heads, n_kv_heads, n_slots, head_dim, position, pads, dtype,
                        device="cpu", k_apart=False):
    """decode_attention_with_cache_write's arguments: unrotated q and new k, v for `batch` rows, views
    into one qkv row as Attention.forward makes them (k_apart: k a tensor of its own, as after
    Qwen3's k_norm); the RoPE tables; the left padding of `cache_rows` >= batch rows, as the model's
    buffer holds it; the new token's slot; caches of `cache_rows` rows."""
    from model import precompute_rope
    g = torch.Generator().manual_seed(position + 17 * batch)
    qkv = torch.randn(batch, (n_heads + 2 * n_kv_heads) * head_dim, generator=g).to(device=device, dtype=dtype)
    new = [part.view(batch, -1, head_dim) for part in qkv.split([n_heads * head_dim, n_kv_heads * head_dim,
                                                                 n_kv_heads * head_dim], dim=-1)]
    if k_apart:
        new[1] = new[1].clone()
    caches = [torch.randn(cache_rows, n_kv_heads, n_slots, head_dim, generator=g).to(device=device, dtype=dtype)
              for _ in range(2)]
    cos, sin = precompute_rope(n_slots, head_dim, 500000.0)
    left_pad = torch.tensor(pads + [0] * (cache_rows - batch), device=device)
    return (*new, cos.to(device), sin.to(device), left_pad, torch.tensor([position], device=device), *caches)


def rows_rope_and_keep(args, batch):
    """What model.forward gives SDPA for the same step: each row's cos/sin at its own position
    (slot - pad) and the causal mask's row with the padding masked."""
    _, _, _, cos, sin, left_pad, write_slot, k_cache, _ = args
    pad = left_pad[:batch].cpu()
    position = int(write_slot)
    rows = (position - pad).clamp(min=0)
    slots = torch.arange(k_cache.shape[2])
    keep = (slots[None, :] <= position) & (slots[None, :] >= pad[:, None])
    return cos[rows.to(cos.device)], sin[rows.to(cos.device)], keep.to(k_cache.device)


# (batch, cache rows, heads, kv heads, slots, head_dim, position, left pads): a batch smaller than
# the cache, the new slot in a later split with padding in front (a whole 64-slot block of it in
# row 1); the first slot; GQA of 3 (with k a tensor of its own, strided unlike v).
ROPE_CASES = [(2, 3, 8, 2, 160, 32, 140, [0, 70]), (1, 1, 4, 4, 64, 16, 0, [0]), (2, 2, 9, 3, 50, 16, 33, [0, 2])]


def check_rope_and_cache_write(case, dtype, bound, device="cpu", k_apart=False):
    """decode_attention_with_cache_write against model.apply_rope, the cache written as
    KVCache.update writes it, and float64 attention; every other slot and row of the caches must
    stay as it was."""
    batch, position = case[0], case[6]
    args = rope_and_write_case(*case, dtype=dtype, device=device, k_apart=k_apart)
    q, new_k, new_v, _, _, _, _, k_cache, v_cache = args
    cos, sin, keep = rows_rope_and_keep(args, batch)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected_k[:batch, :, position] = rotated(new_k, cos, sin)
    expected_v[:batch, :, position] = new_v
    reference = reference_attention(rotated(q, cos, sin), expected_k[:batch], expected_v[:batch], keep)
    out = decode_attention.decode_attention_with_cache_write(*args)
    assert relative_error(out, reference) < bound
    assert torch.equal(v_cache, expected_v)
    # The rotated k is rounded from fp32 once either way; the interpreter truncates bf16, the GPU
    # rounds to nearest: one bf16 step apart at most.
    written = (slice(None, batch), slice(None), position)
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 0.0
    assert torch.allclose(k_cache[written].float(), expected_k[written].float(), rtol=ulp, atol=0)
    k_cache[written] = expected_k[written]
    assert torch.equal(k_cache, expected_k)


@interpreted
@pytest.mark.parametrize("case,k_apart", [(case, case == ROPE_CASES[-1]) for case in ROPE_CASES])
@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
# One split of every slot; one block a split, merged by a kernel of its own or by the last split.
# The pipelined loop stops at the new token's slot: one split of every slot shows it.
@pytest.mark.parametrize("programs_target,merge_in_last_split,v_with_k,stages",
                         [(1, False, False, 1), (1000, False, False, 1), (1000, True, False, 1), (1000, True, True, 1),
                          (1, True, False, 2)])
def test_attention_with_rope_and_cache_write_matches_the_model_path(case, k_apart, dtype, bound, programs_target,
                                                                    merge_in_last_split, v_with_k, stages,
                                                                    monkeypatch):
    monkeypatch.setattr(decode_attention, "PROGRAMS_TARGET", programs_target)
    monkeypatch.setattr(decode_attention, "MERGE_IN_LAST_SPLIT", merge_in_last_split)
    monkeypatch.setattr(decode_attention, "LOAD_V_WITH_K", v_with_k)
    monkeypatch.setattr(decode_attention, "PIPELINE_STAGES", stages)
    check_rope_and_cache_write(case, dtype, bound, k_apart=k_apart)
    assert_arrivals_zeroed()


@interpreted
def test_attention_with_cache_write_rejects_mismatched_inputs():
    q, new_k, new_v, cos, sin, left_pad, write_slot, k_cache, v_cache = rope_and_write_case(*ROPE_CASES[0],
                                                                                            torch.float32)
    with pytest.raises(ValueError, match=r"new k \(2, 2, 32\) / v \(2, 2, 16\) do not match 2 rows of 2 KV heads"):
        decode_attention.decode_attention_with_cache_write(q, new_k, new_v[..., :16], cos, sin, left_pad, write_slot,
                                                           k_cache, v_cache)
    with pytest.raises(ValueError, match=r"RoPE tables \(100, 32\) / \(100, 32\) do not cover 160 positions of 32"):
        decode_attention.decode_attention_with_cache_write(q, new_k, new_v, cos[:100], sin[:100], left_pad, write_slot,
                                                           k_cache, v_cache)
    with pytest.raises(ValueError, match=r"left_pad \(1,\) does not hold 2 rows' padding"):
        decode_attention.decode_attention_with_cache_write(q, new_k, new_v, cos, sin, left_pad[:1], write_slot,
                                                           k_cache, v_cache)


@interpreted
def test_compiled_decode_step_hands_the_model_buffers_to_the_fused_kernel(monkeypatch):
    # The compiled decode step around the kernels (on CPU: Inductor's C++ code, the kernels under
    # the interpreter) must give the fused attention the model's own buffers. Per-step rows computed
    # in the graph (cos/sin at the position, the mask's row) were copied into fresh buffers for each
    # layer's call (16 launches a 2:4 Llama-3.1-8B step on the H200, ~108 in dense; BENCHMARKS
    # session 19). Its logits must match the same model on SDPA, with a left-padded row.
    import re

    from torch._inductor.utils import run_and_get_code

    from model import ModelArgs, Transformer
    torch.manual_seed(0)
    model = Transformer(ModelArgs(block_size=128, vocab_size=64, n_layer=3, n_head=8, n_local_heads=2, dim=256,
                                  intermediate_size=128)).eval()
    model.setup_caches(2, 64)
    model.set_left_padding(torch.tensor([0, 3]))
    token, position = torch.randint(0, 64, (2, 1)), torch.tensor([9])
    with torch.no_grad():
        model(torch.randint(0, 64, (2, 9)), torch.arange(9))  # the prompt, through SDPA (CPU)
        reference = model(token, position)  # SDPA; the fused kernel writes the same slot again below
        monkeypatch.setattr(decode_attention, "handles", lambda q: decode_attention.supports(q.shape[-1]))
        logits, codes = run_and_get_code(torch.compile(model), token, position)
    assert relative_error(logits, reference) < 1e-4
    calls = re.findall(r"sparse_decoding\.decode_attention_with_cache_write\.default\((.*)\)$", "\n".join(codes), re.M)
    assert len(calls) == 3, calls
    for call in calls:
        # q, new k, new v: views into the qkv output; then the tables, the padding, the new token's
        # slot and the caches: every one an input of the graph, none a buffer made in it
        arguments = re.sub(r"reinterpret_tensor\(buf\d+, \([^)]*\), \([^)]*\), \d+\)", "view", call).split(", ")
        assert arguments[:3] == ["view"] * 3 and all(re.fullmatch(r"arg\d+_1", a) for a in arguments[3:]), call


# ---------------------------------------------------------------- GPU

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("batch,position", [(1, 0), (1, 767), (4, 600)])
@pytest.mark.parametrize("merge_in_last_split", [False, True])
def test_gpu_decode_attention_llama_shape(batch, position, merge_in_last_split, monkeypatch):
    monkeypatch.setattr(decode_attention, "MERGE_IN_LAST_SPLIT", merge_in_last_split)
    q, k, v, keep = random_case(batch, 32, 8, 768, 128, position, [0, 5, 300, 0][:batch], torch.bfloat16,
                                device="cuda", seed=position)
    for _ in range(3):  # the fused merge's counters must come back zeroed for the next call
        out = decode_attention.decode_attention(q, k, v, keep)
        assert relative_error(out, reference_attention(q, k, v, keep)) < 1e-2
    assert_arrivals_zeroed()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("batch,position", [(1, 0), (1, 767), (4, 600)])
@pytest.mark.parametrize("merge_in_last_split,v_with_k,stages",
                         [(False, False, 1), (True, False, 1), (True, True, 1), (True, False, 2), (True, False, 3)])
def test_gpu_attention_with_rope_and_cache_write_llama_shape(batch, position, merge_in_last_split, v_with_k, stages,
                                                             monkeypatch):
    # Llama-3.1-8B's heads in bf16, the batch smaller than an 8-row cache.
    monkeypatch.setattr(decode_attention, "MERGE_IN_LAST_SPLIT", merge_in_last_split)
    monkeypatch.setattr(decode_attention, "LOAD_V_WITH_K", v_with_k)
    monkeypatch.setattr(decode_attention, "PIPELINE_STAGES", stages)
    check_rope_and_cache_write((batch, 8, 32, 8, 768, 128, position, [0, 5, 300, 0][:batch]), torch.bfloat16,
                               1e-2, device="cuda")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fuse_rope_and_cache_write,merge_in_last_split", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("qk_norm", [False, True])  # Llama; Qwen3 (k normed apart: strided unlike v)
def test_gpu_model_decode_matches_sdpa(fuse_rope_and_cache_write, merge_in_last_split, qk_norm, monkeypatch):
    # A model whose decode steps go through the kernels (with RoPE and the cache write in the
    # attention kernel or before it, the splits merged by a kernel of their own or by the last
    # split), against the same model on SDPA, with a batch of prompts of different lengths (left
    # padding), eagerly and compiled (through CUDA graphs).
    import generate
    from model import ModelArgs, Transformer

    torch.manual_seed(0)
    model = Transformer(ModelArgs(block_size=128, vocab_size=64, n_layer=2, n_head=8, n_local_heads=2, dim=512,
                                  intermediate_size=256, qk_norm=qk_norm)).cuda().eval()
    prompts = [torch.randint(0, 64, (n,)) for n in (5, 17)]
    # No counters held yet, as in a fresh process, and the compiled run first: only setup_caches
    # (called by the reference's generate) reserves them; counters first made inside the CUDA-graph
    # warm-up broke cudagraph trees' memory-pool check (H200, 2026-12-03).
    monkeypatch.setattr(decode_attention, "_arrivals", {})
    with monkeypatch.context() as patch:
        patch.setattr(decode_attention, "supports", lambda head_dim: False)
        reference = generate.generate(model, prompts, 20)
    monkeypatch.setattr(decode_attention, "FUSE_ROPE_AND_CACHE_WRITE", fuse_rope_and_cache_write)
    monkeypatch.setattr(decode_attention, "MERGE_IN_LAST_SPLIT", merge_in_last_split)
    for compile in (True, False):
        result = generate.generate(model, prompts, 20, compile=compile)
        assert all(torch.equal(a, b) for a, b in zip(result.sequences, reference.sequences)), compile
