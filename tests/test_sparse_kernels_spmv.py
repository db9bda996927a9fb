"""sparse/kernels/spmv.py: the SpMV, on CPU under TRITON_INTERPRET=1 (the real kernel) against
float64, its machine code for sm_90a (compiled on the CPU), and on the GPU (marked `gpu`).

The interpreter must be on before Triton decorates the kernels, and other test modules import
`sparse` first; so the interpreted checks run in a fresh Python process (the first test,
tests/sparse_kernel_testing.py).
"""
import re

import pytest
import torch

from sparse.format import unpack
from sparse.kernels import common, mma_sp, spmv
from tests import sass
from tests.sparse_kernel_testing import (assert_workspace_zeroed, case_seed, compiled_first, interpreted,
                                        random_packed, relative_error)

PATTERNS = ["2:4", "4:8", "8:16", "16:32", "1:4"]


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
        y = spmv.spmv(x, values, mask, config=config, out=out)
        assert y.shape == (batch, 37)
        assert relative_error(y, x.double() @ reference_weight.T) < 1e-6, config
        assert_workspace_zeroed(x.device)


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
        y = spmv.spmv(x, values, mask, config=config, out=out, pack_x=True)
        assert relative_error(y, x.bfloat16().double() @ reference_weight.T) < 1e-6, config
    with pytest.raises(ValueError, match="at least 2 rows"):
        spmv.spmv(x[:1], values, mask, pack_x=True)


@interpreted
def test_spmv_compile_only_launches_nothing():
    # What the tuner and the GPU tests call to compile every candidate before any is launched.
    values, mask = random_packed(37, 96, "2:4", 4)
    out = torch.full((2, 37), float("nan"))
    spmv.spmv(torch.ones(2, 96), values, mask, config=(1, 3, 1), out=out, compile_only=True)
    assert out.isnan().all()


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_spmv_16_bit(dtype):
    values, mask = random_packed(40, 64, "2:4", 7)
    values = values.to(dtype)
    x = torch.randn(2, 64).to(dtype)
    y = spmv.spmv(x, values, mask, config=(2, 1, 1))
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
        y = spmv.spmv(x, values, mask, config=config, out=out, norm_weight=norm_weight, norm_eps=1e-5,
                         residual=residual, gated=gated, pack_x=pack_x)
        expected = fused_reference(x, weight, norm_weight, 1e-5, residual, gated)
        # Packed, the prologue's output is rounded to bf16 (as an unfused bf16 model rounds it).
        assert relative_error(y, expected) < (1e-2 if pack_x else 1e-6), config
        assert_workspace_zeroed(x.device)


@interpreted
def test_spmv_rejects_fused_operands_of_the_wrong_shape():
    values, mask = random_packed(8, 64, "2:4", 1)
    with pytest.raises(ValueError, match=r"gated: x holds gate and up"):
        spmv.spmv(torch.randn(1, 64), values, mask, gated=True)
    with pytest.raises(ValueError, match=r"norm weight \(32,\) does not match in_features=64"):
        spmv.spmv(torch.randn(1, 64), values, mask, norm_weight=torch.ones(32))
    with pytest.raises(ValueError, match=r"residual \(1, 9\) does not match the output \(1, 8\)"):
        spmv.spmv(torch.randn(1, 64), values, mask, residual=torch.ones(1, 9))
    with pytest.raises(ValueError, match=r"either a norm or gated, not both"):
        spmv.spmv(torch.randn(1, 128), values, mask, norm_weight=torch.ones(64), gated=True)


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
    for config in compiled_first(spmv.spmv_kernel, spmv.candidate_configs(out_features, in_features // 32, batch),
                                 lambda c: spmv.spmv(x, values, mask, config=c, compile_only=True)):
        x = torch.randn(batch, in_features, device="cuda", dtype=torch.bfloat16)
        out = torch.full((batch, out_features), float("nan"), device="cuda", dtype=torch.bfloat16)
        y = spmv.spmv(x, values, mask, config=config, out=out)
        assert relative_error(y, x.double() @ reference_weight.T) < 1e-2, config


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
            y = spmv.spmv(x, values, mask, config=config, out=out)
            assert relative_error(y, x.double() @ reference_weight.T) < bound, (config, batch)
            assert_workspace_zeroed(x.device)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fusion", ["norm", "residual", "gated+residual"])  # wqkv and w13; wo; w2
@pytest.mark.parametrize("out_features,in_features", [(6144, 4096), (4096, 14336)])
def test_gpu_spmv_fused_prologue_and_residual(fusion, out_features, in_features):
    # Real shapes in bf16: every config the autotuner may pick at batch 1, two of them at batch 3
    # and at batch 8 (there with x packed in bf16 pairs, as the route table asks from 4 rows).
    values, mask = random_packed(out_features, in_features, "2:4", 11, device="cuda", dtype=torch.bfloat16)
    weight = unpack(values, mask)
    gated = FUSED[fusion].get("gated", False)
    for batch in (1, 3, 8):
        configs = spmv.candidate_configs(out_features, in_features // 32, batch)
        for config in configs if batch == 1 else configs[:1] + configs[-1:]:
            x = torch.randn(batch, in_features * (2 if gated else 1), device="cuda", dtype=torch.bfloat16)
            norm_weight = (1 + 0.3 * torch.randn(in_features, device="cuda")).bfloat16() if FUSED[fusion].get("norm") else None
            residual = torch.randn(batch, out_features, device="cuda", dtype=torch.bfloat16) if FUSED[fusion].get("residual") else None
            out = torch.full((batch, out_features), float("nan"), device="cuda", dtype=torch.bfloat16)
            y = spmv.spmv(x, values, mask, config=config, out=out, norm_weight=norm_weight, norm_eps=1e-5,
                          residual=residual, gated=gated, pack_x=batch >= 4)
            expected = fused_reference(x, weight, norm_weight, 1e-5, residual, gated)
            assert relative_error(y, expected) < 1e-2, (config, batch)
        # The tuned config, as a decode step gets it (the tuner times the plain product).
        y = spmv.spmv(x, values, mask, norm_weight=norm_weight, norm_eps=1e-5, residual=residual, gated=gated,
                      pack_x=batch >= 4)
        assert relative_error(y, expected) < 1e-2, batch


@pytest.mark.gpu
@needs_cuda
def test_gpu_spmv_chain_in_a_cuda_graph():
    """Each SpMV reads the one before's output (x, and the residual) inside one CUDA graph, and
    consecutive calls share the split-K workspace, which each must leave zeroed. Links 3 and 6 are
    the sparse tensor cores' product (sparse/kernels/mma_sp.py). Link by link against float64, over
    two graph replays with new inputs, so that a read of the last replay's x would show."""
    n = 4096
    layers = [random_packed(n, n, "2:4", 20 + i, device="cuda", dtype=torch.bfloat16) for i in range(6)]
    configs = [(2, 4, 2), (16, 8, 1), (4, 32, 4, 1, 4), (32, 4, 2), (4, 8, 1), (8, 16, 2, 2, 2)]  # split K or not
    x = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    norm_weight = (1 + 0.3 * torch.randn(n, device="cuda")).bfloat16()

    def chain():
        outputs, h = [], x
        for i, ((values, mask), config) in enumerate(zip(layers, configs)):
            options = dict(norm_weight=norm_weight, norm_eps=1e-5) if i % 2 else dict(residual=h)
            product = mma_sp.spmv_2of4 if len(config) == 5 else spmv.spmv
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
    assert_workspace_zeroed(x.device)




# ---------------------------------------------------------------- machine code (sm_90a, compiled on the CPU)

machine_code = pytest.mark.skipif(common.INTERPRETING, reason="compiles for sm_90a; not the interpreter's kernels")


@machine_code
def test_batch_one_spmv_machine_code():
    report = sass.spmv_kernel(batch=1, slices=4, prefetch=2)
    assert report["spill_bytes"] == 0
    # Per kept weight one bit scan (FLO), one shuffle of x and one FMA: 16 of each per word walked.
    assert report["ffma"] == 16 and report["flo"] == 16 and report["shfl"] == 16
    # A word's loads: the mask, two 16-byte value loads and x. No shared memory inside the loop
    # (a layout conversion there would mean a barrier per word).
    assert report["loads"] == 4 and report["shared"] == 0
    assert report["loop"] / report["kept_weights"] < 10  # the issue budget is ~17.7 per kept weight


@machine_code
def test_fused_prologues_cost_one_load_per_word():
    # The RMSNorm prologue (wqkv, w13) adds the norm weight's load, a multiply and the square of x
    # for 1/rms (one FFMA) per word; silu(gate) * up (w2) the up load and h + h * tanh(h) with one
    # MUFU op: per word, not per kept weight, so the loop stays well under the issue budget.
    for variant in ("norm", "gated"):
        report = sass.spmv_kernel(batch=1, slices=4, prefetch=2, variant=variant)
        assert report["spill_bytes"] == 0, variant
        assert report["ffma"] == 17 and report["flo"] == 16 and report["shfl"] == 16, variant
        assert report["mufu"] == (1 if variant == "gated" else 0), variant
        assert report["loads"] == 5 and report["shared"] == 0, variant
        assert report["loop"] / report["kept_weights"] < 10, variant


@machine_code
def test_packed_x_halves_the_shuffles():
    # At 8 rows of x, one shuffle per kept weight serves two rows (bf16 pairs in one register):
    # 64 shuffles per word instead of 128, the 128 FMAs unchanged, no shared memory in the loop.
    for packed_x, shuffles in ((False, 128), (True, 64)):
        report = sass.spmv_kernel(batch=8, slices=4, prefetch=1, packed_x=packed_x)
        assert report["spill_bytes"] == 0 and report["shared"] == 0, packed_x
        assert report["shfl"] == shuffles and report["ffma"] == 128 and report["flo"] == 16, packed_x


@machine_code
def test_residual_is_loaded_before_the_split_k_arrival():
    # The residual is read by every program before it adds its partial sums and counts its arrival,
    # not by the last program after them: its L2 round trip overlaps the partial sums' instead of
    # following the arrival's and the exchange's.
    code = sass.spmv_kernel(batch=1, slices=4, prefetch=2, variant="gated")["sass"]
    instructions = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([^;]*);", code)
    residual_load = next(i for i, text in enumerate(instructions) if text.startswith("LDG.E.U16 "))  # not x's .SM
    arrival = next(i for i, text in enumerate(instructions) if text.startswith("ATOMG"))
    assert residual_load < arrival, (residual_load, arrival)
