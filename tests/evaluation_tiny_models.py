"""Tiny random models shared by the evaluation tests (no data files needed)."""
import copy

import torch

from model import ModelArgs, Transformer

TINY = ModelArgs(vocab_size=64, n_layer=2, n_head=4, n_local_heads=2, dim=32, intermediate_size=64, block_size=256)


def tiny_model(seed=0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(TINY).eval()


def half_pruned(model: Transformer) -> Transformer:
    """A copy with the smaller half of every block linear's weights zeroed (a stand-in pruned model)."""
    pruned = copy.deepcopy(model)
    with torch.no_grad():
        for name, module in pruned.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "output":
                w = module.weight
                w.masked_fill_(w.abs() <= w.abs().median(), 0.0)
    return pruned


@torch.no_grad()
def greedy_without_cache(model: Transformer, prompt: list[int], steps: int) -> list[int]:
    """Greedy decoding by recomputing the whole sequence each step: slow, simple, independent of generate.py."""
    ids = list(prompt)
    for _ in range(steps):
        model.setup_caches(1, len(ids))
        logits = model(torch.tensor([ids]), torch.arange(len(ids)))
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt):]
