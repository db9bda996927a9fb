"""Tensor-core SpMM: y = x @ W.T for up to 16 rows of x, W in the N:M bitmask format.

The SpMV (sparse/kernels/spmv.py) does one FMA per kept weight per row of x on the CUDA cores, so
its instructions grow with the rows. Here each program expands a tile of W (BLOCK_OUT rows x
32·WORDS columns) to dense in registers and feeds `tl.dot` against x^T (the rows of x padded to the
MMA's N = 16), accumulating in fp32; the expansion costs the same whatever the number of rows. In
PyTorch terms, for dense column c of word k of row r:

    kept = bit c of mask[k, r];  rank = popcount(mask[k, r] & ((1 << c) - 1))
    W[r, 32 * k + c] = (kept value `rank` of word k of row r) if kept else 0

The value is a gather, but it stays inside the bytes the tile's word owns, so L1 serves it after
the first touch. Threads own rows and expand their columns in column order (`_expand_columns`), so
the tile leaves for the MMA's shared memory in 16-byte stores. The gather expansion costs more
instructions per kept weight than the H200 can issue at full bandwidth (docs/KERNELS.md).

For 2:4 the expansion needs no gather (`two_of_four`): every nibble keeps two columns, whose values
are one 32-bit pair of the word's kept values, so a row's values come in 16-byte loads and each
nibble's column pairs (0, 1) and (2, 3) are that pair byte-permuted by the nibble's bits, one
`prmt` each (`_expand_tile_2of4`): about a third of the gather's instructions.

The K loop is pipelined by hand: mask words are loaded two K steps ahead and the expanded tile one
step ahead of its MMA, so a program waits on memory once, not once per step. Where the grid would
be too small to fill the GPU, K is split over programs (the split-K workspace,
sparse/kernels/common.py). With INTERPRETER_SAFE the popcount is the SWAR one and the byte permute
shifts and masks, so the same source runs under TRITON_INTERPRET=1 on the CPU.
"""
import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from sparse.kernels.common import INTERPRETING, popcount, split_k_workspace, store_or_reduce
from sparse.kernels.tuning import tuned_config

MMA_TOKENS = 16  # the MMA's N: the rows of x a program multiplies, padded
tuned_configs = {}  # (out, words, rows, dtype, device, two_of_four) -> config
candidate_times = {}  # the same keys: {config: µs a call} as the tuner timed each candidate


@triton.jit
def _count_bits(bits, INTERPRETER_SAFE: tl.constexpr):
    if INTERPRETER_SAFE:  # libdevice does not run in the interpreter
        count = popcount(bits).to(tl.int32)
    else:
        count = libdevice.popc(bits.to(tl.int32, bitcast=True))
    return count


@triton.jit
def _expand_columns(values_ptr, slot_offsets, words, chunk_stride, FIRST: tl.constexpr, STRIDE: tl.constexpr,
                    COUNT: tl.constexpr, CHUNK: tl.constexpr, INTERPRETER_SAFE: tl.constexpr):
    """Dense columns FIRST, FIRST + STRIDE, ... (COUNT of them) of the words [R, WORDS] as
    [R, WORDS, COUNT]. slot_offsets [R, WORDS]: where each word's first value sits in `values`;
    chunk_stride: the distance between a row's consecutive chunks of CHUNK values (format.py).

    Splitting even/odd columns and joining them back puts column bit i in register bit i, so
    every thread holds its row's columns in order (join/reshape only relabel registers).
    """
    if COUNT == 1:
        # The bits up to and including this column, counted, are the next column's rank: the
        # compiler shares that popcount, so the kept test costs one compare, not a shift + test.
        rank = _count_bits(words & ((1 << FIRST) - 1), INTERPRETER_SAFE)
        kept = _count_bits(words & ((2 << FIRST) - 1), INTERPRETER_SAFE) != rank
        dense = tl.load(values_ptr + (slot_offsets + (rank // CHUNK) * chunk_stride + rank % CHUNK), mask=kept,
                        other=0.0)
    else:
        even = _expand_columns(values_ptr, slot_offsets, words, chunk_stride, FIRST, 2 * STRIDE, COUNT // 2, CHUNK,
                               INTERPRETER_SAFE)
        odd = _expand_columns(values_ptr, slot_offsets, words, chunk_stride, FIRST + STRIDE, 2 * STRIDE, COUNT // 2,
                              CHUNK,
                              INTERPRETER_SAFE)
        dense = tl.reshape(tl.join(even, odd), (words.shape[0], words.shape[1], COUNT))
    return dense


@triton.jit
def _load_words(mask_ptr, k, k_end, rows, row_ok, n_rows, WORDS: tl.constexpr):
    """Mask words k .. k+WORDS-1 of every row as uint32 [R, WORDS]; zero past k_end or the last
    row, which keeps nothing there, so nothing is gathered for them."""
    if WORDS == 1:
        words = tl.expand_dims(tl.load(mask_ptr + k * n_rows + rows, mask=row_ok & (k < k_end), other=0), 1)
    else:
        first = _load_words(mask_ptr, k, k_end, rows, row_ok, n_rows, WORDS // 2)
        second = _load_words(mask_ptr, k + WORDS // 2, k_end, rows, row_ok, n_rows, WORDS // 2)
        words = tl.reshape(tl.permute(tl.join(first, second), (0, 2, 1)), (rows.shape[0], WORDS))
    return words.to(tl.uint32, bitcast=True)


@triton.jit
def _expand_tile(values_ptr, words, k, rows, n_rows, NNZ: tl.constexpr, CHUNK: tl.constexpr, WORDS: tl.constexpr,
                 INTERPRETER_SAFE: tl.constexpr):
    """Dense W[rows, 32k : 32(k + WORDS)] as [R, 32 * WORDS] from the words `_load_words` gave."""
    slot_offsets = (((k + tl.arange(0, WORDS)) * (NNZ // CHUNK) * n_rows)[None, :] + rows[:, None]) * CHUNK
    tile = _expand_columns(values_ptr, slot_offsets, words, n_rows * CHUNK, 0, 1, 32, CHUNK, INTERPRETER_SAFE)
    return tl.reshape(tile, (rows.shape[0], 32 * WORDS))


# prmt selectors for a nibble's column pairs, 16 bits each, indexed by two of its bits: bytes 0-3
# are the value pair ab, 4-7 zero. Pair (0, 1) by bits 0-1: 00 -> 0, 01 -> (a, 0), 10 -> (0, a),
# 11 -> ab; pair (2, 3) by bits 2-3: 00 -> 0, 01 -> (b, 0), 10 -> (0, b), 11 -> ab.
LOW_PAIR_SELECTORS = tl.constexpr(0x3210_1044_4410_4444)
HIGH_PAIR_SELECTORS = tl.constexpr(0x3210_3244_4432_4444)


@triton.jit
def _permute_bytes(pair, selector):
    """prmt.b32 pair, 0, selector: four bytes picked from pair (0-3) and zero (4-7)."""
    return tl.inline_asm_elementwise("prmt.b32 $0, $1, 0, $2;", "=r,r,r", [pair, selector], dtype=tl.uint32,
                                     is_pure=True, pack=1)


@triton.jit
def _load_pairs_2of4(values_ptr, k, rows, n_rows, word_ok, CHUNK: tl.constexpr, WORDS: tl.constexpr):
    """The kept values of mask words k .. k+WORDS-1 of a 2:4 weight's rows as 32-bit pairs [R, WORDS, 8]:
    pair j of a word holds the two values of its nibble j. Zero where word_ok [R, WORDS] is false."""
    pairs = tl.arange(0, 8)
    slot_offsets = (((k + tl.arange(0, WORDS)) * (16 // CHUNK) * n_rows)[None, :] + rows[:, None]) * (CHUNK // 2)
    pair_offsets = (pairs // (CHUNK // 2)) * (n_rows * CHUNK // 2) + pairs % (CHUNK // 2)
    offsets = slot_offsets[:, :, None] + pair_offsets[None, None, :]
    return tl.load(values_ptr.to(tl.pointer_type(tl.uint32)) + offsets, mask=word_ok[:, :, None], other=0)


@triton.jit
def _expand_tile_2of4(ab, words, WORDS: tl.constexpr, INTERPRETER_SAFE: tl.constexpr):
    """`_expand_tile` for a 2:4 weight, without a gather: nibble j of a word keeps exactly two
    columns, whose values a, b are the word's kept values 2j and 2j + 1, one 32-bit pair ab
    (`_load_pairs_2of4`). Of the nibble's column pairs, (0, 1) is ab, (a, 0), (0, a) or 0 and (2, 3)
    is 0, (b, 0), (0, b) or ab, read off the nibble's bits: one byte permute each on the GPU
    (selectors above), a shift and a mask each under the interpreter (no inline PTX there)."""
    R: tl.constexpr = words.shape[0]
    pairs = tl.arange(0, 8)
    nibbles = (words[:, :, None] >> (4 * pairs)[None, None, :]) & 0xF  # [R, WORDS, 8]
    if INTERPRETER_SAFE:
        low_mask = (nibbles & 1) * 0xFFFF | (nibbles & 2) * 0x7FFF8000
        high_mask = ((nibbles >> 2) & 1) * 0xFFFF | ((nibbles >> 3) & 1) * 0xFFFF0000
        low = (ab << (((nibbles & 3) == 2).to(tl.uint32) * 16)) & low_mask
        high = (ab >> (((nibbles & 12) == 4).to(tl.uint32) * 16)) & high_mask
    else:
        low_selectors = tl.full(nibbles.shape, LOW_PAIR_SELECTORS, tl.uint64)
        high_selectors = tl.full(nibbles.shape, HIGH_PAIR_SELECTORS, tl.uint64)
        low = _permute_bytes(ab, (low_selectors >> ((nibbles & 3) * 16).to(tl.uint64)).to(tl.uint32))
        high = _permute_bytes(ab, (high_selectors >> ((nibbles >> 2) * 16).to(tl.uint64)).to(tl.uint32))
    columns = tl.reshape(tl.join(low, high), (R, 16 * WORDS))  # value pairs in column order
    tile = tl.join((columns & 0xFFFF).to(tl.uint16), (columns >> 16).to(tl.uint16))
    return tl.reshape(tile, (R, 32 * WORDS))


@triton.jit
def _expand(values_ptr, words, k, rows, n_rows, NNZ: tl.constexpr, CHUNK: tl.constexpr, WORDS: tl.constexpr,
            TWO_OF_FOUR: tl.constexpr, INTERPRETER_SAFE: tl.constexpr):
    """Dense W[rows, 32k : 32(k + WORDS)] in W's dtype from the words `_load_words` gave for step k."""
    if TWO_OF_FOUR:
        # Words past the last row or past K are zero (`_load_words`), and a 2:4 word never is.
        ab = _load_pairs_2of4(values_ptr, k, rows, n_rows, words != 0, CHUNK, WORDS)
        tile = _expand_tile_2of4(ab, words, WORDS, INTERPRETER_SAFE).to(values_ptr.dtype.element_ty, bitcast=True)
    else:
        tile = _expand_tile(values_ptr, words, k, rows, n_rows, NNZ, CHUNK, WORDS, INTERPRETER_SAFE)
    return tile


@triton.jit
def _multiply_step(acc, tile, x_ptr, tokens, token_ok, k, k_end, n_words, WORDS: tl.constexpr,
                   INTERPRETER_SAFE: tl.constexpr):
    """acc += tile @ x[tokens, 32k : 32(k + WORDS)].T (x read as W's dtype; zero past k_end)."""
    columns = k * 32 + tl.arange(0, 32 * WORDS)
    x_tile = tl.load(x_ptr + tokens[None, :] * (n_words * 32) + columns[:, None],
                     mask=token_ok[None, :] & (columns < k_end * 32)[:, None], other=0.0).to(tile.dtype)
    if INTERPRETER_SAFE:  # the interpreter multiplies bf16 tiles as raw bits: upcast there
        tile, x_tile = tile.to(tl.float32), x_tile.to(tl.float32)
    return tl.dot(tile, x_tile, acc)


@triton.jit
def spmm_kernel(x_ptr, values_ptr, mask_ptr, y_ptr, workspace_ptr, arrivals_ptr, n_rows, n_tokens, n_words,
                words_per_split, NNZ: tl.constexpr, CHUNK: tl.constexpr, BLOCK_OUT: tl.constexpr,
                BLOCK_TOKENS: tl.constexpr, WORDS: tl.constexpr, TWO_OF_FOUR: tl.constexpr,
                INTERPRETER_SAFE: tl.constexpr):
    """y[tokens, rows] = x[tokens] @ W[rows].T, x (n_tokens, 32 * n_words) and y row-major.
    Grid: (row blocks, token blocks, K splits)."""
    row_block = tl.program_id(0)
    rows = row_block * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    row_ok = rows < n_rows
    tokens = tl.program_id(1) * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
    token_ok = tokens < n_tokens
    k_begin = tl.program_id(2) * words_per_split
    k_end = tl.minimum(k_begin + words_per_split, n_words)

    acc = tl.zeros([BLOCK_OUT, BLOCK_TOKENS], dtype=tl.float32)
    # The tile multiplied now was expanded one step ago, from words loaded two steps ago. The last
    # step is peeled off so that no program expands a tile past its end.
    words = _load_words(mask_ptr, k_begin, k_end, rows, row_ok, n_rows, WORDS)
    tile = _expand(values_ptr, words, k_begin, rows, n_rows, NNZ, CHUNK, WORDS, TWO_OF_FOUR, INTERPRETER_SAFE)
    next_words = _load_words(mask_ptr, k_begin + WORDS, k_end, rows, row_ok, n_rows, WORDS)
    k_last = k_begin + (k_end - k_begin - 1) // WORDS * WORDS
    for k in range(k_begin, k_last, WORDS):
        next_tile = _expand(values_ptr, next_words, k + WORDS, rows, n_rows, NNZ, CHUNK, WORDS, TWO_OF_FOUR,
                            INTERPRETER_SAFE)
        next_words = _load_words(mask_ptr, k + 2 * WORDS, k_end, rows, row_ok, n_rows, WORDS)
        acc = _multiply_step(acc, tile, x_ptr, tokens, token_ok, k, k_end, n_words, WORDS, INTERPRETER_SAFE)
        tile = next_tile
    acc = _multiply_step(acc, tile, x_ptr, tokens, token_ok, k_last, k_end, n_words, WORDS, INTERPRETER_SAFE)

    offsets = tokens[None, :] * n_rows + rows[:, None]
    store_or_reduce(acc, y_ptr, workspace_ptr, arrivals_ptr, row_block, offsets, row_ok[:, None] & token_ok[None, :],
                    tl.num_programs(2))


def candidate_configs(n_rows: int, n_words: int):
    """(BLOCK_OUT, WORDS, warps, split) worth timing for a shape.

    One thread per row of the tile (BLOCK_OUT = 32 x warps); K is split until 2, 4 or 8 programs
    per SM of an H200 exist (each walks its words one after another), at least 2 steps each.
    """
    if INTERPRETING:  # the interpreter is slow: one small config that still splits K
        return [(32, 1, 1, max(1, min(2, n_words)))]
    configs = []
    for warps in (4, 8):
        block_out = 32 * warps
        row_blocks = triton.cdiv(n_rows, block_out)
        for words in (1, 2):
            for target_programs in (264, 528, 1056):
                split = max(1, min(triton.cdiv(target_programs, row_blocks), n_words // (2 * words)))
                if (block_out, words, warps, split) not in configs:
                    configs.append((block_out, words, warps, split))
    return configs


def spmm_config(x: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, two_of_four: bool = False):
    """The fastest candidate for this (out, in, rows of x, expansion), timed once as a compiled
    decode step runs it (sparse/kernels/tuning.py) and remembered; candidate_times keeps every
    candidate's time."""
    n_words, n_rows = mask.shape
    key = (n_rows, n_words, x.shape[0], values.dtype, x.device, two_of_four)
    if key in tuned_configs:
        return tuned_configs[key]
    x = torch.randn_like(x)
    return tuned_config(tuned_configs, key, candidate_configs(n_rows, n_words), x, values, mask,
                        lambda config, v, m: spmm(x, v, m, config=config, two_of_four=two_of_four),
                        lambda config: spmm(x, values, mask, config=config, two_of_four=two_of_four, compile_only=True),
                        timings_out=candidate_times.setdefault(key, {}) if x.is_cuda else None)


def spmm(x: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, config=None, out=None,
         two_of_four: bool = False, compile_only: bool = False) -> torch.Tensor:
    """y = x @ W.T for x of shape (rows <= 16, in), W given as (values, mask); y in x's dtype.

    x is multiplied in W's dtype (bf16 for a model). config: (BLOCK_OUT, WORDS, warps, split)
    instead of the tuned choice; out: optional (rows, out_features) buffer. two_of_four: W is 2:4
    (the caller knows its pattern; the mask alone does not say); for a 16-bit W the tiles then
    expand by nibble instead of by gather, and a 16-a-word mask that is not 2:4 gives a wrong
    product, not an error. compile_only: compile the kernel for these operands and config, launch
    nothing (y unwritten).
    """
    n_tokens, in_features = x.shape
    n_words, n_rows = mask.shape
    if in_features != n_words * 32 or n_tokens > MMA_TOKENS:
        raise ValueError(f"spmm: x {tuple(x.shape)} is not up to {MMA_TOKENS} rows of in_features={n_words * 32}")
    nnz = values.shape[0] * values.shape[2] // n_words
    if two_of_four and nnz != 16:
        raise ValueError(f"spmm: a 2:4 weight keeps 16 values a word, this one {nnz}")
    two_of_four = two_of_four and values.element_size() == 2  # the nibble expansion moves 16-bit pairs
    block_out, words, warps, split = config or spmm_config(x, values, mask, two_of_four)
    words_per_split = triton.cdiv(triton.cdiv(n_words, split), words) * words
    split = triton.cdiv(n_words, words_per_split)
    row_blocks = triton.cdiv(n_rows, block_out)
    workspace, arrivals = split_k_workspace(x.device, MMA_TOKENS * n_rows, row_blocks)
    y = torch.empty(n_tokens, n_rows, dtype=x.dtype, device=x.device) if out is None else out
    spmm_kernel.run(x, values, mask, y, workspace, arrivals, n_rows, n_tokens, n_words, words_per_split,
                    NNZ=nnz, CHUNK=values.shape[2], BLOCK_OUT=block_out, BLOCK_TOKENS=MMA_TOKENS, WORDS=words,
                    TWO_OF_FOUR=two_of_four, INTERPRETER_SAFE=INTERPRETING, num_warps=warps,
                    grid=(row_blocks, 1, split), warmup=compile_only)
    return y
