"""Attention for one new token per sequence (the decode step), as one Triton kernel.

Why not `F.scaled_dot_product_attention`: at decode, with one query per sequence, Inductor lowers
SDPA to a few reduction kernels whose cost depended on what it fused around them, many times the
time to read the KV cache (docs/KERNELS.md).

Flash-decoding: the cache slots are split over programs, grid (batch x KV heads, splits). A
program takes the query heads that share its KV head (GQA) as the rows of one tile, padded to 16
for `tl.dot`, and walks its slots in blocks: scores = q·K^T, an online softmax, acc += p·V. In
PyTorch terms, for one row b and KV head h over the slots s of a split:

    scores = q[b, heads of h] @ k_cache[b, h, s].T / sqrt(D)      (slots outside the window: -inf)
    m = scores.max(-1); p = exp(scores - m); l = p.sum(-1); acc = p @ v_cache[b, h, s]

and the splits' (m, l, acc) merge into softmax(...) @ V as sum_s exp(m_s - M) acc_s / sum_s
exp(m_s - M) l_s. Each program counts its arrival on an atomic counter after storing its partials,
and the last of a (row, KV head) to arrive merges them (as the SpMV's split-K epilogue does), so a
layer's attention is one launch.

The kernel takes the new token's q, k and v as the qkv projection left them (one tensor): it
rotates q and k by RoPE itself (after Qwen3's q/k norms, given their weights) and writes k and v
into the cache (the program whose split holds the new slot writes it, then reads it back like any
slot), looking up its cos/sin row in the model's tables and keeping the row's window of slots (left
padding to the new token) without a mask. That replaces several small kernels a layer (RoPE of q
and k, the cache writes) which cannot fuse into the sparse kernels' custom ops.

A split walks its blocks in a software-pipelined loop (`tl.range(num_stages=PIPELINE_STAGES)`): the
next block's K and V are copied to shared memory while this one is scored, because the kernel was
found waiting on its own loads. A split of one block has nothing to overlap and keeps the plain
loop (`block_loop_stages`).

The same source runs under TRITON_INTERPRET=1 on CPU (tests/test_sparse_kernels_decode_attention.py).
"""
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from sparse.kernels.common import INTERPRETING

PROGRAMS_TARGET = 264  # programs to aim for: two per SM of an H200 (132 SMs)
# Slots a block: 64 measured faster than 32 at every batch and cache length timed; where the cache
# caps the splits (batch 1) that halves them, elsewhere each split walks half as many blocks.
BLOCK_SLOTS = 64
PIPELINE_STAGES = 2  # the block loop's stages where a split walks two blocks or more


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
def _load_rotated(ptr, row_offsets, row_ok, cos, sin, norm_ptr, norm_eps, HEAD_DIM: tl.constexpr,
                  NORM: tl.constexpr):
    """Rows ptr + row_offsets (HEAD_DIM each) turned by RoPE in the rotate-half layout, in fp32
    and rounded back to their dtype, as model.apply_rope does: x * cos + rotate_half(x) * sin.
    With NORM, each row first goes through model.RMSNorm with weight norm_ptr (Qwen3's q/k norm),
    rounded as it rounds: x * rsqrt(mean(x²) + eps) to x's dtype, times the weight to x's dtype."""
    dims = tl.arange(0, HEAD_DIM)
    partner_dims = (dims + HEAD_DIM // 2) % HEAD_DIM
    x = tl.load(ptr + row_offsets[:, None] + dims[None, :], mask=row_ok[:, None], other=0.0)
    partner = tl.load(ptr + row_offsets[:, None] + partner_dims[None, :], mask=row_ok[:, None], other=0.0)
    if NORM:
        x_f32 = x.to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(x_f32 * x_f32, axis=1) / HEAD_DIM + norm_eps)[:, None]
        weight = tl.load(norm_ptr + dims).to(tl.float32)[None, :]
        partner_weight = tl.load(norm_ptr + partner_dims).to(tl.float32)[None, :]
        partner = ((partner.to(tl.float32) * inv_rms).to(x.dtype).to(tl.float32) * partner_weight).to(x.dtype)
        x = ((x_f32 * inv_rms).to(x.dtype).to(tl.float32) * weight).to(x.dtype)
    partner = partner.to(tl.float32)
    rotated = tl.where(dims[None, :] < HEAD_DIM // 2, -partner, partner)
    return (x.to(tl.float32) * cos[None, :] + rotated * sin[None, :]).to(x.dtype)


@triton.jit
def _kept_slots(slots, end, first_kept, last_kept):
    """Which of these slots are attended: the row's window first_kept..last_kept, before `end`."""
    return (slots >= first_kept) & (slots <= last_kept) & (slots < end)


@triton.jit
def _attend_block(q, k_ptr, v_ptr, offsets, keep, max_score, total, acc, scale, MAY_BE_EMPTY: tl.constexpr,
                  IEEE: tl.constexpr, INTERPRETER_SAFE: tl.constexpr):
    """One block of slots folded into the online softmax: returns the new (max score, sum of exp,
    unnormalised p·V). MAY_BE_EMPTY (the pipelined loop, which has no branch around empty blocks): a
    block with nothing kept changes nothing, the max it uses being 0 where every score so far is
    -inf, so no -inf - -inf appears; the plain loop skips such blocks and compiles without the guard."""
    k = tl.load(k_ptr + offsets, mask=keep[:, None], other=0.0)
    scores = _dot(q, tl.trans(k), IEEE, INTERPRETER_SAFE) * scale  # [GROUP, BLOCK] fp32
    scores = tl.where(keep[None, :], scores, float("-inf"))
    new_max = tl.maximum(max_score, tl.max(scores, axis=1))
    finite_max = new_max
    if MAY_BE_EMPTY:
        finite_max = tl.where(new_max == float("-inf"), 0.0, new_max)
    rescale = tl.exp(max_score - finite_max)
    p = tl.exp(scores - finite_max[:, None])
    total = total * rescale + tl.sum(p, axis=1)
    v = tl.load(v_ptr + offsets, mask=keep[:, None], other=0.0)
    acc = acc * rescale[:, None] + _dot(p.to(v.dtype), v, IEEE, INTERPRETER_SAFE)
    return new_max, total, acc


@triton.jit
def partial_attention_kernel(q_ptr, k_ptr, v_ptr, acc_ptr, stats_ptr, out_ptr, arrivals_ptr, new_k_ptr, new_v_ptr,
                             cos_ptr, sin_ptr, left_pad_ptr, write_slot_ptr, q_norm_ptr, k_norm_ptr, norm_eps,
                             n_kv_heads, n_slots, slots_per_split, scale, q_stride_b, q_stride_h,
                             kv_stride_b, kv_stride_h, kv_stride_s, new_k_stride_b, new_k_stride_h, new_v_stride_b,
                             new_v_stride_h, rope_stride_s, GROUP_SIZE: tl.constexpr, GROUP: tl.constexpr,
                             HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, QK_NORM: tl.constexpr,
                             MERGE_HEADS: tl.constexpr, SPLITS: tl.constexpr, MERGE_CHUNK: tl.constexpr,
                             STAGES: tl.constexpr, IEEE: tl.constexpr, INTERPRETER_SAFE: tl.constexpr):
    """Partial attention of the GROUP_SIZE query heads of one KV head over one split of the slots.

    Writes acc (unnormalised sum of p·V, fp32) and stats (max score, sum of exp) per query head and
    split; a split with no kept slot leaves max = -inf, sum = 0, acc = 0. The kept slots are the
    row's window: from its left padding left_pad_ptr[b] to the new token's slot *write_slot_ptr. q
    and the new k (new_k_ptr, new_v_ptr: [B, H_kv, D]) arrive unrotated and are rotated with the
    cos/sin tables' row at the token's position (its slot less the padding), and the split that
    holds slot *write_slot_ptr stores the new k and v there. With QK_NORM, q and the new k first go
    through RMSNorm over each head (weights q_norm_ptr, k_norm_ptr [D]), as Qwen3's do. The last of
    the row's and KV head's programs to finish merges the splits into out (arrivals_ptr: one zeroed
    int32 per row and KV head, left zeroed)."""
    batch_head = tl.program_id(0)
    split = tl.program_id(1)
    b = batch_head // n_kv_heads
    kv_head = batch_head % n_kv_heads
    rows = tl.arange(0, GROUP)
    row_ok = rows < GROUP_SIZE
    dims = tl.arange(0, HEAD_DIM)
    kv_base = b * kv_stride_b + kv_head * kv_stride_h
    first = split * slots_per_split
    last = tl.minimum(first + slots_per_split, n_slots)
    # The kept window first_kept..last_kept is computed here rather than passed in: Inductor copied
    # a per-step mask and cos/sin rows into fresh buffers for each layer's call.
    write_slot = tl.load(write_slot_ptr)
    first_kept = tl.load(left_pad_ptr + b)
    last_kept = write_slot
    position = tl.maximum(write_slot - first_kept, 0)  # positions count from the row's first real token
    cos = tl.load(cos_ptr + position * rope_stride_s + dims)
    sin = tl.load(sin_ptr + position * rope_stride_s + dims)
    q = _load_rotated(q_ptr + b * q_stride_b, (kv_head * GROUP_SIZE + rows) * q_stride_h, row_ok, cos, sin,
                      q_norm_ptr, norm_eps, HEAD_DIM, QK_NORM)
    one_row = tl.arange(0, 1)
    new_k = _load_rotated(new_k_ptr + b * new_k_stride_b + kv_head * new_k_stride_h, one_row, one_row == 0, cos,
                          sin, k_norm_ptr, norm_eps, HEAD_DIM, QK_NORM)  # [1, D]
    new_v = tl.load(new_v_ptr + b * new_v_stride_b + kv_head * new_v_stride_h + one_row[:, None] + dims[None, :])
    if (first <= write_slot) & (write_slot < last):  # one program per (row, KV head) writes
        slot_offsets = kv_base + write_slot * kv_stride_s + dims[None, :]
        tl.store(k_ptr + slot_offsets, new_k.to(k_ptr.dtype.element_ty))
        tl.store(v_ptr + slot_offsets, new_v.to(v_ptr.dtype.element_ty))
    # The block's threads read the slot below: a CTA barrier orders their loads after these stores
    # (CUDA's __syncthreads also orders global memory within the block). Substituting the new k and
    # v's registers in every block instead grew the loop and the registers by nearly half.
    tl.debug_barrier()
    max_score = tl.full([GROUP], float("-inf"), tl.float32)
    total = tl.zeros([GROUP], tl.float32)
    acc = tl.zeros([GROUP, HEAD_DIM], tl.float32)
    if STAGES > 1:
        # No slot before the row's padding or after the new token's is kept: the loop (which has no
        # branch around empty blocks) walks only the blocks that hold the window.
        begin = tl.maximum(first, first_kept // BLOCK * BLOCK)
        stop = tl.minimum(last, last_kept + 1)
        for start in tl.range(begin, stop, BLOCK, num_stages=STAGES):
            slots = start + tl.arange(0, BLOCK)
            keep = _kept_slots(slots, stop, first_kept, last_kept)
            offsets = kv_base + slots[:, None] * kv_stride_s + dims[None, :]
            max_score, total, acc = _attend_block(q, k_ptr, v_ptr, offsets, keep, max_score, total, acc, scale,
                                                  True, IEEE, INTERPRETER_SAFE)
    else:  # (begin/stop here too made this loop longer and took registers)
        for start in range(first, last, BLOCK):
            slots = start + tl.arange(0, BLOCK)
            keep = _kept_slots(slots, last, first_kept, last_kept)
            if tl.max(keep.to(tl.int32), axis=0) > 0:  # skip blocks with nothing kept (past the new token)
                offsets = kv_base + slots[:, None] * kv_stride_s + dims[None, :]
                max_score, total, acc = _attend_block(q, k_ptr, v_ptr, offsets, keep, max_score, total, acc, scale,
                                                      False, IEEE, INTERPRETER_SAFE)
    n_splits = tl.num_programs(1)
    heads = (kv_head * GROUP_SIZE + rows) + b * (n_kv_heads * GROUP_SIZE)  # flat (batch, query head)
    tl.store(acc_ptr + (heads * n_splits + split)[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None])
    tl.store(stats_ptr + (heads * n_splits + split) * 2, max_score, mask=row_ok)
    tl.store(stats_ptr + (heads * n_splits + split) * 2 + 1, total, mask=row_ok)
    tl.debug_barrier()  # every thread's partials are stored before the arrival is counted
    arrived = tl.atomic_add(arrivals_ptr + batch_head, 1, sem="acq_rel")
    if arrived == n_splits - 1:  # the others' partials are visible after this acquire
        _merge_heads(acc_ptr, stats_ptr, out_ptr, b * (n_kv_heads * GROUP_SIZE) + kv_head * GROUP_SIZE,
                     GROUP_SIZE, n_splits, MERGE_HEADS, SPLITS, MERGE_CHUNK, HEAD_DIM)
        tl.atomic_xchg(arrivals_ptr + batch_head, 0)


@triton.jit
def _merge_heads(acc_ptr, stats_ptr, out_ptr, first_head, n_heads, n_splits, HEADS: tl.constexpr,
                 SPLITS: tl.constexpr, CHUNK: tl.constexpr, HEAD_DIM: tl.constexpr):
    """out[h] = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s over the splits s, for the n_heads
    heads first_head, first_head + 1, ... The splits' values come CHUNK at a time, every load
    issued before any store (a one-program merge waits on one L2 round trip, not one per head);
    the loads bypass L1 (.cg): other SMs wrote these lines during this kernel."""
    heads = first_head + tl.arange(0, HEADS)
    head_ok = tl.arange(0, HEADS) < n_heads
    splits = tl.arange(0, SPLITS)
    stats_offsets = (heads[:, None] * n_splits + splits[None, :]) * 2
    ok = head_ok[:, None] & (splits < n_splits)[None, :]
    max_scores = tl.load(stats_ptr + stats_offsets, mask=ok, other=float("-inf"), cache_modifier=".cg")
    totals = tl.load(stats_ptr + stats_offsets + 1, mask=ok, other=0.0, cache_modifier=".cg")
    overall = tl.max(max_scores, axis=1)
    denominator = tl.sum(tl.where(max_scores > float("-inf"), totals * tl.exp(max_scores - overall[:, None]), 0.0),
                         axis=1)
    dims = tl.arange(0, HEAD_DIM)
    out = tl.zeros([HEADS, HEAD_DIM], tl.float32)
    for c in tl.static_range(SPLITS // CHUNK):
        chunk = c * CHUNK + tl.arange(0, CHUNK)
        rows = heads[:, None] * n_splits + chunk[None, :]  # [HEADS, CHUNK]
        chunk_ok = head_ok[:, None] & (chunk < n_splits)[None, :]
        chunk_max = tl.load(stats_ptr + rows * 2, mask=chunk_ok, other=float("-inf"), cache_modifier=".cg")
        weights = tl.where(chunk_max > float("-inf"), tl.exp(chunk_max - overall[:, None]), 0.0)
        acc = tl.load(acc_ptr + rows[:, :, None] * HEAD_DIM + dims[None, None, :], mask=chunk_ok[:, :, None],
                      other=0.0, cache_modifier=".cg")
        out += tl.sum(acc * weights[:, :, None], axis=1)
    out = out / denominator[:, None]
    tl.store(out_ptr + heads[:, None] * HEAD_DIM + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=head_ok[:, None])


# The merge's arrival counters, one zeroed int32 per (row, KV head), per device: the kernel leaves
# them zeroed, so every layer reuses them (calls run one after another on one stream). Reserved
# before torch.compile records its CUDA graphs (`reserve_arrival_counters`): allocated during the
# graph's warm-up they would sit in its memory pool, which cudagraph trees refuse. Replaced ones
# are kept alive because captured CUDA graphs may still point at them.
arrival_counters = {}
retired_arrival_counters = []


def reserve_arrival_counters(device, n: int) -> Tensor:
    """Counters for n (row, KV head) pairs on device, allocated now if those held are fewer."""
    held = arrival_counters.get(str(device))
    if held is None or held.numel() < n:
        if held is not None:
            retired_arrival_counters.append(held)
        held = arrival_counters[str(device)] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return held


def merge_tiling(group_size: int, splits: int):
    """(heads merged by one program: the GQA group, splits padded to a power of two, splits a load
    takes: 32 (head, split) rows of values)."""
    heads = triton.next_power_of_2(group_size)
    split_tile = triton.next_power_of_2(splits)
    return heads, split_tile, max(1, min(split_tile, 32 // heads))


def block_loop_stages(slots_per_split: int) -> int:
    """The block loop's pipeline stages: PIPELINE_STAGES where a split walks two blocks or more,
    the plain loop (1) where it walks one (nothing to overlap)."""
    return PIPELINE_STAGES if slots_per_split > BLOCK_SLOTS else 1


def supports(head_dim: int) -> bool:
    """tl.dot needs a power-of-two head_dim of at least 16 (stories260K's is 8: it uses SDPA)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def handles(q: Tensor) -> bool:
    """Whether a decode step's attention with this q [.., head_dim] should come here: on CUDA, for a
    head_dim the kernel supports; the CPU decodes through SDPA."""
    return q.is_cuda and supports(q.shape[-1])


def _attend(q: Tensor, new_k: Tensor, new_v: Tensor, k_cache: Tensor, v_cache: Tensor, rope_cos: Tensor,
            rope_sin: Tensor, left_pad: Tensor, write_slot: Tensor, q_norm=None, k_norm=None, norm_eps=0.0) -> Tensor:
    """The kernel for q [B, H, D] and the new k, v [B, H_kv, D] of a decode step over the first B rows
    of the caches (see decode_attention_with_cache_write); q_norm and k_norm [D] (both or neither):
    RMSNorm weights for q's and the new k's heads before RoPE."""
    batch, n_heads, head_dim = q.shape
    _, n_kv_heads, n_slots, _ = k_cache.shape
    group_size = n_heads // n_kv_heads
    if n_heads % n_kv_heads or not supports(head_dim) or q.stride(2) != 1 or k_cache.stride(3) != 1:
        raise ValueError(f"decode_attention: unsupported shapes q {tuple(q.shape)}, cache {tuple(k_cache.shape)}")
    if k_cache.stride() != v_cache.stride():
        raise ValueError("decode_attention: k_cache and v_cache must share strides")
    if (rope_cos.dim() != 2 or rope_cos.shape[0] < n_slots or rope_cos.shape[1] != head_dim
            or rope_cos.shape != rope_sin.shape or rope_cos.stride() != rope_sin.stride() or rope_cos.stride(1) != 1):
        raise ValueError(f"decode_attention: RoPE tables {tuple(rope_cos.shape)} / {tuple(rope_sin.shape)} do not "
                         f"cover {n_slots} positions of {head_dim}")
    if left_pad.dim() != 1 or left_pad.numel() < batch or left_pad.is_floating_point():
        raise ValueError(f"decode_attention: left_pad {tuple(left_pad.shape)} does not hold {batch} rows' padding")
    if (q_norm is None) != (k_norm is None) or any(
            w is not None and (w.shape != (head_dim,) or w.stride(0) != 1 or w.dtype != q.dtype)
            for w in (q_norm, k_norm)):
        raise ValueError(f"decode_attention: q/k norm weights {None if q_norm is None else tuple(q_norm.shape)} / "
                         f"{None if k_norm is None else tuple(k_norm.shape)} are not both [{head_dim}] in {q.dtype}")
    qk_norm = q_norm is not None
    if not qk_norm:
        q_norm = k_norm = q  # unused pointers: compiled out
    splits = max(1, min(triton.cdiv(PROGRAMS_TARGET, batch * n_kv_heads), triton.cdiv(n_slots, BLOCK_SLOTS)))
    slots_per_split = triton.cdiv(triton.cdiv(n_slots, splits), BLOCK_SLOTS) * BLOCK_SLOTS
    splits = triton.cdiv(n_slots, slots_per_split)
    acc = torch.empty(batch * n_heads, splits, head_dim, dtype=torch.float32, device=q.device)
    stats = torch.empty(batch * n_heads, splits, 2, dtype=torch.float32, device=q.device)
    out = torch.empty(batch, n_heads, head_dim, dtype=q.dtype, device=q.device)
    arrivals = reserve_arrival_counters(q.device, batch * n_kv_heads)
    merge_heads, split_tile, merge_chunk = merge_tiling(group_size, splits)
    partial_attention_kernel[(batch * n_kv_heads, splits)](
        q, k_cache, v_cache, acc, stats, out, arrivals, new_k, new_v, rope_cos, rope_sin, left_pad, write_slot,
        q_norm, k_norm, norm_eps, n_kv_heads, n_slots, slots_per_split, head_dim ** -0.5,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        new_k.stride(0), new_k.stride(1), new_v.stride(0), new_v.stride(1), rope_cos.stride(0),
        GROUP_SIZE=group_size, GROUP=max(16, triton.next_power_of_2(group_size)), HEAD_DIM=head_dim,
        BLOCK=BLOCK_SLOTS, QK_NORM=qk_norm, MERGE_HEADS=merge_heads, SPLITS=split_tile, MERGE_CHUNK=merge_chunk,
        STAGES=block_loop_stages(slots_per_split), IEEE=q.dtype == torch.float32,
        INTERPRETER_SAFE=INTERPRETING)
    return out


@torch.library.custom_op("sparse_decoding::decode_attention_with_cache_write", mutates_args=("k_cache", "v_cache"))
def decode_attention_with_cache_write(qkv: Tensor, rope_cos: Tensor, rope_sin: Tensor, left_pad: Tensor,
                                      write_slot: Tensor, k_cache: Tensor, v_cache: Tensor,
                                      q_norm_weight: Optional[Tensor] = None, k_norm_weight: Optional[Tensor] = None,
                                      norm_eps: float = 0.0) -> Tensor:
    """decode_attention for the new token's q, k and v before RoPE and before the cache write.

    qkv [B, H + 2 H_kv, D]: the new token's H query heads, then its H_kv key heads, then its H_kv
    value heads (the qkv projection's output viewed by head; unit stride along D), H_kv =
    k_cache.shape[1]. rope_cos, rope_sin [>= S, D]: the RoPE tables by position
    (model.rope_cos/rope_sin, rotate-half layout, model.precompute_rope); left_pad [>= B]
    integers: row b's prompt starts at slot left_pad[b] (model.left_pad); write_slot: a
    one-element integer tensor, the cache slot of the new token (model: input_pos). Row b's token
    sits at position write_slot - left_pad[b] and attends slots left_pad[b] .. write_slot, as the
    model's causal and padding mask does. k_cache, v_cache [B_max >= B, H_kv, S, D] whole
    buffers: row b < B gets the rotated new k and the new v at write_slot; nothing else in them
    changes. q_norm_weight, k_norm_weight [D] (both or neither; qkv's dtype) and norm_eps: Qwen3's
    RMSNorm of each q and k head before RoPE (model.RMSNorm), done here too. Returns softmax
    attention [B, H, D] in q's dtype, scale 1/sqrt(D) like SDPA.

    The op takes whole tensors the model already holds, never rows or slices made in the step:
    Inductor gives a custom op a fresh copy of each such input, every layer, which cost dozens of
    small launches a step. Whole, the qkv projection's cast can fuse into it, and Qwen3's q/k norms
    inside spare their two launches a layer.
    """
    q, new_k, new_v = split_heads(qkv, k_cache)
    return _attend(q, new_k, new_v, k_cache, v_cache, rope_cos, rope_sin, left_pad, write_slot, q_norm_weight,
                   k_norm_weight, norm_eps)


def split_heads(qkv: Tensor, k_cache: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q [B, H, D], k and v [B, H_kv, D]: views into qkv [B, H + 2 H_kv, D], H_kv = k_cache.shape[1]."""
    n_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[3]
    n_heads = qkv.shape[1] - 2 * n_kv_heads
    if qkv.dim() != 3 or qkv.shape[2] != head_dim or n_heads < n_kv_heads:
        raise ValueError(f"decode_attention: qkv {tuple(qkv.shape)} is not [batch, query heads + 2 x {n_kv_heads} KV "
                         f"heads, {head_dim}] for a cache of {n_kv_heads} KV heads of {head_dim}")
    return qkv[:, :n_heads], qkv[:, n_heads:n_heads + n_kv_heads], qkv[:, n_heads + n_kv_heads:]


@decode_attention_with_cache_write.register_fake
def _(qkv, rope_cos, rope_sin, left_pad, write_slot, k_cache, v_cache, q_norm_weight=None, k_norm_weight=None,
      norm_eps=0.0) -> Tensor:
    q = split_heads(qkv, k_cache)[0]
    return q.new_empty(q.shape)  # contiguous, as _attend's out
