"""Attention for one new token per sequence (the decode step), as two Triton kernels.

Why not `F.scaled_dot_product_attention` here: at decode, with one query per sequence, Inductor
lowers SDPA to a few reduction kernels whose cost depended on what it fused around them. On the
H200 (docs/BENCHMARKS.md, 2026-12-01) the same attention code took 429 µs per Llama-3.1-8B step
in the dense model and 730 µs in the 2:4 model, ~12-20x the time to read its ~100 MB of KV cache.

Flash-decoding: the cache slots are split over programs, grid (batch x KV heads, splits). A
program takes the query heads that share its KV head (GQA) as the rows of one tile, padded to 16
for `tl.dot`, and walks its slots in blocks: scores = q·K^T, an online softmax, acc += p·V. Blocks
whose slots are all masked (past the current position, or left padding) are skipped, so the
kernel reads only the cache that is in use. A second kernel merges the splits' partial results
(each split's max score, sum of exponentials and weighted values).

The same source runs under TRITON_INTERPRET=1 on CPU (tests/test_decode_attention.py). The model
(model.py) calls `decode_attention` only on CUDA, for one query per sequence and head_dim >= 16;
everything else goes to SDPA.
"""
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
PROGRAMS_TARGET = 264  # two programs per SM of an H200 (132 SMs)
BLOCK_SLOTS = 32


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, INTERPRETER_SAFE: tl.constexpr):
    """a @ b in fp32; full fp32 products for fp32 inputs (tl.dot defaults to tf32 there). The
    interpreter multiplies bf16 tiles as raw bits, so there the tiles are upcast first."""
    if INTERPRETER_SAFE:
        a, b = a.to(tl.float32), b.to(tl.float32)
    if IEEE:
        product = tl.dot(a, b, input_precision="ieee")
    else:
        product = tl.dot(a, b)
    return product


@triton.jit
def _partial_attention_kernel(q_ptr, k_ptr, v_ptr, keep_ptr, acc_ptr, stats_ptr,
                              n_kv_heads, n_slots, slots_per_split, scale,
                              q_stride_b, q_stride_h, kv_stride_b, kv_stride_h, kv_stride_s, keep_stride_b,
                              GROUP_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                              BLOCK: tl.constexpr, IEEE: tl.constexpr, INTERPRETER_SAFE: tl.constexpr):
    """Partial attention of the GROUP_SIZE query heads of one KV head over one split of the slots.

    Writes acc (unnormalised sum of p·V, fp32) and stats (max score, sum of exp) per query head and
    split; a split with no kept slot leaves max = -inf, sum = 0, acc = 0."""
    batch_head = tl.program_id(0)
    split = tl.program_id(1)
    b = batch_head // n_kv_heads
    kv_head = batch_head % n_kv_heads
    rows = tl.arange(0, GROUP)
    row_ok = rows < GROUP_SIZE
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + b * q_stride_b + (kv_head * GROUP_SIZE + rows)[:, None] * q_stride_h + dims[None, :],
                mask=row_ok[:, None], other=0.0)
    kv_base = b * kv_stride_b + kv_head * kv_stride_h
    max_score = tl.full([GROUP], float("-inf"), tl.float32)
    total = tl.zeros([GROUP], tl.float32)
    acc = tl.zeros([GROUP, HEAD_DIM], tl.float32)
    first = split * slots_per_split
    last = tl.minimum(first + slots_per_split, n_slots)
    for start in range(first, last, BLOCK):
        slots = start + tl.arange(0, BLOCK)
        keep = tl.load(keep_ptr + b * keep_stride_b + slots, mask=slots < last, other=0) != 0
        if tl.max(keep.to(tl.int32), axis=0) > 0:
            offsets = kv_base + slots[:, None] * kv_stride_s + dims[None, :]
            k = tl.load(k_ptr + offsets, mask=keep[:, None], other=0.0)
            scores = _dot(q, tl.trans(k), IEEE, INTERPRETER_SAFE) * scale  # [GROUP, BLOCK] fp32
            scores = tl.where(keep[None, :], scores, float("-inf"))
            new_max = tl.maximum(max_score, tl.max(scores, axis=1))
            rescale = tl.exp(max_score - new_max)
            p = tl.exp(scores - new_max[:, None])
            total = total * rescale + tl.sum(p, axis=1)
            v = tl.load(v_ptr + offsets, mask=keep[:, None], other=0.0)
            acc = acc * rescale[:, None] + _dot(p.to(v.dtype), v, IEEE, INTERPRETER_SAFE)
            max_score = new_max
    n_splits = tl.num_programs(1)
    heads = (kv_head * GROUP_SIZE + rows) + b * (n_kv_heads * GROUP_SIZE)  # flat (batch, query head)
    tl.store(acc_ptr + (heads * n_splits + split)[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None])
    tl.store(stats_ptr + (heads * n_splits + split) * 2, max_score, mask=row_ok)
    tl.store(stats_ptr + (heads * n_splits + split) * 2 + 1, total, mask=row_ok)


@triton.jit
def _merge_splits_kernel(acc_ptr, stats_ptr, out_ptr, n_splits,
                         SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """out[head] = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s over the splits s of one head."""
    head = tl.program_id(0)
    splits = tl.arange(0, SPLITS)
    split_ok = splits < n_splits
    dims = tl.arange(0, HEAD_DIM)
    max_scores = tl.load(stats_ptr + (head * n_splits + splits) * 2, mask=split_ok, other=float("-inf"))
    totals = tl.load(stats_ptr + (head * n_splits + splits) * 2 + 1, mask=split_ok, other=0.0)
    overall = tl.max(max_scores, axis=0)
    weights = tl.where(split_ok & (max_scores > float("-inf")), tl.exp(max_scores - overall), 0.0)
    acc = tl.load(acc_ptr + (head * n_splits + splits)[:, None] * HEAD_DIM + dims[None, :],
                  mask=split_ok[:, None], other=0.0)
    out = tl.sum(acc * weights[:, None], axis=0) / tl.sum(totals * weights, axis=0)
    tl.store(out_ptr + head * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty))


def supports(head_dim: int) -> bool:
    """tl.dot needs a power-of-two head_dim of at least 16 (stories260K's is 8: it uses SDPA)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


@torch.library.custom_op("sparse_decoding::decode_attention", mutates_args=())
def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, keep: Tensor) -> Tensor:
    """Softmax attention of one query per sequence over a KV cache.

    q [B, H, D]; k_cache, v_cache [B, H_kv, S, D] with unit stride along D; keep [B, S] bool: the
    slots each sequence may attend. Returns [B, H, D] in q's dtype; scale 1/sqrt(D) like SDPA.
    """
    batch, n_heads, head_dim = q.shape
    _, n_kv_heads, n_slots, _ = k_cache.shape
    group_size = n_heads // n_kv_heads
    if n_heads % n_kv_heads or not supports(head_dim) or q.stride(2) != 1 or k_cache.stride(3) != 1:
        raise ValueError(f"decode_attention: unsupported shapes q {tuple(q.shape)}, cache {tuple(k_cache.shape)}")
    if k_cache.stride() != v_cache.stride():
        raise ValueError("decode_attention: k_cache and v_cache must share strides")
    splits = max(1, min(triton.cdiv(PROGRAMS_TARGET, batch * n_kv_heads), triton.cdiv(n_slots, BLOCK_SLOTS)))
    slots_per_split = triton.cdiv(triton.cdiv(n_slots, splits), BLOCK_SLOTS) * BLOCK_SLOTS
    splits = triton.cdiv(n_slots, slots_per_split)
    acc = torch.empty(batch * n_heads, splits, head_dim, dtype=torch.float32, device=q.device)
    stats = torch.empty(batch * n_heads, splits, 2, dtype=torch.float32, device=q.device)
    _partial_attention_kernel[(batch * n_kv_heads, splits)](
        q, k_cache, v_cache, keep, acc, stats, n_kv_heads, n_slots, slots_per_split, head_dim ** -0.5,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), keep.stride(0),
        GROUP_SIZE=group_size, GROUP=max(16, triton.next_power_of_2(group_size)), HEAD_DIM=head_dim,
        BLOCK=BLOCK_SLOTS, IEEE=q.dtype == torch.float32, INTERPRETER_SAFE=INTERPRETING)
    out = torch.empty(batch, n_heads, head_dim, dtype=q.dtype, device=q.device)
    _merge_splits_kernel[(batch * n_heads,)](acc, stats, out, splits, SPLITS=triton.next_power_of_2(splits),
                                             HEAD_DIM=head_dim)
    return out


@decode_attention.register_fake
def _(q: Tensor, k_cache: Tensor, v_cache: Tensor, keep: Tensor) -> Tensor:
    return torch.empty_like(q)
