"""sparse/linear.py: SparseLinear on CPU (pure PyTorch path), its route table and measured route,
model swapping and meta-device loading; a whole model's decode step and the prefill through the real
kernels on CPU under TRITON_INTERPRET=1 (in a subprocess, tests/sparse_kernel_testing.py); GPU tests
(marked `gpu`) run the Triton kernels on real layer shapes, eagerly and under torch.compile with CUDA
graphs."""
import dataclasses

import pytest
import torch
import torch.nn as nn

from model import ModelArgs, Transformer
from sparse import SparseLinear, pack, sparse_matmul, swap_linears_for_state_dict, swap_to_sparse, unpack
from sparse import linear
from sparse.format import keep_largest, packed_shapes
from sparse.kernels import common, mma_sp, spmm, spmv
from tests.sparse_kernel_testing import interpreted, relative_error

# The pure-PyTorch path and the stand-in races run in the parent process; the subprocess under
# TRITON_INTERPRET=1 runs the `interpreted` tests only.
parent_process_only = pytest.mark.skipif(common.INTERPRETING, reason="runs in the parent process")
TINY = ModelArgs(n_layer=2, n_head=4, n_local_heads=2, dim=64, intermediate_size=96, vocab_size=128, block_size=64)


@parent_process_only
@pytest.mark.parametrize("pattern", ["2:4", "16:32"])
def test_sparse_linear_matches_pruned_dense(pattern):
    linear = nn.Linear(96, 40, bias=False, dtype=torch.float64)
    layer = SparseLinear.from_dense(linear, pattern)
    assert (tuple(layer.values.shape), tuple(layer.mask.shape)) == packed_shapes(96, 40, pattern)
    pruned = linear.weight * keep_largest(linear.weight, pattern)
    x = torch.randn(2, 3, 96, dtype=torch.float64)
    assert torch.allclose(layer(x), x @ pruned.T)
    assert torch.allclose(sparse_matmul(x, layer.values, layer.mask), x @ pruned.T)


@parent_process_only
def test_decode_route_is_measured_once_per_shape_and_row_count(monkeypatch):
    # From ROUTES.race_from_rows rows the SpMV and the SpMM race (each tuned first), once per shape
    # and row count; fewer rows, or where nothing can be timed, follow the threshold. The kernels
    # and the race are stand-ins here (the race needs CUDA graphs); GPU tests run the real ones.
    calls, races = [], []

    def stand_in(name):
        return lambda x, values, mask, **options: calls.append(name) or x @ unpack(values, mask).T

    def race(candidates, values, mask, run):
        races.append(list(candidates))
        for candidate in candidates:
            run(candidate, values, mask)
        return "spmv"

    monkeypatch.setattr(spmv, "spmv", stand_in("spmv"))
    monkeypatch.setattr(spmm, "spmm", stand_in("spmm"))
    monkeypatch.setattr(linear, "fastest_in_cuda_graph", race)
    monkeypatch.setattr(linear, "can_time_in_cuda_graph", lambda x: True)
    monkeypatch.setattr(linear, "measured_routes", {})
    layer = SparseLinear.from_dense(torch.randn(64, 96, dtype=torch.float64), "2:4")
    dense = unpack(layer.values, layer.mask)
    for _ in range(2):
        x = torch.randn(8, 96, dtype=torch.float64)
        assert torch.allclose(linear._bitmask_matmul(x, layer.values, layer.mask, two_of_four=True), x @ dense.T)
    assert races == [["spmv", "spmm"]]
    assert calls == ["spmv", "spmm", "spmv", "spmm", "spmv", "spmv"]  # tuned, raced, then the winner twice
    calls.clear()
    linear._bitmask_matmul(torch.randn(4, 96, dtype=torch.float64), layer.values, layer.mask, two_of_four=True)
    monkeypatch.setattr(linear, "can_time_in_cuda_graph", lambda x: False)
    linear._bitmask_matmul(torch.randn(16, 96, dtype=torch.float64), layer.values, layer.mask, two_of_four=True)
    assert calls == ["spmv", "spmm"] and len(races) == 1  # 4 rows, and nothing timed: by the threshold


@parent_process_only
def test_tensor_cores_join_the_race_for_bf16_2of4(monkeypatch):
    # A 2:4 weight's matmul of bf16 x, plain or with a residual and/or a prologue (the RMSNorm,
    # silu(gate) * up) fused, races the sparse tensor cores too, at any row count (the SpMM only from
    # ROUTES.race_from_rows, plain); other dtypes and patterns do not.
    calls, races = [], []

    def stand_in(name):
        return lambda x, values, mask, **options: calls.append(name) or x @ unpack(values, mask).T.to(x.dtype)

    def race(candidates, values, mask, run):
        races.append(list(candidates))
        return candidates[-1]

    monkeypatch.setattr(spmv, "spmv", stand_in("spmv"))
    monkeypatch.setattr(spmm, "spmm", stand_in("spmm"))
    monkeypatch.setattr(mma_sp, "spmv_2of4", stand_in("mma_sp"))
    monkeypatch.setattr(linear, "fastest_in_cuda_graph", race)
    monkeypatch.setattr(linear, "can_time_in_cuda_graph", lambda x: True)
    monkeypatch.setattr(linear, "measured_routes", {})
    layer = SparseLinear.from_dense(torch.randn(64, 96, dtype=torch.bfloat16), "2:4")
    for rows in (4, 8):
        linear._bitmask_matmul(torch.randn(rows, 96, dtype=torch.bfloat16), layer.values, layer.mask,
                               two_of_four=True)
    assert races == [["spmv", "mma_sp"], ["spmv", "spmm", "mma_sp"]]
    assert calls == ["spmv", "mma_sp", "mma_sp", "spmv", "spmm", "mma_sp", "mma_sp"]  # tuned, then the winner
    calls.clear()
    linear._bitmask_matmul(torch.randn(4, 96, dtype=torch.float32), layer.values.float(), layer.mask,
                           two_of_four=True)
    linear._bitmask_matmul(torch.randn(4, 96, dtype=torch.bfloat16), layer.values, layer.mask, two_of_four=False)
    assert calls == ["spmv", "spmv"] and len(races) == 2  # fp32 x, or not 2:4: no race below 8 rows
    calls.clear()  # a weight of fewer rows than one 16-row tile: no tensor cores either
    small = SparseLinear.from_dense(torch.randn(8, 96, dtype=torch.bfloat16), "2:4")
    linear._bitmask_matmul(torch.randn(4, 96, dtype=torch.bfloat16), small.values, small.mask, two_of_four=True)
    assert calls == ["spmv"] and len(races) == 2
    calls.clear()  # with a residual to add (o and w2 at 4-7 rows): the SpMV or the tensor cores, never the SpMM
    x, residual = torch.randn(4, 96, dtype=torch.bfloat16), torch.randn(4, 64, dtype=torch.bfloat16)
    linear._bitmask_matmul(x, layer.values, layer.mask, residual=residual, two_of_four=True)
    assert races[-1] == ["spmv", "mma_sp"] and calls == ["spmv", "mma_sp", "mma_sp"]
    calls.clear()  # the RMSNorm fused (qkv and w13 at 1-3 rows): the SpMV or the tensor cores, both given the norm
    norm_weight = torch.randn(96, dtype=torch.bfloat16)
    options = []
    monkeypatch.setattr(spmv, "spmv", lambda x, values, mask, **kw: options.append(("spmv", kw)) or x[:, :64].clone())
    monkeypatch.setattr(mma_sp, "spmv_2of4", lambda x, values, mask, **kw: options.append(("mma_sp", kw)) or x[:, :64].clone())
    x2 = torch.randn(2, 96, dtype=torch.bfloat16)
    linear._bitmask_matmul(x2, layer.values, layer.mask, norm_weight=norm_weight, norm_eps=1e-5, two_of_four=True)
    assert races[-1] == ["spmv", "mma_sp"] and [name for name, _ in options] == ["spmv", "mma_sp", "mma_sp"]
    assert all(kw["norm_weight"] is norm_weight and kw["norm_eps"] == 1e-5 for _, kw in options)
    options.clear()  # silu(gate) * up and the residual fused (w2 at 1-3 rows): both kernels take them
    residual2 = torch.randn(2, 64, dtype=torch.bfloat16)
    linear._bitmask_matmul(torch.randn(2, 192, dtype=torch.bfloat16), layer.values, layer.mask, residual=residual2,
                           gated=True, two_of_four=True)
    assert races[-1] == ["spmv", "mma_sp"] and [name for name, _ in options] == ["spmv", "mma_sp", "mma_sp"]
    assert all(kw["gated"] is True and kw["residual"] is residual2 for _, kw in options)


@parent_process_only
def test_spmv_packs_bf16_x_from_the_route_tables_rows(monkeypatch):
    x = torch.randn(8, 64).bfloat16()
    assert linear.packs_x(x) and linear.packs_x(x[:4]) and not linear.packs_x(x[:3]) and not linear.packs_x(x.float())
    monkeypatch.setattr(linear, "ROUTES", dataclasses.replace(linear.ROUTES, pack_x_from_rows=8))
    assert not linear.packs_x(x[:4]) and linear.packs_x(x)


@parent_process_only
def test_cpu_path_follows_buffers_changed_in_place():
    # The CPU path keeps an unpacked copy; it must not serve stale weights.
    layer = SparseLinear.from_dense(torch.randn(40, 64, dtype=torch.float64), "2:4")
    x = torch.randn(3, 64, dtype=torch.float64)
    before = layer(x)
    values, mask = pack(torch.randn(40, 64, dtype=torch.float64), "2:4")
    layer.values.copy_(values)
    layer.mask.copy_(mask)
    assert torch.allclose(layer(x), x @ unpack(values, mask).T)
    assert not torch.allclose(layer(x), before)


@parent_process_only
def test_bias_stays_dense_and_is_added():
    """A linear with a bias (Qwen2's q/k/v) packs its weight and keeps the bias as it is, on the CPU
    path and through swap_linears_for_state_dict; a layer without one has no bias parameter."""
    dense = nn.Linear(64, 8, dtype=torch.float64)
    layer = SparseLinear.from_dense(dense, "2:4")
    assert torch.equal(layer.bias, dense.bias) and layer.bias.data_ptr() != dense.bias.data_ptr()
    x = torch.randn(3, 64, dtype=torch.float64)
    pruned = dense.weight * keep_largest(dense.weight, "2:4")
    assert torch.allclose(layer(x), x @ pruned.T + dense.bias)
    assert SparseLinear.from_dense(nn.Linear(64, 8, bias=False), "2:4").bias is None
    with torch.device("meta"):
        empty = nn.Module()
        empty.proj = nn.Linear(64, 8)
    swap_linears_for_state_dict(empty, {f"proj.{k}": v for k, v in layer.state_dict().items()}, "2:4")
    empty.load_state_dict({f"proj.{k}": v for k, v in layer.state_dict().items()}, assign=True)
    assert torch.allclose(empty.proj(x), layer(x))


@parent_process_only
def test_swap_to_sparse_keeps_the_model_function():
    torch.manual_seed(0)
    model = Transformer(TINY)
    masks = {"layers.0.attention.wo": keep_largest(torch.randn(64, 64), "2:4")}  # any valid mask
    reference = Transformer(TINY)
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        for name, module in reference.named_modules():
            if isinstance(module, nn.Linear) and name != "output":
                module.weight *= masks.get(name, keep_largest(module.weight, "2:4"))
    swap_to_sparse(model, "2:4", masks)
    assert isinstance(model.layers[1].feed_forward.w2, SparseLinear)
    assert isinstance(model.output, nn.Linear)  # skipped by default
    for m in (model, reference):
        m.setup_caches(1, 16)
    idx, pos = torch.randint(0, 128, (1, 6)), torch.arange(6)
    assert torch.allclose(model(idx, pos), reference(idx, pos), atol=1e-5)


@parent_process_only
def test_swap_linears_for_state_dict_loads_on_meta():
    torch.manual_seed(1)
    source = swap_to_sparse(Transformer(TINY), "4:8")
    state_dict = source.state_dict()
    with torch.device("meta"):
        model = Transformer(TINY)
    swap_linears_for_state_dict(model, state_dict, "4:8")
    assert model.layers[0].attention.wqkv.values.is_meta
    model.load_state_dict(state_dict, assign=True)
    layer = model.layers[0].feed_forward.w13
    assert torch.equal(unpack(layer.values, layer.mask), unpack(*pack(unpack(layer.values, layer.mask), "4:8")))
    assert torch.equal(layer.mask, source.layers[0].feed_forward.w13.mask)


def sparse_model_and_float64_reference(rows, device="cpu", dtype=torch.float32, qkv_bias=False,
                                       prefill_through_the_kernels=True):
    """A two-layer 2:4 model after a 5-token prefill of `rows` prompts, the same model with the
    unpacked weights in float64 on the CPU, and the token of the decode step to feed both.
    qkv_bias: a Qwen2 model, whose packed wqkv keeps its dense bias. prefill_through_the_kernels=False
    copies the reference's caches instead: the interpreter takes most of a minute for the prefill's
    SpMMs, which tests of their own cover."""
    torch.manual_seed(0)
    config = ModelArgs(architecture="qwen2" if qkv_bias else "llama", qkv_bias=qkv_bias, dim=64, n_layer=2,
                       n_head=4, n_local_heads=2, intermediate_size=96, vocab_size=50, block_size=32)
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
    reference(tokens[:, :5], torch.arange(5))
    if prefill_through_the_kernels:
        model(tokens[:, :5].to(device), torch.arange(5, device=device))
    else:
        for ours, theirs in zip(model.layers, reference.layers):
            for name in ("k_cache", "v_cache"):
                getattr(ours.attention.kv_cache, name).copy_(getattr(theirs.attention.kv_cache, name))
    return model, reference, tokens[:, 5:]


@interpreted
@torch.no_grad()
@pytest.mark.parametrize("prologue_apart_from,residual_apart_from,qkv_bias",
                         [(9, 9, False), (2, 9, False), (2, 2, False), (9, 9, True), (2, 2, True)])
def test_sparse_decode_step_through_the_fused_kernels_matches_float64(prologue_apart_from, residual_apart_from,
                                                                      qkv_bias, monkeypatch):
    """A whole model: the decode step's linears take norm, residual and silu * up into the SpMV
    (SparseLinear.fuses under the interpreter), or at its 2 rows only the residual with the
    prologue run apart, or neither, against the unpacked weights in float64 math; with Qwen2's
    q/k/v bias added after the kernel that fused the norm, or after the plain product."""
    monkeypatch.setattr(linear, "ROUTES", dataclasses.replace(linear.ROUTES, prologue_apart_from_rows=prologue_apart_from,
                                                              residual_apart_from_rows=residual_apart_from))
    model, reference, token = sparse_model_and_float64_reference(2, qkv_bias=qkv_bias, prefill_through_the_kernels=False)
    assert (model.layers[0].attention.wqkv.bias is not None) == qkv_bias
    probe = model.layers[0].feed_forward.w2
    assert probe.fuses(torch.zeros(2, 1, 96)) == (residual_apart_from > 2) and not probe.fuses(torch.zeros(2, 5, 96))
    assert probe.fuses(torch.zeros(2, 1, 96), prologue=True) == (prologue_apart_from > 2 and residual_apart_from > 2)
    logits = model(token, torch.tensor([5]))
    assert relative_error(logits, reference(token, torch.tensor([5]))) < 1e-5


@interpreted
def test_prefill_matmul_matches_float64():
    # The prefill: the weight expanded to dense by the Triton kernel, then F.linear.
    values, mask = pack(torch.randn(200, 96), "4:8")
    x = torch.randn(40, 96, generator=torch.Generator().manual_seed(1))
    y = linear.prefill_matmul(x, values, mask)
    assert y.shape == (40, 200) and relative_error(y, x.double() @ unpack(values, mask).double().T) < 1e-6


@interpreted
def test_sparse_linear_dispatch_under_interpreter():
    layer = SparseLinear.from_dense(torch.randn(24, 64), "4:8")
    dense = unpack(layer.values, layer.mask).double()
    for rows in [1, 5, 9, 17]:  # the SpMV, the SpMV (4:8 below 9 rows), the SpMM, the prefill
        x = torch.randn(1, rows, 64)
        assert relative_error(layer(x), x.double() @ dense.T) < 1e-6


@interpreted
def test_sparse_linear_dispatch_to_spmm(monkeypatch):
    calls = []  # whether each SpMM call was told that W is 2:4
    monkeypatch.setattr(spmm, "spmm", lambda *args, _spmm=spmm.spmm, **kwargs:
                        calls.append(kwargs["two_of_four"]) or _spmm(*args, **kwargs))
    for pattern in ("8:16", "2:4"):
        calls.clear()
        layer = SparseLinear.from_dense(torch.randn(24, 64), pattern)
        dense = unpack(layer.values, layer.mask).double()
        for rows in [1, 8, 16, 40]:  # the SpMV; 8 rows: the SpMM for 2:4 only; a full MMA tile; the prefill
            x = torch.randn(rows, 64)
            assert relative_error(layer(x), x.double() @ dense.T) < 1e-6
        assert calls == {"8:16": [False], "2:4": [True] * 2}[pattern]


@interpreted
def test_plain_bf16_2of4_products_from_8_rows_take_x_in_fragment_order(monkeypatch):
    # ROUTES.fragments_from_rows: a plain bf16 2:4 product of 8-16 rows goes to the sparse tensor
    # cores with x repacked (mma_sp.fragment_order); fewer rows, a residual to add, or fp32 do not.
    rows_given = []
    monkeypatch.setattr(mma_sp, "spmv_2of4_fragments", lambda *args, _run=mma_sp.spmv_2of4_fragments, **kwargs:
                        rows_given.append(args[3]) or _run(*args, **kwargs))
    layer = SparseLinear.from_dense(torch.randn(40, 96).to(torch.bfloat16), "2:4")
    dense = unpack(layer.values, layer.mask).double()
    for rows in [4, 12]:
        x = torch.randn(1, rows, 96).to(torch.bfloat16)
        assert relative_error(layer(x), x.double() @ dense.T) < 1e-2
    residual = torch.randn(12, 40).to(torch.bfloat16)
    y = sparse_matmul(x[0], layer.values, layer.mask, residual=residual, two_of_four=True)
    assert relative_error(y, residual.double() + x[0].double() @ dense.T) < 1e-2
    assert relative_error(layer.float()(x.float()), x.double() @ dense.T) < 1e-5
    assert rows_given == [12]


# ---------------------------------------------------------------- GPU

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# (out, in) of Llama-3.1-8B's fused qkv and w2 and Qwen3-14B's qkv; every pattern on one shape.
GPU_CASES = [(6144, 4096, "2:4"), (4096, 14336, "16:32"), (7168, 5120, "4:8"), (4096, 4096, "8:16")]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("out_features,in_features,pattern", GPU_CASES)
@pytest.mark.parametrize("rows", [1, 3, 4, 8, 16, 300])  # 8 and 16: the measured route
def test_gpu_bf16_against_float64(out_features, in_features, pattern, rows):
    weight = torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16)
    layer = SparseLinear.from_dense(weight, pattern)
    dense = unpack(layer.values, layer.mask).double()
    for _ in range(2):  # fresh inputs; the second call also checks the split-K workspace was left clean
        x = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16)
        assert relative_error(layer(x), x.double() @ dense.T) < 1e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rows", [1, 3, 4, 8, 16])
def test_gpu_tensor_core_route_against_float64(rows):
    # Whichever kernel wins the race (the sparse tensor cores among them), the layer's output
    # matches float64, plain, with a residual to add, and (where it fuses them) with a prologue.
    layer = SparseLinear.from_dense(torch.randn(6144, 4096, device="cuda", dtype=torch.bfloat16), "2:4")
    dense = unpack(layer.values, layer.mask).double()
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    assert relative_error(layer(x), x.double() @ dense.T) < 1e-2
    raced = ["spmv", "mma_sp"] + ["spmm"] * (rows >= linear.ROUTES.race_from_rows)
    assert linear.decode_route(x, layer.values, layer.mask, True) in raced
    for name in raced:  # each kernel the race may pick, not only this process's winner
        y = linear.DECODE_KERNELS[name](x, layer.values, layer.mask, True, None, {})
        assert relative_error(y, x.double() @ dense.T) < 1e-2, name
    residual = torch.randn(rows, 6144, device="cuda", dtype=torch.bfloat16)  # o and w2 at 4-7 rows
    assert relative_error(layer(x, residual=residual), residual.double() + x.double() @ dense.T) < 1e-2
    if layer.fuses(x, prologue=True):  # qkv and w13 with the RMSNorm fused, w2 with silu(gate) * up
        from model import RMSNorm
        norm = RMSNorm(4096).cuda().to(torch.bfloat16)
        nn.init.normal_(norm.weight, 1.0, 0.3)
        x64 = x.double()
        normed = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.double()
        assert relative_error(layer(x, norm=norm), normed @ dense.T) < 1e-2
        gate_up = torch.randn(rows, 8192, device="cuda", dtype=torch.bfloat16)
        gate, up = gate_up.double().chunk(2, dim=-1)
        expected = residual.double() + (torch.nn.functional.silu(gate) * up) @ dense.T
        assert relative_error(layer(gate_up, residual=residual, gated=True), expected) < 1e-2


@pytest.mark.gpu
@needs_cuda
def test_gpu_torch_compile_cuda_graphs():
    class Block(nn.Module):  # a residual MLP: two sparse layers and pointwise ops around them
        def __init__(self):
            super().__init__()
            self.up = SparseLinear.from_dense(torch.randn(2048, 1024, dtype=torch.bfloat16) / 32, "2:4").cuda()
            self.down = SparseLinear.from_dense(torch.randn(1024, 2048, dtype=torch.bfloat16) / 45, "8:16").cuda()

        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)))

    block = Block()
    up, down = (unpack(layer.values, layer.mask).double() for layer in (block.up, block.down))
    compiled = torch.compile(block, fullgraph=True, mode="reduce-overhead")
    for rows in [1, 1, 1, 4, 4, 4, 64]:
        x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
        reference = x.double() + torch.relu(x.double() @ up.T) @ down.T
        assert relative_error(compiled(x).clone(), reference) < 1e-2


@parent_process_only
def test_layers_fuse_their_residual_and_prologue_below_the_route_tables_rows(monkeypatch):
    # The residual below ROUTES.residual_apart_from_rows (and the SpMM's rows), the prologue also
    # below ROUTES.prologue_apart_from_rows; a prefill-sized x never.
    monkeypatch.setattr(linear, "_without_kernels", lambda x: False)  # as on a GPU: fuses() only decides
    layer = SparseLinear.from_dense(torch.randn(64, 96, dtype=torch.bfloat16), "4:8")

    def fusions(rows):
        x = torch.zeros(rows, 1, 96, dtype=torch.bfloat16)
        return layer.fuses(x), layer.fuses(x, prologue=True)

    assert fusions(3) == (True, True) and fusions(4) == (True, False) and fusions(8) == (False, False)
    monkeypatch.setattr(linear, "ROUTES", dataclasses.replace(linear.ROUTES, prologue_apart_from_rows=9,
                                                              residual_apart_from_rows=9))
    assert fusions(8) == (True, True) and fusions(9) == (False, False) and fusions(64) == (False, False)


@pytest.mark.gpu
@needs_cuda
@torch.no_grad()
@pytest.mark.parametrize("qkv_bias", [False, True])
@pytest.mark.parametrize("rows", [1, 4, 8])
def test_gpu_sparse_decode_step_with_the_default_fusions_matches_float64(rows, qkv_bias):
    """A whole bf16 model's decode step on the GPU with the shipped row thresholds: at 1 row the
    SpMVs take norm, silu * up and residual; at 4 the prologues run apart; at 8 the residuals too.
    Eagerly, then compiled into CUDA graphs as generate.py runs it (its warm-up, recording and
    replays).
    qkv_bias: Qwen2's dense q/k/v bias, added after the packed wqkv's kernel."""
    model, reference, token = sparse_model_and_float64_reference(rows, "cuda", torch.bfloat16, qkv_bias)
    probe, x = model.layers[0].feed_forward.w2, torch.zeros(rows, 1, 96, device="cuda", dtype=torch.bfloat16)
    assert probe.fuses(x) == (rows < linear.ROUTES.residual_apart_from_rows)
    assert probe.fuses(x, prologue=True) == (rows < min(linear.ROUTES.prologue_apart_from_rows,
                                                        linear.ROUTES.residual_apart_from_rows))
    expected = reference(token, torch.tensor([5]))
    logits = model(token.cuda(), torch.tensor([5], device="cuda"))
    assert relative_error(logits.cpu(), expected) < 3e-2
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    for call in range(4):  # the same step again: it writes the same cache slot with the same values
        logits = compiled(token.cuda(), torch.tensor([5], device="cuda"))
        assert relative_error(logits.cpu(), expected) < 3e-2, call
