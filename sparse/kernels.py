"""Triton kernels for the N:M bitmask format (layout: see sparse/format.py).

- `spmv`: y = x @ W.T for 1..16 rows of x. Threads own output rows; the loop walks the mask
  words k and, per word, a fixed number of steps (nnz per word, a constexpr): take the lowest
  set bit, gather x at that column (all lanes of a warp hit the same 32-column chunk), multiply
  by the next stored value, clear the bit. Words go in steps of a few (a constexpr): the masks
  and values of a whole step are loaded as register tiles one step ahead, so a program waits
  for memory once per step, not once per word. Split-K over programs adds fp32 partial sums into a workspace with
  atomics; the last program of a row block to arrive casts the sum to the output dtype and
  zeroes the workspace again, so one launch does everything and the workspace is always clean
  for the next call. Tile, warps, split and words per step are autotuned per (out, in, batch).
- `unpack_to_dense`: expands (values, mask) into a dense weight for the prefill path
  (decompress + cuBLAS).

`INTERPRETER_SAFE` (a constexpr) keeps inline PTX out so the same source runs under
TRITON_INTERPRET=1 on CPU; the safe bit scan takes the lowest set bit's index from the float32
exponent of (w & -w), which is exact for a power of two. Measurements and SASS counts behind
these choices: docs/KERNEL_NOTES.md.
"""
import os

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
MAX_SPMV_BATCH = 16


@triton.jit
def _prepare_word(word, INTERPRETER_SAFE: tl.constexpr):
    """int32 mask word -> the uint32 form `_pop_next_column` scans (bit-reversed on the fast path)."""
    word = word.to(tl.uint32, bitcast=True)
    if not INTERPRETER_SAFE:
        word = tl.inline_asm_elementwise("brev.b32 $0, $1;", "=r,r", [word], dtype=tl.uint32, is_pure=True, pack=1)
    return word


@triton.jit
def _pop_next_column(word, INTERPRETER_SAFE: tl.constexpr):
    """Column of the lowest set bit of the original word, and the word with that bit cleared.

    Fast path: the word is bit-reversed, so the lowest column is the highest set bit and
    `bfind.shiftamt` (one FLO instruction) returns its column directly; clearing it is a shift
    and an xor. Safe path: isolate the lowest bit (w & -w); for a power of two the float32
    exponent is exactly the bit index.
    """
    if INTERPRETER_SAFE:
        lowest = word & (0 - word)
        column = (lowest.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127
        word = word ^ lowest
    else:
        column = tl.inline_asm_elementwise("bfind.shiftamt.u32 $0, $1;", "=r,r", [word],
                                           dtype=tl.int32, is_pure=True, pack=1)
        word = word ^ (tl.full(word.shape, 0x80000000, tl.uint32) >> column.to(tl.uint32))
    return column, word


@triton.jit
def _gather_lanes(pairs_ptr, pair_stride, LANES: tl.constexpr):
    """x[column, 0:LANES] for every row, as float32 [rows, LANES] held in each thread's registers.

    x is laid out pair-major, (LANES/2, in) int64 with two float32 lanes per element, so at one
    step every lane of a warp reads the same 256-byte chunk (2 cache lines) whatever its column.
    Lanes are put side by side with join/permute/reshape, which only relabel registers; a plain
    2-D gather makes Triton pick a layout that differs from the rows' and shuffle through shared
    memory.
    """
    if LANES == 2:
        bits = tl.load(pairs_ptr, cache_modifier=".ca")
        low = bits.to(tl.uint32).to(tl.float32, bitcast=True)
        high = (bits >> 32).to(tl.uint32).to(tl.float32, bitcast=True)
        lanes = tl.join(low, high)
    else:
        low = _gather_lanes(pairs_ptr, pair_stride, LANES // 2)
        high = _gather_lanes(pairs_ptr + (LANES // 4) * pair_stride, pair_stride, LANES // 2)
        lanes = tl.reshape(tl.permute(tl.join(low, high), (0, 2, 1)), (low.shape[0], LANES))
    return lanes


@triton.jit
def _load_word_values(ptrs, row_ok, n_rows, STEPS: tl.constexpr):
    """The STEPS values of one word for every row, as a register tile built by tl.join (first
    half, second half) so `_multiply_word` can take it apart again with tl.split, for free."""
    if STEPS == 1:
        tile = tl.load(ptrs, mask=row_ok, other=0.0, cache_modifier=".cg")
    else:
        first = _load_word_values(ptrs, row_ok, n_rows, STEPS // 2)
        second = _load_word_values(ptrs + (STEPS // 2) * n_rows, row_ok, n_rows, STEPS // 2)
        tile = tl.join(first, second)
    return tile


@triton.jit
def _multiply_word(acc, tile, word, x_chunk, x_pair_stride, STEPS: tl.constexpr, BATCH: tl.constexpr,
                   INTERPRETER_SAFE: tl.constexpr):
    """acc += value * x[column] over the word's kept columns, lowest first (fixed trip count)."""
    if STEPS == 1:
        column, word = _pop_next_column(word, INTERPRETER_SAFE)
        if BATCH == 1:
            x = tl.load((x_chunk + column)[:, None], cache_modifier=".ca").to(tl.float32)
        else:
            x = _gather_lanes(x_chunk + column, x_pair_stride, BATCH)
        acc += tile.to(tl.float32)[:, None] * x
    else:
        first, second = tl.split(tile)
        acc, word = _multiply_word(acc, first, word, x_chunk, x_pair_stride, STEPS // 2, BATCH, INTERPRETER_SAFE)
        acc, word = _multiply_word(acc, second, word, x_chunk, x_pair_stride, STEPS // 2, BATCH, INTERPRETER_SAFE)
    return acc, word


@triton.jit
def _load_masks(mask_ptr, k, n_words, rows, row_ok, n_rows, WORDS: tl.constexpr):
    """Mask words k .. k+WORDS-1 of every row, joined into one register tile (see _load_word_values).

    Words past the end read as all ones: the scan then stays inside a real chunk of x, and
    their values read as zero."""
    if WORDS == 1:
        tile = tl.load(mask_ptr + k * n_rows + rows, mask=row_ok & (k < n_words), other=-1, cache_modifier=".cg")
    else:
        tile = tl.join(_load_masks(mask_ptr, k, n_words, rows, row_ok, n_rows, WORDS // 2),
                       _load_masks(mask_ptr, k + WORDS // 2, n_words, rows, row_ok, n_rows, WORDS // 2))
    return tile


@triton.jit
def _load_values(values_ptr, k, n_words, rows, row_ok, n_rows, NNZ_PER_WORD: tl.constexpr, WORDS: tl.constexpr):
    """The values of words k .. k+WORDS-1 of every row, as one register tile."""
    if WORDS == 1:
        tile = _load_word_values(values_ptr + k * NNZ_PER_WORD * n_rows + rows, row_ok & (k < n_words), n_rows,
                                 NNZ_PER_WORD)
    else:
        tile = tl.join(_load_values(values_ptr, k, n_words, rows, row_ok, n_rows, NNZ_PER_WORD, WORDS // 2),
                       _load_values(values_ptr, k + WORDS // 2, n_words, rows, row_ok, n_rows, NNZ_PER_WORD,
                                    WORDS // 2))
    return tile


@triton.jit
def _multiply_words(acc, values, masks, x_ptr, k, n_words, x_pair_stride, NNZ_PER_WORD: tl.constexpr,
                    WORDS: tl.constexpr, BATCH: tl.constexpr, INTERPRETER_SAFE: tl.constexpr):
    """acc += the products of words k .. k+WORDS-1 (tiles from _load_masks / _load_values)."""
    if WORDS == 1:
        word = _prepare_word(masks, INTERPRETER_SAFE)
        x_chunk = x_ptr + tl.minimum(k, n_words - 1) * 32  # a word past the end has zero values
        acc, word = _multiply_word(acc, values, word, x_chunk, x_pair_stride, NNZ_PER_WORD, BATCH, INTERPRETER_SAFE)
    else:
        first_values, second_values = tl.split(values)
        first_masks, second_masks = tl.split(masks)
        acc = _multiply_words(acc, first_values, first_masks, x_ptr, k, n_words, x_pair_stride, NNZ_PER_WORD,
                              WORDS // 2, BATCH, INTERPRETER_SAFE)
        acc = _multiply_words(acc, second_values, second_masks, x_ptr, k + WORDS // 2, n_words, x_pair_stride,
                              NNZ_PER_WORD, WORDS // 2, BATCH, INTERPRETER_SAFE)
    return acc


@triton.jit
def _spmv_kernel(x_ptr, values_ptr, mask_ptr, y_ptr, workspace_ptr, arrivals_ptr,
                 n_rows, n_words, words_per_split, x_pair_stride,
                 NNZ_PER_WORD: tl.constexpr, BATCH: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                 WORDS_PER_STEP: tl.constexpr, ONE_STEP: tl.constexpr, INTERPRETER_SAFE: tl.constexpr):
    """y[:BATCH, rows] = x @ W[rows].T. x: (in,) in any float dtype if BATCH == 1, else float32
    pairs (BATCH/2, in) viewed as int64; BATCH and NNZ_PER_WORD are powers of two;
    words_per_split is a multiple of WORDS_PER_STEP."""
    row_block = tl.program_id(0)
    split = tl.program_id(1)
    rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < n_rows

    acc = tl.zeros([BLOCK_ROWS, BATCH], dtype=tl.float32)
    k_begin = split * words_per_split
    k_end = tl.minimum(k_begin + words_per_split, n_words)
    # A step multiplies WORDS_PER_STEP words whose masks and values are all loaded before the
    # first multiply, so a program waits for memory once per step, not once per word. With
    # several steps per program the next step's tiles are loaded while this one is multiplied
    # (twice the registers: each bf16 value takes a 32-bit register); with one step there is
    # nothing to prefetch, and the registers go to more resident programs instead.
    masks = _load_masks(mask_ptr, k_begin, n_words, rows, row_ok, n_rows, WORDS_PER_STEP)
    values = _load_values(values_ptr, k_begin, n_words, rows, row_ok, n_rows, NNZ_PER_WORD, WORDS_PER_STEP)
    if ONE_STEP:
        acc = _multiply_words(acc, values, masks, x_ptr, k_begin, n_words, x_pair_stride, NNZ_PER_WORD,
                              WORDS_PER_STEP, BATCH, INTERPRETER_SAFE)
    else:
        for k in range(k_begin, k_end, WORDS_PER_STEP):
            step_masks = masks
            step_values = values
            prefetch_ok = row_ok & (k + WORDS_PER_STEP < k_end)
            masks = _load_masks(mask_ptr, k + WORDS_PER_STEP, n_words, rows, prefetch_ok, n_rows, WORDS_PER_STEP)
            values = _load_values(values_ptr, k + WORDS_PER_STEP, n_words, rows, prefetch_ok, n_rows, NNZ_PER_WORD,
                                  WORDS_PER_STEP)
            acc = _multiply_words(acc, step_values, step_masks, x_ptr, k, n_words, x_pair_stride, NNZ_PER_WORD,
                                  WORDS_PER_STEP, BATCH, INTERPRETER_SAFE)

    lanes = tl.arange(0, BATCH)
    out_offsets = lanes[None, :] * n_rows + rows[:, None]
    out_ok = row_ok[:, None] & (lanes < BATCH)[None, :]
    _store_or_reduce(acc, y_ptr, workspace_ptr, arrivals_ptr, row_block, out_offsets, out_ok, tl.num_programs(1))


@triton.jit
def _store_or_reduce(acc, y_ptr, workspace_ptr, arrivals_ptr, counter, offsets, ok, n_splits):
    """Store acc, or with K split over n_splits programs add it to the fp32 workspace; the last
    program of `counter` (its row block) to arrive stores the sum and leaves workspace and
    counter zeroed. Shared by the SpMV and the tensor-core SpMM (sparse/spmm.py)."""
    if n_splits == 1:
        tl.store(y_ptr + offsets, acc.to(y_ptr.dtype.element_ty), mask=ok)
    else:
        tl.atomic_add(workspace_ptr + offsets, acc, mask=ok, sem="relaxed")
        tl.debug_barrier()  # every thread's partial sums are in before the arrival is counted
        arrived = tl.atomic_add(arrivals_ptr + counter, 1, sem="acq_rel")
        if arrived == n_splits - 1:
            # Swap the sums out for zeros at L2 (as int32 bits: the interpreter has no float xchg).
            sum_bits = tl.atomic_xchg((workspace_ptr + offsets).to(tl.pointer_type(tl.int32), bitcast=True),
                                      tl.zeros_like(acc).to(tl.int32), mask=ok)
            tl.store(y_ptr + offsets, sum_bits.to(tl.float32, bitcast=True).to(y_ptr.dtype.element_ty), mask=ok)
            tl.atomic_xchg(arrivals_ptr + counter, 0)


@triton.jit
def _popcount(bits):
    """Set bits of each uint32 (SWAR; libdevice popc does not run in the interpreter)."""
    bits = bits - ((bits >> 1) & 0x55555555)
    bits = (bits & 0x33333333) + ((bits >> 2) & 0x33333333)
    bits = (bits + (bits >> 4)) & 0x0F0F0F0F
    return (bits * 0x01010101) >> 24


@triton.jit
def _unpack_kernel(values_ptr, mask_ptr, dense_ptr, n_rows, n_words,
                   NNZ_PER_WORD: tl.constexpr, BLOCK_ROWS: tl.constexpr, WORDS_PER_PROGRAM: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < n_rows
    bit = tl.arange(0, 32).to(tl.uint32)
    below = (tl.full([32], 1, tl.uint32) << bit) - 1  # bits under each column
    for i in tl.static_range(WORDS_PER_PROGRAM):
        k = tl.program_id(1) * WORDS_PER_PROGRAM + i
        if k < n_words:
            word = tl.load(mask_ptr + k * n_rows + rows, mask=row_ok, other=0).to(tl.uint32, bitcast=True)
            kept = ((word[:, None] >> bit[None, :]) & 1) != 0
            rank = _popcount(word[:, None] & below[None, :]).to(tl.int32)  # kept values left of the column
            value = tl.load(values_ptr + (k * NNZ_PER_WORD + rank) * n_rows + rows[:, None],
                            mask=kept & row_ok[:, None], other=0.0)
            columns = k * 32 + bit.to(tl.int32)
            tl.store(dense_ptr + rows[:, None] * (n_words * 32) + columns[None, :], value, mask=row_ok[:, None])


# ---------------------------------------------------------------- launchers

# Split-K partial sums and per-row-block arrival counters, one pair per device, grown on demand.
# The kernel leaves both zeroed after every call, so layers share them as long as their calls
# run one after another (one CUDA stream). Old buffers are kept alive because captured CUDA
# graphs may still point at them.
_workspaces = {}
_retired_workspaces = []


def _workspace(device, n_elements: int, n_counters: int):
    key = str(device)
    held = _workspaces.get(key)
    if held is None or held[0].numel() < n_elements or held[1].numel() < n_counters:
        if held is not None:
            _retired_workspaces.append(held)
        size = max(n_elements, 0 if held is None else held[0].numel(), MAX_SPMV_BATCH * 65536)
        counters = max(n_counters, 0 if held is None else held[1].numel(), 4096)
        held = (torch.zeros(size, dtype=torch.float32, device=device),
                torch.zeros(counters, dtype=torch.int32, device=device))
        _workspaces[key] = held
    return held


def reserve_workspace(device, n_rows: int):
    """Allocate the workspace for layers of up to n_rows outputs now, in eager mode.

    Must happen before a CUDA graph is recorded: under torch.compile(mode="reduce-overhead") a
    workspace first allocated inside the compiled step would land in the graph's private memory
    pool while this module still holds it, which cudagraph trees reject ("tensors in the
    cudagraph pool not tracked as outputs"). The smallest row block is 32 rows (one warp).
    """
    _workspace(device, MAX_SPMV_BATCH * n_rows, triton.cdiv(n_rows, 32))


def candidate_configs(n_rows: int, n_words: int, batch: int):
    """(rows per thread, warps, split, words per step) worth timing for a shape.

    The H200 sweeps (docs/KERNEL_NOTES.md) said: thousands of small programs beat a few long
    ones; 4 and 8 warps tie; 1-2 rows per thread at batch 1. Steps of several words (all of a
    step's loads in flight at once) measured no faster than one-word steps with prefetch
    (4096x4096: 12.2 us for 4 words in one step vs 11.4 us) and take ~10x longer to compile,
    so the autotuner only times one-word steps; `spmv(config=...)` still runs the others.
    """
    if INTERPRETING:  # the interpreter is slow: one small config that still splits K
        return [(1, 1, max(1, min(3, n_words // 2)), 1)]
    configs = []
    for rows_per_thread in (1, 2, 4):
        if rows_per_thread * batch > 32:  # accumulators would spill
            continue
        row_blocks = triton.cdiv(n_rows, rows_per_thread * 32 * 4)
        for target_programs in (1024, 2048, 4096):
            split = max(1, min(triton.cdiv(target_programs, row_blocks), n_words // 4))
            if (rows_per_thread, 4, split, 1) not in configs:
                configs.append((rows_per_thread, 4, split, 1))
    return configs


_tuned_configs = {}


def spmv_config(x: torch.Tensor, values: torch.Tensor, mask: torch.Tensor):
    """The fastest candidate config for this (out, in, batch), timed once and remembered.

    Timed with triton's do_bench, which clears the L2 before every run, so the weights come
    from memory as they do in a model.
    """
    n_words, n_rows = mask.shape
    key = (n_rows, n_words, triton.next_power_of_2(x.shape[0]), values.dtype, x.device)
    if key not in _tuned_configs:
        configs = candidate_configs(n_rows, n_words, x.shape[0])
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return configs[0]  # cannot time inside a graph capture; warm up first to get the tuned one
        if len(configs) == 1:
            _tuned_configs[key] = configs[0]
        else:
            timings = [do_bench(lambda c=c: spmv(x, values, mask, config=c), warmup=5, rep=25,
                                return_mode="median") for c in configs]
            _tuned_configs[key] = configs[timings.index(min(timings))]
    return _tuned_configs[key]


def spmv(x: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, config=None, out=None) -> torch.Tensor:
    """y = x @ W.T for x of shape (batch <= 16, in); W given as (values, mask).

    config: (rows per thread, warps, split, words per step) instead of the tuned choice; out: optional
    (next power of two >= batch, out_features) buffer to write into (tests poison it).
    """
    batch, in_features = x.shape
    n_words, n_rows = mask.shape
    if in_features != n_words * 32 or batch > MAX_SPMV_BATCH:
        raise ValueError(f"spmv: x {tuple(x.shape)} does not fit a packed weight with in_features={n_words * 32}")
    nnz = values.shape[0] // n_words
    if nnz & (nnz - 1):
        raise ValueError(f"spmv needs a power-of-two number of kept weights per 32-bit word, got {nnz}")
    rows_per_thread, warps, split, words_per_step = config or spmv_config(x, values, mask)
    words_per_split = words_per_step * triton.cdiv(n_words, split * words_per_step)
    split = triton.cdiv(n_words, words_per_split)
    block_rows = rows_per_thread * 32 * warps
    row_blocks = triton.cdiv(n_rows, block_rows)
    lanes = triton.next_power_of_2(batch)
    workspace, arrivals = _workspace(x.device, lanes * n_rows, row_blocks)
    y = torch.empty(lanes, n_rows, dtype=x.dtype, device=x.device) if out is None else out
    if batch > 1:
        # Pair-major float32: element (p, c) holds lanes 2p and 2p+1 of column c (one cast+copy launch).
        padded = x if batch == lanes else torch.nn.functional.pad(x, (0, 0, 0, lanes - batch))
        pairs = torch.empty(lanes // 2, in_features, 2, dtype=torch.float32, device=x.device)
        pairs.transpose(1, 2).copy_(padded.view(lanes // 2, 2, in_features))
        x = pairs.view(torch.int64).view(lanes // 2, in_features)
    _spmv_kernel[(row_blocks, split)](
        x, values, mask, y, workspace, arrivals, n_rows, n_words, words_per_split, in_features,
        NNZ_PER_WORD=nnz, BATCH=lanes, BLOCK_ROWS=block_rows, WORDS_PER_STEP=words_per_step,
        ONE_STEP=words_per_split == words_per_step, INTERPRETER_SAFE=INTERPRETING, num_warps=warps)
    return y[:batch]


def unpack_to_dense(values: torch.Tensor, mask: torch.Tensor, out=None, config=None) -> torch.Tensor:
    """Dense (out, in) weight from (values, mask), on the device (graph-capturable).

    config: (rows, words) per program instead of the default.
    """
    n_words, n_rows = mask.shape
    nnz = values.shape[0] // n_words
    dense = torch.empty(n_rows, n_words * 32, dtype=values.dtype, device=values.device) if out is None else out
    block_rows, words_per_program = config or ((16, 2) if INTERPRETING else (64, 4))
    grid = (triton.cdiv(n_rows, block_rows), triton.cdiv(n_words, words_per_program))
    _unpack_kernel[grid](values, mask, dense, n_rows, n_words, NNZ_PER_WORD=nnz,
                         BLOCK_ROWS=block_rows, WORDS_PER_PROGRAM=words_per_program)
    return dense
