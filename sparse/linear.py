"""SparseLinear: an nn.Linear whose weight is stored packed (values + mask), the route that picks
its kernel, and the model swap helpers.

Where `sparse_matmul` runs:
- CUDA (or CPU under TRITON_INTERPRET=1), up to 16 rows of x (a decode step): the CUDA-core SpMV
  (kernels/spmv.py), the tensor-core SpMM (kernels/spmm.py) or, for a bf16 2:4 weight, the sparse
  tensor cores (kernels/mma_sp.py), as the route table `ROUTES` says; where two or three of them
  may run, the one measured fastest for the shape, rows and fusion (`decode_route`). A decode call
  may fuse the layer's prologue (RMSNorm, or silu(gate) * up) and a residual into the kernel.
  A plain bf16 2:4 product of 8-16 rows goes to the sparse tensor cores with x repacked in their
  fragment order (`takes_fragments`), a repack written outside the opaque op so that Inductor
  can fuse it into the kernel producing x.
- CUDA, more rows (a prefill): the weight expanded to dense by a Triton kernel, then cuBLAS.
- CPU otherwise: pure PyTorch (unpack + F.linear).
The CUDA path is a `torch.library.custom_op`, so torch.compile(fullgraph=True) keeps it as one
opaque node and mode="reduce-overhead" records its kernels into the CUDA graph. (An opaque op
rather than `triton_op` because the kernels own a persistent split-K workspace.)
"""
from collections import namedtuple
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from sparse.format import pack, packed_shapes, parse_pattern, unpack
from sparse.kernels import common, mma_sp, spmm, spmv
from sparse.kernels.tuning import fastest_in_cuda_graph
from sparse.kernels.unpack import unpack_to_dense


@dataclass(frozen=True)
class RouteTable:
    """Which kernel a decode-sized matmul (1-16 rows of x) takes, by rows of x. The numbers behind
    each row are in docs/KERNELS.md.

    spmm_from_rows_2of4 / spmm_from_rows: where the race below cannot run (off CUDA, or inside a
        graph capture before the route is known), a plain matmul goes to the SpMM from this many
        rows and to the SpMV below: the SpMV's FMAs and shuffles grow with the rows, the SpMM's
        expansion does not, and the 2:4 nibble expansion makes the SpMM cheaper earlier.
    race_from_rows: from this many rows a plain matmul (nothing fused) races the SpMV against the
        SpMM on CUDA, once per shape and row count, because the crossover differs between shapes.
        A bf16 2:4 weight always races the sparse tensor cores too, at any row count and fusion,
        since they won most layers where they could run.
    prologue_apart_from_rows: from this many rows the prologue (RMSNorm, silu(gate) * up) runs as
        its own small kernel before the product: inside the SpMV every row block repeats the
        prologue's per-element work, which grows with the rows, while one extra launch does not.
    residual_apart_from_rows: from this many rows the residual add leaves the product too, and
        Inductor fuses it into the next layer's norm kernel, which then runs apart anyway.
    pack_x_from_rows: from this many bf16 rows the SpMV shuffles x two rows to a register (bf16
        pairs): half the shuffles at two extra instructions a pair, a gain once the shuffles
        dominate.
    fragments_from_rows: from this many rows a plain bf16 2:4 matmul goes, unraced, to the sparse
        tensor cores with x in fragment order (mma_sp.fragment_order): they won the race on every
        measured layer shape at these rows, and the repacked x's loads made them faster still.
    """
    spmm_from_rows_2of4: int = 8
    spmm_from_rows: int = 9
    race_from_rows: int = 8
    prologue_apart_from_rows: int = 4
    residual_apart_from_rows: int = 8
    pack_x_from_rows: int = 4
    fragments_from_rows: int = 8


ROUTES = RouteTable()


@torch.library.custom_op("sparse_decoding::bitmask_matmul", mutates_args=())
def _bitmask_matmul(x: Tensor, values: Tensor, mask: Tensor, norm_weight: Optional[Tensor] = None,
                    norm_eps: float = 0.0, residual: Optional[Tensor] = None, gated: bool = False,
                    two_of_four: bool = False) -> Tensor:
    prologue = dict(gated=True) if gated else {}
    if norm_weight is not None:
        prologue.update(norm_weight=norm_weight, norm_eps=norm_eps)
    if x.shape[0] <= spmv.MAX_ROWS or residual is not None or prologue:
        route = decode_route(x, values, mask, two_of_four, residual, prologue)
        return DECODE_KERNELS[route](x, values, mask, two_of_four, residual, prologue)
    return prefill_matmul(x, values, mask)


def prefill_matmul(x: Tensor, values: Tensor, mask: Tensor) -> Tensor:
    """x @ W.T for a prefill-sized x: W expanded to dense (kernels/unpack.py), then cuBLAS."""
    return F.linear(x, unpack_to_dense(values, mask).to(x.dtype))


def spmm_min_rows(two_of_four: bool) -> int:
    """The rows of x from which a decode-sized matmul goes to the SpMM instead of the SpMV where the
    route is not measured (ROUTES)."""
    return ROUTES.spmm_from_rows_2of4 if two_of_four else ROUTES.spmm_from_rows


def packs_x(x: Tensor) -> bool:
    """Whether the SpMV shuffles this x two rows to a register (bf16 pairs; ROUTES.pack_x_from_rows)."""
    return x.dtype == torch.bfloat16 and x.shape[0] >= ROUTES.pack_x_from_rows


# The kernels a decode matmul of 1-16 rows with at most a residual and a prologue fused can take,
# by `decode_route`'s name (prologue: {}, the norm_weight and norm_eps, or gated=True; the SpMM
# takes neither a prologue nor a residual).
DECODE_KERNELS = {
    "spmv": lambda x, values, mask, two_of_four, residual, prologue: spmv.spmv(
        x, values, mask, residual=residual, pack_x=packs_x(x), **prologue),
    "spmm": lambda x, values, mask, two_of_four, residual, prologue: spmm.spmm(x, values, mask,
                                                                               two_of_four=two_of_four),
    "mma_sp": lambda x, values, mask, two_of_four, residual, prologue: mma_sp.spmv_2of4(
        x, values, mask, residual=residual, **prologue),
}
RouteKey = namedtuple("RouteKey", "out_features in_words rows dtype two_of_four tensor_cores residual prologue device")
measured_routes = {}  # RouteKey -> a DECODE_KERNELS name


def decode_route(x: Tensor, values: Tensor, mask: Tensor, two_of_four: bool, residual: Tensor = None,
                 prologue: dict = None) -> str:
    """The DECODE_KERNELS name for a matmul of x's 1-16 rows, plain, with a residual to add and/or a
    prologue (norm_weight and norm_eps, or gated=True): by ROUTES, or raced once on CUDA."""
    rows, prologue = x.shape[0], prologue or {}
    fused = residual is not None or bool(prologue)
    by_threshold = "spmv" if rows < spmm_min_rows(two_of_four) or fused else "spmm"
    tensor_cores = tensor_cores_take(x, values, two_of_four)
    spmm_races = rows >= ROUTES.race_from_rows and not fused
    if not ((spmm_races or tensor_cores) and can_time_in_cuda_graph(x)):
        return by_threshold
    key = RouteKey(mask.shape[1], mask.shape[0], rows, values.dtype, two_of_four, tensor_cores, residual is not None,
                   "gated" if prologue.get("gated") else "norm" if prologue else "", x.device)
    if key not in measured_routes:
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return by_threshold  # cannot time inside a capture; warm up first to get the measured one
        names = ["spmv"] + ["spmm"] * spmm_races + ["mma_sp"] * tensor_cores
        for name in names:  # each tunes its own config first, outside the race
            DECODE_KERNELS[name](x, values, mask, two_of_four, residual, prologue)
        measured_routes[key] = fastest_in_cuda_graph(
            names, values, mask, lambda name, v, m: DECODE_KERNELS[name](x, v, m, two_of_four, residual, prologue))
    return measured_routes[key]


def tensor_cores_take(x: Tensor, values: Tensor, two_of_four: bool) -> bool:
    """Whether a matmul of x (its rows: all dimensions but the last) by this packed weight races the
    sparse tensor cores: bf16, 2:4, at most mma_sp.MAX_ROWS rows, a weight of at least one 16-row tile."""
    return (two_of_four and x.dtype == values.dtype == torch.bfloat16
            and x.numel() // x.shape[-1] <= mma_sp.MAX_ROWS and values.shape[1] >= mma_sp.TILE_ROWS)


def can_time_in_cuda_graph(x: Tensor) -> bool:
    """The race times in CUDA graphs (a CPU test stands in for it)."""
    return x.is_cuda


@torch.library.custom_op("sparse_decoding::mma_sp_fragments", mutates_args=())
def _mma_sp_fragments(x_fragments: Tensor, values: Tensor, mask: Tensor, rows: int) -> Tensor:
    return mma_sp.spmv_2of4_fragments(x_fragments, values, mask, rows)


@_mma_sp_fragments.register_fake
def _(x_fragments: Tensor, values: Tensor, mask: Tensor, rows: int) -> Tensor:
    return x_fragments.new_empty(rows, mask.shape[1])


def takes_fragments(x: Tensor, values: Tensor, two_of_four: bool) -> bool:
    """Whether a plain matmul of x (rows: all dimensions but the last) goes to the sparse tensor
    cores with x in fragment order (ROUTES.fragments_from_rows), wherever the kernels run."""
    rows = x.numel() // x.shape[-1]
    return (not _without_kernels(x) and tensor_cores_take(x, values, two_of_four)
            and rows >= ROUTES.fragments_from_rows)


@_bitmask_matmul.register_fake
def _(x: Tensor, values: Tensor, mask: Tensor, norm_weight: Optional[Tensor] = None, norm_eps: float = 0.0,
      residual: Optional[Tensor] = None, gated: bool = False, two_of_four: bool = False) -> Tensor:
    return x.new_empty(x.shape[0], mask.shape[1])


def _without_kernels(x: Tensor) -> bool:
    """True where no Triton kernel can run: on the CPU, unless the interpreter is on."""
    return x.device.type == "cpu" and not common.INTERPRETING


def _as_rows(x: Tensor) -> Tensor:
    """(..., features) -> a contiguous (rows, features) view or copy."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.is_contiguous() else rows.contiguous()


def sparse_matmul(x: Tensor, values: Tensor, mask: Tensor, norm_weight: Tensor = None, norm_eps: float = 0.0,
                  residual: Tensor = None, gated: bool = False, two_of_four: bool = False) -> Tensor:
    """x @ W.T for x of shape (..., in), W given packed as (values, mask); two_of_four: W is 2:4,
    which the SpMM and the sparse tensor cores exploit (the mask alone does not say it).

    With norm_weight / gated / residual: residual + prologue(x) @ W.T in one kernel launch, the
    prologue being RMSNorm(x) * norm_weight or, for x = [gate | up], silu(gate) * up. Only for
    decode-sized x (up to 16 rows) where the kernels run."""
    fused = norm_weight is not None or residual is not None or gated
    if _without_kernels(x):
        if fused:
            raise ValueError("sparse_matmul: the fused prologue/epilogue needs the Triton kernels (CUDA, or "
                             "TRITON_INTERPRET=1)")
        return F.linear(x, unpack(values, mask).to(x.dtype))
    if not fused and takes_fragments(x, values, two_of_four):
        rows = _as_rows(x)
        y = _mma_sp_fragments(mma_sp.fragment_order(rows), values, mask, rows.shape[0])
        return y.reshape(*x.shape[:-1], mask.shape[1])
    if x.is_cuda and not torch.compiler.is_compiling():
        common.reserve_workspace(x.device, mask.shape[1])  # eager calls (e.g. the prefill) run first
    y = _bitmask_matmul(_as_rows(x), values, mask, norm_weight, norm_eps,
                        None if residual is None else _as_rows(residual), gated, two_of_four)
    return y.reshape(*x.shape[:-1], mask.shape[1])


class SparseLinear(nn.Module):
    """y = x @ W.T (+ bias) with W (out_features, in_features) stored in the N:M bitmask format.

    A bias (Qwen2's q/k/v) stays dense and is added after the kernel, so a layer without one runs
    exactly as before; after the kernel rather than in it, because it is one add over the output
    that the compiler fuses with whatever reads the output next."""

    def __init__(self, in_features: int, out_features: int, pattern: str, dtype=None, device=None, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.pattern = in_features, out_features, pattern
        dtype = dtype or torch.get_default_dtype()
        values_shape, mask_shape = packed_shapes(in_features, out_features, pattern)
        self.register_buffer("values", torch.zeros(values_shape, dtype=dtype, device=device))
        self.register_buffer("mask", torch.zeros(mask_shape, dtype=torch.int32, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None
        self._cpu_weight, self._cpu_weight_key = None, None  # see _unpacked_for_cpu

    @classmethod
    def from_dense(cls, linear_or_weight, pattern: str, mask: Tensor = None) -> "SparseLinear":
        """From an nn.Linear (its bias kept as it is) or a weight tensor."""
        weight = linear_or_weight.weight if isinstance(linear_or_weight, nn.Linear) else linear_or_weight
        bias = linear_or_weight.bias if isinstance(linear_or_weight, nn.Linear) else None
        out_features, in_features = weight.shape
        layer = cls(in_features, out_features, pattern, dtype=weight.dtype, device="meta", bias=bias is not None)
        layer.values, layer.mask = pack(weight, pattern, mask)
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad)
        return layer

    def fuses(self, x: Tensor, prologue: bool = False) -> bool:
        """Whether forward should take the residual for this x (the model asks): a decode-sized x
        below the SpMM's rows and ROUTES.residual_apart_from_rows; with prologue=True, whether it
        should also take the norm or silu(gate) * up (below ROUTES.prologue_apart_from_rows)."""
        rows = x.numel() // x.shape[-1]
        return (not _without_kernels(x)
                and rows < min(spmm_min_rows(self.two_of_four), ROUTES.residual_apart_from_rows)
                and (not prologue or rows < ROUTES.prologue_apart_from_rows))

    def forward(self, x: Tensor, norm: nn.Module = None, residual: Tensor = None, gated: bool = False) -> Tensor:
        """x @ W.T; where `fuses(x)`, optionally residual + prologue(x) @ W.T in the same kernel, the
        prologue being norm(x) for an RMSNorm module `norm` (its weight and eps), or silu(gate) *
        up for a gated x = [gate | up]. (A forward hook on this module then sees x before the
        prologue; prune/ and evaluation/ hook dense nn.Linear layers, which never fuse.)"""
        if _without_kernels(x) and norm is None and residual is None and not gated:
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return F.linear(x, self._unpacked_for_cpu().to(x.dtype), bias)
        y = sparse_matmul(x, self.values, self.mask, None if norm is None else norm.weight,
                          0.0 if norm is None else norm.eps, residual, gated, self.two_of_four)
        return y if self.bias is None else y + self.bias

    @property
    def runs_expanded(self) -> bool:
        """True on the CPU without the Triton interpreter: forward multiplies by the weight expanded
        to dense (_unpacked_for_cpu), not by the packed one."""
        return _without_kernels(self.values)

    def bytes_read_per_step(self) -> int:
        """Weight bytes one forward reads: the packed values and mask where the kernels run, the
        expanded dense weight where it runs_expanded (as many bytes as the dense model's layer)."""
        if self.runs_expanded:
            return self.in_features * self.out_features * self.values.element_size()
        return self.values.nbytes + self.mask.nbytes

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
    """Turn every nn.Linear whose `<name>.values` is in state_dict into an empty SparseLinear (with a
    bias where the module has one) on the module's device (meta included), ready for
    `load_state_dict(state_dict, assign=True)`."""
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and f"{name}.values" in state_dict:
            dtype = state_dict[f"{name}.values"].dtype
            _replace(model, name, SparseLinear(module.in_features, module.out_features, pattern, dtype=dtype,
                                               device=module.weight.device, bias=module.bias is not None))
    return model
