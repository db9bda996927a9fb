#!/usr/bin/env bash
# One device call for the tensor-core SpMM (sparse/spmm.py): its GPU tests, timings on the
# Llama-3.1-8B shapes at batch 4/8/16 and a 2048-token prefill against kernels.spmv, the
# prefill's expand + cuBLAS and cuBLAS bf16 F.linear, for 2:4 both expansions (gather; nibble:
# spmm.EXPAND_2OF4_BY_NIBBLE, and up to 16 rows nibble with spmm.PREFETCH_2OF4_PAIRS), and the
# registers/spills of every compiled SpMM variant. Details go to $OUT (the device tool's output
# folder) or ./runs/gpu_spmm: check.log, pytest.log, spmm_bench.json, spmm_*.sass; the table is
# printed last. Stages: tests bench (default both); the whole call takes ~3-4 min, mostly compiling
# and autotuning. (Session 14 fixed the bench's imports, helpers bench_kernel.py no longer has,
# without a GPU to run it on.)
#   bash scripts/gpu_spmm_check.sh [tests] [bench]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_spmm}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
stages=${*:-tests bench}
exec > >(tee "$OUT/check.log") 2>&1
date -u
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

# Into a file, not a pipe: on 2026-11-29 a `pytest | tail` here outlived its timeout, most likely
# because inductor's compile workers kept the pipe open; the call ran out of time before the bench.
export TORCHINDUCTOR_COMPILE_THREADS=1
if [[ " $stages " == *" tests "* ]]; then
  timeout -k 10 100 python3 -m pytest -q -m gpu tests/test_sparse_spmm.py > "$OUT/pytest.log" 2>&1
  tail -8 "$OUT/pytest.log"
fi
[[ " $stages " == *" bench "* ]] || exit 0

python3 - "$OUT" <<'PY'
import json, sys, torch
import torch.nn.functional as F
sys.path.insert(0, "scripts")
from bench_kernel import random_weight
from sparse import kernels, spmm
from sparse.format import pack

out_dir = sys.argv[1]
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
rows = []
for out_features, in_features in SHAPES:
    weight = random_weight(out_features, in_features)
    dense_copies = [weight] + [weight.clone() for _ in range(kernels.copies_for(weight.numel() * 2) - 1)]
    for pattern in ("2:4", "16:32"):
        values, mask = pack(weight, pattern)
        packed = [(values, mask)] + [(values.clone(), mask.clone())
                                     for _ in range(kernels.copies_for(values.numel() * 2 + mask.numel() * 4) - 1)]
        for batch in (4, 8, 16, 2048):
            if pattern == "16:32" and batch != 16:  # the gathers' L1 locality depends on the pattern
                continue
            x = torch.randn(batch, in_features, device="cuda", dtype=torch.bfloat16)
            row = dict(out=out_features, inp=in_features, pattern=pattern, batch=batch,
                       config=spmm.spmm_config(x, values, mask))
            row["spmm_us"] = kernels.time_in_cuda_graph([lambda v=v, m=m: spmm.spmm(x, v, m) for v, m in packed])
            if pattern == "2:4":  # the nibble expansion (spmm.EXPAND_2OF4_BY_NIBBLE), checked, then timed
                default, spmm.EXPAND_2OF4_BY_NIBBLE = spmm.EXPAND_2OF4_BY_NIBBLE, True
                reference = x.double() @ kernels.unpack_to_dense(values, mask).double().T
                error = float((spmm.spmm(x, values, mask, two_of_four=True).double() - reference).norm() / reference.norm())
                assert error < 1e-2, f"nibble SpMM wrong on {out_features}x{in_features} b{batch}: {error:.2e}"
                row["nibble_config"] = spmm.spmm_config(x, values, mask, two_of_four=True)
                row["spmm_nibble_us"] = kernels.time_in_cuda_graph(
                    [lambda v=v, m=m: spmm.spmm(x, v, m, two_of_four=True) for v, m in packed])
                if batch <= kernels.MAX_SPMV_BATCH:  # and with the pairs loaded a step ahead (tuned apart)
                    prefetch, spmm.PREFETCH_2OF4_PAIRS = spmm.PREFETCH_2OF4_PAIRS, True
                    row["prefetch_config"] = spmm.spmm_config(x, values, mask, two_of_four=True)
                    row["spmm_prefetch_us"] = kernels.time_in_cuda_graph(
                        [lambda v=v, m=m: spmm.spmm(x, v, m, two_of_four=True) for v, m in packed])
                    spmm.PREFETCH_2OF4_PAIRS = prefetch
                spmm.EXPAND_2OF4_BY_NIBBLE = default
            if batch <= kernels.MAX_SPMV_BATCH:
                row["spmv_us"] = kernels.time_in_cuda_graph([lambda v=v, m=m: kernels.spmv(x, v, m) for v, m in packed])
            else:
                row["expand_cublas_us"] = kernels.time_in_cuda_graph(
                    [lambda v=v, m=m: F.linear(x, kernels.unpack_to_dense(v, m)) for v, m in packed])
            if pattern == "2:4":
                row["dense_us"] = kernels.time_in_cuda_graph([lambda w=w: F.linear(x, w) for w in dense_copies])
            print(row, flush=True)
            rows.append(row)
            json.dump(rows, open(f"{out_dir}/spmm_bench.json", "w"), indent=1)
        del packed
    del dense_copies
    torch.cuda.empty_cache()
print("\ncompiled SpMM variants:")
for cache in spmm._spmm_kernel.device_caches.values():
    for key, compiled in cache[0].items():
        c = compiled.metadata
        print(f"  {str(key)[-120:]}\n    warps={c.num_warps} regs={compiled.n_regs} spills={compiled.n_spills} shared={c.shared}")
        try:
            sass = compiled.asm["sass"]
            open(f"{out_dir}/spmm_{c.num_warps}w_{len(sass)}.sass", "w").write(sass)
        except Exception as e:
            print("    no sass:", e)

dense = {(r["out"], r["inp"], r["batch"]): r["dense_us"] for r in rows if "dense_us" in r}
print("\n| out×in | pattern | batch | SpMM µs | config | 2:4 nibble SpMM µs | nibble, pairs prefetched µs | SpMV µs | expand+cuBLAS µs | cuBLAS µs | SpMM speedup | nibble SpMM speedup | prefetched speedup | SpMV (b<=16) or expand+cuBLAS speedup |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    d = dense[(r["out"], r["inp"], r["batch"])]
    other = r.get("spmv_us") or r.get("expand_cublas_us")
    nibble = r.get("spmm_nibble_us", float("nan"))
    prefetched = r.get("spmm_prefetch_us", float("nan"))
    print(f"| {r['out']}×{r['inp']} | {r['pattern']} | {r['batch']} | {r['spmm_us']:.1f} | {r['config']} | "
          f"{nibble:.1f} | {prefetched:.1f} | {r.get('spmv_us', float('nan')):.1f} | "
          f"{r.get('expand_cublas_us', float('nan')):.1f} | {d:.1f} | {d / r['spmm_us']:.2f}× | {d / nibble:.2f}× | "
          f"{d / prefetched:.2f}× | {d / other:.2f}× |")
PY
