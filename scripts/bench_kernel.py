"""GPU benchmark of the N:M bitmask kernels against cuBLAS dense F.linear and torch's 2:4 format.

For every linear shape of Llama-3.1-8B, Qwen3-14B, Qwen3-32B and Llama-3.3-70B, at batch 1, 4, 8,
16 and a 2048-token prefill: median time per call, achieved GB/s, speedup over cuBLAS bf16
`F.linear`, over `to_sparse_semi_structured` (2:4, cuSPARSELt), the same SpMV with the prologue or
epilogue a decode step runs with it for that layer (up to 8 rows; DECODE_FUSION: fused into the SpMV,
or from the route table's prologue_apart_from_rows the prologue as its own kernel before it), the
sparse tensor cores (2:4), and the bandwidth floor (the packed bytes over the fastest read bandwidth
cuBLAS reached in the same run; a device copy also writes, so it understates the read bandwidth).

Timing (sparse/kernels/tuning.py's time_in_cuda_graph, which the autotuners use too): each measured call is
recorded many times into one CUDA graph, rotating over enough copies of the weights that they
cannot sit in the 60 MB L2; the graph is replayed and the median replay time divided by the calls
in it. Launch gaps inside a graph are what a compiled decode step sees, so they are part of the
number.

The kernel does not depend on the pattern at 16 kept bits per word, so the table times 2:4 (the one
torch's format can also run); `--patterns` times others. Correctness is checked by the GPU tests, and
in the table each timed kernel's tuned launch against float64 (`check_against_float64`).

    python scripts/bench_kernel.py --out-md docs/kernel_table.md --out-json runs/bench_kernel.json
    python scripts/bench_kernel.py --sweep   # config sweep on a few shapes (what the autotuner picks from)
    python scripts/bench_kernel.py --chain Llama-3.1-8B   # a decode step's 128 SpMVs back to back
    python scripts/bench_kernel.py --pack-x Llama-3.1-8B --batches 2,4,8,16   # x shuffled per row vs in bf16 pairs
    python scripts/bench_kernel.py --unpack-sweep all   # the prefill's expansion kernel, config by config
    python scripts/bench_kernel.py --ncu-shapes 4096x4096   # targets for Nsight Compute (see ncu_targets)
"""
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cli_args  # noqa: E402
from sparse import linear  # noqa: E402
from sparse.format import pack, parse_pattern, unpack  # noqa: E402
from sparse.kernels import mma_sp, spmm, spmv  # noqa: E402
from sparse.kernels.tuning import copies_for, time_in_cuda_graph  # noqa: E402
from sparse.kernels.unpack import unpack_to_dense  # noqa: E402
from sparse.linear import spmm_min_rows  # noqa: E402

SHAPES = {  # (layer, out_features, in_features); qkv and w13 fused as in model.py
    "Llama-3.1-8B": [("qkv", 6144, 4096), ("o", 4096, 4096), ("w13", 28672, 4096), ("w2", 4096, 14336)],
    "Qwen3-14B": [("qkv", 7168, 5120), ("o", 5120, 5120), ("w13", 34816, 5120), ("w2", 5120, 17408)],
    "Qwen3-32B": [("qkv", 10240, 5120), ("o", 5120, 8192), ("w13", 51200, 5120), ("w2", 5120, 25600)],
    "Llama-3.3-70B": [("qkv", 10240, 8192), ("o", 8192, 8192), ("w13", 57344, 8192), ("w2", 8192, 28672)],
}
SWEEP_SHAPES = [(4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336), (57344, 8192)]
PREFILL = 2048


def random_weight(out_features: int, in_features: int) -> torch.Tensor:
    return torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16) / in_features ** 0.5


def check_against_float64(kernel: str, y: torch.Tensor, x: torch.Tensor, values, mask):
    """Stops the table where y = x @ W.T is wrong (bf16 relative error >= 1e-2 against float64), so
    it never reports the time of a wrong kernel; run on each kernel's tuned launch."""
    reference = x.double() @ unpack(values, mask).double().T
    error = float((y.double() - reference).norm() / reference.norm())
    if not error < 1e-2:
        raise AssertionError(f"{kernel} is wrong on {mask.shape[1]}x{mask.shape[0] * 32} at {x.shape[0]} rows: "
                             f"relative error {error:.2e} against float64")


def sparse_call(x, values, mask, config=None):
    if x.shape[0] <= spmv.MAX_ROWS:  # the SpMV, x packed in bf16 pairs as SparseLinear would
        return lambda: spmv.spmv(x, values, mask, config, pack_x=linear.packs_x(x))
    return lambda: linear.prefill_matmul(x, values, mask)  # the prefill: expanded to dense, then cuBLAS


# What a decode step's SparseLinear does inside its SpMV launch (model.project), per layer: the
# RMSNorm before qkv and w13, silu(gate) * up before w2, the residual add after o and w2.
DECODE_FUSION = {"qkv": dict(norm=True), "w13": dict(norm=True), "o": dict(residual=True),
                 "w2": dict(gated=True, residual=True)}


def has_prologue(layer: str) -> bool:
    return bool(DECODE_FUSION[layer].get("norm") or DECODE_FUSION[layer].get("gated"))


def fused_sparse_call(layer: str, batch: int, values, mask, pack_x=None, tensor_cores=False):
    """The SpMV as a decode step runs it for this layer, with its inputs and the config tuned for
    this fusion (spmv.spmv_config); pack_x as spmv.spmv takes it (None: as SparseLinear would).
    tensor_cores: the sparse tensor cores' product with the same fusion instead (2:4)."""
    n_words, n_rows = mask.shape
    fusion = DECODE_FUSION[layer]
    device, dtype = values.device, values.dtype
    x = torch.randn(batch, n_words * 32 * (2 if fusion.get("gated") else 1), device=device, dtype=dtype)
    options = dict(gated=fusion.get("gated", False), pack_x=linear.packs_x(x) if pack_x is None else pack_x)
    if fusion.get("norm"):
        options.update(norm_weight=torch.rand(n_words * 32, device=device, dtype=dtype) + 0.5, norm_eps=1e-5)
    if fusion.get("residual"):
        options["residual"] = torch.randn(batch, n_rows, device=device, dtype=dtype)
    if tensor_cores:
        del options["pack_x"]
        return lambda: mma_sp.spmv_2of4(x, values, mask, **options)
    return lambda: spmv.spmv(x, values, mask, **options)


@torch.compile(fullgraph=True)
def _rms_norm(x, weight):
    return F.rms_norm(x, (x.shape[-1], ), weight, 1e-5)


@torch.compile(fullgraph=True)
def _silu_mul(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def unfused_sparse_call(layer: str, batch: int, values, mask, pack_x=None):
    """The alternative to fused_sparse_call for the layers with a prologue (qkv, w13: the norm; w2:
    silu·mul): the prologue as its own Inductor kernel, as the dense graph runs it, then the SpMV
    with only the residual fused. None for o, which has no prologue."""
    if not has_prologue(layer):
        return None
    fusion = DECODE_FUSION[layer]
    n_words, n_rows = mask.shape
    device, dtype = values.device, values.dtype
    x = torch.randn(batch, n_words * 32 * (2 if fusion.get("gated") else 1), device=device, dtype=dtype)
    norm_weight = torch.rand(n_words * 32, device=device, dtype=dtype) + 0.5
    residual = torch.randn(batch, n_rows, device=device, dtype=dtype) if fusion.get("residual") else None
    prologue = (lambda: _silu_mul(x)) if fusion.get("gated") else (lambda: _rms_norm(x, norm_weight))
    pack_x = linear.packs_x(x) if pack_x is None else pack_x
    return lambda: spmv.spmv(prologue(), values, mask, residual=residual, pack_x=pack_x)


def decode_chain(model: str, pattern: str = "2:4", layers: int = 32, distinct: int = 8) -> dict:
    """The SpMV part of a batch-1 decode step: `layers` layers of qkv (norm) -> o (residual) -> w13
    (norm) -> w2 (gated + residual), each reading the output of the one before, with a small copy
    kernel between qkv and o where attention would be; microseconds per step, measured twice.
    `distinct` different layers' weights are cycled (enough to miss the L2). Compare with the SpMV's
    share of a profiled decode step (bench_decode.py --profile)."""
    shapes = {layer: (out_features, in_features) for layer, out_features, in_features in SHAPES[model]}
    dim = shapes["o"][0]
    weights = [{layer: pack(random_weight(*shapes[layer]), pattern) for layer in shapes} for _ in range(distinct)]
    norm_weight = torch.rand(dim, device="cuda", dtype=torch.bfloat16) + 0.5
    h0 = torch.randn(1, dim, device="cuda", dtype=torch.bfloat16)
    attention = torch.empty(1, shapes["o"][1], device="cuda", dtype=torch.bfloat16)

    def step():
        h = h0
        for i in range(layers):
            w = weights[i % distinct]
            qkv = spmv.spmv(h, *w["qkv"], norm_weight=norm_weight, norm_eps=1e-5)
            attention.copy_(qkv[:, :attention.shape[1]])  # stands in for RoPE and attention
            h = spmv.spmv(attention, *w["o"], residual=h)
            gate_up = spmv.spmv(h, *w["w13"], norm_weight=norm_weight, norm_eps=1e-5)
            h = spmv.spmv(gate_up, *w["w2"], gated=True, residual=h)
        return h

    return dict(model=model, layers=layers, step_us=[time_in_cuda_graph([step], replays=21) for _ in range(2)])


def pack_x_ab(models, batches) -> list:
    """The SpMV with x shuffled one row per register against two rows per register (bf16 pairs,
    linear.packs_x), each with its own autotuned config, plain, with the layer's fused prologue
    and epilogue (DECODE_FUSION, up to 8 rows) and with the prologue as a kernel of its own
    (unfused_sparse_call), the tensor-core SpMM from spmm_min_rows(2:4) rows, and cuBLAS; each plain SpMV's output
    checked against float64 first."""
    from sparse.format import unpack
    rows = []
    for layer, out_features, in_features in [shape for model in models for shape in SHAPES[model]]:
        weight = random_weight(out_features, in_features)
        values, mask = pack(weight, "2:4")
        reference_weight = unpack(values, mask).double()
        nbytes = values.numel() * 2 + mask.numel() * 4
        packed = [(values, mask)] + [(values.clone(), mask.clone()) for _ in range(copies_for(nbytes) - 1)]
        weights = [weight] + [weight.clone() for _ in range(copies_for(weight.numel() * 2) - 1)]
        for batch in batches:
            x = torch.randn(batch, in_features, device="cuda", dtype=torch.bfloat16)
            row = dict(layer=layer, out=out_features, inp=in_features, batch=batch,
                       dense_us=time_in_cuda_graph([lambda w=w: F.linear(x, w) for w in weights]))
            reference = x.double() @ reference_weight.T
            for pack_x in (False, True):
                config = spmv.spmv_config(x, values, mask, pack_x)
                y = spmv.spmv(x, values, mask, config=config, pack_x=pack_x).double()
                error = float((y - reference).norm() / reference.norm())
                if not error < 1e-2:
                    raise AssertionError(f"spmv pack_x={pack_x} {config} is wrong on {out_features}x{in_features} "
                                         f"b{batch}: relative error {error:.2e}")
                name = "packed" if pack_x else "plain"
                row[f"{name}_config"], row[f"{name}_error"] = list(config), error
                row[f"{name}_us"] = time_in_cuda_graph(
                    [lambda v=v, m=m: spmv.spmv(x, v, m, config=config, pack_x=pack_x) for v, m in packed])
                if batch < spmm_min_rows(two_of_four=True):
                    row[f"{name}_fused_us"] = time_in_cuda_graph(
                        [fused_sparse_call(layer, batch, v, m, pack_x) for v, m in packed])
                    if has_prologue(layer):  # o has none
                        row[f"{name}_unfused_us"] = time_in_cuda_graph(
                            [unfused_sparse_call(layer, batch, v, m, pack_x) for v, m in packed])
            if batch >= spmm_min_rows(two_of_four=True):
                row["spmm_us"] = time_in_cuda_graph([lambda v=v, m=m: spmm.spmm(x, v, m) for v, m in packed])
            rows.append(row)
            print(f"{layer} {out_features}x{in_features} b{batch}: cuBLAS {row['dense_us']:.1f}  plain "
                  f"{row['plain_us']:.1f} {tuple(row['plain_config'])}  packed {row['packed_us']:.1f} "
                  f"{tuple(row['packed_config'])}  fused plain {row.get('plain_fused_us', float('nan')):.1f} packed "
                  f"{row.get('packed_fused_us', float('nan')):.1f}  unfused plain {row.get('plain_unfused_us', float('nan')):.1f}"
                  f" packed {row.get('packed_unfused_us', float('nan')):.1f}  SpMM {row.get('spmm_us', float('nan')):.1f} µs",
                  flush=True)
        del packed, weights
        torch.cuda.empty_cache()
    return rows


def pack_x_summary(rows: list) -> str:
    lines = ["| layer | out×in | rows | cuBLAS µs | plain µs (speedup) | packed µs (speedup) | packed / plain "
             "| fused: plain µs | fused: packed µs | packed / plain | prologue apart: plain µs | packed µs | SpMM µs |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        spmm_us = f"{r['spmm_us']:.1f}" if "spmm_us" in r else "-"
        fused = (f"{r['plain_fused_us']:.1f} | {r['packed_fused_us']:.1f} | {r['packed_fused_us'] / r['plain_fused_us']:.3f}"
                 if "plain_fused_us" in r else "- | - | -")
        unfused = (f"{r['plain_unfused_us']:.1f} | {r['packed_unfused_us']:.1f}" if "plain_unfused_us" in r else "- | -")
        lines.append(f"| {r['layer']} | {r['out']}×{r['inp']} | {r['batch']} | {r['dense_us']:.1f} | {r['plain_us']:.1f} "
                     f"({r['dense_us'] / r['plain_us']:.2f}×) | {r['packed_us']:.1f} ({r['dense_us'] / r['packed_us']:.2f}×) "
                     f"| {r['packed_us'] / r['plain_us']:.3f} | {fused} | {unfused} | {spmm_us} |")
    return "\n".join(lines)


UNPACK_CONFIGS = [(64, 4, 4), (128, 2, 4), (32, 8, 4), (64, 4, 8), (128, 4, 8), (256, 2, 8), (64, 8, 8)]


def unpack_sweep(shapes, configs=UNPACK_CONFIGS) -> list:
    """The prefill's expansion to dense (unpack_to_dense), each config (rows, words, warps
    per program): µs per call and GB/s of packed bytes read + dense bytes written; each config's
    output checked against format.unpack first."""
    from sparse.format import unpack
    rows = []
    for out_features, in_features in shapes:
        values, mask = pack(random_weight(out_features, in_features), "2:4")
        expected = unpack(values, mask)
        nbytes = values.numel() * 2 + mask.numel() * 4 + out_features * in_features * 2
        packed = [(values, mask)] + [(values.clone(), mask.clone()) for _ in range(copies_for(nbytes) - 1)]
        outs = [torch.empty(out_features, in_features, device="cuda", dtype=torch.bfloat16) for _ in packed]
        for config in configs:
            if not torch.equal(unpack_to_dense(values, mask, config=config), expected):
                raise AssertionError(f"unpack_to_dense {config} is wrong on {out_features}x{in_features}")
            us = time_in_cuda_graph([lambda v=v, m=m, o=o: unpack_to_dense(v, m, out=o, config=config)
                                             for (v, m), o in zip(packed, outs)])
            rows.append(dict(out=out_features, inp=in_features, config=list(config), us=us, gbps=nbytes / us / 1e3))
            print(f"{out_features}x{in_features} {config}: {us:.1f} µs {rows[-1]['gbps']:.0f} GB/s", flush=True)
        del packed, outs
        torch.cuda.empty_cache()
    return rows


def eager_time_per_call(calls, repeats: int = 20) -> float:
    """Median microseconds per call of plain eager launches (for ops that may not graph-capture)."""
    for call in calls:
        call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        for call in calls:
            call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / len(calls))
    return statistics.median(times)


def semi_structured_time(weight_24: torch.Tensor, x: torch.Tensor, copies: int):
    """Time torch's 2:4 semi-structured F.linear (eager: a failed graph capture would poison the
    process), or the reason it could not run."""
    try:
        from torch.sparse import to_sparse_semi_structured
        semis = [to_sparse_semi_structured(weight_24) for _ in range(copies)]
        return eager_time_per_call([lambda s=s: F.linear(x, s) for s in semis]), None
    except Exception as e:  # record what happens: it may refuse some shapes or batch sizes
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"


def bench_shape(out_features, in_features, batch, pattern, with_semi=True, layer=None) -> dict:
    weight = random_weight(out_features, in_features)
    values, mask = pack(weight, pattern)
    sparse_bytes = values.numel() * values.element_size() + mask.numel() * 4
    dense_bytes = weight.numel() * weight.element_size()
    io_bytes = batch * (in_features + out_features) * 2
    x = torch.randn(batch, in_features, device="cuda", dtype=torch.bfloat16)

    packed = [(values, mask)] + [(values.clone(), mask.clone()) for _ in range(copies_for(sparse_bytes) - 1)]
    sparse_us = time_in_cuda_graph([sparse_call(x, v, m) for v, m in packed])
    check_against_float64("the SpMV/SpMM/prefill", sparse_call(x, values, mask)(), x, values, mask)
    fused_us = None
    # The rows a decode step fuses (SparseLinear.fuses).
    if layer in DECODE_FUSION and batch < spmm_min_rows(parse_pattern(pattern) == (2, 4)):
        prologue_apart = has_prologue(layer) and batch >= linear.ROUTES.prologue_apart_from_rows
        decode_call = unfused_sparse_call if prologue_apart else fused_sparse_call
        fused_us = time_in_cuda_graph([decode_call(layer, batch, v, m) for v, m in packed])
    tensor_core_us = tensor_core_fused_us = None
    if pattern == "2:4" and batch <= mma_sp.MAX_ROWS:  # the same weights on the sparse tensor cores
        # From ROUTES.fragments_from_rows SparseLinear gives them x in fragment order. The repack is
        # not timed here (Inductor may fuse it into the kernel producing x); bench_decode.py counts it.
        fragments = batch >= linear.ROUTES.fragments_from_rows
        x_fragments = mma_sp.fragment_order(x) if fragments else None

        def tensor_cores(v, m):
            return mma_sp.spmv_2of4_fragments(x_fragments, v, m, batch) if fragments else mma_sp.spmv_2of4(x, v, m)

        tensor_cores(values, mask)  # its config for this shape, tuned outside the timing
        tensor_core_us = time_in_cuda_graph([lambda v=v, m=m: tensor_cores(v, m) for v, m in packed])
        check_against_float64("the sparse tensor cores", tensor_cores(values, mask), x, values, mask)
        if fused_us is not None and decode_call is fused_sparse_call:
            calls = [fused_sparse_call(layer, batch, v, m, tensor_cores=True) for v, m in packed]
            calls[0]()  # tunes its config for this fusion, outside the timing
            tensor_core_fused_us = time_in_cuda_graph(calls)
    del packed
    weights = [weight] + [weight.clone() for _ in range(copies_for(dense_bytes) - 1)]
    dense_us = time_in_cuda_graph([lambda w=w: F.linear(x, w) for w in weights])
    del weights
    row = dict(out=out_features, inp=in_features, batch=batch, pattern=pattern,
               sparse_us=sparse_us, fused_us=fused_us, dense_us=dense_us, speedup=dense_us / sparse_us,
               sparse_gbps=(sparse_bytes + io_bytes) / sparse_us / 1e3,
               dense_gbps=(dense_bytes + io_bytes) / dense_us / 1e3, sparse_bytes=sparse_bytes + io_bytes)
    if tensor_core_us is not None:
        row.update(tensor_core_us=tensor_core_us, tensor_core_speedup=dense_us / tensor_core_us,
                   tensor_core_config=mma_sp.spmv_2of4_config(x, mask, "fragments" if fragments else ""),
                   tensor_core_fused_us=tensor_core_fused_us)
        if tensor_core_fused_us is not None and has_prologue(layer):
            row["tensor_core_fused_config"] = mma_sp.spmv_2of4_config(
                x, mask, "norm" if DECODE_FUSION[layer].get("norm") else "gated")
    if batch <= spmv.MAX_ROWS:  # the configs the tuner picked (already timed: no tuning here)
        row["config"] = spmv.spmv_config(x, values, mask, linear.packs_x(x))
        if fused_us is not None and decode_call is fused_sparse_call:
            row["fused_config"] = spmv.spmv_config(x, values, mask, linear.packs_x(x), **{
                name: DECODE_FUSION[layer].get(name, False) for name in ("norm", "gated", "residual")})
    if batch > spmv.MAX_ROWS:
        expand_calls = [lambda: unpack_to_dense(values, mask)]
        row["expand_us"] = time_in_cuda_graph(expand_calls)
    if with_semi and pattern == "2:4":
        weight_24 = unpack_to_dense(values, mask)
        semi_us, semi_error = semi_structured_time(weight_24, x, copies_for(sparse_bytes))
        row["semi_us"], row["semi_error"] = semi_us, semi_error
        row["speedup_vs_semi"] = semi_us / sparse_us if semi_us else None
    return row


def sweep(shapes=SWEEP_SHAPES, batches=(1, 4, 16)) -> list:
    """Time every config the autotuner picks from (spmv.candidate_configs) on a few shapes, the
    autotuned choice and cuBLAS on the same shape."""
    rows = []
    for out_features, in_features in shapes:
        weight = random_weight(out_features, in_features)
        values, mask = pack(weight, "2:4")
        n_words = in_features // 32
        packed = [(values, mask)] + [(values.clone(), mask.clone())
                                     for _ in range(copies_for(values.numel() * 2 + mask.numel() * 4) - 1)]
        weights = [weight] + [weight.clone() for _ in range(copies_for(weight.numel() * 2) - 1)]
        for batch in batches:
            x = torch.randn(batch, in_features, device="cuda", dtype=torch.bfloat16)
            dense_us = time_in_cuda_graph([lambda w=w: F.linear(x, w) for w in weights], replays=7)
            rows.append(dict(out=out_features, inp=in_features, batch=batch, dense=True, us=dense_us))
            reference = F.linear(x.double(), unpack_to_dense(values, mask).double())
            for config in spmv.candidate_configs(out_features, n_words, batch):
                error = float((sparse_call(x, values, mask, config)().double() - reference).norm() / reference.norm())
                us = time_in_cuda_graph([sparse_call(x, v, m, config) for v, m in packed], replays=7)
                rows.append(dict(out=out_features, inp=in_features, batch=batch, config=config, us=us, error=error))
                print(f"{out_features}x{in_features} b{batch} {config}: {us:.1f} us, relative error {error:.1e}"
                      f"{'  WRONG' if not error < 1e-2 else ''}", flush=True)
            tuned = spmv.spmv_config(x, values, mask, linear.packs_x(x))
            rows.append(dict(out=out_features, inp=in_features, batch=batch, config=tuned, tuned=True,
                             us=time_in_cuda_graph([sparse_call(x, v, m) for v, m in packed])))
        del packed, values, mask, weights
    return rows


def sweep_summary(rows: list) -> str:
    """One line per (shape, batch): cuBLAS, the best correct config, the tuned one; then any config
    whose output was wrong."""
    best, dense, tuned, wrong = {}, {}, {}, []
    for r in rows:
        key = (r["out"], r["inp"], r["batch"])
        if r.get("dense"):
            dense[key] = r["us"]
        elif r.get("tuned"):
            tuned[key] = r
        elif not r.get("error", 0) < 1e-2:
            wrong.append(f"{key} {r['config']}: relative error {r.get('error')}")
        elif key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    lines = ["| out×in | batch | cuBLAS µs | best config | best µs | speedup | tuned config | tuned µs | speedup |",
             "|---|---|---|---|---|---|---|---|---|"]
    for key, b in best.items():
        t = tuned[key]
        lines.append(f"| {key[0]}×{key[1]} | {key[2]} | {dense[key]:.1f} | {b['config']} | {b['us']:.1f} | "
                     f"{dense[key] / b['us']:.2f}× | {t['config']} | {t['us']:.1f} | {dense[key] / t['us']:.2f}× |")
    lines += [f"WRONG (excluded): {w}" for w in wrong]
    return "\n".join(lines)


def parse_shapes(text: str) -> list:
    """"OUTxIN,OUTxIN" -> [(out, in), ...]; "all" -> the table's 16 shapes."""
    if text == "all":
        return [(o, i) for layers in SHAPES.values() for _, o, i in layers]
    return [tuple(int(n) for n in shape.split("x")) for shape in text.split(",")]


def ncu_targets(shapes, batch: int = 1, configs: list = None, kernel: str = None) -> list:
    """Launch a 2:4 kernel for each shape at `batch` rows, in its tuned config, once inside an NVTX
    range named after the kernel ("spmv", "spmm" or "mma_sp"; an inner range names shape, batch and
    config), for Nsight Compute to profile. `kernel` picks it; by default the one the route table's
    thresholds give (the SpMV, or from linear.spmm_min_rows the tensor-core SpMM), since the race
    that may pick the sparse tensor cores instead needs timing:

        ncu --clock-control none --nvtx --nvtx-include "spmv/" --set full --import-source yes -o REPORT \\
            python3 scripts/bench_kernel.py --ncu-shapes 4096x4096,28672x4096
        (--ncu-batch 8 and --nvtx-include "spmm/" for the SpMM; --ncu-kernel mma_sp, "mma_sp/")

    Compiles run outside the ranges, so ncu skips them. Tuning under ncu is no tuning: its launch
    interception made the SpMV's tuner pick other configs than the benchmark's on all three shapes
    (slower ones), so `configs` (the rows an earlier run without ncu wrote) gives each shape's tuned
    config instead."""
    kernel = kernel or ("spmm" if batch >= spmm_min_rows(two_of_four=True) else "spmv")
    given = {(r["out"], r["inp"], r["batch"], r["kernel"]): tuple(r["config"]) for r in configs or []}
    rows = []
    for out_features, in_features in shapes:
        values, mask = pack(random_weight(out_features, in_features), "2:4")
        x = torch.randn(batch, in_features, device="cuda", dtype=torch.bfloat16)
        config = given.get((out_features, in_features, batch, kernel))
        if configs is not None and config is None:
            sys.exit(f"--ncu-configs has no {kernel} config for {out_features}x{in_features} at batch {batch}")
        if kernel == "mma_sp":
            config = config or mma_sp.spmv_2of4_tuned(x, values, mask)
            launch = lambda: mma_sp.spmv_2of4(x, values, mask, config=config)  # noqa: E731
        elif kernel == "spmm":
            config = config or spmm.spmm_config(x, values, mask, two_of_four=True)
            launch = lambda: spmm.spmm(x, values, mask, config=config, two_of_four=True)  # noqa: E731
        else:
            config = config or spmv.spmv_config(x, values, mask)
            launch = lambda: spmv.spmv(x, values, mask, config)  # noqa: E731
        launch()  # compiled and warm before the profiled launch
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push(kernel)
        torch.cuda.nvtx.range_push(f"{out_features}x{in_features} b{batch} {config}")
        launch()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        torch.cuda.nvtx.range_pop()
        rows.append(dict(out=out_features, inp=in_features, batch=batch, kernel=kernel, config=config))
        print(f"ncu target {kernel} {out_features}x{in_features} b{batch} {config}", flush=True)
    return rows


def markdown_table(rows: list) -> str:
    peak_gbps = max(r["dense_gbps"] for r in rows)
    lines = [f"Floor = packed bytes (+ x, y) at {peak_gbps / 1e3:.2f} TB/s, the fastest cuBLAS read of this run. "
             "Times in µs per call inside a CUDA graph; speedup = cuBLAS time / sparse time; torch 2:4 is "
             "`to_sparse_semi_structured` + F.linear timed eagerly; fused µs: the same SpMV with the work a "
             "decode step gives it (RMSNorm before qkv/w13, silu·mul before w2, residual after o/w2; from "
             f"{linear.ROUTES.prologue_apart_from_rows} rows the prologue as its own Inductor kernel before the SpMV, "
             "as the step runs it); sparse TC: the same 2:4 weights on the sparse tensor cores (sparse/kernels/mma_sp.py, "
             "no fusions), x cuBLAS; "
             "TC fused µs: the same with the fusions of the SpMV's fused µs.", "",
             "| model | layer | out×in | batch | sparse µs | GB/s | floor µs | cuBLAS µs | speedup | fused µs | torch 2:4 µs | vs 2:4 "
             "| sparse TC µs (x cuBLAS) | TC fused µs |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        semi = f"{r['semi_us']:.1f}" if r.get("semi_us") else (r.get("semi_error") or "-")
        vs_semi = f"{r['speedup_vs_semi']:.2f}×" if r.get("speedup_vs_semi") else "-"
        floor_us = r["sparse_bytes"] / peak_gbps / 1e3
        fused = f"{r['fused_us']:.1f}" if r.get("fused_us") else "-"
        tensor_core = f"{r['tensor_core_us']:.1f} ({r['tensor_core_speedup']:.2f}×)" if r.get("tensor_core_us") else "-"
        tensor_core_fused = f"{r['tensor_core_fused_us']:.1f}" if r.get("tensor_core_fused_us") else "-"
        lines.append(f"| {r['model']} | {r['layer']} | {r['out']}×{r['inp']} | {r['batch']} | {r['sparse_us']:.1f} | "
                     f"{r['sparse_gbps']:.0f} | {floor_us:.1f} | {r['dense_us']:.1f} | {r['speedup']:.2f}× | "
                     f"{fused} | {semi} | {vs_semi} | {tensor_core} | {tensor_core_fused} |")
    return "\n".join(lines) + "\n"


def main():
    p = cli_args.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(SHAPES), help="comma-separated subset of " + ", ".join(SHAPES))
    p.add_argument("--batches", default=f"1,4,8,16,{PREFILL}")
    p.add_argument("--patterns", default="2:4")
    p.add_argument("--no-semi", action="store_true", help="skip torch's to_sparse_semi_structured")
    p.add_argument("--sweep", action="store_true", help="config sweep on a few shapes instead of the table")
    p.add_argument("--sweep-shapes", default=",".join(f"{o}x{i}" for o, i in SWEEP_SHAPES),
                   help="OUTxIN,... for --sweep, or 'all': the table's 16 shapes")
    p.add_argument("--sweep-batches", default="1,4,16", help="batch sizes for --sweep")
    p.add_argument("--ncu-shapes", help="OUTxIN,...: launch the tuned 2:4 kernel once each, for ncu")
    p.add_argument("--ncu-batch", type=int, default=1, help="rows of x for --ncu-shapes (the SpMM from 8)")
    p.add_argument("--ncu-kernel", choices=("spmv", "spmm", "mma_sp"),
                   help="the kernel --ncu-shapes launches (default: the SpMV, the SpMM from 8 rows)")
    p.add_argument("--ncu-configs", type=Path,
                   help="--out-json of an --ncu-shapes run outside ncu: launch its tuned configs, no tuning")
    p.add_argument("--unpack-sweep", help="OUTxIN,... or 'all': time the prefill's expansion kernels and configs")
    p.add_argument("--chain", help="MODEL,...: time the SpMV chain of a decode step (decode_chain) instead")
    p.add_argument("--pack-x", help="MODEL,...: x one row per register against bf16 pairs (pack_x_ab), at --batches")
    p.add_argument("--out-md", type=Path)
    p.add_argument("--out-json", type=Path)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernel.py needs a CUDA GPU")
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}", flush=True)
    if args.ncu_shapes:
        configs = json.loads(args.ncu_configs.read_text()) if args.ncu_configs else None
        rows = ncu_targets(parse_shapes(args.ncu_shapes), args.ncu_batch, configs, args.ncu_kernel)
        if args.out_json:
            args.out_json.write_text(json.dumps(rows, indent=1))
        return
    if args.unpack_sweep:
        shapes = parse_shapes(args.unpack_sweep)
        rows = unpack_sweep(shapes)
        if args.out_json:
            args.out_json.write_text(json.dumps(rows, indent=1))
        for out_features, in_features in shapes:
            mine = [r for r in rows if (r["out"], r["inp"]) == (out_features, in_features)]
            print(f"{out_features}x{in_features}: " + "  ".join(
                f"{tuple(r['config'])} {r['us']:.1f}" for r in sorted(mine, key=lambda r: r["us"])[:5]))
        return
    if args.pack_x:
        rows = pack_x_ab(args.pack_x.split(","), [int(b) for b in args.batches.split(",")])
        if args.out_json:
            args.out_json.write_text(json.dumps(rows, indent=1))
        if args.out_md:
            args.out_md.write_text(pack_x_summary(rows) + "\n")
        print(pack_x_summary(rows))
        return
    if args.chain:
        rows = [decode_chain(model) for model in args.chain.split(",")]
        for row in rows:
            print(f"{row['model']}: {row['layers']} layers of SpMVs, µs a step: "
                  f"{', '.join(f'{t:.1f}' for t in row['step_us'])}")
        if args.out_json:
            args.out_json.write_text(json.dumps(rows, indent=1))
        return
    if args.sweep:
        rows = sweep(parse_shapes(args.sweep_shapes), [int(b) for b in args.sweep_batches.split(",")])
        if args.out_json:
            args.out_json.write_text(json.dumps(rows, indent=1))
        summary = sweep_summary(rows)
        if args.out_md:
            args.out_md.write_text(summary + "\n")
        print(summary)
        return
    rows = []
    batches = [int(b) for b in args.batches.split(",")]
    for model in args.models.split(","):
        for layer, out_features, in_features in SHAPES[model]:
            for pattern in args.patterns.split(","):
                for batch in batches:
                    row = bench_shape(out_features, in_features, batch, pattern, not args.no_semi, layer)
                    rows.append(dict(model=model, layer=layer, **row))
                    print(f"{model} {layer} {out_features}x{in_features} {pattern} b{batch}: sparse {row['sparse_us']:.1f} "
                          f"fused {row['fused_us']} dense {row['dense_us']:.1f} -> {row['speedup']:.2f}x  semi {row.get('semi_us')} "
                          f"{row.get('semi_error') or ''}", flush=True)
                    torch.cuda.empty_cache()
                    # Written after every row: a run cut off by its time limit keeps what it measured.
                    if args.out_md:
                        args.out_md.write_text(markdown_table(rows))
                    if args.out_json:
                        args.out_json.write_text(json.dumps(rows, indent=1))
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
