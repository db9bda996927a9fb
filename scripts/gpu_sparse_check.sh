#!/usr/bin/env bash
# One device call for the sparse kernels: GPU tests, the compiled kernels' report (registers,
# spills, SASS), the config sweep and the full benchmark table. Stages: tests report sweep bench
# (default: all four). Details go to $OUT (the device tool's output folder) or ./runs/gpu_check:
# check.log (everything printed), spmv_*.sass, sweep.json, bench.json, table.md.
#   bash scripts/gpu_sparse_check.sh tests report sweep bench
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
stages=${*:-tests report sweep bench}
exec > >(tee "$OUT/check.log") 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

for stage in $stages; do
  case $stage in
  tests)
    python3 -m pytest -q -m gpu tests/test_sparse_linear.py 2>&1 | tail -15 ;;
  report)
    python3 - "$OUT" <<'PY' 
import sys, torch
from sparse import kernels
from sparse.format import pack
values, mask = pack(torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16), "2:4")
for batch in (1, 4, 16):
    kernels.spmv(torch.randn(batch, 4096, device="cuda", dtype=torch.bfloat16), values, mask)
torch.cuda.synchronize()
for cache in kernels._spmv_kernel.device_caches.values():
    for key, compiled in cache[0].items():
        c = compiled.metadata
        print(f"{str(key)[:160]}\n  warps={c.num_warps} regs={compiled.n_regs} spills={compiled.n_spills} shared={c.shared}")
        try:
            sass = compiled.asm["sass"]
            path = f"{sys.argv[1]}/spmv_{len(sass)}.sass"
            open(path, "w").write(sass)
            print("  sass ->", path)
        except Exception as e:
            print("  no sass:", e)
PY
    ;;
  sweep)
    python3 scripts/bench_kernel.py --sweep --out-json "$OUT/sweep.json" ;;
  bench)
    python3 scripts/bench_kernel.py --out-md "$OUT/table.md" --out-json "$OUT/bench.json" ;;
  esac
done
