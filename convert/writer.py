"""Hugging Face-named tensors -> our state dict -> <out>/model.pth, config.json and the tokenizer files.

The one place every reader feeds: q/k/v and gate/up are fused by rows, each name and shape is
checked against the model the config describes (an unexpected or missing tensor, or a wrong shape,
stops the conversion with the tensor's name), and the files are written atomically. Tensors are
loaded one at a time as they are needed, so converting holds about one copy of the model in the
target dtype, not two.
"""
import json
import shutil
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from checkpoint import atomic_write, save_checkpoint
from model import ModelArgs, Transformer
from sparse.format import FORMAT as BITMASK_FORMAT


class ConversionError(Exception):
    """Input we cannot convert; the message names the file, tensor or setting at fault."""


# The weight dtypes the command lines offer, by name.
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# A loader per tensor: called once, when that tensor is needed.
LazyTensors = dict[str, Callable[[], torch.Tensor]]


def interleaved_to_half(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder q/k projection rows from interleaved RoPE pairs (x0,x1),(x2,x3).. to rotate-half
    (x0,x2,..|x1,x3,..) within each head, so our RoPE rotates the pairs the model was trained with.
    GGUF (llama.cpp permutes Llama's q/k on export) and llama2.c (Meta's layout) both need it."""
    head_dim = weight.shape[0] // n_heads
    return weight.reshape(n_heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(weight.shape)


def hf_sources(config: ModelArgs) -> dict[str, list[str]]:
    """Our key -> the Hugging Face tensors it is made of. Fused weights concatenate their sources'
    rows: wqkv = [q; k; v] (Qwen2's biases likewise), w13 = [gate; up]."""
    sources = {"tok_embeddings.weight": ["model.embed_tokens.weight"], "norm.weight": ["model.norm.weight"]}
    if not config.tie_embeddings:
        sources["output.weight"] = ["lm_head.weight"]
    for i in range(config.n_layer):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        sources[ours + "attention.wqkv.weight"] = [hf + f"self_attn.{x}_proj.weight" for x in "qkv"]
        if config.qkv_bias:
            sources[ours + "attention.wqkv.bias"] = [hf + f"self_attn.{x}_proj.bias" for x in "qkv"]
        sources[ours + "attention.wo.weight"] = [hf + "self_attn.o_proj.weight"]
        sources[ours + "feed_forward.w13.weight"] = [hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"]
        sources[ours + "feed_forward.w2.weight"] = [hf + "mlp.down_proj.weight"]
        sources[ours + "attention_norm.weight"] = [hf + "input_layernorm.weight"]
        sources[ours + "ffn_norm.weight"] = [hf + "post_attention_layernorm.weight"]
        if config.qk_norm:
            sources[ours + "attention.q_norm.weight"] = [hf + "self_attn.q_norm.weight"]
            sources[ours + "attention.k_norm.weight"] = [hf + "self_attn.k_norm.weight"]
    return sources


def build_state_dict(tensors: LazyTensors, config: ModelArgs, dtype: torch.dtype) -> dict:
    """Our state dict from lazily loaded HF-named tensors; raises ConversionError naming a bad tensor."""
    sources = hf_sources(config)
    needed = {name for names in sources.values() for name in names}
    # Tolerated extras: RoPE buffers that old checkpoints saved (we recompute them), and the shared
    # matrix stored a second time as lm_head by some tied checkpoints.
    for name in tensors:
        if name not in needed and not name.endswith("rotary_emb.inv_freq") and name != "lm_head.weight":
            raise ConversionError(f"unexpected tensor '{name}' for a {config.architecture} model "
                                  f"with {config.n_layer} layers")
    missing = sorted(needed - tensors.keys())
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConversionError(f"missing tensor '{missing[0]}'{more}")

    with torch.device("meta"):
        expected = {k: v.shape for k, v in Transformer(config).state_dict().items()}
    state_dict = {}
    for key, names in tqdm(sources.items(), desc="converting tensors", unit="tensor"):
        parts = [tensors[name]() for name in names]
        weight = torch.cat(parts) if len(parts) > 1 else parts[0]
        if weight.shape != expected[key]:
            found = ", ".join(f"{n} {tuple(t.shape)}" for n, t in zip(names, parts))
            raise ConversionError(f"{found} do not fit {key} {tuple(expected[key])}; "
                                  f"does config.json match the weights?")
        state_dict[key] = weight.to(dtype).contiguous()
    if config.tie_embeddings:
        state_dict["output.weight"] = state_dict["tok_embeddings.weight"]
    return state_dict


def write_converted(out, tensors: LazyTensors, config: ModelArgs, tokenizer_files: dict[str, Path | bytes], *,
                    dtype: torch.dtype, source, source_format: str, sparse: str | None = None):
    """Convert `tensors` and write <out>/model.pth + config.json beside the tokenizer files (each a
    file to copy, or its bytes). Tokenizer files first, the checkpoint last: a model.pth only exists
    once everything else does. sparse: "auto" or an N:M pattern to pack the layers whose zeros
    follow it (convert/packing.py); None writes every weight dense."""
    from convert.packing import pack_state_dict

    out = Path(out)
    state_dict = build_state_dict(tensors, config, dtype)
    n_params = sum(t.numel() for t in {id(t): t for t in state_dict.values()}.values())  # tied: count once
    sparsity = None
    if sparse is not None:
        report = pack_state_dict(state_dict, sparse)
        if report.pattern is None and sparse != "auto":
            raise ConversionError(f"no block linear's zeros follow {sparse}; "
                                  f"{next(iter(report.dense.items()), ('', 'no block linears'))[1]}")
        print("\n".join(report.lines()))
        if report.pattern is not None:
            sparsity = dict(pattern=report.pattern, format=BITMASK_FORMAT, layers=report.packed,
                            found_in="the imported weights' zeros")
    out.mkdir(parents=True, exist_ok=True)
    for name, content in tokenizer_files.items():
        if isinstance(content, Path):
            atomic_write(out / name, lambda tmp, content=content: shutil.copyfile(content, tmp))
        else:
            atomic_write(out / name, lambda tmp, content=content: Path(tmp).write_bytes(content))
    metadata = {"source": str(Path(source).resolve()), "source_format": source_format, "dtype": str(dtype)}
    if sparsity is not None:
        metadata["sparsity"] = sparsity
    # config.json beside model.pth: what GPT-Fast-style tools and tokenizer.py's Llama-2 check read.
    atomic_write(out / "config.json", lambda tmp: Path(tmp).write_text(json.dumps(config.to_dict(), indent=2) + "\n"))
    save_checkpoint(out / "model.pth", state_dict, config, metadata)
    kind = "dense" if sparsity is None else f"{sparsity['pattern']} packed"
    print(f"wrote {out / 'model.pth'} ({n_params / 1e6:.1f}M parameters, {config.architecture}, {kind}) "
          f"and {', '.join(tokenizer_files) or 'no tokenizer files'}")
