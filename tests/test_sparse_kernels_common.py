"""sparse/kernels/common.py: the PDL L2 prefetch budget (the kernels' SASS checks of the PDL
contract are in their own test modules)."""
import pytest
import torch

from sparse.kernels import common


def test_l2_prefetch_words_share_the_budget_over_the_grid(monkeypatch):
    monkeypatch.setattr(common, "PDL_L2_PREFETCH_BYTES", 16 << 20)
    # Llama-3.1-8B's w13 (28672 rows: 896 row blocks) at 4 warps a program, 36 bytes a row and word
    # (16 bf16 values and the mask word): 4.1 MB a word of every warp, so 4 words fit 16 MB.
    assert common.l2_prefetch_words(896 * 4 * 32 * 36, 32) == 4
    assert common.l2_prefetch_words(128 * 4 * 32 * 36, 32) == 28  # o (4096 rows): 28 of each warp's 32 words
    assert common.l2_prefetch_words(64 * 4 * 32 * 36, 32) == 32  # never more than the warp walks
    monkeypatch.setattr(common, "PDL_L2_PREFETCH_BYTES", 0)
    assert common.l2_prefetch_words(128 * 4 * 32 * 36, 32) == 0
    assert not common.programmatic_launch(torch.device("cpu"), 1)


def test_pdl_l2_prefetch_sets_the_budget_for_its_block_only(monkeypatch):
    monkeypatch.setattr(common, "PDL_L2_PREFETCH_BYTES", 16 << 20)
    with common.pdl_l2_prefetch(4 * 2 ** 20):  # bench_kernel.py --chain passes megabytes * 2 ** 20
        assert common.l2_prefetch_words(128 * 4 * 32 * 36, 32) == 7
    with pytest.raises(RuntimeError, match="inside"), common.pdl_l2_prefetch(0):
        assert common.l2_prefetch_words(128 * 4 * 32 * 36, 32) == 0
        raise RuntimeError("inside")  # a benchmark that fails must not leave the budget changed
    assert common.PDL_L2_PREFETCH_BYTES == 16 << 20


def test_programmatic_launch_only_at_one_row(monkeypatch):
    monkeypatch.setattr(common, "PDL_L2_PREFETCH_BYTES", 16 << 20)
    monkeypatch.setattr(common, "INTERPRETING", False)
    monkeypatch.setattr(common, "hopper_or_later", lambda index: True)
    cuda = torch.device("cuda", 0)
    assert common.programmatic_launch(cuda, 1)
    assert not any(common.programmatic_launch(cuda, rows) for rows in (2, 4, 8, 16))
    monkeypatch.setattr(common, "hopper_or_later", lambda index: False)
    assert not common.programmatic_launch(cuda, 1)
