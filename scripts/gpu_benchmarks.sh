#!/usr/bin/env bash
# Reproduces every number in docs/BENCHMARKS.md (and runs the GPU tests) on a CUDA machine.
#
#   bash scripts/gpu_benchmarks.sh                        # every section
#   bash scripts/gpu_benchmarks.sh kernel_b1 decode_b1    # the named sections
#   bash scripts/gpu_benchmarks.sh tests                  # a prefix runs every section it begins: tests_*
#   bash scripts/gpu_benchmarks.sh --list                 # the sections, one a line
#   bash scripts/gpu_benchmarks.sh --print decode_b1      # a section's commands, without running them
#
# Each section runs plain commands with a hard time limit (SECTION_LIMIT_S, default 570: one fits
# a 10-minute call of a rented device), writes into $OUT/<section>/ (its log: $OUT/<section>.log),
# and no section starts after DEADLINE_S seconds (default: no deadline). On a machine of several
# GPUs the sections are spread over them, one section per GPU at a time; a section named *_tp2* takes
# GPUs 0 and 1 (tensor parallel), and a run that includes one runs its sections one at a time.
# Everything is packed into $OUT/results.tgz (OUT defaults to runs/gpu_benchmarks), then a summary is printed.
# decode_b1 also times GPT-Fast when a copy of it sits in .gptfast (gptfast_decode_driver.py says how).
# WHEELS=DIR first installs the wheels in DIR (no index, no dependencies) into a temporary folder on
# PYTHONPATH: test references a machine lacks (lm-eval and dill for tests_engine's adapter tests).
#
# Lessons kept here:
# - Never pipe a benchmark into `tail`: Inductor's compile workers keep the pipe open past a timeout and the output is lost.
# - Every command reads stdin from /dev/null, so none can wait for input.
# - Every section has a hard timeout (`timeout -k`) under the device call's own limit.
# - One tarball under $OUT: a device call brings back only a few files.
set -u
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
PYTEST="$PYTHON -m pytest -v -o console_output_style=times -m gpu"  # each test's time, so a cut run says where it went
GPTFAST=.gptfast

SECTIONS=(tests_spmv tests_spmm tests_mma_sp tests_linear tests_engine tests_tp2
          kernel_b1 kernel_b4 kernel_b816 kernel_prefill kernel_chain attention
          decode_b1 decode_batches decode_b16 decode_qwen3 decode_qwen3_32b dense_spread prune prune_1m
          tp70b_dense_tp2_b1 tp70b_dense_tp2_b8 tp70b_2of4_b1 tp70b_2of4_b8 tp70b_2of4_tp2_b1 tp70b_2of4_tp2_b8)

# The GPU tests in parts that each fit one section; tests_engine takes every module the others do not.
tests_spmv() { $PYTEST tests/test_sparse_kernels_spmv.py; }
tests_spmm() { $PYTEST tests/test_sparse_kernels_spmm.py; }
tests_mma_sp() { $PYTEST tests/test_sparse_kernels_mma_sp.py; }
tests_linear() { $PYTEST tests/test_sparse_linear.py; }
tests_engine() {
  $PYTEST tests --ignore=tests/test_sparse_kernels_spmv.py --ignore=tests/test_sparse_kernels_spmm.py \
    --ignore=tests/test_sparse_kernels_mma_sp.py --ignore=tests/test_sparse_linear.py --ignore=tests/test_tp.py
}
tests_tp2() { $PYTEST tests/test_tp.py; }  # tensor parallel over two GPUs

# The sparse kernels against cuBLAS on every linear shape of the four models ("Sparse kernel").
kernel_b1() { $PYTHON scripts/bench_kernel.py --batches 1 --out-md "$JOB/table.md" --out-json "$JOB/table.json"; }
kernel_b4() { $PYTHON scripts/bench_kernel.py --batches 4 --no-semi --out-md "$JOB/table.md" --out-json "$JOB/table.json"; }
kernel_b816() {
  $PYTHON scripts/bench_kernel.py --batches 8,16 --no-semi --out-md "$JOB/table.md" --out-json "$JOB/table.json"
}
kernel_prefill() {
  $PYTHON scripts/bench_kernel.py --batches 2048 --no-semi --out-md "$JOB/table.md" --out-json "$JOB/table.json"
}
# A decode step's SpMVs back to back in one CUDA graph (against their share of a profiled step).
kernel_chain() { $PYTHON scripts/bench_kernel.py --chain Llama-3.1-8B,Qwen3-14B --out-json "$JOB/chain.json"; }
# The decode-attention kernel alone.
attention() { $PYTHON scripts/bench_attention.py --out-md "$JOB/attention.md" --out-json "$JOB/attention.json"; }

# End-to-end decode through generate(), each model in a fresh process ("Dense and end-to-end decode").
# bench_decode starts nothing new after STOP_S (4/5 of the section's limit), so it writes its tables in time.
decode_b1() {
  local gptfast=()
  [[ -f $GPTFAST/generate.py ]] && gptfast=(--gptfast "$GPTFAST" --gptfast_timeout_s 240)
  GPTFAST_PROFILE="$JOB/profile_gptfast.txt" $PYTHON scripts/bench_decode.py --models Llama-3.1-8B \
    --patterns dense,2:4,4:8,8:16,16:32 --batch_sizes 1 --profile "${gptfast[@]}" --deadline_s "$STOP_S" --out "$JOB"
}
decode_batches() {
  $PYTHON scripts/bench_decode.py --models Llama-3.1-8B --patterns dense,2:4 --batch_sizes 4,8 \
    --deadline_s "$STOP_S" --out "$JOB"
}
decode_b16() {
  $PYTHON scripts/bench_decode.py --models Llama-3.1-8B --patterns dense,2:4 --batch_sizes 16 \
    --deadline_s "$STOP_S" --out "$JOB"
}
decode_qwen3() {
  $PYTHON scripts/bench_decode.py --models Qwen3-8B,Qwen3-14B --patterns dense,2:4 --batch_sizes 1 \
    --deadline_s "$STOP_S" --out "$JOB"
}
decode_qwen3_32b() {
  $PYTHON scripts/bench_decode.py --models Qwen3-32B --patterns dense,2:4 --batch_sizes 1 --deadline_s "$STOP_S" --out "$JOB"
}
# Our dense decode in three fresh processes, each tuning Inductor's kernels anew in a cache of its own.
dense_spread() {
  local run cache
  for run in 1 2 3; do
    cache=$(mktemp -d)
    TORCHINDUCTOR_CACHE_DIR=$cache $PYTHON scripts/bench_decode.py --models Llama-3.1-8B --patterns dense \
      --batch_sizes 1 --out "$JOB/run$run"
    rm -rf "$cache"
  done
}

# A Llama-3.3-70B-shaped model ("Tensor parallel"): dense over two GPUs (141 GB does not fit one), 2:4 on
# one GPU, 2:4 over two; a 512-token prompt, batch 1 and 8, one section each (a 70B compile takes minutes).
TORCHRUN2="-m torch.distributed.run --standalone --nproc_per_node=2"
tp70b_dense_tp2_b1() {
  $PYTHON $TORCHRUN2 scripts/bench_decode.py --models Llama-3.3-70B --patterns dense --batch_sizes 1 \
    --prompt_length 512 --deadline_s "$STOP_S" --out "$JOB"
}
tp70b_dense_tp2_b8() {
  $PYTHON $TORCHRUN2 scripts/bench_decode.py --models Llama-3.3-70B --patterns dense --batch_sizes 8 \
    --prompt_length 512 --deadline_s "$STOP_S" --out "$JOB"
}
tp70b_2of4_b1() {
  $PYTHON scripts/bench_decode.py --models Llama-3.3-70B --patterns 2:4 --batch_sizes 1 \
    --prompt_length 512 --deadline_s "$STOP_S" --out "$JOB"
}
tp70b_2of4_b8() {
  $PYTHON scripts/bench_decode.py --models Llama-3.3-70B --patterns 2:4 --batch_sizes 8 \
    --prompt_length 512 --deadline_s "$STOP_S" --out "$JOB"
}
tp70b_2of4_tp2_b1() {
  $PYTHON $TORCHRUN2 scripts/bench_decode.py --models Llama-3.3-70B --patterns 2:4 --batch_sizes 1 \
    --prompt_length 512 --deadline_s "$STOP_S" --out "$JOB"
}
tp70b_2of4_tp2_b8() {
  $PYTHON $TORCHRUN2 scripts/bench_decode.py --models Llama-3.3-70B --patterns 2:4 --batch_sizes 8 \
    --prompt_length 512 --deadline_s "$STOP_S" --out "$JOB"
}

# SparseGPT 2:4 of a Llama-3.1-8B-shaped model calibrated on its own decoding ("Pruning").
prune() {
  $PYTHON scripts/bench_prune.py --model Llama-3.1-8B --batch_size 128 --max_new_tokens 512 --prompt_lengths 64:512 \
    --tokens 262144 --no_write --json "$JOB/bench_prune.json"
}
# The same at 1M decode tokens, longer than one device call: the first run generates and saves the
# calibration under runs/ (kept on the machine, or carried), the same command again loads it and prunes.
prune_1m() {
  $PYTHON scripts/bench_prune.py --model Llama-3.1-8B --batch_size 128 --max_new_tokens 512 --prompt_lengths 64:512 \
    --tokens 1000000 --calibration runs/prune_1m_calibration.pt --no_write --json "$JOB/bench_prune.json"
}

usage() { echo "usage: $0 [--list | --print SECTION... | SECTION...]; sections: ${SECTIONS[*]}"; }

# The sections the arguments name: a section by its name, or every section NAME_* (`tests`, `kernel`).
chosen=()
select_sections() {
  local name section matches
  for name in "$@"; do
    matches=()
    for section in "${SECTIONS[@]}"; do
      [[ $section == "$name" ]] && matches=("$section") && break
      [[ $section == "${name}_"* ]] && matches+=("$section")
    done
    ((${#matches[@]})) || { echo "unknown section '$name'" >&2; usage >&2; exit 2; }
    chosen+=("${matches[@]}")
  done
}

case ${1:-} in
  --list) printf '%s\n' "${SECTIONS[@]}"; exit 0 ;;
  --print)
    shift
    select_sections "$@"
    for section in "${chosen[@]}"; do declare -f "$section"; done
    exit 0 ;;
  --run) select_sections "$2"; JOB=$3 STOP_S=$(($4 * 4 / 5)) "${chosen[0]}"; exit $? ;;  # in the process `timeout` limits
  -h | --help) usage; exit 0 ;;
  -*) usage >&2; exit 2 ;;
esac
if (($# == 0)); then chosen=("${SECTIONS[@]}"); else select_sections "$@"; fi

OUT=${OUT:-runs/gpu_benchmarks}
SECTION_LIMIT_S=${SECTION_LIMIT_S:-570}
DEADLINE_S=${DEADLINE_S:-}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-8}

{ date -u
  nvidia-smi --query-gpu=index,name,clocks.sm,clocks.mem,driver_version --format=csv,noheader
  $PYTHON -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git log -1 --format='commit %h %s' 2>/dev/null
  git status --short 2>/dev/null | head -20  # a tree sent to the device may differ from its commit
} > "$OUT/environment.txt" 2>&1 < /dev/null
cat "$OUT/environment.txt"
if [[ -n ${WHEELS:-} ]]; then
  site=$(mktemp -d)
  $PYTHON -m pip install -q --no-index --no-deps --no-compile --target "$site" "$WHEELS"/*.whl < /dev/null ||
    { echo "WHEELS=$WHEELS: the wheels did not install" >&2; exit 2; }
  export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
fi
gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)
((gpus > 0)) || gpus=1
for section in "${chosen[@]}"; do [[ $section == *_tp2* ]] && gpus=1; done  # it needs GPUs 0 and 1 to itself
start=$SECONDS

run_queue() {  # GPU $1 runs sections $1, $1 + gpus, ... one after another
  local gpu=$1 i section limit log
  for ((i = gpu; i < ${#chosen[@]}; i += gpus)); do
    section=${chosen[$i]} log="$OUT/${chosen[$i]}.log" limit=$SECTION_LIMIT_S visible=$gpu
    mkdir -p "$OUT/$section"
    if [[ -n $DEADLINE_S ]]; then
      limit=$((DEADLINE_S - (SECONDS - start) < limit ? DEADLINE_S - (SECONDS - start) : limit))
      if ((limit < 20)); then echo "skipped: past DEADLINE_S" > "$log"; continue; fi
    fi
    [[ $section == *_tp2* ]] && visible=0,1
    echo "[gpu $visible] $section (limit ${limit}s)" > "$log"
    CUDA_VISIBLE_DEVICES=$visible timeout -k 5 "$limit" bash "$0" --run "$section" "$OUT/$section" "$limit" >> "$log" 2>&1 < /dev/null
    echo "[gpu $gpu] $section: exit $? after $((SECONDS - start))s" >> "$log"
  done
}
for ((gpu = 0; gpu < gpus; gpu++)); do run_queue "$gpu" & done
wait

tar czf "$OUT/results.tgz" -C "$OUT" environment.txt "${chosen[@]/%/.log}" "${chosen[@]}"
for section in "${chosen[@]}"; do
  echo "=== $section"
  grep -hE "passed|failed|error|Error|exit [0-9]+ after|skipped: past" "$OUT/$section.log" | cut -c1-300 | tail -n 8
  for table in "$OUT/$section"/*.md "$OUT/$section"/*/*.md; do
    [[ -f $table ]] && grep "^|" "$table" | cut -c1-220
  done
done
exit 0
