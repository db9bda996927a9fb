"""sparse/kernels.py: the real Triton kernels, on CPU under TRITON_INTERPRET=1, against float64.

The interpreter must be switched on before Triton decorates the kernels, and other test modules
import `sparse` first; so the checks run in a fresh Python process (the first test), where this
module is imported with TRITON_INTERPRET=1 already set.
"""
import pytest
import torch

from sparse import kernels
from sparse.format import unpack
from tests.sparse_kernel_testing import (case_seed, compiled_first, interpreted, random_packed, relative_error,
                                        rerun_under_interpreter)

PATTERNS = ["2:4", "4:8", "8:16", "16:32", "1:4"]


@pytest.mark.skipif(kernels.INTERPRETING, reason="this is the subprocess")
def test_kernels_under_the_interpreter():
    rerun_under_interpreter(__file__)


# Every pattern at batch 1 and 3 (padded to 4 lanes); wider batches on two patterns (the
# interpreter is slow on them).
CASES = [(p, b) for p in PATTERNS for b in (1, 3)] + [("2:4", 16), ("16:32", 8), ("4:8", 4)]


@interpreted
@pytest.mark.parametrize("pattern,batch", CASES)
def test_spmv_matches_float64(pattern, batch):
    # 37 rows: not a multiple of the 32-row block. 96 columns = 3 words, which no config below
    # divides evenly: in_features a multiple of 32 but not of the words a program covers.
    seed = case_seed(pattern, batch)
    values, mask = random_packed(37, 96, pattern, seed)
    reference_weight = unpack(values, mask).double()
    # (slices, words per warp, prefetch): one warp walking all 3 words one and two ahead; 2
    # slices of 2 words (the last word past the end); 2 slices of 1 word split over 2 programs.
    configs = [(1, 3, 1), (1, 3, 2), (2, 2, 2), (2, 1, 1)] + ([(1, 1, 1), (4, 1, 1)] if batch == 1 else [])
    for i, config in enumerate(configs):
        x = torch.randn(batch, 96, generator=torch.Generator().manual_seed(seed + i))
        out = torch.full((batch, 37), float("nan"))  # poisoned: an unwritten element fails
        y = kernels.spmv(x, values, mask, config=config, out=out)
        assert y.shape == (batch, 37)
        assert relative_error(y, x.double() @ reference_weight.T) < 1e-6, config
        workspace, arrivals = kernels._workspace(x.device, 0, 0)
        assert not workspace.any() and not arrivals.any(), "split-K must leave its workspace zeroed"


@interpreted
@pytest.mark.parametrize("pattern,batch", [("2:4", 2), ("16:32", 3), ("4:8", 8)])
def test_spmv_with_x_packed_in_bf16_pairs_matches_float64(pattern, batch):
    # pack_x: x rounded to bf16 (ties to even), two rows to a register, widened after the shuffle.
    # Against float64 math on the same rounded x: only the fp32 accumulation may differ. The
    # configs of the test above: a word past the end (zero lanes) and split K.
    seed = case_seed("packed", pattern, batch)
    values, mask = random_packed(37, 96, pattern, seed)
    reference_weight = unpack(values, mask).double()
    for i, config in enumerate([(1, 3, 2), (2, 2, 2), (2, 1, 1)]):
        x = torch.randn(batch, 96, generator=torch.Generator().manual_seed(seed + i))
        out = torch.full((batch, 37), float("nan"))
        y = kernels.spmv(x, values, mask, config=config, out=out, pack_x=True)
        assert relative_error(y, x.bfloat16().double() @ reference_weight.T) < 1e-6, config
    with pytest.raises(ValueError, match="at least 2 rows"):
        kernels.spmv(x[:1], values, mask, pack_x=True)


@interpreted
def test_spmv_compile_only_launches_nothing():
    # What the tuner and the GPU tests call to compile every candidate before any is launched.
    values, mask = random_packed(37, 96, "2:4", 4)
    out = torch.full((2, 37), float("nan"))
    kernels.spmv(torch.ones(2, 96), values, mask, config=(1, 3, 1), out=out, compile_only=True)
    assert out.isnan().all()


@pytest.mark.skipif(kernels.INTERPRETING or torch.cuda.is_available(),
                    reason="compiles for sm_90 with a stand-in driver; the GPU tests compile for the real one")
def test_compile_all_fills_the_jit_cache_with_every_config(monkeypatch):
    # Real compiles (Triton to PTX to a cubin) without a GPU: the JIT's driver stands in for an
    # sm_90 device, and the kernel gets an empty cache of its own for the test.
    import sys
    from collections import defaultdict
    from pathlib import Path

    import triton
    from triton.runtime.driver import driver
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from compile_time import Sm90StandIn

    monkeypatch.setattr(driver, "_active", Sm90StandIn())
    monkeypatch.setattr(kernels._spmv_kernel, "device_caches", defaultdict(kernels._spmv_kernel.create_binder))
    monkeypatch.setattr(kernels, "COMPILE_THREADS", 2)
    values, mask = random_packed(64, 128, "2:4", 9, dtype=torch.bfloat16)
    x = torch.ones(1, 128, dtype=torch.bfloat16)
    configs = [(1, 4, 1), (2, 2, 1), (2, 2, 2), (4, 1, 1)]
    kernels.compile_all(configs, lambda c: kernels.spmv(x, values, mask, config=c, compile_only=True))
    compiled = kernels._spmv_kernel.device_caches[0][0].values()
    assert sorted(kernel.metadata.num_warps for kernel in compiled) == [1, 2, 2, 4]
    assert all(isinstance(kernel, triton.compiler.CompiledKernel) and kernel.asm["cubin"] for kernel in compiled)


@interpreted
def test_spmv_packs_bf16_x_of_four_rows_or_more_by_default():
    values, mask = random_packed(40, 64, "2:4", 3)
    values = values.bfloat16()
    x = torch.randn(8, 64).bfloat16()
    assert kernels.packs_x(x) and kernels.packs_x(x[:4]) and not kernels.packs_x(x[:3])
    assert not kernels.packs_x(x.float())
    y = kernels.spmv(x, values, mask, config=(2, 1, 1))
    assert relative_error(y, x.double() @ unpack(values, mask).double().T) < 1e-2


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_spmv_16_bit(dtype):
    values, mask = random_packed(40, 64, "2:4", 7)
    values = values.to(dtype)
    x = torch.randn(2, 64).to(dtype)
    y = kernels.spmv(x, values, mask, config=(2, 1, 1))
    assert y.dtype == dtype
    assert relative_error(y, x.double() @ unpack(values, mask).double().T) < 1e-2


def fused_reference(x, weight, norm_weight=None, eps=0.0, residual=None, gated=False):
    """float64 residual + prologue(x) @ weight.T, the prologue as model.py computes it unfused."""
    x = x.double()
    if gated:
        gate, up = x.chunk(2, dim=-1)
        x = torch.nn.functional.silu(gate) * up
    if norm_weight is not None:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.double()
    y = x @ weight.double().T
    return y if residual is None else y + residual.double()


FUSED = {"norm": dict(norm=True), "norm+residual": dict(norm=True, residual=True),
         "gated+residual": dict(gated=True, residual=True), "residual": dict(residual=True)}


@interpreted
@pytest.mark.parametrize("fusion", FUSED)
@pytest.mark.parametrize("pattern,batch,pack_x", [("2:4", 1, False), ("16:32", 3, False), ("4:8", 2, False),
                                                  ("4:8", 2, True)])
def test_spmv_fused_prologue_and_residual_match_float64(fusion, pattern, batch, pack_x):
    # The same ragged shape and configs as above: whole K in one warp (one and two words ahead), a
    # word past the end, and K split over programs (the epilogue then runs in the last to arrive).
    seed = case_seed(fusion, pattern, batch)
    values, mask = random_packed(37, 96, pattern, seed)
    weight = unpack(values, mask)
    for i, config in enumerate([(1, 3, 1), (1, 3, 2), (2, 2, 2), (2, 1, 1)]):
        g = torch.Generator().manual_seed(seed + i)
        x = 3 * torch.randn(batch, 192 if FUSED[fusion].get("gated") else 96, generator=g)
        norm_weight = torch.randn(96, generator=g) if FUSED[fusion].get("norm") else None
        residual = torch.randn(batch, 37, generator=g) if FUSED[fusion].get("residual") else None
        gated = FUSED[fusion].get("gated", False)
        out = torch.full((batch, 37), float("nan"))
        y = kernels.spmv(x, values, mask, config=config, out=out, norm_weight=norm_weight, norm_eps=1e-5,
                         residual=residual, gated=gated, pack_x=pack_x)
        expected = fused_reference(x, weight, norm_weight, 1e-5, residual, gated)
        # Packed, the prologue's output is rounded to bf16 (as an unfused bf16 model rounds it).
        assert relative_error(y, expected) < (1e-2 if pack_x else 1e-6), config
        workspace, arrivals = kernels._workspace(x.device, 0, 0)
        assert not workspace.any() and not arrivals.any(), "split-K must leave its workspace zeroed"


@interpreted
def test_spmv_rejects_fused_operands_of_the_wrong_shape():
    values, mask = random_packed(8, 64, "2:4", 1)
    with pytest.raises(ValueError, match=r"gated: x holds gate and up"):
        kernels.spmv(torch.randn(1, 64), values, mask, gated=True)
    with pytest.raises(ValueError, match=r"norm weight \(32,\) does not match in_features=64"):
        kernels.spmv(torch.randn(1, 64), values, mask, norm_weight=torch.ones(32))
    with pytest.raises(ValueError, match=r"residual \(1, 9\) does not match the output \(1, 8\)"):
        kernels.spmv(torch.randn(1, 64), values, mask, residual=torch.ones(1, 9))
    with pytest.raises(ValueError, match=r"either a norm or gated, not both"):
        kernels.spmv(torch.randn(1, 128), values, mask, norm_weight=torch.ones(64), gated=True)


def sparse_model_and_float64_reference(rows, device="cpu", dtype=torch.float32):
    """A two-layer 2:4 model after a 5-token prefill of `rows` prompts, the same model with the
    unpacked weights in float64 on the CPU, and the token of the decode step to feed both."""
    from model import ModelArgs, Transformer
    from sparse import SparseLinear, swap_to_sparse
    torch.manual_seed(0)
    config = ModelArgs(dim=64, n_layer=2, n_head=4, n_local_heads=2, intermediate_size=96, vocab_size=50,
                       block_size=32)
    model = Transformer(config).eval()
    for norm in [m for m in model.modules() if type(m).__name__ == "RMSNorm"]:
        norm.weight.data = 1 + 0.3 * torch.randn_like(norm.weight)  # not all ones: the fused scale counts
    swap_to_sparse(model, "2:4")
    model = model.to(device=device, dtype=dtype)
    reference = Transformer(config).double().eval()
    reference.load_state_dict({name: tensor.double().cpu() for name, tensor in model.state_dict().items()
                               if not name.endswith((".values", ".mask"))}, strict=False)
    for name, module in model.named_modules():
        if isinstance(module, SparseLinear):
            reference.get_submodule(name).weight.data = unpack(module.values, module.mask).double().cpu()
    tokens = torch.randint(0, 50, (rows, 6))
    model.setup_caches(rows, 16)
    reference.setup_caches(rows, 16)
    model(tokens[:, :5].to(device), torch.arange(5, device=device))
    reference(tokens[:, :5], torch.arange(5))
    return model, reference, tokens[:, 5:]


@interpreted
@torch.no_grad()
@pytest.mark.parametrize("prologue_apart_from,residual_apart_from", [(9, 9), (2, 9), (2, 2)])
def test_sparse_decode_step_through_the_fused_kernels_matches_float64(prologue_apart_from, residual_apart_from,
                                                                      monkeypatch):
    """A whole model: the decode step's linears take norm, residual and silu * up into the SpMV
    (SparseLinear.fuses under the interpreter), or at its 2 rows only the residual with the
    prologue run apart, or neither, against the unpacked weights in float64 math."""
    from sparse import linear
    monkeypatch.setattr(linear, "PROLOGUE_APART_MIN_ROWS", prologue_apart_from)
    monkeypatch.setattr(linear, "RESIDUAL_APART_MIN_ROWS", residual_apart_from)
    model, reference, token = sparse_model_and_float64_reference(2)
    probe = model.layers[0].feed_forward.w2
    assert probe.fuses(torch.zeros(2, 1, 96)) == (residual_apart_from > 2) and not probe.fuses(torch.zeros(2, 5, 96))
    assert probe.fuses(torch.zeros(2, 1, 96), prologue=True) == (prologue_apart_from > 2 and residual_apart_from > 2)
    logits = model(token, torch.tensor([5]))
    assert relative_error(logits, reference(token, torch.tensor([5]))) < 1e-5


@interpreted
@pytest.mark.parametrize("pattern", ["2:4", "16:32", "1:4", "1:32"])
def test_unpack_to_dense_matches_unpack(pattern):
    values, mask = random_packed(37, 160, pattern, 3)  # 5 words: the last program is half full
    out = torch.full((37, 160), float("nan"))
    assert torch.equal(kernels.unpack_to_dense(values, mask, out=out), unpack(values, mask))


@interpreted
def test_unpack_to_dense_expands_a_range_of_rows():
    # The sliced prefill's expansion: rows 16..37 of a 37-row weight (a slice that starts inside
    # the weight and ends at its last row), and a refused range.
    values, mask = random_packed(37, 160, "2:4", 4)
    out = torch.full((21, 160), float("nan"))
    assert torch.equal(kernels.unpack_to_dense(values, mask, out=out, rows=(16, 37)), unpack(values, mask)[16:37])
    with pytest.raises(ValueError, match=r"rows 30\.\.40 are not inside the weight's 37"):
        kernels.unpack_to_dense(values, mask, rows=(30, 40))


@interpreted
@pytest.mark.parametrize("slices", [1, 2, 4])
def test_prefill_matmul_in_slices_matches_float64(slices):
    # 200 rows in slices of whole 64-row blocks: 4 slices of 64, 64, 64, 8 (more slices than the two
    # buffers, a short last one), 2 of 128 + 72, or the whole weight at once.
    from sparse import linear
    values, mask = random_packed(200, 96, "4:8", slices)
    x = torch.randn(40, 96, generator=torch.Generator().manual_seed(slices))
    y = linear.prefill_matmul(x, values, mask, slices)
    assert y.shape == (40, 200) and relative_error(y, x.double() @ unpack(values, mask).double().T) < 1e-6


@interpreted
def test_sparse_linear_dispatch_under_interpreter():
    from sparse import SparseLinear
    layer = SparseLinear.from_dense(torch.randn(24, 64), "4:8")
    dense = unpack(layer.values, layer.mask).double()
    for rows in [1, 5, 17]:  # spmv, small batch, prefill (dense expansion + F.linear)
        x = torch.randn(1, rows, 64)
        assert relative_error(layer(x), x.double() @ dense.T) < 1e-6


# ---------------------------------------------------------------- GPU: the fast path (inline PTX)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("out_features,in_features", [(6144, 4096), (4096, 14336), (28672, 4096)])
@pytest.mark.parametrize("batch", [1, 3])
def test_gpu_spmv_every_candidate_config(out_features, in_features, batch):
    # Every config the autotuner may pick, not only the one it picks on this GPU.
    values, mask = random_packed(out_features, in_features, "2:4", batch, device="cuda", dtype=torch.bfloat16)
    reference_weight = unpack(values, mask).double()
    x = torch.randn(batch, in_features, device="cuda", dtype=torch.bfloat16)
    for config in compiled_first(kernels._spmv_kernel, kernels.candidate_configs(out_features, in_features // 32, batch),
                                 lambda c: kernels.spmv(x, values, mask, config=c, compile_only=True)):
        x = torch.randn(batch, in_features, device="cuda", dtype=torch.bfloat16)
        out = torch.full((batch, out_features), float("nan"), device="cuda", dtype=torch.bfloat16)
        y = kernels.spmv(x, values, mask, config=config, out=out)
        assert relative_error(y, x.double() @ reference_weight.T) < 1e-2, config


@pytest.mark.gpu
@needs_cuda
@torch.no_grad()
@pytest.mark.parametrize("rows", [1, 4, 8])
def test_gpu_sparse_decode_step_with_the_default_fusions_matches_float64(rows):
    """A whole bf16 model's decode step on the GPU with the shipped row thresholds: at 1 row the
    SpMVs take norm, silu * up and residual; at 4 the prologues run apart; at 8 the residuals too.
    Eagerly, then compiled into CUDA graphs as generate.py runs it (its warm-up, recording and
    replays): the kernels' programmatic dependent launches (on Hopper) captured with their edges."""
    from sparse import linear
    model, reference, token = sparse_model_and_float64_reference(rows, "cuda", torch.bfloat16)
    probe, x = model.layers[0].feed_forward.w2, torch.zeros(rows, 1, 96, device="cuda", dtype=torch.bfloat16)
    assert probe.fuses(x) == (rows < linear.RESIDUAL_APART_MIN_ROWS)
    assert probe.fuses(x, prologue=True) == (rows < min(linear.PROLOGUE_APART_MIN_ROWS, linear.RESIDUAL_APART_MIN_ROWS))
    expected = reference(token, torch.tensor([5]))
    logits = model(token.cuda(), torch.tensor([5], device="cuda"))
    assert relative_error(logits.cpu(), expected) < 3e-2
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    for call in range(4):  # the same step again: it writes the same cache slot with the same values
        logits = compiled(token.cuda(), torch.tensor([5], device="cuda"))
        assert relative_error(logits.cpu(), expected) < 3e-2, call


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("slices", [2, 4])
def test_gpu_prefill_matmul_in_slices(slices):
    # The expansion on a second stream, each slice's GEMM on the current one: eagerly and recorded
    # into a CUDA graph (as bench_kernel times it), against float64; y poisoned before the graph's replay.
    from sparse import linear
    values, mask = random_packed(6144, 4096, "2:4", slices, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16)
    reference = x.double() @ unpack(values, mask).double().T
    assert relative_error(linear.prefill_matmul(x, values, mask, slices), reference) < 1e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = linear.prefill_matmul(x, values, mask, slices)
    y.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert relative_error(y, reference) < 1e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("pattern", ["2:4", "16:32", "1:4", "1:8", "1:16", "1:32"])  # 16, 16, 8, 4, 2, 1 a word
def test_gpu_unpack_to_dense_matches_unpack(pattern):
    # The prefill's expansion, compiled for the GPU (16-byte loads, shuffles): a real shape and a
    # ragged one (100 rows, 11 words: neither a multiple of a program's 64 rows nor of its 4 words).
    for out_features, in_features in [(6144, 4096), (100, 352)]:
        values, mask = random_packed(out_features, in_features, pattern, 7, device="cuda", dtype=torch.bfloat16)
        out = torch.full((out_features, in_features), float("nan"), device="cuda", dtype=torch.bfloat16)
        assert torch.equal(kernels.unpack_to_dense(values, mask, out=out), unpack(values, mask)), (out_features, pattern)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("pattern", ["16:32", "1:4"])
def test_gpu_spmv_dtypes_and_ragged_shapes(dtype, bound, pattern):
    # 100 rows and 11 words: neither a multiple of the 32-row block nor of any config's words.
    values, mask = random_packed(100, 352, pattern, 5, device="cuda", dtype=dtype)
    reference_weight = unpack(values, mask).double()
    for config in [(1, 11, 2), (2, 3, 2), (8, 1, 1)]:  # whole K in one warp; a tail word; split K
        for batch in (1, 5):
            x = torch.randn(batch, 352, device="cuda", dtype=dtype)
            out = torch.full((batch, 100), float("nan"), device="cuda", dtype=dtype)
            y = kernels.spmv(x, values, mask, config=config, out=out)
            assert relative_error(y, x.double() @ reference_weight.T) < bound, (config, batch)
            workspace, arrivals = kernels._workspace(x.device, 0, 0)
            assert not workspace.any() and not arrivals.any(), "split-K must leave its workspace zeroed"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fusion", ["norm", "residual", "gated+residual"])  # wqkv and w13; wo; w2
@pytest.mark.parametrize("out_features,in_features", [(6144, 4096), (4096, 14336)])
def test_gpu_spmv_fused_prologue_and_residual(fusion, out_features, in_features):
    # Real shapes in bf16: every config the autotuner may pick at batch 1, two of them at batch 3
    # and at batch 8 (x packed in bf16 pairs by default from kernels.PACK_X_MIN_BATCH rows).
    values, mask = random_packed(out_features, in_features, "2:4", 11, device="cuda", dtype=torch.bfloat16)
    weight = unpack(values, mask)
    gated = FUSED[fusion].get("gated", False)
    for batch in (1, 3, 8):
        configs = kernels.candidate_configs(out_features, in_features // 32, batch)
        for config in configs if batch == 1 else configs[:1] + configs[-1:]:
            x = torch.randn(batch, in_features * (2 if gated else 1), device="cuda", dtype=torch.bfloat16)
            norm_weight = (1 + 0.3 * torch.randn(in_features, device="cuda")).bfloat16() if FUSED[fusion].get("norm") else None
            residual = torch.randn(batch, out_features, device="cuda", dtype=torch.bfloat16) if FUSED[fusion].get("residual") else None
            out = torch.full((batch, out_features), float("nan"), device="cuda", dtype=torch.bfloat16)
            y = kernels.spmv(x, values, mask, config=config, out=out, norm_weight=norm_weight, norm_eps=1e-5,
                             residual=residual, gated=gated)
            expected = fused_reference(x, weight, norm_weight, 1e-5, residual, gated)
            assert relative_error(y, expected) < 1e-2, (config, batch)
        # The tuned config, as a decode step gets it (the tuner times the plain product).
        y = kernels.spmv(x, values, mask, norm_weight=norm_weight, norm_eps=1e-5, residual=residual, gated=gated)
        assert relative_error(y, expected) < 1e-2, batch


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("l2_megabytes", [16, 0.01])  # the default budget; one that prefetches nothing
def test_gpu_spmv_chain_with_pdl_in_a_cuda_graph(l2_megabytes, monkeypatch):
    """Each SpMV reads the one before's output (x, and the residual) while launched to overlap it
    (programmatic dependent launch): its wait must come before those reads and before the split-K
    workspace, which consecutive calls share. Links 3 and 6 are the sparse tensor cores' product
    (sparse/mma_sp.py, launched the same way). Link by link against float64, over two graph
    replays with new inputs, so that a read of the last replay's x would show."""
    from sparse import mma_sp
    assert kernels.programmatic_launch(torch.device("cuda")) == kernels.hopper_or_later(torch.cuda.current_device())
    monkeypatch.setattr(kernels, "PDL_L2_PREFETCH_BYTES", int(l2_megabytes * 2 ** 20))
    n = 4096
    layers = [random_packed(n, n, "2:4", 20 + i, device="cuda", dtype=torch.bfloat16) for i in range(6)]
    configs = [(2, 4, 2), (16, 8, 1), (4, 32, 4, 1, 4), (32, 4, 2), (4, 8, 1), (8, 16, 2, 2, 2)]  # split K or not
    x = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    norm_weight = (1 + 0.3 * torch.randn(n, device="cuda")).bfloat16()

    def chain():
        outputs, h = [], x
        for i, ((values, mask), config) in enumerate(zip(layers, configs)):
            options = dict(norm_weight=norm_weight, norm_eps=1e-5) if i % 2 else dict(residual=h)
            product = mma_sp.spmv_2of4 if len(config) == 5 else kernels.spmv
            h = product(h, values, mask, config=config, **options)
            outputs.append(h)
        return outputs

    x.copy_(torch.randn(1, n, device="cuda"))
    chain()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = chain()
    for replay in range(2):
        x.copy_(torch.randn(1, n, device="cuda") * (replay + 1))
        graph.replay()
        torch.cuda.synchronize()
        h = x
        for i, ((values, mask), y) in enumerate(zip(layers, outputs)):
            weight = unpack(values, mask)
            expected = (fused_reference(h, weight, norm_weight, 1e-5) if i % 2 else
                        fused_reference(h, weight, residual=h))
            assert relative_error(y, expected) < 1e-2, (replay, i)
            h = y
    workspace, arrivals = kernels._workspace(x.device, 0, 0)
    assert not workspace.any() and not arrivals.any()


def test_l2_prefetch_words_share_the_budget_over_the_grid(monkeypatch):
    monkeypatch.setattr(kernels, "PDL_L2_PREFETCH_BYTES", 16 << 20)
    # Llama-3.1-8B's w13 (28672 rows: 896 row blocks) at 4 warps a program, 36 bytes a row and word
    # (16 bf16 values and the mask word): 4.1 MB a word of every warp, so 4 words fit 16 MB.
    assert kernels.l2_prefetch_words(896 * 4 * 32 * 36, 32) == 4
    assert kernels.l2_prefetch_words(128 * 4 * 32 * 36, 32) == 28  # o (4096 rows): 28 of each warp's 32 words
    assert kernels.l2_prefetch_words(64 * 4 * 32 * 36, 32) == 32  # never more than the warp walks
    monkeypatch.setattr(kernels, "PDL_L2_PREFETCH_BYTES", 0)
    assert kernels.l2_prefetch_words(128 * 4 * 32 * 36, 32) == 0
    assert not kernels.programmatic_launch(torch.device("cpu"))


def test_pdl_l2_prefetch_sets_the_budget_for_its_block_only(monkeypatch):
    monkeypatch.setattr(kernels, "PDL_L2_PREFETCH_BYTES", 16 << 20)
    with kernels.pdl_l2_prefetch(4 * 2 ** 20):  # bench_kernel.py --chain passes megabytes * 2 ** 20
        assert kernels.l2_prefetch_words(128 * 4 * 32 * 36, 32) == 7
    with pytest.raises(RuntimeError, match="inside"), kernels.pdl_l2_prefetch(0):
        assert kernels.l2_prefetch_words(128 * 4 * 32 * 36, 32) == 0
        raise RuntimeError("inside")  # a benchmark that fails must not leave the budget changed
    assert kernels.PDL_L2_PREFETCH_BYTES == 16 << 20
