"""What the sparse kernels share: the interpreter switch, the split-K workspace, and small
@triton.jit helpers that several kernels inline.

`INTERPRETING` is true under TRITON_INTERPRET=1. Every kernel takes it as its `INTERPRETER_SAFE`
constexpr: the interpreter runs no inline PTX and no libdevice, so the kernels keep a plain-Triton
path for it, and the CPU tests run the same kernel source as the GPU.

Split K: where one program per row block would not fill the GPU, programs add fp32 partial sums
into a shared workspace with atomics; the last of a row block to arrive takes the sum and leaves
the workspace and its arrival counter zeroed (`sum_splits`), so one launch does the whole product
and the workspace is clean for the next call.
"""
import os

import torch
import triton
import triton.language as tl

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
MAX_DECODE_ROWS = 16  # rows of x the decode kernels (SpMV, mma.sp, the SpMM's tile) take


@triton.jit
def load_u32(ptr, COUNT: tl.constexpr, INTERPRETER_SAFE: tl.constexpr):
    """A tuple of COUNT consecutive uint32 at each thread's `ptr` (4·COUNT-byte aligned), in 16-byte
    vector loads where possible. Streamed through L2 only (.cg): a weight is read once per call.

    Tuples of 1-D tensors (one element per thread), not joined tiles: a tile carried around the
    pipelined loop made Triton convert its layout through shared memory every iteration."""
    if COUNT > 4 or (INTERPRETER_SAFE and COUNT > 1):
        tile = load_u32(ptr, COUNT // 2, INTERPRETER_SAFE) + load_u32(ptr + COUNT // 2, COUNT // 2,
                                                                      INTERPRETER_SAFE)
    elif INTERPRETER_SAFE:
        tile = (tl.load(ptr), )
    elif COUNT == 1:
        tile = (tl.inline_asm_elementwise("ld.global.cg.u32 $0, [$1];", "=r,l", [ptr],
                                          dtype=tl.uint32, is_pure=True, pack=1), )
    elif COUNT == 2:
        tile = tl.inline_asm_elementwise("ld.global.cg.v2.u32 {$0, $1}, [$2];", "=r,=r,l", [ptr],
                                         dtype=(tl.uint32, tl.uint32), is_pure=True, pack=1)
    else:
        tile = tl.inline_asm_elementwise("ld.global.cg.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l",
                                         [ptr], dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32),
                                         is_pure=True, pack=1)
    return tile


@triton.jit
def bf16_bits(bits):
    """The bf16 nearest to each float32 (given as uint32 bits; ties to even), as bits 0-15 of a
    uint32. Integer arithmetic, because the interpreter's float32 -> bf16 cast truncates."""
    return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16


@triton.jit
def silu(x, INTERPRETER_SAFE: tl.constexpr):
    """x * sigmoid(x). On the GPU as h + h * tanh(h) with h = x / 2: three instructions (one of them
    the MUFU's tanh.approx, relative error ~2^-11, below bf16's rounding), where x / (1 + exp(-x))
    compiled to ~13 with two MUFU ops and their range fix-ups; it matters because every row
    block's program computes it again for its words."""
    if INTERPRETER_SAFE:
        return x / (1.0 + tl.exp(-x))
    half = 0.5 * x
    tanh = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [half], dtype=tl.float32, is_pure=True, pack=1)
    return half + half * tanh


@triton.jit
def replace_item(items, index: tl.constexpr, item):
    """The tuple `items` with items[index] replaced."""
    return items[:index] + (item, ) + items[index + 1:]


@triton.jit
def popcount(bits):
    """Set bits of each uint32 (SWAR; libdevice popc does not run in the interpreter)."""
    bits = bits - ((bits >> 1) & 0x55555555)
    bits = (bits & 0x33333333) + ((bits >> 2) & 0x33333333)
    bits = (bits + (bits >> 4)) & 0x0F0F0F0F
    return (bits * 0x01010101) >> 24


@triton.jit
def sum_splits(acc, workspace_ptr, arrivals_ptr, counter, offsets, ok, n_splits):
    """(row sums, whether this program holds them). With K split over n_splits programs, each adds
    acc to the fp32 workspace; the last program of `counter` (its row block) to arrive takes the
    sums and leaves workspace and counter zeroed."""
    total = acc
    last = n_splits == 1
    if n_splits > 1:
        tl.atomic_add(workspace_ptr + offsets, acc, mask=ok, sem="relaxed")
        tl.debug_barrier()  # every thread's partial sums are in before the arrival is counted
        arrived = tl.atomic_add(arrivals_ptr + counter, 1, sem="acq_rel")
        last = arrived == n_splits - 1
        if last:
            # Swap the sums out for zeros at L2 (as int32 bits: the interpreter has no float xchg).
            sum_bits = tl.atomic_xchg((workspace_ptr + offsets).to(tl.pointer_type(tl.int32), bitcast=True),
                                      tl.zeros_like(acc).to(tl.int32), mask=ok)
            total = sum_bits.to(tl.float32, bitcast=True)
            tl.atomic_xchg(arrivals_ptr + counter, 0)
    return total, last


@triton.jit
def store_or_reduce(acc, y_ptr, workspace_ptr, arrivals_ptr, counter, offsets, ok, n_splits):
    """Store acc, or its sum over the n_splits programs of `counter` (see sum_splits)."""
    total, last = sum_splits(acc, workspace_ptr, arrivals_ptr, counter, offsets, ok, n_splits)
    if last:
        tl.store(y_ptr + offsets, total.to(y_ptr.dtype.element_ty), mask=ok)


# Split-K partial sums and per-row-block arrival counters, one pair per device, grown on demand.
# Layers share them as long as their calls run one after another on one stream. Replaced
# buffers are kept alive because captured CUDA graphs may still point at them.
workspaces = {}
retired_workspaces = []


def split_k_workspace(device, n_elements: int, n_counters: int):
    """(fp32 partial sums of at least n_elements, int32 arrival counters of at least n_counters) on
    device, both zero."""
    key = str(device)
    held = workspaces.get(key)
    if held is None or held[0].numel() < n_elements or held[1].numel() < n_counters:
        if held is not None:
            retired_workspaces.append(held)
        size = max(n_elements, 0 if held is None else held[0].numel(), MAX_DECODE_ROWS * 65536)
        counters = max(n_counters, 0 if held is None else held[1].numel(), 4096)
        held = (torch.zeros(size, dtype=torch.float32, device=device),
                torch.zeros(counters, dtype=torch.int32, device=device))
        workspaces[key] = held
    return held


def reserve_workspace(device, n_rows: int):
    """Allocate the workspace for layers of up to n_rows outputs now, in eager mode.

    Must happen before a CUDA graph is recorded: under torch.compile(mode="reduce-overhead") a
    workspace first allocated inside the compiled step would land in the graph's private memory
    pool while this module still holds it, which cudagraph trees reject ("tensors in the
    cudagraph pool not tracked as outputs"). A row block is 32 rows (one warp).
    """
    row_blocks = triton.cdiv(n_rows, 32)
    split_k_workspace(device, MAX_DECODE_ROWS * (n_rows + row_blocks), row_blocks)
