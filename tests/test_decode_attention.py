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
# One split of every slot; one block a split, merged by a kernel of its own or by the last split.
# The pipelined loop stops at the new token's slot: one split of every slot shows it.
@pytest.mark.parametrize("programs_target,merge_in_last_split,v_with_k,stages",
                         [(1, False, False, 1), (1000, False, False, 1), (1000, True, False, 1), (1000, True, True, 1),
                          (1, True, False, 2)])
def test_attention_with_rope_and_cache_write_matches_the_model_path(case, qk_norm, dtype, bound, programs_target,
                                                                    merge_in_last_split, v_with_k, stages,
                                                                    monkeypatch):
    monkeypatch.setattr(decode_attention, "PROGRAMS_TARGET", programs_target)
    monkeypatch.setattr(decode_attention, "MERGE_IN_LAST_SPLIT", merge_in_last_split)
    monkeypatch.setattr(decode_attention, "LOAD_V_WITH_K", v_with_k)
    monkeypatch.setattr(decode_attention, "PIPELINE_STAGES", stages)
    if qk_norm and dtype == torch.bfloat16:
        # The interpreter truncates bf16 where the GPU rounds to nearest: with the norm's two
        # roundings in front of RoPE's, q and k come out ~1 % small (0.0125 on this case; 0.0049
        # against a reference that truncates the same way).
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


def gemv_as_inductor_decomposes_it_on_the_gpu(a, b, out_dtype=None):
    """aten.mm as torch's Inductor lowers a one-row product on CUDA under coordinate-descent
    tuning: an fp32 multiply-and-sum, then a cast back (torch/_inductor/decomposition.py, mm)."""
    return (a.float().unsqueeze(2) * b.float().unsqueeze(0)).sum(dim=1).to(a.dtype)


@interpreted
@pytest.mark.parametrize("gemv_as_on_the_gpu,qk_norm", [(False, False), (True, False), (False, True)])
def test_compiled_decode_step_hands_the_model_buffers_to_the_fused_kernel(gemv_as_on_the_gpu, qk_norm, monkeypatch):
    # The compiled decode step around the kernels (on CPU: Inductor's C++ code, the kernels under
    # the interpreter) must give the fused attention whole buffers: Inductor copies each row or
    # slice made in the step into a fresh buffer for each layer's call. Per-step cos/sin and mask
    # rows cost 16 launches a 2:4 Llama-3.1-8B step on the H200 (BENCHMARKS session 19); q, k, v
    # as three slices of the dense GEMV's output (fp32 sums cast to bf16, as the GPU lowers a
    # one-row product; emulated here) 96 launches a dense step (session 20). Its logits must match
    # the same model on SDPA, with a left-padded row, also with Qwen3's q/k norms (in the kernel).
    # In fp32, but bf16 where the GPU's lowering is emulated: its cast is to bf16.
    import contextlib
    import re

    from torch._inductor import decomposition
    from torch._inductor.utils import run_and_get_code

    from model import ModelArgs, Transformer
    if gemv_as_on_the_gpu:
        for table in (decomposition.decompositions, decomposition.fast_random_decomps()):
            monkeypatch.setitem(table, torch.ops.aten.mm.default, gemv_as_inductor_decomposes_it_on_the_gpu)
    torch.manual_seed(0)
    model = Transformer(ModelArgs(block_size=128, vocab_size=64, n_layer=3, n_head=8, n_local_heads=2, dim=256,
                                  intermediate_size=128, qk_norm=qk_norm)).eval()
    if gemv_as_on_the_gpu:
        model = model.to(torch.bfloat16)
    model.setup_caches(2, 64)
    model.set_left_padding(torch.tensor([0, 3]))
    token, position = torch.randint(0, 64, (2, 1)), torch.tensor([9])
    with torch.no_grad():
        model(torch.randint(0, 64, (2, 9)), torch.arange(9))  # the prompt, through SDPA (CPU)
        reference = model(token, position)  # SDPA; the fused kernel writes the same slot again below
        monkeypatch.setattr(decode_attention, "handles", lambda q: decode_attention.supports(q.shape[-1]))
        # (a cached graph of another case would not know the decomposition changed)
        with (torch._inductor.config.patch(fx_graph_cache=False) if gemv_as_on_the_gpu else contextlib.nullcontext()):
            logits, codes = run_and_get_code(torch.compile(model), token, position)
    assert relative_error(logits, reference) < (2e-2 if gemv_as_on_the_gpu else 1e-4)
    code = "\n".join(codes)
    calls = re.findall(r"sparse_decoding\.decode_attention_with_cache_write\.default\((.*)\)$", code, re.M)
    assert len(calls) == 3, calls
    assert ("extern_kernels.mm(" in code) != gemv_as_on_the_gpu  # the emulation took
    for call in calls:
        # the heads: the projection's output whole (a buffer, or a view of all of it); then the
        # tables, the padding, the new token's slot, the caches (and the norms' weights): each an
        # input of the graph
        arguments = re.sub(r"reinterpret_tensor\((buf\d+), \([^)]*\), \([^)]*\), 0\)", r"\1", call).split(", ")
        arguments = [re.sub(r"^\w+=", "", a) for a in arguments]  # keyword arguments by value
        assert re.fullmatch(r"buf\d+", arguments[0]), call
        assert all(re.fullmatch(r"arg\d+_1", a) for a in arguments[1:7 + 2 * qk_norm]), call
        norm_eps = arguments[9:] if qk_norm else arguments[7:]
        assert norm_eps == ["1e-05"] if qk_norm else norm_eps in ([], ["None", "None", "0.0"]), call
        # ... written whole by one kernel (the GEMV's, with its cast): not in slices, each of which
        # the GPU writes with a kernel of its own
        writer = rf"^\s*(cpp_fused\w*|extern_kernels\.\w+)\(.*\b{arguments[0]}\b"
        assert re.search(writer, code, re.M), f"{arguments[0]} is written in slices"


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
@pytest.mark.parametrize("batch,position", [(1, 0), (1, 767), (4, 600)])
@pytest.mark.parametrize("stages", [1, 2])
def test_gpu_attention_with_qk_norm_rope_and_cache_write_qwen3_shape(batch, position, stages, monkeypatch):
    # Qwen3-32B's heads (64 query heads, 8 KV heads of 128) in bf16, with its q/k norms in the kernel.
    monkeypatch.setattr(decode_attention, "PIPELINE_STAGES", stages)
    check_rope_and_cache_write((batch, 8, 64, 8, 768, 128, position, [0, 5, 300, 0][:batch]), torch.bfloat16,
                               1e-2, device="cuda", qk_norm=True)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fuse_rope_and_cache_write,merge_in_last_split", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("qk_norm", [False, True])  # Llama; Qwen3 (its q/k norms in the kernel)
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
