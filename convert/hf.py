"""Read a Hugging Face model folder: config.json -> ModelArgs (by its architecture, never by the
folder's name), weights from safetensors (single or sharded) or pytorch_model*.bin, read lazily
(safetensors `safe_open`, mmap for .bin), and the tokenizer and chat-template files beside them."""
import json
import pickle
import sys
from pathlib import Path

import torch

from convert.compressed_tensors import decompressed_tensors, sparsity_format
from convert.writer import ConversionError, LazyTensors, write_converted
from model import ModelArgs, require_positive_int

# Hugging Face class name -> our ModelArgs.architecture
HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}

# The tokenizer and chat-template files a model folder may have; copied next to model.pth.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json", "vocab.json", "merges.txt")


def model_args_from_hf_config(hf: dict) -> ModelArgs:
    architecture = hf_architecture(hf)
    for flag in ("attention_bias", "mlp_bias"):  # Qwen2's q/k/v biases are implied by its architecture
        if hf.get(flag):
            raise ConversionError(f"config.json sets {flag}=true; our model has no biases there")
    if hf.get("use_sliding_window") or "sliding_attention" in (hf.get("layer_types") or []):
        raise ConversionError("config.json asks for sliding-window attention (use_sliding_window / layer_types); "
                              "sliding-window attention is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConversionError(f"config.json: hidden_act '{hf['hidden_act']}' is not supported (only silu)")
    n_head = hf["num_attention_heads"]
    for key in ("num_attention_heads", "hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size"):
        require_positive_int(key, hf[key])  # by the file's own names; a missing key is a KeyError
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
        qkv_bias=architecture == "qwen2",
    )


def hf_architecture(hf: dict) -> str:
    names = hf.get("architectures") or []
    for name in names:
        if name in HF_ARCHITECTURES:
            return HF_ARCHITECTURES[name]
    if not names and hf.get("model_type") in ("llama", "qwen2", "qwen3"):
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
        try:
            shard = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except RuntimeError:  # files from before torch 1.6 are not zip archives and cannot be memory-mapped
            shard = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "weights_only" in str(e):  # a pickle of Python objects, which could run code: never unpickled
            raise ConversionError(f"cannot read {path}: it holds Python objects besides tensors, which are "
                                  f"refused (only weights are loaded)") from None
        raise ConversionError(f"cannot read {path}: not a PyTorch weights file ({str(e).strip().splitlines()[0]})") from None
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConversionError(f"cannot read {path}: {first}") from None
    if not isinstance(shard, dict) or not all(isinstance(t, torch.Tensor) for t in shard.values()):
        raise ConversionError(f"cannot read {path}: it holds a {type(shard).__name__}, not a dict of tensors")
    return shard


def read_hf_folder(folder: Path):
    """(lazy HF-named tensors, ModelArgs, {tokenizer file name: its path}) for a Hugging Face model folder."""
    if folder.is_file():
        raise ConversionError(f"{folder} is a file, not a model folder (config.json + weights); "
                              f"for a GGUF or llama2.c file use --gguf or --llama2c")
    if not folder.is_dir():
        raise ConversionError(f"model folder not found: {folder}")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ConversionError(f"no config.json in {folder}")
    try:
        hf_config = json.loads(config_path.read_text())
        if not isinstance(hf_config, dict):
            raise TypeError(f"it holds a JSON {type(hf_config).__name__}, not an object")
        config = model_args_from_hf_config(hf_config)
        compressed = sparsity_format(hf_config)
    except KeyError as e:
        raise ConversionError(f"{config_path} is not a usable model config: it has no {e}") from None
    except json.JSONDecodeError as e:
        raise ConversionError(f"{config_path} is not valid JSON: {e}") from None
    except (TypeError, ValueError) as e:
        raise ConversionError(f"{config_path} is not a usable model config: {e}") from None
    tokenizer_files = {name: folder / name for name in TOKENIZER_FILES if (folder / name).is_file()}
    tensors = lazy_tensors_from_folder(folder)
    if compressed is not None:  # compressed-tensors sparse weights: decompressed as they are read
        tensors = decompressed_tensors(tensors, compressed)
    return tensors, config, tokenizer_files


def convert_hf_folder(folder, out, dtype=torch.bfloat16, sparse=None):
    folder = Path(folder)
    tensors, config, tokenizer_files = read_hf_folder(folder)
    if not any(n in tokenizer_files for n in ("tokenizer.json", "tokenizer.model")):
        print(f"warning: no tokenizer.json or tokenizer.model in {folder}; the checkpoint will have no tokenizer",
              file=sys.stderr)
    write_converted(out, tensors, config, tokenizer_files, dtype=dtype, source=folder, source_format="huggingface",
                    sparse=sparse)
