#!/usr/bin/env bash
# End-to-end A/B of a code constant: bench_decode.py in alternating fresh processes, A on this tree,
# B on a copy of it edited by sed expressions; one process per (variant, batch) and round, so
# compile and tuning luck lands on both sides. Output under $OUT/{A,B}_b<batch>_r<round>/.
#   usage: OUT=dir scripts/decode_ab.sh 'FILE:SED_EXPR;FILE:SED_EXPR' ROUNDS BATCHES -- bench_decode args
#   e.g.   OUT=/tmp/ab scripts/decode_ab.sh 'sparse/linear.py:s/^PROLOGUE_APART_MIN_ROWS = 4/PROLOGUE_APART_MIN_ROWS = 1/' \
#              1 1,2 -- --models Llama-3.1-8B --patterns 2:4   (gpu_session.sh has such jobs)
set -euo pipefail
edits=$1 rounds=$2 batches=$3; shift 4
tree_b=$(mktemp -d); trap 'rm -rf "$tree_b"' EXIT
tar cf - --exclude=.git --exclude=.venv . | tar xf - -C "$tree_b"
IFS=';' read -ra pairs <<< "$edits"
for pair in "${pairs[@]}"; do
  file=${pair%%:*} expr=${pair#*:}
  before=$(sha1sum < "$tree_b/$file")
  sed -i "$expr" "$tree_b/$file"
  [[ $(sha1sum < "$tree_b/$file") != "$before" ]] || { echo "decode_ab: '$expr' changed nothing in $file" >&2; exit 2; }
  echo "B: $file: $expr"
done
IFS=',' read -ra batch_list <<< "$batches"
for ((round = 1; round <= rounds; round++)); do
  for batch in "${batch_list[@]}"; do
    for variant in A B; do
      tree=.; [[ $variant == B ]] && tree=$tree_b
      out="$OUT/${variant}_b${batch}_r${round}"; mkdir -p "$out"
      (cd "$tree" && python3 scripts/bench_decode.py "$@" --batch_sizes "$batch" --out "$out") > "$out/log.txt" 2>&1 \
        || echo "$variant batch $batch round $round: exit $?"
      echo "$variant batch $batch round $round: $(grep -ho 'median_step_ms[^,]*' "$out"/*.json 2>/dev/null | tr '\n' ' ')"
    done
  done
done
