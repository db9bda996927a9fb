"""Helpers shared by the sparse kernel tests (tests/test_sparse_kernels_*.py, test_sparse_linear.py).

Tests that run the Triton kernels on the CPU are marked `interpreted`: they run in one
TRITON_INTERPRET=1 subprocess and are reported here as they ran there (tests/interpreted_tests.py).
"""
import zlib

import pytest
import torch

from sparse.format import pack
from sparse.kernels import common, tuning

interpreted = pytest.mark.interpreted

def relative_error(y: torch.Tensor, reference: torch.Tensor) -> float:
    return float((y.double() - reference).norm() / reference.norm())


def assert_workspace_zeroed(device):
    """Split K must leave the shared workspace and its arrival counters zeroed for the next call."""
    workspace, arrivals = common.split_k_workspace(device, 0, 0)
    assert not workspace.any() and not arrivals.any(), "split-K must leave its workspace zeroed"


def random_packed(out_features: int, in_features: int, pattern: str, seed: int, device="cpu", dtype=torch.float32):
    """A random weight packed to `pattern` (its N largest |w| per M-group kept)."""
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))
    return pack(weight.to(device=device, dtype=dtype), pattern)


def case_seed(*parts) -> int:
    """A seed fixed by the test case (Python's str hash changes every process, so a failure seeded
    with it could not be reproduced)."""
    return zlib.crc32(repr(parts).encode()) % 1000


def compiled_first(kernel, configs, compile_only):
    """Yields `configs` after compiling them all with tuning.compile_all (compile_only(c): a launch
    with compile_only=True), then, once the caller has launched each, checks that none of those
    launches had to compile (the kernel's JIT cache on the current GPU did not grow). GPU only."""
    configs = list(configs)
    tuning.compile_all(configs, compile_only)
    cache = kernel.device_caches[torch.cuda.current_device()][0]
    compiled = len(cache)
    yield from configs
    assert len(cache) == compiled, f"{len(cache) - compiled} launches compiled what compile_all had compiled"
