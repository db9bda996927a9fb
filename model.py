"""The transformer: Llama-2/3.x, Qwen2/2.5, Qwen3, SmolLM2 and llama2.c stories models in one flat file.

GPT-Fast's calling convention: `setup_caches(max_batch_size, max_seq_length)`, then
`forward(idx[B, T], input_pos[T]) -> logits[B, T, vocab]`.

Layout choices that other modules rely on:
- q/k/v are fused into `attention.wqkv` and gate/up into `feed_forward.w13`. Fusion only
  concatenates *output rows*, so N:M groups along in_features stay intact for the sparse format.
  Qwen2's q/k/v biases are likewise one fused `attention.wqkv.bias`; no other layer has a bias.
- RoPE rotates the two halves of each head (Hugging Face's `rotate_half` layout), so HF weights
  load unchanged; GGUF and llama2.c weights (interleaved pairs) are permuted on import.
- Every linear layer is a plain `nn.Linear`; `sparse.linear.swap_to_sparse` replaces them. Linear
  layers are called through `project`, which lets a SparseLinear take the norm before it, the
  residual add after it and FeedForward's silu(gate) * up into its decode kernel.
- Attention is plain PyTorch (RoPE, the KV-cache write, `F.scaled_dot_product_attention`) unless
  a decode-attention kernel is plugged into `Attention.decode_attention` from outside (generate.py
  does so on CUDA): then a decode step hands it the projection's output whole, and it applies the
  q/k norms and RoPE, writes the cache and attends in one call.
"""
import math
import numbers
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor


@dataclass
class ModelArgs:
    architecture: str = "llama"  # "llama" (Llama-2/3.x, SmolLM2, stories), "qwen2" (Qwen2, Qwen2.5) or "qwen3"
    block_size: int = 2048  # longest context the model was trained for
    vocab_size: int = 32000
    n_layer: int = 32
    n_head: int = 32
    dim: int = 4096
    intermediate_size: Optional[int] = None
    n_local_heads: int = -1  # key/value heads (GQA); -1 means n_head
    head_dim: Optional[int] = None  # Qwen3 sets it independently of dim // n_head
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    rope_scaling: Optional[dict] = None  # Llama-3.1 style: factor, low/high_freq_factor, original_max_position_embeddings
    tie_embeddings: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    qkv_bias: bool = False  # Qwen2: q, k and v projections have a bias (the output projection has none)

    def __post_init__(self):
        if self.architecture not in ("llama", "qwen2", "qwen3"):
            raise ValueError(f"unknown architecture '{self.architecture}' (expected 'llama', 'qwen2' or 'qwen3')")
        if self.n_local_heads == -1:
            self.n_local_heads = self.n_head
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "dim", "n_local_heads"):
            require_positive_int(name, getattr(self, name))
        if self.intermediate_size is None:  # llama2.c / Llama-2 rule: 2/3 of 4·dim, rounded up to 256
            hidden = int(2 * (4 * self.dim) / 3)
            self.intermediate_size = 256 * ((hidden + 255) // 256)
        if self.head_dim is None:
            self.head_dim = self.dim // self.n_head
        for name in ("intermediate_size", "head_dim"):
            require_positive_int(name, getattr(self, name))

    @classmethod
    def from_name(cls, name: str) -> "ModelArgs":
        """Exact name, else the longest config name contained in `name` (e.g. a folder name)."""
        if name in transformer_configs:
            return cls(**transformer_configs[name])
        matches = [c for c in transformer_configs if c.lower() in str(name).lower()]
        if not matches:
            raise ValueError(f"unknown model name '{name}'; known: {', '.join(transformer_configs)}")
        return cls(**transformer_configs[max(matches, key=len)])

    def to_dict(self) -> dict:
        return asdict(self)


def require_positive_int(name, value):
    """A config from a file may say 0 heads or "32" layers: refuse it here, not as a crash deep in the model."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:  # numpy ints too (GGUF)
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


_LLAMA31_ROPE = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
_LLAMA32_ROPE = dict(_LLAMA31_ROPE, factor=32.0)
_LLAMA3 = dict(vocab_size=128256, rope_base=500000.0, n_local_heads=8)
_QWEN3 = dict(architecture="qwen3", vocab_size=151936, rope_base=1e6, norm_eps=1e-6, qk_norm=True,
              head_dim=128, n_local_heads=8, block_size=40960)
_QWEN2 = dict(architecture="qwen2", vocab_size=151936, rope_base=1e6, norm_eps=1e-6, qkv_bias=True, block_size=32768)
_SMOLLM2 = dict(vocab_size=49152, rope_base=100000.0, tie_embeddings=True, block_size=8192)

transformer_configs = {
    "Llama-2-7b": dict(block_size=4096, n_layer=32, n_head=32, dim=4096, intermediate_size=11008),
    "Llama-2-13b": dict(block_size=4096, n_layer=40, n_head=40, dim=5120, intermediate_size=13824),
    "Llama-2-70b": dict(block_size=4096, n_layer=80, n_head=64, n_local_heads=8, dim=8192, intermediate_size=28672),
    "Meta-Llama-3-8B": dict(_LLAMA3, block_size=8192, n_layer=32, n_head=32, dim=4096, intermediate_size=14336),
    "Meta-Llama-3-70B": dict(_LLAMA3, block_size=8192, n_layer=80, n_head=64, dim=8192, intermediate_size=28672),
    "Llama-3.1-8B": dict(_LLAMA3, block_size=131072, n_layer=32, n_head=32, dim=4096, intermediate_size=14336,
                         rope_scaling=_LLAMA31_ROPE),
    "Llama-3.1-70B": dict(_LLAMA3, block_size=131072, n_layer=80, n_head=64, dim=8192, intermediate_size=28672,
                          rope_scaling=_LLAMA31_ROPE),
    "Llama-3.2-1B": dict(_LLAMA3, block_size=131072, n_layer=16, n_head=32, dim=2048, intermediate_size=8192,
                         rope_scaling=_LLAMA32_ROPE, tie_embeddings=True),
    "Llama-3.2-3B": dict(_LLAMA3, block_size=131072, n_layer=28, n_head=24, dim=3072, intermediate_size=8192,
                         rope_scaling=_LLAMA32_ROPE, tie_embeddings=True),
    "Llama-3.3-70B": dict(_LLAMA3, block_size=131072, n_layer=80, n_head=64, dim=8192, intermediate_size=28672,
                          rope_scaling=_LLAMA31_ROPE),
    "Qwen2.5-Coder-0.5B": dict(_QWEN2, n_layer=24, n_head=14, n_local_heads=2, dim=896, intermediate_size=4864,
                               tie_embeddings=True),
    "Qwen3-0.6B": dict(_QWEN3, n_layer=28, n_head=16, dim=1024, intermediate_size=3072, tie_embeddings=True),
    "Qwen3-1.7B": dict(_QWEN3, n_layer=28, n_head=16, dim=2048, intermediate_size=6144, tie_embeddings=True),
    "Qwen3-4B": dict(_QWEN3, n_layer=36, n_head=32, dim=2560, intermediate_size=9728, tie_embeddings=True),
    "Qwen3-8B": dict(_QWEN3, n_layer=36, n_head=32, dim=4096, intermediate_size=12288),
    "Qwen3-14B": dict(_QWEN3, n_layer=40, n_head=40, dim=5120, intermediate_size=17408),
    "Qwen3-32B": dict(_QWEN3, n_layer=64, n_head=64, dim=5120, intermediate_size=25600),
    "SmolLM2-135M": dict(_SMOLLM2, n_layer=30, n_head=9, n_local_heads=3, dim=576, intermediate_size=1536),
    "SmolLM2-360M": dict(_SMOLLM2, n_layer=32, n_head=15, n_local_heads=5, dim=960, intermediate_size=2560),
    "SmolLM2-1.7B": dict(_SMOLLM2, rope_base=130000.0, n_layer=24, n_head=32, dim=2048, intermediate_size=8192),
    "stories260K": dict(block_size=512, vocab_size=512, n_layer=5, n_head=8, n_local_heads=4, dim=64,
                        intermediate_size=172, tie_embeddings=True),
    "stories15M": dict(block_size=256, n_layer=6, n_head=6, dim=288, intermediate_size=768, tie_embeddings=True),
    "stories110M": dict(block_size=1024, n_layer=12, n_head=12, dim=768, intermediate_size=2048, tie_embeddings=True),
}


class KVCache(nn.Module):
    def __init__(self, max_batch_size, max_seq_length, n_heads, head_dim, dtype):
        super().__init__()
        shape = (max_batch_size, n_heads, max_seq_length, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype), persistent=False)

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor):
        # k, v: [B, H, T, D]; writing in place keeps the buffers static for CUDA graphs. The write
        # indexes the whole buffer, not a slice [:B] of it: for a batch smaller than the cache,
        # Inductor compiles a write into a slice as a copy of the whole slice out and back.
        B = k.shape[0]
        rows = torch.arange(B, device=k.device)[:, None]
        self.k_cache[rows, :, input_pos[None, :]] = k.transpose(1, 2)  # indexed shape: [B, T, H, D]
        self.v_cache[rows, :, input_pos[None, :]] = v.transpose(1, 2)
        return self.k_cache[:B], self.v_cache[:B]


class Transformer(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.max_batch_size = -1
        self.max_seq_length = -1

    @classmethod
    def from_name(cls, name: str) -> "Transformer":
        return cls(ModelArgs.from_name(name))

    def setup_caches(self, max_batch_size: int, max_seq_length: int):
        if max_seq_length > self.config.block_size:
            raise ValueError(f"max_seq_length {max_seq_length} exceeds the model's context of {self.config.block_size} tokens")
        if self.max_seq_length >= max_seq_length and self.max_batch_size >= max_batch_size:
            return
        max_seq_length = min(self.config.block_size, (max_seq_length + 7) // 8 * 8)
        self.max_seq_length, self.max_batch_size = max_seq_length, max_batch_size
        c = self.config
        # The embedding always stays dense, so it names the model's dtype and device.
        dtype, device = self.tok_embeddings.weight.dtype, self.tok_embeddings.weight.device
        for b in self.layers:  # the attention's own head count: tensor parallel (tp.py) keeps a share of the heads
            b.attention.kv_cache = KVCache(max_batch_size, max_seq_length, b.attention.n_local_heads, c.head_dim,
                                           dtype).to(device)
        cos, sin = precompute_rope(max_seq_length, c.head_dim, c.rope_base, c.rope_scaling)
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)
        causal = torch.tril(torch.ones(max_seq_length, max_seq_length, dtype=torch.bool, device=device))
        self.register_buffer("causal_mask", causal, persistent=False)
        # Left padding per batch row (a batch of prompts of different lengths): padded slots are
        # never attended and positions count from each row's first real token.
        self.register_buffer("left_pad", torch.zeros(max_batch_size, dtype=torch.long, device=device), persistent=False)

    def set_left_padding(self, pad: Optional[Tensor]):
        """pad[b] = number of pad tokens in front of row b's prompt (None: no padding)."""
        self.left_pad.zero_()
        if pad is not None:
            self.left_pad[: pad.numel()].copy_(pad)

    def forward(self, idx: Tensor, input_pos: Tensor, last_position_only: bool = False) -> Tensor:
        """logits [B, T, vocab]; with last_position_only, [B, 1, vocab] for the last position alone:
        a prefill samples from that one, and the vocabulary-wide projection of the other T - 1
        positions would cost as much as a fifth of a small model's prefill, and memory B·T·vocab."""
        assert self.max_seq_length > 0, "call setup_caches() before forward()"
        B = idx.shape[0]
        pad = self.left_pad[:B, None]
        positions = (input_pos[None, :] - pad).clamp(min=0)  # [B, T]
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]  # [B, T, head_dim]
        live = self.max_seq_length  # cache slots attended over: all of them, a static shape for CUDA graphs
        if idx.device.type == "cpu" and not torch.compiler.is_compiling():
            live = int(input_pos[-1]) + 1  # eager CPU pays for every slot read: only those written so far
        slots = torch.arange(live, device=idx.device)
        mask = self.causal_mask[input_pos, :live][None, None] & (slots[None, :] >= pad)[:, None, None, :]  # [B,1,T,S]
        x = self.tok_embeddings(idx)
        # A decode-attention plug looks up its rows of the whole tables and padding itself; in a
        # step that uses it, cos, sin and mask go unused and compile away.
        decode_buffers = (self.rope_cos, self.rope_sin, self.left_pad)
        for layer in self.layers:
            x = layer(x, input_pos, cos, sin, mask, decode_buffers)
        if last_position_only:
            x = x[:, -1:]
        return self.output(self.norm(x))


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = FeedForward(config)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)

    def forward(self, x, input_pos, cos, sin, mask, decode_buffers=None):
        h = self.attention(x, input_pos, cos, sin, mask, norm=self.attention_norm, residual=x,
                           decode_buffers=decode_buffers)
        return self.feed_forward(h, norm=self.ffn_norm, residual=h)


class Attention(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        self.n_head, self.n_local_heads, self.head_dim = config.n_head, config.n_local_heads, config.head_dim
        qkv_rows = (config.n_head + 2 * config.n_local_heads) * config.head_dim
        self.wqkv = nn.Linear(config.dim, qkv_rows, bias=config.qkv_bias)
        self.wo = nn.Linear(config.n_head * config.head_dim, config.dim, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.kv_cache: Optional[KVCache] = None
        # Plugged in from outside (generate.install_decode_attention); None: plain PyTorch. Called on
        # a decode step as decode_attention(qkv [B, n_head + 2 n_local_heads, head_dim], rope_cos,
        # rope_sin, left_pad, input_pos, k_cache, v_cache[, q_norm weight, k_norm weight, eps]), it
        # applies the q/k norms and RoPE, writes k and v into the caches and returns [B, n_head, head_dim].
        self.decode_attention = None

    def forward(self, x, input_pos, cos, sin, mask, norm=None, residual=None, decode_buffers=None):
        """residual + attention(norm(x)); norm and residual are optional. decode_buffers: the model's
        (rope_cos, rope_sin, left_pad), for the decode-attention plug (None: not used)."""
        B, T, _ = x.shape
        qkv = project(self.wqkv, x, norm=norm)
        if T == 1 and self.kv_cache is not None and self.decode_attention is not None and decode_buffers is not None:
            # The projection's output whole: a plug that is a custom op would get a copy of each slice.
            norms = () if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
            y = self.decode_attention(qkv.view(B, -1, self.head_dim), *decode_buffers, input_pos,
                                      self.kv_cache.k_cache, self.kv_cache.v_cache, *norms).unsqueeze(2)
        else:
            kv_size = self.n_local_heads * self.head_dim
            q, k, v = qkv.split([self.n_head * self.head_dim, kv_size, kv_size], dim=-1)
            q = q.view(B, T, self.n_head, self.head_dim)
            k = k.view(B, T, self.n_local_heads, self.head_dim)
            v = v.view(B, T, self.n_local_heads, self.head_dim)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
            if self.kv_cache is not None:  # None: a teacher-forced pass over whole sequences (prune/ replays blocks this way)
                k, v = self.kv_cache.update(input_pos, k, v)
                k, v = k[:, :, :mask.shape[-1]], v[:, :, :mask.shape[-1]]  # the slots the mask covers
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_head != self.n_local_heads)
        return project(self.wo, y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim), residual=residual)


class FeedForward(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.w13 = nn.Linear(config.dim, 2 * config.intermediate_size, bias=False)  # [gate; up]
        self.w2 = nn.Linear(config.intermediate_size, config.dim, bias=False)

    def forward(self, x, norm=None, residual=None):
        """residual + w2(silu(gate) * up) with [gate | up] = w13(norm(x)); norm and residual are optional."""
        return project(self.w2, project(self.w13, x, norm=norm), residual=residual, gated=True)


def project(linear: nn.Module, x: Tensor, norm: Optional[nn.Module] = None, residual: Optional[Tensor] = None,
            gated: bool = False) -> Tensor:
    """residual + linear(prologue(x)): the prologue is norm(x), or silu(gate) * up for gated
    x = [gate | up]. A SparseLinear that can (a decode step on the GPU: `fuses`; sparse/linear.py
    has the route table) adds the residual in its SpMV kernel and, for fewer rows, also does the
    prologue there, saving the launches of separate norm, add and silu kernels; otherwise these
    are plain ops, which Inductor fuses with one another and, for nn.Linear, into its GEMV."""
    fuses = getattr(linear, "fuses", None)
    if fuses is not None and fuses(x):
        if (norm is not None or gated) and not fuses(x, prologue=True):
            x, norm, gated = prologue(x, norm, gated), None, False
        return linear(x, norm=norm, residual=residual, gated=gated)
    y = linear(prologue(x, norm, gated))
    return y if residual is None else residual + y


def prologue(x: Tensor, norm: Optional[nn.Module], gated: bool) -> Tensor:
    """norm(x) if a norm is given, then silu(gate) * up of x = [gate | up] if gated."""
    if norm is not None:
        x = norm(x)
    if gated:
        gate, up = x.chunk(2, dim=-1)
        x = F.silu(gate) * up
    return x


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def precompute_rope(seq_len: int, head_dim: int, base: float, scaling: Optional[dict] = None):
    """cos/sin tables [seq_len, head_dim] (fp32) for the rotate-half layout."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is not None:
        inv_freq = llama31_scale_frequencies(inv_freq, **scaling)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def llama31_scale_frequencies(inv_freq, factor, low_freq_factor, high_freq_factor,
                              original_max_position_embeddings, **_ignored):
    """Llama-3.1 RoPE scaling: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between."""
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = original_max_position_embeddings / low_freq_factor
    high_freq_wavelen = original_max_position_embeddings / high_freq_factor
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    ramped = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(wavelen < high_freq_wavelen, inv_freq,
                       torch.where(wavelen > low_freq_wavelen, inv_freq / factor, ramped))


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: [B, T, H, D]; cos/sin: [B, T, D]. Computed in fp32 and cast back, like the reference models.
    half = x.shape[-1] // 2
    xf = x.float()
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos[:, :, None] + rotated * sin[:, :, None]).type_as(x)
