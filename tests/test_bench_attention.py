"""scripts/bench_attention.py: its decode-step case and float32 reference (on CPU, the real kernel
under TRITON_INTERPRET=1, every setting the benchmark varies) and its summary table. The timing
itself needs a GPU."""
import pytest
import torch

from scripts import bench_attention
from sparse.kernels import decode_attention
from tests.sparse_kernel_testing import interpreted, relative_error


@interpreted
@pytest.mark.parametrize("target,block,stages", [(264, 32, 1), (8, 16, 2), (1056, 64, 2), (264, 128, 1)])
def test_every_benchmarked_setting_matches_the_reference(target, block, stages):
    # GQA 4:1 over 80 slots (not a multiple of any block): 1, 3 or more splits per row and KV head,
    # or one split in one part-filled block (128).
    case = bench_attention.attention_case(2, 8, 2, 16, 80, device="cpu", dtype=torch.float32, seed=3)
    previous = bench_attention.with_settings(target, block, stages)
    try:
        out = decode_attention.decode_attention_with_cache_write(*case)
    finally:
        bench_attention.with_settings(*previous)
    assert tuple(getattr(decode_attention, name) for name in bench_attention.SETTINGS) == previous
    assert relative_error(out, bench_attention.reference_attention(case).double()) < 1e-5
    cos, sin = bench_attention.new_token_rope(case)
    k_cache, v_cache = case[5:7]
    _, new_k, new_v = decode_attention.split_heads(case[0], k_cache)
    rotated_k = bench_attention.apply_rope(new_k[:, None], cos[:, None], sin[:, None])[:, 0]
    assert torch.equal(k_cache[:, :, -1], rotated_k) and torch.equal(v_cache[:, :, -1], new_v)  # the last slot


def test_the_table_shows_the_committed_setting_and_the_fastest():
    committed = dict(programs_target=decode_attention.PROGRAMS_TARGET, block_slots=decode_attention.BLOCK_SLOTS,
                     pipeline_stages=decode_attention.PIPELINE_STAGES)
    case = dict(model="Llama-3.1-8B", slots=768, batch=8)
    rows = [dict(case, **committed, us=17.0, gb_s=1480),
            dict(case, programs_target=1056, block_slots=64, pipeline_stages=3, us=9.5, gb_s=2650),
            dict(case, batch=4, programs_target=1056, block_slots=16, pipeline_stages=1, us=8.0, gb_s=1570)]
    table = bench_attention.markdown_table(rows)
    assert "| Llama-3.1-8B | 768 | 8 | 17.00 (1480) | 9.50 (2650) | 1056 / 64 / 3 |" in table
    assert "| Llama-3.1-8B | 768 | 4 | not timed | 8.00 (1570) | 1056 / 16 / 1 |" in table
