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


def test_rows_not_a_multiple_of_32_are_one_clear_error():
    values, mask = random_packed(48, 64, "2:4", seed=1, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 32"):
        load_probe.read(values, mask, (1, 2, 1))
