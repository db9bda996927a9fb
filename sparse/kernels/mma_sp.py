"""2:4 product on the sparse tensor cores: y = x @ W.T for 1 to 16 rows of bf16 x with Hopper's
(and Ampere's) warp-level `mma.sp` (m16n8k32: 16 weight rows x 32 input columns, of which the
instruction reads only the 16 kept values a row, against 8 rows of x), issued as inline PTX from
Triton, which has no sparse dot of its own.

Why: the SpMV (sparse/kernels/spmv.py) spends its instructions per kept weight on the bit scan,
shuffles and FMAs, several times more at 8 rows than at 1. One `mma.sp` does 256 kept weights x 8
rows; around it a thread issues two 8-byte value loads, two mask words, four 4-byte loads of x (L1
hits) and a few integer instructions that turn the two mask words into the instruction's metadata,
so its instructions per kept weight stay low and nearly flat up to 8 rows (docs/KERNELS.md). 2:4
only: the tensor cores take exactly two kept values in every aligned group of four columns, which
4:8 and wider patterns do not promise. As the SpMV, it can take a prologue, the RMSNorm (x times the
norm weight, rounded to bf16, before the instruction; 1/rms, from the squares of the x it loaded,
applied to the output) or silu(gate) * up (x = [gate | up], rounded to bf16), and a residual after
the product.

The instruction's fragments (PTX ISA, "Matrix Fragments for sparse mma.m16n8k32 with .f16 and
.bf16 types"), for thread (g, t) = (lane // 4, lane % 4) of a warp:
  A (16 rows x 32 columns, two kept in each group of four): a0 = row g, group t (its two kept
      values, a bf16 pair), a1 = row g + 8, group t, a2 / a3 = rows g / g + 8, group 4 + t;
  B (32 x 8, x^T): b_j = x[row g, columns 8j + 2t, 8j + 2t + 1] for j = 0..3;
  e (metadata, selector 0: threads t = 0 and 1): per group of four columns the two kept
      positions' 2-bit indices, first in the low bits; t = 0: groups 0-3 of row g (bits 0-15)
      and of row g + 8 (bits 16-31); t = 1: groups 4-7 (as Triton-XLA's SparseDot lowering reads
      the ISA's figure);
  C/D: d0, d1 = row g, x rows 2t and 2t + 1; d2, d3 = row g + 8, the same x rows.
Same buffers as the SpMV, no new format (sparse/format.py): the registers are filled straight
from the packed layout with the instruction's K order permuted so that each thread's A registers
are four consecutive kept values of a row (`_word_pointers`), and the metadata is computed from
the bitmask in registers (`_thread_metadata`). Kept values are stored in column order, so the two
of each group of four are consecutive, as mma.sp takes them. Under TRITON_INTERPRET=1 the same
kernel runs with `_mma_sp_emulated`, which computes each thread's D from the other threads'
fragments by this layout (gathers across the warp), so the CPU tests check the fragments, the
permutation, the metadata and everything around them; the GPU tests check that the hardware
reads the fragments the same way.

x in fragment order (X_FRAG, `spmv_2of4_fragments`, 8-16 rows): read row-major, a thread's four B
registers are four 4-byte loads a block of 8 x rows, each warp-wide load touching 8 rows' lines;
at 16 rows 8 loads a word against a tile's 4 weight loads. Given x repacked word-major, each
word's pairs permuted so that thread t's four are consecutive (`fragment_order`, a reshape and a
permute that Inductor can fuse into the kernel producing x), a block is one 16-byte load of 512
contiguous bytes a warp. Prologues and the residual stay on the row-major path (they run apart
from the product at these rows anyway).
"""
import torch
import triton
import triton.language as tl

from sparse.kernels.common import INTERPRETING, MAX_DECODE_ROWS, bf16_bits, load_u32, replace_item, silu
from sparse.kernels.tuning import tuned_config

MAX_ROWS = MAX_DECODE_ROWS  # two m16n8k32 instructions per tile and word
TILE_ROWS = 16  # weight rows of one m16n8k32 instruction: a weight needs at least one tile
tuned_configs = {}  # (mask shape, rows of x, prologue, device) -> config


@triton.jit
def metadata_of(word):
    """mma.sp's metadata for a 32-column mask word with two set bits in every aligned nibble: each
    nibble b3b2b1b0 becomes (second index << 2) | first index, computed for all eight nibbles at
    once (bitwise within nibbles, no carries across them).

    first = 0 if b0 else 1 if b1 else 2; second = 3 if b3 else 2 if b2 else 1."""
    ones = 0x11111111
    b0 = word & ones
    b1 = (word >> 1) & ones
    b2 = (word >> 2) & ones
    b3 = (word >> 3) & ones
    first_low = b1 & (b0 ^ ones)  # XOR with `ones` is NOT within the nibbles' low bits (the
    first_high = (b0 | b1) ^ ones  # interpreter has no ~ on uint32)
    second_low = b3 | (b2 ^ ones)
    second_high = b3 | b2
    return first_low | (first_high << 1) | (second_low << 2) | (second_high << 3)


@triton.jit
def _load_x_pair(ptr, INTERPRETER_SAFE: tl.constexpr):
    """The uint32 (a bf16 pair of x) at each thread's ptr, through L1 (.ca): every warp reads x.
    (The weights' loads stream through L2 only: load_u32.)"""
    if INTERPRETER_SAFE:
        pair = tl.load(ptr)
    else:
        pair = tl.inline_asm_elementwise("ld.global.ca.u32 $0, [$1];", "=r,l", [ptr], dtype=tl.uint32, is_pure=True,
                                         pack=1)
    return pair


@triton.jit
def _bytes_0_and_2(low, high, INTERPRETER_SAFE: tl.constexpr):
    """Bytes 0 and 2 of `low`, then bytes 0 and 2 of `high`, as one uint32 (one PRMT)."""
    if INTERPRETER_SAFE:
        picked = (low & 0xFF) | ((low >> 8) & 0xFF00) | ((high & 0xFF) << 16) | ((high << 8) & 0xFF000000)
    else:
        picked = tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x6420;", "=r,r,r", [low, high], dtype=tl.uint32,
                                           is_pure=True, pack=1)
    return picked


@triton.jit
def _thread_metadata(word_low, word_high, ODD, INTERPRETER_SAFE: tl.constexpr):
    """The metadata register of a thread (selector 0): the even (ODD false) or odd groups of four
    columns of its rows g (word_low: bits 0-15) and g + 8 (word_high: bits 16-31), four nibbles
    each in group order. The two rows' chosen nibbles are interleaved into one word first, so one
    `metadata_of` serves both; ODD may differ per thread."""
    shift = tl.where(ODD, 4, 0).to(tl.uint32)
    nibbles = 0x0F0F0F0F
    both = metadata_of(((word_low >> shift) & nibbles) | (((word_high >> shift) & nibbles) << 4))
    low = both & nibbles  # row g's four nibbles, one a byte
    high = (both >> 4) & nibbles
    low = (low | (low >> 4)) & 0x00FF00FF  # two a byte, in bytes 0 and 2
    high = (high | (high >> 4)) & 0x00FF00FF
    return _bytes_0_and_2(low, high, INTERPRETER_SAFE)


@triton.jit
def _half(bits, HIGH):
    """float32 of the bf16 in the low (HIGH false) or high half of each uint32; HIGH may differ per
    thread."""
    return tl.where(HIGH, bits & 0xFFFF0000, bits << 16).to(tl.float32, bitcast=True)


@triton.jit
def _from_lane(bits, lane):
    """Each thread's view of `bits` as held by `lane` of its own warp (a gather across the program)."""
    thread = tl.arange(0, bits.shape[0])
    return tl.gather(bits, thread // 32 * 32 + lane, 0)


@triton.jit
def _mma_sp_emulated(a, b, c, e):
    """What `mma.sp.sync.aligned.m16n8k32.row.col.f32.bf16.bf16.f32 d, a, b, c, e, 0` leaves in each
    thread's d (a tuple of 4 float32), computed from every thread's fragments by the layout in the
    module docstring, for the interpreter: the sum runs over the 16 kept values of each of the
    thread's two rows, each multiplied by x at the column its metadata names."""
    lane = tl.arange(0, a[0].shape[0]) % 32
    g = lane // 4
    t = lane % 4
    d = c
    for upper in tl.static_range(2):  # d0, d1: row g; d2, d3: row g + 8
        for kept in tl.static_range(16):  # the row's compressed column
            group = kept // 2  # its group of four columns
            value = _half(_from_lane(a[2 * (kept // 8) + upper], g * 4 + (kept % 8) // 2), kept % 2 == 1)
            meta = _from_lane(e, g * 4 + group // 4)  # thread t = group // 4 holds this half of K
            nibble = (meta >> (16 * upper + 4 * (group % 4))) & 0xF
            column = 4 * group + ((nibble >> (2 * (kept % 2))) & 3)  # 0..31
            for n in tl.static_range(2):  # x rows 2t and 2t + 1
                # x[2t + n, column] is b[column // 8] of lane (2t + n) * 4 + (column % 8) // 2
                owner = (2 * t + n) * 4 + (column % 8) // 2
                reg = column // 8
                pair = tl.where(reg == 0, _from_lane(b[0], owner),
                                tl.where(reg == 1, _from_lane(b[1], owner),
                                         tl.where(reg == 2, _from_lane(b[2], owner), _from_lane(b[3], owner))))
                x = _half(pair, column % 2 == 1)
                index = 2 * upper + n
                d = d[:index] + (d[index] + value * x, ) + d[index + 1:]
    return d


@triton.jit
def _mma_sp(a, b, c, e, INTERPRETER_SAFE: tl.constexpr):
    """d = A·B + C on the sparse tensor cores (16 x 32 of W, 2:4, times 32 x 8 of x^T), each thread
    passing its fragments (tuples of uint32 a, b; float32 c; metadata e)."""
    if INTERPRETER_SAFE:
        d = _mma_sp_emulated(a, b, c, e)
    else:
        d = tl.inline_asm_elementwise(
            "mma.sp::ordered_metadata.sync.aligned.m16n8k32.row.col.f32.bf16.bf16.f32 "
            "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9, $10, $11}, {$12, $13, $14, $15}, $16, 0x0;",
            "=f,=f,=f,=f,r,r,r,r,r,r,r,r,f,f,f,f,r", [a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3], c[0], c[1],
                                                     c[2], c[3], e],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
    return d


@triton.jit
def _word_pointers(values_u32, mask_u32, x_u32, norm_u32, k, row, t, x_rows, n_rows, n_words, x_stride_u32,
                   N_BLOCKS: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr, X_FRAG: tl.constexpr):
    """Where the thread's loads of word k start: ((its values in `row`, row g of the program's first
    tile, and its mask word there: the rows g and g + 8 of every tile are constant offsets from
    these, so one 64-bit register each addresses them all), (x's sources: x at B register 0 of each
    block of 8 x rows; with GATED those are the gate's columns and the up half's follow, block by
    block; with NORM the norm weight at the same columns last; with X_FRAG x in `fragment_order`,
    where thread t's four pairs of a block are the consecutive uint32 4t..4t+3)).

    The instruction's K order is a permutation of the word's columns, chosen so that a thread's A
    registers are four consecutive kept values of a row (one 8-byte load a row instead of two
    4-byte ones): the instruction's group of four columns q is the word's group 2q (q < 4) or
    2(q - 4) + 1, so thread t's a0, a2 (groups t and 4 + t) are the word's groups 2t and 2t + 1,
    kept values 4t..4t+3: chunk t // 2 of the row, its uint32 2(t % 2) and 2(t % 2) + 1. The
    metadata follows (`_thread_metadata`: t = 0 the even groups, t = 1 the odd) and so does x: B
    register j holds K rows 8j + 2t, + 1, in group 2j + t // 2, which is at the word's column
    8(t // 2) + 2(t % 2) + (0, 16, 4, 20)[j], i.e. uint32 4(t // 2) + t % 2 + (0, 8, 2, 10)[j]."""
    first = ((2 * k + t // 2) * n_rows) * 4 + 2 * (t % 2)
    weights = (values_u32 + first + row * 4, mask_u32 + k * n_rows + row)
    x_pointers = ()
    if X_FRAG:  # x repacked word-major in fragment order: [word][8 N_BLOCKS rows][16 uint32]
        for source in tl.static_range(N_BLOCKS):
            x_pointers = x_pointers + (x_u32 + (k * 8 * N_BLOCKS + x_rows[source]) * 16 + 4 * t, )
    else:
        for source in tl.static_range(N_BLOCKS * (1 + GATED) + NORM):
            if source < N_BLOCKS * (1 + GATED):  # a block of x rows (with GATED, the up half)
                start = x_u32 + x_rows[source % N_BLOCKS] * x_stride_u32 + (source // N_BLOCKS) * n_words * 16
            else:
                start = norm_u32
            x_pointers = x_pointers + (start + k * 16 + 4 * (t // 2) + t % 2, )
    return weights, x_pointers


@triton.jit
def _load_word(pointers, valid, M_TILES: tl.constexpr, SOURCES: tl.constexpr, EVEN_K: tl.constexpr,
               INTERPRETER_SAFE: tl.constexpr, X_FRAG: tl.constexpr):
    """The fragments at `pointers` (`_word_pointers`): (a of each tile, its two mask words of rows g
    and g + 8 as loaded, four bf16 pairs of each of x's SOURCES). The mask words become metadata,
    and the sources b, only when the word is multiplied (`_multiply`), so that a load a few words
    ahead waits nowhere before then. Unless EVEN_K, the sources are zeroed where not `valid` (a word
    past the end, read at the last word)."""
    weights, x_pointers = pointers
    a = ()
    masks = ()
    for m in tl.static_range(M_TILES):
        low = load_u32(weights[0] + 64 * m, 2, INTERPRETER_SAFE)  # row g of tile m: 16 m rows of 4 uint32 on
        high = load_u32(weights[0] + 64 * m + 32, 2, INTERPRETER_SAFE)
        a = a + (low[0], high[0], low[1], high[1])
        masks = masks + (load_u32(weights[1] + 16 * m, 1, INTERPRETER_SAFE)[0],
                         load_u32(weights[1] + 16 * m + 8, 1, INTERPRETER_SAFE)[0])
    b = ()
    if X_FRAG:
        for source in tl.static_range(SOURCES):
            if INTERPRETER_SAFE:
                quad = load_u32(x_pointers[source], 4, INTERPRETER_SAFE)
            else:  # cached in L1 (.ca) as `_load_x_pair`: every program reads the same x
                quad = tl.inline_asm_elementwise("ld.global.ca.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l",
                                                 [x_pointers[source]], dtype=(tl.uint32, tl.uint32, tl.uint32,
                                                                              tl.uint32), is_pure=True, pack=1)
            for j in tl.static_range(4):
                b = b + (quad[j] if EVEN_K else tl.where(valid, quad[j], 0), )
    else:
        for source in tl.static_range(SOURCES):
            for j in tl.static_range(4):
                pair = _load_x_pair(x_pointers[source] + 8 * (j % 2) + 2 * (j // 2), INTERPRETER_SAFE)
                b = b + (pair if EVEN_K else tl.where(valid, pair, 0), )
    return a, masks, b


@triton.jit
def _advance(pointers, n_rows, SOURCES: tl.constexpr, X_STEP: tl.constexpr):
    """`_word_pointers` of the next word."""
    weights, x_pointers = pointers
    step = 8 * n_rows  # uint32 of values a word: two chunks of 4 per row
    next_weights = (weights[0] + step, weights[1] + n_rows)
    next_x = ()
    for source in tl.static_range(SOURCES):
        next_x = next_x + (x_pointers[source] + X_STEP, )
    return next_weights, next_x


@triton.jit
def _bf16_pair(low, high, INTERPRETER_SAFE: tl.constexpr):
    """Two float32 rounded to bf16 (to nearest, ties to even) in one uint32, `low` in bits 0-15."""
    if INTERPRETER_SAFE:
        pair = bf16_bits(low.to(tl.uint32, bitcast=True)) | (bf16_bits(high.to(tl.uint32, bitcast=True)) << 16)
    else:
        pair = tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,f,f", [low, high], dtype=tl.uint32,
                                         is_pure=True, pack=1)
    return pair


@triton.jit
def _bf16_product(pair, weight, INTERPRETER_SAFE: tl.constexpr):
    """The two bf16 of `pair` times those of `weight`, each rounded to bf16 (to nearest, ties to
    even: the float32 product of two bf16 is exact, so rounding it once is the bf16 product), one
    instruction on the GPU."""
    if INTERPRETER_SAFE:
        product = _bf16_pair(_half(pair, False) * _half(weight, False), _half(pair, True) * _half(weight, True),
                             INTERPRETER_SAFE)
    else:
        product = tl.inline_asm_elementwise("mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [pair, weight], dtype=tl.uint32,
                                            is_pure=True, pack=1)
    return product


@triton.jit
def _normed_x(b, squares, N_BLOCKS: tl.constexpr, INTERPRETER_SAFE: tl.constexpr):
    """b (x's pairs of each block, then the norm weight's four) -> (x times the norm weight as bf16
    pairs, squares + each block's x^2). The norm's 1/rms factors out of the row sum: applied at the
    end (as the SpMV's fused norm does)."""
    normed = ()
    for block in tl.static_range(N_BLOCKS):
        for j in tl.static_range(4):
            pair = b[4 * block + j]
            low, high = _half(pair, False), _half(pair, True)
            squares = replace_item(squares, block, squares[block] + low * low + high * high)
            normed = normed + (_bf16_product(pair, b[4 * N_BLOCKS + j], INTERPRETER_SAFE), )
    return normed, squares


@triton.jit
def _gated_x(b, N_BLOCKS: tl.constexpr, INTERPRETER_SAFE: tl.constexpr):
    """b (the gate's pairs of each block, then the up half's) -> silu(gate) * up as bf16 pairs."""
    gated = ()
    for i in tl.static_range(4 * N_BLOCKS):
        gate, up = b[i], b[4 * N_BLOCKS + i]
        gated = gated + (_bf16_pair(silu(_half(gate, False), INTERPRETER_SAFE) * _half(up, False),
                                    silu(_half(gate, True), INTERPRETER_SAFE) * _half(up, True), INTERPRETER_SAFE), )
    return gated


@triton.jit
def _multiply(acc, squares, word, t, M_TILES: tl.constexpr, N_BLOCKS: tl.constexpr, NORM: tl.constexpr,
              GATED: tl.constexpr, INTERPRETER_SAFE: tl.constexpr):
    """One instruction per tile and block of 8 x rows for a `_load_word` word; acc holds 4 float32
    per (tile, block); first, with NORM, x times the norm weight, and its squares added up; with
    GATED, silu(gate) * up."""
    a, masks, b = word
    if NORM:
        b, squares = _normed_x(b, squares, N_BLOCKS, INTERPRETER_SAFE)
    if GATED:
        b = _gated_x(b, N_BLOCKS, INTERPRETER_SAFE)
    for m in tl.static_range(M_TILES):
        e = _thread_metadata(masks[2 * m], masks[2 * m + 1], t % 2 == 1, INTERPRETER_SAFE)
        for block in tl.static_range(N_BLOCKS):
            acc = (acc[:4 * (m * N_BLOCKS + block)]
                   + _mma_sp(a[4 * m:4 * m + 4], b[4 * block:4 * block + 4],
                             acc[4 * (m * N_BLOCKS + block):4 * (m * N_BLOCKS + block) + 4], e, INTERPRETER_SAFE)
                   + acc[4 * (m * N_BLOCKS + block) + 4:])
    return acc, squares


@triton.jit
def _next_pointers(pointers, values_u32, mask_u32, x_u32, norm_u32, k, row, t, x_rows, n_rows, n_words,
                   x_stride_u32, N_BLOCKS: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr,
                   EVEN_K: tl.constexpr, X_FRAG: tl.constexpr):
    """`_word_pointers` of word k, the word after `pointers`': with EVEN_K a constant step, otherwise
    found again, clamped to the last word (the words past the end are read there, x zeroed)."""
    if EVEN_K:
        pointers = _advance(pointers, n_rows, N_BLOCKS * (1 + GATED) + NORM, 128 * N_BLOCKS if X_FRAG else 16)
    else:
        pointers = _word_pointers(values_u32, mask_u32, x_u32, norm_u32, tl.minimum(k, n_words - 1), row, t, x_rows,
                                  n_rows, n_words, x_stride_u32, N_BLOCKS, NORM, GATED, X_FRAG)
    return pointers


@triton.jit
def _add_fours(a0, a1, a2, a3, b0, b1, b2, b3):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3


@triton.jit
def _summed_over_slices(parts, SLICES: tl.constexpr):
    """A tile and block's four accumulators ([32 * SLICES] each, warp s holding slice s of K), each
    summed over the slices ([32] each), in one reduction of the four: summed one at a time, each
    took a store, a load and three barriers."""
    return tl.reduce((tl.reshape(parts[0], (SLICES, 32)), tl.reshape(parts[1], (SLICES, 32)),
                      tl.reshape(parts[2], (SLICES, 32)), tl.reshape(parts[3], (SLICES, 32))), 0, _add_fours)


@triton.jit
def mma_sp_kernel(x_ptr, values_ptr, mask_ptr, y_ptr, residual_ptr, norm_ptr, n_rows, n_words, words_per_warp,
                  batch_rows, x_stride, norm_eps, SLICES: tl.constexpr, M_TILES: tl.constexpr,
                  N_BLOCKS: tl.constexpr, EVEN_K: tl.constexpr, UNROLL: tl.constexpr, PREFETCH: tl.constexpr,
                  NORM: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr, INTERPRETER_SAFE: tl.constexpr,
                  X_FRAG: tl.constexpr):
    """y[:batch_rows, M_TILES 16-row tiles] of this program (+ the residual's, with RESIDUAL; of
    RMSNorm(x) * the norm weight, with NORM; of silu(gate) * up for x = [gate | up], with GATED;
    x in `fragment_order`, with X_FRAG); SLICES warps, warp s walking words_per_warp words from
    s · words_per_warp for every tile (x's loads shared by the tiles), summed through shared memory."""
    THREADS: tl.constexpr = 32 * SLICES
    thread = tl.arange(0, THREADS)
    lane = thread % 32
    g = lane // 4
    t = lane % 4
    first_row = tl.program_id(0) * 16 * M_TILES
    # A program's tiles are one block of rows, so each thread addresses every tile's weights from one
    # pointer (a 64-bit pointer a row and tile filled the registers at 16 rows). The last program's
    # block shifts back to end at the last row (n_rows >= 16 M_TILES); its rows before first_row
    # belong to the program before and are not stored.
    block_row = tl.minimum(first_row, n_rows - 16 * M_TILES)
    row_g = block_row + g  # the thread's row g of the program's first tile
    k_first = (thread // 32) * words_per_warp
    values_u32 = values_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    mask_u32 = mask_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    x_u32 = x_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    norm_u32 = norm_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    x_rows = ()  # the x row each thread's B fragment reads in each block of 8 (past the batch: the last)
    for block in tl.static_range(N_BLOCKS):
        x_rows = x_rows + (block * 8 + g if X_FRAG else tl.minimum(block * 8 + g, batch_rows - 1), )
    acc = ()
    for i in tl.static_range(4 * M_TILES * N_BLOCKS):
        acc = acc + (tl.zeros([THREADS], dtype=tl.float32), )
    squares = ()  # with NORM: each block's sum of x^2 (x row g of the block) over the thread's columns
    for block in tl.static_range(N_BLOCKS * NORM):
        squares = squares + (tl.zeros([THREADS], dtype=tl.float32), )

    # PREFETCH words ahead: word i + PREFETCH's loads are issued before word i's instructions, so a
    # warp has PREFETCH words' loads in flight (a warp walks its words one after another; with one
    # word ahead, a warp's time was about its words x the memory latency).
    x_stride_u32 = x_stride // 2
    SOURCES: tl.constexpr = N_BLOCKS * (1 + GATED) + NORM
    pointers = _word_pointers(values_u32, mask_u32, x_u32, norm_u32,
                              k_first if EVEN_K else tl.minimum(k_first, n_words - 1), row_g, t, x_rows, n_rows,
                              n_words, x_stride_u32, N_BLOCKS, NORM, GATED, X_FRAG)
    ahead = ()
    for d in tl.static_range(PREFETCH):
        ahead = ahead + (_load_word(pointers, k_first + d < n_words, M_TILES, SOURCES, EVEN_K, INTERPRETER_SAFE,
                                    X_FRAG), )
        pointers = _next_pointers(pointers, values_u32, mask_u32, x_u32, norm_u32, k_first + d + 1, row_g, t, x_rows,
                                  n_rows, n_words, x_stride_u32, N_BLOCKS, NORM, GATED, EVEN_K, X_FRAG)
    for i in tl.range(PREFETCH, words_per_warp, loop_unroll_factor=UNROLL):
        fresh = _load_word(pointers, k_first + i < n_words, M_TILES, SOURCES, EVEN_K, INTERPRETER_SAFE, X_FRAG)
        pointers = _next_pointers(pointers, values_u32, mask_u32, x_u32, norm_u32, k_first + i + 1, row_g, t, x_rows,
                                  n_rows, n_words, x_stride_u32, N_BLOCKS, NORM, GATED, EVEN_K, X_FRAG)
        acc, squares = _multiply(acc, squares, ahead[0], t, M_TILES, N_BLOCKS, NORM, GATED, INTERPRETER_SAFE)
        ahead = ahead[1:] + (fresh, )
    for d in tl.static_range(PREFETCH):
        acc, squares = _multiply(acc, squares, ahead[d], t, M_TILES, N_BLOCKS, NORM, GATED, INTERPRETER_SAFE)

    # d0, d1: row g with x rows 2t, 2t + 1; d2, d3: row g + 8 with the same x rows (per tile and block)
    out_lane = tl.arange(0, 32)
    out_g = out_lane // 4
    out_t = out_lane % 4
    inverse_rms = ()  # with NORM, per block and x row 2t / 2t + 1 of each lane: 1/rms of that row of x
    for block in tl.static_range(N_BLOCKS * NORM):
        sums = squares[block]
        if SLICES > 1:
            sums = tl.sum(tl.reshape(sums, (SLICES, 32)), axis=0)
        by_row = tl.sum(tl.reshape(sums, (8, 4)), axis=1)  # x row g of the block: its four threads' columns
        by_row = tl.reshape(tl.broadcast_to(by_row[:, None], (8, 4)), (32, ))  # lane l: row l // 4
        for n in tl.static_range(2):
            inverse_rms = inverse_rms + (tl.rsqrt(tl.gather(by_row, (2 * out_t + n) * 4, 0) / (n_words * 32)
                                                  + norm_eps), )
    for m in tl.static_range(M_TILES):
        for block in tl.static_range(N_BLOCKS):
            parts = (acc[4 * (m * N_BLOCKS + block)], acc[4 * (m * N_BLOCKS + block) + 1],
                     acc[4 * (m * N_BLOCKS + block) + 2], acc[4 * (m * N_BLOCKS + block) + 3])
            if SLICES > 1:  # the warps' slices of K, summed through shared memory
                parts = _summed_over_slices(parts, SLICES)
            for i in tl.static_range(4):
                part = parts[i]
                if NORM:
                    part = part * inverse_rms[2 * block + i % 2]
                row = block_row + 16 * m + out_g + 8 * (i // 2)
                x_row = block * 8 + 2 * out_t + i % 2
                ok = (row >= first_row) & (row < n_rows) & (x_row < batch_rows)
                if RESIDUAL:
                    part += tl.load(residual_ptr + x_row * n_rows + row, mask=ok, other=0.0).to(tl.float32)
                tl.store(y_ptr + x_row * n_rows + row, part.to(y_ptr.dtype.element_ty), mask=ok)


# (words ahead, unroll) pairs tuned. Unrolling removes the rotation of the prefetched registers.
# ptxas reorders the ring of prefetched words, so what it keeps in flight is not what the source
# asks for: one word ahead, some weight loads are first read in the word they were issued for and
# a warp waits on memory once a word; 4 ahead unrolled 4 times and 2 ahead unrolled twice keep
# every weight load 4 or 2 words from its first read (tests/test_sparse_kernels_mma_sp.py checks it).
PREFETCH_UNROLL = ((1, 2), (1, 4), (2, 2), (4, 4))


def candidate_configs(n_rows: int, n_words: int, batch: int):
    """(slices, words per warp, unroll, tiles, words ahead) for `batch` rows of x and a weight of
    n_rows x 32 n_words: the warps of a program split K evenly (K whole in a program); one to three
    16-row tiles a warp (more: more bytes in flight a warp, x's loads shared; three as well as two
    and four because the tile count decides how evenly a layer's programs cover the SMs), and above
    8 rows also four, since x's fragments then double and sharing them over more weight rows pays;
    no more tiles than n_rows fill (a program's tiles are one block of rows); 1, 2 or 4 words'
    loads in flight a warp (PREFETCH_UNROLL; no more than the warp's words), at most 8 tile-words
    (four tiles four words ahead spill)."""
    tile_counts = [tiles for tiles in ((1, 2, 3, 4) if batch > 8 else (1, 2, 3)) if TILE_ROWS * tiles <= n_rows]
    return [(slices, triton.cdiv(n_words, slices), unroll, tiles, ahead) for slices in (1, 2, 4, 8, 16)
            if slices <= n_words for ahead, unroll in PREFETCH_UNROLL if ahead <= triton.cdiv(n_words, slices)
            for tiles in tile_counts if tiles * ahead <= 8]


def spmv_2of4(x: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, config=None, out=None,
              residual: torch.Tensor = None, norm_weight: torch.Tensor = None, norm_eps: float = 0.0,
              gated: bool = False, compile_only: bool = False) -> torch.Tensor:
    """y = residual + x @ W.T on the sparse tensor cores for bf16 x of shape (batch <= 16, in) and a
    2:4 weight packed by sparse/format.py (residual: optional, (batch, out)), with at most one
    prologue, as the SpMV's: norm_weight (in,): x -> RMSNorm(x) * norm_weight, with norm_eps; gated:
    x is (batch, 2 * in) = [gate | up] -> silu(gate) * up. config: (slices, words per warp, unroll,
    tiles, words ahead), else the fastest of `candidate_configs` timed once per shape in a CUDA
    graph (on CPU: the first). compile_only: compile the kernel for these operands and config,
    launch nothing (y unwritten)."""
    batch, x_width = x.shape
    n_words, n_rows = mask.shape
    in_features = x_width // 2 if gated else x_width
    if x.dtype != torch.bfloat16 or values.dtype != torch.bfloat16:
        raise ValueError(f"spmv_2of4 takes bf16 x and values, got {x.dtype} and {values.dtype}")
    if x_width != n_words * 32 * (1 + gated) or not 1 <= batch <= MAX_ROWS:
        raise ValueError(f"spmv_2of4: x {tuple(x.shape)} does not fit a packed weight with in_features="
                         f"{n_words * 32}{' (gated: twice that)' if gated else ''} (1 to {MAX_ROWS} rows)")
    _check_weight("spmv_2of4", values, mask)
    if gated and norm_weight is not None:
        raise ValueError("spmv_2of4 takes one prologue: the norm or gated, not both")
    if residual is not None and tuple(residual.shape) != (batch, n_rows):
        raise ValueError(f"spmv_2of4: residual {tuple(residual.shape)} does not match the output ({batch}, {n_rows})")
    if norm_weight is not None and (tuple(norm_weight.shape) != (in_features, ) or norm_weight.dtype != torch.bfloat16):
        raise ValueError(f"spmv_2of4: norm weight {tuple(norm_weight.shape)} {norm_weight.dtype} is not bf16 "
                         f"({in_features},)")
    optional = tuple(t for t in (residual, norm_weight) if t is not None)
    if not all(t.is_contiguous() for t in (x, values, mask) + optional):
        raise ValueError("spmv_2of4 needs contiguous operands")
    y = torch.empty(batch, n_rows, dtype=x.dtype, device=x.device) if out is None else out
    _launch(x, values, mask, y, config or spmv_2of4_tuned(x, values, mask, norm_weight, norm_eps, gated), residual,
            norm_weight, norm_eps, gated, compile_only)
    return y


def _check_weight(caller: str, values: torch.Tensor, mask: torch.Tensor):
    """The packed weight's checks both entry points share: one tile of rows, 16 kept values a word."""
    n_words, n_rows = mask.shape
    if n_rows < TILE_ROWS:
        raise ValueError(f"{caller} needs a 2:4 weight of at least {TILE_ROWS} rows (one tile), got {n_rows}")
    if tuple(values.shape) != (2 * n_words, n_rows, 8):
        raise ValueError(f"{caller} needs a 2:4 weight (16 kept values a word): values {tuple(values.shape)}")


def _launch(x, values, mask, y, config, residual=None, norm_weight=None, norm_eps=0.0, gated=False,
            compile_only=False, fragment_rows=None):
    """The kernel on x (batch, width), or with fragment_rows on that many rows of x in `fragment_order`."""
    n_words, n_rows = mask.shape
    batch, x_width = x.shape if fragment_rows is None else (fragment_rows, n_words * 32)
    slices, words_per_warp, unroll, tiles, ahead = config
    if TILE_ROWS * tiles > n_rows:
        raise ValueError(f"spmv_2of4: config {config} has {tiles} 16-row tiles a program, more than the weight's "
                         f"{n_rows} rows fill")
    if not 1 <= ahead <= words_per_warp or slices * words_per_warp < n_words:
        raise ValueError(f"spmv_2of4: config {config} does not cover {n_words} words with 1 to words-per-warp "
                         "words ahead")
    programs = triton.cdiv(n_rows, TILE_ROWS * tiles)
    mma_sp_kernel.run(  # kernel[grid](...), or only its compile (Triton's warmup)
        x, values, mask, y, y if residual is None else residual, x if norm_weight is None else norm_weight, n_rows,
        n_words, words_per_warp, batch, x_width, norm_eps, SLICES=slices, M_TILES=tiles,
        N_BLOCKS=triton.cdiv(batch, 8), EVEN_K=n_words == slices * words_per_warp, UNROLL=unroll, PREFETCH=ahead,
        NORM=norm_weight is not None, GATED=gated, RESIDUAL=residual is not None,
        INTERPRETER_SAFE=INTERPRETING, X_FRAG=fragment_rows is not None, num_warps=slices, grid=(programs, ),
        warmup=compile_only)


def fragment_order(x: torch.Tensor) -> torch.Tensor:
    """x (rows <= 16, in) -> (in / 32, 8 ceil(rows / 8), 32): word-major, rows padded with zeros to
    whole blocks of 8, each word's 16 bf16 pairs reordered so thread t's four B registers are
    consecutive (one 16-byte load a block). Reshapes and a permute only, so that Inductor can fuse
    it into the kernel that produces x."""
    rows, width = x.shape
    padded = 8 * triton.cdiv(rows, 8)
    if padded > rows:
        x = torch.nn.functional.pad(x, (0, 0, 0, padded - rows))
    # a word's uint32 u = 8 j0 + 4 t1 + 2 j1 + t0 goes to 4 t + j = 8 t1 + 4 t0 + 2 j1 + j0
    return x.view(padded, width // 32, 2, 2, 2, 2, 2).permute(1, 0, 3, 5, 4, 2, 6).reshape(width // 32, padded, 32)


def spmv_2of4_fragments(x_fragments: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, rows: int,
                        config=None) -> torch.Tensor:
    """y = x @ W.T as `spmv_2of4` (no prologue, no residual) for the `rows` rows of x given as
    `fragment_order(x)`; config as there, tuned separately from the row-major x's."""
    n_words, n_rows = mask.shape
    if x_fragments.dtype != torch.bfloat16 or values.dtype != torch.bfloat16:
        raise ValueError(f"spmv_2of4_fragments takes bf16 x and values, got {x_fragments.dtype} and {values.dtype}")
    if not 1 <= rows <= MAX_ROWS or tuple(x_fragments.shape) != (n_words, 8 * triton.cdiv(rows, 8), 32):
        raise ValueError(f"spmv_2of4_fragments: x {tuple(x_fragments.shape)} is not {rows} rows (1 to {MAX_ROWS}) "
                         f"in fragment order for a packed weight with in_features={n_words * 32}")
    _check_weight("spmv_2of4_fragments", values, mask)
    if not all(t.is_contiguous() for t in (x_fragments, values, mask)):
        raise ValueError("spmv_2of4_fragments needs contiguous operands")
    y = torch.empty(rows, n_rows, dtype=x_fragments.dtype, device=x_fragments.device)
    if config is None:
        configs = candidate_configs(n_rows, n_words, rows)
        key = _key(rows, mask, x_fragments.device, "fragments")
        config = tuned_config(tuned_configs, key, configs, x_fragments, values, mask,
                              lambda c, v, m: _launch(x_fragments, v, m, y, c, fragment_rows=rows),
                              lambda c: _launch(x_fragments, values, mask, y, c, compile_only=True, fragment_rows=rows))
    _launch(x_fragments, values, mask, y, config, fragment_rows=rows)
    return y


def _key(rows, mask, device, prologue=""):
    return tuple(mask.shape), rows, prologue, device.index


def spmv_2of4_config(x: torch.Tensor, mask: torch.Tensor, prologue: str = ""):
    """The config spmv_2of4 tuned for this shape and batch, with no prologue, "norm" or "gated"
    (None before its first call); "fragments": spmv_2of4_fragments' for this x."""
    return tuned_configs.get(_key(x.shape[0], mask, x.device, prologue))


def spmv_2of4_tuned(x: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, norm_weight: torch.Tensor = None,
                    norm_eps: float = 0.0, gated: bool = False):
    """The fastest of `candidate_configs` for this shape and batch (and its prologue, if any), timed
    once as a compiled decode step runs it (sparse/kernels/tuning.py); on CPU the first."""
    key = _key(x.shape[0], mask, x.device, "norm" if norm_weight is not None else "gated" if gated else "")
    y = torch.empty(x.shape[0], mask.shape[1], dtype=x.dtype, device=x.device)
    options = dict(norm_weight=norm_weight, norm_eps=norm_eps, gated=gated)
    configs = candidate_configs(mask.shape[1], mask.shape[0], x.shape[0])
    return tuned_config(tuned_configs, key, configs, x, values, mask,
                        lambda config, v, m: _launch(x, v, m, y, config, **options),
                        lambda config: _launch(x, values, mask, y, config, compile_only=True, **options))
