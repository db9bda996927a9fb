"""Tensor parallel decode on torch.distributed: one model split over the GPUs of a host.

    torchrun --nproc_per_node=2 generate.py --checkpoint model.pth --prompt "Hello" --compile
    torchrun --nproc_per_node=2 scripts/bench_decode.py --models Llama-3.3-70B --patterns 2:4 --batch_sizes 1,8

Each process reads the checkpoint memory-mapped, keeps its own slices (`shard`) and moves only
those to its device: cuda:LOCAL_RANK with NCCL, or the CPU with gloo. Outside torchrun
(WORLD_SIZE unset or 1) nothing here changes the model. The split, for W processes:

- attention.wqkv: output rows by heads. Rank r keeps query heads [r·H/W, (r+1)·H/W) and
  key/value heads [r·K/W, (r+1)·K/W) (and the same rows of a bias). A query head h attends to KV
  head h // (H/K), so contiguous blocks keep every query head beside its KV head.
- feed_forward.w13: output rows, the rank's slice of the gate and the same slice of up, stored as
  [gate_r | up_r] so silu(gate) * up stays a local op.
- attention.wo, feed_forward.w2: input columns (the heads / features the rank computed), then an
  all-reduce sums the partial products of every row of the batch; the residual is added once,
  after the sum.
- The KV cache holds the rank's KV heads only (Attention.n_local_heads).
- lm_head (`output`): split by vocabulary rows, the logits all-gathered. It is read whole on every
  step, so splitting it saves a 1/W share of its bytes per step (1 GB of Llama-70B's 2 GB at W=2)
  for one gather of B x vocab logits. A vocabulary W does not divide is padded with zero rows
  that the gather cuts off again.
- The embedding and every norm (Qwen3's per-head q/k norms too) are replicated: a lookup reads only
  B rows, so splitting the embedding would save memory only, at one more collective per step.

Packed SparseLinear layers split the same way. Their buffers are word-major, mask (in/32, out)
and values (in/32 · chunks, out, C) (sparse/format.py), so a row split slices the out axis and an
input-column split keeps whole 32-column words: the bitmask words and the N:M groups inside them
(M divides 32) stay intact. A rank's share of a packed layer's input columns must therefore be a
multiple of 32.

The collectives are functional collectives, which torch.compile traces into the graph, so the
compiled decode step, all-reduces included, is captured into one CUDA graph as on one device.
Every rank ends a step with the same logits; given the same sampling noise (`shared_seed`) every
rank then picks the same next token, and no broadcast of tokens is needed.
"""
import os
import random
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch import Tensor

from model import Attention, FeedForward, Transformer


def world_size() -> int:
    """Processes torchrun started (1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def is_main_process() -> bool:
    """The process that prints and writes results (rank 0; the only one outside torchrun)."""
    return rank() == 0


def process_device(device: str) -> str:
    """The device this process runs on: under torchrun a CUDA device is cuda:LOCAL_RANK (one GPU
    a process, whatever index was asked for); the CPU, or one process, keeps `device`."""
    if world_size() == 1 or not str(device).startswith("cuda"):
        return str(device)
    local_rank, here = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", world_size()))
    if here > torch.cuda.device_count():  # every rank sees this alike, so rank 0 reports it
        raise ValueError(f"torchrun started {here} processes on this machine but it has {torch.cuda.device_count()} "
                         f"GPU(s): use --nproc_per_node={torch.cuda.device_count()} or fewer")
    torch.cuda.set_device(local_rank)
    return f"cuda:{local_rank}"


def init_process_group(device: str):
    """Join the other processes: NCCL between GPUs, gloo on the CPU. Call after `shard`, so that a
    world size the model cannot be split by is refused before waiting for the other processes."""
    if world_size() > 1 and not dist.is_initialized():
        on_cuda = str(device).startswith("cuda")
        dist.init_process_group("nccl" if on_cuda else "gloo", device_id=torch.device(device) if on_cuda else None)


def destroy_process_group():
    if dist.is_initialized():
        dist.destroy_process_group()


def from_main_process(value):
    """Rank 0's `value` on every rank (the value itself in one process): for decisions every rank
    must take alike, such as a seed or whether to start another run."""
    if world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def shared_generator(device):
    """Under torchrun, a random generator on `device` seeded alike on every rank (rank 0 draws the
    seed); None in one process. Sampling must draw the same noise on every rank for all of them to
    pick the same token, and torch's default generators may drift apart between ranks (the kernel
    tuners draw random inputs from them)."""
    if world_size() == 1:
        return None
    seed = from_main_process(random.SystemRandom().randrange(2**63) if is_main_process() else None)
    return torch.Generator(device).manual_seed(seed)


def input_on_main_process(prompt: str) -> str:
    """input(prompt) read by rank 0 and handed to every rank; EOFError on every rank at the end."""
    if world_size() == 1:
        return input(prompt)
    line = None
    if is_main_process():
        try:
            line = input(prompt)
        except EOFError:
            pass
    line = from_main_process(line)
    if line is None:
        raise EOFError
    return line


def silence_other_ranks():
    """Ranks other than 0 print nothing to stdout (their errors still go to stderr)."""
    if not is_main_process():
        sys.stdout = open(os.devnull, "w")


# ---------------------------------------------------------------------------------------------
# Splitting a model


def check_split(model: Transformer, ranks: int):
    """Raise ValueError (one line) unless `ranks` processes can split this model."""
    from sparse.format import WORD_BITS  # sparse (Triton) is imported where a model may be packed, not by generate.py
    from sparse.linear import SparseLinear

    c = model.config
    if c.n_local_heads % ranks:
        raise ValueError(f"tensor parallel over {ranks} processes needs the model's {c.n_local_heads} key/value heads "
                         f"to divide evenly: use a process count that divides {c.n_local_heads}")
    if c.intermediate_size % ranks:
        raise ValueError(f"tensor parallel over {ranks} processes needs the model's intermediate size "
                         f"{c.intermediate_size} to divide evenly")
    for name, module in model.named_modules():
        if isinstance(module, SparseLinear) and name.endswith(("attention.wo", "feed_forward.w2")):
            width = module.in_features // ranks
            if width % WORD_BITS:
                raise ValueError(f"tensor parallel over {ranks} processes would give each a {width}-column slice of the "
                                 f"packed layer {name} ({module.in_features} input columns); packed layers split only "
                                 f"at 32-column words: use fewer processes")


def shard(model: Transformer, rank_index: int = None, ranks: int = None) -> Transformer:
    """Keep this rank's slices of `model` (in place; the module docstring says which), on whatever
    device the model is, meta included. rank_index / ranks default to torchrun's RANK / WORLD_SIZE.
    Needs no process group; the collectives it installs need one when the model runs."""
    rank_index = rank() if rank_index is None else rank_index
    ranks = world_size() if ranks is None else ranks
    if ranks == 1:
        return model
    check_split(model, ranks)
    for module in model.modules():
        if isinstance(module, Attention):
            shard_attention(module, rank_index, ranks)
        elif isinstance(module, FeedForward):
            shard_feed_forward(module, rank_index, ranks)
    model.output = VocabSplitHead(model.output, rank_index, ranks)
    return model


def shard_attention(attention: Attention, rank_index: int, ranks: int):
    q_heads, kv_heads, d = attention.n_head // ranks, attention.n_local_heads // ranks, attention.head_dim
    q_rows, kv_rows = attention.n_head * d, attention.n_local_heads * d
    q_start, kv_start = rank_index * q_heads * d, rank_index * kv_heads * d
    attention.wqkv = keep_rows(attention.wqkv, [(q_start, q_start + q_heads * d),
                                                (q_rows + kv_start, q_rows + kv_start + kv_heads * d),
                                                (q_rows + kv_rows + kv_start, q_rows + kv_rows + kv_start + kv_heads * d)])
    attention.wo = SummedOverRanks(keep_columns(attention.wo, q_start, q_start + q_heads * d, rank_index))
    attention.n_head, attention.n_local_heads = q_heads, kv_heads


def shard_feed_forward(feed_forward: FeedForward, rank_index: int, ranks: int):
    full, part = feed_forward.intermediate_size, feed_forward.intermediate_size // ranks
    start = rank_index * part
    feed_forward.w13 = keep_rows(feed_forward.w13, [(start, start + part), (full + start, full + start + part)])
    feed_forward.w2 = SummedOverRanks(keep_columns(feed_forward.w2, start, start + part, rank_index))
    feed_forward.intermediate_size = part


def keep_rows(linear: nn.Module, ranges: list, pad_to: int = None) -> nn.Module:
    """A new layer of the same kind holding output rows [a, b) of every (a, b) in `ranges`, in
    order, then zero rows up to `pad_to` rows (a packed layer pads with its first row's mask)."""
    def rows_of(t: Tensor, dim: int) -> Tensor:
        kept = torch.cat([t.narrow(dim, a, b - a) for a, b in ranges], dim=dim)
        missing = (pad_to or kept.shape[dim]) - kept.shape[dim]
        if missing:
            filler = t.narrow(dim, 0, 1).expand_as(t.narrow(dim, 0, missing)) if t.dtype == torch.int32 else \
                t.new_zeros(t.narrow(dim, 0, missing).shape)
            kept = torch.cat([kept, filler], dim=dim)
        return kept

    from sparse.linear import SparseLinear

    if isinstance(linear, SparseLinear):  # values (chunks, out, C), mask (words, out)
        values, mask = rows_of(linear.values, 1), rows_of(linear.mask, 1)
        kept = SparseLinear(linear.in_features, mask.shape[1], linear.pattern, dtype=values.dtype, device="meta")
        kept.values, kept.mask = values, mask
        return kept
    if isinstance(linear, nn.Linear):
        weight = rows_of(linear.weight.detach(), 0)
        kept = nn.Linear(linear.in_features, weight.shape[0], bias=linear.bias is not None, device="meta")
        kept.weight = nn.Parameter(weight, requires_grad=False)
        if linear.bias is not None:
            kept.bias = nn.Parameter(rows_of(linear.bias.detach(), 0), requires_grad=False)
        return kept
    raise TypeError(f"cannot split a {type(linear).__name__} by rows")


def keep_columns(linear: nn.Module, start: int, stop: int, rank_index: int) -> nn.Module:
    """A new layer of the same kind holding input columns [start, stop). A bias stays on rank 0
    only, so the all-reduce adds it once."""
    from sparse.format import WORD_BITS
    from sparse.linear import SparseLinear

    if isinstance(linear, SparseLinear):
        if start % WORD_BITS or stop % WORD_BITS:  # check_split refuses such a split first
            raise ValueError(f"a packed layer splits only at 32-column words, not at columns {start}..{stop}")
        words = linear.mask.shape[0]
        chunks_per_word = linear.values.shape[0] // words
        first, last = start // WORD_BITS, stop // WORD_BITS
        kept = SparseLinear(stop - start, linear.out_features, linear.pattern, dtype=linear.values.dtype, device="meta")
        kept.values = linear.values[first * chunks_per_word:last * chunks_per_word].clone()
        kept.mask = linear.mask[first:last].clone()
        return kept
    if isinstance(linear, nn.Linear):
        has_bias = linear.bias is not None and rank_index == 0
        kept = nn.Linear(stop - start, linear.out_features, bias=has_bias, device="meta")
        kept.weight = nn.Parameter(linear.weight.detach()[:, start:stop].contiguous(), requires_grad=False)
        if has_bias:
            kept.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        return kept
    raise TypeError(f"cannot split a {type(linear).__name__} by columns")


class SummedOverRanks(nn.Module):
    """A linear layer holding a slice of the input columns: its product is a partial sum, and an
    all-reduce adds the ranks' partial sums for every row of x. `fuses` and the prologue pass
    through to a SparseLinear, but the residual is added after the all-reduce (inside the kernel
    every rank would add it)."""

    def __init__(self, linear: nn.Module):
        super().__init__()
        self.linear = linear

    def fuses(self, x: Tensor, prologue: bool = False) -> bool:
        inner = getattr(self.linear, "fuses", None)
        return inner is not None and inner(x, prologue)

    def forward(self, x: Tensor, norm: nn.Module = None, residual: Tensor = None, gated: bool = False) -> Tensor:
        partial = self.linear(x, norm=norm, gated=gated) if norm is not None or gated else self.linear(x)
        total = funcol.wait_tensor(funcol.all_reduce(partial, "sum", dist.group.WORLD))  # a plain tensor, eager too
        return total if residual is None else residual + total


class VocabSplitHead(nn.Module):
    """The lm_head split by vocabulary rows: each rank computes the logits of its rows and an
    all-gather along the last axis gives every rank all of them."""

    def __init__(self, linear: nn.Module, rank_index: int, ranks: int):
        super().__init__()
        self.vocab_size = linear.out_features
        per_rank = -(-self.vocab_size // ranks)
        start, stop = min(rank_index * per_rank, self.vocab_size), min((rank_index + 1) * per_rank, self.vocab_size)
        self.linear = keep_rows(linear, [(start, stop)], pad_to=per_rank)

    def forward(self, x: Tensor) -> Tensor:
        local = self.linear(x)
        logits = funcol.all_gather_single(local, local.dim() - 1, dist.group.WORLD)
        return funcol.wait_tensor(logits[..., :self.vocab_size])
