"""scripts/mma_sp_layout_probe.py: on CPU (TRITON_INTERPRET=1) the host-built fragments and
sparse/mma_sp.py's emulation of mma.sp agree on the kernel's layout hypothesis and on no other (so
the probe can tell them apart); on the GPU (marked) the hardware follows that hypothesis."""
import sys
from pathlib import Path

import pytest
import torch

from sparse import kernels
from tests.sparse_kernel_testing import interpreted, rerun_under_interpreter

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import mma_sp_layout_probe  # noqa: E402

KERNELS_HYPOTHESIS = ("k blocks in order", "groups 0-3 / 4-7")


@pytest.mark.skipif(kernels.INTERPRETING, reason="this is the subprocess")
def test_probe_under_the_interpreter():
    rerun_under_interpreter(__file__)


@interpreted
def test_only_the_kernels_hypothesis_matches_the_emulation():
    errors = mma_sp_layout_probe.probe("cpu")
    assert errors.pop(KERNELS_HYPOTHESIS) < 1e-6  # fp32 accumulation of bf16-exact products
    assert min(errors.values()) > 0.1, errors


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or kernels.INTERPRETING, reason="needs a CUDA GPU")
def test_the_hardware_follows_the_kernels_hypothesis():
    errors = mma_sp_layout_probe.probe("cuda")
    assert errors[KERNELS_HYPOTHESIS] < 1e-3, errors
