"""SparseLinear: an nn.Linear whose weight is stored packed (values + mask), and the model swap helpers.

Dispatch of `sparse_matmul` by where it runs and how many rows x has:
- CUDA (or CPU under TRITON_INTERPRET=1): up to 16 rows -> the CUDA-core SpMV (kernels.spmv),
  or from spmm_min_rows rows on the tensor-core SpMM (spmm.spmm, which expands weight tiles in
  registers for tl.dot), from 8 rows on CUDA whichever of the two was measured faster for the
  shape (MEASURED_ROUTE), and with TENSOR_CORE_2OF4 a 2:4 bf16 weight's matmul at any row count,
  plain or with a residual and/or a prologue (RMSNorm or silu(gate) * up) fused, also races the
  sparse tensor cores (mma_sp.spmv_2of4); more rows (prefill) -> the SpMM if
  SPMM_PREFILL, else expand the weight to dense with a Triton kernel and call cuBLAS (whole, or in
  PREFILL_SLICES slices that overlap the next slice's expansion with this one's GEMM). The
  switches below say why they are set as they are.
- CPU otherwise: pure PyTorch (unpack + F.linear).
The CUDA path is a `torch.library.custom_op`, so torch.compile(fullgraph=True) keeps it as one
opaque node and mode="reduce-overhead" records its kernels into the CUDA graph. (An opaque op
rather than `triton_op` because the SpMV launcher owns a persistent split-K workspace.)
"""
from collections import namedtuple
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from sparse import kernels, mma_sp, spmm
from sparse.format import pack, packed_shapes, parse_pattern, unpack

# Where the tensor-core SpMM takes over: the SpMV's FMAs and shuffles grow with the rows of x, the
# SpMM's expansion does not. Measured on the H200 on the four Llama-3.1-8B shapes, 2:4
# (docs/KERNEL_NOTES.md, v7, 2026-12-01): at 8 rows the SpMV (0.69-0.77x of cuBLAS) beat the SpMM
# with the gather expansion (0.60-0.66x, session 3), at 16 rows the SpMM (0.52-0.63x) beat the SpMV
# (0.38-0.47x); 9-15 rows were not timed and go to the SpMM. Since the 2:4 tiles expand by nibble
# (spmm.EXPAND_2OF4_BY_NIBBLE), 2:4 switches at 8 rows: the whole Llama-3.1-8B 2:4 step at batch 8
# went 5.668 -> 5.305 ms, the 128 SpMV calls 4398 us -> 4059 us of SpMM (H200, one process each,
# docs/BENCHMARKS.md session 16). The other patterns still expand by gather: not re-timed, kept at 9.
# Prefill stays expand-to-dense + cuBLAS: the SpMM took 5-6x its time at 2048 tokens.
SPMM_MIN_ROWS = 9
SPMM_MIN_ROWS_2OF4 = 8
SPMM_PREFILL = False
# From MEASURED_ROUTE_MIN_ROWS rows up to the SpMV's limit, a plain decode matmul (nothing fused)
# goes to whichever of the SpMV and the SpMM ran it faster, each in its tuned config, timed once
# per shape and row count in a CUDA graph as the configs are (`decode_route`). The row threshold
# alone is wrong for some shapes on either side of it: at 8 rows, 2:4, the SpMV beat the SpMM on
# 4096x4096 (12.7 against 15.5 µs) while the SpMM won on 28672x4096 (56.0 against 67.6) (H200,
# docs/BENCHMARKS.md session 15). Off CUDA (the interpreter), and while a graph is being captured
# before the route is known, the threshold decides. On the H200 (session 21) it sent 4096x4096 to
# the SpMV and the other Llama-3.1-8B shapes to the SpMM at 8 rows: the 2:4 step 4.910 -> 4.812 ms.
MEASURED_ROUTE = True
MEASURED_ROUTE_MIN_ROWS = 8
# The 2:4 product on the sparse tensor cores (sparse/mma_sp.py: 6.1 instructions per kept weight at
# 1-8 rows in its machine code, against the SpMV's 8.6 at 1 and ~27 at 8) joins that race, at any
# row count, for bf16 matmuls with a 2:4 weight, with whatever the SpMV would fuse (a residual, the
# RMSNorm, silu(gate) * up): in a decode step all four layers at any batch (from 4 rows qkv and w13
# plain, their norm apart, o and w2 with the residual; at 1-3 rows with their prologues fused). On
# the H200 (session 24, before the prologues were fused in it) it won w13 at 4 rows and every layer
# at 8: Llama-3.1-8B's 2:4 step 3.734 -> 3.558 ms at batch 4 and 4.812 (session 21) -> 3.839 at
# batch 8 (docs/BENCHMARKS.md session 24).
TENSOR_CORE_2OF4 = True
# Prefill expands the weight in this many slices of rows, on a second CUDA stream, each slice's
# cuBLAS GEMM overlapping the next slice's expansion (`prefill_matmul`): the expansion is DRAM-bound
# (2.7-3.1 TB/s) and the GEMM at 2048 tokens compute-bound, so apart the expansion adds 5-12 % to
# the GEMM (0.89-0.98x of dense, docs/BENCHMARKS.md session 10). 1: expand it whole, then one GEMM.
# Timed in session 20 at 4 slices: the same or slower on 15 of 16 shapes (docs/BENCHMARKS.md), so 1.
PREFILL_SLICES = 1
# From this many rows of x the prologue (RMSNorm, silu(gate) * up) runs as its own small kernel
# before the SpMV, which then only fuses the residual: inside the SpMV every row block repeats the
# prologue's per-element work, which grows with the rows while one extra launch does not. On the
# H200, Llama-3.1-8B 2:4, it made the decode step 6.278 -> 5.665 ms at batch 8 and, with x packed
# from 4 rows too, 4.219 -> 4.032 ms at batch 4 (docs/KERNEL_NOTES.md, session 13). 1-3 rows keep
# it fused: at batch 1, fusing the norms and adds made the step 3.30-3.42 -> 3.10-3.20 ms (session
# 8); 2-3 rows were not measured either way.
PROLOGUE_APART_MIN_ROWS = 4
# From this many rows the residual add leaves the SpMV too (it then runs as a plain SpMV, and
# Inductor fuses the add into the next layer's norm kernel, which runs apart from these rows
# anyway). H200, Llama-3.1-8B 2:4, A/B in fresh processes (KERNEL_NOTES, session 14): apart from
# 8 rows the step went 5.862/5.873 -> 5.743/5.725 ms at batch 8, but apart from 4 rows batch 4
# went 3.981 -> 4.057 ms, so 4-7 rows keep the add fused.
RESIDUAL_APART_MIN_ROWS = 8
# The sparse tensor cores' product spends the same instructions on a prologue at 1 to 8 rows of x
# (a thread holds one row of each 8-row block; the SpMV's threads every row, so its cost grows with
# them), so for a layer they may take (`tensor_cores_take`: 2:4, bf16) the prologue and the residual
# could stay fused below this many rows, the race then choosing between the SpMV and the tensor
# cores with the same fusion: at batch 4-8 up to three small kernels a layer fewer (the norms
# before qkv and w13, silu(gate) * up before w2) and nothing between the layers' sparse kernels to
# stop their programmatic dependent launches from overlapping. Built in session 25, not yet timed
# (the decode_tc_fused_b48 job: this at 9); 0: every layer on the thresholds above.
TENSOR_CORE_FUSES_BELOW_ROWS = 0


@torch.library.custom_op("sparse_decoding::bitmask_matmul", mutates_args=())
def _bitmask_matmul(x: Tensor, values: Tensor, mask: Tensor, norm_weight: Optional[Tensor] = None,
                    norm_eps: float = 0.0, residual: Optional[Tensor] = None, gated: bool = False,
                    two_of_four: bool = False) -> Tensor:
    rows = x.shape[0]
    prologue = dict(gated=True) if gated else {}
    if norm_weight is not None:
        prologue.update(norm_weight=norm_weight, norm_eps=norm_eps)
    if rows <= kernels.MAX_SPMV_BATCH or residual is not None or prologue:
        route = decode_route(x, values, mask, two_of_four, residual, prologue)
        return DECODE_KERNELS[route](x, values, mask, two_of_four, residual, prologue)
    if SPMM_PREFILL:
        return spmm.spmm(x, values, mask, two_of_four=two_of_four)
    return prefill_matmul(x, values, mask, PREFILL_SLICES)


_side_streams = {}


def prefill_matmul(x: Tensor, values: Tensor, mask: Tensor, slices: int = 1) -> Tensor:
    """x @ W.T for a prefill-sized x: W expanded to dense (kernels.unpack_to_dense) and cuBLAS.

    slices > 1: W is expanded in `slices` slices of rows (multiples of 64) into two alternating
    buffers on a second stream, while the current stream multiplies the slice before into its
    columns of y; the slices' GEMMs read no more of W than one GEMM does, and the expansion's
    memory traffic hides under their tensor-core work. Off CUDA (the interpreter) the same slices
    run one after another, which is what the CPU tests check."""
    n_words, n_rows = mask.shape
    if slices <= 1:
        return F.linear(x, kernels.unpack_to_dense(values, mask).to(x.dtype))
    rows_per_slice = -(-n_rows // (64 * slices)) * 64
    bounds = [(first, min(first + rows_per_slice, n_rows)) for first in range(0, n_rows, rows_per_slice)]
    y = x.new_empty(x.shape[0], n_rows)
    buffers = [values.new_empty(rows_per_slice, n_words * 32) for _ in range(min(2, len(bounds)))]
    main = torch.cuda.current_stream(x.device) if x.is_cuda else None
    side = _side_streams.setdefault(x.device, torch.cuda.Stream(x.device)) if x.is_cuda else None
    if side is not None:
        side.wait_stream(main)  # x and the buffers are ready before the side stream touches them
    multiplied = [None] * len(bounds)  # events: slice i's GEMM is done, its buffer free again
    for i, (first, end) in enumerate(bounds):
        weight = buffers[i % 2][: end - first]
        if side is None:
            kernels.unpack_to_dense(values, mask, out=weight, rows=(first, end))
        else:
            with torch.cuda.stream(side):
                if i >= 2:
                    side.wait_event(multiplied[i - 2])
                kernels.unpack_to_dense(values, mask, out=weight, rows=(first, end))
                expanded = torch.cuda.Event()
                expanded.record(side)
            main.wait_event(expanded)
        torch.mm(x, weight.to(x.dtype).T, out=y[:, first:end])
        if side is not None:
            multiplied[i] = torch.cuda.Event()
            multiplied[i].record(main)
    return y


def spmm_min_rows(two_of_four: bool) -> int:
    """The rows of x from which a decode-sized matmul goes to the SpMM instead of the SpMV, where
    the route is not measured (MEASURED_ROUTE)."""
    return SPMM_MIN_ROWS_2OF4 if two_of_four else SPMM_MIN_ROWS


# The kernels a decode matmul of 1-16 rows with at most a residual and a prologue fused can take,
# by `decode_route`'s name (prologue: {}, the norm_weight and norm_eps, or gated=True; the SpMM
# takes neither a prologue nor a residual).
DECODE_KERNELS = {
    "spmv": lambda x, values, mask, two_of_four, residual, prologue: kernels.spmv(x, values, mask, residual=residual,
                                                                                  **prologue),
    "spmm": lambda x, values, mask, two_of_four, residual, prologue: spmm.spmm(x, values, mask,
                                                                               two_of_four=two_of_four),
    "mma_sp": lambda x, values, mask, two_of_four, residual, prologue: mma_sp.spmv_2of4(x, values, mask,
                                                                                        residual=residual, **prologue),
}
RouteKey = namedtuple("RouteKey", "out_features in_words rows dtype two_of_four tensor_cores residual prologue device")
_routes = {}  # RouteKey -> a DECODE_KERNELS name


def decode_route(x: Tensor, values: Tensor, mask: Tensor, two_of_four: bool, residual: Tensor = None,
                 prologue: dict = None) -> str:
    """The DECODE_KERNELS name for a matmul of x's 1-16 rows, plain, with a residual to add and/or a
    prologue (norm_weight and norm_eps, or gated=True); see MEASURED_ROUTE and TENSOR_CORE_2OF4."""
    rows, prologue = x.shape[0], prologue or {}
    fused = residual is not None or bool(prologue)
    by_threshold = "spmv" if rows < spmm_min_rows(two_of_four) or fused else "spmm"
    tensor_cores = tensor_cores_take(x, values, two_of_four)
    spmm_races = rows >= MEASURED_ROUTE_MIN_ROWS and not fused
    if not (MEASURED_ROUTE and (spmm_races or tensor_cores) and can_time_in_cuda_graph(x)):
        return by_threshold
    key = RouteKey(mask.shape[1], mask.shape[0], rows, values.dtype, two_of_four, tensor_cores, residual is not None,
                   "gated" if prologue.get("gated") else "norm" if prologue else "", x.device)
    if key not in _routes:
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return by_threshold  # cannot time inside a capture; warm up first to get the measured one
        names = ["spmv"] + ["spmm"] * spmm_races + ["mma_sp"] * tensor_cores
        for name in names:  # each tunes its own config first, outside the race
            DECODE_KERNELS[name](x, values, mask, two_of_four, residual, prologue)
        _routes[key] = kernels.fastest_in_cuda_graph(
            names, values, mask, lambda name, v, m: DECODE_KERNELS[name](x, v, m, two_of_four, residual, prologue))
    return _routes[key]


def tensor_cores_take(x: Tensor, values: Tensor, two_of_four: bool) -> bool:
    """Whether a matmul of x (its rows: all dimensions but the last) by this packed weight races the
    sparse tensor cores (TENSOR_CORE_2OF4: bf16, 2:4, at most mma_sp.MAX_ROWS rows)."""
    return (TENSOR_CORE_2OF4 and two_of_four and x.dtype == values.dtype == torch.bfloat16
            and x.numel() // x.shape[-1] <= mma_sp.MAX_ROWS)


def can_time_in_cuda_graph(x: Tensor) -> bool:
    """The race times in CUDA graphs (a CPU test stands in for it)."""
    return x.is_cuda


@_bitmask_matmul.register_fake
def _(x: Tensor, values: Tensor, mask: Tensor, norm_weight: Optional[Tensor] = None, norm_eps: float = 0.0,
      residual: Optional[Tensor] = None, gated: bool = False, two_of_four: bool = False) -> Tensor:
    return x.new_empty(x.shape[0], mask.shape[1])


def _without_kernels(x: Tensor) -> bool:
    """True where no Triton kernel can run: on the CPU, unless the interpreter is on."""
    return x.device.type == "cpu" and not kernels.INTERPRETING


def _as_rows(x: Tensor) -> Tensor:
    """(..., features) -> a contiguous (rows, features) view or copy."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.is_contiguous() else rows.contiguous()


def sparse_matmul(x: Tensor, values: Tensor, mask: Tensor, norm_weight: Tensor = None, norm_eps: float = 0.0,
                  residual: Tensor = None, gated: bool = False, two_of_four: bool = False) -> Tensor:
    """x @ W.T for x of shape (..., in), W given packed as (values, mask); two_of_four: W is 2:4,
    which the SpMM may exploit (spmm.spmm says how; the mask alone does not say it).

    With norm_weight / gated / residual: residual + prologue(x) @ W.T in one SpMV launch, the
    prologue being RMSNorm(x) * norm_weight or, for x = [gate | up], silu(gate) * up
    (kernels.spmv). Only for decode-sized x (up to 16 rows) where the kernels run."""
    fused = norm_weight is not None or residual is not None or gated
    if _without_kernels(x):
        if fused:
            raise ValueError("sparse_matmul: the fused prologue/epilogue needs the Triton kernels (CUDA, or "
                             "TRITON_INTERPRET=1)")
        return F.linear(x, unpack(values, mask).to(x.dtype))
    if x.is_cuda and not torch.compiler.is_compiling():
        kernels.reserve_workspace(x.device, mask.shape[1])  # eager calls (e.g. the prefill) run first
    y = _bitmask_matmul(_as_rows(x), values, mask, norm_weight, norm_eps,
                        None if residual is None else _as_rows(residual), gated, two_of_four)
    return y.reshape(*x.shape[:-1], mask.shape[1])


class SparseLinear(nn.Module):
    """y = x @ W.T with W (out_features, in_features) stored in the N:M bitmask format; no bias."""

    def __init__(self, in_features: int, out_features: int, pattern: str, dtype=None, device=None):
        super().__init__()
        self.in_features, self.out_features, self.pattern = in_features, out_features, pattern
        values_shape, mask_shape = packed_shapes(in_features, out_features, pattern)
        self.register_buffer("values", torch.zeros(values_shape, dtype=dtype or torch.get_default_dtype(), device=device))
        self.register_buffer("mask", torch.zeros(mask_shape, dtype=torch.int32, device=device))
        self._cpu_weight, self._cpu_weight_key = None, None  # see _unpacked_for_cpu

    @classmethod
    def from_dense(cls, linear_or_weight, pattern: str, mask: Tensor = None) -> "SparseLinear":
        weight = linear_or_weight.weight if isinstance(linear_or_weight, nn.Linear) else linear_or_weight
        if isinstance(linear_or_weight, nn.Linear) and linear_or_weight.bias is not None:
            raise ValueError("SparseLinear has no bias; the layer to convert has one")
        out_features, in_features = weight.shape
        layer = cls(in_features, out_features, pattern, dtype=weight.dtype, device="meta")
        layer.values, layer.mask = pack(weight, pattern, mask)
        return layer

    def fuses(self, x: Tensor, prologue: bool = False) -> bool:
        """Whether forward should take the residual for this x (model.project asks): a decode-sized
        x that goes to the SpMV kernel, fewer than RESIDUAL_APART_MIN_ROWS rows; with prologue=True,
        whether it should also take the norm or silu(gate) * up (fewer than PROLOGUE_APART_MIN_ROWS
        rows). Where the tensor cores may take the matmul, both below TENSOR_CORE_FUSES_BELOW_ROWS
        rows as well."""
        rows = x.numel() // x.shape[-1]
        fused_below = TENSOR_CORE_FUSES_BELOW_ROWS if tensor_cores_take(x, self.values, self.two_of_four) else 0
        return (not _without_kernels(x)
                and rows < max(min(spmm_min_rows(self.two_of_four), RESIDUAL_APART_MIN_ROWS), fused_below)
                and (not prologue or rows < max(PROLOGUE_APART_MIN_ROWS, fused_below)))

    def forward(self, x: Tensor, norm: nn.Module = None, residual: Tensor = None, gated: bool = False) -> Tensor:
        """x @ W.T; where `fuses(x)`, optionally residual + prologue(x) @ W.T in the same kernel, the
        prologue being norm(x) for an RMSNorm module `norm` (its weight and eps), or silu(gate) *
        up for a gated x = [gate | up]. (A forward hook on this module then sees x before the
        prologue; prune/ and evaluation/ hook dense nn.Linear layers, which never fuse.)"""
        if _without_kernels(x) and norm is None and residual is None and not gated:
            return F.linear(x, self._unpacked_for_cpu().to(x.dtype))
        return sparse_matmul(x, self.values, self.mask, None if norm is None else norm.weight,
                             0.0 if norm is None else norm.eps, residual, gated, self.two_of_four)

    @property
    def two_of_four(self) -> bool:
        return parse_pattern(self.pattern) == (2, 4)

    def _unpacked_for_cpu(self) -> Tensor:
        """The CPU has no sparse kernel (it is the correctness path: calibration, evaluation), and
        unpacking every layer on every decode step made CPU generation ~10x slower than dense; so
        unpack once and keep it, again whenever the buffers are replaced or changed in place."""
        key = (self.values.data_ptr(), self.values._version, self.mask.data_ptr(), self.mask._version)
        if self._cpu_weight_key != key:
            self._cpu_weight, self._cpu_weight_key = unpack(self.values, self.mask), key
        return self._cpu_weight

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, pattern={self.pattern}"


def _replace(model: nn.Module, name: str, new: nn.Module):
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def swap_to_sparse(model: nn.Module, pattern: str, masks: dict = None, skip=("output",)) -> nn.Module:
    """Replace every nn.Linear (except names in `skip`) by a packed SparseLinear, in place.

    masks: optional {module name (or "<name>.weight"): bool (out, in) tensor of kept weights};
    layers without a mask keep the N largest |w| of each M-group.
    """
    masks = masks or {}
    linears = [(name, module) for name, module in model.named_modules()
               if isinstance(module, nn.Linear) and name not in skip]
    for name, module in linears:
        mask = masks.get(name, masks.get(f"{name}.weight"))
        _replace(model, name, SparseLinear.from_dense(module, pattern, mask))
    return model


def swap_linears_for_state_dict(model: nn.Module, state_dict: dict, pattern: str) -> nn.Module:
    """Turn every nn.Linear whose `<name>.values` is in state_dict into an empty SparseLinear on the
    module's device (meta included), ready for `load_state_dict(state_dict, assign=True)`."""
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and f"{name}.values" in state_dict:
            dtype = state_dict[f"{name}.values"].dtype
            _replace(model, name, SparseLinear(module.in_features, module.out_features, pattern,
                                               dtype=dtype, device=module.weight.device))
    return model
