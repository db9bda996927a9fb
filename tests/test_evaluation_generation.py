"""evaluation/generation.py: greedy replies batched by prompt length come back in the prompts' order,
each the reply its prompt gets alone."""
import torch

from evaluation.generation import greedy_token_ids
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
