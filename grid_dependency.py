"""Programmatic dependent launch between the decode step's own kernels (Hopper and later).

A decode step at batch 1 is ~160 short kernels (Llama-3.1-8B 2:4: four SpMVs and one attention a
layer, 5-35 µs each). Each pays a ramp (launch, programs spreading over the SMs, the first loads'
DRAM latency) while the one before drains its last programs. With programmatic dependent launch
the next kernel's programs start on the SMs the previous one frees, do the work that needs
nothing from it (an SpMV loads its first weights), and only then wait for it to finish.

A kernel opts in three ways, all or none:
- launched with `launch_pdl=True` (`grid_dependent(device)` says whether to);
- `release_next_kernel()` first thing, so the kernel after it may start;
- `wait_for_kernel_ahead()` before reading anything an earlier kernel writes, its zero result
  added to every such pointer.
Writes all come after the wait, so a kernel never races the one ahead. Kernels not launched this
way (Inductor's, cuBLAS) serialize as usual; a release before them is a no-op.

Off until timed on the H200 (docs/KERNEL_NOTES.md, session 21). The interpreter has no inline PTX,
so the CPU tests run the kernels with it off; kernel_sass.py checks the compiled order.
"""
import functools
import os

import torch
import triton
import triton.language as tl

GRID_DEPENDENT_LAUNCH = False
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=None)
def _hopper_or_later(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def grid_dependent(device: torch.device) -> bool:
    """Whether the opted-in kernels launch grid-dependent on this device: GRID_DEPENDENT_LAUNCH, a
    CUDA device of compute capability 9.0 or later, not the interpreter."""
    return (GRID_DEPENDENT_LAUNCH and not INTERPRETING and device.type == "cuda"
            and _hopper_or_later(device.index if device.index is not None else torch.cuda.current_device()))


@triton.jit
def release_next_kernel(GRID_DEPENDENT: tl.constexpr):
    """Let the next kernel in the stream (if launched grid-dependent) start once every program of
    this one has run this."""
    if GRID_DEPENDENT:
        tl.inline_asm_elementwise("griddepcontrol.launch_dependents; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def wait_for_kernel_ahead(GRID_DEPENDENT: tl.constexpr):
    """Block until the kernel ahead in the stream has finished and its writes are visible. Returns an
    int32 zero to add to every pointer read after it: our loads are side-effect-free inline PTX,
    which the compiler may schedule above the wait unless they depend on it
    (triton.language.extra.cuda.gdc_wait returns nothing to depend on)."""
    zero = 0
    if GRID_DEPENDENT:
        zero = tl.inline_asm_elementwise("griddepcontrol.wait; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                         is_pure=False, pack=1)
    return zero
