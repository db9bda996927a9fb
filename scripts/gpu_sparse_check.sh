#!/usr/bin/env bash
# One device call for the sparse kernels: GPU tests, the compiled kernels' report (registers,
# spills, SASS), the config sweep, the full benchmark table, and a probe of the fixed cost of one
# SpMV call. Stages: tests report sweep bench probe (default: the first four). Details go to $OUT (the device tool's output folder) or ./runs/gpu_check:
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
    python3 -m pytest -q -m gpu tests/test_sparse_linear.py tests/test_generate.py 2>&1 | tail -15 ;;
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
  probe)  # fixed cost: a 1-word matrix (launch + first loads + epilogue) against 4096x4096
    python3 - <<'PY'
import sys, torch
sys.path.insert(0, "scripts")
from bench_kernel import time_per_call, random_weight
from sparse import kernels
from sparse.format import pack
x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
for n_in, configs in [(32, [(1, 4, 1), (2, 4, 1)]), (128, [(2, 4, 1), (2, 4, 2), (2, 4, 4)]),
                      (4096, [(2, 4, 32), (2, 4, 16), (1, 4, 32), (4, 4, 8)])]:
    copies = [pack(random_weight(4096, n_in), "2:4") for _ in range(10 if n_in == 4096 else 4)]  # 10 x 19 MB misses L2
    for config in configs:
        us = time_per_call([lambda v=v, m=m: kernels.spmv(x[:, :n_in], v, m, config) for v, m in copies])
        print(f"probe 4096x{n_in} config {config}: {us:.2f} us")
PY
    ;;
  sweep)
    python3 scripts/bench_kernel.py --sweep --out-json "$OUT/sweep.json" ;;
  bench)
    python3 scripts/bench_kernel.py --out-md "$OUT/table.md" --out-json "$OUT/bench.json" ;;
  esac
done
