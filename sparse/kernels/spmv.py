"""The bitmask SpMV on the CUDA cores: y = x @ W.T for 1 to 16 rows of x (format: sparse/format.py).

Each thread owns one output row. The 32 threads of a warp walk the same mask word k of 32
neighbouring rows, so at every step they need x from the same 32-column chunk: lane j holds
x[32k + j] in a register, and a warp shuffle hands each thread the element its column asks for,
with no address arithmetic and no memory access per kept weight. Per word a thread loads the mask
word and its kept values (16-byte loads), then runs a fixed number of steps (kept weights per word,
a constexpr): take the lowest set bit's column, shuffle x from that lane, multiply by the next
value, clear the bit. In PyTorch terms, for one row r and word k:

    word = mask[k, r]; kept = values of word k of row r (in column order)
    for value in kept:
        column = lowest_set_bit(word); word &= word - 1
        y[:, r] += value * x[:, 32 * k + column]

That is six instructions a kept weight at batch 1 (bit scan, shuffle, widen, FMA), well under what
the H200 can issue per kept weight at full memory bandwidth; instruction count per kept weight, not
bytes, is what limits this kernel (docs/KERNELS.md). With `pack_x` two rows of x share a lane
register as bf16, so one shuffle serves both. The loads of the next one or two words (PREFETCH) are
issued before the current word is multiplied.

The warps of a program take consecutive slices of K for the same rows and are summed through shared
memory; programs may split K further (the split-K workspace, sparse/kernels/common.py). Slices,
words per warp and prefetch are tuned per (out, in, batch) and fusion (`spmv_config`).

Around the product the SpMV can do a decode step's small ops that would otherwise each be a kernel
launch: RMSNorm of x (the norm weight multiplies x's lanes as they are loaded, and each thread adds
up the squares of the lanes it loads; 1/rms factors out of the row sum, so the program that stores a
row applies it from those sums), silu(gate) * up for x = [gate | up], and a residual added before
the store.

With INTERPRETER_SAFE (the CPU interpreter) the kernel uses plain loads instead of the vector loads,
a gather of x across the program instead of the shuffle, and a bit scan that reads the lowest set
bit's index from the float32 exponent of (w & -w), exact for a power of two.
"""
import torch
import triton
import triton.language as tl

from sparse.kernels.common import (INTERPRETING, MAX_DECODE_ROWS, load_u32, replace_item, silu, bf16_bits,
                                   split_k_workspace, sum_splits)
from sparse.kernels.tuning import tuned_config

MAX_ROWS = MAX_DECODE_ROWS
tuned_configs = {}  # (out, words, rows rounded up to a power of two, dtype, pack_x, fusion, device) -> config


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
            acc = replace_item(acc, 2 * p, acc[2 * p] + value * (bits << 16).to(tl.float32, bitcast=True))
            acc = replace_item(acc, 2 * p + 1,
                           acc[2 * p + 1] + value * (bits & 0xFFFF0000).to(tl.float32, bitcast=True))
        else:
            acc = replace_item(acc, p, acc[p] + value * bits.to(tl.float32, bitcast=True))
    return acc, word


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
    word = _prepare_word(load_u32(mask_u32 + k * n_rows + rows, 1, INTERPRETER_SAFE)[0], INTERPRETER_SAFE)
    tile = ()
    for c in tl.static_range(CHUNKS):
        tile = tile + load_u32(values_u32 + ((k * CHUNKS + c) * n_rows + rows) * U32_PER_CHUNK, U32_PER_CHUNK,
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
            squares = replace_item(squares, b, squares[b] + (x * x if EVEN_K else tl.where(valid, x * x, 0.0)))
        if GATED:
            x = silu(x, INTERPRETER_SAFE) * _load_lane(row + n_words * 32 + column, INTERPRETER_SAFE)
        if NORM:
            x = x * scale
        bits = x.to(tl.uint32, bitcast=True)
        if PACKED_X:  # rows 2p and 2p + 1 share a register: bf16 bits in the low and the high half
            bits = bf16_bits(bits)
            if b % 2 == 1:
                bits = x_lanes[b // 2] | (bits << 16)
                x_lanes = x_lanes[:b // 2]
        x_lanes = x_lanes + (bits if EVEN_K else tl.where(valid, bits, 0), )
    return word, tile, x_lanes, valid, squares


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
def spmv_kernel(x_ptr, values_ptr, mask_ptr, y_ptr, workspace_ptr, arrivals_ptr, norm_ptr, residual_ptr,
                n_rows, n_words, words_per_warp, batch_rows, x_stride, norm_eps,
                NNZ: tl.constexpr, CHUNK: tl.constexpr, BATCH: tl.constexpr, SLICES: tl.constexpr,
                PREFETCH: tl.constexpr, EVEN_K: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr,
                GATED: tl.constexpr, PACKED_X: tl.constexpr, INTERPRETER_SAFE: tl.constexpr):
    """y[:batch_rows, rows] = residual + prologue(x) @ W[rows].T for the 32 rows of this program's
    row block (`spmv` says what the optional prologue and residual are).

    Grid (row blocks, K splits); SLICES warps per program, warp s walking words_per_warp words
    from (split · SLICES + s) · words_per_warp. BATCH: batch_rows rounded up to a power of two."""
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
    total, last = sum_splits(acc, workspace_ptr, arrivals_ptr, tl.program_id(0), out_offsets, out_ok,
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


def spmv_config(x: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, pack_x: bool = False, norm: bool = False,
                gated: bool = False, residual: bool = False):
    """The fastest candidate config for this (out, in, batch) and this fusion (norm / gated /
    residual, as spmv takes them), timed once and remembered.

    Timed as a compiled decode step runs it (sparse/kernels/tuning.py). The fused call is timed
    itself: the plain product's near-ties are not the fused call's.
    """
    n_words, n_rows = mask.shape
    fusion = "+".join(name for name, on in (("norm", norm), ("gated", gated), ("residual", residual)) if on)
    key = (n_rows, n_words, triton.next_power_of_2(x.shape[0]), values.dtype, pack_x, fusion, x.device)
    if key in tuned_configs:
        return tuned_configs[key]
    batch, in_features = x.shape[0], n_words * 32
    x = torch.randn(batch, x.shape[1], dtype=x.dtype, device=x.device)
    operands = dict(gated=gated, pack_x=pack_x, norm_eps=1e-5,
                    norm_weight=torch.ones(in_features, dtype=x.dtype, device=x.device) if norm else None,
                    residual=torch.zeros(batch, n_rows, dtype=x.dtype, device=x.device) if residual else None)
    return tuned_config(tuned_configs, key, candidate_configs(n_rows, n_words, batch), x, values, mask,
                        lambda config, v, m: spmv(x, v, m, config=config, **operands),
                        lambda config: spmv(x, values, mask, config=config, compile_only=True, **operands))


def spmv(x: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, config=None, out=None,
         norm_weight: torch.Tensor = None, norm_eps: float = 0.0, residual: torch.Tensor = None,
         gated: bool = False, pack_x: bool = False, compile_only: bool = False) -> torch.Tensor:
    """y = residual + prologue(x) @ W.T for x of shape (batch <= 16, in); W given as (values, mask);
    y in x's dtype.

    The optional prologue and epilogue are the work around a decode step's linear layers, done
    in this kernel instead of kernels of their own (one launch each per layer saved):
    - norm_weight (in,): x -> RMSNorm(x) * norm_weight, with norm_eps;
    - gated: x is (batch, 2 * in), [gate | up], and the layer's input is silu(gate) * up;
    - residual (batch, out): added to the result.
    config: (slices, words per warp, prefetch) instead of the tuned choice; out: optional (batch,
    out_features) buffer to write into (tests poison it); pack_x: round x (after the prologue) to
    bf16 and shuffle two rows of it at a time (needs 2+ rows; sparse/linear.py decides from when);
    compile_only: compile the kernel for these operands and config, launch nothing (y unwritten).
    """
    batch, x_width = x.shape
    n_words, n_rows = mask.shape
    in_features = n_words * 32
    if x_width != in_features * (2 if gated else 1) or batch > MAX_ROWS:
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
    if pack_x and batch < 2:
        raise ValueError("spmv: packing x in pairs of rows needs at least 2 rows")
    slices, words_per_warp, prefetch = config or spmv_config(x, values, mask, pack_x, norm_weight is not None, gated,
                                                             residual is not None)
    if prefetch > words_per_warp:
        raise ValueError(f"spmv: a prefetch of {prefetch} words needs at least as many words per warp")
    split = triton.cdiv(n_words, slices * words_per_warp)
    row_blocks = triton.cdiv(n_rows, 32)
    # the partial products, then (NORM) each row block's sums of squares
    workspace, arrivals = split_k_workspace(x.device, batch * n_rows + row_blocks * triton.next_power_of_2(batch),
                                            row_blocks)
    y = torch.empty(batch, n_rows, dtype=x.dtype, device=x.device) if out is None else out
    spmv_kernel.run(  # kernel[grid](...), or only its compile (Triton's warmup)
        x, values, mask, y, workspace, arrivals, x if norm_weight is None else norm_weight,
        x if residual is None else residual, n_rows, n_words, words_per_warp, batch, x_width, norm_eps,
        NNZ=nnz, CHUNK=chunk, BATCH=triton.next_power_of_2(batch), SLICES=slices, PREFETCH=prefetch,
        EVEN_K=n_words % (slices * words_per_warp) == 0, NORM=norm_weight is not None,
        RESIDUAL=residual is not None, GATED=gated, PACKED_X=pack_x, INTERPRETER_SAFE=INTERPRETING,
        num_warps=slices, grid=(row_blocks, split), warmup=compile_only)
    return y
