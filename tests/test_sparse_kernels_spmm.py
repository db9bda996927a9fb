"""sparse/kernels/spmm.py: the tensor-core SpMM, on CPU under TRITON_INTERPRET=1 (the real kernel)
against float64, its machine code for sm_90a (compiled on the CPU), and on the GPU (marked `gpu`) on
Llama-3.1-8B shapes, eagerly and under torch.compile with CUDA graphs.

The interpreter must be on before Triton decorates the kernels, so the CPU checks run in a fresh
Python process started by the first test (tests/sparse_kernel_testing.py).
"""
import dataclasses

import pytest
import torch

from sparse.format import unpack
from sparse.kernels import common, spmm
from tests import sass
from tests.sparse_kernel_testing import (assert_workspace_zeroed, case_seed, interpreted, random_packed,
                                        relative_error)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# 40 rows: not a multiple of the 32-row tile; 96 columns = 3 words: a multiple of 32 but not of
# the 2-word K step, and split 2 ways (2 + 1 words); up to the MMA's 16 rows of x. two_of_four: a
# bf16 2:4 weight expanded by nibble (the nibble expansion moves 16-bit pairs), else by gather.
CASES = [("2:4", 4, False), ("4:8", 8, False), ("8:16", 16, False), ("16:32", 4, False), ("2:4", 1, False),
         ("16:32", 13, False), ("2:4", 4, True), ("2:4", 16, True)]


@interpreted
@pytest.mark.parametrize("pattern,tokens,two_of_four", CASES)
def test_spmm_matches_float64(pattern, tokens, two_of_four):
    dtype = torch.bfloat16 if two_of_four else torch.float32
    seed = case_seed(pattern, tokens, two_of_four)
    values, mask = random_packed(40, 96, pattern, seed, dtype=dtype)
    weight = unpack(values, mask).double()
    for config in [(32, 1, 1, 1), (32, 2, 1, 2)]:  # (BLOCK_OUT, WORDS, warps, split): one word a step; two, split
        x = torch.randn(tokens, 96, generator=torch.Generator().manual_seed(seed + config[1])).to(dtype)
        out = torch.full((tokens, 40), float("nan"), dtype=dtype)  # poisoned: an unwritten element fails
        y = spmm.spmm(x, values, mask, config=config, out=out, two_of_four=two_of_four)
        assert relative_error(y, x.double() @ weight.T) < (1e-2 if two_of_four else 1e-6), config  # y in bf16
        assert_workspace_zeroed(x.device)


@interpreted
def test_spmm_compile_only_launches_nothing():
    # What the tuner calls to compile every candidate before any is launched.
    values, mask = random_packed(40, 96, "2:4", 6)
    out = torch.full((4, 40), float("nan"))
    spmm.spmm(torch.ones(4, 96), values, mask, config=(32, 1, 1, 1), out=out, compile_only=True)
    assert out.isnan().all()


@interpreted
def test_spmm_refuses_more_rows_than_the_mma_tile():
    values, mask = random_packed(40, 96, "2:4", 6)
    with pytest.raises(ValueError, match="is not up to 16 rows"):
        spmm.spmm(torch.ones(17, 96), values, mask)


def permute_bytes(pair: int, selector: int) -> int:
    """PTX prmt.b32 pair, 0, selector (default mode): output byte i is byte selector[4i:4i+4] of
    the eight bytes pair (0-3), zero (4-7)."""
    source = pair.to_bytes(4, "little") + bytes(4)
    return int.from_bytes(bytes(source[(selector >> 4 * i) & 7] for i in range(4)), "little")


def test_prmt_selectors_expand_every_2of4_nibble():
    # The GPU's byte permutes against the columns a 2:4 nibble means (the interpreter cannot run
    # inline PTX, so this is where the selector tables are checked): a, b the pair's halves.
    a, b = 0x1A2B, 0x3C4D
    for nibble in (0b0011, 0b0101, 0b0110, 0b1001, 0b1010, 0b1100):
        kept = [column for column in range(4) if nibble >> column & 1]
        columns = [{kept[0]: a, kept[1]: b}.get(column, 0) for column in range(4)]
        low = permute_bytes(a | b << 16, spmm.LOW_PAIR_SELECTORS.value >> 16 * (nibble & 3) & 0xFFFF)
        high = permute_bytes(a | b << 16, spmm.HIGH_PAIR_SELECTORS.value >> 16 * (nibble >> 2) & 0xFFFF)
        assert (low, high) == (columns[0] | columns[1] << 16, columns[2] | columns[3] << 16), bin(nibble)


@interpreted
def test_spmm_2of4_expands_fp32_by_gather_and_refuses_other_patterns():
    # fp32 W: the gather expansion (the nibble one moves 16-bit pairs); a weight not 16 a word: refused.
    values, mask = random_packed(40, 96, "2:4", 5)
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(5))
    y = spmm.spmm(x, values, mask, two_of_four=True)
    assert relative_error(y, x.double() @ unpack(values, mask).double().T) < 1e-6
    values_1of4, mask_1of4 = random_packed(40, 96, "1:4", 5)
    with pytest.raises(ValueError, match="a 2:4 weight keeps 16 values a word, this one 8"):
        spmm.spmm(x, values_1of4, mask_1of4, two_of_four=True)


# ---------------------------------------------------------------- GPU

LLAMA_8B_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("out_features,in_features", LLAMA_8B_SHAPES)
@pytest.mark.parametrize("two_of_four", [False, True])  # expanded by gather, or by nibble
def test_spmm_llama_shapes_bf16(out_features, in_features, two_of_four):
    values, mask = random_packed(out_features, in_features, "2:4", 0, device="cuda", dtype=torch.bfloat16)
    reference_weight = unpack(values, mask).double()
    for tokens in (4, 8, 16):
        for config in spmm.candidate_configs(out_features, in_features // 32):
            x = torch.randn(tokens, in_features, device="cuda", dtype=torch.bfloat16)
            out = torch.full((tokens, out_features), float("nan"), device="cuda", dtype=torch.bfloat16)
            y = spmm.spmm(x, values, mask, config=config, out=out, two_of_four=two_of_four)
            assert relative_error(y, x.double() @ reference_weight.T) < 1e-2, (tokens, config)


@pytest.mark.gpu
@gpu
def test_spmm_under_cuda_graphs(monkeypatch):
    from sparse import SparseLinear, linear
    torch.manual_seed(0)
    layer = SparseLinear.from_dense(torch.randn(6144, 4096, device="cuda", dtype=torch.bfloat16), "16:32")
    dense = unpack(layer.values, layer.mask).double()
    compiled = torch.compile(layer, fullgraph=True, mode="reduce-overhead")
    monkeypatch.setattr(linear, "ROUTES", dataclasses.replace(linear.ROUTES, spmm_from_rows=4))
    monkeypatch.setattr(linear, "can_time_in_cuda_graph", lambda x: False)  # the SpMM from 4 rows, not the race's pick
    for tokens in (4, 8, 16):
        layer(torch.randn(tokens, 4096, device="cuda", dtype=torch.bfloat16))  # tune outside the graph
        for _ in range(3):  # warm-up, recording, then a replay, each with fresh inputs
            x = torch.randn(tokens, 4096, device="cuda", dtype=torch.bfloat16)
            assert relative_error(compiled(x).clone(), x.double() @ dense.T) < 1e-2


# ---------------------------------------------------------------- machine code (sm_90a, compiled on the CPU)

@pytest.mark.skipif(common.INTERPRETING, reason="compiles for sm_90a; not the interpreter's kernels")
def test_2of4_nibble_expansion_fits_the_issue_budget():
    # The K loop at a decode batch: the gather expansion is over the ~17.7 instructions per kept
    # weight that the H200 can issue at full bandwidth; the 2:4 nibble one (two byte permutes a
    # nibble) must stay well under it, without spills, with the same MMAs.
    gather, nibble = (sass.spmm_kernel(two_of_four) for two_of_four in (False, True))
    assert nibble["spill_bytes"] == 0 and nibble["per_kept_weight"] < 12 and 17.7 < gather["per_kept_weight"]
    assert nibble["mix"]["PRMT"] == 2 * 8 * 2  # per nibble, 8 nibbles a word, 2 words a K step
    assert nibble["mix"]["HGMMA"] == gather["mix"]["HGMMA"]
    assert nibble["registers"] <= 2 ** 16 // (4 * 128)  # four programs of 128 threads an SM
