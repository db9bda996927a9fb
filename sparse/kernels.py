"""Triton kernels for the N:M bitmask format (layout: see sparse/format.py).

- `spmv`: y = x @ W.T for 1..16 rows of x. Each thread owns one output row; the 32 threads of a
  warp walk the same mask word k of 32 neighbouring rows, so at every step they need x from the
  same 32-column chunk. Lane j holds x[32k + j] in a register and a warp shuffle hands each
  thread the element its column asks for: no address arithmetic and no memory access per kept
  weight. Per word a thread loads the mask word and its values in 16-byte loads (8 bf16), then
  runs a fixed number of steps (nnz per word, a constexpr): take the lowest set bit's column,
  shuffle x from that lane, multiply by the next value, clear the bit. That is six instructions
  per step at batch 1 (bit scan 3, shuffle, bf16 -> fp32, FMA), 8.4-8.8 per kept weight in the
  SASS with the per-word loads and addressing, against the ~17.7 the H200 can issue per kept
  weight at full bandwidth (docs/KERNEL_NOTES.md). From 5 rows of bf16 x, two rows share a lane
  register as bf16 and one shuffle serves both (`packs_x`). The loads of the next one or two words
  (a constexpr) are issued before the current word is multiplied. The warps of a program take consecutive
  slices of K for the same rows and are summed through shared memory; programs may split K
  further and add fp32 partial sums into a workspace with atomics, the last program of a row
  block to arrive casting the sum to the output dtype and zeroing the workspace again, so one
  launch does everything and the workspace is always clean for the next call. Slices and words
  per warp are autotuned per (out, in, batch) and fusion.
  Around the product the SpMV can do a decode step's small ops that would otherwise each be a
  kernel launch of a few microseconds (~100 per Llama-3.1-8B step): RMSNorm of x (the norm
  weight multiplies x's lanes as they are loaded, and each thread also adds up the squares of
  the lanes it loads; 1/rms factors out of the row sum, so the program that stores a row applies
  it from those sums), silu(gate) * up for x = [gate | up], and a residual added before the store.
- `unpack_to_dense`: expands (values, mask) into a dense weight for the prefill path
  (decompress + cuBLAS).

`INTERPRETER_SAFE` (a constexpr) keeps inline PTX out so the same source runs under
TRITON_INTERPRET=1 on CPU: plain loads instead of the vector loads, a gather of x from memory
instead of the shuffle, and a bit scan that takes the lowest set bit's index from the float32
exponent of (w & -w), exact for a power of two. Measurements and SASS counts behind these
choices: docs/KERNEL_NOTES.md.
"""
import contextlib
import functools
import math
import os
from concurrent.futures import ThreadPoolExecutor

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
MAX_SPMV_BATCH = 16
# Programmatic dependent launch (Hopper on) with an L2 prefetch: each SpMV may start while the
# kernel before it drains, asks the L2 for the first words of its weights (about this many bytes
# over the whole grid), and only then waits for that kernel's output. The weights never depend on
# the previous kernel, so its tail and the ramp of this one overlap the DRAM reads. Session 10's
# PDL without the prefetch (1-2 words loaded into registers) measured nothing end to end: the loop
# restarted its reads only after x arrived (docs/KERNEL_NOTES.md, sessions 10 and 25). 0: off.
PDL_L2_PREFETCH_BYTES = 16 << 20
PACK_X_MIN_BATCH = 4  # see packs_x and docs/KERNEL_NOTES.md (sessions 11 and 13)


@triton.jit
def _load_u32(ptr, COUNT: tl.constexpr, INTERPRETER_SAFE: tl.constexpr):
    """A tuple of COUNT consecutive uint32 at each thread's `ptr` (4·COUNT-byte aligned), in 16-byte
    vector loads where possible. Streamed through L2 only (.cg): a weight is read once per call.

    Tuples of 1-D tensors (one element per thread), not joined tiles: a tile carried around the
    pipelined loop made Triton convert its layout through shared memory every iteration."""
    if COUNT > 4 or (INTERPRETER_SAFE and COUNT > 1):
        tile = _load_u32(ptr, COUNT // 2, INTERPRETER_SAFE) + _load_u32(ptr + COUNT // 2, COUNT // 2,
                                                                        INTERPRETER_SAFE)
    elif INTERPRETER_SAFE:
        tile = (tl.load(ptr), )
    elif COUNT == 1:
        tile = (tl.inline_asm_elementwise("ld.global.cg.u32 $0, [$1];", "=r,l", [ptr],
                                          dtype=tl.uint32, is_pure=True, pack=1), )
    elif COUNT == 2:
        tile = tl.inline_asm_elementwise("ld.global.cg.v2.u32 {$0, $1}, [$2];", "=r,=r,l", [ptr],
                                         dtype=(tl.uint32, tl.uint32), is_pure=True, pack=1)
    else:
        tile = tl.inline_asm_elementwise("ld.global.cg.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l",
                                         [ptr], dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32),
                                         is_pure=True, pack=1)
    return tile


@triton.jit
def _to_float(bits, DTYPE: tl.constexpr):
    """float32 of the DTYPE value in the low bits of a uint32 (16-bit types: bits 0-15)."""
    if DTYPE == tl.float32:
        value = bits.to(tl.float32, bitcast=True)
    elif DTYPE == tl.bfloat16:
        value = (bits << 16).to(tl.float32, bitcast=True)
    else:
        value = (bits & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return value


@triton.jit
def _high_half_to_float(bits, DTYPE: tl.constexpr):
    """float32 of the 16-bit DTYPE value in bits 16-31 (for bf16 a mask, not a shift)."""
    if DTYPE == tl.bfloat16:
        value = (bits & 0xFFFF0000).to(tl.float32, bitcast=True)
    else:
        value = _to_float(bits >> 16, DTYPE)
    return value


@triton.jit
def _prepare_word(word, INTERPRETER_SAFE: tl.constexpr):
    """uint32 mask word -> the form `_pop_next_column` scans (bit-reversed on the fast path)."""
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
def _step(acc, word, value, x_lanes, valid, PACKED_X: tl.constexpr, INTERPRETER_SAFE: tl.constexpr):
    """acc[b] += value * x[b, column of the word's lowest set bit] for every row b of x; that bit
    cleared.

    x_lanes (a tuple): per row b of x the float32 bits of x[b, 32k + lane], or with PACKED_X per
    pair of rows (2p, 2p + 1) their bf16 bits in the low and high half (zero for a word past the
    end). The column's element comes from lane `column` of the same warp, by a warp shuffle on the
    fast path and by a gather across the program's threads on the safe path. A packed pair takes
    one shuffle for two rows of x and two instructions to widen them again."""
    column, word = _pop_next_column(word, INTERPRETER_SAFE)
    for p in tl.static_range(len(x_lanes)):
        if INTERPRETER_SAFE:
            thread = tl.arange(0, x_lanes[p].shape[0])
            bits = tl.gather(x_lanes[p], thread // 32 * 32 + column, 0)
        else:
            bits = tl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, $2, 31, -1;", "=r,r,r", [x_lanes[p], column],
                                             dtype=tl.uint32, is_pure=True, pack=1)
        if PACKED_X:
            acc = _replace(acc, 2 * p, acc[2 * p] + value * (bits << 16).to(tl.float32, bitcast=True))
            acc = _replace(acc, 2 * p + 1,
                           acc[2 * p + 1] + value * (bits & 0xFFFF0000).to(tl.float32, bitcast=True))
        else:
            acc = _replace(acc, p, acc[p] + value * bits.to(tl.float32, bitcast=True))
    return acc, word


@triton.jit
def _replace(items, index: tl.constexpr, item):
    """The tuple `items` with items[index] replaced."""
    return items[:index] + (item, ) + items[index + 1:]


@triton.jit
def _multiply(acc, word, tile, x_lanes, valid, DTYPE: tl.constexpr, PACKED_X: tl.constexpr,
              INTERPRETER_SAFE: tl.constexpr):
    """acc += the word's kept weights (a tuple of uint32 of packed values, in column order) times x
    at their columns, lowest column first: a fixed number of steps."""
    for i in tl.static_range(len(tile)):
        if DTYPE == tl.float32:
            acc, word = _step(acc, word, _to_float(tile[i], DTYPE), x_lanes, valid, PACKED_X, INTERPRETER_SAFE)
        else:  # two 16-bit values per uint32, the first in the low half
            acc, word = _step(acc, word, _to_float(tile[i], DTYPE), x_lanes, valid, PACKED_X, INTERPRETER_SAFE)
            acc, word = _step(acc, word, _high_half_to_float(tile[i], DTYPE), x_lanes, valid, PACKED_X,
                              INTERPRETER_SAFE)
    return acc


@triton.jit
def _load_lane(ptr, INTERPRETER_SAFE: tl.constexpr):
    """float32 of the element at each thread's ptr, read through L1 (.ca): every warp on the SM
    reads the same x."""
    DTYPE: tl.constexpr = ptr.dtype.element_ty
    if INTERPRETER_SAFE:
        value = tl.load(ptr).to(tl.float32)
    elif DTYPE == tl.float32:
        value = tl.inline_asm_elementwise("ld.global.ca.u32 $0, [$1];", "=r,l", [ptr],
                                          dtype=tl.uint32, is_pure=True, pack=1).to(tl.float32, bitcast=True)
    else:
        bits = tl.inline_asm_elementwise("ld.global.ca.u16 $0, [$1];", "=r,l", [ptr],
                                         dtype=tl.uint32, is_pure=True, pack=1)
        value = _to_float(bits, DTYPE)
    return value


@triton.jit
def _load_word(x_ptr, norm_ptr, values_u32, mask_u32, k, rows, lane, n_rows, n_words, x_stride, batch_rows, squares,
               CHUNKS: tl.constexpr, U32_PER_CHUNK: tl.constexpr, BATCH: tl.constexpr, EVEN_K: tl.constexpr,
               NORM: tl.constexpr, GATED: tl.constexpr, PACKED_X: tl.constexpr, INTERPRETER_SAFE: tl.constexpr):
    """What a thread needs to multiply word k of its row: (word ready to scan, values, x lanes, valid,
    squares).

    Lane j of x is the input at column 32k + j after the fused prologue: silu(gate) * up when
    GATED (x rows are [gate | up]), times the norm weight when NORM. The norm's 1/rms is a factor
    of the whole row sum, applied at the end; for it, with NORM, squares[b] (a tuple over the rows
    of x) adds up x[b, 32k + lane]^2 of every word loaded. Unless EVEN_K (the programs' words cover
    K exactly), a word past the end reads the last word again and multiplies it by zero. PACKED_X:
    x rounded to bf16, two rows of x to a lane register (see `_step`)."""
    if EVEN_K:
        valid = k >= 0  # always true; without clamping, the compiler steps the addresses by a constant
    else:
        valid = k < n_words
        k = tl.minimum(k, n_words - 1)
    word = _prepare_word(_load_u32(mask_u32 + k * n_rows + rows, 1, INTERPRETER_SAFE)[0], INTERPRETER_SAFE)
    tile = ()
    for c in tl.static_range(CHUNKS):
        tile = tile + _load_u32(values_u32 + ((k * CHUNKS + c) * n_rows + rows) * U32_PER_CHUNK, U32_PER_CHUNK,
                                INTERPRETER_SAFE)
    column = k * 32 + lane
    if NORM:
        scale = _load_lane(norm_ptr + column, INTERPRETER_SAFE)
    x_lanes = ()
    for b in tl.static_range(BATCH):
        # Rows of x past the batch repeat the last one (their results are not stored).
        row = x_ptr + min(b, batch_rows - 1) * x_stride
        x = _load_lane(row + column, INTERPRETER_SAFE)
        if NORM:
            squares = _replace(squares, b, squares[b] + (x * x if EVEN_K else tl.where(valid, x * x, 0.0)))
        if GATED:
            x = _silu(x, INTERPRETER_SAFE) * _load_lane(row + n_words * 32 + column, INTERPRETER_SAFE)
        if NORM:
            x = x * scale
        bits = x.to(tl.uint32, bitcast=True)
        if PACKED_X:  # rows 2p and 2p + 1 share a register: bf16 bits in the low and the high half
            bits = _bf16_bits(bits)
            if b % 2 == 1:
                bits = x_lanes[b // 2] | (bits << 16)
                x_lanes = x_lanes[:b // 2]
        x_lanes = x_lanes + (bits if EVEN_K else tl.where(valid, bits, 0), )
    return word, tile, x_lanes, valid, squares


@triton.jit
def _silu(x, INTERPRETER_SAFE: tl.constexpr):
    """x * sigmoid(x). On the GPU as h + h * tanh(h) with h = x / 2: three instructions (one of them
    the MUFU's tanh.approx, relative error ~2^-11, below bf16's rounding), where x / (1 + exp(-x))
    compiled to ~13 with two MUFU ops and their range fix-ups. Every row block's program computes
    it again for its words; at 8 rows of x the gated SpMV's SASS went from 1512 to 1360
    instructions with it (the plain product's: 1136)."""
    if INTERPRETER_SAFE:
        return x / (1.0 + tl.exp(-x))
    half = 0.5 * x
    tanh = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [half], dtype=tl.float32, is_pure=True, pack=1)
    return half + half * tanh


@triton.jit
def _bf16_bits(bits):
    """The bf16 nearest to each float32 (given as uint32 bits; ties to even), as bits 0-15 of a
    uint32. Integer arithmetic, because the interpreter's float32 -> bf16 cast truncates."""
    return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16


@triton.jit
def _join_lanes(acc, FIRST: tl.constexpr, COUNT: tl.constexpr):
    """acc[FIRST : FIRST + COUNT] (a tuple of [T]) as one [T, COUNT] tensor, lanes in order."""
    if COUNT == 1:
        lanes = acc[FIRST][:, None]
    else:
        low = _join_lanes(acc, FIRST, COUNT // 2)
        high = _join_lanes(acc, FIRST + COUNT // 2, COUNT // 2)
        lanes = tl.reshape(tl.permute(tl.join(low, high), (0, 2, 1)), (low.shape[0], COUNT))
    return lanes


@triton.jit
def _prefetch_words_to_l2(values_u32, mask_u32, k_first, rows, n_rows, n_words, words,
                          CHUNKS: tl.constexpr, U32_PER_CHUNK: tl.constexpr):
    """Asks the L2 for `words` words from k_first of each thread's row (its mask word and values): a
    hint, no registers written, no wait. At the normal eviction priority: lines marked evict_last
    would outlive their one read and crowd out the step's other data (x, the KV cache); against
    that, lines prefetched during the previous kernel's last ~24 MB of reads are the newest of the
    L2's 60 MB when this kernel reads them."""
    for i in range(0, words):
        k = tl.minimum(k_first + i, n_words - 1)
        _prefetch_l2(mask_u32 + k * n_rows + rows)
        for c in tl.static_range(CHUNKS):
            _prefetch_l2(values_u32 + ((k * CHUNKS + c) * n_rows + rows) * U32_PER_CHUNK)


@triton.jit
def _prefetch_l2(ptr):
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // dummy $0", "=r,l", [ptr], dtype=tl.int32, is_pure=False,
                              pack=1)


@triton.jit
def _spmv_kernel(x_ptr, values_ptr, mask_ptr, y_ptr, workspace_ptr, arrivals_ptr, norm_ptr, residual_ptr,
                 n_rows, n_words, words_per_warp, batch_rows, x_stride, norm_eps, l2_words,
                 NNZ: tl.constexpr, CHUNK: tl.constexpr, BATCH: tl.constexpr, SLICES: tl.constexpr,
                 PREFETCH: tl.constexpr, EVEN_K: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr,
                 GATED: tl.constexpr, PACKED_X: tl.constexpr, PDL: tl.constexpr, INTERPRETER_SAFE: tl.constexpr):
    """y[:batch_rows, rows] = residual + prologue(x) @ W[rows].T for the 32 rows of this program's
    row block (`spmv` says what the optional prologue and residual are).

    Grid (row blocks, K splits); SLICES warps per program, warp s walking words_per_warp words
    from (split · SLICES + s) · words_per_warp. BATCH: batch_rows rounded up to a power of two.
    PDL: launched as a programmatic dependent launch (PDL_L2_PREFETCH_BYTES): the program may run
    while the previous kernel drains; it prefetches its warps' first l2_words words into the L2,
    then waits for that kernel before its first load (x, the residual and the split-K workspace
    are that kernel's or its predecessors')."""
    DTYPE: tl.constexpr = values_ptr.dtype.element_ty
    U32_PER_CHUNK: tl.constexpr = CHUNK * DTYPE.primitive_bitwidth // 32
    CHUNKS: tl.constexpr = NNZ // CHUNK
    THREADS: tl.constexpr = 32 * SLICES
    thread = tl.arange(0, THREADS)
    lane = thread % 32
    rows = tl.minimum(tl.program_id(0) * 32 + lane, n_rows - 1)  # rows past the end repeat the last
    k_first = (tl.program_id(1) * SLICES + thread // 32) * words_per_warp
    values_u32 = values_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    mask_u32 = mask_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    acc = ()
    for b in tl.static_range(BATCH):
        acc = acc + (tl.zeros([THREADS], dtype=tl.float32), )
    squares = acc if NORM else ()

    if PDL:
        _prefetch_words_to_l2(values_u32, mask_u32, k_first, rows, n_rows, n_words, l2_words, CHUNKS,
                              U32_PER_CHUNK)
        gdc_wait()  # the previous kernel has finished and its writes are visible
        gdc_launch_dependents()  # the next PDL launch may start its prefetch while this grid runs

    # Software pipeline, PREFETCH words deep: word i + PREFETCH's loads are issued before word i
    # is multiplied.
    word, tile, x_lanes, valid, squares = _load_word(
        x_ptr, norm_ptr, values_u32, mask_u32, k_first, rows, lane, n_rows, n_words, x_stride, batch_rows, squares,
        CHUNKS, U32_PER_CHUNK, BATCH, EVEN_K, NORM, GATED, PACKED_X, INTERPRETER_SAFE)
    if PREFETCH == 2:
        word1, tile1, x_lanes1, valid1, squares = _load_word(
            x_ptr, norm_ptr, values_u32, mask_u32, k_first + 1, rows, lane, n_rows, n_words, x_stride, batch_rows,
            squares, CHUNKS, U32_PER_CHUNK, BATCH, EVEN_K, NORM, GATED, PACKED_X, INTERPRETER_SAFE)
    for i in range(PREFETCH, words_per_warp):
        next_word, next_tile, next_x, next_valid, squares = _load_word(
            x_ptr, norm_ptr, values_u32, mask_u32, k_first + i, rows, lane, n_rows, n_words, x_stride, batch_rows,
            squares, CHUNKS, U32_PER_CHUNK, BATCH, EVEN_K, NORM, GATED, PACKED_X, INTERPRETER_SAFE)
        acc = _multiply(acc, word, tile, x_lanes, valid, DTYPE, PACKED_X, INTERPRETER_SAFE)
        if PREFETCH == 2:
            word, tile, x_lanes, valid = word1, tile1, x_lanes1, valid1
            word1, tile1, x_lanes1, valid1 = next_word, next_tile, next_x, next_valid
        else:
            word, tile, x_lanes, valid = next_word, next_tile, next_x, next_valid
    acc = _multiply(acc, word, tile, x_lanes, valid, DTYPE, PACKED_X, INTERPRETER_SAFE)
    if PREFETCH == 2:
        acc = _multiply(acc, word1, tile1, x_lanes1, valid1, DTYPE, PACKED_X, INTERPRETER_SAFE)

    acc = _join_lanes(acc, 0, BATCH)  # [THREADS, BATCH]
    if SLICES > 1:  # the warps' slices of K, summed through shared memory
        acc = tl.sum(tl.reshape(acc, (SLICES, 32, BATCH)), axis=0)
    out_rows = tl.program_id(0) * 32 + tl.arange(0, 32)
    lanes = tl.arange(0, BATCH)
    out_offsets = lanes[None, :] * n_rows + out_rows[:, None]
    out_ok = (out_rows < n_rows)[:, None] & (lanes < batch_rows)[None, :]
    if NORM:  # sum(x^2) over this program's words; with K split, the row block's sum goes through the
        # workspace past the partial products (it holds batch_rows x n_rows of them), like theirs
        square_sums = tl.sum(_join_lanes(squares, 0, BATCH), axis=0)
        square_sums_ptr = workspace_ptr + batch_rows * n_rows + tl.program_id(0) * BATCH + lanes
        if tl.num_programs(1) > 1:
            tl.atomic_add(square_sums_ptr, square_sums, mask=lanes < batch_rows, sem="relaxed")
    if RESIDUAL:  # loaded by every program before the split-K arrival, so the last one to arrive
        # does not wait a further round trip for it after its sums (64 B a row block and row of x)
        residual = tl.load(residual_ptr + out_offsets, mask=out_ok, other=0.0)
    total, last = _sum_splits(acc, workspace_ptr, arrivals_ptr, tl.program_id(0), out_offsets, out_ok,
                              tl.num_programs(1))
    if last:  # this program holds the whole row sum: apply the epilogue and store
        if NORM:  # 1/rms(x) factors out of the row sum
            if tl.num_programs(1) > 1:
                square_sums = tl.atomic_xchg(square_sums_ptr.to(tl.pointer_type(tl.int32), bitcast=True),
                                             tl.zeros_like(square_sums).to(tl.int32),
                                             mask=lanes < batch_rows).to(tl.float32, bitcast=True)
            total = total * tl.rsqrt(square_sums / (n_words * 32) + norm_eps)[None, :]
        if RESIDUAL:
            total += residual.to(tl.float32)
        tl.store(y_ptr + out_offsets, total.to(y_ptr.dtype.element_ty), mask=out_ok)


@triton.jit
def _sum_splits(acc, workspace_ptr, arrivals_ptr, counter, offsets, ok, n_splits):
    """(row sums, whether this program holds them). With K split over n_splits programs, each adds
    acc to the fp32 workspace; the last program of `counter` (its row block) to arrive takes the
    sums and leaves workspace and counter zeroed. Shared by the SpMV and the tensor-core SpMM
    (sparse/spmm.py)."""
    total = acc
    last = n_splits == 1
    if n_splits > 1:
        tl.atomic_add(workspace_ptr + offsets, acc, mask=ok, sem="relaxed")
        tl.debug_barrier()  # every thread's partial sums are in before the arrival is counted
        arrived = tl.atomic_add(arrivals_ptr + counter, 1, sem="acq_rel")
        last = arrived == n_splits - 1
        if last:
            # Swap the sums out for zeros at L2 (as int32 bits: the interpreter has no float xchg).
            sum_bits = tl.atomic_xchg((workspace_ptr + offsets).to(tl.pointer_type(tl.int32), bitcast=True),
                                      tl.zeros_like(acc).to(tl.int32), mask=ok)
            total = sum_bits.to(tl.float32, bitcast=True)
            tl.atomic_xchg(arrivals_ptr + counter, 0)
    return total, last


@triton.jit
def _store_or_reduce(acc, y_ptr, workspace_ptr, arrivals_ptr, counter, offsets, ok, n_splits):
    """Store acc, or its sum over the n_splits programs of `counter` (see _sum_splits)."""
    total, last = _sum_splits(acc, workspace_ptr, arrivals_ptr, counter, offsets, ok, n_splits)
    if last:
        tl.store(y_ptr + offsets, total.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _popcount(bits):
    """Set bits of each uint32 (SWAR; libdevice popc does not run in the interpreter)."""
    bits = bits - ((bits >> 1) & 0x55555555)
    bits = (bits & 0x33333333) + ((bits >> 2) & 0x33333333)
    bits = (bits + (bits >> 4)) & 0x0F0F0F0F
    return (bits * 0x01010101) >> 24


@triton.jit
def _unpack_kernel(values_ptr, mask_ptr, dense_ptr, n_rows, row_stride, n_words,
                   NNZ_PER_WORD: tl.constexpr, CHUNK: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                   WORDS_PER_PROGRAM: tl.constexpr):
    """Dense rows from (values, mask), one word of BLOCK_ROWS rows at a time: a row's kept values
    of the word come in CHUNK-wide (16-byte) loads and are spread over its 32 columns in registers
    (tl.gather by each column's rank among the set bits). 24-26 % faster on the H200 than loading
    each column's value with a scalar gather (docs/KERNEL_NOTES.md, session 10). n_rows rows of a
    packed weight of row_stride rows (the pointers at the first of them) into n_rows dense rows."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < n_rows
    bit = tl.arange(0, 32).to(tl.uint32)
    below = (tl.full([32], 1, tl.uint32) << bit) - 1
    CHUNKS: tl.constexpr = NNZ_PER_WORD // CHUNK
    chunk = tl.arange(0, CHUNKS)
    lane = tl.arange(0, CHUNK)
    for i in tl.static_range(WORDS_PER_PROGRAM):
        k = tl.program_id(1) * WORDS_PER_PROGRAM + i
        if k < n_words:
            word = tl.load(mask_ptr + k * row_stride + rows, mask=row_ok, other=0).to(tl.uint32, bitcast=True)
            kept = ((word[:, None] >> bit[None, :]) & 1) != 0
            rank = _popcount(word[:, None] & below[None, :]).to(tl.int32)
            offsets = ((k * CHUNKS + chunk)[None, :, None] * row_stride + rows[:, None, None]) * CHUNK + lane[None, None, :]
            kept_values = tl.load(values_ptr + offsets, mask=row_ok[:, None, None], other=0.0)
            kept_values = tl.reshape(kept_values, (BLOCK_ROWS, NNZ_PER_WORD))
            if NNZ_PER_WORD == 1:  # one value per word (1:32): Triton cannot lower a gather over one element
                value = tl.broadcast_to(kept_values, (BLOCK_ROWS, 32))
            else:
                value = tl.gather(kept_values, tl.minimum(rank, NNZ_PER_WORD - 1), 1)
            columns = k * 32 + bit.to(tl.int32)
            tl.store(dense_ptr + rows[:, None] * (n_words * 32) + columns[None, :], tl.where(kept, value, 0.0),
                     mask=row_ok[:, None])


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
    cudagraph pool not tracked as outputs"). A row block is 32 rows (one warp).
    """
    row_blocks = triton.cdiv(n_rows, 32)
    _workspace(device, MAX_SPMV_BATCH * (n_rows + row_blocks), row_blocks)


def candidate_configs(n_rows: int, n_words: int, batch: int):
    """(slices, words per warp, prefetch) worth timing for a shape.

    Each warp walks `words per warp` words of 32 rows, `prefetch` words ahead; a program holds
    `slices` such warps on the same rows (summed in shared memory), and K is split over programs
    until every word is covered. So the words per warp set how many warps the call has (row
    blocks x words / words per warp): the candidates span ~1/4 to ~4 waves of the H200's resident
    warps (132 SMs x up to 64). Programs that cover all of K in their slices (up to 32 warps)
    need no split-K epilogue (atomics, arrival counter), which counts on the small matrices.
    """
    if INTERPRETING:  # the interpreter is slow: one small config that splits K over programs too
        return [(2, 1, 1)]
    row_blocks = triton.cdiv(n_rows, 32)
    shapes = []
    for words_per_warp in (2, 4, 8, 16, 32, 64):
        warps = row_blocks * triton.cdiv(n_words, words_per_warp)
        if words_per_warp <= n_words and 2000 <= warps <= 40000:
            shapes += [(slices, words_per_warp) for slices in (2, 4, 8) if slices * words_per_warp <= n_words]
    for slices in (8, 16, 32):  # whole K in one program
        if n_words % slices == 0 and n_words // slices >= 2 and 2000 <= row_blocks * slices <= 40000:
            shapes.append((slices, n_words // slices))
    configs = [(slices, words, prefetch) for slices, words in dict.fromkeys(shapes) for prefetch in (1, 2)]
    return configs or [(1, 1, 1)]


_tuned_configs = {}
# A tuner's candidates are compiled this many at a time before any is timed (Triton's
# AsyncCompileMode: the compiles run in threads, most of their work outside the GIL). Compiling
# took most of a tuning (40 tensor-core candidates a shape, ~0.5 s each); two threads on two cores
# compiled them 1.7x faster than one (scripts/compile_time.py; docs/KERNEL_NOTES.md, session 25).
COMPILE_THREADS = min(16, os.cpu_count() or 1)
L2_BYTES = 60e6  # the H200's L2 is ~60 MB (50 MB on an H100): copies rotated past it come from DRAM


def copies_for(nbytes: int) -> int:
    """Copies of an operand of nbytes so that rotating through them always misses the L2."""
    return max(1, math.ceil(3 * L2_BYTES / nbytes))


def time_in_cuda_graph(calls, target_ms: float = 3.0, replays: int = 15) -> float:
    """Median microseconds per call of `calls` (run round-robin), recorded into one CUDA graph of
    about target_ms and replayed: launch gaps as in a compiled decode step, no Python launch
    overhead in the number. The benchmarks (scripts/bench_kernel.py) time with this too."""
    for call in calls:  # compile and warm up outside the graph
        call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for call in calls:
        call()
    end.record()
    end.synchronize()
    estimate_ms = start.elapsed_time(end) / len(calls)
    loops = max(1, min(200, round(target_ms / max(estimate_ms, 1e-3) / len(calls))))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(loops):
            for call in calls:
                call()
    graph.replay()
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return sorted(times)[len(times) // 2] * 1000 / (loops * len(calls))


def spmv_config(x: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, pack_x: bool = False, norm: bool = False,
                gated: bool = False, residual: bool = False):
    """The fastest candidate config for this (out, in, batch) and this fusion (norm / gated /
    residual, as spmv takes them), timed once and remembered.

    Timed as the benchmark and a compiled decode run it: inside a CUDA graph, rotating over copies
    of the weight that together exceed the L2 three times, so they come from DRAM. (triton's
    do_bench, which clears the L2 but launches each call from Python, picked configs up to 27 %
    slower than the best on 5 of 16 shapes in the 2026-12-01 sweep: docs/KERNEL_NOTES.md.) The
    fused call is timed itself: with the plain product's choice, near-ties for the product became
    the fused calls' configs, up to 10 % apart between processes (session 12, KERNEL_NOTES.md).
    """
    n_words, n_rows = mask.shape
    fusion = "+".join(name for name, on in (("norm", norm), ("gated", gated), ("residual", residual)) if on)
    key = (n_rows, n_words, triton.next_power_of_2(x.shape[0]), values.dtype, pack_x, fusion, x.device)
    if key not in _tuned_configs:
        configs = candidate_configs(n_rows, n_words, x.shape[0])
        if len(configs) == 1 or not x.is_cuda:
            _tuned_configs[key] = configs[0]
        elif torch.cuda.is_current_stream_capturing():
            return configs[0]  # cannot time inside a graph capture; warm up first to get the tuned one
        else:
            batch, in_features = x.shape[0], n_words * 32
            x = torch.randn(batch, x.shape[1], dtype=x.dtype, device=x.device)
            operands = dict(gated=gated, pack_x=pack_x, norm_eps=1e-5,
                            norm_weight=torch.ones(in_features, dtype=x.dtype, device=x.device) if norm else None,
                            residual=torch.zeros(batch, n_rows, dtype=x.dtype, device=x.device) if residual else None)
            _tuned_configs[key] = fastest_in_cuda_graph(
                configs, values, mask, lambda config, v, m: spmv(x, v, m, config=config, **operands),
                compile_only=lambda config: spmv(x, values, mask, config=config, compile_only=True, **operands))
    return _tuned_configs[key]


def compile_all(configs, compile_only):
    """Calls compile_only(c) for every config c, each a launch that only compiles its kernel (the
    launchers' compile_only=True: Triton's warmup), COMPILE_THREADS compiles at a time; later
    launches of those configs then find their kernels compiled."""
    with ThreadPoolExecutor(COMPILE_THREADS) as pool, triton.AsyncCompileMode(pool):
        for config in configs:
            compile_only(config)


def fastest_in_cuda_graph(configs, values: torch.Tensor, mask: torch.Tensor, run, timings_out: dict = None,
                          compile_only=None):
    """The config c of `configs` for which run(c, values, mask) is fastest, each timed in a CUDA
    graph rotating over copies of the packed weight that together exceed the L2 three times (so
    they stream from DRAM, as in a decode step). The SpMV's and the SpMM's tuners both use it.
    timings_out, if given, receives {config: µs a call} for every candidate. compile_only, if given:
    as `compile_all` takes it; every candidate is then compiled first, several at a time."""
    if compile_only is not None:
        compile_all(configs, compile_only)
    nbytes = values.numel() * values.element_size() + mask.numel() * 4
    copies = [(values, mask)] + [(values.clone(), mask.clone()) for _ in range(copies_for(nbytes) - 1)]
    timings = [time_in_cuda_graph([lambda v=v, m=m, c=c: run(c, v, m) for v, m in copies], target_ms=1.0, replays=9)
               for c in configs]
    if timings_out is not None:
        timings_out.update(zip(configs, timings))
    return configs[timings.index(min(timings))]


def packs_x(x: torch.Tensor) -> bool:
    """Whether spmv shuffles x two rows to a register (bf16 pairs) by default: for bf16 inputs of
    PACK_X_MIN_BATCH rows or more. Packing halves the shuffles (one per row of x per kept weight)
    at two extra instructions per pair; on the H200 it made every fused decode call 8-19 % faster
    at 8 rows, but the norm-fused ones 3-14 % slower at 4 (docs/KERNEL_NOTES.md, session 11). With
    the norm run apart from 4 rows (sparse.linear.PROLOGUE_APART_MIN_ROWS) the 4-row calls gain
    from packing too (session 13)."""
    return x.dtype == torch.bfloat16 and x.shape[0] >= PACK_X_MIN_BATCH


def spmv(x: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, config=None, out=None,
         norm_weight: torch.Tensor = None, norm_eps: float = 0.0, residual: torch.Tensor = None,
         gated: bool = False, pack_x: bool = None, compile_only: bool = False) -> torch.Tensor:
    """y = residual + prologue(x) @ W.T for x of shape (batch <= 16, in); W given as (values, mask);
    y in x's dtype.

    The optional prologue and epilogue are the work around a decode step's linear layers, done
    in this kernel instead of kernels of their own (one launch each per layer saved):
    - norm_weight (in,): x -> RMSNorm(x) * norm_weight, with norm_eps;
    - gated: x is (batch, 2 * in), [gate | up], and the layer's input is silu(gate) * up;
    - residual (batch, out): added to the result.
    config: (slices, words per warp, prefetch) instead of the tuned choice; out: optional (batch,
    out_features) buffer to write into (tests poison it); pack_x: round x (after the prologue) to
    bf16 and shuffle two rows of it at a time, instead of `packs_x`'s choice (needs 2+ rows);
    compile_only: compile the kernel for these operands and config, launch nothing (y unwritten).
    """
    batch, x_width = x.shape
    n_words, n_rows = mask.shape
    in_features = n_words * 32
    if x_width != in_features * (2 if gated else 1) or batch > MAX_SPMV_BATCH:
        raise ValueError(f"spmv: x {tuple(x.shape)} does not fit a packed weight with in_features={in_features}"
                         f"{' (gated: x holds gate and up, 2 x in_features wide)' if gated else ''}")
    if norm_weight is not None and gated:
        raise ValueError("spmv: the prologue is either a norm or gated, not both")
    if norm_weight is not None and norm_weight.shape != (in_features, ):
        raise ValueError(f"spmv: norm weight {tuple(norm_weight.shape)} does not match in_features={in_features}")
    if residual is not None and residual.shape != (batch, n_rows):
        raise ValueError(f"spmv: residual {tuple(residual.shape)} does not match the output ({batch}, {n_rows})")
    chunks, _, chunk = values.shape
    nnz = chunks * chunk // n_words
    if nnz & (nnz - 1):
        raise ValueError(f"spmv needs a power-of-two number of kept weights per 32-bit word, got {nnz}")
    operands = [t for t in (x, values, mask, norm_weight, residual) if t is not None]
    if values.data_ptr() % 16 or not all(t.is_contiguous() for t in operands):
        raise ValueError("spmv needs contiguous operands, with values 16-byte aligned")
    pack_x = packs_x(x) if pack_x is None else pack_x
    if pack_x and batch < 2:
        raise ValueError("spmv: packing x in pairs of rows needs at least 2 rows")
    slices, words_per_warp, prefetch = config or spmv_config(x, values, mask, pack_x, norm_weight is not None, gated,
                                                             residual is not None)
    if prefetch > words_per_warp:
        raise ValueError(f"spmv: a prefetch of {prefetch} words needs at least as many words per warp")
    split = triton.cdiv(n_words, slices * words_per_warp)
    row_blocks = triton.cdiv(n_rows, 32)
    # the partial products, then (NORM) each row block's sums of squares
    workspace, arrivals = _workspace(x.device, batch * n_rows + row_blocks * triton.next_power_of_2(batch), row_blocks)
    y = torch.empty(batch, n_rows, dtype=x.dtype, device=x.device) if out is None else out
    pdl = programmatic_launch(x.device)
    # a word of every warp: 32 rows each, their kept values and mask word
    l2_words = l2_prefetch_words(row_blocks * split * slices * 32 * (nnz * values.element_size() + 4),
                                 words_per_warp) if pdl else 0
    _spmv_kernel.run(  # kernel[grid](...), or only its compile (Triton's warmup)
        x, values, mask, y, workspace, arrivals, x if norm_weight is None else norm_weight,
        x if residual is None else residual, n_rows, n_words, words_per_warp, batch, x_width, norm_eps, l2_words,
        NNZ=nnz, CHUNK=chunk, BATCH=triton.next_power_of_2(batch), SLICES=slices, PREFETCH=prefetch,
        EVEN_K=n_words % (slices * words_per_warp) == 0, NORM=norm_weight is not None,
        RESIDUAL=residual is not None, GATED=gated, PACKED_X=pack_x, PDL=pdl, INTERPRETER_SAFE=INTERPRETING,
        num_warps=slices, launch_pdl=pdl, grid=(row_blocks, split), warmup=compile_only)
    return y


def programmatic_launch(device: torch.device) -> bool:
    """Whether kernels on `device` launch as programmatic dependent launches with the L2 prefetch
    (PDL_L2_PREFETCH_BYTES on, a Hopper or later GPU, not the interpreter)."""
    return PDL_L2_PREFETCH_BYTES > 0 and device.type == "cuda" and not INTERPRETING and hopper_or_later(device.index)


@functools.lru_cache(maxsize=None)
def hopper_or_later(index: int) -> bool:
    """griddepcontrol (PDL) is sm_90 PTX."""
    return torch.cuda.get_device_capability(index)[0] >= 9


def l2_prefetch_words(bytes_a_word: int, words_per_warp: int) -> int:
    """Words each warp of a grid prefetches into the L2 before its PDL wait, where one word of
    every warp's rows (kept values and mask words) is `bytes_a_word`: as many as
    PDL_L2_PREFETCH_BYTES covers, at most the warp's words."""
    return min(words_per_warp, PDL_L2_PREFETCH_BYTES // bytes_a_word)


@contextlib.contextmanager
def pdl_l2_prefetch(budget_bytes: int):
    """PDL_L2_PREFETCH_BYTES set to budget_bytes inside the block (0: plain launches), restored
    after it whatever happens: for benchmarks that time the same tuned configs both ways."""
    global PDL_L2_PREFETCH_BYTES
    saved, PDL_L2_PREFETCH_BYTES = PDL_L2_PREFETCH_BYTES, int(budget_bytes)
    try:
        yield
    finally:
        PDL_L2_PREFETCH_BYTES = saved


def unpack_to_dense(values: torch.Tensor, mask: torch.Tensor, out=None, config=None, rows=None) -> torch.Tensor:
    """Dense (out, in) weight from (values, mask), on the device (graph-capturable).

    config: (rows, words) or (rows, words, warps) per program instead of the default.
    rows: (first, end) to expand only those rows, into an (end - first, in) result.
    """
    n_words, row_stride = mask.shape
    first, end = rows or (0, row_stride)
    if not 0 <= first < end <= row_stride:
        raise ValueError(f"unpack_to_dense: rows {first}..{end} are not inside the weight's {row_stride}")
    n_rows = end - first
    chunks, _, chunk = values.shape
    nnz = chunks * chunk // n_words
    dense = torch.empty(n_rows, n_words * 32, dtype=values.dtype, device=values.device) if out is None else out
    block_rows, words_per_program, warps = (*config, 4)[:3] if config else ((16, 2, 4) if INTERPRETING else (64, 4, 4))
    grid = (triton.cdiv(n_rows, block_rows), triton.cdiv(n_words, words_per_program))
    # The pointers start at row `first`: its offset inside each word's rows (row_stride apart).
    _unpack_kernel[grid](values[:, first:], mask[:, first:], dense, n_rows, row_stride, n_words, NNZ_PER_WORD=nnz,
                         CHUNK=chunk, BLOCK_ROWS=block_rows, WORDS_PER_PROGRAM=words_per_program, num_warps=warps)
    return dense
