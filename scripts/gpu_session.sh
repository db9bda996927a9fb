#!/usr/bin/env bash
# One device call that runs the named GPU jobs, spread over every visible GPU (one job per GPU at
# a time, each with its own time limit), and packs everything they wrote into ONE file,
# $OUT/results.tgz: the device tool brings back at most 8 files, and on 2026-11-29 a run lost its
# profiles to that limit. A summary of each job is printed last.
#
#   bash scripts/gpu_session.sh gpu_tests kernel_table decode_b1 decode_batches      # on nvidia-h200-x2: two at a time
#   DEADLINE_S=540 bash scripts/gpu_session.sh decode_b1 prune_8b
#
# Jobs (name: what, rough minutes on an idle H200 incl. compiles; bench_decode runs our dense and
# our sparse model in fresh processes of their own; the pytest jobs print each test's time, so one
# cut by its limit still says where the time went):
#   gpu_tests       pytest -m gpu over every module with GPU tests (far over one call's limit by now: run the
#                   parts below; the SpMV autotuner compiles per shape)
#   kernel_table    bench_kernel.py: the issue-3 table, 16 shapes x batch 1/4/8/16/2048 (~4)
#   kernel_table_b1_prefill  the same table at batch 1 and the 2048-token prefill only (~5)
#   kernel_table_b1  the same table at batch 1 only, without torch's 2:4 (~1)
#   prefill_slices  the sliced prefill's GPU tests, then bench_kernel.py's 2048-token prefill on every shape with the
#                   weight expanded whole (linear.PREFILL_SLICES 1) and in 4 slices on a second stream (~5)
#   unpack_sweep    bench_kernel.py --unpack-sweep all: the prefill's expansion to dense, kernels x configs (~2)
#   kernel_pack_x   bench_kernel.py --pack-x: x one row per register vs bf16 pairs, Llama-3.1-8B and Qwen3-14B
#                   shapes at 2, 4, 8, 16 rows, each autotuned, plain / fused / prologue apart, with cuBLAS
#                   and the SpMM (~6)
#   kernel_pack_x_b48  the same at 4 and 8 rows only, the rows where packing and the fused prologues are undecided (~3)
#   kernel_chain    bench_kernel.py --chain: a decode step's SpMVs back to back, no model compile, with the
#                   SpMV's programmatic dependent launch prefetching 16, 4 and 48 MB into the L2, then plain (~1.5)
#   pdl_gpu_tests   pytest -m gpu: the SpMV chain under PDL in a CUDA graph (each link's wait before its reads),
#                   a whole model's decode step, and the attention's GPU tests (it is a PDL launch too) (~4).
#                   If any fails, it sets kernels.PDL_L2_PREFETCH_BYTES = 0 in this tree for the rest of the
#                   call and says so (the jobs after it then time plain launches; bench_decode's rows record
#                   the budget they ran with), so put it first, on a one-GPU machine
#   decode_pdl_b14  Llama-3.1-8B 2:4 at batch 1 and 4 with --profile, one process each: this tree (PDL with the
#                   L2 prefetch, session 25) against plain launches (kernels.PDL_L2_PREFETCH_BYTES 0) (~6)
#   decode_tc_fused_b48  Llama-3.1-8B 2:4 at batch 4 and 8 with --profile, one process each: this tree against the
#                   prologues and residuals kept fused at 4-8 rows where the tensor cores may take the layer
#                   (linear.TENSOR_CORE_FUSES_BELOW_ROWS 9: the norm and silu·mul kernels gone) (~6)
#   kernel_sweep    bench_kernel.py --sweep on the Llama-3.1-8B and Qwen3-14B shapes at batch 1 and 4 (~4)
#   kernel_sweep_b1 the same sweep at batch 1 on all 16 shapes of the kernel table, with cuBLAS (~2)
#   kernel_sweep_batches  the sweep at batch 4, 8 and 16 on the four Llama-3.1-8B shapes (~2)
#   sparse_gpu_tests  pytest -m gpu over the sparse/ modules' tests only (> 9.5: 45 of its 67 tests in 570 s on
#                   2026-12-04, on a cold machine; the parts below fit a call)
#   spmv_gpu_tests  pytest -m gpu over the SpMV kernel's tests (test_sparse_kernels.py, every candidate config) only
#   decode_gpu_tests  pytest -m gpu over the SpMV, SparseLinear, decode attention and generate tests (~8.5 in session 20)
#   spmm_gpu_tests  pytest -m gpu over the tensor-core SpMM's tests (every tile shape with each K loop) (~3)
#   mma_sp_gpu_tests  mma_sp_layout_probe.py (which register layout the hardware's mma.sp reads: a table of
#                   hypotheses), then pytest -m gpu over the sparse tensor-core product's tests (sparse/mma_sp.py:
#                   mma.sp as inline PTX, every candidate config on three shapes at 1, 5, 8, 16 rows, and with
#                   each prologue fused (RMSNorm, silu·mul) at 1 and 3 rows on two) (2026-12-04, session 25:
#                   21 passed in 423 s, 438 s the job, the 40 candidates compiled one at a time; now each test
#                   compiles them all first on kernels.COMPILE_THREADS threads: ~3-4 predicted)
#   compile_time    scripts/compile_time.py on the device: the tensor-core product's 40 candidates and the SpMV's
#                   compiled one at a time against 4 and 16 threads (kernels.compile_all) (~1.5)
#   tc_route_gpu_tests  pytest -m gpu over SparseLinear's tensor-core route at 1, 3, 4, 8, 16 rows against float64,
#                   with each prologue at 1 and 3, and at 4 and 8 with TENSOR_CORE_FUSES_BELOW_ROWS 9 (each races
#                   the candidates first; 172 s in session 24 with 20 candidates and no prologue; ~7 now)
#   kernel_table_tc bench_kernel.py at batch 1, 4, 8, 16 without torch's 2:4: the issue-3 table with the sparse
#                   tensor-core column beside the SpMV/SpMM (2026-12-04: 357 s with 20 tensor-core candidates a
#                   shape; with 40 now, run it in halves:)
#   kernel_table_tc_b1, kernel_table_tc_b4, kernel_table_tc_b816  the same at batch 1 (with the tensor cores'
#                   fused norm/residual column), 4, and 8 and 16 (~4, ~3, ~6)
#   tuner_gpu_tests  pytest -m gpu over test_generate.py's device-clock tuning tests only: a compile with
#                   Inductor's tuner on the profiler's kernel times, before any decode job relies on it (~1)
#   attention_gpu_tests  pytest -m gpu over the decode attention, SparseLinear (the measured SpMV/SpMM
#                   route) and generate tests: decode_gpu_tests without the SpMV kernel's own (it took 8.4 min
#                   in session 20) (~4)
#   new_gpu_tests   only the GPU tests written in sessions 14-15 without a GPU: the SpMM's 2:4 nibble
#                   expansion, RoPE and the KV write inside the decode attention, its merge in the last split (~3)
#   load_probe      load_probe.py: the batch-1 SpMV's weight reads alone (its grid and loads, no arithmetic) in the
#                   packed layout and interleaved into one run a warp, and the SpMV without its bit scan (its
#                   loads and x's, the slices' sum, split-K where the config has it), and the packed reads with K
#                   split in two (half the warps a program: the whole-K grids' SM imbalance), beside the SpMV and
#                   cuBLAS, Llama-3.1-8B shapes and 5120x5120 (~1)
#   kernel_ncu      Nsight Compute (full set, SASS source page with stall samples) of the tuned batch-1
#                   SpMV on 4096x4096, 28672x4096 and 4096x14336, tuned in a run of its own first (tuned under
#                   ncu, the picks differed from the benchmark's on all three shapes, 2026-12-04) (~2)
#   spmm_ncu        kernel_ncu's profile of the tuned 2:4 SpMM at 8 rows (the batch-8 decode step's kernel) (~2)
#   attention_table bench_attention.py: the decode-attention kernel alone (RoPE and KV write inside), Llama-3.1-8B
#                   heads, batch 1/4/8/16, 768 and 4096 slots, over program targets, slots a block and the merge (~2)
#   attention_stages  the attention's GPU tests (the pipelined loop at 2 and 3 stages among them), then bench_attention.py
#                   at 64- and 128-slot blocks, 132 / 264 / 528 programs, PIPELINE_STAGES 1, 2, 3 (~4)
#   decode_pipeline_b148  Llama-3.1-8B 2:4 at batch 1, 4 and 8 with --profile, one process each: this tree (the
#                   attention's block loop pipelined, 2 stages, since session 19), then the plain loop (~6)
#   attention_ncu   Nsight Compute (full set, SASS with stall samples) of the attention's partial kernel at batch 8 (~2)
#   spmm            gpu_spmm_check.sh bench: tensor-core SpMM vs SpMV vs cuBLAS (~3)
#   decode_b1       Llama-3.1-8B dense + GPT-Fast (needs .gptfast carried) + 2:4..16:32, --profile (~7; GPT-Fast's
#                   first call took 116 s once its driver ran under no_grad, 2026-12-02 session 9; before, with
#                   autograd on, it outlasted 220 and 250 s)
#   decode_gptfast  Llama-3.1-8B our dense + GPT-Fast alone, GPT-Fast given 450 s (~4.5)
#   decode_b1_ours  the same without GPT-Fast, dense and 2:4 only (~4)
#   decode_sampling_b1  Llama-3.1-8B 2:4 at batch 1 with --profile, one process each: this tree (the vocabulary's
#                   argmax in 64 slices since session 17), the argmax in one piece (generate.ARGMAX_CHUNKS 0), and
#                   the top-k threshold in 64 slices too (generate.TOPK_CHUNKS); sampling costs dense the same (~5)
#   decode_output_code_b1  Llama-3.1-8B 2:4 at batch 1 with a fresh Inductor cache of its own, then keeps the compiled
#                   decode step's wrapper code (what launches what, and which small kernels run per layer: 16
#                   pointwise launches a step around the attention, ~24 µs, session 18) and drops the cache (~3)
#   decode_output_code_dense_b1  the same for dense, profiled (its 108 small copy launches a step before the attention
#                   took the model's buffers itself, session 19) (~3)
#   decode_b1_patterns  our dense and 4:8, 8:16, 16:32, each in a fresh process (~6)
#   decode_batches  Llama-3.1-8B dense and 2:4 at batch 4 and 8 (~8)
#   decode_prologue_ab_b1  Llama-3.1-8B 2:4 at batch 1, A/B in alternating fresh processes
#                   (decode_ab.sh): this tree against the prologue apart from 1 row (~5; each process
#                   takes ~2.3 min cold, ~50 s with the compile caches warm, so one cold call of 560 s
#                   holds 3 processes, not 4; measured 2026-12-03: apart costs 0.14 ms a step)
#   decode_prologue_ab_b23  the same at batch 2 and 3: this tree against the prologue apart from 2 rows (~5)
#   decode_attention_off_b48  Llama-3.1-8B 2:4 at batch 4 and 8 with --profile, one process each (decode_variants.sh):
#                   this tree, the SpMV at 8 rows (2:4 takes the SpMM from 8 since session 16), the attention's merge
#                   off, both attention fusions off (~8; the last variant did not fit one call, 2026-12-03)
#   decode_attention_programs_b48  Llama-3.1-8B dense and 2:4 at batch 4 and 8 with --profile: this tree, then
#                   the attention's grid aimed at 1056 programs instead of 264 (more, shorter splits) (~8)
#   decode_tc_b48   Llama-3.1-8B 2:4 at batch 4 and 8 with --profile, one process each: this tree (the sparse
#                   tensor cores race the SpMV/SpMM for every plain 2:4 matmul), then with linear.TENSOR_CORE_2OF4
#                   off (~5; 2026-12-04: 3.558 against 3.734 ms at batch 4)
#   decode_pending_b18  session 16's four untimed switches in one call: Llama-3.1-8B 2:4 at batch 1 and 8 with
#                   --profile, one process each: this tree, the SpMM's pairs prefetched, V loaded with K, the
#                   sliced top-k (with the sliced argmax, on since session 17) (~8; ran 2026-12-04)
#   decode_v_with_k_b148  Llama-3.1-8B 2:4 at batch 1, 4 and 8 with --profile, one process each: this tree, then the
#                   attention loading each block's V with its K (decode_attention.LOAD_V_WITH_K) (~6)
#   dense_spread    dense_spread.sh: our dense at batch 1 with --profile twice, each with a fresh Inductor cache,
#                   then once more in the first's cache directory (which tuned anew, 2026-12-04); each kernel's
#                   pick beside the time the tuner measured for it and its time in the step (3.4-7.7 on 2026-12-04)
#   dense_spread_short  the same with one fresh cache (run 1, then 1r): two processes, for when tuning takes longer
#   dense_spread_wide  the same with Inductor's coordinate descent searching wider (every direction, radius 2:
#                   generate.py's INDUCTOR_OPTIONS edited for the job); worth a run if dense_spread's picks show the
#                   slow process's search stopping at a config it measured slow (~5; 2026-12-04: they showed the
#                   tuner's timings mislead instead, so not run)
#   dense_spread_event_clock  the same with Inductor's tuner back on its CUDA-event timing of Python launches
#                   (generate.TUNE_ON_DEVICE_CLOCK off): the control for the device clock's effect on the spread (~5)
#   dense_placement dense_placement.py: our dense at batch 1 in ONE process, the weights moved to new memory four
#                   times with the compiled kernels kept (the CUDA graph re-recorded, tokens checked), then all of
#                   them in one allocation (~4)
#   decode_spmm_prefetch_b816  the SpMM's 2:4 value pairs loaded a K step ahead (spmm.PREFETCH_2OF4_PAIRS): its GPU
#                   test on the Llama shapes, then Llama-3.1-8B 2:4 at batch 8 and 16 with --profile, this tree
#                   against the prefetch on, one process each (~6)
#   decode_spmm_from4_b4  Llama-3.1-8B 2:4 at batch 4 with --profile: this tree (the SpMV) against the SpMM from 4
#                   rows (worth a run if the pipelined SpMM beats the SpMV's ~89 µs a layer at 8 rows) (~4)
#   decode_spmm_ab_b8  Llama-3.1-8B 2:4 at batch 8: this tree (the tensor-core SpMM from 8 rows for 2:4) against
#                   the SpMV at 8 rows, in alternating copies of the tree (decode_ab.sh) (~5)
#   decode_qwen3    Qwen3-8B and -14B, dense and 2:4, batch 1 (~9); Qwen3-32B is a job of its own:
#   decode_qwen3_32b  (profiled since session 20: the q/k norms' kernels should be gone from it)
#   prune_8b        bench_prune.py: SparseGPT 2:4, 262,144 decode tokens on Llama-3.1-8B (~7.5)
#   prune_1m_generate, then (next call) prune_1m_prune: the same at 1M decode tokens, which does not
#                   fit one 10-minute call (~8 + ~7): the first saves $JOB/calibration_1m.pt (in
#                   results.tgz); put it at runs/prune_1m_calibration.pt and carry that path to the second
#
# Lessons this encodes (2026-11-29): never `cmd | tail` (inductor's compile workers keep the pipe
# open past a timeout, and the output is lost); stdin from /dev/null; a hard per-job timeout
# under the call's limit; everything under $OUT in one tarball.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_session}
DEADLINE_S=${DEADLINE_S:-570}  # keep under the device call's own limit (600 s at most)
mkdir -p "$OUT/jobs"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-8}

# The shared head of each family of jobs; $JOB is expanded when a job runs.
DECODE="python3 scripts/bench_decode.py"
PRUNE_8B="python3 scripts/bench_prune.py --model Llama-3.1-8B --batch_size 128 --max_new_tokens 512 --prompt_lengths 64:512 --no_write --json \$JOB/bench_prune.json"
NO_MERGE="decode_attention.py:s/^MERGE_IN_LAST_SPLIT = True/MERGE_IN_LAST_SPLIT = False/"
NO_ROPE="decode_attention.py:s/^FUSE_ROPE_AND_CACHE_WRITE = True/FUSE_ROPE_AND_CACHE_WRITE = False/"
NO_SPMM8="sparse/linear.py:s/^SPMM_MIN_ROWS_2OF4 = 8/SPMM_MIN_ROWS_2OF4 = 9/"
PREFETCH_PAIRS="sparse/spmm.py:s/^PREFETCH_2OF4_PAIRS = False/PREFETCH_2OF4_PAIRS = True/"
SPMM_FROM4="sparse/linear.py:s/^SPMM_MIN_ROWS_2OF4 = 8/SPMM_MIN_ROWS_2OF4 = 4/"
ARGMAX_WHOLE="generate.py:s/^ARGMAX_CHUNKS = 64/ARGMAX_CHUNKS = 0/"
TOPK64="generate.py:s/^TOPK_CHUNKS = 0/TOPK_CHUNKS = 64/"
V_WITH_K="decode_attention.py:s/^LOAD_V_WITH_K = False/LOAD_V_WITH_K = True/"
NO_TENSOR_CORES="sparse/linear.py:s/^TENSOR_CORE_2OF4 = True/TENSOR_CORE_2OF4 = False/"
NO_PDL="sparse/kernels.py:s/^PDL_L2_PREFETCH_BYTES = 16 << 20/PDL_L2_PREFETCH_BYTES = 0/"
TC_FUSED="sparse/linear.py:s/^TENSOR_CORE_FUSES_BELOW_ROWS = 0/TENSOR_CORE_FUSES_BELOW_ROWS = 9/"
PLAIN_LOOP="decode_attention.py:s/^PIPELINE_STAGES = 2/PIPELINE_STAGES = 1/"
PROGRAMS1056="decode_attention.py:s/^PROGRAMS_TARGET = 264 /PROGRAMS_TARGET = 1056 /"
WIDE_COORDESC="generate.py:s/^INDUCTOR_OPTIONS = {/INDUCTOR_OPTIONS = {\x22coordinate_descent_check_all_directions\x22: True, \x22coordinate_descent_search_radius\x22: 2, /"
PYTEST_GPU="python3 -m pytest -v -o console_output_style=times -m gpu"  # each test's time printed
declare -A JOBS=(
  [gpu_tests]="$PYTEST_GPU tests"
  [prefill_slices]="$PYTEST_GPU tests/test_sparse_kernels.py -k prefill_matmul; for n in 1 4; do python3 scripts/bench_kernel.py --batches 2048 --no-semi --prefill-slices \$n --out-md \$JOB/slices\$n.md --out-json \$JOB/slices\$n.json; done"
  [kernel_table_b1_prefill]="python3 scripts/bench_kernel.py --batches 2048,1 --out-md \$JOB/table.md --out-json \$JOB/bench.json"
  [kernel_table_b1]="python3 scripts/bench_kernel.py --batches 1 --no-semi --out-md \$JOB/table.md --out-json \$JOB/bench.json"
  [unpack_sweep]="python3 scripts/bench_kernel.py --unpack-sweep all --out-json \$JOB/unpack.json"
  [kernel_pack_x]="python3 scripts/bench_kernel.py --pack-x Llama-3.1-8B,Qwen3-14B --batches 2,4,8,16 --out-md \$JOB/pack_x.md --out-json \$JOB/pack_x.json"
  [kernel_pack_x_b48]="python3 scripts/bench_kernel.py --pack-x Llama-3.1-8B,Qwen3-14B --batches 4,8 --out-md \$JOB/pack_x.md --out-json \$JOB/pack_x.json"
  [kernel_chain]="python3 scripts/bench_kernel.py --chain Llama-3.1-8B,Qwen3-14B --pdl-l2-mb 16,4,48,0 --out-json \$JOB/chain.json"
  [pdl_gpu_tests]="{ $PYTEST_GPU tests/test_sparse_kernels.py -k 'pdl or decode_step' && $PYTEST_GPU tests/test_decode_attention.py; } || { sed -i '${NO_PDL#*:}' ${NO_PDL%%:*} && echo 'pdl_gpu_tests failed: PDL_L2_PREFETCH_BYTES = 0 for the rest of this call'; }"
  [decode_tc_fused_b48]="OUT=\$JOB bash scripts/decode_variants.sh 1 'base=' 'tc_fused=$TC_FUSED' -- --models Llama-3.1-8B --patterns 2:4 --batch_sizes 4,8 --profile"
  [decode_pdl_b14]="OUT=\$JOB bash scripts/decode_variants.sh 1 'base=' 'no_pdl=$NO_PDL' -- --models Llama-3.1-8B --patterns 2:4 --batch_sizes 1,4 --profile"
  [kernel_table]="python3 scripts/bench_kernel.py --out-md \$JOB/table.md --out-json \$JOB/bench.json"
  [kernel_sweep]="python3 scripts/bench_kernel.py --sweep --sweep-shapes 6144x4096,4096x4096,28672x4096,4096x14336,7168x5120,5120x5120,34816x5120,5120x17408 --sweep-batches 1,4 --out-json \$JOB/sweep.json"
  [kernel_sweep_b1]="python3 scripts/bench_kernel.py --sweep --sweep-shapes all --sweep-batches 1 --out-json \$JOB/sweep.json --out-md \$JOB/sweep.md"
  [kernel_sweep_batches]="python3 scripts/bench_kernel.py --sweep --sweep-shapes 6144x4096,4096x4096,28672x4096,4096x14336 --sweep-batches 4,8,16 --out-json \$JOB/sweep.json --out-md \$JOB/sweep.md"
  [sparse_gpu_tests]="$PYTEST_GPU tests/test_sparse_kernels.py tests/test_sparse_linear.py tests/test_sparse_spmm.py"
  [spmv_gpu_tests]="$PYTEST_GPU tests/test_sparse_kernels.py"
  [new_gpu_tests]="$PYTEST_GPU tests/test_sparse_spmm.py tests/test_decode_attention.py -k 'llama_shape or model_decode_matches_sdpa'"
  [spmm_gpu_tests]="$PYTEST_GPU tests/test_sparse_spmm.py"
  [mma_sp_gpu_tests]="python3 scripts/mma_sp_layout_probe.py; $PYTEST_GPU tests/test_mma_sp_layout_probe.py tests/test_sparse_mma_sp.py"
  [compile_time]="python3 scripts/compile_time.py --threads 1,4,16 --out-json \$JOB/compile_time.json"
  [tc_route_gpu_tests]="$PYTEST_GPU tests/test_sparse_linear.py -k 'tensor_core or hardware'"
  [kernel_table_tc]="python3 scripts/bench_kernel.py --batches 1,4,8,16 --no-semi --out-md \$JOB/table.md --out-json \$JOB/bench.json"
  [kernel_table_tc_b1]="python3 scripts/bench_kernel.py --batches 1 --no-semi --out-md \$JOB/table.md --out-json \$JOB/bench.json"
  [kernel_table_tc_b4]="python3 scripts/bench_kernel.py --batches 4 --no-semi --out-md \$JOB/table.md --out-json \$JOB/bench.json"
  [kernel_table_tc_b816]="python3 scripts/bench_kernel.py --batches 8,16 --no-semi --out-md \$JOB/table.md --out-json \$JOB/bench.json"
  [tuner_gpu_tests]="$PYTEST_GPU tests/test_generate.py -k device_clock"
  [attention_gpu_tests]="$PYTEST_GPU tests/test_decode_attention.py tests/test_sparse_linear.py tests/test_generate.py"
  [decode_gpu_tests]="$PYTEST_GPU tests/test_sparse_kernels.py tests/test_sparse_linear.py tests/test_decode_attention.py tests/test_generate.py"
  [load_probe]="python3 scripts/load_probe.py --shapes 6144x4096,4096x4096,28672x4096,4096x14336,5120x5120 > \$JOB/load_probe.md; cat \$JOB/load_probe.md"
  [kernel_ncu]="python3 scripts/bench_kernel.py --ncu-shapes 4096x4096,28672x4096,4096x14336 --out-json \$JOB/tuned.json && ncu --clock-control none --nvtx --nvtx-include 'spmv/' --set full --import-source yes -o \$JOB/spmv python3 scripts/bench_kernel.py --ncu-shapes 4096x4096,28672x4096,4096x14336 --ncu-configs \$JOB/tuned.json --out-json \$JOB/targets.json && ncu -i \$JOB/spmv.ncu-rep --page details --csv > \$JOB/details.csv && ncu -i \$JOB/spmv.ncu-rep --page source --print-source sass --csv > \$JOB/source_sass.csv"
  [spmm_ncu]="python3 scripts/bench_kernel.py --ncu-shapes 4096x4096,28672x4096,4096x14336 --ncu-batch 8 --out-json \$JOB/tuned.json && ncu --clock-control none --nvtx --nvtx-include 'spmm/' --set full --import-source yes -o \$JOB/spmm python3 scripts/bench_kernel.py --ncu-shapes 4096x4096,28672x4096,4096x14336 --ncu-batch 8 --ncu-configs \$JOB/tuned.json --out-json \$JOB/targets.json && ncu -i \$JOB/spmm.ncu-rep --page details --csv > \$JOB/details.csv && ncu -i \$JOB/spmm.ncu-rep --page source --print-source sass --csv > \$JOB/source_sass.csv"
  [attention_table]="python3 scripts/bench_attention.py --out-md \$JOB/attention.md --out-json \$JOB/attention.json"
  [attention_stages]="$PYTEST_GPU tests/test_decode_attention.py; python3 scripts/bench_attention.py --targets 132,264,528 --blocks 64,128 --v-with-k 0 --stages 1,2,3 --out-md \$JOB/attention.md --out-json \$JOB/attention.json"
  [decode_pipeline_b148]="OUT=\$JOB bash scripts/decode_variants.sh 1 'base=' 'plain_loop=$PLAIN_LOOP' -- --models Llama-3.1-8B --patterns 2:4 --batch_sizes 1,4,8 --profile"
  [attention_ncu]="ncu --clock-control none --kernel-name regex:_partial_attention_kernel --launch-count 3 --set full --import-source yes -o \$JOB/attention python3 scripts/bench_attention.py --batches 8 --slots 768 --targets 264 --blocks 64 && ncu -i \$JOB/attention.ncu-rep --page details --csv > \$JOB/details.csv && ncu -i \$JOB/attention.ncu-rep --page source --print-source sass --csv > \$JOB/source_sass.csv"
  [spmm]="env OUT=\$JOB bash scripts/gpu_spmm_check.sh bench"
  [decode_b1]="env GPTFAST_PROFILE=\$JOB/profile_gptfast.txt $DECODE --models Llama-3.1-8B --patterns dense,2:4,4:8,8:16,16:32 --batch_sizes 1 --profile --gptfast .gptfast --gptfast_timeout_s 240 --out \$JOB"
  [decode_gptfast]="$DECODE --models Llama-3.1-8B --patterns dense --batch_sizes 1 --gptfast .gptfast --gptfast_timeout_s 450 --out \$JOB"
  [decode_b1_ours]="$DECODE --models Llama-3.1-8B --patterns dense,2:4 --batch_sizes 1 --profile --out \$JOB"
  [decode_sampling_b1]="OUT=\$JOB bash scripts/decode_variants.sh 1 'base=' 'argmax_whole=$ARGMAX_WHOLE' 'topk64=$TOPK64' -- --models Llama-3.1-8B --patterns 2:4 --batch_sizes 1 --profile"
  [decode_output_code_b1]="TORCHINDUCTOR_CACHE_DIR=\$JOB/inductor $DECODE --models Llama-3.1-8B --patterns 2:4 --batch_sizes 1 --same_process --out \$JOB; grep -rl --include='*.py' 'def call(' \$JOB/inductor | xargs -r cp -t \$JOB/ ; rm -rf \$JOB/inductor"
  [decode_output_code_dense_b1]="TORCHINDUCTOR_CACHE_DIR=\$JOB/inductor $DECODE --models Llama-3.1-8B --patterns dense --batch_sizes 1 --same_process --profile --out \$JOB; grep -rl --include='*.py' 'def call(' \$JOB/inductor | xargs -r cp -t \$JOB/ ; rm -rf \$JOB/inductor"
  [decode_b1_patterns]="$DECODE --models Llama-3.1-8B --patterns dense,4:8,8:16,16:32 --batch_sizes 1 --out \$JOB"
  [decode_prologue_ab_b1]="OUT=\$JOB bash scripts/decode_ab.sh 'sparse/linear.py:s/^PROLOGUE_APART_MIN_ROWS = 4/PROLOGUE_APART_MIN_ROWS = 1/' 1 1 -- --models Llama-3.1-8B --patterns 2:4"
  [decode_attention_off_b48]="OUT=\$JOB bash scripts/decode_variants.sh 1 'on=' 'spmv8=$NO_SPMM8' 'no_merge=$NO_MERGE' 'off=$NO_MERGE;$NO_ROPE' -- --models Llama-3.1-8B --patterns 2:4 --batch_sizes 4,8 --profile"
  [decode_attention_programs_b48]="OUT=\$JOB bash scripts/decode_variants.sh 1 'base=' 'programs1056=$PROGRAMS1056' -- --models Llama-3.1-8B --patterns dense,2:4 --batch_sizes 4,8 --profile"
  [decode_tc_b48]="OUT=\$JOB bash scripts/decode_variants.sh 1 'base=' 'no_tc=$NO_TENSOR_CORES' -- --models Llama-3.1-8B --patterns 2:4 --batch_sizes 4,8 --profile"
  [decode_pending_b18]="OUT=\$JOB bash scripts/decode_variants.sh 1 'base=' 'prefetch=$PREFETCH_PAIRS' 'v_with_k=$V_WITH_K' 'sampling=$TOPK64' -- --models Llama-3.1-8B --patterns 2:4 --batch_sizes 1,8 --profile"
  [decode_v_with_k_b148]="OUT=\$JOB bash scripts/decode_variants.sh 1 'base=' 'v_with_k=$V_WITH_K' -- --models Llama-3.1-8B --patterns 2:4 --batch_sizes 1,4,8 --profile"
  [dense_spread]="OUT=\$JOB bash scripts/dense_spread.sh 2"
  [dense_spread_short]="OUT=\$JOB bash scripts/dense_spread.sh 1"
  [dense_spread_wide]="VARIANT='$WIDE_COORDESC' OUT=\$JOB bash scripts/dense_spread.sh 2"
  [dense_spread_event_clock]="VARIANT='generate.py:s/^TUNE_ON_DEVICE_CLOCK = True/TUNE_ON_DEVICE_CLOCK = False/' OUT=\$JOB bash scripts/dense_spread.sh 2"
  [dense_placement]="python3 scripts/dense_placement.py --placements 4 --arena --out \$JOB"
  [decode_spmm_from4_b4]="OUT=\$JOB bash scripts/decode_variants.sh 1 'base=' 'spmm_from4=$SPMM_FROM4' -- --models Llama-3.1-8B --patterns 2:4 --batch_sizes 4 --profile"
  [decode_spmm_prefetch_b816]="$PYTEST_GPU tests/test_sparse_spmm.py -k 'llama_shapes and prefetched'; OUT=\$JOB bash scripts/decode_variants.sh 1 'base=' 'prefetch=$PREFETCH_PAIRS' -- --models Llama-3.1-8B --patterns 2:4 --batch_sizes 8,16 --profile"
  [decode_spmm_ab_b8]="OUT=\$JOB bash scripts/decode_ab.sh '$NO_SPMM8' 1 8 -- --models Llama-3.1-8B --patterns 2:4"
  [decode_prologue_ab_b23]="OUT=\$JOB bash scripts/decode_ab.sh 'sparse/linear.py:s/^PROLOGUE_APART_MIN_ROWS = 4/PROLOGUE_APART_MIN_ROWS = 2/' 1 2,3 -- --models Llama-3.1-8B --patterns 2:4"
  [decode_batches]="$DECODE --models Llama-3.1-8B --patterns dense,2:4 --batch_sizes 4,8 --deadline_s 500 --out \$JOB"
  [decode_qwen3]="$DECODE --models Qwen3-8B,Qwen3-14B --patterns dense,2:4 --batch_sizes 1 --out \$JOB"
  [decode_qwen3_32b]="$DECODE --models Qwen3-32B --patterns dense,2:4 --batch_sizes 1 --deadline_s 500 --profile --out \$JOB"
  [prune_8b]="$PRUNE_8B --tokens 262144"
  [prune_1m_generate]="$PRUNE_8B --tokens 1000000 --calibration \$JOB/calibration_1m.pt"
  [prune_1m_prune]="$PRUNE_8B --tokens 1000000 --calibration runs/prune_1m_calibration.pt"
)

jobs=("$@")
[[ ${#jobs[@]} -gt 0 ]] || { echo "usage: $0 JOB... (jobs: ${!JOBS[*]})"; exit 2; }
for job in "${jobs[@]}"; do
  [[ -n "${JOBS[$job]:-}" ]] || { echo "unknown job '$job' (jobs: ${!JOBS[*]})"; exit 2; }
done

{ date -u; nvidia-smi --query-gpu=index,name,clocks.sm,clocks.mem,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  # The device's copy of .git may lag the working tree it was sent, so also fingerprint the code:
  # compare with `LC_ALL=C; cat sparse/*.py decode_attention.py model.py generate.py | sha1sum` of a
  # commit (the locale orders the glob: sparse/__init__.py first only in the C locale).
  git log -1 --format='commit %h %s (of the copied .git; see the code hash)' 2>/dev/null
  (export LC_ALL=C; echo "code hash $(cat sparse/*.py decode_attention.py model.py generate.py | sha1sum | cut -c1-12)")
} > "$OUT/environment.txt" 2>&1
cat "$OUT/environment.txt"
gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
start=$SECONDS

run_queue() {  # GPU $1 runs jobs $1, $1 + gpus, ... one after another until the deadline
  local gpu=$1 i job left
  for ((i = gpu; i < ${#jobs[@]}; i += gpus)); do
    job=${jobs[$i]}
    left=$((DEADLINE_S - (SECONDS - start)))
    if ((left < 20)); then echo "skipped: past the deadline" > "$OUT/jobs/$job.log"; continue; fi
    mkdir -p "$OUT/jobs/$job"
    echo "[gpu $gpu] $job (limit ${left}s): ${JOBS[$job]}" > "$OUT/jobs/$job.log"
    JOB="$OUT/jobs/$job" CUDA_VISIBLE_DEVICES=$gpu timeout -k 5 "$left" \
      bash -c "${JOBS[$job]}" >> "$OUT/jobs/$job.log" 2>&1 < /dev/null
    echo "[gpu $gpu] $job: exit $? after $((SECONDS - start))s" >> "$OUT/jobs/$job.log"
  done
}
for ((gpu = 0; gpu < gpus; gpu++)); do run_queue "$gpu" & done
wait

tar czf "$OUT/results.tgz" -C "$OUT" environment.txt jobs
for job in "${jobs[@]}"; do
  echo "=== $job"
  grep -hE "passed|failed|error|Error|tok_s|median_step_ms|exit [0-9]+ after|skipped: past" "$OUT/jobs/$job.log" | cut -c1-300 | tail -8
  for table in "$OUT/jobs/$job"/*.md; do
    [[ -f $table ]] || continue  # a job without a table must not turn the call's status to 1
    grep "^|" "$table" | cut -c1-220
  done
done
exit 0
