"""The k-th largest value of each row of logits [B, V], for top-k sampling, as two Triton kernels.

Top-k sampling needs only the row's k-th largest logit (generate.kept_logits masks everything
below it). torch.topk finds all k of them by radix select: on the H200, over Llama-3's 128,256-wide
row at k = 200, ~19 launches and ~51 µs of a batch-1 decode step (its radix passes and scans;
docs/BENCHMARKS.md, sessions 8 and 20), in a step of 2.9 ms (2:4) or 4.6 ms (dense).

1. `_slice_top_kernel`, one program per (row, slice of SLICE_WIDTH): sorts its slice (`tl.sort`)
   and keeps the K_PAD >= k largest as candidates. Each of the row's k largest is among its own
   slice's k largest, so the row's k-th largest is the k-th largest of the candidates.
2. `_kth_largest_kernel`, one program per row: binary search on the candidates' order-preserving
   32-bit keys, from the top bit down: the largest key t with at least k candidates >= t is the
   k-th largest. 32 counts over 16,384 candidates held in registers: ~14,300 instructions a warp
   scheduler at 4 warps (sm_90a; ~7 µs at 1.98 GHz). A radix select by 256-bin `tl.histogram`s
   compiled to twice that, with spills.

Exactly torch.topk's k-th value (ties, -inf and signed zeros included; not for rows holding NaN). The
same source runs under TRITON_INTERPRET=1 on CPU (tests/test_topk_threshold.py).
"""
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
SLICES = 64  # about this many programs a row in the first kernel (slices are a power of two wide)
MAX_K = 256  # larger k, and rows whose slices are narrower than k: torch.topk


@triton.jit
def _order_key(x):
    """fp32 -> uint32 with the same order (negative floats reversed below the positive ones)."""
    bits = x.to(tl.uint32, bitcast=True)
    return tl.where((bits >> 31) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)


@triton.jit
def _slice_top_kernel(x_ptr, candidates_ptr, n_cols, x_stride, candidates_stride, SLICE_WIDTH: tl.constexpr,
                      K_PAD: tl.constexpr):
    """Row program_id(0)'s slice program_id(1): its K_PAD largest values, in descending order."""
    row = tl.program_id(0)
    piece = tl.program_id(1)
    cols = piece * SLICE_WIDTH + tl.arange(0, SLICE_WIDTH)
    x = tl.load(x_ptr + row * x_stride + cols, mask=cols < n_cols, other=float("-inf"))
    ranked = tl.sort(x, descending=True)
    keep = tl.arange(0, SLICE_WIDTH)
    tl.store(candidates_ptr + row * candidates_stride + piece * K_PAD + keep, ranked, mask=keep < K_PAD)


@triton.jit
def _kth_largest_kernel(candidates_ptr, out_ptr, k, n_candidates, CANDIDATES: tl.constexpr):
    """Row program_id(0)'s k-th largest candidate: the largest key t with >= k candidates >= t,
    found bit by bit from the top."""
    row = tl.program_id(0)
    offsets = tl.arange(0, CANDIDATES)
    keys = _order_key(tl.load(candidates_ptr + row * n_candidates + offsets, mask=offsets < n_candidates,
                              other=float("-inf")))
    found = tl.full((), 0, tl.uint32)
    for bit in tl.static_range(31, -1, -1):
        trial = found | (tl.full((), 1, tl.uint32) << bit)
        found = tl.where(tl.sum((keys >= trial).to(tl.int32)) >= k, trial, found)
    bits = tl.where((found >> 31) != 0, found ^ 0x80000000, found ^ 0xFFFFFFFF)  # _order_key undone
    tl.store(out_ptr + row, bits.to(tl.float32, bitcast=True))


def _tiling(n_cols: int, k: int) -> tuple[int, int]:
    """(slice width, K_PAD): power-of-two slices, about SLICES of them, and k rounded up."""
    return triton.next_power_of_2(triton.cdiv(n_cols, SLICES)), max(16, triton.next_power_of_2(k))


def handles(x: Tensor, k: int) -> bool:
    """Whether kth_largest runs the kernels for this x [B, V] and k (else torch.topk): fp32 rows of
    unit stride on CUDA (or on CPU under the interpreter), k <= MAX_K, slices at least K_PAD wide."""
    slice_width, k_pad = _tiling(x.shape[-1], k)
    return ((x.is_cuda or (INTERPRETING and x.device.type == "cpu")) and x.dtype == torch.float32 and x.dim() == 2
            and x.stride(-1) == 1 and 1 <= k <= MAX_K and slice_width >= k_pad)


@torch.library.custom_op("sparse_decoding::kth_largest", mutates_args=())
def kth_largest(x: Tensor, k: int) -> Tensor:
    """[B, 1]: the k-th largest value of each row of x [B, V], as torch.topk(x, k).values[:, -1:].
    (A custom op, so that torch.compile keeps the kernels as one opaque node of the decode step.)"""
    if not handles(x, k):
        return torch.topk(x, k, sorted=False).values.min(dim=-1, keepdim=True).values
    batch, n_cols = x.shape
    slice_width, k_pad = _tiling(n_cols, k)
    n_slices = triton.cdiv(n_cols, slice_width)
    candidates = torch.empty(batch, n_slices * k_pad, dtype=torch.float32, device=x.device)
    _slice_top_kernel[(batch, n_slices)](x, candidates, n_cols, x.stride(0), candidates.stride(0),
                                          SLICE_WIDTH=slice_width, K_PAD=k_pad, num_warps=4)
    out = torch.empty(batch, 1, dtype=torch.float32, device=x.device)
    _kth_largest_kernel[(batch,)](candidates, out, k, n_slices * k_pad,
                                  CANDIDATES=triton.next_power_of_2(n_slices * k_pad), num_warps=4)
    return out


@kth_largest.register_fake
def _(x: Tensor, k: int) -> Tensor:
    return x.new_empty(x.shape[0], 1)
