#!/usr/bin/env bash
# Is the dense engine's process-to-process spread (4.48-5.21 ms a Llama-3.1-8B step at batch 1,
# 68-79 % of the copy bandwidth, docs/BENCHMARKS.md) Inductor's tuning? Runs our dense model N
# times, each in a fresh process with an Inductor cache of its own (so each tunes its GEMV
# reductions anew, as the first process on a fresh machine does), and keeps the configs each
# picked (the *.best_config files coordinate descent leaves in the cache). Same picks with
# different times: not the tuning; different picks tracking the times: the tuning.
#   usage: OUT=dir scripts/dense_spread.sh [N]     (~2.3 min a process on an H200)
set -uo pipefail
n=${1:-3}
for ((i = 1; i <= n; i++)); do
  cache=$(mktemp -d)
  TORCHINDUCTOR_CACHE_DIR=$cache python3 scripts/bench_decode.py --models Llama-3.1-8B --patterns dense \
    --batch_sizes 1 --out "$OUT/run$i" > "$OUT/run$i.log" 2>&1 || echo "run $i: exit $?"
  python3 - "$cache" > "$OUT/best_configs_$i.txt" <<'PY'
import json, pathlib, sys
# One line per tuned kernel: its cache key (a hash of the kernel's source, the same in every
# process) and the config picked, without the fields that differ even for the same pick.
for path in sorted(pathlib.Path(sys.argv[1]).rglob("*.best_config")):
    picked = {k: v for k, v in json.loads(path.read_text()).items()
              if k not in ("time_taken_ms", "triton_cache_hash", "configs_hash")}
    print(path.name, json.dumps(picked, sort_keys=True))
PY
  rm -rf "$cache"
  echo "run $i: $(grep -ho 'median_step_ms[^,]*' "$OUT/run$i"/*.json 2>/dev/null) $(wc -l < "$OUT/best_configs_$i.txt") tuned kernels"
done
for ((i = 2; i <= n; i++)); do
  echo "kernels tuned differently in run 1 and run $i: $(diff "$OUT/best_configs_1.txt" "$OUT/best_configs_$i.txt" | grep -c '^<')"
done
