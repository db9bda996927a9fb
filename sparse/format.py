"""The N:M bitmask sparse format: pattern parsing, pack, unpack, validate.

Logical format, for a weight W of shape (out, in) pruned to N:M (M divides 32):
- mask: one bit per input column, 32 consecutive columns per 32-bit word; bit j of word k of
  row r is W[r, 32k + j] != pruned.
- values: the kept weights of each row in increasing column order, in the model dtype.
At N/M = 1/2 every word holds exactly 16 set bits, so a kernel can walk a word in a fixed
number of steps; in general a word holds 32·N/M bits (`nnz_per_word`).

Physical layout (what pack returns and the buffers hold). The SpMV kernel gives each thread one
output row and lets the 32 threads of a warp walk the same word k of 32 neighbouring rows, so
the buffers are word-major with the rows of a word side by side:
    mask   int32 (in/32, out):            mask[k, r]              = word k of row r
    values dtype (in/32 · nnz/C, out, C):  values[k·nnz/C + c, r, j] = kept value c·C + j of row r in word k
with C = min(8, nnz) values per chunk (`values_per_chunk`): a thread reads a word's values in
16-byte loads (8 bf16), and a warp's load of one chunk is 512 contiguous bytes. Both shapes
follow from (in, out, pattern) alone, so a model can be built on the meta device and loaded with
`load_state_dict(assign=True)`.

Checkpoints name this layout "bitmask-v2" (`FORMAT`). "bitmask-v1" (the earlier layout) stored
values as (in/32 · nnz, out), value s of word k of row r at [k·nnz + s, r]; `values_from_v1`
converts, and generate.load_model does so on load.

"50%" style patterns mean unstructured sparsity: stored as a dense tensor with zeros, never
packed; `parse_pattern` returns the fraction of zeros as a float for them (0.5).
"""
import torch
from torch import Tensor

WORD_BITS = 32
FORMAT = "bitmask-v2"


def parse_pattern(pattern: str):
    """"2:4" -> (2, 4). "50%" -> 0.5 (a float marks unstructured: the fraction of zeros).

    N:M needs M to divide 32 and 0 < N < M, so every 32-bit word holds exactly 32·N/M kept bits.
    """
    if not isinstance(pattern, str):
        raise ValueError(f"sparsity pattern must be a string like '2:4' or '50%', got {pattern!r}")
    text = pattern.strip()
    if text.endswith("%"):
        try:
            percent = float(text[:-1])
        except ValueError:
            raise ValueError(f"bad sparsity pattern {pattern!r}: expected a percentage like '50%'") from None
        if not 0 < percent < 100:
            raise ValueError(f"bad sparsity pattern {pattern!r}: percentage must be in (0, 100)")
        return percent / 100
    parts = text.split(":")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ValueError(f"bad sparsity pattern {pattern!r}: expected 'N:M' (e.g. '2:4') or a percentage ('50%')")
    n, m = int(parts[0]), int(parts[1])
    if m < 2 or WORD_BITS % m != 0:
        raise ValueError(f"bad sparsity pattern {pattern!r}: M must divide 32 (2, 4, 8, 16 or 32)")
    if not 0 < n < m:
        raise ValueError(f"bad sparsity pattern {pattern!r}: N must satisfy 0 < N < M")
    return n, m


def is_unstructured(pattern: str) -> bool:
    return isinstance(parse_pattern(pattern), float)


def _structured(pattern: str):
    parsed = parse_pattern(pattern)
    if isinstance(parsed, float):
        raise ValueError(f"pattern {pattern!r} is unstructured: it is stored dense with zeros, not packed")
    return parsed


def nnz_per_word(pattern: str) -> int:
    n, m = _structured(pattern)
    return WORD_BITS * n // m


def values_per_chunk(nnz: int) -> int:
    """Kept values of one word that sit contiguously for one row (one 16-byte load in bf16)."""
    return min(8, nnz)


def packed_shapes(in_features: int, out_features: int, pattern: str):
    """(values shape, mask shape) of a packed (out_features, in_features) weight."""
    if in_features % WORD_BITS != 0:
        raise ValueError(f"in_features={in_features} must be a multiple of 32 for the bitmask format")
    words = in_features // WORD_BITS
    nnz = nnz_per_word(pattern)
    if nnz & (nnz - 1):
        raise ValueError(f"pattern {pattern!r} keeps {nnz} of every 32 columns; the bitmask format packs only a "
                         f"power-of-two count per 32-bit word (N a power of two: 1:4, 2:4, 4:8, 8:16, 16:32, ...)")
    chunk = values_per_chunk(nnz)
    return (words * nnz // chunk, out_features, chunk), (words, out_features)


def keep_largest(weight: Tensor, pattern: str) -> Tensor:
    """Boolean mask keeping the N largest |w| of every M consecutive columns (ties: lowest column)."""
    n, m = _structured(pattern)
    out, inp = weight.shape
    if inp % m != 0:
        raise ValueError(f"in_features={inp} is not a multiple of M={m}")
    groups = weight.detach().abs().float().reshape(out, inp // m, m)
    top = groups.topk(n, dim=-1).indices
    keep = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, top, True)
    return keep.reshape(out, inp)


def _bits_to_words(keep: Tensor) -> Tensor:
    """(out, in) bool -> (out, in/32) int32 words (bit j of word k = column 32k + j)."""
    out, inp = keep.shape
    weights = torch.ones(WORD_BITS, dtype=torch.int64, device=keep.device) << torch.arange(WORD_BITS, device=keep.device)
    words = (keep.reshape(out, inp // WORD_BITS, WORD_BITS).to(torch.int64) * weights).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _words_to_bits(mask: Tensor) -> Tensor:
    """Physical (in/32, out) int32 mask -> (out, in) bool."""
    shifts = torch.arange(WORD_BITS, device=mask.device, dtype=torch.int32)
    bits = (mask.t()[:, :, None] >> shifts) & 1  # arithmetic shift is fine: we keep only bit 0
    return bits.reshape(mask.shape[1], -1).bool()


def pack(weight: Tensor, pattern: str, mask: Tensor = None):
    """Dense (out, in) weight -> (values, mask) in the physical layout above.

    mask: optional (out, in) bool tensor of kept weights; it must follow the pattern exactly.
    Without it the N largest |w| of each M-group are kept.
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (out, in), got shape {tuple(weight.shape)}")
    out, inp = weight.shape
    packed_shapes(inp, out, pattern)  # checks pattern and in_features
    if mask is None:
        keep = keep_largest(weight, pattern)
    else:
        if mask.shape != weight.shape or mask.dtype != torch.bool:
            raise ValueError(f"mask must be a bool tensor of shape {tuple(weight.shape)}, "
                             f"got {mask.dtype} {tuple(mask.shape)}")
        keep = mask.to(weight.device)
    words = _bits_to_words(keep)
    _check_words(words, pattern, where="mask")
    nnz = nnz_per_word(pattern)
    chunk = values_per_chunk(nnz)
    # Each row's kept values in column order, as (row, word, chunk, j) -> (word, chunk, row, j).
    values = weight.detach()[keep].reshape(out, inp // WORD_BITS, nnz // chunk, chunk)
    values = values.permute(1, 2, 0, 3).reshape(-1, out, chunk)
    return values.contiguous(), words.t().contiguous()


def values_from_v1(values: Tensor, mask: Tensor) -> Tensor:
    """A "bitmask-v1" values buffer (in/32 · nnz, out) in this module's layout (see the top);
    the mask is the same in both."""
    words, out = mask.shape
    if values.dim() != 2 or values.shape[1] != out or values.shape[0] % words:
        raise ValueError(f"values {tuple(values.shape)} are not bitmask-v1 values for mask {tuple(mask.shape)}")
    nnz = values.shape[0] // words
    chunk = values_per_chunk(nnz)
    return values.reshape(words, nnz // chunk, chunk, out).permute(0, 1, 3, 2).reshape(-1, out, chunk).contiguous()


def unpack(values: Tensor, mask: Tensor) -> Tensor:
    """(values, mask) -> dense (out, in) weight with zeros at the pruned positions (pure PyTorch)."""
    words, out = mask.shape
    keep = _words_to_bits(mask)
    dense = torch.zeros(out, words * WORD_BITS, dtype=values.dtype, device=values.device)
    # Every word holds the same number of bits, so the row-major order of the kept positions is
    # exactly the (row, word, chunk, j) order of the values.
    chunks, _, chunk = values.shape
    dense[keep] = values.reshape(words, chunks // words, out, chunk).permute(2, 0, 1, 3).reshape(-1)
    return dense


def _group_counts_equal(words: Tensor, n: int, m: int) -> Tensor:
    """Per word: True when every aligned M-bit group holds exactly N set bits (SWAR popcount)."""
    c = words.to(torch.int64) & 0xFFFFFFFF
    # Each step leaves, in every field of width `width`, the number of set bits of that field.
    c = c - ((c >> 1) & 0x55555555)
    width = 2
    for shift, keep_bits in ((2, 0x33333333), (4, 0x0F0F0F0F), (8, 0x00FF00FF), (16, 0x0000FFFF)):
        if width == m:
            break
        c = (c & keep_bits) + ((c >> shift) & keep_bits)
        width *= 2
    expected = sum(n << (i * m) for i in range(WORD_BITS // m))
    return c == expected


def _check_words(words: Tensor, pattern: str, where: str):
    """Raise ValueError naming the first row and columns whose M-group does not keep exactly N.

    words: logical (rows, in/32) int32 words (the transpose of the physical mask).
    """
    n, m = _structured(pattern)
    ok = _group_counts_equal(words, n, m)
    if not bool(ok.all()):
        row, word = (int(i) for i in torch.nonzero(~ok)[0])
        bits = int(words[row, word]) & 0xFFFFFFFF
        counts = [bin((bits >> (g * m)) & ((1 << m) - 1)).count("1") for g in range(WORD_BITS // m)]
        group = next(g for g, c in enumerate(counts) if c != n)
        col = word * WORD_BITS + group * m
        raise ValueError(f"{where} breaks pattern {pattern}: row {row}, columns {col}..{col + m - 1} "
                         f"keep {counts[group]} weights, expected exactly {n}")


def validate(values: Tensor, mask: Tensor, pattern: str):
    """Check dtypes, shapes and that every M-group of the mask keeps exactly N weights.

    Raises ValueError with one line naming the problem.
    """
    nnz = nnz_per_word(pattern)
    if not isinstance(mask, Tensor) or mask.dtype != torch.int32:
        raise ValueError(f"mask must be an int32 tensor, got {getattr(mask, 'dtype', type(mask))}")
    if not isinstance(values, Tensor) or not values.is_floating_point():
        raise ValueError(f"values must be a floating-point tensor, got {getattr(values, 'dtype', type(values))}")
    if mask.dim() != 2 or values.dim() != 3:
        raise ValueError(f"values must be 3-D and mask 2-D, got {tuple(values.shape)} and {tuple(mask.shape)}")
    words, out = mask.shape
    chunk = values_per_chunk(nnz)
    if values.shape != (words * nnz // chunk, out, chunk):
        raise ValueError(f"values shape {tuple(values.shape)} does not match mask shape {tuple(mask.shape)} "
                         f"for pattern {pattern}: expected {(words * nnz // chunk, out, chunk)}")
    _check_words(mask.t(), pattern, where="mask")
