"""Helpers shared by the sparse kernel tests (test_sparse_kernels.py, test_sparse_spmm.py,
test_sparse_linear.py, test_grid_dependency.py).

Triton reads TRITON_INTERPRET when it decorates a kernel, i.e. when sparse/ is first imported,
and other test modules import sparse/ first; so a kernel test module re-runs itself in a fresh
Python process with the interpreter on (`rerun_under_interpreter`), and its interpreter-only
tests are marked `interpreted`.
"""
import os
import subprocess
import sys
import zlib

import pytest
import torch

from sparse import kernels
from sparse.format import pack, unpack

interpreted = pytest.mark.skipif(not kernels.INTERPRETING, reason="runs in the TRITON_INTERPRET=1 subprocess")


def rerun_under_interpreter(test_file: str):
    """Run the pytest module `test_file` in a subprocess with TRITON_INTERPRET=1; fail with its output."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file],
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def relative_error(y: torch.Tensor, reference: torch.Tensor) -> float:
    return float((y.double() - reference).norm() / reference.norm())


def random_packed(out_features: int, in_features: int, pattern: str, seed: int, device="cpu", dtype=torch.float32):
    """A random weight packed to `pattern` (its N largest |w| per M-group kept)."""
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))
    return pack(weight.to(device=device, dtype=dtype), pattern)


def case_seed(*parts) -> int:
    """A seed fixed by the test case (Python's str hash changes every process, so a failure seeded
    with it could not be reproduced)."""
    return zlib.crc32(repr(parts).encode()) % 1000


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
