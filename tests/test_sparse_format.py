"""sparse/format.py: pattern parsing, pack/unpack round trips and validate on corrupted masks."""
import pytest
import torch

from sparse.format import keep_largest, pack, packed_shapes, parse_pattern, unpack, validate

PATTERNS = ["2:4", "4:8", "8:16", "16:32"]


def test_parse_pattern():
    assert parse_pattern("2:4") == (2, 4)
    assert parse_pattern("16:32") == (16, 32)
    assert parse_pattern("1:4") == (1, 4)  # other densities: 8 kept bits per word
    assert parse_pattern("50%") == 0.5  # a float marks unstructured
    for bad, problem in [("2:3", "M must divide 32"), ("4:4", "0 < N < M"), ("0:4", "0 < N < M"),
                         ("2-4", "expected 'N:M'"), ("", "expected 'N:M'"), ("150%", "percentage"),
                         ("x%", "percentage"), ("2:64", "M must divide 32")]:
        with pytest.raises(ValueError, match=problem):
            parse_pattern(bad)


@pytest.mark.parametrize("pattern", PATTERNS + ["1:4"])
def test_pack_unpack_round_trip(pattern):
    n, m = parse_pattern(pattern)
    weight = torch.randn(48, 160, generator=torch.Generator().manual_seed(m))
    values, mask = pack(weight, pattern)
    assert (tuple(values.shape), tuple(mask.shape)) == packed_shapes(160, 48, pattern)
    assert mask.dtype == torch.int32 and values.dtype == weight.dtype
    validate(values, mask, pattern)

    keep = keep_largest(weight, pattern)
    assert torch.equal(unpack(values, mask), weight * keep)
    # Logical format: each row's kept weights in increasing column order. Physical layout:
    # values[k·nnz/C + c, r, j] is kept value c·C + j of row r in word k.
    kept_in_order = weight[keep].reshape(48, -1)
    chunks, _, chunk = values.shape
    nnz = 32 * n // m
    for row, word, index in [(0, 0, 0), (5, 2, nnz - 1), (47, 4, nnz // 2)]:
        c, j = divmod(index, chunk)
        assert values[word * (nnz // chunk) + c, row, j] == kept_in_order[row, word * nnz + index]
    assert torch.equal(values.permute(1, 0, 2).reshape(48, -1), kept_in_order)
    # Bit j of word k of row r <-> column 32k + j.
    row, col = 5, 77
    assert bool((int(mask[col // 32, row]) >> (col % 32)) & 1) == bool(keep[row, col])


def test_pack_refuses_patterns_without_a_power_of_two_per_word():
    # 3:8 keeps 12 of every 32 columns: the kernels walk a power-of-two count per word.
    assert parse_pattern("3:8") == (3, 8)  # a valid N:M for pruning (stored dense)
    for pattern, kept in [("3:8", 12), ("3:4", 24), ("5:16", 10)]:
        with pytest.raises(ValueError, match=f"pattern '{pattern}' keeps {kept} of every 32 columns"):
            pack(torch.randn(4, 64), pattern)


def test_keep_largest_keeps_n_largest_per_group():
    weight = torch.tensor([[0.1, -3.0, 2.0, 0.5, 1.0, 1.5, -0.2, -4.0]])
    assert keep_largest(weight, "2:4").tolist() == [[False, True, True, False, False, True, False, True]]


def test_pack_with_given_mask_and_bad_masks():
    weight = torch.randn(8, 64)
    keep = (torch.rand(8, 16, 4).argsort(-1) < 2).reshape(8, 64)  # a random valid 2:4 mask
    values, mask = pack(weight, "2:4", keep)
    assert torch.equal(unpack(values, mask), weight * keep)
    broken = keep.clone()
    broken[3, 9] = ~broken[3, 9]
    with pytest.raises(ValueError, match=r"row 3, columns 8..11 keep [13] weights, expected exactly 2"):
        pack(weight, "2:4", broken)
    with pytest.raises(ValueError, match="bool tensor"):
        pack(weight, "2:4", keep.float())
    with pytest.raises(ValueError, match="unstructured"):
        pack(weight, "50%")
    with pytest.raises(ValueError, match="multiple of 32"):
        pack(torch.randn(4, 48), "2:4")


@pytest.mark.parametrize("pattern", PATTERNS)
def test_validate_rejects_corrupted_masks(pattern):
    n, m = parse_pattern(pattern)
    values, mask = pack(torch.randn(16, 96), pattern)

    extra_bit = mask.clone()
    word = int(extra_bit[1, 7]) & 0xFFFFFFFF
    free_bit = next(j for j in range(32) if not (word >> j) & 1)
    word |= 1 << free_bit
    extra_bit[1, 7] = word - 2**32 if word >= 2**31 else word
    with pytest.raises(ValueError, match=rf"row 7, columns .* keep {n + 1} weights, expected exactly {n}"):
        validate(values, extra_bit, pattern)

    if m < 32:  # same bit count per word, but one group gives a bit to its neighbour
        moved = mask.clone()
        word = int(moved[2, 3]) & 0xFFFFFFFF
        first_group, second_group = word & ((1 << m) - 1), (word >> m) & ((1 << m) - 1)
        give = next(j for j in range(m) if (first_group >> j) & 1)
        take = next(j for j in range(m) if not (second_group >> j) & 1)
        word = (word & ~(1 << give)) | (1 << (m + take))
        moved[2, 3] = word - 2**32 if word >= 2**31 else word
        with pytest.raises(ValueError, match=rf"row 3, columns {64}..{64 + m - 1} keep {n - 1} weights"):
            validate(values, moved, pattern)

    with pytest.raises(ValueError, match="int32"):
        validate(values, mask.long(), pattern)
    with pytest.raises(ValueError, match="floating-point"):
        validate(values.to(torch.int32), mask, pattern)
    with pytest.raises(ValueError, match="does not match mask shape"):
        validate(values[:-1], mask, pattern)
    with pytest.raises(ValueError, match="does not match mask shape"):
        validate(values, mask[:, :-1], pattern)
    with pytest.raises(ValueError, match="2-D"):
        validate(values, mask[0], pattern)
