#!/usr/bin/env bash
# One device call for the decode benchmark: our dense Llama-3.1-8B decode (generate.py --compile
# path, batch 1) and GPT-Fast's own dense decode of the same shape, side by side; then, if time is
# left, one quick sparse pattern. Needs .gptfast/ (gpt-fast's files + decode_driver.py) carried.
#   OUT=runs/check bash scripts/gpu_decode_check.sh
# Knobs: BATCH_SIZES (1); DEADLINE_S (start nothing new after this, default 230); GPTFAST_TIMEOUT_S
# (420: its first compile alone took over 147 s on a fresh machine); SPARSE (2:4; "" = none);
# SPARSE_IF_BEFORE_S (run the sparse pattern only if this little time has passed, default 170).
set -uo pipefail
OUT=${OUT:-runs/gpu_decode_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
start=$SECONDS
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used,temperature.gpu --format=csv 2>&1 | tee "$OUT/nvidia_smi.txt"
python3 scripts/bench_decode.py --models Llama-3.1-8B --patterns dense --batch_sizes "${BATCH_SIZES:-1}" \
    --gptfast .gptfast --gptfast_timeout_s "${GPTFAST_TIMEOUT_S:-420}" --deadline_s "${DEADLINE_S:-230}" --out "$OUT/dense" 2>&1 | tee "$OUT/dense_log.txt"
if [[ -n "${SPARSE-2:4}" ]] && (( SECONDS - start < ${SPARSE_IF_BEFORE_S:-170} )); then
    python3 scripts/bench_decode.py --models Llama-3.1-8B --patterns "${SPARSE-2:4}" --batch_sizes 1 \
        --deadline_s 1 --out "$OUT/sparse" 2>&1 | tee "$OUT/sparse_log.txt"
fi
cat "$OUT"/dense/bench_decode.md "$OUT"/sparse/bench_decode.md 2>/dev/null
echo "total ${SECONDS}s"
