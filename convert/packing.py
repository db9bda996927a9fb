"""Find the N:M pattern that a model's zeros already follow, and pack those layers.

A model pruned elsewhere (SparseGPT, Wanda, a published 2:4 model, a compressed-tensors
checkpoint) arrives as dense weights with exact zeros. A linear layer follows N:M along its input
dimension when every aligned group of M columns of every row holds at most N non-zeros; such a
layer packs with no change to its weights (a group with fewer non-zeros keeps some zeros, the
lowest columns first). `--sparse auto` tries 2:4, 4:8, 8:16 and 16:32 and takes the finest one
that the most layers follow (a 2:4 layer also follows 4:8, so this is the finest pattern shared
by every sparse layer); the layers that do not follow it stay dense, and the report says why.
Only block linears are packed (the embedding and the output head stay dense, as prune/ leaves them).
"""
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

import sparse
from sparse.format import WORD_BITS, parse_pattern

AUTO_PATTERNS = ("2:4", "4:8", "8:16", "16:32")
BLOCK_LINEARS = ("attention.wqkv", "attention.wo", "feed_forward.w13", "feed_forward.w2")


@dataclass
class PackingReport:
    pattern: str | None  # None: nothing packed
    packed: list = field(default_factory=list)
    dense: dict = field(default_factory=dict)  # layer -> why it stayed dense

    def lines(self) -> list[str]:
        if self.pattern is None:
            head = "no layer follows an N:M pattern; the checkpoint stays dense"
        else:
            head = f"packed {len(self.packed)} layers as {self.pattern}, {len(self.dense)} stayed dense"
        return [head] + [f"  {layer}: packed {self.pattern}" for layer in self.packed] + \
            [f"  {layer}: dense ({why})" for layer, why in self.dense.items()]


def block_linear_names(state_dict: dict) -> list[str]:
    return [key[:-len(".weight")] for key in state_dict
            if key.endswith(".weight") and key.startswith("layers.") and key[:-len(".weight")].endswith(BLOCK_LINEARS)]


def most_nonzeros_per_group(weight: torch.Tensor, m: int) -> int:
    return int((weight.reshape(weight.shape[0], -1, m) != 0).sum(-1).max())


def why_not(weight: torch.Tensor, pattern: str) -> str | None:
    """None if `weight` follows `pattern`, else the reason it does not."""
    n, m = parse_pattern(pattern)
    if weight.shape[1] % WORD_BITS:
        return f"{weight.shape[1]} input columns are not a multiple of {WORD_BITS}"
    most = most_nonzeros_per_group(weight, m)
    if most > n:
        zeros = float((weight == 0).float().mean())
        return f"{zeros:.1%} zeros; a group of {m} holds up to {most} non-zeros, {pattern} allows {n}"
    return None


def keep_nonzeros(weight: torch.Tensor, pattern: str) -> torch.Tensor:
    """Boolean mask with exactly N per M-group: every non-zero, then zeros from the lowest column."""
    n, m = parse_pattern(pattern)
    groups = weight.reshape(weight.shape[0], -1, m) != 0
    zero_rank = (~groups).cumsum(-1)  # 1, 2, ... along each group's zeros
    fill = (~groups) & (zero_rank <= n - groups.sum(-1, keepdim=True))
    return (groups | fill).reshape(weight.shape)


def choose_pattern(state_dict: dict, layers: list, requested: str) -> str | None:
    """The pattern to pack with: `requested`, or for "auto" the finest one the most layers follow."""
    if requested != "auto":
        return requested
    counts = {p: sum(why_not(state_dict[f"{layer}.weight"], p) is None for layer in layers) for p in AUTO_PATTERNS}
    best = max(counts.values())
    return next(p for p in AUTO_PATTERNS if counts[p] == best) if best else None


def pack_state_dict(state_dict: dict, requested: str) -> PackingReport:
    """Replace, in place, each block linear of `state_dict` that follows the pattern by `.values` +
    `.mask` (one layer at a time, so packing holds about one model, not two); returns the report.
    requested: "auto" or an N:M pattern."""
    layers = block_linear_names(state_dict)
    pattern = choose_pattern(state_dict, layers, requested)
    report = PackingReport(pattern)
    if pattern is None:
        report.dense = {layer: "no N:M pattern" for layer in layers}
        return report
    for layer in tqdm(layers, desc=f"packing {pattern}", unit="layer", leave=False):
        weight = state_dict[f"{layer}.weight"]
        reason = "has a bias (packed layers have none)" if f"{layer}.bias" in state_dict else why_not(weight, pattern)
        if reason is not None:
            report.dense[layer] = reason
            continue
        del state_dict[f"{layer}.weight"]
        state_dict[f"{layer}.values"], state_dict[f"{layer}.mask"] = sparse.pack(weight, pattern,
                                                                                 keep_nonzeros(weight, pattern))
        report.packed.append(layer)
    if not report.packed:
        report.pattern = None
    return report
