"""scripts/load_probe.py: the read-only probe loads exactly the packed weight's words, in either
layout and on every grid shape the SpMV's configs give (checked by XOR against the words
themselves, under the Triton interpreter); its timings are for the device, not for tests."""
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from sparse import kernels
from tests.sparse_kernel_testing import interpreted, random_packed, rerun_under_interpreter

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import load_probe  # noqa: E402


def xor_of(*tensors) -> int:
    return int(np.bitwise_xor.reduce(np.concatenate([t.contiguous().view(torch.int32).flatten().numpy()
                                                     for t in tensors])))


@pytest.mark.skipif(kernels.INTERPRETING, reason="this is the subprocess")
def test_load_probe_under_the_interpreter():
    rerun_under_interpreter(__file__)


def test_interleave_keeps_every_word_and_puts_a_warps_word_in_one_run():
    values, mask = random_packed(64, 256, "2:4", seed=3, dtype=torch.bfloat16)  # 2 row blocks, 8 words
    flat = load_probe.interleave(values, mask)
    assert flat.shape == (2, 8, 32 * (1 + 2 * 4)) and xor_of(flat) == xor_of(values, mask)
    # row block 1, word 5: its 32 mask words, then chunk 0's values for its 32 rows
    assert torch.equal(flat[1, 5, :32], mask[5, 32:64])
    assert torch.equal(flat[1, 5, 32:32 + 32 * 4], values[5 * 2, 32:64].contiguous().view(torch.int32).flatten())


@interpreted
@pytest.mark.parametrize("config", [(1, 8, 1), (2, 2, 2), (2, 3, 1), (4, 3, 2)])  # (2, 3): words past the end
def test_probe_reads_every_word_once_in_both_layouts(config):
    values, mask = random_packed(64, 256, "2:4", seed=5, dtype=torch.bfloat16)
    expected = xor_of(values, mask)
    assert xor_of(load_probe.read(values, mask, config)) == expected
    assert xor_of(load_probe.read(values, mask, config, load_probe.interleave(values, mask))) == expected


@interpreted
@pytest.mark.parametrize("config", [(1, 8, 1), (2, 2, 2), (2, 3, 1), (4, 3, 2)])
def test_the_spmv_without_its_scan_sums_each_warps_xor_over_the_splits(config):
    """SPMV_LOADS: per row, the sum over the warps that cover its words (the slices of a program, then
    the K splits through the workspace) of the low byte of the XOR of each word's mask word, value
    words and x's element at that row's lane."""
    values, mask = random_packed(64, 256, "2:4", seed=7, dtype=torch.bfloat16)
    n_words, n_rows = mask.shape
    x = torch.randn(1, n_words * 32, dtype=torch.bfloat16)
    value_words = values.contiguous().view(torch.int32).view(n_words, -1, n_rows, 4).numpy()
    x_words = x.float().view(torch.int32).view(n_words, 32).numpy()
    word_xor = (mask.numpy() ^ np.bitwise_xor.reduce(value_words, axis=(1, 3))
                ^ (x_words[:, np.arange(n_rows) % 32] >> 16))  # [word, row]
    words_per_warp = config[1]
    expected = np.zeros(n_rows)
    for first in range(0, n_words, words_per_warp):
        expected += np.bitwise_xor.reduce(word_xor[first:first + words_per_warp], axis=0) & 0xFF
    for _ in range(2):  # the second call also finds the workspace and counters left zeroed
        np.testing.assert_array_equal(load_probe.read(values, mask, config, x=x).numpy(), expected)


@pytest.mark.skipif(kernels.INTERPRETING, reason="compiles for the GPU; runs in the parent process")
def test_the_spmv_without_its_scan_issues_the_spmvs_loads_and_no_scan():
    # Compiled for sm_90a: a loop trip of the scan-free probe has the SpMV's loads (mask, two 16-byte
    # value loads, x's element) and none of its bit scans or shuffles. (x enters the XOR by its high
    # half, the bf16 bits: XORed whole, its load was dead code for the low byte that is summed.)
    import kernel_sass
    types = {"x_ptr": "*bf16", "mask_u32": "*i32", "values_u32": "*i32", "out_ptr": "*fp32", "workspace_ptr": "*fp32",
             "arrivals_ptr": "*i32"}
    constants = dict(CHUNKS=2, U32_PER_CHUNK=4, SLICES=4, PREFETCH=2, INTERLEAVED=False, SPMV_LOADS=True,
                     INTERPRETER_SAFE=False)
    sass = kernel_sass.compile_for_sm90a(load_probe._read_kernel, types, constants, 4,
                                         divisible_by_16=("x_ptr", "mask_u32", "values_u32", "n_rows", "n_words"))[0]
    loop = [op for op, _ in kernel_sass.innermost_loop(sass, marker="LDG")]
    spmv = kernel_sass.compile_spmv(kernel_sass.kernels_module(), batch=1, slices=4, prefetch=2)
    assert sum(op.startswith("LDG") for op in loop) == spmv["loads"] == 4
    assert not any(op.startswith(("FLO", "SHFL")) for op in loop)


def test_halving_the_warps_a_program_splits_k_in_two():
    assert load_probe.halved_programs((16, 8, 2)) == (8, 8, 2)  # 6144x4096: 192 programs -> 384
    assert load_probe.halved_programs((1, 8, 1)) is None


def test_rows_not_a_multiple_of_32_are_one_clear_error():
    values, mask = random_packed(48, 64, "2:4", seed=1, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 32"):
        load_probe.read(values, mask, (1, 2, 1))
