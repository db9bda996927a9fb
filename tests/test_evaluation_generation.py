"""evaluation/generation.py: greedy replies batched by prompt length come back in the prompts' order,
each the reply its prompt gets alone; a long prompt does not widen a whole batch."""
import torch

from evaluation.generation import greedy_token_ids, length_batches
from generate import generate
from model import ModelArgs, Transformer


def test_greedy_batches_by_length_and_answers_in_prompt_order():
    torch.manual_seed(0)
    model = Transformer(ModelArgs(architecture="qwen2", qkv_bias=True, dim=64, n_layer=2, n_head=4, n_local_heads=2,
                                  intermediate_size=96, vocab_size=50, block_size=64)).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 50, (n,), generator=g).tolist() for n in (9, 3, 14, 5, 3)]
    batched = greedy_token_ids(model, prompts, 6, batch_size=2, progress=False)
    alone = [generate(model, [torch.tensor(p)], 6).new_tokens[0].tolist() for p in prompts]
    assert batched == alone


def test_a_long_prompt_does_not_set_the_width_of_a_whole_batch():
    # MBPP's prompts: most near 150 tokens, one of 3753; at 64 rows a batch padded to it would
    # prefill 64 x 3753 tokens. Each batch stays within the token budget, a longer prompt alone.
    lengths = [150] * 70 + [900, 3753, 120]
    batches = length_batches(lengths, 64, token_budget=16384)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert [len(b) for b in batches] == [64, 8, 1]  # 8 x 900 fits the budget; 9 x 3753 does not
    assert batches[0][0] == 72  # shortest first
    assert all(len(b) * max(lengths[i] for i in b) <= 16384 or len(b) == 1 for b in batches)
    assert batches[-1] == [71]
    assert [len(b) for b in length_batches([10] * 5, 2)] == [2, 2, 1]  # the row cap alone
