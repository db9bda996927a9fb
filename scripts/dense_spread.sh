#!/usr/bin/env bash
# Is the dense engine's process-to-process spread (4.24-5.53 ms a Llama-3.1-8B step at batch 1,
# 64-84 % of the copy bandwidth, docs/BENCHMARKS.md) Inductor's tuning? Runs our dense model at
# batch 1 with --profile in N fresh processes, each with an Inductor cache of its own (so each
# tunes its GEMV reductions anew, as the first process on a fresh machine does), then once more
# reusing run 1's cache directory (run 1r; on 2026-12-04 it tuned anew each time, so it is one
# more sample, not a control; the control for "same picks, other speed" is dense_placement.py).
# Each run logs Inductor's coordinate-descent searches (TORCH_LOGS), and picks_N.txt sets each
# kernel's pick, the time the tuner measured for it, and its time a call in the step side by side
# (scripts/inductor_picks.py): whether a slow process's slow kernel also measured slow while tuning.
# (2026-12-04: all picks but one measured above their time in the step, the small ones by 20-45 µs:
# the launch was timed, not the kernel; generate.py now times the tuner on the device clock,
# TUNE_ON_DEVICE_CLOCK.)
# VARIANT='FILE:SED' (optional): every process runs with this edit made to the tree, restored on
# exit, e.g. a wider coordinate-descent search in generate.py's INDUCTOR_OPTIONS (gpu_session.sh
# dense_spread_wide).
#   usage: [VARIANT='FILE:SED'] OUT=dir scripts/dense_spread.sh [N]     (1.1-2.6 min a process on an H200, 2026-12-04)
set -uo pipefail
n=${1:-2}
mkdir -p "$OUT"
if [[ -n ${VARIANT:-} ]]; then
  edited=${VARIANT%%:*} expr=${VARIANT#*:}
  original=$(mktemp)
  cp "$edited" "$original"
  trap 'cp "$original" "$edited"; rm -f "$original"' EXIT
  trap 'exit 143' TERM INT  # a job's timeout: exit through the EXIT trap, so the tree is restored
  sed -i "$expr" "$edited"
  if cmp -s "$edited" "$original"; then echo "dense_spread: '$expr' changed nothing in $edited" >&2; exit 2; fi
fi

dense_run() {  # dense_run LABEL CACHE_DIR
  TORCHINDUCTOR_CACHE_DIR=$2 TORCH_LOGS=+torch._inductor.runtime.coordinate_descent_tuner \
    python3 scripts/bench_decode.py --models Llama-3.1-8B --patterns dense --batch_sizes 1 --profile \
    --out "$OUT/run$1" > "$OUT/run$1.log" 2>&1 || echo "run $1: exit $?"
  python3 scripts/inductor_picks.py "$OUT/run$1.log" "$OUT/run$1"/profile_*dense_b1.txt > "$OUT/picks_$1.txt"
  echo "run $1: $(grep -ho 'median_step_ms[^,]*' "$OUT/run$1"/*.json 2>/dev/null) $(grep -c ' | tuned ' "$OUT/picks_$1.txt") tuned kernels"
}

caches=()
for ((i = 1; i <= n; i++)); do
  caches+=("$(mktemp -d)")
  dense_run "$i" "${caches[-1]}"
done
dense_run 1r "${caches[0]}"
rm -rf "${caches[@]}"
# Picks that differ from run 1's (kernel and config columns), per run.
for run in $(seq 2 "$n") 1r; do
  echo "kernels picked differently in run 1 and run $run: $(diff <(cut -d'|' -f1,4 "$OUT/picks_1.txt" | sort) \
    <(cut -d'|' -f1,4 "$OUT/picks_$run.txt" | sort) | grep -c '^<')"
done
