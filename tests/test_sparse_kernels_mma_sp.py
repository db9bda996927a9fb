"""sparse/kernels/mma_sp.py: the 2:4 product on the sparse tensor cores. On CPU the real kernel runs
under TRITON_INTERPRET=1 with mma.sp emulated from the fragment layout, against float64; its metadata
from the bitmask against the PTX ISA's encoding; its sm_90a machine code (compiled on the CPU); on the
GPU (marked) the hardware instruction on real shapes."""
import pytest
import torch

from sparse.format import pack, unpack
from sparse.kernels import common, mma_sp
from tests import sass
from tests.sparse_kernel_testing import (case_seed, compiled_first, interpreted, random_packed, relative_error)


def metadata_reference(word: int) -> int:
    """mma.sp's metadata of a mask word, nibble by nibble: the two set bits' positions, first in the
    low two bits (PTX ISA: the meaningful values are 0b0100, 0b1000, 0b1001, 0b1100, 0b1101, 0b1110)."""
    out = 0
    for group in range(8):
        nibble = (word >> 4 * group) & 0xF
        first, second = [i for i in range(4) if nibble >> i & 1]
        out |= (first | second << 2) << 4 * group
    return out


@interpreted
def test_metadata_of_every_2of4_word_shape():
    # The six nibbles with two set bits, each in every position of a word.
    import triton
    import triton.language as tl

    @triton.jit
    def metadata_kernel(words_ptr, out_ptr):
        offsets = tl.arange(0, 64)
        tl.store(out_ptr + offsets, mma_sp.metadata_of(tl.load(words_ptr + offsets)))

    nibbles = [0b0011, 0b0101, 0b0110, 0b1001, 0b1010, 0b1100]
    words = [sum(nibbles[(i + g) % 6] << 4 * g for g in range(8)) for i in range(6)]
    words += [int(w) for w in torch.randint(0, 6, (58, 8), generator=torch.Generator().manual_seed(0))
              .apply_(lambda i: nibbles[i]).mul(torch.tensor([16 ** g for g in range(8)])).sum(1)]
    as_int32 = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)
    out = torch.empty(64, dtype=torch.int32)
    metadata_kernel[(1, )](as_int32.view(torch.uint32), out.view(torch.uint32))
    assert [int(v) & 0xFFFFFFFF for v in out] == [metadata_reference(w) for w in words]
    assert {metadata_reference(n * 0x11111111) & 0xF for n in nibbles} == {0b0100, 0b1000, 0b1001, 0b1100, 0b1101, 0b1110}


# (slices, words per warp, unroll, tiles, words ahead): the last word past the end (2 x 2, 4 x 1),
# unrolled past the words there are (4 > 3), two 16-row tiles a warp (on 40 rows the second
# program's tiles shift back to rows 8-39 and store only 32-39), and 2 or 3 words ahead (the loop
# then runs once or not at all: the words come from the ring's fill and drain; with 2 x 2 the second
# warp's second word is past the end).
K_CONFIGS = [(1, 3, 1, 1, 1), (2, 2, 2, 1, 2), (4, 1, 4, 2, 1), (1, 3, 4, 2, 2), (1, 3, 4, 1, 3)]


# 96 columns = 3 words. 40 rows: two and a half 16-row tiles; 72 for three and four tiles a program
# (the second program shifted back by 24 or 56 rows). Every K walk at a partial block of 8 batch
# rows; one row, a full block, and two blocks (the second partial) with one walk each and four or
# three tiles, since the batch only sets the blocks and their masks (each interpreted launch takes
# seconds).
@interpreted
@pytest.mark.parametrize("batch,out_features,configs", [
    (3, 40, K_CONFIGS), (1, 40, K_CONFIGS[3:4]), (8, 40, K_CONFIGS[3:4]),
    (11, 72, K_CONFIGS[1:2] + [(1, 3, 2, 4, 2), (1, 3, 2, 3, 2)])], ids=["3rows", "1row", "8rows", "11rows"])
def test_product_matches_float64(batch, out_features, configs):
    seed = case_seed("mma_sp", batch)
    values, mask = random_packed(out_features, 96, "2:4", seed, dtype=torch.bfloat16)
    reference_weight = unpack(values, mask).double()
    for i, config in enumerate(configs):
        x = torch.randn(batch, 96, generator=torch.Generator().manual_seed(seed + i)).to(torch.bfloat16)
        out = torch.full((batch, out_features), float("nan"), dtype=torch.bfloat16)  # poisoned
        y = mma_sp.spmv_2of4(x, values, mask, config=config, out=out)
        assert relative_error(y, x.double() @ reference_weight.T) < 1e-2, config  # bf16 output rounding
    if batch in (3, 11):
        residual = torch.randn(batch, out_features, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        y = mma_sp.spmv_2of4(x, values, mask, config=(2, 2, 2, 2, 2), residual=residual)
        assert relative_error(y, residual.double() + x.double() @ reference_weight.T) < 1e-2


def fragment_order_reference(x: torch.Tensor) -> torch.Tensor:
    """x's B fragments by index: word w, x row r, thread t's register j (the word's bf16 pair
    4(t // 2) + t % 2 + (0, 8, 2, 10)[j], as `_word_pointers` derives from the ISA) at pair 4t + j;
    rows up to the next multiple of 8 zero."""
    rows, width = x.shape
    pairs = x.view(rows, width // 32, 16, 2)
    out = torch.zeros(width // 32, 8 * -(-rows // 8), 16, 2, dtype=x.dtype)
    for t in range(4):
        for j in range(4):
            out[:, :rows, 4 * t + j] = pairs[:, :, 4 * (t // 2) + t % 2 + (0, 8, 2, 10)[j]].transpose(0, 1)
    return out.view(width // 32, -1, 32)


@pytest.mark.parametrize("rows", [1, 5, 8, 12, 16])
def test_fragment_order_matches_the_fragments_by_index(rows):
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    assert torch.equal(mma_sp.fragment_order(x), fragment_order_reference(x))


# x in fragment order at the rows where a decode step gives it (8-16): one full block, a partial
# second block, two full; K split over warps (with the last word past the end at 12 rows), two tiles.
@interpreted
@pytest.mark.parametrize("rows,out_features,configs", [
    (8, 40, [(4, 1, 4, 2, 1)]), (12, 40, [(2, 2, 2, 1, 2)]), (16, 40, [(1, 3, 2, 2, 2)])])
def test_product_of_x_in_fragment_order_equals_the_row_major_product(rows, out_features, configs):
    # The same instructions on the same fragments, so the same bits as spmv_2of4; and float64 close.
    seed = case_seed("mma_sp fragments", rows)
    values, mask = random_packed(out_features, 96, "2:4", seed, dtype=torch.bfloat16)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    expected = x.double() @ unpack(values, mask).double().T
    for config in configs:
        y = mma_sp.spmv_2of4_fragments(mma_sp.fragment_order(x), values, mask, rows, config=config)
        assert torch.equal(y, mma_sp.spmv_2of4(x, values, mask, config=config)), config
        assert relative_error(y, expected) < 1e-2, config


def test_candidates_have_no_more_tiles_than_the_weight_fills():
    # A program's tiles are one block of rows, so a 40-row weight takes one or two tiles, 16 rows one.
    assert {c[3] for c in mma_sp.candidate_configs(40, 3, 16)} == {1, 2}
    assert {c[3] for c in mma_sp.candidate_configs(16, 3, 1)} == {1}
    assert {c[3] for c in mma_sp.candidate_configs(4096, 128, 16)} == {1, 2, 3, 4}
    assert {c[3] for c in mma_sp.candidate_configs(4096, 128, 8)} == {1, 2, 3}


@interpreted
def test_compile_only_launches_nothing():
    # What the tuner and the GPU tests call to compile every candidate before any is launched.
    values, mask = random_packed(40, 96, "2:4", 5, dtype=torch.bfloat16)
    out = torch.full((3, 40), float("nan"), dtype=torch.bfloat16)
    mma_sp.spmv_2of4(torch.ones(3, 96, dtype=torch.bfloat16), values, mask, config=(1, 3, 1, 1, 1), out=out,
                     compile_only=True)
    assert out.isnan().all()


def prologue_case(prologue: str, batch: int, values, mask, seed: int, device="cpu"):
    """(x, spmv_2of4's options, float64 expected output) for a fused prologue, as a decode step
    gives them at 1-3 rows: "norm" (RMSNorm(x) * norm weight: qkv, w13) or "gated" (x = [gate | up]
    -> silu(gate) * up, with the residual: w2)."""
    n_words, out_features = mask.shape
    in_features = n_words * 32
    generator = torch.Generator().manual_seed(seed)
    weight = unpack(values, mask).double().cpu()
    if prologue == "norm":
        x = (3 * torch.randn(batch, in_features, generator=generator)).to(torch.bfloat16)
        norm_weight = (1 + 0.3 * torch.randn(in_features, generator=generator)).to(torch.bfloat16)
        x64 = x.double()
        expected = (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_weight.double()) @ weight.T
        options = dict(norm_weight=norm_weight.to(device), norm_eps=1e-5)
    else:
        x = (2 * torch.randn(batch, 2 * in_features, generator=generator)).to(torch.bfloat16)
        residual = torch.randn(batch, out_features, generator=generator).to(torch.bfloat16)
        gate, up = x.double().chunk(2, dim=-1)
        expected = residual.double() + (torch.nn.functional.silu(gate) * up) @ weight.T
        options = dict(gated=True, residual=residual.to(device))
    return x.to(device), options, expected.to(device)


PROLOGUE_CONFIGS = [(2, 2, 2, 1, 2), (1, 3, 4, 2, 1), (1, 4, 4, 1, 4)]


@interpreted
@pytest.mark.parametrize("prologue", ["norm", "gated"])
@pytest.mark.parametrize("batch,configs", [(3, PROLOGUE_CONFIGS), (1, PROLOGUE_CONFIGS[1:2]),
                                           (11, PROLOGUE_CONFIGS[:1])], ids=["3rows", "1row", "11rows"])
def test_product_with_a_prologue_fused_matches_float64(prologue, batch, configs):
    # The norm: x times its weight rounded to bf16 before the instruction, 1/rms from the squares of
    # every x the warps loaded, applied at the end; gated: silu(gate) * up rounded to bf16, and the
    # residual after. Configs: K split over two warps with the last word past the end, two tiles,
    # and four words ahead (one past the end); every one at 3 rows, one each at 1 and 11.
    seed = case_seed("mma_sp", prologue, batch)
    values, mask = random_packed(40, 96, "2:4", seed, dtype=torch.bfloat16)
    x, options, expected = prologue_case(prologue, batch, values, mask, seed)
    for config in configs:
        out = torch.full((batch, 40), float("nan"), dtype=torch.bfloat16)
        y = mma_sp.spmv_2of4(x, values, mask, config=config, out=out, **options)
        assert relative_error(y, expected) < 1e-2, config


def test_bad_operands_are_one_clear_error():
    values, mask = random_packed(16, 64, "2:4", 0, dtype=torch.bfloat16)
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bf16"):
        mma_sp.spmv_2of4(x.float(), values, mask)
    with pytest.raises(ValueError, match="in_features=64"):
        mma_sp.spmv_2of4(torch.zeros(1, 96, dtype=torch.bfloat16), values, mask)
    with pytest.raises(ValueError, match="1 to 16 rows"):
        mma_sp.spmv_2of4(torch.zeros(17, 64, dtype=torch.bfloat16), values, mask)
    with pytest.raises(ValueError, match="words ahead"):
        mma_sp.spmv_2of4(x, values, mask, config=(1, 2, 2, 1, 4))  # more words ahead than the warp's 2
    with pytest.raises(ValueError, match="does not cover"):
        mma_sp.spmv_2of4(x, values, mask, config=(1, 1, 2, 1, 1))  # one word of two
    with pytest.raises(ValueError, match="2 16-row tiles"):
        mma_sp.spmv_2of4(x, values, mask, config=(1, 2, 2, 2, 1))  # 32 rows of tiles on a 16-row weight
    with pytest.raises(ValueError, match="residual"):
        mma_sp.spmv_2of4(x, values, mask, residual=torch.zeros(2, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="norm weight"):
        mma_sp.spmv_2of4(x, values, mask, norm_weight=torch.ones(32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="gated: twice that"):
        mma_sp.spmv_2of4(x, values, mask, gated=True)  # x must be [gate | up], 128 wide
    with pytest.raises(ValueError, match="one prologue"):
        mma_sp.spmv_2of4(torch.zeros(1, 128, dtype=torch.bfloat16), values, mask, gated=True,
                         norm_weight=torch.ones(64, dtype=torch.bfloat16))
    values8, mask8 = random_packed(8, 64, "2:4", 0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="at least 16 rows"):
        mma_sp.spmv_2of4(x, values8, mask8)
    values48, mask48 = pack(torch.randn(16, 64).to(torch.bfloat16), "4:8")
    values48 = values48[:, :, :4].contiguous()  # a 1:4-like buffer shape: not 16 kept values a word
    with pytest.raises(ValueError, match="2:4 weight"):
        mma_sp.spmv_2of4(x, values48, mask48)
    fragments = mma_sp.fragment_order(torch.zeros(8, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="not 12 rows"):
        mma_sp.spmv_2of4_fragments(fragments, values, mask, 12)  # 12 rows are two blocks of 8
    with pytest.raises(ValueError, match="bf16"):
        mma_sp.spmv_2of4_fragments(fragments.float(), values, mask, 8)
    with pytest.raises(ValueError, match="2:4 weight of at least 16 rows"):
        mma_sp.spmv_2of4_fragments(fragments, values8, mask8, 8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("out_features,in_features", [(6144, 4096), (4096, 14336), (40, 96)])
@pytest.mark.parametrize("batch", [1, 5, 8, 16])
def test_product_on_the_tensor_cores_matches_float64(out_features, in_features, batch):
    values, mask = random_packed(out_features, in_features, "2:4", case_seed(out_features, batch), device="cuda",
                                 dtype=torch.bfloat16)
    reference = unpack(values, mask).double()
    x = torch.randn(batch, in_features, device="cuda").to(torch.bfloat16)
    expected = x.double() @ reference.T
    for config in compiled_first(mma_sp.mma_sp_kernel, mma_sp.candidate_configs(out_features, in_features // 32, batch),
                                 lambda c: mma_sp.spmv_2of4(x, values, mask, config=c, compile_only=True)):
        out = torch.full((batch, out_features), float("nan"), device="cuda", dtype=torch.bfloat16)
        y = mma_sp.spmv_2of4(x, values, mask, config=config, out=out)
        assert relative_error(y, expected) < 1e-2, config


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("prologue", ["norm", "gated"])
@pytest.mark.parametrize("out_features,in_features", [(6144, 4096), (40, 96)])
@pytest.mark.parametrize("batch", [1, 3])
def test_product_with_a_prologue_on_the_tensor_cores_matches_float64(prologue, out_features, in_features, batch):
    # At the rows where a decode step fuses the prologues (1-3), on qkv's shape and a small one whose
    # words the warps do not split evenly; every candidate config.
    seed = case_seed(prologue, out_features, batch)
    values, mask = random_packed(out_features, in_features, "2:4", seed, device="cuda", dtype=torch.bfloat16)
    x, options, expected = prologue_case(prologue, batch, values, mask, seed, device="cuda")
    for config in compiled_first(mma_sp.mma_sp_kernel, mma_sp.candidate_configs(out_features, in_features // 32, batch),
                                 lambda c: mma_sp.spmv_2of4(x, values, mask, config=c, compile_only=True, **options)):
        out = torch.full((batch, out_features), float("nan"), device="cuda", dtype=torch.bfloat16)
        y = mma_sp.spmv_2of4(x, values, mask, config=config, out=out, **options)
        assert relative_error(y, expected) < 1e-2, config


# ---------------------------------------------------------------- machine code (sm_90a, compiled on the CPU)

machine_code = pytest.mark.skipif(common.INTERPRETING, reason="compiles for sm_90a; not the interpreter's kernels")


@machine_code
def test_sparse_tensor_core_product_machine_code():
    # One HMMA.SP (m16n8k32, bf16) a word and 8 rows of x, 8 loads a word up to 8 rows (the two
    # rows' 8-byte values, their mask words, x's four bf16 pairs), 12 at 16 (x twice), and with the
    # word loop unrolled 4 times few instructions per kept weight at any batch up to 8, no spills.
    for batch, per_kept_weight, loads in ((1, 7.0, 8), (8, 7.0, 8), (16, 9.0, 12)):
        report = sass.mma_sp_kernel(batch, slices=4, unroll=4)
        assert report["spill_bytes"] == 0, batch
        assert report["sass"].count("HMMA.SP.16832.F32.BF16") >= report["words_in_loop"], batch
        assert report["loads_per_word"] == loads, batch
        assert report["per_kept_weight"] < per_kept_weight, (batch, report["per_kept_weight"])
    # Two 16-row tiles a warp: twice the weight bytes in flight, x's four loads shared, no spills.
    report = sass.mma_sp_kernel(8, slices=4, unroll=4, tiles=2)
    assert report["spill_bytes"] == 0 and report["loads_per_word"] == 12 and report["per_kept_weight"] < 7.0
    # Four tiles at 16 rows (two blocks of x shared by four tiles' loads), two words ahead: no spills.
    report = sass.mma_sp_kernel(16, slices=2, unroll=2, tiles=4, ahead=2)
    assert report["spill_bytes"] == 0 and report["loads_per_word"] == 24 and report["per_kept_weight"] < 8.0
    # Three tiles at 16 rows, two words ahead (what the tuner picks for most 16-row shapes): no
    # spills, every weight load first read more than a word and a half after it was issued, and few
    # enough registers for three programs of four warps an SM: every tile's loads address from one
    # base pointer a thread (with a pointer a row and tile, 249).
    report = sass.mma_sp_kernel(16, slices=8, unroll=2, tiles=3, ahead=2)
    assert report["spill_bytes"] == 0 and report["loads_per_word"] == 20 and report["per_kept_weight"] < 7.0
    assert report["words_to_first_use"][0] >= 1.5 and report["registers"] <= 168


@machine_code
def test_x_in_fragment_order_is_one_load_a_block():
    # One 16-byte load a block of 8 x rows instead of four 4-byte ones: at 16 rows 6 loads a word
    # (12 row-major), with three tiles 14 (20); at 8 rows and two tiles 9 (12). No spills, fewer
    # instructions a kept weight, and the weights' loads still well ahead of their use.
    for args, loads in ((dict(batch=16, slices=4, unroll=4), 6), (dict(batch=8, slices=4, unroll=4, tiles=2), 9),
                        (dict(batch=16, slices=8, unroll=2, tiles=3, ahead=2), 14)):
        report = sass.mma_sp_kernel(x_fragments=True, **args)
        assert report["spill_bytes"] == 0 and report["loads_per_word"] == loads, args
        assert report["per_kept_weight"] < sass.mma_sp_kernel(**args)["per_kept_weight"], args
    assert report["words_to_first_use"][0] >= 1.5 and report["registers"] <= 168


@machine_code
def test_sparse_tensor_core_product_sums_its_warps_slices_in_one_pass_a_tile_and_block():
    # The warps' slices of K are summed through shared memory once per 16-row tile and 8-row block
    # of x (its four accumulators in one reduction: two barriers), not once per accumulator.
    for batch, tiles, most in ((1, 1, 2), (8, 2, 2 * 2 + 1), (16, 2, 4 * 2 + 3)):
        report = sass.mma_sp_kernel(batch, slices=4, unroll=4, tiles=tiles, ahead=4)
        assert report["barriers"] <= most, (batch, tiles, report["barriers"])


@machine_code
def test_sparse_tensor_core_product_keeps_its_words_ahead_in_flight():
    # ptxas reorders the ring of prefetched words (mma_sp.PREFETCH_UNROLL): one word ahead, some
    # weight loads are read in the word they were issued for (0 words later), so a warp waits on
    # the memory every word; four ahead unrolled four times, every weight load is first read four
    # words later (3.5 at 16 rows: x's second block), with no spills, with a prologue fused too.
    for batch, tiles, prologue in ((1, 1, ""), (8, 1, ""), (8, 2, ""), (16, 1, ""), (1, 1, "norm"), (1, 1, "gated")):
        report = sass.mma_sp_kernel(batch, slices=4, unroll=4, tiles=tiles, ahead=4, norm=prologue == "norm",
                                    gated=prologue == "gated")
        assert report["spill_bytes"] == 0, (batch, tiles)
        assert report["words_to_first_use"][0] >= 3.5, (batch, tiles, report["words_to_first_use"])
    assert sass.mma_sp_kernel(1, slices=4, unroll=4)["words_to_first_use"][0] == 0
