"""scripts/bench_kernel.py (a GPU script): the check that stops its table on a wrong kernel."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_kernel  # noqa: E402
from sparse.format import pack, unpack  # noqa: E402


def test_check_against_float64_passes_a_right_product_and_names_a_wrong_one():
    values, mask = pack(torch.randn(48, 64, generator=torch.Generator().manual_seed(0)).bfloat16(), "2:4")
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    right = (x.float() @ unpack(values, mask).float().T).bfloat16()
    bench_kernel.check_against_float64("the SpMV", right, x, values, mask)
    wrong = right.clone()
    wrong[:, 5] += 1.0  # one output row off: a kernel that skipped a tile would look like this
    with pytest.raises(AssertionError, match=r"the SpMV is wrong on 48x64 at 3 rows: relative error"):
        bench_kernel.check_against_float64("the SpMV", wrong, x, values, mask)
