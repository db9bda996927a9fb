"""Read a llama2.c model .bin (the legacy, version-0 export) as Hugging Face-named tensors.

The file is a header of seven int32

    dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len

(a negative vocab_size means the classifier is stored separately; positive means it is the embedding),
then float32 arrays in llama2.c's order, each weight as PyTorch's (out, in) matrix, one per layer:
embedding, attention norms, wq, wk, wv, wo, ffn norms, w1 (gate), w2 (down), w3 (up), final norm,
two RoPE tables we skip, and the classifier if untied. Its q/k rows use Meta's interleaved RoPE
pairs, so they are permuted to our rotate-half layout.
"""
import struct
from pathlib import Path

import numpy as np
import torch

from convert.writer import ConversionError, interleaved_to_half, write_converted
from model import ModelArgs

HEADER = struct.Struct("<7i")
VERSIONED_MAGIC = 0x616B3432  # "ak42": llama2.c's newer export versions, which we do not read


def read_llama2c(path, tokenizer=None):
    """(HF-named tensors, ModelArgs, {tokenizer file name: its path}). The whole file is read at once:
    llama2.c models are small. The tokenizer is `tokenizer`, else the first tok*.bin beside the model."""
    if not path.is_file():
        raise ConversionError(f"llama2.c model not found: {path}")
    data = path.read_bytes()
    if len(data) < HEADER.size:
        raise ConversionError(f"{path} is too short to be a llama2.c model")
    dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len = HEADER.unpack_from(data)
    if dim == VERSIONED_MAGIC:
        raise ConversionError(f"{path} is a versioned llama2.c export; only the legacy (version 0) format is supported")
    if min(dim, hidden_dim, n_layers, n_heads, n_kv_heads, seq_len) <= 0 or dim % n_heads:
        raise ConversionError(f"{path} has an implausible llama2.c header {HEADER.unpack_from(data)}")
    config = ModelArgs(block_size=seq_len, vocab_size=abs(vocab_size), n_layer=n_layers, n_head=n_heads,
                       dim=dim, intermediate_size=hidden_dim, n_local_heads=n_kv_heads,
                       tie_embeddings=vocab_size > 0)
    head_dim = dim // n_heads
    values = np.frombuffer(data, dtype="<f4", offset=HEADER.size)
    offset = 0

    def take(*shape):
        nonlocal offset
        count = int(np.prod(shape))
        if offset + count > values.size:
            raise ConversionError(f"{path} ends early: the header {HEADER.unpack_from(data)} needs more weights")
        block = torch.from_numpy(values[offset:offset + count].copy()).reshape(shape)
        offset += count
        return block

    def per_layer(name, *shape):
        block = take(n_layers, *shape)
        for i in range(n_layers):
            tensors[f"model.layers.{i}.{name}.weight"] = block[i]

    tensors = {"model.embed_tokens.weight": take(config.vocab_size, dim)}
    per_layer("input_layernorm", dim)
    per_layer("self_attn.q_proj", n_heads * head_dim, dim)
    per_layer("self_attn.k_proj", n_kv_heads * head_dim, dim)
    per_layer("self_attn.v_proj", n_kv_heads * head_dim, dim)
    per_layer("self_attn.o_proj", dim, n_heads * head_dim)
    per_layer("post_attention_layernorm", dim)
    per_layer("mlp.gate_proj", hidden_dim, dim)
    per_layer("mlp.down_proj", dim, hidden_dim)
    per_layer("mlp.up_proj", hidden_dim, dim)
    tensors["model.norm.weight"] = take(dim)
    take(2, seq_len, head_dim // 2)  # RoPE cos/sin tables; we compute our own
    if not config.tie_embeddings:
        tensors["lm_head.weight"] = take(config.vocab_size, dim)
    if offset != values.size:
        raise ConversionError(f"{path} has {values.size - offset} float32 values more than its header describes")
    for i in range(n_layers):
        for name, heads in (("q_proj", n_heads), ("k_proj", n_kv_heads)):
            key = f"model.layers.{i}.self_attn.{name}.weight"
            tensors[key] = interleaved_to_half(tensors[key], heads)
    tokenizer = Path(tokenizer) if tokenizer else next(iter(sorted(path.parent.glob("tok*.bin"))), None)
    tokenizer_files = {tokenizer.name: tokenizer} if tokenizer else {}
    return {name: (lambda t=t: t) for name, t in tensors.items()}, config, tokenizer_files


def convert_llama2c(path, out, dtype=torch.float32, tokenizer=None, sparse=None):
    tensors, config, tokenizer_files = read_llama2c(Path(path), tokenizer)
    write_converted(out, tensors, config, tokenizer_files, dtype=dtype, source=path, source_format="llama2c",
                    sparse=sparse)
