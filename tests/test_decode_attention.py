"""The model's decode step through the decode-attention kernel (sparse/kernels/decode_attention.py):
compiled on CPU under TRITON_INTERPRET=1 (the real kernel, in a subprocess:
tests/sparse_kernel_testing.py), and on the GPU (marked `gpu`) against the same model on SDPA.
The kernel itself: tests/test_sparse_kernels_decode_attention.py."""
import pytest
import torch

import decode_attention
from sparse.kernels import common
from tests.sparse_kernel_testing import interpreted, relative_error, rerun_under_interpreter


@pytest.mark.skipif(common.INTERPRETING, reason="this is the subprocess")
def test_model_decode_attention_under_the_interpreter():
    rerun_under_interpreter(__file__)


def gemv_as_inductor_decomposes_it_on_the_gpu(a, b, out_dtype=None):
    """aten.mm as torch's Inductor lowers a one-row product on CUDA under coordinate-descent
    tuning: an fp32 multiply-and-sum, then a cast back (torch/_inductor/decomposition.py, mm)."""
    return (a.float().unsqueeze(2) * b.float().unsqueeze(0)).sum(dim=1).to(a.dtype)


@interpreted
@pytest.mark.parametrize("gemv_as_on_the_gpu,qk_norm", [(False, False), (True, False), (False, True)])
def test_compiled_decode_step_hands_the_model_buffers_to_the_fused_kernel(gemv_as_on_the_gpu, qk_norm, monkeypatch):
    # The compiled decode step around the kernels (on CPU: Inductor's C++ code, the kernels under
    # the interpreter) must give the fused attention whole buffers: Inductor copies each row or
    # slice made in the step into a fresh buffer for each layer's call: per-step cos/sin and mask
    # rows, or q, k, v as three slices of the dense GEMV's output (fp32 sums cast to bf16, as the
    # GPU lowers a one-row product; emulated here), each cost launches a step. Its logits must match
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
@pytest.mark.parametrize("qk_norm", [False, True])  # Llama; Qwen3 (its q/k norms in the kernel)
def test_gpu_model_decode_matches_sdpa(qk_norm, monkeypatch):
    # A model whose decode steps go through the kernel, against the same model on SDPA, with a
    # batch of prompts of different lengths (left padding), eagerly and compiled (through CUDA
    # graphs).
    import generate
    from model import ModelArgs, Transformer

    torch.manual_seed(0)
    model = Transformer(ModelArgs(block_size=128, vocab_size=64, n_layer=2, n_head=8, n_local_heads=2, dim=512,
                                  intermediate_size=256, qk_norm=qk_norm)).cuda().eval()
    prompts = [torch.randint(0, 64, (n,)) for n in (5, 17)]
    # No counters held yet, as in a fresh process, and the compiled run first: only setup_caches
    # (called by the reference's generate) reserves them; counters first made inside the CUDA-graph
    # warm-up break cudagraph trees' memory-pool check.
    monkeypatch.setattr(decode_attention, "arrival_counters", {})
    with monkeypatch.context() as patch:
        patch.setattr(decode_attention, "supports", lambda head_dim: False)
        reference = generate.generate(model, prompts, 20)
    for compile in (True, False):
        result = generate.generate(model, prompts, 20, compile=compile)
        assert all(torch.equal(a, b) for a, b in zip(result.sequences, reference.sequences)), compile
