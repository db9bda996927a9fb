#!/usr/bin/env bash
# Is the dense engine's process-to-process spread (4.48-5.53 ms a Llama-3.1-8B step at batch 1,
# 64-79 % of the copy bandwidth, docs/BENCHMARKS.md) Inductor's tuning? Runs our dense model at
# batch 1 with --profile in N fresh processes, each with an Inductor cache of its own (so each
# tunes its GEMV reductions anew, as the first process on a fresh machine does), then once more
# reusing run 1's cache directory (run 1r). Keeps the configs each cache holds (the *.best_config
# files coordinate descent leaves there), each with the name of the kernel it tuned
# (scripts/inductor_picks.py), so a pick can be set beside that kernel's time in the profile.
# Run 1r was meant to keep run 1's picks; on 2026-12-04 it tuned anew instead (22 of 29 picks
# changed; docs/BENCHMARKS.md session 18), so it is one more sample, not a control. The control
# for "same picks, other speed" is dense_placement.py (one process, weights moved, kernels kept).
#   usage: OUT=dir scripts/dense_spread.sh [N]     (~2.3 min a process on an H200)
set -uo pipefail
n=${1:-2}
mkdir -p "$OUT"

dense_run() {  # dense_run LABEL CACHE_DIR
  TORCHINDUCTOR_CACHE_DIR=$2 python3 scripts/bench_decode.py --models Llama-3.1-8B --patterns dense \
    --batch_sizes 1 --profile --out "$OUT/run$1" > "$OUT/run$1.log" 2>&1 || echo "run $1: exit $?"
  python3 scripts/inductor_picks.py "$2" > "$OUT/best_configs_$1.txt"
  # On 2026-12-04 the picks file named no kernel twice ("?" on all 20-23), though Inductor records
  # the Triton cache directory's own name (runtime_utils.triton_hash_to_path_key): keep where
  # the compiled kernels and the picks really lie, to mend inductor_picks.py from.
  (echo "TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-unset}"; cd "$2" && find . -maxdepth 4 | sort | head -200) > "$OUT/cache_layout_$1.txt"
  echo "run $1: $(grep -ho 'median_step_ms[^,]*' "$OUT/run$1"/*.json 2>/dev/null) $(wc -l < "$OUT/best_configs_$1.txt") tuned kernels"
}

caches=()
for ((i = 1; i <= n; i++)); do
  caches+=("$(mktemp -d)")
  dense_run "$i" "${caches[-1]}"
done
dense_run 1r "${caches[0]}"
rm -rf "${caches[@]}"
# Run 1r shares run 1's cache, so its count is 0 unless it tuned anew (the cache was not reused).
for run in $(seq 2 "$n") 1r; do
  echo "kernels tuned differently in run 1 and run $run: $(diff "$OUT/best_configs_1.txt" "$OUT/best_configs_$run.txt" | grep -c '^<')"
done
