"""Expand a packed weight to dense on the GPU: the prefill's path (expand, then cuBLAS).

At a prefill's thousands of tokens the product is compute-bound, and cuBLAS on the dense weight
beats multiplying from the packed form; expanding costs one read of the packed weight and one write
of the dense one. In PyTorch terms this is sparse.format.unpack:

    dense[r, 32 * k + c] = (kept value `rank` of word k of row r) if bit c of mask[k, r] else 0,
    rank = popcount(mask[k, r] & ((1 << c) - 1))

A program expands one word of BLOCK_ROWS rows at a time: a row's kept values of the word come in
CHUNK-wide (16-byte) loads and are spread over its 32 columns in registers (tl.gather by each
column's rank among the set bits), measured faster than loading each column's value with a scalar
gather (docs/KERNELS.md).
"""
import torch
import triton
import triton.language as tl

from sparse.kernels.common import INTERPRETING, popcount


@triton.jit
def unpack_kernel(values_ptr, mask_ptr, dense_ptr, n_rows, row_stride, n_words,
                  NNZ_PER_WORD: tl.constexpr, CHUNK: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                  WORDS_PER_PROGRAM: tl.constexpr):
    """n_rows dense rows from (values, mask) of a packed weight of row_stride rows; grid (row
    blocks, word blocks)."""
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
            rank = popcount(word[:, None] & below[None, :]).to(tl.int32)
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


def unpack_to_dense(values: torch.Tensor, mask: torch.Tensor, out=None, config=None) -> torch.Tensor:
    """Dense (out, in) weight from (values, mask), on the device (graph-capturable).

    config: (rows, words) or (rows, words, warps) per program instead of the default.
    """
    n_words, n_rows = mask.shape
    chunks, _, chunk = values.shape
    nnz = chunks * chunk // n_words
    dense = torch.empty(n_rows, n_words * 32, dtype=values.dtype, device=values.device) if out is None else out
    block_rows, words_per_program, warps = (*config, 4)[:3] if config else ((16, 2, 4) if INTERPRETING else (64, 4, 4))
    grid = (triton.cdiv(n_rows, block_rows), triton.cdiv(n_words, words_per_program))
    unpack_kernel[grid](values, mask, dense, n_rows, n_rows, n_words, NNZ_PER_WORD=nnz,
                        CHUNK=chunk, BLOCK_ROWS=block_rows, WORDS_PER_PROGRAM=words_per_program, num_warps=warps)
    return dense
