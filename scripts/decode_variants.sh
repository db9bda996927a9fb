#!/usr/bin/env bash
# End-to-end timing of code variants in one tree: bench_decode.py in a fresh process per variant
# and round, the variants in turn (A, B, C, A, B, C, ...), each edited by sed expressions on top
# of the files as they were. Unlike decode_ab.sh it edits this tree in place (restored on exit),
# so that every variant shares this tree's Inductor and Triton caches (decode_ab.sh's copy has
# caches of its own: cold compiles on both sides).
#   usage: OUT=dir scripts/decode_variants.sh ROUNDS 'LABEL=FILE:SED;FILE:SED' ... -- bench_decode args
#   e.g.   OUT=/tmp/v scripts/decode_variants.sh 2 'on=' 'no_merge=decode_attention.py:s/^MERGE_IN_LAST_SPLIT = True/MERGE_IN_LAST_SPLIT = False/' \
#              -- --models Llama-3.1-8B --patterns 2:4 --batch_sizes 1
set -euo pipefail
rounds=$1; shift
variants=()
while [[ $1 != -- ]]; do variants+=("$1"); shift; done
shift
backup=$(mktemp -d)
files=$(for v in "${variants[@]}"; do spec=${v#*=}; IFS=';' read -ra pairs <<< "$spec"
          for pair in "${pairs[@]}"; do [[ -n $pair ]] && echo "${pair%%:*}"; done; done | sort -u)
for file in $files; do mkdir -p "$backup/$(dirname "$file")"; cp "$file" "$backup/$file"; done
originals() { for file in $files; do cp "$backup/$file" "$file"; done; }
trap 'originals; rm -rf "$backup"' EXIT
for ((round = 1; round <= rounds; round++)); do
  for v in "${variants[@]}"; do
    label=${v%%=*} spec=${v#*=}
    originals
    IFS=';' read -ra pairs <<< "$spec"
    for pair in "${pairs[@]}"; do
      [[ -n $pair ]] || continue
      file=${pair%%:*} expr=${pair#*:}
      before=$(sha1sum < "$file"); sed -i "$expr" "$file"
      [[ $(sha1sum < "$file") != "$before" ]] || { echo "decode_variants: '$expr' changed nothing in $file" >&2; exit 2; }
    done
    out="$OUT/${label}_r${round}"; mkdir -p "$out"
    python3 scripts/bench_decode.py "$@" --out "$out" > "$out/log.txt" 2>&1 || echo "$label round $round: exit $?"
    echo "$label round $round: $(grep -ho 'median_step_ms[^,]*' "$out"/*.json 2>/dev/null | tr '\n' ' ')"
  done
done
