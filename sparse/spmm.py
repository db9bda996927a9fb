"""Tensor-core SpMM for the N:M bitmask format: y = x @ W.T for a few rows of x, or a prefill.

`kernels.spmv` does one FMA per kept weight per row of x on the CUDA cores, so at batch 16 its
FMAs alone nearly use the instruction budget (docs/KERNEL_NOTES.md). Here each program expands
a tile of W (BLOCK_OUT rows x 32*WORDS columns) to dense in registers and feeds `tl.dot`
against a tile of x^T (the token axis padded to the MMA's N = 16, or a token tile for prefill),
accumulating in fp32. The expansion costs the same whatever the number of tokens:

    dense column c of word k of row r:  kept = bit c of the word,
    rank = popcount(word & ((1 << c) - 1)),  value = kept value `rank` of word k of row r
                                                  (values[k·NNZ/C + rank / C, r, rank % C])

The value is a gather, but it stays inside the 2 * NNZ * BLOCK_OUT bytes the tile's word owns,
so it is served by L1 after the first touch. Threads own rows and expand their columns in
registers in column order (see `_expand_columns`), so for WORDS = 2 the tile leaves for the
MMA's shared memory in 16-byte stores. Mask words are loaded two K steps ahead and the
expanded tile one step ahead of its MMA: a program waits on memory once, not once per step.

Cost (SASS of the loop, Triton 3.6, sm_90, BLOCK_OUT 128, WORDS 2): 698 instructions per
thread per 64 dense columns when first written, 10.9 per dense weight = 21.8 per kept weight at
50 %, whatever the batch (recounted in session 14 on today's chunked values layout with
`scripts/kernel_sass.py`'s `compile_spmm`: 863, 27.0 per kept weight): popcount + mask,
compare, 3 for the address, the load, zero-fill and pairing, 1/8 of a 16-byte shared store;
the MMAs are 8 instructions. That is above the 17.7 the H200 can issue per kept weight at full
bandwidth, so the best case is ~80 % of the bytes floor; the gathers'
L1 wavefronts (one per distinct rank among a warp's rows) are the other limit, lower for 2:4
(ranks of a column differ by at most 2) than for 16:32. Prefill redoes the expansion for every
64-token tile (128 spill), ~30x per weight at 2048 tokens: slower than expanding once + cuBLAS.

For 2:4 the expansion needs no gather: every nibble keeps two columns, whose values are one
32-bit pair of the word's kept values, so a row's values come in 16-byte loads and each nibble's
column pairs (0, 1) and (2, 3) are that pair byte-permuted by the nibble's bits, one `prmt` each
(`_expand_tile_2of4`). Compiled the same way (with the run-time alignment the JIT specializes):
280 loop instructions against 863 for the gather, 8.75 per kept weight against 27.0 (27 for the
gather is over the 17.7 the bytes allow; 8.75 is well under it). On the H200 the Llama-3.1-8B
shapes at 16 rows ran 0.62-0.89x of cuBLAS with it against 0.45-0.50x with the gather
(EXPAND_2OF4_BY_NIBBLE, on).

With PREFETCH_2OF4_PAIRS the 2:4 value pairs are loaded with the mask words, a step before their
expansion, so that no trip waits on its own loads (statically 126 registers against 86). Timed
on the H200 it gained nothing (121 -> 123 µs a layer at 8 rows, docs/KERNEL_NOTES.md session 17): off.
Nsight Compute without it (session 18) still has the expansion's PRMT waiting on the value loads
(9.5-24 % of stall samples); why loading them a step earlier did not help is open.

Decode candidates also run the K loop as Triton's software pipeline (`tl.range(num_stages=3)`,
DECODE_STAGES): every load of a 2:4 step (mask words, value pairs, x) becomes an asynchronous copy
to shared memory issued two steps ahead, at 377 loop instructions instead of 280 (11.8 per kept
weight, under the 17.7 budget) and 72 registers instead of 86. Timed on the H200 it lost to the
hand-pipelined loop on every Llama-3.1-8B shape (20-37 % slower at 8 rows, never the tuner's pick
at 8 or 16 rows: docs/BENCHMARKS.md sessions 20-21), so the tuner no longer times it
(DECODE_STAGES); `spmm(config=...)` still runs it.

Where the grid would be too small to fill the GPU, K is split over programs; their fp32
partial sums meet in the workspace that `kernels.spmv` also uses (`_store_or_reduce`).
`INTERPRETER_SAFE` (a constexpr) swaps libdevice popc for the SWAR `kernels._popcount`, so the
same source runs under TRITON_INTERPRET=1 on CPU.
"""
import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from sparse import kernels
from sparse.kernels import INTERPRETING, _popcount, _store_or_reduce

MMA_TOKENS = 16  # the smallest token tile: the MMA's N
# 2:4 weights expand by nibble (`_expand_tile_2of4`) rather than by gather: statically (sm_90a,
# kernel_sass.compile_spmm) the K loop is 280 instructions against 863, 8.75 per kept weight
# against 27.0 (docs/KERNEL_NOTES.md, session 14); on the H200 the Llama-3.1-8B shapes at 16 rows
# ran 0.62-0.89x of cuBLAS against the gather's 0.45-0.50x (docs/BENCHMARKS.md, session 15).
EXPAND_2OF4_BY_NIBBLE = True
# With the nibble expansion, load a step's value pairs together with its mask words, one K step
# before they are expanded (a 2:4 tile's pairs sit at fixed offsets, no word needed to find them),
# instead of in the step that expands them. The SASS of the loop (kernel_sass.compile_spmm) had each
# pair's LDG.128 42-99 instructions before its first PRMT, in the same trip: every trip waited on
# one DRAM round trip. Off: timed in session 17 the SpMM at 8 rows went 121 -> 123 µs a layer with it
# (predicted 85-100; docs/KERNEL_NOTES.md, session 17), though session 18's profile without it still
# shows the expansion waiting on those loads (see the module docstring).
PREFETCH_2OF4_PAIRS = False
# Decode candidates may also time the K loop software-pipelined by Triton over these stages
# (`_spmm_kernel`'s STAGES). Off: at (3,) the tuner compiled and timed twice the candidates and
# picked the hand loop for every shape at 8 and 16 rows (the fastest 3-stage candidate 20-37 %
# slower at 8 rows; docs/BENCHMARKS.md sessions 20-21).
DECODE_STAGES = ()


@triton.jit
def _count_bits(bits, INTERPRETER_SAFE: tl.constexpr):
    if INTERPRETER_SAFE:  # libdevice does not run in the interpreter
        count = _popcount(bits).to(tl.int32)
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
def _load_step(values_ptr, mask_ptr, k, k_end, rows, row_ok, n_rows, CHUNK: tl.constexpr, WORDS: tl.constexpr,
               PREFETCH_PAIRS: tl.constexpr):
    """What a K step reads before its expansion: the mask words, and with PREFETCH_PAIRS (2:4 by
    nibble) the value pairs too; otherwise `_expand` loads the values itself (pairs is a stand-in)."""
    words = _load_words(mask_ptr, k, k_end, rows, row_ok, n_rows, WORDS)
    if PREFETCH_PAIRS:  # the rows and words that exist (past them the words are zero, as below)
        word_ok = row_ok[:, None] & ((k + tl.arange(0, WORDS)) < k_end)[None, :]
        pairs = _load_pairs_2of4(values_ptr, k, rows, n_rows, word_ok, CHUNK, WORDS)
    else:
        pairs = words
    return words, pairs


@triton.jit
def _expand(values_ptr, words, pairs, k, rows, n_rows, NNZ: tl.constexpr, CHUNK: tl.constexpr,
            WORDS: tl.constexpr, TWO_OF_FOUR: tl.constexpr, PREFETCH_PAIRS: tl.constexpr,
            INTERPRETER_SAFE: tl.constexpr):
    """Dense W[rows, 32k : 32(k + WORDS)] in W's dtype from what `_load_step` gave for step k."""
    if TWO_OF_FOUR:
        if PREFETCH_PAIRS:
            ab = pairs
        else:
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
def _spmm_kernel(x_ptr, values_ptr, mask_ptr, y_ptr, workspace_ptr, arrivals_ptr,
                 n_rows, n_tokens, n_words, words_per_split,
                 NNZ: tl.constexpr, CHUNK: tl.constexpr, BLOCK_OUT: tl.constexpr, BLOCK_TOKENS: tl.constexpr, WORDS: tl.constexpr,
                 TWO_OF_FOUR: tl.constexpr, PREFETCH_PAIRS: tl.constexpr, STAGES: tl.constexpr,
                 INTERPRETER_SAFE: tl.constexpr):
    """y[tokens, rows] = x[tokens] @ W[rows].T, x (n_tokens, 32 * n_words) and y row-major.
    Grid: (row blocks, token blocks, K splits). STAGES > 1: the K loop software-pipelined by Triton
    (see below); 1: pipelined by hand."""
    row_block = tl.program_id(0)
    rows = row_block * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    row_ok = rows < n_rows
    tokens = tl.program_id(1) * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
    token_ok = tokens < n_tokens
    k_begin = tl.program_id(2) * words_per_split
    k_end = tl.minimum(k_begin + words_per_split, n_words)

    acc = tl.zeros([BLOCK_OUT, BLOCK_TOKENS], dtype=tl.float32)
    if STAGES > 1:
        # Triton's pipeliner copies each step's loads (mask words, 2:4 value pairs, the x tile)
        # to shared memory asynchronously, STAGES - 1 steps ahead (sm_90a, kernel_sass.compile_spmm:
        # all 7 of the 2:4 loop's loads become LDGSTS). The hand pipeline below has one step of
        # loads in flight and waits on it every trip: Nsight Compute (session 18) put long-scoreboard
        # stalls first at 8 rows. A 2:4 step's value pairs are loaded with its words (the prefetch
        # flag = TWO_OF_FOUR), where the pipeliner can take them; a gather expansion's value loads
        # depend on the step's own words, so for the other patterns only the words and x go ahead.
        for k in tl.range(k_begin, k_end, WORDS, num_stages=STAGES):
            words, pairs = _load_step(values_ptr, mask_ptr, k, k_end, rows, row_ok, n_rows, CHUNK, WORDS,
                                      TWO_OF_FOUR)
            tile = _expand(values_ptr, words, pairs, k, rows, n_rows, NNZ, CHUNK, WORDS, TWO_OF_FOUR,
                           TWO_OF_FOUR, INTERPRETER_SAFE)
            acc = _multiply_step(acc, tile, x_ptr, tokens, token_ok, k, k_end, n_words, WORDS, INTERPRETER_SAFE)
    else:
        # Pipelined by hand: the tile multiplied now was expanded one step ago, from words (and,
        # with PREFETCH_PAIRS, value pairs) loaded two steps ago. The last step is peeled off so
        # that no program expands a tile past its end.
        words, pairs = _load_step(values_ptr, mask_ptr, k_begin, k_end, rows, row_ok, n_rows, CHUNK, WORDS,
                                  PREFETCH_PAIRS)
        tile = _expand(values_ptr, words, pairs, k_begin, rows, n_rows, NNZ, CHUNK, WORDS, TWO_OF_FOUR,
                       PREFETCH_PAIRS, INTERPRETER_SAFE)
        next_words, next_pairs = _load_step(values_ptr, mask_ptr, k_begin + WORDS, k_end, rows, row_ok, n_rows,
                                            CHUNK, WORDS, PREFETCH_PAIRS)
        k_last = k_begin + (k_end - k_begin - 1) // WORDS * WORDS
        for k in range(k_begin, k_last, WORDS):
            next_tile = _expand(values_ptr, next_words, next_pairs, k + WORDS, rows, n_rows, NNZ, CHUNK, WORDS,
                                TWO_OF_FOUR, PREFETCH_PAIRS, INTERPRETER_SAFE)
            next_words, next_pairs = _load_step(values_ptr, mask_ptr, k + 2 * WORDS, k_end, rows, row_ok, n_rows,
                                                CHUNK, WORDS, PREFETCH_PAIRS)
            acc = _multiply_step(acc, tile, x_ptr, tokens, token_ok, k, k_end, n_words, WORDS, INTERPRETER_SAFE)
            tile = next_tile
        acc = _multiply_step(acc, tile, x_ptr, tokens, token_ok, k_last, k_end, n_words, WORDS, INTERPRETER_SAFE)

    offsets = tokens[None, :] * n_rows + rows[:, None]
    _store_or_reduce(acc, y_ptr, workspace_ptr, arrivals_ptr, row_block, offsets, row_ok[:, None] & token_ok[None, :],
                     tl.num_programs(2))


# ---------------------------------------------------------------- launcher


def candidate_configs(n_rows: int, n_words: int, n_tokens: int):
    """(BLOCK_OUT, BLOCK_TOKENS, WORDS, warps, split, stages) worth timing for a shape.

    One thread per row of the tile (BLOCK_OUT = 32 x warps); decode splits K until 2, 4 or 8
    programs per SM exist (each walks its words one after another), at least 2 steps each, with
    the K loop pipelined by hand (stages 1) or by Triton over DECODE_STAGES; prefill tiles the
    tokens instead.
    """
    if INTERPRETING:  # the interpreter is slow: one small config that still splits K
        return [(32, MMA_TOKENS, 1, 1, 1 if n_tokens > MMA_TOKENS else max(1, min(2, n_words)), 1)]
    if n_tokens > MMA_TOKENS:
        # 64 tokens per tile: 128 spill (sm_90 compile: 255 registers + stack). The expansion is
        # redone for every token tile, so prefill pays it n_tokens / 64 times (see the module doc).
        return [(128, 64, 2, 4, 1, 1)]
    configs = []
    for warps in (4, 8):
        block_out = 32 * warps
        row_blocks = triton.cdiv(n_rows, block_out)
        for words in (1, 2):
            for target_programs in (264, 528, 1056):
                split = max(1, min(triton.cdiv(target_programs, row_blocks), n_words // (2 * words)))
                for stages in (1, *DECODE_STAGES):
                    if (block_out, MMA_TOKENS, words, warps, split, stages) not in configs:
                        configs.append((block_out, MMA_TOKENS, words, warps, split, stages))
    return configs


_tuned_configs = {}
candidate_times = {}  # the same keys: {config: µs a call} as the tuner timed each candidate


def spmm_config(x: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, two_of_four: bool = False):
    """The fastest candidate for this (out, in, token count, expansion), timed once in a CUDA graph
    as the SpMV's configs are (kernels.fastest_in_cuda_graph) and remembered. (Timed with do_bench
    instead, three processes of the same 2:4 Llama-3.1-8B model at batch 8 spent 4059, 4292 and
    4621 µs a step in the SpMM on one H200: docs/KERNEL_NOTES.md, session 16.)"""
    n_words, n_rows = mask.shape
    n_tokens = x.shape[0]
    key = (n_rows, n_words, n_tokens if n_tokens <= MMA_TOKENS else triton.next_power_of_2(n_tokens),
           values.dtype, x.device, two_of_four, two_of_four and PREFETCH_2OF4_PAIRS)
    if key not in _tuned_configs:
        configs = candidate_configs(n_rows, n_words, n_tokens)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return configs[0]  # cannot time inside a graph capture; warm up first to get the tuned one
        if len(configs) == 1:
            _tuned_configs[key] = configs[0]
        else:
            x = torch.randn_like(x)
            candidate_times[key] = {}
            _tuned_configs[key] = kernels.fastest_in_cuda_graph(
                configs, values, mask, lambda config, v, m: spmm(x, v, m, config=config, two_of_four=two_of_four),
                timings_out=candidate_times[key],
                compile_only=lambda config: spmm(x, values, mask, config=config, two_of_four=two_of_four,
                                                 compile_only=True))
    return _tuned_configs[key]


def spmm(x: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, config=None, out=None,
         two_of_four: bool = False, compile_only: bool = False) -> torch.Tensor:
    """y = x @ W.T for x of shape (tokens, in), W given as (values, mask); y in x's dtype.

    x is multiplied in W's dtype (bf16 for a model). config: (BLOCK_OUT, BLOCK_TOKENS, WORDS,
    warps, split, stages) instead of the tuned choice; out: optional (tokens, out_features) buffer.
    two_of_four: W is 2:4 (the caller knows its pattern; the mask alone does not say): with
    EXPAND_2OF4_BY_NIBBLE on and W in bf16/fp16, tiles expand by nibble (`_expand_tile_2of4`)
    instead of by gather; a 16-a-word mask that is not 2:4 then gives a wrong product, not an error.
    compile_only: compile the kernel for these operands and config, launch nothing (y unwritten).
    """
    n_tokens, in_features = x.shape
    n_words, n_rows = mask.shape
    if in_features != n_words * 32:
        raise ValueError(f"spmm: x {tuple(x.shape)} does not fit a packed weight with in_features={n_words * 32}")
    nnz = values.shape[0] * values.shape[2] // n_words
    if two_of_four and nnz != 16:
        raise ValueError(f"spmm: a 2:4 weight keeps 16 values a word, this one {nnz}")
    two_of_four = two_of_four and EXPAND_2OF4_BY_NIBBLE and values.element_size() == 2  # it moves 16-bit pairs
    block_out, block_tokens, words, warps, split, stages = config or spmm_config(x, values, mask, two_of_four)
    if n_tokens > MMA_TOKENS:
        split = 1  # the workspace holds at most 16 token rows; prefill has programs enough anyway
    words_per_split = triton.cdiv(triton.cdiv(n_words, split), words) * words
    split = triton.cdiv(n_words, words_per_split)
    row_blocks = triton.cdiv(n_rows, block_out)
    workspace, arrivals = kernels._workspace(x.device, MMA_TOKENS * n_rows, row_blocks)
    y = torch.empty(n_tokens, n_rows, dtype=x.dtype, device=x.device) if out is None else out
    grid = (row_blocks, triton.cdiv(n_tokens, block_tokens), split)
    _spmm_kernel.run(x, values, mask, y, workspace, arrivals, n_rows, n_tokens, n_words, words_per_split,
                     NNZ=nnz, CHUNK=values.shape[2], BLOCK_OUT=block_out, BLOCK_TOKENS=block_tokens, WORDS=words,
                     TWO_OF_FOUR=two_of_four, PREFETCH_PAIRS=two_of_four and PREFETCH_2OF4_PAIRS, STAGES=stages,
                     INTERPRETER_SAFE=INTERPRETING, num_warps=warps, grid=grid, warmup=compile_only)
    return y
